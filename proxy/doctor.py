"""`kvroute doctor`: what a user runs when something is wrong.

`report` reads the installation, the config and the backends (a running `kvroute serve`
is found through its log_dir/backends.json) into a stable document (keys are only ever
added) that scripts use to find the built artifacts: ``llama_server.path``,
``demo_model.path``; `print_report` says it in lines, BAD where something is broken.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import platform
from pathlib import Path
from typing import Any

from proxy.config.fields import ConfigError
from proxy.config.load import Config, check_port_free, load_config


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


async def _probe(url: str, api_key: str | None = None, kind: str = "llama"
                 ) -> tuple[bool, str]:
    """Up or not, and why: a llama-server by /health, a server of the OpenAI API by the
    models it lists (with the key kvroute sends it)."""
    import aiohttp

    from backends.client import BackendClient, Health
    from backends.dialect import dialect_of

    async with aiohttp.ClientSession() as session:
        client = BackendClient(session, url, api_key, timeout=3.0)
        if not dialect_of(kind).has_health:
            models = await client.models()
            if isinstance(models, list):
                return True, f"/v1/models: {', '.join(models[:3])}"
            return False, getattr(models, "reason", None) or f"/v1/models: {models}"
        h = await client.health()
    if isinstance(h, Health):
        return h.ok, f"/health {h.status}"
    return False, h.reason


def backend_health(cfg: Config) -> list[dict[str, Any]]:
    """External backends are probed directly; managed ones through the state file the
    running `kvroute serve` keeps (they listen on random ports)."""
    running: dict[str, dict[str, Any]] = {}
    state_file = cfg.log_dir / "backends.json"
    try:
        state = json.loads(state_file.read_text())
        if _pid_alive(int(state["kvroute_pid"])):
            running = {b["name"]: b for b in state["backends"]}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    out: list[dict[str, Any]] = []
    for b in cfg.backends:
        managed = not hasattr(b, "url")
        url = getattr(b, "url", None) or running.get(b.name, {}).get("url")
        entry: dict[str, Any] = {"name": b.name, "managed": managed, "url": url,
                                 "healthy": False, "detail": ""}
        if url is None:
            entry["detail"] = "not running (start it with `kvroute serve`)"
        else:
            entry["healthy"], entry["detail"] = asyncio.run(_probe(
                url, getattr(b, "api_key", None), getattr(b, "kind", "llama")))
            if managed:
                entry["pid"] = running[b.name].get("pid")
                entry["log"] = running[b.name].get("log")
                entry["state"] = running[b.name].get("state")
                # what died, its log's tail, its command line and the likely fix
                entry["crash_loop"] = running[b.name].get("crash_loop")
        out.append(entry)
    return out


def report(config_path: Path | None) -> dict[str, Any]:
    from backends.binary import cache_dir
    from backends.cpu import build_report
    from backends.demo_model import DemoModelParams, demo_model_path

    report: dict[str, Any] = {"ok": True, "python": platform.python_version()}
    try:
        report["kvroute_version"] = importlib.metadata.version("kvroute")
    except importlib.metadata.PackageNotFoundError:
        report["kvroute_version"] = None
    report["llama_cpp_python"] = lcp = _bindings()
    report["cache_dir"] = str(cache_dir())
    cfg, report["config"] = _config(config_path)
    report["llama_server"] = srv = _server(cfg)
    report["cpu"] = build_report(_recipe_of(srv["path"]))
    params = cfg.demo_model if cfg else DemoModelParams()
    model = demo_model_path(params)
    report["demo_model"] = {"path": str(model), "exists": model.is_file(),
                            "kv_bytes_per_token": params.kv_bytes_per_token}
    report["backends"] = backend_health(cfg) if cfg else []
    if cfg is not None:
        _devices(cfg, srv["path"], report["backends"])
        _mmprojs(cfg, report["backends"])
    report["ok"] = (lcp["error"] is None and report["config"]["ok"] and not srv["error"]
                    and not any(b.get("devices_error") for b in report["backends"])
                    and all(b.get("mmproj_exists", True) and not b.get("lora_missing")
                            for b in report["backends"])
                    and not (cfg is not None and any(b.is_demo for b in cfg.managed())
                             and not model.is_file())
                    and not any(b.get("crash_loop") for b in report["backends"]))
    # the tokenizer needs libllama: without it, said under llama_cpp_python
    if cfg is not None and lcp["importable"]:
        report["tokens"] = _tokens(cfg)
    return report


def _bindings() -> dict[str, Any]:
    """llama-cpp-python: its version, whether it imports, the libllama it loads."""
    from backends.binary import llama_cpp_python_version as lcp_version
    from backends.libllama import libllama_dir

    lcp: dict[str, Any] = {"version": lcp_version(), "importable": False, "error": None,
                           "libllama": str(d) if (d := libllama_dir()) else None}
    try:
        from proxy.prompt.llama import llama_cpp  # noqa: F401  (loads libllama)

        lcp["importable"] = True
    except Exception as e:  # any import failure is something to report, not crash on
        lcp["error"] = f"{type(e).__name__}: {e}"
    return lcp


def _config(config_path: Path | None) -> tuple[Config | None, dict[str, Any]]:
    """The config (None: none loads, even without its demo model) and its report."""
    cfg: Config | None = None
    conf: dict[str, Any] = {"path": str(config_path.resolve()) if config_path else None,
                            "ok": True, "error": None, "proxy_port_free": None}
    try:
        cfg = load_config(config_path, check_port=False)
    except ConfigError as e:
        conf["ok"], conf["error"] = False, str(e)
        try:  # still report artifacts for a config whose only fault is a missing model
            cfg = load_config(config_path, check_port=False, allow_missing_demo=True)
        except ConfigError:
            cfg = None
    if cfg is not None:
        try:
            check_port_free(cfg)
            conf["proxy_port_free"] = True
        except ConfigError as e:
            conf["proxy_port_free"] = False
            conf["proxy_port_note"] = str(e)
        conf["proxy"] = {"host": cfg.proxy.host, "port": cfg.proxy.port,
                         "policy": cfg.proxy.policy}
    return cfg, conf


def _devices(cfg: Config, binary: str | None, entries: list[dict[str, Any]]) -> None:
    """Each managed backend's devices, checked against what the llama-server lists."""
    from backends.devices import list_devices, problem

    for b, entry in zip(cfg.backends, entries, strict=True):
        devices = getattr(b, "devices", ())
        if not devices:
            continue
        entry["devices"] = list(devices)
        entry["devices_error"] = ("no llama-server to ask" if binary is None
                                  else problem(devices, list_devices(Path(binary))))


def _mmprojs(cfg: Config, entries: list[dict[str, Any]]) -> None:
    """Each managed backend's projector (`mmproj:`) and LoRA adapters (`lora:`), and
    whether their files are there (the demo ones are built by prepare)."""
    for b, entry in zip(cfg.backends, entries, strict=True):
        mmproj = getattr(b, "mmproj", None)
        if mmproj is not None:
            entry["mmproj"], entry["mmproj_exists"] = str(mmproj), mmproj.is_file()
        loras: tuple[Path, ...] = getattr(b, "lora", ())
        if loras:
            entry["lora"] = [str(p) for p in loras]
            entry["lora_missing"] = [str(p) for p in loras if not p.is_file()]


def _server(cfg: Config | None) -> dict[str, Any]:
    """The llama-server binary the config runs: where, which version, how it was had."""
    from backends.binary import BinaryError, find_llama_server
    from backends.version import version_warning

    srv: dict[str, Any] = {"path": None, "version": None, "source": None, "error": None,
                           "version_warning": None}
    try:
        found = find_llama_server(cfg.llama_server if cfg else None)
        if found is None:
            srv["error"] = "not found (fix: run `python -m backends prepare`)"
        else:
            srv.update(path=str(found.path), version=found.version, source=found.source,
                       version_warning=version_warning(found.path, found.version))
    except BinaryError as e:
        srv["error"] = str(e)
    return srv


def _recipe_of(path: str | None) -> str | None:
    """What the llama-server at ``path`` was built from: the cache's recipe for the build
    kvroute made, wherever it is named from (a cached native build for another CPU is
    not found, and its recipe says for which); a portable build copied elsewhere (the
    container's) by its CPU variants beside it; else unknown (None)."""
    from backends.binary import BinaryError, cached_binary_path, cached_recipe
    from backends.cpu import PORTABLE

    try:
        if path in (None, str(cached_binary_path())):
            return cached_recipe()
    except BinaryError:  # $KVROUTE_GPU names no variant: said under llama_server
        return None
    if path is not None and any(Path(path).parent.glob("libggml-cpu-*.so")):
        return f"cpu={PORTABLE}"
    return None


def _tokens(cfg: Config) -> dict[str, Any]:
    """Where prompt ids come from: a local GGUF, or the backends (exact, one round trip
    more); and what a running `kvroute serve` found (its template check)."""
    from proxy.app import tokenizer_model

    found = tokenizer_model(cfg, tokenizer=cfg.tokenizer)
    out: dict[str, Any] = {"local_gguf": str(found[0]) if found else None, "serving": None}
    pools = cfg.pools()
    if len(pools) > 1:  # (the first is the one above)
        out["pools"] = {p.name: None if (g := tokenizer_model(cfg, p, cfg.tokenizer)) is None
                        else str(g[0]) for p in pools}
    try:
        import urllib.request

        url = f"http://{cfg.proxy.host}:{cfg.proxy.port}/kvroute/status"
        with urllib.request.urlopen(url, timeout=2) as r:
            out["serving"] = json.loads(r.read()).get("tokenizer")
    except (OSError, ValueError):
        pass  # not serving, or its status needs a key
    return out


def _print_crash_loop(c: dict[str, Any]) -> None:
    print(f"[BAD]   in a crash loop: {c['died']} ({c['deaths']} deaths within "
          f"{c['window_s']:g} s)")
    print(f"        likely fix: {c['fix']}")
    print(f"        model: {c['model']}")
    print(f"        command: {c['command']}")
    print(f"        last lines of {c['log']}:")
    for line in c["log_tail"][-10:]:
        print(f"          {line}")


def print_report(r: dict[str, Any]) -> None:
    def mark(ok: object) -> str:
        return "ok " if ok else "BAD"

    srv, model, conf, lcp = r["llama_server"], r["demo_model"], r["config"], r["llama_cpp_python"]
    print(f"[{mark(not srv['error'])}] llama-server: {srv['path'] or srv['error']}"
          + (f"  ({srv['version']}, {srv['source']})" if srv["path"] else ""))
    if srv.get("version_warning"):
        print(f"[!! ] {srv['version_warning']}")
    cpu = r["cpu"]
    print(f"[{mark(cpu['matches'] is not False)}] llama-server build: {cpu['build']}"
          + ("" if cpu["matches"] is not False else
             f", for {','.join(cpu['built_for'])} (fix: python -m backends prepare)"))
    print(f"      CPU: {', '.join(cpu['features']) or 'none of the x86 kernel features'}")
    print(f"[{mark(lcp['importable'])}] llama-cpp-python {lcp['version']}"
          + (f" (libllama in {lcp['libllama']})" if lcp["libllama"] else "")
          + (f": {lcp['error']}" if lcp["error"] else ""))
    print(f"[{mark(model['exists'])}] demo model: {model['path']}"
          + ("" if model["exists"] else "  (missing: run `python -m backends prepare`)"))
    print(f"[{mark(conf['ok'])}] config: {conf['path'] or 'built-in defaults'}"
          + (f": {conf['error']}" if conf["error"] else ""))
    if conf.get("proxy_port_free") is False:
        print(f"      note: {conf['proxy_port_note']}")
    for b in r["backends"]:
        kind = "managed" if b["managed"] else "external"
        # a managed backend that is not running is normal when kvroute is not serving
        m = "-- " if b["managed"] and b["url"] is None else mark(b["healthy"])
        print(f"[{m}] backend {b['name']} ({kind}) "
              f"{b['url'] or ''} {b['detail']}")
        if b.get("devices"):
            print(f"[{mark(not b['devices_error'])}]   devices {', '.join(map(str, b['devices']))}"
                  + (f": {b['devices_error']}" if b["devices_error"] else ""))
        if b.get("mmproj"):
            print(f"[{mark(b['mmproj_exists'])}]   mmproj {b['mmproj']}" + (
                "" if b["mmproj_exists"] else "  (missing: run `python -m backends prepare`)"))
        for path in b.get("lora") or ():
            ok = path not in b["lora_missing"]
            print(f"[{mark(ok)}]   lora {path}" + (
                "" if ok else "  (missing: run `python -m backends prepare`)"))
        if b.get("crash_loop"):
            _print_crash_loop(b["crash_loop"])
    tok = r.get("tokens")
    if tok is not None:
        where = (f"local ({tok['local_gguf']})" if tok["local_gguf"] else
                 "from the backends (no local GGUF: set proxy.tokenizer to save a round trip)")
        print(f"[ok ] prompt ids: {where}"
              + (f"; the running proxy: {tok['serving']}" if tok["serving"] else ""))
        for name, gguf in (tok.get("pools") or {}).items():
            print(f"      pool {name or '(unnamed)'}: "
                  f"{f'local ({gguf})' if gguf else 'from its backends'}")
    print(f"cache: {r['cache_dir']}")
    print("all good" if r["ok"] else "problems found (see BAD lines)")
