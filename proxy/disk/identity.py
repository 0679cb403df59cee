"""What a slot's KV depends on besides its tokens: the identity of the model that computed
it, recorded with each saved file and compared before a restore.

The server checks a file's format, layer count and cache types, not which weights made
it: the KV of a fine-tune or another quantization of the same base loads without a word
and decodes wrong. A managed backend's identity is read from what kvroute starts it with;
an external server's from what it reports of itself, since kvroute did not start it. The
two kinds never match each other: a file moves between managed backends, or between
external ones, not from one kind to the other.

`Identities` holds the model each backend of a directory runs, and asks an external
server again before each save and restore: it may have been restarted with another model
between two health probes.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath, PureWindowsPath

import aiohttp
import structlog

from backends.client import BackendClient, BackendDown, BadResponse, Failure, Props
from backends.config import ManagedBackendConfig
from backends.info import BackendInfo

# An external server asked which model it runs: at once (its HTTP threads answer), and
# its adapters after the batch under way (its loop answers: seconds on a long prefill)
_IDENTITY_TIMEOUT_S = 5.0
_ADAPTERS_TIMEOUT_S = 30.0
_IDENTITY_RETRY_S = 300.0  # an external server that did not say: asked again this seldom


def _digest(doc: object) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def model_identity(cfg: ManagedBackendConfig) -> str | None:
    """A managed backend's model, as a short hash (None: the model file cannot be read).
    The weights: the GGUF by its resolved path, size and mtime (a file replaced or
    requantized in place gets another). The command line: a LoRA adapter, RoPE scaling,
    the cache types change what the KV holds, and `LLAMA_ARG_*` variables are options
    too. The build is not: the server checks a file's format version itself, and another
    build computes the same KV from the same weights, up to rounding. A projector
    (`mmproj:`) made the KV of the images a slot holds, so it counts as the weights do;
    so do LoRA adapters (`lora:`), in their order (a request names one by its index),
    as `--lora` in extra_args counts (each only when there is one: the files of a
    backend without keep their identity)."""
    try:
        files = [_file(cfg.model)] + ([] if cfg.mmproj is None else [_file(cfg.mmproj)])
        loras = [["lora", *_file(p)] for p in cfg.lora]
    except OSError:
        return None
    env = sorted((k, v) for k, v in cfg.env.items() if k.startswith("LLAMA_ARG_"))
    return _digest([*files[0], list(cfg.extra_args), env, *files[1:], *loras])


def _file(path: Path) -> list[object]:
    """A file by its resolved path, size and mtime."""
    path = path.resolve()
    st = path.stat()
    return [str(path), st.st_size, st.st_mtime_ns]


async def reported_model(client: BackendClient) -> str | None:
    """An external llama-server's model, as it reports it at once however busy it is
    (`/props` and `/v1/models` are answered by its HTTP threads), as a short hash (None:
    it did not answer, or said too little to tell its model from another). The GGUF by
    the absolute path it was started with, its type and shape (`/v1/models`' meta:
    parameters, bytes, vocabulary, width, training context; not the context it runs
    with), and the LoRA adapters' scales it applies by default."""
    props, models = await asyncio.gather(client.props(), client.get("/v1/models"))
    if not isinstance(props, Props) or not _absolute(props.model_path):
        return None
    meta = _meta(models)
    if meta is None:
        return None
    settings = props.raw.get("default_generation_settings")
    params = settings.get("params") if isinstance(settings, dict) else None
    lora = params.get("lora") if isinstance(params, dict) else None
    return _digest(["reported", props.model_path, str(props.raw.get("model_ftype")), meta,
                    lora])


async def reported_identity(client: BackendClient, model: str) -> str | Failure:
    """``model`` (reported_model's) with the adapters' files (`/lora-adapters`, answered
    by the server's loop: after the batch under way, seconds on a long prefill; so asked
    when the server becomes ready, and when its model changed); the failure when the
    server does not say (no answer in time; a 404 from a server older than the endpoint:
    its adapters are unknown, and so is what its KV holds). What a server does not
    report (a RoPE scaling option, a file replaced in place by one of the same size)
    servers that share a directory must have alike: kvroute cannot tell them apart."""
    lora = await client.get("/lora-adapters")
    if isinstance(lora, BackendDown | BadResponse):
        return lora
    if not isinstance(lora, list):
        return BadResponse(client.url, 200, str(lora)[:500])
    return _digest([model, lora])


def _absolute(path: str) -> bool:
    """A path that names one file whatever the server's working directory."""
    return PurePosixPath(path).is_absolute() or PureWindowsPath(path).is_absolute()


def _meta(models: object) -> dict[str, object] | None:
    """The model's meta of a `/v1/models` answer, without the context it runs with (two
    servers of one model may be given different `-c`)."""
    rows = models.get("data") if isinstance(models, dict) else None
    meta = rows[0].get("meta") if isinstance(rows, list) and rows \
        and isinstance(rows[0], dict) else None
    if not isinstance(meta, dict) or not meta:
        return None
    return {k: v for k, v in meta.items() if k != "n_ctx"}


class Identities:
    """The model each backend of a directory runs (`models`: backend -> identity; a
    backend whose model is unknown has none). An external server is asked through
    ``session``, and what an ask learns goes to ``learnt(backend, identity, count,
    fresh)`` (SlotStore.backend_ready: it calls `learn`)."""

    def __init__(self, session: aiohttp.ClientSession,
                 learnt: Callable[[str, str | None, bool, bool], None]) -> None:
        self.session, self.learnt = session, learnt
        self.log = structlog.get_logger()
        self.models: dict[str, str] = {}
        # external backend -> reported_model when it last became ready: asked again
        # before each save and restore
        self._reported: dict[str, str | None] = {}
        self._asked: dict[str, float] = {}  # external backend -> when it was last asked
        self._asking: dict[str, asyncio.Task[None]] = {}  # external backend -> its ask
        self.retry_s = _IDENTITY_RETRY_S

    def learn(self, backend: str, model: str | None) -> None:
        """``backend`` runs ``model`` (None: unknown)."""
        if model is None:
            self.models.pop(backend, None)
        else:
            self.models[backend] = model

    async def model_of(self, info: BackendInfo) -> str | None:
        """The model ``info`` runs now (None: unknown). An external server is asked: it
        may have been restarted with another model between two health probes, unseen;
        one whose model is unknown (it did not say when it became ready) is asked again,
        once in ``retry_s``, and one being asked is waited for."""
        model = self.models.get(info.name)
        if info.managed:
            return model
        if model is None:
            if info.name not in self._asking and time.monotonic() - self._asked.get(
                    info.name, 0.0) < self.retry_s:
                return None
            await self.ask(info, count=False)
            return self.models.get(info.name)
        now = await reported_model(self._client(info))
        if now is None or now == self._reported.get(info.name):
            return None if now is None else model  # (no answer: nothing learnt)
        self.log.warning("slot.model_changed", backend=info.name)
        await self.ask(info, count=False)
        return self.models.get(info.name)

    async def ask(self, info: BackendInfo, count: bool = True) -> None:
        """External backend ``info`` answers (again): what it runs is what it reports
        (kvroute did not start it); ``count``: passed on to ``learnt``. One ask at a
        time: a caller that comes while one is under way waits for that one (a turn's
        save in the seconds its /lora-adapters waits for the server's loop), and one
        that goes away leaves it to finish (within its clients' timeouts)."""
        asking = self._asking.get(info.name)
        if asking is None:
            asking = self._asking[info.name] = asyncio.ensure_future(self._ask(info, count))
            asking.add_done_callback(
                lambda t: self._asking.pop(info.name) if self._asking.get(info.name) is t
                else None)
        await asyncio.shield(asking)

    async def _ask(self, info: BackendInfo, count: bool) -> None:
        self._asked[info.name] = time.monotonic()
        known = self.models.get(info.name)
        model = await reported_model(self._client(info))
        got = None if model is None else await reported_identity(
            self._client(info, _ADAPTERS_TIMEOUT_S), model)
        # (with its identity, not before: an ask cut short between the two, its request
        # gone, would leave `model_of` taking the new report for the old model)
        self._reported[info.name] = model
        if not isinstance(got, str):
            self.log.warning("slot.model_unknown", backend=info.name,
                             reason="/props, /v1/models: no model" if got is None
                             else str(got), fix="start it with -m and the GGUF's "
                             "absolute path; check its api_key; a llama-server that "
                             "answers /lora-adapters")
        identity = got if isinstance(got, str) else None
        self.learnt(info.name, identity, count, known is not None and identity != known)

    async def close(self) -> None:
        """Cancel the asks under way."""
        tasks = list(self._asking.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _client(self, info: BackendInfo, timeout: float = _IDENTITY_TIMEOUT_S
                ) -> BackendClient:
        return BackendClient(self.session, info.url, info.api_key, timeout=timeout)
