"""Logging set-up: plain text for people, one JSON object per line for log shippers."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from enum import Enum


class LogFormat(Enum):
    TEXT = "text"
    JSON = "json"


def fields(**values: object) -> dict[str, object]:
    """`extra=` for a state-change line: JSON logs carry these values as keys of their own
    (`adapter_id`, `size_bytes`, `duration_s`, ...), so shippers need not parse the message."""
    return {"fields": values}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        extra = getattr(record, "fields", None)
        if isinstance(extra, dict):
            entry.update({k: v for k, v in extra.items() if k not in entry})
        if record.exc_info:
            entry["traceback"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str, fmt: LogFormat) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt is LogFormat.JSON:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s")
        )
    handler.setLevel(level.upper())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Third-party chatter stays at WARNING unless we debug the sidecar itself.
    for noisy in ("aiobotocore", "botocore", "aiohttp.access", "watchdog"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
