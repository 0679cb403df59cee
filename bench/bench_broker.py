"""NATS against Redis as the replicas' broker, measured with kvroute's own event codec.

    python3 -m venv /tmp/benchvenv && /tmp/benchvenv/bin/pip install redis nats-py orjson
    /tmp/benchvenv/bin/python bench/bench_broker.py [--seconds 8] [--rate 20]

Runs in a venv of its own: the Redis client is this bench's dependency, never kvroute's.
The codec (proxy/replicas/events.py) is imported from this tree via sys.path. Starts
Debian's nats-server and redis-server itself (`apt-get install nats-server redis-server`)
on free 127.0.0.1 ports, default settings but no persistence, then for each broker a
publisher ("replica A", this process) and a subscriber ("replica B", a child process):

- publish -> apply latency p50 / p99 at `--rate` events/s, events of 2k, 8k and 32k
  tokens (encode, publish, broker, receive, decode; the router's own `observe` is not in
  it: bench_core.py measures the tree);
- saturation: pre-encoded events sent back to back, each publish awaited as the bus's
  sender awaits it; sustained = applied / (last applied - first sent);
- bytes per event: the codec's payload and what the broker's own counters saw;
- a broker restart (stopped 5 s, started again on the same port) under 20 events/s of 8k
  tokens: when events flow again, how many are lost, and what the client library did
  (reconnected alone, or raised to our code);
- a late joiner's snapshot (16 slots x 8k tokens): a NATS request/reply against a Redis
  GET of a key the peer keeps;
- order per publisher (out-of-order deliveries, counted).

Token ids: real ones, from the project's tokenizer (Qwen2's vocabulary, the demo
model's) on this tree's own README, docs and sources, as a coding agent's context would
hold; `--tokenizer-python` names a Python with llama-cpp-python (default: ./.venv's).
Without one, random ids in Qwen2's vocabulary range drawn Zipf-like from 8,192 distinct
ids (repetition as text has); the run says which. Everything is bounded in time
(`--time-limit`) and stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from array import array
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proxy.replicas.events import Event, Kind, decode, encode  # noqa: E402

SUBJECT = "kvroute.events"  # the bus's subject, and the Redis channel here
SNAPSHOT_SUBJECT = "kvroute.snapshot"
SIZES = (2048, 8192, 32768)
SATURATION_EVENTS = {2048: 3000, 8192: 1000, 32768: 300}  # ~20-30 MB each
QWEN2_VOCAB = 151_936
HOST = "127.0.0.1"


def event(phase: str, seq: int, sent_ns: int, tokens: bytes, slot: int = 0) -> bytes:
    """An event carrying ``tokens`` as the bus sends it: a request's start with its
    prompt. The phase rides in the pool's name and the sequence number and send time in
    the backend's."""
    return encode(Event("A", Kind.START, phase, f"{seq}:{sent_ns}", slot, seq, tokens))


CODEC = "Event (kind start: a request's prompt)"


def now_ns() -> int:
    return time.monotonic_ns()  # CLOCK_MONOTONIC: one clock for both processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


# -- token ids ---------------------------------------------------------------------------

_TOKENIZE = r"""
import sys
from array import array
from pathlib import Path
from proxy.prompt.llama import llama_cpp
from backends.binary import find_llama_cpp_source
src = find_llama_cpp_source()
if src is None:
    sys.exit(3)
gguf = src / "vendor" / "llama.cpp" / "models" / "ggml-vocab-qwen2.gguf"
llama = llama_cpp.Llama(model_path=str(gguf), vocab_only=True, verbose=False)
root = Path(".")
files = [root / "README.md", *sorted(root.glob("docs/*.md")), *sorted(root.glob("proxy/**/*.py"))]
text = "\n\n".join(f.read_text() for f in files)[:600_000]
ids = llama.tokenize(text.encode(), add_bos=False, special=False)
sys.stdout.buffer.write(array("i", ids).tobytes())
"""


def token_corpus(python: str | None) -> tuple[array, str]:
    """int32 ids for the events (at least 2x the largest size), and where they came from."""
    python = python or str(ROOT / ".venv" / "bin" / "python")
    if Path(python).exists():
        try:
            out = subprocess.run([python, "-c", _TOKENIZE], cwd=ROOT, capture_output=True,
                                 timeout=120, check=True).stdout
            ids = array("i")
            ids.frombytes(out)
            if len(ids) >= 2 * max(SIZES):
                return ids, (f"real: this tree's README, docs and sources tokenized with "
                             f"Qwen2's vocabulary ({len(ids):,} tokens)")
        except (subprocess.SubprocessError, OSError):
            pass
    rng = random.Random(0)
    distinct = rng.sample(range(QWEN2_VOCAB), 8192)
    weights = [1.0 / (rank + 1) for rank in range(len(distinct))]
    ids = array("i", rng.choices(distinct, weights, k=4 * max(SIZES)))
    return ids, "random: Zipf over 8,192 distinct ids in Qwen2's range (no tokenizer found)"


def tokens_for(corpus: array, i: int, n: int) -> bytes:
    """Event i's slot content: n consecutive ids from its own offset into the corpus."""
    off = (i * 7919) % (len(corpus) - n)
    return corpus[off:off + n].tobytes()


# -- brokers -----------------------------------------------------------------------------

@dataclass
class Broker:
    name: str
    binary: str
    workdir: Path
    port: int = field(default_factory=free_port)
    monitor_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        if self.name == "nats":
            return [self.binary, "-a", HOST, "-p", str(self.port), "-m", str(self.monitor_port)]
        return [self.binary, "--bind", HOST, "--port", str(self.port), "--save", "",
                "--appendonly", "no", "--dir", str(self.workdir), "--daemonize", "no"]

    def start(self, timeout: float = 10.0) -> None:
        log = (self.workdir / f"{self.name}.log").open("ab")
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection((HOST, self.port), 0.2):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} did not start on {HOST}:{self.port}: "
                           f"see {self.workdir / f'{self.name}.log'}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    def counters(self) -> tuple[int, int, int]:
        """(bytes in, bytes out, messages in) as the broker counts them."""
        if self.name == "nats":
            with urllib.request.urlopen(f"http://{HOST}:{self.monitor_port}/varz",
                                        timeout=2) as r:
                v = json.loads(r.read())
            return int(v["in_bytes"]), int(v["out_bytes"]), int(v["in_msgs"])
        out = subprocess.run(["redis-cli", "-h", HOST, "-p", str(self.port), "INFO", "stats"],
                             capture_output=True, text=True, timeout=5).stdout
        stats = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        return (int(stats["total_net_input_bytes"]), int(stats["total_net_output_bytes"]), 0)


# -- clients -----------------------------------------------------------------------------

class Publisher:
    """Replica A's side: one connection, the way the bus would hold it."""

    def __init__(self, broker: str, port: int) -> None:
        self.broker, self.port = broker, port
        self.client: Any = None

    async def connect(self) -> None:
        if self.broker == "nats":
            import nats

            async def quiet(e: Exception) -> None:
                pass  # (reconnection attempts while the broker is away: expected here)

            self.client = await nats.connect(  # the bus's settings
                servers=[f"nats://{HOST}:{self.port}"], connect_timeout=2,
                allow_reconnect=True, max_reconnect_attempts=-1, reconnect_time_wait=1,
                error_cb=quiet)
        else:
            import redis.asyncio as redis
            self.client = redis.Redis(host=HOST, port=self.port)  # the client's defaults
            await self.client.ping()

    async def publish(self, data: bytes) -> None:
        if self.broker == "nats":
            await self.client.publish(SUBJECT, data)  # buffered; no answer to wait for
        else:
            await self.client.publish(SUBJECT, data)  # one round trip: the count of readers

    async def flush(self) -> None:
        if self.broker == "nats":
            await self.client.flush(timeout=30)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.broker == "nats":
                await self.client.close()
            else:
                await self.client.aclose()


async def subscriber(broker: str, port: int) -> None:
    """Replica B (the child process): applies every event and answers `dump` on stdin with
    what it applied since the last one: [phase, seq, latency_ns, bytes, applied_ns]."""
    records: list[list[Any]] = []
    happened: list[list[Any]] = []  # [what, monotonic ns, detail]

    def apply(data: bytes) -> None:
        e = decode(data)
        t = now_ns()
        if e is None:
            happened.append(["invalid", t, len(data)])
            return
        seq, sent = e.backend.split(":")
        records.append([e.pool, int(seq), t - int(sent), len(data), t])

    async def note(what: str, detail: str = "") -> None:
        happened.append([what, now_ns(), detail])

    tasks: list[asyncio.Task[None]] = []
    if broker == "nats":
        import nats

        async def on_msg(msg: Any) -> None:
            apply(msg.data)

        async def down() -> None:
            await note("down")

        async def up() -> None:
            await note("up")

        async def error(e: Exception) -> None:
            await note("error", type(e).__name__)

        nc = await nats.connect(
            servers=[f"nats://{HOST}:{port}"], connect_timeout=2, allow_reconnect=True,
            max_reconnect_attempts=-1, reconnect_time_wait=1, disconnected_cb=down,
            reconnected_cb=up, error_cb=error)
        await nc.subscribe(SUBJECT, cb=on_msg)
        await nc.flush()
    else:
        import redis.asyncio as redis
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import TimeoutError as RedisTimeoutError

        r = redis.Redis(host=HOST, port=port)
        ps = r.pubsub()
        await ps.subscribe(SUBJECT)

        async def listen() -> None:
            broken = False
            while True:
                try:
                    msg = await ps.get_message(ignore_subscribe_messages=True, timeout=1.0)
                except (RedisConnectionError, RedisTimeoutError, OSError) as e:
                    # redis-py has retried (and backed off) already: it is up to us now
                    await note("raised", type(e).__name__)
                    broken = True
                    await asyncio.sleep(0.5)
                    continue
                if broken:
                    broken = False
                    await note("up")
                if msg is not None and msg["type"] == "message":
                    apply(msg["data"])

        await ps.get_message(timeout=5)  # (the subscribe confirmation)
        tasks.append(asyncio.create_task(listen()))

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print("ready", flush=True)
    while line := (await reader.readline()).strip():
        if line == b"dump":
            print(json.dumps({"records": records, "happened": happened}), flush=True)
            records, happened = [], []
        elif line == b"quit":
            break
    for t in tasks:
        t.cancel()


class Subscriber:
    """The main process's handle on replica B."""

    def __init__(self, broker: str, port: int) -> None:
        self.broker, self.port = broker, port
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--role", "sub", "--broker", self.broker,
            "--port", str(self.port), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, limit=1 << 28)
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), 20)
        if line.strip() != b"ready":
            raise RuntimeError(f"{self.broker} subscriber did not start: {line!r}")

    async def dump(self) -> tuple[list[list[Any]], list[list[Any]]]:
        assert self.proc is not None and self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(b"dump\n")
        await self.proc.stdin.drain()
        got = json.loads(await asyncio.wait_for(self.proc.stdout.readline(), 30))
        return got["records"], got["happened"]

    async def stop(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        with contextlib.suppress(Exception):
            assert self.proc.stdin is not None
            self.proc.stdin.write(b"quit\n")
            await self.proc.stdin.drain()
        try:
            await asyncio.wait_for(self.proc.wait(), 5)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()


# -- phases ------------------------------------------------------------------------------

@dataclass
class Paced:
    generated: int = 0
    generated_ns: list[int] = field(default_factory=list)  # when each event was made
    publish_failed: int = 0
    records: list[list[Any]] = field(default_factory=list)
    happened: list[list[Any]] = field(default_factory=list)


async def paced(pub: Publisher, sub: Subscriber, corpus: array, phase: str, size: int,
                rate: float, seconds: float,
                at: dict[float, Callable[[], Awaitable[None]]] | None = None) -> Paced:
    """`rate` events/s for `seconds`: a producer that never waits (a request ending) and a
    sender that awaits each publish, with a bounded queue between them, as the bus has.
    `at` runs actions (a broker stop, a start) at those seconds into the phase."""
    out = Paced()
    queue: asyncio.Queue[bytes] = asyncio.Queue(1024)

    async def send() -> None:
        while True:
            data = await queue.get()
            try:
                await pub.publish(data)
            except Exception:  # (the broker away: the client gave up on this one)
                out.publish_failed += 1

    async def actions() -> None:
        t0 = time.monotonic()
        for when, act in sorted((at or {}).items()):
            await asyncio.sleep(max(0.0, t0 + when - time.monotonic()))
            await act()

    sender = asyncio.create_task(send())
    acting = asyncio.create_task(actions())
    t0 = time.monotonic()
    for i in range(int(rate * seconds)):
        await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
        data = event(phase, i, now_ns(), tokens_for(corpus, i, size))
        if queue.full():
            queue.get_nowait()
            out.publish_failed += 1
        queue.put_nowait(data)
        out.generated += 1
        out.generated_ns.append(now_ns())
    await acting
    deadline = time.monotonic() + 10
    while not queue.empty() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)  # (the last ones' way through)
    sender.cancel()
    await asyncio.gather(sender, return_exceptions=True)
    out.records, out.happened = await sub.dump()
    return out


async def saturate(pub: Publisher, sub: Subscriber, corpus: array, size: int
                   ) -> tuple[float, float, int, int]:
    """(sent/s, applied/s, sent, applied): pre-encoded events back to back."""
    n, phase = SATURATION_EVENTS[size], f"sat{size}"
    events = [event(phase, i, 0, tokens_for(corpus, i, size))
              for i in range(n)]
    t0 = now_ns()
    sent = 0
    deadline = time.monotonic() + 30
    for data in events:
        await pub.publish(data)
        sent += 1
        if time.monotonic() > deadline:
            break
    await pub.flush()
    t_sent = now_ns()
    applied: list[list[Any]] = []
    quiet = 0
    while quiet < 3 and time.monotonic() < deadline + 15:  # until nothing more arrives
        await asyncio.sleep(0.5)
        records, _ = await sub.dump()
        applied += [r for r in records if r[0] == phase]
        quiet = quiet + 1 if not records else 0
        if len(applied) >= sent:
            break
    last = max((r[4] for r in applied), default=t_sent)
    return (sent / ((t_sent - t0) / 1e9), len(applied) / max(1e-9, (last - t0) / 1e9),
            sent, len(applied))


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def out_of_order(records: list[list[Any]]) -> int:
    last, n = -1, 0
    for r in records:
        n += r[1] < last
        last = max(last, r[1])
    return n


async def snapshot_rtt(broker: Broker, corpus: array, rounds: int = 20) -> tuple[float, int]:
    """Median ms for a late joiner to fetch a peer's view (16 slots x 8k tokens) and its
    size: NATS request/reply to a peer's responder; Redis GET of a key the peer keeps."""
    view = b"\n".join(event("view", i, 0, tokens_for(corpus, i, 8192), i % 4)
                      for i in range(16))
    times: list[float] = []
    if broker.name == "nats":
        import nats
        url = f"nats://{HOST}:{broker.port}"
        peer, joiner = await nats.connect(servers=[url]), await nats.connect(servers=[url])

        async def answer(msg: Any) -> None:
            await msg.respond(view)

        await peer.subscribe(SNAPSHOT_SUBJECT, cb=answer)
        await peer.flush()
        for _ in range(rounds):
            t = time.perf_counter()
            reply = await joiner.request(SNAPSHOT_SUBJECT, b"", timeout=5)
            times.append(time.perf_counter() - t)
            assert reply.data == view
        await peer.close()
        await joiner.close()
    else:
        import redis.asyncio as redis
        peer_r, joiner_r = (redis.Redis(host=HOST, port=broker.port),
                            redis.Redis(host=HOST, port=broker.port))
        await peer_r.set("kvroute:view:A", view)
        for _ in range(rounds):
            t = time.perf_counter()
            got = await joiner_r.get("kvroute:view:A")
            times.append(time.perf_counter() - t)
            assert got == view
        await peer_r.aclose()
        await joiner_r.aclose()
    return statistics.median(times) * 1e3, len(view)


@dataclass
class Result:
    latency: dict[int, tuple[float, float, int, int]] = field(default_factory=dict)
    saturation: dict[int, tuple[float, float, int, int]] = field(default_factory=dict)
    payload: dict[int, float] = field(default_factory=dict)
    wire: dict[int, tuple[float, float]] = field(default_factory=dict)
    out_of_order: int = 0
    restart: dict[str, Any] = field(default_factory=dict)
    snapshot: tuple[float, int] = (0.0, 0)


async def measure(broker: Broker, corpus: array, args: argparse.Namespace) -> Result:
    res = Result()
    broker.start()
    sub, pub = Subscriber(broker.name, broker.port), Publisher(broker.name, broker.port)
    try:
        await sub.start()
        await pub.connect()
        await asyncio.sleep(0.5)
        for size in SIZES:
            before = broker.counters()
            p = await paced(pub, sub, corpus, f"rate{size}", size, args.rate, args.seconds)
            after = broker.counters()
            lat = [r[2] / 1e6 for r in p.records if r[0] == f"rate{size}"]
            res.latency[size] = (pct(lat, 0.5), pct(lat, 0.99), len(lat), p.generated)
            res.payload[size] = statistics.mean(r[3] for r in p.records) if p.records else 0
            res.wire[size] = ((after[0] - before[0]) / max(1, p.generated),
                              (after[1] - before[1]) / max(1, p.generated))
            res.out_of_order += out_of_order(p.records)
            print(f"  {broker.name} {size} tokens at {args.rate:g}/s: p50 "
                  f"{res.latency[size][0]:.2f} ms, p99 {res.latency[size][1]:.2f} ms, "
                  f"{len(lat)}/{p.generated} applied", flush=True)
        for size in SIZES:
            res.saturation[size] = await saturate(pub, sub, corpus, size)
            print(f"  {broker.name} {size} tokens, saturation: sent "
                  f"{res.saturation[size][0]:.0f}/s, applied {res.saturation[size][1]:.0f}/s "
                  f"({res.saturation[size][3]}/{res.saturation[size][2]})", flush=True)
        res.snapshot = await snapshot_rtt(broker, corpus)
        res.restart = await restart(broker, pub, sub, corpus, args)
        print(f"  {broker.name} restart: {res.restart}", flush=True)
    finally:
        await pub.close()
        await sub.stop()
        broker.stop()
    return res


async def restart(broker: Broker, pub: Publisher, sub: Subscriber, corpus: array,
                  args: argparse.Namespace) -> dict[str, Any]:
    """20 events/s of 8k tokens; the broker stopped at 2 s, started again 5 s later."""
    marks: dict[str, int] = {}

    async def stop() -> None:
        await asyncio.to_thread(broker.stop)
        marks["stopped"] = now_ns()

    async def start() -> None:
        marks["started"] = now_ns()  # (the process launched: clients may beat the port poll)
        await asyncio.to_thread(broker.start)

    p = await paced(pub, sub, corpus, "restart", 8192, 20.0, 2 + args.down + 10,
                    at={2.0: stop, 2.0 + args.down: start})
    recs = [r for r in p.records if r[0] == "restart"]
    after = [r for r in recs if r[4] > marks["started"]]
    first_after = min((r[4] for r in after), default=None)
    seen = {r[1] for r in recs}
    ups = [h[1] for h in p.happened if h[0] == "up" and h[1] > marks["started"]]
    raised = [h[2] for h in p.happened if h[0] == "raised"]
    back = ups[0] if ups else marks["started"]
    return {
        "generated": p.generated,
        "applied": len(seen),
        "lost": p.generated - len(seen),
        # made once the subscriber was back (its subscription on the broker again)
        "lost_after": sum(1 for i, t in enumerate(p.generated_ns) if t > back and i not in seen),
        "publish_failed": p.publish_failed,
        "reconnected_s": (ups[0] - marks["started"]) / 1e9 if ups else None,
        "flowing_s": (first_after - marks["started"]) / 1e9 if first_after else None,
        "raised_to_us": len(raised),
        "raised": sorted(set(raised)),
        "out_of_order": out_of_order(recs),
    }


def table(results: dict[str, Result], source: str, args: argparse.Namespace) -> str:
    n, r = results["nats"], results["redis"]

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}x" if b else "-"

    rows = ["| figure | NATS | Redis | NATS / Redis |", "|---|---|---|---|"]
    for size in SIZES:
        a, b = n.latency[size], r.latency[size]
        rows.append(f"| {size // 1024}k tokens, {args.rate:g}/s: latency p50 | {a[0]:.2f} ms "
                    f"| {b[0]:.2f} ms | {ratio(a[0], b[0])} |")
        rows.append(f"| ... p99 ({a[3]} events) | {a[1]:.2f} ms | {b[1]:.2f} ms "
                    f"| {ratio(a[1], b[1])} |")
    for size in SIZES:
        a2, b2 = n.saturation[size], r.saturation[size]
        rows.append(f"| {size // 1024}k tokens, saturation: applied/s (sent/s; applied/sent) "
                    f"| {a2[1]:,.0f} ({a2[0]:,.0f}; {a2[3]}/{a2[2]}) "
                    f"| {b2[1]:,.0f} ({b2[0]:,.0f}; {b2[3]}/{b2[2]}) | {ratio(a2[1], b2[1])} |")
    for size in SIZES:
        rows.append(f"| {size // 1024}k tokens: payload B/event (B/token) "
                    f"| {n.payload[size]:,.0f} ({n.payload[size] / size:.2f}) "
                    f"| {r.payload[size]:,.0f} ({r.payload[size] / size:.2f}) | same codec |")
        rows.append(f"| ... broker's counters in / out B/event | {n.wire[size][0]:,.0f} / "
                    f"{n.wire[size][1]:,.0f} (payload only) | {r.wire[size][0]:,.0f} / "
                    f"{r.wire[size][1]:,.0f} (with framing) | |")
    for key, label in (("flowing_s", "restart: events flow again, s after the start"),
                       ("reconnected_s", "... subscriber reconnected, s after the start"),
                       ("lost", "... events lost (of generated)"),
                       ("lost_after", "... of them made after the subscriber was back"),
                       ("publish_failed", "... publishes that raised"),
                       ("raised_to_us", "... subscriber: errors raised to our code")):
        a3, b3 = n.restart.get(key), r.restart.get(key)
        if key == "lost":
            a3 = f"{a3}/{n.restart['generated']}"
            b3 = f"{b3}/{r.restart['generated']}"
        elif isinstance(a3, float) or isinstance(b3, float):
            a3 = f"{a3:.2f}" if a3 is not None else "never"
            b3 = f"{b3:.2f}" if b3 is not None else "never"
        rows.append(f"| {label} | {a3} | {b3} | |")
    rows.append(f"| late joiner's snapshot, {n.snapshot[1] / 1e6:.2f} MB: median ms "
                f"| {n.snapshot[0]:.2f} (request/reply) | {r.snapshot[0]:.2f} (GET) "
                f"| {ratio(n.snapshot[0], r.snapshot[0])} |")
    rows.append(f"| out-of-order deliveries | {n.out_of_order + n.restart['out_of_order']} "
                f"| {r.out_of_order + r.restart['out_of_order']} | |")
    return f"Token ids: {source}.\nCodec: {CODEC}.\n\n" + "\n".join(rows)


async def main(args: argparse.Namespace) -> None:
    binaries = {"nats": shutil.which("nats-server") or "/usr/sbin/nats-server",
                "redis": shutil.which("redis-server") or "/usr/bin/redis-server"}
    missing = [b for b in binaries.values() if not Path(b).exists()]
    if missing:
        sys.exit(f"missing {missing}: apt-get install nats-server redis-server")
    corpus, source = await asyncio.to_thread(token_corpus, args.tokenizer_python)
    print(f"token ids: {source}", flush=True)
    results: dict[str, Result] = {}
    with tempfile.TemporaryDirectory(prefix="bench_broker_") as tmp:
        for name in ("nats", "redis"):
            workdir = Path(tmp) / name
            workdir.mkdir()
            broker = Broker(name, binaries[name], workdir)
            try:
                results[name] = await measure(broker, corpus, args)
            finally:
                broker.stop()
    print()
    print(table(results, source, args))
    print(f"\nraised to the subscriber's code: nats {results['nats'].restart['raised']}, "
          f"redis {results['redis'].restart['raised']}")


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=20.0, help="events/s in the paced phases")
    ap.add_argument("--seconds", type=float, default=8.0, help="length of each paced phase")
    ap.add_argument("--down", type=float, default=5.0, help="seconds the broker is stopped")
    ap.add_argument("--tokenizer-python", help="a Python with llama-cpp-python")
    ap.add_argument("--time-limit", type=float, default=600.0)
    ap.add_argument("--role", choices=("main", "sub"), default="main", help=argparse.SUPPRESS)
    ap.add_argument("--broker", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    return ap.parse_args()


if __name__ == "__main__":
    a = parse()
    if a.role == "sub":
        asyncio.run(subscriber(a.broker, a.port))
    else:
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        asyncio.run(asyncio.wait_for(main(a), a.time_limit))
