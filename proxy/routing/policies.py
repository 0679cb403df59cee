"""The routing policies by name: what each chooses, and what the router asks of it.

`REGISTRY` is the one list of policies: the router makes its policy from it
(`make_policy`), the config accepts its names (`POLICIES`), and `kvroute serve --help`
lists them with their one-line descriptions (`describe`). A policy answers `choose`, and
says what the router would otherwise have to ask by its name:

- ``orders_waiters``: a freed slot goes to the waiter of shortest expected prefill there,
  with ageing (proxy/routing/queue.py), not to the oldest (the server's own order);
- ``checks_head``: a choice made on the head of a prompt is checked against what the
  slots and RAM entries hold of it (`NeedWholePrompt`), as only a cache-aware choice can
  be.

The baselines pin no slot: they send requests where llama-server would put them (its
slot choice), as a plain load balancer in front of it would.
"""

from __future__ import annotations

import random
from typing import ClassVar, NamedTuple

from proxy.routing.options import Candidate
from proxy.routing.policy import Choice, choose_prefix
from proxy.routing.settings import RouterSettings


class Ask(NamedTuple):
    """One request as a policy sees it, beside its candidates."""

    n: int  # the prompt's tokens (estimated, decided on its head)
    now: float
    session: str | None  # the client's session hint
    known: int | None  # decided on its head: the head's tokens (None: the whole prompt)


class Policy:
    """A routing policy: `choose` a backend (and slot) among the candidates."""

    name: ClassVar[str]
    description: ClassVar[str]  # one line, for --help
    orders_waiters: ClassVar[bool] = False
    checks_head: ClassVar[bool] = False

    def __init__(self, settings: RouterSettings, seed: int) -> None:
        self.settings = settings

    def choose(self, cands: list[Candidate], ask: Ask) -> Choice:
        raise NotImplementedError


class Prefix(Policy):
    name = "prefix"
    description = "lowest expected time to first token, from what each slot and RAM holds"
    orders_waiters = True
    checks_head = True

    def choose(self, cands: list[Candidate], ask: Ask) -> Choice:
        return choose_prefix(cands, ask.n, self.settings, ask.now, ask.session, ask.known)


class _Baseline(Policy):
    """A comparison policy: picks a backend, the server picks the slot."""

    def pick(self, cands: list[Candidate]) -> Candidate:
        raise NotImplementedError

    def choose(self, cands: list[Candidate], ask: Ask) -> Choice:
        c = self.pick(cands)
        p = c.state.cache.predict(None, c.slot_lcp, c.ram_lcp, ask.n, lora=c.lora,
                                  prompt=c.prompt)
        reasons: dict[str, object] = {
            "policy": self.name,
            "why": self.name,
            "matched": {x.name: x.matched() for x in cands},
            "inflight": {x.name: x.state.inflight for x in cands},
        }
        return Choice(c.name, None, p, reasons)


class RoundRobin(_Baseline):
    name = "round_robin"
    description = "each backend in turn"

    def __init__(self, settings: RouterSettings, seed: int) -> None:
        super().__init__(settings, seed)
        self.next = 0

    def pick(self, cands: list[Candidate]) -> Candidate:
        c = cands[self.next % len(cands)]
        self.next += 1
        return c


class LeastLoaded(_Baseline):
    name = "least_loaded"
    description = "the backend with the fewest requests in flight"

    def pick(self, cands: list[Candidate]) -> Candidate:
        return min(cands, key=lambda x: (x.state.inflight, x.state.work))


class Random(_Baseline):
    name = "random"
    description = "a backend at random"

    def __init__(self, settings: RouterSettings, seed: int) -> None:
        super().__init__(settings, seed)
        self.rng = random.Random(seed)

    def pick(self, cands: list[Candidate]) -> Candidate:
        return self.rng.choice(cands)


REGISTRY: dict[str, type[Policy]] = {
    p.name: p for p in (Prefix, RoundRobin, LeastLoaded, Random)}
POLICIES = tuple(REGISTRY)


def make_policy(name: str, settings: RouterSettings, seed: int = 0) -> Policy:
    kind = REGISTRY.get(name)
    if kind is None:
        raise ValueError(f"policy: must be one of {', '.join(POLICIES)}, got {name!r}")
    return kind(settings, seed)


def describe() -> str:
    """The policies and what each does, for --help."""
    return "; ".join(f"{p.name}: {p.description}" for p in REGISTRY.values())
