"""make_runner(): the one place an aiohttp runner for kvroute's app is made, and the
answer to requests that do not parse as HTTP.

aiohttp answers a request its parser refuses (a bare LF or a control byte in a header,
Content-Length beside Transfer-Encoding, a bad request line, an oversized line, a broken
chunked body) itself: a text/plain 400 that quotes the offending line back, with an
HTTP/1.0 status line. kvroute promises errors in the API's own format, so its runner
builds connections whose `handle_error` answers these in JSON instead: the OpenAI shape,
or Anthropic's when the request line named /v1/messages, with a message in kvroute's
words that never repeats the client's bytes. The status stays the one aiohttp chose and
the connection closes after the answer (what follows the bad bytes is not a request).

aiohttp has no supported hook for this, so the module leans on these internals of
aiohttp 3.14 (each pinned by tests/server/test_malformed_http.py):

- `web.AppRunner._make_server`, the runner's server factory, overridden to hand out
  `_Server`, whose `__call__` makes each connection's protocol from `Server._kwargs` and
  `Server._loop`, as aiohttp's own `Server.__call__` does.
- `web_protocol.ERROR`, the placeholder message aiohttp builds the request of a parse
  error from (method UNKNOWN, path "/", HTTP/1.0): swapped in `request_factory` for an
  HTTP/1.1 copy, so the answer's status line is HTTP/1.1; the request made from it is
  marked (`_UNPARSED`), as nothing else tells it from a real request for "/".
- `RequestHandler.handle_error(request, status, exc, message)`, which aiohttp calls with
  that request and the parser's exception, and `RequestHandler.data_received`, where the
  request line is read before aiohttp parses it (its request keeps only "/"); its queue
  of parsed messages (`_messages`) tells when that request line is parsed and its
  target no longer needed.

With an aiohttp that lacks these, `make_runner` logs one warning and serves with
aiohttp's own runner: parse errors are then answered in aiohttp's plain text.

Hostile input costs little: only the first `_KEEP` bytes of a request target are kept
(the error format needs its first path segments), found with bytes methods and a
compiled pattern, and released once its request is parsed whole.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

import aiohttp
from aiohttp import web, web_protocol
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http import HttpVersion11, RawRequestMessage
from aiohttp.http_exceptions import (
    BadHttpMethod,
    BadStatusLine,
    ContentLengthError,
    InvalidHeader,
    InvalidURLError,
    LineTooLong,
    TransferEncodingError,
)
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler

from proxy.errors import BadRequest, error_response, format_for_path
from proxy.observability.logging import get_logger

# the placeholder message aiohttp makes a parse error's request from (None: not this
# aiohttp), and that message as answered: HTTP/1.1
_ERROR: RawRequestMessage | None = getattr(web_protocol, "ERROR", None)
_UNPARSED_MESSAGE = (_ERROR._replace(version=HttpVersion11)
                     if isinstance(_ERROR, RawRequestMessage) else None)
# set on the request aiohttp makes for a parse error (no handler of the app sees it)
_UNPARSED = web.RequestKey("kvroute_unparsed", bool)

# request lines are searched for at most this many times per received chunk: a body
# whose lines mention " HTTP/" costs no more than that
_LINE_TRIES = 4
# bytes of a request target kept: the error format is chosen by its first path segments
_KEEP = 256
# METHOD SP target at a line's start: a first word of at most 32 bytes (longer than any
# method clients send) without a colon (a header's name) or a quote (a line of JSON),
# then an origin- or absolute-form target, of which the first _KEEP bytes are taken
_REQUEST_LINE = re.compile(rb'[^ :"\n]{1,32} ((?:/|https?://)[^ \r\n]{0,%d})' % _KEEP)
# the bytes a URL path may hold (RFC 3986 pchar and "/"); the path ends at the first other
_PATH = re.compile(rb"[A-Za-z0-9\-._~!$&'()*+,;=:@/%]*")
# the end of a message's head
_HEAD_END = re.compile(rb"\r?\n\r?\n")


def missing_internals() -> list[str]:
    """The aiohttp internals `make_runner`'s runner relies on that this aiohttp lacks."""
    missing = []
    if not isinstance(getattr(web_protocol, "ERROR", None), RawRequestMessage):
        missing.append("web_protocol.ERROR")
    if not callable(vars(web.AppRunner).get("_make_server")):
        missing.append("AppRunner._make_server")
    if not callable(getattr(RequestHandler, "handle_error", None)):
        missing.append("RequestHandler.handle_error")
    return missing


def _fall_back(missing: list[str]) -> None:
    get_logger().warning("http.malformed_as_text", aiohttp=aiohttp.__version__,
                         missing=", ".join(missing),
                         effect="malformed HTTP requests get aiohttp's plain-text errors, "
                                "not JSON in the API's format")


def make_runner(app: web.Application, *, handler_cancellation: bool = True,
                access_log: logging.Logger | None = None, **kwargs: Any) -> web.AppRunner:
    """The runner kvroute serves `app` with (proxy/cli.py, tests): requests aiohttp
    cannot parse are answered in the API's error format.

    handler_cancellation: a client that hangs up cancels its handler at once, which
    cancels the upstream request and frees the backend slot (not at the next write).
    access_log None: aiohttp's access log line would double the cost of the proxy's own.
    """
    missing = missing_internals()
    if missing:
        _fall_back(missing)
        return web.AppRunner(app, handler_cancellation=handler_cancellation,
                             access_log=access_log, **kwargs)
    return _AppRunner(app, handler_cancellation=handler_cancellation,
                      access_log=access_log, **kwargs)


class _AppRunner(web.AppRunner):
    async def _make_server(self) -> web.Server:
        made = await super()._make_server()  # runs the app's startup, as aiohttp does
        kwargs = getattr(made, "_kwargs", None)
        if not isinstance(kwargs, dict) or not hasattr(made, "_loop"):
            _fall_back(["Server._kwargs" if kwargs is None else "Server._loop"])
            return made
        return _Server(made.request_handler, request_factory=made.request_factory,
                       handler_cancellation=made.handler_cancellation,
                       loop=asyncio.get_running_loop(), **kwargs)


class _Server(web.Server):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        make_request = self.request_factory

        def request_factory(message: RawRequestMessage, payload: StreamReader,
                            protocol: RequestHandler, writer: AbstractStreamWriter,
                            task: asyncio.Task[None]) -> web.BaseRequest:
            if message is not _ERROR or _UNPARSED_MESSAGE is None:
                return make_request(message, payload, protocol, writer, task)
            request = make_request(_UNPARSED_MESSAGE, payload, protocol, writer, task)
            request[_UNPARSED] = True
            return request

        self.request_factory = request_factory

    def __call__(self) -> RequestHandler:
        return _Connection(self, loop=self._loop, **self._kwargs)


class _Connection(RequestHandler):
    """aiohttp's connection protocol, answering parse errors in the API's format."""

    __slots__ = ("_body", "_first_chunk", "_target")

    def __init__(self, manager: web.Server, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        # the start of the target of the last request line seen, until it is parsed
        self._target: bytes | None = None
        # the body of the target's request, parsed but not yet received whole
        self._body: StreamReader | None = None
        self._first_chunk = True

    def data_received(self, data: bytes) -> None:
        found = _last_request_line(data, at_message_start=self._first_chunk)
        self._first_chunk = False
        if found is not None:
            self._target, self._body = found[0], None
        queue = getattr(self, "_messages", None)
        queued = len(queue) if queue is not None else 0
        super().data_received(data)
        if self._target is None or queue is None:
            return
        # a request line whose head is not whole in this chunk is not parsed yet
        head_whole = found is None or _HEAD_END.search(data, found[1]) is not None
        if head_whole and len(queue) > queued:
            message, payload = queue[-1]
            if isinstance(message, RawRequestMessage):  # not a parse error
                self._body = payload
        if self._body is not None and self._body.is_eof():
            self._target = self._body = None  # parsed whole: nothing left to answer for

    def handle_error(self, request: web.BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if not request.get(_UNPARSED):  # not a parse error (a handler's): aiohttp answers
            return super().handle_error(request, status, exc, message)
        code, text = describe(exc, line_limit=max(self.max_line_size, self.max_field_size),
                              max_headers=self.max_headers)
        path = path_of(self._target) if self._target is not None else ""
        self._target = self._body = None
        # non-HTTP traffic (a scanner, TLS on the plain port) is noise, as aiohttp deems it
        log = get_logger()
        note = log.debug if isinstance(exc, BadHttpMethod) else log.info
        note("http.malformed", status=status, problem=code, peer=request.remote)
        err = BadRequest(f"malformed HTTP request: {text}", code=code, close=True)
        err.status = status
        return error_response(err, format_for_path(path))


def describe(exc: BaseException | None, *, line_limit: int,
             max_headers: int) -> tuple[str, str]:
    """(code, what is wrong and the fix) for aiohttp's parse error `exc`. Only its class
    and the parser's own reason (the text before the quoted bytes) are read."""
    reason = str(getattr(exc, "message", "")).split("\n", 1)[0].lower()
    if isinstance(exc, LineTooLong):
        return ("line_too_long",
                f"the request line or a header is longer than {line_limit} bytes - fix: "
                "send large data in the JSON body, not in the URL or a header")
    if isinstance(exc, BadHttpMethod):
        return ("invalid_method",
                "the request does not start with an HTTP method (TLS or another protocol "
                "sent to a plain-HTTP port?) - fix: send an HTTP/1.1 request such as "
                "`POST /v1/chat/completions HTTP/1.1` to an http:// URL")
    if "content-length" in reason and "transfer-encoding" in reason:
        return ("conflicting_length",
                "both Content-Length and Transfer-Encoding are set - fix: send only one "
                "of them (Content-Length for a body sent whole)")
    if "chunk" in reason or isinstance(exc, TransferEncodingError):
        return ("invalid_chunked_body",
                "the chunked body is not valid chunked encoding (each chunk is its size "
                "in hex, CRLF, the data, CRLF; a 0-size chunk ends it) - fix: send the "
                "body with Content-Length instead")
    if "transfer-encoding" in reason:
        return ("invalid_transfer_encoding",
                "Transfer-Encoding is not valid (chunked must be its last coding) - fix: "
                "send `Transfer-Encoding: chunked` or Content-Length")
    if "content-length" in reason or isinstance(exc, ContentLengthError):
        return ("invalid_content_length",
                "Content-Length is not a single decimal number - fix: send one "
                "Content-Length with the body's size in bytes")
    if "too many headers" in reason:
        return ("too_many_headers",
                f"the request has more than {max_headers} headers - fix: send fewer")
    if "header" in reason or isinstance(exc, InvalidHeader):
        return ("invalid_header",
                "a header line is not valid (a bare LF, a control byte, or a byte outside "
                "ASCII in a header name) - fix: end every line with CRLF, and send header "
                "names as ASCII tokens and values without control bytes")
    if "url" in reason or isinstance(exc, InvalidURLError):
        return ("invalid_target",
                "the path in the request line is not a valid URL path - fix: "
                "percent-encode (%XX) spaces, control bytes and bytes outside ASCII")
    if isinstance(exc, BadStatusLine):
        return ("invalid_request_line",
                "the request line is not `METHOD /path HTTP/1.1` - fix: send one method, "
                "one path and HTTP/1.1 (or HTTP/1.0), separated by single spaces")
    return ("malformed_http",
            "the request is not valid HTTP/1.1 - fix: send it with an HTTP client library")


def last_request_target(chunk: bytes, *, at_message_start: bool) -> bytes | None:
    """The start (at most `_KEEP` bytes) of the target of the last request line in
    `chunk`, if one is seen; the chunk's first line counts as one, " HTTP/" or not, when
    a message starts with it."""
    found = _last_request_line(chunk, at_message_start=at_message_start)
    return found[0] if found is not None else None


def _last_request_line(chunk: bytes, *, at_message_start: bool) -> tuple[bytes, int] | None:
    """(`last_request_target`, the offset of its line in `chunk`)."""
    end = len(chunk)
    for _ in range(_LINE_TRIES):
        at = chunk.rfind(b" HTTP/", 0, end)
        if at < 0:
            break
        start = chunk.rfind(b"\n", 0, at) + 1
        line = _REQUEST_LINE.match(chunk, start, at)
        if line is not None:
            return line[1], start
        if start == 0:
            break
        end = start - 1
    if at_message_start:
        line = _REQUEST_LINE.match(chunk)
        if line is not None:
            return line[1], 0
    return None


def path_of(target: bytes) -> str:
    """The path of a request target, up to its first byte a path may not hold (a query,
    or the byte the parser refused), at most `_KEEP` bytes: the API's error format is
    chosen by it."""
    start = 0
    if not target.startswith(b"/"):  # absolute form: http://host/path
        start = target.find(b"/", target.find(b"//") + 2)
        if start < 0:
            return "/"
    path = _PATH.match(target, start, start + _KEEP)
    return path[0].decode("ascii") if path is not None else ""
