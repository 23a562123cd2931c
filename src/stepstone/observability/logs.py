"""The worker's log formats: ``--log-format json`` writes one JSON object per line, with the workflow,
instance, position, step and attempt of the step that logged it (handlers' own log lines included);
``text`` writes one line with the same fields appended in brackets."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

from stepstone.runtime.observe import log_fields

__all__ = ["JsonFormatter", "TextFormatter"]


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
        elif record.exc_text:  # a failed step's traceback, as stored (`observe._log_failure`)
            doc["exception"] = record.exc_text
        return json.dumps(doc, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """``time LEVEL logger: message``, then ``[workflow=... instance=... step=... attempt=...]`` for a line
    logged while a step runs."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = log_fields.get()
        if not fields:
            return line
        context = " ".join(f"{key}={value}" for key, value in fields.items() if value != "")
        head, newline, rest = line.partition("\n")  # after the message, before a traceback
        return f"{head} [{context}]{newline}{rest}"
