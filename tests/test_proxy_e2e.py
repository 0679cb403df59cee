"""The proxy in front of real llama-server backends (demo model): affinity, spreading,
return-to-prefix, prediction accuracy, streaming relay, pass-through, headers, status.

Prompts are seeded word salad (about one token per word) so each test's content is its
own, even on a shared pool whose caches are warm from earlier tests.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

from aiohttp.test_utils import TestClient
from proxy_client import proxy
from texts import words

from proxy.config.settings import ProxySettings
from proxy.server.keys import ROUTER


def cached_of(body: dict[str, Any]) -> int:
    return int(body["timings"]["cache_n"])


class Accuracy:
    """|predicted - reported| <= max(16, 2% of the prompt) for >= 99% of requests."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, int]] = []  # (predicted, reported, prompt tokens)

    def add(self, headers: Any, body: dict[str, Any]) -> None:
        pt = int(body["usage"]["prompt_tokens"])
        self.rows.append((int(headers["X-Kvroute-Predicted-Cached"]), cached_of(body), pt))

    def bad(self) -> list[tuple[int, int, int]]:
        return [r for r in self.rows if abs(r[0] - r[1]) > max(16, 0.02 * r[2])]

    def check(self) -> None:
        bad = self.bad()
        assert len(bad) <= 0.01 * len(self.rows), f"mispredicted {bad} of {len(self.rows)}"


async def chat(client: TestClient[Any, Any], messages: list[dict[str, str]], *,
               max_tokens: int = 12, **extra: Any) -> tuple[Any, dict[str, Any]]:
    body = {"model": "kvroute-demo", "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, **extra}
    async with client.post("/v1/chat/completions", json=body) as r:
        data = await r.json()
        assert r.status == 200, data
        return r.headers, data


async def test_conversation_stays_on_one_backend_and_reuses_its_history(backend_pool: Any
                                                                        ) -> None:
    sup = await backend_pool()
    acc = Accuracy()
    async with proxy(sup) as client:
        messages = [{"role": "system", "content": words(400, 1)}]
        backends, prev_total = set(), 0
        for turn in range(6):
            messages.append({"role": "user", "content": words(60, 100 + turn)})
            headers, data = await chat(client, messages)
            backends.add(headers["X-Kvroute-Backend"])
            acc.add(headers, data)
            if turn:
                assert cached_of(data) >= 0.95 * prev_total, (turn, data["timings"])
            usage = data["usage"]
            prev_total = usage["prompt_tokens"] + usage["completion_tokens"]
            messages.append({"role": "assistant",
                             "content": data["choices"][0]["message"]["content"] or ""})
    assert len(backends) == 1
    acc.check()


async def test_any_model_name_is_served_as_llama_server_serves_it(backend_pool: Any) -> None:
    """llama-server answers whatever `model` a client names (it serves one); so does
    kvroute, unless told `strict_models`: then a name no backend serves is a 404."""
    sup = await backend_pool()
    for strict, status in ((False, 200), (True, 404)):
        async with proxy(sup, ProxySettings(strict_models=strict)) as client:
            async with client.post("/v1/chat/completions", json={
                    "model": "gpt-4o", "max_tokens": 2,
                    "messages": [{"role": "user", "content": words(10, 9)}]}) as r:
                data = await r.json()
                assert r.status == status, data
            if strict:
                assert data["error"]["code"] == "model_not_found"
                assert "kvroute-demo" in data["error"]["message"]


async def test_cache_prompt_false_is_predicted_to_reuse_nothing(backend_pool: Any) -> None:
    """A client's `cache_prompt: false`: the server reuses nothing (and still caches the
    prompt). The router predicted its usual reuse and counted a misprediction."""
    sup = await backend_pool()
    async with proxy(sup) as client:
        messages = [{"role": "user", "content": words(300, 77)}]
        await chat(client, messages)
        before = client.server.app[ROUTER].snapshot()["mispredictions"]
        headers, data = await chat(client, messages, cache_prompt=False)
        assert int(headers["X-Kvroute-Predicted-Cached"]) == cached_of(data) == 0
        headers, data = await chat(client, messages)  # the slot holds it, as modelled
        assert int(headers["X-Kvroute-Predicted-Cached"]) == cached_of(data) > 250
        assert client.server.app[ROUTER].snapshot()["mispredictions"] == before


async def test_shared_system_prompt_spreads_over_both_backends(backend_pool: Any) -> None:
    sup = await backend_pool()
    acc = Accuracy()
    system = {"role": "system", "content": words(2000, 7)}
    async with proxy(sup) as client:
        firsts = await asyncio.gather(*(
            chat(client, [system, {"role": "user", "content": words(40, 200 + i)}])
            for i in range(8)))
        for headers, data in firsts:
            acc.add(headers, data)
    per: dict[str, int] = {}
    for headers, _ in firsts:
        per[headers["X-Kvroute-Backend"]] = per.get(headers["X-Kvroute-Backend"], 0) + 1
    assert len(per) == 2 and max(per.values()) <= 5, per
    # the four that found no idle slot wait on the server, unpinned, and reuse the shared
    # prefix in the slot that frees: the router must predict that too
    acc.check()


async def test_conversations_return_to_their_own_prefix(backend_pool: Any) -> None:
    # 4 slots for 3 conversations: each can keep a slot of its own, and a router that
    # packs them onto the shared prefix (displacing another's history) fails this.
    sup = await backend_pool(fresh=True)
    acc = Accuracy()
    shared = words(800, 11)
    convs = {name: [{"role": "system", "content": shared},
                    {"role": "user", "content": words(300, 300 + i)}]
             for i, name in enumerate("ABC")}
    first_prompt: dict[str, int] = {}
    returns: list[tuple[str, int, int]] = []
    async with proxy(sup) as client:
        for rnd in range(2):
            for name in "ABC":
                msgs = convs[name]
                headers, data = await chat(client, msgs)
                acc.add(headers, data)
                if rnd == 0:
                    first_prompt[name] = data["usage"]["prompt_tokens"]
                    msgs.append({"role": "assistant",
                                 "content": data["choices"][0]["message"]["content"] or ""})
                    msgs.append({"role": "user", "content": words(30, 400 + ord(name))})
                else:
                    returns.append((name, cached_of(data), first_prompt[name]))
    acc.check()  # the proxy's part: exact tokens and feedback make predictions right
    # packing B onto A's slot for the shared prefix would truncate A's own history (the
    # server keeps, not saves, a slot that similar): each must get its prompt back
    short = [r for r in returns if r[1] < r[2]]
    assert not short, f"a conversation lost its own prefix: {short}"


async def routed_on_head(client: TestClient[Any, Any]) -> int:
    async with client.get("/metrics") as r:
        found = re.search(r"^kvroute_routed_on_head_total (\S+)$", await r.text(), re.M)
    assert found, "metric missing"
    return int(float(found.group(1)))


async def test_turns_are_sent_before_their_new_text_is_tokenized(backend_pool: Any) -> None:
    """A turn whose history was seen is routed on that history and sent while its new text
    is tokenized; its prediction (header, feedback) is still the whole prompt's, and the
    conversation stays put. Mostly new text (on a known system prompt) is tokenized whole
    before routing."""
    sup = await backend_pool()
    acc = Accuracy()
    async with proxy(sup) as client:
        messages = [{"role": "system", "content": words(400, 31)}]
        backends = set()
        for turn in range(4):
            messages.append({"role": "user", "content": words(60, 300 + turn)})
            headers, data = await chat(client, messages)
            backends.add(headers["X-Kvroute-Backend"])
            acc.add(headers, data)
            messages.append({"role": "assistant",
                             "content": data["choices"][0]["message"]["content"] or ""})
        assert await routed_on_head(client) >= 3  # all but the first turn
        # streamed: the header goes out with the first event, once the rest is known
        messages.append({"role": "user", "content": words(60, 399)})
        body = {"messages": messages, "max_tokens": 4, "stream": True, "temperature": 0,
                "stream_options": {"include_usage": True}}
        async with client.post("/v1/chat/completions", json=body) as r:
            predicted = int(r.headers["X-Kvroute-Predicted-Cached"])
            backends.add(r.headers["X-Kvroute-Backend"])
            text = await r.text()
        final = [json.loads(ln[5:]) for ln in text.splitlines()
                 if ln.startswith("data:") and '"timings"' in ln][-1]
        assert abs(predicted - final["timings"]["cache_n"]) <= 16, (predicted, final)
        assert await routed_on_head(client) >= 4
        before = await routed_on_head(client)
        await chat(client, [messages[0], {"role": "user", "content": words(2000, 77)}])
        assert await routed_on_head(client) == before
    acc.check()
    assert len(backends) == 1


async def test_stream_is_relayed_chunk_by_chunk(backend_pool: Any) -> None:
    sup = await backend_pool()
    body = {"messages": [{"role": "user", "content": words(50, 21)}], "max_tokens": 48,
            "stream": True, "ignore_eos": True}
    async with proxy(sup) as client, client.post("/v1/chat/completions", json=body) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        assert r.headers["X-Kvroute-Backend"] in {i.name for i in sup.ready()}
        arrivals: list[tuple[float, bytes]] = []
        async for line in r.content:
            if line.startswith(b"data:"):
                arrivals.append((time.perf_counter(), line))
    payloads = [ln[5:].strip() for _, ln in arrivals]
    assert payloads[-1] == b"[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    # usage was not asked for: the proxy asked on its behalf and must strip that chunk
    assert not any("usage" in c for c in chunks)
    content = [t for (t, _), c in zip(arrivals, chunks, strict=False)
               if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(content) >= 10
    # generated one by one: the first arrived well before the last (no buffering)
    assert content[-1] - content[0] > 0.02


async def test_stream_keeps_usage_the_client_asked_for(backend_pool: Any) -> None:
    sup = await backend_pool()
    body = {"messages": [{"role": "user", "content": words(20, 22)}], "max_tokens": 4,
            "stream": True, "stream_options": {"include_usage": True}}
    async with proxy(sup) as client, client.post("/v1/chat/completions", json=body) as r:
        text = await r.text()
    usage = [json.loads(ln[5:]) for ln in text.splitlines()
             if ln.startswith("data:") and "usage" in ln]
    assert usage and usage[-1]["usage"]["prompt_tokens"] > 0


async def test_upstream_errors_pass_through(backend_pool: Any) -> None:
    sup = await backend_pool()
    body = {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}
    async with proxy(sup) as client, client.post("/v1/chat/completions", json=body) as r:
        data = await r.json()
        assert r.status == 400
        assert "top_logprobs" in data["error"]["message"]  # llama-server's own message
        assert r.headers["X-Kvroute-Backend"]


async def test_headers_completion_endpoints_and_status(backend_pool: Any) -> None:
    sup = await backend_pool()
    names = {i.name for i in sup.ready()}
    async with proxy(sup) as client:
        headers, _ = await chat(client, [{"role": "user", "content": words(30, 31)}])
        assert headers["X-Kvroute-Backend"] in names
        assert int(headers["X-Kvroute-Predicted-Cached"]) >= 0
        assert int(headers["X-Kvroute-Slot"]) in range(2)

        async with client.post("/completion", json={"prompt": words(30, 32),
                                                    "n_predict": 4}) as r:
            native = await r.json()
            assert r.status == 200 and native["timings"]["prompt_n"] > 0
        async with client.post("/v1/completions", json={"prompt": words(30, 33),
                                                        "max_tokens": 4}) as r:
            assert r.status == 200 and (await r.json())["choices"]
        async with client.post("/tokenize", json={"content": "hello world"}) as r:
            assert r.status == 200 and (await r.json())["tokens"]
        async with client.get("/v1/models") as r:
            assert [m["id"] for m in (await r.json())["data"]] == ["kvroute-demo"]
        async with client.get("/v1/models/kvroute-demo") as r:  # models.retrieve(id)
            assert r.status == 200 and (await r.json())["id"] == "kvroute-demo"
        async with client.get("/v1/models/nope") as r:
            assert r.status == 404 and (await r.json())["error"]["type"]
        async with client.post("/v1/responses", json={"model": "m", "input": "hi",
                                                      "max_output_tokens": 4}) as r:
            assert r.status == 200 and (await r.json())["object"] == "response"
        async with client.get("/health") as r:
            assert r.status == 200

        async with client.get("/kvroute/status") as r:
            status = await r.json()
        assert {b["name"] for b in status["backends"]} == names
        assert {b["memory"] for b in status["backends"]} == {"dense"}
        assert status["kv_disk"] is None  # off unless configured
        router = status["router"]
        assert router["tree"]["resident_tokens"] > 0 and router["completed"] >= 3
        assert set(router["backends"]) == names

        async with client.get("/metrics") as r:
            text = await r.text()
        for metric in ("kvroute_requests_total", "kvroute_prompt_tokens_total",
                       "kvroute_predicted_cached_tokens_total",
                       "kvroute_reported_cached_tokens_total",
                       "kvroute_prediction_error_tokens_bucket", "kvroute_ttft_seconds_bucket",
                       "kvroute_request_seconds_bucket", "kvroute_in_flight",
                       "kvroute_backend_up"):
            assert metric in text, metric


async def test_client_disconnect_frees_the_slot(backend_pool: Any) -> None:
    sup = await backend_pool()
    body = {"messages": [{"role": "user", "content": words(30, 41)}], "max_tokens": 2000,
            "stream": True, "ignore_eos": True}
    async with proxy(sup) as client:
        r = await client.post("/v1/chat/completions", json=body)
        name = r.headers["X-Kvroute-Backend"]
        await r.content.readline()
        r.close()  # the client goes away mid-stream
        info = next(i for i in sup.ready() if i.name == name)
        deadline = time.monotonic() + 2.0
        busy = True
        while busy and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            async with client.session.get(f"{info.url}/slots", headers={
                    "Authorization": f"Bearer {info.api_key}"}) as s:
                busy = any(slot["is_processing"] for slot in await s.json())
        assert not busy, "upstream generation kept running after the client left"
        async with client.get("/kvroute/status") as s:
            assert (await s.json())["router"]["inflight"] == 0


async def test_an_interrupted_turn_keeps_its_history_on_its_backend(backend_pool: Any) -> None:
    """An agent's user interrupts a turn once output flows (the client closes the stream),
    then sends the next message. llama-server keeps a cancelled slot's state, so the
    history is still there: the next turn goes back to it, predicted as reported."""
    sup = await backend_pool()
    messages = [{"role": "system", "content": words(600, 43)},
                {"role": "user", "content": words(40, 44)}]
    body = {"messages": messages, "max_tokens": 2000, "stream": True, "ignore_eos": True}
    async with proxy(sup) as client:
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status == 200
        first = r.headers["X-Kvroute-Backend"]
        while b'"content":"' not in await r.content.readline():
            pass  # up to the first generated text: the prompt is in the slot
        r.close()  # interrupted
        for _ in range(50):  # the proxy sees the disconnect and aborts
            async with client.get("/kvroute/status") as s:
                if (await s.json())["router"]["inflight"] == 0:
                    break
            await asyncio.sleep(0.1)
        messages.append({"role": "user", "content": "[Request interrupted by user] "
                         + words(20, 45)})
        headers, data = await chat(client, messages)
    assert headers["X-Kvroute-Backend"] == first
    acc = Accuracy()
    acc.add(headers, data)
    assert cached_of(data) >= 600, data["timings"]
    assert not acc.bad(), acc.rows


async def test_a_summary_waiting_for_its_turns_slot_is_predicted_whole(backend_pool: Any
                                                                      ) -> None:
    """An agent sends a summary call together with its next turn: the same history, the
    turn's tool result extended by an instruction. The summary (routed on its seen head:
    the history, its last message being new text) waits for the turn's busy slot and is
    sent there when the turn ends: it reuses the history *and* the tool result the turn
    put in the slot. Its prediction must count both (it once counted the head only: 250
    tokens short), and it must not be sent cold elsewhere because, on the head alone,
    waiting looked like truncating the turn's (unknown) tool result."""
    sup = await backend_pool()
    acc = Accuracy()
    messages = [{"role": "system", "content": words(4500, 51)},
                {"role": "user", "content": words(200, 52)}]
    async with proxy(sup) as client:
        headers, data = await chat(client, messages)
        acc.add(headers, data)
        history = cached_of(data) + int(data["timings"]["prompt_n"])
        result = "Tool result: " + words(250, 53)
        messages += [{"role": "assistant",
                      "content": data["choices"][0]["message"]["content"] or ""},
                     {"role": "user", "content": result}]
        summary = [*messages[:-1], {"role": "user",
                                    "content": result + "\nSummarize the session so far."}]
        on_head = await routed_on_head(client)

        async def later() -> tuple[Any, dict[str, Any]]:
            await asyncio.sleep(0.05)  # the turn is decided first and holds its slot
            return await chat(client, summary)

        (th, turn), (sh, summ) = await asyncio.gather(chat(client, messages, max_tokens=24),
                                                      later())
        acc.add(th, turn)
        acc.add(sh, summ)
        # the turn; the summary too, unless decided before the turn's rest was known
        # (then the head alone would move it off the turn's slot: decided whole)
        assert await routed_on_head(client) - on_head >= 1
    # it ran in the turn's slot after the turn: it reused the tool result too
    assert (sh["X-Kvroute-Backend"], sh["X-Kvroute-Slot"]) == \
        (th["X-Kvroute-Backend"], th["X-Kvroute-Slot"])
    assert cached_of(summ) >= history + 240, (history, summ["timings"])
    assert not acc.bad(), acc.rows
