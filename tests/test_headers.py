"""Verdicts a consumer can trust on a shared index: a duplicate always names a message that went to unique, and
a duplicate decided again after an aborted transaction gets the headers of its first decision."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence

import numpy as np
import orjson
import pytest

from bench.kafka_support import produce, redis_namespace, run_until, settings_for
from bench.reliability import read_outputs
from filters.engine import Message, NearDupFilter, Verdict
from filters.index import Batch, Candidate, Entry, IndexWrapper, Memo, Query, Verifier, finish
from filters.index.redis import RedisIndex
from filters.index.shared import AnsweredRounds, SharedDecider
from stream.kafka_tools import KafkaRecord, ensure_topics
from stream.outputs import OutRecord
from stream.router import open_filter
from stream.worker import AiokafkaWorker

ORIGINAL = "Congratulations! You have won a 1000 dollar gift card, call 555-0100 now to claim your prize today"
COPY_A = "Congratulations!! You have won a 1000 dollar gift card, call 555-0177 now to claim your prize today"
COPY_B = "Congratulations! You have won a 1000 dollar gift card, call 555-0199 now to claim your prize today!!"
COPY_C = "Congratulations!! You have won a 1000 dollar gift voucher, call 555-0177 now to claim your prize"


class Racing(AnsweredRounds, IndexWrapper):
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


    def insert(self, entries: Sequence[tuple[Entry, tuple[int, ...]]],
               memos: Sequence[Memo] = ()) -> list[list[Candidate] | None]:
        if self.batch:
            self.other.check_batch(self.batch)  # the other worker wins the race
            self.batch = ()
        return super().insert(entries, memos)


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


@pytest.mark.parametrize("layout", ["slot", "spread"])
@pytest.mark.parametrize(("clock", "found"), [(None, False), (294.0, True)])
def test_the_window_keeps_what_a_worker_running_behind_still_needs(url: str, clock: float | None, found: bool,
                                                                   layout: str) -> None:
    """A worker 7 s of event time behind the newest insert, which it has read, looks for a message 95.5 s
    before its own time (window 100 s). Without a clock the slice holding it went when the newest insert
    passed its end; with the group's low watermark as the clock (`expire`, as aligned workers set it) it
    stays, and the worker matches within the window of its own event time, as the filter does. The same on
    the spread layout, whose slices go in every shard."""
    from filters.config import FilterConfig
    from filters.index.backends import open_index

    config = FilterConfig(window=100.0)
    at = url + ("&layout=spread&shards=4" if layout == "spread" else "")
    ahead = NearDupFilter(config, index=open_index(at, window=100.0, bucket_cap=64, namespace=config.digest()))
    behind = NearDupFilter(config, index=open_index(at, window=100.0, bucket_cap=64, namespace=config.digest()))
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


class Crash(Exception):
    pass


@pytest.mark.services
@pytest.mark.timeout(120)
def test_a_duplicate_decided_again_after_an_aborted_transaction_keeps_its_headers(kafka_bootstrap: str, url: str) -> None:
    """Exactly-once, bucket cap 1. The worker routes a (unique; committed), then b, a copy of a: b's output is
    sent in a transaction, and the worker dies before the commit (the transaction is aborted when its
    successor, with the same instance id, starts). Meanwhile another worker indexes a newer message that
    shares every bucket of a: a is in none of them now. The restarted worker decides b again: a
    read_committed consumer sees one output of each input, and b's is the first decision's, header for
    header (duplicate of a, same similarity and method): nothing tells of the retry. Without the memo of
    b's verdict, b came out unique."""
    settings = settings_for(kafka_bootstrap, url, id_field="id", ts_field="ts", max_batch=1, bucket_cap=1,
                            processing_guarantee="exactly_once", group_instance_id="memo-w1", session_timeout=6.0)
    topic = settings.input_topics[0]
    lines = [orjson.dumps({"id": "a", "text": ORIGINAL, "ts": 100.0}), orjson.dumps({"id": "b", "text": COPY_C, "ts": 101.0})]
    first: dict[bytes, tuple[str, tuple[tuple[str, bytes], ...]]] = {}  # neardup-id -> (topic, headers)

    def crash_on_b(records: Sequence[KafkaRecord], outs: Sequence[OutRecord]) -> None:
        for out in outs:
            first[dict(out.headers)["neardup-id"]] = (out.topic, out.headers)
        if b"b" in first:
            raise Crash  # just before the batch's transaction commits

    async def scenario() -> list[KafkaRecord]:
        await ensure_topics(settings, [topic, *settings.output_topics])
        await produce(settings, topic, [(None, line, ()) for line in lines])
        with pytest.raises(Crash):
            await run_until(AiokafkaWorker(settings, observer=crash_on_b), lambda s: False)
        evict(settings)
        routed: set[bytes] = set()

        def note(records: Sequence[KafkaRecord], outs: Sequence[OutRecord]) -> None:
            routed.update(dict(out.headers)["neardup-id"] for out in outs)

        await run_until(AiokafkaWorker(settings, observer=note), lambda s: b"b" in routed, timeout=60)
        return await read_outputs(settings, committed=True, sources=len(lines), timeout=30)

    got = asyncio.run(scenario())
    assert sorted(dict(r.headers)["neardup-id"] for r in got) == [b"a", b"b"]  # each once
    b = next(r for r in got if dict(r.headers)["neardup-id"] == b"b")
    topic_first, headers_first = first[b"b"]
    assert dict(headers_first)["neardup-duplicate-of"] == b"a" and dict(headers_first)["neardup-method"] == b"mgram"
    assert (b.topic, b.headers) == (topic_first, headers_first)
    assert all(b"replay" not in dict(r.headers).values() and "neardup-late" not in dict(r.headers) for r in got)


def evict(settings: object) -> None:
    """Another worker indexes a message, newer than a and b, in every bucket of theirs (cap 1: a goes)."""
    nd = open_filter(settings)  # type: ignore[arg-type]
    keys = tuple(dict.fromkeys(nd.fingerprinter.fingerprint(ORIGINAL).keys + nd.fingerprinter.fingerprint(COPY_C).keys))
    filler = Entry("filler", 102.0, 7, 500, np.arange(1, 129, dtype=np.uint32))
    [(_, cands)] = nd.index.lookup([Query("filler", 102.0, keys)], 8)
    assert [c.entry.id for c in cands] == ["a"]
    assert nd.index.insert([(filler, keys)]) == [None]
    [(_, cands)] = nd.index.lookup([Query("q", 103.0, keys)], 8)
    assert [c.entry.id for c in cands] == ["filler"]
    nd.index.close()
