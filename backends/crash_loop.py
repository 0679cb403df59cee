"""A managed backend's deaths, and when they make a crash loop: what died, and the fix;
and when it restarts.

A backend that dies `crash_loop_deaths` times within `crash_loop_window_s` is in a crash
loop. Its restarts then wait longer, and a restart is held out of routing until it stays
up `crash_loop_window_s`: by then it no longer died that often in that long, so the loop
is over.

`Restarts` keeps one backend's: the first restart waits `restart_backoff_s`, each next one
twice as long up to `restart_backoff_max_s`; a backend that ran fine for `RAN_FINE_S`
starts over from the first. Deaths that make a crash loop wait from
`restart_backoff_max_s`, doubling up to `crash_loop_backoff_max_s`; a held restart that
ends the loop starts the backoff over too. Pure: backends/managed.py tells it each death,
each run that lasted and each hold, and sleeps what it says.
"""

from __future__ import annotations

import shlex
import signal
from collections import deque
from dataclasses import dataclass, field

from backends.config import SupervisionConfig

RAN_FINE_S = 60.0  # a backend ready this long was not crash-looping: the backoff resets
# signals that are a crash of llama-server itself (a bug, or a kernel it runs wrongly)
_CRASHES = ("SIGSEGV", "SIGBUS", "SIGFPE", "SIGABRT")
# (words in the log tail, the fix): the first that matches is the likely cause
_LOG_CAUSES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("error loading model", "failed to load model", "unknown model architecture",
      "gguf_init", "invalid magic"),
     "the model file: check that it is a whole GGUF this llama-server supports "
     "(a newer architecture needs a newer build)"),
    (("out of memory", "failed to allocate", "cannot allocate", "bad_alloc",
      "unable to allocate"),
     "memory: lower ctx_per_slot, slots or cache_ram_mib, or free memory for it"),
    (("invalid argument", "unknown argument", "error while handling argument"),
     "a flag llama-server refuses: correct the backend's extra_args"),
    (("couldn't bind", "address already in use"),
     "its port was taken as it started: another restart picks another one"),
)


def signal_name(returncode: int | None) -> str | None:
    """The signal that ended a process, from its `Popen.returncode` (None: not one)."""
    if returncode is None or returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def likely_fix(sig: str | None, exit_code: int | None, log_tail: str, log: str,
               reason: str = "") -> str:
    """What to do about a backend that died by ``sig`` (or with ``exit_code``) after
    writing ``log_tail`` to ``log``; ``reason``: why the supervisor restarted it."""
    if sig == "SIGILL":
        return ("an instruction this CPU lacks: llama-server was built for another CPU "
                "(kvroute rebuilds its own when the CPU changes: a configured or PATH "
                "binary is not its own); use a portable build (`make artifacts`) or one "
                "built here")
    if sig == "SIGKILL":
        return ("killed from outside, most often by the kernel's OOM killer (see `dmesg`): "
                "lower ctx_per_slot, slots or cache_ram_mib")
    text = log_tail.lower()
    for words, fix in _LOG_CAUSES:
        if any(w in text for w in words):
            return fix
    if sig in _CRASHES:
        return ("a crash in llama-server itself: try `--no-repack` in the backend's "
                "extra_args, or another llama-server build; report it upstream with the "
                f"log at {log}")
    if reason.startswith("not healthy after"):
        return ("it did not load in time: raise supervision.startup_timeout_s for a model "
                f"that loads slowly, else read the log at {log}")
    return f"read the log at {log}"


@dataclass(frozen=True)
class Death:
    """One end of a managed backend's process, as the supervisor saw it."""

    at: float  # time.time()
    reason: str  # why the supervisor restarts it ("llama-server exited", ...)
    returncode: int | None  # Popen's: negative for a signal
    by_itself: bool  # it ended on its own (not stopped by the supervisor)
    log_tail: tuple[str, ...]
    model: str
    argv: tuple[str, ...]  # (no API key: llama-server takes it from its environment)
    log: str

    @property
    def signal(self) -> str | None:
        return signal_name(self.returncode) if self.by_itself else None

    @property
    def exit_code(self) -> int | None:
        rc = self.returncode
        return rc if self.by_itself and rc is not None and rc >= 0 else None

    def what(self) -> str:
        """What ended it, in a few words."""
        if self.signal is not None:
            return f"killed by {self.signal}"
        if self.exit_code is not None:
            return f"exited with code {self.exit_code}"
        return self.reason.split("\n", 1)[0]

    def fix(self) -> str:
        return likely_fix(self.signal, self.exit_code, "\n".join(self.log_tail), self.log,
                          self.reason)


@dataclass
class CrashLoop:
    """The recent deaths of one backend; in a loop from `since` until a restart holds."""

    deaths_needed: int
    window_s: float
    recent: deque[float] = field(default_factory=deque)  # times of the deaths in the window
    last: Death | None = None
    since: float | None = None  # time.time() it entered the loop (None: not in one)
    until: float | None = None  # when the next restart is, or the held one is routed
    # A held restart gets no traffic, and some crashes come only with it (a kernel that
    # fails on two slots decoding together): a death within window_s of the loop's end
    # starts it again at once, not after crash_loop_deaths more.
    probation_until: float | None = None

    @property
    def looping(self) -> bool:
        return self.since is not None

    def died(self, death: Death) -> bool:
        """Count ``death``; True when it makes a crash loop (it was not in one)."""
        self.last = death
        self.recent.append(death.at)
        while self.recent and self.recent[0] < death.at - self.window_s:
            self.recent.popleft()
        if self.looping:
            return False
        on_probation = self.probation_until is not None and death.at <= self.probation_until
        if len(self.recent) < self.deaths_needed and not on_probation:
            return False
        self.since = death.at
        return True

    def held(self, now: float) -> None:
        """A restart stayed up `window_s` (at ``now``): the loop is over, on probation."""
        self.since = self.until = None
        self.recent.clear()
        self.probation_until = now + self.window_s

    def summary(self, name: str) -> str:
        """One line: which backend, what died and the fix (a log line, a 503's message)."""
        assert self.last is not None
        return (f"backend {name} is in a crash loop ({len(self.recent)} deaths within "
                f"{self.window_s:g} s, the last {self.last.what()}); likely fix: "
                f"{self.last.fix()}")

    def report(self) -> dict[str, object] | None:
        """What /kvroute/status and backends.json say of it (None: not in a loop)."""
        d = self.last
        if not self.looping or d is None:
            return None
        return {"since": self.since, "deaths": len(self.recent), "window_s": self.window_s,
                "died": d.what(), "signal": d.signal, "exit_code": d.exit_code,
                "reason": d.reason.split("\n", 1)[0], "fix": d.fix(),
                "log_tail": list(d.log_tail), "log": d.log, "model": d.model,
                "argv": list(d.argv), "command": shlex.join(d.argv), "until": self.until}


@dataclass(frozen=True)
class Unavailable:
    """Why some backends cannot serve now (their crash loops), and when to ask again."""

    reason: str
    retry_after: float  # seconds


@dataclass(frozen=True)
class Restart:
    """What to do after a death."""

    wait_s: float  # before the next start
    loop_began: bool  # this death made a crash loop (it was not in one)
    deaths: int  # within the crash loop's window, this one included


class Restarts:
    """One managed backend's restarts: how many, the next backoff, its crash loop."""

    def __init__(self, supervision: SupervisionConfig) -> None:
        self._sup = supervision
        self._loop = CrashLoop(supervision.crash_loop_deaths, supervision.crash_loop_window_s)
        self._backoff = supervision.restart_backoff_s
        self._count = 0

    @property
    def count(self) -> int:
        """Deaths so far (each one restarts it)."""
        return self._count

    @property
    def looping(self) -> bool:
        return self._loop.looping

    @property
    def until(self) -> float | None:
        """In a crash loop: when the next restart is, or the held one is routed."""
        return self._loop.until

    def died(self, death: Death) -> Restart:
        """Count ``death``: how long until the next start."""
        self._count += 1
        began = self._loop.died(death)
        if began:
            self._backoff = max(self._backoff, self._sup.restart_backoff_max_s)
        wait = self._backoff
        self._loop.until = death.at + wait if self._loop.looping else None
        cap = (self._sup.crash_loop_backoff_max_s if self._loop.looping
               else self._sup.restart_backoff_max_s)
        self._backoff = min(wait * 2, cap)
        return Restart(wait, began, len(self._loop.recent))

    def ran(self, seconds: float) -> None:
        """It was ready ``seconds`` before it went down (or the pool stopped)."""
        if seconds > RAN_FINE_S:
            self._backoff = self._sup.restart_backoff_s

    def hold(self, now: float) -> float:
        """A restart in a crash loop is up at ``now``: how long it is held unrouted."""
        window = self._loop.window_s
        self._loop.until = now + window
        return window

    def held(self, now: float) -> None:
        """The held restart stayed up (at ``now``): the loop is over, the backoff resets."""
        self._loop.held(now)
        self._backoff = self._sup.restart_backoff_s

    def summary(self, name: str) -> str:
        """In a crash loop: one line naming ``name``, what died and the fix."""
        return self._loop.summary(name)

    def report(self) -> dict[str, object] | None:
        """What the status says of its crash loop (None: not in one)."""
        return self._loop.report()
