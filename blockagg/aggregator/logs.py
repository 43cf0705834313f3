"""The one logging setup of blockagg: structured lines, one JSON object per line.

``setup()`` configures the root logger once (idempotent); ``event(logger, message,
**fields)`` logs a message with structured fields, which the JSON formatter writes as
top-level keys: ``{"ts": ..., "level": "INFO", "logger": "blockagg.job", "msg":
"batch", "batch": 12, "rows": 10000, ...}``. ``format="text"`` writes the same
fields as ``key=value`` after the message, for a terminal.

Secrets never reach a log line: values of fields whose name looks secret are masked,
and configuration objects mask their own secrets in ``repr``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from typing import Any, Final

_FIELDS_ATTR: Final = "blockagg_fields"
_RESERVED: Final = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}
_SECRET_PARTS: Final = ("password", "secret", "jaas", "token")
_configured = False


def _masked(fields: Mapping[str, Any]) -> dict[str, Any]:
    return {
        k: "***" if any(p in k.lower() for p in _SECRET_PARTS) and v else v
        for k, v in fields.items()
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_jsonable(v) for v in value]
    return repr(value)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, _FIELDS_ATTR, None)
        if fields:
            out.update(_jsonable(_masked(fields)))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, separators=(",", ":"), ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        text = f"{stamp} {record.levelname:<7} {record.name}: {record.getMessage()}"
        fields = getattr(record, _FIELDS_ATTR, None)
        if fields:
            text += " " + " ".join(
                f"{k}={json.dumps(_jsonable(v), separators=(',', ':'))}"
                for k, v in _masked(fields).items()
            )
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def setup(level: str | int | None = None, fmt: str | None = None) -> None:
    """Configure the root logger: ``BLOCKAGG_LOG_LEVEL`` (INFO) and
    ``BLOCKAGG_LOG_FORMAT`` (``json`` or ``text``) unless given. Idempotent."""
    global _configured
    chosen_level = level or os.environ.get("BLOCKAGG_LOG_LEVEL", "INFO")
    chosen_fmt = fmt or os.environ.get("BLOCKAGG_LOG_FORMAT", "json")
    root = logging.getLogger()
    if _configured:
        root.setLevel(chosen_level)
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(TextFormatter() if chosen_fmt == "text" else JsonFormatter())
    root.handlers = [h for h in root.handlers if not getattr(h, "_blockagg", False)]
    handler._blockagg = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(chosen_level)
    for noisy in ("py4j", "kafka", "clickhouse_driver"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    _configured = True


def get(name: str) -> logging.Logger:
    """A blockagg logger (``blockagg.<name>``)."""
    return logging.getLogger(f"blockagg.{name}")


def event(logger: logging.Logger, message: str, level: int = logging.INFO,
          **fields: Any) -> None:
    """Log ``message`` with structured ``fields``."""
    if logger.isEnabledFor(level):
        logger.log(level, message, extra={_FIELDS_ATTR: fields})
