"""Delivery and commit of routed batches, two strategies behind one Protocol (`Delivery`): at-least-once and exactly-once.

At-least-once (`AtLeastOnce`, the default): a batch's offsets are committed only after every output record of
the batch has been acknowledged by the broker (acks=all). A worker that dies between the two re-reads the
batch after a restart; with a shared index (Redis) the engine gives a replayed message the verdict it got
before (an indexed unique one is found under its own id: unique, method "replay"; a duplicate finds the
memo of its verdict, whatever left the buckets since). With `memory://` the index dies with the worker, so replays
after a restart are checked against an empty index: use Redis for `serve`; memory:// is for trying out.
During a Kafka outage (`stream.kafka_health`) a delivery that failed meanwhile is sent again before its
batch is committed. An output that its topic refuses as too large is dead-lettered without its value
(reason `output_too_large`) instead of stopping the worker.

Exactly-once (`ExactlyOnce`, `processing_guarantee = "exactly_once"`, aiokafka runtime only): each batch's
outputs and its consumed offsets go in one Kafka transaction (a transactional producer,
`send_offsets_to_transaction`, then commit), so a reader with isolation.level=read_committed sees every
input's output exactly once, crash or not; a batch interrupted by a crash is aborted and re-read. The
transactional id is `neardup-<group_id>-<group_instance_id>`: with static membership a restarted worker
fences its dead predecessor and aborts its open transaction at once (without one the id is random, and the
dead transaction holds read_committed readers back until the broker's transaction timeout, 60 s). Before it
lets partitions go (revoked, or leaving), a worker waits until the group shows its transactions' offsets:
they land only with the commit marker, a little after the commit returned, and aiokafka's offset fetch
does not wait for them (no require_stable), so the next owner would start before the last batch. aiokafka
commits transactional offsets without the group generation (no KIP-447 fencing): a worker that stalls
past its session timeout and then commits could still repeat a batch that its successor also routed.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError
from aiokafka.partitioner import DefaultPartitioner

from filters.errors import ServiceError
from stream.config import Settings
from stream.kafka_health import KafkaHealth
from stream.kafka_tools import TOO_LARGE, KafkaRecord, broker_errors, map_kafka_error, transient
from stream.outputs import OUTPUT_TOO_LARGE, OutRecord, refused_output

log = logging.getLogger("neardup.worker")



def capped_batch_bytes(batch_bytes: int, limits: Mapping[str, int]) -> tuple[int, str | None]:
    """The producer's record batch size for output topics with these `max.message.bytes` (topic → bytes):
    `batch_bytes`, lowered to the smallest limit, and the topic that lowered it (None: not lowered).

    No overhead is taken off: aiokafka's `max_batch_size` bounds the whole record batch, its 61-byte header
    included, which is what the broker compares with max.message.bytes (a batch of exactly the limit is
    accepted, one byte more refused: tests/test_worker.py). A record larger than the batch still goes in a
    batch of its own, and its topic may refuse it (at-least-once: dead-lettered, `AtLeastOnce._delivered`)."""
    if not limits:
        return batch_bytes, None
    topic = min(limits, key=lambda t: (limits[t], t))
    return (limits[topic], topic) if limits[topic] < batch_bytes else (batch_bytes, None)


@dataclass
class Outgoing:
    """Routed batches handed over as one: their records and outputs in input order, and the index changelog's records."""

    records: list[KafkaRecord]
    outs: list[OutRecord]
    assignment: int = 0  # the worker's assignment count when the records were fetched
    logged: list[OutRecord] = field(default_factory=list)  # the index changelog's records of the batches
    parts: list[list[KafkaRecord]] = field(default_factory=list)  # the routed batches it joins (empty: one)

    @classmethod
    def joined(cls, batches: Sequence[Outgoing]) -> Outgoing:
        """`batches` (fetched under one assignment) as one, in order."""
        if len(batches) == 1:
            return batches[0]
        return cls([r for b in batches for r in b.records], [o for b in batches for o in b.outs], batches[0].assignment,
                   [o for b in batches for o in b.logged], [b.records for b in batches])


@dataclass(frozen=True, slots=True)
class Link:
    """What a delivery strategy uses of its worker: the clients, and the worker's own part of each step."""

    consumer: AIOKafkaConsumer
    producer: Any  # an AIOKafkaProducer: transactional under exactly-once
    kafka: KafkaHealth  # at-least-once: an outage is noted there and waited out
    stopping: Callable[[], bool]
    # Called per routed batch once its outputs were acknowledged, before its commit (stats, the observer).
    acknowledged: Callable[[Sequence[KafkaRecord], Sequence[OutRecord]], Awaitable[None]]
    assignments: Callable[[], int]  # exactly-once: the worker's assignment count now
    reread: Callable[[Sequence[KafkaRecord]], None]  # exactly-once: the records of an aborted transaction
    # exactly-once: the partitions' revocation has gone on so long that the group may have given them to
    # another member, who reads them from the committed offsets: what is not committed yet must not be.
    late: Callable[[], bool] = lambda: False
    # Called per batch handed over once its outputs are visible to consumers: acknowledged (at-least-once, the
    # index changelog's records too), committed (exactly-once).
    visible: Callable[[Outgoing], None] = lambda batch: None


class Delivery(Protocol):
    """How routed batches reach their output topics and their input offsets get committed. One batch is in
    flight at a time: handing one over commits the one before."""

    @property
    def in_flight(self) -> bool:
        """A batch was handed over and is not committed yet."""
        ...

    async def send(self, batch: Outgoing) -> None:
        """Hands `batch`'s outputs to the producer and commits the batch sent before it; `batch` is then in flight."""
        ...

    async def commit(self) -> None:
        """The batch in flight (if any) acknowledged and committed."""
        ...

    async def release(self) -> None:
        """Before partitions go to another member: waits until the group shows what was committed."""
        ...


@dataclass
class _InFlight:
    """An outgoing batch handed to the producer but not yet acknowledged."""

    batch: Outgoing
    deliveries: list[asyncio.Future[Any]]  # one per output (the outputs of a record batch share one)
    log_deliveries: list[asyncio.Future[Any]]


def offsets_of(records: Sequence[KafkaRecord]) -> dict[TopicPartition, int]:
    """The offsets to commit once `records` are done: the next one of each partition."""
    last: dict[tuple[str, int], int] = {}
    for r in records:
        lane = (r.topic, r.partition)
        if r.offset >= last.get(lane, -1):
            last[lane] = r.offset
    return {TopicPartition(topic, partition): offset + 1 for (topic, partition), offset in last.items()}


async def _acknowledged(link: Link, batch: Outgoing) -> None:
    start = 0
    for part in batch.parts or [batch.records]:  # per routed batch: the very list that was routed
        outs = batch.outs[start:start + len(part)]
        await link.acknowledged(part, outs)
        start += len(part)


class Sender:
    """Hands outputs to the producer in record batches of our own. With `keep_failures` (at-least-once), an
    outage or a too-large refusal while handing a record over becomes that delivery's error, settled when the
    acks are awaited; anything else (and anything in a transaction) is raised."""

    def __init__(self, producer: Any, *, keep_failures: bool) -> None:
        self.producer = producer
        self.keep_failures = keep_failures
        self._partitioner = DefaultPartitioner()  # what `send` uses: keyed records land where they would

    async def send_all(self, outs: Sequence[OutRecord]) -> list[asyncio.Future[Any]]:
        """Hands `outs` to the producer in record batches of our own, one open per topic partition (as
        `send` would partition them): a delivery per batch, shared by its outputs, instead of a coroutine,
        a future and a partitioner call per record (≈ 3 times less producer CPU a record). An output
        that fits no batch goes through `send`."""
        prod = self.producer
        deliveries: list[asyncio.Future[Any] | None] = [None] * len(outs)
        open_batches: dict[tuple[str, int], tuple[Any, list[int]]] = {}
        partitions: dict[str, tuple[list[int], list[int]]] = {}

        async def close(topic: str, partition: int) -> None:
            batch, members = open_batches.pop((topic, partition))
            try:
                delivery = await prod.send_batch(batch, topic, partition=partition)
            except KafkaError as exc:
                delivery = self._failed(exc)
            for i in members:
                deliveries[i] = delivery

        for i, out in enumerate(outs):
            if out.key is None and out.value is None:
                deliveries[i] = await self.send_alone(out)
                continue
            known = partitions.get(out.topic)
            if known is None:
                try:
                    every = sorted(await prod.partitions_for(out.topic))
                except KafkaError as exc:
                    deliveries[i] = self._failed(exc)
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
                deliveries[i] = await self.send(out)  # larger than a batch: `send` decides
                continue
            open_batches[place] = (batch, [i])
        for place in list(open_batches):
            await close(*place)
        return deliveries  # type: ignore[return-value]

    async def hand_over(self, batch: Outgoing) -> _InFlight:
        """`batch`'s outputs and changelog records handed to the producer."""
        deliveries = await self.send_all([*batch.outs, *batch.logged])
        n = len(batch.outs)
        return _InFlight(batch, deliveries[:n], deliveries[n:])

    async def send(self, out: OutRecord) -> asyncio.Future[Any]:
        """Hands `out` to the producer."""
        if out.key is None and out.value is None:
            # A record without a key dead-lettered without its value: `send` refuses a record with
            # neither, a record batch of its own takes it.
            return await self.send_alone(out)
        try:
            return await self.producer.send(out.topic, value=out.value, key=out.key, headers=list(out.headers))
        except KafkaError as exc:
            return self._failed(exc)

    async def send_alone(self, out: OutRecord) -> asyncio.Future[Any]:
        """`out` in a record batch of its own, to the partition `send` would choose: the broker refuses a
        batch as a whole, so small records batched with a too-large one were refused with it."""
        prod = self.producer
        try:
            partitions = sorted(await prod.partitions_for(out.topic))
            batch = prod.create_batch()
            batch.append(key=out.key, value=out.value, timestamp=None, headers=list(out.headers))
            partition = self._partitioner(out.key, partitions, partitions)
            return await prod.send_batch(batch, out.topic, partition=partition)
        except KafkaError as exc:
            return self._failed(exc)

    def _failed(self, exc: KafkaError) -> asyncio.Future[Any]:
        if not self.keep_failures or not (transient(exc) or isinstance(exc, TOO_LARGE)):
            raise exc
        failed: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        failed.set_exception(exc)
        return failed


class AtLeastOnce:
    """Acks awaited (outputs not delivered during an outage sent again, too-large outputs dead-lettered),
    then `consumer.commit`. A batch's outputs go to the producer before the batch before it is committed:
    their acks overlap."""

    isolation_level: ClassVar[str] = "read_uncommitted"

    def __init__(self, settings: Settings, link: Link) -> None:
        self.settings = settings
        self.link = link
        self.sender = Sender(link.producer, keep_failures=True)
        self._in_flight: _InFlight | None = None
        # Outputs sent again alone because their record batch was refused as too large (a topic's
        # max.message.bytes below the batch size, or a record too large for its topic among them).
        self.resent_alone = 0

    @staticmethod
    def producer_options(settings: Settings) -> dict[str, Any]:
        return {}

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    async def send(self, batch: Outgoing) -> None:
        with broker_errors(self.settings):
            handed = await self.sender.hand_over(batch)
        await self.commit()  # the batch before: its acks arrived while this one was routed
        self._in_flight = handed

    async def commit(self) -> None:
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return
        s = self.settings
        with broker_errors(s):
            flight.batch.outs = await self._delivered(flight)
            await self._logs_delivered(flight)
        await _acknowledged(self.link, flight.batch)
        self.link.visible(flight.batch)
        try:
            await self.link.consumer.commit(offsets_of(flight.batch.records))
        except (CommitFailedError, IllegalStateError) as exc:
            # The group moved on (rebalance): whoever owns the partitions now re-reads this batch.
            log.warning("commit failed, the batch will be re-read by the partitions' new owner: %s", exc)
        except KafkaError as exc:
            raise map_kafka_error(exc, s.kafka_bootstrap) from exc

    async def release(self) -> None:
        """Nothing to wait for: the group has a consumer's commit when it returns."""

    async def _logs_delivered(self, flight: _InFlight) -> None:
        """Waits until the batch's changelog records were acknowledged (before its commit), sending again what
        failed during a broker outage; another error stops the worker (nothing committed: the batch is
        routed again after a restart, and its entries journaled again)."""
        kafka, logged = self.link.kafka, flight.batch.logged
        pending = dict(enumerate(flight.log_deliveries))
        while pending:
            results = await asyncio.gather(*pending.values(), return_exceptions=True)
            failed = [(i, r) for i, r in zip(list(pending), results, strict=True) if isinstance(r, BaseException)]
            for i, result in failed:
                if not transient(result):
                    raise result
                kafka.failed(result, f"delivery to {logged[i].topic}")
            if failed and not await kafka.retry(self.link.stopping):  # once a round (a record batch's share a future)
                raise failed[0][1]
            pending = {i: await self.sender.send(logged[i]) for i, _ in failed}

    async def _delivered(self, flight: _InFlight) -> list[OutRecord]:
        """Waits until every output of the batch was acknowledged (`settle_outputs`), and returns the outputs as
        delivered."""
        outs = list(flight.batch.outs)
        self.resent_alone += await settle_outputs(flight.deliveries, outs, flight.batch.records, self.sender.send,
                                                  self.sender.send_alone, self.link.kafka, self.link.stopping,
                                                  self.settings)
        return outs


async def settle_outputs(deliveries: Sequence[asyncio.Future[Any]], outs: list[OutRecord],
                         records: Sequence[KafkaRecord], send: Callable[[OutRecord], Awaitable[asyncio.Future[Any]]],
                         send_alone: Callable[[OutRecord], Awaitable[asyncio.Future[Any]]], kafka: KafkaHealth,
                         stopping: Callable[[], bool], settings: Settings) -> int:
    """Waits until every output (`outs[i]`, handed over as `deliveries[i]`) was acknowledged, `outs` updated in
    place as delivered; returns how many were sent again alone. For both runtimes, at-least-once: an output
    refused as too large is sent again alone (`send_alone`: a record batch of its own, as a batch is refused
    whole, maybe for another record's size), and if refused alone, dead-lettered without its value (reason
    `output_too_large`); one the dead-letter topic refuses stops the worker (nothing of the batch committed).
    An output that failed with a `transient` error (the broker unreachable or hung, a leader election) is sent
    again once the broker answers (`KafkaHealth.retry`). Other errors stop the worker."""
    alone: set[int] = set()
    pending = dict(enumerate(deliveries))
    while pending:
        results = await asyncio.gather(*pending.values(), return_exceptions=True)
        again: dict[int, asyncio.Future[Any]] = {}
        split = 0
        outage: list[tuple[int, BaseException]] = []
        for i, result in zip(list(pending), results, strict=True):
            if not isinstance(result, BaseException):
                continue
            if isinstance(result, TOO_LARGE):
                if i not in alone:
                    alone.add(i)
                    split += 1
                elif outs[i].topic != settings.dead_letter_topic:
                    outs[i] = refused_output(records[i], outs[i], result, settings)
                    log.warning("output of %s refused as too large: dead-lettered without its value (%s)",
                                records[i].coordinates, OUTPUT_TOO_LARGE)
                else:
                    raise ServiceError(
                        f"the dead-letter topic {outs[i].topic!r} refused the record for {records[i].coordinates} "
                        "as too large: stopping, nothing of the batch committed") from result
                again[i] = await send_alone(outs[i])
            elif transient(result):
                kafka.failed(result, f"delivery to {outs[i].topic}")
                outage.append((i, result))
            else:
                raise result
        # Once a round, not once an output: the outputs of a record batch share its future, and its error.
        if outage and not await kafka.retry(stopping):
            raise outage[0][1]  # stopping during the outage: nothing of the batch committed
        for i, _ in outage:
            again[i] = await (send_alone(outs[i]) if i in alone else send(outs[i]))
        if outage:
            log.info("%d outputs not delivered during the outage sent again", len(outage))
        if split:
            log.info("%d outputs sent again one by one: their record batches were refused as too large", split)
        pending = again
    return len(alone)


class ExactlyOnce:
    """One transaction a batch: begin, the outputs, `send_offsets_to_transaction`, commit; aborted (and the
    records re-read) when the partitions were reassigned meanwhile. Partitions go only once the group shows
    the committed offsets (`release`)."""

    isolation_level: ClassVar[str] = "read_committed"  # an upstream's aborted transactions are not input

    def __init__(self, settings: Settings, link: Link) -> None:
        self.settings = settings
        self.link = link
        self.sender = Sender(link.producer, keep_failures=False)  # any failure: the transaction is not committed
        self._in_flight: _InFlight | None = None
        # Offsets committed in transactions that the group coordinator may not show yet.
        self.unconfirmed: dict[TopicPartition, int] = {}

    @staticmethod
    def producer_options(settings: Settings) -> dict[str, Any]:
        return {"transactional_id": f"neardup-{settings.group_id}-{settings.group_instance_id or uuid.uuid4().hex[:12]}"}

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    async def send(self, batch: Outgoing) -> None:
        await self.commit()  # one transaction at a time: the batch before first
        with broker_errors(self.settings):
            await self.link.producer.begin_transaction()
            self._in_flight = await self.sender.hand_over(batch)

    async def commit(self) -> None:
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return
        s, batch, prod = self.settings, flight.batch, self.link.producer
        with broker_errors(s):
            await asyncio.gather(*flight.deliveries, *flight.log_deliveries)
        if batch.assignment != self.link.assignments() or self.link.late():
            # The partitions were reassigned since the batch was fetched (or, late in a revocation, may have
            # been): their owner now (maybe this worker) re-reads it from the committed offsets, so committing it
            # too would repeat it.
            log.warning("partitions reassigned while a batch of %d records was in flight: its transaction is "
                        "aborted, the records are re-read by their owner", len(batch.records))
            with broker_errors(s):
                await prod.abort_transaction()
            self.link.reread(batch.records)
            return
        await _acknowledged(self.link, batch)
        offsets = offsets_of(batch.records)
        with broker_errors(s):
            await prod.send_offsets_to_transaction(offsets, s.group_id)
            await prod.commit_transaction()
        self.link.visible(batch)
        for tp, offset in offsets.items():
            self.unconfirmed[tp] = max(self.unconfirmed.get(tp, 0), offset)

    async def release(self) -> None:
        """Waits until the group coordinator answers the offsets our transactions committed.

        A transaction's offsets reach the group when the transaction coordinator writes its commit marker,
        after `commit_transaction` returned; until then aiokafka's OffsetFetch (below v7: no require_stable)
        answers the offset before. The partitions' next owner starts from that answer, so letting them go
        earlier would have it route the last batch again (`bench/txn_offsets.py`: about half or more of the
        reads right after a commit are stale, for a few ms). Bounded by half the session timeout: a stop, or a
        revocation that already waited for its last batch, is not held much longer."""
        pending, consumer = self.unconfirmed, self.link.consumer
        if not pending:
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
                # (`get`: a release running beside this one, a stop meeting a rebalance, may have let it go)
                if offset is not None and offset >= pending.get(tp, offset):
                    pending.pop(tp, None)
            if not pending:
                return
            if time.monotonic() >= deadline:
                log.warning("the group did not show the last transaction's offsets of %s in time; their next "
                            "owner may route the last batch again", ", ".join(f"{tp.topic}/{tp.partition}"
                                                                              for tp in sorted(pending)))
                pending.clear()
                return
            await asyncio.sleep(0.005)
