"""`python -m loadtest run`: the same seeded workload against several policies.

Each policy gets fresh backends (empty caches): `kvroute serve` as a subprocess on a
generated config (loadtest/launch.py; it stops its llama-servers). `direct` is the
no-proxy baseline: one llama-server (same slots and threads) started in-process by the
Supervisor. A peer router (``smg:<policy>``) and, with ``--external``, kvroute get fresh
llama-servers of the runner's as external backends (loadtest/fleet.py). `--target`
measures any OpenAI-compatible URL (e.g. another router) on the same workload instead.
With `--rates` the whole comparison is repeated per arrival rate: a sweep, whose TTFT
percentiles per rate show where each policy's knee is.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from backends.demo_model import DEMO, DEMO_KINDS
from loadtest import workloads as wl
from loadtest.bounds import Bounds
from loadtest.client import LoadClient, check_loopback
from loadtest.fleet import (
    PEERS,
    Cluster,
    busy_loops,
    external_config,
    find_smg,
    fresh_servers,
    policy_variant,
    smg_router,
    split_policies,
    split_router,
)
from loadtest.launch import (
    direct_backend,
    kvroute_serve,
    scrape_metrics,
    scrape_servers,
    write_config,
)
from loadtest.report import PolicyRun
from loadtest.trace import TRACES
from proxy.routing.policies import POLICIES

DEFAULT_POLICIES = "prefix,round_robin,least_loaded,direct"


class Bar:
    """One stderr line per run, rewritten in place (no dependency)."""

    def __init__(self, label: str) -> None:
        self.label, self.t0, self.tty = label, time.monotonic(), sys.stderr.isatty()
        self._last = -1.0
        self._finished = False

    def __call__(self, done: int, total: int, errors: int) -> None:
        now = time.monotonic()
        if self._finished or (done < total and now - self._last < (0.2 if self.tty else 10.0)):
            return
        self._last, self._finished = now, done >= total
        width = 24
        fill = int(width * done / total) if total else width
        line = (f"[{self.label}] |{'#' * fill}{'.' * (width - fill)}| {done}/{total} "
                f"requests, {errors} errors, {now - self.t0:.0f} s")
        end = "\n" if done >= total or not self.tty else ""
        print(("\r" if self.tty else "") + line, end=end, file=sys.stderr, flush=True)


def build_workload(args: argparse.Namespace, rate: float | None = None) -> wl.Workload:
    if args.workload == "agentic":
        return wl.agentic(sessions=args.sessions, turns=args.turns,
                          prefix_tokens=args.prefix_tokens, context_tokens=args.context_tokens,
                          tool_tokens=args.tool_tokens, max_tokens=args.max_tokens,
                          think_s=args.think, session_rate=rate or args.rate,
                          side_calls=not args.no_side_calls, api=args.api or "openai",
                          seed=args.seed)
    if args.workload == "shared-prefix":
        return wl.shared_prefix(groups=args.groups, prompts=args.prompts,
                                system_tokens=args.system_tokens,
                                question_tokens=args.question_tokens,
                                max_tokens=args.max_tokens, rate=rate or args.rate,
                                api=args.api or "openai", seed=args.seed)
    if args.workload == "chat-trace":
        return wl.chat_trace(path=args.trace, requests=args.requests, rate=rate or args.rate,
                             block=args.block, max_tokens=args.max_tokens, seed=args.seed)
    return wl.trace(path=args.trace, requests=args.requests, rate=rate or args.rate,
                    block=args.block, max_tokens=args.max_tokens, api=args.api or "llama",
                    seed=args.seed)


def needed_ctx(workload: wl.Workload, max_tokens: int) -> int:
    """Per-slot context for the largest prompt, rounded up to 1024 (at least 4096)."""
    top = max((r.approx_prompt_tokens for r in workload.requests()), default=0)
    need = int(top * 1.1) + max_tokens + 256  # template tokens the estimate leaves out
    return max(4096, -(-need // 1024) * 1024)


async def run_one(policy: str, workload: wl.Workload, cluster: Cluster, work_dir: Path,
                  args: argparse.Namespace, rate: float | None) -> PolicyRun:
    tag = policy + (f"-r{rate:g}" if rate is not None else "")
    client_kw = dict(max_requests=args.max_requests, time_limit_s=args.time_limit,
                     request_timeout_s=args.request_timeout, progress=Bar(tag),
                     ignore_eos=not args.no_ignore_eos)
    t0 = time.monotonic()
    if policy == "target":
        client = LoadClient(args.target, args.target_key, **client_kw)
        outcome = await client.run(workload)
        return PolicyRun(policy, rate, outcome, await scrape_metrics(client.base))
    if policy == "direct":
        cfg = write_config(work_dir / f"{tag}.yaml", cluster, 1, "round_robin")
        async with direct_backend(cfg, cluster.startup_timeout_s) as (url, key):
            started = time.monotonic() - t0
            outcome = await LoadClient(url, key, label="direct", **client_kw).run(workload)
        return PolicyRun(policy, rate, outcome, {}, started)
    peer, pol = split_router(policy)
    tag = re.sub(r"[^\w.-]+", "-", tag).strip("-")

    async def through_kvroute(cfg: Path) -> PolicyRun:
        async with kvroute_serve(cfg, policy_variant(pol)[0], cluster.backends,
                                 cluster.startup_timeout_s, args.serve_log_level) as url:
            started = time.monotonic() - t0
            outcome = await LoadClient(url, **client_kw).run(workload)
            metrics = await scrape_metrics(url)
        return PolicyRun(policy, rate, outcome, metrics, started)

    if peer == "kvroute" and not args.external:
        return await through_kvroute(write_config(work_dir / f"{tag}.yaml", cluster,
                                                  cluster.backends, pol))
    async with fresh_servers(cluster, work_dir / "logs" / tag) as urls:
        if peer == "kvroute":
            run = await through_kvroute(external_config(work_dir / f"{tag}.yaml", cluster,
                                                        urls, pol))
        else:
            async with smg_router(find_smg(args.smg), urls, pol,
                                  work_dir / f"{tag}.smg.log") as url:
                started = time.monotonic() - t0
                outcome = await LoadClient(url, **client_kw).run(workload)
            run = PolicyRun(policy, rate, outcome, {}, started)
        run.servers = await scrape_servers(urls)
        return run


async def run_all(args: argparse.Namespace,
                  on_run: Callable[[list[PolicyRun]], None] | None = None) -> list[PolicyRun]:
    """Every (rate, policy) run in order; ``on_run(runs so far)`` after each one."""
    # SIGTERM (e.g. `timeout`) cancels us, so the context managers stop what we started
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    if task is not None:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGTERM, task.cancel)
    policies = ["target"] if args.target else split_policies(args.policies)
    for p in policies:
        peer, _ = split_router(p)
        if policy_variant(p)[0] not in (*POLICIES, "direct", "target") and peer not in PEERS:
            raise ValueError(f"unknown policy {p!r}: {DEFAULT_POLICIES},random,"
                             "smg:<smg policy>, or one with settings: prefix[key=value,...]")
    rates: list[float | None] = ([float(x) for x in args.rates.split(",")] if args.rates
                                 else [None])
    work_dir = Path(args.out) / "runs"
    runs: list[PolicyRun] = []
    with busy_loops(args.contend):
        for rate in rates:
            runs += await _at_rate(args, rate, policies, work_dir, runs, on_run)
    return runs


async def _at_rate(args: argparse.Namespace, rate: float | None, policies: list[str],
                   work_dir: Path, done: list[PolicyRun],
                   on_run: Callable[[list[PolicyRun]], None] | None) -> list[PolicyRun]:
    """Every policy's run at one rate (``done``: the runs before, for ``on_run``)."""
    runs: list[PolicyRun] = []
    workload = build_workload(args, rate)
    cluster = Cluster(backends=args.backends, slots=args.slots, threads=args.threads,
                      ctx_per_slot=args.ctx or needed_ctx(workload, args.max_tokens),
                      cache_ram_mib=args.cache_ram_mib, kv_disk=args.kv_disk,
                      model=args.model, devices=_devices(args.devices, args.backends))
    for p in policies:
        runs.append(await run_one(p, workload, cluster, work_dir, args, rate))
        if on_run is not None:
            on_run([*done, *runs])
    return runs


def add_arguments(p: argparse.ArgumentParser, default_trace: str) -> None:
    a = p.add_argument
    a("--workload", choices=wl.WORKLOADS, default="agentic")
    a("--policies", default=DEFAULT_POLICIES,
      help="comma-separated; direct = 1 backend; a kvroute policy may carry routing "
           "settings: 'prefix,prefix[wait_starve_s=0]'")
    a("--target", help="measure this OpenAI-compatible loopback URL instead")
    a("--target-key", help="API key for --target")
    a("--external", action="store_true",
      help="kvroute runs get fresh llama-servers of the runner's as url: backends")
    a("--smg", help="smg binary for smg:<policy> runs (default: smg on PATH)")
    a("--out", default="loadtest-out", help="report directory")
    a("--rates", help="comma-separated arrival rates (/s): a sweep")
    a("--rate", type=float, default=0.5, help="arrivals/s (agentic: session starts)")
    a("--seed", type=int, default=0)
    a("--api", choices=wl.APIS, help="request format (default openai; trace: llama)")
    a("--max-tokens", type=int, default=16, help="output tokens per request")
    a("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    g = p.add_argument_group("agentic")
    g.add_argument("--sessions", type=int, default=4)
    g.add_argument("--turns", type=int, default=4)
    g.add_argument("--prefix-tokens", type=int, default=6000)
    g.add_argument("--context-tokens", type=int, default=1000)
    g.add_argument("--tool-tokens", type=int, default=300)
    g.add_argument("--think", type=float, default=1.0, help="mean think time (s)")
    g.add_argument("--no-side-calls", action="store_true")
    g = p.add_argument_group("shared-prefix")
    g.add_argument("--groups", type=int, default=4)
    g.add_argument("--prompts", type=int, default=8)
    g.add_argument("--system-tokens", type=int, default=2000)
    g.add_argument("--question-tokens", type=int, default=100)
    g = p.add_argument_group("trace")
    g.add_argument("--trace", default=default_trace,
                   help=f"Mooncake JSONL trace (.xz too), or a kept one: {', '.join(TRACES)}")
    g.add_argument("--requests", type=int, default=100)
    g.add_argument("--block", type=int, default=32, help="tokens per hash id (trace: 512)")
    g = p.add_argument_group("cluster and bounds")
    g.add_argument("--backends", type=int, default=2)
    g.add_argument("--slots", type=int, default=2)
    g.add_argument("--threads", type=int, default=1)
    g.add_argument("--ctx", type=int, default=0, help="per slot (default: fits the workload)")
    g.add_argument("--cache-ram-mib", type=int, default=1024)
    g.add_argument("--model", choices=sorted(DEMO_KINDS), default=DEMO,
                   help="demo model: plain attention, sliding window, or hybrid")
    g.add_argument("--kv-disk", action="store_true",
                   help="managed backends save idle slots to disk (kv_disk) and restore them")
    g.add_argument("--devices", default="",
                   help="one per backend, comma-separated: CUDA indices (0,1) or names "
                   "from `llama-server --list-devices` (Vulkan0,Vulkan1); every layer "
                   "is offloaded there (-ngl all)")
    g.add_argument("--max-requests", type=int, default=500, help="per policy run")
    g.add_argument("--time-limit", type=float, default=300.0, help="s per policy run")
    g.add_argument("--contend", type=int, default=0, metavar="N",
                   help="N busy-loop processes for the whole run (the machine kept busy)")
    g.add_argument("--request-timeout", type=float, default=120.0)
    g.add_argument("--serve-log-level", default="info",
                   choices=["debug", "info", "warning", "error"],
                   help="kvroute's log in <out>/runs/<policy>.serve.log (debug: reasons)")


def fleet_estimate(workload: wl.Workload, runs: list[PolicyRun],
                   args: argparse.Namespace) -> Bounds | None:
    """The trace's estimates on the fleet each run started (none for --target, nor with
    the disk tier, which they leave out)."""
    if not workload.blocks or not runs or args.target or args.kv_disk:
        return None
    from backends.demo_model import ensure_demo_model
    from backends.memory import gguf_kv_bytes_per_token
    from loadtest.bounds import run_estimate
    from proxy.routing.cache.values import BackendCapacity

    ctx = args.ctx or needed_ctx(workload, args.max_tokens)
    kv = gguf_kv_bytes_per_token(ensure_demo_model(kind=args.model))
    if kv is None:
        return None
    cap = BackendCapacity("bound", args.slots, ctx, args.cache_ram_mib << 20, kv)
    ram_tokens = args.backends * cap.ram_cache_bytes * ctx / cap.entry_bytes(ctx)
    return run_estimate(workload.blocks, [(r.id, r.prompt_tokens) for r in runs[0].outcome.results],
                     slots=args.backends * args.slots, ram_tokens=ram_tokens)


def main_run(args: argparse.Namespace) -> int:
    from loadtest import report
    from proxy.observability.logging import configure_logging

    configure_logging("warning")  # the in-process `direct` Supervisor logs every state change
    if args.target:
        try:
            check_loopback(args.target)
        except ValueError as e:
            print(f"loadtest: {e}", file=sys.stderr)
            return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workload = build_workload(args)

    def partial(runs: list[PolicyRun]) -> None:
        # a long sweep that is interrupted still leaves the runs it finished
        report.write(out, runs, workload, vars(args), with_plots=False)

    try:
        runs = asyncio.run(run_all(args, partial))
    except (RuntimeError, ValueError, OSError) as e:
        print(f"loadtest: {e}", file=sys.stderr)
        return 1
    except (asyncio.CancelledError, KeyboardInterrupt):
        print(f"loadtest: interrupted; finished runs are in {out}/report.md", file=sys.stderr)
        return 130
    bounds = fleet_estimate(workload, runs, args)
    paths = report.write(out, runs, workload, vars(args), bounds=bounds)
    for path in paths:
        print(path)
    print(report.console_table(runs, workload.oracle_reuse, bounds), file=sys.stderr)
    return 0 if all(r.outcome.results for r in runs) else 1


def _devices(spec: str, backends: int) -> tuple[str | int, ...]:
    """``--devices``: one per backend (indices as ints: CUDA_VISIBLE_DEVICES)."""
    if not spec:
        return ()
    got = tuple(int(d) if d.isdigit() else d for d in spec.split(","))
    if len(got) != backends:
        raise SystemExit(f"--devices {spec}: {len(got)} device(s) for {backends} backends "
                         "(fix: one per backend, or --backends to match)")
    return got
