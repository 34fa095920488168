"""Batch routing: decode raw records, ask the filter, and say where each record goes; plus the file/stdin loop.

`route_batch` is the pure "process a batch" step shared by `neardup filter` and the Kafka worker: every
input record comes back as exactly one `Routed` (unique, duplicate or rejected), in input order.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from filters.engine import Message, NearDupFilter, Verdict
from filters.errors import RejectedInput
from filters.records import maker
from stream.codec import Decoded, RecordFormat, decoded_batch, duplicate_record, rejected_record

# Records routed together from a file (`neardup filter`, `neardup eval`): the Kafka worker's batches are
# whatever it fetched, up to `Settings.max_batch`.
FILE_BATCH = 512

UNIQUE, DUPLICATE, REJECTED = "unique", "duplicate", "rejected"


@dataclass(frozen=True, slots=True)
class RawRecord:
    value: bytes
    fallback_id: str  # used when the record has no id field (line number, topic/partition/offset)
    fallback_ts: float  # used when it has no timestamp field (arrival time, Kafka timestamp)
    # Its decoding when it was decoded before routing (`stream.outputs.arrived`: the Kafka worker decodes
    # each record once, on arrival, for its event time), else None: `decode_batch` takes it as it is.
    decoded: Decoded | RejectedInput | None = field(default=None, compare=False)  # (derived: not compared)


@dataclass(frozen=True, slots=True)
class Routed:
    kind: str  # UNIQUE, DUPLICATE or REJECTED
    raw: RawRecord
    decoded: Decoded | None = None
    verdict: Verdict | None = None
    error: RejectedInput | None = None


# One of each per record: from all field values, without the dataclass __init__'s cost.
_new_routed = maker(Routed)
_new_raw = maker(RawRecord)


def route_batch(nd: NearDupFilter, batch: Sequence[RawRecord], fmt: RecordFormat) -> list[Routed]:
    return ReadAhead(fmt).route(nd, batch)


def route_batches(nd: NearDupFilter, batches: Iterable[Sequence[RawRecord]], fmt: RecordFormat) -> Iterator[list[Routed]]:
    """`route_batch` of each batch in turn, reading two batches ahead (`ReadAhead`). The same results as
    `route_batch` one by one."""
    return (step.routed() for step in decided_batches(nd, batches, fmt))


def decided_batches(nd: NearDupFilter, batches: Iterable[Sequence[RawRecord]], fmt: RecordFormat) -> Iterator[Decided]:
    """`route_batches` as each batch's `Decided`, whose records are made only where asked for."""
    ahead = ReadAhead(fmt)
    it = iter(batches)
    batch, following = next(it, None), next(it, None)
    while batch is not None:
        then = next(it, None)
        yield ahead.decided(nd, batch, following, then)
        batch, following = following, then


class ReadAhead:
    """`route_batch` that decodes and fingerprints the following batch, when there is one already, while a
    shared index works on the current one's round trips (`NearDupFilter.decide`'s `meanwhile`), so that
    the client's CPU and Redis's overlap. Given the batch after that too (`then`), it reads two ahead: the
    following batch is prepared already, so the index reads its buckets while this one is verified and
    inserted (`decide`'s `upcoming`), and `then` is prepared meanwhile. Used by `route_batches` (files)
    and the Kafka worker (the batch it fetched meanwhile). One batch's routing at a time."""

    def __init__(self, fmt: RecordFormat) -> None:
        self.fmt = fmt
        self._ahead: list[_Ahead] = []  # the following batches' decoding and fingerprints, in order

    def route(self, nd: NearDupFilter, batch: Sequence[RawRecord], following: Sequence[RawRecord] | None = None,
              then: Sequence[RawRecord] | None = None) -> list[Routed]:
        """The routing of `batch` by `nd` (as `route_batch`); `following` (and `then`), if given, are prepared
        meanwhile and used when they are routed next (by the same filter). An error preparing one is raised
        when it is routed."""
        return self.decided(nd, batch, following, then).routed()

    def decided(self, nd: NearDupFilter, batch: Sequence[RawRecord], following: Sequence[RawRecord] | None = None,
                then: Sequence[RawRecord] | None = None) -> Decided:
        """`route` as the batch's `Decided`."""
        kept, self._ahead = self._ahead, []
        step, prepared = self._taken(kept, nd, batch).result()
        if not step.messages:
            prepared = None
        if not following:
            return Decided(step, nd.decide(step.messages, prepared) if step.messages else [])
        upcoming = None
        if then:
            ready = self._taken(kept, nd, following)  # prepared during the last batch, or now
            self._ahead.append(ready)
            upcoming = ready.upcoming()
            share = _Ahead(nd, then, self.fmt)
        else:  # the last batch but one: the following one was prepared as `then` last time (when there was one)
            share = self._taken(kept, nd, following)
        verdicts = nd.decide(step.messages, prepared, meanwhile=share.run, upcoming=upcoming) if step.messages else []
        self._ahead.append(share)
        return Decided(step, verdicts)

    def _taken(self, kept: list[_Ahead], nd: NearDupFilter, batch: Sequence[RawRecord]) -> _Ahead:
        """The preparation of `batch` kept from before (by the same filter: the worker times each batch's
        routing with a stand-in of it), or a new one by `nd` (not run yet)."""
        for ahead in kept:
            if ahead.batch is batch:
                return ahead
        return _Ahead(nd, batch, self.fmt)


class _Step:
    """One batch between decoding and routing: the rejected in place, the messages to decide."""

    def __init__(self, batch: Sequence[RawRecord], fmt: RecordFormat) -> None:
        self.batch = batch
        self.out: list[Routed | None] = [None] * len(batch)
        results, rejected = decoded_batch(batch, fmt)
        if not rejected:
            self.places: list[int] = list(range(len(batch)))
            self.decoded: list[Decoded] = results  # type: ignore[assignment]
        else:
            self.places, self.decoded = [], []
            for i, d in enumerate(results):
                if isinstance(d, RejectedInput):
                    self.out[i] = Routed(REJECTED, batch[i], error=d)
                else:
                    self.decoded.append(d)
                    self.places.append(i)
        self.messages = [d.message for d in self.decoded]


class Decided:
    """One batch decided: its records' `Routed`s (`routed`), or only those of the records not unique (`others`)."""

    def __init__(self, step: _Step, verdicts: Sequence[Verdict]) -> None:
        if len(verdicts) != len(step.places):
            raise ValueError(f"{len(verdicts)} verdicts for {len(step.places)} messages")
        self.step, self.verdicts = step, verdicts
        self.batch = step.batch

    def routed(self) -> list[Routed]:
        """Every record's `Routed`, in input order."""
        step, batch, out = self.step, self.batch, self.step.out
        for i, d, v in zip(step.places, step.decoded, self.verdicts, strict=True):
            out[i] = _new_routed(DUPLICATE if v.duplicate else UNIQUE, batch[i], d, v, None)
        assert all(r is not None for r in out)
        return out  # type: ignore[return-value]

    def others(self) -> list[tuple[int, Routed]]:
        """The place and `Routed` of each record routed duplicate or rejected, in input order: the rest are unique."""
        step, batch = self.step, self.batch
        found = [(i, _new_routed(DUPLICATE, batch[i], d, v, None))
                 for i, d, v in zip(step.places, step.decoded, self.verdicts) if v.duplicate]
        if len(step.places) < len(batch):  # rejected records: routed already
            found += [(i, r) for i, r in enumerate(step.out) if r is not None and r.kind == REJECTED]
            found.sort(key=_place)
        return found


def _place(found: tuple[int, Routed]) -> int:
    return found[0]


def _lines(raws: Sequence[RawRecord]) -> list[bytes]:
    """The records' values as output lines (without their line ends)."""
    return [r.value.rstrip(b"\r\n") for r in raws]


class _Ahead:
    """The next batch's decoding and `prepare`, as `decide`'s `meanwhile`: in two shares when the filter
    prepares in parts (one while Redis answers the lookup, one while it writes), else in one. An error
    is raised when the result is asked for: the batch in flight is not failed by its successor."""

    def __init__(self, nd: NearDupFilter, batch: Sequence[RawRecord] | None, fmt: RecordFormat) -> None:
        self.nd, self.batch, self.fmt = nd, batch, fmt
        self._step: _Step | None = None
        self._prepared: list[Any] = []
        self._texts: list[str] = []
        self._done = batch is None
        self._error: Exception | None = None

    def run(self) -> bool:
        """Does the next share; True when all is done."""
        if self._done:
            return True
        try:
            if self._step is None:
                self._step = _Step(self.batch, self.fmt)  # type: ignore[arg-type]
                self._texts = [m.text for m in self._step.messages]
                if not self.nd.prepares_in_parts or len(self._texts) < 64:
                    self._prepared = [self.nd.prepare(self._texts)] if self._texts else []
                    self._done = True
                    return True
                half = len(self._texts) // 2
                self._prepared = [self.nd.prepare(self._texts[:half])]
                self._texts = self._texts[half:]
                return False
            self._prepared.append(self.nd.prepare(self._texts))
        except Exception as exc:
            self._error = exc  # raised by `result`, in the next batch's turn
        self._done = True
        return True

    def result(self) -> tuple[_Step, Any]:
        """The decoded batch and its prepared fingerprints (the same objects each time), once all is done."""
        while not self.run():
            pass
        if self._error is not None:
            raise self._error
        assert self._step is not None
        parts = self._prepared
        if len(parts) > 1:
            self._prepared = parts = [[*parts[0], *parts[1]]]
        return self._step, parts[0] if parts else None

    def upcoming(self) -> tuple[Sequence[Message], Any] | None:
        """`decide`'s `upcoming` for this batch (done), or None if it has no messages or failed."""
        try:
            step, prepared = self.result()
        except Exception:
            return None  # raised again when the batch is routed
        return (step.messages, prepared) if step.messages else None


class Sink(Protocol):
    def write(self, record: bytes) -> None: ...

    def write_many(self, records: list[bytes]) -> None:
        """`write` of each record in turn."""

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

    def add_uniques(self, n: int) -> None:
        """`n` records routed unique (counted a batch at a time)."""
        self.seen += n
        self.unique += n

    def add(self, r: Routed) -> None:
        """A record routed duplicate or rejected."""
        self.seen += 1
        if r.kind == DUPLICATE:
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
    duplicates: Sink | None,
    rejected: Sink | None,
    fmt: RecordFormat,
    batch_size: int = FILE_BATCH,
    clock: Callable[[], float] = time.time,
    progress: Callable[[Summary], None] | None = None,
    read_ahead: bool = True,
    on_rejected: Callable[[Routed], None] | None = None,
) -> Summary:
    """Route every line to exactly one sink; returns the counts. `read_ahead` (for files): batches go
    through `route_batches`, which reads one batch ahead; off for a live stream (stdin), whose batch
    would otherwise wait for the next one to fill. An empty line (`IDLE`: a live input paused; real lines
    have their newline) routes the partial batch at once. `on_rejected` sees each rejected record. Duplicates
    or rejected records with no sink (None) are counted, and their output records never made."""
    summary = Summary()
    started = time.perf_counter()
    sinks = [sink for sink in (unique, duplicates, rejected) if sink is not None]
    json_lines = fmt.format == "json"

    def batches() -> Iterator[list[RawRecord]]:
        batch: list[RawRecord] = []
        number = 0
        for line in lines:
            if not line:  # IDLE
                if batch:
                    yield batch
                    batch = []
                continue
            number += 1
            if json_lines and line.isspace():  # what strip() leaves empty, without the copy
                summary.blank += 1
                continue
            batch.append(_new_raw(line, str(number), clock(), None))
            if len(batch) >= batch_size:
                yield batch
                batch = []
        if batch:
            yield batch

    decided = (decided_batches(nd, batches(), fmt) if read_ahead
               else (ReadAhead(fmt).decided(nd, b, None, None) for b in batches()))
    add = summary.add
    for step in decided:
        # Unique records go out a batch at a time (`write_many`), but before any other record of the batch is
        # written: two outputs may be one stream (`--duplicates -`), and its lines stay in input order. Only
        # the records routed otherwise get a `Routed`; the unique ones go out as runs of lines between them.
        batch = step.batch
        uniques: list[bytes] = []
        count = 0
        start = 0
        for at, r in step.others():
            if at > start:  # the unique records before it
                uniques += _lines(batch[start:at])
            start = at + 1
            add(r)
            sink = duplicates if r.kind == DUPLICATE else rejected
            if sink is not None and uniques:  # the uniques before it first
                count += len(uniques)
                unique.write_many(uniques)
                uniques.clear()
            if r.kind == DUPLICATE:
                if duplicates is not None:
                    assert r.decoded is not None and r.verdict is not None
                    duplicates.write(duplicate_record(r.decoded, r.verdict, fmt))
            else:
                assert r.error is not None
                if rejected is not None:
                    rejected.write(rejected_record(r.raw.value.rstrip(b"\r\n"), r.error, r.raw.fallback_id))
                if on_rejected is not None:
                    on_rejected(r)
        uniques += _lines(batch[start:])
        count += len(uniques)
        unique.write_many(uniques)
        summary.add_uniques(count)
        summary.seconds = time.perf_counter() - started
        if progress is not None:
            progress(summary)
        if read_ahead is False:  # a live stream: what was routed is seen at once
            for sink in sinks:
                sink.flush()
    for sink in sinks:
        sink.flush()
    summary.seconds = time.perf_counter() - started
    return summary
