"""The daemon's log lines: text with time, level and logger, JSON lines, or, under systemd
(JOURNAL_STREAM set), text with the kernel-style `<N>` level prefix the journal reads
and no time of our own (the journal stamps each line)."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Literal

LogFormat = Literal["text", "json"]
LOG_LEVELS = ("debug", "info", "warning", "error")
_SYSLOG_LEVEL = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3}


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ts (ISO 8601, UTC), level, logger, msg, and the record's
    `fields` (a dict passed as `extra={"fields": ...}`) merged in."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **getattr(record, "fields", {}),
        }
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)

    converter: Callable[[float | None], time.struct_time] = time.gmtime


class JournalFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        level = _SYSLOG_LEVEL.get(record.levelno, 6)
        return f"<{level}>{record.name}: {super().format(record)}"


def configure(level: str = "info", fmt: LogFormat = "text") -> None:
    """Send the `reprise` loggers' lines to stderr in `fmt` at `level` and above."""
    if level not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}; got {level!r}")
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    elif os.environ.get("JOURNAL_STREAM"):
        handler.setFormatter(JournalFormatter("%(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger("reprise")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
