"""What goes upstream, table-driven: the fields set for a backend, and the body with them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from backends.config import LLAMA, OPENAI
from backends.info import BackendInfo
from proxy.forwarding.assemble import ChatAssembler, NativeAssembler
from proxy.forwarding.payload import encoded, for_backend, upstream_payload, with_own_name

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


def backend(kind: str = LLAMA, marker: str = "") -> BackendInfo:
    return BackendInfo(name="a", url="http://127.0.0.1:9", api_key=None, n_slots=2,
                       slot_ctx=4096, ram_cache_bytes=0, kv_bytes_per_token=1024,
                       model="m", managed=False, kind=kind, media_marker=marker)


CHAT, NATIVE = "/v1/chat/completions", "/completion"
MEDIA = {"prompt_string": "look: <__media__>", "multimodal_data": ["x"]}


@pytest.mark.parametrize(("body", "path", "info", "kw", "fields", "strip", "streams"), [
    # a short answer goes as it is: the slot pinned, nothing else
    ({"stream": False, "max_tokens": 4}, CHAT, backend(), {"slot": 1}, {"id_slot": 1},
     False, False),
    # a stream asks for the usage the client did not ask for (stripped on the way back)
    ({"stream": True}, CHAT, backend(), {"slot": 0},
     {"id_slot": 0, "stream_options": {"include_usage": True}}, True, True),
    ({"stream": True, "stream_options": {"include_usage": True}}, CHAT, backend(),
     {"slot": None}, {}, False, True),
    # an unpinned request names no slot; an OpenAI backend gets its own model name, no slot
    ({"stream": False, "max_tokens": 4}, CHAT, backend(OPENAI), {"slot": 1},
     {"model": "m"}, False, False),
    # cache_prompt off for a recompute, the adapters named for one naming none
    ({"max_tokens": 4}, CHAT, backend(), {"slot": 0, "recompute": True,
                                          "lora": ((0, 0.5), (1, 0.0))},
     {"id_slot": 0, "cache_prompt": False,
      "lora": [{"id": 0, "scale": 0.5}, {"id": 1, "scale": 0.0}]}, False, False),
    # a whole answer that may run long: streamed upstream, assembled
    ({}, CHAT, backend(), {"slot": 0},
     {"id_slot": 0, "stream": True, "stream_options": {"include_usage": True}}, False, True),
    ({}, NATIVE, backend(), {"slot": 0},
     {"id_slot": 0, "stream": True, "return_tokens": True}, False, True),
    ({"n_predict": 4, "return_tokens": False}, NATIVE, backend(), {"slot": 0},
     {"id_slot": 0}, False, False),
    # a completion's media marker rewritten to this backend's own
    ({"prompt": MEDIA, "n_predict": 4}, NATIVE, backend(marker="<m>"),
     {"slot": None, "markers": {"<__media__>", "<m>"}},
     {"prompt": {**MEDIA, "prompt_string": "look: <m>"}, "return_tokens": True}, False, False),
])
def test_the_fields_a_backend_gets(body: dict[str, Any], path: str, info: BackendInfo,
                                   kw: dict[str, Any], fields: dict[str, Any], strip: bool,
                                   streams: bool) -> None:
    rest = {k: v for k, v in kw.items() if k != "slot"}
    out = for_backend(body, path, info, kw["slot"], **rest)
    assert (out.fields, out.strip_usage, out.streams) == (fields, strip, streams)
    want = {CHAT: ChatAssembler, NATIVE: NativeAssembler}[path] \
        if out.fields.get("stream") is True else type(None)
    assert isinstance(out.assemble, want)


@pytest.mark.parametrize(("raw", "kind", "sent"), [
    (b'{"model":"x","input":"hi"}', OPENAI, {"model": "m", "input": "hi"}),
    (b'{"input":"hi"}', OPENAI, {"model": "m", "input": "hi"}),
    (b'{"model":"x","input":"hi"}', LLAMA, {"model": "x", "input": "hi"}),  # any name
    (b'["hi"]', OPENAI, ["hi"]),  # not an object: the server says what it makes of it
])
def test_a_forwarded_call_names_the_model_a_backend_serves(raw: bytes, kind: str,
                                                           sent: object) -> None:
    assert json.loads(with_own_name(raw, backend(kind))) == sent


def test_a_forwarded_body_that_is_not_json_goes_as_it_is() -> None:
    assert with_own_name(b"{not json", backend(OPENAI)) == b"{not json"
