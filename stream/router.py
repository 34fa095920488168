"""Routing a batch of Kafka records with the index-error policy (`Router`), and the core both worker runtimes share around it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from filters.engine import NearDupFilter
from filters.errors import IndexLost, IndexUnavailable
from filters.index.backends import open_index
from stream.config import Settings
from stream.kafka_health import KafkaHealth
from stream.kafka_tools import KafkaRecord
from stream.outputs import H_VERDICT, UNCHECKED, OutRecord, output_of, raw_record, unchecked_records
from stream.runner import DUPLICATE, UNIQUE, RawRecord, ReadAhead, Routed

log = logging.getLogger("neardup.worker")


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
        tally: dict[bytes, int] = {}
        for out in outs:
            for k, v in out.headers[::-1]:  # the last verdict header (the one the worker added)
                if k == H_VERDICT:
                    tally[v] = tally.get(v, 0) + 1
                    break
        unique, duplicate, unchecked = (tally.pop(v.encode(), 0) for v in (UNIQUE, DUPLICATE, UNCHECKED))
        self.unique += unique
        self.duplicate += duplicate
        self.unchecked += unchecked
        self.rejected += len(outs) - unique - duplicate - unchecked

    def line(self) -> str:
        seconds = time.monotonic() - self.started
        rate = self.seen / seconds if seconds > 0 else 0.0
        return (f"{self.seen} routed in {self.batches} batches = unique {self.unique} + duplicate {self.duplicate}"
                f" + rejected {self.rejected} + unchecked {self.unchecked}; {rate:,.0f} msg/s;"
                f" index errors {self.index_errors}")


class BatchObserver(Protocol):
    """A seam for tests and metrics: called after a batch's outputs are acknowledged, before its commit."""

    def __call__(self, records: Sequence[KafkaRecord], outs: Sequence[OutRecord]) -> Awaitable[None] | None: ...



def route_records(nd: NearDupFilter, records: Sequence[KafkaRecord], settings: Settings,
                  ahead: Lookahead | None = None, following: Sequence[KafkaRecord] = ()) -> list[OutRecord]:
    """One output per input, in input order. Raises `IndexUnavailable` (nothing routed) on an outage.
    With `ahead`, the `following` records (fetched already) are decoded and fingerprinted meanwhile."""
    routed = (ahead or Lookahead(settings)).route(nd, records, following)
    return [output_of(rec, r, settings) for rec, r in zip(records, routed, strict=True)]


class Lookahead:
    """The worker's `ReadAhead`: Kafka records in, the following batch's raw records kept so that the
    batch prepared ahead is recognised when it is routed."""

    def __init__(self, settings: Settings) -> None:
        self._read_ahead = ReadAhead(settings.record_format())
        self._following: tuple[Sequence[KafkaRecord], list[RawRecord]] | None = None

    def route(self, nd: NearDupFilter, records: Sequence[KafkaRecord], following: Sequence[KafkaRecord]) -> list[Routed]:
        known, self._following = self._following, None
        raw = known[1] if known is not None and known[0] is records else [raw_record(r) for r in records]
        after = [raw_record(r) for r in following] if following else None
        routed = self._read_ahead.route(nd, raw, after)
        if after is not None:
            self._following = (following, after)
        return routed



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
        self.lookahead = Lookahead(settings)  # prepares the following batch while Redis works

    async def route(
        self,
        records: Sequence[KafkaRecord],
        *,
        following: Sequence[KafkaRecord] = (),
        pause: Callable[[], None] = lambda: None,
        resume: Callable[[], None] = lambda: None,
        keepalive: Callable[[], Awaitable[None]] | None = None,
        stopping: Callable[[], bool] = lambda: False,
        before_retry: Callable[[], Awaitable[bool]] | None = None,
    ) -> list[OutRecord] | None:
        """The outputs of `records`, or None when stopping before they could be routed. `following`: the
        records to be routed next, if fetched already (prepared meanwhile). `before_retry` runs before the
        batch is routed again after the index lost its data (`IndexLost`: the index changelog's guard), and says
        whether it is (else None is returned: its worker takes it again)."""
        if self.settings.on_index_error == "unchecked":
            return await self._route_unchecked(records, before_retry)
        while True:
            try:
                outs = await self._run(route_records, self.nd, records, self.settings, self.lookahead, following)
            except IndexLost:
                if before_retry is None:
                    raise
                # The index answered (it said it lost its data): an outage before ends here, and consumption goes on,
                # also when the batch is let go below (taken again, its records fetched again).
                self._answered(resume)
                # Rebuilt (or waited for): the batch is decided again, nothing of it written; or let go, taken again.
                if not await before_retry():
                    return None
                continue
            except IndexUnavailable as exc:
                self.stats.index_errors += 1
                self._attempts += 1
                pause()  # (every time: a new assignment since the outage began is not paused)
                if self._down_since is None:
                    self._down_since = time.monotonic()
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
            self._answered(resume)
            return outs

    def _answered(self, resume: Callable[[], None]) -> None:
        """The index answered: the outage going on, if any, ends (one log line) and consumption resumes."""
        if self._down_since is not None:
            log.warning("index available again after %.1fs (%d failed attempts): consumption resumed",
                        time.monotonic() - self._down_since, self._attempts)
            self._down_since = None
            self._attempts = 0
            self.backoff.reset()
            resume()

    @property
    def index_down(self) -> bool:
        """True from an index error until the index answers again."""
        return self._down_since is not None

    async def _route_unchecked(self, records: Sequence[KafkaRecord],
                               before_retry: Callable[[], Awaitable[bool]] | None = None) -> list[OutRecord] | None:
        now = time.monotonic()
        if self._down_since is None or now >= self._retry_at:
            if self._down_since is not None:
                self.retries += 1
            try:
                try:
                    outs = await self._run(route_records, self.nd, records, self.settings)
                except IndexLost:
                    if before_retry is None:
                        raise
                    if not await before_retry():  # rebuilt (or waited for): the batch once more, or taken again
                        return None
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
    config = settings.filter_config()
    index = open_index(settings.index, window=config.window, bucket_cap=config.bucket_cap, namespace=config.digest(),
                       fenced=settings.changelogged)
    return NearDupFilter(config, index=index)



class WorkerCore:
    """What both runtimes share: settings, the filter, the router and its stats, the stop signal."""

    def __init__(self, settings: Settings, nd: NearDupFilter | None = None, *,
                 observer: BatchObserver | None = None) -> None:
        self.settings = settings
        self.nd = nd or open_filter(settings)
        self.stats = WorkerStats()
        self.router = Router(settings, self.nd, self.stats)
        self.kafka = KafkaHealth()  # each runtime gives it a probe and watches the broker
        self.observer = observer
        self.stop_event = asyncio.Event()

    async def acknowledged(self, records: Sequence[KafkaRecord], outs: Sequence[OutRecord]) -> None:
        """A routed batch's outputs were acknowledged (before its commit): counted, and shown to the observer."""
        self.stats.add(outs)
        if self.observer is not None:
            maybe = self.observer(records, outs)
            if maybe is not None:
                await maybe
