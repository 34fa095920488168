"""The records a batch is decided in (messages, verdicts), and constructors for the frozen records made once or
more per message (verdicts, entries, fingerprints...)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


def maker(cls: type[T]) -> Callable[..., T]:
    """A constructor of `cls` from all its field values, in field order (defaults are not filled in): the
    compiled core's `Frozen(cls)`, which makes the very objects `cls(*values)` makes at a quarter of the
    cost, or `cls` itself where the core was not built. For frozen, slotted dataclasses only."""
    try:
        import filters._native as _native
    except ImportError:  # pragma: no cover - exercised on machines without a compiler
        return cls
    made: Any = _native.Frozen(cls)
    return made  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class Message:
    id: str
    text: str
    ts: float


@dataclass(frozen=True, slots=True)
class Verdict:
    """The routing decision for one message."""

    id: str
    duplicate: bool
    duplicate_of: str | None = None
    similarity: float = 0.0
    method: str | None = None

    @property
    def label(self) -> str:
        return "duplicate" if self.duplicate else "unique"


# The compiled loops make a verdict per message: from all its field values, without the __init__'s cost.
new_verdict = maker(Verdict)


_INVALID = object()  # a timestamp `decode_common` leaves to the caller's rules


def decode_common(raws: Sequence[Any], loads: Callable[[bytes], Any], error: type[Exception], text_field: str,
                  id_field: str, ts_field: str, limit: int, max_ts: float, new_message: Callable[..., Any],
                  new_decoded: Callable[..., Any]) -> tuple[list[Any], list[int]]:
    """Per raw record (`.value`, `.fallback_id`, `.fallback_ts`: `stream.runner.RawRecord`) the decoded record
    (`new_decoded(new_message(id, text, ts), record)`) of a common JSON line: `loads` of it a dict with a
    non-blank string text, a non-empty string id or none, a number of seconds from 0 to `max_ts` or none
    (`error`: what `loads` raises on invalid JSON); else None, left to the caller's rules (`stream.codec.decode`:
    a byte-order mark, too long, any other rule); and the places of the Nones, in order. The reference of
    `filters._native.decode_common`."""
    out: list[Any] = []
    left: list[int] = []
    for i, raw in enumerate(raws):
        value = raw.value
        made = None
        if len(value) <= limit:  # (with a byte-order mark orjson refuses it: `decode` strips it)
            try:
                record = loads(value)
            except error:
                record = None
            if type(record) is dict:
                text = record.get(text_field)
                id = record.get(id_field)
                ts = record.get(ts_field)
                if type(text) is str and text and not text.isspace() and (id is None or (type(id) is str and id)):
                    if ts is None:
                        ts = raw.fallback_ts
                    elif (type(ts) is float or type(ts) is int) and 0 <= ts <= max_ts:  # NaN fails both
                        ts = float(ts)
                    else:
                        ts = _INVALID
                    if ts is not _INVALID:
                        made = new_decoded(new_message(raw.fallback_id if id is None else id, text, ts), record)
        if made is None:
            left.append(i)
        out.append(made)
    return out, left
