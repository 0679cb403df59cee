"""Images on sliding-window and hybrid models (the demo projector on demo-swa and
demo-hybrid): the server reuses a prompt holding an image only up to its context
checkpoints, and takes none in a batch that decodes an image. Through kvroute, a
conversation carrying a screenshot for six turns, and conversations sharing an image or
not, are predicted within max(16, 2%) of what the server reports; the image's count read
from the projector (`mmproj:`) or learned from a report (`--mmproj` as an extra argument,
as an external server's is)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient
from images import data_uri, png
from proxy_client import carried_turns, close, demo_chat, serving
from texts import words

from backends.config import ManagedBackendConfig
from backends.demo_mmproj import ensure_demo_mmproj, for_model
from backends.demo_model import DemoModelParams, ensure_demo_model
from proxy.config.load import Config

pytestmark = pytest.mark.timeout(180)
IMAGE = 64  # the demo projector's positions per image


@pytest_asyncio.fixture(scope="module", loop_scope="session",
                        params=[("demo-swa", "read"), ("demo-hybrid", "read"),
                                ("demo-swa", "learned")], ids=lambda p: "-".join(p))
async def client(request: pytest.FixtureRequest, pool_config: Callable[..., Config]
                 ) -> AsyncIterator[TestClient[Any, Any]]:
    kind, count = request.param
    mmproj = ensure_demo_mmproj(for_model(DemoModelParams()))
    cfg = pool_config(n=1, slots=2, ctx_per_slot=4096)
    (b,) = cfg.backends
    assert isinstance(b, ManagedBackendConfig)
    b = dataclasses.replace(b, model=ensure_demo_model(kind=kind), **(
        {"mmproj": mmproj} if count == "read" else {"extra_args": ("--mmproj", str(mmproj))}))
    async with serving(dataclasses.replace(cfg, backends=(b,))) as c:
        yield c


def user(text: str, *images: bytes) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": text}] + [
        {"type": "image_url", "image_url": {"url": data_uri(i)}} for i in images]}


async def test_a_screenshot_carried_for_six_turns_is_predicted(client: TestClient[Any, Any]
                                                               ) -> None:
    messages = [{"role": "system", "content": words(60, 131)},
                user(words(20, 132), png(131, 300, 200))]
    rows = []
    for n in range(6):
        predicted, reported, total, answer = await demo_chat(client, messages)
        rows.append((predicted, reported, total))
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": words(15, 140 + n)}]
    # every later turn reuses through the image (from a checkpoint past it)
    assert all(close(*r) and r[1] > IMAGE + 60 for r in rows[1:]), rows


async def test_an_anthropic_screenshot_is_predicted(client: TestClient[Any, Any]) -> None:
    """As Claude Code sends a pasted screenshot: a base64 image block, carried."""
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": data_uri(png(171, 300, 180)).split(",")[1]}}
    first = {"role": "user", "content": [{"type": "text", "text": words(40, 172)}, block]}
    rows = await carried_turns(
        client, "/v1/messages", first,
        lambda m: {"model": "kvroute-demo", "max_tokens": 3, "system": words(30, 173),
                   "messages": m},
        lambda d: "".join(c.get("text", "") for c in d["content"]) or "ok", turns=4)
    assert all(close(*r) and r[1] > IMAGE + 40 for r in rows[1:]), rows


async def test_conversations_sharing_an_image_or_not(client: TestClient[Any, Any]) -> None:
    """Three conversations over one system prompt: the second sends the first's image
    with its own question after it, the third another image of the same size. Each
    predicted as the server reuses it."""
    system = {"role": "system", "content": words(80, 151)}
    text = words(12, 152)
    rows = []
    for image, question in ((png(151, 200, 150), 153), (png(151, 200, 150), 154),
                            (png(152, 200, 150), 155)):
        msgs = [system, user(text, image), {"role": "assistant", "content": "Seen."},
                {"role": "user", "content": words(30, question)}]
        rows.append(await demo_chat(client, msgs))
    assert all(close(p, r, t) for p, r, t, _ in rows[1:]), rows
    # (whether the second takes the first's slot is the policy's choice: an empty slot
    # may keep the first conversation whole) the other image is never matched
    assert rows[2][1] < IMAGE + 80, rows



@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def one_slot(pool_config: Callable[..., Config]) -> AsyncIterator[TestClient[Any, Any]]:
    """demo-hybrid with the projector, one slot: every request lands on what the last
    one left."""
    cfg = pool_config(n=1, slots=1, ctx_per_slot=4096)
    (b,) = cfg.backends
    assert isinstance(b, ManagedBackendConfig)
    b = dataclasses.replace(b, model=ensure_demo_model(kind="demo-hybrid"),
                            mmproj=ensure_demo_mmproj(for_model(DemoModelParams())))
    async with serving(dataclasses.replace(cfg, backends=(b,))) as c:
        yield c


async def test_an_edit_after_an_image_resumes_where_the_server_checkpointed(
        one_slot: TestClient[Any, Any]) -> None:
    """A prompt whose checkpoint before its end (n - 4 - n_ubatch) would fall inside its
    image: the server decodes the image whole and takes no checkpoint there, so a request
    that edits the text after the image resumes from the user message's start."""
    system = {"role": "system", "content": words(40, 181)}

    def asking(tail: str) -> list[dict[str, Any]]:
        msg = user(words(10, 182), png(181, 120, 90))
        msg["content"].append({"type": "text", "text": tail})
        return [system, msg]

    first = await demo_chat(one_slot, asking(words(464, 183)))
    edited = await demo_chat(one_slot, asking(words(232, 183) + " but " + words(232, 184)))
    assert first[2] - 516 > 60, first  # (the cut lies past the text before the image)
    assert close(*edited[:3]) and 0 < edited[1] < 60, (first, edited)
