"""The Kafka worker (aiokafka runtime): consume input topics in batches, route each (`stream.router`), produce, commit after acks.

Order (aiokafka runtime, `align`, the default): fetched records wait in per-partition buffers and are
decided in event-time order across the assigned partitions, and no more than `max_skew` ahead of the
other workers of the group (`stream.align`: the partition with the lowest head first, empty partitions
waited for unless idle, the group's marks in the index's Redis). So a verdict does not depend on how
many partitions or workers there are, or on which partition the consumer happened to drain first.

Delivery and commit (`stream.delivery`): at-least-once (default: acks, then the commit) or exactly-once (a
transaction a batch), a strategy chosen once when the worker is made; the loop hands routed batches to it
(`_hand_over`) and lets partitions go only once it has committed what was routed from them (`_let_go`).

Two runtimes share everything but the loop: `aiokafka` (default: a plain consume → route → produce →
commit loop, pipelined: the next batch is routed while the last one is handed over and the one before
committed) and `faust` (a faust-streaming agent over `stream.noack_take`,
acking a batch after its outputs were acknowledged). aiokafka is the default: faster, lower latency,
and its commits are explicit (see bench/kafka_e2e.py and stream/faust_worker.py). `make_worker` picks one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import IllegalStateError, KafkaError, UnknownTopicOrPartitionError

from filters.engine import NearDupFilter
from filters.errors import ConfigError, IndexUnavailable
from stream.align import Aligner, GroupMarks, GroupView, SoloMarks, Taken, lanes_of, open_marks
from stream.changelog import (
    NAMESPACE_HEADER,
    IndexGuard,
    Journal,
    Write,
    encode_records,
    entries_of,
    read_changelog,
    retention,
)
from stream.config import Settings
from stream.delivery import AtLeastOnce, Delivery, ExactlyOnce, Link, Outgoing, capped_batch_bytes
from stream.faust_worker import FaustWorker
from stream.kafka_tools import (
    KafkaRecord,
    admin_client,
    broker_errors,
    client_options,
    create_missing,
    lags_of,
    max_message_bytes,
    partition_positions,
    producer,
    stale_ends,
    transient,
)
from stream.outputs import MAX_OUTPUT_BYTES, OutRecord, arrived, late_output, record_time
from stream.router import BatchObserver, WorkerCore, WorkerStats

log = logging.getLogger("neardup.worker")

# How long a worker held back by the group waits for another worker's mark to move (`GroupMarks.moved`: at
# once when one does) before it reads the marks again anyway (a mark that expired says nothing).
_GROUP_POLL = 0.05
STALL_WARNING = 30.0  # seconds without a record taken, with records waiting, before the worker says why
# Seconds a worker asks again for the max.message.bytes of a topic the broker does not know yet: one that another
# worker created a moment ago is described once its metadata reached every broker (KRaft: milliseconds).
TOPIC_SETTLE = 5.0
# How old (seconds) a partition's end may be for a lag of 0 to count (nothing to fetch): the fetcher reads the end of
# every partition it holds no fetched records of at least every fetch_max_wait_ms (aiokafka's 500 ms); an older one is
# that of a partition whose fetched records waited for the loop (`stale_ends`), and more may have been produced since.
END_FRESH = 1.0
# How often, at most, a worker reads the log starts of partitions whose offsets jumped (`_unread`): a gap is
# mostly what reading committed records skips, or a compacted topic's, and each read is a round trip.
UNREAD_EVERY = 5.0
# Seconds a poll that keeps the consumer in its group during an index outage may wait: a rebalance makes it wait for
# the new assignment, which waits for the batch being retried to let its partitions go (`_Rebalance.revoking`).
KEEPALIVE_WAIT = 0.5
# How long the group waits for a member to rejoin once a rebalance began (aiokafka's default is the session
# timeout): the revocation delivers and commits what was routed first, which may wait for a batch held by the
# index (a Redis stall, a rebuild). A member that rejoins later has lost its partitions to another, so a batch
# it had not committed within half of it is aborted rather than committed late (`_Rebalance.late`).
REBALANCE_TIMEOUT = 60.0


def rebalance_timeout(settings: Settings) -> float:
    """The group's wait for a member to rejoin: `REBALANCE_TIMEOUT`, or the session timeout if longer."""
    return max(REBALANCE_TIMEOUT, settings.session_timeout)



@dataclass(slots=True)
class _Logged:
    """A routed batch's changelog records, kept for a write-back after the index lost its data (`_check_index`)."""

    # The very list routed (an outgoing batch's part), known by its identity: held (so that no other list takes
    # its id) until its outputs are visible.
    records: list[KafkaRecord] | None
    routed: int  # its length
    logged: list[OutRecord]
    visible: bool = False  # its outputs were acknowledged (at-least-once) or committed (exactly-once)


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    """Before partitions are taken away, deliver and commit what was routed from them."""

    def __init__(self, let_go: Callable[[], Awaitable[None]], assigned: Callable[[Any], Awaitable[None]],
                 timeout: float) -> None:
        self.let_go = let_go
        self.timeout = timeout  # the group's wait for this member to rejoin (`rebalance_timeout`)
        self.assigned = assigned
        # Counts assignments; aiokafka fetches nothing of a new assignment before this callback runs.
        self.assignments = 0
        self.revoking = False  # from the revocation to the next assignment: a batch in an outage lets go
        self.revoked_at = math.inf  # when the revocation going on began (monotonic)

    def late(self) -> bool:
        """A revocation going on for so long that the group may have given this member's partitions to
        another: what it has not committed yet must not be committed any more (it is re-read by the owner)."""
        return self.revoking and time.monotonic() - self.revoked_at > self.timeout / 2

    async def on_partitions_revoked(self, revoked: Any) -> None:
        self.revoking = True
        self.revoked_at = time.monotonic()
        await self.let_go()

    async def on_partitions_assigned(self, assigned: Any) -> None:
        self.revoking = False
        self.assignments += 1
        await self.assigned(assigned)
        if assigned:
            log.info("assigned %s", ", ".join(f"{tp.topic}/{tp.partition}" for tp in sorted(assigned)))


class AiokafkaWorker(WorkerCore):
    """consume (getmany) → route (a thread) → produce → await acks → commit.

    Pipelined: as soon as batch N is routed, the next batch is fetched and routed (in a thread) while
    the event loop hands N's outputs to the producer and commits N-1 once its acknowledgements arrived
    (`Delivery.send`, a task; the next batch's hand-over waits for it). Routing never waits for Kafka
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
        # The delivery guarantee, chosen once: its strategy runs while `run` does (with the clients).
        exactly_once = settings.processing_guarantee == "exactly_once"
        self._guarantee: type[AtLeastOnce | ExactlyOnce] = ExactlyOnce if exactly_once else AtLeastOnce
        self.delivery: Delivery | None = None
        self._delivering: asyncio.Future[None] | None = None  # `Delivery.send` of the batch routed last
        # Routed batches waiting for the hand-over going on to finish (`_hand_over`).
        self._queued: list[Outgoing] = []
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: Any = None
        # The producer's record batch size: `batch_bytes`, or less when an output topic accepts less (`run`).
        self.batch_bytes = settings.batch_bytes
        fmt = settings.record_format()
        # Event-time order across the assigned partitions (stream/align.py); off: the order fetched.
        self._format = fmt
        self.aligner = Aligner(lambda r: record_time(r, fmt),
                               max_skew=settings.max_skew, idle_timeout=settings.idle_timeout,
                               buffer=2 * settings.max_batch, ordered=settings.align)
        self.marks: GroupMarks = SoloMarks()  # the group's marks: opened by `run` (in the index's Redis)
        self.group = GroupView(None, complete=False)  # what the group's marks said last (nothing yet)
        self._marked_at = -math.inf
        # After the index lost its data: this worker's mark was gone and it has not written back what it decided
        # yet (it publishes 0 meanwhile: `_rejoin`); and how many times the group's marks were reset (by this
        # worker, or found reset), so that a batch taken against the view before is taken again.
        self._rejoining = False
        self._regroups = 0
        self._took_at: float | None = None  # when a record was last taken (`_stalled`)
        self._stall_told = -math.inf
        self.held_seconds = 0.0  # waited for a partition or the group (a metric)
        self._rewound: set[tuple[str, int]] = set()  # partitions sent back since the loop last looked (`_reread`)
        # Per partition owned, the offset reading goes on from as far as this worker knows (its committed offset
        # when assigned, then after each record returned), and the gaps seen past it: `_unread`.
        self._read_to: dict[tuple[str, int], int] = {}
        self._gaps: dict[tuple[str, int], list[tuple[int, int]]] = {}
        self._gaps_read_at = -math.inf  # when the log starts were last read for them (at most every UNREAD_EVERY)
        self.unread = 0  # records the broker deleted before this worker read them (a metric)
        self._member = settings.group_instance_id or uuid.uuid4().hex[:12]
        self._rebalance = _Rebalance(self._let_go, self._assigned, rebalance_timeout(settings))
        # The index changelog (stream/changelog.py): what each batch made unique, and the guard that rebuilds
        # a shared index that lost its data.
        self.journal: Journal | None = None
        if settings.changelogged:
            self.journal = Journal(self.nd.index)
            self.nd.index = self.journal
        self.guard: IndexGuard | None = None
        self._log_headers = ((NAMESPACE_HEADER, self.nd.config.digest().encode()),)  # of each changelog record
        # The changelog records of the batches routed last: after a restore, the entries of those whose outputs
        # are visible are written back (`_check_index`).
        self._recent: collections.deque[_Logged] = collections.deque()

    def stop(self) -> None:
        self.stop_event.set()

    @property
    def consumer(self) -> AIOKafkaConsumer | None:
        """The consumer once `run` started it (stream/ops.py reads its lag)."""
        return self._consumer

    async def run(self) -> WorkerStats:
        s = self.settings
        async with admin_client(s) as admin:  # one admin connection for the checks at start
            if s.create_topics:
                await create_missing(admin, s, [*s.input_topics, *s.output_topics])
            if self.journal is not None:
                await self._open_changelog(admin)
            self.batch_bytes = await self._batch_size(admin)
        consumer = AIOKafkaConsumer(
            group_id=s.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_poll_records=s.max_batch,
            group_instance_id=s.group_instance_id or None,
            session_timeout_ms=round(s.session_timeout * 1000),
            heartbeat_interval_ms=max(100, round(s.session_timeout * 1000 / 3)),
            rebalance_timeout_ms=round(self._rebalance.timeout * 1000),
            isolation_level=self._guarantee.isolation_level,
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
            options = self._guarantee.producer_options(s)
            # Record batches of `batch_bytes` (aiokafka's default is 16 KB: some 35 outputs of 450 bytes, and a
            # batch, its future and its part of a produce request for each; bench/worker_steady.py), at most
            # what the output topics accept (`_batch_size`).
            async with producer(s, max_request_size=MAX_OUTPUT_BYTES, max_batch_size=self.batch_bytes,
                                **options) as prod:
                self._producer = prod
                self.delivery = self._guarantee(s, Link(
                    consumer=consumer, producer=prod, kafka=self.kafka, stopping=self.stop_event.is_set,
                    acknowledged=self.acknowledged, assignments=lambda: self._rebalance.assignments,
                    late=self._rebalance.late, visible=self._visible,
                    reread=self._reread))
                await self._check_index()  # before the first batch: a lost index is rebuilt first
                await self._loop(consumer)
                # Stopping (not failing): deliver and commit the batch in flight before leaving the group.
                await self._let_go()
        finally:
            delivering, self._delivering = self._delivering, None
            if delivering is not None and not delivering.done():
                delivering.cancel()  # failing: what it had not committed is re-read after a restart
            elif delivering is not None and not delivering.cancelled():
                delivering.exception()  # retrieved: the error that stopped the loop is the one raised
            self.delivery = None  # what it had in flight is re-read after a restart
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

    async def _loop(self, consumer: AIOKafkaConsumer) -> None:
        s = self.settings
        timeout_ms = max(1, round(s.batch_within * 1000))
        stop_wait = asyncio.ensure_future(self.stop_event.wait())
        pending: Taken | None = None  # taken with the last batch (its records prepared meanwhile): next
        pending_assignment = pending_regroups = 0
        held_since: float | None = None  # since when the aligner holds records back (waiting)
        pushed = False  # the group's view came with the news that another worker moved: no need to read it
        try:
            while not self.stop_event.is_set():
                if pending is not None and (pending_assignment != self._rebalance.assignments
                                            or pending_regroups != self._regroups):
                    self._put_back(pending)  # taken against the group's view before a rebalance (or a loss): again
                    pending = None
                elif pending is not None and self._rewound:
                    pending = self._still_owned(pending)
                self._rewound.clear()
                if pending is not None:
                    batch, assignment, regroups, pending = pending, pending_assignment, pending_regroups, None
                else:
                    if not await self._fetch(consumer, 0, stop_wait):
                        break
                    assignment = self._rebalance.assignments
                    batch = await self._take(consumer, refresh=held_since is not None and not pushed)
                    regroups = self._regroups
                    pushed = False
                    if not batch:
                        busy = (self._delivering is not None or bool(self._queued)
                                or (self.delivery is not None and self.delivery.in_flight))
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
                pending_assignment, pending_regroups = self._rebalance.assignments, self._regroups
                following = self.aligner.take(s.max_batch, self.group)
                async with self._lock:
                    # (`revoking`: aiokafka may return a new assignment's records before its callback counts it.)
                    if assignment != self._rebalance.assignments or self._rebalance.revoking:
                        # A rebalance since `batch` was taken: partitions came or went, and with them the group's
                        # view (the other workers' marks). What this worker keeps of both batches is taken again
                        # against the new view: decided as taken, it could run far ahead of a worker that took
                        # over partitions of the same event times.
                        self._put_back(batch, following)
                        following = Taken([], [], [])
                    else:
                        owned = self._still_owned(batch) if self._rewound else batch
                        if owned is not None and not await self._batch(consumer, owned, assignment,
                                                                       following.records, regroups):
                            # Let go during an outage (a rebalance, stopping), or after a loss of the index's data.
                            self._put_back(owned, following)
                            following = Taken([], [], [])
                pending = following if following else None
        finally:
            stop_wait.cancel()

    def _put_back(self, *taken: Taken) -> None:
        """Batches taken and not decided (a rebalance came in between, they were let go during an index outage, or
        the group's marks were reset after a loss of the index's data) are taken again: the aligner forgets them,
        and the consumer reads the partitions this worker still owns again from the first record of them (their
        records buffered after those come again too); the next owner of the others reads them from the committed
        offsets."""
        for batch in taken:
            self.aligner.dropped(batch)
        self._send_back(r for batch in taken for r in batch.records
                        if (r.topic, r.partition) not in self._rewound)  # (sent back further already)

    def _send_back(self, records: Iterable[KafkaRecord]) -> dict[tuple[str, int], int]:
        """The consumer sent back to the first of `records` in each partition this worker owns, and the aligner's
        buffers of those partitions dropped; those first offsets."""
        first: dict[tuple[str, int], int] = {}
        for r in records:
            lane = (r.topic, r.partition)
            if self.aligner.owns(lane):
                first[lane] = min(first.get(lane, r.offset), r.offset)
        for lane, offset in first.items():
            with contextlib.suppress(IllegalStateError):
                assert self._consumer is not None
                self._consumer.seek(TopicPartition(*lane), offset)
        self.aligner.rewind(first)
        self._read_to.update(first)
        return first

    def _still_owned(self, taken: Taken) -> Taken | None:
        """`taken`, taken before a transaction aborted, without the records of partitions sent back (`_reread`)
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
                return await self.kafka.retry(self.stop_event.is_set)
        for tp, msgs in fetched.items():
            if not msgs:
                continue
            lane = (tp.topic, tp.partition)
            self._went_on(lane, msgs[0].offset)
            self._read_to[lane] = msgs[-1].offset + 1
            self.aligner.add(arrived(msgs, self._format))  # each decoded once: its event time, then its routing
        return True

    async def _take(self, consumer: AIOKafkaConsumer, refresh: bool) -> Taken:
        """The next batch in event-time order (`Aligner.take`), after pausing the partitions whose buffer is
        full and resuming the drained ones; the group's marks are read again when `refresh` or due."""
        # Before the ends are read (a fetch answered meanwhile only makes one fresher): a lag of 0 from an old end is
        # not known, a lag above 0 is (an old end is a floor).
        stale = stale_ends(consumer, END_FRESH)
        positions = await partition_positions(consumer,
                                              committed_only=self._guarantee.isolation_level == "read_committed")
        lags = {lane: n for lane, n in lags_of(positions).items() if n or lane not in stale}
        for lane, (position, _) in positions.items():
            if self._went_on(lane, position):  # moved on without returning records
                self._read_to[lane] = position
        if self._gaps and time.monotonic() - self._gaps_read_at >= UNREAD_EVERY:
            await self._unread(consumer)
        pause, resume = self.aligner.flow(lags.get)
        if pause:
            consumer.pause(*(TopicPartition(*lane) for lane in pause))
        if resume:
            consumer.resume(*(TopicPartition(*lane) for lane in resume))
        if refresh or time.monotonic() - self._marked_at > self.settings.session_timeout / 4:
            await self._publish_marks()
            if self._rejoining:
                async with self._lock:
                    await self._rejoin()
        taken = self.aligner.take(self.settings.max_batch, self.group)
        await self._stalled(consumer, taken, lags)
        return taken

    def _went_on(self, lane: tuple[str, int], offset: int) -> bool:
        """Reading of `lane` went on at `offset`: more than one past the offset it had reached (one: an upstream
        transaction's marker) is a gap, for `_unread` to judge. Whether it was."""
        was = self._read_to.get(lane)
        if was is None or offset <= was + 1:
            return False
        self._gaps.setdefault(lane, []).append((was, offset))
        return True

    async def _unread(self, consumer: AIOKafkaConsumer) -> None:
        """Records the broker deleted before this worker read them: the topic's retention (`retention.ms`: by the
        records' timestamps, so a backfill of old records can go at once; or `retention.bytes`) passed the
        committed offset of a partition whose reading lagged, and the consumer went on from the oldest offset left
        (`auto_offset_reset` earliest). They are never routed: said in one line each time, and counted (a
        metric). A gap in the offsets is also what reading committed records skips (an upstream's aborted
        transactions): the partition's log start says which."""
        gaps, self._gaps, self._gaps_read_at = self._gaps, {}, time.monotonic()
        tps = [TopicPartition(*lane) for lane in gaps]
        try:
            starts = await asyncio.wait_for(consumer.beginning_offsets(tps), 5.0)
        except (KafkaError, TimeoutError, IllegalStateError) as exc:
            log.debug("log start offsets not read: %r", exc)
            return
        for tp in tps:
            start = starts.get(tp)
            for was, now in gaps[(tp.topic, tp.partition)]:
                if start is None or start <= was:
                    continue
                lost = min(start, now) - was
                self.unread += lost
                log.warning("%s/%d: %d records (offsets %d to %d) were deleted by the broker before this worker read "
                            "them (the topic's retention passed them: retention.ms counts from the records' "
                            "timestamps): they are not routed; reading went on from offset %d", tp.topic,
                            tp.partition, lost, was, was + lost - 1, now)

    async def _stalled(self, consumer: AIOKafkaConsumer, taken: Taken, lags: dict[tuple[str, int], int]) -> None:
        """A warning, every STALL_WARNING seconds, while nothing is taken though a partition has records
        waiting (buffered; not returned by the consumer yet: behind its high-water mark, paused, or with no
        position or end known; or returned past the committed offset and neither buffered nor routed): what
        holds each partition, so that a stall explains itself where it happens. Idle without a backlog: silent."""
        now = time.monotonic()
        if taken or self._took_at is None:
            self._took_at = now
            return
        if now - self._took_at < STALL_WARNING or now - self._stall_told < STALL_WARNING:
            return
        states = self.aligner.lane_states()
        behind = {}
        for tp in consumer.assignment():
            lane = (tp.topic, tp.partition)
            high = consumer.highwater(tp)
            try:
                position: int | None = await asyncio.wait_for(consumer.position(tp), 1.0)
                committed: int | None = await asyncio.wait_for(consumer.committed(tp), 1.0)
            except (IllegalStateError, AssertionError, TimeoutError, KafkaError):
                position = committed = None
            buffered, state = states.get(lane, (0, "not in the aligner"))
            paused = tp in consumer.paused()
            # Fetched past what was committed, with nothing buffered nor in flight: records the worker lost track of.
            dropped = committed is not None and position is not None and committed < position and not buffered
            if buffered or dropped or paused or position is None or high is None or high > position:
                behind[f"{tp.topic}/{tp.partition}"] = (
                    f"position {position}, committed {committed}, high-water {high}, stable "
                    f"{consumer.last_stable_offset(tp)}, lag seen {lags.get(lane)}{', consumer paused' if paused else ''}; "
                    f"{state}")
        if behind:
            self._stall_told = now
            log.warning("nothing routed for %.0fs (waiting for: %s; group: %s): %s", now - self._took_at,
                        taken.waiting or "records", self.group, behind)

    async def _publish_marks(self) -> None:
        """This worker's low mark and partitions to the group, and the group's view back (`GroupMarks`). While the
        index's Redis is down, routing waits for the index (`on_index_error` block) and the last view holds: a
        worker that went on alone would take a batch far ahead of the others, decided as soon as the index is
        back, before it hears of them again. Records passed unchecked meanwhile need no order: the worker goes
        on alone. A mark found gone (`GroupView.rejoined`) is published as 0 until `_rejoin`."""
        try:
            low = 0.0 if self._rejoining else self.aligner.low_mark()
            self.group = await self.marks.publish(low, self.aligner.lanes(), self._every())
            if self.group.rejoined:
                self._rejoining = True
                self._regroups += 1
        except IndexUnavailable as exc:
            log.debug("event-time marks not shared while the index is unavailable: %s", exc)
            if self.settings.on_index_error == "unchecked":
                self.group = GroupView(None)
            else:
                await asyncio.sleep(_GROUP_POLL)  # held by the last view meanwhile: no busy retry of the marks
        self._marked_at = time.monotonic()

    async def _rejoin(self) -> None:
        """This worker's mark was gone (the index's Redis lost its data, or another worker reset the marks after
        finding the index lost): what it decided may be missing from the index, rebuilt from a changelog that does
        not hold its last batches yet. Until it has checked the index and written those back (`_check_index`), its
        mark stays 0 and the group waits: a worker that went on meanwhile would decide copies of them as new, and
        their originals, decided again after a crash of this one, as their duplicates. Called with `_lock` held."""
        for _ in range(3):  # a reset met by the check itself: once more (each loss is met once)
            if await self._check_index() is None:
                return  # the index is out: published as 0 until a check goes through
            self._rejoining = False
            await self._publish_marks()
            if not self._rejoining:
                return

    def _every(self) -> list[tuple[str, int]]:
        """Every partition of the input topics (as the consumer's metadata knows them)."""
        consumer = self._consumer
        if consumer is None:
            return []
        return [(topic, p) for topic in self.settings.input_topics
                for p in sorted(consumer.partitions_for_topic(topic) or ())]

    async def _assigned(self, tps: Any) -> None:
        """A new assignment: the aligner starts afresh and the group hears of it at the loop's next take (until
        every member has said what it owns, nobody takes anything: `GroupView.complete`)."""
        self.aligner.assign(lanes_of(tps))
        self._read_to, self._gaps = {}, {}
        consumer, tps = self._consumer, sorted(tps)
        if consumer is not None and tps:
            with contextlib.suppress(KafkaError, TimeoutError, IllegalStateError):  # then: gaps from the first fetch on
                offsets = await asyncio.wait_for(asyncio.gather(*(consumer.committed(tp) for tp in tps)), 2.0)
                self._read_to = {(tp.topic, tp.partition): o for tp, o in zip(tps, offsets, strict=True) if o is not None}
        if self.settings.align:
            # The group's view from before the rebalance is another group's: until this worker hears the new one
            # (the index's Redis may be down), it takes nothing. It is published by the loop's next take, not
            # here: aiokafka sends no heartbeat until this callback returns, and a Redis that stalls would
            # hold it past the session timeout (the member expelled, its commits then doubling another's).
            self.group = GroupView(None, complete=False)
            self._marked_at = -math.inf

    async def _batch(self, consumer: AIOKafkaConsumer, taken: Taken, assignment: int = 0,
                     following: Sequence[KafkaRecord] = (), regroups: int = 0) -> bool:
        """Routes `taken` (taken when `_regroups` was `regroups`) and hands its outputs over; False if it let it go
        unrouted: stopping, or its partitions revoked, while the index was out; or the group's marks reset since it
        was taken (the index lost its data: it is taken again against the group's new view)."""
        def pause() -> None:
            consumer.pause(*consumer.assignment())

        def resume() -> None:
            consumer.resume(*consumer.assignment())
            consumer.pause(*(TopicPartition(*lane) for lane in self.aligner.paused()))

        async def keepalive() -> None:
            await self._drain()  # what was routed before the outage need not wait for the index
            if self._rebalance.revoking:
                return  # the retry lets the batch go: its partitions are being revoked
            # Polling keeps the consumer in its group (its partitions paused: it returns little, kept as fetched).
            # A rebalance makes the poll wait for the new assignment, which waits for this batch to let its
            # partitions go: waited for only so long, then the retry sees `revoking` and lets the batch go.
            timer = asyncio.ensure_future(asyncio.sleep(KEEPALIVE_WAIT))
            try:
                await self._fetch(consumer, 0, timer)
            finally:
                timer.cancel()

        records = taken.records
        if self.journal is not None:
            self.journal.take()  # what a failed attempt left (its entries come again as replays)
        if self.aligner.ordered:
            # The window's clock is the group's low watermark: nobody decides anything older any more (a late
            # record is decided against its worker's own window), so a worker running ahead never makes the
            # shared index forget what one behind still needs.
            low = [m for m in (self.aligner.low_mark(), self.group.low) if m is not None]
            if low:
                self.nd.index.expire(min(low))

        async def again() -> bool:
            # The index lost its data since the batch was taken: under alignment the group's marks were reset (by
            # this check, or another worker's), and the batch is taken again against the new view (once every
            # worker has written back: `_rejoin`).
            lost = await self._check_index()
            return not (self.aligner.ordered and (lost or self._regroups != regroups))

        rebalance = self._rebalance
        outs = await self.router.route(records, following=following, pause=pause, resume=resume,
                                       keepalive=keepalive,
                                       stopping=lambda: self.stop_event.is_set() or rebalance.revoking,
                                       before_retry=again if self.guard is not None else None)
        if outs is None:
            # Stopping, or partitions revoked, during an index outage, or taken again after a loss of the index's
            # data (`again`): nothing of this batch produced or committed.
            return False
        logged = self._logged(records)
        self.aligner.decided(taken)
        if self.aligner.ordered:
            await self._publish_marks()  # decided: the group may move past these records
        if any(taken.late):
            outs = [late_output(o, behind) if behind else o for o, behind in zip(outs, taken.late, strict=True)]
        await self._hand_over(Outgoing(records, outs, assignment, logged))
        if self._rejoining:
            await self._rejoin()  # after the hand-over: this batch is delivered, and written back (`_lock` is held)
        return True

    async def _batch_size(self, admin: AIOKafkaAdminClient) -> int:
        """The producer's record batch size: `batch_bytes`, lowered to the smallest max.message.bytes of the
        topics this producer writes to (a topic refuses a larger batch whole, and under exactly-once that
        stops the worker). Not permitted to read them (DescribeConfigs): `batch_bytes`, with a warning. A topic
        another worker created a moment ago may not be described yet (unknown to the broker that answers):
        asked again, for up to `TOPIC_SETTLE` seconds."""
        s = self.settings
        topics = [*s.output_topics, *([s.changelog_name] if self.journal is not None else [])]
        deadline = time.monotonic() + TOPIC_SETTLE
        try:
            while True:
                try:
                    limits = await max_message_bytes(admin, topics)
                    break
                except UnknownTopicOrPartitionError:
                    if time.monotonic() >= deadline:
                        raise
                    await asyncio.sleep(0.1)
        except (KafkaError, TimeoutError) as exc:
            log.warning("cannot read the max.message.bytes of the output topics (%s): record batches stay at "
                        "batch_bytes %d, which a topic with a smaller max.message.bytes refuses (allow "
                        "DescribeConfigs on the output topics)", str(exc) or type(exc).__name__, s.batch_bytes)
            return s.batch_bytes
        size, topic = capped_batch_bytes(s.batch_bytes, limits)
        if topic is not None:
            log.info("record batches of up to %d bytes: batch_bytes %d lowered to the max.message.bytes of topic %s",
                     size, s.batch_bytes, topic)
        return size

    async def _open_changelog(self, admin: AIOKafkaAdminClient) -> None:
        """The changelog topic (created with time retention: the window plus a margin), and the index's guard."""
        s = self.settings
        keep_ms = str(round(retention(s.window) * 1000))
        if s.create_topics:
            await create_missing(admin, s, [s.changelog_name], configs={
                "cleanup.policy": "delete", "retention.ms": keep_ms,
                "segment.ms": str(max(60_000, round(s.window * 1000 / 4))),
                # Its records are read back only by a restore, which needs every one a commit covers.
                "min.insync.replicas": "1" if s.replication_factor < 3 else "2"})
        self.guard = IndexGuard(s.index, namespace=self.nd.config.digest(), window=s.window, member=self._member)

    async def _check_index(self) -> bool | None:
        """A shared index that lost its window (its marker is gone: found before the first batch, or by a
        batch's lookup or insert, `IndexLost`) is rebuilt from the changelog before routing goes on: what was
        routed is delivered first, then one worker of the group restores and the others wait for it. Then
        each writes back the entries of the batches it delivered meanwhile: inserted before the loss, their
        changelog records may have been committed after the restorer read their partition. Under event-time
        alignment a loss also resets the group's marks, and the batch being routed is taken again: the group
        goes on once every live worker has written back (`_rejoin`), in event-time order again. Whether a loss
        (or a rebuild by another worker) was met; None if the index could not be checked (unavailable)."""
        guard = self.guard
        if guard is None:
            return False
        s = self.settings
        index = self.nd.index

        async def read(write: Write) -> int:
            # Records of up to RECORD_BYTES: fetches of many at a time.
            reader = AIOKafkaConsumer(enable_auto_commit=False, isolation_level="read_committed",
                                      auto_offset_reset="earliest", max_partition_fetch_bytes=8 * 1024 * 1024,
                                      fetch_max_bytes=32 * 1024 * 1024, **client_options(s))
            with broker_errors(s):
                await reader.start()
                try:
                    since = round((time.time() - retention(s.window)) * 1000)
                    partitions = sorted(await self._producer.partitions_for(s.changelog_name))
                    return await read_changelog(reader, s.changelog_name, partitions, self.nd.config.digest(), since,
                                                write)
                finally:
                    await reader.stop()

        delivered: list[OutRecord] = []

        async def deliver() -> None:
            await self._drain()
            # Those of an aborted transaction are not: their records are routed again, and journaled then. Those of
            # an earlier assignment are (committed before its partitions went, maybe after the restore read them).
            delivered.extend(o for batch in self._recent if batch.visible for o in batch.logged)

        losses = guard.losses
        try:
            lost = await guard.ensure(read, index.restore, deliver)
            if lost and delivered:
                # Beside the others, who route again (a guarded restore): live ids are kept as they are.
                await asyncio.to_thread(index.restore, [entries_of([(o.key or b"", o.value or b"") for o in delivered])])
            if lost and self.aligner.ordered:
                self._marked_at = -math.inf  # the next take publishes, and rejoins
                self._regroups += 1
                await self.marks.reset()
            return lost
        except IndexUnavailable as exc:
            # The router meets the outage itself (its policy: block, or pass unchecked); a lookup finds the
            # index without its marker again if it came back empty, and the rebuild starts over.
            if guard.losses > losses:
                log.warning("rebuilding the index from the changelog, or writing back what this worker routed, "
                            "failed: %s; a lookup that finds the index without its marker starts the rebuild again",
                            exc)
            else:
                log.debug("the index's marker could not be read: %s", exc)
            return None

    def _logged(self, records: list[KafkaRecord]) -> list[OutRecord]:
        """The changelog's records of the entries the batch of `records` just routed made unique; those of the
        batches routed last (some 3 × max_batch records: what may not be committed yet) are kept."""
        if self.journal is None:
            return []
        topic, headers = self.settings.changelog_name, self._log_headers
        logged = [OutRecord(topic, key, value, headers) for key, value in encode_records(self.journal.take())]
        recent = self._recent
        recent.append(_Logged(records, len(records), logged))
        while sum(b.routed for b in recent) - recent[0].routed >= 3 * self.settings.max_batch:
            recent.popleft()
        return logged

    def _visible(self, batch: Outgoing) -> None:
        """`batch`'s outputs are visible to consumers (`Link.visible`): the entries of its routed batches are
        written back after a restore."""
        parts = {id(part) for part in batch.parts or [batch.records]}
        for routed in self._recent:
            if routed.records is not None and id(routed.records) in parts:
                routed.visible, routed.records = True, None

    async def _hand_over(self, batch: Outgoing) -> None:
        """Queues a routed batch for delivery. While the previous hand-over is still going on (its acks, or
        under exactly-once its commit), routed batches queue up and go together in the next one (one
        transaction for all): small batches, as the group moves in lockstep under event-time alignment,
        do not each pay a commit. Outputs stay in input order."""
        if self._queued and self._queued[0].assignment != batch.assignment:
            await self._send_queued()  # fetched under another assignment: a transaction of its own
        self._queued.append(batch)
        going = self._delivering is not None and not self._delivering.done()
        if going and sum(len(q.records) for q in self._queued) < self.settings.max_batch:
            return
        await self._send_queued()

    async def _send_queued(self) -> None:
        """The queued batches handed to the producer as one (after the hand-over before them): the batch
        before is committed meanwhile (`Delivery.send`), while the next batch is routed."""
        await self._settle()
        queued, self._queued = self._queued, []
        if not queued:
            return
        assert self.delivery is not None
        self._delivering = asyncio.ensure_future(self.delivery.send(Outgoing.joined(queued)))

    async def _settle(self) -> None:
        """Waits for the last routed batch's hand-over (and raises what it raised)."""
        delivering, self._delivering = self._delivering, None
        if delivering is not None:
            await delivering

    async def _drain(self) -> None:
        """Everything routed so far handed over, acknowledged and committed."""
        await self._send_queued()
        await self._settle()
        if self.delivery is not None:
            await self.delivery.commit()

    async def _let_go(self) -> None:
        """Before this worker's partitions may go to another member (revoked, or the worker leaving):
        everything routed is delivered and committed, and the group shows those commits."""
        delivery = self.delivery
        if delivery is None:
            return  # not running: nothing routed
        async with self._lock:
            await self._drain()
        await delivery.release()

    def _reread(self, records: Sequence[KafkaRecord]) -> None:
        """Records whose outputs were aborted: where this worker still owns their partitions, the consumer
        is sent back to them (and what the aligner buffered, and the batches queued behind them, of those
        partitions, are dropped: they come again); the others' owner reads them from the committed offsets."""
        first = self._send_back([*records, *(r for q in self._queued for r in q.records)])
        self._queued = [q for q in self._queued if not any((r.topic, r.partition) in first for r in q.records)]
        self._rewound |= set(first)


# -- entry point ---------------------------------------------------------------------------------


def make_worker(settings: Settings, nd: NearDupFilter | None = None, *,
                observer: BatchObserver | None = None) -> AiokafkaWorker | FaustWorker:
    if settings.runtime == "aiokafka":
        return AiokafkaWorker(settings, nd, observer=observer)
    if settings.runtime == "faust":
        return FaustWorker(settings, nd, observer=observer)
    raise ConfigError(f"unknown runtime {settings.runtime!r}")
