"""Batch routing: decode raw records, ask the filter, and say where each record goes; plus the file/stdin loop.

`route_batch` is the pure "process a batch" step shared by `neardup filter` and the Kafka worker: every
input record comes back as exactly one `Routed` (unique, duplicate or rejected), in input order.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from filters.engine import NearDupFilter, Verdict
from filters.errors import RejectedInput
from stream.codec import Decoded, RecordFormat, decode, duplicate_record, rejected_record

UNIQUE, DUPLICATE, REJECTED = "unique", "duplicate", "rejected"


@dataclass(frozen=True, slots=True)
class RawRecord:
    value: bytes
    fallback_id: str  # used when the record has no id field (line number, topic/partition/offset)
    fallback_ts: float  # used when it has no timestamp field (arrival time, Kafka timestamp)


@dataclass(frozen=True, slots=True)
class Routed:
    kind: str  # UNIQUE, DUPLICATE or REJECTED
    raw: RawRecord
    decoded: Decoded | None = None
    verdict: Verdict | None = None
    error: RejectedInput | None = None


def route_batch(nd: NearDupFilter, batch: Sequence[RawRecord], fmt: RecordFormat) -> list[Routed]:
    routed: list[Routed | None] = [None] * len(batch)
    decoded: list[tuple[int, Decoded]] = []
    for i, raw in enumerate(batch):
        try:
            decoded.append((i, decode(raw.value, fmt, fallback_id=raw.fallback_id, fallback_ts=raw.fallback_ts)))
        except RejectedInput as exc:
            routed[i] = Routed(REJECTED, raw, error=exc)
    verdicts = nd.check_batch([d.message for _, d in decoded])
    for (i, d), v in zip(decoded, verdicts):
        routed[i] = Routed(DUPLICATE if v.duplicate else UNIQUE, batch[i], d, v)
    assert all(r is not None for r in routed)
    return routed  # type: ignore[return-value]


class Sink(Protocol):
    def write(self, record: bytes) -> None: ...

    def flush(self) -> None: ...


@dataclass
class Summary:
    """What a run did. `seen == unique + duplicate + rejected` always holds."""

    seen: int = 0
    unique: int = 0
    duplicate: int = 0
    rejected: int = 0
    blank: int = 0  # blank lines between JSONL records: not records, so not counted in `seen`
    reasons: Counter[str] = field(default_factory=Counter)
    methods: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0

    def add(self, r: Routed) -> None:
        self.seen += 1
        if r.kind == UNIQUE:
            self.unique += 1
        elif r.kind == DUPLICATE:
            self.duplicate += 1
            assert r.verdict is not None
            self.methods[r.verdict.method or "?"] += 1
        else:
            self.rejected += 1
            assert r.error is not None
            self.reasons[r.error.reason] += 1

    def text(self) -> str:
        rate = self.seen / self.seconds if self.seconds > 0 else 0.0
        checked = self.unique + self.duplicate
        ratio = self.duplicate / checked if checked else 0.0
        lines = [
            f"in {self.seen} = unique {self.unique} + duplicate {self.duplicate} + rejected {self.rejected}",
            f"duplicate ratio {ratio:.2%}  ({self.seconds:.2f} s, {rate:,.0f} messages/s)",
        ]
        if self.blank:
            lines.append(f"skipped {self.blank} blank lines (not records)")
        if self.methods:
            lines.append("matched by: " + ", ".join(f"{k} {v}" for k, v in self.methods.most_common()))
        if self.reasons:
            lines.append("rejected: " + ", ".join(f"{k} {v}" for k, v in self.reasons.most_common()))
        return "\n".join(lines)


def run_filter(
    nd: NearDupFilter,
    lines: Iterable[bytes],
    *,
    unique: Sink,
    duplicates: Sink,
    rejected: Sink,
    fmt: RecordFormat,
    batch_size: int = 512,
    clock: Callable[[], float] = time.time,
    progress: Callable[[Summary], None] | None = None,
) -> Summary:
    """Route every line to exactly one sink; returns the counts."""
    summary = Summary()
    started = time.perf_counter()
    batch: list[RawRecord] = []

    def flush_batch() -> None:
        for r in route_batch(nd, batch, fmt):
            summary.add(r)
            if r.kind == UNIQUE:
                unique.write(r.raw.value.rstrip(b"\r\n"))
            elif r.kind == DUPLICATE:
                assert r.decoded is not None and r.verdict is not None
                duplicates.write(duplicate_record(r.decoded, r.verdict, fmt))
            else:
                assert r.error is not None
                rejected.write(rejected_record(r.raw.value.rstrip(b"\r\n"), r.error, r.raw.fallback_id))
        batch.clear()
        summary.seconds = time.perf_counter() - started
        if progress is not None:
            progress(summary)

    for number, line in enumerate(lines, start=1):
        if fmt.format == "json" and not line.strip():
            summary.blank += 1
            continue
        batch.append(RawRecord(line, str(number), clock()))
        if len(batch) >= batch_size:
            flush_batch()
    if batch:
        flush_batch()
    for sink in (unique, duplicates, rejected):
        sink.flush()
    summary.seconds = time.perf_counter() - started
    return summary
