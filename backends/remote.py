"""Backends an agent (`kvroute agent`, backends/agent.py) runs on another host, as a
router takes them.

Each agent is asked `GET /backends`, its key as Bearer, every `poll_interval_s`. Each
backend it lists becomes an external llama backend of the Supervisor named
"<agent>/<backend>", reached at the address the agent advertises, with the key the agent
started it with: up while the agent says it is ready, down otherwise. One it no longer
lists leaves. An agent that does not answer (or answers nonsense) takes its backends down
with it, said once per outage; they come back when it answers again.

What an agent sends is validated field by field: a peer's answer may be wrong, never a
crash. Keys are kept out of every log line and error: a failure names the status or the
field, never a header or a value that might be one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import structlog

from backends.client import media_marker
from backends.config import LLAMA, AgentLink, ExternalBackendConfig
from backends.memory import DENSE, MemoryKind

log = structlog.get_logger(__name__)

MAX_BACKENDS = 256  # more than any host runs: a longer list is not an agent's
MAX_BODY = 1 << 20
TIMEOUT_S = 5.0


class BadReport(ValueError):
    """An agent's answer that is not what `GET /backends` returns."""


@dataclass(frozen=True)
class Reported:
    """One backend as its agent reports it."""

    cfg: ExternalBackendConfig  # name "<agent>/<backend>", url, api_key, alias
    agent: str
    state: str  # the agent's supervisor's: starting | held | ready | down | failed | stopped
    error: str | None = None
    restarts: int = 0
    n_slots: int = 0
    slot_ctx: int = 0
    ram_cache_bytes: int = 0
    kv_bytes_per_token: int = 0
    model: str = ""
    memory: MemoryKind = DENSE
    modalities: frozenset[str] = frozenset()
    lora: tuple[float, ...] = ()
    alora: tuple[tuple[int, ...], ...] = ()
    media_marker: str = ""

    @property
    def ready(self) -> bool:
        return self.state == "ready"


class RemoteFleet(Protocol):
    """Where reports go (the Supervisor)."""

    def remote(self, report: Reported) -> None: ...
    def remote_down(self, agent: str, name: str, error: str) -> None: ...
    def forget(self, agent: str, name: str) -> None: ...


def _get(item: Mapping[str, Any], key: str, kind: type | tuple[type, ...],
          where: str) -> Any:
    value = item.get(key)
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
        raise BadReport(f"{where}.{key}: expected {getattr(kind, '__name__', kind)}")
    return value


def _count(item: Mapping[str, Any], key: str, where: str, lo: int = 0) -> int:
    value = int(_get(item, key, int, where))
    if value < lo:
        raise BadReport(f"{where}.{key}: expected an integer >= {lo}")
    return value


def _text(item: Mapping[str, Any], key: str, where: str, *, header: bool = False) -> str:
    value = str(_get(item, key, str, where))
    if not value or len(value) > 4096 or (header and not (value.isascii()
                                                          and value.isprintable())):
        raise BadReport(f"{where}.{key}: expected a short printable string")
    return value


def _modalities(raw: object, where: str) -> frozenset[str]:
    """An agent's ``modalities``: the media kinds its server's /props names (vision,
    audio, video; absent: an agent before them)."""
    if raw is None:
        return frozenset()
    if not isinstance(raw, list) or len(raw) > 16 \
            or not all(isinstance(m, str) and 0 < len(m) <= 32 for m in raw):
        raise BadReport(f"{where}.modalities: expected a list of media kinds")
    return frozenset(raw)


def _lora(raw: object, where: str) -> tuple[float, ...]:
    """An agent's ``lora``: its server's global adapter scales (absent: an agent before
    them, or none)."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > 1024 or not all(
            isinstance(x, int | float) and not isinstance(x, bool) for x in raw):
        raise BadReport(f"{where}.lora: expected a list of adapter scales")
    return tuple(float(x) for x in raw)


def _alora(raw: object, where: str) -> tuple[tuple[int, ...], ...]:
    """An agent's ``alora``: each adapter's aLoRA invocation tokens (absent: an agent
    before them, or none)."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > 1024 or not all(
            isinstance(t, list) and len(t) <= 4096 and all(
                isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**31 for x in t)
            for t in raw):
        raise BadReport(f"{where}.alora: expected a list of token id lists")
    return tuple(tuple(t) for t in raw)


def _memory(raw: object, where: str) -> MemoryKind:
    if not isinstance(raw, Mapping):
        raise BadReport(f"{where}.memory: expected an object")
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(MemoryKind):
        if f.name not in raw:
            continue
        value = raw[f.name]
        if f.name == "recurrent":
            kwargs[f.name] = bool(_get(raw, f.name, bool, f"{where}.memory"))
        elif value is not None or f.name != "kv_bytes_per_token":
            kwargs[f.name] = _count(raw, f.name, f"{where}.memory")
    return MemoryKind(**kwargs)


def parse_report(link: AgentLink, item: object, i: int) -> Reported:
    """Backend ``i`` of ``link``'s answer; BadReport naming the field otherwise."""
    where = f"backends[{i}]"
    if not isinstance(item, Mapping):
        raise BadReport(f"{where}: expected an object")
    name = _text(item, "name", where)
    state = _text(item, "state", where)
    cfg = ExternalBackendConfig(name=f"{link.name}/{name}", url="", kind=LLAMA)
    error = item.get("error")
    common: dict[str, Any] = {"agent": link.name, "state": state,
                              "error": error[:500] if isinstance(error, str) else None,
                              "restarts": _count(item, "restarts", where)}
    if state != "ready":
        return Reported(cfg, **common)
    url = _text(item, "url", where, header=True)
    if not url.startswith(("http://", "https://")):
        raise BadReport(f"{where}.url: expected an http(s) URL")
    model = _text(item, "model", where)
    cfg = dataclasses.replace(cfg, url=url.rstrip("/"), alias=model,
                              api_key=_text(item, "api_key", where, header=True))
    return Reported(
        cfg, **common, n_slots=_count(item, "n_slots", where, lo=1),
        slot_ctx=_count(item, "slot_ctx", where, lo=1),
        ram_cache_bytes=_count(item, "ram_cache_bytes", where),
        kv_bytes_per_token=_count(item, "kv_bytes_per_token", where, lo=1),
        model=model, memory=_memory(item.get("memory"), where),
        modalities=_modalities(item.get("modalities"), where),
        lora=_lora(item.get("lora"), where),
        alora=_alora(item.get("alora"), where),
        media_marker=media_marker(item.get("media_marker")))


def parse_answer(link: AgentLink, body: object) -> list[Reported]:
    raw = body.get("backends") if isinstance(body, Mapping) else None
    if not isinstance(raw, list) or len(raw) > MAX_BACKENDS:
        raise BadReport(f"expected {{\"backends\": [...]}} of at most {MAX_BACKENDS}")
    reports = [parse_report(link, item, i) for i, item in enumerate(raw)]
    if len({r.cfg.name for r in reports}) != len(reports):
        raise BadReport("backends: a name is listed twice")
    return reports


async def fetch(session: aiohttp.ClientSession, link: AgentLink) -> list[Reported] | str:
    """The agent's backends, or why there are none to be had (no key in it)."""
    headers = {"Authorization": f"Bearer {link.key}"}
    try:
        async with session.get(link.url + "/backends", headers=headers,
                               timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as r:
            if r.status in (401, 403):
                return f"/backends answered {r.status} (fix: give the agent's key)"
            if r.status != 200:
                return f"/backends answered {r.status}"
            if (r.content_length or 0) > MAX_BODY:
                return "/backends: answer too large"
            body = await r.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        return f"/backends: {type(e).__name__}"
    try:
        return parse_answer(link, body)
    except BadReport as e:
        return f"/backends: not an agent's answer ({e})"


class AgentWatch:
    """Polls one agent for as long as it runs; ``settled`` is set after the first poll."""

    def __init__(self, link: AgentLink, session: aiohttp.ClientSession,
                 fleet: RemoteFleet) -> None:
        self.link, self.session, self.fleet = link, session, fleet
        self.settled = asyncio.Event()
        self.known: set[str] = set()  # the names it listed last
        self.outage: str | None = None  # why it does not answer (None: it does)

    async def run(self) -> None:
        interval = max(self.link.poll_interval_s, 0.1)
        if not math.isfinite(interval):
            interval = 2.0
        while True:
            self.apply(await fetch(self.session, self.link))
            self.settled.set()
            await asyncio.sleep(interval)

    def apply(self, got: list[Reported] | str) -> None:
        if isinstance(got, str):
            self._unreachable(got)
            return
        if self.outage is not None:
            log.info("agent.back", agent=self.link.name, backends=len(got))
            self.outage = None
        names = {r.cfg.name for r in got}
        for gone in sorted(self.known - names):
            self.fleet.forget(self.link.name, gone)
        for report in got:
            self.fleet.remote(report)
        self.known = names

    def _unreachable(self, error: str) -> None:
        if self.outage is None:
            # its backends may well still serve, but nothing says whether they restarted
            # (a new key) or are the same: they leave until the agent says again
            log.warning("agent.unreachable", agent=self.link.name, url=self.link.url,
                        error=error, backends_down=len(self.known))
        self.outage = error
        for name in sorted(self.known):
            self.fleet.remote_down(self.link.name, name,
                                   f"agent {self.link.name} unreachable: {error}")
