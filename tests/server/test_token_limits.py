"""`proxy.max_tokens_cap`: what a request may ask to generate, on every generating API.

llama-server reads `max_tokens: -1` (`max_output_tokens: -1` on Responses), a null limit
and no limit at all alike: "no limit of the request's own", so its `-n`, and with no
`-n` the generation runs until the slot's context is full, thousands of tokens on a
CPU. The OpenAI SDK, Responses clients and `/completion` callers leave the limit out
unless told. With a cap, each of these, and a request asking for more than the cap, gets
the cap; never a refusal. Through real llama-server backends (no `-n`, 8192 tokens a
slot): a request the cap misses runs past the client's timeout.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio
import yaml
from aiohttp.test_utils import TestServer
from texts import words

from proxy.app import create_app
from proxy.config.fields import ConfigError
from proxy.config.load import load_config
from proxy.config.settings import ProxySettings
from proxy.server.validate import capped_lengths

pytestmark = pytest.mark.timeout(300)

CAP = 8
# a request that is not capped runs for minutes: it fails here instead
CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=60)


# ------------------------------------------------------------------------ pure
# (body, cap, slot_ctx, the field a limit is added as, fields rewritten)
CASES: list[tuple[dict[str, Any], int | None, int | None, str, dict[str, int]]] = [
    ({"max_tokens": -1}, 8, 8192, "max_tokens", {"max_tokens": 8}),
    ({"max_tokens": 9}, 8, 8192, "max_tokens", {"max_tokens": 8}),
    ({"max_tokens": 8}, 8, 8192, "max_tokens", {}),
    ({"max_tokens": 0}, 8, 8192, "max_tokens", {}),  # 0: only the prompt is processed
    # no limit given (absent, or null: the server reads both as -1): the cap, in the
    # field the endpoint's API names the limit by
    ({}, 8, 8192, "max_tokens", {"max_tokens": 8}),
    ({}, 8, 8192, "n_predict", {"n_predict": 8}),
    ({"max_tokens": None}, 8, 8192, "max_tokens", {"max_tokens": 8}),
    ({"n_predict": None, "max_tokens": None}, 8, None, "n_predict", {"n_predict": 8}),
    ({"n_predict": None, "max_completion_tokens": None}, 8, 8192, "max_tokens",
     {"max_tokens": 8}),
    # a limit given by any alias is the limit: none added
    ({"n_predict": None, "max_tokens": 5}, 8, 8192, "n_predict", {}),
    ({"max_completion_tokens": 5}, 8, 8192, "max_tokens", {}),
    ({"max_tokens": "9"}, 8, 8192, "max_tokens", {}),  # a wrong type is check_fields' 400
    ({"max_completion_tokens": 100, "n_predict": -1}, 8, 8192, "max_tokens",
     {"max_completion_tokens": 8, "n_predict": 8}),
    ({"n_predict": 10**6}, 8, None, "n_predict", {"n_predict": 8}),
    # no cap configured: the slot's context bounds a limit; -1, null and absent are the
    # server's own default (its -n, else the slot's context)
    ({"max_tokens": 10**6}, None, 8192, "max_tokens", {"max_tokens": 8192}),
    ({"max_tokens": -1}, None, 8192, "max_tokens", {}),
    ({"max_tokens": 8192}, None, 8192, "max_tokens", {}),
    ({}, None, 8192, "max_tokens", {}),
    ({}, None, 8192, "n_predict", {}),
    ({"max_tokens": None}, None, 8192, "max_tokens", {}),
    ({"max_tokens": 10**6}, None, None, "max_tokens", {}),  # no backend up: no bound
    ({}, None, None, "max_tokens", {}),
]


@pytest.mark.parametrize(("body", "cap", "slot_ctx", "key", "want"), CASES)
def test_capped_lengths(body: dict[str, Any], cap: int | None, slot_ctx: int | None,
                        key: str, want: dict[str, int]) -> None:
    assert capped_lengths(body, cap, slot_ctx, key=key) == want


@pytest.mark.parametrize(("value", "want"), [(8, 8), (None, None), (32000, 32000)])
def test_config_knob(tmp_path: Path, value: Any, want: int | None) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"proxy": {"max_tokens_cap": value},
                                    "backends": [{"name": "a", "url": "http://x:1"}]}))
    assert load_config(path, check_port=False).proxy.settings.max_tokens_cap == want


@pytest.mark.parametrize("value", [0, -1, "many", 8.5, True])
def test_config_knob_refused(tmp_path: Path, value: Any) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"proxy": {"max_tokens_cap": value},
                                    "backends": [{"name": "a", "url": "http://x:1"}]}))
    with pytest.raises(ConfigError, match=r"proxy\.max_tokens_cap: expected a positive integer"):
        load_config(path, check_port=False)


# ------------------------------------------------------------ real backends
@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def url(backend_pool: Any) -> AsyncIterator[str]:
    sup = await backend_pool()
    server = TestServer(create_app(sup.config, sup, ProxySettings(max_tokens_cap=CAP)),
                        handler_cancellation=True)
    await server.start_server()
    yield str(server.make_url("")).rstrip("/")
    await server.close()


async def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http, \
            http.post(url + path, json=body) as r:
        data = await r.json()
        assert r.status == 200, data
        return data  # type: ignore[no-any-return]


MSGS = [{"role": "user", "content": words(40, 901)}]


# {}: the OpenAI SDK's default; null reads as absent
@pytest.mark.parametrize("limit", [{"max_tokens": -1}, {"max_completion_tokens": -1},
                                   {"max_tokens": 100000}, {}, {"max_tokens": None}],
                         ids=["-1", "max_completion_tokens -1", "100000", "absent", "null"])
async def test_chat(url: str, limit: dict[str, int]) -> None:
    data = await post(url, "/v1/chat/completions", {"messages": MSGS, **limit})
    assert data["usage"]["completion_tokens"] <= CAP
    assert data["choices"][0]["finish_reason"] == "length"


async def test_chat_openai_sdk(url: str) -> None:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=60,
                                max_retries=0)
    async with client:
        answer = await client.chat.completions.create(model="m", messages=MSGS)
    assert answer.usage is not None and answer.usage.completion_tokens <= CAP
    assert answer.choices[0].finish_reason == "length"


async def test_chat_streamed(url: str) -> None:
    body = {"messages": MSGS, "max_tokens": -1, "stream": True,
            "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http, \
            http.post(url + "/v1/chat/completions", json=body) as r:
        text = await r.text()
    assert r.status == 200 and text.rstrip().endswith("data: [DONE]")
    chunks = [json.loads(ln[6:]) for ln in text.splitlines()
              if ln.startswith("data: {")]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")][-1] == \
        "length"
    assert chunks[-1]["usage"]["completion_tokens"] <= CAP


@pytest.mark.parametrize("path", ["/completion", "/completions"])
@pytest.mark.parametrize("limit", [{"n_predict": -1}, {}, {"n_predict": None}],
                         ids=["-1", "absent", "null"])
async def test_completion(url: str, path: str, limit: dict[str, int]) -> None:
    data = await post(url, path, {"prompt": words(40, 902), **limit})
    assert data["tokens_predicted"] <= CAP and data["stop_type"] == "limit"


@pytest.mark.parametrize("limit", [{"max_tokens": -1}, {}], ids=["-1", "absent"])
async def test_openai_completions(url: str, limit: dict[str, int]) -> None:
    data = await post(url, "/v1/completions", {"prompt": words(40, 904), **limit})
    assert data["usage"]["completion_tokens"] <= CAP
    assert data["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("limit", [{"max_output_tokens": -1}, {}], ids=["-1", "absent"])
async def test_responses(url: str, limit: dict[str, int]) -> None:
    data = await post(url, "/v1/responses", {"input": words(40, 903), **limit})
    assert 0 < data["usage"]["output_tokens"] <= CAP


async def test_messages(url: str) -> None:
    data = await post(url, "/v1/messages", {"max_tokens": 100000, "messages": MSGS})
    assert data["usage"]["output_tokens"] <= CAP and data["stop_reason"] == "max_tokens"
