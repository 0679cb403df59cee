"""What a slot's KV depends on besides its tokens: the identity of the model that computed
it, recorded with each saved file and compared before a restore.

The server checks a file's format, layer count and cache types, not which weights made
it: the KV of a fine-tune or another quantization of the same base loads without a word
and decodes wrong. A managed backend's identity is read from what kvroute starts it with;
an external server's from what it reports of itself, since kvroute did not start it. The
two kinds never match each other: a file moves between managed backends, or between
external ones, not from one kind to the other.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import PurePosixPath, PureWindowsPath

from backends.client import BackendClient, BackendDown, BadResponse, Failure, Props
from backends.config import ManagedBackendConfig


def _digest(doc: object) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def model_identity(cfg: ManagedBackendConfig) -> str | None:
    """A managed backend's model, as a short hash (None: the model file cannot be read).
    The weights: the GGUF by its resolved path, size and mtime (a file replaced or
    requantized in place gets another). The command line: a LoRA adapter, RoPE scaling,
    the cache types change what the KV holds, and `LLAMA_ARG_*` variables are options
    too. The build is not: the server checks a file's format version itself, and another
    build computes the same KV from the same weights, up to rounding."""
    try:
        path = cfg.model.resolve()
        st = path.stat()
    except OSError:
        return None
    env = sorted((k, v) for k, v in cfg.env.items() if k.startswith("LLAMA_ARG_"))
    return _digest([str(path), st.st_size, st.st_mtime_ns, list(cfg.extra_args), env])


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
