"""Shared fixtures: real llama-server processes on the demo model.

    llama_server_bin   Path of llama-server (session; fails if `prepare` has not run)
    demo_model         Path of the demo GGUF (session; idem)
    backend_pool       async factory returning a *started* Supervisor of managed
                       backends on the demo model:
                           sup = await backend_pool()                      # 2 x 2 slots
                           sup = await backend_pool(n=1, slots=4, ctx_per_slot=4096)
                           sup = await backend_pool(fresh=True)            # not shared
                       Pools are shared per parameter set for the whole session (start-up
                       costs seconds and we have 2 cores), so a shared pool's caches are
                       warm from earlier tests: ask for fresh=True when a test needs empty
                       caches or kills processes. Everything is stopped at session end.
    pool_config        build the Config a pool would use, without starting anything.

All async tests and fixtures share one session event loop (pyproject.toml).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import pytest
import pytest_asyncio
from prompt_corpus import Backend

from backends.binary import cache_dir, find_llama_server
from backends.config import ManagedBackendConfig, SupervisionConfig
from backends.demo_model import DemoModelParams, demo_model_path
from backends.process import free_port
from backends.supervisor import Supervisor
from proxy.config.load import Config, ProxyConfig, RoutingConfig
from proxy.prompt.builder import PromptBuilder


@pytest.fixture(scope="session")
def llama_server_bin() -> Path:
    # NOTE: never builds: a 4-minute cmake run inside a test session (or several at once,
    # from parallel sessions) is worse than a clear instruction. `make test` prepares.
    found = find_llama_server()
    if found is None:
        pytest.fail("llama-server not found: run `python -m backends prepare` (make test does)")
    return found.path


@pytest.fixture(scope="session")
def demo_model() -> Path:
    path = demo_model_path(DemoModelParams())
    if not path.is_file():
        pytest.fail(f"demo model missing ({path}): run `python -m backends prepare`")
    return path


class PoolFactory(Protocol):
    def __call__(self, *, n: int = 2, slots: int = 2, ctx_per_slot: int = 8192,
                 threads: int = 1, cache_ram_mib: int = 1024,
                 extra_args: tuple[str, ...] = (), fresh: bool = False) -> Awaitable[Supervisor]:
        ...


@pytest.fixture(scope="session")
def pool_config(llama_server_bin: Path, demo_model: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Config]:
    def make(*, n: int = 2, slots: int = 2, ctx_per_slot: int = 8192, threads: int = 1,
             cache_ram_mib: int = 1024, extra_args: tuple[str, ...] = (),
             names: tuple[str, ...] | None = None) -> Config:
        names = names or tuple(chr(ord("a") + i) for i in range(n))
        return Config(
            proxy=ProxyConfig(port=free_port()),
            routing=RoutingConfig(),
            backends=tuple(
                ManagedBackendConfig(
                    name=name, model=demo_model, slots=slots, ctx_per_slot=ctx_per_slot,
                    threads=threads, cache_ram_mib=cache_ram_mib, alias="kvroute-demo",
                    extra_args=extra_args, is_demo=True,
                ) for name in names),
            llama_server=str(llama_server_bin),
            cache_dir=cache_dir(),
            log_dir=tmp_path_factory.mktemp("pool-logs"),
            supervision=SupervisionConfig(startup_timeout_s=60.0),
        )

    return make


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def backend_pool(pool_config: Callable[..., Config]) -> AsyncIterator[PoolFactory]:
    shared: dict[tuple[Any, ...], Supervisor] = {}
    started: list[Supervisor] = []

    async def make(*, n: int = 2, slots: int = 2, ctx_per_slot: int = 8192, threads: int = 1,
                   cache_ram_mib: int = 1024, extra_args: tuple[str, ...] = (),
                   fresh: bool = False) -> Supervisor:
        key = (n, slots, ctx_per_slot, threads, cache_ram_mib, tuple(extra_args))
        if not fresh and key in shared:
            return shared[key]
        cfg = pool_config(n=n, slots=slots, ctx_per_slot=ctx_per_slot, threads=threads,
                          cache_ram_mib=cache_ram_mib, extra_args=tuple(extra_args))
        sup = Supervisor(cfg)
        started.append(sup)
        await sup.start()
        if len(sup.ready()) != n:
            pytest.fail(f"backend pool did not come up: {sup.statuses()}")
        if not fresh:
            shared[key] = sup
        return sup

    try:
        yield make
    finally:
        for sup in started:
            with contextlib.suppress(Exception):
                await sup.stop()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def backend(backend_pool: PoolFactory) -> AsyncIterator[Backend]:
    """One real llama-server with one slot and no RAM cache: a follow-up request must land
    in the slot the previous one filled, so its reuse count says exactly which tokens that
    slot holds (the token-exactness tests rely on this)."""
    sup = await backend_pool(n=1, slots=1, ctx_per_slot=16384, cache_ram_mib=0)
    info = sup.ready()[0]
    yield Backend(info.url, info.api_key)


@pytest.fixture(scope="session")
def builder(demo_model: Path) -> PromptBuilder:
    return PromptBuilder.load(demo_model)
