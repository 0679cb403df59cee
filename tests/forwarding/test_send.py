"""The bytes sent upstream and the chat answer's first choice, table-driven."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.forwarding.answer import first_choice
from proxy.forwarding.send import encoded, upstream_payload

BIG = 1 << 70  # past 64 bits: orjson refuses it, json writes it


@pytest.mark.parametrize("body", [{"a": 1}, {"seed": BIG}, {"n": [BIG, {"x": "é"}]}])
def test_encoded_bodies_read_back_the_same(body: dict[str, Any]) -> None:
    assert json.loads(encoded(body)) == body


def test_a_merged_payload_with_a_big_integer_is_sent_not_refused() -> None:
    body = {"seed": BIG, "stream_options": {"x": 1}}
    raw = json.dumps(body).encode()
    sent = upstream_payload(raw, body, {"stream_options": {"include_usage": True}})
    assert json.loads(sent) == {"seed": BIG,
                                "stream_options": {"x": 1, "include_usage": True}}


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
