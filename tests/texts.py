"""Prompt text for tests: ``n`` words, each one token of the demo vocabulary, seeded."""

from __future__ import annotations

import random

from loadtest.workloads import words as _words


def words(n: int, seed: int) -> str:
    return _words(random.Random(seed), n)
