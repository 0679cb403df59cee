"""What prompt ids from the backend cost, against kvroute's own, on a ~20k-token turn.

    python bench/bench_backend_tokens.py [--rounds N]

One real llama-server (demo model). For one coding-agent-sized chat body: the median time
of the backend's ids (`/apply-template` + `/tokenize`, as `BackendTokens.chat` asks them)
and of the local ids, cold (a new fragment cache each time) and warm (the history seen,
only the last message new: a later turn); and of the backend's text tokenized here (the
fallback when a GGUF is at hand but its template is not exact). Target: that fallback adds
<= 5 ms (median) over the local warm turn.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from array import array
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.binary import find_llama_server  # noqa: E402
from backends.demo_model import DemoModelParams, demo_model_path  # noqa: E402
from backends.info import BackendInfo  # noqa: E402
from backends.process import LlamaServerProcess, ServerSpec, free_port  # noqa: E402
from loadtest.workloads import words  # noqa: E402
from proxy.prompt.builder import PromptBuilder  # noqa: E402
from proxy.server.backend_tokens import BackendTokens  # noqa: E402


def body(turn: int) -> dict[str, object]:
    rng = random.Random(0)
    history = [{"role": "system", "content": words(rng, 6000)}]
    for _ in range(12):
        history.append({"role": "user", "content": words(rng, 600)})
        history.append({"role": "assistant", "content": words(rng, 500)})
    history.append({"role": "user", "content": words(random.Random(turn), 200)})
    return {"messages": history}


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    found = find_llama_server()
    model = demo_model_path(DemoModelParams())
    if found is None or not model.is_file():
        print("run `python -m backends prepare` first", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        proc = LlamaServerProcess(ServerSpec(found.path, model, free_port(), slots=1,
                                             ctx_per_slot=4096, cache_ram_mib=0),
                                  Path(tmp) / "server.log")
        proc.spawn()
        try:
            async with aiohttp.ClientSession() as http:
                ready = await proc.wait_ready(http, 120)
                assert hasattr(ready, "seconds"), ready
                info = BackendInfo("a", proc.spec.url, None, 1, 4096, 0, 8192, "demo", True)
                remote = BackendTokens(http, lambda: info, lambda _: None)
                local = PromptBuilder.load(model)
                n = len(local.chat_ids(body(0)))
                await remote.chat(body(0), "bench")  # connection up
                backend_ms, text_ms, cold_ms, warm_ms = [], [], [], []
                here = PromptBuilder.load(model)

                async def tokenize_here(text: str) -> array:
                    return here.tokenizer.tokenize_ids(text)

                bodies = [body(turn) for turn in range(args.rounds + 1)]
                for turn in range(1, args.rounds + 1):
                    b = bodies[turn]
                    t0 = time.perf_counter()
                    ids = await remote.chat(b, "bench")
                    backend_ms.append((time.perf_counter() - t0) * 1000)
                    t0 = time.perf_counter()
                    warm = local.chat_ids(b)  # history seen on earlier turns
                    warm_ms.append((time.perf_counter() - t0) * 1000)
                    assert list(ids) == list(warm), "backend and local ids differ"
                    t0 = time.perf_counter()  # the backend's text, tokenized here
                    await remote.chat(b, "bench", tokenize_here)
                    text_ms.append((time.perf_counter() - t0) * 1000)
                    cold = PromptBuilder.load(model)
                    t0 = time.perf_counter()
                    cold.chat_ids(b)
                    cold_ms.append((time.perf_counter() - t0) * 1000)
        finally:
            await proc.stop()
    b, t, c, w = (statistics.median(x) for x in (backend_ms, text_ms, cold_ms, warm_ms))
    print(f"prompt: {n} tokens; medians over {args.rounds} turns")
    print(f"local, cold : {c:.2f} ms")
    print(f"local, warm : {w:.2f} ms ({w / c:.2f}x of cold)")
    print(f"from backend: {b:.2f} ms (rendered and tokenized there; no local GGUF)")
    print(f"backend text, local ids: {t:.2f} ms; adds {t - w:.2f} ms over the warm local "
          f"turn (target <= 5 ms: {'met' if t - w <= 5 else 'MISSED'})")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
