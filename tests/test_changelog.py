"""The index changelog: its record codec, the journal at the index's door, `restore` on every backend, and
two `neardup serve` workers on a real broker that route a backlog as the filter does while their Redis loses
its data (restarted without persistence, or FLUSHALL) mid-stream."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from bench.kafka_support import redis_namespace
from bench.reliability import Serve, create_topics, produce_to, read, scenario_settings, serving, wait_assigned
from filters.config import FilterConfig
from filters.engine import NearDupFilter
from filters.errors import IndexCorrupt
from filters.index import Entry
from filters.index.backends import open_index
from filters.index.memory import MemoryIndex
from filters.records import Message
from stream.backlog import backlog, differences, f1, reference, verdicts_of
from stream.changelog import IndexGuard, Journal, decode_record, encode_record

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


def test_a_record_reads_back_as_the_entry_and_keys_it_was_made_of() -> None:
    nd = NearDupFilter(FilterConfig(methods=("exact", "mgram", "simhash", "minhash", "sentences")))
    for msg, fp in zip(messages(), nd.fingerprinter.fingerprint_batch([m.text for m in messages()]), strict=True):
        entry = Entry.of(msg.id, msg.ts, fp)
        got, keys = decode_record(msg.id, encode_record(entry, fp.keys))
        assert keys == tuple(fp.keys)
        assert (got.id, got.ts, got.exact, got.size, got.simhash, got.sentences) == (
            entry.id, entry.ts, entry.exact, entry.size, entry.simhash, entry.sentences)
        assert np.array_equal(got.sketch, entry.sketch)
        assert (got.minhash is None) == (entry.minhash is None)
    with pytest.raises(IndexCorrupt):
        decode_record("x", b"\x01\x05\x00\x00\x00" + bytes(8))  # five keys promised, one there
    with pytest.raises(IndexCorrupt):
        decode_record("x", b"\x09\x00\x00\x00\x00")  # a format this neardup does not read


@pytest.fixture(params=["memory", "redis", "redis-spread"])
def index_url(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "memory":
        yield "memory://"
        return
    with redis_namespace(request.getfixturevalue("redis_url")) as url:
        yield url + ("&layout=spread" if request.param == "redis-spread" else "")


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
            restored = _shared(other + ("&layout=spread" if "layout=spread" in index_url else ""), cfg)
            try:
                _restore_and_compare(original, restored, made, later)
            finally:
                restored.index.close()
                original.index.close()
            return
    _restore_and_compare(original, restored, made, later)


def _restore_and_compare(original: NearDupFilter, restored: NearDupFilter, made: list, later: list[Message]) -> None:  # type: ignore[type-arg]
    assert restored.index.restore(made) == len(made) > 0
    assert restored.index.restore(made) == 0  # live ids are kept as they are
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
                await asyncio.gather(a.ensure(read, lambda e: 0), b.ensure(read, lambda e: 0))
                assert len(restores) == 1
                assert await a.intact() and await b.intact()
                assert await a.ensure(read, lambda e: 0) is None
                assert a.losses == b.losses == 1
            finally:
                await a.close()
                await b.close()

        asyncio.run(go())


# -- two workers, and a Redis that loses its data ---------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivateRedis:
    """A redis-server of this test's own, without persistence, that it may restart (losing everything)."""

    def __init__(self, workdir: Path) -> None:
        self.port = _free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not installed (.ci/run installs it)", pytrace=False)
        self.proc = subprocess.Popen([exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.workdir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                if redis.Redis(port=self.port, socket_timeout=1).ping():
                    return
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.mark.parametrize(("loss", "changelog"), [("restart", True), ("flushall", True), ("restart", False)])
def test_two_workers_route_a_backlog_as_the_filter_though_redis_loses_its_data(
        kafka_bootstrap: str, tmp_path: Path, loss: str, changelog: bool) -> None:
    """Exactly-once, two `neardup serve` processes on a 4-partition backlog whose copies lie hours apart;
    mid-stream their Redis is restarted without persistence (or FLUSHALL'd). The workers notice the missing
    marker, rebuild the window from the changelog, and route on: every record exactly once, and the routing
    equal to the filter's but for the records decided between the loss and its detection."""
    items = backlog(clusters=400, copies=3)
    want = reference(items, NearDupFilter())
    server = PrivateRedis(tmp_path)
    server.start()
    try:
        settings = scenario_settings(kafka_bootstrap, server.url + "?prefix=cl", ts_field="ts", max_batch=20,
                                     max_skew=1800.0, processing_guarantee="exactly_once", session_timeout=6.0,
                                     retry_initial=0.2, retry_max=1.0, changelog=changelog)

        async def load() -> None:
            await create_topics(settings, 4)
            await produce_to(settings, [(i.partition, i.id.encode(), i.value) for i in items],
                             enable_idempotence=True)

        asyncio.run(load())
        with serving() as started:
            hook = "pause=0.1"  # slowed down, so that the loss lands mid-stream
            a = Serve(settings, tmp_path, "a", hook=hook, args=["--group-instance-id", "a"])
            b = Serve(settings, tmp_path, "b", hook=hook, args=["--group-instance-id", "b"])
            started += [a, b]
            wait_assigned([a, b], 4)
            read(settings, committed=True, sources=len(items) // 3, settle=0.0, timeout=90)
            if loss == "restart":
                server.stop()
                time.sleep(1.0)
                server.start()
            else:
                redis.Redis(port=server.port).flushall()
            got = read(settings, committed=True, sources=len(items), settle=2.0, timeout=180)
            for w in (a, b):
                w.alive()
            logs = a.log() + b.log()
    finally:
        server.stop()
    sources = [r.header("neardup-source") for r in got]
    assert len(sources) == len(set(sources)) == len(items)  # lost 0, doubled 0
    routed = verdicts_of(got)
    diff = differences(routed, want)
    print(loss, changelog, len(diff), f1(routed, items), f1(want, items), logs.count("rebuilding it from"))
    if not changelog:  # the test can fail: without the changelog, what the window held is forgotten
        assert len(diff) > 100
        return
    assert "rebuilding it from the changelog" in logs and "index rebuilt from the changelog" in logs
    # Decided between the loss and the check that noticed it (index_check, 200 ms, at most a few batches of
    # 50 per worker): without the changelog, every copy of what the window held before would differ.
    assert len(diff) <= 30, diff
    assert abs(f1(routed, items) - f1(want, items)) <= 0.01
    assert not any(r.header("neardup-method") == b"replay" for r in got)
