"""The model pools of a running app (see proxy/config/pools.py), and which one a request
names.

Each pool has what one model needs of its own: its backends, router, health and
breakers, tokenizer and forwarder. What the pools share (the client session and
connection pool, admission, metrics, the disk tier's files) the app keeps once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from backends.info import BackendInfo
from proxy.config.pools import PoolSpec
from proxy.errors import NotFound
from proxy.forwarding.forwarder import Forwarder
from proxy.forwarding.health import BackendHealth
from proxy.routing.router import Router
from proxy.server.tokenizing import Tokenizing


@dataclass
class Pool:
    spec: PoolSpec
    router: Router
    backends: dict[str, BackendInfo]  # its routable backends (kept by `health`)
    health: BackendHealth
    cursor: list[int] = field(default_factory=lambda: [0])  # round robin of unrouted calls
    # set up with the app's resources (proxy/app.py): the tokenizer thread, the session
    tokenizing: Tokenizing | None = None
    forwarder: Forwarder | None = None

    def names(self) -> set[str]:
        """The model names that reach it: its aliases and what its backends report."""
        return {*self.spec.aliases, *(b.info.model for b in self.health.breakers.values())}

    @property
    def tok(self) -> Tokenizing:
        assert self.tokenizing is not None, "set up with the app"
        return self.tokenizing

    @property
    def fw(self) -> Forwarder:
        assert self.forwarder is not None, "set up with the app"
        return self.forwarder


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
