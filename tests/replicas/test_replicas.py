"""Two kvroute replicas in front of the same real llama-server, sharing what their
requests leave in its slots through a real NATS broker: a conversation's next turn,
reaching the other replica, is predicted exactly from where the first one put it. The
broker away: a replica still serves, and says so. Events from peers are validated."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import random
import shutil
import socket
import subprocess
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import nats
import old_events
import orjson
import pytest
from aiohttp.test_utils import TestClient
from faults import until
from hypothesis import given, settings
from hypothesis import strategies as st
from proxy_client import ProxyServer
from texts import words

from backends.process import free_port
from backends.supervisor import Supervisor
from proxy.app import create_app
from proxy.config.load import Config, ReplicasConfig
from proxy.forwarding.upstream import Upstream
from proxy.replicas.bases import Bases
from proxy.replicas.bus import LIVE_QUEUE, SUBJECT, ReplicaBus, snapshot_subject
from proxy.replicas.events import MAX_TOKENS, Event, Kind, decode, encode
from proxy.replicas.peers import PeerView, PoolPort, Teller
from proxy.routing.cache.values import BackendCapacity
from proxy.routing.router import Router
from proxy.routing.tree.token_bytes import to_token_bytes
from proxy.server.keys import ROUTER

pytestmark = pytest.mark.timeout(120)
NATS = shutil.which("nats-server")
KEEPALIVE_S = Upstream().keepalive_s
NEEDS_NATS = pytest.mark.skipif(NATS is None, reason="no nats-server (apt-get install "
                                "nats-server; `make test` installs it where apt is available)")


@pytest.mark.parametrize("event", [
    Event("a", Kind.START, "kvroute-demo", "x", 0, 7, bytes(range(8))),
    Event("r" * 256, Kind.HELD, "", "gpu0", 65535, 0, b"\x01\x00\x00\x00" * 5000),
    Event("a", Kind.FIRST, "", "x", 1, 1 << 40),
    Event("a", Kind.END, "", "x", 1, 3, b"\x02\x00\x00\x00", 900),
    Event("a", Kind.END, "", "x", 1, 3),
    Event("a", Kind.START, "", "x", 1, 3, b"\x02\x00\x00\x00", 900, base=bytes(range(8))),
    Event("a", Kind.START, "", "x", 1, 3, b"", 2, base=bytes(8)),
    Event("a", Kind.START, "", "x", 1, 3, b"", 2, base=bytes(8), base_from=("y", 0)),
    Event("a", Kind.START, "", "x", 1, 3, bytes(8), at=1.7e9),
    Event("a", Kind.MOVED, "", "x", 1, 3),
    Event("a", Kind.START, "", "x", 1, 3, bytes(8), lora=((0, 1.0), (1, 0.5))),
    Event("a", Kind.START, "", "x", 1, 3, bytes(8), lora=((-1, 0.0),)),
    Event("r", Kind.HELD, "", "gpu0", 1, 0, bytes(8), lora=((0, 1.0), (1, 0.0))),
    Event("b", Kind.HELLO), Event("b", Kind.RESYNC), Event("b", Kind.ALIVE),
    Event("b", Kind.BYE),
])
def test_events_read_back_as_sent(event: Event) -> None:
    assert decode(encode(event)) == event


@pytest.mark.parametrize("event", [
    Event("a", Kind.START, "", "x", 1, 3, b"\x02\x00\x00\x00", 900),  # (no digest)
    Event("a", Kind.START, "", "x", 1, 3, bytes(8), 0, base=bytes(8)),  # (of nothing)
    Event("a", Kind.START, "", "x", 1, 3, b"", 1, base=bytes(8)),  # (one token)
    Event("a", Kind.START, "", "x", 1, 3, bytes(8), 9, base=bytes(7)),
    Event("a", Kind.END, "", "x", 1, 3, bytes(8), 9, base=bytes(8)),
    Event("a", Kind.START, "", "x", 1, 3, bytes(8), MAX_TOKENS, base=bytes(8)),
    Event("a", Kind.START, "", "x", 1, 3, bytes(8), 9, base=bytes(8),
          base_from=("y", 1 << 16)),
])
def test_a_start_names_its_base_whole_or_is_not_read(event: Event) -> None:
    assert decode(encode(event)) is None


@pytest.mark.parametrize("adapters", [
    "x", [], [[0]], [[0, 1.0, 2]], [["0", 1.0]], [[True, 1.0]], [[0, "1"]], [[1 << 31, 1.0]],
    [[0, 1.0]] * 1025,
])
def test_a_start_names_adapters_as_pairs_or_is_not_read(adapters: object) -> None:
    good = orjson.loads(encode(Event("a", Kind.START, "", "x", 1, 3, bytes(8))))
    assert decode(orjson.dumps({**good, "a": [[0, 1.0]]})) is not None
    assert decode(orjson.dumps({**good, "a": adapters})) is None
    end = orjson.loads(encode(Event("a", Kind.END, "", "x", 1, 3)))
    assert decode(orjson.dumps({**end, "a": [[0, 1.0]]})) is None  # (a start's, a held's)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=300), st.builds(
    lambda r, k, s, i, t, n: encode(Event(r, k, "p", "b", s, i, t, n)),
    st.text(max_size=300), st.sampled_from(Kind), st.integers(0, 1 << 16),
    st.integers(-1, 1 << 63), st.binary(min_size=0, max_size=64), st.integers(-1, 1 << 23))))
def test_whatever_a_peer_sends_is_an_event_or_nothing(data: bytes) -> None:
    got = decode(data)
    assert got is None or (len(got.tokens) % 4 == 0 and len(got.tokens) <= MAX_TOKENS * 4
                           and len(got.replica) <= 256 and 0 <= got.slot < 1 << 16
                           and 0 <= got.keep <= MAX_TOKENS and got.request >= 0)


@asynccontextmanager
async def broker(max_payload: int | None = None) -> AsyncIterator[str]:
    port = free_port()
    with tempfile.NamedTemporaryFile("w", suffix=".conf") as conf:
        conf.write("" if max_payload is None else f"max_payload: {max_payload}\n")
        conf.flush()
        proc = subprocess.Popen(
            [NATS, "-c", conf.name, "-a", "127.0.0.1", "-p", str(port)],  # type: ignore[list-item]
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            await until(lambda: _listening(port), 10)
            yield f"nats://127.0.0.1:{port}"
        finally:
            proc.terminate()
            proc.wait(10)


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
        return True
    return False


@asynccontextmanager
async def replica(cfg: Config, sup: Supervisor, url: str, name: str
                  ) -> AsyncIterator[TestClient[Any, Any]]:
    app = create_app(dataclasses.replace(cfg, replicas=ReplicasConfig(url, name)), sup)
    async with TestClient(ProxyServer(app)) as client:
        yield client


@asynccontextmanager
async def first_replica(cfg: Config
                        ) -> AsyncIterator[tuple[Supervisor, str, TestClient[Any, Any]]]:
    """``cfg``'s llama-servers, a broker, and replica r1 connected to it."""
    sup = Supervisor(cfg)
    await sup.start()
    try:
        async with broker() as url, replica(cfg, sup, url, "r1") as a:
            await until(lambda: _connected(a), 20)
            yield sup, url, a
    finally:
        await sup.stop()


@asynccontextmanager
async def two_replicas(cfg: Config, ready: Callable[[TestClient[Any, Any]], Awaitable[bool]]
                       ) -> AsyncIterator[tuple[TestClient[Any, Any], TestClient[Any, Any]]]:
    """``cfg``'s llama-servers, a broker, and replicas r1 and r2 on it, both ``ready``."""
    sup = Supervisor(cfg)
    await sup.start()
    try:
        async with broker() as url, replica(cfg, sup, url, "r1") as a, \
                replica(cfg, sup, url, "r2") as b:
            for c in (a, b):
                await until(lambda c=c: ready(c), 20)
            yield a, b
    finally:
        await sup.stop()


async def turn(client: TestClient[Any, Any], messages: list[dict[str, str]]
               ) -> tuple[int, int, int]:
    """(predicted, reused, prompt tokens) of one turn; a fixed answer goes in the history."""
    async with client.post("/v1/chat/completions", json={
            "model": "kvroute-demo", "max_tokens": 4, "messages": messages}) as r:
        body = await r.json()
        assert r.status == 200, body
        predicted = int(r.headers["X-Kvroute-Predicted-Cached"])
    messages.append({"role": "assistant", "content": "Noted."})
    t = body["timings"]
    return predicted, t["cache_n"], t["cache_n"] + t["prompt_n"]


@NEEDS_NATS
async def test_a_conversation_moves_between_replicas_predicted_exactly(
        pool_config: Callable[..., Config]) -> None:
    cfg = pool_config(n=1, slots=2, cache_ram_mib=0)
    async with two_replicas(cfg, _connected) as (a, b):
        conv = [{"role": "system", "content": words(400, 950)},
                {"role": "user", "content": words(30, 951)}]
        _, _, first = await turn(a, conv)
        held = a.server.app[ROUTER].held
        await until(lambda: any(b.server.app[ROUTER].held("a", s) == held("a", s)
                                and held("a", s) for s in (0, 1)), 20)
        conv.append({"role": "user", "content": words(20, 952)})
        predicted, reused, _ = await turn(b, conv)
        async with b.get("/metrics") as r:
            metrics = await r.text()
    assert reused >= 0.9 * first and abs(predicted - reused) <= 1, (predicted, reused, first)
    # a's prompt as it was sent, then what its answer left: b applied both
    assert 'kvroute_replica_events_total{event="applied"} 2.0' in metrics


@NEEDS_NATS
async def test_a_replica_that_joins_late_is_sent_the_others_view(
        pool_config: Callable[..., Config]) -> None:
    cfg = pool_config(n=1, slots=2, cache_ram_mib=0)
    async with first_replica(cfg) as (sup, url, a):
        conv = [{"role": "system", "content": words(300, 970)},
                {"role": "user", "content": words(30, 971)}]
        await turn(a, conv)
        held = a.server.app[ROUTER].held
        async with replica(cfg, sup, url, "r2") as b:
            await until(lambda: any(b.server.app[ROUTER].held("a", s) == held("a", s)
                                    and held("a", s) for s in (0, 1)), 20)
            conv.append({"role": "user", "content": words(20, 972)})
            predicted, reused, _ = await turn(b, conv)
            async with b.get("/kvroute/status") as r:
                status = (await r.json())["replicas"]
    assert reused > 300 and abs(predicted - reused) <= 1, (predicted, reused)
    assert status["peers"] == ["r1"] and status["peers_in_flight"] == 0


@NEEDS_NATS
async def test_a_replica_that_joins_during_a_request_reads_its_end(
        pool_config: Callable[..., Config]) -> None:
    """r2 joins while r1's request streams: r1's answer to its hello names that request,
    so r2 has its slot busy, and reads its end (relative to its start) when the client
    leaves: both end with the same view of the slot."""
    cfg = pool_config(n=1, slots=2, cache_ram_mib=0)
    body = {"model": "kvroute-demo", "stream": True, "ignore_eos": True, "max_tokens": 6000,
            "messages": [{"role": "user", "content": words(300, 980)}]}
    async with first_replica(cfg) as (sup, url, a), \
            a.post("/v1/chat/completions", json=body) as r:
        assert r.status == 200
        slot = int(r.headers["X-Kvroute-Slot"])
        await r.content.readline()  # (its first token)
        async with replica(cfg, sup, url, "r2") as b:
            await until(lambda: _in_flight(b), 20)
            r.close()  # (the client leaves: the request ends)
            held = a.server.app[ROUTER].held
            await until(lambda: held("a", slot) is not None, 20)
            await until(lambda: b.server.app[ROUTER].held("a", slot) == held("a", slot), 20)


async def _slot_turn(client: TestClient[Any, Any], messages: list[dict[str, str]]
                     ) -> tuple[int, int, int]:
    """(slot, reused, prompt tokens) of one turn (see `_placed_turn`)."""
    (_, slot), reused, prompt = await _placed_turn(client, messages)
    return slot, reused, prompt


@NEEDS_NATS
async def test_new_conversations_at_two_replicas_in_one_slot_at_once_the_later_moves(
        pool_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch) -> None:
    """Both replicas take empty slots from the first (as if each were alone), and a new
    conversation reaches each at the same instant: both choose slot 0. The later claim
    moves to slot 1, so neither cuts the other's history: each conversation's next turn
    reuses its whole last prompt."""
    monkeypatch.setattr(PeerView, "_spread", lambda self: None)
    cfg = pool_config(n=1, slots=2, cache_ram_mib=0)
    async with two_replicas(cfg, _peers) as (a, b):
        convs = [[{"role": "user", "content": words(300, 990 + k)}] for k in (0, 1)]
        first = await asyncio.gather(_slot_turn(a, convs[0]), _slot_turn(b, convs[1]))
        for c in (a, b):
            await until(lambda c=c: _settled(c), 20)
        for conv, k in zip(convs, (992, 993), strict=True):
            conv.append({"role": "user", "content": words(20, k)})
        second = [await _slot_turn(a, convs[0]), await _slot_turn(b, convs[1])]
    assert {slot for slot, _, _ in first} == {0, 1}, first
    for (_, _, prompt), (_, reused, _) in zip(first, second, strict=True):
        assert reused >= 0.9 * prompt, (first, second)


async def _peers(client: TestClient[Any, Any]) -> bool:
    async with client.get("/kvroute/status") as r:
        return bool((await r.json())["replicas"]["peers"])


async def _settled(client: TestClient[Any, Any]) -> bool:
    """No peer's request in flight, and none of its own in the router."""
    async with client.get("/kvroute/status") as r:
        replicas = (await r.json())["replicas"]
    return not replicas["peers_in_flight"] and not client.server.app[ROUTER].snapshot()[
        "inflight"]


async def _in_flight(client: TestClient[Any, Any]) -> bool:
    async with client.get("/kvroute/status") as r:
        return bool((await r.json())["replicas"]["peers_in_flight"])


@asynccontextmanager
async def two_buses(url: str, slots: int) -> AsyncIterator[
        tuple[dict[str, ReplicaBus], dict[str, collections.Counter[str]]]]:
    """Replicas a, then b, on the broker at ``url``, without the app: each a router over
    backend x (``slots`` slots) in pool p; and their events, counted."""
    buses, counts = {}, {}
    for name in ("a", "b"):
        router = Router("prefix")
        router.add_backend(BackendCapacity("x", slots, 8192, 0, 8192))
        c = counts[name] = collections.Counter[str]()
        buses[name] = ReplicaBus(url, name, PeerView(name, {"p": PoolPort(
            router, lambda h: None)}), lambda e, c=c: c.update((e,)))
    try:
        for bus in buses.values():
            await bus.start()
            await until(lambda bus=bus: bus.connected, 20)
        yield buses, counts
    finally:
        for bus in buses.values():
            await bus.close()


def _router(bus: ReplicaBus) -> Router:
    return bus.view.pools["p"].router


async def tap_on(nc: Any, subject: str, cb: Callable[[Any], Awaitable[None]]) -> Any:
    """``nc``'s subscription to ``subject``, live at the broker once this returns. A flush
    does not say so: the client writes its PING at once, ahead of the SUB still in its
    buffer, and the PONG can come back before the broker has read the SUB (a message
    published meanwhile does not reach the tap). A message of its own, sent after the SUB
    on the same connection, does: the broker reads a connection's commands in order."""
    sub = await nc.subscribe(subject, cb=cb)
    echoed = asyncio.Event()

    async def echo(_: Any) -> None:
        echoed.set()

    inbox = nc.new_inbox()
    probe = await nc.subscribe(inbox, cb=echo)
    await nc.publish(inbox, b"")
    await until(echoed.is_set, 20)
    await probe.unsubscribe()
    return sub


@NEEDS_NATS
async def test_a_view_larger_than_the_live_queue_and_live_events_both_go_whole() -> None:
    """a's view (more idle slots than the live queue holds) goes to a replica that
    says hello while as many live events as that queue holds go out: nothing is
    dropped, the joiner takes every slot and gets every live event."""
    n = LIVE_QUEUE + 100
    async with broker() as url, two_buses(url, n) as (buses, counts):
        a, b = buses["a"], buses["b"]
        for slot in range(n):
            assert _router(a).seed("x", slot, to_token_bytes([slot + 1, slot + 2]))
        a._apply(encode(Event("b", Kind.HELLO)))
        for i in range(LIVE_QUEUE):
            a.publish(Event("a", Kind.FIRST, "p", "x", 0, i))
        # (b knows no such request: each one ignored)
        await until(lambda: counts["b"]["ignored"] == LIVE_QUEUE, 20)
        await until(lambda: all(_router(b).held("x", s) == _router(a).held("x", s)
                                for s in range(n)), 20)
        assert counts["a"]["dropped"] == 0


@NEEDS_NATS
async def test_events_larger_than_the_brokers_limit_arrive_whole() -> None:
    """On a broker that takes 4 kB a message: a start of 5,000 tokens (~17 kB) on the live
    subject, and a slot of as many in the view a replica that says hello is sent, are
    read whole; nothing is dropped, none held in parts after."""
    rng = random.Random(7)
    prompt, held = (to_token_bytes([rng.randrange(150_000) for _ in range(5000)])
                    for _ in range(2))
    async with broker(max_payload=4096) as url, two_buses(url, 2) as (buses, counts):
        a, b = buses["a"], buses["b"]
        assert a._nc.max_payload == 4096 and len(encode(Event(
            "a", Kind.HELD, "p", "x", 1, 0, held))) > 4 * 4096
        a.publish(Event("a", Kind.START, "p", "x", 0, 1, prompt))
        await until(lambda: b.view.in_flight == 1, 20)
        assert b.view._told["a", "p", 1].prompt == prompt
        assert _router(a).seed("x", 1, held)
        a._apply(encode(Event("b", Kind.HELLO)))
        await until(lambda: _router(b).held("x", 1) == held, 20)
        assert counts["a"]["dropped"] == 0 and b._parts.held == 0
        assert not counts["b"]["invalid"] and not counts["b"]["incomplete"]


@NEEDS_NATS
async def test_a_replica_back_on_the_broker_tells_its_requests_in_flight_again() -> None:
    """A request a started while cut off from the broker (its start lost): once a is
    back, b has it in flight."""
    async with broker() as url, two_buses(url, 2) as (buses, _):
        a = buses["a"]
        cut_off = Teller("a", "p", lambda e: None, a.view.touched)
        a.tellers.append(cut_off)
        cut_off.started("x", 0, 7, to_token_bytes(list(range(100))))
        await a._up()
        await until(lambda: buses["b"].view.in_flight == 1, 20)


@NEEDS_NATS
async def test_a_start_against_a_base_a_replica_lacks_gets_it_the_start_whole() -> None:
    """b lost what a's first start told slot 0 (a missed event): a's next start there,
    relative to it, is unreadable at b, which says hello again: a sends it its requests
    in flight, whole, and b reads the next start."""
    prompt = to_token_bytes(list(range(500)))
    async with broker() as url, two_buses(url, 2) as (buses, counts):
        a, b = buses["a"], buses["b"]
        teller = Teller("a", "p", a.publish, a.view.touched)
        a.tellers.append(teller)
        teller.started("x", 0, 0, prompt)
        await until(lambda: b.view.in_flight == 1, 20)
        b.bases = Bases()
        for request in (1, 2):
            teller.started("x", 0, request, prompt + to_token_bytes([request]))
            await until(lambda r=request: b.view.in_flight == r + 1, 20)
        assert counts["b"]["unreadable"] == 1


@NEEDS_NATS
async def test_a_views_starts_are_not_overtaken_by_their_ends_on_the_live_path() -> None:
    """a's view for b holds more starts than the client buffers before it flushes (a
    publish then waits); their requests end meanwhile: b reads each end after its
    start (none ignored)."""
    rng = random.Random(3)
    n = 200  # of 8000 tokens (a slot's context): ~27 kB each, 2 MB buffered after ~80
    async with broker() as url, two_buses(url, 2) as (buses, counts):
        a, b = buses["a"], buses["b"]
        cut_off = Teller("a", "p", lambda e: None, a.view.touched)
        a.tellers.append(cut_off)
        for request in range(n):
            cut_off.started("x", request % 2, request, to_token_bytes(
                [rng.randrange(150_000) for _ in range(8000)]))
        cut_off.send = a.publish
        ignored, applied = counts["b"]["ignored"], counts["b"]["applied"]
        a._apply(encode(Event("b", Kind.HELLO)))
        await asyncio.sleep(0)  # (the view starts going out)
        for request in range(n):
            cut_off.freed("x", request % 2, request, None)
        await until(lambda: counts["b"]["applied"] + counts["b"]["ignored"]
                    >= applied + ignored + 2 * n, 30)
        assert counts["b"]["ignored"] == ignored
        assert b.view.in_flight == 0


@NEEDS_NATS
async def test_a_resync_is_answered_with_the_requests_in_flight_a_hello_with_all() -> None:
    """A replica asking to resync (it missed a base) has what the slots hold: a sends
    it its requests in flight only; a hello gets those and every idle slot's content."""
    async with broker() as url, two_buses(url, 2) as (buses, _):
        a = buses["a"]
        teller = Teller("a", "p", lambda e: None, a.view.touched)
        a.tellers.append(teller)
        teller.started("x", 0, 7, to_token_bytes(list(range(100))))
        assert _router(a).seed("x", 1, to_token_bytes([1, 2, 3]))
        got: list[Kind | None] = []

        async def tapped(msg: Any) -> None:
            got.append(None if (e := decode(msg.data)) is None else e.kind)

        tap = await nats.connect(url)
        try:
            sub = await tap_on(tap, snapshot_subject("c"), tapped)
            a._apply(encode(Event("c", Kind.RESYNC)))
            a._apply(encode(Event("c", Kind.HELLO)))
            await until(lambda: Kind.HELD in got, 20)
            assert got == [Kind.START, Kind.START, Kind.HELD]
            await sub.unsubscribe()
        finally:
            await tap.close()


@NEEDS_NATS
async def test_a_turn_goes_as_what_it_adds_to_the_last_and_is_read_whole() -> None:
    """a's next turn in a slot goes out as the tokens it adds to the one before (a tap
    on the subject sees it), or to what the slot held after its end (the prompt, then
    the answer), and b reads its whole prompt; after a replica said hello, a's next
    start goes whole (the joiner holds none of a's)."""
    rng = random.Random(5)
    history, answer = ([rng.randrange(150_000) for _ in range(n)] for n in (600, 300))
    asked = [*history, *range(20)]
    prompts = [history, asked, [*asked, *answer, *range(30)], [*history, *range(40)]]
    sizes: list[int] = []

    async def tapped(msg: Any) -> None:
        if (e := decode(msg.data)) is not None and e.kind == Kind.START:
            sizes.append(len(msg.data))

    async with broker() as url, two_buses(url, 2) as (buses, _):
        a, b = buses["a"], buses["b"]
        tap = await nats.connect(url)
        try:
            await tap_on(tap, SUBJECT, tapped)  # (before a's first start goes out)
            for request, prompt in enumerate(prompts):
                if request == 2:  # (its slot holds the turn before, then its answer)
                    a.publish(Event("a", Kind.END, "p", "x", 0, 1, to_token_bytes(answer),
                                    len(asked)))
                if request == 3:
                    a._apply(encode(Event("c", Kind.HELLO)))
                a.publish(Event("a", Kind.START, "p", "x", 0, request, to_token_bytes(prompt)))
                await until(lambda r=request: len(sizes) > r, 20)
                await until(lambda r=request: ("a", "p", r) in b.view._told, 20)
                assert b.view._told["a", "p", request].prompt == to_token_bytes(prompt)
        finally:
            await tap.close()
    whole, turn, after_answer, after_hello = sizes
    assert turn < whole / 10 and after_answer < whole / 10 and after_hello > whole


async def _connected(client: TestClient[Any, Any]) -> bool:
    async with client.get("/kvroute/status") as r:
        return bool((await r.json())["replicas"]["connected"])


async def test_a_turn_after_a_pause_is_told_with_its_whole_prompt(
        pool_config: Callable[..., Config]) -> None:
    """A turn tokenized in two parts (its history's head, then the rest beside the
    send) whose rest is done before it is sent (the backend's idle connection expired
    meanwhile: a new one takes longer) is told to the others with all of its prompt."""
    cfg = pool_config(n=1, slots=1, cache_ram_mib=0)
    sup = Supervisor(cfg)
    await sup.start()
    try:
        async with replica(cfg, sup, f"nats://127.0.0.1:{free_port()}", "alone") as c:
            conv = [{"role": "system", "content": words(600, 965)},
                    {"role": "user", "content": words(20, 966)}]
            await turn(c, conv)
            await asyncio.sleep(KEEPALIVE_S + 0.5)
            conv.append({"role": "user", "content": words(20, 967)})
            predicted, reused, _ = await turn(c, conv)
    finally:
        await sup.stop()
    assert predicted == reused > 600


async def test_without_its_broker_a_replica_serves_on_its_own_view(
        pool_config: Callable[..., Config]) -> None:
    cfg = pool_config(n=1, slots=1, cache_ram_mib=0)
    sup = Supervisor(cfg)
    await sup.start()
    try:
        async with replica(cfg, sup, f"nats://127.0.0.1:{free_port()}", "alone") as c:
            conv = [{"role": "user", "content": words(200, 960)}]
            await turn(c, conv)
            conv.append({"role": "user", "content": words(10, 961)})
            predicted, reused, _ = await turn(c, conv)
            assert predicted == reused > 0
            async with c.get("/kvroute/status") as r:
                status = (await r.json())["replicas"]
            assert status["id"] == "alone" and status["connected"] is False
    finally:
        await sup.stop()


@NEEDS_NATS
@pytest.mark.timeout(240)
async def test_a_burst_of_new_conversations_over_one_prompt_through_two_replicas(
        pool_config: Callable[..., Config]) -> None:
    """Four new conversations over one system prompt reach two replicas at once (two
    each), 2 servers x 2 slots: enough slots for all. Each takes a slot of its own, so
    no next turn, sent to the other replica, loses its history (as through one)."""
    cfg = pool_config(n=2, slots=2, cache_ram_mib=0)
    async with two_replicas(cfg, _peers) as (a, b):
        system = words(700, 980)
        convs = [[{"role": "system", "content": system},
                  {"role": "user", "content": words(250, 981 + k)}] for k in range(4)]
        via = [a, b, a, b]
        turns = [await asyncio.gather(*(_placed_turn(via[k], convs[k])
                                        for k in range(4)))]
        for n in range(2):
            for c in (a, b):
                await until(lambda c=c: _settled(c), 20)
            for k, conv in enumerate(convs):
                conv.append({"role": "user", "content": words(20, 990 + 4 * n + k)})
            via = via[1:] + via[:1]  # each conversation's next turn: the other replica
            turns.append(await asyncio.gather(*(_placed_turn(via[k], convs[k])
                                                for k in range(4))))
    assert len({where for where, _, _ in turns[0]}) == 4, turns[0]
    for before, after in itertools.pairwise(turns):
        for (_, _, prompt), (_, reused, _) in zip(before, after, strict=True):
            assert reused >= 0.9 * prompt, turns


async def _placed_turn(client: TestClient[Any, Any], messages: list[dict[str, str]]
                       ) -> tuple[tuple[str, int], int, int]:
    """((backend, slot), reused, prompt tokens) of one turn (see `_slot_turn`)."""
    async with client.post("/v1/chat/completions", json={
            "model": "kvroute-demo", "max_tokens": 4, "messages": messages}) as r:
        body = await r.json()
        assert r.status == 200, body
        where = (r.headers["X-Kvroute-Backend"], int(r.headers["X-Kvroute-Slot"]))
    messages.append({"role": "assistant", "content": "Noted."})
    t = body["timings"]
    return where, t["cache_n"], t["cache_n"] + t["prompt_n"]


@NEEDS_NATS
async def test_a_replica_from_before_claims_reads_every_request_sent() -> None:
    """A rolling upgrade: a replica of the version before claims (its decoder kept
    verbatim, old_events.py) beside this one. It drops a claim (a start with its time)
    and a move, reads the rest as this version's b does, and reads each start told
    again once sent whole: a claim is no base the next start goes against."""
    rng = random.Random(11)
    history, answer, more = ([rng.randrange(150_000) for _ in range(n)]
                             for n in (400, 50, 30))
    turn = to_token_bytes([*history, *answer, *more])
    got: list[old_events.Event | None] = []

    async def tapped(msg: Any) -> None:
        got.append(old_events.decode(msg.data))

    async with broker() as url, two_buses(url, 2) as (buses, counts):
        a, b = buses["a"], buses["b"]
        teller = Teller("a", "p", a.publish, a.view.touched)
        tap = await nats.connect(url)
        try:
            await tap_on(tap, SUBJECT, tapped)
            teller.started("x", 0, 0, to_token_bytes(history))
            teller.freed("x", 0, 0, to_token_bytes([*history, *answer]))
            teller.claimed("x", 1, 1, turn, 1.7e9)  # (won: then sent)
            teller.started("x", 1, 1, turn)
            teller.claimed("x", 0, 2, turn, 1.7e9)  # (lost: it moves)
            teller.withdrawn("x", 2)
            await until(lambda: len(got) == 6 and counts["b"]["applied"] == 5, 20)
            assert b.view._told["a", "p", 1].prompt == turn and b.view.in_flight == 1
        finally:
            await tap.close()
    assert [None if e is None else e.kind.value for e in got] == [
        "start", "end", None, "start", None, None]
    old = Bases()  # (as the old replica reads them: unchanged since)
    read = []
    for e in (e for e in got if e is not None):
        new = Event(**{**dataclasses.asdict(e), "kind": Kind(e.kind.value)})
        if (whole := old.whole(new)) is not None:
            (old.told if new.kind == Kind.START else old.ended)(whole)
        read.append(whole)
    assert read[2] is not None and read[2].tokens == turn, read
