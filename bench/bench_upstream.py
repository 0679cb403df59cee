"""CPU per request of the proxy's backend client (proxy/forwarding/upstream.py) against aiohttp's
ClientSession, the client it replaced, on the same fake backend in one run.

    python bench/bench_upstream.py [--quick]

The fake backend (bench_proxy's: a real aiohttp server) runs in its own process; this
process sends sequential requests with each client in turn, in rounds, and measures its
own CPU time per request (`time.process_time`): the client's cost alone, whatever the
fake and the machine do meanwhile. Small chat bodies and a 200 KiB conversation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from latency import free_port, wait_up, words  # noqa: E402

from proxy.forwarding.upstream import Upstream  # noqa: E402

HEADERS = {"Content-Type": "application/json"}


async def cpu_per_request(send: Callable[[bytes], Awaitable[bytes]], body: bytes, n: int
                          ) -> float:
    """Microseconds of this process's CPU per request, after a warm-up."""
    for _ in range(max(10, n // 10)):
        await send(body)
    c0 = time.process_time()
    for _ in range(n):
        await send(body)
    return (time.process_time() - c0) / n * 1e6


async def main(quick: bool) -> dict[str, float]:
    import random

    port = free_port()
    fake = subprocess.Popen([sys.executable, str(ROOT / "bench" / "bench_proxy.py"),
                             "--role", "fake", "--port", str(port)])
    base = f"http://127.0.0.1:{port}"
    url = base + "/v1/chat/completions"
    rng = random.Random(0)
    small = json.dumps({"messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 1}).encode()
    history = [{"role": "user" if i % 2 else "assistant", "content": words(300, rng)}
               for i in range(100)]
    large = json.dumps({"messages": history, "max_tokens": 1}).encode()
    upstream = Upstream()
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4)
    try:
        async with aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                         cookie_jar=aiohttp.DummyCookieJar()) as session:
            await wait_up(session, base)

            async def via_aiohttp(body: bytes) -> bytes:
                async with session.post(url, data=body, headers=HEADERS) as r:
                    return await r.read()

            async def via_upstream(body: bytes) -> bytes:
                r = await upstream.request("POST", base, "/v1/chat/completions", body,
                                           HEADERS)
                data = await r.read()
                r.release()
                return data

            rounds, n_small, n_large = (2, 300, 30) if quick else (5, 1000, 100)
            got: dict[str, list[float]] = {}
            for _ in range(rounds):  # alternated, so that drift hits both alike
                for name, send in (("aiohttp", via_aiohttp), ("upstream", via_upstream)):
                    got.setdefault(f"{name}_small", []).append(
                        await cpu_per_request(send, small, n_small))
                    got.setdefault(f"{name}_large", []).append(
                        await cpu_per_request(send, large, n_large))
    finally:
        await upstream.close()
        fake.terminate()
        fake.wait(10)
    return {k: statistics.median(v) for k, v in got.items()}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests")
    res = asyncio.run(main(ap.parse_args().quick))
    for kind, what in (("small", "small chat body"), ("large", "200 KiB conversation")):
        a, u = res[f"aiohttp_{kind}"], res[f"upstream_{kind}"]
        print(f"{what:22s}: aiohttp ClientSession {a:6.1f} us CPU/request, "
              f"proxy.forwarding.upstream {u:6.1f} us ({a / u:.1f}x less)")
    print(json.dumps({k: round(v, 1) for k, v in res.items()}))
