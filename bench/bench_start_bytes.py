"""What the replicas' events cost on the wire per routed request, with a start sent
whole against sent as what it adds to a prompt its slot was told before
(proxy/replicas/bases.py): the prompts starts told only, or also what ends left (the
prompt, then the answer). No server: the workload's prompts are made with the demo
model's tokenizer and template, routed by a Router (prefix policy) in the order the
sessions' steps come, and each request's start, first token and end encoded. A turn's
answer is what the next turn's prompt holds of it (its reply's tokens and the end of
turn, as a model that said it would have left them); a side call's, its last 8 tokens.

    python bench/bench_start_bytes.py [--sessions 16] [--turns 6] [--backends 4]
        [--slots 2] [--reply-tokens 30]

Defaults: bench_replica_faults.py's agentic workload (2k shared prefix, 800-token
context, 30-word replies, title and summary calls).
"""

from __future__ import annotations

import argparse
import sys
from array import array
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.demo_model import ensure_demo_model  # noqa: E402
from loadtest.workloads import agentic  # noqa: E402
from proxy.prompt.builder import PromptBuilder  # noqa: E402
from proxy.replicas.bases import Bases  # noqa: E402
from proxy.replicas.events import Event, Kind, encode  # noqa: E402
from proxy.routing.cache.values import BackendCapacity  # noqa: E402
from proxy.routing.decision import Report  # noqa: E402
from proxy.routing.routed import Routed  # noqa: E402
from proxy.routing.router import Router  # noqa: E402
from proxy.routing.tree.token_bytes import common_len  # noqa: E402

ANSWER = 8  # tokens a side call's answer leaves (the workload's max_tokens)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--backends", type=int, default=4)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--reply-tokens", type=int, default=30)
    args = p.parse_args()
    # (a turn more: the last turn's answer is what the one after it holds)
    workload = agentic(sessions=args.sessions, turns=args.turns + 1, prefix_tokens=2000,
                       context_tokens=800, tool_tokens=200, reply_tokens=args.reply_tokens,
                       max_tokens=ANSWER)
    builder = PromptBuilder.load(ensure_demo_model())
    router = Router("prefix")
    for b in range(args.backends):
        router.add_backend(BackendCapacity(f"b{b}", args.slots, 32768, 0, 8192))
    prompts_only, with_ends = Bases(), Bases()
    # the sessions' steps as they come: each session's k-th step after the others' k-1-th
    steps = sorted(((k, s.start_s, st, s.steps[k + 1]) for s in workload.sessions
                    for k, st in enumerate(s.steps[:-1])), key=lambda t: (t[0], t[1]))
    whole = sent = sent_ends = rest = tokens = n = 0
    for _, _, step, after in steps:
        for req in (step.main, *step.side):
            ids = builder.chat_ids(req.body)
            d = router.decide(ids, now=float(n))
            assert isinstance(d, Routed) and d.slot is not None
            start = Event("r0", Kind.START, "kvroute-demo", d.backend, d.slot, n,
                          ids.tobytes())
            whole += len(encode(start))
            sent += len(encode(prompts_only.shorten(start)))
            sent_ends += len(encode(with_ends.shorten(start)))
            answer = _answer(builder, ids, after.main.body) if req is step.main \
                else ids[-ANSWER:]
            ended = Event("r0", Kind.END, "kvroute-demo", d.backend, d.slot, n,
                          answer.tobytes(), len(ids))
            for bases in (prompts_only, with_ends):
                bases.told(start)
            with_ends.ended(ended)
            rest += len(encode(Event("r0", Kind.FIRST, "kvroute-demo", d.backend, d.slot, n)))
            rest += len(encode(ended))
            router.complete(d, Report(output_tokens=answer), now=n + 0.5)
            tokens += len(ids)
            n += 1
    print(f"{n} requests, {tokens / n:,.0f} prompt tokens each on average")
    for name, got in (("bases: starts' prompts", sent), ("and what ends left", sent_ends)):
        print(f"{name}: start whole {whole / n:,.0f} B a request; as sent {got / n:,.0f} B "
              f"(x{got / whole:.3f}); start + first + end: whole {(whole + rest) / n:,.0f} "
              f"B, as sent {(got + rest) / n:,.0f} B (x{(got + rest) / (whole + rest):.3f})")
    print(f"with ends against without: start x{sent_ends / sent:.3f}, start + first + end "
          f"x{(sent_ends + rest) / (sent + rest):.3f}")
    return 0


def _answer(builder: PromptBuilder, ids: array, after: dict[str, Any]) -> array:
    """What the next turn (``after``) holds of this turn's answer: its reply's tokens
    beyond this prompt, and the end of turn."""
    following = builder.chat_ids(after)
    at = common_len(ids.tobytes(), following.tobytes(), 0)
    reply = after["messages"][-2]["content"]  # (the history ends: reply, tool result)
    return following[at:at + len(builder.tokenizer.tokenize_ids(reply, add_special=False))
                     + 1]


if __name__ == "__main__":
    sys.exit(main())
