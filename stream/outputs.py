"""The worker's record contract: a Kafka record as routed (`raw_record`), and the output record and headers it becomes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from filters.errors import RejectedInput
from filters.records import maker
from stream.codec import Decoded, RecordFormat, decoded_batch, event_time
from stream.config import Settings
from stream.kafka_tools import Headers, KafkaRecord, new_kafka_record
from stream.runner import DUPLICATE, UNIQUE, RawRecord, Routed

# Header names the worker adds (input headers are passed through unchanged, before these).
H_VERDICT = "neardup-verdict"  # unique | duplicate | rejected | unchecked
H_DUPLICATE_OF = "neardup-duplicate-of"
H_SIMILARITY = "neardup-similarity"
H_METHOD = "neardup-method"
H_ID = "neardup-id"
H_SOURCE = "neardup-source"  # topic/partition/offset of the input record
H_REASON = "neardup-reason"
H_ERROR = "neardup-error"
H_LATE = "neardup-late"  # seconds of event time the record came behind the group's (stream/align.py)
UNCHECKED = "unchecked"
REPLAY = "replay"  # the engine's method for a unique message found under its own id (decided before)
REJECTED = "rejected"
# The reason of a record that an output topic refused as larger than its max.message.bytes.
OUTPUT_TOO_LARGE = "output_too_large"
_MAX_ERROR_CHARS = 500
# The producer must pass through the largest record the codec accepts, plus headers.
MAX_OUTPUT_BYTES = RecordFormat().max_record_bytes + 1024 * 1024


@dataclass(frozen=True, slots=True)
class OutRecord:
    """One output record: where it goes, and the input's key, value and headers plus the verdict's."""

    topic: str
    key: bytes | None
    value: bytes | None
    headers: Headers


# One of each per record routed: from all field values, without the dataclass __init__'s cost.
_new_out_record = maker(OutRecord)
_new_raw_record = maker(RawRecord)


def raw_record(record: KafkaRecord) -> RawRecord:
    """The record as routed: its value, coordinates (the id fallback) and timestamp in seconds (the event time's)."""
    if record.raw is not None:
        return record.raw  # decoded on arrival (`arrived`)
    # A tombstone (value None) is routed as empty bytes: it is rejected and dead-lettered as such.
    return _new_raw_record(record.value or b"", record.coordinates, record.timestamp / 1000.0, None)


def arrived(msgs: Sequence[Any], fmt: RecordFormat) -> list[KafkaRecord]:
    """aiokafka's ConsumerRecords of one partition (as `getmany` returns them) as KafkaRecords, each decoded
    once, here (`decoded_batch`, a batch at a time): its event time (`record_time`) and its routing
    (`raw_record`) take that decoding, as `raw_record` and `decode` would have made it."""
    if not msgs:
        return []
    topic, partition = msgs[0].topic, msgs[0].partition
    values = [m.value or b"" for m in msgs]
    where = [f"{topic}/{partition}/{m.offset}" for m in msgs]  # `KafkaRecord.coordinates`
    times = [m.timestamp / 1000.0 for m in msgs]
    new_raw, new_record = _new_raw_record, new_kafka_record
    decoded, _ = decoded_batch([new_raw(v, c, t, None) for v, c, t in zip(values, where, times, strict=True)], fmt)
    return [new_record(topic, partition, m.offset, m.timestamp, m.key, m.value,
                       tuple([(k, bytes(v)) for k, v in m.headers]) if m.headers else (), new_raw(v, c, t, d))
            for m, v, c, t, d in zip(msgs, values, where, times, decoded, strict=True)]


def record_time(record: KafkaRecord, fmt: RecordFormat) -> float | None:
    """`stream.codec.event_time` of the record (None: it is rejected), from its decoding if it was decoded on arrival."""
    raw = record.raw
    if raw is not None and raw.decoded is not None:
        decoded = raw.decoded
        return decoded.message.ts if type(decoded) is Decoded else None
    return event_time(record.value or b"", fmt, record.timestamp / 1000.0)


def _float(value: float) -> bytes:
    return format(value, "g").encode()


def output_of(record: KafkaRecord, routed: Routed, settings: Settings) -> OutRecord:
    """Where `routed` goes and the headers that say why; key, value and input headers unchanged."""
    headers: list[tuple[str, bytes]] = list(record.headers)
    if routed.kind in (UNIQUE, DUPLICATE):
        assert routed.verdict is not None
        v = routed.verdict
        headers.append((H_VERDICT, routed.kind.encode()))
        if v.duplicate:
            headers.append((H_DUPLICATE_OF, (v.duplicate_of or "").encode()))
            headers.append((H_SIMILARITY, _float(v.similarity)))
        if v.method and v.method != REPLAY:  # a replay carries the headers of its first decision
            headers.append((H_METHOD, v.method.encode()))
        headers.append((H_ID, v.id.encode()))
        topic = settings.duplicate_topic if v.duplicate else settings.unique_topic
    else:
        assert routed.error is not None
        headers += [(H_VERDICT, REJECTED.encode()), (H_REASON, routed.error.reason.encode()),
                    (H_ERROR, str(routed.error)[:_MAX_ERROR_CHARS].encode())]
        topic = settings.dead_letter_topic
    headers.append((H_SOURCE, routed.raw.fallback_id.encode()))  # the record's coordinates (`raw_record`)
    if routed.kind == REJECTED and routed.error is not None and routed.error.reason == "too_large":
        # Too large for the codec is too large for the producer: dead-lettered without its value
        # (neardup-source says where to find it), so one huge record cannot stop the worker.
        return _new_out_record(topic, record.key, None, tuple(headers))
    return _new_out_record(topic, record.key, record.value, tuple(headers))


def refused_output(record: KafkaRecord, refused: OutRecord, exc: BaseException, settings: Settings) -> OutRecord:
    """The dead-letter record for `record` once `refused.topic` refused its output as too large: like the
    `too_large` rule, without the value (`neardup-source` says where it is), so it cannot be refused again."""
    size = len(refused.value or b"") + len(refused.key or b"") + sum(len(k) + len(v) for k, v in refused.headers)
    verdict = next((v for k, v in reversed(refused.headers) if k == H_VERDICT), b"")
    message_id = next((v for k, v in reversed(refused.headers) if k == H_ID), None)
    error = (f"{refused.topic!r} refused the {verdict.decode()} output of about {size} bytes as too large "
             f"(its max.message.bytes): {type(exc).__name__}")
    headers = [*record.headers, (H_VERDICT, REJECTED.encode()), (H_REASON, OUTPUT_TOO_LARGE.encode()),
               (H_ERROR, error[:_MAX_ERROR_CHARS].encode())]
    if message_id is not None:
        headers.append((H_ID, message_id))
    headers.append((H_SOURCE, record.coordinates.encode()))
    return OutRecord(settings.dead_letter_topic, record.key, None, tuple(headers))


def late_output(out: OutRecord, behind: float) -> OutRecord:
    """`out` with the `neardup-late` header: decided more than max_skew behind the group's event time."""
    return _new_out_record(out.topic, out.key, out.value, (*out.headers, (H_LATE, _float(round(behind, 3)))))



def unchecked_records(records: Sequence[KafkaRecord], settings: Settings) -> list[OutRecord]:
    """What `--on-index-error unchecked` does while the index is down: decodable records go to unique
    with `neardup-verdict: unchecked` (not indexed, not checked), the others to the dead-letter topic."""
    raws = [raw_record(rec) for rec in records]
    outs = []
    for rec, raw, got in zip(records, raws, decoded_batch(raws, settings.record_format())[0], strict=True):
        if isinstance(got, RejectedInput):  # (decoded on arrival, or just now)
            outs.append(output_of(rec, Routed(REJECTED, raw, error=got), settings))
            continue
        headers = (*rec.headers, (H_VERDICT, UNCHECKED.encode()), (H_ID, got.message.id.encode()),
                   (H_SOURCE, raw.fallback_id.encode()))
        outs.append(OutRecord(settings.unique_topic, rec.key, rec.value, headers))
    return outs
