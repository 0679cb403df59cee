"""When a managed backend restarts (Restarts, backends/crash_loop.py), table-driven:
the backoff as it doubles, caps and starts over, and the crash loop its deaths make and
end. No processes: the component is pure (backends/managed.py feeds it)."""

from __future__ import annotations

import pytest

from backends.config import SupervisionConfig
from backends.crash_loop import RAN_FINE_S, Death, Restarts

SUP = SupervisionConfig(restart_backoff_s=0.5, restart_backoff_max_s=4.0,
                        crash_loop_deaths=3, crash_loop_window_s=10.0,
                        crash_loop_backoff_max_s=30.0)


def death(at: float) -> Death:
    return Death(at=at, reason="llama-server exited", returncode=-11, by_itself=True,
                 log_tail=("fake_backend: SIGSEGV on demand",), model="m.gguf",
                 argv=("llama-server", "--port", "1"), log="a.log")


Event = tuple[str, float]  # ("die", at) | ("ran", seconds) | ("held", at)


def play(events: list[Event]) -> tuple[Restarts, list[tuple[float, bool, bool]]]:
    """(wait, loop began, looping) after each death."""
    r = Restarts(SUP)
    got = []
    for kind, x in events:
        if kind == "die":
            restart = r.died(death(x))
            got.append((restart.wait_s, restart.loop_began, r.looping))
        elif kind == "ran":
            r.ran(x)
        else:
            r.hold(x)
            r.held(x)
    return r, got


@pytest.mark.parametrize(("events", "expect"), [
    # deaths far apart: no loop; the backoff doubles up to restart_backoff_max_s
    ([("die", 0), ("die", 20), ("die", 40), ("die", 60), ("die", 80), ("die", 100)],
     [(0.5, False, False), (1.0, False, False), (2.0, False, False), (4.0, False, False),
      (4.0, False, False), (4.0, False, False)]),
    # 3 within the window: a loop; its waits start at restart_backoff_max_s and double up
    # to crash_loop_backoff_max_s
    ([("die", 0), ("die", 1), ("die", 2), ("die", 3), ("die", 4), ("die", 5)],
     [(0.5, False, False), (1.0, False, False), (4.0, True, True), (8.0, False, True),
      (16.0, False, True), (30.0, False, True)]),
    # a run that lasted: the backoff starts over (a short one does not)
    ([("die", 0), ("die", 20), ("ran", RAN_FINE_S + 1), ("die", 100)],
     [(0.5, False, False), (1.0, False, False), (0.5, False, False)]),
    ([("die", 0), ("die", 20), ("ran", RAN_FINE_S - 1), ("die", 100)],
     [(0.5, False, False), (1.0, False, False), (2.0, False, False)]),
    # a held restart ends the loop and the backoff; one death on probation starts it anew
    ([("die", 0), ("die", 1), ("die", 2), ("held", 20), ("die", 25)],
     [(0.5, False, False), (1.0, False, False), (4.0, True, True), (4.0, True, True)]),
    # ... once the probation is over, one death is one death
    ([("die", 0), ("die", 1), ("die", 2), ("held", 20), ("die", 40)],
     [(0.5, False, False), (1.0, False, False), (4.0, True, True), (0.5, False, False)]),
])
def test_waits_and_crash_loops(events: list[Event],
                               expect: list[tuple[float, bool, bool]]) -> None:
    r, got = play(events)
    assert got == expect
    assert r.count == len(expect)


def test_until_is_the_next_restart_while_in_a_loop() -> None:
    r, _ = play([("die", 0), ("die", 1)])
    assert r.until is None and r.report() is None
    r.died(death(2))
    assert r.until == 2 + 4.0  # the death's time and its wait
    assert r.hold(100.0) == SUP.crash_loop_window_s
    assert r.until == 100.0 + SUP.crash_loop_window_s  # when the held restart is routed
    report = r.report()
    assert report is not None and (report["deaths"], report["died"]) == (3, "killed by SIGSEGV")
    assert r.summary("a").startswith("backend a is in a crash loop (3 deaths within 10 s")
    r.held(110.0)
    assert not r.looping and r.until is None and r.report() is None
