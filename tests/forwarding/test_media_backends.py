"""Requests carrying media go to the backends whose projector takes them.

A pool of two demo backends, one started with the demo projector (`mmproj:`): what
each takes is read from its /props (`modalities`), shown in the status, and a request
with an image (OpenAI `image_url`, Anthropic image block) is served by the one that
takes it, however the policy would have placed it. Text goes anywhere."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient
from faults import until
from images import data_uri, png
from proxy_client import carried_turns, chat_turn, serving
from texts import words

from backends.config import ManagedBackendConfig
from backends.demo_mmproj import ensure_demo_mmproj, for_model
from backends.demo_model import DemoModelParams
from proxy.config.load import Config
from proxy.prompt.media import media_kinds
from proxy.server.keys import METRICS, ROUTER, SUPERVISOR, TOKENIZING

pytestmark = pytest.mark.timeout(120)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def client(pool_config: Callable[..., Config]) -> AsyncIterator[TestClient[Any, Any]]:
    cfg = pool_config(n=2, slots=2, ctx_per_slot=4096)
    plain, seeing = cfg.backends
    assert isinstance(seeing, ManagedBackendConfig)
    seeing = dataclasses.replace(seeing, mmproj=ensure_demo_mmproj(for_model(DemoModelParams())))
    async with serving(dataclasses.replace(cfg, backends=(plain, seeing))) as c:
        yield c


def _image_message(seed: int) -> dict[str, Any]:
    return {"role": "user", "content": [
        {"type": "text", "text": words(30, seed)},
        {"type": "image_url", "image_url": {"url": data_uri(png(seed))}}]}


async def test_status_names_what_each_backend_takes(client: TestClient[Any, Any]) -> None:
    async with client.get("/kvroute/status") as r:
        status = await r.json()
    got = {b["name"]: b["modalities"] for b in status["backends"]}
    assert got == {"a": [], "b": ["video", "vision"]}  # as the demo projector's /props says


async def test_images_go_to_the_backend_that_takes_them(client: TestClient[Any, Any]) -> None:
    # new conversations spread over idle backends: without the filter, some would land on
    # "a", whose server refuses an image
    for seed in range(4):
        body = {"model": "kvroute-demo", "max_tokens": 2, "messages": [_image_message(seed)]}
        async with client.post("/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
            assert r.headers["X-Kvroute-Backend"] == "b"
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": data_uri(png(9)).split(",", 1)[1]}}
    body = {"model": "kvroute-demo", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, block]}]}
    async with client.post("/v1/messages", json=body,
                           headers={"anthropic-version": "2023-06-01"}) as r:
        assert r.status == 200, await r.text()
        assert r.headers["X-Kvroute-Backend"] == "b"


async def test_apply_template_of_an_image_goes_to_a_backend_that_takes_it(
        client: TestClient[Any, Any]) -> None:
    # forwarded as it is, round robin: without the filter every other one reaches "a",
    # whose server refuses the image
    for seed in range(4):
        body = {"messages": [_image_message(seed)]}
        async with client.post("/apply-template", json=body) as r:
            assert r.status == 200, await r.text()
            assert "prompt" in await r.json()


async def test_text_goes_to_either(client: TestClient[Any, Any]) -> None:
    # sent together, long prompts spread over both backends (the load bound)
    async def one(seed: int) -> str:
        body = {"model": "kvroute-demo", "max_tokens": 2,
                "messages": [{"role": "user", "content": words(600, 50 + seed)}]}
        async with client.post("/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
            return str(r.headers["X-Kvroute-Backend"])
    assert set(await asyncio.gather(*(one(seed) for seed in range(4)))) == {"a", "b"}


@pytest.mark.parametrize(("content", "kinds"), [
    ("text", set()),
    ([{"type": "text", "text": "x"}], set()),
    ([{"type": "image_url", "image_url": {"url": "data:x"}}], {"vision"}),
    ([{"type": "input_audio", "input_audio": {"data": "x"}},
      {"type": "video_url", "video_url": {"url": "x"}}], {"audio", "video"}),
    ([{"type": "input_video"}, 3, {"type": 5}], {"video"}),
])
def test_media_kinds(content: Any, kinds: set[str]) -> None:
    assert media_kinds({"messages": [{"role": "user", "content": content}, "odd"]}) == kinds
    assert media_kinds({"messages": "x"}) == frozenset()


async def _markers(client: TestClient[Any, Any]) -> dict[str, str]:
    """Each backend's media marker, as its own /props says (random per server)."""
    out = {}
    async with aiohttp.ClientSession() as session:
        for info in client.server.app[SUPERVISOR].ready():
            async with session.get(info.url + "/props", headers={
                    "Authorization": f"Bearer {info.api_key}"}) as r:
                out[info.name] = (await r.json())["media_marker"]
    return out


async def test_a_completion_with_multimodal_data_is_served_and_predicted(
        client: TestClient[Any, Any]) -> None:
    """`/completion` with `multimodal_data` goes to the backend that takes images,
    whichever backend's marker the client read from /props (each server has its own:
    kvroute puts the target's in), and its next request is predicted through the image."""
    markers = await _markers(client)
    assert len(set(markers.values())) == 2  # (two servers, two random markers)
    async with client.get("/props") as r:
        assert (await r.json())["media_marker"] in markers.values()
    image = data_uri(png(21, 200, 100)).split(",", 1)[1]
    rows = []
    for marker in (markers["a"], markers["b"], markers["a"]):
        sub = {"prompt_string": words(40, 21) + f" {marker} " + words(20, 22),
               "multimodal_data": [image]}
        async with client.post("/completion", json={
                "prompt": sub, "n_predict": 1, "cache_prompt": True}) as r:
            data = await r.json()
            assert r.status == 200, data
            assert r.headers["X-Kvroute-Backend"] == "b"
            rows.append((int(r.headers["X-Kvroute-Predicted-Cached"]),
                         data["timings"]["cache_n"], data["tokens_evaluated"]))
    assert rows[0][1] == 0 and all(p == c for p, c, _ in rows), rows
    assert rows[1][1] == rows[1][2] - 1, rows  # through the image: all but the last token


async def test_a_completion_ending_with_media_is_refused(client: TestClient[Any, Any]
                                                        ) -> None:
    # llama-server aborts on a prompt whose last chunk is an image: refused before it can
    # reach one, in any subprompt, whichever backend's marker it holds
    image = data_uri(png(3)).split(",", 1)[1]
    for marker in (await _markers(client)).values():
        sub = {"prompt_string": f"Look: {marker}", "multimodal_data": [image]}
        for prompt in (sub, ["first", sub]):
            async with client.post("/completion", json={"prompt": prompt,
                                                         "n_predict": 1}) as r:
                assert r.status == 400, await r.text()
                assert "X-Kvroute-Backend" not in r.headers  # refused here, sent nowhere
                assert "ends with media" in (await r.json())["error"]["message"]


def _exact(rows: list[tuple[int, int, int]]) -> None:
    for predicted, reported, total in rows:
        assert abs(predicted - reported) <= max(16, total // 50), rows
    assert all(reported > 64 for _, reported, _ in rows[1:]), rows  # through the image


async def test_a_screenshot_carried_for_six_turns_is_predicted(client: TestClient[Any, Any]
                                                               ) -> None:
    image = data_uri(png(21, 320, 200))
    first = {"role": "user", "content": [
        {"type": "text", "text": words(40, 7)},
        {"type": "image_url", "image_url": {"url": image}},
        {"type": "text", "text": "What does the screenshot show?"}]}
    rows = await carried_turns(
        client, "/v1/chat/completions", first,
        lambda m: {"model": "kvroute-demo", "max_tokens": 3, "messages": m},
        lambda d: str(d["choices"][0]["message"]["content"]))
    _exact(rows)


async def test_an_anthropic_screenshot_is_predicted(client: TestClient[Any, Any]) -> None:
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": data_uri(png(22, 300, 180)).split(",", 1)[1]}}
    first = {"role": "user", "content": [{"type": "text", "text": words(40, 8)}, block]}
    rows = await carried_turns(
        client, "/v1/messages", first,
        lambda m: {"model": "kvroute-demo", "max_tokens": 3, "messages": m},
        lambda d: "".join(c.get("text", "") for c in d["content"]) or "ok")
    _exact(rows)


async def test_the_same_image_is_shared_and_another_is_not(client: TestClient[Any, Any]
                                                           ) -> None:
    system = {"role": "system", "content": words(60, 11)}

    async def ask(seed: int, question: int) -> tuple[int, int, int]:
        body = {"model": "kvroute-demo", "max_tokens": 2, "messages": [system, {
            "role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_uri(png(seed, 200, 100))}},
                {"type": "text", "text": words(10, question)}]}]}
        t = await chat_turn(client, body)
        return t.predicted, t.reported, t.prompt_tokens

    def media_counted() -> float:
        m = client.server.app[METRICS]
        return float(m.child(m.media_tokens, "b")._value.get())
    before = media_counted()
    first = await ask(31, 1)
    same = await ask(31, 2)  # the system prompt and the image reused, the question not
    other = await ask(32, 3)  # the system prompt only: no match through another image
    _exact_each([first, same, other])
    assert same[1] >= 64 + 60 and other[1] < 64 + 60, (first, same, other)
    assert media_counted() - before == 3 * 64


def _exact_each(rows: list[tuple[int, int, int]]) -> None:
    for predicted, reported, total in rows:
        assert abs(predicted - reported) <= max(16, total // 50), rows


async def test_an_image_in_a_continued_assistant_message_gets_the_servers_answer(
        client: TestClient[Any, Any]) -> None:
    # a final assistant message is continued: the server renders its text only, finds
    # one image for no marker and refuses it; the backend stays up
    body = {"model": "kvroute-demo", "max_tokens": 2, "messages": [
        {"role": "user", "content": "Draw it."},
        {"role": "assistant", "content": [
            {"type": "image_url", "image_url": {"url": data_uri(png(5))}}]}]}
    async with client.post("/v1/chat/completions", json=body) as r:
        assert r.status == 400, await r.text()
        assert (await r.json())["error"]["message"] == "Failed to tokenize prompt"
    async with client.get("/kvroute/status") as r:
        assert all(b["healthy"] for b in (await r.json())["backends"])


async def test_ids_from_a_backends_rendering_stop_at_its_marker(
        client: TestClient[Any, Any]) -> None:
    # where the ids come from a backend's /apply-template (no local tokenizer, or an
    # inexact template), its own random marker stands for the image: cut there
    tok = client.server.app[TOKENIZING]
    assert tok.remote is not None and tok.prompt is not None
    body = {"messages": [_image_message(41)]}
    ids = await tok.remote.chat(body, "test")
    local = tok.prompt.chat_ids(body)
    head = local[:local.index(next(i for i in local if i < 0))]
    assert list(ids) == list(head) and len(ids) > 20


async def test_while_the_backend_taking_images_restarts_they_wait(
        client: TestClient[Any, Any]) -> None:
    """Killed, the projector backend restarts: meanwhile an image gets a 503 to retry
    (not the plain backend's refusal), text is served, and once it is back images are.
    (Last in this module: it restarts "b".)"""
    app = client.server.app
    sup = app[SUPERVISOR]
    old = sup.pid("b")
    assert old is not None
    os.kill(old, signal.SIGKILL)
    await until(lambda: "b" not in app[ROUTER].snapshot()["backends"], 30)
    body = {"model": "kvroute-demo", "max_tokens": 2, "messages": [_image_message(5)]}
    async with client.post("/v1/chat/completions", json=body) as r:
        assert r.status == 503 and "Retry-After" in r.headers, await r.text()
        assert "vision" in (await r.json())["error"]["message"]
    text = {"model": "kvroute-demo", "max_tokens": 2,
            "messages": [{"role": "user", "content": words(20, 5)}]}
    async with client.post("/v1/chat/completions", json=text) as r:
        assert r.status == 200 and r.headers["X-Kvroute-Backend"] == "a"
    await until(lambda: "b" in app[ROUTER].snapshot()["backends"], 90)
    async with client.post("/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        assert r.headers["X-Kvroute-Backend"] == "b"
