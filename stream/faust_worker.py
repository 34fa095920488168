"""The faust runtime of the worker: the same batch step as a faust-streaming agent (the default runtime is stream/worker.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any, cast

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from filters.engine import NearDupFilter
from filters.errors import ServiceError
from stream import kafka_tools
from stream.config import Settings
from stream.delivery import settle_outputs
from stream.kafka_tools import (
    KafkaRecord,
    broker_errors,
    client_options,
    ensure_topics,
    map_kafka_error,
)
from stream.outputs import OutRecord
from stream.router import BatchObserver, WorkerCore, WorkerStats

log = logging.getLogger("neardup.worker")

BATCH_WAIT = 60.0  # seconds a stop waits for the batch in progress


class FaustWorker(WorkerCore):
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
            # A produce request unanswered this long fails (and the outage is said, then waited out: `_deliver`),
            # as on the aiokafka runtime; faust's own default is 20 minutes, during which a hung broker went unsaid.
            producer_request_timeout=kafka_tools.REQUEST_TIMEOUT,
            broker_commit_interval=1.0,
            # The group's liveness as the aiokafka runtime has it: a member killed is replaced within
            # `session_timeout` (faust's own default is 60 s).
            broker_session_timeout=s.session_timeout,
            broker_heartbeat_interval=max(0.1, s.session_timeout / 3),
            stream_buffer_maxsize=max(4096, 2 * s.max_batch),
            # Unacked events (a failed batch) are simply not committed; faust must not wait for them.
            stream_wait_empty=False,
            topic_partitions=s.partitions,
            topic_replication_factor=s.replication_factor,
        )
        source = app.topic(*s.input_topics, key_type=bytes, value_type=bytes,
                           key_serializer="raw", value_serializer="raw")

        async def agent(stream: Any) -> None:
            # noack_take, not take_events: take_events acks a batch in a `finally`, so a batch whose
            # routing or delivery failed would be committed anyway (measured: lost records).
            async for events in stream.noack_take(s.max_batch, within=s.batch_within):
                # run() takes the lock to stop between batches, and keeps it: an agent waiting for it is
                # cancelled by the app's stop, which is no failure (nothing of its batch was acked).
                async with self._lock:
                    try:
                        if not await self._batch(events):
                            return
                    except asyncio.CancelledError:
                        if self.stop_event.is_set():
                            return  # the stop gave up waiting for this batch (`BATCH_WAIT`): nothing acked
                        raise
                    except Exception as exc:
                        # Nothing of this batch is acked; stop the worker rather than let faust restart
                        # the agent past a gap that would be committed only after a restart anyway. Returned,
                        # not raised: faust logs an agent that raised as crashed (a traceback) and restarts it,
                        # which would take the next batch while the worker stops. run() raises the failure.
                        self._failure = self._failure or exc
                        self.stop()
                        return
                for event in events:
                    await stream.ack(event)

        app.agent(source, name="neardup.route")(agent)
        return app

    async def _batch(self, events: Sequence[Any]) -> bool:
        """Route, produce and await the deliveries of one batch; False when stopping instead."""
        records = [_faust_record(e.message) for e in events]
        outs = await self.router.route(records, stopping=self.stop_event.is_set)
        if outs is None:
            return False  # stopping during an index outage: nothing produced, nothing acked
        outs = await self._deliver(records, list(outs))
        await self.acknowledged(records, outs)
        return True

    async def _deliver(self, records: Sequence[KafkaRecord], outs: list[OutRecord]) -> list[OutRecord]:
        """Produces the batch's outputs and waits for them (`stream.delivery.settle_outputs`, as the aiokafka
        runtime: too-large outputs sent again alone, then dead-lettered; those failed in an outage sent again once
        the broker answers); returns them as delivered. Through the app's producer (a topic's `send` would leave a
        future of its own with the error, unretrieved, to be logged with a traceback)."""
        from faust.exceptions import ProducerSendError  # faust is imported by this runtime only

        producer = self.app.producer

        async def send(o: OutRecord) -> asyncio.Future[Any]:
            # A keyless record dead-lettered without its value: aiokafka's `send` refuses a record with neither
            # (the aiokafka runtime sends it in a record batch of its own), so it carries an empty value here.
            value = b"" if o.key is None and o.value is None else o.value
            try:
                return cast("asyncio.Future[Any]", await producer.send(o.topic, o.key, value, None, None,
                                                                      list(o.headers)))
            except ProducerSendError as exc:  # refused at once (larger than a request may be): as if sent
                failed = asyncio.get_running_loop().create_future()
                failed.set_exception(exc.__cause__ if isinstance(exc.__cause__, KafkaError) else exc)
                return failed

        async def send_alone(o: OutRecord) -> asyncio.Future[Any]:
            # Sent and awaited before the next: a record batch of its own, as a batch is refused whole (maybe for
            # another record's size). Returned done, its error (if any) read with the others'.
            sent = await send(o)
            await asyncio.wait([sent])
            return sent

        deliveries = [await send(o) for o in outs]
        await settle_outputs(deliveries, outs, records, send, send_alone, self.kafka, self.stop_event.is_set,
                             self.settings)
        return outs

    async def run(self) -> WorkerStats:
        s = self.settings
        if s.align:
            log.info("faust runtime: records are decided in the order fetched (event-time alignment needs the "
                     "aiokafka runtime)")
        unfinished = ""
        # The broker's outages said and counted as on the aiokafka runtime (`KafkaHealth`): one line each way,
        # `neardup_kafka_up`, and aiokafka's reconnect loop (faust's clients are aiokafka's) kept out of the log.
        filtered = self.kafka.attach()
        prober: AIOKafkaAdminClient | None = None
        watch: asyncio.Future[None] | None = None
        try:
            prober = AIOKafkaAdminClient(**client_options(s))
            self.kafka.probe = prober.list_topics  # a metadata request
            if s.create_topics:
                await ensure_topics(s, [*s.input_topics, *s.output_topics])
            # The app starts once the group assigned its partitions: a stop meanwhile is not kept waiting.
            starting = asyncio.ensure_future(self.app.start())
            stopped = asyncio.ensure_future(self.stop_event.wait())
            try:
                with broker_errors(s):
                    await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
                    if starting.done():
                        starting.result()
                        await prober.start()
                        watch = asyncio.ensure_future(self.kafka.watch())
                        await stopped
            finally:
                for task in (starting, stopped):
                    task.cancel()
                # (its error, if it failed once the stop had won, is not this worker's: retrieved, not logged)
                starting.add_done_callback(lambda task: task.cancelled() or task.exception())
            try:
                await asyncio.wait_for(self._lock.acquire(), timeout=BATCH_WAIT)  # the batch in progress finishes
            except TimeoutError:
                unfinished = (f"the batch in progress did not finish within {BATCH_WAIT:.0f}s (the broker or the "
                              "index unreachable?)")
        finally:
            # Waits for the broker if it is unreachable (faust flushes its producer), as the aiokafka runtime
            # does: cut short, faust's tasks are left half stopped and the process never exits.
            await self.app.stop()
            if watch is not None:
                watch.cancel()
            if prober is not None:
                with contextlib.suppress(Exception):
                    await prober.close()
            for logger in filtered:
                logger.removeFilter(self.kafka)
            if self._own_datadir:
                shutil.rmtree(self._datadir, ignore_errors=True)
        if self._failure is not None:
            failure = self._failure
            from faust.exceptions import ProducerSendError

            if isinstance(failure, ProducerSendError) and isinstance(failure.__cause__, KafkaError):
                failure = failure.__cause__
            if isinstance(failure, KafkaError):
                raise map_kafka_error(failure, s.kafka_bootstrap) from failure
            raise failure
        if unfinished:
            raise ServiceError(f"{unfinished}: stopped without it; what was not acknowledged is read again after "
                               "a restart")
        log.info("stopped: %s", self.stats.line())
        return self.stats


def _faust_record(message: Any) -> KafkaRecord:
    timestamp = round(message.timestamp * 1000) if message.timestamp is not None else 0
    return KafkaRecord(message.topic, message.partition, message.offset, timestamp, message.key, message.value,
                       tuple((k, bytes(v)) for k, v in (message.headers or ())))
