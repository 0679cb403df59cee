"""What the replicas' events cost on the wire per routed request, with a start sent
whole against sent as what it adds to a prompt its slot was told before
(proxy/replicas/bases.py). No server: the workload's prompts are made with the demo
model's tokenizer and template, routed by a Router (prefix policy) in the order the
sessions' steps come, and each request's start, first token and end encoded.

    python bench/bench_start_bytes.py [--sessions 16] [--turns 6] [--backends 4] [--slots 2]

Defaults: bench_replica_faults.py's agentic workload (2k shared prefix, 800-token
context, title and summary calls).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.demo_model import ensure_demo_model  # noqa: E402
from loadtest.workloads import agentic  # noqa: E402
from proxy.prompt.builder import PromptBuilder  # noqa: E402
from proxy.replicas.bases import Bases  # noqa: E402
from proxy.replicas.events import Event, Kind, encode  # noqa: E402
from proxy.routing.cache.predict import BackendCapacity  # noqa: E402
from proxy.routing.decision import Decision  # noqa: E402
from proxy.routing.router import Router  # noqa: E402

ANSWER = 8  # tokens each answer leaves (the workload's max_tokens)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--backends", type=int, default=4)
    p.add_argument("--slots", type=int, default=2)
    args = p.parse_args()
    workload = agentic(sessions=args.sessions, turns=args.turns, prefix_tokens=2000,
                       context_tokens=800, tool_tokens=200, reply_tokens=30,
                       max_tokens=ANSWER)
    builder = PromptBuilder.load(ensure_demo_model())
    router = Router("prefix")
    for b in range(args.backends):
        router.add_backend(BackendCapacity(f"b{b}", args.slots, 32768, 0, 8192))
    bases = Bases()
    # the sessions' steps as they come: each session's k-th step after the others' k-1-th
    steps = sorted(((k, s.start_s, st) for s in workload.sessions
                    for k, st in enumerate(s.steps)), key=lambda t: (t[0], t[1]))
    whole = sent = rest = tokens = n = 0
    for _, _, step in steps:
        for req in (step.main, *step.side):
            ids = builder.chat_ids(req.body)
            d = router.decide(ids, now=float(n))
            assert isinstance(d, Decision) and d.slot is not None
            start = Event("r0", Kind.START, "kvroute-demo", d.backend, d.slot, n,
                          ids.tobytes())
            whole += len(encode(start))
            sent += len(encode(bases.shorten(start)))
            bases.told(start)
            rest += len(encode(Event("r0", Kind.FIRST, "kvroute-demo", d.backend, d.slot, n)))
            rest += len(encode(Event("r0", Kind.END, "kvroute-demo", d.backend, d.slot, n,
                                     ids[-ANSWER:].tobytes(), len(ids))))
            router.complete(d, output_tokens=ids[-ANSWER:], now=n + 0.5)
            tokens += len(ids)
            n += 1
    print(f"{n} requests, {tokens / n:,.0f} prompt tokens each on average")
    print(f"start whole: {whole / n:,.0f} B a request; as sent: {sent / n:,.0f} B "
          f"(x{sent / whole:.3f})")
    print(f"start + first + end: whole {(whole + rest) / n:,.0f} B; as sent "
          f"{(sent + rest) / n:,.0f} B (x{(sent + rest) / (whole + rest):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
