"""Operations around a running worker: metrics, campaign view updates, health/readiness, the batch log line, the HTTP server.

`Ops.attach` hooks into a worker (its observer, its router's route step, a timed index) without
changing what the worker routes; `start`/`stop` run the HTTP server (stream/ops_http.py) on the
worker's event loop. What fails here (the campaign store, the HTTP port) is logged and counted but
never stops the routing: the outputs matter more than the view of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from filters.errors import NeardupError, RejectedInput
from stream.campaigns import CampaignDetail, CampaignStore, CampaignView, Sighting, open_campaigns
from stream.codec import decode
from stream.collector import tune_collector
from stream.config import Settings
from stream.faust_worker import FaustWorker
from stream.kafka_tools import KafkaRecord, client_options, partition_lags
from stream.metrics import TimedIndex, WorkerMetrics, timed_route_runner
from stream.outputs import H_DUPLICATE_OF, H_REASON, H_VERDICT, OutRecord
from stream.router import Router, WorkerStats
from stream.worker import AiokafkaWorker, make_worker
from stream.worker import log as worker_log

log = logging.getLogger("neardup.ops")
T = TypeVar("T")

INFO_EVERY = 10.0  # seconds between INFO batch lines (every batch gets a DEBUG line otherwise)
INDEX_STATS_EVERY = 30.0  # seconds between index size refreshes (a few O(1) Redis commands)
PROBE_TIMEOUT = 3.0  # seconds a readiness check may take


def _header(out: OutRecord, name: str) -> bytes | None:
    # Input headers come first and are passed through: the worker's own header is the last one.
    return next((v for k, v in reversed(out.headers) if k == name), None)


class Ops:
    """Metrics, campaign view and HTTP endpoints of one worker."""

    def __init__(self, settings: Settings, worker: AiokafkaWorker | FaustWorker,
                 store: CampaignStore | None = None) -> None:
        self.settings = settings
        self.worker = worker
        self.metrics = WorkerMetrics()
        self.store = store or open_campaigns(settings.index, namespace=worker.nd.config.digest(),
                                             window=settings.window, minutes=settings.campaign_minutes)
        self.started = time.monotonic()
        self.http_port: int | None = None  # the bound port while the HTTP server runs
        self._runner: Any = None
        self._admin: AIOKafkaAdminClient | None = None
        self._routed_at: dict[int, tuple[Sequence[KafkaRecord], float]] = {}
        self._last_info = 0.0
        self._interval_start = (time.monotonic(), 0)  # (when, records seen then): the rate of the last interval
        self._last_index_stats = -INDEX_STATS_EVERY
        self._index_stats_task: asyncio.Future[Any] | None = None
        self._campaign_failing = False

    # -- wiring ------------------------------------------------------------------------------------
    def attach(self) -> None:
        """Observe the worker's batches and time its route step (call before `worker.run`)."""
        w = self.worker
        if not w.nd.index.in_process:  # its round trips are timed (attached once: `serve`)
            w.nd.index = TimedIndex(w.nd.index, lambda op, s: self.metrics.redis_seconds.labels(op).observe(s))
        w.router = Router(w.settings, w.nd, w.stats, run=timed_route_runner(self.metrics, self._routed))
        previous = w.observer

        async def observer(records: Sequence[KafkaRecord], outs: Sequence[OutRecord]) -> None:
            await self.observe(records, outs)
            if previous is not None:
                maybe = previous(records, outs)
                if maybe is not None:
                    await maybe

        w.observer = observer

    async def start(self) -> None:
        """Start the HTTP server (unless metrics_port is 0). A port in use is logged, not fatal."""
        from stream.ops_http import start_server

        if self.settings.metrics_port == 0:
            return
        try:
            self._runner, self.http_port = await start_server(self, self.settings.metrics_host,
                                                              self.settings.metrics_port)
        except OSError as exc:
            log.error("metrics/campaign HTTP server not started on %s:%d: %s (the worker runs without it)",
                      self.settings.metrics_host, self.settings.metrics_port, exc)
            return
        log.info("metrics on http://%s:%d/metrics, campaigns on http://%s:%d/", self.settings.metrics_host,
                 self.http_port, self.settings.metrics_host, self.http_port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._index_stats_task is not None:
            with contextlib.suppress(BaseException):
                await self._index_stats_task
        if self._admin is not None:
            with contextlib.suppress(KafkaError, OSError):
                await self._admin.close()
            self._admin = None
        self.store.close()

    # -- per batch -----------------------------------------------------------------------------------
    def _routed(self, records: Sequence[KafkaRecord]) -> None:
        # Keyed by identity: the worker hands the same list to the route step and to the observer.
        self._routed_at[id(records)] = (records, time.perf_counter())

    async def observe(self, records: Sequence[KafkaRecord], outs: Sequence[OutRecord]) -> None:
        """After a batch's outputs were acknowledged: count, time, feed the campaign view, log."""
        routed = self._routed_at.pop(id(records), None)
        if routed is not None:
            self.metrics.stage("produce", time.perf_counter() - routed[1])
        if len(self._routed_at) > 16:  # batches routed but never observed (stopped during an outage)
            self._routed_at.clear()
        verdicts = [(_header(o, H_VERDICT) or b"").decode() for o in outs]
        reasons = [(_header(o, H_REASON) or b"").decode() or None for o in outs]
        # The campaign view first: once /metrics counts a batch, the view includes it too.
        if self.settings.campaigns:
            await self._record_campaigns(outs, verdicts)
        self.metrics.count([r.topic for r in records], verdicts, reasons)
        self._refresh_index_stats()
        self._log_batch(verdicts)

    async def _record_campaigns(self, outs: Sequence[OutRecord], verdicts: Sequence[str]) -> None:
        fmt = self.settings.record_format()
        sightings = []
        for out, verdict in zip(outs, verdicts):
            rep = _header(out, H_DUPLICATE_OF) if verdict == "duplicate" else None
            if rep is None:
                continue
            try:
                text = decode(out.value or b"", fmt, fallback_id="", fallback_ts=0.0).message.text
            except RejectedInput:  # it was decoded once to be routed; cannot happen, but must not stop a batch
                text = ""
            sightings.append(Sighting(rep.decode(errors="replace"), text))
        if not sightings:
            return
        t0 = time.perf_counter()
        try:
            await self._in_store(self.store.record, sightings)
        except NeardupError as exc:
            self.metrics.campaign_errors.inc()
            if not self._campaign_failing:
                log.warning("campaign view not updated (routing goes on): %s", exc)
            self._campaign_failing = True
            return
        self.metrics.redis_seconds.labels("campaigns").observe(time.perf_counter() - t0)
        if self._campaign_failing:
            log.warning("campaign view updated again")
            self._campaign_failing = False

    def _refresh_index_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_index_stats < INDEX_STATS_EVERY:
            return
        if self._index_stats_task is not None and not self._index_stats_task.done():
            return
        self._last_index_stats = now
        index = self.worker.nd.index
        if index.in_process:
            # Between batches the route step is not running: the in-process index is not changing.
            self.metrics.index_stats(index.stats())
            return

        async def refresh() -> None:
            try:
                self.metrics.index_stats(await asyncio.to_thread(index.stats))
            except NeardupError as exc:
                log.debug("index stats not refreshed: %s", exc)

        self._index_stats_task = asyncio.ensure_future(refresh())

    def _log_batch(self, verdicts: Sequence[str]) -> None:
        s = self.worker.stats
        counts = {k: verdicts.count(k) for k in ("unique", "duplicate", "rejected", "unchecked")}
        now = time.monotonic()
        level = logging.DEBUG
        since, seen_then = self._interval_start
        if now - self._last_info >= INFO_EVERY:
            level, self._last_info = logging.INFO, now
            self._interval_start = (now, s.seen)  # the next INFO line's rate is over the interval from here
        if not log.isEnabledFor(level):
            return
        # The rate over the interval since the last INFO line (its length is in the line), not the average
        # since start: after an idle hour, the lines logged during a burst show the burst's rate.
        seconds = now - since
        rate = (s.seen - seen_then) / seconds if seconds > 0 else 0.0
        log.log(level, "batch %d: %d records = unique %d + duplicate %d + rejected %d + unchecked %d; total %d, "
                "%.0f msg/s over the last %.0fs", s.batches, len(verdicts), counts["unique"], counts["duplicate"],
                counts["rejected"], counts["unchecked"], s.seen, rate, seconds,
                extra={"batch": s.batches, "records": len(verdicts), **counts, "total": s.seen,
                       "index_errors": s.index_errors, "rate": round(rate, 1)})

    # -- endpoints -----------------------------------------------------------------------------------
    async def metrics_text(self) -> bytes:
        router = self.worker.router
        self.metrics.index_state(self.worker.stats.index_errors, router.retries, router.index_down)
        self.metrics.kafka_state(self.worker.kafka.errors, self.worker.kafka.down)
        consumer = self.worker.consumer if isinstance(self.worker, AiokafkaWorker) else None
        if consumer is not None:
            self.metrics.lag(await partition_lags(consumer))
            w = self.worker
            assert isinstance(w, AiokafkaWorker)
            self.metrics.alignment_state(w.aligner.late, w.held_seconds, w.aligner.low_mark(), len(w.aligner.paused()))
            self.metrics.unread_state(w.unread)
            if w.guard is not None:
                self.metrics.changelog_state(w.guard.losses, w.guard.restored_entries, w.guard.restoring,
                                             w.guard.restore_read)
        return self.metrics.render()

    async def health(self) -> tuple[bool, dict[str, Any]]:
        """Liveness: the event loop answers and the worker is not shutting down."""
        stopping = self.worker.stop_event.is_set()
        s = self.worker.stats
        return not stopping, {"status": "stopping" if stopping else "ok",
                              "uptime": round(time.monotonic() - self.started, 3),
                              "batches": s.batches, "routed": s.seen}

    async def ready(self) -> tuple[bool, dict[str, Any]]:
        """Readiness: Kafka answers a metadata request, Redis a PING, and the index is not in an outage."""
        checks: dict[str, str] = {}
        kafka, redis_check = await asyncio.gather(self._kafka_check(), self._redis_check())
        checks["kafka"] = kafka
        checks["redis"] = redis_check
        checks["index"] = "outage: routing paused" if self.worker.router.index_down else "ok"
        w = self.worker
        if isinstance(w, AiokafkaWorker) and w.guard is not None and w.guard.restoring:
            checks["index"] = "restoring from the changelog: routing waits"
        checks["worker"] = "stopping" if self.worker.stop_event.is_set() else "ok"
        ok = all(v in ("ok", "not used") for v in checks.values())
        return ok, {"status": "ready" if ok else "not ready", "checks": checks}

    async def campaigns(self, limit: int, sort: str) -> CampaignView:
        return await self._in_store(self.store.top, limit, sort)

    async def campaign(self, campaign_id: str) -> CampaignDetail | None:
        return await self._in_store(self.store.detail, campaign_id)

    async def _in_store(self, call: Callable[..., T], *args: Any) -> T:
        # A store over the network waits off the event loop; one in this process answers at once.
        if self.store.in_process:
            return call(*args)
        return await asyncio.to_thread(call, *args)

    async def _kafka_check(self) -> str:
        try:
            if self._admin is None:
                self._admin = AIOKafkaAdminClient(**client_options(self.settings),
                                                  request_timeout_ms=round(PROBE_TIMEOUT * 1000))
                await asyncio.wait_for(self._admin.start(), PROBE_TIMEOUT)
            await asyncio.wait_for(self._admin.list_topics(), PROBE_TIMEOUT)
            return "ok"
        except (KafkaError, OSError, TimeoutError) as exc:
            admin, self._admin = self._admin, None  # a fresh client next time
            if admin is not None:
                with contextlib.suppress(KafkaError, OSError):
                    await admin.close()
            return f"unreachable: {type(exc).__name__}: {exc}"[:300]

    async def _redis_check(self) -> str:
        if self.store.in_process:
            return "not used"
        try:
            await asyncio.wait_for(asyncio.to_thread(self.store.ping), PROBE_TIMEOUT)
            return "ok"
        except (NeardupError, TimeoutError) as exc:
            return f"unreachable: {exc}"[:300]


async def serve(settings: Settings) -> WorkerStats:
    """Run a worker until SIGINT/SIGTERM; the batch in progress is finished and committed first."""
    worker = make_worker(settings)
    ops = Ops(settings, worker)
    ops.attach()
    await ops.start()
    tune_collector()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, worker.stop)
    worker_log.info("serving %s → %s / %s / %s (runtime %s, index %s)", ",".join(settings.input_topics),
             settings.unique_topic, settings.duplicate_topic, settings.dead_letter_topic, settings.runtime,
             settings.masked()["index"])
    try:
        return await worker.run()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await ops.stop()
        worker.nd.index.close()
