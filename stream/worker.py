"""The Kafka worker: consume input topics in batches, route each batch with `route_batch`, produce, commit after acks.

Delivery is at-least-once: a batch's offsets are committed only after every output record of the batch
has been acknowledged by the broker (acks=all). A worker that dies between the two re-reads the batch
after a restart; with a shared index (Redis) the engine gives a replayed message the verdict it got
before (an indexed unique one is found under its own id: unique, method "replay"; a duplicate was not
indexed and matches its original again). With `memory://` the index dies with the worker, so replays
after a restart are checked against an empty index: use Redis for `serve`; memory:// is for trying out.

Exactly-once (`processing_guarantee = "exactly_once"`, aiokafka runtime only): each batch's outputs and
its consumed offsets go in one Kafka transaction (a transactional producer, `send_offsets_to_transaction`,
then commit), so a reader with isolation.level=read_committed sees every input's output exactly once,
crash or not; a batch interrupted by a crash is aborted and re-read. The transactional id is
`neardup-<group_id>-<group_instance_id>`: with static membership a restarted worker fences its dead
predecessor and aborts its open transaction at once (without one the id is random, and the dead
transaction holds read_committed readers back until the broker's transaction timeout, 60 s). aiokafka
commits transactional offsets without the group generation (no KIP-447 fencing): a worker that stalls
past its session timeout and then commits could still repeat a batch that its successor also routed.

Two runtimes share everything but the loop: `aiokafka` (default: a plain consume → route → produce →
commit loop, pipelined one batch deep) and `faust` (a faust-streaming agent over `stream.noack_take`,
acking a batch after its outputs were acknowledged). aiokafka is the default: faster, lower latency,
and its commits are explicit (see bench/kafka_e2e.py and the FaustWorker docstring).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError

from filters.engine import NearDupFilter
from filters.errors import ConfigError, IndexUnavailable, RejectedInput
from stream.codec import RecordFormat, decode
from stream.config import Settings
from stream.kafka_tools import (
    Headers,
    KafkaRecord,
    broker_errors,
    client_options,
    ensure_topics,
    map_kafka_error,
    producer,
)
from stream.runner import DUPLICATE, UNIQUE, RawRecord, Routed, route_batch

log = logging.getLogger("neardup.worker")

# Header names the worker adds (input headers are passed through unchanged, before these).
H_VERDICT = "neardup-verdict"  # unique | duplicate | rejected | unchecked
H_DUPLICATE_OF = "neardup-duplicate-of"
H_SIMILARITY = "neardup-similarity"
H_METHOD = "neardup-method"
H_ID = "neardup-id"
H_SOURCE = "neardup-source"  # topic/partition/offset of the input record
H_REASON = "neardup-reason"
H_ERROR = "neardup-error"
UNCHECKED = "unchecked"
REJECTED = "rejected"
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


@dataclass
class WorkerStats:
    """Counters of one worker run (mutable: updated per batch)."""

    batches: int = 0
    seen: int = 0
    unique: int = 0
    duplicate: int = 0
    rejected: int = 0
    unchecked: int = 0
    index_errors: int = 0
    started: float = field(default_factory=time.monotonic)

    def add(self, outs: Sequence[OutRecord]) -> None:
        self.batches += 1
        self.seen += len(outs)
        for out in outs:
            verdict = next(v for k, v in reversed(out.headers) if k == H_VERDICT).decode()
            if verdict == UNIQUE:
                self.unique += 1
            elif verdict == DUPLICATE:
                self.duplicate += 1
            elif verdict == UNCHECKED:
                self.unchecked += 1
            else:
                self.rejected += 1

    def line(self) -> str:
        seconds = time.monotonic() - self.started
        rate = self.seen / seconds if seconds > 0 else 0.0
        return (f"{self.seen} routed in {self.batches} batches = unique {self.unique} + duplicate {self.duplicate}"
                f" + rejected {self.rejected} + unchecked {self.unchecked}; {rate:,.0f} msg/s;"
                f" index errors {self.index_errors}")


class BatchObserver(Protocol):
    """A seam for tests and metrics: called after a batch's outputs are acknowledged, before its commit."""

    def __call__(self, records: Sequence[KafkaRecord], outs: Sequence[OutRecord]) -> Awaitable[None] | None: ...


# -- routing (shared by both runtimes) -----------------------------------------------------------


def raw_record(record: KafkaRecord) -> RawRecord:
    # A tombstone (value None) is routed as empty bytes: it is rejected and dead-lettered as such.
    return RawRecord(record.value or b"", record.coordinates, record.timestamp / 1000.0)


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
        if v.method:
            headers.append((H_METHOD, v.method.encode()))
        headers.append((H_ID, v.id.encode()))
        topic = settings.duplicate_topic if v.duplicate else settings.unique_topic
    else:
        assert routed.error is not None
        headers += [(H_VERDICT, REJECTED.encode()), (H_REASON, routed.error.reason.encode()),
                    (H_ERROR, str(routed.error)[:_MAX_ERROR_CHARS].encode())]
        topic = settings.dead_letter_topic
    headers.append((H_SOURCE, record.coordinates.encode()))
    if routed.kind == REJECTED and routed.error is not None and routed.error.reason == "too_large":
        # Too large for the codec is too large for the producer: dead-lettered without its value
        # (neardup-source says where to find it), so one huge record cannot stop the worker.
        return OutRecord(topic, record.key, None, tuple(headers))
    return OutRecord(topic, record.key, record.value, tuple(headers))


def route_records(nd: NearDupFilter, records: Sequence[KafkaRecord], settings: Settings) -> list[OutRecord]:
    """One output per input, in input order. Raises `IndexUnavailable` (nothing routed) on an outage."""
    routed = route_batch(nd, [raw_record(r) for r in records], settings.record_format())
    return [output_of(rec, r, settings) for rec, r in zip(records, routed, strict=True)]


def unchecked_records(records: Sequence[KafkaRecord], settings: Settings) -> list[OutRecord]:
    """What `--on-index-error unchecked` does while the index is down: decodable records go to unique
    with `neardup-verdict: unchecked` (not indexed, not checked), the others to the dead-letter topic."""
    fmt = settings.record_format()
    outs = []
    for rec in records:
        raw = raw_record(rec)
        try:
            message = decode(raw.value, fmt, fallback_id=raw.fallback_id, fallback_ts=raw.fallback_ts).message
        except RejectedInput as exc:
            outs.append(output_of(rec, Routed(REJECTED, raw, error=exc), settings))
            continue
        headers = (*rec.headers, (H_VERDICT, UNCHECKED.encode()), (H_ID, message.id.encode()),
                   (H_SOURCE, rec.coordinates.encode()))
        outs.append(OutRecord(settings.unique_topic, rec.key, rec.value, headers))
    return outs


class Backoff:
    """Exponential backoff: initial, 2×, 4× … up to `maximum` seconds."""

    def __init__(self, initial: float, maximum: float) -> None:
        self.initial = initial
        self.maximum = maximum
        self.next = initial

    def step(self) -> float:
        delay = self.next
        self.next = min(self.next * 2, self.maximum)
        return delay

    def reset(self) -> None:
        self.next = self.initial


class Router:
    """Routes batches with the index-error policy of the settings.

    `block`: on `IndexUnavailable`, call `pause()`, log one line, retry the same batch with backoff
    (calling `keepalive()` while waiting, so the consumer stays in its group) until the index answers
    or `stopping()`; then `resume()` and log one line. Nothing of the batch is produced or committed
    before it is routed. `unchecked`: while the index is down (retried at most every backoff step),
    batches go out unchecked.
    """

    def __init__(self, settings: Settings, nd: NearDupFilter, stats: WorkerStats,
                 *, run: Callable[..., Awaitable[Any]] | None = None) -> None:
        self.settings = settings
        self.nd = nd
        self.stats = stats
        self.backoff = Backoff(settings.retry_initial, settings.retry_max)
        self._down_since: float | None = None
        self._attempts = 0  # failed attempts in the current outage
        self._retry_at = 0.0
        self.retries = 0  # route attempts repeated after an index error (a metric)
        # How the CPU-bound, blocking routing step runs: in a worker thread by default, so that the
        # event loop keeps fetching, heartbeating and delivering the previous batch meanwhile.
        self._run = run or asyncio.to_thread

    async def route(
        self,
        records: Sequence[KafkaRecord],
        *,
        pause: Callable[[], None] = lambda: None,
        resume: Callable[[], None] = lambda: None,
        keepalive: Callable[[], Awaitable[None]] | None = None,
        stopping: Callable[[], bool] = lambda: False,
    ) -> list[OutRecord] | None:
        """The outputs of `records`, or None when stopping before they could be routed."""
        if self.settings.on_index_error == "unchecked":
            return await self._route_unchecked(records)
        while True:
            try:
                outs = await self._run(route_records, self.nd, records, self.settings)
            except IndexUnavailable as exc:
                self.stats.index_errors += 1
                self._attempts += 1
                if self._down_since is None:
                    self._down_since = time.monotonic()
                    pause()
                    log.error("index unavailable: consumption paused, retrying with backoff up to %gs, "
                              "nothing committed meanwhile: %s", self.settings.retry_max, exc)
                delay = self.backoff.step()
                deadline = time.monotonic() + delay
                while time.monotonic() < deadline:
                    if stopping():
                        return None
                    if keepalive is not None:
                        await keepalive()
                    await asyncio.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
                self.retries += 1
                continue
            if self._down_since is not None:
                log.warning("index available again after %.1fs (%d failed attempts): consumption resumed",
                            time.monotonic() - self._down_since, self._attempts)
                self._down_since = None
                self._attempts = 0
                self.backoff.reset()
                resume()
            return outs

    @property
    def index_down(self) -> bool:
        """True from an index error until the index answers again."""
        return self._down_since is not None

    async def _route_unchecked(self, records: Sequence[KafkaRecord]) -> list[OutRecord]:
        now = time.monotonic()
        if self._down_since is None or now >= self._retry_at:
            if self._down_since is not None:
                self.retries += 1
            try:
                outs = await self._run(route_records, self.nd, records, self.settings)
            except IndexUnavailable as exc:
                self.stats.index_errors += 1
                if self._down_since is None:
                    self._down_since = now
                    log.error("index unavailable: passing records to %r unchecked (header %s: %s) until it "
                              "answers again: %s", self.settings.unique_topic, H_VERDICT, UNCHECKED, exc)
                self._retry_at = time.monotonic() + self.backoff.step()
            else:
                if self._down_since is not None:
                    log.warning("index available again after %.1fs: checking records again",
                                time.monotonic() - self._down_since)
                    self._down_since = None
                    self.backoff.reset()
                return outs
        return unchecked_records(records, self.settings)


def open_filter(settings: Settings) -> NearDupFilter:
    if settings.index.startswith("memory:"):
        log.warning("index %s lives in this process only: verdicts are not shared with other workers and "
                    "replays after a restart are not recognised; use redis:// for serve", settings.index)
    return NearDupFilter(settings.filter_config(), index=settings.index)


# -- the aiokafka runtime ------------------------------------------------------------------------


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    """Before partitions are taken away, deliver and commit what was routed from them."""

    def __init__(self, flush: Callable[[], Awaitable[None]]) -> None:
        self.flush = flush
        # Counts assignments; aiokafka fetches nothing of a new assignment before this callback runs.
        self.assignments = 0

    async def on_partitions_revoked(self, revoked: Any) -> None:
        await self.flush()

    async def on_partitions_assigned(self, assigned: Any) -> None:
        self.assignments += 1
        if assigned:
            log.info("assigned %s", ", ".join(f"{tp.topic}/{tp.partition}" for tp in sorted(assigned)))


@dataclass
class _InFlight:
    """A routed batch whose output records were handed to the producer but not yet acknowledged."""

    records: list[KafkaRecord]
    outs: list[OutRecord]
    deliveries: list[asyncio.Future[Any]]
    assignment: int = 0  # `_Rebalance.assignments` when the records were fetched


class _WorkerCore:
    """What both runtimes share: settings, the filter, the router and its stats, the stop signal."""

    def __init__(self, settings: Settings, nd: NearDupFilter | None = None, *,
                 observer: BatchObserver | None = None) -> None:
        self.settings = settings
        self.nd = nd or open_filter(settings)
        self.stats = WorkerStats()
        self.router = Router(settings, self.nd, self.stats)
        self.observer = observer
        self.stop_event = asyncio.Event()


class AiokafkaWorker(_WorkerCore):
    """consume (getmany) → route (a thread) → produce → await acks → commit.

    Pipelined one batch deep: while batch N+1 is routed (in a thread), the event loop collects batch N's
    acknowledgements; N is committed after they all arrived, and always before N+1. So a batch's offsets
    are committed only after every output of it and of all batches before it was acknowledged; a crash
    may leave up to two routed batches uncommitted, to be re-read (replayed) after a restart.
    """

    def __init__(self, settings: Settings, nd: NearDupFilter | None = None, *,
                 observer: BatchObserver | None = None) -> None:
        super().__init__(settings, nd, observer=observer)
        self._lock = asyncio.Lock()  # one batch step at a time: the loop, or a rebalance's flush
        self._in_flight: _InFlight | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: Any = None
        self._transactional = settings.processing_guarantee == "exactly_once"
        self._rebalance = _Rebalance(self._flush_locked)

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
        with broker_errors(s):
            await consumer.start()
        try:
            consumer.subscribe(list(s.input_topics), listener=self._rebalance)
            options: dict[str, Any] = {"max_request_size": MAX_OUTPUT_BYTES}
            if self._transactional:
                options["transactional_id"] = (f"neardup-{s.group_id}-"
                                               f"{s.group_instance_id or uuid.uuid4().hex[:12]}")
            async with producer(s, **options) as prod:
                self._producer = prod
                await self._loop(consumer, prod)
                # Stopping (not failing): deliver and commit the batch in flight.
                await self._flush_locked()
        finally:
            self._in_flight = None
            with broker_errors(s):
                await consumer.stop()
        log.info("stopped: %s", self.stats.line())
        return self.stats

    async def _loop(self, consumer: AIOKafkaConsumer, prod: Any) -> None:
        s = self.settings
        timeout_ms = max(1, round(s.batch_within * 1000))
        stop_wait = asyncio.ensure_future(self.stop_event.wait())
        try:
            while not self.stop_event.is_set():
                # With a batch in flight, look for more without waiting: if there is none, finish the
                # batch in flight first (latency), then wait for records.
                wait_ms = 0 if self._in_flight is not None else timeout_ms
                fetch = asyncio.ensure_future(consumer.getmany(timeout_ms=wait_ms, max_records=s.max_batch))
                await asyncio.wait([fetch, stop_wait], return_when=asyncio.FIRST_COMPLETED)
                if not fetch.done():
                    fetch.cancel()
                    break
                with broker_errors(s):
                    fetched = fetch.result()
                assignment = self._rebalance.assignments
                records = [KafkaRecord.of(m) for msgs in fetched.values() for m in msgs]
                async with self._lock:
                    if records:
                        await self._batch(consumer, prod, records, assignment)
                    else:
                        await self._flush()
        finally:
            stop_wait.cancel()

    async def _batch(self, consumer: AIOKafkaConsumer, prod: Any, records: list[KafkaRecord],
                     assignment: int = 0) -> None:
        s = self.settings

        def pause() -> None:
            consumer.pause(*consumer.assignment())

        def resume() -> None:
            consumer.resume(*consumer.assignment())

        async def keepalive() -> None:
            await self._flush()  # what was routed before the outage need not wait for the index
            # Paused partitions return nothing; polling keeps the consumer in its group.
            await consumer.getmany(timeout_ms=0)

        outs = await self.router.route(records, pause=pause, resume=resume, keepalive=keepalive,
                                       stopping=self.stop_event.is_set)
        if outs is None:
            return  # stopping during an index outage: nothing of this batch produced or committed
        if self._transactional:
            await self._flush()  # one transaction at a time: commit the previous batch's first
            with broker_errors(s):
                await prod.begin_transaction()
        with broker_errors(s):
            deliveries = [await prod.send(o.topic, value=o.value, key=o.key, headers=list(o.headers))
                          for o in outs]
        await self._flush()  # the previous batch: its acks arrived while this one was routed
        self._in_flight = _InFlight(records, outs, deliveries, assignment)

    async def _flush_locked(self) -> None:
        async with self._lock:
            await self._flush()

    async def _flush(self) -> None:
        """Await the acks of the batch in flight, then commit its offsets."""
        batch, self._in_flight = self._in_flight, None
        if batch is None:
            return
        s = self.settings
        with broker_errors(s):
            await asyncio.gather(*batch.deliveries)
        if self._transactional and batch.assignment != self._rebalance.assignments:
            # The partitions were reassigned since the batch was fetched: their owner now (maybe this
            # worker) re-reads it from the committed offsets, so committing it too would repeat it.
            log.warning("partitions reassigned while a batch of %d records was in flight: its transaction is "
                        "aborted, the records are re-read by their owner", len(batch.records))
            with broker_errors(s):
                await self._producer.abort_transaction()
            return
        self.stats.add(batch.outs)
        if self.observer is not None:
            maybe = self.observer(batch.records, batch.outs)
            if maybe is not None:
                await maybe
        offsets: dict[TopicPartition, int] = {}
        for r in batch.records:
            tp = TopicPartition(r.topic, r.partition)
            offsets[tp] = max(offsets.get(tp, 0), r.offset + 1)
        if self._transactional:
            with broker_errors(s):
                await self._producer.send_offsets_to_transaction(offsets, s.group_id)
                await self._producer.commit_transaction()
            return
        assert self._consumer is not None
        try:
            await self._consumer.commit(offsets)
        except (CommitFailedError, IllegalStateError) as exc:
            # The group moved on (rebalance): whoever owns the partitions now re-reads this batch.
            log.warning("commit failed, the batch will be re-read by the partitions' new owner: %s", exc)
        except KafkaError as exc:
            raise map_kafka_error(exc, s.kafka_bootstrap) from exc


# -- the faust runtime ---------------------------------------------------------------------------


class FaustWorker(_WorkerCore):
    """The same batch step as a faust-streaming agent over `stream.noack_take(max_batch, within)`.

    The agent acks a batch's events after every output was acknowledged; faust's consumer commits the
    acked offsets every `broker_commit_interval`. (`take_events` would ack in a `finally`, i.e. also
    when routing or producing failed: measured, that commits records that never reached an output.)
    While the index is down, faust keeps fetching until its stream buffer is full (no explicit pause).
    """

    def __init__(self, settings: Settings, nd: NearDupFilter | None = None, *,
                 observer: BatchObserver | None = None) -> None:
        super().__init__(settings, nd, observer=observer)
        self._failure: BaseException | None = None
        self._lock = asyncio.Lock()
        # faust wants a data directory even with in-memory tables; a temporary one unless configured.
        self._own_datadir = not settings.state_dir
        self._datadir = settings.state_dir or tempfile.mkdtemp(prefix="neardup-faust-")
        self.app = self._build_app()

    def stop(self) -> None:
        self.stop_event.set()

    def _build_app(self) -> Any:
        import faust

        s = self.settings
        credentials: Any = None
        if s.kafka_security_protocol.startswith("SASL"):
            ssl = client_options(s).get("ssl_context")
            credentials = faust.SASLCredentials(username=s.kafka_sasl_username, password=s.kafka_sasl_password,
                                                mechanism=s.kafka_sasl_mechanism, ssl_context=ssl)
        elif s.kafka_security_protocol == "SSL":
            credentials = faust.SSLCredentials(client_options(s)["ssl_context"])
        brokers = [f"kafka://{b.strip()}" for b in s.kafka_bootstrap.split(",") if b.strip()]
        app = faust.App(
            s.group_id,
            broker=brokers,
            broker_credentials=credentials,
            broker_client_id=s.kafka_client_id,
            datadir=self._datadir,
            store="memory://",
            web_enabled=False,
            value_serializer="raw",
            key_serializer="raw",
            consumer_auto_offset_reset="earliest",
            producer_acks=-1,
            producer_linger=s.linger,
            broker_commit_interval=1.0,
            stream_buffer_maxsize=max(4096, 2 * s.max_batch),
            # Unacked events (a failed batch) are simply not committed; faust must not wait for them.
            stream_wait_empty=False,
            topic_partitions=s.partitions,
            topic_replication_factor=s.replication_factor,
        )
        source = app.topic(*s.input_topics, key_type=bytes, value_type=bytes,
                           key_serializer="raw", value_serializer="raw")
        sinks = {t: app.topic(t, key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")
                 for t in s.output_topics}

        async def agent(stream: Any) -> None:
            # noack_take, not take_events: take_events acks a batch in a `finally`, so a batch whose
            # routing or delivery failed would be committed anyway (measured: lost records).
            async for events in stream.noack_take(s.max_batch, within=s.batch_within):
                try:
                    async with self._lock:  # run() takes it to stop between batches
                        if not await self._batch(events, sinks):
                            return
                except BaseException as exc:
                    # Nothing of this batch is acked; stop the worker rather than let faust restart
                    # the agent past a gap that would be committed only after a restart anyway.
                    self._failure = self._failure or exc
                    self.stop()
                    raise
                for event in events:
                    await stream.ack(event)

        app.agent(source, name="neardup.route")(agent)
        return app

    async def _batch(self, events: Sequence[Any], sinks: dict[str, Any]) -> bool:
        """Route, produce and await the deliveries of one batch; False when stopping instead."""
        records = [_faust_record(e.message) for e in events]
        outs = await self.router.route(records, stopping=self.stop_event.is_set)
        if outs is None:
            return False  # stopping during an index outage: nothing produced, nothing acked
        futures = [await sinks[o.topic].send(key=o.key, value=o.value, headers=list(o.headers)) for o in outs]
        await asyncio.gather(*futures)
        self.stats.add(outs)
        if self.observer is not None:
            maybe = self.observer(records, outs)
            if maybe is not None:
                await maybe
        return True

    async def run(self) -> WorkerStats:
        s = self.settings
        if s.create_topics:
            await ensure_topics(s, [*s.input_topics, *s.output_topics])
        await self.app.start()
        try:
            await self.stop_event.wait()
            await asyncio.wait_for(self._lock.acquire(), timeout=60)  # let the batch in progress finish
        finally:
            await self.app.stop()
            if self._own_datadir:
                shutil.rmtree(self._datadir, ignore_errors=True)
        if self._failure is not None:
            raise self._failure
        log.info("stopped: %s", self.stats.line())
        return self.stats


def _faust_record(message: Any) -> KafkaRecord:
    timestamp = round(message.timestamp * 1000) if message.timestamp is not None else 0
    return KafkaRecord(message.topic, message.partition, message.offset, timestamp, message.key, message.value,
                       tuple((k, bytes(v)) for k, v in (message.headers or ())))


# -- entry point ---------------------------------------------------------------------------------


def make_worker(settings: Settings, nd: NearDupFilter | None = None, *,
                observer: BatchObserver | None = None) -> AiokafkaWorker | FaustWorker:
    if settings.runtime == "aiokafka":
        return AiokafkaWorker(settings, nd, observer=observer)
    if settings.runtime == "faust":
        return FaustWorker(settings, nd, observer=observer)
    raise ConfigError(f"unknown runtime {settings.runtime!r}")


async def serve(settings: Settings) -> WorkerStats:
    """Run a worker until SIGINT/SIGTERM; the batch in progress is finished and committed first."""
    from stream.ops import Ops  # metrics, campaign view, HTTP endpoints

    worker = make_worker(settings)
    ops = Ops(settings, worker)
    ops.attach()
    await ops.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, worker.stop)
    log.info("serving %s → %s / %s / %s (runtime %s, index %s)", ",".join(settings.input_topics),
             settings.unique_topic, settings.duplicate_topic, settings.dead_letter_topic, settings.runtime,
             settings.masked()["index"])
    try:
        return await worker.run()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await ops.stop()
        worker.nd.index.close()
