"""A kvroute app on a real loopback port, driven by aiohttp's test client."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, NamedTuple

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from texts import words

from backends.supervisor import Supervisor
from proxy.app import create_app
from proxy.config.load import Config
from proxy.config.settings import ProxySettings
from proxy.server.keys import METRICS
from proxy.server.runner import make_runner


class ProxyServer(TestServer):
    """aiohttp's TestServer on the runner `serve` uses (its answers to malformed HTTP)."""

    async def _make_runner(self, **kwargs: Any) -> web.AppRunner:
        return make_runner(self.app, **kwargs)


@asynccontextmanager
async def proxy(sup: Supervisor, settings: ProxySettings | None = None
                ) -> AsyncIterator[TestClient[Any, Any]]:
    # handler_cancellation: a client that goes away cancels its handler (as in `serve`).
    server = ProxyServer(create_app(sup.config, sup, settings), handler_cancellation=True)
    async with TestClient(server) as client:
        yield client


@asynccontextmanager
async def serving(cfg: Config) -> AsyncIterator[TestClient[Any, Any]]:
    """kvroute in front of ``cfg``'s backends, started for it (all of them ready), and
    stopped after."""
    sup = Supervisor(cfg)
    await sup.start()
    try:
        assert len(sup.ready()) == len(cfg.backends), sup.statuses()
        async with proxy(sup) as client:
            yield client
    finally:
        await sup.stop()


class Turn(NamedTuple):
    """One chat completion through kvroute, as its answer tells it."""

    predicted: int  # X-Kvroute-Predicted-Cached
    reported: int  # usage.prompt_tokens_details.cached_tokens
    prompt_tokens: int
    backend: str  # X-Kvroute-Backend
    answer: str


def close(predicted: int, reported: int, total: int) -> bool:
    """A prediction within max(16, 2%) of the prompt (the answers' own tokens, random,
    may retokenize otherwise when a later turn sends them back)."""
    return abs(predicted - reported) <= max(16, total // 50)


async def chat_turn(client: TestClient[Any, Any], body: dict[str, Any]) -> Turn:
    async with client.post("/v1/chat/completions", json=body) as r:
        data = await r.json()
        assert r.status == 200, data
        predicted = int(r.headers["X-Kvroute-Predicted-Cached"])
        backend = r.headers["X-Kvroute-Backend"]
    usage = data["usage"]
    return Turn(predicted, usage["prompt_tokens_details"]["cached_tokens"],
                usage["prompt_tokens"], backend, data["choices"][0]["message"]["content"])


async def demo_chat(client: TestClient[Any, Any], messages: list[dict[str, Any]]
                    ) -> tuple[int, int, int, str]:
    """(predicted, reported, prompt tokens, answer) of a 3-token chat turn of the demo
    model."""
    t = await chat_turn(client, {"model": "kvroute-demo", "max_tokens": 3,
                                 "messages": messages})
    return t.predicted, t.reported, t.prompt_tokens, t.answer


async def carried_turns(client: TestClient[Any, Any], path: str, first: dict[str, Any],
                 build: Callable[[list[dict[str, Any]]], dict[str, Any]],
                 answer: Callable[[dict[str, Any]], str], turns: int = 6
                 ) -> list[tuple[int, int, int]]:
    """A conversation whose first message holds an image, carried for ``turns`` turns:
    (predicted, reported, prompt tokens) per turn."""
    messages, rows = [first], []
    for turn in range(turns):
        async with client.post(path, json=build(messages),
                               headers={"anthropic-version": "2023-06-01"}) as r:
            data = await r.json()
            assert r.status == 200, data
            predicted = int(r.headers["X-Kvroute-Predicted-Cached"])
        usage = data["usage"]
        if "input_tokens" in usage:  # Anthropic's: the uncached part, and the reused one
            reported = usage["cache_read_input_tokens"]
            total = usage["input_tokens"] + reported
        else:
            reported = usage["prompt_tokens_details"]["cached_tokens"]
            total = usage["prompt_tokens"]
        rows.append((predicted, reported, total))
        messages += [{"role": "assistant", "content": answer(data)},
                     {"role": "user", "content": words(12, 300 + turn)}]
    return rows


def slot_files_counted(client: TestClient[Any, Any], event: str) -> float:
    """The app's `kvroute_slot_files_total{event}` (the disk tier's saves, restores...)."""
    m = client.server.app[METRICS]
    return float(m.child(m.slot_files, event)._value.get())
