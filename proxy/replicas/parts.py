"""An encoded event larger than the broker takes in one message (NATS: `max_payload`,
1 MB unless the server's config says more: a prompt of ~450k tokens) goes in parts, each
within it, and is put back together by the receiver.

A part is ``MAGIC``, the message's id (random), its index and the number of parts, then
its share of the event's bytes (an event itself is JSON: it never starts with MAGIC).
The broker keeps one sender's messages on a subject in order, so a receiver takes each
message's parts in order only: a part out of turn means one was lost, and the message
with it. What the receiver holds is bounded: each message at the events' own limit
(`MAX_EVENT_BYTES`), all of them at `PENDING_BYTES` and `PENDING` messages (the least
recently added to go first), and one not added to for `TIMEOUT_S` is dropped.
"""

from __future__ import annotations

import os
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from proxy.replicas.events import MAX_EVENT_BYTES

MAGIC = b"\x00kvp"
_HEADER = struct.Struct(">4s8sII")  # magic, id, index, parts
HEADER = _HEADER.size
MIN_SHARE = 256  # bytes of the event a part carries at least (else it is not sent)
PENDING = 64  # messages in parts held at once
PENDING_BYTES = 2 * MAX_EVENT_BYTES
TIMEOUT_S = 10.0  # a message not added to for this long lost a part


def split(data: bytes, max_payload: int) -> list[bytes]:
    """``data`` as the messages that carry it (itself when it fits; none when it is
    larger than a peer reads, or the broker's limit too small to split it)."""
    if len(data) > MAX_EVENT_BYTES:
        return []
    if len(data) <= max_payload:
        return [data]
    share = max_payload - HEADER
    if share < MIN_SHARE:
        return []
    ident, n = os.urandom(8), -(-len(data) // share)
    return [_HEADER.pack(MAGIC, ident, i, n) + data[i * share:(i + 1) * share]
            for i in range(n)]


def is_part(data: bytes) -> bool:
    return data.startswith(MAGIC)


@dataclass
class _Message:
    at: float  # when its last part came
    data: bytearray | None  # None: a part was lost (its others are let go)
    next: int = 0  # the index of the part it waits for
    parts: int = 0


class Assembler:
    """The events that came in parts, whole; ``counted`` hears ``invalid`` (a part that
    is not one, or a message too large) and ``incomplete`` (a message that lost a part,
    or was let go to stay within the bounds)."""

    def __init__(self, counted: Callable[[str], None]) -> None:
        self.counted = counted
        self._messages: OrderedDict[tuple[str, bytes], _Message] = OrderedDict()
        self._bytes = 0

    @property
    def held(self) -> int:
        """Bytes held of messages not yet whole."""
        return self._bytes

    def add(self, subject: str, data: bytes, now: float) -> bytes | None:
        """The event ``data`` (a part, received on ``subject``) completes, if any."""
        self.expire(now)
        if len(data) <= HEADER:
            self.counted("invalid")
            return None
        magic, ident, index, parts = _HEADER.unpack_from(data)
        if magic != MAGIC or not index < parts or parts < 2:
            self.counted("invalid")
            return None
        key = subject, ident
        message = self._pop(key)
        if message is None and index == 0:
            message = _Message(now, bytearray(), parts=parts)
        elif message is None or (message.data is not None and (
                index != message.next or parts != message.parts)):
            self.counted("incomplete")  # (a part before this one was lost)
            message = _Message(now, None)
        if message.data is not None:
            if len(message.data) + len(data) - HEADER > MAX_EVENT_BYTES:
                self.counted("invalid")
                message.data = None
            else:
                message.data += memoryview(data)[HEADER:]
        message.next, message.at = index + 1, now
        if index == parts - 1:
            return None if message.data is None else bytes(message.data)
        self._keep(key, message)
        return None

    def expire(self, now: float) -> None:
        """Let go the messages not added to for TIMEOUT_S (a part was lost)."""
        while self._messages:
            key, oldest = next(iter(self._messages.items()))
            if now - oldest.at <= TIMEOUT_S:
                return
            self._let_go(key)

    def _keep(self, key: tuple[str, bytes], message: _Message) -> None:
        self._messages[key] = message
        self._bytes += len(message.data or b"")
        while len(self._messages) > PENDING or self._bytes > PENDING_BYTES:
            self._let_go(next(iter(self._messages)))

    def _let_go(self, key: tuple[str, bytes]) -> None:
        message = self._pop(key)
        if message is not None and message.data is not None:
            self.counted("incomplete")

    def _pop(self, key: tuple[str, bytes]) -> _Message | None:
        message = self._messages.pop(key, None)
        if message is not None:
            self._bytes -= len(message.data or b"")
        return message
