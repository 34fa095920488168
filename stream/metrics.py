"""Prometheus metrics of a worker: routed counts per topic, stage latencies, batch sizes, index and Kafka errors, lag, index size.

Every worker has its own `CollectorRegistry` (several workers in one test process must not share
counters). Stage latencies are per batch: `decode` (decoding records and building the output headers:
the route step minus the two below), `fingerprint`, `index` (candidate lookup, verification and insert),
`produce` (from routed until every output record was acknowledged). Redis round trips of the index
and of the campaign view are timed on their own (`neardup_redis_seconds`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from filters.engine import Message, NearDupFilter, Prepared, Verdict
from filters.index import Batch, Candidate, CandidateIndex, Entry, IndexWrapper, Memo, Query, Verifier

STAGES = ("decode", "fingerprint", "index", "produce")
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BATCH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


class WorkerMetrics:
    """The metric families of one worker, in a registry of their own."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.messages_in = Counter("neardup_messages_in", "input records routed, by input topic", ["topic"], registry=r)
        self.unique = Counter("neardup_messages_unique", "records routed to the unique topic, by input topic",
                              ["topic"], registry=r)
        self.duplicate = Counter("neardup_messages_duplicate", "records routed to the duplicate topic, by input topic",
                                 ["topic"], registry=r)
        self.dead_lettered = Counter("neardup_messages_dead_lettered",
                                     "records routed to the dead-letter topic, by input topic and reason",
                                     ["topic", "reason"], registry=r)
        self.unchecked = Counter("neardup_messages_unchecked",
                                 "records passed to unique unchecked while the index was down (on_index_error=unchecked)",
                                 ["topic"], registry=r)
        self.duplicate_ratio = Gauge("neardup_duplicate_ratio",
                                     "duplicate / (unique + duplicate) since the worker started", registry=r)
        self.batches = Counter("neardup_batches", "batches routed and acknowledged", registry=r)
        self.batch_size = Histogram("neardup_batch_size", "records per batch", buckets=_BATCH_BUCKETS, registry=r)
        self.stage_seconds = Histogram("neardup_stage_seconds", "seconds per batch in each stage", ["stage"],
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.redis_seconds = Histogram("neardup_redis_seconds", "seconds per Redis round trip, by operation", ["op"],
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.index_errors = Counter("neardup_index_errors",
                                    "routing attempts that failed because the index was unavailable", registry=r)
        self.index_retries = Counter("neardup_index_retries",
                                     "batches routed again after an index error (backoff)", registry=r)
        self.index_up = Gauge("neardup_index_up", "1 while the index answers, 0 during an outage", registry=r)
        self.kafka_errors = Counter("neardup_kafka_errors",
                                    "worker operations (fetch, delivery) and reachability probes that failed because "
                                    "the broker was unreachable", registry=r)
        self.kafka_up = Gauge("neardup_kafka_up", "1 while the broker answers, 0 during an outage", registry=r)
        self.campaign_errors = Counter("neardup_campaign_errors",
                                       "campaign view updates that failed (the batch was routed regardless)", registry=r)
        self.consumer_lag = Gauge("neardup_consumer_lag",
                                  "records not yet fetched: highwater - position, per assigned partition",
                                  ["topic", "partition"], registry=r)
        self.late = Counter("neardup_late_records",
                            "records decided more than max_skew behind the group's event time (header neardup-late)",
                            registry=r)
        self.held = Counter("neardup_alignment_held_seconds",
                            "seconds the worker waited for a partition or the group to catch up in event time",
                            registry=r)
        self.low_mark = Gauge("neardup_event_time_low_mark_seconds",
                              "event time of the next record this worker decides (its low watermark; NaN: none)",
                              registry=r)
        self.paused = Gauge("neardup_partitions_paused", "partitions paused because their buffer is full", registry=r)
        self.unread = Counter("neardup_records_deleted_unread",
                              "input records the broker deleted (its retention) before the worker read them: never "
                              "routed", registry=r)
        self.index_losses = Counter("neardup_index_losses",
                                    "times the shared index was found without its marker (data lost, or never built)",
                                    registry=r)
        self.restored = Counter("neardup_index_restored_entries",
                                "entries this worker wrote back into the shared index from the changelog", registry=r)
        self.restoring = Gauge("neardup_index_restoring",
                               "1 while the index is being rebuilt from the changelog (routing waits)", registry=r)
        self.restore_read = Gauge("neardup_index_restore_read_entries",
                                  "entries of the changelog the restore going on has read (0 when none is)", registry=r)
        self.index_size = Gauge("neardup_index_size", "the candidate index's stats(): entries, buckets, ...",
                                ["stat"], registry=r)
        self.index_up.set(1)
        self.kafka_up.set(1)
        for stage in STAGES:
            self.stage_seconds.labels(stage)  # present (at 0) before the first batch: dashboards need no special case
        self._unique_total = 0
        self._duplicate_total = 0
        self._errors_seen = 0
        self._retries_seen = 0
        self._kafka_errors_seen = 0
        self._lag_labels: set[tuple[str, str]] = set()
        self._late_seen = 0
        self._unread_seen = 0
        self._held_seen = 0.0
        self._losses_seen = 0
        self._restored_seen = 0

    # -- per batch -------------------------------------------------------------------------------
    def count(self, topics: Sequence[str], verdicts: Sequence[str], reasons: Sequence[str | None]) -> None:
        """One acknowledged batch: per record its input topic, verdict (unique, duplicate, rejected,
        unchecked) and, for rejected ones, the reason."""
        self.batches.inc()
        self.batch_size.observe(len(topics))
        for topic, verdict, reason in zip(topics, verdicts, reasons, strict=True):
            self.messages_in.labels(topic).inc()
            if verdict == "unique":
                self.unique.labels(topic).inc()
                self._unique_total += 1
            elif verdict == "duplicate":
                self.duplicate.labels(topic).inc()
                self._duplicate_total += 1
            elif verdict == "unchecked":
                self.unchecked.labels(topic).inc()
            else:
                self.dead_lettered.labels(topic, reason or "unknown").inc()
        checked = self._unique_total + self._duplicate_total
        self.duplicate_ratio.set(self._duplicate_total / checked if checked else 0.0)

    def stage(self, name: str, seconds: float) -> None:
        self.stage_seconds.labels(name).observe(max(0.0, seconds))

    # -- at scrape time ----------------------------------------------------------------------------
    def index_state(self, errors: int, retries: int, down: bool) -> None:
        """The router's running totals (counters only move forward by their increase)."""
        if errors > self._errors_seen:
            self.index_errors.inc(errors - self._errors_seen)
            self._errors_seen = errors
        if retries > self._retries_seen:
            self.index_retries.inc(retries - self._retries_seen)
            self._retries_seen = retries
        self.index_up.set(0 if down else 1)

    def kafka_state(self, errors: int, down: bool) -> None:
        """The worker's `KafkaHealth` totals (the counter only moves forward by their increase)."""
        if errors > self._kafka_errors_seen:
            self.kafka_errors.inc(errors - self._kafka_errors_seen)
            self._kafka_errors_seen = errors
        self.kafka_up.set(0 if down else 1)

    def changelog_state(self, losses: int, restored: int, restoring: bool, reading: int = 0) -> None:
        """The index changelog's guard (stream/changelog.py): losses found, entries restored, a restore going on
        and the entries it has read so far."""
        if losses > self._losses_seen:
            self.index_losses.inc(losses - self._losses_seen)
            self._losses_seen = losses
        if restored > self._restored_seen:
            self.restored.inc(restored - self._restored_seen)
            self._restored_seen = restored
        self.restoring.set(1 if restoring else 0)
        self.restore_read.set(reading)

    def alignment_state(self, late: int, held: float, low: float | None, paused: int) -> None:
        """The worker's event-time alignment (stream/align.py): totals and the current marks."""
        if late > self._late_seen:
            self.late.inc(late - self._late_seen)
            self._late_seen = late
        if held > self._held_seen:
            self.held.inc(held - self._held_seen)
            self._held_seen = held
        self.low_mark.set(float("nan") if low is None else low)
        self.paused.set(paused)

    def unread_state(self, unread: int) -> None:
        """Input records the broker deleted before they were read (the worker's `unread`)."""
        if unread > self._unread_seen:
            self.unread.inc(unread - self._unread_seen)
            self._unread_seen = unread

    def lag(self, lags: Mapping[tuple[str, int], int]) -> None:
        labels = {(topic, str(partition)) for topic, partition in lags}
        for gone in self._lag_labels - labels:  # partitions taken away by a rebalance
            self.consumer_lag.remove(*gone)
        for (topic, partition), value in lags.items():
            self.consumer_lag.labels(topic, str(partition)).set(value)
        self._lag_labels = labels

    def index_stats(self, stats: Mapping[str, int]) -> None:
        for name, value in stats.items():
            self.index_size.labels(name).set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class TimedFilter:
    """Stands in for a `NearDupFilter` in `route_batch`: its two steps (`prepare`: normalize and
    fingerprint; `decide`: the index stage), timed; the rest is the filter's. One instance per batch."""

    def __init__(self, nd: NearDupFilter) -> None:
        self.nd = nd
        self.fingerprint = 0.0  # seconds in `prepare`
        self.decided = 0.0  # seconds in `decide`: the index stage

    @property
    def index(self) -> CandidateIndex:
        return self.nd.index

    @property
    def prepares_in_parts(self) -> bool:
        return self.nd.prepares_in_parts

    def prepare(self, texts: Sequence[str]) -> Prepared:
        t0 = time.perf_counter()
        try:
            return self.nd.prepare(texts)
        finally:
            self.fingerprint += time.perf_counter() - t0

    def decide(self, messages: Sequence[Message], prepared: Prepared, meanwhile: Callable[[], bool] | None = None,
               upcoming: tuple[Sequence[Message], Prepared] | None = None) -> list[Verdict]:
        aside = [0.0]  # in `meanwhile`: the next batch's decoding and `prepare` (reading ahead), not the index's

        def share() -> bool:
            assert meanwhile is not None
            t = time.perf_counter()
            try:
                return meanwhile()
            finally:
                aside[0] += time.perf_counter() - t

        t0 = time.perf_counter()
        try:
            return self.nd.decide(messages, prepared, meanwhile=share if meanwhile is not None else None,
                                  upcoming=upcoming)
        finally:
            self.decided += time.perf_counter() - t0 - aside[0]


class TimedIndex(IndexWrapper):
    """A `CandidateIndex` that times the round trips of another (a shared one: Redis). It wraps the door
    (`decide`): the batch goes to the inner index whole (its overlap and read-ahead with it), with the
    timing as the batch's `observe`."""

    def __init__(self, inner: CandidateIndex, observe: Callable[[str, float], None]) -> None:
        super().__init__(inner)
        self._observe = observe

    def decide(self, batch: Batch, verifier: Verifier) -> list[Verdict]:
        return self.inner.decide(replace(batch, observe=self._observe), verifier)

    def lookup(self, queries: Sequence[Query], limit: int) -> list[tuple[Entry | Verdict | None, list[Candidate]]]:
        t0 = time.perf_counter()
        try:
            return self.inner.lookup(queries, limit)
        finally:
            self._observe("lookup", time.perf_counter() - t0)

    def insert(self, entries: Sequence[tuple[Entry, tuple[int, ...]]],
               memos: Sequence[Memo] = ()) -> list[list[Candidate] | None]:
        t0 = time.perf_counter()
        try:
            return self.inner.insert(entries, memos)
        finally:
            self._observe("insert", time.perf_counter() - t0)


RouteStep = Callable[..., Any]


def timed_route_runner(metrics: WorkerMetrics, routed: Callable[[Sequence[Any]], None]
                       ) -> Callable[..., Any]:
    """A `Router(run=...)`: runs the route step in a thread, as the default does, with a `TimedFilter`
    in place of the filter; records the stage times and calls `routed(records)` when it is done."""

    async def run(step: RouteStep, nd: NearDupFilter, records: Sequence[Any], *args: Any) -> Any:
        timed = TimedFilter(nd)
        t0 = time.perf_counter()
        result = await asyncio.to_thread(step, timed, records, *args)
        total = time.perf_counter() - t0
        metrics.stage("fingerprint", timed.fingerprint)
        metrics.stage("index", timed.decided)
        # What is left of the wall time: decoding the records, and routing them.
        metrics.stage("decode", max(0.0, total - timed.fingerprint - timed.decided))
        routed(records)
        return result

    return run
