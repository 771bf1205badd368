"""How the programs write their log: ``--log-format text`` (the default) or
``json``, set up once by :func:`configure`.

``json`` writes one object per line on stderr, for a collector to parse
without regular expressions::

    {"time": "2026-12-02T11:20:12.041Z", "level": "INFO", "logger": "blockd", "message": "..."}

plus ``exception`` (the formatted traceback) when a record carries one. An
audit line (:mod:`blockd.auth.audit`, logger ``blockd.audit``) is a JSON
object already: its fields are merged into the line, not encoded a second
time as a string (its ``time`` is the line's; ``message`` says
``audit <event> <method> <outcome>``), so a collector reads
``identity``/``outcome``/``reason`` as fields either way.

Standard library only: the daemon and the workers both use it.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import sys
from typing import Any, TextIO

from blockd.auth.audit import AUDIT_LOGGER

#: what ``--log-format`` takes, in the daemon and the workers
LOG_FORMATS = ("text", "json")
#: the keys every JSON line starts with, in this order
JSON_KEYS = ("time", "level", "logger", "message")


def _utc(created: float) -> str:
    when = dt.datetime.fromtimestamp(created, dt.timezone.utc)
    return when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{when.microsecond // 1000:03d}Z"


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        line: dict[str, Any] = {"time": _utc(record.created), "level": record.levelname, "logger": record.name,
                                "message": message}
        if record.name == AUDIT_LOGGER:
            fields = _json_object(message)
            if fields is not None:
                line["message"] = " ".join(["audit", *(str(fields.get(k, "")) for k in ("event", "method",
                                                                                          "outcome"))])
                line.update((k, v) for k, v in fields.items() if k not in ("level", "logger", "message"))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=True, separators=(",", ":"), default=str)


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def configure(level: str, log_format: str, text_format: str, stream: TextIO | None = None) -> None:
    """The root logger at ``level``, writing ``log_format`` lines to ``stream``
    (stderr); ``text_format`` is the program's own ``%``-style text layout."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(text_format))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


__all__ = ["JSON_KEYS", "LOG_FORMATS", "JsonFormatter", "configure"]
