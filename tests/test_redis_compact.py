"""The compact slot layout (filters/index/redis_compact.py, `?layout=compact`) against a real Redis: the behaviour
tests of tests/test_redis_index.py that hold for any layout, run again on it (they take this module's `make`),
and the layout's own: where its fields live, the refusal of a namespace of the layout before."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable, Iterator
from typing import Any, cast

import numpy as np
import pytest
import redis

from filters.config import FilterConfig
from filters.engine import NearDupFilter
from filters.errors import ConfigError, IndexUnavailable
from filters.index import Entry, Query
from filters.index import compact_codec as cc
from filters.index.redis import RedisIndex, RedisTarget
from filters.index.redis_codec import stored_of
from filters.index.redis_compact import CompactIndex
from tests.test_changelog import (
    _keys,
    _mark,
    drop_index,
    redis_namespace,
    test_a_batch_looked_up_before_a_loss_writes_nothing_after_it,
    test_a_conflict_re_read_after_a_rebuild_is_refused,
    test_a_fenced_index_without_its_marker_refuses_to_decide,
)
from tests.test_changelog import messages as changelog_messages
from tests.test_index_contract import _view, drop_namespace, generated_messages, with_query
from tests.test_redis_index import (  # noqa: F401 (race_url: a fixture)
    ANY_LAYOUT,
    WINDOW,
    PausedLookup,
    _namespace_dump,
    _put,
    assert_stored_alike,
    cluster_url,
    drop_cluster_namespace,
    entry,
    ids,
    made_indexes,
    race,
    race_url,
)

globals().update(ANY_LAYOUT)  # collected here again, each with this module's `make` or `layout`: the compact layout
__all__ = [  # idem, the changelog's
    "test_a_batch_looked_up_before_a_loss_writes_nothing_after_it",
    "test_a_conflict_re_read_after_a_rebuild_is_refused",
    "test_a_fenced_index_without_its_marker_refuses_to_decide",
]


@pytest.fixture
def make(redis_url: str, prefix: str) -> Iterator[Callable[..., RedisIndex]]:
    yield from made_indexes(CompactIndex, redis_url, prefix, layout="compact")


@pytest.fixture
def watched() -> str:
    return "_write_watched_compact"


def test_a_stream_leaves_its_fields_in_small_listpack_hashes(make: Callable[..., RedisIndex], redis_url: str,
                                                             prefix: str) -> None:
    """After a stream: the buckets and ids in small hashes Redis keeps as listpacks, records of 16 bytes, the
    entries in the slice hash keyed by seq; the meta hash says the layout and the bits of its slice."""
    index = make()
    verdicts = NearDupFilter(FilterConfig(window=WINDOW), index=index).check_batch(generated_messages(600, seed=3))
    assert sum(not v.duplicate for v in verdicts) >= 100
    with redis.Redis.from_url(redis_url) as client:
        meta = client.hgetall(f"{{{prefix}:ns}}:meta")
        assert meta[b"layout"] == b"compact"
        (slice_field,) = [f for f in meta if f.startswith(b"k:")]
        bits = int(meta[slice_field])
        slice_key = f"{{{prefix}:ns}}:c:{slice_field[2:].decode()}"
        small = [f"{slice_key}:{j}" for j in range(2**bits)]
        assert {client.object("encoding", key) for key in small if client.exists(key)} == {b"listpack"}
        fields = {f: v for key in small for f, v in client.hgetall(key).items()}
        assert {f[:1] for f in fields} == {b"b", b"i"}
        assert all(len(v) % 16 == 0 for f, v in fields.items() if v != b"\x00")
        entries = [f for f in client.hkeys(slice_key) if f.startswith(b"e")]
        assert sum(f.startswith(b"i") for f in fields) == int(client.hget(slice_key, "n")) == len(entries) >= 100
        assert all(len(f) == 9 for f in entries)
    slot = RedisIndex(with_query(redis_url, prefix=prefix), window=WINDOW, bucket_cap=8, namespace="slot")
    try:  # the same verdicts as the slot layout, and as many entries
        assert NearDupFilter(FilterConfig(window=WINDOW), index=slot).check_batch(generated_messages(600, seed=3)) \
            == verdicts
        assert slot.stats()["entries"] == len(entries)
    finally:
        slot.close()


def test_a_namespace_of_the_layout_before_is_refused_with_one_line(make: Callable[..., RedisIndex], redis_url: str,
                                                                    prefix: str) -> None:
    old = RedisIndex(with_query(redis_url, prefix=prefix), window=WINDOW, bucket_cap=8, namespace="old")
    assert_refused_after(old, make, "another layout.*give a new prefix")


def assert_refused_after(old: RedisIndex, make: Callable[..., RedisIndex], match: str) -> None:
    """`old` (of namespace `old`, in another layout) inserts; an index of this layout (`make`) of that namespace
    then refuses to look up, with one line that matches `match`."""
    try:
        old.lookup([Query("a", 1000.0, (1, 2))], 8)
        old.insert([(entry("a"), (1, 2))])
    finally:
        old.close()
    index = make("old")
    with pytest.raises(ConfigError, match=match) as caught:
        index.lookup([Query("b", 1001.0, (1, 2))], 8)
    assert "\n" not in str(caught.value)


class _PausedCompact(PausedLookup, CompactIndex):
    """The compact layout, paused between lookup and insert (`PausedLookup`)."""


@pytest.mark.parametrize("paused", [True, False], ids=["paused-between-lookup-and-insert", "free-running"])
def test_near_duplicates_at_the_same_moment_make_exactly_one_unique(race_url: str, paused: bool) -> None:  # noqa: F811
    """Standalone and Redis Cluster (where every insert round is the checking script)."""
    uniques = race(race_url, racy=False, paused=paused, index=_PausedCompact)
    assert uniques == [1] * len(uniques)


@pytest.mark.parametrize("inline", [True, False], ids=["by-the-insert", "by-the-next-lookups"])
def test_a_slice_that_left_the_window_goes_with_its_small_hashes(make: Callable[..., CompactIndex], redis_url: str,
                                                                  prefix: str, inline: bool,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The insert that moves the window unlinks the slice hash of the slice that left it, and its small hashes
    when they are few (`UNLINK_INLINE_BITS`); more are unlinked by the next lookups (a few UNLINKs with each),
    and then its bits."""
    if not inline:
        monkeypatch.setattr(cc, "UNLINK_INLINE_BITS", 0)
    index = make(window=100.0)
    for id, ts in (("a", 10.0), ("b", 150.0), ("c", 250.0)):  # slices 0, 1, 2
        index.lookup([Query(id, ts, (1,))], 8)
        assert index.insert([(entry(id, ts), (1,))]) == [None]
    with redis.Redis.from_url(redis_url) as client:
        def slices() -> list[str]:
            return sorted({k.decode().split(":")[3] for k in client.scan_iter(match=f"{{{prefix}:ns}}:c:*")})

        assert not client.exists(f"{{{prefix}:ns}}:c:0")
        if not inline:
            assert slices() == ["0", "1", "2"]  # slice 0's small hashes not yet
            for ts in (251.0, 252.0):  # the first lookup finds slice 0's bits, the second unlinks its small hashes
                index.lookup([Query("q", ts, (1,))], 8)
        assert slices() == ["1", "2"]
        assert client.hget(f"{{{prefix}:ns}}:meta", "k:0") is None
        assert client.hget(f"{{{prefix}:ns}}:meta", "k:1") is not None


@pytest.mark.parametrize(("window", "cap"), [(3600.0, 8), (30.0, 2)])
def test_uncontended_inserts_store_what_the_checking_script_stores(make: Callable[..., CompactIndex], redis_url: str,
                                                                   prefix: str, window: float, cap: int) -> None:
    """As tests/test_redis_index.py's: the uncontended rounds (the watched transaction), the checking script
    alone, and the uncontended rounds on the Python references of the compiled helpers leave the very same
    keys and bytes (records, marks, trims, entries, ids, bits, seq and high-water mark, slices unlinked)."""
    config = FilterConfig(window=window, bucket_cap=cap)
    fast, checked = make("fast", window=window, bucket_cap=cap), make("checked", window=window, bucket_cap=cap)
    checked.alone_inserts = False
    reference = make("reference", window=window, bucket_cap=cap)
    reference._alone_compact, reference._rank_compact = cc.alone_round, cc.rank_records
    reference._read_commands_of, reference._column_of = cc.read_commands, cc.column_of
    reference._write_commands_of = cc.write_commands
    assert_stored_alike(config, fast, checked, reference, redis_url, prefix)


def test_the_checking_script_is_loaded_again_after_a_script_flush(make: Callable[..., CompactIndex],
                                                                   redis_url: str) -> None:
    """A server that forgot the script (a restart, a failover) answers NOSCRIPT: it comes back in its place among
    the replies read in bulk, and the script is loaded and run again."""
    index = make()
    index.alone_inserts = False
    for id in ("a", "b"):
        with redis.Redis.from_url(redis_url) as client:
            client.script_flush()
        index.lookup([Query(id, 1000.0, (1,))], 8)
        assert index.insert([(entry(id), (1,))]) == [None]
    assert ids(index.lookup([Query("q", 1000.0, (1,))], 8)[0][1]) == ["b", "a"]


# --- the fence (docs/design.md, "The index changelog"): as tests/test_changelog.py's, in the compact layout ---

def _fenced(url: str) -> CompactIndex:
    return CompactIndex(url, window=3600.0, bucket_cap=8, namespace="ns", fenced=True)


@pytest.fixture
def layout() -> type[RedisIndex]:
    return CompactIndex


def test_a_cluster_routes_as_the_memory_index(redis_cluster_url: str, layout: type[CompactIndex]) -> None:
    """On Redis Cluster (no WATCH: the checking script every round, its keys all of one hash tag) the layout
    decides a stream as the memory index, its keys all on one master."""
    prefix = f"neardup-test-{uuid.uuid4().hex[:10]}"
    url = with_query(cluster_url(redis_cluster_url), prefix=prefix, layout=layout.LAYOUT)
    messages = generated_messages(400, seed=5)
    config = FilterConfig(window=WINDOW)
    index = layout(url, window=WINDOW, bucket_cap=config.bucket_cap, namespace="ns")
    try:
        got = [v for at in range(0, 400, 50) for v in NearDupFilter(config, index=index).check_batch(messages[at : at + 50])]
    finally:
        index.close()
    memory = NearDupFilter(config)
    assert got == [v for at in range(0, 400, 50) for v in memory.check_batch(messages[at : at + 50])]
    with redis.RedisCluster.from_url(redis_cluster_url) as cluster:
        holding = [node for node in cluster.get_primaries()
                   if list(cluster.scan_iter(match=f"{{{prefix}:*", target_nodes=node))]
        assert len(holding) == 1
    drop_cluster_namespace(cluster_url(redis_cluster_url), prefix)


def test_a_namespace_lost_and_made_again_is_not_taken_for_the_one_before(make: Callable[..., CompactIndex],
                                                                         redis_url: str, prefix: str) -> None:
    """Lost and made again by another client, the namespace's seqs name other entries, at the same event
    times: the client that kept the entries of the namespace before must read them again, not take its own."""
    a, b = make(), make()
    a.lookup([Query("a", 1000.0, (1,))], 8)
    assert a.insert([(entry("a"), (1,))]) == [None]
    assert ids(a.lookup([Query("q", 1000.0, (1,))], 8)[0][1]) == ["a"]
    drop_namespace(redis_url, prefix)  # the loss (unfenced: `neardup filter --index redis://`)
    b.lookup([Query("b", 1000.0, (1,))], 8)
    assert b.insert([(entry("b", seed=1), (1,))]) == [None]  # seq 1 again, at the same event time
    [(_, found)] = a.lookup([Query("q", 1000.0, (1,))], 8)
    assert ids(found) == ["b"] and found[0].entry.exact == entry("b", seed=1).exact


def test_a_small_hash_renewed_in_this_period_gets_its_ttl_again_once_the_namespace_was_lost(
        make: Callable[..., CompactIndex], redis_url: str, prefix: str) -> None:
    """A small hash's TTL is set once a period (grace / 2) by a client, not at each write; a namespace lost and
    made again starts the periods afresh: every key it writes has a TTL again."""
    index = make(grace="600")
    for id, ts in (("a", 1000.0), ("b", 1001.0)):
        index.lookup([Query(id, ts, (1, 2))], 8)
        assert index.insert([(entry(id, ts), (1, 2))]) == [None]
    drop_namespace(redis_url, prefix)
    index.lookup([Query("c", 1002.0, (1, 2))], 8)
    assert index.insert([(entry("c", 1002.0), (1, 2))]) == [None]
    with redis.Redis.from_url(redis_url) as client:
        keys = set(client.scan_iter(match=f"{{{prefix}:ns}}:*"))  # SCAN may name a key twice
        assert len(keys) >= 3 and all(0 < client.pttl(key) <= (WINDOW + 600) * 1000 for key in keys)


def _journal(n: int = 40) -> list[tuple[Entry, tuple[int, ...]]]:
    return [(Entry(f"j{i}", 1000.0 + i, i, 30, np.arange(8, dtype=np.uint64) + i), (i % 7, 100 + i % 3))
            for i in range(n)]


def _original(url: str, journal: list[tuple[Entry, tuple[int, ...]]],
              queries: list[Query]) -> list[tuple[object, ...]]:
    """What an index that inserted `journal` one after another answers to `queries`; the index is dropped after
    (a loss: the guard rebuilds it from the changelog)."""
    _mark(url)
    original = _fenced(url)
    try:
        for e, keys in journal:
            original.lookup([Query(e.id, e.ts, keys)], 8)
            assert original.insert([(e, keys)]) == [None]
        return _view(original.lookup(queries, 8))
    finally:
        original.close()
        drop_index(url)


_QUERIES = [Query("q", 1100.0, (3, 101)), Query("j5", 1100.0, (5,)), Query("x", 1100.0, (999,))]


def _unpacked(data: bytes) -> list[tuple[Any, ...]]:
    """The commands of a RESP request (`_Packed`): name and key (if any) as str, the rest bytes."""
    out: list[tuple[Any, ...]] = []
    at = 0
    while at < len(data):
        end = data.index(b"\r\n", at)
        count, at = int(data[at + 1 : end]), end + 2
        args: list[Any] = []
        for _ in range(count):
            end = data.index(b"\r\n", at)
            size, at = int(data[at + 1 : end]), end + 2
            args.append(data[at : at + size])
            at += size + 2
        out.append((*(a.decode() for a in args[:2]), *args[2:]))
    return out


def _recording(index: CompactIndex) -> bytearray:
    """Every byte `index` sends on its own connection from now on (`_unpacked` reads the commands), the rebuild's
    writes sent from a thread of their own, in pieces, among them."""
    sent = bytearray()
    conn = index._pinned()
    send = conn.send_packed_command

    def recorded(command: Any, check_health: bool = True) -> None:
        for part in command if isinstance(command, list) else [command]:
            sent.extend(part)
        send(command, check_health)

    conn.send_packed_command = recorded
    return sent


def test_a_rebuild_holds_the_fields_and_writes_each_small_hash_once(redis_url: str) -> None:
    """A fenced index without its marker (lost: the guard rebuilds it from the changelog) takes a restore with
    no transaction and no read of what it wrote: each small hash is written by one HSET, every key it leaves
    has a TTL, and it decides as the index it was once the marker is set."""
    cfg = FilterConfig()
    with redis_namespace(redis_url) as url:
        journal = _journal()
        before = _original(url, journal, _QUERIES)
        rebuilt = _fenced(url)
        raw = _recording(rebuilt)
        try:
            assert rebuilt.restore([stored_of(journal)], rebuild=b"t") == 40
            sent = _unpacked(bytes(raw))
            names = [c[0] for c in sent]
            assert "MULTI" not in names and "WATCH" not in names and "EVALSHA" not in names
            small = [c[1] for c in sent if c[0] == "HSET" and str(c[1]).count(":c:") and str(c[1]).count(":") == 4]
            assert small and len(small) == len(set(small))
            with redis.Redis.from_url(redis_url) as client:
                assert all(client.pttl(k) > 0 for k in _keys(url))
                assert not client.hexists(f"{{{url.partition('prefix=')[2]}:ns}}:meta", "rebuilding")
            _mark(url, "e2")
            assert _view(rebuilt.lookup(_QUERIES, 8)) == before
            assert any(v.duplicate for v in NearDupFilter(cfg, index=rebuilt).check_batch(changelog_messages()))
        finally:
            rebuilt.close()


def _resolved(dump: dict[bytes, Any]) -> dict[bytes, dict[bytes, bytes]]:
    """A compact namespace's dump (`_namespace_dump`) as one hash a slice: its small hashes' fields and its slice
    hash's, a bucket's records where they are kept (not its mark)."""
    out: dict[bytes, dict[bytes, bytes]] = {}
    for key, fields in dump.items():
        whole = out.setdefault(b":".join(key.split(b":")[:3]), {})
        for name, value in fields.items():
            if value != cc.MARK or name not in whole:
                whole[name] = value
    return out


@pytest.mark.parametrize("cap", [8, 2])
def test_a_rebuild_that_holds_more_than_it_may_writes_it_and_goes_on(redis_url: str, monkeypatch: pytest.MonkeyPatch,
                                                                     cap: int) -> None:
    """Past `HOLD_RECORDS` bucket records held (30 here, for 2^24), a rebuild writes what it holds and goes on
    rebuilding: no guarded chunk, no transaction, no script; a field it wrote is read back and goes on from what
    Redis holds (its records, its trims, a bucket kept in the slice hash), and a slice it wrote that left the
    window goes with its small hashes. The namespace holds the very bytes of a rebuild that held it all, and
    decides as it does."""
    import filters.index.redis as slot
    import filters.index.redis_compact as compact

    monkeypatch.setattr(slot, "REBUILD_CHUNK", 7)
    # Three slices of an hour; buckets shared by many entries (trimmed, kept in the slice hash); ids again.
    journal = [(Entry(f"j{i % 250}", 1000.0 + i * 30, i, 30, np.arange(8, dtype=np.uint64) + i),
                (i % 7, 100 + i % 3, 1000 + i)) for i in range(300)]
    queries = [Query("q", 10_000.0, (3, 101)), Query("j5", 10_000.0, (5,)), Query("x", 10_000.0, (1290,))]
    with redis_namespace(redis_url) as whole_url, redis_namespace(redis_url) as url:
        whole = CompactIndex(whole_url, window=3600.0, bucket_cap=cap, namespace="ns", fenced=True)
        assert whole.restore([stored_of(journal)], rebuild=b"t") == 300
        monkeypatch.setattr(compact, "HOLD_RECORDS", 30)
        rebuilt = CompactIndex(url, window=3600.0, bucket_cap=cap, namespace="ns", fenced=True)
        raw = _recording(rebuilt)
        rebuilt._restore_watched = None  # type: ignore[assignment,method-assign] # never called
        try:
            assert rebuilt.restore([stored_of(journal)], rebuild=b"t") == 300
            sent = _unpacked(bytes(raw))
            names = [c[0] for c in sent]
            assert "MULTI" not in names and "WATCH" not in names and "EVALSHA" not in names
            small = [c[1] for c in sent if c[0] == "HSET" and str(c[1]).count(":c:") and str(c[1]).count(":") == 4]
            assert len(small) > len(set(small))  # held fields written more than once
            assert [c for c in sent if c[0] == "HMGET" and str(c[1]).count(":") == 4]  # ... and read back
            assert any(c[0] == "UNLINK" and str(c[1]).count(":") == 4 for c in sent)  # a slice written left
            with redis.Redis.from_url(redis_url) as client:
                assert all(client.pttl(k) > 0 for k in _keys(url))
            dumps = [_namespace_dump(redis_url, u.partition("prefix=")[2], "ns") for u in (whole_url, url)]
            if cap == 8:
                assert dumps[1] == dumps[0]
            else:  # a bucket written long midway, trimmed short after, stays in the slice hash: a mark never goes back
                assert _resolved(dumps[1]) == _resolved(dumps[0]) and dumps[1] != dumps[0]
            _mark(url, "e2")
            _mark(whole_url, "e2")
            assert _view(rebuilt.lookup(queries, 8)) == _view(whole.lookup(queries, 8))
        finally:
            rebuilt.close()
            whole.close()


def test_a_rebuild_after_one_that_died_drops_what_it_left(redis_url: str) -> None:
    """A rebuild that died left entries whose fields it still held (its `rebuilding` field says so): the next
    rebuild unlinks what the namespace holds first, and decides as the index it was."""
    with redis_namespace(redis_url) as url:
        journal = _journal()
        before = _original(url, journal, _QUERIES)
        prefix = url.partition("prefix=")[2]
        with redis.Redis.from_url(redis_url) as client:
            client.hset(f"{{{prefix}:ns}}:meta", mapping={"rebuilding": "1", "seq": "7", "hwm": "9000",
                                                         "layout": "compact"})
            client.hset(f"{{{prefix}:ns}}:c:9", "n", "3")
        rebuilt = _fenced(url)
        try:
            assert rebuilt.restore([stored_of(journal)], rebuild=b"t") == 40
            with redis.Redis.from_url(redis_url) as client:
                assert not client.exists(f"{{{prefix}:ns}}:c:9")
                assert client.hget(f"{{{prefix}:ns}}:meta", "seq") == b"40"
            _mark(url, "e2")
            assert _view(rebuilt.lookup(_QUERIES, 8)) == before
        finally:
            rebuilt.close()


def _intruded(rebuilt: CompactIndex, other: CompactIndex) -> list[bool]:
    """Makes `other` (an unfenced client of `rebuilt`'s namespace) insert an entry `x` (keys 3 and 999) once
    `rebuilt` first writes its high-water mark: somebody else writing during a rebuild. Returns a list that holds
    True once it did."""
    execute = rebuilt._execute
    intruded: list[bool] = []

    def intruding(commands: Any, **options: Any) -> Any:
        replies = execute(commands, **options)
        if not intruded and any(c[0] == "HSET" and c[2] == "hwm" for c in commands):
            intruded.append(True)
            other.lookup([Query("x", 1020.0, (3, 999))], 8)
            assert other.insert([(Entry("x", 1020.0, 1, 30, np.arange(8, dtype=np.uint64)), (3, 999))]) == [None]
        return replies

    rebuilt._execute = intruding  # type: ignore[method-assign]
    return intruded


def _watched_rounds(index: CompactIndex) -> list[bool]:
    """A list that gets, per guarded chunk of `index`'s restores (`_restore_watched`), whether Redis took it."""
    restore_watched = index._restore_watched
    watched: list[bool] = []

    def counted(rows: Any) -> Any:
        done = restore_watched(rows)
        watched.append(done is not None)
        return done

    index._restore_watched = counted  # type: ignore[method-assign]
    return watched


def _assert_rebuilt_beside_an_intruder(rebuilt: CompactIndex, other: CompactIndex,
                                       journal: list[tuple[Entry, tuple[int, ...]]]) -> None:
    """`rebuilt` restores `journal` (40 entries) while `other` writes (`_intruded`): all of them written, what it
    handed on in guarded chunks, each taken."""
    intruded = _intruded(rebuilt, other)
    watched = _watched_rounds(rebuilt)
    assert rebuilt.restore([stored_of(journal)], rebuild=b"t") == 40
    assert intruded and watched and all(watched)
    del rebuilt._execute  # (the class's again)


def _assert_the_intruder_kept(rebuilt: CompactIndex) -> None:
    """The entry `_intruded` inserted is a candidate of its keys, beside those of the rebuild."""
    [(_, found)] = rebuilt.lookup([Query("y", 1100.0, (999,))], 8)
    assert [c.entry.id for c in found] == ["x"]
    [(_, found)] = rebuilt.lookup([Query("y", 1100.0, (3,))], 8)
    assert "x" in [c.entry.id for c in found] and len(found) > 1


def test_a_rebuild_that_finds_another_writer_hands_the_rest_to_guarded_chunks(redis_url: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Somebody else writes during a rebuild (an unfenced client): the rebuild sees the seq move, writes what it
    holds merged with what Redis holds, and restores the rest in guarded transactions. Both are kept."""
    import filters.index.redis as slot

    monkeypatch.setattr(slot, "REBUILD_CHUNK", 10)
    with redis_namespace(redis_url) as url:
        journal = _journal()
        before = _original(url, journal, _QUERIES[:2])
        rebuilt = _fenced(url)
        other = CompactIndex(url, window=3600.0, bucket_cap=8, namespace="ns")
        try:
            _assert_rebuilt_beside_an_intruder(rebuilt, other, journal)
            _mark(url, "e2")
            assert _view(rebuilt.lookup(_QUERIES[:2], 8)) == before
            _assert_the_intruder_kept(rebuilt)
        finally:
            rebuilt.close()
            other.close()


def test_a_restore_makes_a_slice_with_the_small_hashes_of_its_rate(make: Callable[..., CompactIndex], redis_url: str,
                                                                   prefix: str) -> None:
    """A rebuilt namespace has no slice before its first: the restore sizes the slices it makes for the rate
    its entries show (5,000 in a tenth of a slice: 50,000 a slice), not the first slice's 2^K_FIRST."""
    index = make(window=1000.0)
    made = [(Entry(f"r{i}", 1000.0 + i * 0.02, i, 30, np.arange(8, dtype=np.uint64) + i), (i, 10**6 + i))
            for i in range(5000)]
    assert index.restore([stored_of(made)]) == 5000
    with redis.Redis.from_url(redis_url) as client:
        assert int(client.hget(f"{{{prefix}:ns}}:meta", "k:1")) == cc.slice_bits(50_000) > cc.K_FIRST


@pytest.mark.parametrize("path", ["transaction", "checking script"])
def test_the_first_slice_gets_the_small_hashes_of_the_rate_the_url_names(make: Callable[..., CompactIndex],
                                                                         redis_url: str, prefix: str,
                                                                         path: str) -> None:
    """`?rate=` (messages a second) sizes a slice made with no slice before it (else 2^K_FIRST): 20 a second over
    a window of 1,000 s is 20,000 a slice; the checking script (as on Cluster, and when contended) alike."""
    index = make(window=1000.0, rate="20")
    index.alone_inserts = path == "transaction"
    NearDupFilter(FilterConfig(window=1000.0), index=index).check_batch(generated_messages(50, seed=5))
    with redis.Redis.from_url(redis_url) as client:
        (bits,) = [int(v) for f, v in client.hgetall(f"{{{prefix}:ns}}:meta").items() if f.startswith(b"k:")]
    assert bits == cc.slice_bits(20_000) > cc.K_FIRST


def test_a_refused_round_sent_ahead_leaves_the_slice_it_would_have_made_unmade(
        make: Callable[..., CompactIndex]) -> None:
    """A round sent ahead (`insert_ahead`) that makes a slice (its bits in the meta hash) and that Redis refuses
    made nothing: the client does not take the slice as made, so the next round that writes there makes it, and
    another client reads what it wrote."""
    a, b = make(), make()
    t = WINDOW * 10 + 1.0  # in slice 10, which nobody made
    for id, ts in (("b1", t - WINDOW), ("b2", t - WINDOW + 1)):  # slice 9
        b.lookup([Query(id, ts, (7,))], 8)
        assert b.insert([(entry(id, ts), (7,))]) == [None]
        if id == "b1":
            a.lookup([Query("a1", t, (1, 2))], 8)  # b2 goes in after this lookup
    assert a.insert_ahead([(entry("a1", t), (1, 2))])
    assert a.settle() == (False, False)
    # a1 not inserted after all (as an entry that lost a race): the next round to write slice 10 is a2's.
    a.lookup([Query("a2", t, (3, 4))], 8)
    assert a.insert([(entry("a2", t), (3, 4))]) == [None]
    [(_, found)] = make().lookup([Query("q", t, (3, 4))], 8)
    assert ids(found) == ["a2"]


def test_a_round_sent_ahead_whose_answer_is_lost_leaves_nothing_of_it_kept(make: Callable[..., CompactIndex]) -> None:
    """A round sent ahead (refused by Redis: another client wrote after the lookup) whose answer goes with the
    connection: `settle` fails the batch (whether Redis wrote it is unknown), and the client keeps nothing of
    the round: no entry at a seq another client took, no slice taken as made."""
    a, b = make(), make()
    t = WINDOW * 10 + 1.0  # in slice 10, which nobody made
    for id, ts in (("b1", t - WINDOW), ("b2", t - WINDOW + 1)):  # slice 9, seqs 1 and 2
        b.lookup([Query(id, ts, (7,))], 8)
        assert b.insert([(entry(id, ts), (7,))]) == [None]
        if id == "b1":
            a.lookup([Query("a1", t, (1, 2))], 8)  # b2 goes in after this lookup
    assert a.insert_ahead([(entry("a1", t), (1, 2))])  # a1 at seq 2, if Redis took it
    a._conn.disconnect()  # the connection goes before the answer is read
    with pytest.raises(IndexUnavailable):
        a.settle()
    [(_, found)] = a.lookup([Query("q", t - WINDOW + 2, (7,))], 8)
    assert sorted(ids(found)) == ["b1", "b2"]
    a.lookup([Query("a2", t, (3, 4))], 8)
    assert a.insert([(entry("a2", t), (3, 4))]) == [None]
    [(_, found)] = make().lookup([Query("q", t, (3, 4))], 8)
    assert ids(found) == ["a2"]


def test_a_small_hash_a_refused_round_sent_ahead_would_have_renewed_gets_its_ttl_from_the_next_round(
        make: Callable[..., CompactIndex], redis_url: str, prefix: str) -> None:
    """A refused round sent ahead renewed nothing: the next round that writes its small hashes sets their TTL (a
    client sets a small hash's TTL once a period, `_renewing`)."""
    a, b = make(grace="600"), make(grace="600")
    for id in ("b1", "b2"):
        b.lookup([Query(id, 1000.0, (1, 2))], 8)
        assert b.insert([(entry(id, 1000.0), (1, 2))]) == [None]
        if id == "b1":
            a.lookup([Query("a1", 1000.0, (1, 2))], 8)  # b2 goes in after this lookup
    bits = b._bits[b._slice(1000.0)]
    small = [cc.small_key(f"{b._spre}{b._slice(1000.0)}", cc.small_hash(key, bits)) for key in (1, 2)]
    with redis.Redis.from_url(redis_url) as client:
        for key in small:
            assert client.pexpire(key, 5000)  # as if set long ago, with 5 s of it left
        assert a.insert_ahead([(entry("a1", 1000.0), (1, 2))])
        assert a.settle() == (False, False)
        a.lookup([Query("a2", 1000.0, (1, 2))], 8)
        assert a.insert([(entry("a2", 1000.0), (1, 2))]) == [None]
        assert all(client.pttl(key) > (WINDOW + 300) * 1000 for key in small)


def test_a_refused_round_sent_ahead_moves_no_window_for_the_reaping(make: Callable[..., CompactIndex]) -> None:
    """A refused round sent ahead far ahead in event time (it would have moved the window past slice 0) raised
    no high-water mark: the client reaps no small hash of a slice still inside the window (`_gone`)."""
    a, b = make(), make()
    far = 1000.0 + 3 * WINDOW
    for id in ("b1", "b2"):
        b.lookup([Query(id, 1000.0, (1, 2))], 8)
        assert b.insert([(entry(id, 1000.0), (1, 2))]) == [None]
        if id == "b1":
            a.lookup([Query("a1", far, (5,))], 8)  # b2 goes in after this lookup
    assert a.insert_ahead([(entry("a1", far), (5,))])
    assert a.settle() == (False, False)
    for id in ("q1", "q2"):  # (a lookup's read sends the reaping its previous read found to do)
        a.lookup([Query(id, 1001.0, (1, 2))], 8)
    [(_, found)] = make().lookup([Query("q", 1002.0, (1, 2))], 8)
    assert sorted(ids(found)) == ["b1", "b2"]


def test_rate_is_an_option_of_the_compact_layout_only() -> None:
    assert RedisTarget.parse("redis://h/0?layout=compact&rate=2.5").rate == 2.5
    for url in ("redis://h/0?rate=3", "redis://h/0?layout=compact&rate=0", "redis://h/0?layout=compact&rate=x",
                "redis://h/0?layout=compact&rate=inf"):
        with pytest.raises(ConfigError):
            RedisTarget.parse(url)


def test_without_the_compiled_core_the_python_reference_decides_alike(make: Callable[..., CompactIndex],
                                                                      layout: type[CompactIndex],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The layout on its Python reference (a slice's reads and writes packed by `compact_codec` or
    `group_codec`, the rest of the round through hiredis): the verdicts of the compiled core, batch after batch."""
    import filters.index.redis_compact as redis_compact

    messages = generated_messages(900, seed=11)
    verdicts = {}
    for name, native in (("compiled", redis_compact._native), ("reference", None)):
        for module in {redis_compact, sys.modules[layout.__module__]}:
            monkeypatch.setattr(module, "_native", native)
        nd = NearDupFilter(FilterConfig(window=WINDOW), index=make(name))
        verdicts[name] = [v for at in range(0, len(messages), 128) for v in nd.check_batch(messages[at : at + 128])]
    assert verdicts["reference"] == verdicts["compiled"]
    assert sum(v.duplicate for v in verdicts["compiled"]) > 0


def test_the_entries_kept_by_seq_are_the_newest_once_a_quarter_more_came(make: Callable[..., RedisIndex]) -> None:
    """The entries a client keeps by seq (`entry_cache`): once a quarter more than the cache came, the oldest go
    and the newest `entry_cache` stay, in the order they came."""
    index = cast(CompactIndex, make(entry_cache="8"))
    kept = {seq: entry(f"m{seq}") for seq in range(1, 11)}
    index._keep(kept)
    assert list(index._by_seq) == list(range(1, 11))  # 10: not more than 8 + 8 // 4
    newest = entry("m11")
    index._keep({11: newest, 3: kept[3]})  # 3 again: it stays where it was, among the oldest
    assert list(index._by_seq) == list(range(4, 12))
    assert index._by_seq[11] is newest and index._by_seq[4] is kept[4]
