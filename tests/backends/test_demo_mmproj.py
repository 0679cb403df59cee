"""The demo projector (`mmproj: demo`) on the real pinned llama-server: what an image
costs and what the server reuses around it.

One llama-server runs the demo model with the demo projector (1 slot, 4096 tokens,
--cache-ram 1024); the last tests start their own. Each scenario sends images of its
own (tests/images.py), so none finds another's image in the slot or the RAM cache.
What it shows:

- The server reports `/props` modalities {vision: true, video: true, audio: false} and
  a `media_marker` (random per process unless LLAMA_MEDIA_MARKER pins it) that stands
  for each image in the rendered prompt (`/apply-template` shows it there).
- One image is one chunk of exactly 64 tokens (the projector's (64 / 8)^2 patches),
  whatever the picture's size: usage.prompt_tokens and timings.prompt_n count them as
  tokens, and on the demo model (llama: one position per token) they take 64 positions.
- The chunk is keyed by the SHA-256 of the bytes sent (after base64 decoding), not of the
  pixels: the same pixels compressed otherwise are another image.
- The same request again reuses everything but the last token (cache_n = n - 1); a next
  turn reuses the previous prompt, image included, and the 3 generated tokens kept.
- Another image at the same place: reuse stops exactly where the image starts (a chunk
  matches whole or not at all, server_tokens::get_common_prefix); the text after it is
  processed again even where it is the same.
- The host-RAM cache keeps the image: a conversation pushed out of the slot comes back
  with its image (cache_n = n - 1).
- `/completion` takes images too: `{"prompt_string": ...marker..., "multimodal_data":
  [base64]}`, counted the same way; but a prompt whose last chunk is an image aborts
  the server (an assertion of the pinned build).
- `/slots` n_prompt_tokens counts an image's 64 tokens as any others.
- demo-swa and demo-hybrid take the projector too, and reuse around an image only from
  their context checkpoints, as around text.

On this machine's CPU an image costs about twice the prompt time of as many text tokens
(a 66-token prompt with one image: 40 ms; 65 text tokens: 20 ms).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from direct_server import DirectServer
from images import data_uri, png

from backends.config import ManagedBackendConfig
from backends.demo_mmproj import DemoMmprojParams, ensure_demo_mmproj, for_model
from backends.demo_model import DEMO, DemoModelParams, ensure_demo_model
from backends.supervisor import Supervisor
from proxy.config.load import Config

IMAGE_TOKENS = DemoMmprojParams().n_patches  # 64
SYSTEM = {"role": "system", "content": "You look at pictures."}


class Server(DirectServer):
    """The llama-server with the projector, and what a request's prompt holds."""


def user(text: str, *images: bytes) -> dict[str, Any]:
    """A user message: the text, then each image."""
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": data_uri(i)}} for i in images]
    return {"role": "user", "content": parts}


def cached(out: dict[str, Any]) -> tuple[int, int]:
    """(cache_n, prompt_n): the prompt tokens reused and those processed."""
    return out["timings"]["cache_n"], out["timings"]["prompt_n"]


@asynccontextmanager
async def started(pool_config: Callable[..., Config], kind: str = DEMO
                  ) -> AsyncIterator[tuple[Server, Supervisor]]:
    """A llama-server of a demo model with the demo projector."""
    mmproj = ensure_demo_mmproj(for_model(DemoModelParams()))
    cfg = pool_config(n=1, slots=1, ctx_per_slot=4096, cache_ram_mib=1024)
    backend = cfg.backends[0]
    assert isinstance(backend, ManagedBackendConfig)
    cfg = dataclasses.replace(cfg, backends=(dataclasses.replace(
        backend, model=ensure_demo_model(kind=kind), mmproj=mmproj, threads=2),))
    sup = Supervisor(cfg)
    await sup.start()
    try:
        assert len(sup.ready()) == 1, sup.statuses()
        assert sup.statuses()[0]["mmproj"] == str(mmproj)
        info = sup.ready()[0]
        async with aiohttp.ClientSession() as session:
            yield Server(session, info.url, str(info.api_key)), sup
    finally:
        await sup.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(pool_config: Callable[..., Config]) -> AsyncIterator[Server]:
    async with started(pool_config) as (srv, _):
        yield srv


async def test_reports_vision_and_its_marker(server: Server) -> None:
    props = await server.get("/props")
    assert props["modalities"] == {"vision": True, "video": True, "audio": False}
    marker = props["media_marker"]
    assert marker.startswith("<__media_") and marker.endswith("__>")
    prompt = (await server.post("/apply-template", {"messages": [user("Hi.", png(1))]}))
    assert prompt["prompt"] == f"<|im_start|>user\nHi.{marker}<|im_end|>\n<|im_start|>assistant\n"


async def test_an_image_is_64_tokens_whatever_its_size(server: Server) -> None:
    for seed, size in ((2, (40, 30)), (3, (300, 120)), (4, (8, 8))):
        messages = [SYSTEM, user("Describe this image.", png(seed, *size))]
        before, after = await server.text_around(messages)
        out = await server.chat(messages)
        cache_n, prompt_n = cached(out)
        assert out["usage"]["prompt_tokens"] == before + IMAGE_TOKENS + after
        # (the system prompt may be in the slot still: never the new image)
        assert cache_n <= before and cache_n + prompt_n == before + IMAGE_TOKENS + after


async def test_the_same_request_again_reuses_through_the_image(server: Server) -> None:
    messages = [SYSTEM, user("What is here?", png(5))]
    n = (await server.chat(messages))["usage"]["prompt_tokens"]
    again = await server.chat(messages)
    assert cached(again) == (n - 1, 1)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
    # the slot holds the prompt, its image's 64 tokens counted, and 3 generated tokens
    assert (await server.get("/slots"))[0]["n_prompt_tokens"] == n + 3


async def test_a_next_turn_reuses_the_image(server: Server) -> None:
    """Claude Code's pattern: a screenshot in the first turn, carried by every later one."""
    messages = [SYSTEM, user("Look at this screenshot.", png(6, 64, 48))]
    previous = 0  # the last turn's prompt tokens
    for turn in range(3):
        out = await server.chat(messages)
        n = out["usage"]["prompt_tokens"]
        if turn:
            assert cached(out) == (previous + 3, n - previous - 3)
        previous = n
        messages += [{"role": "assistant", "content": out["choices"][0]["message"]["content"]},
                     user(f"And now, step {turn}?")]


async def test_another_image_stops_reuse_where_the_image_starts(server: Server) -> None:
    messages = [SYSTEM, user("Compare:", png(7)), user("with this one.", png(8))]
    before, between, after = await server.text_around(messages)
    n = (await server.chat(messages))["usage"]["prompt_tokens"]
    assert n == before + between + after + 2 * IMAGE_TOKENS
    # the second image differs: all up to it is reused, nothing after
    out = await server.chat([SYSTEM, user("Compare:", png(7)), user("with this one.", png(9))])
    assert cached(out) == (before + IMAGE_TOKENS + between, IMAGE_TOKENS + after)
    # the first differs: only the text before it
    out = await server.chat([SYSTEM, user("Compare:", png(10)), user("with this one.", png(9))])
    assert cached(out) == (before, n - before)


async def test_an_image_is_its_bytes_not_its_pixels(server: Server) -> None:
    """The same pixels compressed at another level are another image to the server."""
    fast, small = png(11, level=1), png(11, level=9)
    assert fast != small
    messages = [SYSTEM, user("Same picture?", fast)]
    before, _ = await server.text_around(messages)
    await server.chat(messages)
    out = await server.chat([SYSTEM, user("Same picture?", small)])
    assert cached(out)[0] == before


async def test_the_ram_cache_keeps_the_image(server: Server) -> None:
    messages = [SYSTEM, user("Keep this one.", png(12))]
    n = (await server.chat(messages))["usage"]["prompt_tokens"]
    await server.chat([{"role": "user", "content": "Something else entirely, " * 20}])
    assert cached(await server.chat(messages)) == (n - 1, 1)


async def test_completion_takes_multimodal_data(server: Server) -> None:
    marker = (await server.get("/props"))["media_marker"]
    image = data_uri(png(13)).split(",", 1)[1]
    body = {"prompt": {"prompt_string": f"Look: {marker} what?", "multimodal_data": [image]},
            "n_predict": 2, "temperature": 0}
    out = await server.post("/completion", body)
    text = await server.n_tokens("Look: ") + await server.n_tokens(" what?")
    assert out["tokens_evaluated"] == text + IMAGE_TOKENS


async def test_a_prompt_ending_in_an_image_aborts_the_server(
        pool_config: Callable[..., Config]) -> None:
    """The pinned build asserts (GGML_ASSERT(batch.size() > 0), server-context.cpp) when
    the last chunk of a prompt is an image: nothing is left for the text batch that
    takes the logits. A chat prompt never ends so (the template closes the turn after
    the image); a `/completion` one can. So a proxy must not forward one as it is."""
    async with started(pool_config) as (srv, sup):
        marker = (await srv.get("/props"))["media_marker"]
        image = data_uri(png(14)).split(",", 1)[1]
        body = {"prompt": {"prompt_string": f"Look: {marker}", "multimodal_data": [image]},
                "n_predict": 1}
        with pytest.raises(aiohttp.ClientError):
            await srv.post("/completion", body)
        log = Path(str(sup.statuses()[0]["log"]))
        for _ in range(100):
            if "GGML_ASSERT(batch.size() > 0) failed" in log.read_text():
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"no assertion in {log}")


@pytest.mark.parametrize(("kind", "same", "restored"), [
    ("demo-swa", 5, -1), ("demo-hybrid", 4, 0)])
async def test_checkpoint_models_take_it_too(pool_config: Callable[..., Config], kind: str,
                                             same: int, restored: int) -> None:
    """The projector fits every demo model (one width). The sliding-window and hybrid ones
    reuse by context checkpoints as they do for text (docs/checkpoints.md): the same
    request again restores the checkpoint at n - 4 (cache_n n - 5 for demo-swa, n - 4
    for demo-hybrid), and another image one at the start of the user message that holds
    it (demo-swa one token short of it), not the text before the image."""
    async with started(pool_config, kind) as (srv, _):
        text = "See " * 5
        messages = [{"role": "system", "content": "sys " * 50}, user(text, png(15))]
        prompt = (await srv.post("/apply-template", {"messages": messages}))["prompt"]
        user_start = await srv.n_tokens(prompt[:prompt.index("<|im_start|>user")])
        before, _ = await srv.text_around(messages)
        n = (await srv.chat(messages))["usage"]["prompt_tokens"]
        assert cached(await srv.chat(messages))[0] == n - same
        out = await srv.chat([messages[0], user(text, png(16))])
        assert cached(out)[0] == user_start + restored < before
