"""structlog JSON logging: one line per routed request, never secrets or prompts.

`configure_logging()` is called once by the CLI (structlog's configuration is
process-wide by design); the app only asks for a logger.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any, TextIO

import structlog

# Fields that could carry a secret or a user's text: dropped from every event unless
# prompt logging is switched on explicitly (and keys are never logged at all).
_SECRET_KEYS = frozenset({"api_key", "authorization", "x-api-key", "headers", "key"})
_PROMPT_KEYS = frozenset({"prompt", "messages", "body", "content", "system", "text"})


def _redactor(log_prompts: bool) -> structlog.types.Processor:
    banned = _SECRET_KEYS if log_prompts else _SECRET_KEYS | _PROMPT_KEYS

    def redact(_logger: Any, _name: str, event: MutableMapping[str, Any]
               ) -> MutableMapping[str, Any]:
        for key in banned.intersection(event):
            del event[key]
        return event

    return redact


def configure_logging(level: str = "info", stream: TextIO | None = None,
                      log_prompts: bool = False) -> None:
    """JSON lines on `stream` (stderr by default) at `level`."""
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _redactor(log_prompts),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(stream or sys.stderr),
        cache_logger_on_first_use=True,
    )


def get_logger(name: str = "kvroute.proxy") -> Any:
    """A structlog logger bound to `name` (type Any: structlog's proxies are untyped)."""
    return structlog.get_logger(name)
