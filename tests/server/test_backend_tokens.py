"""Prompt ids from the backend itself, where kvroute's own cannot be had or are not exact:
no local GGUF (external backends only), a backend whose chat template differs from the
GGUF's, a request the local renderer refuses. Each against a real llama-server: the
answer is the server's, and the next turn's predicted reuse is what the server reports."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient
from fake_backend import FakeBackend
from faults import external, until
from proxy_client import proxy
from texts import words

from backends.binary import llama_cpp_source
from backends.process import LlamaServerProcess, ServerSpec, free_port
from proxy.config.settings import ProxySettings
from proxy.prompt.builder import PromptBuilder
from proxy.prompt.chat_request import PromptError
from proxy.server.backend_tokens import NoBackendIds
from proxy.server.keys import METRICS, TOKENIZING

pytestmark = pytest.mark.timeout(180)

# The local template refuses a request holding this word (the backend's does not).
REFUSED = "REFUSEDHERE"


@contextlib.asynccontextmanager
async def server(llama_server_bin: Path, demo_model: Path, log: Path,
                 template: Path | None = None) -> AsyncIterator[str]:
    """One llama-server of the demo model (optionally with another chat template)."""
    extra = ("--chat-template-file", str(template)) if template else ()
    proc = LlamaServerProcess(ServerSpec(llama_server_bin, demo_model, free_port(), slots=2,
                                         ctx_per_slot=4096, cache_ram_mib=0,
                                         alias="kvroute-demo", extra_args=extra), log)
    proc.spawn()
    try:
        async with aiohttp.ClientSession() as http:
            ready = await proc.wait_ready(http, 120)
            assert hasattr(ready, "seconds"), ready
        yield proc.spec.url
    finally:
        await proc.stop()


async def conversation(client: TestClient[Any, Any], seed: int, turns: int = 3,
                       first: str = "") -> list[tuple[int, int]]:
    """(predicted, reported) reuse of each turn after the first of one conversation."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": words(40, seed)}]
    out = []
    for turn in range(turns):
        text = (first if turn == 0 else "") + " " + words(30, seed * 10 + turn)
        messages.append({"role": "user", "content": text})
        async with client.post("/v1/chat/completions", json={
                "model": "kvroute-demo", "max_tokens": 4, "messages": messages}) as r:
            assert r.status == 200, await r.text()
            body = await r.json()
            predicted = int(r.headers["X-Kvroute-Predicted-Cached"])
        if turn:
            out.append((predicted, int(body["timings"]["cache_n"])))
        # a fixed answer in the history: what a slot holds past its prompt (the sampled
        # tokens) is only known where kvroute can tokenize the answer itself
        assert body["choices"][0]["message"] is not None
        messages.append({"role": "assistant", "content": "Noted."})
    return out


def counted(client: TestClient[Any, Any], reason: str) -> float:
    metrics = client.server.app[METRICS]
    return metrics.child(metrics.tokens_from_backend, reason)._value.get()  # type: ignore[no-any-return]


async def test_external_backend_without_a_local_gguf_is_routed_on_its_own_ids(
        llama_server_bin: Path, demo_model: Path, tmp_path: Path) -> None:
    async with server(llama_server_bin, demo_model, tmp_path / "a.log") as url, \
            external(tmp_path, {"a": (url, None)}) as sup, proxy(sup) as client:
        assert client.server.app[TOKENIZING].source == "backend (no_tokenizer)"
        turns = await conversation(client, 1)
        assert all(abs(p - r) <= 1 and r > 40 for p, r in turns), turns
        assert counted(client, "no_tokenizer") == 3
        async with client.post("/v1/messages", json={
                "model": "kvroute-demo", "max_tokens": 4,
                "messages": [{"role": "user", "content": words(20, 5)}]}) as r:
            assert r.status == 200, await r.text()
            assert r.headers["X-Kvroute-Backend"] == "a"
        async with client.get("/kvroute/status") as r:
            assert (await r.json())["tokenizer"] == "backend (no_tokenizer)"


async def test_a_backend_with_another_template_switches_to_its_ids(
        llama_server_bin: Path, demo_model: Path, tmp_path: Path) -> None:
    """The server was started with a template the GGUF kvroute tokenizes with does not
    have: the check at ready finds the difference, and every turn is then exact."""
    other = (llama_cpp_source() / "vendor" / "llama.cpp" / "models" / "templates"
             / "microsoft-Phi-3.5-mini-instruct.jinja")
    settings = ProxySettings(tokenizer=demo_model)
    async with server(llama_server_bin, demo_model, tmp_path / "a.log", other) as url, \
            external(tmp_path, {"a": (url, None)}) as sup, proxy(sup, settings) as client:
        tok = client.server.app[TOKENIZING]
        await until(lambda: tok.inexact is not None, 30)
        assert tok.source.startswith("backend (inexact: probe 0: token ")
        turns = await conversation(client, 2)
        assert all(abs(p - r) <= 1 and r > 40 for p, r in turns), turns
        assert counted(client, "inexact") == 3


async def test_a_request_the_local_renderer_refuses_gets_the_backends_ids(
        llama_server_bin: Path, demo_model: Path, tmp_path: Path) -> None:
    """The local template is the backend's, except that it refuses requests holding a
    word: those get the backend's ids (and its answer), the others stay local."""
    same = PromptBuilder.load(demo_model).template.source
    refusing = ("{%- for m in messages -%}{%- if m.content is string and '" + REFUSED
                + "' in m.content -%}{{ raise_exception('not here') }}{%- endif -%}"
                "{%- endfor -%}" + same)
    settings = ProxySettings(tokenizer=demo_model)
    async with server(llama_server_bin, demo_model, tmp_path / "a.log") as url, \
            external(tmp_path, {"a": (url, None)}) as sup, proxy(sup, settings) as client:
        tok = client.server.app[TOKENIZING]
        await until(lambda: url in tok.verified, 30)  # the GGUF's template: alike
        tok.prompt = PromptBuilder.load(demo_model, chat_template=refusing)
        with pytest.raises(PromptError):
            tok.prompt.chat_ids({"messages": [{"role": "user", "content": REFUSED}]})
        turns = await conversation(client, 3, first=REFUSED)
        assert all(abs(p - r) <= 1 and r > 40 for p, r in turns), turns
        assert counted(client, "render_failed") == 3  # every turn holds the word
        assert await conversation(client, 4) and counted(client, "render_failed") == 3
        assert tok.inexact is None and tok.source == "local"


async def test_a_prompt_the_server_fails_to_build_gets_its_status(
        backend_pool: Any) -> None:
    """Qwen3.5's template raises on a second system message; the server answers 500 for
    that (its specialized handler reports the template's failure as its own): so does
    kvroute, where a plain template's refusal is a 400."""
    template = (llama_cpp_source() / "vendor" / "llama.cpp" / "models" / "templates"
                / "Qwen3.5-4B.jinja")
    sup = await backend_pool(n=1, fresh=True, cache_ram_mib=0,
                             extra_args=("--chat-template-file", str(template)))
    two_systems = [{"role": "system", "content": "Be brief."},
                   {"role": "system", "content": "Answer in English."},
                   {"role": "user", "content": "Hi"}]
    info = sup.ready()[0]
    async with proxy(sup) as client, aiohttp.ClientSession() as http:
        body = {"model": "kvroute-demo", "max_tokens": 2, "messages": two_systems}
        async with http.post(info.url + "/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {info.api_key}"}) as r:
            assert r.status == 500
        async with client.post("/v1/chat/completions", json=body) as r:
            assert r.status == 500
            assert "System message must be at the beginning" in (await r.json())["error"][
                "message"]


async def test_continued_final_messages_take_the_backends_rendering_where_it_differs(
        backend_pool: Any) -> None:
    """Qwen3.5's server reopens a continued assistant message with the reasoning tags it
    infers; kvroute's renderer does not: the check at ready finds it, and continuations
    (only those) are rendered by the backend, tokenized here, predicted exactly."""
    template = (llama_cpp_source() / "vendor" / "llama.cpp" / "models" / "templates"
                / "Qwen3.5-4B.jinja")
    sup = await backend_pool(n=1, slots=1, fresh=True, cache_ram_mib=0,
                             extra_args=("--chat-template-file", str(template)))
    async with proxy(sup) as client:
        tok = client.server.app[TOKENIZING]
        await until(lambda: tok.continuation is not None, 30)
        assert tok.inexact is None and tok.source.startswith("local (backend for ")
        body = {"model": "kvroute-demo", "max_tokens": 2, "messages": [
            {"role": "user", "content": words(200, 11)},
            {"role": "assistant", "content": words(30, 12)}]}
        got = []
        for _ in range(2):  # the same request again: all but its last token reused
            async with client.post("/v1/chat/completions", json=body) as r:
                data = await r.json()
                assert r.status == 200, data
                got.append((int(r.headers["X-Kvroute-Predicted-Cached"]),
                            data["timings"]["cache_n"]))
        assert got[1][0] == got[1][1] > 200, got
        assert counted(client, "continuation") == 2


# A plain template refusing a word with a message longer than the part of an error body
# the backend client keeps (500 characters).
LONG_REFUSAL = ("{%- for m in messages -%}{%- if 'LONGFAIL' in m.content -%}"
                "{{ raise_exception('This template refuses the word LONGFAIL:"
                + " the reason is long." * 30 + "') }}{%- endif -%}"
                "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
                "{%- endfor -%}{%- if add_generation_prompt -%}"
                "{{ '<|im_start|>assistant\\n' }}{%- endif -%}")


@pytest.mark.parametrize("case", ["specialized", "long"])
async def test_a_request_the_server_refuses_gets_its_answer_without_a_local_gguf(
        llama_server_bin: Path, demo_model: Path, tmp_path: Path, case: str) -> None:
    """No local GGUF: the ids come from the backend's `/apply-template`, which refuses
    the request as its chat endpoint does. The client gets that answer (status, type,
    message; cut where the message is long), not a 503 to retry, and never the backend's
    address. Qwen3.5's handler reports its template's failure as a 500; a plain template's
    is a 400."""
    if case == "specialized":
        template = (llama_cpp_source() / "vendor" / "llama.cpp" / "models" / "templates"
                    / "Qwen3.5-4B.jinja")
        messages = [{"role": "system", "content": "Be brief."},
                    {"role": "system", "content": "Answer in English."},
                    {"role": "user", "content": "Hi"}]
    else:
        template = tmp_path / "long.jinja"
        template.write_text(LONG_REFUSAL)
        messages = [{"role": "user", "content": "LONGFAIL"}]
    body = {"model": "kvroute-demo", "max_tokens": 2, "messages": messages}
    async with server(llama_server_bin, demo_model, tmp_path / "a.log", template) as url, \
            external(tmp_path, {"a": (url, None)}) as sup, proxy(sup) as client, \
            aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/chat/completions", json=body) as r:
            status, theirs = r.status, (await r.json())["error"]
        assert status == (500 if case == "specialized" else 400)
        async with client.post("/v1/chat/completions", json=body) as r:
            text = await r.text()
            assert (r.status, "Retry-After" in r.headers) == (status, False), text
        assert url.split("//")[1] not in text
        ours = json.loads(text)["error"]
        if case == "specialized":
            assert (ours["message"], ours["type"]) == (theirs["message"], theirs["type"])
            return
        assert ours["message"].endswith(" ...") and len(ours["message"]) > 300
        assert theirs["message"].startswith(ours["message"][:-4])
        async with client.post("/v1/messages", json=body) as r:  # in Anthropic's format
            data = await r.json()
            assert r.status == 400, data
        assert data["error"]["type"] == "invalid_request_error"
        assert theirs["message"].startswith(data["error"]["message"][:-4])


async def test_a_backend_that_cannot_render_serves_the_request_unrouted(
        demo_model: Path, tmp_path: Path) -> None:
    """A backend without `/apply-template` (an older llama-server, another OpenAI-style
    server) says nothing against the request: without a local GGUF it is served as it is,
    unrouted, as before kvroute asked backends for ids. `NoBackendIds` names the backend,
    never its address."""
    fake = FakeBackend()
    await fake.start()
    try:
        async with external(tmp_path, {"f": (fake.url, None)}) as sup, \
                proxy(sup) as client:
            body = {"model": "kvroute-demo", "max_tokens": 4,
                    "messages": [{"role": "user", "content": "Hello."}]}
            with pytest.raises(NoBackendIds) as got:
                await client.server.app[TOKENIZING].chat(64, body, None)
            assert "f answered 404" in got.value.message
            assert fake.url.split("//")[1] not in got.value.message
            async with client.post("/v1/chat/completions", json=body) as r:
                data = await r.json()
                assert r.status == 200, data
            assert data["choices"][0]["message"]["content"] == "ok"
            async with client.post("/v1/messages", json=body) as r:
                data = await r.json()
                assert r.status == 200, data
            assert data["content"] == [{"type": "text", "text": "ok"}]
            assert [p for p, _, _ in fake.requests] == ["/v1/chat/completions"] * 2
            assert all(b"id_slot" not in raw for _, _, raw in fake.requests)
    finally:
        await fake.stop()


def nested_tool(depth: int) -> bytes:
    """A chat body whose one tool's parameters nest `depth` objects deep (2 JSON levels
    each: orjson, and so kvroute, parses up to 1024 levels; llama-server has no limit)."""
    schema = '{"type":"object","properties":{"a":' * depth + '{"type":"string"}' \
        + "}}" * depth
    return ('{"model":"kvroute-demo","max_tokens":2,"messages":[{"role":"user","content":'
            '"Fill in the form."}],"tools":[{"type":"function","function":{"name":"f",'
            '"description":"A form.","parameters":' + schema + "}}]}").encode()


async def test_a_tool_schema_too_deep_for_the_local_renderer_is_rendered_by_the_backend(
        backend_pool: Any) -> None:
    """Jinja's `tojson` of a schema nested 500 deep exceeds Python's recursion limit here;
    llama-server serves it. The backend renders it (its ids, exact: the same request
    again is predicted as the server reuses it), and the proxy goes on serving."""
    sup = await backend_pool(n=1)
    info = sup.ready()[0]
    raw = nested_tool(500)
    headers = {"Content-Type": "application/json"}
    async with proxy(sup) as client, aiohttp.ClientSession() as http:
        async with http.post(info.url + "/apply-template", data=raw, headers={
                **headers, "Authorization": f"Bearer {info.api_key}"}) as r:
            assert r.status == 200, await r.text()
        got = []
        for _ in range(2):
            async with client.post("/v1/chat/completions", data=raw, headers=headers) as r:
                data = await r.json()
                assert r.status == 200, data
                got.append((int(r.headers["X-Kvroute-Predicted-Cached"]),
                            data["timings"]["cache_n"]))
        assert abs(got[1][0] - got[1][1]) <= 1 and got[1][1] > 5000, got
        assert counted(client, "render_failed") == 2
        turns = await conversation(client, 5, turns=2)
        assert all(abs(p - r) <= 1 for p, r in turns), turns
