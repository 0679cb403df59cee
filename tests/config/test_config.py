"""Config loading: every bad input fails at load, naming the field and the fix."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from backends.config import (
    ExternalBackendConfig,
    KvDiskConfig,
    ManagedBackendConfig,
    SupervisionConfig,
)
from backends.demo_model import DemoModelParams, demo_model_path
from proxy.config.fields import ConfigError
from proxy.config.load import load_config
from proxy.config.settings import ProxySettings

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def managed(**kw: Any) -> dict[str, Any]:
    return {"name": "a", "model": "demo", **kw}


def load(tmp_path: Path, data: Any, **kw: Any) -> Any:
    return load_config(write(tmp_path, data), check_port=False, **kw)


def error_of(tmp_path: Path, data: Any, **kw: Any) -> str:
    with pytest.raises(ConfigError) as exc:
        load(tmp_path, data, **kw)
    return str(exc.value)


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def test_shipped_config_is_the_default(demo_model: Path) -> None:
    shipped = load_config(REPO / "config.yaml", check_port=False)
    default = load_config(None, check_port=False)
    assert shipped.proxy == default.proxy
    assert shipped.backends == default.backends
    assert shipped.proxy.host == "127.0.0.1" and shipped.proxy.port == 8080
    assert shipped.proxy.policy == "prefix"
    # slots with room for Claude Code's ~30k-token first prompt (tests/test_claude_code.py)
    assert [(b.name, b.slots, b.ctx_per_slot, b.threads, b.model)
            for b in shipped.managed()] == [("a", 2, 32768, 1, demo_model),
                                            ("b", 2, 32768, 1, demo_model)]
    assert shipped.log_dir == REPO / "logs"
    # what config.yaml spells out is what the code defaults to: one value per knob
    assert shipped.proxy.settings == ProxySettings()
    assert shipped.supervision == SupervisionConfig()
    assert shipped.demo_model == DemoModelParams()


def test_full_config_round_trip(tmp_path: Path, demo_model: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    cfg = load(tmp_path, {
        "proxy": {"host": "127.0.0.1", "port": 9000, "policy": "round_robin"},
        "routing": {"load_factor": 2, "load_slack_tokens": 100},
        "log_dir": "mylogs",
        "backends": [
            managed(slots=4, ctx_per_slot=4096, threads=2, cache_ram_mib=0,
                    extra_args=["--temp", 0], env={"CUDA_VISIBLE_DEVICES": 1}),
            {"name": "local", "model": "m.gguf"},
            {"name": "far", "url": "http://10.0.0.1:8080/", "api_key": "k"},
        ],
    })
    a, local, far = cfg.backends
    assert isinstance(a, ManagedBackendConfig) and a.is_demo and a.model == demo_model
    assert (a.slots, a.ctx_per_slot, a.threads, a.cache_ram_mib) == (4, 4096, 2, 0)
    assert a.extra_args == ("--temp", "0") and dict(a.env) == {"CUDA_VISIBLE_DEVICES": "1"}
    assert isinstance(local, ManagedBackendConfig) and local.model == model
    assert not local.is_demo and local.alias is None
    assert isinstance(far, ExternalBackendConfig) and far.url == "http://10.0.0.1:8080"
    assert cfg.log_dir == tmp_path / "mylogs"
    assert cfg.proxy.policy == "round_robin"
    assert cfg.routing.router_settings().load_factor == 2


@pytest.mark.parametrize(("data", "expect"), [
    ({"backends": [managed()], "proxi": {}},
     "proxi: unknown key (fix: did you mean 'proxy'?)"),
    ({"backends": [managed()], "proxy": {"prot": 1}},
     "proxy.prot: unknown key (fix: did you mean 'port'?)"),
    ({"backends": [managed(slot=2)]},
     "backends[0].slot: unknown key (fix: did you mean 'slots'?)"),
    ({"backends": [{"name": "x", "url": "http://h:1", "slots": 2}]},
     "backends[0].slots: unknown key"),
    ({"backends": [managed()], "routing": {"load_fctor": 2}},
     "routing.load_fctor: unknown key (fix: did you mean 'load_factor'?)"),
])
def test_unknown_keys_are_rejected(tmp_path: Path, demo_model: Path, data: Any,
                                   expect: str) -> None:
    assert expect in error_of(tmp_path, data)


@pytest.mark.parametrize(("data", "expect"), [
    ({"backends": [managed(slots="two")]},
     "backends[0].slots: expected a positive integer, got 'two' (fix: e.g. slots: 2)"),
    ({"backends": [managed(), managed(name="b", threads=True)]},
     "backends[1].threads: expected a positive integer, got True"),
    ({"backends": [managed(slots=0)]}, "backends[0].slots: expected"),
    ({"backends": [managed(extra_args="--foo")]},
     "backends[0].extra_args: expected a list of strings"),
    ({"backends": [managed(env=["A=1"])]}, "backends[0].env: expected a mapping of strings"),
    ({"backends": [managed()], "proxy": {"port": "80a"}},
     "proxy.port: expected an integer in 1..65535"),
    ({"backends": [managed()], "proxy": {"port": 70000}},
     "proxy.port: expected an integer in 1..65535"),
    ({"backends": [managed()], "proxy": {"policy": "fastest"}},
     "proxy.policy: unknown policy 'fastest'"),
    ({"backends": [managed()], "supervision": {"health_interval_s": "2s"}},
     "supervision.health_interval_s: expected a positive number"),
    ({"backends": [managed()], "supervision": {"crash_loop_deaths": 1}},
     "supervision.crash_loop_deaths: expected an integer >= 2, got 1"),
    ({"backends": [managed()], "supervision": {"crash_loop_window_s": 0}},
     "supervision.crash_loop_window_s: expected a positive number, got 0"),
    ({"backends": [managed()], "supervision": {"crash_loop_backoff_max_s": 10}},
     "supervision.crash_loop_backoff_max_s: 10 is less than restart_backoff_max_s (30)"),
    ({"backends": [managed()], "routing": {"load_factor": "high"}},
     "routing.load_factor: expected float, got 'high'"),
    ({"backends": [managed()], "routing": {"load_factor": 0.5}},
     "routing.load_factor: must be >= 1.0"),
    ({"backends": [managed()], "routing": {"load_slack_tokens": 1.5}},
     "routing.load_slack_tokens: expected int"),
    ({"backends": [managed()], "demo_model": {"n_head": 7}},
     "demo_model: n_embd must be a multiple"),
    ({"backends": []}, "backends: expected a non-empty list"),
    ({"backends": "a"}, "backends: expected a non-empty list"),
    ({"backends": [managed(), managed()]}, "backends[1].name: duplicate name 'a'"),
    ({"backends": [{"name": "x", "model": "demo", "url": "http://h:1"}]},
     "backends[0]: give exactly one of 'model'"),
    ({"backends": [{"name": "x", "url": "h:1"}]}, "backends[0].url: expected an http(s) URL"),
    ({"backends": [{"url": "http://h:1", "kind": "vllm"}]},
     "backends[0].kind: expected one of llama, openai, got 'vllm'"),
    ({"backends": [{"url": "http://h:1", "kind": "openai", "sequences": 0}]},
     "backends[0].sequences: expected an integer in 1..4096"),
    ({"backends": [managed()], "proxy": [1]}, "proxy: expected a mapping"),
    ({"backends": [managed()], "proxy": {"max_in_flight": "many"}},
     "proxy.max_in_flight: expected int, got 'many'"),
    ({"backends": [managed()], "proxy": {"queue_timeout_s": 0}},
     "proxy.queue_timeout_s: expected a positive number"),
    ({"backends": [managed()], "proxy": {"log_prompts": "yes"}},
     "proxy.log_prompts: expected bool"),
    ({"backends": [managed()], "proxy": {"max_in_flght": 3}},
     "proxy.max_in_flght: unknown key (fix: did you mean 'max_in_flight'?)"),
    ({"backends": [managed()], "proxy": {"health": {"breaker": 2}}},
     "proxy.health.breaker: unknown key (fix: did you mean 'breaker_failures'?)"),
    ({"backends": [managed()], "proxy": {"health": {"probe_interval_s": 0}}},
     "proxy.health.probe_interval_s: expected a positive number, got 0"),
    ({"backends": [managed()], "proxy": {"health": {"breaker_failures": -1}}},
     "proxy.health.breaker_failures: expected a positive number, got -1"),
    ({"backends": [managed()], "proxy": {"health": {"stall_timeout_s": -5}}},
     "proxy.health.stall_timeout_s: expected a positive number (or 0: off), got -5"),
    ({"backends": [{"url": "http://10.0.0.1:8080", "api_key": "k\r\nX-Evil: 1"}]},
     "backends[0].api_key: holds a control character, line break"),
    ({"backends": [managed()], "proxy": {"api_keys": "k"}},
     "proxy.api_keys: expected a list of strings"),
    ({"backends": [managed()], "proxy": {"tokenizer": "/nonexistent.gguf"}},
     "proxy.tokenizer: file not found"),
    ("proxy: [", "not valid YAML"),
])
def test_bad_values_name_the_field(tmp_path: Path, demo_model: Path, data: Any,
                                   expect: str) -> None:
    msg = error_of(tmp_path, data)
    assert expect in msg
    assert "(fix:" in msg


def test_missing_model_file(tmp_path: Path) -> None:
    msg = error_of(tmp_path, {"backends": [{"name": "a", "model": "nope.gguf"}]})
    assert f"backends[0].model: file not found: {tmp_path / 'nope.gguf'}" in msg
    assert "fix: give the path of an existing .gguf file" in msg


def test_missing_demo_model_says_how_to_build_it(tmp_path: Path) -> None:
    data = {"backends": [managed()], "demo_model": {"seed": 12345}}  # a model nobody built
    msg = error_of(tmp_path, data)
    assert "backends[0].model: file not found" in msg and "python -m backends prepare" in msg
    # prepare / serve load the same config to build it
    assert load(tmp_path, data, allow_missing_demo=True).managed()[0].is_demo


def test_missing_llama_server_binary(tmp_path: Path, demo_model: Path) -> None:
    data = {"backends": [managed()], "llama_server": "/nonexistent/llama-server"}
    msg = error_of(tmp_path, data)
    assert "llama_server: file not found: /nonexistent/llama-server (fix:" in msg


def test_port_in_use(tmp_path: Path, demo_model: Path, busy_port: int) -> None:
    path = write(tmp_path, {"backends": [managed()], "proxy": {"port": busy_port}})
    with pytest.raises(ConfigError, match=rf"proxy.port: 127.0.0.1:{busy_port} is already in use "
                       r"\(fix: .*--port"):
        load_config(path)
    load_config(path, check_port=False)  # the check can be skipped (doctor, prepare)


def test_cli_overrides_are_validated(tmp_path: Path, demo_model: Path, busy_port: int) -> None:
    path = write(tmp_path, {"backends": [managed()]})
    cfg = load_config(path, check_port=False, overrides={"port": 9123, "policy": "random",
                                                         "host": None})
    assert (cfg.proxy.host, cfg.proxy.port, cfg.proxy.policy) == ("127.0.0.1", 9123, "random")
    with pytest.raises(ConfigError, match="--policy: unknown policy 'best'"):
        load_config(path, check_port=False, overrides={"policy": "best"})
    with pytest.raises(ConfigError, match=r"--port: expected an integer in 1\.\.65535"):
        load_config(path, check_port=False, overrides={"port": 0})
    with pytest.raises(ConfigError, match=r"proxy\.port: .* already in use"):
        load_config(path, overrides={"port": busy_port})


def test_unreadable_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--config: cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_proxy_knobs_and_api_keys_from_the_environment(
        tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVROUTE_API_KEYS", " env-one, ,env-two ")
    cfg = load(tmp_path, {"backends": [managed()], "proxy": {
        "api_keys": ["file-key"], "max_in_flight": 3, "queue_timeout_s": 2,
        "health": {"breaker_failures": 5, "stall_timeout_s": 0}}})
    s = cfg.proxy.settings
    assert s.api_keys == ("file-key", "env-one", "env-two")
    assert (s.max_in_flight, s.queue_timeout_s, s.health.breaker_failures) == (3, 2.0, 5)
    assert s.health.stall_timeout_s == 0.0  # (0: no stall check)
    assert isinstance(s.queue_timeout_s, float)


def test_kv_disk(tmp_path: Path, demo_model: Path) -> None:
    assert load(tmp_path, {"backends": [managed()]}).kv_disk is None  # off by default
    cfg = load(tmp_path, {"backends": [managed()],
                          "kv_disk": {"path": "slots", "max_gib": 2, "min_tokens": 512}})
    assert cfg.kv_disk == KvDiskConfig(tmp_path / "slots", max_gib=2.0, min_tokens=512)
    # 0: saved as soon as idle, whatever its size
    cfg = load(tmp_path, {"backends": [managed()], "kv_disk": {
        "path": "slots", "save_after_idle_s": 0, "min_tokens": 0}})
    assert cfg.kv_disk == KvDiskConfig(tmp_path / "slots", save_after_idle_s=0.0, min_tokens=0)
    assert "kv_disk.save_after_idle_s: expected a number >= 0, got -1" in error_of(
        tmp_path, {"backends": [managed()], "kv_disk": {"path": "s", "save_after_idle_s": -1}})
    assert "kv_disk.path: required" in error_of(
        tmp_path, {"backends": [managed()], "kv_disk": {"max_gib": 2}})
    assert "kv_disk.max_gb: unknown key (fix: did you mean 'max_gib'?)" in error_of(
        tmp_path, {"backends": [managed()], "kv_disk": {"path": "s", "max_gb": 2}})


def test_each_set_of_demo_sizes_has_its_own_file() -> None:
    """A size changed in demo_model: builds another file (config.yaml says so), the
    trained context included; the defaults keep the name they have."""
    base = DemoModelParams()
    others = [replace(base, n_layer=4), replace(base, n_embd=256), replace(base, n_head=4),
              replace(base, n_head_kv=2), replace(base, n_ff=1024),
              replace(base, n_ctx_train=4096), replace(base, seed=1)]
    paths = {demo_model_path(p) for p in [base, *others]}
    assert len(paths) == 1 + len(others)
    assert "-C" not in demo_model_path(base).name


@pytest.mark.parametrize(("devices", "want"), [
    (None, ()),
    ("Vulkan0", ("Vulkan0",)),
    (["CUDA0", "CUDA1"], ("CUDA0", "CUDA1")),
    ([0, 1], (0, 1)),
    ([], "devices: expected a device name"),
    ([0, 0], "distinct"),
    (["Vulkan 0"], "devices: expected"),
    ([True], "devices: expected"),
    ([-1], "devices: expected"),
])
def test_a_managed_backends_devices(tmp_path: Path, demo_model: Path, devices: Any,
                                    want: tuple[str | int, ...] | str) -> None:
    data = {"backends": [managed() if devices is None else managed(devices=devices)]}
    if isinstance(want, str):
        assert want in error_of(tmp_path, data, allow_missing_demo=True)
    else:
        assert load(tmp_path, data, allow_missing_demo=True).backends[0].devices == want
