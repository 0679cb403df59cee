"""The policy registry: one list read by the router, the config and --help; the baselines."""

from __future__ import annotations

import pytest

from proxy.cli import main
from proxy.config.fields import ConfigError
from proxy.config.load import load_config
from proxy.routing.cache.values import BackendCapacity
from proxy.routing.decision import Report
from proxy.routing.policies import POLICIES, REGISTRY, describe, make_policy
from proxy.routing.routed import Routed
from proxy.routing.router import Router
from proxy.routing.settings import RouterSettings

BACKENDS = 'backends: [{name: x, url: "http://h:1"}]\n'


def cluster(policy: str, n: int = 3, seed: int = 0) -> Router:
    r = Router(policy, seed=seed)
    for i in range(n):
        r.add_backend(BackendCapacity(f"b{i}", 2, 4096, 0, 8192))
    return r


def route(r: Router, tokens: list[int]) -> Routed:
    d = r.decide(tokens)
    assert isinstance(d, Routed)
    return d


@pytest.mark.parametrize(("name", "orders_waiters", "checks_head"), [
    ("prefix", True, True),
    ("round_robin", False, False),
    ("least_loaded", False, False),
    ("random", False, False),
])
def test_each_policy_says_what_the_router_asks_of_it(name: str, orders_waiters: bool,
                                                      checks_head: bool) -> None:
    p = make_policy(name, RouterSettings())
    assert (p.name, p.orders_waiters, p.checks_head) == (name, orders_waiters, checks_head)
    assert Router(name).policy == name


def test_the_registry_is_the_one_list(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    shown = " ".join(capsys.readouterr().out.split())  # (argparse wraps lines)
    for name, kind in REGISTRY.items():
        assert f"{name}: {kind.description}" in describe()
        assert f"{name}: {' '.join(kind.description.split())}" in shown
    with pytest.raises(ValueError, match="must be one of prefix, round_robin"):
        make_policy("fastest", RouterSettings())


def test_the_config_accepts_the_registry_names_only(tmp_path) -> None:  # type: ignore[no-untyped-def]
    for name in POLICIES:
        cfg = tmp_path / f"{name}.yaml"
        cfg.write_text(f"proxy: {{policy: {name}}}\n{BACKENDS}")
        assert load_config(cfg, check_port=False).proxy.policy == name
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"proxy: {{policy: fastest}}\n{BACKENDS}")
    with pytest.raises(ConfigError, match=", ".join(POLICIES)):
        load_config(bad, check_port=False)


def test_round_robin_takes_each_backend_in_turn_and_pins_nothing() -> None:
    r = cluster("round_robin")
    got = [route(r, [1, 2, 3]) for _ in range(6)]
    assert [d.backend for d in got] == ["b0", "b1", "b2"] * 2
    assert all(d.slot is None for d in got)
    assert got[0].reasons["why"] == "round_robin"


def test_least_loaded_takes_the_backend_with_fewest_in_flight() -> None:
    r = cluster("least_loaded")
    first = [route(r, [i, 2, 3]) for i in range(3)]
    assert sorted(d.backend for d in first) == ["b0", "b1", "b2"]
    first[1].complete(Report(output_tokens=[9]))
    assert route(r, [7, 7, 7]).backend == first[1].backend


def test_random_is_the_seed_s_sequence() -> None:
    a = [route(cluster("random", seed=5), [1, 2]).backend for _ in range(1)]
    runs = [[route(r, [i, 2]).backend for i in range(12)]
            for r in (cluster("random", seed=5), cluster("random", seed=5))]
    assert runs[0] == runs[1] and a[0] == runs[0][0]
    assert len(set(runs[0])) > 1
