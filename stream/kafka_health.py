"""Whether the Kafka broker answers, as one worker sees it (`KafkaHealth`): an outage made visible.

aiokafka's clients reconnect on their own and mostly only log; `KafkaHealth` makes an outage visible: one
WARNING line, one INFO line when the broker answers again, `neardup_kafka_up` and `neardup_kafka_errors_total`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiokafka.errors import KafkaError

from stream.kafka_tools import INCONCLUSIVE, KAFKA_UNAVAILABLE

log = logging.getLogger("neardup.worker")

KAFKA_PROBE_EVERY = 1.0  # seconds between reachability probes while the broker is unavailable
_KAFKA_PROBE_TIMEOUT = 5.0
RETRY_PAUSE = 0.1  # seconds before an operation that failed with a transient error is tried again
# Seconds after an outage ended during which only a probe left unanswered (timed out) starts another: the clients
# reconnect and find the group coordinator again meanwhile, and their failures are no news.
SETTLE = 5.0


class KafkaHealth(logging.Filter):
    """Whether the broker answers, as one worker sees it: one WARNING line when it stops, one INFO line when it is back.

    aiokafka's clients retry on their own and mostly only log, so the evidence comes from two places: the
    worker's own operations failing with an unavailability error (`failed`: the broker is down), and
    aiokafka's log records carrying one (as a logging filter: the broker is suspect). `watch` decides a
    suspicion with a metadata request (`probe`): down if it fails; while down it probes every
    KAFKA_PROBE_EVERY seconds, and the first answer ends the outage. While suspect or down, each of
    aiokafka's log lines is shown once per outage: its reconnect loop repeats them thousands of times a
    second. `errors` counts failed operations and probes (a metric), not aiokafka's internal retries.
    """

    def __init__(self, probe: Callable[[], Awaitable[Any]] | None = None) -> None:
        super().__init__("neardup.kafka-health")
        self.probe = probe
        self.errors = 0
        self.suppressed = 0  # aiokafka log lines not shown in the current outage
        self._errors_before = 0  # `errors` when the current outage began
        self._down_since: float | None = None
        self._suspect = False
        self._evidence = ""
        self._shown: set[tuple[str, Any]] = set()
        self._up_at = -math.inf  # when the last outage ended

    @property
    def down(self) -> bool:
        return self._down_since is not None

    def failed(self, exc: BaseException, where: str) -> None:
        """An operation of the worker failed with a `transient` error: the broker is down if it was
        unreachable, suspect otherwise (a leader election, a request that timed out, a connection being made:
        the probe decides). A timeout says the broker hung, or says it late: the requests sent to a broker that
        hung fail one after another once it answers again, while the clients connect anew, and each taken for
        a new outage would say it again."""
        self.errors += 1
        self._suspect = True
        cause = f"{where}: {type(exc).__name__}: {exc}"
        if isinstance(exc, INCONCLUSIVE) or self._settling():
            self._evidence = self._evidence or cause
        elif isinstance(exc, KAFKA_UNAVAILABLE):
            self._mark_down(cause)

    def _settling(self) -> bool:
        return time.monotonic() - self._up_at < SETTLE

    def filter(self, record: logging.LogRecord) -> bool:
        if not self._suspect:
            args = record.args if isinstance(record.args, tuple) else ()
            if not any(isinstance(a, (*KAFKA_UNAVAILABLE, OSError)) for a in args):
                return True
            self._suspect = True
            self._evidence = record.getMessage()[:300]
        key = (record.name, record.msg)
        if key in self._shown:
            self.suppressed += 1
            return False
        self._shown.add(key)
        return True

    async def watch(self) -> None:
        """Until cancelled: settle suspicions and outages with probes."""
        assert self.probe is not None
        inconclusive = False  # the last probe failed as a connection being made fails
        while True:
            await asyncio.sleep(KAFKA_PROBE_EVERY if self.down else 0.2)
            if not self._suspect:
                continue
            try:
                await asyncio.wait_for(self.probe(), _KAFKA_PROBE_TIMEOUT)
            except (KafkaError, OSError, TimeoutError) as exc:
                self.errors += 1
                if not self.down and not isinstance(exc, TimeoutError) and (
                        self._settling() or (isinstance(exc, INCONCLUSIVE) and not inconclusive)):
                    # The clients connecting anew to a broker that answers again (after a freeze, say): the next
                    # probes decide. A broker that does not answer makes a probe time out.
                    inconclusive = True
                    continue
                self._mark_down(self._evidence or f"metadata request: {type(exc).__name__}: {exc}")
            else:
                self._mark_up()
            inconclusive = False

    async def retry(self, stopping: Callable[[], bool]) -> bool:
        """Before an operation that failed with a `transient` error is tried again: a pause (a leader elected, a
        connection made: no busy loop), then until the broker answers again (True), or stopping (False)."""
        await asyncio.sleep(RETRY_PAUSE)
        return await self.wait_up(stopping)

    async def wait_up(self, stopping: Callable[[], bool]) -> bool:
        """Until the broker answers again (True), or stopping (False)."""
        while self.down:
            if stopping():
                return False
            await asyncio.sleep(0.1)
        return True

    def _mark_down(self, cause: str) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            self._errors_before = self.errors - 1
            log.warning("kafka unavailable: %s (retrying; outputs not acknowledged are kept and nothing is "
                        "committed until they are)", cause)

    def _mark_up(self) -> None:
        if self._down_since is not None:
            self._up_at = time.monotonic()
            log.info("kafka available again after %.1fs (%d failed operations and probes; %d repeated client log "
                     "lines not shown)", time.monotonic() - self._down_since, self.errors - self._errors_before,
                     self.suppressed)
        self._down_since = None
        self._suspect = False
        self._evidence = ""
        self._shown.clear()
        self.suppressed = 0

    def attach(self) -> list[logging.Logger]:
        """Adds this filter to aiokafka's loggers (a logger's filters do not apply to its children)."""
        names = [n for n in list(logging.root.manager.loggerDict) if n == "aiokafka" or n.startswith("aiokafka.")]
        loggers = [logging.getLogger(n) for n in {"aiokafka", *names}]
        for logger in loggers:
            logger.addFilter(self)
        return loggers
