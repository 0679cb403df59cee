"""Typed calls to one llama-server. A backend being down is an expected outcome, so every
call returns a value or a `BackendDown`/`BadResponse` result instead of raising.

    client = BackendClient(session, "http://127.0.0.1:8081", api_key)
    props = await client.props()
    if isinstance(props, Props): ...
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

# What a /props may say: beyond these it is a broken (external) backend, not a server
MAX_SLOTS = 4096
MAX_SLOT_CTX = 1 << 24  # tokens per slot (the largest models' context is ~10^6-10^7)


@dataclass(frozen=True)
class BackendDown:
    """Could not talk to the backend: connection refused/reset, or timeout."""

    url: str
    reason: str
    timed_out: bool = False  # no answer in time (not refused or reset)
    refused: bool = False  # no connection made: the request never reached it


@dataclass(frozen=True)
class BadResponse:
    """The backend answered, but not with what the call expects (status or shape)."""

    url: str
    status: int
    body: str  # first 500 characters


Failure = BackendDown | BadResponse


@dataclass(frozen=True)
class Health:
    ok: bool  # 200 {"status": "ok"}
    status: int  # HTTP status (503 while the model loads)


@dataclass(frozen=True)
class Props:
    total_slots: int
    slot_ctx: int  # default_generation_settings.n_ctx: tokens per slot
    model_alias: str  # the id /v1/models reports
    model_path: str
    build_info: str
    chat_template: str
    raw: Mapping[str, Any]
    # what its projector (--mmproj) lets it take besides text: vision, audio, video
    modalities: frozenset[str] = frozenset()
    media_marker: str = ""  # where a completion prompt's media go ("": not said)


@dataclass(frozen=True)
class SlotState:
    id: int
    is_processing: bool
    n_ctx: int
    n_prompt_tokens: int  # tokens the slot holds after its last task (0 before any)
    raw: Mapping[str, Any]


@dataclass(frozen=True)
class Tokens:
    ids: list[int]
    pieces: list[str] | None  # only with with_pieces=True


class BackendClient:
    def __init__(self, session: aiohttp.ClientSession, url: str, api_key: str | None = None,
                 timeout: float = 10.0) -> None:
        self.session = session
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout = aiohttp.ClientTimeout(total=timeout)

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def _request(self, method: str, path: str, body: object = None
                       ) -> tuple[int, str] | BackendDown:
        raw = isinstance(body, bytes)
        headers = {**self._headers(), "Content-Type": "application/json"} if raw else \
            self._headers()
        try:
            async with self.session.request(
                method, self.url + path, json=None if raw else body,
                data=body if raw else None, headers=headers, timeout=self.timeout,
            ) as r:
                return r.status, await r.text()
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            # (aiohttp's own timeouts are TimeoutError subclasses)
            return BackendDown(self.url, f"{type(e).__name__}: {e}" if str(e) else
                               type(e).__name__, timed_out=isinstance(e, TimeoutError),
                               refused=isinstance(e, aiohttp.ClientConnectorError))

    async def _json(self, method: str, path: str, body: object = None) -> Any | Failure:
        res = await self._request(method, path, body)
        if isinstance(res, BackendDown):
            return res
        status, text = res
        if status != 200:
            return BadResponse(self.url, status, text[:500])
        try:
            return orjson.loads(text)
        except ValueError:
            return BadResponse(self.url, status, text[:500])

    async def get(self, path: str) -> Any | Failure:
        """``path``'s JSON body (a 200 only)."""
        return await self._json("GET", path)

    async def health(self) -> Health | BackendDown:
        res = await self._request("GET", "/health")
        if isinstance(res, BackendDown):
            return res
        return Health(ok=res[0] == 200, status=res[0])

    async def models(self) -> list[str] | Failure:
        """The model ids `/v1/models` lists (any server of the OpenAI API has it)."""
        data = await self._json("GET", "/v1/models")
        if isinstance(data, BackendDown | BadResponse):
            return data
        rows = data.get("data") if isinstance(data, dict) else None
        ids = [r["id"] for r in rows if isinstance(r, dict) and isinstance(r.get("id"), str)] \
            if isinstance(rows, list) else []
        if not ids:
            return BadResponse(self.url, 200, str(data)[:500])
        return ids

    async def props(self) -> Props | Failure:
        data = await self._json("GET", "/props")
        if isinstance(data, BackendDown | BadResponse):
            return data
        try:
            slots = int(data["total_slots"])
            ctx = int(data["default_generation_settings"]["n_ctx"])
            # NOTE: an external backend may say anything: one claiming 10^12 tokens per
            # slot would lift the proxy's context check for all (it takes the largest)
            if not (0 < slots <= MAX_SLOTS and 0 < ctx <= MAX_SLOT_CTX):
                raise ValueError(f"total_slots {slots} or n_ctx {ctx} out of range")
            return Props(
                total_slots=slots,
                slot_ctx=ctx,
                model_alias=str(data.get("model_alias", "")),
                model_path=str(data.get("model_path", "")),
                build_info=str(data.get("build_info", "")),
                chat_template=str(data.get("chat_template", "")),
                raw=data,
                modalities=modalities(data.get("modalities")),
                media_marker=media_marker(data.get("media_marker")),
            )
        except (KeyError, TypeError, ValueError) as e:
            return BadResponse(self.url, 200, f"{type(e).__name__} {e}: {str(data)[:400]}")

    async def adapters(self) -> Adapters | Failure:
        """Its LoRA adapters (`/lora-adapters`; none when it has none, or is older than the
        endpoint: a 404)."""
        data = await self._json("GET", "/lora-adapters")
        if isinstance(data, BadResponse) and data.status == 404:
            return Adapters()
        if isinstance(data, BackendDown | BadResponse):
            return data
        got = adapter_list(data)
        return BadResponse(self.url, 200, str(data)[:500]) if got is None else got

    async def set_adapters(self, raw: bytes) -> Any | Failure:
        """POST /lora-adapters ``raw`` (a JSON array of id and scale): its answer."""
        return await self._json("POST", "/lora-adapters", raw)

    async def slots(self) -> list[SlotState] | Failure:
        data = await self._json("GET", "/slots")
        if isinstance(data, BackendDown | BadResponse):
            return data
        try:
            return [SlotState(id=int(s["id"]), is_processing=bool(s["is_processing"]),
                              n_ctx=int(s["n_ctx"]),
                              n_prompt_tokens=int(s.get("n_prompt_tokens", 0)), raw=s)
                    for s in data]
        except (KeyError, TypeError, ValueError):
            return BadResponse(self.url, 200, str(data)[:500])

    async def slot_when_idle(self, slot: int, limit_s: float, poll_s: float = 1.5
                             ) -> tuple[SlotState | None, bool]:
        """`slot` once it is not processing, asked every `poll_s` (None: not within
        `limit_s`, no such slot, or no /slots), and whether an answer showed it processing.

        NOTE: `poll_s` must stay over a second: a request's HTTP thread checks whether its
        client left only after a second in which no result at all reached the server's
        queues (server_response_reader::next), and each /slots answer is one: polling
        faster keeps an abandoned prefill running to its first token."""
        deadline = time.monotonic() + limit_s
        seen = False
        await asyncio.sleep(poll_s)  # (the server is still at it: it just lost its client)
        while time.monotonic() < deadline:
            got = await self.slots()
            if not isinstance(got, list):
                return None, seen
            state = next((s for s in got if s.id == slot), None)
            if state is None or not state.is_processing:
                return state, seen
            seen = True
            await asyncio.sleep(poll_s)
        return None, seen

    async def tokenize(self, content: str | Sequence[Any], add_special: bool = True,
                       parse_special: bool = True, with_pieces: bool = False
                       ) -> Tokens | Failure:
        data = await self._json("POST", "/tokenize", {
            "content": content, "add_special": add_special,
            "parse_special": parse_special, "with_pieces": with_pieces,
        })
        if isinstance(data, BackendDown | BadResponse):
            return data
        toks = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(toks, list):
            return BadResponse(self.url, 200, str(data)[:500])
        if with_pieces:
            return Tokens([int(t["id"]) for t in toks], [str(t["piece"]) for t in toks])
        return Tokens([int(t) for t in toks], None)

    async def apply_template(self, body: Mapping[str, Any] | bytes) -> str | Failure:
        """The prompt /v1/chat/completions would build for this request body (a JSON
        object, or its encoding)."""
        data = await self._json("POST", "/apply-template", body)
        if isinstance(data, BackendDown | BadResponse):
            return data
        if not isinstance(data, dict) or not isinstance(data.get("prompt"), str):
            return BadResponse(self.url, 200, str(data)[:500])
        return str(data["prompt"])

    async def slot_file(self, slot: int, action: str, filename: str) -> int | Failure:
        """Save the slot's KV to ``filename`` (in the server's --slot-save-path), or
        restore it from there (``action``: save | restore); the tokens saved or restored."""
        data = await self._json("POST", f"/slots/{slot}?action={action}",
                                {"filename": filename})
        if isinstance(data, BackendDown | BadResponse):
            return data
        key = "n_saved" if action == "save" else "n_restored"
        n = data.get(key) if isinstance(data, dict) else None
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            return BadResponse(self.url, 200, str(data)[:500])
        return n

    async def metrics(self) -> str | Failure:
        """The server's Prometheus text (llama-server --metrics; 501 without it)."""
        res = await self._request("GET", "/metrics")
        if isinstance(res, BackendDown):
            return res
        status, text = res
        return text if status == 200 else BadResponse(self.url, status, text[:500])


MAX_MARKER = 256  # characters of a media marker taken from /props (the server's: ~30)


def media_marker(raw: object) -> str:
    """The `/props` `media_marker` ("": none, or not a marker)."""
    return raw if isinstance(raw, str) and 0 < len(raw) <= MAX_MARKER else ""


@dataclass(frozen=True)
class Adapters:
    """A server's LoRA adapters, by id: their global scales, and each one's aLoRA
    invocation tokens (() for a plain adapter)."""

    scales: tuple[float, ...] = ()
    alora: tuple[tuple[int, ...], ...] = ()


def _token_id(t: object) -> bool:
    """A vocabulary's token id (an int32 at least 0)."""
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31


def adapter_list(raw: object) -> Adapters | None:
    """The adapters of a `GET /lora-adapters` answer (None: not one)."""
    if not isinstance(raw, list):
        return None
    got: dict[int, tuple[float, tuple[int, ...]]] = {}
    for a in raw:
        i, scale = (a.get("id"), a.get("scale")) if isinstance(a, Mapping) else (None, None)
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(raw) \
                or not isinstance(scale, int | float) or isinstance(scale, bool):
            return None
        inv = a.get("alora_invocation_tokens", [])
        if not isinstance(inv, list) or not all(_token_id(t) for t in inv):
            return None
        got[i] = (float(scale), tuple(inv))
    if len(got) != len(raw):
        return None
    return Adapters(tuple(got[i][0] for i in range(len(raw))),
                    tuple(got[i][1] for i in range(len(raw))))


def modalities(raw: object) -> frozenset[str]:
    """The media kinds `/props` says the server takes (``{"vision": true, ...}``)."""
    if not isinstance(raw, Mapping):
        return frozenset()
    return frozenset(k for k, v in raw.items() if isinstance(k, str) and v is True)
