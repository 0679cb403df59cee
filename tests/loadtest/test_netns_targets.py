"""The load client's guard with loadtest/netns.py's hosts: their addresses are accepted
only from a thread inside them (where nothing else is reachable); any other address,
and theirs from outside or once they are gone, still refused."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from loadtest.client import LoadClient, check_loopback
from loadtest.netns import SUBNET, hosts, unavailable

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _root() -> None:
    why = unavailable()
    if why:
        pytest.skip(why)


def test_hosts_addresses_accepted_only_from_inside_them() -> None:
    with hosts("a", "b") as net:
        url = f"http://{net.ip('a')}:8080/v1"
        with pytest.raises(ValueError, match="non-loopback"):
            check_loopback(url)  # this thread is outside: there it could leave the machine

        async def inside() -> list[str]:
            refused = []
            for bad in (f"http://{SUBNET}.99:8080", "http://10.0.0.5:8080",
                        "http://example.com", f"ftp://{net.ip('a')}:21"):
                with pytest.raises(ValueError):
                    check_loopback(bad)
                refused.append(bad)
            return [check_loopback(url), check_loopback("http://127.0.0.1:1"), *refused]

        accepted, loop, *refused = net.run_in("b", inside)
        assert accepted == f"http://{net.ip('a')}:8080"
        assert loop == "http://127.0.0.1:1" and len(refused) == 4
    with pytest.raises(ValueError, match="non-loopback"):
        check_loopback(url)


def test_a_client_inside_a_host_reaches_another(tmp_path: Path) -> None:
    with hosts("server", "client") as net:
        net.spawn("server", [sys.executable, "-m", "http.server", "--bind",
                             net.ip("server"), "--directory", str(tmp_path), "8080"])

        async def fetch() -> int:
            base = LoadClient(f"http://{net.ip('server')}:8080").base
            deadline = time.monotonic() + 20
            async with aiohttp.ClientSession() as http:
                while True:
                    try:
                        async with http.get(base + "/") as r:
                            return r.status
                    except aiohttp.ClientConnectionError:
                        if time.monotonic() > deadline:
                            raise
                        await asyncio.sleep(0.2)

        assert net.run_in("client", fetch) == 200
