"""Record codec: raw bytes (a JSONL line or a Kafka value) → `Message`, and verdicts back to output records.

Decoding rules (the README states them): a record must be UTF-8; in JSON format it must be a JSON
object with a string text field whose content is not empty or whitespace only. The id field may be a
string or a number (absent: the caller's fallback, e.g. line number or topic/partition/offset). The
timestamp field is seconds since the epoch (0 to 1e11) as a number or numeric string (absent: the
caller's fallback, e.g. arrival time or the Kafka record timestamp). Anything else raises a `RejectedInput`
subclass whose `reason` goes to the dead-letter output.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from filters.engine import Message, Verdict
from filters.errors import DecodeError, MissingText, RejectedInput
from filters.records import decode_common, maker

# Event times above it are units mistaken for seconds (ms, µs, ns): refused, not let loose on the window.
MAX_EVENT_TIME = 1e11

FORMATS = ("json", "text")


@dataclass(frozen=True, slots=True)
class RecordFormat:
    format: str = "json"
    text_field: str = "text"
    id_field: str = "id"
    ts_field: str = "ts"
    max_record_bytes: int = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Decoded:
    message: Message
    record: dict[str, Any] | None  # the parsed JSON object; None in text format


_BOM = b"\xef\xbb\xbf"
# One of each per record: from all field values, without the dataclass __init__'s cost.
_new_message = maker(Message)
_new_decoded = maker(Decoded)


def decode(raw: bytes, fmt: RecordFormat, *, fallback_id: str, fallback_ts: float) -> Decoded:
    if len(raw) > fmt.max_record_bytes:
        raise DecodeError(f"record of {len(raw)} bytes exceeds {fmt.max_record_bytes}", "too_large")
    if raw.startswith(_BOM):
        raw = raw[len(_BOM):]  # a byte-order mark (first line of a file saved by some editors) is not content
    if fmt.format == "text":
        text = _utf8(raw).rstrip("\r\n")
        _require_content(text)
        return Decoded(Message(fallback_id, text, fallback_ts), None)
    try:  # orjson validates UTF-8 itself: the input is decoded once, unless it is refused
        record = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        _utf8(raw)  # undecodable bytes are the reason to give, before any JSON error
        raise DecodeError(f"not JSON: {exc}", "invalid_json") from exc
    if not isinstance(record, dict):
        raise DecodeError(f"JSON {type(record).__name__} is not an object", "not_an_object")
    if fmt.text_field not in record:
        raise MissingText(f"no {fmt.text_field!r} field", "no_text")
    value = record[fmt.text_field]
    if not isinstance(value, str):
        raise MissingText(f"{fmt.text_field!r} is {type(value).__name__}, not a string", "text_not_string")
    _require_content(value)
    return _new_decoded(
        _new_message(_id(record, fmt.id_field, fallback_id), value, _ts(record, fmt.ts_field, fallback_ts)),
        record,
    )


class Raw(Protocol):
    """A raw record and its fallbacks (`stream.runner.RawRecord`)."""

    @property
    def value(self) -> bytes: ...

    @property
    def fallback_id(self) -> str: ...

    @property
    def fallback_ts(self) -> float: ...

    @property
    def decoded(self) -> Decoded | RejectedInput | None:
        """Its decoding, when it was decoded before (the Kafka worker's, on arrival), else None."""
        ...


def decode_batch(raws: Sequence[Raw], fmt: RecordFormat) -> list[Decoded | RejectedInput]:
    """`decode` of each raw record, in order: its `Decoded`, or the `RejectedInput` it raises. A record
    decoded before (its `decoded`: the Kafka worker decodes each record once, on arrival, for its event time)
    is taken as it is. The common record (a JSON object with a non-blank string text, a non-empty string id or
    none, a number of seconds in range or none) is decoded by `filters.records.decode_common` (compiled:
    `filters._native`'s) without `decode`'s calls per field; any other goes to `decode` itself, so each rule
    stays written once (tests/test_properties.py holds the two equal)."""
    return decoded_batch(raws, fmt)[0]


def decoded_batch(raws: Sequence[Raw], fmt: RecordFormat,
                  common: Callable[..., tuple[list[Any], list[int]]] | None = None,
                  ) -> tuple[list[Decoded | RejectedInput], int]:
    """`decode_batch`, and how many of the records it rejected. `common`: the common records' decoder
    (`filters.records.decode_common` or its compiled twin, the default)."""
    out: list[Any]
    left: Sequence[int]
    if any([r.decoded is not None for r in raws]):  # decoded on arrival (the others, none as the worker routes, here)
        out = [r.decoded for r in raws]
        rest = [i for i, d in enumerate(out) if d is None]
        if rest:
            got, _ = decoded_batch([raws[i] for i in rest], fmt, common)
            for i, d in zip(rest, got, strict=True):
                out[i] = d
        return out, sum([type(d) is not Decoded for d in out])
    if fmt.format != "json":
        out, left = [None] * len(raws), range(len(raws))
    else:
        out, left = (common or _common)(
            raws if isinstance(raws, list) else list(raws), orjson.loads, orjson.JSONDecodeError, fmt.text_field,
            fmt.id_field, fmt.ts_field, fmt.max_record_bytes, MAX_EVENT_TIME, _new_message, _new_decoded)
    rejected = 0
    for i in left:
        raw = raws[i]
        try:
            out[i] = decode(raw.value, fmt, fallback_id=raw.fallback_id, fallback_ts=raw.fallback_ts)
        except RejectedInput as exc:  # kept with the record (buffered by the worker): no frame kept alive with it
            out[i] = exc.with_traceback(None)
            rejected += 1
    return out, rejected


try:  # the compiled twin of `filters.records.decode_common`; absent when the core could not be built at install time
    from filters._native import decode_common as _common
except ImportError:  # pragma: no cover - exercised on machines without a compiler
    _common = decode_common


def event_time(raw: bytes, fmt: RecordFormat, fallback_ts: float) -> float | None:
    """The event time `decode` gives the record, without keeping the rest of the decoding: the timestamp
    field in JSON format, else the fallback (the Kafka record timestamp). None for a record `decode` rejects:
    it is dead-lettered, so it has no event time of its own, and the aligner must not let it move the
    worker's clock (a record without text or time, stamped now by Kafka, would make every later one late)."""
    try:
        return decode(raw, fmt, fallback_id="", fallback_ts=fallback_ts).message.ts
    except RejectedInput:
        return None


def _utf8(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DecodeError(f"not UTF-8: {exc.reason} at byte {exc.start}", "invalid_utf8") from exc


def _require_content(text: str) -> None:
    if not text or text.isspace():  # no copy of the text, as strip() would make
        raise MissingText("text is empty or whitespace only", "empty_text")


def _id(record: dict[str, Any], field: str, fallback: str) -> str:
    value = record.get(field)
    if value is None:
        return fallback
    if isinstance(value, str) and value:
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    raise RejectedInput(f"{field!r} must be a non-empty string or a number", "bad_id")


def _ts(record: dict[str, Any], field: str, fallback: float) -> float:
    value = record.get(field)
    if value is None:
        return fallback
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise RejectedInput(f"{field!r} is not a number: {record[field][:40]!r}", "bad_timestamp") from None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise RejectedInput(f"{field!r} must be seconds since the epoch (>= 0)", "bad_timestamp")
    if value > MAX_EVENT_TIME:
        raise RejectedInput(f"{field!r} must be seconds since the epoch, at most {MAX_EVENT_TIME:.0e} (year 5138); "
                            f"got {value:.4g}: milliseconds or nanoseconds?", "bad_timestamp")
    return float(value)


def duplicate_record(decoded: Decoded, verdict: Verdict, fmt: RecordFormat) -> bytes:
    """The original record plus `duplicate_of`, `similarity` and `method`, as one JSON line."""
    record: dict[str, Any] = dict(decoded.record) if decoded.record is not None else {
        fmt.id_field: decoded.message.id, fmt.text_field: decoded.message.text,
    }
    record["duplicate_of"] = verdict.duplicate_of
    record["similarity"] = verdict.similarity
    record["method"] = verdict.method
    return orjson.dumps(record)


def rejected_record(raw: bytes, error: RejectedInput, position: str) -> bytes:
    """The original line (undecodable bytes replaced) plus why it was rejected."""
    return orjson.dumps({
        "error": str(error),
        "reason": error.reason,
        "position": position,
        "line": raw.decode("utf-8", "replace"),
    })
