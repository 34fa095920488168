"""The Kafka worker (aiokafka runtime): consume input topics in batches, route each (`stream.router`), produce, commit after acks.

Order (aiokafka runtime, `align`, the default): fetched records wait in per-partition buffers and are
decided in event-time order across the assigned partitions, and no more than `max_skew` ahead of the
other workers of the group (`stream.align`: the partition with the lowest head first, empty partitions
waited for unless idle, the group's marks in the index's Redis). So a verdict does not depend on how
many partitions or workers there are, or on which partition the consumer happened to drain first.

Delivery is at-least-once: a batch's offsets are committed only after every output record of the batch
has been acknowledged by the broker (acks=all). A worker that dies between the two re-reads the batch
after a restart; with a shared index (Redis) the engine gives a replayed message the verdict it got
before (an indexed unique one is found under its own id: unique, method "replay"; a duplicate was not
indexed and matches its original again). With `memory://` the index dies with the worker, so replays
after a restart are checked against an empty index: use Redis for `serve`; memory:// is for trying out.
During a Kafka outage (`stream.kafka_health`) a delivery that failed meanwhile is sent again before its
batch is committed. An output that its topic refuses as too large is dead-lettered without its value
(reason `output_too_large`) instead of stopping the worker.

Exactly-once (`processing_guarantee = "exactly_once"`, aiokafka runtime only): each batch's outputs and
its consumed offsets go in one Kafka transaction (a transactional producer, `send_offsets_to_transaction`,
then commit), so a reader with isolation.level=read_committed sees every input's output exactly once,
crash or not; a batch interrupted by a crash is aborted and re-read. The transactional id is
`neardup-<group_id>-<group_instance_id>`: with static membership a restarted worker fences its dead
predecessor and aborts its open transaction at once (without one the id is random, and the dead
transaction holds read_committed readers back until the broker's transaction timeout, 60 s). Before it
lets partitions go (revoked, or leaving), a worker waits until the group shows its transactions' offsets:
they land only with the commit marker, a little after the commit returned, and aiokafka's offset fetch
does not wait for them (no require_stable), so the next owner would start before the last batch. aiokafka
commits transactional offsets without the group generation (no KIP-447 fencing): a worker that stalls
past its session timeout and then commits could still repeat a batch that its successor also routed.

Two runtimes share everything but the loop: `aiokafka` (default: a plain consume → route → produce →
commit loop, pipelined: the next batch is routed while the last one is handed over and the one before
committed) and `faust` (a faust-streaming agent over `stream.noack_take`,
acking a batch after its outputs were acknowledged). aiokafka is the default: faster, lower latency,
and its commits are explicit (see bench/kafka_e2e.py and stream/faust_worker.py). `make_worker` picks one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import (
    CommitFailedError,
    IllegalStateError,
    KafkaError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
)
from aiokafka.partitioner import DefaultPartitioner

from filters.engine import NearDupFilter
from filters.errors import ConfigError, IndexUnavailable, ServiceError
from stream.align import Aligner, GroupMarks, GroupView, SoloMarks, Taken, lanes_of, open_marks
from stream.changelog import NAMESPACE_HEADER, IndexGuard, Journal, encode_record, read_changelog, retention
from stream.codec import event_time
from stream.config import Settings
from stream.faust_worker import FaustWorker
from stream.kafka_health import transient
from stream.kafka_tools import (
    KafkaRecord,
    broker_errors,
    client_options,
    ensure_topics,
    map_kafka_error,
    partition_lags,
    producer,
)
from stream.outputs import MAX_OUTPUT_BYTES, OUTPUT_TOO_LARGE, OutRecord, late_output, refused_output
from stream.router import BatchObserver, WorkerCore, WorkerStats

log = logging.getLogger("neardup.worker")

# The broker refused a record batch as larger than the topic's max.message.bytes (Kafka's
# MESSAGE_TOO_LARGE / RecordTooLarge, and RECORD_LIST_TOO_LARGE).
_TOO_LARGE = (MessageSizeTooLargeError, RecordListTooLargeError)


# How long a worker held back by the group waits for another worker's mark to move (`GroupMarks.moved`: at
# once when one does) before it reads the marks again anyway (a mark that expired says nothing).
_GROUP_POLL = 0.05


# -- the aiokafka runtime ------------------------------------------------------------------------


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    """Before partitions are taken away, deliver and commit what was routed from them."""

    def __init__(self, let_go: Callable[[], Awaitable[None]], assigned: Callable[[Any], Awaitable[None]]) -> None:
        self.let_go = let_go
        self.assigned = assigned
        # Counts assignments; aiokafka fetches nothing of a new assignment before this callback runs.
        self.assignments = 0

    async def on_partitions_revoked(self, revoked: Any) -> None:
        await self.let_go()

    async def on_partitions_assigned(self, assigned: Any) -> None:
        self.assignments += 1
        await self.assigned(assigned)
        if assigned:
            log.info("assigned %s", ", ".join(f"{tp.topic}/{tp.partition}" for tp in sorted(assigned)))


@dataclass
class _InFlight:
    """A routed batch whose output records were handed to the producer but not yet acknowledged."""

    records: list[KafkaRecord]
    outs: list[OutRecord]
    deliveries: list[asyncio.Future[Any]]
    assignment: int = 0  # `_Rebalance.assignments` when the records were fetched
    parts: list[list[KafkaRecord]] = field(default_factory=list)  # the routed batches it joins (empty: one)
    logged: list[OutRecord] = field(default_factory=list)  # the index changelog's records of the batch
    log_deliveries: list[asyncio.Future[Any]] = field(default_factory=list)



class AiokafkaWorker(WorkerCore):
    """consume (getmany) → route (a thread) → produce → await acks → commit.

    Pipelined: as soon as batch N is routed, the next batch is fetched and routed (in a thread) while
    the event loop hands N's outputs to the producer and commits N-1 once its acknowledgements arrived
    (`_deliver`, a task; the next batch's hand-over waits for it). Routing never waits for Kafka
    round trips, and Kafka's work is never held up by routing. The records the consumer holds already
    are fetched with each batch and prepared while it is routed (`Lookahead`); they are the next batch.
    N is committed after all its outputs were acknowledged, and always before N+1. So a batch's offsets
    are committed only after every output of it and of all batches before it was acknowledged; a crash
    may leave up to three routed batches uncommitted, to be re-read (replayed, same verdicts) after a
    restart.
    """

    def __init__(self, settings: Settings, nd: NearDupFilter | None = None, *,
                 observer: BatchObserver | None = None) -> None:
        super().__init__(settings, nd, observer=observer)
        self._lock = asyncio.Lock()  # one batch step at a time: the loop, or a rebalance's flush
        self._in_flight: _InFlight | None = None
        self._delivering: asyncio.Future[None] | None = None  # `_deliver` of the batch routed last
        # Routed batches waiting for the hand-over going on to finish (`_hand_over`): records, outputs,
        # assignment, the index changelog's records.
        self._queued: list[tuple[list[KafkaRecord], list[OutRecord], int, list[OutRecord]]] = []
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: Any = None
        self._transactional = settings.processing_guarantee == "exactly_once"
        fmt = settings.record_format()
        # Event-time order across the assigned partitions (stream/align.py); off: the order fetched.
        self.aligner = Aligner(lambda r: event_time(r.value or b"", fmt, r.timestamp / 1000.0),
                               max_skew=settings.max_skew, idle_timeout=settings.idle_timeout,
                               buffer=2 * settings.max_batch, ordered=settings.align,
                               skew_records=settings.skew_records)
        self.marks: GroupMarks = SoloMarks()  # the group's marks: opened by `run` (in the index's Redis)
        self.group = GroupView()  # what the group's marks said last
        self._marked_at = -math.inf
        self.held_seconds = 0.0  # waited for a partition or the group (a metric)
        self._rewound: set[tuple[str, int]] = set()  # partitions sent back since the loop last looked (`_reread`)
        self._member = settings.group_instance_id or uuid.uuid4().hex[:12]
        self._rebalance = _Rebalance(self._let_go, self._assigned)
        # Exactly-once: offsets committed in transactions that the group coordinator may not show yet.
        self._unconfirmed: dict[TopicPartition, int] = {}
        self._partitioner = DefaultPartitioner()  # what `send` uses: keyed records land where they would
        # The index changelog (stream/changelog.py): what each batch made unique, and the guard that rebuilds
        # a shared index that lost its data.
        self.journal: Journal | None = None
        if settings.changelogged:
            self.journal = Journal(self.nd.index)
            self.nd.index = self.journal
        self.guard: IndexGuard | None = None
        self._checked_at = -math.inf

    def stop(self) -> None:
        self.stop_event.set()

    @property
    def consumer(self) -> AIOKafkaConsumer | None:
        """The consumer once `run` started it (stream/ops.py reads its lag)."""
        return self._consumer

    async def run(self) -> WorkerStats:
        s = self.settings
        if s.create_topics:
            await ensure_topics(s, [*s.input_topics, *s.output_topics])
        if self.journal is not None:
            await self._open_changelog()
        consumer = AIOKafkaConsumer(
            group_id=s.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_poll_records=s.max_batch,
            group_instance_id=s.group_instance_id or None,
            session_timeout_ms=round(s.session_timeout * 1000),
            heartbeat_interval_ms=max(100, round(s.session_timeout * 1000 / 3)),
            # Exactly-once: an upstream's aborted transactions are not input.
            isolation_level="read_committed" if self._transactional else "read_uncommitted",
            **client_options(s),
        )
        self._consumer = consumer
        if s.align:
            self.marks = open_marks(s.index, namespace=self.nd.config.digest(), group=s.group_id,
                                    member=self._member, ttl=s.session_timeout)
        with broker_errors(s):
            await consumer.start()
        self.kafka.probe = consumer.topics  # a metadata request
        filtered = self.kafka.attach()
        watch = asyncio.ensure_future(self.kafka.watch())
        try:
            consumer.subscribe(list(s.input_topics), listener=self._rebalance)
            options: dict[str, Any] = {"max_request_size": MAX_OUTPUT_BYTES}
            if self._transactional:
                options["transactional_id"] = (f"neardup-{s.group_id}-"
                                               f"{s.group_instance_id or uuid.uuid4().hex[:12]}")
            async with producer(s, **options) as prod:
                self._producer = prod
                await self._check_index()  # before the first batch: a lost index is rebuilt first
                await self._loop(consumer, prod)
                # Stopping (not failing): deliver and commit the batch in flight before leaving the group.
                await self._let_go()
        finally:
            delivering, self._delivering = self._delivering, None
            if delivering is not None and not delivering.done():
                delivering.cancel()  # failing: what it had not committed is re-read after a restart
            elif delivering is not None and not delivering.cancelled():
                delivering.exception()  # retrieved: the error that stopped the loop is the one raised
            self._in_flight = None
            self._queued = []  # not handed over: re-read after a restart
            watch.cancel()
            with broker_errors(s):
                await consumer.stop()
            for logger in filtered:
                logger.removeFilter(self.kafka)
            await self.marks.close()
            if self.guard is not None:
                await self.guard.close()
        log.info("stopped: %s", self.stats.line())
        if self.settings.align:
            log.info("event-time alignment: held back %.1fs in all, %d late records", self.held_seconds,
                     self.aligner.late)
        return self.stats

    async def _loop(self, consumer: AIOKafkaConsumer, prod: Any) -> None:
        s = self.settings
        timeout_ms = max(1, round(s.batch_within * 1000))
        stop_wait = asyncio.ensure_future(self.stop_event.wait())
        pending: Taken | None = None  # taken with the last batch (its records prepared meanwhile): next
        pending_assignment = 0
        held_since: float | None = None  # since when the aligner holds records back (waiting)
        pushed = False  # the group's view came with the news that another worker moved: no need to read it
        try:
            while not self.stop_event.is_set():
                if pending is not None and (pending_assignment != self._rebalance.assignments or self._rewound):
                    pending, pending_assignment = self._still_owned(pending), self._rebalance.assignments
                self._rewound.clear()
                if pending is not None:
                    batch, assignment, pending = pending, pending_assignment, None
                else:
                    if not await self._fetch(consumer, 0, stop_wait):
                        break
                    assignment = self._rebalance.assignments
                    batch = await self._take(consumer, refresh=held_since is not None and not pushed)
                    pushed = False
                    if not batch:
                        busy = self._in_flight is not None or self._delivering is not None or bool(self._queued)
                        if batch.waiting:
                            # Held back (a partition or the group behind): look again shortly; what is in
                            # flight is finished if the wait goes on, so that outputs are not held up.
                            now = time.monotonic()
                            held_since = now if held_since is None else held_since
                            if busy and now - held_since >= s.batch_within:
                                async with self._lock:
                                    await self._drain()
                            elif batch.waiting == "group":
                                view = await self.marks.moved(_GROUP_POLL)  # else: read the marks again
                                if view is not None:
                                    self.group, pushed = view, True
                            elif not await self._fetch(consumer, 2, stop_wait):
                                break
                        elif busy:
                            async with self._lock:
                                await self._drain()  # nothing more now: finish the batch in flight first
                        elif not await self._fetch(consumer, timeout_ms, stop_wait):
                            break
                        continue
                if held_since is not None:
                    self.held_seconds += time.monotonic() - held_since
                    held_since = None
                await self._fetch(consumer, 0, stop_wait)
                following = self.aligner.take(s.max_batch, self.group)
                pending_assignment = self._rebalance.assignments
                async with self._lock:
                    owned: Taken | None = batch
                    if assignment != self._rebalance.assignments or self._rewound:  # a rebalance meanwhile
                        owned, assignment = self._still_owned(batch), self._rebalance.assignments
                    if owned is not None:
                        await self._batch(consumer, prod, owned, assignment, following.records)
                pending = following if following else None
        finally:
            stop_wait.cancel()

    def _still_owned(self, taken: Taken) -> Taken | None:
        """`taken`, taken before a rebalance, without the records of partitions this worker no longer owns
        (their next owner reads them from the committed offset); None if nothing is left. The others are
        decided here: the consumer fetches them again, and the aligner knows them by their offsets."""
        self.aligner.dropped(taken)
        keep = [i for i, r in enumerate(taken.records)
                if self.aligner.owns((r.topic, r.partition)) and (r.topic, r.partition) not in self._rewound]
        if not keep:
            return None
        return self.aligner.retake(Taken([taken.records[i] for i in keep], [taken.times[i] for i in keep],
                                         [taken.late[i] for i in keep]))

    async def _fetch(self, consumer: AIOKafkaConsumer, wait_ms: int, stop_wait: asyncio.Future[Any]) -> bool:
        """What the consumer holds (waiting up to `wait_ms` for records) into the aligner; False when stopping
        meanwhile. A transient broker error is noted (`KafkaHealth`) and waited out."""
        s = self.settings
        fetch = asyncio.ensure_future(consumer.getmany(timeout_ms=wait_ms, max_records=4 * s.max_batch))
        await asyncio.wait([fetch, stop_wait], return_when=asyncio.FIRST_COMPLETED)
        if not fetch.done():
            fetch.cancel()
            return False
        with broker_errors(s):
            try:
                fetched = fetch.result()
            except KafkaError as exc:
                if not transient(exc):
                    raise
                self.kafka.failed(exc, "fetch")
                await asyncio.sleep(0.1)  # a leader election does not mark the broker down
                return await self.kafka.wait_up(self.stop_event.is_set)
        for msgs in fetched.values():
            self.aligner.add(KafkaRecord.of(m) for m in msgs)
        return True

    async def _take(self, consumer: AIOKafkaConsumer, refresh: bool) -> Taken:
        """The next batch in event-time order (`Aligner.take`), after pausing the partitions whose buffer is
        full and resuming the drained ones; the group's marks are read again when `refresh` or due."""
        lags = await partition_lags(consumer, self._transactional)
        pause, resume = self.aligner.flow(lags.get)
        if pause:
            consumer.pause(*(TopicPartition(*lane) for lane in pause))
        if resume:
            consumer.resume(*(TopicPartition(*lane) for lane in resume))
        if refresh or time.monotonic() - self._marked_at > self.settings.session_timeout / 4:
            await self._publish_marks()
        return self.aligner.take(self.settings.max_batch, self.group)

    async def _publish_marks(self) -> None:
        """This worker's low mark and partitions to the group, and the group's view back (`GroupMarks`). While the
        index's Redis is down the worker goes on alone: routing waits for the index anyway (block), or
        passes records unchecked."""
        try:
            self.group = await self.marks.publish(self.aligner.low_mark(), self.aligner.lanes(), self._every())
        except IndexUnavailable as exc:
            if self.group.low is not None:
                log.debug("event-time marks not shared while the index is unavailable: %s", exc)
            self.group = GroupView(None)
        self._marked_at = time.monotonic()

    def _every(self) -> list[tuple[str, int]]:
        """Every partition of the input topics (as the consumer's metadata knows them)."""
        consumer = self._consumer
        if consumer is None:
            return []
        return [(topic, p) for topic in self.settings.input_topics
                for p in sorted(consumer.partitions_for_topic(topic) or ())]

    async def _assigned(self, tps: Any) -> None:
        """A new assignment: the aligner starts afresh and the group hears of it at once (until every
        member has said what it owns, nobody takes anything: `GroupView.complete`)."""
        self.aligner.assign(lanes_of(tps))
        if self.settings.align:
            await self._publish_marks()

    async def _batch(self, consumer: AIOKafkaConsumer, prod: Any, taken: Taken,
                     assignment: int = 0, following: Sequence[KafkaRecord] = ()) -> None:
        def pause() -> None:
            consumer.pause(*consumer.assignment())

        def resume() -> None:
            consumer.resume(*consumer.assignment())
            consumer.pause(*(TopicPartition(*lane) for lane in self.aligner.paused()))

        async def keepalive() -> None:
            await self._drain()  # what was routed before the outage need not wait for the index
            # Paused partitions return nothing; polling keeps the consumer in its group.
            await consumer.getmany(timeout_ms=0)

        records = taken.records
        if self.guard is not None and (time.monotonic() - self._checked_at >= self.settings.index_check
                                       or self.router.index_down):
            await self._check_index()
        if self.journal is not None:
            self.journal.take()  # what a failed attempt left (its entries come again as replays)
        if self.aligner.ordered:
            # The window's clock is the group's low watermark: nobody decides anything older any more (a late
            # record is decided against its worker's own window), so a worker running ahead never makes the
            # shared index forget what one behind still needs.
            low = [m for m in (self.aligner.low_mark(), self.group.low) if m is not None]
            if low:
                self.nd.index.expire(min(low))
        outs = await self.router.route(records, following=following, pause=pause, resume=resume,
                                       keepalive=keepalive, stopping=self.stop_event.is_set,
                                       before_retry=self._check_index if self.guard is not None else None)
        if outs is None:
            return  # stopping during an index outage: nothing of this batch produced or committed
        logged = self._logged()
        self.aligner.decided(taken)
        if self.aligner.ordered:
            await self._publish_marks()  # decided: the group may move past these records
        if any(taken.late):
            outs = [late_output(o, behind) if behind else o for o, behind in zip(outs, taken.late, strict=True)]
        await self._hand_over(prod, records, outs, assignment, logged)

    async def _open_changelog(self) -> None:
        """The changelog topic (created with time retention: the window plus a margin), and the index's guard."""
        s = self.settings
        keep_ms = str(round(retention(s.window) * 1000))
        if s.create_topics:
            await ensure_topics(s, [s.changelog_name], configs={
                "cleanup.policy": "delete", "retention.ms": keep_ms,
                "segment.ms": str(max(60_000, round(s.window * 1000 / 4))),
                # Its records are read back only by a restore, which needs every one a commit covers.
                "min.insync.replicas": "1" if s.replication_factor < 3 else "2"})
        self.guard = IndexGuard(s.index, namespace=self.nd.config.digest(), window=s.window, member=self._member)

    async def _check_index(self) -> None:
        """A shared index that lost its window (its marker is gone) is rebuilt from the changelog before the
        next batch is routed: what was routed is delivered first (its changelog records are then readable),
        then one worker of the group restores and the others wait for it."""
        guard = self.guard
        if guard is None:
            return
        s = self.settings

        async def read(write: Callable[[list[Any]], Awaitable[int]]) -> int:
            reader = AIOKafkaConsumer(enable_auto_commit=False, isolation_level="read_committed",
                                      auto_offset_reset="earliest", **client_options(s))
            with broker_errors(s):
                await reader.start()
                try:
                    since = round((time.time() - retention(s.window)) * 1000)
                    partitions = sorted(await self._producer.partitions_for(s.changelog_name))
                    return await read_changelog(reader, s.changelog_name, partitions, self.nd.config.digest(), since,
                                                write)
                finally:
                    await reader.stop()

        try:
            await guard.ensure(read, self.nd.index.restore, self._drain)
        except IndexUnavailable as exc:
            # The router meets the outage itself (its policy: block, or pass unchecked) and checks again
            # before it retries a batch: the index may come back without its data.
            log.debug("the index's marker could not be read: %s", exc)
            return
        self._checked_at = time.monotonic()

    def _logged(self) -> list[OutRecord]:
        """The changelog's records of the entries the batch just routed made unique."""
        if self.journal is None:
            return []
        topic = self.settings.changelog_name
        headers = ((NAMESPACE_HEADER, self.nd.config.digest().encode()),)
        return [OutRecord(topic, entry.id.encode("utf-8", "surrogatepass"), encode_record(entry, keys), headers)
                for entry, keys in self.journal.take()]

    async def _hand_over(self, prod: Any, records: list[KafkaRecord], outs: list[OutRecord], assignment: int,
                         logged: list[OutRecord] | None = None) -> None:
        """Queues a routed batch for delivery. While the previous hand-over is still going on (its acks, or
        under exactly-once its commit), routed batches queue up and go together in the next one (one
        transaction for all): small batches, as the group moves in lockstep under event-time alignment,
        do not each pay a commit. Outputs stay in input order."""
        if self._queued and self._queued[0][2] != assignment:
            await self._send_queued(prod)  # fetched under another assignment: a transaction of its own
        self._queued.append((records, outs, assignment, logged or []))
        going = self._delivering is not None and not self._delivering.done()
        if going and sum(len(q[0]) for q in self._queued) < self.settings.max_batch:
            return
        await self._send_queued(prod)

    async def _send_queued(self, prod: Any) -> None:
        """The queued batches handed to the producer as one (after the hand-over before them)."""
        await self._settle()
        queued, self._queued = self._queued, []
        if not queued:
            return
        if len(queued) == 1:
            records, outs, assignment, logged = queued[0]
            parts: list[list[KafkaRecord]] = []
        else:
            records = [r for q in queued for r in q[0]]
            outs = [o for q in queued for o in q[1]]
            assignment = queued[0][2]
            parts = [q[0] for q in queued]
            logged = [o for q in queued for o in q[3]]
        self._delivering = asyncio.ensure_future(self._deliver(prod, records, outs, assignment, parts, logged))

    async def _deliver(self, prod: Any, records: list[KafkaRecord], outs: list[OutRecord], assignment: int,
                       parts: list[list[KafkaRecord]], logged: list[OutRecord]) -> None:
        """Hands a routed batch's outputs to the producer and commits the batch before it (whose acks
        arrived meanwhile); the batch is then in flight. Runs while the next batch is routed."""
        s = self.settings
        if self._transactional:
            await self._flush()  # one transaction at a time: commit the previous batch's first
            with broker_errors(s):
                await prod.begin_transaction()
        with broker_errors(s):
            deliveries = await self._send_all(prod, [*outs, *logged])
        await self._flush()  # the previous batch: its acks arrived while this one was routed
        n = len(outs)
        self._in_flight = _InFlight(records, outs, deliveries[:n], assignment, parts, logged, deliveries[n:])

    async def _settle(self) -> None:
        """Waits for the last routed batch's `_deliver` (and raises what it raised)."""
        delivering, self._delivering = self._delivering, None
        if delivering is not None:
            await delivering

    async def _drain(self) -> None:
        """Everything routed so far handed over, acknowledged and committed."""
        await self._send_queued(self._producer)
        await self._settle()
        await self._flush()

    async def _let_go(self) -> None:
        """Before this worker's partitions may go to another member (revoked, or the worker leaving):
        everything routed is delivered and committed, and the group shows those commits."""
        async with self._lock:
            await self._drain()
        await self._offsets_shown()

    async def _offsets_shown(self) -> None:
        """Exactly-once: waits until the group coordinator answers the offsets our transactions committed.

        A transaction's offsets reach the group when the transaction coordinator writes its commit marker,
        after `commit_transaction` returned; until then aiokafka's OffsetFetch (below v7: no require_stable)
        answers the offset before. The partitions' next owner starts from that answer, so letting them go
        earlier would have it route the last batch again (`bench/txn_offsets.py`: about half or more of the
        reads right after a commit are stale, for a few ms). Bounded by half the session timeout: the
        rebalance waits for this member only so long."""
        pending, consumer = self._unconfirmed, self._consumer
        if not pending or consumer is None:
            return
        deadline = time.monotonic() + self.settings.session_timeout / 2
        while True:
            tps = list(pending)
            try:
                # aiokafka retries a fetch while the coordinator is unreachable: bounded here.
                shown = await asyncio.wait_for(asyncio.gather(*(consumer.committed(tp) for tp in tps)),
                                               max(0.05, deadline - time.monotonic()))
            except (TimeoutError, KafkaError) as exc:
                log.warning("could not read the group's committed offsets before letting partitions go: %r; "
                            "their next owner may route the last batch again", exc)
                pending.clear()
                return
            for tp, offset in zip(tps, shown, strict=True):
                if offset is not None and offset >= pending[tp]:
                    del pending[tp]
            if not pending:
                return
            if time.monotonic() >= deadline:
                log.warning("the group did not show the last transaction's offsets of %s in time; their next "
                            "owner may route the last batch again", ", ".join(f"{tp.topic}/{tp.partition}"
                                                                              for tp in sorted(pending)))
                pending.clear()
                return
            await asyncio.sleep(0.005)

    async def _flush(self) -> None:
        """Await the acks of the batch in flight, then commit its offsets."""
        batch, self._in_flight = self._in_flight, None
        if batch is None:
            return
        s = self.settings
        with broker_errors(s):
            if self._transactional:
                # Any failure: the transaction is not committed.
                await asyncio.gather(*batch.deliveries, *batch.log_deliveries)
            else:
                batch.outs = await self._delivered(batch)
                await self._logs_delivered(batch)
        if self._transactional and batch.assignment != self._rebalance.assignments:
            # The partitions were reassigned since the batch was fetched: their owner now (maybe this
            # worker) re-reads it from the committed offsets, so committing it too would repeat it.
            log.warning("partitions reassigned while a batch of %d records was in flight: its transaction is "
                        "aborted, the records are re-read by their owner", len(batch.records))
            with broker_errors(s):
                await self._producer.abort_transaction()
            self._reread(batch.records)
            return
        start = 0
        for part in batch.parts or [batch.records]:  # per routed batch: the very list that was routed
            outs = batch.outs[start:start + len(part)]
            self.stats.add(outs)
            if self.observer is not None:
                maybe = self.observer(part, outs)
                if maybe is not None:
                    await maybe
            start += len(part)
        offsets: dict[TopicPartition, int] = {}
        for r in batch.records:
            tp = TopicPartition(r.topic, r.partition)
            offsets[tp] = max(offsets.get(tp, 0), r.offset + 1)
        if self._transactional:
            with broker_errors(s):
                await self._producer.send_offsets_to_transaction(offsets, s.group_id)
                await self._producer.commit_transaction()
            for tp, offset in offsets.items():
                self._unconfirmed[tp] = max(self._unconfirmed.get(tp, 0), offset)
            return
        assert self._consumer is not None
        try:
            await self._consumer.commit(offsets)
        except (CommitFailedError, IllegalStateError) as exc:
            # The group moved on (rebalance): whoever owns the partitions now re-reads this batch.
            log.warning("commit failed, the batch will be re-read by the partitions' new owner: %s", exc)
        except KafkaError as exc:
            raise map_kafka_error(exc, s.kafka_bootstrap) from exc

    def _reread(self, records: Sequence[KafkaRecord]) -> None:
        """Records whose outputs were aborted: where this worker still owns their partitions, the consumer
        is sent back to them (and what the aligner buffered, and the batches queued behind them, of those
        partitions, are dropped: they come again); the others' owner reads them from the committed offsets."""
        queued = [r for q in self._queued for r in q[0]]
        first: dict[tuple[str, int], int] = {}
        for r in (*records, *queued):
            lane = (r.topic, r.partition)
            if self.aligner.owns(lane):
                first[lane] = min(first.get(lane, r.offset), r.offset)
        self._queued = [q for q in self._queued if not any((r.topic, r.partition) in first for r in q[0])]
        for lane, offset in first.items():
            with contextlib.suppress(IllegalStateError):
                assert self._consumer is not None
                self._consumer.seek(TopicPartition(*lane), offset)
        self.aligner.rewind(first)
        self._rewound |= set(first)

    async def _send_all(self, prod: Any, outs: Sequence[OutRecord]) -> list[asyncio.Future[Any]]:
        """Hands `outs` to the producer in record batches of our own, one open per topic partition (as
        `send` would partition them): a delivery per batch, shared by its outputs, instead of a coroutine,
        a future and a partitioner call per record (≈ 3 times less producer CPU a record). An output
        that fits no batch goes through `_send`."""
        deliveries: list[asyncio.Future[Any] | None] = [None] * len(outs)
        open_batches: dict[tuple[str, int], tuple[Any, list[int]]] = {}
        partitions: dict[str, tuple[list[int], list[int]]] = {}

        async def close(topic: str, partition: int) -> None:
            batch, members = open_batches.pop((topic, partition))
            try:
                delivery = await prod.send_batch(batch, topic, partition=partition)
            except KafkaError as exc:
                delivery = self._failed_delivery(exc)
            for i in members:
                deliveries[i] = delivery

        for i, out in enumerate(outs):
            if out.key is None and out.value is None:
                deliveries[i] = await self._send_alone(prod, out)
                continue
            known = partitions.get(out.topic)
            if known is None:
                try:
                    every = sorted(await prod.partitions_for(out.topic))
                except KafkaError as exc:
                    deliveries[i] = self._failed_delivery(exc)
                    continue
                available = sorted(prod.client.cluster.available_partitions_for_topic(out.topic) or every)
                known = partitions[out.topic] = (every, available)
            place = (out.topic, self._partitioner(out.key, *known))
            headers = list(out.headers)
            current = open_batches.get(place)
            if current is not None:
                if current[0].append(key=out.key, value=out.value, timestamp=None, headers=headers) is not None:
                    current[1].append(i)
                    continue
                await close(*place)  # full: send it, and start another
            batch = prod.create_batch()
            if batch.append(key=out.key, value=out.value, timestamp=None, headers=headers) is None:
                deliveries[i] = await self._send(prod, out)  # larger than a batch: `send` decides
                continue
            open_batches[place] = (batch, [i])
        for place in list(open_batches):
            await close(*place)
        return deliveries  # type: ignore[return-value]

    async def _send(self, prod: Any, out: OutRecord) -> asyncio.Future[Any]:
        """Hands `out` to the producer. At-least-once, a refusal or an outage while doing so comes back as the
        delivery's error (see `_delivered`)."""
        if out.key is None and out.value is None:
            # A record without a key dead-lettered without its value: `send` refuses a record with
            # neither, a record batch of its own takes it.
            return await self._send_alone(prod, out)
        try:
            return await prod.send(out.topic, value=out.value, key=out.key, headers=list(out.headers))
        except KafkaError as exc:
            return self._failed_delivery(exc)

    def _failed_delivery(self, exc: KafkaError) -> asyncio.Future[Any]:
        """At-least-once, an outage or a too-large refusal while handing a record over becomes that delivery's
        error, settled in `_delivered`; anything else (and anything in a transaction) is raised."""
        if self._transactional or not (transient(exc) or isinstance(exc, _TOO_LARGE)):
            raise exc
        failed: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        failed.set_exception(exc)
        return failed

    async def _send_alone(self, prod: Any, out: OutRecord) -> asyncio.Future[Any]:
        """`out` in a record batch of its own, to the partition `send` would choose: the broker refuses a
        batch as a whole, so small records batched with a too-large one were refused with it."""
        try:
            partitions = sorted(await prod.partitions_for(out.topic))
            batch = prod.create_batch()
            batch.append(key=out.key, value=out.value, timestamp=None, headers=list(out.headers))
            partition = self._partitioner(out.key, partitions, partitions)
            return await prod.send_batch(batch, out.topic, partition=partition)
        except KafkaError as exc:
            return self._failed_delivery(exc)

    async def _logs_delivered(self, batch: _InFlight) -> None:
        """At-least-once: waits until the batch's changelog records were acknowledged (before its commit), sending
        again what failed during a broker outage; another error stops the worker (nothing committed: the
        batch is routed again after a restart, and its entries journaled again)."""
        pending = dict(enumerate(batch.log_deliveries))
        while pending:
            results = await asyncio.gather(*pending.values(), return_exceptions=True)
            again: dict[int, asyncio.Future[Any]] = {}
            for i, result in zip(list(pending), results, strict=True):
                if not isinstance(result, BaseException):
                    continue
                if not transient(result):
                    raise result
                self.kafka.failed(result, f"delivery to {batch.logged[i].topic}")
                if not await self.kafka.wait_up(self.stop_event.is_set):
                    raise result
                again[i] = await self._send(self._producer, batch.logged[i])
            pending = again

    async def _delivered(self, batch: _InFlight) -> list[OutRecord]:
        """At-least-once: waits until every output of `batch` was acknowledged, and returns the outputs as
        delivered. An output refused as too large is sent again alone, and if refused alone, dead-lettered
        without its value (reason `output_too_large`); one the dead-letter topic refuses stops the worker
        (nothing committed). An output that failed with a `transient` error (the broker unreachable, a
        leader election) is sent again once the broker answers. Other errors stop the worker."""
        prod = self._producer
        outs = list(batch.outs)
        alone: set[int] = set()
        pending = dict(enumerate(batch.deliveries))
        while pending:
            results = await asyncio.gather(*pending.values(), return_exceptions=True)
            again: dict[int, asyncio.Future[Any]] = {}
            resent = 0
            for i, result in zip(list(pending), results, strict=True):
                if not isinstance(result, BaseException):
                    continue
                if isinstance(result, _TOO_LARGE):
                    if i not in alone:
                        alone.add(i)
                    elif outs[i].topic != self.settings.dead_letter_topic:
                        outs[i] = refused_output(batch.records[i], outs[i], result, self.settings)
                        log.warning("output of %s refused as too large: dead-lettered without its value (%s)",
                                    batch.records[i].coordinates, OUTPUT_TOO_LARGE)
                    else:
                        raise ServiceError(
                            f"the dead-letter topic {outs[i].topic!r} refused the record for "
                            f"{batch.records[i].coordinates} as too large: stopping, nothing of the batch "
                            f"committed") from result
                    again[i] = await self._send_alone(prod, outs[i])
                elif transient(result):
                    self.kafka.failed(result, f"delivery to {outs[i].topic}")
                    if not await self.kafka.wait_up(self.stop_event.is_set):
                        raise result  # stopping during the outage: nothing of the batch committed
                    again[i] = await (self._send_alone(prod, outs[i]) if i in alone else self._send(prod, outs[i]))
                    resent += 1
                else:
                    raise result
            if resent:
                log.info("%d outputs not delivered during the outage sent again", resent)
            pending = again
        return outs


# -- entry point ---------------------------------------------------------------------------------


def make_worker(settings: Settings, nd: NearDupFilter | None = None, *,
                observer: BatchObserver | None = None) -> AiokafkaWorker | FaustWorker:
    if settings.runtime == "aiokafka":
        return AiokafkaWorker(settings, nd, observer=observer)
    if settings.runtime == "faust":
        return FaustWorker(settings, nd, observer=observer)
    raise ConfigError(f"unknown runtime {settings.runtime!r}")
