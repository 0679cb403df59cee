"""`kvroute serve`, `kvroute agent` and `kvroute doctor`.

serve: load and check the config, obtain llama-server and the demo model if needed
(seconds when cached), start the supervisor, then the proxy app on host:port. SIGINT or
SIGTERM stops the app, then every backend.

agent: the llama-servers of one host, for routers on other hosts (backends/agent.py):
the same set-up as serve for them, then the agent's routes until SIGINT or SIGTERM.

doctor: what a user runs when something is wrong. `--json` prints a stable document
(keys are only ever added) that scripts use to find the built artifacts:
``llama_server.path``, ``demo_model.path``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import platform
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from backends.binary import LlamaServerBinary
from backends.config import AgentConfig
from proxy.config.fields import ConfigError
from proxy.config.load import Config, check_port_free, load_config
from proxy.instance import Instance


def _default_config_path(given: Path | None) -> Path | None:
    if given is not None:
        return given
    return Path("config.yaml") if Path("config.yaml").is_file() else None


def _prepare_artifacts(cfg: Config | AgentConfig) -> None:
    """Obtain what the managed backends need; builds only on first use."""
    from backends.binary import ensure_libllama, ensure_llama_server
    from backends.demo_model import demo_kinds_for, ensure_demo_model

    if cfg.managed():
        _warn_on_version(ensure_llama_server(cfg.llama_server))
    if isinstance(cfg, Config):  # the tokenizer's, unless llama-cpp-python compiled one
        ensure_libllama()
    demos = [b.model for b in cfg.managed() if b.is_demo]
    for kind in demo_kinds_for(cfg.demo_model, demos):  # demo, demo-swa, demo-hybrid
        ensure_demo_model(cfg.demo_model, kind=kind)


def _warn_on_version(binary: LlamaServerBinary) -> None:
    """A llama-server of another llama.cpp than the tokenizer's may cache other prompt
    ids than kvroute routes by: said at start, not fatal (it may well work)."""
    from backends.version import version_warning
    from proxy.observability.logging import get_logger

    warning = version_warning(binary.path, binary.version)
    if warning:
        get_logger("kvroute.cli").warning("llama_server.version_mismatch",
                                          source=binary.source, detail=warning)


async def _serve(cfg: Config) -> int:
    from aiohttp import web

    from backends.supervisor import Supervisor
    from proxy.app import create_app
    from proxy.observability.logging import get_logger
    from proxy.server.runner import make_runner

    log = get_logger("kvroute.cli")
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    supervisor = Supervisor(cfg)
    runner: web.AppRunner | None = None
    try:
        # a signal during the (up to minutes long) start must still stop everything
        starting = asyncio.create_task(supervisor.start())
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            starting.cancel()
            return 0
        stopped.cancel()
        n_ready, n_all = len(supervisor.ready()), len(supervisor.statuses())
        if n_ready == 0:
            log.warning("serve.no_backend_ready", statuses=supervisor.statuses())
        runner = make_runner(create_app(cfg, supervisor))
        try:
            await runner.setup()
        except ConfigError as e:  # (a disk tier directory it cannot read)
            print(f"kvroute: {e}", file=sys.stderr)
            return 2
        try:
            await web.TCPSite(runner, cfg.proxy.host, cfg.proxy.port).start()
        except OSError as e:  # taken since load_config checked it
            print(f"kvroute: proxy.port: cannot listen on {cfg.proxy.host}:{cfg.proxy.port}: "
                  f"{e.strerror} (fix: pick another port with --port)", file=sys.stderr)
            return 2
        url = f"http://{cfg.proxy.host}:{cfg.proxy.port}"
        ctx = sorted({b.slot_ctx for b in supervisor.ready()})
        log.info("serve.listening", url=url, policy=cfg.proxy.policy, ready=n_ready,
                 backends=n_all, slot_tokens=ctx)
        held = ("" if not ctx else f", a slot holds {ctx[0]:,} tokens" if len(ctx) == 1
                else f", a slot holds {ctx[0]:,} to {ctx[-1]:,} tokens")
        print(f"kvroute: listening on {url} ({n_ready}/{n_all} backends ready{held}, "
              f"policy {cfg.proxy.policy}); status page {url}/; Ctrl-C stops",
              file=sys.stderr, flush=True)
        await stop.wait()
        log.info("serve.stopping")
        return 0
    finally:
        if runner is not None:
            await runner.cleanup()
        await supervisor.stop()


def cmd_serve(args: argparse.Namespace) -> int:
    from proxy.observability.logging import configure_logging

    configure_logging(args.log_level)
    overrides = {"host": args.host, "port": args.port, "policy": args.policy}
    try:
        cfg = load_config(_default_config_path(args.config), allow_missing_demo=True,
                          overrides=overrides)
        instance = _claim(cfg)  # before anything is built, started or written
    except (ConfigError, OSError) as e:
        print(f"kvroute: {e}", file=sys.stderr)
        return 2
    try:
        return _serve_claimed(args, cfg)
    finally:
        instance.release()


def _claim(cfg: Config) -> Instance:
    """This instance's directories, locked (proxy/instance.py)."""
    from proxy.forwarding.slot_tier import directories

    if cfg.kv_disk is None:
        return Instance(cfg.log_dir, ())
    return Instance(cfg.log_dir, directories(cfg.kv_disk, cfg.backends), cfg.kv_disk.path)


def _serve_claimed(args: argparse.Namespace, cfg: Config) -> int:
    from proxy.observability.logging import configure_logging

    try:
        _prepare_artifacts(cfg)
    except (ConfigError, RuntimeError, OSError) as e:  # BinaryError is a RuntimeError
        print(f"kvroute: {e}", file=sys.stderr)
        return 2
    if args.log_prompts:
        settings = replace(cfg.proxy.settings, log_prompts=True)
        cfg = replace(cfg, proxy=replace(cfg.proxy, settings=settings))
    # prompts reach the log only when asked for explicitly (flag or proxy.log_prompts)
    configure_logging(args.log_level, log_prompts=cfg.proxy.settings.log_prompts)
    return asyncio.run(_serve(cfg))


def cmd_agent(args: argparse.Namespace) -> int:
    from proxy.config.agent_file import load_agent_config
    from proxy.observability.logging import configure_logging

    configure_logging(args.log_level)
    try:
        cfg = load_agent_config(args.config, allow_missing_demo=True)
        instance = Instance(cfg.log_dir, ())  # (its backends.json and logs)
    except (ConfigError, OSError) as e:
        print(f"kvroute: {e}", file=sys.stderr)
        return 2
    try:
        try:
            _prepare_artifacts(cfg)
        except (ConfigError, RuntimeError, OSError) as e:  # (a BinaryError too)
            print(f"kvroute: {e}", file=sys.stderr)
            return 2
        return asyncio.run(_agent(cfg))
    finally:
        instance.release()


async def _agent(cfg: AgentConfig) -> int:
    from backends.agent import run_agent

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    a = cfg.agent
    print(f"kvroute agent: listening on http://{a.host}:{a.port}, backends advertised at "
          f"{a.advertise}; Ctrl-C stops", file=sys.stderr, flush=True)
    return await run_agent(cfg, stop)


# -- doctor ---------------------------------------------------------------------------


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
    from backends.config import OPENAI

    async with aiohttp.ClientSession() as session:
        client = BackendClient(session, url, api_key, timeout=3.0)
        if kind == OPENAI:
            models = await client.models()
            if isinstance(models, list):
                return True, f"/v1/models: {', '.join(models[:3])}"
            return False, getattr(models, "reason", None) or f"/v1/models: {models}"
        h = await client.health()
    if isinstance(h, Health):
        return h.ok, f"/health {h.status}"
    return False, h.reason


def _backend_health(cfg: Config) -> list[dict[str, Any]]:
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


def doctor_report(config_path: Path | None) -> dict[str, Any]:
    from backends.binary import (
        BinaryError,
        cache_dir,
        find_llama_server,
        libllama_dir,
    )
    from backends.binary import llama_cpp_python_version as lcp_version
    from backends.cpu import build_report
    from backends.demo_model import DemoModelParams, demo_model_path
    from backends.version import version_warning

    report: dict[str, Any] = {"ok": True, "python": platform.python_version()}
    try:
        report["kvroute_version"] = importlib.metadata.version("kvroute")
    except importlib.metadata.PackageNotFoundError:
        report["kvroute_version"] = None
    lcp: dict[str, Any] = {"version": lcp_version(), "importable": False, "error": None,
                           "libllama": str(d) if (d := libllama_dir()) else None}
    try:
        from proxy.prompt.llama import llama_cpp  # noqa: F401  (loads libllama)

        lcp["importable"] = True
    except Exception as e:  # any import failure is something to report, not crash on
        lcp["error"] = f"{type(e).__name__}: {e}"
        report["ok"] = False
    report["llama_cpp_python"] = lcp
    report["cache_dir"] = str(cache_dir())

    cfg: Config | None = None
    conf: dict[str, Any] = {"path": str(config_path.resolve()) if config_path else None,
                            "ok": True, "error": None, "proxy_port_free": None}
    try:
        cfg = load_config(config_path, check_port=False)
    except ConfigError as e:
        conf["ok"], conf["error"] = False, str(e)
        report["ok"] = False
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
    report["config"] = conf

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
    if srv["error"]:
        report["ok"] = False
    report["llama_server"] = srv
    report["cpu"] = build_report(_recipe_of(srv["path"]))

    params = cfg.demo_model if cfg else DemoModelParams()
    model = demo_model_path(params)
    report["demo_model"] = {"path": str(model), "exists": model.is_file(),
                            "kv_bytes_per_token": params.kv_bytes_per_token}
    if cfg is not None and any(b.is_demo for b in cfg.managed()) and not model.is_file():
        report["ok"] = False
    report["backends"] = _backend_health(cfg) if cfg else []
    if any(b.get("crash_loop") for b in report["backends"]):
        report["ok"] = False
    # the tokenizer needs libllama: without it, said under llama_cpp_python
    if cfg is not None and lcp["importable"]:
        report["tokens"] = _tokens(cfg)
    return report


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


def _print_report(r: dict[str, Any]) -> None:
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


def cmd_doctor(args: argparse.Namespace) -> int:
    report = doctor_report(_default_config_path(args.config))
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        _print_report(report)
    return 0 if report["ok"] else 1


_CONFIG_HELP = "config file (default: ./config.yaml, else the built-in one)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvroute", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="start the backends and the proxy",
                       description="Exit status 2: the config is invalid, llama-server "
                       "or the demo model cannot be had, or the port or a disk tier "
                       "directory (kvroute.lock) is taken.")
    s.add_argument("--config", type=Path, help=_CONFIG_HELP)
    s.add_argument("--host", help="proxy host (overrides proxy.host)")
    s.add_argument("--port", type=int, help="proxy port (overrides proxy.port)")
    s.add_argument("--policy", help="prefix | round_robin | least_loaded | random")
    s.add_argument("--log-level", default="info", help="debug | info | warning | error")
    s.add_argument("--log-prompts", action="store_true",
                   help="also log request bodies (prompts) at debug level; never API keys")
    s.set_defaults(func=cmd_serve)
    a = sub.add_parser("agent", help="run this host's backends for routers elsewhere",
                       description="Exit status 2: the file is invalid, llama-server "
                       "or the demo model cannot be had, or the port is taken.")
    a.add_argument("--config", type=Path, required=True,
                   help="the agent's file (e.g. docs/examples/agent.yaml)")
    a.add_argument("--log-level", default="info", help="debug | info | warning | error")
    a.set_defaults(func=cmd_agent)
    d = sub.add_parser("doctor", help="check the installation, config and backends",
                       description="Exit status 1: something is broken (BAD lines).")
    d.add_argument("--config", type=Path, help=_CONFIG_HELP)
    d.add_argument("--json", action="store_true", help="stable JSON output for scripts")
    d.set_defaults(func=cmd_doctor)
    args = ap.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
