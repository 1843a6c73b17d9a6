"""Structured logging: an event name plus key=value fields, as text or JSON lines.

    log_event(logger, logging.INFO, "connection closed", client="1.2.3.4:5", bytes_in=10)

Text:  ``2026-11-22T10:00:00Z INFO gatehouse.proxy connection closed client=1.2.3.4:5 bytes_in=10``
JSON:  ``{"ts": "...", "level": "INFO", "logger": "...", "event": "connection closed", ...}``

Payload bytes are never passed here (SASL tokens, records): only names and counts.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import Any, Final

FIELDS_ATTR = "gatehouse_fields"


def log_event(logger: logging.Logger, level: int, event: str, **fields: Any) -> None:
    if logger.isEnabledFor(level):
        logger.log(level, event, extra={FIELDS_ATTR: fields})


def _timestamp(record: logging.LogRecord) -> str:
    t = time.gmtime(record.created)
    return time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}Z"


# Quoted (as JSON strings) in the text format: what would end or blur a field, and
# control characters (a newline would forge a line; ESC drives the terminal of whoever
# tails the log), all in values clients choose (client ids, software names, topics).
_QUOTED: Final = re.compile(r'[\s"=\x00-\x1f\x7f-\x9f]')


def _text_value(value: Any) -> str:
    text = str(value)
    if text == "" or _QUOTED.search(text):
        return json.dumps(text)
    return text


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, FIELDS_ATTR, None) or {}
        parts = [_timestamp(record), record.levelname, record.name, record.getMessage()]
        parts += [f"{k}={_text_value(v)}" for k, v in fields.items() if v is not None]
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname,
            "logger": record.name,
            "event": record.getMessage(),
        }
        for key, value in (getattr(record, FIELDS_ATTR, None) or {}).items():
            if value is not None:
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class _Tagged(logging.Filter):
    """Adds fixed fields to every line (``worker=N`` for a worker of ``workers: N``)."""

    def __init__(self, fields: dict[str, Any]) -> None:
        super().__init__()
        self.fields = fields

    def filter(self, record: logging.LogRecord) -> bool:
        setattr(record, FIELDS_ATTR, {**(getattr(record, FIELDS_ATTR, None) or {}),
                                      **self.fields})
        return True


def setup_logging(level: str = "INFO", json_lines: bool = False, stream: Any = None,
                  **fixed: Any) -> None:
    """Log to ``stream`` (stderr); ``fixed`` fields go on every line."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if json_lines else TextFormatter())
    if fixed:
        handler.addFilter(_Tagged(fixed))
    root = logging.getLogger("gatehouse")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
