"""`kvroute serve`, `kvroute agent` and `kvroute doctor`.

serve: load and check the config, bind host:port (held from here on), obtain llama-server
and the demo model if needed (seconds when cached), start the supervisor, then the proxy
app listening on host:port. SIGINT or SIGTERM stops the app, then every backend.

agent: the llama-servers of one host, for routers on other hosts (backends/agent.py):
the same set-up as serve for them, then the agent's routes until SIGINT or SIGTERM.

doctor: what a user runs when something is wrong (proxy/doctor.py); `--json` prints its
stable document.

serve and agent lock the directories they write (proxy/instance.py) before anything else.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import sys
from dataclasses import replace
from pathlib import Path

from backends.binary import LlamaServerBinary
from backends.config import AgentConfig
from proxy.config.fields import ConfigError
from proxy.config.load import Config, claim_port, load_config, to_listen
from proxy.instance import Instance
from proxy.routing.policies import describe


def _default_config_path(given: Path | None) -> Path | None:
    if given is not None:
        return given
    return Path("config.yaml") if Path("config.yaml").is_file() else None


def _prepare_artifacts(cfg: Config | AgentConfig) -> None:
    """Obtain what the managed backends need; builds only on first use."""
    from backends.binary import ensure_llama_server
    from backends.demo_audio import ensure_if_used as ensure_audio_if_used
    from backends.demo_lora import ensure_if_used as ensure_loras_if_used
    from backends.demo_mmproj import ensure_if_used
    from backends.demo_model import demo_kinds_for, ensure_demo_model
    from backends.libllama import ensure_libllama

    if cfg.managed():
        _warn_on_version(ensure_llama_server(cfg.llama_server))
    if isinstance(cfg, Config):  # the tokenizer's, unless llama-cpp-python compiled one
        ensure_libllama()
    demos = [b.model for b in cfg.managed() if b.is_demo]
    for kind in demo_kinds_for(cfg.demo_model, demos):  # demo, demo-swa, demo-hybrid
        ensure_demo_model(cfg.demo_model, kind=kind)
    mmprojs = [b.mmproj for b in cfg.managed()]
    ensure_if_used(cfg.demo_model, mmprojs)  # `mmproj: demo`
    ensure_audio_if_used(cfg.demo_model, mmprojs)  # `mmproj: demo-audio`
    ensure_loras_if_used(cfg.demo_model, (p for b in cfg.managed() for p in b.lora))


def _warn_on_version(binary: LlamaServerBinary) -> None:
    """A llama-server of another llama.cpp than the tokenizer's may cache other prompt
    ids than kvroute routes by: said at start, not fatal (it may well work)."""
    from backends.version import version_warning
    from proxy.observability.logging import get_logger

    warning = version_warning(binary.path, binary.version)
    if warning:
        get_logger("kvroute.cli").warning("llama_server.version_mismatch",
                                          source=binary.source, detail=warning)


async def _serve(cfg: Config, sockets: list[socket.socket]) -> int:
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
        to_listen(sockets)  # bound since the start: nothing else took the port
        try:
            for sock in sockets:
                await web.SockSite(runner, sock).start()
        except OSError as e:
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
        cfg = load_config(_default_config_path(args.config), check_port=False,
                          allow_missing_demo=True, overrides=overrides)
        instance = _claim(cfg)  # before anything is built, started or written
    except (ConfigError, OSError) as e:
        print(f"kvroute: {e}", file=sys.stderr)
        return 2
    try:
        sockets = claim_port(cfg)  # held until the proxy listens on them
    except ConfigError as e:
        instance.release()
        print(f"kvroute: {e}", file=sys.stderr)
        return 2
    try:
        return _serve_claimed(args, cfg, sockets)
    finally:
        for sock in sockets:
            sock.close()
        instance.release()


def _claim(cfg: Config) -> Instance:
    """This instance's directories, locked (proxy/instance.py)."""
    from proxy.disk.tier import directories

    if cfg.kv_disk is None:
        return Instance(cfg.log_dir, ())
    return Instance(cfg.log_dir, directories(cfg.kv_disk, cfg.backends), cfg.kv_disk.path)


def _serve_claimed(args: argparse.Namespace, cfg: Config,
                   sockets: list[socket.socket]) -> int:
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
    return asyncio.run(_serve(cfg, sockets))


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


def cmd_doctor(args: argparse.Namespace) -> int:
    from proxy.doctor import print_report
    from proxy.doctor import report as doctor_report

    report = doctor_report(_default_config_path(args.config))
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        print_report(report)
    return 0 if report["ok"] else 1


def cmd_init(args: argparse.Namespace) -> int:
    from backends.binary import BinaryError, find_llama_server
    from backends.detect import NotAModel, machine, model_facts
    from backends.init_plan import DoesNotFit, plan, render

    out: Path = args.out
    if out.exists() and not args.force:
        print(f"kvroute init: {out} exists (fix: --out another path, or --force)",
              file=sys.stderr)
        return 2
    try:
        found = find_llama_server(args.llama_server)
        facts = model_facts(args.model)
        p = plan(facts, machine(found.path if found else None))
    except (BinaryError, NotAModel, DoesNotFit) as e:
        print(f"kvroute init: {e}", file=sys.stderr)
        return 2
    for line in p.why:
        print(line, file=sys.stderr)
    out.write_text(render(p, facts, args.alias))
    print(f"wrote {out}: {len(p.backends)} backend(s); run `kvroute serve --config {out}`",
          file=sys.stderr)
    return 0


_CONFIG_HELP = "config file (default: ./config.yaml, else the built-in one)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvroute", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="start the backends and the proxy",
                       description="Exit status 2: the config is invalid, llama-server "
                       "or the demo model cannot be had, the port is taken, or another "
                       "kvroute holds its log_dir or a disk tier directory (kvroute.lock).")
    s.add_argument("--config", type=Path, help=_CONFIG_HELP)
    s.add_argument("--host", help="proxy host (overrides proxy.host)")
    s.add_argument("--port", type=int, help="proxy port (overrides proxy.port)")
    s.add_argument("--policy", help=describe())
    s.add_argument("--log-level", default="info", help="debug | info | warning | error")
    s.add_argument("--log-prompts", action="store_true",
                   help="also log request bodies (prompts) at debug level; never API keys")
    s.set_defaults(func=cmd_serve)
    a = sub.add_parser("agent", help="run this host's backends for routers elsewhere",
                       description="Exit status 2: the file is invalid, llama-server "
                       "or the demo model cannot be had, the port is taken, or another "
                       "kvroute holds its log_dir (kvroute.lock).")
    a.add_argument("--config", type=Path, required=True,
                   help="the agent's file (e.g. docs/examples/agent.yaml)")
    a.add_argument("--log-level", default="info", help="debug | info | warning | error")
    a.set_defaults(func=cmd_agent)
    d = sub.add_parser("doctor", help="check the installation, config and backends",
                       description="Exit status 1: something is broken (BAD lines).")
    d.add_argument("--config", type=Path, help=_CONFIG_HELP)
    d.add_argument("--json", action="store_true", help="stable JSON output for scripts")
    d.set_defaults(func=cmd_doctor)
    i = sub.add_parser("init", help="write a config for this machine's devices and a model",
                       description="Exit status 2: the model is not a GGUF file, it does "
                       "not fit, or the output exists.")
    i.add_argument("model", type=Path, help="the model's .gguf file")
    i.add_argument("--out", type=Path, default=Path("config.yaml"),
                   help="where to write it (default: ./config.yaml)")
    i.add_argument("--force", action="store_true", help="overwrite --out")
    i.add_argument("--alias", help="the model name clients send (default: the file's name)")
    i.add_argument("--llama-server", help="the build whose devices count when nvidia-smi "
                   "finds no GPU (default: the one `kvroute serve` runs)")
    i.set_defaults(func=cmd_init)
    args = ap.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
