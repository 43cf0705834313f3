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
import re
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


def _exception_text(formatter: logging.Formatter, record: logging.LogRecord) -> str:
    """The whole traceback at DEBUG; otherwise only its last line (type and message):
    an operator's log holds one line per event, not a trace per retry."""
    if logging.getLogger().getEffectiveLevel() <= logging.DEBUG:
        return formatter.formatException(record.exc_info)  # type: ignore[arg-type]
    _, exc, _ = record.exc_info  # type: ignore[misc]
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:500]


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
            out["exc"] = _exception_text(self, record)
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
            exc = _exception_text(self, record)
            text += ("\n" if "\n" in exc else " exc=") + exc
        return text


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to the *current* ``sys.stderr`` (a CLI run under a test runner swaps it
    per invocation)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


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
    handler = _Stderr()
    handler.setFormatter(TextFormatter() if chosen_fmt == "text" else JsonFormatter())
    root.handlers = [h for h in root.handlers if not getattr(h, "_blockagg", False)]
    handler._blockagg = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(chosen_level)
    for noisy in ("py4j", "kafka"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # clickhouse-driver warns with a traceback at each failed connect; blockagg's own
    # line says which replica and what to change
    logging.getLogger("clickhouse_driver").setLevel(logging.ERROR)
    # py4j logs the whole Python and Java trace of every exception a foreachBatch
    # callback raises; the driver logs the batch's failure as one line
    logging.getLogger("py4j.clientserver").addFilter(_only_at_debug)
    _configured = True


def _only_at_debug(record: logging.LogRecord) -> bool:
    return logging.getLogger().getEffectiveLevel() <= logging.DEBUG


def setup_worker() -> None:
    """In a Spark Python worker (a task): the same handler and format as the driver,
    from ``BLOCKAGG_LOG_FORMAT`` / ``BLOCKAGG_LOG_LEVEL``, so a task's WARN lines carry
    their time and logger instead of Python's bare last-resort message. A process set
    up already keeps its setup and level (the driver runs empty ranges itself)."""
    if not _configured:
        setup()


def worker_env() -> dict[str, str]:
    """``BLOCKAGG_LOG_LEVEL`` and ``BLOCKAGG_LOG_FORMAT`` as this process logs now, for
    the Spark Python workers (``spark.executorEnv.*``): a ``--log-format`` or
    ``--log-level`` given to the job applies to its tasks' lines too, on every
    executor, so the driver's and the executors' lines share one format."""
    root = logging.getLogger()
    ours = [h for h in root.handlers if getattr(h, "_blockagg", False)]
    text = bool(ours) and isinstance(ours[0].formatter, TextFormatter)
    return {"BLOCKAGG_LOG_LEVEL": logging.getLevelName(root.getEffectiveLevel()),
            "BLOCKAGG_LOG_FORMAT": "text" if text else "json"}


class SlowWait:
    """WARN lines for a wait made of retries: none before ``after`` seconds (a blip is
    not news), then at most one per ``every`` seconds, each saying what is awaited, for
    how long so far and the last error, so a task that waits is never silent."""

    def __init__(self, logger: logging.Logger, what: str, after: float = 2.0,
                 every: float = 10.0, clock: Any = time.monotonic) -> None:
        self._logger = logger
        self.what = what
        self._after = after
        self._every = every
        self._clock = clock
        self._started = clock()
        self._last: float | None = None

    def note(self, **fields: Any) -> bool:
        """One more failed try; returns whether a line was logged."""
        now = self._clock()
        if now - self._started < self._after:
            return False
        if self._last is not None and now - self._last < self._every:
            return False
        self._last = now
        event(self._logger, f"still waiting for {self.what}", level=logging.WARNING,
              seconds=round(now - self._started, 1), **fields)
        return True


class RateLimit(logging.Filter):
    """Let one line of each kind through per ``interval`` seconds.

    A client that cannot reach its broker repeats the same "Connect ... failed" line
    for every broker and every retry; one line of each kind per interval says the
    same, and the count of dropped ones rides on the next line that passes."""

    def __init__(self, interval: float = 30.0,
                 clock: Any = time.monotonic) -> None:
        super().__init__()
        self.interval = interval
        self._clock = clock
        self._last: dict[str, float] = {}
        self._dropped: dict[str, int] = {}

    @staticmethod
    def kind(record: logging.LogRecord) -> str:
        """The line without its numbers and addresses: one kind per repeated message."""
        return re.sub(r"[0-9]+", "#", f"{record.levelno}:{record.getMessage()}")[:200]

    def filter(self, record: logging.LogRecord) -> bool:
        kind = self.kind(record)
        now = self._clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval:
            self._dropped[kind] = self._dropped.get(kind, 0) + 1
            return False
        self._last[kind] = now
        dropped = self._dropped.pop(kind, 0)
        if dropped:
            record.msg = f"{record.getMessage()} (and {dropped} more like it)"
            record.args = None
        return True


class RetriedAsInfo(logging.Filter):
    """librdkafka logs each failed connection attempt (facility ``FAIL``) as an error,
    although the client retries it and the caller gets the error that matters (a
    timeout naming the bootstrap servers): those lines count as INFO here."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self._logger = logger

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if args and args[0] == "FAIL" and record.levelno > logging.INFO:
            record.levelno, record.levelname = logging.INFO, "INFO"
            return self._logger.getEffectiveLevel() <= logging.INFO
        return True


class ExpectedAsDebug(logging.Filter):
    """librdkafka lines about what the job does on purpose or waits out, at DEBUG: an
    older attempt's producer told it was fenced (a newer attempt of the partition
    started: invariant 6 at work, logged FATAL by librdkafka), and a coordinator that
    moved or is still loading (the client retries; a failure that matters reaches the
    caller as an error)."""

    EXPECTED: Final = ("fenced by a newer instance", "Not coordinator",
                       "Coordinator load in progress", "COORDINATOR_LOAD_IN_PROGRESS",
                       "NOT_COORDINATOR")

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self._logger = logger

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.DEBUG and any(
                text in record.getMessage() for text in self.EXPECTED):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return self._logger.getEffectiveLevel() <= logging.DEBUG
        return True


def librdkafka_logger() -> logging.Logger:
    """The logger librdkafka's own lines go to (``blockagg.librdkafka``): WARNING and
    above unless the root level is DEBUG, each kind of line at most once per 30 s;
    connection failures the client retries count as INFO (:class:`RetriedAsInfo`), an
    expected fencing and moving coordinators as DEBUG (:class:`ExpectedAsDebug`)."""
    logger = logging.getLogger("blockagg.librdkafka")
    if not any(isinstance(f, RateLimit) for f in logger.filters):
        logger.addFilter(ExpectedAsDebug(logger))
        logger.addFilter(RetriedAsInfo(logger))
        logger.addFilter(RateLimit())
    debug = logging.getLogger().getEffectiveLevel() <= logging.DEBUG
    logger.setLevel(logging.DEBUG if debug else logging.WARNING)
    return logger


def kafka_client_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` for a confluent-kafka client, its librdkafka log routed through
    :func:`librdkafka_logger` (never straight to stderr/stdout as ``%3|...`` lines)."""
    return {**config, "logger": librdkafka_logger()}


def get(name: str) -> logging.Logger:
    """A blockagg logger (``blockagg.<name>``)."""
    return logging.getLogger(f"blockagg.{name}")


def event(logger: logging.Logger, message: str, level: int = logging.INFO,
          **fields: Any) -> None:
    """Log ``message`` with structured ``fields``."""
    if logger.isEnabledFor(level):
        logger.log(level, message, extra={_FIELDS_ATTR: fields})
