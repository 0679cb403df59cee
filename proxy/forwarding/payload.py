"""What goes upstream: the fields kvroute sets on a request for the backend it chose
(`for_backend`; a call it forwards as it is gets only the model's name: `with_own_name`),
and the client's body with them (`upstream_payload`, `encoded`)."""

from __future__ import annotations

import json
from collections.abc import Set
from dataclasses import dataclass

import orjson

from backends.dialect import NATIVE_PATHS, OPENAI_PATHS
from backends.info import BackendInfo
from proxy.forwarding.answer import JSON
from proxy.forwarding.assemble import Assembler, assembler_for
from proxy.prompt.media import prompt_for
from proxy.routing.cache.lora import Lora


@dataclass(frozen=True)
class Outgoing:
    """The request as sent to one backend."""

    fields: JSON  # set on the client's body
    strip_usage: bool  # the usage-only event asked for here is not the client's
    assemble: Assembler | None  # a whole answer asked for, streamed upstream, assembled
    streams: bool  # the answer comes from the backend as a stream


def for_backend(body: JSON, path: str, info: BackendInfo, slot: int | None, *,
                recompute: bool = False, lora: Lora | None = None,
                markers: Set[str] = frozenset()) -> Outgoing:
    """The fields a request gets for ``info``: ``slot`` pinned (where it pins slots),
    the model's name (where it knows only its own), its media markers (``markers``: all
    the backends' markers; a completion's prompt carries one), ``cache_prompt`` off
    (``recompute``), the LoRA adapters it runs under (``lora``, for one naming none), a
    stream's usage, and a whole answer streamed upstream (so that a client that leaves
    stops it: proxy/forwarding/assemble.py)."""
    dialect = info.dialect
    fields: JSON = {}
    if slot is not None and dialect.pins_slots:
        fields["id_slot"] = slot
    if not dialect.any_model_name:
        fields["model"] = info.model  # (it may know only its own name: see with_own_name)
    if markers and info.media_marker and "prompt" in body:
        fields["prompt"] = prompt_for(body["prompt"], markers, info.media_marker)
    if recompute:
        fields["cache_prompt"] = False  # (see Decision.recompute)
    if lora:
        # named, so the server never runs it over KV made under other adapters
        fields["lora"] = [{"id": i, "scale": s} for i, s in lora]
    stream = body.get("stream") is True
    strip_usage = stream and path in OPENAI_PATHS and not _wants_usage(body)
    if strip_usage:
        fields["stream_options"] = {"include_usage": True}
    assemble = None if stream else assembler_for(path, body)
    if assemble is not None:
        fields["stream"] = True
        if path in OPENAI_PATHS:
            fields["stream_options"] = {"include_usage": True}
    if path in NATIVE_PATHS and "return_tokens" not in body and dialect.returns_tokens:
        fields["return_tokens"] = True  # exact generated ids: the slot holds these
    return Outgoing(fields, strip_usage, assemble, stream or assemble is not None)


def _wants_usage(body: JSON) -> bool:
    opts = body.get("stream_options")
    return isinstance(opts, dict) and opts.get("include_usage") is True


def upstream_payload(raw: bytes, body: JSON, extra: JSON) -> bytes:
    """The client's body with `extra` fields set.

    When none of `extra`'s keys is in the body, the fields are spliced in front of the raw
    bytes: re-serialising a 30k-token conversation costs ~1 ms, splicing a memcpy (one:
    the tail goes in as a memoryview, not a sliced copy).
    """
    if not extra:
        return raw
    if body and extra.keys().isdisjoint(body):
        start = raw.index(b"{") + 1
        fields = orjson.dumps(extra)[1:-1]
        return b"".join((raw[:start], fields, b",", memoryview(raw)[start:]))
    merged = dict(body)
    for key, val in extra.items():
        if isinstance(val, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **val}
        else:
            merged[key] = val
    return encoded(merged)


def encoded(body: JSON) -> bytes:
    """``body`` as the bytes sent upstream: orjson (~10x json's speed on a long
    conversation), json for an integer past 64 bits (which orjson refuses)."""
    try:
        return orjson.dumps(body)
    except TypeError:
        return json.dumps(body, separators=(",", ":")).encode()


def with_own_name(raw: bytes, info: BackendInfo) -> bytes:
    """The body for ``info``: a server of the OpenAI API (vLLM, SGLang) answers 404 to a
    `model` it does not serve, and a pool takes any of its aliases (and, alone, any
    name), so it gets its own. A llama-server takes any name: the body as it is."""
    if info.dialect.any_model_name or not raw:
        return raw
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw
    return upstream_payload(raw, body, {"model": info.model}) if isinstance(body, dict) else raw
