"""Event-time alignment: the aligner's order and waiting rules, the group's marks in Redis, and the worker on a
real broker, whose routing of a backlog on four partitions must equal the filter's on the same records."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from urllib.parse import urlsplit

import orjson
import pytest
import redis

from bench.kafka_support import free_port, redis_namespace, redis_server
from bench.reliability import (
    KEEP,
    ProxyThread,
    Serve,
    create_topics,
    produce_to,
    read,
    read_outputs,
    scenario_settings,
    serving,
    wait_assigned,
)
from filters.engine import NearDupFilter
from filters.errors import NeardupError
from stream import worker as worker_module
from stream.align import Aligner, GroupView, RedisMarks, open_marks
from stream.backlog import Item, backlog, differences, f1, reference, verdicts_of
from stream.kafka_tools import KafkaRecord, ensure_topics
from stream.worker import AiokafkaWorker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def rec(partition: int, ts: float, offset: int | None = None) -> KafkaRecord:
    """A record of partition `partition` at event time `ts` (its offset grows with it unless given)."""
    offset = round(ts * 1000) if offset is None else offset
    return KafkaRecord("in", partition, offset, round(ts * 1000), None, f"{partition}@{ts}".encode(), ())


def aligner(clock: Clock, skew: float = 5.0, idle: float = 1.0, buffer: int = 100) -> Aligner:
    return Aligner(lambda r: r.timestamp / 1000.0, max_skew=skew, idle_timeout=idle, buffer=buffer, clock=clock)


def times(taken: Sequence[KafkaRecord]) -> list[float]:
    return [r.timestamp / 1000.0 for r in taken]


# -- the aligner ---------------------------------------------------------------------------------


def test_partitions_are_merged_by_event_time_whatever_the_fetch_order() -> None:
    clock = Clock()
    a = aligner(clock)
    a.assign([("in", 0), ("in", 1), ("in", 2)])
    a.add([rec(0, t) for t in (10, 20, 30, 40)])  # fetched first, but later than most of the others
    a.add([rec(1, t) for t in (1, 2, 25, 50)])
    a.add([rec(2, t) for t in (3, 4, 5, 60)])
    a.flow(lambda lane: 0)
    taken = a.take(100)
    # Partition 0 ran dry at 40: nothing beyond 40 + max_skew until it has more or is idle.
    assert times(taken.records) == [1, 2, 3, 4, 5, 10, 20, 25, 30, 40]
    assert taken.waiting == "partition" and a.low_mark() == 1  # the batch is not decided yet
    a.decided(taken)
    assert a.low_mark() == 40  # partition 0's last event time: its next record is at least that
    a.flow(lambda lane: 0)  # partition 0 has nothing left to fetch: quiet from now
    assert not a.take(100)
    clock.now += 1.0  # ... for idle_timeout: idle, and partition 1 runs dry at 50 in turn
    assert times(a.take(100).records) == [50]
    a.flow(lambda lane: 0)
    clock.now += 1.0
    assert times(a.take(100).records) == [60]
    assert a.low_mark() is not None


def test_an_empty_partition_with_records_left_to_fetch_is_waited_for() -> None:
    clock = Clock()
    a = aligner(clock)
    a.assign([("in", 0), ("in", 1)])
    a.add([rec(0, t) for t in (1, 2, 100)])
    a.flow(lambda lane: 500 if lane == ("in", 1) else 0)  # partition 1: a backlog not fetched yet
    clock.now += 60
    assert a.take(100).waiting == "partition" and not a.take(100)
    a.add([rec(1, 1.5), rec(1, 99)])
    a.flow(lambda lane: 0)
    assert times(a.take(100).records) == [1, 1.5, 2, 99, 100]


def test_a_partition_run_dry_with_records_left_to_fetch_holds_the_others_to_its_last_event_time() -> None:
    """A partition whose buffer runs dry in a take lets the others go max_skew past its last event time only when
    it has nothing left to fetch (live traffic); with records left to fetch, or none known, not past it at all."""
    clock = Clock()
    a = aligner(clock, skew=5.0)
    a.assign([("in", 0), ("in", 1)])
    a.add([rec(0, t) for t in (1, 2)])  # a short first fetch: more of partition 0 comes
    a.add([rec(1, t) for t in (1.5, 3, 4, 6)])
    a.flow(lambda lane: 10 if lane == ("in", 0) else 0)
    taken = a.take(100)
    assert times(taken.records) == [1, 1.5, 2] and taken.waiting == "partition"
    a.flow(lambda lane: None if lane == ("in", 0) else 0)  # its end not known (a stale one says nothing)
    assert not a.take(100)
    a.add([rec(0, 2.5), rec(0, 5)])
    a.flow(lambda lane: 0)  # all fetched: partition 0 runs dry at 5, with nothing left to fetch
    assert times(a.take(100).records) == [2.5, 3, 4, 5, 6]


def test_a_partition_never_fetched_is_waited_for_only_so_long() -> None:
    clock = Clock()
    a = aligner(clock, idle=1.0)
    a.assign([("in", 0), ("in", 1)])
    a.add([rec(0, 1)])
    a.flow(lambda lane: None if lane == ("in", 1) else 0)  # no fetch answered for partition 1 yet
    clock.now += 2.0
    assert not a.take(10)  # not known: waited for longer than idle_timeout
    clock.now += 10.0
    assert times(a.take(10).records) == [1]


def test_nothing_is_taken_until_the_group_has_said_who_owns_what() -> None:
    clock = Clock()
    a = aligner(clock)
    a.assign([("in", 0)])
    a.add([rec(0, 1)])
    a.flow(lambda lane: 0)
    assert a.take(10, GroupView(None, complete=False)).waiting == "group"
    assert times(a.take(10, GroupView(None)).records) == [1]


def test_the_group_holds_a_worker_back_to_its_low_mark_plus_the_skew() -> None:
    clock = Clock()
    a = aligner(clock, skew=5.0)
    a.assign([("in", 0)])
    a.add([rec(0, t) for t in (100, 104, 105, 106, 200)])
    a.flow(lambda lane: 0)
    taken = a.take(100, GroupView(low=100.0))
    assert times(taken.records) == [100, 104, 105] and taken.waiting == "group"
    a.decided(taken)
    assert a.low_mark() == 106
    assert times(a.take(100, GroupView(low=106.0)).records) == [106]


def test_a_record_with_no_event_time_of_its_own_moves_nothing() -> None:
    """A record the worker will dead-letter (no text, not JSON: no event time) is placed after its
    partition's previous record: it neither makes later records late nor holds anything back."""
    clock = Clock()
    a = Aligner(lambda r: None if r.value == b"bad" else r.timestamp / 1000.0, max_skew=5.0, idle_timeout=1.0,
                buffer=100, clock=clock)
    a.assign([("in", 0), ("in", 1)])
    bad = KafkaRecord("in", 0, 5, 10_000_000 * 1000, None, b"bad", ())  # stamped "now" by Kafka
    a.add([rec(0, 100, offset=4), bad, rec(0, 101, offset=6)])
    a.add([rec(1, 99, offset=1), rec(1, 102, offset=2)])
    a.flow(lambda lane: 0)
    clock.now += 2
    taken = a.take(100)
    assert [r.offset for r in taken.records] == [1, 4, 5, 6, 2]
    assert not any(taken.late) and a.late == 0 and a.high == 102


def test_a_record_far_behind_what_the_worker_decided_is_late() -> None:
    """A quiet partition wakes up with old records: decided all the same, marked late; one within the skew
    is not. (Against the worker's own decisions since its assignment: records read again after a crash are
    not late, so a replay carries the headers of its first decision.)"""
    clock = Clock()
    a = aligner(clock, skew=5.0)
    a.assign([("in", 0), ("in", 1)])
    a.add([rec(0, 100), rec(0, 120)])
    a.flow(lambda lane: 0)
    clock.now += 2  # partition 1: idle
    assert times(a.take(100).records) == [100, 120]
    a.add([rec(1, 50), rec(1, 116)])
    taken = a.take(100)
    assert times(taken.records) == [50, 116]
    assert taken.late == [70.0, 0.0] and a.late == 1


def test_full_partitions_are_paused_and_resumed_when_drained() -> None:
    clock = Clock()
    a = aligner(clock, buffer=4)
    a.assign([("in", 0), ("in", 1)])
    for t in range(1, 6):  # a record a fetch
        a.add([rec(0, t, t)])
    a.add([rec(1, t) for t in range(1, 3)])
    assert a.flow(lambda lane: 0) == ([("in", 0)], [])
    a.take(5)
    assert a.flow(lambda lane: 0) == ([], [("in", 0)])


def test_a_partition_holds_two_fetches_before_it_is_paused() -> None:
    """The consumer drops what it fetched ahead of a paused partition: a buffer smaller than one fetch would
    pause the partition after every fetch and have the same records fetched again."""
    clock = Clock()
    a = aligner(clock, buffer=4)
    a.assign([("in", 0)])
    a.add([rec(0, t, t) for t in range(10)])  # one fetch of 10
    assert a.flow(lambda lane: 0) == ([], [])  # under 2 × 10
    a.add([rec(0, t, t) for t in range(10, 20)])
    assert a.flow(lambda lane: 0) == ([("in", 0)], [])
    a.take(10)
    assert a.flow(lambda lane: 0) == ([], [("in", 0)])  # drained to half of 20


def test_a_rebalance_keeps_what_is_still_owned_and_skips_what_comes_again() -> None:
    """After an assignment the consumer fetches each partition again from its committed offset, and may
    return records of the new assignment before the rebalance callback has run: every record is kept once
    (by its offset), and only the partitions taken away are dropped (their next owner reads them)."""
    clock = Clock()
    a = aligner(clock)
    a.assign([("in", 0), ("in", 1)])
    a.add([rec(0, 1, 0), rec(1, 2, 0), rec(1, 5, 1)])
    a.add([rec(2, 4, 0)])  # the new assignment's records, before the callback says so
    a.assign([("in", 1), ("in", 2)])
    a.add([rec(1, 2, 0), rec(1, 5, 1), rec(1, 7, 2), rec(2, 4, 0)])  # fetched again, and one new
    a.flow(lambda lane: 0)
    clock.now += 2
    assert times(a.take(10).records) == [2, 4, 5, 7]


def test_a_partition_sent_back_is_read_again() -> None:
    clock = Clock()
    a = aligner(clock)
    a.assign([("in", 0)])
    a.add([rec(0, 1, 0), rec(0, 2, 1)])
    a.rewind([("in", 0)])  # the consumer was sent back (an aborted transaction's records)
    a.add([rec(0, 1, 0), rec(0, 2, 1)])
    a.flow(lambda lane: 0)
    assert times(a.take(10).records) == [1, 2]


def test_records_read_again_after_an_abort_are_not_late() -> None:
    """Records decided, their transaction aborted, read again: they get the headers of the first time (no
    `neardup-late` against the event times of the aborted records themselves)."""
    clock = Clock()
    a = aligner(clock)
    a.assign([("in", 0)])
    a.add([rec(0, 1, 0), rec(0, 20, 1), rec(0, 40, 2)])
    a.flow(lambda lane: 0)
    assert a.take(10).late == [0.0, 0.0, 0.0]
    a.rewind([("in", 0)])
    a.add([rec(0, 1, 0), rec(0, 20, 1), rec(0, 40, 2)])
    assert a.take(10).late == [0.0, 0.0, 0.0]


def test_alignment_off_takes_records_as_fetched() -> None:
    a = Aligner(lambda r: r.timestamp / 1000.0, max_skew=5.0, idle_timeout=1.0, buffer=100, ordered=False)
    a.assign([("in", 0), ("in", 1)])
    a.add([rec(0, 10), rec(0, 20)])
    a.add([rec(1, 1)])
    assert times(a.take(10).records) == [10, 20, 1]


# -- the group's marks in Redis ------------------------------------------------------------------


@pytest.fixture
def index_url(redis_url: str) -> Iterator[str]:
    with redis_namespace(redis_url) as url:
        yield url


def test_marks_in_redis_give_the_groups_low_and_high_and_expire(index_url: str) -> None:
    async def scenario() -> None:
        every = [("in", 0), ("in", 1)]
        a = RedisMarks(index_url, namespace="ns", group="g", member="a", ttl=0.5)
        b = RedisMarks(index_url, namespace="ns", group="g", member="b", ttl=60)
        try:
            # a alone, owning half: b has not said what it owns yet, so nobody may go on.
            assert await a.publish(10.0, [("in", 0)], every) == GroupView(None, complete=False)
            assert await b.publish(15.5, [("in", 1)], every) == GroupView(10.0)
            assert await a.publish(12.0, [("in", 0)], every) == GroupView(15.5)
            assert await b.publish(None, [("in", 1)], every) == GroupView(12.0)  # b idle: holds nobody back
            assert await a.publish(13.0, [("in", 0)], every) == GroupView(None)
            # A rebalance: b now owns both, a has not said it lost its partition: a stale claim.
            assert (await b.publish(30.0, every, every)).complete is False
            await asyncio.sleep(0.7)  # a died: its mark expires, and so does its claim
            assert await b.publish(40.0, every, every) == GroupView(None)
            other = RedisMarks(index_url, namespace="ns", group="other", member="c", ttl=60)
            assert await other.publish(1.0, every, every) == GroupView(None)  # a group of its own
            await other.close()
        finally:
            await a.close()
            await b.close()
        c = RedisMarks(index_url, namespace="ns", group="g", member="c", ttl=60)
        assert await c.publish(50.0, every, every) == GroupView(None)  # b left, and its claim with it
        await c.close()

    asyncio.run(scenario())


def test_a_worker_held_back_wakes_when_another_mark_moves_not_when_it_is_refreshed(index_url: str) -> None:
    async def waited(marks: RedisMarks, timeout: float) -> tuple[GroupView | None, float]:
        started = time.monotonic()
        view = await marks.moved(timeout)
        return view, time.monotonic() - started

    async def scenario() -> None:
        every = [("in", 0), ("in", 1)]
        a = RedisMarks(index_url, namespace="ns", group="g", member="a", ttl=60)
        b = RedisMarks(index_url, namespace="ns", group="g", member="b", ttl=60)
        try:
            await b.publish(10.0, [("in", 1)], every)
            assert await a.publish(20.0, [("in", 0)], every) == GroupView(10.0)
            view, seconds = await waited(a, 0.3)
            assert view is None and seconds >= 0.25  # nothing moved since a read the marks: the timeout
            await b.publish(10.0, [("in", 1)], every)  # b refreshes its mark: nobody is woken
            await a.publish(25.0, [("in", 0)], every)  # a's own move does not wake a ...
            view, seconds = await waited(a, 0.3)
            assert view is None and seconds >= 0.25
            view, seconds = await waited(b, 5.0)  # ... it wakes b, with the marks as they are: no read needed
            assert view == GroupView(25.0) and seconds < 1.0

            async def b_decides() -> None:
                await asyncio.sleep(0.2)
                await b.publish(14.0, [("in", 1)], every)

            task = asyncio.ensure_future(b_decides())
            view, seconds = await waited(a, 5.0)
            assert view == GroupView(14.0) and 0.15 < seconds < 1.0  # woken by b's move, long before the timeout
            await task
            assert await a.publish(25.0, [("in", 0)], every) == GroupView(14.0)
            await b.publish(15.0, [("in", 1)], every)  # moved between a's read and a's wait: not missed
            view, seconds = await waited(a, 5.0)
            assert view == GroupView(15.0) and seconds < 0.5
            # Marks published before a's last read are older than what a read: a reads nothing from them.
            await b.publish(16.0, [("in", 1)], every)
            await asyncio.sleep(0.1)  # the news of b's move arrived ...
            assert await a.publish(25.0, [("in", 0)], every) == GroupView(16.0)  # ... but a read the marks since
            view, seconds = await waited(a, 0.3)
            assert view is None and seconds >= 0.25
            # A claim that does not fit (b says it owns both, a has not let go) is pushed as it is: incomplete.
            await b.publish(17.0, every, every)
            view, _ = await waited(a, 5.0)
            assert view is not None and view.complete is False
        finally:
            await a.close()
            await b.close()

    asyncio.run(scenario())


def test_a_worker_whose_mark_is_gone_holds_the_group_until_it_publishes_again(index_url: str) -> None:
    """The index's Redis lost its data, or a worker reset the group's marks after finding the index lost: a worker
    whose mark is gone may have decided records the rebuilt index does not hold. Its next publish writes its mark
    as 0 (`rejoined`), holding the group until it has written those back and published again; a worker that never
    published, or left, comes back without that."""
    async def scenario() -> None:
        every = [("in", 0), ("in", 1)]
        a = RedisMarks(index_url, namespace="ns", group="g", member="a", ttl=60)
        b = RedisMarks(index_url, namespace="ns", group="g", member="b", ttl=60)
        try:
            assert await a.publish(10.0, [("in", 0)], every) == GroupView(None, complete=False)
            assert await b.publish(15.0, [("in", 1)], every) == GroupView(10.0)
            await b.reset()
            assert await a.publish(20.0, [("in", 0)], every) == GroupView(None, complete=False, rejoined=True)
            assert await b.publish(30.0, [("in", 1)], every) == GroupView(0.0, rejoined=True)  # a holds it at 0
            assert await a.publish(20.0, [("in", 0)], every) == GroupView(0.0)  # a wrote back; b has not yet
            assert await b.publish(30.0, [("in", 1)], every) == GroupView(20.0)
            assert await a.publish(21.0, [("in", 0)], every) == GroupView(30.0)
            await a.close()
            again = RedisMarks(index_url, namespace="ns", group="g", member="a", ttl=60)
            try:
                assert await again.publish(22.0, [("in", 0)], every) == GroupView(30.0)  # left: no rejoin
            finally:
                await again.close()
        finally:
            await a.close()
            await b.close()

    asyncio.run(scenario())


def test_a_user_not_granted_the_channel_shares_its_marks_and_polls_them(tmp_path: Path) -> None:
    """An ACL user without pub/sub: the script's publish is refused inside it (the marks are written all the
    same), the subscription fails, and a held worker reads the marks again after a millisecond, not 50."""
    port = free_port()
    proc = redis_server(port, tmp_path)
    try:
        redis.Redis(port=port).acl_setuser("marks", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all"],
                                           reset_channels=True)

        async def scenario() -> None:
            every = [("in", 0), ("in", 1)]
            url = f"redis://marks:pw@127.0.0.1:{port}/0"
            a = RedisMarks(url, namespace="ns", group="g", member="a", ttl=60)
            b = RedisMarks(url, namespace="ns", group="g", member="b", ttl=60)
            try:
                await b.publish(10.0, [("in", 1)], every)
                assert await a.publish(20.0, [("in", 0)], every) == GroupView(10.0)
                started = time.monotonic()
                assert await a.moved(5.0) is None
                assert time.monotonic() - started < 0.5
                await b.publish(12.0, [("in", 1)], every)
                assert await a.publish(20.0, [("in", 0)], every) == GroupView(12.0)
            finally:
                await a.close()
                await b.close()

        asyncio.run(scenario())
    finally:
        proc.kill()
        proc.wait()


def test_after_a_redis_restart_the_marks_are_pushed_again(tmp_path: Path) -> None:
    """A Redis of this test's own, restarted without persistence: the calls' counter starts again, and a
    held worker still wakes with the marks (not only after its timeout) once both published again."""
    port = free_port()

    def start() -> subprocess.Popen[bytes]:
        return redis_server(port, tmp_path)

    async def scenario() -> None:
        every = [("in", 0), ("in", 1)]
        url = f"redis://127.0.0.1:{port}/0"
        a = RedisMarks(url, namespace="ns", group="g", member="a", ttl=60)
        b = RedisMarks(url, namespace="ns", group="g", member="b", ttl=60)
        for _ in range(20):  # a counter well ahead of what it restarts from
            await b.publish(10.0, [("in", 1)], every)
            await a.publish(30.0, [("in", 0)], every)
        await b.publish(11.0, [("in", 1)], every)
        assert await a.moved(5.0) == GroupView(11.0)
        nonlocal proc
        proc.kill()
        proc.wait()
        proc = start()

        async def publish(marks: RedisMarks, low: float, owned: list[tuple[str, int]]) -> None:
            for _ in range(20):  # the pool's connections to the old server fail once each
                try:
                    await marks.publish(low, owned, every)
                    return
                except NeardupError:
                    await asyncio.sleep(0.05)
            raise AssertionError("the marks could not be published after the restart")

        await publish(a, 30.0, [("in", 0)])
        await publish(b, 12.0, [("in", 1)])
        await publish(a, 30.0, [("in", 0)])
        await asyncio.sleep(0.2)  # a's listener has subscribed again

        async def b_decides() -> None:
            await asyncio.sleep(0.2)
            await publish(b, 13.0, [("in", 1)])

        task = asyncio.ensure_future(b_decides())
        started = time.monotonic()
        assert await a.moved(5.0) == GroupView(13.0)
        assert time.monotonic() - started < 1.0
        await task
        await a.close()
        await b.close()

    proc = start()
    try:
        asyncio.run(scenario())
    finally:
        proc.kill()
        proc.wait()


# -- the worker on a real broker -----------------------------------------------------------------


def _produce(settings, items: Sequence[Item]) -> None:  # type: ignore[no-untyped-def]
    async def go() -> None:
        await create_topics(settings, 4)
        # Idempotent: a batch retried after a leader election is not appended twice (a new topic).
        await produce_to(settings, [(i.partition, i.id.encode(), i.value) for i in items], enable_idempotence=True)
    asyncio.run(go())


async def _seen(workers: Sequence[AiokafkaWorker], tasks: Sequence[asyncio.Future[object]], count: int,
                deadline: float) -> None:
    """Until the workers have routed `count` records between them (a worker that stopped raises its error)."""
    while sum(w.stats.seen for w in workers) < count:
        for t in tasks:
            if t.done():
                t.result()
        assert time.monotonic() < deadline, [w.stats.line() for w in workers]
        await asyncio.sleep(0.05)


async def _backlog_then_live(settings, items: Sequence[Item]) -> list[AiokafkaWorker]:  # type: ignore[no-untyped-def]
    """Half the items a backlog on four partitions, the other half produced once two workers are routing it;
    the workers, stopped once they routed every item between them."""
    half = len(items) // 2
    await create_topics(settings, 4)
    await produce_to(settings, [(i.partition, i.id.encode(), i.value) for i in items[:half]])
    workers = [AiokafkaWorker(settings) for _ in range(2)]
    tasks = [asyncio.ensure_future(w.run()) for w in workers]
    deadline = time.monotonic() + 120
    try:
        await _seen(workers, tasks, half // 4, deadline)  # routing the backlog
        await produce_to(settings, [(i.partition, i.id.encode(), i.value) for i in items[half:]])  # live
        await _seen(workers, tasks, len(items), deadline)
    finally:
        for w in workers:
            w.stop()
        await asyncio.gather(*tasks)
    return workers


def _run_workers(settings, count: int, total: int) -> dict[str, str]:  # type: ignore[no-untyped-def]
    async def go() -> list[KafkaRecord]:
        workers = [AiokafkaWorker(settings) for _ in range(count)]
        tasks = [asyncio.ensure_future(w.run()) for w in workers]
        deadline = time.monotonic() + 120
        try:
            await _seen(workers, tasks, total, deadline)
        finally:
            for w in workers:
                w.stop()
            await asyncio.gather(*tasks)
        return await read_outputs(settings, sources=total, settle=0.5)

    return verdicts_of(asyncio.run(go()))


@pytest.mark.parametrize("workers", [1, 2])
def test_a_backlog_on_four_partitions_is_routed_as_the_filter_routes_it(kafka_bootstrap: str, index_url: str,
                                                                        workers: int) -> None:
    """Copies hours apart in event time sit in other partitions than their originals; the workers start on
    the whole backlog. Aligned, the routing is the filter's on the same records in event-time order."""
    items = backlog()
    want = reference(items, NearDupFilter())
    settings = scenario_settings(kafka_bootstrap, index_url, ts_field="ts", max_batch=100, max_skew=1800.0,
                                 session_timeout=10.0)
    _produce(settings, items)
    got = _run_workers(settings, workers, len(items))
    assert len(got) == len(items)
    # Within a worker the order is exact; across two, copies less than max_skew apart may be decided in
    # either order: this backlog's are an hour apart at least.
    assert differences(got, want) == []
    assert f1(got, items) == f1(want, items) == 1.0



def test_a_worker_joining_mid_backlog_changes_no_verdict(kafka_bootstrap: str, index_url: str) -> None:
    """One worker routes a backlog alone; a second joins while it holds a batch taken under the old assignment
    (and the next, taken ahead): what it keeps of them is taken again under the group's new view, so the copies
    (half an hour apart at least, max_skew one minute) are decided after their originals whoever decides them."""
    items = backlog(clusters=600, apart=(0.5, 3.0))
    want = reference(items, NearDupFilter())
    settings = scenario_settings(kafka_bootstrap, index_url, ts_field="ts", max_batch=200, max_skew=60.0,
                                 session_timeout=10.0)
    _produce(settings, items)

    async def slowly(records: Sequence[KafkaRecord], outs: object) -> None:
        if not workers[1].stats.seen:  # the first worker, a batch in 0.5 s until the second routes
            await asyncio.sleep(0.5)

    workers = [AiokafkaWorker(settings, observer=slowly), AiokafkaWorker(settings)]

    async def go() -> list[KafkaRecord]:
        tasks = [asyncio.ensure_future(workers[0].run())]
        deadline = time.monotonic() + 120
        try:
            await _seen(workers[:1], tasks, 200, deadline)  # the first alone, mid-backlog
            tasks.append(asyncio.ensure_future(workers[1].run()))
            await _seen(workers, tasks, len(items), deadline)
        finally:
            for w in workers:
                w.stop()
            await asyncio.gather(*tasks)
        assert all(w.stats.seen for w in workers)  # (both routed some)
        return await read_outputs(settings, sources=len(items), settle=0.5)

    got = verdicts_of(asyncio.run(go()))
    assert len(got) == len(items)
    assert differences(got, want) == []

def test_two_exactly_once_workers_fit_a_small_max_message_bytes_on_a_backlog_and_live_records(
        kafka_bootstrap: str, index_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """The unique topic takes record batches of at most 2,048 bytes (a batch of its outputs is several times
    that): two exactly-once workers read that at start and send smaller batches, neither stops. Half the
    records are a backlog on four partitions, the other half produced while the workers route; every record
    lands once (read committed), routed as the filter routes them."""
    items = backlog()
    want = reference(items, NearDupFilter())
    settings = scenario_settings(kafka_bootstrap, index_url, ts_field="ts", max_batch=100, max_skew=1800.0,
                                 session_timeout=10.0, processing_guarantee="exactly_once")
    caplog.set_level(logging.INFO, logger="neardup")

    async def go() -> list[KafkaRecord]:
        await ensure_topics(settings, [settings.unique_topic], 4, {**KEEP, "max.message.bytes": "2048"})
        workers = await _backlog_then_live(settings, items)
        assert [w.batch_bytes for w in workers] == [2048, 2048]
        return await read_outputs(settings, committed=True, sources=len(items), settle=0.5)

    records = asyncio.run(go())
    sources = [r.header("neardup-source") for r in records]
    assert len(sources) == len(set(sources)) == len(items)  # lost 0, doubled 0
    got = verdicts_of(records)
    # The live half arrives after the backlog's later records were decided: up to max_skew, two workers may
    # decide a copy and its original in either order, as in the fault test.
    assert len(differences(got, want)) <= 2
    assert not [r for r in caplog.records if "one by one" in r.getMessage()]
    assert len([r for r in caplog.records if "record batches of up to 2048 bytes" in r.getMessage()]) == 2


def test_two_workers_on_the_group_layout_route_a_backlog_and_live_records_as_the_filter(kafka_bootstrap: str,
                                                                                      index_url: str) -> None:
    """The index in the group layout (`?layout=group`: its watched rounds, and the checking script whenever the
    other worker inserted since a lookup): two workers, four partitions, half the records a backlog and half
    produced while they route; every record lands once, routed as the filter routes them."""
    items = backlog()
    want = reference(items, NearDupFilter())
    settings = scenario_settings(kafka_bootstrap, f"{index_url}&layout=group", ts_field="ts", max_batch=100,
                                 max_skew=1800.0, session_timeout=10.0)

    async def go() -> list[KafkaRecord]:
        workers = await _backlog_then_live(settings, items)
        assert all(w.nd.index.stats()["entries"] > 0 for w in workers)  # (the one namespace, seen by both)
        return await read_outputs(settings, sources=len(items), settle=0.5)

    records = asyncio.run(go())
    sources = [r.header("neardup-source") for r in records]
    assert len(sources) == len(set(sources)) == len(items)  # lost 0, doubled 0
    # As in the test above: the live half may meet two workers deciding a copy and its original within max_skew.
    assert len(differences(verdicts_of(records), want)) <= 2
    with redis.Redis.from_url(index_url.split("?")[0]) as client:  # the namespace is the group layout's
        prefix = index_url.split("prefix=")[1].split("&")[0]
        metas = [k for k in client.scan_iter(match=f"{{{prefix}:*}}:meta")]
        assert metas and all(client.hget(k, "layout") == b"group" for k in metas)


def test_without_alignment_the_same_backlog_is_routed_otherwise(kafka_bootstrap: str, index_url: str) -> None:
    """The test above can fail: drained in fetch order, the later copies are decided first."""
    items = backlog()
    want = reference(items, NearDupFilter())
    settings = scenario_settings(kafka_bootstrap, index_url, ts_field="ts", max_batch=100, align=False)
    _produce(settings, items)
    got = _run_workers(settings, 1, len(items))
    assert len(got) == len(items)
    assert len(differences(got, want)) > 20


def test_a_quiet_partition_does_not_stall_live_traffic(kafka_bootstrap: str, index_url: str) -> None:
    """Live records on three partitions, none on the fourth: each is routed within a fraction of a second
    (the quiet partition counts as idle after idle_timeout, once)."""
    settings = scenario_settings(kafka_bootstrap, index_url, max_batch=50, idle_timeout=0.5)
    latencies: list[float] = []

    async def go() -> None:
        await create_topics(settings, 4)
        worker = AiokafkaWorker(settings)
        task = asyncio.ensure_future(worker.run())
        try:
            await asyncio.sleep(3.0)  # joined and assigned
            for n in range(60):
                sent = time.monotonic()
                value = f'{{"id": "live-{n}", "text": "live message number {n} {"x" * (n % 7)} {n * 7919}"}}'
                await produce_to(settings, [(n % 3, None, value.encode())])
                while worker.stats.seen < n + 1:
                    assert time.monotonic() - sent < 5, worker.stats.line()
                    await asyncio.sleep(0.005)
                latencies.append(time.monotonic() - sent)
        finally:
            worker.stop()
            await task

    asyncio.run(go())
    latencies.sort()
    assert latencies[len(latencies) // 2] < 0.3, latencies
    assert latencies[-3] < 1.0, latencies  # at most the first records waited for the idle partition


def test_a_backlog_produced_while_the_worker_waits_for_a_restore_is_routed_in_event_time_order(
        kafka_bootstrap: str, index_url: str) -> None:
    """The worker waits for another's restore of the index (its lock held) before its first batch; meanwhile
    its consumer fetched the first few records of partition 3 (produced alone), and, once the rest of the
    backlog came, a full fetch of the others, but not partition 3 again (what it fetched of it waits to be
    returned): partition 3's end is that of the first fetch, its lag 0. Its few records run dry in the first
    take; the rest of it is still to fetch, so the others wait for it: a message of partition 3 and its later
    copy in partition 0, a few seconds apart, are decided in event-time order, as the filter decides them."""
    from filters.index.redis import RedisTarget

    rng = random.Random(5)

    def words(n: int) -> str:
        return " ".join("".join(rng.choice("kalomineruta") for _ in range(rng.randint(4, 9))) for _ in range(n))

    def item(partition: int, ts: float, ident: str, text: str) -> Item:
        return Item(partition, ts, ident, 0, orjson.dumps({"id": ident, "text": text, "ts": ts}))

    original = words(18) + " 48213"
    head = [item(3, 1000.0 + k, f"head-{k}", words(12)) for k in range(5)]  # partition 3's first fetch
    rest = [item(3, 1010.0, "original", original), item(0, 1020.0, "copy", original.replace("48213", "77125"))]
    rest += [item(p, 1000.5 + 2 * k + p / 4, f"f{p}-{k}", words(12)) for p in range(3) for k in range(150)]
    rest += [item(3, 1011.0 + 2 * k, f"f3-{k}", words(12)) for k in range(150)]  # partitions are in event-time order
    rest.sort(key=lambda i: i.ts)
    want = reference([*head, *rest], NearDupFilter())
    assert want["original"] == "unique" and want["copy"] == "duplicate"
    settings = scenario_settings(kafka_bootstrap, index_url, ts_field="ts", max_batch=100, max_skew=60.0)
    lock = f"{{{RedisTarget.parse(index_url).prefix}:{settings.filter_config().digest()}}}:restoring"
    r = redis.Redis.from_url(RedisTarget.parse(index_url).client_url)

    async def go() -> list[KafkaRecord]:
        await create_topics(settings, 4)
        r.set(lock, b"another worker", px=60_000)  # another worker restores the index (its marker is missing)
        worker = AiokafkaWorker(settings)
        task = asyncio.ensure_future(worker.run())
        try:
            deadline = time.monotonic() + 60
            while not worker._rebalance.assignments:
                assert not task.done() and time.monotonic() < deadline
                await asyncio.sleep(0.05)
            await produce_to(settings, [(i.partition, i.id.encode(), i.value) for i in head])
            await asyncio.sleep(1.5)  # partition 3's first fetch: its head only
            await produce_to(settings, [(i.partition, i.id.encode(), i.value) for i in rest])
            await asyncio.sleep(1.5)  # the others' fetches; partition 3's first waits to be returned meanwhile
            assert worker.stats.seen == 0
            r.delete(lock)  # the restore is done: the worker restores (an empty changelog) and routes
            await _seen([worker], [task], len(head) + len(rest), deadline)
        finally:
            worker.stop()
            await task
        return await read_outputs(settings, sources=len(head) + len(rest), settle=0.5)

    try:
        got = verdicts_of(asyncio.run(go()))
    finally:
        r.delete(lock)
        r.close()
    assert (got["original"], got["copy"]) == ("unique", "duplicate")
    assert differences(got, want) == []


def test_a_worker_that_takes_nothing_though_records_wait_says_why(kafka_bootstrap: str, index_url: str,
                                                                  caplog: pytest.LogCaptureFixture,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Held back (here by another member's mark, far behind), with records fetched and waiting: after
    STALL_WARNING the worker logs what holds each partition."""
    monkeypatch.setattr(worker_module, "STALL_WARNING", 1.0)
    items = backlog(clusters=20, copies=2)
    # (No changelog: a worker that builds the index at its start resets the group's marks, the member's with them.)
    settings = scenario_settings(kafka_bootstrap, index_url, ts_field="ts", max_batch=10, session_timeout=10.0,
                                 changelog=False)
    _produce(settings, items)
    worker = AiokafkaWorker(settings)

    async def go() -> None:
        behind = RedisMarks(index_url, namespace=worker.nd.config.digest(), group=settings.group_id, member="behind",
                            ttl=30.0)
        try:
            await behind.publish(0.0, [], [])  # a member far behind that owns nothing (yet)
            task = asyncio.ensure_future(worker.run())
            await asyncio.sleep(6.0)
            worker.stop()
            await task
        finally:
            await behind.close()

    with caplog.at_level(logging.WARNING, logger="neardup.worker"):
        asyncio.run(go())
    told = [r.getMessage() for r in caplog.records if r.getMessage().startswith("nothing routed for")]
    assert told and "waiting for: group" in told[0], told
    assert all(f"{settings.input_topics[0]}/{p}" in told[0] for p in range(4)), told  # each holds records
    assert worker.stats.seen == 0


@pytest.mark.parametrize("policy", ["block", "unchecked"])
def test_while_the_marks_cannot_be_shared_the_last_view_holds_unless_records_pass_unchecked(
        redis_url: str, policy: str) -> None:
    """Redis unreachable: a worker that routes nothing meanwhile (block) keeps the group's last view, so the
    batch it takes during the outage, decided once the index is back, is no further ahead of the others than
    before, and after a rebalance it takes nothing until it hears the group again; one whose records pass
    unchecked meanwhile goes on alone."""
    host, port = urlsplit(redis_url).hostname or "127.0.0.1", urlsplit(redis_url).port or 6379
    with ProxyThread(host, port) as proxy, redis_namespace(redis_url) as direct:
        index = direct.replace(f"{host}:{port}", f"127.0.0.1:{proxy.port}", 1)
        settings = scenario_settings("127.0.0.1:1", index, on_index_error=policy, retry_initial=0.2)
        worker = AiokafkaWorker(settings)

        async def go() -> None:
            worker.marks = open_marks(index, namespace="ns", group="g", member="w", ttl=10.0)
            try:
                await worker._publish_marks()  # reachable: nobody else, nothing owned
                worker.group = GroupView(100.0)  # as another worker's mark said
                proxy.down()
                await worker._publish_marks()
                assert worker.group == (GroupView(100.0) if policy == "block" else GroupView(None))
                # A new assignment meanwhile: the last view is another group's; until it hears the new one,
                # the worker takes nothing (it would take a batch far ahead of the others: decided as soon as
                # the index is back, before it hears of them again).
                await worker._assigned([])
                assert worker.group == GroupView(None, complete=False)
                # The loop's next take publishes (not the assignment callback: aiokafka sends no heartbeat until
                # it returns, and Redis may stall).
                assert worker._marked_at == -math.inf
                await worker._publish_marks()
                assert worker.group == (GroupView(None, complete=False) if policy == "block" else GroupView(None))
            finally:
                proxy.up()
                await worker.marks.close()

        asyncio.run(go())


def test_a_rebalance_during_an_index_outage_lets_the_batch_go_and_both_workers_route_on(
        kafka_bootstrap: str, redis_url: str) -> None:
    """Redis unreachable while a worker retries a batch, and a second worker joins: the first lets the batch go
    (nothing of it produced or committed: its partitions are revoked) instead of holding the rebalance up for
    the whole outage, and its poll that keeps it in the group does not wait for the rebalance that waits for it.
    The group settles during the outage, the newcomer takes nothing until it hears the group, and once Redis is
    back both route on: every record once, as the filter routes them."""
    items = backlog(clusters=200, copies=3)
    want = reference(items, NearDupFilter())
    host, port = urlsplit(redis_url).hostname or "127.0.0.1", urlsplit(redis_url).port or 6379
    with ProxyThread(host, port) as proxy, redis_namespace(redis_url) as direct:
        index = direct.replace(f"{host}:{port}", f"127.0.0.1:{proxy.port}", 1)
        settings = scenario_settings(kafka_bootstrap, index, ts_field="ts", max_batch=50, max_skew=1800.0,
                                     session_timeout=6.0, retry_initial=0.2, retry_max=1.0)
        _produce(settings, items)

        async def slowly(records: Sequence[KafkaRecord], outs: object) -> None:
            await asyncio.sleep(0.2)  # the first worker is mid-backlog when Redis goes

        workers = [AiokafkaWorker(settings, observer=slowly), AiokafkaWorker(settings)]

        async def go() -> list[KafkaRecord]:
            tasks = [asyncio.ensure_future(workers[0].run())]
            deadline = time.monotonic() + 120
            try:
                await _seen(workers[:1], tasks, 100, deadline)
                proxy.down()
                await asyncio.sleep(1.0)  # its batch retried
                tasks.append(asyncio.ensure_future(workers[1].run()))
                while not (workers[1]._rebalance.assignments and workers[0]._rebalance.assignments > 1):
                    assert time.monotonic() < deadline - 90, "the rebalance did not end during the outage"
                    await asyncio.sleep(0.05)
                assert workers[1].stats.seen == 0  # nothing taken without the group's view
            finally:
                proxy.up()
            try:
                await _seen(workers, tasks, len(items), deadline)
            finally:
                for w in workers:
                    w.stop()
                await asyncio.gather(*tasks)
            return await read_outputs(settings, sources=len(items), settle=0.5)

        records = asyncio.run(go())
    sources = [r.header("neardup-source") for r in records]
    assert len(sources) == len(set(sources)) == len(items)
    assert differences(verdicts_of(records), want) == []

@pytest.mark.parametrize("options", ["", "&round=16", "&layout=group&round=16"])
def test_two_serve_workers_with_a_kill_9_and_a_redis_outage_route_a_backlog_as_the_filter(
        kafka_bootstrap: str, redis_url: str, tmp_path: Path, options: str) -> None:
    """Exactly-once, two `neardup serve` processes on a 4-partition backlog; one is killed with kill -9
    mid-run and started again, then Redis is unreachable for 3 s (stopped and started, data kept). Read
    committed: every record exactly once, routed as the filter routes it, no trace of the faults. Also with
    batches decided in parts of 16 (`?round=16`), each part's transaction going out before the next part is
    looked up (`insert_ahead`), in the slot and the group layout."""
    items = backlog(clusters=400, copies=3)
    want = reference(items, NearDupFilter())
    host, port = urlsplit(redis_url).hostname or "127.0.0.1", urlsplit(redis_url).port or 6379
    with ProxyThread(host, port) as proxy, redis_namespace(redis_url) as direct:
        index = direct.replace(f"{host}:{port}", f"127.0.0.1:{proxy.port}", 1) + options
        settings = scenario_settings(kafka_bootstrap, index, ts_field="ts", max_batch=50, max_skew=1800.0,
                                     processing_guarantee="exactly_once", session_timeout=6.0, retry_initial=0.2,
                                     retry_max=1.0)
        _produce(settings, items)
        with serving() as started:
            hook = "pause=0.02"  # slowed down, so that the faults land mid-stream
            a = Serve(settings, tmp_path, "a", hook=hook, args=["--group-instance-id", "a"])
            b = Serve(settings, tmp_path, "b", hook=hook, args=["--group-instance-id", "b"])
            started += [a, b]
            wait_assigned([a, b], 4)
            read(settings, committed=True, sources=len(items) // 5, settle=0.0, timeout=60)
            b.kill()
            b2 = Serve(settings, tmp_path, "b2", hook=hook, args=["--group-instance-id", "b"])
            started.append(b2)
            wait_assigned([a, b2], 4)  # started: serve refuses an index it cannot reach at start
            read(settings, committed=True, sources=len(items) // 2, settle=0.0, timeout=60)
            proxy.down()
            time.sleep(3.0)
            proxy.up()
            got = read(settings, committed=True, sources=len(items), settle=2.0, timeout=120)
            for w in (a, b2):
                w.alive()
    sources = [r.header("neardup-source") for r in got]
    assert len(sources) == len(set(sources)) == len(items)  # lost 0, doubled 0
    routed = verdicts_of(got)
    diff = differences(routed, want)
    assert len(diff) <= 2, diff
    assert abs(f1(routed, items) - f1(want, items)) <= 0.005
    assert not any(r.header("neardup-method") == b"replay" or r.header("neardup-late") for r in got)


def test_the_event_time_is_the_one_the_filter_decides_with() -> None:
    """The aligner orders by the time `decode` gives a record: its timestamp field, else the Kafka timestamp."""
    from stream.codec import RecordFormat, decode, event_time

    fmt = RecordFormat("json", "text", "id", "ts")
    for raw in (b'{"text": "hello there", "ts": 1700000123.5}', b'{"text": "hello there", "ts": "17.25"}',
                b'{"text": "hello there"}', b'\xef\xbb\xbf{"text": "bom", "ts": 42}'):
        assert event_time(raw, fmt, 99.0) == decode(raw, fmt, fallback_id="x", fallback_ts=99.0).message.ts
    for rejected in (b"not json", b'{"text": "x", "ts": -1}', b"[1, 2]", b'{"text": "x", "ts": "soon"}',
                     b'{"id": "bad-1", "txt": "no text field here"}', b'{"text": "  ", "ts": 5}'):
        assert event_time(rejected, fmt, 99.0) is None  # dead-lettered: no event time of its own
    assert event_time(b'{"text": "x", "ts": 5}', RecordFormat("text"), 7.0) == 7.0
    assert event_time(b'{"text": "x", "ts": 5}', RecordFormat("json", ts_field=""), 7.0) == 7.0
