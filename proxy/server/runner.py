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
  request line is read before aiohttp parses it (its request keeps only "/").
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web
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
from aiohttp.web_protocol import ERROR, RequestHandler

from proxy.errors import BadRequest, error_response, format_for_path
from proxy.observability.logging import get_logger

# the message of a parse error's request, as answered: ERROR with HTTP/1.1
_UNPARSED_MESSAGE = ERROR._replace(version=HttpVersion11)
# set on the request aiohttp makes for a parse error (no handler of the app sees it)
_UNPARSED = web.RequestKey("kvroute_unparsed", bool)

# request lines are searched for at most this many times per received chunk: a body
# whose lines mention " HTTP/" costs no more than that
_LINE_TRIES = 4
# longer than any method clients send: a longer first word does not start a request line
_MAX_METHOD = 32
# bytes a URL path may hold (RFC 3986 pchar and "/"); the path ends at the first other
_PATH_BYTES = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
                        b"-._~!$&'()*+,;=:@/%")


def make_runner(app: web.Application, *, handler_cancellation: bool = True,
                access_log: logging.Logger | None = None, **kwargs: Any) -> web.AppRunner:
    """The runner kvroute serves `app` with (proxy/cli.py, tests): requests aiohttp
    cannot parse are answered in the API's error format.

    handler_cancellation: a client that hangs up cancels its handler at once, which
    cancels the upstream request and frees the backend slot (not at the next write).
    access_log None: aiohttp's access log line would double the cost of the proxy's own.
    """
    return _AppRunner(app, handler_cancellation=handler_cancellation,
                      access_log=access_log, **kwargs)


class _AppRunner(web.AppRunner):
    async def _make_server(self) -> web.Server:
        made = await super()._make_server()  # runs the app's startup, as aiohttp does
        return _Server(made.request_handler, request_factory=made.request_factory,
                       handler_cancellation=made.handler_cancellation,
                       loop=asyncio.get_running_loop(), **made._kwargs)


class _Server(web.Server):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        make_request = self.request_factory

        def request_factory(message: RawRequestMessage, payload: StreamReader,
                            protocol: RequestHandler, writer: AbstractStreamWriter,
                            task: asyncio.Task[None]) -> web.BaseRequest:
            if message is not ERROR:
                return make_request(message, payload, protocol, writer, task)
            request = make_request(_UNPARSED_MESSAGE, payload, protocol, writer, task)
            request[_UNPARSED] = True
            return request

        self.request_factory = request_factory

    def __call__(self) -> RequestHandler:
        return _Connection(self, loop=self._loop, **self._kwargs)


class _Connection(RequestHandler):
    """aiohttp's connection protocol, answering parse errors in the API's format."""

    __slots__ = ("_first_chunk", "_target")

    def __init__(self, manager: web.Server, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._target: bytes | None = None  # the last request target seen on the wire
        self._first_chunk = True

    def data_received(self, data: bytes) -> None:
        target = last_request_target(data, at_message_start=self._first_chunk)
        self._first_chunk = False
        if target is not None:
            self._target = target
        super().data_received(data)

    def handle_error(self, request: web.BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if not request.get(_UNPARSED):  # not a parse error (a handler's): aiohttp answers
            return super().handle_error(request, status, exc, message)
        code, text = describe(exc, line_limit=max(self.max_line_size, self.max_field_size),
                              max_headers=self.max_headers)
        path = path_of(self._target) if self._target is not None else ""
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
    """The target of the last request line in `chunk`, if one is seen; the chunk's first
    line counts as one, " HTTP/" or not, when a message starts with it."""
    end = len(chunk)
    for _ in range(_LINE_TRIES):
        at = chunk.rfind(b" HTTP/", 0, end)
        if at < 0:
            break
        start = chunk.rfind(b"\n", 0, at) + 1
        target = _target_of(chunk[start:at])
        if target is not None:
            return target
        if start == 0:
            break
        end = start - 1
    if at_message_start:
        line = chunk.split(b"\n", 1)[0]
        return _target_of(line.split(b" HTTP/", 1)[0])
    return None


def _target_of(line: bytes) -> bytes | None:
    """`line`'s target when it reads METHOD SP target; a header line (its name ends in
    a colon) or a line of JSON is none."""
    method, space, rest = line.partition(b" ")
    if not space or not 0 < len(method) <= _MAX_METHOD or b":" in method or b'"' in method:
        return None
    target = rest.split(b" ", 1)[0].rstrip(b"\r")
    return target if target.startswith((b"/", b"http://", b"https://")) else None


def path_of(target: bytes) -> str:
    """The path of a request target, up to its first byte a path may not hold (a query,
    or the byte the parser refused): the API's error format is chosen by it."""
    if not target.startswith(b"/"):  # absolute form: http://host/path
        slash = target.find(b"/", target.find(b"//") + 2)
        target = target[slash:] if slash >= 0 else b"/"
    end = next((i for i, byte in enumerate(target) if byte not in _PATH_BYTES), len(target))
    return target[:end].decode("ascii")
