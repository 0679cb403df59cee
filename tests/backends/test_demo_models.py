"""The demo models against the real pinned llama-server: what it reuses, and from which
context checkpoint, for the plain (`demo`), sliding-window (`demo-swa`) and hybrid
(`demo-hybrid`) models. docs/checkpoints.md states the rule these numbers follow.

Each model runs in one llama-server: 1 slot, 8192 tokens, --cache-ram 1024, default
checkpoint settings (32 per slot, --checkpoint-min-step 8192, ubatch 512), log level 4
so the checkpoint lines (trace level) are written. Every scenario starts from token ids
that share nothing with the slot or the RAM cache, so scenarios do not depend on order.
Prompts of token ids go to /completion (exact positions); n_predict 4 leaves the slot
with the prompt and 3 generated tokens (the last sampled token is not evaluated).
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from backends.config import ManagedBackendConfig
from backends.demo_model import DEMO_KINDS, ensure_demo_model
from backends.supervisor import Supervisor
from proxy.config.load import Config

N = 1000  # prompt length of the token-id scenarios
CREATED = re.compile(r"created context checkpoint \d+ of \d+ \(pos_min = (\d+), "
                     r"pos_max = (\d+), n_tokens = (\d+)")
RESTORED = re.compile(r"restored context checkpoint \(pos_min = (\d+), pos_max = (\d+), "
                      r"n_tokens = (\d+), n_past = (\d+)")
FORCED = "forcing full prompt re-processing due to lack of cache data"
RAM_ENTRY = re.compile(r"- prompt 0x[0-9a-f]+: +(\d+) tokens, checkpoints: +(\d+)")


@dataclass(frozen=True)
class Expect:
    """What the server does on one model; see docs/checkpoints.md."""

    memory_lines: tuple[str, ...]  # server log lines that name the memory kind
    first: list[tuple[int, int, int]]  # checkpoints (pos_min, pos_max, n_tokens) of N ids
    side: dict[int, int]  # shared prefix -> cache_n of a call that diverges there
    same: int  # cache_n of the same N-token prompt again
    ram_continuation: int  # cache_n of a continuation loaded back from the RAM cache
    chat_side: int  # cache_n: same history, a different last user message
    chat_title: int  # cache_n: same system prompt, one different user message
    checkpoints: bool = True  # does the server create checkpoints at all
    chat_points: Callable[[int, list[int]], list[int]] = field(
        default=lambda n, users: [users[0], users[-1], n - 516, n - 4])


EXPECT = {
    # plain attention: any prefix is reused as it is; no checkpoints
    "demo": Expect(
        memory_lines=("(  8192 cells,   8 layers,",),
        first=[], side={300: 300, 488: 488, 700: 700, 999: 999}, same=N - 1,
        ram_continuation=N + 3, chat_side=1236, chat_title=668, checkpoints=False,
        chat_points=lambda n, users: []),
    # SWA cache of 256 + 512 (ubatch) cells: exact while the slot still holds the window
    # before the divergence (pos_min < p - 256), else a checkpoint, restored at n_tokens-1
    "demo-swa": Expect(
        memory_lines=("n_swa                 = 256", "(   768 cells,   6 layers,",
                      "(  8192 cells,   2 layers,"),
        first=[(0, 483, 484), (228, 995, 996)],
        side={300: 0, 488: 483, 700: 700, 999: 999}, same=N - 1,
        ram_continuation=995, chat_side=1232, chat_title=664),
    # recurrent state holds only the last position: exact only for a continuation, else
    # the latest checkpoint at or before the divergence, restored at n_tokens
    "demo-hybrid": Expect(
        memory_lines=("(  8192 cells,   2 layers,",
                      "llama_memory_recurrent: size =    0.02 MiB (     1 cells,   8 layers,"),
        first=[(483, 483, 484), (995, 995, 996)],
        side={300: 0, 488: 484, 700: 484, 999: 996}, same=996,
        ram_continuation=N + 3, chat_side=1233, chat_title=665),
}


def ids(seed: int, n: int = N) -> list[int]:
    """n token ids that share no prefix with another seed's."""
    return [1000 + (i * 7919 + seed * 104729) % 100000 for i in range(n)]


class Probe:
    """One llama-server: requests, and the log lines each request wrote."""

    def __init__(self, session: aiohttp.ClientSession, sup: Supervisor) -> None:
        info = sup.ready()[0]
        self.session, self.url = session, info.url
        self.headers = {"Authorization": f"Bearer {info.api_key}"}
        self.log = Path(str(sup.statuses()[0]["log"]))
        backend = sup.config.backends[0]
        assert isinstance(backend, ManagedBackendConfig)
        self.model = backend.model
        self.offset = 0

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self.session.post(self.url + path, json=body, headers=self.headers) as r:
            assert r.status == 200, await r.text()
            out: dict[str, Any] = await r.json()
        return out

    async def completion(self, tokens: list[int]) -> tuple[dict[str, Any], str]:
        body = {"prompt": tokens, "n_predict": 4, "temperature": 0, "cache_prompt": True,
                "return_tokens": True}
        return await self.post("/completion", body), await self.new_log()

    async def chat(self, messages: list[dict[str, str]]) -> tuple[int, str]:
        body = {"messages": messages, "max_tokens": 4, "temperature": 0}
        out = await self.post("/v1/chat/completions", body)
        return out["usage"]["prompt_tokens_details"]["cached_tokens"], await self.new_log()

    async def new_log(self) -> str:
        """The log written since the last call, up to the end of the request's task (the
        server logs from another thread: wait for the slot's release line)."""
        for _ in range(100):
            text = self.log.read_text()[self.offset:]
            if "stop processing: n_tokens" in text:
                self.offset += len(text)
                return text
            await asyncio.sleep(0.02)
        raise AssertionError(f"no task end in {self.log}")


def created(log: str) -> list[tuple[int, int, int]]:
    return [(int(a), int(b), int(c)) for a, b, c in CREATED.findall(log)]


def restored(log: str) -> list[tuple[int, int, int, int]]:
    return [tuple(int(x) for x in m) for m in RESTORED.findall(log)]  # type: ignore[misc]


@pytest_asyncio.fixture(scope="module", loop_scope="session", params=list(EXPECT))
async def probe(request: pytest.FixtureRequest, pool_config: Callable[..., Config]
                ) -> AsyncIterator[tuple[Probe, Expect]]:
    kind = request.param
    # demo-coder is demo with another vocabulary (tests/prompt/test_infill.py runs it)
    assert set(EXPECT) == set(DEMO_KINDS) - {"demo-coder"}
    model = ensure_demo_model(kind=kind)  # seconds the first time, then cached
    cfg = pool_config(n=1, slots=1, ctx_per_slot=8192, cache_ram_mib=1024,
                      extra_args=("-lv", "4"))
    backend = cfg.backends[0]
    assert isinstance(backend, ManagedBackendConfig)
    cfg = dataclasses.replace(cfg, backends=(dataclasses.replace(
        backend, model=model, alias=f"kvroute-{kind}", threads=2),))
    sup = Supervisor(cfg)
    await sup.start()
    try:
        assert len(sup.ready()) == 1, sup.statuses()
        async with aiohttp.ClientSession() as session:
            yield Probe(session, sup), EXPECT[kind]
    finally:
        await sup.stop()


async def test_loads_serves_and_names_its_memory(probe: tuple[Probe, Expect]) -> None:
    """/props names no memory kind: the start-up log does, with the checkpoint settings."""
    p, want = probe
    _, log = await p.completion(ids(1, 20))
    for line in (*want.memory_lines, "context checkpoints enabled, max = 32, min spacing = 8192"):
        assert line in log, line
    async with p.session.get(p.url + "/props", headers=p.headers) as r:
        props = await r.json()
    assert props["model_path"] == str(p.model)
    assert not {"n_swa", "memory", "recurrent", "checkpoints"} & set(props)
    cached, _ = await p.chat([{"role": "user", "content": "Say hi."}])
    assert cached == 0


async def test_checkpoints_of_a_prompt(probe: tuple[Probe, Expect]) -> None:
    """A prompt of n ids without message spans: checkpoints at n - 4 - n_ubatch and
    n - 4, taken before the batch that starts there (so n_tokens tokens are in it)."""
    p, want = probe
    out, log = await p.completion(ids(2))
    assert out["timings"]["cache_n"] == 0
    assert created(log) == want.first


async def test_continuation_reuses_everything(probe: tuple[Probe, Expect]) -> None:
    """prompt + answer + new turn: the slot's N + 3 tokens are reused on every model."""
    p, _ = probe
    base = ids(3)
    out, _ = await p.completion(base)
    out, log = await p.completion(base + out["tokens"] + ids(30, 50))
    assert out["timings"]["cache_n"] == N + 3
    assert FORCED not in log and not restored(log)


@pytest.mark.parametrize("shared", [300, 488, 700, 999])
async def test_side_call_diverging_after(probe: tuple[Probe, Expect], shared: int) -> None:
    p, want = probe
    base = ids(100 + shared)
    await p.completion(base)
    out, log = await p.completion(base[:shared] + ids(31, 30))
    cache_n = out["timings"]["cache_n"]
    assert cache_n == want.side[shared]
    if 0 < cache_n < shared:  # a checkpoint was restored: the one that gives cache_n
        (_, _, n_tokens, n_past), = restored(log)
        assert n_past == cache_n and n_tokens in {c[2] for c in want.first}
    assert (FORCED in log) == (cache_n == 0)


async def test_same_prompt_again(probe: tuple[Probe, Expect]) -> None:
    """Nothing new to process: the server evaluates at least the last prompt token, and
    a hybrid model falls back to its checkpoint at n - 4."""
    p, want = probe
    base = ids(4)
    await p.completion(base)
    out, _ = await p.completion(base)
    assert out["timings"]["cache_n"] == want.same


WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
         "lambda", "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon"]


def text(n: int, seed: int) -> str:
    return " ".join(WORDS[(i * seed) % len(WORDS)] + str(i % 7) for i in range(n))


async def test_chat_checkpoints_at_user_messages(probe: tuple[Probe, Expect]) -> None:
    """Chat prompts carry message spans (the template's user delimiter,
    `<|im_start|>user`): checkpoints at the first user message (none yet), the last one,
    n - 516 and n - 4. A side call restores the latest one at or before the divergence."""
    p, want = probe
    history = [{"role": "system", "content": text(300, 3)},
               {"role": "user", "content": text(150, 5)},
               {"role": "assistant", "content": text(100, 9)},
               {"role": "user", "content": text(250, 11)}]
    prompt = (await p.post("/apply-template", {"messages": history}))["prompt"]
    toks = (await p.post("/tokenize", {"content": prompt, "parse_special": True}))["tokens"]
    user = (await p.post("/tokenize", {"content": "<|im_start|>user",
                                       "parse_special": True}))["tokens"]
    users = [i for i in range(len(toks)) if toks[i:i + len(user)] == user]
    assert (len(toks), users) == (1790, [665, 1233])
    cached, log = await p.chat(history)
    assert cached == 0
    assert [c[2] for c in created(log)] == want.chat_points(len(toks), users)
    cached, _ = await p.chat([*history[:3], {"role": "user", "content": "Summarise."}])
    assert cached == want.chat_side
    cached, _ = await p.chat([*history[:1], {"role": "user", "content": "Title?"}])
    assert cached == want.chat_title


async def test_ram_cache_keeps_checkpoints(probe: tuple[Probe, Expect]) -> None:
    """A conversation pushed out of the slot by an unrelated prompt goes to the host-RAM
    cache with its checkpoints, and comes back for its continuation. The hybrid state
    comes back whole; the SWA part only for the last 256 positions, so the SWA model
    restores its checkpoint at n - 4 (cache_n = n - 5)."""
    p, want = probe
    base = ids(5)
    out, _ = await p.completion(base)
    _, log = await p.completion(ids(6))
    n_ckpt = len(want.first)
    assert RAM_ENTRY.findall(log)[-1] == (str(N + 3), str(n_ckpt))
    out, log = await p.completion(base + out["tokens"] + ids(32, 50))
    assert out["timings"]["cache_n"] == want.ram_continuation
