"""The Kafka worker against real Kafka and Redis: routing, headers, pass-through, replay, crash/restart, outages, SASL."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, RecordsToDelete
from aiokafka.errors import MessageSizeTooLargeError
from aiokafka.partitioner import DefaultPartitioner

from bench.kafka_support import (
    TcpProxy,
    committed,
    create_topics_with,
    drop_index,
    free_port,
    outputs,
    produce,
    redis_namespace,
    reference_verdicts,
    run_until,
    settings_for,
    unique_name,
)
from bench.reliability import KEEP, cluster_text, read
from filters.errors import BrokerUnavailable, ConfigError
from filters.index import Batch, CandidateIndex, IndexWrapper, Verifier
from filters.records import Verdict
from stream import commands
from stream import worker as worker_module
from stream.backlog import backlog
from stream.config import Settings
from stream.delivery import AtLeastOnce, Delivery, ExactlyOnce, Link, capped_batch_bytes
from stream.faust_worker import FaustWorker
from stream.kafka_health import KafkaHealth
from stream.kafka_tools import KafkaRecord, admin_client, client_options, ensure_topics, producer
from stream.outputs import OutRecord, raw_record
from stream.router import Lookahead, open_filter, route_records
from stream.worker import AiokafkaWorker, make_worker

pytestmark = [pytest.mark.services, pytest.mark.timeout(120)]

SAMPLE = Path(__file__).parent / "data" / "sample.jsonl"


@pytest.fixture
def index_url(redis_url: str) -> Iterator[str]:
    with redis_namespace(redis_url) as url:
        yield url


def by_source(records: Sequence[KafkaRecord]) -> dict[str, list[KafkaRecord]]:
    out: dict[str, list[KafkaRecord]] = {}
    for r in records:
        source = r.header("neardup-source")
        assert source is not None, r
        out.setdefault(source.decode(), []).append(r)
    return out


def verdict(r: KafkaRecord) -> tuple[str, str | None]:
    """(output kind, duplicate_of) of an output record."""
    dup_of = r.header("neardup-duplicate-of")
    return (r.header("neardup-verdict") or b"").decode(), dup_of.decode() if dup_of is not None else None


GOOD = [
    (b"k-a", b'{"id": "a", "text": "WIN a FREE iPhone now!!! call 555-0100 to claim your prize"}',
     (("trace", b"t-1"), ("x-bin", b"\x00\xff"))),
    (b"k-b", b'{"id": "b", "text": "w i n a free iphone NOW, call 555-0199 to claim your prize"}', (("trace", b"t-2"),)),
    (None, b'{"id": "c", "text": "The meeting moved to Thursday at ten; bring the quarterly numbers."}', ()),
]
BAD = [
    (b"k-utf", b'{"id": "u", "text": "caf\xe9"}', (("trace", b"t-3"),)),  # Latin-1, not UTF-8
    (b"k-json", b'{"id": "j", "text": ', ()),
    (b"k-notext", b'{"id": "n", "body": "no text field"}', ()),
    (b"k-tomb", None, ()),  # a tombstone
]


@pytest.mark.parametrize("runtime", ["aiokafka", "faust"])
def test_good_duplicate_and_bad_records_land_in_the_right_topics(
    kafka_bootstrap: str, index_url: str, runtime: str
) -> None:
    settings = settings_for(kafka_bootstrap, index_url, runtime=runtime, id_field="id")
    inputs = GOOD + BAD
    topic = settings.input_topics[0]

    async def scenario() -> list[KafkaRecord]:
        await ensure_topics(settings, [topic, *settings.output_topics])
        await produce(settings, topic, inputs)
        await run_until(make_worker(settings), lambda s: s.seen >= len(inputs))
        return await outputs(settings, len(inputs), settle=0.3)  # and nothing more arrives

    got = by_source(asyncio.run(scenario()))
    assert sorted(got) == [f"{topic}/0/{i}" for i in range(len(inputs))]  # each exactly once
    for i, (key, value, headers) in enumerate(inputs):
        (out,) = got[f"{topic}/0/{i}"]
        assert (out.key, out.value) == (key, value)  # passed through unchanged
        assert out.headers[: len(headers)] == headers  # input headers first, unchanged
    a, b, c, utf, js, notext, tomb = (got[f"{topic}/0/{i}"][0] for i in range(len(inputs)))
    assert (a.topic, verdict(a)) == (settings.unique_topic, ("unique", None))
    assert (b.topic, verdict(b)) == (settings.duplicate_topic, ("duplicate", "a"))
    assert 0.5 <= float(b.header("neardup-similarity") or b"0") <= 1.0
    assert b.header("neardup-method") and b.header("neardup-id") == b"b"
    assert (c.topic, verdict(c)) == (settings.unique_topic, ("unique", None))
    assert {r.topic for r in (utf, js, notext, tomb)} == {settings.dead_letter_topic}
    assert utf.header("neardup-reason") == b"invalid_utf8" and b"UTF-8" in (utf.header("neardup-error") or b"")
    assert js.header("neardup-reason") == b"invalid_json"
    assert notext.header("neardup-reason") == b"no_text"
    assert tomb.value is None and tomb.header("neardup-reason") == b"invalid_json"
    assert all(r.header("neardup-verdict") == b"rejected" for r in (utf, js, notext, tomb))


def test_the_faust_runtime_keeps_the_group_liveness_of_the_settings(tmp_path: Path) -> None:
    """A member killed is replaced within `session_timeout` on the faust runtime too (faust's own default is
    60 s: the group stood still a minute after a kill -9)."""
    worker = FaustWorker(Settings(runtime="faust", session_timeout=6.0, index="memory://", state_dir=str(tmp_path)))
    assert (worker.app.conf.broker_session_timeout, worker.app.conf.broker_heartbeat_interval) == (6.0, 2.0)


def test_the_faust_runtime_without_a_broker_stops_with_one_error(index_url: str) -> None:
    """Kafka unreachable, topics not created first: the error the worker stops with is neardup's (one line
    and an exit code), not the Kafka client's traceback; as the aiokafka runtime's."""
    for runtime in ("aiokafka", "faust"):
        settings = settings_for("127.0.0.1:1", index_url, runtime=runtime, create_topics=False)
        with pytest.raises(BrokerUnavailable, match="127.0.0.1:1"):
            asyncio.run(asyncio.wait_for(make_worker(settings).run(), 60))


def test_two_releases_at_once_let_go_of_the_same_partitions(kafka_bootstrap: str) -> None:
    """A worker stopping (SIGTERM) while a rebalance revokes its partitions lets go of them twice at once:
    both wait until the group shows the offsets its transactions committed, and neither fails when the other
    let a partition go first (it was a KeyError: the worker died with a traceback instead of leaving)."""
    settings = settings_for(kafka_bootstrap, "memory://", processing_guarantee="exactly_once")
    topic = settings.input_topics[0]
    tps = [TopicPartition(topic, p) for p in range(2)]

    async def scenario() -> dict[TopicPartition, int]:
        await ensure_topics(settings, [topic], partitions=2)
        consumer = AIOKafkaConsumer(group_id=settings.group_id, enable_auto_commit=False, **client_options(settings))
        await consumer.start()
        try:
            consumer.assign(tps)
            await consumer.commit({tp: 3 for tp in tps})
            delivery = ExactlyOnce(settings, Link(
                consumer=consumer, producer=None, kafka=KafkaHealth(), stopping=lambda: False,
                acknowledged=lambda records, outs: asyncio.sleep(0), assignments=lambda: 0, reread=lambda r: None))
            delivery.unconfirmed.update({tp: 3 for tp in tps})
            await asyncio.gather(delivery.release(), delivery.release())
            return delivery.unconfirmed
        finally:
            await consumer.stop()

    assert asyncio.run(scenario()) == {}


class _Stalls(IndexWrapper):
    """The index's door, whose next batch (once `armed`) takes `seconds` longer: an index that stalls (a Redis
    paused, a rebuild waited for)."""

    def __init__(self, inner: CandidateIndex, seconds: float) -> None:
        super().__init__(inner)
        self.seconds = seconds
        self.armed = False
        self.stalled = threading.Event()

    def decide(self, batch: Batch, verifier: Verifier) -> list[Verdict]:
        if self.armed:
            self.armed = False
            self.stalled.set()
            time.sleep(self.seconds)
        return self.inner.decide(batch, verifier)


@pytest.mark.parametrize("group_wait", [None, 7.0])
def test_a_revocation_held_up_by_the_index_longer_than_the_session_doubles_nothing(
        kafka_bootstrap: str, redis_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        group_wait: float | None) -> None:
    """Exactly-once, static members, session 6 s: worker `a` routes a 4-partition backlog alone; a second
    worker joins while `a`'s batch is held 10 s by its index, so `a`'s revocation (which first delivers and
    commits what it routed) takes that long. The group waits for it (`REBALANCE_TIMEOUT`), so the partitions
    go to `b` only after `a` committed: every input in the outputs exactly once. (With the group's wait at the
    session timeout, `b` read the committed offsets first and routed `a`'s batch again.) With the group's wait
    at 7 s (`group_wait`), shorter than the stall, the group gives `a`'s partitions to `b` first: `a`, past
    half of that wait, aborts its batch instead of committing it (`_Rebalance.late`), and `b` routes it once."""
    if group_wait is not None:
        monkeypatch.setattr(worker_module, "REBALANCE_TIMEOUT", group_wait)
    items = backlog(clusters=120, copies=3)
    with redis_namespace(redis_url) as url:
        settings = settings_for(kafka_bootstrap, url, id_field="id", ts_field="ts", max_batch=20, max_skew=1800.0,
                                processing_guarantee="exactly_once", session_timeout=6.0, changelog=False)
        topic = settings.input_topics[0]
        nd_a = open_filter(settings)
        stalls = _Stalls(nd_a.index, 10.0)
        nd_a.index = stalls
        a = AiokafkaWorker(replace(settings, group_instance_id="a"), nd_a)
        b = AiokafkaWorker(replace(settings, group_instance_id="b"))

        async def scenario() -> None:
            await ensure_topics(settings, [topic, *settings.output_topics], 4)
            async with producer(settings) as p:
                await asyncio.gather(*[await p.send(topic, i.value, partition=i.partition) for i in items])
            running_a = asyncio.ensure_future(a.run())
            try:
                while a.stats.seen < len(items) // 4:
                    assert not running_a.done(), running_a.result()
                    await asyncio.sleep(0.05)
                stalls.armed = True
                while not stalls.stalled.is_set():
                    await asyncio.sleep(0.01)
                await run_until(b, lambda s: a.stats.seen + s.seen >= len(items), timeout=120)
            finally:
                a.stop()
                await asyncio.wait_for(running_a, 60)

        with caplog.at_level(logging.WARNING, logger="neardup.worker"):
            asyncio.run(scenario())
        got = read(settings, committed=True, sources=len(items), settle=2.0, timeout=60)
    sources = [r.header("neardup-source") for r in got]
    assert len(sources) == len(set(sources)) == len(items)  # lost 0, doubled 0
    if group_wait is not None:  # the late revocation's batch was aborted, not committed
        assert any("its transaction is aborted" in r.getMessage() for r in caplog.records)


def test_replay_gets_the_same_verdict(kafka_bootstrap: str, index_url: str) -> None:
    """A second group re-reads everything (a full replay): same verdicts and the same headers, so that a
    consumer cannot tell a replay (after a crash or an aborted transaction) from the first decision."""
    settings = settings_for(kafka_bootstrap, index_url, id_field="id", ts_field="ts", max_batch=64)
    lines = SAMPLE.read_bytes().splitlines()
    topic = settings.input_topics[0]

    async def scenario() -> tuple[list[KafkaRecord], list[KafkaRecord]]:
        await produce(settings, topic, [(None, line, ()) for line in lines])
        await run_until(make_worker(settings), lambda s: s.seen >= len(lines))
        first = await outputs(settings, len(lines))
        again = replace(settings, group_id=settings.group_id + "-replay")
        await run_until(make_worker(again), lambda s: s.seen >= len(lines))
        both = await outputs(settings, 2 * len(lines))
        return first, both

    first, both = asyncio.run(scenario())
    original = {source: verdict(rs[0]) for source, rs in by_source(first).items()}
    assert len(original) == len(lines)
    replayed = by_source(both)
    for source, records in replayed.items():
        assert len(records) == 2
        assert verdict(records[1]) == original[source], source
        assert records[1].headers == records[0].headers, source
    assert Counter(kind for kind, _ in original.values()) == Counter(
        {"unique": 169, "duplicate": 131, "rejected": 2})


class Crash(Exception):
    pass


def test_crash_after_produce_before_commit_then_restart(kafka_bootstrap: str, index_url: str) -> None:
    """At-least-once: the worker dies after batch 3 was delivered but before its commit (batch 4 may be
    out too: the worker is pipelined); the restarted worker re-reads from batch 3: every input is routed,
    and each output copy has the single-run verdict."""
    settings = settings_for(kafka_bootstrap, index_url, id_field="id", ts_field="ts", max_batch=40)
    lines = SAMPLE.read_bytes().splitlines()
    topic = settings.input_topics[0]
    crashed_batch: list[KafkaRecord] = []

    def crash_on_third(records: Sequence[KafkaRecord], outs: Sequence[OutRecord]) -> None:
        if worker.stats.batches == 3:
            crashed_batch.extend(records)
            raise Crash

    worker = AiokafkaWorker(settings, observer=crash_on_third)

    async def scenario() -> list[KafkaRecord]:
        await produce(settings, topic, [(None, line, ()) for line in lines])
        with pytest.raises(Crash):
            await run_until(worker, lambda s: False)
        before = await committed(settings)
        assert before == {0: crashed_batch[0].offset}  # batches 1-2 committed, batch 3 not
        first_run = len(await outputs(settings, 2 * len(lines), timeout=0.5))
        restarted = make_worker(settings)
        remaining = len(lines) - crashed_batch[0].offset
        await run_until(restarted, lambda s: s.seen >= remaining)
        assert await committed(settings) == {0: len(lines)}
        return await outputs(settings, first_run + remaining, timeout=20)

    got = by_source(asyncio.run(scenario()))
    reference = reference_verdicts(lines, settings, topic)
    assert set(got) == set(reference)  # nothing lost
    first_replayed = crashed_batch[0].offset
    for source, records in got.items():
        offset = int(source.rsplit("/", 1)[1])
        if offset < first_replayed:
            assert len(records) == 1, source  # committed before the crash: never re-read
        else:
            assert len(records) in (1, 2), source
            if offset <= crashed_batch[-1].offset:
                assert len(records) == 2, source  # delivered, then re-read after the restart
        ref = reference[source]
        expected = ("rejected", None) if ref.kind == "rejected" else (
            ref.kind, ref.verdict.duplicate_of if ref.verdict else None)
        for r in records:
            assert verdict(r) == expected, source


def _through_an_index_outage(kafka_bootstrap: str, redis_url: str, *, lose: bool
                             ) -> tuple[list[KafkaRecord], AiokafkaWorker, Settings]:
    """Redis behind a proxy that goes down once the worker has joined its group (and heard the group's
    event-time marks); the records produced then are taken, nothing is produced or committed; then Redis comes
    back (with `lose`, without the namespace's data) and the worker runs until every record is routed. The
    outputs, the worker and its settings."""
    port = free_port()
    host, redis_port = redis_url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    with redis_namespace(redis_url) as direct:
        url = direct.replace(f"{host}:{redis_port}", f"127.0.0.1:{port}", 1)
        settings = settings_for(kafka_bootstrap, url, retry_initial=0.05, retry_max=0.2, id_field="id")
        proxy = TcpProxy(host, int(redis_port), port)
        inputs = GOOD + BAD
        worker = make_worker(settings)
        assert isinstance(worker, AiokafkaWorker)

        async def scenario() -> list[KafkaRecord]:
            await proxy.start()
            task = asyncio.ensure_future(run_until(worker, lambda s: s.seen >= len(inputs)))
            while not (worker._rebalance.assignments and worker.group.complete):
                assert not task.done(), task
                await asyncio.sleep(0.02)
            await proxy.stop()
            await produce(settings, settings.input_topics[0], inputs)
            while worker.stats.index_errors < 3:
                assert not task.done(), task
                await asyncio.sleep(0.02)
            assert await outputs(settings, 1, timeout=0.5) == []
            assert await committed(settings) == {}
            if lose:
                drop_index(direct)  # the namespace's data lost while the worker could not reach it
            await proxy.start()
            try:
                await task
            finally:
                await proxy.stop()
            return await outputs(settings, len(inputs))

        got = asyncio.run(scenario())
    assert Counter(r.topic for r in got) == {settings.unique_topic: 2, settings.duplicate_topic: 1,
                                             settings.dead_letter_topic: 4}
    return got, worker, settings


def test_index_outage_blocks_then_resumes(kafka_bootstrap: str, redis_url: str,
                                          caplog: pytest.LogCaptureFixture) -> None:
    """Redis down while the worker routes: nothing is produced or committed, one log line; then Redis comes back
    and everything is routed (`_through_an_index_outage`)."""
    with caplog.at_level(logging.INFO, logger="neardup.worker"):
        _through_an_index_outage(kafka_bootstrap, redis_url, lose=False)
    paused = [r for r in caplog.records if "index unavailable" in r.message]
    assert len(paused) == 1 and "consumption paused" in paused[0].message
    assert any("index available again" in r.message for r in caplog.records)


def test_an_outage_that_ends_with_the_index_lost_resumes_consumption(kafka_bootstrap: str, redis_url: str) -> None:
    """As above, but Redis comes back without the namespace's data: the retry finds the index lost, the worker
    rebuilds it from the changelog and, under event-time alignment, takes the batch again against the group's
    new view. Consumption, paused during the outage, resumes: everything is routed. (Before, a batch let go
    that way left the consumer paused for good, and the worker routed nothing more.)"""
    _, worker, _ = _through_an_index_outage(kafka_bootstrap, redis_url, lose=True)
    assert worker.guard is not None and worker.guard.losses >= 1


def test_index_outage_unchecked_passes_records(kafka_bootstrap: str) -> None:
    settings = settings_for(kafka_bootstrap, f"redis://127.0.0.1:{free_port()}/0", on_index_error="unchecked",
                            id_field="id")
    inputs = GOOD + BAD

    async def scenario() -> list[KafkaRecord]:
        await produce(settings, settings.input_topics[0], inputs)
        await run_until(make_worker(settings), lambda s: s.seen >= len(inputs))
        return await outputs(settings, len(inputs))

    got = asyncio.run(scenario())
    unique = [r for r in got if r.topic == settings.unique_topic]
    assert [r.header("neardup-id") for r in unique] == [b"a", b"b", b"c"]
    assert all(r.header("neardup-verdict") == b"unchecked" for r in unique)
    reasons = Counter(r.header("neardup-reason") for r in got if r.topic == settings.dead_letter_topic)
    assert reasons == {b"invalid_utf8": 1, b"invalid_json": 2, b"no_text": 1}


def test_sasl_plain(kafka_sasl: dict[str, str], index_url: str) -> None:
    settings = settings_for(kafka_sasl["bootstrap"], index_url, kafka_security_protocol="SASL_PLAINTEXT",
                            kafka_sasl_username=kafka_sasl["user"], kafka_sasl_password=kafka_sasl["password"],
                            id_field="id")

    async def scenario() -> list[KafkaRecord]:
        await produce(settings, settings.input_topics[0], GOOD)
        await run_until(make_worker(settings), lambda s: s.seen >= len(GOOD))
        return await outputs(settings, len(GOOD))

    got = asyncio.run(scenario())
    assert sorted(verdict(r) for r in got) == [("duplicate", "a"), ("unique", None), ("unique", None)]

    wrong = replace(settings, kafka_sasl_password="wrong-password")
    with pytest.raises(ConfigError, match="AuthenticationFailed|security"):
        asyncio.run(ensure_topics(wrong, [unique_name()]))


def test_produce_and_tail_commands(kafka_bootstrap: str, capsys: pytest.CaptureFixture[str],
                                   tmp_path: Path) -> None:
    topic = unique_name("cmd")
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"id": "x1", "text": "hello"}\n\n{"id": 7, "text": "caf\xc3\xa9"}\n')
    assert commands.main(["produce", str(path), "--topic", topic, "--key-field", "id",
                          "--kafka-bootstrap", kafka_bootstrap]) == 0
    assert "produced 2 records" in capsys.readouterr().err
    assert commands.main(["tail", topic, "--from-beginning", "--max", "2", "--timeout", "10s",
                          "--kafka-bootstrap", kafka_bootstrap]) == 0
    rows = [orjson.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["key"], r["offset"], r["partition"]) for r in rows] == [("x1", 0, 0), ("7", 1, 0)]
    assert orjson.loads(rows[1]["value"]) == {"id": 7, "text": "café"}
    assert rows[0]["headers"] == {} and isinstance(rows[0]["timestamp"], int)


def test_tail_shows_binary_as_base64(kafka_bootstrap: str, capsys: pytest.CaptureFixture[str]) -> None:
    settings = settings_for(kafka_bootstrap, "memory://")
    topic = settings.input_topics[0]
    asyncio.run(produce(settings, topic, [(b"\xff", b"\x00\xfe", (("h", b"\xff"), ("ok", b"yes")))]))
    assert commands.main(["tail", topic, "--from-beginning", "--max", "1", "--timeout", "10s",
                          "--kafka-bootstrap", kafka_bootstrap]) == 0
    (row,) = [orjson.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["key"] == {"base64": "/w=="} and row["value"] == {"base64": "AP4="}
    assert row["headers"] == {"h": {"base64": "/w=="}, "ok": "yes"}


def test_committed_offsets_after_a_run(kafka_bootstrap: str, index_url: str) -> None:
    settings = settings_for(kafka_bootstrap, index_url, partitions=2)
    topic = settings.input_topics[0]

    async def scenario() -> dict[int, int | None]:
        await ensure_topics(settings, [topic])
        await produce(settings, topic, [(str(i).encode(), b'{"text": "message %d"}' % i, ()) for i in range(40)])
        await run_until(make_worker(settings), lambda s: s.seen >= 40)
        return await committed(settings)

    offsets = asyncio.run(scenario())
    assert sum(o or 0 for o in offsets.values()) == 40 and set(offsets) == {0, 1}


def test_exactly_once_partitions_go_only_once_the_group_shows_the_last_commit(kafka_bootstrap: str,
                                                                              index_url: str) -> None:
    """Exactly-once: a transaction's offsets reach the group a little after the commit returns, and
    aiokafka's offset fetch answers the offset before until then. When its partitions are revoked right
    after its last batch's commit, the worker returns from the callback only once the group shows that
    commit, so their next owner (here: a reader of the group's offsets, asking at once) does not start
    before the batch and route it again. Eight times: without the wait most of them read the offset before
    the last batch (6 to 7 of 8 in four runs)."""
    count = 30

    async def once() -> int | None:
        settings = settings_for(kafka_bootstrap, index_url, max_batch=10, processing_guarantee="exactly_once")
        topic = settings.input_topics[0]
        last_batch = asyncio.Event()

        def note_last(records: Sequence[KafkaRecord], outs: Sequence[OutRecord]) -> None:
            if records[-1].offset == count - 1:
                last_batch.set()  # called just before the batch's transaction commits

        worker = AiokafkaWorker(settings, observer=note_last)
        await ensure_topics(settings, [topic])
        await produce(settings, topic, [(None, b'{"text": "message %d"}' % i, ()) for i in range(count)])
        reader = AIOKafkaConsumer(group_id=settings.group_id, enable_auto_commit=False, **client_options(settings))
        await reader.start()
        assert await reader.committed(TopicPartition(topic, 0)) is None  # and the reader knows the coordinator
        shown: list[int | None] = []

        async def revoke_after_last() -> None:
            if last_batch.is_set() and not shown:
                await worker._rebalance.on_partitions_revoked(set())
                shown.append(await reader.committed(TopicPartition(topic, 0)))

        try:
            await run_until(worker, lambda s: bool(shown), timeout=60, during=revoke_after_last)
        finally:
            await reader.stop()
        return shown[0]

    async def scenario() -> list[int | None]:
        return [await once() for _ in range(8)]

    assert asyncio.run(scenario()) == [count] * 8


def test_a_commit_the_group_never_shows_holds_partitions_for_half_the_session_timeout_at_most(
        kafka_bootstrap: str, index_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """The wait before letting partitions go is bounded (the rebalance waits for this member only so
    long): an offset the group never shows is given up on after half the session timeout, with a
    warning, and the callback returns."""
    settings = settings_for(kafka_bootstrap, index_url, processing_guarantee="exactly_once", session_timeout=6.0)
    topic = settings.input_topics[0]
    worker = AiokafkaWorker(settings)

    async def scenario() -> float:
        await ensure_topics(settings, [topic])
        await produce(settings, topic, [(None, b'{"text": "message %d"}' % i, ()) for i in range(5)])
        took: list[float] = []

        async def revoke_once_all_routed() -> None:
            if worker.stats.seen >= 5 and not took:
                assert isinstance(worker.delivery, ExactlyOnce)
                worker.delivery.unconfirmed[TopicPartition(topic, 0)] = 10**9  # an offset no commit made
                started = time.monotonic()
                await worker._rebalance.on_partitions_revoked(set())
                took.append(time.monotonic() - started)

        await run_until(worker, lambda s: bool(took), during=revoke_once_all_routed)
        return took[0]

    with caplog.at_level(logging.WARNING, logger="neardup.worker"):
        took = asyncio.run(scenario())
    assert 2.9 <= took < 5.0, took
    assert any("did not show the last transaction's offsets" in r.getMessage() for r in caplog.records)


def test_outputs_land_on_the_partition_send_would_choose(kafka_bootstrap: str, index_url: str) -> None:
    """The worker builds its own record batches: a keyed output still lands on the partition of its key
    (the default murmur2 partitioner, as `send` would place it), in input order per key; unkeyed ones
    anywhere. Two topics, three partitions each, several batches."""
    settings = settings_for(kafka_bootstrap, index_url, max_batch=25)
    keys = [f"user-{i % 7}".encode() for i in range(90)]
    records = [(keys[i], b'{"text": "message %d about topic %d"}' % (i, i % 3), ()) for i in range(90)]
    records += [(None, b'{"text": "unkeyed %d"}' % i, ()) for i in range(10)]

    async def scenario() -> list[KafkaRecord]:
        await ensure_topics(settings, [*settings.input_topics, *settings.output_topics], partitions=3)
        await produce(settings, settings.input_topics[0], records)
        await run_until(make_worker(settings), lambda s: s.seen >= len(records))
        return await outputs(settings, len(records))

    got = asyncio.run(scenario())
    assert len(got) == len(records)
    partitioner = DefaultPartitioner()
    for record in got:
        if record.key is not None:
            assert record.partition == partitioner(record.key, [0, 1, 2], [0, 1, 2]), record
    by_key: dict[tuple[str, bytes], list[int]] = {}  # input offsets, in output order per topic and key
    for record in sorted(got, key=lambda r: (r.topic, r.partition, r.offset)):
        if record.key is not None:
            source = record.header("neardup-source") or b""
            by_key.setdefault((record.topic, record.key), []).append(int(source.rsplit(b"/", 1)[1]))
    assert len(by_key) > 7 and all(offsets == sorted(offsets) for offsets in by_key.values())


def test_event_time_is_the_kafka_timestamp_unless_a_field_is_configured(kafka_bootstrap: str, index_url: str) -> None:
    """Window 60 s of Kafka record time: a copy 30 s later is a duplicate, one 1000 s later is not."""
    settings = settings_for(kafka_bootstrap, index_url, window=60.0)
    text = b'{"text": "Your parcel is waiting: confirm delivery at http://example.test/p/123"}'
    t0 = 1_700_000_000_000

    async def scenario() -> list[KafkaRecord]:
        await ensure_topics(settings, settings.input_topics, configs=KEEP)  # 2023's records: no time retention
        await produce(settings, settings.input_topics[0], [(None, text, ())] * 3,
                      timestamps_ms=[t0, t0 + 30_000, t0 + 1_000_000])
        await run_until(make_worker(settings), lambda s: s.seen >= 3)
        return await outputs(settings, 3)

    got = sorted(asyncio.run(scenario()), key=lambda r: r.header("neardup-source") or b"")
    topic = settings.input_topics[0]
    assert [verdict(r) for r in got] == [("unique", None), ("duplicate", f"{topic}/0/0"), ("unique", None)]
    assert [r.header("neardup-id") for r in got] == [f"{topic}/0/{i}".encode() for i in range(3)]


def test_raw_record_fallbacks() -> None:
    rec = KafkaRecord("in", 3, 42, 1_700_000_000_123, b"k", b"v", (("h", b"x"),))
    raw = raw_record(rec)
    assert (raw.value, raw.fallback_id, raw.fallback_ts) == (b"v", "in/3/42", 1_700_000_000.123)
    assert raw_record(KafkaRecord("in", 0, 1, 0, None, None)).value == b""  # a tombstone is rejected


def test_the_next_batch_is_routed_while_the_last_one_is_handed_over(kafka_bootstrap: str, index_url: str) -> None:
    """Pipelining: while a batch's outputs are acknowledged and it is committed (the observer runs then,
    slowly here), a later batch is being routed (slowly too): routing does not wait for Kafka."""
    settings = settings_for(kafka_bootstrap, index_url, id_field="id", max_batch=40)
    lines = SAMPLE.read_bytes().splitlines()
    routing = [0]  # routes in progress
    overlapped: list[bool] = []  # per commit: did a route run during it?

    async def slow(records: Sequence[KafkaRecord], outs: Sequence[OutRecord]) -> None:
        busy = routing[0] > 0
        started = routes[0]
        await asyncio.sleep(0.2)
        overlapped.append(busy or routing[0] > 0 or routes[0] > started)

    worker = AiokafkaWorker(settings, observer=slow)
    run = worker.router._run
    routes = [0]

    async def routed_slowly(*args: object) -> object:
        routing[0] += 1
        routes[0] += 1
        try:
            await asyncio.sleep(0.1)
            return await run(*args)
        finally:
            routing[0] -= 1

    worker.router._run = routed_slowly

    async def scenario() -> None:
        await produce(settings, settings.input_topics[0], [(None, line, ()) for line in lines])
        await run_until(worker, lambda s: s.seen >= len(lines), timeout=60)

    asyncio.run(scenario())
    assert routes[0] >= 8 and len(overlapped) >= 6
    assert overlapped.count(True) >= 3, overlapped


@pytest.mark.parametrize("index", ["memory", "redis"])
def test_the_following_batch_is_prepared_once_while_one_is_routed(index: str, index_url: str) -> None:
    """`route_records` with a `Lookahead` and the records that come next: the same outputs as batch after
    batch, and each batch decoded and fingerprinted once (the following one meanwhile, then reused)."""
    from filters.config import FilterConfig
    from filters.engine import NearDupFilter

    lines = SAMPLE.read_bytes().splitlines()
    records = [KafkaRecord("in", 0, i, 1_700_000_000_000 + i, None, line) for i, line in enumerate(lines)]
    batches = [records[i : i + 70] for i in range(0, len(records), 70)]
    settings = settings_for("127.0.0.1:1", index_url if index == "redis" else "memory://", id_field="id")

    urls = {name: "memory://" if index == "memory" else index_url.replace("prefix=", f"prefix={name}-")
            for name in ("plain", "ahead")}
    prepared: list[int] = []
    try:
        plain = NearDupFilter(FilterConfig(window=settings.window), index=urls["plain"])
        expected = [out for batch in batches for out in route_records(plain, batch, settings)]
        ahead_nd = NearDupFilter(FilterConfig(window=settings.window), index=urls["ahead"])
        prepare = ahead_nd.prepare

        def counted(texts: Sequence[str]) -> object:
            prepared.append(len(texts))
            return prepare(texts)

        ahead_nd.prepare = counted  # type: ignore[method-assign]
        ahead = Lookahead(settings)
        got = []
        for i, batch in enumerate(batches):
            following = batches[i + 1] if i + 1 < len(batches) else ()
            got += route_records(ahead_nd, batch, settings, ahead, following)
    finally:
        if index == "redis":
            for url in urls.values():
                drop_index(url)
    assert got == expected
    assert sum(prepared) == sum(1 for out in expected if dict(out.headers)["neardup-verdict"] != b"rejected")


def test_records_the_broker_deleted_before_they_were_read_are_said_and_counted(
        kafka_bootstrap: str, index_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """A partition whose reading lagged past the topic's retention (here: DeleteRecords, what retention does to
    a log's start) goes on from the oldest offset left: the records in between are never routed, and the worker
    says so in one line and counts them, whether records follow the gap (some deleted) or none do (all)."""
    settings = settings_for(kafka_bootstrap, index_url, partitions=1)
    topic = settings.input_topics[0]
    tp = TopicPartition(topic, 0)

    def messages(start: int, stop: int) -> list[tuple[bytes, bytes, tuple[()]]]:
        return [(str(i).encode(), b'{"text": "message number %d about something else entirely"}' % i, ())
                for i in range(start, stop)]

    async def delete_before(offset: int) -> None:
        admin = AIOKafkaAdminClient(**client_options(settings))
        await admin.start()
        try:
            await admin.delete_records({tp: RecordsToDelete(before_offset=offset)})
        finally:
            await admin.close()

    async def scenario() -> tuple[int, int, list[KafkaRecord], dict[int, int | None]]:
        await ensure_topics(settings, [topic, *settings.output_topics])
        await produce(settings, topic, messages(0, 10))
        await run_until(make_worker(settings), lambda s: s.seen >= 10)  # committed: 10
        await produce(settings, topic, messages(10, 40))
        await delete_before(30)  # 10..29 go before they were read
        some = make_worker(settings)
        await run_until(some, lambda s: s.seen >= 10)
        await produce(settings, topic, messages(40, 50))
        await delete_before(50)  # all of 40..49: nothing follows the gap
        every = make_worker(settings)
        await run_until(every, lambda s: every.unread >= 10, timeout=20)
        return some.unread, every.unread, await outputs(settings, 20, settle=0.5), await committed(settings)

    with caplog.at_level(logging.WARNING, logger="neardup.worker"):
        some, every, got, offsets = asyncio.run(scenario())
    assert (some, every) == (20, 10)
    routed = sorted(int((r.header("neardup-source") or b"").decode().rsplit("/", 1)[1]) for r in got)
    assert routed == [*range(10), *range(30, 40)]  # each once; the deleted ones never
    said = [r.message for r in caplog.records if "deleted by the broker before this worker read" in r.message]
    assert [m.split(": ", 1)[1].split(" were")[0] for m in said] == ["20 records (offsets 10 to 29)",
                                                                    "10 records (offsets 40 to 49)"]
    assert offsets == {0: 40}  # the last worker routed nothing: its commit stays where reading stopped


# -- output record batches within the output topics' max.message.bytes ---------------------------

SMALL_LIMIT = 20_000  # an output topic's max.message.bytes below the default batch_bytes (64 KB)


def records_of_500_bytes(n: int) -> list[bytes]:
    """`n` JSON records of some 480 bytes; every fourth a near-duplicate of an earlier one."""
    lines = []
    for i in range(n):
        cluster, copy = (i // 4, 1) if i % 4 == 3 else (i, 0)
        text = f"{cluster_text(cluster, copy)} {cluster_text(cluster + 100_000, copy)}"
        lines.append(orjson.dumps({"id": f"m{i}", "text": text}))
    return lines


def test_the_batch_size_waits_for_an_output_topic_another_worker_is_creating(kafka_bootstrap: str,
                                                                            index_url: str) -> None:
    """Two workers start together: one creates an output topic (here of max.message.bytes 2,048) while the other
    reads the topics' limits, which the broker does not describe yet (unknown topic). The second asks again
    until it can, and sends batches the topic takes: kept at batch_bytes, its exactly-once batches of 64 KB were
    refused and it stopped."""
    settings = settings_for(kafka_bootstrap, index_url, id_field="id", processing_guarantee="exactly_once")
    worker = make_worker(settings)
    assert isinstance(worker, AiokafkaWorker)

    async def scenario() -> int:
        others = [t for t in [*settings.output_topics, settings.changelog_name] if t != settings.unique_topic]
        await ensure_topics(settings, others, 1)

        async def other_worker() -> None:
            await asyncio.sleep(0.5)
            await ensure_topics(settings, [settings.unique_topic], 1, {"max.message.bytes": "2048"})

        async with admin_client(settings) as admin:
            creating = asyncio.ensure_future(other_worker())
            size = await worker._batch_size(admin)
            await creating
        return size

    assert asyncio.run(scenario()) == 2048


@pytest.mark.parametrize("guarantee", ["exactly_once", "at_least_once"])
def test_record_batches_fit_an_output_topic_with_a_small_max_message_bytes(
        kafka_bootstrap: str, index_url: str, guarantee: str, caplog: pytest.LogCaptureFixture) -> None:
    """The unique topic accepts record batches of at most 20,000 bytes, less than batch_bytes (64 KB): the
    worker reads that at start and sends smaller batches, so its 400 records of ~500 bytes (several batches'
    worth on unique) are routed without a refusal. Exactly-once does not stop, at-least-once sends nothing
    again one by one; every input lands once, with the verdict a single memory-index run gives it."""
    settings = settings_for(kafka_bootstrap, index_url, id_field="id", processing_guarantee=guarantee)
    assert settings.batch_bytes > SMALL_LIMIT
    lines = records_of_500_bytes(400)
    topic = settings.input_topics[0]
    caplog.set_level(logging.INFO, logger="neardup")
    worker = make_worker(settings)
    assert isinstance(worker, AiokafkaWorker)
    deliveries: list[Delivery] = []

    async def note_delivery() -> None:
        if worker.delivery is not None and not deliveries:
            deliveries.append(worker.delivery)

    async def scenario() -> list[KafkaRecord]:
        await create_topics_with(settings, {settings.unique_topic: SMALL_LIMIT})
        await produce(settings, topic, [(None, line, ()) for line in lines])
        await run_until(worker, lambda s: s.seen >= len(lines), timeout=60, during=note_delivery)
        return await outputs(settings, len(lines), timeout=30, settle=0.5)  # and nothing more arrives

    got = by_source(asyncio.run(scenario()))
    reference = reference_verdicts(lines, settings, topic)
    assert set(got) == set(reference)  # every input routed
    assert all(len(records) == 1 for records in got.values())  # once each (uncommitted reads included)
    for source, (r,) in got.items():
        ref = reference[source]
        assert ref.verdict is not None
        assert (r.topic, verdict(r)) == ({"unique": settings.unique_topic, "duplicate": settings.duplicate_topic}[
            ref.kind], (ref.kind, ref.verdict.duplicate_of)), source
    unique = [r for (r,) in got.values() if r.topic == settings.unique_topic]
    assert sum(len(r.value or b"") for r in unique) > 5 * SMALL_LIMIT  # several batches' worth
    assert any(r.topic == settings.duplicate_topic for (r,) in got.values())
    assert not [r for r in caplog.records if "one by one" in r.getMessage() or r.exc_info]
    (delivery,) = deliveries
    if isinstance(delivery, AtLeastOnce):
        assert delivery.resent_alone == 0  # no batch was refused
    assert worker.batch_bytes == SMALL_LIMIT
    lowered = [r for r in caplog.records if "record batches of up to" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in lowered] == [
        (logging.INFO, f"record batches of up to {SMALL_LIMIT} bytes: batch_bytes {settings.batch_bytes} lowered "
                       f"to the max.message.bytes of topic {settings.unique_topic}")]


def test_a_record_batch_of_the_capped_size_is_accepted_and_one_byte_more_refused(kafka_bootstrap: str) -> None:
    """`capped_batch_bytes` takes nothing off a topic's max.message.bytes: aiokafka's max_batch_size bounds
    the whole record batch, header included, as the broker counts it. Plain and transactional."""
    settings = settings_for(kafka_bootstrap, "memory://")
    topic = settings.unique_topic
    size, lowered_by = capped_batch_bytes(settings.batch_bytes, {topic: SMALL_LIMIT})
    assert (size, lowered_by) == (SMALL_LIMIT, topic)

    def batch_of(prod: AIOKafkaProducer, total: int) -> Any:
        """A record batch of exactly `total` bytes: one record (a first record always fits)."""
        for n in range(total - 100, total):
            batch = prod.create_batch()
            batch.append(key=None, value=b"x" * n, timestamp=None, headers=[])
            if batch.size() == total:
                return batch
        raise AssertionError(f"no record makes a batch of {total} bytes")

    async def sent(prod: AIOKafkaProducer, total: int, transactional: bool) -> str:
        if transactional:
            await prod.begin_transaction()
        try:
            await (await prod.send_batch(batch_of(prod, total), topic, partition=0))
        except MessageSizeTooLargeError:
            if transactional:
                await prod.abort_transaction()
            return "refused"
        if transactional:
            await prod.commit_transaction()
        return "accepted"

    async def scenario() -> list[tuple[bool, int, str]]:
        await create_topics_with(settings, {topic: SMALL_LIMIT})
        results = []
        for transactional in (False, True):
            options = {"transactional_id": unique_name("txn")} if transactional else {}
            prod = AIOKafkaProducer(**client_options(settings), acks="all", max_batch_size=size, **options)
            await prod.start()
            try:
                for total in (size, size + 1):
                    results.append((transactional, total, await sent(prod, total, transactional)))
            finally:
                await prod.stop()
        return results

    assert asyncio.run(scenario()) == [(False, SMALL_LIMIT, "accepted"), (False, SMALL_LIMIT + 1, "refused"),
                                       (True, SMALL_LIMIT, "accepted"), (True, SMALL_LIMIT + 1, "refused")]


def test_topic_limits_unreadable_keep_batch_bytes_with_one_warning(kafka_bootstrap: str, index_url: str,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """When the broker does not describe an output topic (here: it does not exist yet, and the worker may not
    create topics; a missing DescribeConfigs permission is answered the same way), the worker keeps
    batch_bytes and says so in one warning, without a traceback, and routes on."""
    settings = settings_for(kafka_bootstrap, index_url, id_field="id", create_topics=False)
    topic = settings.input_topics[0]
    caplog.set_level(logging.INFO, logger="neardup")
    worker = make_worker(settings)
    assert isinstance(worker, AiokafkaWorker)

    async def scenario() -> list[KafkaRecord]:
        await ensure_topics(settings, [topic, settings.unique_topic, settings.duplicate_topic, settings.changelog_name],
                            partitions=1)  # not the dead-letter topic
        await produce(settings, topic, GOOD)
        await run_until(worker, lambda s: s.seen >= len(GOOD))
        return await outputs(settings, len(GOOD))

    assert len(by_source(asyncio.run(scenario()))) == len(GOOD)
    assert worker.batch_bytes == settings.batch_bytes
    (warning,) = [r for r in caplog.records if "max.message.bytes" in r.getMessage()]
    assert warning.levelno == logging.WARNING and warning.exc_info is None
    message = warning.getMessage()
    assert "UnknownTopicOrPartitionError" in message and settings.dead_letter_topic in message
    assert f"batch_bytes {settings.batch_bytes}" in message and "DescribeConfigs" in message
