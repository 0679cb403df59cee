"""create_app(): routes, typed AppKeys, middlewares and the long-lived resources.

The caller (proxy/cli.py, tests) owns the Supervisor's lifecycle; the app only listens
to its events: a backend that becomes ready is added to the Router fresh and empty, one
that goes down is forgotten. The client session, the Router, the PromptBuilder and the
tokenizer thread live in `cleanup_ctx` and are closed with the app.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import aiohttp
from aiohttp import web

from backends.supervisor import BackendInfo, Supervisor
from proxy.config import Config, ManagedBackendConfig
from proxy.errors import (
    ProxyError,
    Unauthorized,
    error_response,
    format_for_path,
    from_http_exception,
)
from proxy.feedback import Recorder
from proxy.forward import Forwarder
from proxy.logging import get_logger
from proxy.metrics import ProxyMetrics
from proxy.prompt import PromptBuilder
from proxy.router import BackendCapacity, Router

T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class ProxySettings:
    """Proxy knobs not (yet) in Config; create_app() reads Config.proxy when it has them."""

    api_keys: tuple[str, ...] = ()          # client keys; empty = no auth
    protect_admin: bool = True              # /metrics and /kvroute/status need a key too
    max_body_bytes: int = 32 << 20          # larger bodies -> 413
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0           # between bytes: a cold 30k prompt on CPU is slow
    inline_tokenize_bytes: int = 16 << 10   # smaller bodies tokenize on the loop (measured)
    tokenizer: Path | None = None           # GGUF to tokenize with (default: first managed)


CONFIG = web.AppKey("kvroute.config", Config)
SUPERVISOR = web.AppKey("kvroute.supervisor", Supervisor)
SETTINGS = web.AppKey("kvroute.settings", ProxySettings)
METRICS = web.AppKey("kvroute.metrics", ProxyMetrics)
BACKENDS: web.AppKey[dict[str, BackendInfo]] = web.AppKey("kvroute.backends")
ROUTER = web.AppKey("kvroute.router", Router)
PROMPT: web.AppKey[PromptBuilder | None] = web.AppKey("kvroute.prompt")
TOKENIZING: web.AppKey[Tokenizing] = web.AppKey("kvroute.tokenizing")
FORWARDER = web.AppKey("kvroute.forwarder", Forwarder)
# Round-robin cursor for calls that are not routed by prefix (/tokenize, /props, ...).
CURSOR: web.AppKey[list[int]] = web.AppKey("kvroute.cursor")


def create_app(config: Config, supervisor: Supervisor,
               settings: ProxySettings | None = None) -> web.Application:
    """The proxy application; `supervisor` must be started/stopped by the caller."""
    settings = settings or _settings_from(config)
    app = web.Application(client_max_size=settings.max_body_bytes,
                          middlewares=[_errors_middleware, _auth_middleware])
    app[CONFIG] = config
    app[SUPERVISOR] = supervisor
    app[SETTINGS] = settings
    app[METRICS] = ProxyMetrics()
    app[BACKENDS] = {}
    app[CURSOR] = [0]
    app[ROUTER] = Router(config.proxy.policy, settings=config.routing.router_settings())
    app.cleanup_ctx.append(_prompt_ctx)
    app.cleanup_ctx.append(_session_ctx)
    app.cleanup_ctx.append(_backends_ctx)
    from proxy import handlers  # NOTE: handlers import the AppKeys defined here

    handlers.add_routes(app)
    from proxy import anthropic  # issue 5: /v1/messages (owned by proxy/anthropic.py)

    anthropic.add_routes(app)
    return app


def _settings_from(config: Config) -> ProxySettings:
    # NOTE: getattr so that fields the config may grow (issue 7) take effect unchanged.
    p, d = config.proxy, ProxySettings()
    keys = getattr(p, "api_keys", ()) or ()
    return ProxySettings(
        api_keys=tuple(keys),
        protect_admin=getattr(p, "protect_admin", d.protect_admin),
        max_body_bytes=getattr(p, "max_body_bytes", d.max_body_bytes),
        connect_timeout_s=getattr(p, "connect_timeout_s", d.connect_timeout_s),
        read_timeout_s=getattr(p, "read_timeout_s", d.read_timeout_s),
    )


def tokenizer_model(config: Config) -> tuple[Path, str | None] | None:
    """The GGUF (and `--chat-template-file` text, if any) the proxy tokenizes with.

    Every backend serves the same model (one tree is shared across them), so the first
    managed backend's is it. External-only setups have none: requests are then
    balanced round robin without prefix routing.
    """
    for b in config.backends:
        if isinstance(b, ManagedBackendConfig):
            args = list(b.extra_args)
            template = None
            if "--chat-template-file" in args[:-1]:
                template = Path(args[args.index("--chat-template-file") + 1]).read_text()
            return b.model, template
    return None


class Tokenizing:
    """Runs PromptBuilder calls on the loop when cheap, else on one worker thread.

    Measured (bench/bench_proxy.py): a small chat body tokenizes in tens of microseconds,
    about what a thread hop costs; a cold 30k-token prompt takes ~55 ms and would stall
    every other request. PromptBuilder's fragment cache is not thread-safe, so the loop
    uses it only while the worker is idle, and there is a single worker.
    """

    def __init__(self, prompt: PromptBuilder | None, inline_bytes: int) -> None:
        self.prompt = prompt
        self.inline_bytes = inline_bytes
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvroute-tokenize")
        self._queued = 0

    async def run(self, size: int, build: Callable[[], T]) -> T:
        if size <= self.inline_bytes and self._queued == 0:
            return build()
        self._queued += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, build)
        finally:
            self._queued -= 1

    def output_tokens(self, text: str) -> Sequence[int]:
        # Answers are short: inline, unless the worker holds the (unshared) cache now.
        if self.prompt is None or not text or self._queued:
            return ()
        return self.prompt.tokenizer.tokenize(text, add_special=False)


async def _prompt_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    found = ((settings.tokenizer, None) if settings.tokenizer is not None
             else tokenizer_model(app[CONFIG]))
    tok = Tokenizing(None, settings.inline_tokenize_bytes)
    if found is not None:
        path, template = found
        tok.prompt = await asyncio.get_running_loop().run_in_executor(
            tok.pool, lambda: PromptBuilder.load(path, chat_template=template))
    app[PROMPT] = tok.prompt
    app[TOKENIZING] = tok
    yield
    tok.pool.shutdown(wait=False, cancel_futures=True)


async def _session_ctx(app: web.Application) -> AsyncIterator[None]:
    s = app[SETTINGS]
    timeout = aiohttp.ClientTimeout(total=None, connect=s.connect_timeout_s,
                                    sock_read=s.read_timeout_s)
    # No connection cap: llama-server queues itself, and the router bounds work per backend.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    session = aiohttp.ClientSession(connector=connector, timeout=timeout,
                                    read_bufsize=1 << 20, auto_decompress=False)
    recorder = Recorder(app[METRICS], get_logger())
    app[FORWARDER] = Forwarder(session, app[ROUTER], app[BACKENDS], recorder,
                               app[TOKENIZING].output_tokens)
    yield
    await session.close()


async def _backends_ctx(app: web.Application) -> AsyncIterator[None]:
    supervisor, router, backends = app[SUPERVISOR], app[ROUTER], app[BACKENDS]
    up = app[METRICS].backend_up
    active = True

    def on_event(name: str, info: BackendInfo | None) -> None:
        if not active:
            return
        if info is None:
            backends.pop(name, None)
            router.remove_backend(name)
            up.labels(name).set(0)
            return
        backends[name] = info
        router.add_backend(capacity(info))
        up.labels(name).set(1)

    for info in supervisor.ready():
        on_event(info.name, info)
    supervisor.subscribe(on_event)
    yield
    active = False  # the Supervisor has no unsubscribe; a closed app ignores its events


def capacity(info: BackendInfo) -> BackendCapacity:
    return BackendCapacity(name=info.name, n_slots=info.n_slots, slot_ctx=info.slot_ctx,
                           ram_cache_bytes=info.ram_cache_bytes,
                           kv_bytes_per_token=info.kv_bytes_per_token)


@web.middleware
async def _errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure leaves as a JSON error in the API's format, never a traceback."""
    fmt = format_for_path(request.path)
    try:
        return await handler(request)
    except ProxyError as e:
        return error_response(e, fmt)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(from_http_exception(e), fmt)
    except asyncio.CancelledError:
        raise
    except Exception:
        get_logger().exception("unhandled", path=request.path)
        return error_response(ProxyError("internal error"), fmt)


_OPEN_PATHS = frozenset({"/health"})
_ADMIN_PATHS = frozenset({"/metrics", "/kvroute/status"})


def _presented_key(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return request.headers.get("x-api-key")


@web.middleware
async def _auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    s = request.app[SETTINGS]
    path = request.path
    if (not s.api_keys or path in _OPEN_PATHS
            or (path in _ADMIN_PATHS and not s.protect_admin)):
        return await handler(request)
    given = (_presented_key(request) or "").encode()
    # Constant time: compare against every key, no early exit on a match.
    ok = False
    for key in s.api_keys:
        ok |= hmac.compare_digest(given, key.encode())
    if not ok:
        raise Unauthorized("missing or invalid API key")
    return await handler(request)
