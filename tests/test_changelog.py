"""The index changelog: its record codec, the journal at the index's door, `restore` on every backend, and
two `neardup serve` workers on a real broker that route a backlog as the filter does while their Redis loses
its data (restarted without persistence, or FLUSHALL) mid-stream."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import numpy as np
import orjson
import pytest
import redis
from aiokafka import AIOKafkaConsumer, TopicPartition

from bench.kafka_support import PrivateCluster, PrivateRedis, drop_index, redis_namespace
from bench.reliability import (
    KEEP,
    Serve,
    create_topics,
    produce_to,
    read,
    read_outputs,
    scenario_settings,
    serving,
    wait_assigned,
)
from filters.config import FilterConfig
from filters.engine import NearDupFilter
from filters.errors import IndexCorrupt, IndexLost
from filters.index import Batch, CandidateIndex, Entry, IndexWrapper, Query, Stored, Verifier
from filters.index.backends import open_index
from filters.index.memory import MemoryIndex
from filters.index.redis import MARKER, RedisIndex, meta_key
from filters.index.redis_codec import encode_entry_v2, stored_entries, stored_of
from filters.records import Message, Verdict
from stream.backlog import Item, backlog, differences, f1, reference, verdicts_of
from stream.changelog import (
    LOCK_TTL,
    NAMESPACE_HEADER,
    IndexGuard,
    Journal,
    decode_records,
    encode_records,
    read_changelog,
)
from stream.config import Settings
from stream.delivery import ExactlyOnce
from stream.kafka_tools import KafkaRecord, client_options, ensure_topics, producer
from stream.outputs import OutRecord
from stream.router import open_filter
from stream.testing import ListChangelog
from stream.worker import AiokafkaWorker

TEXTS = [
    "WIN a FREE iPhone now!!! call 555-0100 to claim your prize today",
    "w i n a free iphone NOW, call 555-0199 to claim your prize today",
    "Quarterly earnings beat expectations as revenue grew twelve percent year over year",
    "The committee will meet on Thursday to discuss the budget for the coming fiscal year",
    "quarterly earnings beat expectations as revenue grew 12 percent year over year!!",
    "Lunch at noon? The new place on the corner has good noodles and cheap dumplings",
]


def messages(offset: float = 0.0, prefix: str = "m") -> list[Message]:
    return [Message(f"{prefix}{i}", text, offset + i) for i, text in enumerate(TEXTS)]


def _same(got: list[tuple[Entry, tuple[int, ...]]], want: list[tuple[Entry, tuple[int, ...]]]) -> None:
    assert len(got) == len(want)
    for (g, gk), (w, wk) in zip(got, want, strict=True):
        assert gk == tuple(wk)
        assert (g.id, g.ts, g.exact, g.size, g.simhash, g.sentences) == (w.id, w.ts, w.exact, w.size, w.simhash,
                                                                           w.sentences)
        assert np.array_equal(g.sketch, w.sketch)
        assert (g.minhash is None) == (w.minhash is None)



def _writes_nothing(parts: Iterable[Stored], *, rebuild: bytes = b"") -> int:
    """A `Restore` that writes nothing (the guard's own steps are what is tested)."""
    return 0

def test_records_read_back_as_the_entries_and_keys_they_were_made_of() -> None:
    nd = NearDupFilter(FilterConfig(methods=("exact", "mgram", "simhash", "minhash", "sentences")))
    made = [(Entry.of(m.id, m.ts, fp), tuple(fp.keys))
            for m, fp in zip(messages(), nd.fingerprinter.fingerprint_batch([m.text for m in messages()]), strict=True)]
    made.append((Entry.of("ü\udcff", 7.5, nd.fingerprinter.fingerprint_batch(["x"])[0]), ()))  # no keys, odd id
    records = encode_records(made)
    assert len(records) == 1 and records[0][0] == b"m0"
    _same(stored_entries(decode_records(*records[0])), made)
    # Many entries: records of at most RECORD_BYTES, in order.
    many = [(Entry.of(f"n{i}", float(i), fp), tuple(fp.keys)) for i, (_, fp) in
            enumerate(zip(range(3000), nd.fingerprinter.fingerprint_batch([f"{TEXTS[i % 6]} {i}" for i in range(3000)])))]
    records = encode_records(many)
    assert len(records) > 1 and all(len(v) <= 512 * 1024 for _, v in records)
    _same([p for k, v in records for p in stored_entries(decode_records(k, v))], many)
    # Format 1 (one entry a record) is still read.
    keys = made[2][1]
    old = b"\x01" + len(keys).to_bytes(4, "little") + np.asarray(keys, "<u8").tobytes() + stored_of([made[2]]).blobs[0]
    _same(stored_entries(decode_records(b"m2", old)), [made[2]])
    # Entries of version 2 (what the release before wrote into its records) are still read.
    stored = stored_of(made)
    blobs = [encode_entry_v2(e) for e, _ in made]
    written = encode_records(made)[0][1]
    head = 16 + 8 * len(made) + 8 * int(stored.bounds[-1]) + 12 * len(made)
    lengths = np.frombuffer(written, "<u4", len(made), head - 4 * len(made)).copy()
    assert [len(b) for b in stored.blobs] == lengths.tolist()
    id_bytes = sum(len(e.id.encode("utf-8", "surrogatepass")) for e, _ in made)
    v2 = (written[: head - 4 * len(made)] + np.array([len(b) for b in blobs], "<u4").tobytes()
          + written[head : head + id_bytes] + b"".join(blobs))
    assert all(b[0] == 2 for b in blobs) and len(v2) > len(written)
    _same(stored_entries(decode_records(b"m0", v2)), made)
    value = records[0][1]
    for broken in (b"\x01\x05\x00\x00\x00" + bytes(8),  # five keys promised, one there
                   b"\x09" + bytes(15),  # a format this neardup does not read
                   value[:-1],  # a byte short
                   value[:16] + value[17:] + b"x"):  # lengths shifted
        with pytest.raises(IndexCorrupt):
            decode_records(b"x", broken)


@pytest.fixture(params=["memory", "redis", "redis-spread", "redis-compact", "redis-group", "redis-group-cluster"])
def index_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """`redis-group-cluster`: the group layout on a Redis Cluster (every round its checking script)."""
    if request.param == "memory":
        yield "memory://"
        return
    if request.param == "redis-group-cluster":
        node = urlsplit(request.getfixturevalue("redis_cluster_url")).netloc
        with redis_namespace(f"redis+cluster://{node}?layout=group") as url:
            yield url
        return
    with redis_namespace(request.getfixturevalue("redis_url")) as url:
        yield url + {"redis-spread": "&layout=spread", "redis-compact": "&layout=compact",
                     "redis-group": "&layout=group"}.get(request.param, "")


def _shared(url: str, cfg: FilterConfig) -> NearDupFilter:
    """A filter whose index decides from fingerprints, as a worker's shared index does."""
    index = open_index(url, window=cfg.window, bucket_cap=cfg.bucket_cap, namespace="ns", native=False) \
        if url.startswith("memory:") else open_index(url, window=cfg.window, bucket_cap=cfg.bucket_cap, namespace="ns")
    return NearDupFilter(cfg, index=index)


def test_the_journal_holds_what_each_batch_made_unique_replays_included(index_url: str) -> None:
    cfg = FilterConfig()
    nd = _shared(index_url, cfg)
    journal = Journal(nd.index)
    nd.index = journal
    try:
        verdicts = nd.check_batch(messages())
        made = journal.take()
        assert [e.id for e, _ in made] == [v.id for v in verdicts if not v.duplicate]
        assert {"m1", "m4"} <= {v.id for v in verdicts if v.duplicate}
        assert journal.take() == []
        again = nd.check_batch(messages()[:3])  # read again after a crash: its unique one is journaled again
        assert [e.id for e, _ in journal.take()] == [v.id for v in again if not v.duplicate] == ["m0", "m2"]
    finally:
        nd.index.close()


def test_an_index_restored_from_the_journal_decides_as_the_original(index_url: str) -> None:
    """Decide a stream, journal it, restore the journal into an empty index: a second stream gets the same
    verdicts from the restored index as from the original. Restoring twice writes nothing new."""
    cfg = FilterConfig()
    original = _shared(index_url, cfg)
    journal = Journal(original.index)
    original.index = journal
    first = [Message(f"a{i}", f"{t} number {i % 3}", float(i)) for i, t in enumerate(TEXTS * 4)]
    original.check_batch(first)
    made = journal.take()
    later = [Message(f"b{i}", t.upper() + " !!", 100.0 + i) for i, t in enumerate(TEXTS)]
    if index_url.startswith("memory:"):
        restored_index = MemoryIndex(cfg.window, cfg.bucket_cap, native=False)
        restored = NearDupFilter(cfg, index=restored_index)
    else:
        with redis_namespace(index_url.split("?")[0]) as other:
            restored = _shared(other + "".join(f"&layout={layout}" for layout in ("spread", "compact", "group")
                                               if f"layout={layout}" in index_url), cfg)
            try:
                _restore_and_compare(original, restored, made, later)
            finally:
                restored.index.close()
                original.index.close()
            return
    _restore_and_compare(original, restored, made, later)


def _restore_and_compare(original: NearDupFilter, restored: NearDupFilter, made: list, later: list[Message]) -> None:  # type: ignore[type-arg]
    assert restored.index.restore([stored_of(made)]) == len(made) > 0
    assert restored.index.restore([stored_of(made)]) == 0  # live ids are kept as they are
    want = original.check_batch(later)
    got = restored.check_batch(later)
    assert [(v.id, v.duplicate, v.duplicate_of) for v in got] == [(v.id, v.duplicate, v.duplicate_of) for v in want]
    assert any(v.duplicate for v in got)


def test_the_guard_restores_once_and_the_others_wait(redis_url: str) -> None:
    """Two guards find the marker missing at once: one restores (the lock), the other waits for the marker;
    then both find it there."""
    with redis_namespace(redis_url) as url:
        restores: list[int] = []

        async def read(write):  # type: ignore[no-untyped-def]
            restores.append(1)
            await asyncio.sleep(0.3)
            return 0

        async def go() -> None:
            a = IndexGuard(url, namespace="ns", window=60.0, member="a")
            b = IndexGuard(url, namespace="ns", window=60.0, member="b")
            try:
                assert await asyncio.gather(a.ensure(read, _writes_nothing), b.ensure(read, _writes_nothing)) == [True, True]
                assert len(restores) == 1
                assert await a.intact() and await b.intact()
                assert await a.ensure(read, _writes_nothing) is False
                assert a.losses == b.losses == 1
            finally:
                await a.close()
                await b.close()

        asyncio.run(go())


def test_a_restore_that_fails_lets_its_lock_go_at_once(redis_url: str) -> None:
    """A restore whose changelog read fails (the broker gone mid-read) lets its lock go: the next attempt, its
    own or another worker's, restores at once instead of waiting out the lock's TTL."""
    with redis_namespace(redis_url) as url:
        async def failing(write):  # type: ignore[no-untyped-def]
            raise RuntimeError("the changelog could not be read")

        async def read(write):  # type: ignore[no-untyped-def]
            return 0

        async def go() -> None:
            a = IndexGuard(url, namespace="ns", window=60.0, member="a")
            b = IndexGuard(url, namespace="ns", window=60.0, member="b")
            try:
                with pytest.raises(RuntimeError):
                    await a.ensure(failing, _writes_nothing)
                assert await a._client.get(a.lock) is None
                t0 = time.monotonic()
                assert await b.ensure(read, _writes_nothing) is True
                assert time.monotonic() - t0 < LOCK_TTL / 3
                assert await a.intact()
            finally:
                await a.close()
                await b.close()

        asyncio.run(go())


def test_a_restore_reads_the_changelog_partitions_in_the_order_they_were_journaled(kafka_bootstrap: str) -> None:
    """Entries journaled one after the other land on the changelog's partitions by their keys; a restore gives
    them seqs in the order it reads them, and a full bucket keeps the newest. So it merges the partitions by
    their records' timestamps, the lowest head first, whatever order a fetch returns them in."""
    settings = scenario_settings(kafka_bootstrap, "memory://")
    topic = f"neardup-test-changelog-order-{time.time_ns()}"
    namespace = "ns-order"
    base = int(time.time() * 1000) - 60_000
    journaled = [(i, (i * 7) % 3) for i in range(12)]  # (entry, partition): spread over the 3 partitions

    async def go() -> list[str]:
        await ensure_topics(settings, [topic], partitions=3, configs=KEEP)
        async with producer(settings) as p:
            for partition in (2, 0, 1):  # a partition at a time: a fetch returns them grouped so too
                for i, part in journaled:
                    if part == partition:
                        [(key, value)] = encode_records([(Entry(f"e{i}", 1000.0 + i, i, 30, np.arange(8, dtype=np.uint64)),
                                                          (1, 2))])
                        await (await p.send(topic, key=key, value=value, partition=part, timestamp_ms=base + 10 * i,
                                            headers=[(NAMESPACE_HEADER, namespace.encode())]))
        return await _changelog(settings, topic, namespace)

    assert asyncio.run(go()) == [f"e{i}" for i in range(12)]



def test_a_restore_reads_what_is_journaled_while_it_reads(kafka_bootstrap: str) -> None:
    """A worker journals on while another restores: what lands on the changelog after the restore took its end
    is read too (the end is taken again once reached), also when a fetch of the first pass returns it."""
    settings = scenario_settings(kafka_bootstrap, "memory://")
    topic = f"neardup-test-changelog-meanwhile-{time.time_ns()}"
    namespace = "ns-meanwhile"

    async def journal(p: Any, i: int) -> None:
        [(key, value)] = encode_records([(Entry(f"e{i}", 1000.0 + i, i, 30, np.arange(8, dtype=np.uint64)), (1, 2))])
        await (await p.send(topic, key=key, value=value, partition=0, headers=[(NAMESPACE_HEADER, namespace.encode())]))

    async def go() -> list[str]:
        await ensure_topics(settings, [topic], partitions=1, configs=KEEP)
        async with producer(settings) as p:
            for i in range(3):
                await journal(p, i)
            journaled: list[bool] = []

            def two_more_once_the_end_is_taken(consumer: AIOKafkaConsumer) -> None:
                """The broker's answer, after which a worker journals two more (once): the first pass's fetch
                returns them with the three before."""
                ends = consumer.end_offsets

                async def end_offsets(tps: list[TopicPartition]) -> dict[TopicPartition, int]:
                    got = await ends(tps)
                    if not journaled:
                        journaled.append(True)
                        await journal(p, 3)
                        await journal(p, 4)
                    return cast("dict[TopicPartition, int]", got)

                consumer.end_offsets = end_offsets  # type: ignore[method-assign]

            return await _changelog(settings, topic, namespace, prepare=two_more_once_the_end_is_taken)

    assert asyncio.run(go()) == [f"e{i}" for i in range(5)]


# -- the fence: a changelogged index refuses to decide without its marker -------------------------------


@pytest.mark.parametrize("layout_name", ["slot", "compact", "group", "spread"])
def test_a_rebuild_that_loses_data_before_its_marker_is_set_is_not_marked(redis_url: str, layout_name: str) -> None:
    """Redis restarts empty after the rebuild's last write and before the guard sets the marker: the marker
    goes only where the rebuild's stamp still is (none here), the guard says the index lost data, and a
    lookup refuses to decide (`IndexLost`) until the next rebuild, after which it decides as the memory
    index does. (Without the stamp the marker was set on the empty index: every copy decided unique.)"""
    cfg = FilterConfig()
    rng = random.Random(5)
    syllables = ["ka", "lo", "mi", "ne", "ru", "ta", "vo", "si", "pe", "du", "ar", "en", "il", "om", "ub", "zy"]
    texts = [" ".join("".join(rng.choice(syllables) for _ in range(3)) for _ in range(14)) for _ in range(30)]
    originals = [Message(f"a{i}", t, 1000.0 + i) for i, t in enumerate(texts)]
    copies = [Message(f"b{i}", t + " !!", 2000.0 + i) for i, t in enumerate(texts)]
    with redis_namespace(redis_url) as base:
        url = base + ("" if layout_name == "slot" else f"&layout={layout_name}")
        index = open_index(url, window=cfg.window, bucket_cap=cfg.bucket_cap, namespace="ns", fenced=True)
        journal = Journal(index)
        nd = NearDupFilter(cfg, index=journal)
        read = ListChangelog()

        def then_lost(parts: Iterable[Stored], *, rebuild: bytes = b"") -> int:
            written = index.restore(parts, rebuild=rebuild)
            drop_index(url)  # its master restarted empty, before the marker
            return written

        async def go() -> None:
            guard = IndexGuard(url, namespace="ns", window=cfg.window, member="t")
            try:
                assert await guard.ensure(read, index.restore) is True  # never built: built
                nd.check_batch(originals)
                read.entries.extend(journal.take())
                drop_index(url)  # lost
                with pytest.raises(IndexLost):
                    nd.check_batch(copies)
                with pytest.raises(IndexLost, match="lost data while it was rebuilt"):
                    await guard.ensure(read, then_lost)
                assert await guard.marker() is None
                with pytest.raises(IndexLost):
                    nd.check_batch(copies)
                assert await guard.ensure(read, index.restore) is True
                assert [v.duplicate_of for v in nd.check_batch(copies)] == [f"a{i}" for i in range(len(texts))]
            finally:
                await guard.close()

        try:
            asyncio.run(go())
        finally:
            index.close()


def _keys(url: str) -> list[bytes]:
    base, _, query = url.partition("?")
    prefix = dict(item.split("=", 1) for item in query.split("&"))["prefix"]
    with redis.Redis.from_url(base) as client:
        return sorted(set(client.scan_iter(match=f"{{{prefix}:*")))  # SCAN may name a key twice


def _mark(url: str, epoch: str = "e1") -> None:
    """What the guard does once the index holds the changelog's window."""
    with redis.Redis.from_url(url.partition("?")[0]) as client:
        client.hset(meta_key(url.partition("prefix=")[2], "ns"), MARKER, epoch)


def _fenced(url: str, layout: type[RedisIndex] = RedisIndex) -> RedisIndex:
    return layout(url, window=3600.0, bucket_cap=8, namespace="ns", fenced=True)


@pytest.fixture
def layout() -> type[RedisIndex]:
    """The slot layout's class the fence tests below run on (tests/test_redis_compact.py runs them on its own)."""
    return RedisIndex


def _entry(id: str) -> Entry:
    return Entry(id, 1000.0, 7, 30, np.arange(8, dtype=np.uint64))


def test_a_fenced_index_without_its_marker_refuses_to_decide(redis_url: str, layout: type[RedisIndex]) -> None:
    """Fenced (a worker with a changelog), the index refuses a batch while its marker is missing: nothing is
    decided, nothing written. Unfenced (`neardup filter --index redis://`), it decides as always."""
    cfg = FilterConfig()
    with redis_namespace(redis_url) as url:
        fenced, plain = _fenced(url, layout), layout(url, window=3600.0, bucket_cap=8, namespace="ns")
        try:
            with pytest.raises(IndexLost):
                NearDupFilter(cfg, index=fenced).check_batch(messages())
            with pytest.raises(IndexLost):
                fenced.insert([(_entry("x"), (1, 2))])
            assert _keys(url) == []
            assert any(v.duplicate for v in NearDupFilter(cfg, index=plain).check_batch(messages()))
            drop_index(url)
            _mark(url)
            assert any(v.duplicate for v in NearDupFilter(cfg, index=fenced).check_batch(messages()))
        finally:
            fenced.close()
            plain.close()


def test_a_rebuild_between_two_batches_is_told_once_and_the_guard_has_the_worker_write_back(redis_url: str) -> None:
    """Lost and rebuilt by another worker between two batches of this one (its next lookup finds another
    marker, not none): the rebuild may have read the changelog before this worker committed its last batch,
    so the index says so once (`IndexLost`), and the guard, which knew the old marker, has the worker deliver
    and write back (`ensure` runs `before` and answers True without restoring); the batch after goes on."""
    with redis_namespace(redis_url) as url:
        _mark(url)
        index = _fenced(url)
        guard = IndexGuard(url, namespace="ns", window=3600.0, member="b")
        restores: list[int] = []
        delivered: list[int] = []

        async def read(write):  # type: ignore[no-untyped-def]
            restores.append(1)
            return 0

        async def deliver() -> None:
            delivered.append(1)

        async def go() -> None:
            assert await guard.ensure(read, _writes_nothing, deliver) is False  # the marker as it is: e1
            assert index.lookup([Query("a", 1000.0, (1, 2))], 8) == [(None, [])]
            assert index.insert([(_entry("a"), (1, 2))]) == [None]
            drop_index(url)
            _mark(url, "e2")  # another worker rebuilt it: without "a", committed after its read
            with pytest.raises(IndexLost, match="rebuilt since this worker's last batch"):
                index.lookup([Query("b", 1000.0, (1, 2))], 8)
            assert await guard.ensure(read, _writes_nothing, deliver) is True
            assert (restores, delivered, guard.losses) == ([], [1], 1)
            assert await guard.ensure(read, _writes_nothing, deliver) is False  # told once
            assert index.lookup([Query("b", 1000.0, (1, 2))], 8) == [(None, [])]

        async def run() -> None:
            try:
                await go()
            finally:
                await guard.close()

        try:
            asyncio.run(run())
        finally:
            index.close()


@pytest.mark.parametrize("path", ["transaction", "script (as on Cluster)", "checking script"])
@pytest.mark.parametrize("rebuilt", [False, True], ids=["lost", "rebuilt"])
def test_a_batch_looked_up_before_a_loss_writes_nothing_after_it(redis_url: str, layout: type[RedisIndex], path: str,
                                                                 rebuilt: bool) -> None:
    """The lookup ran before the loss, the insert after it: whether the index is still empty or was rebuilt
    meanwhile (another marker), the insert is refused (`IndexLost`) on each of its paths, and nothing of the
    batch is written: the worker decides it again against the index as it is now."""
    with redis_namespace(redis_url) as url:
        _mark(url)
        index = _fenced(url, layout)
        if path == "script (as on Cluster)":
            index._watchable = lambda: False  # type: ignore[method-assign]  # the slot layout: INSERT_ALONE_LUA
        elif path == "checking script":
            index.alone_inserts = False  # INSERT_LUA
        try:
            assert index.lookup([Query("a", 1000.0, (1, 2))], 8) == [(None, [])]
            drop_index(url)  # the loss: the namespace's keys are gone, the meta hash with its marker
            if rebuilt:
                _mark(url, "e2")
            with pytest.raises(IndexLost):
                index.insert([(_entry("a"), (1, 2))])
            with redis.Redis.from_url(redis_url) as client:
                assert [client.hgetall(k) for k in _keys(url)] == ([{MARKER.encode(): b"e2"}] if rebuilt else [])
        finally:
            index.close()


def test_a_conflict_re_read_after_a_rebuild_is_refused(redis_url: str, layout: type[RedisIndex]) -> None:
    """Another worker's insert makes this one's conflict; the index is rebuilt before the re-read: the
    re-read finds another marker than the lookup did and refuses the batch (its verification was made
    against an index that no longer is)."""
    with redis_namespace(redis_url) as url:
        _mark(url)
        a, b = _fenced(url, layout), _fenced(url, layout)
        a.alone_inserts = False
        try:
            a.lookup([Query("a", 1000.0, (1, 2))], 8)
            b.lookup([Query("b", 1000.0, (2, 3))], 8)
            assert b.insert([(_entry("b"), (2, 3))]) == [None]
            read = a._read_covering

            def rebuilt_first(*args: object, **options: object) -> object:
                _mark(url, "e2")
                return read(*args, **options)  # type: ignore[arg-type]

            a._read_covering = rebuilt_first  # type: ignore[method-assign]
            with pytest.raises(IndexLost):
                a.insert([(_entry("a"), (1, 2))])
        finally:
            a.close()
            b.close()


# -- two workers, and a Redis that loses its data ---------------------------------------------------


def _through_a_loss(kafka_bootstrap: str, tmp_path: Path, index_url: str, items: list[Item],
                    lose: Callable[[list[Serve], Settings], set[str]], **overrides: Any) -> tuple[list[KafkaRecord], str]:
    """Exactly-once, two `neardup serve` processes (static members `a` and `b`, slowed down so that the loss lands
    mid-stream) on a 4-partition backlog of `items`; once a third of it is routed, `lose(started, settings)` (which
    may kill workers, returning their names, and start others into `started`); returns the committed outputs once
    every input has one, and the workers' logs (every worker not killed still running)."""
    settings = scenario_settings(kafka_bootstrap, index_url, ts_field="ts", max_batch=20, max_skew=1800.0,
                                 processing_guarantee="exactly_once", session_timeout=6.0, retry_initial=0.2,
                                 retry_max=1.0, **overrides)

    async def load() -> None:
        await create_topics(settings, 4)
        await produce_to(settings, [(i.partition, i.id.encode(), i.value) for i in items], enable_idempotence=True)

    asyncio.run(load())
    with serving() as started:
        hook = "pause=0.1"
        started += [Serve(settings, tmp_path, name, hook=hook, args=["--group-instance-id", name]) for name in "ab"]
        wait_assigned(started, 4)
        read(settings, committed=True, sources=len(items) // 3, settle=0.0, timeout=90)
        killed = lose(started, settings)
        got = read(settings, committed=True, sources=len(items), settle=2.0, timeout=240)
        for w in started:
            if w.name not in killed:
                w.alive()
        return got, "".join(w.log() for w in started)


def _routed_as_the_filter(got: list[KafkaRecord], logs: str, items: list[Item]) -> list[str]:
    """Every input exactly once in `got`, rebuilt from the changelog in `logs`; the ids routed otherwise than the
    filter (the memory index, event-time order)."""
    sources = [r.header("neardup-source") for r in got]
    assert len(sources) == len(set(sources)) == len(items)  # lost 0, doubled 0
    routed = verdicts_of(got)
    diff = differences(routed, reference(items, NearDupFilter()))
    print(len(diff), f1(routed, items), logs.count("rebuilding it from"))
    return diff


@pytest.mark.parametrize(("loss", "changelog"), [("restart", True), ("flushall", True), ("restart", False),
                                                 ("kill -9 and restart", True)])
def test_two_workers_route_a_backlog_as_the_filter_though_redis_loses_its_data(
        kafka_bootstrap: str, tmp_path: Path, loss: str, changelog: bool) -> None:
    """Exactly-once, two `neardup serve` processes on a 4-partition backlog whose copies lie hours apart;
    mid-stream their Redis is restarted without persistence (or FLUSHALL'd; or, at once, one worker is
    killed with kill -9, Redis restarted without its data and the worker started again under its instance
    id). The workers notice the missing marker (the first lookup or insert after it: `IndexLost`), rebuild
    the window from the changelog, and route on: every record exactly once, and the routing equal to the
    filter's."""
    items = backlog(clusters=400, copies=3)
    server = PrivateRedis(tmp_path)
    server.start()

    def lose(started: list[Serve], settings: Settings) -> set[str]:
        if not loss.startswith("kill"):
            server.lose(loss)
            return set()
        started[0].kill()  # its open transaction is aborted when it comes back (its instance id)
        server.lose("restart")
        started.append(Serve(settings, tmp_path, "again", hook="pause=0.1", args=["--group-instance-id", "a"]))
        return {started[0].name}

    try:
        got, logs = _through_a_loss(kafka_bootstrap, tmp_path, server.url + "?prefix=cl", items, lose,
                                    changelog=changelog)
    finally:
        server.stop()
    diff = _routed_as_the_filter(got, logs, items)
    if not changelog:  # the test can fail: without the changelog, what the window held is forgotten
        assert len(diff) > 100
        return
    assert "rebuilding it from the changelog" in logs and "index rebuilt from the changelog" in logs
    # The fence: no batch is decided against the lost index; and the group goes on only once each worker has
    # written back what it decided (its mark, found gone, published as 0 until then). Without the changelog,
    # every copy of what the window held before differs.
    assert diff == []
    assert not any(r.header("neardup-method") == b"replay" for r in got)


@pytest.mark.parametrize("lost", ["one master", "every master"])
def test_two_workers_route_a_backlog_as_the_filter_though_a_spread_clusters_masters_lose_their_data(
        kafka_bootstrap: str, tmp_path: Path, lost: str) -> None:
    """As above, on the spread layout over a Redis Cluster of 3 masters of the test's own: mid-stream one master
    (or each in turn) is killed and started again empty, with its slots. The workers notice the shard without
    its marker (the lookup, or a later read of the batch: `IndexLost`), one rebuilds the whole namespace from
    the changelog, and they route on: every record exactly once, and the routing equal to the filter's."""
    items = backlog(clusters=300, copies=3)
    cluster = PrivateCluster(tmp_path)
    cluster.start()

    def lose(started: list[Serve], settings: Settings) -> set[str]:
        for master in range(3) if lost == "every master" else [1]:
            cluster.lose(master)
        return set()

    try:
        got, logs = _through_a_loss(kafka_bootstrap, tmp_path, cluster.url + "?prefix=cl&layout=spread", items, lose)
    finally:
        cluster.stop()
    diff = _routed_as_the_filter(got, logs, items)
    assert "rebuilding it from the changelog" in logs and "index rebuilt from the changelog" in logs
    assert diff == []
    assert not any(r.header("neardup-method") == b"replay" for r in got)


async def _changelog(settings: Settings, topic: str | None = None, namespace: str | None = None,
                     prepare: Callable[[AIOKafkaConsumer], None] | None = None) -> list[str]:
    """The ids of the entries the changelog holds (`topic`, by default the settings'; of `namespace`, by default
    the default configuration's), in the order a restore reads them (`read_committed`); `prepare` is shown the
    restore's consumer first."""
    topic = topic or settings.changelog_name
    namespace = namespace or NearDupFilter().config.digest()
    consumer = AIOKafkaConsumer(enable_auto_commit=False, isolation_level="read_committed",
                                max_partition_fetch_bytes=8 * 1024 * 1024, **client_options(settings))
    await consumer.start()
    if prepare is not None:
        prepare(consumer)
    ids: list[str] = []

    async def write(entries: Stored) -> int:
        ids.extend(entries.ids)
        return len(entries)

    try:
        async with producer(settings) as p:  # (a consumer's metadata may not list the topic yet)
            partitions = sorted(await p.partitions_for(topic))
        await read_changelog(consumer, topic, partitions, namespace, 0, write)
    finally:
        await consumer.stop()
    return ids


class _Crash(Exception):
    pass


class _LosesItsData(IndexWrapper):
    """The index's door, whose Redis loses its data (FLUSHALL) right after the first batch holding message `id`
    was decided: its entries inserted, the batch not yet handed over."""

    def __init__(self, inner: CandidateIndex, server: PrivateRedis, id: str, armed: list[bool]) -> None:
        super().__init__(inner)
        self.server, self.id, self.armed = server, id, armed

    def decide(self, batch: Batch, verifier: Verifier) -> list[Verdict]:
        verdicts = self.inner.decide(batch, verifier)
        if self.armed[0] and any(m.id == self.id for m in batch.messages):
            self.armed[0] = False
            self.server.lose("flushall")
        return verdicts


@pytest.mark.parametrize("dies", [True, False])
def test_a_worker_that_dies_after_redis_lost_its_data_lets_no_copy_overtake_what_it_decided(
        kafka_bootstrap: str, tmp_path: Path, dies: bool) -> None:
    """Exactly-once, aligned, two workers of one partition each: `x` (partition 0) and its copy `y` 50 s later
    (partition 1), `max_skew` 1 s. Right after the worker of `x` decided it, Redis loses its data (FLUSHALL:
    the index and the group's marks); that worker then dies before committing (its transaction stays open) and
    comes back under its instance id 3 s later (or, `dies` false, goes on). Its mark, found gone, was published
    as 0 until it had delivered `x` and written it back into the rebuilt index, so the other worker decides `y`
    only after that: `y` a duplicate of `x`, as the filter decides. (Before, its mark went on past `x` at once:
    `y` was decided unique against an index rebuilt without `x`, and `x`, decided again after the restart, a
    duplicate of its own later copy; and a worker that went on wrote back only the batches delivered before
    it published its mark again, not `x`'s.)"""
    text = "Your parcel is held at the depot, confirm your address at parcel-help.example within 24 hours"
    t = 1_700_000_000.0
    rows = [(0, "a0", "Lunch at noon? The new place on the corner has good noodles", t + 10),
            (0, "x", text + " ref 1182", t + 100), (0, "a2", "The committee meets on Thursday about the budget", t + 300),
            (1, "b0", "Quarterly earnings beat expectations as revenue grew twelve percent", t + 20),
            (1, "y", text + " ref 9907", t + 150), (1, "b2", "Rain is expected over the weekend in the north", t + 310)]
    items = [Item(part, ts, id, 0, orjson.dumps({"id": id, "text": body, "ts": ts})) for part, id, body, ts in rows]
    want = reference(items, NearDupFilter())
    assert want["y"] == "duplicate" and want["x"] == "unique"
    server = PrivateRedis(tmp_path)
    server.start()
    settings = scenario_settings(kafka_bootstrap, server.url + "?prefix=rj", ts_field="ts", max_batch=20, max_skew=1.0,
                                 processing_guarantee="exactly_once", idle_timeout=30.0)
    armed, crash_armed = [True], [dies]

    def crash(records: Sequence[KafkaRecord], outs: Sequence[OutRecord]) -> None:
        if crash_armed[0] and any(b'"id":"x"' in (r.value or b"") for r in records):
            crash_armed[0] = False
            raise _Crash

    def worker(name: str, hooked: bool) -> AiokafkaWorker:
        nd = open_filter(replace(settings, group_instance_id=name))
        if hooked:
            nd.index = _LosesItsData(nd.index, server, "x", armed)
        return AiokafkaWorker(replace(settings, group_instance_id=name), nd, observer=crash if hooked else None)

    async def scenario() -> list[KafkaRecord]:
        await create_topics(settings, 2)
        workers = {name: worker(name, True) for name in "ab"}
        tasks = {name: asyncio.ensure_future(w.run()) for name, w in workers.items()}
        try:
            deadline = time.monotonic() + 60
            while not all(len(w.aligner.lanes()) == 1 and w.group.complete for w in workers.values()):
                assert time.monotonic() < deadline and not any(t.done() for t in tasks.values())
                await asyncio.sleep(0.05)
            await produce_to(settings, [(i.partition, i.id.encode(), i.value) for i in items], enable_idempotence=True)
            if dies:
                done, _ = await asyncio.wait(tasks.values(), timeout=60, return_when=asyncio.FIRST_COMPLETED)
                dead = next(name for name, t in tasks.items() if t in done)
                with pytest.raises(_Crash):
                    tasks[dead].result()
                await asyncio.sleep(3.0)  # the other worker goes on meanwhile, as far as the group lets it
                workers[dead] = worker(dead, False)
                tasks[dead] = asyncio.ensure_future(workers[dead].run())
            return await read_outputs(settings, committed=True, sources=len(items), settle=2.0, timeout=90)
        finally:
            for w in workers.values():
                w.stop()
            await asyncio.wait_for(asyncio.gather(*tasks.values(), return_exceptions=True), 60)

    try:
        got = asyncio.run(scenario())
    finally:
        server.stop()
    sources = [r.header("neardup-source") for r in got]
    assert len(sources) == len(set(sources)) == len(items)  # lost 0, doubled 0
    assert differences(verdicts_of(got), want) == []


def test_a_batch_committed_as_its_partitions_go_is_written_back_after_a_rebuild_that_missed_it(
        kafka_bootstrap: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Exactly-once, aligned. Worker `a` routes ten originals alone, and their transaction is held open while Redis
    loses its data (FLUSHALL) and worker `b` joins: `b` rebuilds the index from the changelog, which does not show
    the open transaction, and the rebalance waits for `a` to commit the batch as its partitions go. Then ten
    copies, later in event time. `a`, under its new assignment, finds the index rebuilt and writes back what it
    delivered, that batch included (committed under the assignment before): every copy a duplicate, as the filter
    decides. (Before, the write-back took only the batches of the worker's current assignment: 10 copies unique.)"""
    t = 1_700_000_000.0
    words = [f"word{i}" for i in range(40)]
    texts = [" ".join(random.Random(n).sample(words, 18)) for n in range(10)]
    originals = [Item(n % 2, t + n, f"o{n}", n, orjson.dumps({"id": f"o{n}", "text": texts[n], "ts": t + n}))
                 for n in range(10)]
    copies = [Item(n % 2, t + 100 + n, f"c{n}", n,
                   orjson.dumps({"id": f"c{n}", "text": texts[n] + " call 555-01" + str(n), "ts": t + 100 + n}))
              for n in range(10)]
    want = reference(originals + copies, NearDupFilter())
    assert all(want[c.id] == "duplicate" for c in copies)
    server = PrivateRedis(tmp_path)
    server.start()
    settings = scenario_settings(kafka_bootstrap, server.url + "?prefix=wb", ts_field="ts", max_batch=20, max_skew=5.0,
                                 processing_guarantee="exactly_once", idle_timeout=2.0)
    held = [True]
    restored = asyncio.Event()  # b rebuilt the index (from a changelog without the batch held open)
    commit = ExactlyOnce.commit

    async def held_commit(self: ExactlyOnce) -> None:
        flight = self._in_flight
        if held[0] and flight is not None and any(b'"id":"o0"' in (r.value or b"") for r in flight.batch.records):
            held[0] = False
            await asyncio.wait_for(restored.wait(), 60)  # the transaction stays open, its outputs and records sent
        await commit(self)

    monkeypatch.setattr(ExactlyOnce, "commit", held_commit)

    async def scenario() -> list[KafkaRecord]:
        await create_topics(settings, 2)
        a = AiokafkaWorker(replace(settings, group_instance_id="a"))
        b = AiokafkaWorker(replace(settings, group_instance_id="b"))
        tasks = [asyncio.ensure_future(a.run())]
        try:
            deadline = time.monotonic() + 60
            while not (len(a.aligner.lanes()) == 2 and a.group.complete):
                assert time.monotonic() < deadline and not tasks[0].done()
                await asyncio.sleep(0.05)
            await produce_to(settings, [(i.partition, i.id.encode(), i.value) for i in originals],
                             enable_idempotence=True)
            while held[0]:  # a's batch routed, its transaction open
                assert time.monotonic() < deadline and not tasks[0].done()
                await asyncio.sleep(0.02)
            server.lose("flushall")
            tasks.append(asyncio.ensure_future(b.run()))
            while not (b.guard is not None and b.guard.last is not None):  # b's rebuild done
                assert time.monotonic() < deadline + 30 and not any(t.done() for t in tasks)
                await asyncio.sleep(0.02)
            restored.set()
            while not (len(b.aligner.lanes()) == 1 and len(a.aligner.lanes()) == 1):
                assert time.monotonic() < deadline + 60 and not any(t.done() for t in tasks)
                await asyncio.sleep(0.05)
            await produce_to(settings, [(i.partition, i.id.encode(), i.value) for i in copies], enable_idempotence=True)
            return await read_outputs(settings, committed=True, sources=20, settle=2.0, timeout=90)
        finally:
            a.stop()
            b.stop()
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)

    try:
        got = asyncio.run(scenario())
    finally:
        server.stop()
    sources = [r.header("neardup-source") for r in got]
    assert len(sources) == len(set(sources)) == 20  # lost 0, doubled 0
    assert differences(verdicts_of(got), want) == []


def _indexed(index_url: str) -> list[str]:
    """The ids of the entries the Redis index holds."""
    base, _, query = index_url.partition("?")
    prefix = dict(item.split("=", 1) for item in query.split("&"))["prefix"]
    with redis.Redis.from_url(base) as client:
        return [field[1:].decode() for key in set(client.scan_iter(match=f"{{{prefix}:*}}:s:*"))
                for field in client.hkeys(key) if field[:1] == b"e"]


async def _until_a_transaction_is_open(settings: Settings, partitions: int, then: Callable[[], object],
                                       timeout: float = 30.0) -> None:
    """Until an output partition holds records of a transaction not committed yet (its stable end behind its
    end); then calls `then` at once (before the consumers close: that takes long enough for it to commit)."""
    ends = {isolation: AIOKafkaConsumer(enable_auto_commit=False, isolation_level=isolation, **client_options(settings))
            for isolation in ("read_committed", "read_uncommitted")}
    for consumer in ends.values():
        await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for topic in (settings.unique_topic, settings.duplicate_topic)
               for p in range(partitions)]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stable = await ends["read_committed"].end_offsets(tps)
            if stable != await ends["read_uncommitted"].end_offsets(tps):
                then()
                return
            await asyncio.sleep(0.01)
        raise AssertionError("no transaction was seen open")
    finally:
        for consumer in ends.values():
            await consumer.stop()


def test_an_aborted_transaction_leaves_nothing_behind(kafka_bootstrap: str, redis_url: str, tmp_path: Path) -> None:
    """Exactly-once with the changelog: worker a is killed (-9) with a transaction open (slowed down: one
    always is) and started again under the same instance id, whose transactional id aborts it: a real
    aborted transaction, its outputs and changelog records in the log but never committed. The records it
    held are routed again: the entries the aborted attempt inserted are found under their own ids
    (replays), and the outputs get the very headers the aborted attempt had given them (a first decision's,
    no trace of the retry); their entries are journaled then. So the changelog's committed entries are the
    unique outputs, each once, the index holds exactly those, and the routing is the filter's."""
    items = backlog(clusters=150, copies=3)
    want = reference(items, NearDupFilter())
    for _ in range(3):  # the kill can land in the moment the open transaction commits: then again, afresh
        got, everything, journaled, indexed = _killed_with_a_transaction_open(kafka_bootstrap, redis_url, tmp_path, items)
        committed = {(r.topic, r.partition, r.offset) for r in got}
        aborted = [r for r in everything if (r.topic, r.partition, r.offset) not in committed]
        if aborted:
            break
    assert aborted, "no transaction with outputs was aborted: the test proves nothing"
    sources = [r.header("neardup-source") for r in got]
    assert len(sources) == len(set(sources)) == len(items)  # lost 0, doubled 0
    first = {r.header("neardup-source"): r for r in got}
    assert all(first[r.header("neardup-source")].headers == r.headers for r in aborted)
    routed = verdicts_of(got)
    unique = sorted(id for id, verdict in routed.items() if verdict == "unique")
    assert sorted(journaled) == unique  # each unique once; nothing of the aborted attempt
    assert sorted(indexed) == unique
    assert differences(routed, want) == []


def _killed_with_a_transaction_open(kafka_bootstrap: str, redis_url: str, tmp_path: Path, items: list[Item],
                                    ) -> tuple[list[KafkaRecord], list[KafkaRecord], list[str], list[str]]:
    """`test_an_aborted_transaction_leaves_nothing_behind`'s run on fresh topics and a fresh namespace: the
    outputs committed, all outputs (aborted ones too), the changelog's entries and the index's ids."""
    with redis_namespace(redis_url) as index:
        settings = scenario_settings(kafka_bootstrap, index, ts_field="ts", max_batch=20, max_skew=1800.0,
                                     processing_guarantee="exactly_once", session_timeout=6.0)

        async def load() -> None:
            await create_topics(settings, 4)
            await produce_to(settings, [(i.partition, i.id.encode(), i.value) for i in items], enable_idempotence=True)

        asyncio.run(load())
        with serving() as started:
            a = Serve(settings, tmp_path, "a", hook="pause=0.2,hold_commit=0.5", args=["--group-instance-id", "a"])
            started.append(a)
            read(settings, committed=True, sources=len(items) // 8, settle=0.0, timeout=90)
            asyncio.run(_until_a_transaction_is_open(settings, 4, then=a.kill))
            again = Serve(settings, tmp_path, "again", args=["--group-instance-id", "a"])
            started.append(again)
            got = read(settings, committed=True, sources=len(items), settle=2.0, timeout=180)
            assert again.stop() == 0, again.log()[-3000:]
        everything = read(settings, sources=len(items), settle=2.0, timeout=60)  # aborted records too
        return got, everything, asyncio.run(_changelog(settings)), _indexed(index)
