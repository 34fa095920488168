"""Logging setup of the CLI: plain text lines (default) or JSON lines (`--log-format json`) on stderr."""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from typing import IO, Any

import orjson

from filters.errors import ConfigError

LOG_FORMATS = ("plain", "json")
PLAIN = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_HANDLER = "neardup"

# Attributes every LogRecord has; anything else on a record came from `extra=` and goes into the JSON.
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (UTC, ISO 8601), level, logger, msg, the `extra=` fields, exc."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        # default=str: an extra field that orjson cannot serialise must not lose the log line.
        return orjson.dumps(out, default=str).decode()


# aiokafka logs these at ERROR while a group forms or a broker starts (the coordinator is being elected, a
# connection is not ready yet, a topic just created has no leader yet) and retries them itself: at a healthy
# start they are not errors.
TRANSIENT_KAFKA = ("GroupCoordinatorNotAvailable", "CoordinatorNotAvailable", "CoordinatorLoadInProgress",
                   "NotCoordinator", "NodeNotReady", "NotLeaderForPartition")


class TransientKafkaFilter(logging.Filter):
    """Lowers aiokafka's ERROR lines about transient, retried conditions to INFO (on our handler, so it sees
    every aiokafka logger's records)."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING and record.name.startswith("aiokafka"):
            text = record.getMessage()
            if any(name in text for name in TRANSIENT_KAFKA):
                record.levelno, record.levelname = logging.INFO, "INFO"
                return record.levelno >= self.level
        return True


def setup_logging(level: str = "info", fmt: str = "plain", stream: IO[str] | None = None) -> logging.Handler:
    """Configure the root logger: level, and one handler of the given format (replacing the one an
    earlier call installed); returns that handler."""
    if fmt not in LOG_FORMATS:
        raise ConfigError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(PLAIN))
    handler.set_name(_HANDLER)
    root = logging.getLogger()
    # Replace the handler of an earlier call only: others (a test runner's capture) stay.
    for old in [h for h in root.handlers if h.get_name() == _HANDLER]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    # Libraries that lower their own loggers' levels (jieba logs at DEBUG) must not reach us below ours.
    handler.setLevel(root.level)
    handler.addFilter(TransientKafkaFilter(root.level))
    # aiokafka logs every retried connection at ERROR; ours say what matters.
    logging.getLogger("aiokafka").setLevel(max(logging.WARNING, root.level))
    return handler


def warn_if_interpreted() -> None:
    """One warning when the compiled core was not built at install time (no C++ compiler): neardup
    works the same, on the numpy/Python reference of the same algorithms, but a few times slower."""
    from filters.index.memory import native_available

    if not native_available():
        logging.getLogger("neardup").warning(
            "the compiled core filters._native was not built at install time: running the numpy/Python "
            "reference of the same algorithms (same verdicts, about 3x slower); reinstall with a C++ compiler")
