"""Prefill and decode speed of llama-server builds side by side: native against portable.

    python bench/bench_cpu_build.py [--binary 'NAME=PATH [ARGS]' ...] [--model GGUF]
                                    [--rounds N] [--threads T]

Default binaries: the cached portable build and the cached native one (`make artifacts`
and `NATIVE=1 make artifacts`). Each runs the demo model in its own llama-server, one
slot; every round sends each server, in turn, a prompt of --tokens fresh token ids (no
cache to reuse) and --predict generated tokens, and reads the server's own timings. The
medians per build and their ratios to the first build are printed; the rounds interleave
the builds, so a noisy machine slows all of them alike.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.binary import cache_dir  # noqa: E402
from backends.demo_model import DemoModelParams, demo_model_path  # noqa: E402
from backends.gpu import binary_path  # noqa: E402
from backends.process import Failed, LlamaServerProcess, ServerSpec, free_port  # noqa: E402


def _default_binaries() -> dict[str, Path]:
    return {"portable": binary_path(cache_dir(), "cpu", native=False),
            "native": binary_path(cache_dir(), "cpu", native=True)}


async def _round(session: aiohttp.ClientSession, url: str, tokens: int, predict: int,
                 seed: int) -> tuple[float, float]:
    rng = random.Random(seed)
    prompt = [rng.randrange(1000, 30_000) for _ in range(tokens)]  # in any vocabulary
    body = {"prompt": prompt, "n_predict": predict, "cache_prompt": False,
            "ignore_eos": True, "temperature": 0}
    async with session.post(f"{url}/completion", json=body) as r:
        t = (await r.json())["timings"]
    return t["prompt_per_second"], t["predicted_per_second"]


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", action="append", default=[], metavar="NAME=PATH [ARGS]",
                    help="a build to run, with llama-server flags of its own: e.g. "
                         "'no-amx=bin-cpu/llama-server --no-repack'")
    ap.add_argument("--model", type=Path, default=None,
                    help="GGUF to run (default: the demo model, f16; AMX's tile kernels "
                         "take quantized weights: Q4_0, Q8_0, Q4_K...)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--predict", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="-t (config.yaml: 1)")
    args = ap.parse_args()
    given = {k: shlex.split(v) for k, v in (b.split("=", 1) for b in args.binary)}
    bins = ({k: (Path(v[0]), tuple(v[1:])) for k, v in given.items()}
            or {k: (p, ()) for k, p in _default_binaries().items()})
    model = args.model or demo_model_path(DemoModelParams())
    missing = [str(p) for p in [*(b for b, _ in bins.values()), model] if not p.is_file()]
    if missing:
        print(f"missing: {', '.join(missing)} (make artifacts; NATIVE=1 make artifacts)",
              file=sys.stderr)
        return 2
    procs: dict[str, LlamaServerProcess] = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for name, (path, extra) in bins.items():
                spec = ServerSpec(path, model, free_port(), slots=1, threads=args.threads,
                                  ctx_per_slot=args.tokens + args.predict + 64, cache_ram_mib=0,
                                  extra_args=extra)
                procs[name] = LlamaServerProcess(spec, Path(tmp) / f"{name}.log")
                procs[name].spawn()
            speeds: dict[str, list[tuple[float, float]]] = {n: [] for n in procs}
            async with aiohttp.ClientSession() as s:
                for p in procs.values():
                    ready = await p.wait_ready(s)
                    if isinstance(ready, Failed):
                        print(f"{p.spec.binary} did not start: {ready}", file=sys.stderr)
                        return 1
                for i in range(args.rounds + 1):
                    for name, p in procs.items():
                        got = await _round(s, p.spec.url, args.tokens, args.predict, i)
                        if i:  # the first round warms each server
                            speeds[name].append(got)
        finally:
            for p in procs.values():
                await p.stop()
    first = next(iter(speeds))
    base = [statistics.median(x[k] for x in speeds[first]) for k in (0, 1)]
    print(f"{model.name}, {args.tokens}-token prompt, {args.predict} generated, "
          f"-t {args.threads}, median of {args.rounds} interleaved rounds")
    print(f"{'build':<10} {'prefill tok/s':>14} {'decode tok/s':>13} {'prefill x':>10} "
          f"{'decode x':>9}")
    for name, xs in speeds.items():
        pre, dec = (statistics.median(x[k] for x in xs) for k in (0, 1))
        print(f"{name:<10} {pre:>14.1f} {dec:>13.1f} {pre / base[0]:>10.3f} "
              f"{dec / base[1]:>9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
