"""Model pools: the backends that serve one model, and the names clients send for it.

A backend's `alias` names its pool (a managed one passes it to llama-server as `-a`;
without one, the GGUF's file name), and `aliases` adds names. Backends of one alias form
a pool: one tokenizer, one radix tree, one policy state; a request goes to the pool its
`model` names. An external backend without an alias joins the first pool, the model
kvroute tokenizes for when there is one. The managed backends of a pool must serve one
GGUF: kvroute tokenizes a pool's requests with it, and one tree's token ids would mean
different things on two models.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from backends.config import BackendConfig, ManagedBackendConfig
from proxy.config.fields import ConfigError


@dataclass(frozen=True)
class PoolSpec:
    name: str  # the model name its backends report (the first backend's alias)
    aliases: tuple[str, ...]  # every name that reaches it, `name` first
    backends: tuple[str, ...]  # backend names, in the configuration's order
    managed: ManagedBackendConfig | None  # its first managed backend: the GGUF, template
    # the projector of its first managed backend with one: what its media take
    mmproj: Path | None = None


def pool_name(b: BackendConfig) -> str | None:
    """The pool ``b`` serves (None: an external backend that names none, the first)."""
    if isinstance(b, ManagedBackendConfig):
        return b.alias or b.model.name
    return b.alias


def derive_pools(backends: Sequence[BackendConfig]) -> tuple[PoolSpec, ...]:
    """The pools of a configuration, in the order their first backend is listed;
    ConfigError naming both backends when two of a pool serve different GGUFs, or one
    name would reach two pools."""
    order: list[str] = []
    members: dict[str, list[int]] = {}
    for i, b in enumerate(backends):
        name = pool_name(b)
        if name is None:
            continue
        if name not in members:
            order.append(name)
            members[name] = []
        members[name].append(i)
    if not order:  # external backends only, none named: one pool of whatever they serve
        order, members = [""], {"": []}
    for i, b in enumerate(backends):
        if pool_name(b) is None:
            members[order[0]].append(i)
    owner: dict[str, str] = {}
    out = []
    for name in order:
        idx = sorted(members[name])
        managed = [(i, b) for i in idx
                   if isinstance(b := backends[i], ManagedBackendConfig)]
        _same_model(name, managed)
        names = [name] if name else []
        for i in idx:
            names += backends[i].aliases
        aliases = tuple(dict.fromkeys(names))
        for a in aliases:
            if owner.setdefault(a, name) != name:
                raise ConfigError(f"backends: the name {a!r} is given to the pools {owner[a]!r} "
                                  f"and {name!r} (fix: one model per name)")
        first = managed[0][1] if managed else None
        assert first is None or isinstance(first, ManagedBackendConfig)
        mmproj = next((b.mmproj for _, b in managed
                       if isinstance(b, ManagedBackendConfig) and b.mmproj), None)
        out.append(PoolSpec(name, aliases, tuple(backends[i].name for i in idx), first,
                            mmproj))
    return tuple(out)


def _same_model(pool: str, managed: list[tuple[int, BackendConfig]]) -> None:
    first: tuple[int, Path] | None = None
    for i, b in managed:
        assert isinstance(b, ManagedBackendConfig)
        path = b.model.resolve()
        if first is None:
            first = (i, path)
        elif path != first[1]:
            raise ConfigError(
                f"backends[{first[0]}] and backends[{i}]: both serve {pool!r} but run "
                f"different GGUFs ({first[1]}, {path}) (fix: give one an alias of its own)")
