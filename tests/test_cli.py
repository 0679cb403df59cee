"""`kvroute serve` and `kvroute doctor` as a user runs them: real subprocesses."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from procs import gone

from backends.cpu import kernel_features
from backends.gpu import portable
from backends.process import free_port

REPO = Path(__file__).resolve().parent.parent
KVROUTE = [sys.executable, "-m", "proxy.cli"]




def llama_servers_in_group(pgids: set[int]) -> list[int]:
    """Live processes whose process group is one of `pgids` (a server's own pid)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) in pgids:
            out.append(int(entry))
    return out


def write_config(tmp_path: Path, llama_server_bin: Path, **extra: Any) -> tuple[Path, int]:
    port = free_port()
    data: dict[str, Any] = {
        "proxy": {"host": "127.0.0.1", "port": port},
        "llama_server": str(llama_server_bin),
        "log_dir": str(tmp_path / "logs"),
        "backends": [{"name": "a", "model": "demo", "slots": 2, "threads": 1,
                      "ctx_per_slot": 4096},
                     {"name": "b", "model": "demo", "slots": 2, "threads": 1,
                      "ctx_per_slot": 4096}],
        **extra,
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, port


def post(url: str, body: object, timeout: float = 60) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


class Serve:
    def __init__(self, config: Path, port: int, log: Path) -> None:
        self.port, self.log = port, log
        self.state = config.parent / "logs" / "backends.json"
        with open(log, "wb") as out:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen([*KVROUTE, "serve", "--config", str(config)],
                                         cwd=REPO, stdout=out, stderr=subprocess.STDOUT)

    def wait_listening(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"kvroute exited:\n{self.log.read_text()}"
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.2)
        pytest.fail(f"kvroute did not listen within {timeout} s:\n{self.log.read_text()}")

    def backend_pids(self) -> dict[str, int]:
        data = json.loads(self.state.read_text())
        assert data["kvroute_pid"] == self.proc.pid
        return {b["name"]: b["pid"] for b in data["backends"] if b["pid"]}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def serve(tmp_path: Path, llama_server_bin: Path, demo_model: Path) -> Iterator[Serve]:
    config, port = write_config(tmp_path, llama_server_bin)
    s = Serve(config, port, tmp_path / "serve.log")
    pids: dict[str, int] = {}
    try:
        s.wait_listening()
        pids = s.backend_pids()
        yield s
    finally:
        s.close()
        for pid in pids.values():  # never leave a server behind, even when a test fails
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_serve_answers_through_proxy_and_sigterm_leaves_nothing(serve: Serve) -> None:
    pids = serve.backend_pids()
    assert sorted(pids) == ["a", "b"]
    for _ in range(2):
        status, body = post(f"http://127.0.0.1:{serve.port}/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4})
        assert status == 200, body
        assert body["choices"][0]["message"]["role"] == "assistant"
    assert "a slot holds 4,096 tokens" in serve.log.read_text()
    # longer than any slot: a 400 that says what to change, and what value fits
    status, body = post(f"http://127.0.0.1:{serve.port}/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hello " * 5000}], "max_tokens": 4})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    msg = body["error"]["message"]
    assert "ctx_per_slot: 8192" in msg and "config.yaml" in msg, body
    t0 = time.monotonic()
    serve.proc.send_signal(signal.SIGTERM)
    assert serve.proc.wait(timeout=20) == 0, serve.log.read_text()
    assert time.monotonic() - t0 < 20
    assert all(gone(pid) for pid in pids.values())
    assert llama_servers_in_group(set(pids.values())) == []
    assert not serve.state.exists()


def test_sigkill_of_kvroute_leaves_no_server(serve: Serve) -> None:
    pids = serve.backend_pids()
    serve.proc.kill()  # no chance to clean up: PR_SET_PDEATHSIG must do it
    serve.proc.wait()
    deadline = time.monotonic() + 5
    while not all(gone(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(gone(pid) for pid in pids.values())


def _contents(directory: Path) -> dict[str, bytes]:
    return {str(f.relative_to(directory)): f.read_bytes()
            for f in sorted(directory.rglob("*")) if f.is_file()}


def test_a_second_kvroute_on_the_same_directories_touches_nothing(
        tmp_path: Path, llama_server_bin: Path, demo_model: Path) -> None:
    """A copy of a running kvroute's config with only the port changed: the copy is
    refused before it starts a server or writes a byte, naming the directory and the
    running kvroute's pid; the running one's backends.json, logs and slot directory are
    as they were, and it serves on."""
    config, port = write_config(tmp_path, llama_server_bin,
                                kv_disk={"path": str(tmp_path / "slots")})
    first = Serve(config, port, tmp_path / "serve.log")
    try:
        first.wait_listening()
        pids = first.backend_pids()
        logs = tmp_path / "logs"
        before = _contents(logs)
        slots = _contents(tmp_path / "slots")
        copy = yaml.safe_load(config.read_text())
        copy["proxy"]["port"] = free_port()
        second = tmp_path / "copy.yaml"
        second.write_text(yaml.safe_dump(copy))
        r = subprocess.run([*KVROUTE, "serve", "--config", str(second)], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, r.stderr
        assert (f"log_dir: {logs} is in use by another kvroute, pid {first.proc.pid}"
                in r.stderr), r.stderr
        assert "fix: one kvroute per log_dir" in r.stderr
        after = _contents(logs)
        assert sorted(after) == sorted(before)
        assert after["backends.json"] == before["backends.json"]
        for name, text in before.items():  # (the first's servers may log on, no one else)
            assert after[name].startswith(text), name
            assert b"=== kvroute:" not in after[name][len(text):], name
        assert _contents(tmp_path / "slots") == slots
        assert first.backend_pids() == pids
        status, body = post(f"http://127.0.0.1:{port}/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4})
        assert status == 200, body
    finally:
        first.close()


def test_serve_holds_its_port_while_backends_start(tmp_path: Path, llama_server_bin: Path,
                                                  demo_model: Path) -> None:
    """The port is bound before the backends start: nothing can take it during their
    start (minutes on a first run), and a client is refused until the proxy listens."""
    config, port = write_config(tmp_path, llama_server_bin)
    s = Serve(config, port, tmp_path / "serve.log")
    pids: dict[str, int] = {}
    try:
        deadline = time.monotonic() + 60
        while not pids:  # the backends are starting: the proxy does not listen yet
            assert time.monotonic() < deadline and s.proc.poll() is None, s.log.read_text()
            time.sleep(0.02)
            if s.state.is_file():
                pids = s.backend_pids() if s.state.read_text().strip() else {}
        for reuse in (0, 1):  # (servers set SO_REUSEADDR: asyncio, aiohttp, uvicorn)
            with socket.socket() as taker, pytest.raises(OSError) as taken:
                taker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, reuse)
                taker.bind(("127.0.0.1", port))
                taker.listen()
            assert taken.value.errno == errno.EADDRINUSE
        s.wait_listening()
        status, body = post(f"http://127.0.0.1:{port}/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4})
        assert status == 200, body
    finally:
        s.close()
        for pid in pids.values():
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_serve_rejects_bad_config(tmp_path: Path, llama_server_bin: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config, _ = write_config(tmp_path, llama_server_bin)
        r = subprocess.run([*KVROUTE, "serve", "--config", str(config), "--port", str(port)],
                           cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert f"proxy.port: 127.0.0.1:{port} is already in use (fix:" in r.stderr
    config.write_text(config.read_text() + "\nbogus: 1\n")
    r = subprocess.run([*KVROUTE, "serve", "--config", str(config)],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "bogus: unknown key" in r.stderr


def test_serve_says_why_it_cannot_build_the_demo_model(tmp_path: Path,
                                                      llama_server_bin: Path) -> None:
    """The artifact cache is not a directory (here: under a file): one line naming it
    and exit 2, as for a config error, not a traceback."""
    config, _ = write_config(tmp_path, llama_server_bin)
    (tmp_path / "a-file").write_text("")
    env = {**os.environ, "KVROUTE_CACHE": str(tmp_path / "a-file" / "cache")}
    r = subprocess.run([*KVROUTE, "serve", "--config", str(config)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "a-file" in r.stderr


def test_doctor_names_each_pools_tokenizer(tmp_path: Path, llama_server_bin: Path,
                                           demo_model: Path) -> None:
    """Three pools: the demo model's, a coder model's, a server of the OpenAI API's (down:
    said so, from its /v1/models)."""
    from backends.demo_model import ensure_demo_model

    coder = ensure_demo_model(kind="demo-coder")
    dead = f"http://127.0.0.1:{free_port()}"
    extra = {"backends": [{"name": "a", "model": "demo"}, {"name": "c", "model": "demo-coder"},
                          {"name": "v", "url": dead, "kind": "openai", "alias": "vllm"}]}
    config, _ = write_config(tmp_path, llama_server_bin, **extra)
    r = subprocess.run([*KVROUTE, "doctor", "--json", "--config", str(config)], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    report = json.loads(r.stdout)
    assert report["tokens"]["pools"] == {"kvroute-demo": str(demo_model),
                                         "kvroute-demo-coder": str(coder), "vllm": None}
    v = next(b for b in report["backends"] if b["name"] == "v")
    assert v["healthy"] is False and "Cannot connect" in v["detail"]


def test_doctor_checks_a_backends_devices(tmp_path: Path, llama_server_bin: Path) -> None:
    """A device the build does not list (this CPU build lists none) is a BAD line."""
    extra = {"backends": [{"name": "a", "model": "demo", "devices": "Vulkan0"}]}
    config, _ = write_config(tmp_path, llama_server_bin, **extra)
    r = subprocess.run([*KVROUTE, "doctor", "--config", str(config)], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "[BAD]   devices Vulkan0: device Vulkan0: not one this llama-server lists " \
        "(none: a CPU build)" in r.stdout, r.stdout


def test_doctor_names_a_backends_projector(tmp_path: Path, llama_server_bin: Path,
                                           demo_model: Path) -> None:
    """`mmproj:` is an ok line when its file is there, a BAD one (with the fix) when the
    demo projector is not built yet."""
    from backends.demo_mmproj import demo_mmproj_path, ensure_demo_mmproj, for_model
    from backends.demo_model import DemoModelParams

    built = ensure_demo_mmproj(for_model(DemoModelParams()))
    unbuilt = demo_mmproj_path(for_model(DemoModelParams(n_embd=256)))
    assert not unbuilt.is_file()
    for sizes, path, line in (({}, built, "[ok ]   mmproj "),
                              ({"n_embd": 256}, unbuilt, "[BAD]   mmproj ")):
        extra = {"backends": [{"name": "a", "model": "demo", "mmproj": "demo"}],
                 "demo_model": sizes}
        config, _ = write_config(tmp_path, llama_server_bin, **extra)
        r = subprocess.run([*KVROUTE, "doctor", "--config", str(config)], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
        assert line + str(path) in r.stdout, r.stdout
    assert "(missing: run `python -m backends prepare`)" in r.stdout


def test_doctor_names_a_backends_adapters(tmp_path: Path, llama_server_bin: Path,
                                          demo_model: Path) -> None:
    """`lora:` is an ok line per adapter whose file is there, a BAD one (with the fix)
    for a demo adapter not built yet, and doctor fails."""
    from backends.demo_lora import demo_lora_path, ensure_demo_lora, for_model
    from backends.demo_model import DemoModelParams

    built = ensure_demo_lora(for_model(DemoModelParams(), 0))
    unbuilt = demo_lora_path(for_model(DemoModelParams(), 1, "gemma3"))
    unbuilt.unlink(missing_ok=True)
    extra = {"backends": [{"name": "a", "model": "demo", "lora": ["demo"]},
                          {"name": "b", "model": "demo-swa", "lora": ["demo1"]}]}
    config, _ = write_config(tmp_path, llama_server_bin, **extra)
    r = subprocess.run([*KVROUTE, "doctor", "--config", str(config)], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert f"[ok ]   lora {built}\n" in r.stdout, r.stdout
    assert (f"[BAD]   lora {unbuilt}  (missing: run `python -m backends prepare`)"
            in r.stdout), r.stdout


def test_doctor_json(tmp_path: Path, llama_server_bin: Path, demo_model: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    extra = {"backends": [{"name": "a", "model": "demo"}, {"name": "far", "url": dead}]}
    config, port = write_config(tmp_path, llama_server_bin, **extra)
    r = subprocess.run([*KVROUTE, "doctor", "--json", "--config", str(config)], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["ok"] is True
    assert report["llama_server"]["path"] == str(llama_server_bin)
    assert report["llama_server"]["version"].startswith("version:")
    assert report["demo_model"] == {"path": str(demo_model), "exists": True,
                                    "kv_bytes_per_token": 8192}
    assert report["llama_cpp_python"]["importable"] is True
    assert report["llama_cpp_python"]["version"] == "0.3.36"
    assert report["config"]["ok"] is True and report["config"]["proxy_port_free"] is True
    assert report["config"]["proxy"] == {"host": "127.0.0.1", "port": port, "policy": "prefix"}
    backends = {b["name"]: b for b in report["backends"]}
    assert backends["a"]["healthy"] is False and "not running" in backends["a"]["detail"]
    assert backends["far"]["healthy"] is False and backends["far"]["url"] == dead
    assert report["tokens"] == {"local_gguf": str(demo_model), "serving": None}
    assert set(report) >= {"ok", "python", "kvroute_version", "cache_dir", "llama_cpp_python",
                           "llama_server", "demo_model", "config", "backends", "cpu"}
    # the CPU features that pick ggml's kernels, and what the cached build was made for
    cpu = report["cpu"]
    assert cpu["features"] == list(kernel_features())
    assert cpu["amx"] == ("amx_int8" in cpu["features"])
    if portable():
        assert cpu["build"].startswith("portable") and cpu["built_for"] is None
    else:  # NATIVE=1: built for this very CPU
        assert cpu["build"].startswith("native") and cpu["matches"] is True


def test_doctor_sees_running_backends(serve: Serve, tmp_path: Path) -> None:
    r = subprocess.run([*KVROUTE, "doctor", "--json", "--config", str(tmp_path / "config.yaml")],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    report = json.loads(r.stdout)
    pids = serve.backend_pids()
    for b in report["backends"]:
        assert b["healthy"] is True, b
        assert b["pid"] == pids[b["name"]]
    assert report["config"]["proxy_port_free"] is False  # kvroute itself listens there
    assert report["tokens"]["serving"] == "local"  # its template renders as the backends do


def test_doctor_reports_bad_config(tmp_path: Path, llama_server_bin: Path) -> None:
    config, _ = write_config(tmp_path, llama_server_bin)
    config.write_text(config.read_text().replace("slots: 2", "slots: two", 1))
    r = subprocess.run([*KVROUTE, "doctor", "--config", str(config)], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "backends[0].slots: expected a positive integer, got 'two'" in r.stdout
    assert "problems found" in r.stdout


def test_prepare_is_deterministic_and_idempotent(tmp_path: Path, llama_server_bin: Path) -> None:
    """`python -m backends prepare` on a tiny demo model in a private cache."""
    from backends.binary import cache_dir
    from backends.libllama import LIB_ENV, libllama_dir

    cache = tmp_path / "cache" / "v"
    cache.parent.mkdir()
    # the sdist's llama.cpp tree (vocabulary) is reused, not downloaded again
    (cache.parent / "src").symlink_to(cache_dir() / "src" if (cache_dir() / "src").is_dir()
                                      else cache_dir().parent / "src")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "llama_server": str(llama_server_bin),
        "demo_model": {"n_layer": 1, "n_embd": 64, "n_head": 2, "n_head_kv": 1, "n_ff": 64},
        "backends": [{"name": "a", "model": "demo"}],
    }))
    # the tokenizer's libllama is this session's (else prepare builds one in the cache)
    env = {**os.environ, "KVROUTE_CACHE": str(cache), LIB_ENV: str(libllama_dir())}

    def prepare() -> dict[str, Any]:
        r = subprocess.run([sys.executable, "-m", "backends", "prepare", "--json", "--config",
                            str(config)], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        result: dict[str, Any] = json.loads(r.stdout)
        return result

    first = prepare()
    model = Path(first["demo_model"]["path"])
    assert model.parent == cache / "models" and model.name.startswith("kvroute-demo-L1-E64-H2-KV1")
    assert first["demo_model"]["kv_bytes_per_token"] == 1 * 1 * 32 * 2 * 2
    assert first["llama_server"] == {"path": str(llama_server_bin), "source": "config",
                                     "version": first["llama_server"]["version"]}
    digest = hashlib.sha256(model.read_bytes()).hexdigest()
    again = prepare()
    assert again["demo_model"] == first["demo_model"] and again["seconds"] < 1
    model.unlink()
    prepare()
    assert hashlib.sha256(model.read_bytes()).hexdigest() == digest  # seeded: same bytes

    from backends.demo_model import read_gguf_metadata
    from backends.memory import gguf_kv_bytes_per_token

    meta = read_gguf_metadata(model)
    assert gguf_kv_bytes_per_token(model) == 128
    assert meta["general.architecture"] == "llama" and meta["tokenizer.ggml.pre"] == "qwen2"
    assert meta["tokenizer.ggml.eos_token_id"] == 151645
    assert meta["tokenizer.ggml.add_bos_token"] is False
    template = REPO / "backends" / "templates" / "chatml-tools.jinja"
    if template.is_file():  # our tool-capable template, not the vocabulary's
        assert meta["tokenizer.chat_template"] == template.read_text()


# -- llama.cpp versions -------------------------------------------------------------------
# A llama-server of another llama.cpp than the tokenizer's: a real executable in tmp_path
# that answers --version as such a server would.
OTHER_VERSION = "version: 0.4.0-dev (build 4242, commit deadbee)"


def other_llama_server(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "llama-server"
    path.write_text(f'#!/bin/sh\necho "{OTHER_VERSION}" >&2\n')
    path.chmod(0o755)
    return path


def names_both_versions(warning: str | None, server: Path) -> bool:
    from backends.version import tokenizer_version

    ours = tokenizer_version()
    assert ours is not None and ours.commit and warning
    return all(s in warning for s in (str(server), "0.4.0-dev", "deadbee", ours.version,
                                      ours.commit))


@pytest.mark.parametrize("where", ["config", "path"])
def test_doctor_warns_of_another_llama_cpp(where: str, tmp_path: Path,
                                           llama_server_bin: Path, demo_model: Path) -> None:
    other = other_llama_server(tmp_path / "bin")
    config, _ = write_config(tmp_path, other if where == "config" else llama_server_bin)
    env = dict(os.environ)
    if where == "path":
        data = yaml.safe_load(config.read_text())
        del data["llama_server"]
        config.write_text(yaml.safe_dump(data))
        env["PATH"] = f"{other.parent}:{env['PATH']}"
    r = subprocess.run([*KVROUTE, "doctor", "--json", "--config", str(config)], cwd=REPO,
                       capture_output=True, text=True, timeout=60, env=env)
    srv = json.loads(r.stdout)["llama_server"]
    assert (srv["path"], srv["source"], srv["version"]) == (str(other), where, OTHER_VERSION)
    assert names_both_versions(srv["version_warning"], other)
    text = subprocess.run([*KVROUTE, "doctor", "--config", str(config)], cwd=REPO,
                          capture_output=True, text=True, timeout=60, env=env).stdout
    assert "[!! ] llama-server " + str(other) + " is llama.cpp 0.4.0-dev" in text


def test_doctor_is_quiet_for_the_built_server(tmp_path: Path, llama_server_bin: Path,
                                              demo_model: Path) -> None:
    config, _ = write_config(tmp_path, llama_server_bin)
    r = subprocess.run([*KVROUTE, "doctor", "--json", "--config", str(config)], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert json.loads(r.stdout)["llama_server"]["version_warning"] is None


@pytest.mark.parametrize("which", ["other", "built"])
def test_serve_warns_of_another_llama_cpp_at_start(which: str, tmp_path: Path,
                                                   llama_server_bin: Path,
                                                   demo_model: Path) -> None:
    """What `kvroute serve` logs before it starts the backends."""
    from proxy.cli import _prepare_artifacts
    from proxy.config.load import load_config
    from proxy.observability.logging import configure_logging

    other = other_llama_server(tmp_path / "bin")
    config, _ = write_config(tmp_path, other if which == "other" else llama_server_bin)
    out = io.StringIO()
    configure_logging("info", stream=out)
    try:
        _prepare_artifacts(load_config(config, check_port=False))
    finally:
        configure_logging("info")
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    warned = [e for e in events if e["event"] == "llama_server.version_mismatch"]
    if which == "built":
        assert warned == []
    else:
        assert [(e["level"], e["source"]) for e in warned] == [("warning", "config")]
        assert names_both_versions(warned[0]["detail"], other)
