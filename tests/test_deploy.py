"""The deployment files, checked as far as a machine without a Docker daemon allows: the
Dockerfile copies what the repo has and builds llama-server through `python -m backends
prepare`; its command line, the systemd unit's and the compose service's are real
kvroute command lines over the same config, ports and directories; `systemd-analyze
verify` accepts the unit where systemd is installed."""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from backends.binary import find_llama_server
from backends.demo_model import demo_model_path
from backends.gpu import NATIVE_ENV, binary_path, portable
from backends.libllama import LIB_ENV
from proxy import cli
from proxy.config.load import load_config

ROOT = Path(__file__).resolve().parent.parent
KVROUTE = Path(sys.executable).with_name("kvroute")
DEPLOY_CONFIG = ROOT / "deploy" / "config.yaml"
UNIT = ROOT / "deploy" / "kvroute.service"
# PATH of the python:3.11-slim base images, which the Dockerfile's ENV PATH extends
BASE_IMAGE_PATH = "/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass
class Stage:
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [rest for kw, rest in self.instructions if kw == keyword]

    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for rest in self.all("ENV"):
            for pair in shlex.split(rest):
                key, _, value = pair.partition("=")
                out[key] = value
        return out

    def copies(self) -> list[tuple[dict[str, str], list[str], str]]:
        """(flags, sources, destination) of each COPY."""
        out = []
        for rest in self.all("COPY"):
            words = shlex.split(rest)
            flags = dict(w[2:].partition("=")[::2] for w in words if w.startswith("--"))
            paths = [w for w in words if not w.startswith("--")]
            out.append((flags, paths[:-1], paths[-1]))
        return out


def _stages() -> list[Stage]:
    """The Dockerfile's stages: instructions with continuation lines joined."""
    stages: list[Stage] = []
    pending = ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        keyword, _, rest = (pending + line).strip().partition(" ")
        pending = ""
        keyword = keyword.upper()
        if keyword == "FROM":
            words = rest.split()
            stages.append(Stage(words[2] if len(words) > 2 and words[1].upper() == "AS"
                                else str(len(stages))))
        elif stages:
            stages[-1].instructions.append((keyword, rest.strip()))
    return stages


STAGES = _stages()
BUILD, RUNTIME = STAGES[0], STAGES[-1]
DEPLOY = load_config(DEPLOY_CONFIG, check_port=False, allow_missing_demo=True)


def _command() -> list[str]:
    """The runtime image's command line: ENTRYPOINT + CMD (exec form)."""
    (entry,), (cmd,) = RUNTIME.all("ENTRYPOINT"), RUNTIME.all("CMD")
    return [*json.loads(entry), *json.loads(cmd)]


def _option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def _parses(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """kvroute's own parser over ``argv`` (after the program name), every option checked
    (a --help run exits before it complains about an unknown option); the command's
    handler is replaced, so nothing starts."""
    seen: list[Any] = []

    def record(args: Any) -> int:
        seen.append(args)
        return 0

    monkeypatch.setattr(cli, "cmd_serve", record)
    monkeypatch.setattr(cli, "cmd_doctor", record)
    assert cli.main(argv) == 0
    return seen[0]


def _helps(argv: list[str]) -> str:
    """Run ``argv`` (kvroute's program name replaced by this venv's) with --help."""
    out = subprocess.run([str(KVROUTE), *argv[1:], "--help"], capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _ignored(path: str) -> bool:
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    parts = PurePosixPath(path).parts
    return any(fnmatch.fnmatch("/".join(parts[:i + 1]), p.removeprefix("**/"))
               or fnmatch.fnmatch(parts[i], p.removeprefix("**/"))
               for p in patterns for i in range(len(parts)))


def test_dockerfile_copies_what_the_repo_has() -> None:
    assert [s.name for s in STAGES] == ["build", "runtime"]
    copied: list[str] = []
    for stage in STAGES:
        for flags, sources, _ in stage.copies():
            if "from" in flags:
                continue
            for src in sources:
                assert (ROOT / src).exists(), f"COPY {src}: not in the repo"
                assert not _ignored(src), f"COPY {src}: excluded by .dockerignore"
            copied += sources
    # what `pip install .` needs: the packages, the metadata and its readme, and the
    # shipped config that proxy/config/default.yaml links to
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*.") for p in project["tool"]["setuptools"]["packages"]["find"]
                ["include"]}
    needed = packages | {"pyproject.toml", project["project"]["readme"], "config.yaml"}
    build_copied = {s.rstrip("/") for _, sources, _ in BUILD.copies() for s in sources}
    assert needed <= build_copied, needed - build_copied


def _copy_context(dst: Path) -> None:
    """The build stage's COPYs into ``dst``, as Docker does them: what .dockerignore
    leaves of the context, links kept as links."""
    for flags, sources, target in BUILD.copies():
        assert "from" not in flags
        assert not target.startswith("/"), "the build stage copies into its WORKDIR"
        for src in sources:
            # a directory's contents go to the target; a file into it when it ends in /
            into = dst / target
            if (ROOT / src).is_dir():
                shutil.copytree(ROOT / src, into, symlinks=True, dirs_exist_ok=True,
                                ignore=lambda d, names: [
                                    n for n in names
                                    if _ignored(str((Path(d) / n).relative_to(ROOT)))])
            else:
                into = into / Path(src).name if target.endswith("/") else into
                into.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / src, into, follow_symlinks=False)


def test_docker_build_context_builds_the_wheel(tmp_path: Path) -> None:
    """What the build stage copies is enough for its `pip install .`, built-in config
    included (proxy/config/default.yaml links to the copied config.yaml)."""
    (workdir,) = BUILD.all("WORKDIR")
    src = tmp_path / "ctx" / workdir.lstrip("/")
    src.mkdir(parents=True)
    _copy_context(src)
    have = all(importlib.util.find_spec(m) for m in ("setuptools", "wheel"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    *(["--no-build-isolation"] if have else []), "-w", str(tmp_path), "."],
                   cwd=src, check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("kvroute-*.whl")
    with zipfile.ZipFile(wheel) as z:
        assert z.read("proxy/config/default.yaml") == (ROOT / "config.yaml").read_bytes()
        assert "backends/templates/chatml-tools.jinja" in z.namelist()


def test_runtime_layout_is_enough_for_kvroute(tmp_path: Path) -> None:
    """The runtime stage's layout, rebuilt from this machine's cache: llama-server alone
    on PATH, the demo model alone in KVROUTE_CACHE (no sdist, no build tree).
    `kvroute doctor` over the image's config finds both, and the llama.cpp version."""
    built = find_llama_server()
    model = demo_model_path(DEPLOY.demo_model)
    if built is None or not model.is_file():
        pytest.skip("llama-server or the demo model not built (python -m backends prepare)")
    from_build = {src: dst for flags, sources, dst in RUNTIME.copies()
                  if flags.get("from") == "build" for src in sources}
    root = tmp_path / "image"
    build_cache = Path(BUILD.env()["KVROUTE_CACHE"])
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(NATIVE_ENV, raising=False)  # the image's build
        built_dir = binary_path(build_cache, "cpu").parent
    # the copied directory: the binary and its libraries, the tokenizer's libllama too
    server_dir = root / from_build[str(built_dir)].lstrip("/")
    server_dir.parent.mkdir(parents=True)
    server_dir.symlink_to(built.path.parent, target_is_directory=True)
    assert RUNTIME.env()[LIB_ENV] == from_build[str(built_dir)]
    cache = root / RUNTIME.env()["KVROUTE_CACHE"].lstrip("/")
    (cache / "models").mkdir(parents=True)
    (cache / "models" / model.name).symlink_to(model)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env |= {"KVROUTE_CACHE": str(cache), "KVROUTE_GPU": "", LIB_ENV: str(server_dir),
            # the image's PATH has no other llama-server: this machine's may
            "PATH": f"{KVROUTE.parent}:{server_dir}:/usr/bin:/bin"}
    out = subprocess.run([str(KVROUTE), "doctor", "--json", "--config", str(DEPLOY_CONFIG)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
                         check=False)
    report = json.loads(out.stdout)
    assert report["llama_server"]["source"] == "path", report["llama_server"]
    assert report["llama_server"]["version"] and not report["llama_server"]["version_warning"]
    assert report["demo_model"]["exists"], report["demo_model"]
    assert report["config"]["ok"], report["config"]
    # the tokenizer loads the copied libllama; the build is known by its CPU variants
    assert report["llama_cpp_python"]["importable"], report["llama_cpp_python"]
    assert report["cpu"]["build"].startswith("portable") == portable(), report["cpu"]


def test_dockerfile_builds_llama_server_as_backends_prepare_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    runs = " ; ".join(BUILD.all("RUN"))
    # what build_llama_server needs on PATH, and nothing that builds around it
    assert "cmake" in runs and ("build-essential" in runs or "g++" in runs)
    assert "git" in runs.split()  # applies kvroute's patches to the tree
    assert "cmake -S" not in runs and "cmake --build" not in runs
    assert "pip install ." in runs and "[" not in runs.split("pip install", 1)[1].split()[0]
    venv = runs.split("-m venv ", 1)[1].split()[0]
    assert f"{venv}/bin/python -m backends prepare" in runs

    # the runtime copies llama-server and the demo model from where prepare puts them
    cache = Path(BUILD.env()["KVROUTE_CACHE"])
    monkeypatch.setenv("KVROUTE_CACHE", str(cache))
    # the portable build: the image runs on CPUs other than the builder's
    assert NATIVE_ENV not in BUILD.env()
    monkeypatch.delenv(NATIVE_ENV, raising=False)
    from_build = {src: dst for flags, sources, dst in RUNTIME.copies()
                  if flags.get("from") == "build" for src in sources}
    assert venv in from_build
    # the whole directory: the binary and the CPU variants it loads from beside itself
    server_dst = from_build[str(binary_path(cache, "cpu").parent)]
    # on the runtime PATH, which kvroute searches before any cache
    path = RUNTIME.env()["PATH"].replace("$PATH", BASE_IMAGE_PATH).split(":")
    assert server_dst in path
    # its libllama is the tokenizer's: llama-cpp-python is installed without one
    assert 'CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF"' in runs
    assert RUNTIME.env()[LIB_ENV] == server_dst
    models = str(demo_model_path(DEPLOY.demo_model).parent)
    assert Path(from_build[models]) == Path(RUNTIME.env()["KVROUTE_CACHE"]) / "models"


def test_dockerfile_runs_a_real_kvroute_command(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = _command()
    assert argv[0] == "kvroute"
    assert "--config" in _helps(argv)
    args = _parses(argv[1:], monkeypatch)
    assert args.cmd == "serve" and args.host == "0.0.0.0"
    # the deploy config is the image's default config and listens on the exposed port
    copied = {dst: src for flags, sources, dst in RUNTIME.copies() if "from" not in flags
              for src in sources}
    assert copied[str(args.config)] == "deploy/config.yaml"
    assert RUNTIME.all("EXPOSE") == [str(DEPLOY.proxy.port)]
    user = RUNTIME.all("USER")
    assert user and user[-1] not in ("root", "0")


def _volumes() -> tuple[dict[str, Any], dict[str, str]]:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    service = compose["services"]["kvroute"]
    mounts = {}
    for v in service["volumes"]:
        src, dst, *_ = v.split(":")
        mounts[dst] = src
        if not src.startswith((".", "/")):
            assert src in (compose.get("volumes") or {}), f"volume {src} is not declared"
    return service, mounts


def test_compose_matches_the_image() -> None:
    service, mounts = _volumes()
    build = service["build"]
    context = build if isinstance(build, str) else build["context"]
    assert (ROOT / context / "Dockerfile").is_file()
    assert [str(p).split(":")[-1] for p in service["ports"]] == RUNTIME.all("EXPOSE")
    # the config kvroute reads is the one mounted, and it is in the repo
    config = _option(_command(), "--config")
    assert (ROOT / mounts[config]).resolve() == DEPLOY_CONFIG
    # the image's volumes are the service's: the cache, and the state that holds the
    # config's log_dir and kv_disk path
    image_volumes = set(json.loads(RUNTIME.all("VOLUME")[0]))
    assert image_volumes <= set(mounts)
    assert RUNTIME.env()["KVROUTE_CACHE"] in image_volumes
    assert DEPLOY.kv_disk is not None
    for path in (DEPLOY.log_dir, DEPLOY.kv_disk.path):
        assert any(path.is_relative_to(v) for v in image_volumes), path
    # where the README says your own GGUFs go
    assert "/models" in mounts


def _unit() -> dict[str, dict[str, list[str]]]:
    """A systemd unit file: section -> key -> every value (keys may repeat)."""
    out: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    section = ""
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, sep, value = line.partition("=")
        assert sep and section, f"not a key=value line in a section: {raw!r}"
        out[section][key.strip()].append(value.strip())
    return out


def test_systemd_unit_runs_kvroute_serve_hardened(monkeypatch: pytest.MonkeyPatch) -> None:
    unit = _unit()
    for section, key in [("Unit", "Description"), ("Service", "ExecStart"),
                         ("Service", "User"), ("Service", "Restart"),
                         ("Install", "WantedBy")]:
        assert unit[section][key], f"[{section}] {key}= missing"
    service = {k: v[-1] for k, v in unit["Service"].items()}
    assert service["User"] not in ("root", "0")
    assert service["NoNewPrivileges"] == "yes"
    assert service["ProtectSystem"] in ("strict", "full", "yes")

    argv = shlex.split(service["ExecStart"])
    assert Path(argv[0]).is_absolute() and argv[0].endswith("/bin/kvroute")
    assert "--config" in _helps(argv)
    args = _parses(argv[1:], monkeypatch)
    assert args.cmd == "serve"
    # the same config path as the image's, installed from deploy/config.yaml
    assert str(args.config) == _option(_command(), "--config")
    # the config's directories are the ones systemd creates and lets the user write
    state = Path("/var/lib") / service["StateDirectory"]
    assert DEPLOY.kv_disk is not None
    assert DEPLOY.log_dir.is_relative_to(state) and DEPLOY.kv_disk.path.is_relative_to(state)
    env = dict(e.partition("=")[::2] for e in unit["Service"]["Environment"])
    assert env["KVROUTE_CACHE"] == str(Path("/var/cache") / service["CacheDirectory"])


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze not installed: the unit is parsed only")
def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    # verify checks that ExecStart's program exists: this venv's kvroute stands in for
    # the installed one
    text = UNIT.read_text()
    installed = shlex.split(_unit()["Service"]["ExecStart"][-1])[0]
    unit = tmp_path / "kvroute.service"
    unit.write_text(text.replace(installed, str(KVROUTE)))
    out = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                         text=True, timeout=60, check=False)
    complaints = [ln for ln in (out.stdout + out.stderr).splitlines()
                  if "kvroute.service" in ln]
    assert out.returncode == 0 and not complaints, out.stdout + out.stderr
