"""Errors the proxy returns to clients, and their bodies in each API's own format.

Hierarchy::

    ProxyError                  anything the proxy answers with an error status
    ├── BadRequest              400 malformed JSON, wrong types, bad prompt
    ├── Unauthorized            401 missing or wrong client API key
    ├── NotFound                404 unknown path
    ├── MethodNotAllowed        405
    ├── RequestTimeout          408 the body did not arrive in time
    ├── PayloadTooLarge         413 body over the configured limit
    ├── Overloaded              429 queue full (carries Retry-After)
    ├── NoBackendAvailable      503 no healthy backend (carries Retry-After)
    ├── UpstreamError           502 backend unreachable or broke the connection
    └── UpstreamTimeout         504 backend did not answer in time

A body is rendered by a formatter picked per request (`format_for_path`): the OpenAI
shape ``{"error": {"message", "type", "code"}}``, or Anthropic's
``{"type": "error", "error": {"type", "message"}}`` on its endpoints.
"""

from __future__ import annotations

import contextlib
import enum
import json
from collections.abc import Callable
from typing import Any

from aiohttp import web


class ErrorFormat(enum.Enum):
    """The API whose error shape a response must use."""

    OPENAI = "openai"
    ANTHROPIC = "anthropic"


class ProxyError(Exception):
    """An error the client sees as a status code and an API-format body."""

    status: int = 500
    type: str = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, code: str | None = None,
                 retry_after: float | None = None, close: bool = False) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.retry_after = retry_after
        # the connection ends after this answer: its request's body was not read whole,
        # so what follows on it is not the next request
        self.close = close


class BadRequest(ProxyError):
    """The request body or its fields are invalid."""

    status, type = 400, "invalid_request_error"


class Unauthorized(ProxyError):
    """No or a wrong client API key."""

    status, type, code = 401, "authentication_error", "invalid_api_key"


class NotFound(ProxyError):
    """No such endpoint or model."""

    status, type, code = 404, "not_found_error", "not_found"


class MethodNotAllowed(ProxyError):
    """The endpoint exists but not with that method."""

    status, type, code = 405, "invalid_request_error", "method_not_allowed"


class RequestTimeout(ProxyError):
    """The client did not send its whole body within `body_timeout_s`."""

    status, type, code = 408, "invalid_request_error", "request_timeout"


class PayloadTooLarge(ProxyError):
    """The body exceeds the configured size limit."""

    status, type, code = 413, "invalid_request_error", "request_too_large"


class Overloaded(ProxyError):
    """Too many requests queued; retry later."""

    status, type, code = 429, "rate_limit_error", "overloaded"


class NoBackendAvailable(ProxyError):
    """No backend is healthy right now."""

    status, type, code = 503, "server_error", "no_backend"


class UpstreamError(ProxyError):
    """The backend could not be reached or dropped the connection."""

    status, type, code = 502, "server_error", "upstream_error"


class UpstreamTimeout(ProxyError):
    """The backend did not answer within the timeout."""

    status, type, code = 504, "server_error", "upstream_timeout"


# aiohttp raises its own HTTPExceptions for routing and body-size failures; map them so
# every error leaves in the API's format (never aiohttp's text/plain page).
_HTTP_STATUS_TO_ERROR: dict[int, type[ProxyError]] = {
    400: BadRequest, 401: Unauthorized, 404: NotFound, 405: MethodNotAllowed,
    413: PayloadTooLarge, 429: Overloaded, 502: UpstreamError, 503: NoBackendAvailable,
    504: UpstreamTimeout,
}


def from_http_exception(exc: web.HTTPException) -> ProxyError:
    """Translate an aiohttp HTTPException (404, 405, 413, ...) into a ProxyError."""
    cls = _HTTP_STATUS_TO_ERROR.get(exc.status, ProxyError)
    # 413's text names the limit and the actual size; the others' is just "404: Not Found".
    message = exc.text if exc.status == 413 and exc.text else exc.reason
    err = cls(message or "error")
    if cls is ProxyError:
        err.status = exc.status
    return err


def _openai_body(err: ProxyError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.type, "code": err.code}}


# OpenAI-style error `type`s (llama-server's, and kvroute's) -> Anthropic's error types.
_ERROR_TYPES = {
    "invalid_request_error": "invalid_request_error",
    "authentication_error": "authentication_error",
    "permission_error": "permission_error",
    "not_found_error": "not_found_error",
    "rate_limit_error": "rate_limit_error",
    "exceed_context_size_error": "invalid_request_error",
    "not_supported_error": "invalid_request_error",
    "unavailable_error": "overloaded_error",
    "server_error": "api_error",
}
_STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                 403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                 429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_type(status: int, openai_type: str | None = None) -> str:
    """Anthropic's error `type` for an HTTP status and an OpenAI-style type."""
    if status in (413, 503, 529):
        return _STATUS_TYPES[status]  # more precise than the generic types
    if openai_type in _ERROR_TYPES:
        return _ERROR_TYPES[openai_type]
    return _STATUS_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def anthropic_error(status: int, message: str, openai_type: str | None = None) -> dict[str, Any]:
    """Anthropic's error envelope."""
    return {"type": "error",
            "error": {"type": anthropic_error_type(status, openai_type), "message": message}}


def _anthropic_body(err: ProxyError) -> dict[str, Any]:
    return anthropic_error(err.status, err.message, err.type)


FORMATTERS: dict[ErrorFormat, Callable[[ProxyError], dict[str, Any]]] = {
    ErrorFormat.OPENAI: _openai_body,
    ErrorFormat.ANTHROPIC: _anthropic_body,
}


def format_for_path(path: str) -> ErrorFormat:
    """Which API's error shape a request to `path` expects."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return ErrorFormat.ANTHROPIC
    return ErrorFormat.OPENAI


def error_body(err: ProxyError, fmt: ErrorFormat = ErrorFormat.OPENAI) -> dict[str, Any]:
    """The JSON body for `err` in `fmt`."""
    return FORMATTERS[fmt](err)


def error_response(err: ProxyError, fmt: ErrorFormat = ErrorFormat.OPENAI) -> web.Response:
    """A complete JSON error response, with Retry-After when the error carries one."""
    headers = {}
    if err.retry_after is not None:
        headers["Retry-After"] = str(max(1, round(err.retry_after)))
    resp = web.Response(status=err.status, text=json.dumps(error_body(err, fmt)),
                        content_type="application/json", headers=headers)
    if err.close:
        resp.force_close()
    return resp


# The response a handler has begun to write (its headers may be gone): set before its
# `prepare`, so that a failure after it ends that response instead of writing a second
# one into the same connection.
RESPONSE_STARTED = web.RequestKey("kvroute_response_started", web.StreamResponse)


async def end_started(resp: web.StreamResponse, err: ProxyError,
                      fmt: ErrorFormat) -> web.StreamResponse:
    """End `resp`, begun before `err` happened: an event stream gets an error event (so
    the client does not take what it has for a whole answer). The framing stays whole
    (aiohttp ends the chunked body), so the connection can serve the next request."""
    if resp.content_type == "text/event-stream":
        # RuntimeError: the stream was already ended; OSError: the client left
        with contextlib.suppress(RuntimeError, OSError):
            await resp.write(sse_error_event(err, fmt))
    return resp


def sse_error_event(err: ProxyError, fmt: ErrorFormat = ErrorFormat.OPENAI) -> bytes:
    """An SSE event that ends a stream already under way (headers are gone)."""
    body = json.dumps(error_body(err, fmt))
    if fmt is ErrorFormat.ANTHROPIC:
        return f"event: error\ndata: {body}\n\n".encode()
    return f"data: {body}\n\n".encode()
