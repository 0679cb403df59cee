"""Seeded, deterministic workloads: what a load test sends, and when.

A workload is a set of sessions. A session starts at ``start_s`` and runs its steps one
after the other: wait ``delay_s`` (think time), send the main request and, concurrently,
the step's side calls, wait for all of them, go on. Everything (text, arrivals, sizes)
comes from ``random.Random(seed)``: the same arguments give byte-identical requests, so
policies are compared on the same work.

- ``agentic``: coding-agent sessions over one shared prefix (system prompt + tool
  schemas), a per-session context, turns that append a scripted reply and a tool result,
  and side calls (a title after the first turn, a summary every few turns) that share the
  prefix and then diverge. Replies are scripted, not the model's output: the demo model
  emits random text, and a scripted history keeps every policy's requests identical.
- ``shared-prefix``: G groups x P single-turn prompts over a per-group system prompt,
  shuffled, Poisson arrivals.
- ``trace``: Mooncake replay; every hash id is a fixed block of token ids
  (:func:`loadtest.trace.block_tokens`), sent as a token-id prompt, so the block mapping
  is exact. Whole prefix groups are sampled so reuse survives down-scaling.
- ``chat-trace``: the same replay as a chat client sends it: every hash id is a fixed
  block of words, a request's blocks are one user message to ``/v1/chat/completions``,
  so the server's template and tokenizer are on the path, as with real conversations.

Text is built from words that are one token each in the demo (Qwen2) vocabulary and are
joined by single spaces, so ``n`` words are ``n`` tokens: sizes given in tokens hold.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from loadtest.bounds import oracle_hit_ratio
from loadtest.trace import BLOCK, TraceRequest, block_tokens, load_mooncake

APIS = ("openai", "anthropic", "llama")
WORKLOADS = ("agentic", "shared-prefix", "trace", "chat-trace")

# Each is a single token with a leading space (checked against the demo vocabulary).
_WORD_TEXT = (
    "the of and to in is for on with as by at from that this be are was it or an not which "
    "have has can will all one file code line return value function class type name data "
    "test error list path call tool read write run build user system model request response "
    "server client cache token slot route prefix config option result output input string "
    "number object array field method module package import export update delete create "
    "check find search replace patch diff commit branch merge status log debug trace info "
    "warn note step task plan review change fix issue bug feature version release install "
    "start stop open close load save parse format print time date size count index key map "
    "set get add remove insert sort filter match split join end first last next previous "
    "new old default current local remote global public private static async await yield "
    "throw catch try final block scope context state event handler query table column row "
    "schema record source target stream buffer channel socket port host address network"
)
_WORDS = tuple(_WORD_TEXT.split())


def words(rng: random.Random, n: int) -> str:
    """``n`` tokens of text (one vocabulary word each)."""
    return " ".join(rng.choice(_WORDS) for _ in range(max(0, n)))


@dataclass(frozen=True)
class Request:
    id: str
    session: str
    turn: int  # the step it belongs to (side calls share their step's turn)
    kind: str  # main | title | summary | prompt | trace
    api: str  # openai | anthropic | llama
    body: dict[str, Any]  # without "stream": the client sets it
    approx_prompt_tokens: int


@dataclass(frozen=True)
class Step:
    delay_s: float  # think time before this step (after the previous one finished)
    main: Request
    side: tuple[Request, ...] = ()


@dataclass(frozen=True)
class Session:
    id: str
    start_s: float
    steps: tuple[Step, ...]


@dataclass(frozen=True)
class Workload:
    name: str
    sessions: tuple[Session, ...]
    params: dict[str, Any] = field(default_factory=dict)
    oracle_reuse: float | None = None  # trace: best achievable reused / prompt tokens
    blocks: dict[str, tuple[int, ...]] = field(default_factory=dict)  # trace: id -> hash ids

    def requests(self) -> list[Request]:
        return [r for s in self.sessions for st in s.steps for r in (st.main, *st.side)]

    def fingerprint(self) -> str:
        """Stable digest of everything sent (determinism checks, report provenance)."""
        import hashlib

        h = hashlib.sha256()
        for s in self.sessions:
            h.update(f"{s.id}|{s.start_s:.6f}".encode())
            for st in s.steps:
                h.update(f"{st.delay_s:.6f}".encode())
                for r in (st.main, *st.side):
                    h.update(json.dumps(r.body, sort_keys=True).encode())
        return h.hexdigest()[:16]


def _body(api: str, system: str, msgs: Sequence[tuple[str, str]], max_tokens: int,
          model: str) -> dict[str, Any]:
    """A chat request in the given API; ``msgs`` alternate user/assistant, user first."""
    if api == "anthropic":
        return {"model": model, "max_tokens": max_tokens, "system": system,
                "messages": [{"role": r, "content": c} for r, c in msgs]}
    if api == "openai":
        return {"model": model, "max_tokens": max_tokens,
                "messages": [{"role": "system", "content": system},
                             *({"role": r, "content": c} for r, c in msgs)]}
    raise ValueError(f"chat workloads speak openai or anthropic, not {api!r}")


def _tool_schemas(rng: random.Random, n_tokens: int) -> str:
    """JSON-ish tool schemas of about ``n_tokens`` tokens (the agent's tool list)."""
    out, used, i = [], 0, 0
    while used < n_tokens:
        desc = min(120, n_tokens - used)
        out.append(json.dumps({"name": f"tool_{i}", "description": words(rng, desc)}))
        used += desc + 12  # braces, keys and the name cost about a dozen tokens
        i += 1
    return "\n".join(out)


def agentic(*, sessions: int = 4, turns: int = 4, prefix_tokens: int = 6000,
            context_tokens: int = 1000, tool_tokens: int = 300, reply_tokens: int = 40,
            max_tokens: int = 16, think_s: float = 1.0, session_rate: float = 0.5,
            side_calls: bool = True, summary_every: int = 3, api: str = "openai",
            model: str = "kvroute-demo", seed: int = 0) -> Workload:
    """N coding-agent sessions, each T turns, over one shared ~prefix_tokens prefix.

    Sessions start at Poisson arrivals of ``session_rate`` per second; think time between
    turns is exponential with mean ``think_s``.
    """
    params = dict(locals())
    rng = random.Random(seed)
    # the shared prefix: instructions (a third) + tool schemas (the rest)
    system = ("You are a coding agent. " + words(rng, prefix_tokens // 3) + "\n# Tools\n"
              + _tool_schemas(rng, prefix_tokens - prefix_tokens // 3))
    out: list[Session] = []
    t = 0.0
    for s in range(sessions):
        sid = f"s{s}"
        srng = random.Random(f"{seed}/{sid}")
        history: list[tuple[str, str]] = [
            ("user", f"Session {sid}. Repository context: " + words(srng, context_tokens))]
        steps: list[Step] = []
        for turn in range(turns):
            main = Request(f"{sid}.t{turn}", sid, turn, "main", api,
                           _body(api, system, history, max_tokens, model),
                           prefix_tokens + sum(len(c.split()) for _, c in history))
            side: list[Request] = []
            if side_calls and turn == 0:
                # shares the system prefix, then diverges from the session's context
                title = "Write a five word title for: " + history[0][1][:200]
                side.append(Request(f"{sid}.title", sid, turn, "title", api, _body(
                    api, system, [("user", title)], 8, model), prefix_tokens + 60))
            if side_calls and summary_every and turn and turn % summary_every == 0:
                side.append(Request(f"{sid}.sum{turn}", sid, turn, "summary", api, _body(
                    api, system, [*history[:-1], (history[-1][0], history[-1][1]
                                                  + "\nSummarize the session so far.")],
                    max_tokens, model), main.approx_prompt_tokens + 6))
            steps.append(Step(0.0 if turn == 0 else rng.expovariate(1 / think_s)
                              if think_s > 0 else 0.0, main, tuple(side)))
            history += [("assistant", "I will call a tool. " + words(srng, reply_tokens)),
                        ("user", "Tool result: " + words(srng, tool_tokens))]
        out.append(Session(sid, t, tuple(steps)))
        t += rng.expovariate(session_rate) if session_rate > 0 else 0.0
    return Workload("agentic", tuple(out), params)


def shared_prefix(*, groups: int = 4, prompts: int = 8, system_tokens: int = 2000,
                  question_tokens: int = 100, max_tokens: int = 16, rate: float = 1.0,
                  api: str = "openai", model: str = "kvroute-demo", seed: int = 0) -> Workload:
    """G groups x P single-turn prompts over a per-group system prompt, Poisson arrivals."""
    params = dict(locals())
    rng = random.Random(seed)
    systems = [f"Group {g} instructions. " + words(rng, system_tokens) for g in range(groups)]
    order = [(g, p) for g in range(groups) for p in range(prompts)]
    rng.shuffle(order)
    out, t = [], 0.0
    for g, p in order:
        sid = f"g{g}p{p}"
        q = f"Question {p}: " + words(rng, question_tokens)
        req = Request(sid, sid, 0, "prompt", api,
                      _body(api, systems[g], [("user", q)], max_tokens, model),
                      system_tokens + question_tokens)
        out.append(Session(sid, t, (Step(0.0, req),)))
        t += rng.expovariate(rate) if rate > 0 else 0.0
    return Workload("shared-prefix", tuple(out), params)


def shared_depth(trace: Sequence[TraceRequest]) -> int:
    """How many leading hash ids every request of ``trace`` shares (a system prompt all
    its conversations start with): a conversation is told by the id after them."""
    if not trace:
        return 0
    first = trace[0].hash_ids
    n = min(len(first), *(len(r.hash_ids) for r in trace))
    for r in trace:
        n = next((i for i in range(n) if r.hash_ids[i] != first[i]), n)
    return n


def group_of(r: TraceRequest, depth: int) -> int:
    """``r``'s conversation: its first hash id past the ``depth`` all share (-1: none)."""
    return r.hash_ids[depth] if len(r.hash_ids) > depth else -1


def sample_groups(trace: Sequence[TraceRequest], requests: int,
                  seed: int) -> list[TraceRequest]:
    """Whole conversations (requests sharing their first hash id past those every request
    shares) in seeded random order until ``requests`` are taken: a request's ancestors
    come along, so its reuse does too. Returned in trace (timestamp) order."""
    depth = shared_depth(trace)
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(trace):
        groups.setdefault(group_of(r, depth), []).append(i)
    keys = sorted(groups)
    random.Random(seed).shuffle(keys)
    keep: list[int] = []
    for k in keys:
        if len(keep) >= requests:
            break
        keep += groups[k]
    return [trace[i] for i in sorted(keep)]


def scale_request(r: TraceRequest, block: int) -> TraceRequest:
    """The same request with ``block`` tokens per hash id instead of 512."""
    n = max(1, min(len(r.hash_ids) * block, math.ceil(r.input_length * block / BLOCK)))
    return TraceRequest(r.timestamp_ms, n, r.output_length, r.hash_ids)


def trace_prompt(r: TraceRequest, block: int) -> list[int]:
    out: list[int] = []
    for h in r.hash_ids:
        out.extend(block_tokens(h, block))
    return out[: r.input_length]


def trace(*, path: str, requests: int = 100, rate: float = 1.0, block: int = 32,
          max_tokens: int = 8, api: str = "llama", model: str = "kvroute-demo",
          seed: int = 0) -> Workload:
    """Mooncake replay: ``requests`` (whole groups) at a mean ``rate`` per second.

    Every hash id becomes ``block`` token ids (512 in the trace; smaller keeps a 2-core
    box's prefill bounded while preserving which requests share what). ``api`` llama sends
    ``/completion``, openai ``/v1/completions``, both with a token-id prompt.
    """
    params = dict(locals())
    if api == "anthropic":
        raise ValueError("trace replay sends token ids: --api llama or openai")
    whole = load_mooncake(path)
    depth = shared_depth(whole)
    picked = [scale_request(r, block) for r in sample_groups(whole, requests, seed)]
    if not picked:
        return Workload("trace", (), params, 0.0)
    out = []
    for i, r, at, root, turn in _replay(picked, rate, depth):
        prompt = trace_prompt(r, block)
        body: dict[str, Any] = {"prompt": prompt}
        out_n = max(1, min(r.output_length, max_tokens))
        if api == "llama":
            body["n_predict"] = out_n
        else:
            body.update(model=model, max_tokens=out_n)
        req = Request(f"r{i}", f"h{root}", turn, "trace", api, body, len(prompt))
        out.append(Session(f"r{i}", at, (Step(0.0, req),)))
    blocks = {f"r{i}": tuple(r.hash_ids[:math.ceil(r.input_length / block)])
              for i, r in enumerate(picked)}
    return Workload("trace", tuple(out), params, oracle_hit_ratio(picked, block), blocks)


def _replay(picked: Sequence[TraceRequest], rate: float, depth: int
            ) -> Iterator[tuple[int, TraceRequest, float, int, int]]:
    """Each request with its index, arrival (s: the trace's relative spacing at a mean
    ``rate`` per s), conversation (``group_of``) and turn within it."""
    if not picked:
        return
    t0 = picked[0].timestamp_ms
    span_s = (picked[-1].timestamp_ms - t0) / 1000
    scale = (len(picked) - 1) / rate / span_s if span_s > 0 and rate > 0 else 0.0
    turns: dict[int, int] = {}
    for i, r in enumerate(picked):
        root = group_of(r, depth)
        turns[root] = turns.get(root, -1) + 1
        yield i, r, (r.timestamp_ms - t0) / 1000 * scale, root, turns[root]


def block_text(hash_id: int, n_words: int) -> str:
    """The fixed text of one hash id: ``n_words`` words seeded by the id alone."""
    return words(random.Random(hash_id), n_words)


def chat_trace(*, path: str, requests: int = 200, rate: float = 2.0, block: int = 32,
               max_tokens: int = 8, model: str = "kvroute-demo", seed: int = 0) -> Workload:
    """Mooncake replay in chat form: ``requests`` (whole groups) at a mean ``rate`` per
    second, each hash id a block of ``block`` words, a request's blocks joined into one
    user message (the trace's ``input_length`` only says how many blocks: the last one
    is whole)."""
    params = dict(locals())
    full = load_mooncake(path)
    picked = sample_groups(full, requests, seed)
    out = []
    for i, r, at, root, turn in _replay(picked, rate, shared_depth(full)):
        n_blocks = max(1, min(len(r.hash_ids), math.ceil(r.input_length / BLOCK)))
        text = " ".join(block_text(h, block) for h in r.hash_ids[:n_blocks])
        body = {"model": model, "max_tokens": max(1, min(r.output_length, max_tokens)),
                "messages": [{"role": "user", "content": text}]}
        req = Request(f"r{i}", f"h{root}", turn, "trace", "openai", body, n_blocks * block)
        out.append(Session(f"r{i}", at, (Step(0.0, req),)))
    whole = [TraceRequest(r.timestamp_ms, min(len(r.hash_ids), math.ceil(r.input_length / BLOCK))
                          * block, r.output_length, r.hash_ids) for r in picked]
    blocks = {f"r{i}": tuple(r.hash_ids[:r.input_length // block]) for i, r in enumerate(whole)}
    return Workload("chat-trace", tuple(out), params, oracle_hit_ratio(whole, block), blocks)
