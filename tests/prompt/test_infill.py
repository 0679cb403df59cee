"""`/infill` prompt ids (proxy/prompt/infill.py) against the real pinned llama-server on
the `demo-coder` model (StarCoder's vocabulary, repo-level FIM tokens), and the route
through kvroute.

The servers run with -b 512 -n 64 and 2048 tokens per slot, so truncation shows with
short inputs: the prefix keeps its last 384 tokens, the suffix its first 126 less the
prompt, the extra context its last 2048 - 512 - 128 = 1408. Each comparison sends the
body to a one-slot server, then a /completion of our ids and one more token: it reuses
exactly all of our ids only if the slot holds them, id for id. A variant without the
repo and file-separator tokens, on a server started with --spm-infill, checks the other
layout (snippet separators, suffix first).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from proxy_client import proxy

from backends.config import ManagedBackendConfig
from backends.demo_model import (
    DEMO_KINDS,
    STARCODER,
    DemoModelParams,
    ensure_demo_model,
    write_model,
)
from backends.info import BackendInfo
from backends.supervisor import Supervisor
from proxy.config.load import Config
from proxy.prompt.builder import PromptBuilder
from proxy.prompt.infill import InfillShape, fim_missing, infill_ids
from proxy.prompt.tokenizer import FragmentTokenizer

SHAPE = InfillShape(n_batch=512, n_ctx=2048, n_predict=64)
ARGS = ("-b", "512", "-n", "64")
NAMES = ("alpha", "beta", "gamma", "delta", "value", "count", "items", "result")


def code(n_lines: int, seed: int) -> str:
    """Python-looking source, seeded: about 20 tokens a line."""
    r = random.Random(seed)
    out = []
    for i in range(n_lines):
        a, b = r.sample(NAMES, 2)
        out.append(f"    {a}_{i} = {b}_{r.randrange(1000)} + {r.randrange(100)}  # {i}\n")
    return "".join(out)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def coder(pool_config: Callable[..., Config]) -> AsyncIterator[Supervisor]:
    """Two demo-coder servers of one slot each, no RAM cache."""
    model = ensure_demo_model(kind="demo-coder")  # seconds the first time, then cached
    sup = await start(pool_config, model, 2, ARGS)
    try:
        yield sup
    finally:
        await sup.stop()


async def start(pool_config: Callable[..., Config], model: Path, n: int,
                args: tuple[str, ...]) -> Supervisor:
    cfg = pool_config(n=n, slots=1, ctx_per_slot=SHAPE.n_ctx, cache_ram_mib=0,
                      extra_args=args)
    backends = []
    for b in cfg.backends:
        assert isinstance(b, ManagedBackendConfig)
        backends.append(dataclasses.replace(b, model=model, alias="kvroute-demo-coder"))
    sup = Supervisor(dataclasses.replace(cfg, backends=tuple(backends)))
    await sup.start()
    assert len(sup.ready()) == n, sup.statuses()
    return sup


@pytest.fixture(scope="module")
def snippet_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small demo-coder without repo and file-separator tokens (llama.cpp does not
    find StarCoder's by their text)."""
    path = tmp_path_factory.mktemp("fim") / "coder-no-sep.gguf"
    spec = dataclasses.replace(DEMO_KINDS["demo-coder"], vocab=dataclasses.replace(
        STARCODER, fim={"pre": 1, "mid": 2, "suf": 3}))
    write_model(path, spec, DemoModelParams(n_layer=1, n_embd=64, n_head=2, n_head_kv=1,
                                            n_ff=128))
    return path


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def snippet(pool_config: Callable[..., Config], snippet_model: Path
                  ) -> AsyncIterator[Supervisor]:
    sup = await start(pool_config, snippet_model, 1, (*ARGS, "--spm-infill"))
    try:
        yield sup
    finally:
        await sup.stop()


@pytest.fixture(scope="module")
def coder_builder() -> PromptBuilder:
    return PromptBuilder.load(ensure_demo_model(kind="demo-coder"))


async def post(session: aiohttp.ClientSession, info: BackendInfo, path: str,
               body: dict[str, Any]) -> dict[str, Any]:
    async with session.post(info.url + path, json=body,
                            headers={"Authorization": f"Bearer {info.api_key}"}) as r:
        out: dict[str, Any] = await r.json()
        assert r.status == 200, out
        return out


FILE = code(120, seed=1)
CUT = FILE.index("    ", 2000)  # the cursor, at a line start
BODIES: dict[str, dict[str, Any]] = {
    "prefix only": {"input_prefix": "def f(x):\n    return", "input_suffix": ""},
    "prefix and suffix": {"input_prefix": FILE[:400], "input_suffix": FILE[400:700]},
    "extra chunks": {"input_prefix": FILE[:300], "input_suffix": FILE[300:500],
                     "input_extra": [{"filename": "util.py", "text": code(10, 2)},
                                     {"text": code(5, 3)},  # filename "tmp"
                                     {"filename": "", "text": ""}]},
    "prompt field": {"input_prefix": FILE[:200], "input_suffix": FILE[200:300],
                     "prompt": "    alpha<fim_pad> = "},  # special tokens parsed here
    "special text": {"input_prefix": "x = '<fim_prefix><file_sep>'\n",  # ...not here
                     "input_suffix": "<fim_middle>", "prompt": 7},  # not a string: ""
    "mixed prefix": {"input_prefix": ["def g():", 1000, "\n    "], "input_suffix": ["", 5]},
    "unicode": {"input_prefix": "s = 'héllo wörld ✓ 日本'\n", "input_suffix": "# 🙂\n"},
    "long, truncated": {"input_prefix": FILE[:CUT], "input_suffix": FILE[CUT:],
                        "prompt": "    beta",
                        "input_extra": [{"filename": f"m{i}.py", "text": code(60, 10 + i)}
                                        for i in range(4)]},
}


def test_the_demo_coder_vocabulary_has_repo_level_fim_tokens(
        coder_builder: PromptBuilder) -> None:
    tok = coder_builder.tokenizer
    assert tok.fim_ids() == (1, 3, 2, 5, 6)
    assert fim_missing(tok) == ""


@pytest.mark.parametrize("name", list(BODIES))
async def test_prompt_ids_are_the_servers(coder: Supervisor, coder_builder: PromptBuilder,
                                          name: str) -> None:
    ours = infill_ids(coder_builder.tokenizer, BODIES[name], SHAPE).tolist()
    if name == "long, truncated":
        # every part was cut: 1408 extra + <pre> 384 prompt(2) <suf> 124 <mid>
        assert len(ours) == 1408 + 1 + 384 + 2 + 1 + 124 + 1, len(ours)
    await same_ids(coder.ready()[0], BODIES[name], ours)


@pytest.mark.parametrize("name", ["prefix and suffix", "extra chunks", "long, truncated"])
async def test_prompt_ids_without_file_separators_suffix_first(
        snippet: Supervisor, snippet_model: Path, name: str) -> None:
    tok = FragmentTokenizer(snippet_model)
    assert tok.fim_ids() == (1, 3, 2, -1, -1)
    ours = infill_ids(tok, BODIES[name], dataclasses.replace(SHAPE, spm=True)).tolist()
    assert ours[-1] == 2 and 3 in ours[:len(ours) - 1]
    assert ours.index(3) < ours.index(1)  # <suf> before <pre>
    await same_ids(snippet.ready()[0], BODIES[name], ours)


async def same_ids(info: BackendInfo, body: dict[str, Any], ours: list[int]) -> None:
    """The server's prompt for `body` is `ours`: as long, and the slot holds them."""
    async with aiohttp.ClientSession() as session:
        got = await post(session, info, "/infill", {**body, "n_predict": 1,
                                                     "temperature": 0})
        assert got["tokens_evaluated"] == len(ours)
        assert got["timings"]["prompt_n"] + got["timings"]["cache_n"] == len(ours)
        again = await post(session, info, "/completion", {
            "prompt": [*ours, 11], "n_predict": 1, "temperature": 0, "cache_prompt": True})
    assert again["timings"]["cache_n"] == len(ours), "the slot holds other ids"


async def test_refusals_are_the_servers(coder: Supervisor) -> None:
    """What the server refuses, kvroute refuses with its message (a missing input, which
    the server fails on with a 500, gets a 400 naming it)."""
    async with proxy(coder) as client:
        for body, status, message in [
            ({"input_suffix": ""}, 400, '"input_prefix" is required'),
            ({"input_prefix": "", "input_suffix": "", "input_extra": [{"filename": "a"}]},
             400, 'extra_context chunk must contain a "text" field'),
            ({"input_prefix": "", "input_suffix": "",
              "input_extra": [{"filename": None, "text": ""}]},
             400, 'chunk\'s "filename" field must be a string'),
            ({"input_prefix": "", "input_suffix": "", "input_extra": {}},
             400, '"input_extra" must be an array'),
        ]:
            async with client.post("/infill", json=body) as r:
                error = (await r.json())["error"]
                assert r.status == status and message in error["message"], error
        # an input the port does not model goes to a backend as it is: it answers
        async with client.post("/infill", json={"input_prefix": {"a": 1},
                                                "input_suffix": ""}) as r:
            assert r.status == 500, await r.text()
            assert "X-Kvroute-Predicted-Cached" not in r.headers


async def test_infill_is_routed_by_prefix_and_predicted(coder: Supervisor) -> None:
    """Two completions in one file, the cursor moved down between them: the second goes
    to the slot of the first and reuses the extra context and the prefix before the
    first cursor, as predicted; the same request again reuses all but its last token."""
    extra = [{"filename": "util.py", "text": code(20, 40)}]
    text = code(60, seed=41)
    # both prefixes within the 384 tokens the server keeps (about 20 tokens a line)
    first, second = text.index("    ", 300), text.index("    ", 600)
    rows = []
    async with proxy(coder) as client:
        for cut in (first, second, second):  # the last: the same request again
            body = {"input_prefix": text[:cut], "input_suffix": text[cut:],
                    "input_extra": extra, "n_predict": 8, "temperature": 0}
            async with client.post("/infill", json=body) as r:
                data = await r.json()
                assert r.status == 200, data
                rows.append((r.headers["X-Kvroute-Backend"], r.headers["X-Kvroute-Slot"],
                             int(r.headers["X-Kvroute-Predicted-Cached"]),
                             r.headers["X-Kvroute-Tier"], int(data["timings"]["cache_n"]),
                             int(data["tokens_evaluated"])))
    (b1, s1, _, _, _, n1), *again = rows
    for b, s, predicted, tier, reused, n in again:
        assert (b, s, tier) == (b1, s1, "slot"), rows
        assert reused > n1 // 2, rows  # the extra context and most of the first prefix
        assert abs(predicted - reused) <= max(16, 0.02 * n), rows
    assert again[1][4] == again[1][5] - 1, rows  # the same prompt: all but its last token


async def test_a_model_without_fim_tokens_gets_the_servers_answer(
        backend_pool: Any) -> None:
    """The plain demo model's vocabulary has no FIM tokens: the server says so."""
    sup = await backend_pool(n=1, slots=1, ctx_per_slot=16384, cache_ram_mib=0)
    async with proxy(sup) as client, client.post(
            "/infill", json={"input_prefix": "a", "input_suffix": "b"}) as r:
        text = await r.text()
    assert r.status == 501, (r.status, text)
    assert "Infill is not supported by this model" in text, text


async def test_a_truncated_infill_is_predicted_with_the_servers_shape(
        coder: Supervisor, coder_builder: PromptBuilder) -> None:
    """kvroute reads the backends' -b, -n and context: a long body, cut as the servers
    cut it, sent twice, is predicted to reuse all but its last token."""
    body = {**BODIES["long, truncated"], "n_predict": 4, "temperature": 0}
    n = len(infill_ids(coder_builder.tokenizer, body, SHAPE))
    rows = []
    async with proxy(coder) as client:
        for _ in range(2):
            async with client.post("/infill", json=body) as r:
                data = await r.json()
                assert r.status == 200, data
                rows.append((int(r.headers["X-Kvroute-Predicted-Cached"]),
                             int(data["timings"]["cache_n"]), int(data["tokens_evaluated"])))
    assert [row[2] for row in rows] == [n, n], rows
    predicted, reused, _ = rows[1]
    assert reused == n - 1 and abs(predicted - reused) <= max(16, 0.02 * n), rows
