"""Verdicts a consumer can trust on a shared index: a duplicate always names a message that went to unique."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

from bench.kafka_support import redis_namespace
from filters.engine import Message, NearDupFilter, Verdict
from filters.index import Batch, Candidate, Entry, IndexWrapper, Query, Verifier, finish
from filters.index.redis import RedisIndex
from filters.index.shared import SharedDecider

ORIGINAL = "Congratulations! You have won a 1000 dollar gift card, call 555-0100 now to claim your prize today"
COPY_A = "Congratulations!! You have won a 1000 dollar gift card, call 555-0177 now to claim your prize today"
COPY_B = "Congratulations! You have won a 1000 dollar gift card, call 555-0199 now to claim your prize today!!"


class Racing(IndexWrapper):
    """The Redis index of one worker, with another worker's batch decided between its lookup and its insert:
    what two workers racing on near-duplicates do, on cue (the shared decision over its own rounds)."""

    def __init__(self, index: RedisIndex, other: NearDupFilter, batch: Sequence[Message]) -> None:
        super().__init__(index)
        self.other = other
        self.batch = batch
        self._decider = SharedDecider()

    def decide(self, batch: Batch, verifier: Verifier) -> list[Verdict]:
        verdicts = self._decider.decide(self, batch, verifier)
        finish(batch.meanwhile)
        return verdicts

    def prefetch(self, queries: Sequence[Query]) -> None:
        pass  # every lookup reads when it is made

    def insert(self, entries: Sequence[tuple[Entry, tuple[int, ...]]]) -> list[list[Candidate] | None]:
        if self.batch:
            self.other.check_batch(self.batch)  # the other worker wins the race
            self.batch = ()
        return super().insert(entries)


@pytest.fixture
def url(redis_url: str) -> Iterator[str]:
    with redis_namespace(redis_url) as url:
        yield url


def test_a_duplicate_of_a_message_that_lost_its_insert_race_names_the_winner(url: str) -> None:
    """Worker 1 decides [a, b]: a unique, b a copy of a (in the batch). Before a is inserted, worker 2
    indexes the original o. a's insert conflicts, a becomes a duplicate of o, and b, which matched a, must
    name o: a is not in `unique`."""
    other = NearDupFilter(index=url)
    racing = Racing(RedisIndex(url, window=3600, bucket_cap=64, namespace=other.config.digest()), other,
                    [Message("o", ORIGINAL, 100.0)])
    nd = NearDupFilter(index=racing)
    a, b = nd.check_batch([Message("a", COPY_A, 101.0), Message("b", COPY_B, 102.0)])
    assert (a.duplicate, a.duplicate_of) == (True, "o")
    assert (b.duplicate, b.duplicate_of) == (True, "o")
    other.index.close()
    racing.close()


@pytest.mark.parametrize(("clock", "found"), [(None, False), (294.0, True)])
def test_the_window_keeps_what_a_worker_running_behind_still_needs(url: str, clock: float | None, found: bool) -> None:
    """A worker 7 s of event time behind the newest insert, which it has read, looks for a message 95.5 s
    before its own time (window 100 s). Without a clock the slice holding it went when the newest insert
    passed its end; with the group's low watermark as the clock (`expire`, as aligned workers set it) it
    stays, and the worker matches within the window of its own event time, as the filter does."""
    from filters.config import FilterConfig

    config = FilterConfig(window=100.0)
    ahead = NearDupFilter(config, index=RedisIndex(url, window=100.0, bucket_cap=64, namespace=config.digest()))
    behind = NearDupFilter(config, index=RedisIndex(url, window=100.0, bucket_cap=64, namespace=config.digest()))
    if clock is not None:
        ahead.index.expire(clock)
        behind.index.expire(clock)
    assert not ahead.check(ORIGINAL, id="o", ts=199.5).duplicate
    assert not ahead.check("An entirely different message about the weather in Lisbon tomorrow", id="w", ts=301.0).duplicate
    assert not behind.check("Nothing like the others: a recipe for lentil soup with cumin", id="x", ts=294.0).duplicate
    verdict = behind.check(COPY_A, id="a", ts=295.0)
    assert verdict.duplicate is found and verdict.duplicate_of == ("o" if found else None)
    ahead.index.close()
    behind.index.close()
