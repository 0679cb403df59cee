"""The model pools of a running app (see proxy/config/pools.py), and which one a request
names.

Each pool has what one model needs of its own: its backends, router, health and
breakers, tokenizer and forwarder, all made by `build_pool`. What the pools share (the
client session and connection pool, the recorder, tracing, the disk tier's files:
`Shared`) the app makes once and keeps under keys of their own (proxy/server/keys.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from backends.crash_loop import Unavailable
from backends.info import BackendInfo
from backends.memory import gguf_memory
from proxy.config.pools import PoolSpec
from proxy.config.settings import ProxySettings
from proxy.disk.tier import DiskTier
from proxy.errors import NotFound
from proxy.forwarding.forwarder import Forwarder, Services
from proxy.forwarding.health import BackendHealth
from proxy.forwarding.upstream import Upstream
from proxy.observability.logging import get_logger
from proxy.observability.metrics import ProxyMetrics
from proxy.observability.tracing import Tracing
from proxy.prompt.builder import PromptBuilder
from proxy.prompt.media import MediaCounts, MediaModel
from proxy.reporting.recorder import Recorder
from proxy.routing.router import Router
from proxy.server.backend_tokens import BackendTokens
from proxy.server.tokenizing import Tokenizing


@dataclass
class Pool:
    spec: PoolSpec
    router: Router
    backends: dict[str, BackendInfo]  # its routable backends (kept by `health`)
    health: BackendHealth
    tok: Tokenizing
    fw: Forwarder
    cursor: list[int] = field(default_factory=lambda: [0])  # round robin of unrouted calls

    def names(self) -> set[str]:
        """The model names that reach it: its aliases and what its backends report."""
        return {*self.spec.aliases, *(b.info.model for b in self.health.breakers.values())}

    def pick_ready(self, path: str = "", media: frozenset[str] = frozenset()) -> BackendInfo:
        """Next ready backend that serves ``path`` and takes ``media`` (see
        Forwarder.serving), round robin (calls that carry no prefix to route by; no
        path: a llama-server's own call)."""
        serving = self.fw.serving(path, media)
        ready = [b for b in self.backends.values() if serving is None or b.name in serving]
        if not ready:
            raise self.fw.unavailable(f"no healthy backend for {self.spec.name or 'the model'}")
        self.cursor[0] += 1
        return ready[self.cursor[0] % len(ready)]


@dataclass(frozen=True)
class Shared:
    """What every pool uses of the app's, made once (proxy/app.py)."""

    settings: ProxySettings
    metrics: ProxyMetrics
    upstream: Upstream  # the request path's HTTP/1.1 client
    session: aiohttp.ClientSession  # off the request path: probes, /slots, /tokenize
    recorder: Recorder
    tracing: Tracing
    disk: DiskTier | None  # slots saved to disk (kv_disk), if on


async def build_pool(spec: PoolSpec, router: Router, shared: Shared,
                     model: tuple[Path, str | None] | None,
                     why_down: Callable[[], Unavailable | None]) -> Pool:
    """The pool of ``spec``, whole: ``router`` (made before the pools: the disk tier
    offers its files to every pool's), its tokenizer loaded from ``model`` (the GGUF
    and the chat template its prompts are tokenized with; None: its backends give the
    ids), its health and forwarder. ``why_down``: what keeps its backends down, as
    their supervisor knows it."""
    s, metrics = shared.settings, shared.metrics
    # its backends' own ids (round robin over those ready), where the local ones cannot
    # be had or are not exact; `pool` is bound below, before any request can ask
    remote = BackendTokens(shared.session, lambda media: pool.pick_ready(media=media),
                           lambda reason: metrics.child(metrics.tokens_from_backend, reason).inc())
    tok = Tokenizing(None, s.inline_tokenize_bytes, remote)
    if model is not None:
        path, template = model
        try:
            tok.prompt = await asyncio.get_running_loop().run_in_executor(
                tok.pool, lambda: PromptBuilder.load(path, chat_template=template))
        except BaseException:
            tok.pool.shutdown(wait=False, cancel_futures=True)
            raise
    prompt = tok.prompt
    if prompt is not None and model is not None:
        prompt.media = _media_counts(spec.mmproj, model[0])
    # the live view of its routable backends: one dict, kept by its health, read by its
    # forwarder and the pool's own round robin
    routable: dict[str, BackendInfo] = {}
    health = BackendHealth(router, routable, metrics, s.health, get_logger())
    services = Services(shared.upstream, shared.recorder, shared.session, shared.disk,
                        shared.tracing, max_attempts=s.retry_attempts,
                        first_byte_timeout=s.first_byte_timeout_s, log_prompts=s.log_prompts)
    fw = Forwarder(
        services, router, routable, tok.output_tokens, health, why_down=why_down,
        prompt=prompt)
    pool = Pool(spec, router, routable, health, tok, fw)
    return pool


def _media_counts(mmproj: Path | None, gguf: Path) -> MediaCounts:
    """The positions of images: read from the pool's projector, else learned. Not on a
    sliding-window or hybrid model with M-RoPE (its checkpoints count positions, which an
    image there has fewer of than tokens), nor on DeepSeek-V4 (it pads an image by the
    position it starts at): not modelled."""
    memory = gguf_memory(gguf)
    modelled = memory.arch != "deepseek4" and (
        not memory.mrope or not (memory.n_swa or memory.recurrent))
    model = MediaModel.read(mmproj) if modelled and mmproj is not None else None
    if mmproj is not None and model is None:
        get_logger().info("media.positions_unknown", mmproj=str(mmproj),
                          now="learned per image size (audio: per clip) from what its "
                          "servers report" if modelled
                          else "a prompt's ids stop at its first image or audio")
    return MediaCounts(model, learns=modelled)


class Pools:
    """The app's pools, in the configuration's order."""

    def __init__(self, pools: list[Pool]) -> None:
        assert pools, "a configuration has at least one backend"
        self._pools = pools
        self._of_backend = {b: p for p in pools for b in p.spec.backends}
        self._adopted: dict[str, Pool] = {}  # backends an agent runs: known once up

    def __iter__(self) -> Iterator[Pool]:
        return iter(self._pools)

    def __len__(self) -> int:
        return len(self._pools)

    @property
    def first(self) -> Pool:
        return self._pools[0]

    def of_backend(self, name: str) -> Pool | None:
        return self._of_backend.get(name) or self._adopted.get(name)

    def adopt(self, info: BackendInfo) -> Pool | None:
        """The pool of a backend that is up: its configured one, else (one an agent runs,
        named nowhere in the configuration) the pool one of whose names is the model it
        serves, or the only pool; None when several pools name none of it."""
        pool = self.of_backend(info.name)
        if pool is None:
            pool = next((p for p in self._pools if info.model in p.spec.aliases), None)
            if pool is None and len(self._pools) == 1:
                pool = self.first
            if pool is not None:
                self._adopted[info.name] = pool
        return pool

    def for_model(self, model: object, strict: bool = False) -> Pool:
        """The pool a request's ``model`` names. With one pool any name reaches it, as
        with llama-server itself (unless ``strict``); with several, a name none serves is
        a 404 listing those they do, and no name is the first pool."""
        if not isinstance(model, str) or not model:
            return self.first
        for p in self._pools:
            if model in p.names():
                return p
        if len(self._pools) == 1 and not strict:
            return self.first
        served = sorted({n for p in self._pools for n in p.names()})
        if len(self._pools) == 1 and not served:
            return self.first  # (nothing ready says what it serves yet)
        raise NotFound(f"model {model[:100]!r} does not exist; available: "
                       f"{', '.join(served)}", code="model_not_found")
