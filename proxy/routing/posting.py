"""The RAM entries created by starts whose requests are not known posted on their
server yet (`Unposted`).

llama-server posts a task only once its HTTP thread has templated and tokenized the
request; its main loop then launches tasks in the order they were posted. A start that
saves a slot to RAM (its own, or an idle one: --cache-idle-slots) creates that entry only
when the server launches it. A request sent a moment after it and posted first (a short
prompt behind a long one) would launch first and find no entry to load: so a request
predicted to load such an entry names its creator (``Decision.after``), and the proxy
sends it only once the creator is known posted (its answer's head came, or it ended).
So does a request handed a slot whose idle save such a start makes, and whose content
it keeps (proxy/routing/outcomes.py `_saved_at`): posted first, it would take the slot
before the save. An answer that comes whole (not streamed) shows it posted only at its
end: a request held for it waits for that end, or AFTER_WAIT_S (proxy/forwarding/waits.py).
"""

from __future__ import annotations

from collections.abc import Iterable


class Unposted:
    """Of this replica's requests started in the model and not known posted, the RAM
    entries their starts created (or the idle saves named theirs), and per backend the
    order of their starts."""

    def __init__(self) -> None:
        self._creator: dict[tuple[str, int], int] = {}  # (backend, entry) -> request id
        self._created: dict[int, list[tuple[str, int]]] = {}  # request id -> its entries
        # backend -> {request id: the number of its start there}, oldest first
        self._open: dict[str, dict[int, int]] = {}

    def started(self, rid: int, backend: str, entries: Iterable[int],
                start: int | None = None) -> None:
        """``rid`` started on ``backend`` in the model, its start creating ``entries``;
        ``start``: that start's number there (`BackendCache.starts` after it), when it
        is the request's own (not only entries named its own)."""
        if start is not None:
            self._open.setdefault(backend, {})[rid] = start
        keys = [(backend, e) for e in entries]
        if keys:
            self._created.setdefault(rid, []).extend(keys)
            for k in keys:
                self._creator[k] = rid

    def creator(self, rid: int, backend: str, entry: int | None) -> int | None:
        """The request, other than ``rid``, whose start creates ``backend``'s RAM entry
        ``entry`` and which is not known posted yet (None: none such)."""
        if entry is None:
            return None
        got = self._creator.get((backend, entry))
        return None if got == rid else got

    def created(self, rid: int) -> list[int]:
        """The RAM entries ``rid``'s start created, while it is not known posted."""
        return [e for _, e in self._created.get(rid, ())]

    def pending(self, rid: int) -> bool:
        """Did ``rid``'s start create entries while it is not known posted?"""
        return rid in self._created

    def since(self, backend: str, start: int) -> int | None:
        """Of this replica's requests started on ``backend`` and not known posted, the
        last one, if its start came after number ``start`` (None: no such request)."""
        opened = self._open.get(backend)
        if not opened:
            return None
        rid = next(reversed(opened))
        return rid if opened[rid] > start else None

    def posted(self, rid: int) -> None:
        """``rid`` is known posted on its server, or it ended (or its backend left)."""
        for k in self._created.pop(rid, ()):
            self._creator.pop(k, None)
        for opened in self._open.values():
            opened.pop(rid, None)
