"""Structured logs: ``stepstone worker --log-format json`` writes one JSON object per line, with the
instance, position, step and attempt of the segment that logged it (handlers' own log lines included)."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

from stepstone.runtime.observe import log_fields

__all__ = ["JsonFormatter"]


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        doc.update(log_fields.get() or {})
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False, default=str)
