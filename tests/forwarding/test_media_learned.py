"""Images whose positions kvroute cannot read from a projector (here the demo projector
given as `--mmproj` in extra_args, as an external server's is): learned from the count
the server reports for the first prompt that holds each, so every turn after it is
predicted through the image, and the first turn's slot record holds the whole prompt."""

from __future__ import annotations

import base64
import dataclasses
from array import array
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient
from images import data_uri, png
from proxy_client import demo_chat, serving
from texts import words

from backends.config import ManagedBackendConfig
from backends.demo_mmproj import ensure_demo_mmproj, for_model
from backends.demo_model import DemoModelParams
from proxy.config.load import Config
from proxy.prompt.media import SENTINEL, image_of
from proxy.server.keys import POOLS

pytestmark = pytest.mark.timeout(120)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def client(pool_config: Callable[..., Config]) -> AsyncIterator[TestClient[Any, Any]]:
    mmproj = ensure_demo_mmproj(for_model(DemoModelParams()))
    cfg = pool_config(n=1, slots=2, ctx_per_slot=4096)
    (b,) = cfg.backends
    assert isinstance(b, ManagedBackendConfig)
    b = dataclasses.replace(b, extra_args=("--mmproj", str(mmproj)))
    async with serving(dataclasses.replace(cfg, backends=(b,))) as c:
        yield c


async def test_a_screenshot_carried_for_four_turns_is_predicted(client: TestClient[Any, Any]
                                                                ) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": words(60, 31)},
        {"role": "user", "content": [
            {"type": "text", "text": words(20, 32)},
            {"type": "image_url", "image_url": {"url": data_uri(png(31, 300, 200))}}]}]
    rows = []
    for turn in range(4):
        predicted, reported, total, answer = await demo_chat(client, messages)
        rows.append((predicted, reported, total))
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": words(15, 40 + turn)}]
    assert rows[0][1] == 0, rows
    # from the second turn, reused through the image (64 positions), as predicted (the
    # answers' own tokens, random, may retokenize otherwise: within max(16, 2%))
    assert all(abs(p - r) <= max(16, t // 50) and p > 64 + 60 for p, r, t in rows[1:]), rows
    async with client.get("/kvroute/status") as r:
        (backend,) = (await r.json())["backends"]
    assert backend["media_tokens"] >= 3 * 64  # (the first turn's ids stopped at the image)


async def test_counts_are_learned_per_image_size(client: TestClient[Any, Any]) -> None:
    """An image's count is learned per size: a new image of a size seen is known at
    once; two new images of one new size are learned from one report; two of two new
    sizes are not (two counts from one report), and their prompt predicts only up to
    the first."""
    system = {"role": "system", "content": words(50, 51)}

    def user(*images: tuple[int, int, int]) -> dict[str, Any]:
        return {"role": "user", "content": [{"type": "text", "text": words(10, 52)}] + [
            {"type": "image_url", "image_url": {"url": data_uri(png(*image))}}
            for image in images]}

    first = await demo_chat(client, [system, user((61, 120, 90))])
    # 62 is of 61's size: known, the prompt whole (the server reuses all but its last)
    second = await demo_chat(client, [system, user((61, 120, 90), (62, 120, 90))])
    assert second[1] > 64 and 0 <= second[1] - second[0] <= 1, (first, second)
    third = await demo_chat(client, [system, user((61, 120, 90), (62, 120, 90))])
    assert third[0] == third[1] == third[2] - 1, (first, second, third)
    both = await demo_chat(client, [system, user((71, 100, 80), (72, 100, 80))])
    again = await demo_chat(client, [system, user((71, 100, 80), (72, 100, 80))])
    assert again[0] == again[1] == again[2] - 1, (both, again)
    # two new sizes: the ids stop at the first image, and stay so
    mixed = await demo_chat(client, [system, user((73, 90, 70), (74, 70, 90))])
    still = await demo_chat(client, [system, user((73, 90, 70), (74, 70, 90))])
    assert still[1] == still[2] - 1 and still[0] < 64 + 50, (mixed, still)


async def test_counting_a_prompt_with_an_image_not_known_asks_the_server(
        client: TestClient[Any, Any]) -> None:
    """Anthropic's count_tokens and Responses' input_tokens of a prompt holding an image
    whose positions kvroute does not know yet: the server counts it (kvroute's ids stop
    before the image), as many as the turn then reports."""
    image = data_uri(png(81, 200, 150))
    text = words(20, 82)
    anthropic = {"model": "kvroute-demo", "max_tokens": 3, "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": text},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": image.partition(",")[2]}}]}]}
    responses = {"model": "kvroute-demo", "max_output_tokens": 3, "input": [
        {"role": "user", "content": [
            {"type": "input_text", "text": words(20, 83)},
            {"type": "input_image", "image_url": data_uri(png(84, 200, 150))}]}]}
    counts = []
    for path, body in (("/v1/messages/count_tokens", anthropic),
                       ("/v1/responses/input_tokens", responses)):
        async with client.post(path, json=body) as r:
            data = await r.json()
            assert r.status == 200, data
            counts.append(data["input_tokens"])
    async with client.post("/v1/messages", json=anthropic) as r:
        data = await r.json()
        assert r.status == 200, data
        usage = data["usage"]
    async with client.post("/v1/responses", json=responses) as r:
        done = await r.json()
        assert r.status == 200, done
    reported = [usage["input_tokens"] + usage["cache_read_input_tokens"],
                done["usage"]["input_tokens"]]
    assert counts == reported and min(counts) > 64, (counts, reported)


async def test_a_count_a_server_disagrees_with_is_learned_again(
        client: TestClient[Any, Any]) -> None:
    """A size's count learned wrong (made so here in the pool's own table, as a file
    Pillow sizes otherwise than the server's decoder would) is forgotten at the first
    report that disagrees with the whole ids, and learned again from the next."""
    prompt = client.server.app[POOLS].first.tok.prompt
    assert prompt is not None
    image = png(91, 140, 100)
    assert prompt.media.learn(array("i", [5, SENTINEL]), (image_of(image),), 1 + 10)
    messages = [{"role": "system", "content": words(40, 92)},
                {"role": "user", "content": [
                    {"type": "text", "text": words(10, 93)},
                    {"type": "image_url", "image_url": {"url": data_uri(image)}}]}]
    rows = [await demo_chat(client, messages) for _ in range(3)]
    assert prompt.media.chunk(image_of(image)) is not None  # learned again: 64
    assert rows[2][0] == rows[2][1] == rows[2][2] - 1, rows


async def test_a_count_the_server_refuses_is_its_error_in_the_apis_envelope(
        client: TestClient[Any, Any]) -> None:
    """count_tokens of an image the server cannot decode (bytes no decoder takes), and
    the turn itself: each the server's own refusal (its status differs between the two
    paths), in Anthropic's error object."""
    junk = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(200)).decode()
    body = {"model": "kvroute-demo", "max_tokens": 3, "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": words(10, 95)},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": junk}}]}]}
    (info,) = client.server.app[POOLS].first.fw.backends.values()
    for path in ("/v1/messages/count_tokens", "/v1/messages"):
        async with aiohttp.ClientSession() as s, s.post(
                info.url + path, json=body,
                headers={"Authorization": f"Bearer {info.api_key}"}) as r:
            direct = r.status, await r.json()
        async with client.post(path, json=body) as r:
            status, data = r.status, await r.json()
        assert status == direct[0] >= 400, (path, direct, data)
        assert data["type"] == "error" and data["error"]["message"] == \
            "Failed to load image or audio file", (path, direct, data)
