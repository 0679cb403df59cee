"""config.yaml's backends and what runs them: `backends:` (managed llama-servers and
external servers), `demo_model:`, `llama_server:` and `supervision:`. An agent's file
(agent_file.py) has the same sections, read by the same functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path

from backends.client import MAX_SLOT_CTX, MAX_SLOTS
from backends.config import (
    BACKEND_KINDS,
    EXTERNAL_KV_BYTES,
    LLAMA,
    BackendConfig,
    ExternalBackendConfig,
    ManagedBackendConfig,
    SupervisionConfig,
)
from backends.demo_audio import DEMO_AUDIO, demo_audio_path
from backends.demo_audio import for_model as audio_for_model
from backends.demo_lora import DEMO_LORAS, INVOCATIONS, demo_lora_paths
from backends.demo_mmproj import DEMO_MMPROJ, demo_mmproj_path, for_model
from backends.demo_model import DEMO_KINDS, QWEN2, DemoModelParams, demo_model_path
from proxy.config.disk import slot_save_path
from proxy.config.fields import ConfigError, _path, _Section, _show, unique_names

# `model: demo`, `demo-swa` (sliding-window attention), `demo-hybrid` (recurrent layers)
DEMO_NAMES = tuple(DEMO_KINDS)

# the demo adapters that are aLoRAs (invoked by Qwen2 tokens)
ALORA = frozenset(n for n, seed in DEMO_LORAS.items() if seed in INVOCATIONS)


def demo_params(raw: object) -> DemoModelParams:
    sec = _Section(raw, "demo_model.")
    d = DemoModelParams()
    kwargs = {f.name: sec.get_int(f.name, getattr(d, f.name), lo=0 if f.name == "seed" else 1)
              for f in fields(DemoModelParams)}
    sec.finish([f.name for f in fields(DemoModelParams)])
    try:
        return DemoModelParams(**kwargs)
    except ValueError as e:
        raise ConfigError(f"{e} (fix: adjust the demo_model sizes)") from None


def _backend(raw: object, i: int, base: Path, demos: Mapping[str, Path],
             demo_mmproj: Mapping[str, Path],
             demo_loras: Mapping[str, Mapping[str, Path] | None],
             allow_missing_demo: bool) -> BackendConfig:
    """One entry of `backends:`; ``demos``: the demo models' files by name,
    ``demo_loras``: each one's demo adapters by name (None: none fit it)."""
    where = f"backends[{i}]."
    sec = _Section(raw, where)
    name = sec.get_str("name", f"backend{i}", "gpu0")
    assert name is not None
    if sec.has("url") == sec.has("model"):
        raise ConfigError(
            f"backends[{i}]: give exactly one of 'model' (a managed llama-server kvroute "
            "starts) or 'url' (an external server) (fix: e.g. model: demo)"
        )
    if sec.has("url"):
        return _external(sec, where, name, base)
    model_raw = sec.get_str("model", None, "demo")
    assert model_raw is not None
    is_demo = model_raw in demos
    model = demos[model_raw] if is_demo else _path(base, model_raw)
    if not model.is_file() and not (is_demo and allow_missing_demo):
        fix = ("run `python -m backends prepare` (or `make run`) to build it" if is_demo
               else "give the path of an existing .gguf file, or `model: demo` "
               f"(or {', '.join(DEMO_NAMES[1:])})")
        raise ConfigError(f"{where}model: file not found: {model} (fix: {fix})")
    d = ManagedBackendConfig(name=name, model=model)
    b = ManagedBackendConfig(
        name=name, model=model, is_demo=is_demo,
        slots=sec.get_int("slots", d.slots),
        ctx_per_slot=sec.get_int("ctx_per_slot", d.ctx_per_slot, lo=256),
        threads=sec.get_int("threads", d.threads),
        cache_ram_mib=sec.get_int("cache_ram_mib", d.cache_ram_mib, lo=0),
        alias=sec.get_str("alias", f"kvroute-{model_raw}" if is_demo else None, "my-model"),
        aliases=sec.get_str_list("aliases"),
        extra_args=sec.get_str_list("extra_args"),
        env=sec.get_str_map("env"),
        devices=_devices(sec, where),
        mmproj=_mmproj(sec, where, base, demo_mmproj if is_demo else None,
                       allow_missing_demo),
        lora=_loras(sec, where, base, demo_loras[model_raw] if is_demo else None,
                    allow_missing_demo),
    )
    sec.finish([f.name for f in fields(ManagedBackendConfig) if f.name != "is_demo"])
    return b


def _external(sec: _Section, where: str, name: str, base: Path) -> ExternalBackendConfig:
    """An entry with `url:`: a server kvroute does not start."""
    url = sec.get_str("url", None, "http://127.0.0.1:8081")
    assert url is not None
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"{where}url: expected an http(s) URL, got {_show(url)} "
                          "(fix: e.g. url: http://127.0.0.1:8081)")
    key = sec.get_str("api_key", None, "sk-backend")
    if key is not None and not (key.isascii() and key.isprintable()):  # a header value
        raise ConfigError(f"{where}api_key: holds a control character, line break or "
                          "non-ASCII character (fix: the key alone, on one line)")
    ext = ExternalBackendConfig(
        name=name, url=url.rstrip("/"), api_key=key,
        kv_bytes_per_token=(sec.get_int("kv_bytes_per_token", EXTERNAL_KV_BYTES)
                            if sec.has("kv_bytes_per_token") else None),
        cache_ram_mib=sec.get_int("cache_ram_mib", 0, lo=0),
        kind=_kind(sec, where),
        sequences=sec.get_int("sequences", 32, hi=MAX_SLOTS),
        ctx=sec.get_int("ctx", 131072, hi=MAX_SLOT_CTX),
        alias=sec.get_str("alias", None, "my-model"),
        aliases=sec.get_str_list("aliases"),
        slot_save_path=slot_save_path(sec, base),
    )
    sec.finish([f.name for f in fields(ExternalBackendConfig)])
    return ext


def _mmproj(sec: _Section, where: str, base: Path, demos: Mapping[str, Path] | None,
            allow_missing_demo: bool) -> Path | None:
    """``mmproj: demo`` or ``demo-audio`` (the demo models' projectors by name, ``demos``:
    None for a model they do not fit) or the path of a projector GGUF."""
    raw = sec.get_str("mmproj", None, "demo")
    if raw is None:
        return None
    if raw in (DEMO_MMPROJ, DEMO_AUDIO):
        demo = None if demos is None else demos[raw]
        if demo is None:
            raise ConfigError(f"{where}mmproj: `{raw}` is one of the demo models' projectors and "
                              "fits only them (fix: the path of this model's own mmproj "
                              ".gguf, or model: demo)")
        if demo.is_file() or allow_missing_demo:
            return demo
        raise ConfigError(f"{where}mmproj: file not found: {demo} (fix: run `python -m "
                          "backends prepare` (or `make run`) to build it)")
    path = _path(base, raw)
    if not path.is_file():
        raise ConfigError(f"{where}mmproj: file not found: {path} (fix: give the path of "
                          "an existing mmproj .gguf file, or mmproj: demo with a demo model)")
    return path


def _demo_loras(params: DemoModelParams, kind: str) -> dict[str, Path] | None:
    """The demo adapters that fit demo model ``kind``: the aLoRA's invocation tokens are
    Qwen2's, so it fits only the demo models of that vocabulary."""
    paths = demo_lora_paths(params, DEMO_KINDS[kind].arch)
    if paths is None or DEMO_KINDS[kind].vocab == QWEN2:
        return paths
    return {name: path for name, path in paths.items() if name not in ALORA}


def _loras(sec: _Section, where: str, base: Path, demo: Mapping[str, Path] | None,
           allow_missing_demo: bool) -> tuple[Path, ...]:
    """``lora: [demo, demo1]`` (the demo models' two adapters, ``demo``: None for a
    model they do not fit) or paths of LoRA adapter GGUFs; a single one may be given
    without the list."""
    raw = sec.get_raw("lora")
    items = [] if raw is None else raw if isinstance(raw, list) else [raw]
    if not all(isinstance(x, str) and x for x in items) or len(set(items)) != len(items):
        raise ConfigError(f"{where}lora: expected an adapter path or a list of distinct "
                          f"ones, got {_show(raw)} (fix: e.g. lora: [my-adapter.gguf], or "
                          "lora: [demo, demo1] with a demo model)")
    out: list[Path] = []
    for name in items:
        if name in DEMO_LORAS:
            if demo is None or name not in demo:
                fits = ("the demo models with attention in every layer" if name not in ALORA
                        else "demo and demo-swa (its invocation is of their vocabulary)")
                raise ConfigError(f"{where}lora: `{name}` is a demo adapter and fits only "
                                  f"{fits} (fix: the path of this model's own adapter, or "
                                  "model: demo)")
            path = demo[name]
            if not (path.is_file() or allow_missing_demo):
                raise ConfigError(f"{where}lora: file not found: {path} (fix: run `python "
                                  "-m backends prepare` (or `make run`) to build it)")
        else:
            path = _path(base, name)
            if not path.is_file():
                raise ConfigError(f"{where}lora: file not found: {path} (fix: give the path "
                                  "of an existing LoRA adapter .gguf file)")
        if "," in str(path):  # llama-server splits --lora at commas
            raise ConfigError(f"{where}lora: {path} has a comma, which llama-server's "
                              "--lora cannot take (fix: rename or link the file)")
        out.append(path)
    return tuple(out)


def _devices(sec: _Section, where: str) -> tuple[str | int, ...]:
    """``devices: Vulkan0``, ``[CUDA0, CUDA1]``, or CUDA indices ``[0, 1]``
    (backends/devices.py)."""
    v = sec.get_raw("devices")
    if v is None:
        return ()
    items = v if isinstance(v, list) else [v]

    def ok(x: object) -> bool:
        return (isinstance(x, str) and x.isidentifier()) or \
            (isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1024)

    if not items or not all(ok(x) for x in items) or len(set(items)) != len(items):
        raise ConfigError(f"{where}devices: expected a device name or a list of distinct "
                          "names or CUDA indices, got " + repr(v) + " (fix: e.g. devices: "
                          "Vulkan0, or devices: [0, 1]; names: `llama-server --list-devices`)")
    return tuple(items)


def _kind(sec: _Section, where: str) -> str:
    kind = sec.get_str("kind", LLAMA, "openai")
    if kind not in BACKEND_KINDS:
        raise ConfigError(f"{where}kind: expected one of {', '.join(BACKEND_KINDS)}, got "
                          f"{kind!r} (fix: kind: openai for a server of the OpenAI API only)")
    assert kind is not None
    return kind


def supervision(raw: object) -> SupervisionConfig:
    sec = _Section(raw, "supervision.")
    d = SupervisionConfig()
    # (one death is a restart; a loop is several)
    out = SupervisionConfig(**{f.name: sec.get_int(f.name, d.crash_loop_deaths, lo=2)
                               if f.name == "crash_loop_deaths"
                               else sec.get_num(f.name, getattr(d, f.name))
                               for f in fields(SupervisionConfig)})
    sec.finish([f.name for f in fields(SupervisionConfig)])
    if out.crash_loop_backoff_max_s < out.restart_backoff_max_s:
        raise ConfigError(
            f"supervision.crash_loop_backoff_max_s: {out.crash_loop_backoff_max_s:g} is less "
            f"than restart_backoff_max_s ({out.restart_backoff_max_s:g}), where a crash "
            "loop's backoff starts (fix: raise crash_loop_backoff_max_s, or lower "
            "restart_backoff_max_s)")
    return out


def llama_server(top: _Section, base: Path) -> str | None:
    llama_server = top.get_str("llama_server", None, "/usr/local/bin/llama-server")
    if llama_server is None:
        return None
    binary = _path(base, llama_server)
    if not binary.is_file():
        raise ConfigError(f"llama_server: file not found: {binary} (fix: correct the "
                          "path, or remove the key to use PATH or build one)")
    return str(binary)


def backend_list(top: _Section, base: Path, params: DemoModelParams,
              allow_missing_demo: bool, optional: bool = False) -> tuple[BackendConfig, ...]:
    """`backends:`, each named once (none at all: only with ``optional``, a router whose
    agents run them)."""
    demos = {k: demo_model_path(params, kind=k) for k in DEMO_NAMES}
    demo_mmproj = {DEMO_MMPROJ: demo_mmproj_path(for_model(params)),
                   DEMO_AUDIO: demo_audio_path(audio_for_model(params))}
    demo_loras = {k: _demo_loras(params, k) for k in DEMO_NAMES}
    raw_backends = top._get("backends")
    if optional and raw_backends in (None, []):
        return ()
    if not isinstance(raw_backends, list) or not raw_backends:
        raise ConfigError(f"backends: expected a non-empty list, got {_show(raw_backends)} "
                          "(fix: e.g. backends: [{name: a, model: demo}])")
    backends = tuple(_backend(b, i, base, demos, demo_mmproj, demo_loras,
                              allow_missing_demo)
                     for i, b in enumerate(raw_backends))
    unique_names([b.name for b in backends], "backends")
    return backends
