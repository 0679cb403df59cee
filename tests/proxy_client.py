"""A kvroute app on a real loopback port, driven by aiohttp's test client."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

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


def slot_files_counted(client: TestClient[Any, Any], event: str) -> float:
    """The app's `kvroute_slot_files_total{event}` (the disk tier's saves, restores...)."""
    m = client.server.app[METRICS]
    return float(m.child(m.slot_files, event)._value.get())
