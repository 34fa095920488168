"""The faust runtime of the worker: the same batch step as a faust-streaming agent (the default runtime is stream/worker.py)."""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

from filters.engine import NearDupFilter
from stream.config import Settings
from stream.kafka_tools import KafkaRecord, client_options, ensure_topics
from stream.router import BatchObserver, WorkerCore, WorkerStats

log = logging.getLogger("neardup.worker")


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
        await self.acknowledged(records, outs)
        return True

    async def run(self) -> WorkerStats:
        s = self.settings
        if s.align:
            log.info("faust runtime: records are decided in the order fetched (event-time alignment needs the "
                     "aiokafka runtime)")
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
