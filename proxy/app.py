"""create_app(): routes, typed AppKeys, middlewares and the long-lived resources.

The caller (proxy/cli.py, tests) owns the Supervisor's lifecycle; the app only listens
to its events (through `BackendHealth`, which also trips backends that stop answering):
a backend that becomes ready is added to the Router fresh and empty, one that goes down
is forgotten. What the pools share (the clients to the backends, the recorder, tracing,
the disk tier) and each pool, built whole (proxy/server/pools.py `build_pool`: its
Router, PromptBuilder, tokenizer thread, health and forwarder), live in `cleanup_ctx`,
each under its own key, and are closed with the app.

Middlewares, outermost first: errors (every failure in the API's format), auth (client
keys, constant time), admission (bounded in-flight and queue, 429 past them).

Run it with `proxy.server.runner.make_runner(app)` (handler cancellation on, no access
log, requests that do not parse as HTTP answered in the API's format).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import importlib.metadata
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import aiohttp
from aiohttp import web

from backends.info import BackendInfo
from backends.supervisor import Supervisor
from backends.version import tokenizer_version
from proxy.anthropic import routes as anthropic
from proxy.config.load import Config
from proxy.config.pools import PoolSpec
from proxy.config.settings import ProxySettings
from proxy.disk.tier import DiskTier, restored_up
from proxy.errors import (
    RESPONSE_STARTED,
    Overloaded,
    ProxyError,
    Unauthorized,
    end_started,
    error_response,
    format_for_path,
    from_http_exception,
)
from proxy.forwarding.upstream import Upstream
from proxy.observability.logging import get_logger
from proxy.observability.metrics import ProxyMetrics
from proxy.observability.recent import RecentActivity
from proxy.observability.tracing import Tracing
from proxy.replicas.bus import ReplicaBus
from proxy.replicas.claims import Claims
from proxy.replicas.peers import PeerView, PoolPort, Teller
from proxy.reporting.recorder import Recorder
from proxy.responses import routes as responses
from proxy.routing.router import Router
from proxy.server import adapters, handlers, status_page
from proxy.server.admission import Admission, Refused
from proxy.server.keys import (
    ADMISSION,
    CONFIG,
    DISK,
    FORWARDER,
    HEALTH,
    METRICS,
    POOLS,
    RECENT,
    RECORDER,
    REPLICAS,
    ROUTER,
    SESSION,
    SETTINGS,
    SUPERVISOR,
    TOKENIZING,
    TRACING,
    UPSTREAM,
)
from proxy.server.pools import Pool, Pools, Shared, build_pool

T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def create_app(config: Config, supervisor: Supervisor,
               settings: ProxySettings | None = None) -> web.Application:
    """The proxy application; `supervisor` must be started/stopped by the caller."""
    settings = settings or config.proxy.settings
    app = web.Application(client_max_size=settings.max_body_bytes,
                          middlewares=[_errors_middleware, _auth_middleware,
                                       _admission_middleware])
    app[CONFIG] = config
    app[SUPERVISOR] = supervisor
    app[SETTINGS] = settings
    app[METRICS] = ProxyMetrics()
    app[RECENT] = RecentActivity()  # the status page's recent decisions (the Recorder's)
    app[METRICS].build_info.labels(*_build()).set(1)
    app[ADMISSION] = Admission(settings.max_in_flight, settings.max_queue,
                               settings.queue_timeout_s)
    app.cleanup_ctx.append(_pools_ctx)
    app.cleanup_ctx.append(_backends_ctx)
    handlers.add_routes(app)
    adapters.add_routes(app)
    anthropic.add_routes(app)
    responses.add_routes(app)
    status_page.add_routes(app)
    return app


@functools.cache
def _build() -> tuple[str, str]:
    """kvroute's version and the llama.cpp one it tokenizes as (read once: ~50 ms)."""
    try:
        version = importlib.metadata.version("kvroute")
    except importlib.metadata.PackageNotFoundError:  # (run from a tree not installed)
        version = "unknown"
    return version, str(tokenizer_version() or "unknown")


def tokenizer_model(config: Config, spec: PoolSpec | None = None,
                    tokenizer: Path | None = None) -> tuple[Path, str | None] | None:
    """The GGUF (and `--chat-template-file` text, if any) a pool (default: the first) is
    tokenized with: its first managed backend's; for a pool of external backends only,
    ``tokenizer`` (proxy.tokenizer), else none: its requests get their ids from a
    backend."""
    spec = spec or config.pools()[0]
    b = spec.managed
    if b is None:
        return None if tokenizer is None else (tokenizer, None)
    args = list(b.extra_args)
    template = None
    if "--chat-template-file" in args[:-1]:
        template = Path(args[args.index("--chat-template-file") + 1]).read_text()
    return b.model, template


async def _pools_ctx(app: web.Application) -> AsyncIterator[None]:
    """What the pools share, each pool built whole, the other replicas' bus and the
    health probers; closed with the app."""
    s, config, metrics = app[SETTINGS], app[CONFIG], app[METRICS]
    upstream, session = _clients(s)
    tracing = Tracing.start(s.otel)
    specs = config.pools()
    # made before the pools: the disk tier offers its files to every pool's router
    routers = [Router(config.proxy.policy, settings=config.routing.router_settings())
               for _ in specs]
    built: list[Pool] = []
    disk = None
    try:
        disk = None if config.kv_disk is None else DiskTier(
            config.kv_disk, config.backends, session, routers,
            lambda event: metrics.child(metrics.slot_files, event).inc(),
            router_of=lambda name: None if (p := app[POOLS].of_backend(name)) is None
            else p.router)
        shared = Shared(s, metrics, upstream, session,
                        Recorder(metrics, get_logger(), app[RECENT]), tracing, disk)
        for spec, router in zip(specs, routers, strict=True):
            built.append(await build_pool(
                spec, router, shared, tokenizer_model(config, spec, s.tokenizer),
                functools.partial(app[SUPERVISOR].why_down, spec.backends)))
    except BaseException:
        # (a directory another kvroute holds, a model that does not load: this one does
        # not start, and lets go of what it took)
        await _let_go(built, disk, session, upstream, tracing)
        raise
    app[UPSTREAM], app[SESSION], app[TRACING] = upstream, session, tracing
    app[RECORDER] = shared.recorder
    if disk is not None:
        app[DISK] = disk
    pools = app[POOLS] = Pools(built)
    first = pools.first
    app[ROUTER], app[HEALTH], app[TOKENIZING], app[FORWARDER] = (
        first.router, first.health, first.tok, first.fw)
    bus = await _replicas(app)
    probers = [asyncio.create_task(p.health.run(session), name=f"kvroute-health-{i}")
               for i, p in enumerate(pools)]
    probers += [asyncio.create_task(adapters.watch(p, session), name=f"kvroute-lora-{i}")
                for i, p in enumerate(pools)]
    yield
    if bus is not None:
        await bus.close()
    for prober in probers:
        prober.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await prober
    for pool in pools:
        await pool.fw.close()
    await _let_go(list(pools), disk, session, upstream, tracing)


def _clients(s: ProxySettings) -> tuple[Upstream, aiohttp.ClientSession]:
    """The request path's own client to the backends (proxy/forwarding/upstream.py:
    aiohttp's costs 2-3x the CPU per request), and aiohttp's for the health prober and
    /slots (off the request path). No connection cap: llama-server queues itself, and the
    router bounds work per backend. Idle connections are dropped before llama-server's own
    5 s keep-alive timeout (cpp-httplib) would close them under a request. No cookie jar:
    a proxy must not keep one backend answer's cookies."""
    upstream = Upstream(connect_timeout=s.connect_timeout_s, read_timeout=s.read_timeout_s,
                        keepalive_s=4.0)
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(keepalive_timeout=4),
                                    cookie_jar=aiohttp.DummyCookieJar())
    return upstream, session


async def _let_go(pools: list[Pool], disk: DiskTier | None, session: aiohttp.ClientSession,
                  upstream: Upstream, tracing: Tracing) -> None:
    """Close what the pools share, and their tokenizer threads."""
    if disk is not None:
        await disk.close()
    await session.close()
    await upstream.close()
    await asyncio.to_thread(tracing.close)  # (its exporter's last batch: a blocking send)
    for pool in pools:
        pool.tok.pool.shutdown(wait=False, cancel_futures=True)


async def _replicas(app: web.Application) -> ReplicaBus | None:
    """The other replicas' view, shared over their broker (None: this one is alone)."""
    cfg = app[CONFIG].replicas
    if cfg is None:
        return None
    pools, metrics = app[POOLS], app[METRICS]
    claims = {p.spec.name: Claims(cfg.replica, cfg.claim_window_s,
                                  lambda: bus.connected and bool(view.peers)) for p in pools}
    view = PeerView(cfg.replica, {p.spec.name: PoolPort(
        p.router, p.fw.waits.hand_off, claims[p.spec.name].heard) for p in pools})
    bus = app[REPLICAS] = ReplicaBus(cfg.nats, cfg.replica, view,
                                     lambda e: metrics.child(metrics.replica_events, e).inc())
    for pool in pools:
        teller = Teller(cfg.replica, pool.spec.name, bus.publish, view.touched)
        bus.tellers.append(teller)
        pool.router.peers.listener = teller
        pool.fw.on_sent = teller.started
        claims[pool.spec.name].tell = teller.claimed
        pool.fw.claims = claims[pool.spec.name]
    await bus.start()
    return bus


async def _backends_ctx(app: web.Application) -> AsyncIterator[None]:
    supervisor, pools = app[SUPERVISOR], app[POOLS]
    active = True
    checks: set[asyncio.Task[None]] = set()

    def on_event(name: str, info: BackendInfo | None) -> None:
        pool = pools.of_backend(name) if info is None else pools.adopt(info)
        if active and pool is None and info is not None:
            get_logger().warning("backend.no_pool", backend=name, model=info.model,
                                 fix="name the model in an alias of a configured backend")
        if not active or pool is None:
            return
        if info is None:
            pool.health.backend_down(name)
            return
        disk = app.get(DISK)
        store = None if disk is None else disk.backend_ready(info, pool.router)
        if store is not None:  # its saved slots first
            background(restored_up(store, info, pool.router, pool.health.backend_up,
                                   lambda i=info: i in supervisor.ready()))
        else:
            pool.health.backend_up(info)
        # is the local template the backend's? (once per backend URL; a server of the
        # OpenAI API cannot say)
        if info.dialect.renders_prompts:
            background(pool.tok.check(info))

    def background(work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        checks.add(task)
        task.add_done_callback(checks.discard)

    for info in supervisor.ready():
        on_event(info.name, info)
    supervisor.subscribe(on_event)
    yield
    active = False  # the Supervisor has no unsubscribe; a closed app ignores its events
    for task in checks:
        task.cancel()


@web.middleware
async def _errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure leaves as a JSON error in the API's format, never a traceback; one
    after the response began ends that response (see `end_started`)."""
    fmt = format_for_path(request.path)
    try:
        return await handler(request)
    except ProxyError as e:
        err = e
    except web.HTTPException as e:
        if e.status < 400:
            raise
        err = from_http_exception(e)
    except asyncio.CancelledError:
        raise
    except Exception:
        get_logger().exception("unhandled", path=request.path)
        err = ProxyError("internal error")
    started = request.get(RESPONSE_STARTED)
    if started is not None:
        return await end_started(started, err, fmt)
    return error_response(err, fmt)


_OPEN_PATHS = frozenset({"/health"})
_ADMIN_PATHS = frozenset({"/metrics", "/kvroute/status", *status_page.PAGE_PATHS})


def _presented_key(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    # Basic credentials only where a browser is sent for them (the status page, the admin
    # reads): a browser attaches them to any request to this origin, a form another site
    # posts included, and a POST must not spend a backend on the operator's key
    if request.path in status_page.PAGE_PATHS or request.path in _ADMIN_PATHS:
        basic = status_page.basic_password(auth)
        if basic:
            return basic
    return request.headers.get("x-api-key")


@web.middleware
async def _auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    s = request.app[SETTINGS]
    path = request.path
    if (not s.api_keys or path in _OPEN_PATHS
            or (path in _ADMIN_PATHS and not s.protect_admin)):
        return await handler(request)
    # surrogateescape: header bytes that are not UTF-8 come back as they were sent
    given = (_presented_key(request) or "").encode("utf-8", "surrogateescape")
    # Constant time: compare against every key, no early exit on a match.
    ok = False
    for key in s.api_keys:
        ok |= hmac.compare_digest(given, key.encode())
    if not ok:
        if path in status_page.PAGE_PATHS:
            return status_page.ask_for_key()
        raise Unauthorized("missing or invalid API key")
    return await handler(request)


@web.middleware
async def _admission_middleware(request: web.Request, handler: Handler
                                ) -> web.StreamResponse:
    # Only POSTs carry work (bodies, generation); GETs are cheap reads.
    if request.method != "POST":
        return await handler(request)
    admission = request.app[ADMISSION]
    asked = time.perf_counter()
    got = await admission.acquire()
    request.app[METRICS].admission_wait.observe(time.perf_counter() - asked)
    if isinstance(got, Refused):
        request.app[METRICS].rejected.labels("overloaded").inc()
        raise Overloaded(got.reason, retry_after=got.retry_after_s)
    try:
        return await handler(request)
    finally:
        admission.release()
