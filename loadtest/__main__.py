"""Command line: ``python -m loadtest simulate|run|soak|sweep ...``.

Each subcommand is one ``add_parser`` call plus one handler in ``_COMMANDS``; a new one is
added the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from loadtest.fleet import policy_variant, split_policies
from loadtest.trace import TRACES, TraceRequest
from proxy.routing.cache.checkpoints import Memory

if TYPE_CHECKING:
    from loadtest.simulate import SimBackend, SimResult

DEFAULT_TRACE = str(TRACES["synthetic"])
TRACE_HELP = f"Mooncake JSONL trace (.xz too), or a kept one: {', '.join(TRACES)}"


def _add_simulate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("simulate", help="discrete-event replay with the real router")
    p.add_argument("--trace", default=DEFAULT_TRACE, help=TRACE_HELP)
    p.add_argument("--limit", type=int, default=0, help="use only the first N requests")
    p.add_argument("--backends", type=int, default=4)
    p.add_argument(
        "--policies", default="prefix,round_robin,least_loaded,random",
        help="comma-separated; one may carry routing settings: prefix[wait_starve_s=0]"
    )
    p.add_argument("--slots", type=int, default=8, help="slots per backend")
    p.add_argument("--ram-tokens", type=int, default=4_000_000, help="RAM cache per backend")
    p.add_argument("--kv-bytes-per-token", type=int, default=131_072)
    p.add_argument("--prefill-tps", type=float, default=20_000.0, help="at a context's start")
    p.add_argument("--prefill-s-per-position", type=float, default=0.0,
                   help="a token's extra prefill seconds per token before it (attention)")
    p.add_argument("--decode-tps", type=float, default=40.0, help="per slot")
    p.add_argument("--time-scale", type=float, default=1.0, help=">1 replays faster")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--memory", choices=("dense", "swa", "hybrid"), default="dense",
                   help="the backends' memory: plain attention, a sliding window "
                        "(--swa-window), or recurrent layers (reuse up to checkpoints)")
    p.add_argument("--swa-window", type=int, default=256)
    p.add_argument(
        "--plan-p90",
        type=float,
        default=0.0,
        help="capacity planner: fewest backends whose p90 TTFT (s) meets this target",
    )
    p.add_argument("--max-backends", type=int, default=64)
    g = p.add_argument_group("chat-trace: the live runner's chat replay, tokenized")
    g.add_argument("--workload", choices=("trace", "chat-trace"), default="trace")
    g.add_argument("--requests", type=int, default=200, help="whole groups sampled")
    g.add_argument("--rate", type=float, default=2.0, help="mean arrivals/s")
    g.add_argument("--block", type=int, default=32, help="words per hash id")
    g.add_argument("--max-tokens", type=int, default=8)
    g.add_argument("--slot-ctx", type=int, default=262_144, help="tokens per slot")
    g.add_argument("--ram-mib", type=int, help="RAM cache per backend (overrides --ram-tokens)")
    g.add_argument("--gguf", help="model to tokenize with (default: the demo model)")


def _memory(kind: str, window: int) -> Memory:
    """The server's memory rules for ``kind`` at its default settings (ubatch 512)."""
    from backends.memory import swa_cells
    from proxy.routing.cache.checkpoints import DENSE

    if kind == "swa":
        return Memory(n_swa=window, swa_cells=swa_cells(window, 512, 1 << 30))
    return Memory(recurrent=True) if kind == "hybrid" else DENSE


def _simulate_one(spec: str, trace: Sequence[TraceRequest], be: SimBackend,
                  args: argparse.Namespace, prompts: Sequence[bytes] | None,
                  starts: Sequence[tuple[int, ...]] | None) -> SimResult:
    """One policy's replay; ``spec`` may carry routing settings (``policy_variant``)."""
    from loadtest.simulate import simulate
    from proxy.routing.settings import RouterSettings

    policy, routing = policy_variant(spec)
    settings = RouterSettings(**{"default_prefill_tps": be.prefill_tps, **routing})
    got = simulate(trace, policy, args.backends, be, settings=settings,
                   time_scale=args.time_scale, seed=args.seed, prompts=prompts,
                   user_starts=starts)
    return dataclasses.replace(got, policy=spec)


def _simulate(args: argparse.Namespace) -> int:
    from loadtest.bounds import oracle_hit_ratio
    from loadtest.capacity import plan_capacity
    from loadtest.simulate import SimBackend, format_table
    from loadtest.trace import load_mooncake

    prompts = starts = None
    if args.workload == "chat-trace":
        from backends.demo_model import ensure_demo_model
        from loadtest.simulate import chat_replay
        from loadtest.workloads import chat_trace

        w = chat_trace(path=args.trace, requests=args.requests, rate=args.rate,
                       block=args.block, max_tokens=args.max_tokens, seed=args.seed)
        trace, prompts, starts = chat_replay(w, Path(args.gguf) if args.gguf
                                             else ensure_demo_model())
        oracle = w.oracle_reuse or 0.0
    else:
        trace = load_mooncake(args.trace)
        if args.limit:
            trace = trace[: args.limit]
        oracle = oracle_hit_ratio(trace)
    ram_tokens = (args.ram_mib << 20) // args.kv_bytes_per_token if args.ram_mib is not None \
        else args.ram_tokens
    be = SimBackend(
        n_slots=args.slots,
        slot_ctx=args.slot_ctx,
        ram_cache_tokens=ram_tokens,
        kv_bytes_per_token=args.kv_bytes_per_token,
        prefill_tps=args.prefill_tps,
        prefill_s_per_position=args.prefill_s_per_position,
        decode_tps=args.decode_tps,
        memory=_memory(args.memory, args.swa_window),
    )
    if args.plan_p90 > 0:
        n, runs = plan_capacity(
            trace, args.plan_p90, be, max_backends=args.max_backends,
            time_scale=args.time_scale, prompts=prompts)
        for r in runs:
            print(f"{r.n_backends:3d} backends: p90 ttft {r.ttft_p90:.3f} s, hit {r.hit_ratio:.3f}")
        if n is None:
            print(f"target p90 {args.plan_p90} s not met with {args.max_backends} backends")
            return 1
        print(f"{n} backends meet p90 TTFT <= {args.plan_p90} s")
        return 0
    results = [_simulate_one(spec, trace, be, args, prompts, starts)
               for spec in split_policies(args.policies)]
    print(f"{len(trace)} requests, {args.backends} backends x {args.slots} slots")
    print(format_table(results, oracle))
    return 0


def _add_run(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from loadtest.runner import add_arguments

    p = sub.add_parser("run", help="live A/B of policies on fresh backends (--rates: a sweep)")
    add_arguments(p, DEFAULT_TRACE)


def _run(args: argparse.Namespace) -> int:
    from loadtest.runner import main_run

    return main_run(args)


def _add_soak(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from loadtest.soak import add_arguments

    add_arguments(sub.add_parser("soak", help="bounded agentic run with injected faults"))


def _soak(args: argparse.Namespace) -> int:
    from loadtest.soak import main_soak

    return main_soak(args)


def _add_sweep(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from loadtest.sweep import add_arguments

    add_arguments(sub.add_parser(
        "sweep", help="the smg matrix simulated over many seeds, judged on its targets"))


def _sweep(args: argparse.Namespace) -> int:
    from loadtest.sweep import main_sweep

    return main_sweep(args)


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "simulate": _simulate, "run": _run, "soak": _soak, "sweep": _sweep}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest")
    sub = p.add_subparsers(dest="command", required=True)
    _add_simulate(sub)
    _add_run(sub)
    _add_soak(sub)
    _add_sweep(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except ValueError as e:  # what was asked cannot be run as given (the message says why)
        print(f"loadtest: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
