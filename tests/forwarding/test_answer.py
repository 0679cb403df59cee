"""The chat answer's first choice, table-driven."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.forwarding.answer import first_choice


@pytest.mark.parametrize(("obj", "choice", "message"), [
    ({"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}]},
     {"message": {"content": "hi"}, "finish_reason": "stop"}, {"content": "hi"}),
    ({"choices": []}, {}, {}),
    ({"choices": ["text"]}, {}, {}),  # (an external backend may send anything)
    ({"choices": [{"message": "text"}]}, {"message": "text"}, {}),
    ({}, {}, {}),
])
def test_first_choice(obj: dict[str, Any], choice: dict[str, Any],
                      message: dict[str, Any]) -> None:
    assert first_choice(obj) == (choice, message)
