"""Replicas on separate hosts: two backend hosts (a llama-server each), a broker host
(Debian's nats-server), two replica hosts (a `kvroute serve` each, both backends external
by URL and key) and a client host, each a network namespace on one bridge
(loadtest/netns.py, loadtest/hosts.py).
One conversation's turns go to the replicas in turn; each turn is predicted from what
the other replica's previous turn left, which it learns only through the broker. The
broker killed: both replicas serve and say they are alone; back: they reconnect and
predict each other's turns again. Every request stays inside the namespaces."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from texts import words

from backends.process import ServerSpec
from loadtest.hosts import (
    PROXY_PORT,
    broker_url,
    nats_binary,
    ready,
    spawn_backend,
    spawn_broker,
    spawn_replica,
    tails,
)
from loadtest.netns import Client, Net, hosts, unavailable

pytestmark = pytest.mark.timeout(120)
PORT = 8080  # every host its own ports: the same one everywhere
BACKENDS = ("b1", "b2")
REPLICAS = ("r1", "r2")
_APPLIED = re.compile(r'^kvroute_replica_events_total\{event="applied"\} (\S+)$', re.M)


@dataclass(frozen=True)
class Turn:
    backend: str
    slot: int
    predicted: int
    reused: int
    prompt: int


@dataclass
class Cluster:
    net: Net
    client: Client
    logs: Path
    broker: subprocess.Popen[bytes] | None = None

    def start_broker(self) -> None:
        self.broker = spawn_broker(self.net, "broker", self.logs)

    def url(self, host: str, path: str) -> str:
        return f"http://{self.net.ip(host)}:{PROXY_PORT}{path}"

    def status(self, host: str) -> dict[str, Any]:
        code, _, text = self.client.request("GET", self.url(host, "/kvroute/status"), timeout=5)
        return json.loads(text) if code == 200 else {}

    def connected(self, host: str) -> bool | None:
        return (self.status(host).get("replicas") or {}).get("connected")

    def applied(self, host: str) -> float:
        """Peers' events this replica applied to its view (its /metrics)."""
        _, _, text = self.client.request("GET", self.url(host, "/metrics"), timeout=5)
        m = _APPLIED.search(text)
        return float(m.group(1)) if m else 0.0

    def turn(self, host: str, messages: list[dict[str, str]]) -> Turn:
        """One turn through replica ``host``; a fixed answer goes in the history."""
        code, headers, text = self.client.request(
            "POST", self.url(host, "/v1/chat/completions"),
            {"model": "kvroute-demo", "max_tokens": 4, "messages": messages}, timeout=30)
        assert code == 200, (host, code, text[:500])
        messages.append({"role": "assistant", "content": "Noted."})
        t = json.loads(text)["timings"]
        return Turn(headers["x-kvroute-backend"], int(headers["x-kvroute-slot"]),
                    int(headers["x-kvroute-predicted-cached"]), t["cache_n"],
                    t["cache_n"] + t["prompt_n"])

    def until(self, cond: Callable[[], Any], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout} s\n{tails(self.logs)}")
            time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster(llama_server_bin: Path, demo_model: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if nats_binary() is None:
        pytest.skip("no nats-server (apt-get install nats-server; `make test` installs it "
                    "where apt is available)")
    why = unavailable()
    if why:
        pytest.skip(why)
    logs = tmp_path_factory.mktemp("hosts")
    with hosts(*BACKENDS, "broker", *REPLICAS, "client") as net, \
            net.client("client") as client:
        c = Cluster(net, client, logs)
        keys = {b: f"key-{b}-{i}" for i, b in enumerate(BACKENDS)}
        spec = ServerSpec(llama_server_bin, demo_model, PORT, slots=2, ctx_per_slot=4096,
                          cache_ram_mib=0, alias="kvroute-demo")
        urls = {b: spawn_backend(net, b, spec, logs, b, keys[b]) for b in BACKENDS}
        c.start_broker()
        for r in REPLICAS:
            spawn_replica(net, r, [{"name": b, "url": urls[b], "api_key": keys[b],
                                    "alias": "kvroute-demo"} for b in BACKENDS],
                          demo_model, logs, broker_url(net, "broker"))
        for r in REPLICAS:
            c.until(lambda r=r: ready(c.status(r), shared=True), 60,
                    f"{r} serving both backends, connected")
        yield c


def _slot(c: Cluster, host: str, turn: Turn) -> dict[str, Any] | None:
    """What replica ``host`` takes the slot of ``turn`` to hold (its /kvroute/status)."""
    slots = c.status(host).get("router", {}).get("backends", {}).get(turn.backend, {})
    return next((s for s in slots.get("slots", ()) if s["id"] == turn.slot), None)


def _learned(c: Cluster, host: str, peer: str, turn: Turn, since: float) -> bool:
    """Has ``host`` applied events of ``peer`` since it had applied ``since``, and does it
    now see the slot of ``peer``'s ``turn``, idle, as ``peer`` does? (Not a count of
    events: how many a request makes is the bus's business.)"""
    mine = _slot(c, host, turn)
    return (c.applied(host) > since and mine is not None and not mine["busy"]
            and mine == _slot(c, peer, turn))


def _alternating(c: Cluster, conv: list[dict[str, str]], order: list[str], seed: int
                 ) -> list[Turn]:
    """Turns through the replicas in ``order`` (``conv`` ends in a user message): each
    sent once its replica has learned, through the broker, what the previous turn left,
    and predicted from it."""
    turns: list[Turn] = []
    since = 0.0
    for i, host in enumerate(order):
        if turns:
            peer, prev = order[i - 1], turns[-1]
            c.until(lambda h=host, p=peer, t=prev, n=since: _learned(c, h, p, t, n), 10,
                    f"{host} learns {peer}'s turn")
            conv.append({"role": "user", "content": words(60, seed + i)})
        since = c.applied(order[i + 1]) if i + 1 < len(order) else 0.0
        t = c.turn(host, conv)
        if turns:
            assert t.backend == prev.backend and t.reused >= 0.9 * prev.prompt, (host, turns, t)
            assert abs(t.predicted - t.reused) <= max(16, 0.02 * t.prompt), (host, turns, t)
        turns.append(t)
    return turns


def test_turns_alternating_between_replica_hosts_are_predicted(cluster: Cluster) -> None:
    conv = [{"role": "system", "content": words(400, 1000)},
            {"role": "user", "content": words(30, 1001)}]
    _alternating(cluster, conv, ["r1", "r2", "r1", "r2"], 1002)


def test_broker_away_replicas_serve_alone_and_agree_again_once_it_is_back(
        cluster: Cluster) -> None:
    c = cluster
    conv = [{"role": "system", "content": words(400, 2000)},
            {"role": "user", "content": words(30, 2001)}]
    _alternating(c, conv, ["r1", "r2"], 2002)
    assert c.broker is not None
    c.broker.kill()
    c.broker.wait(10)
    for r in REPLICAS:
        c.until(lambda r=r: c.connected(r) is False, 15, f"{r} says it is alone")
    for i, r in enumerate(REPLICAS):  # each on its own view
        conv.append({"role": "user", "content": words(60, 2010 + i)})
        c.turn(r, conv)
    c.start_broker()
    for r in REPLICAS:
        c.until(lambda r=r: c.connected(r) is True, 20, f"{r} reconnects")
    conv.append({"role": "user", "content": words(60, 2020)})
    _alternating(c, conv, ["r1", "r2"], 2021)
