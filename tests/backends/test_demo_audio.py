"""The demo audio projector (backends/demo_audio.py) on the real pinned llama-server: what
a clip costs and what the server reuses around it.

One llama-server runs the demo model with the audio projector (1 slot, 4096 tokens,
--cache-ram 1024, -lv 4 so that mtmd logs each chunk it decodes). Each scenario sends
clips of its own (a seeded sine with noise, WAV, 16 kHz mono), so none finds another's
clip in the slot or the RAM cache. What it shows:

- `/props` modalities {vision: false, video: false, audio: true}.
- A clip takes 150 positions per whole 30 s window of (samples + 30 s of silence): 150
  up to 29.98 s, 300 from 29.99 s to 59.98 s (DemoAudioParams.positions). mtmd writes no
  marker tokens around it (Ultravox), so prompt_tokens = text + positions.
- Each window is a chunk of its own ("decoding audio batch" once per window in the log),
  all keyed by the SHA-256 of the bytes sent (mtmd-helper.cpp), not of the samples: the
  same samples in another file are another clip.
- The same request again reuses everything but the last token (cache_n = n - 1), long
  clips too; another clip at the same place stops reuse where the clip starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from audio import audio_part, samples, wav
from direct_server import DirectServer

from backends.config import ManagedBackendConfig
from backends.demo_audio import ensure_demo_audio, for_model
from backends.demo_model import DemoModelParams, ensure_demo_model
from backends.supervisor import Supervisor
from proxy.config.load import Config

pytestmark = pytest.mark.timeout(300)

PARAMS = for_model(DemoModelParams())
WINDOW = PARAMS.window_positions  # 150
SYSTEM = {"role": "system", "content": "You listen to recordings."}


def user(text: str, *clips: bytes) -> dict[str, Any]:
    """A user message: the text, then each clip."""
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    parts += [audio_part(c) for c in clips]
    return {"role": "user", "content": parts}


def cached(out: dict[str, Any]) -> tuple[int, int]:
    """(cache_n, prompt_n): the prompt tokens reused and those processed."""
    return out["timings"]["cache_n"], out["timings"]["prompt_n"]


class Server(DirectServer):
    """The llama-server with the audio projector, and what a request's prompt holds."""

    def __init__(self, session: aiohttp.ClientSession, url: str, key: str, log: Path) -> None:
        super().__init__(session, url, key)
        self.log = log

    async def positions(self, messages: list[dict[str, Any]]) -> tuple[int, int]:
        """(the clips' positions, the prompt's tokens) of a chat of messages."""
        n = (await self.chat(messages))["usage"]["prompt_tokens"]
        return n - sum(await self.text_around(messages)), n

    def chunks_decoded(self) -> int:
        """The audio chunks the server has decoded so far (mtmd-helper.cpp logs each at
        verbosity 4, as "decoding audio batch 1/1": a chunk is one batch up to n_batch)."""
        return self.log.read_text(errors="replace").count("decoding audio batch")


@asynccontextmanager
async def started(pool_config: Callable[..., Config]) -> AsyncIterator[Server]:
    """A llama-server of the demo model with the demo audio projector."""
    mmproj = ensure_demo_audio(PARAMS)
    cfg = pool_config(n=1, slots=1, ctx_per_slot=4096, cache_ram_mib=1024,
                      extra_args=("-lv", "4"))
    backend = cfg.backends[0]
    assert isinstance(backend, ManagedBackendConfig)
    cfg = dataclasses.replace(cfg, backends=(dataclasses.replace(
        backend, model=ensure_demo_model(), mmproj=mmproj),))
    sup = Supervisor(cfg)
    await sup.start()
    try:
        assert len(sup.ready()) == 1, sup.statuses()
        assert sup.statuses()[0]["mmproj"] == str(mmproj)
        info = sup.ready()[0]
        log = Path(str(sup.statuses()[0]["log"]))
        async with aiohttp.ClientSession() as session:
            yield Server(session, info.url, str(info.api_key), log)
    finally:
        await sup.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(pool_config: Callable[..., Config]) -> AsyncIterator[Server]:
    async with started(pool_config) as srv:
        yield srv


async def test_reports_audio(server: Server) -> None:
    props = await server.get("/props")
    assert props["modalities"] == {"vision": False, "video": False, "audio": True}


async def test_a_clip_answers_with_usage(server: Server) -> None:
    messages = [SYSTEM, user("What do you hear?", wav(1, 3))]
    out = await server.chat(messages)
    assert out["choices"][0]["message"]["role"] == "assistant"
    assert out["usage"]["completion_tokens"] > 0
    assert out["usage"]["prompt_tokens"] == sum(await server.text_around(messages)) + WINDOW


@pytest.mark.parametrize(("seconds", "windows"), [
    (1, 1), (2, 1), (5, 1), (29.98, 1), (29.99, 2), (30, 2), (31, 2)])
async def test_positions_per_clip_length(server: Server, seconds: float, windows: int) -> None:
    """A clip takes its whole 30 s windows, after 30 s of silence are appended: a
    function of the decoded sample count only. Each window is a chunk of its own."""
    seed = 10 + int(seconds * 100)
    before = server.chunks_decoded()
    positions, n = await server.positions([SYSTEM, user("Transcribe this.", wav(seed, seconds))])
    print(f"\n{seconds:>6} s  {samples(seconds):>7} samples  {positions:>4} positions  "
          f"({n} prompt tokens)")
    assert positions == windows * WINDOW == PARAMS.positions(samples(seconds))
    assert server.chunks_decoded() - before == windows


@pytest.mark.parametrize(("seconds", "windows"), [(29.98, 1), (29.99, 2)])
async def test_other_rates_count_by_their_16khz_samples(server: Server, seconds: float,
                                                        windows: int) -> None:
    """mtmd resamples to 16 kHz before it cuts windows: an 8 kHz clip counts as twice
    its samples."""
    clip = wav(20 + windows, seconds, rate=8000)
    positions, _ = await server.positions([SYSTEM, user("And this?", clip)])
    assert positions == windows * WINDOW == PARAMS.positions(2 * samples(seconds, 8000))


async def test_the_same_clip_again_reuses_through_it(server: Server) -> None:
    messages = [SYSTEM, user("Is this music?", wav(2, 4))]
    n = (await server.chat(messages))["usage"]["prompt_tokens"]
    again = await server.chat(messages)
    assert cached(again) == (n - 1, 1)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1


async def test_a_long_clip_is_reused_whole(server: Server) -> None:
    """Both windows of a 31 s clip (two chunks, one id) come back from the slot."""
    messages = [SYSTEM, user("Summarise the meeting.", wav(3, 31))]
    n = (await server.chat(messages))["usage"]["prompt_tokens"]
    before = server.chunks_decoded()
    assert cached(await server.chat(messages)) == (n - 1, 1)
    assert server.chunks_decoded() == before  # no chunk decoded again


async def test_another_clip_stops_reuse_where_it_starts(server: Server) -> None:
    messages = [SYSTEM, user("Compare:", wav(4, 2))]
    before, after = await server.text_around(messages)
    assert (await server.chat(messages))["usage"]["prompt_tokens"] == before + WINDOW + after
    out = await server.chat([SYSTEM, user("Compare:", wav(5, 2))])
    assert cached(out) == (before, WINDOW + after)


async def test_a_clip_is_its_bytes_not_its_samples(server: Server) -> None:
    """The same samples with a LIST chunk after them are another clip to the server."""
    plain, tagged = wav(6, 2), wav(6, 2, extra=b"INFOkvroute")
    assert plain != tagged and plain[44:len(plain)] == tagged[44:len(plain)]
    messages = [SYSTEM, user("Same sound?", plain)]
    before, after = await server.text_around(messages)
    await server.chat(messages)
    out = await server.chat([SYSTEM, user("Same sound?", tagged)])
    assert cached(out) == (before, WINDOW + after)
