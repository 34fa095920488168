"""The group layout of the Redis index (filters/index/redis_group.py): the slot layout's tests run again on it, and
its own: what it stores, the refusal of another layout, ids confirmed by their entry, the contended round."""

from __future__ import annotations

import random
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import numpy as np
import pytest
import redis

from filters.config import FilterConfig
from filters.engine import NearDupFilter
from filters.index import Entry, Query
from filters.index import compact_codec as cc
from filters.index import group_codec as gc
from filters.index import redis as slot
from filters.index.redis import MARKER, STAMP, RedisIndex, RedisTarget
from filters.index.redis_codec import stored_of
from filters.index.redis_compact import CompactIndex
from filters.index.redis_group import GroupIndex
from tests.test_index_contract import _view, drop_namespace, generated_messages, with_query
from tests.test_redis_compact import (
    _assert_rebuilt_beside_an_intruder,
    _assert_the_intruder_kept,
    _recording,
    _unpacked,
    _watched_rounds,
    assert_refused_after,
    test_a_cluster_routes_as_the_memory_index,
    test_a_refused_round_sent_ahead_leaves_the_slice_it_would_have_made_unmade,
    test_a_round_sent_ahead_whose_answer_is_lost_leaves_nothing_of_it_kept,
    test_the_checking_script_is_loaded_again_after_a_script_flush,
    test_without_the_compiled_core_the_python_reference_decides_alike,
)
from tests.test_redis_index import (
    ANY_LAYOUT,
    WINDOW,
    PausedLookup,
    _namespace_dump,
    assert_stored_alike,
    cluster_url,
    drop_cluster_namespace,
    entry,
    ids,
    made_indexes,
    race,
)

globals().update(ANY_LAYOUT)  # collected here again, each with this module's `make`, `watched` and `race_url`
__all__ = [  # idem, the compact layout's that hold for this one, with this module's `make` and `layout`
    "test_a_cluster_routes_as_the_memory_index",
    "test_a_refused_round_sent_ahead_leaves_the_slice_it_would_have_made_unmade",
    "test_a_round_sent_ahead_whose_answer_is_lost_leaves_nothing_of_it_kept",
    "test_the_checking_script_is_loaded_again_after_a_script_flush",
    "test_without_the_compiled_core_the_python_reference_decides_alike",
]


@pytest.fixture
def make(redis_url: str, prefix: str) -> Iterator[Callable[..., RedisIndex]]:
    yield from made_indexes(GroupIndex, redis_url, prefix, layout="group")


@pytest.fixture
def watched() -> str:
    return "_write_groups"


@pytest.fixture
def layout() -> type[RedisIndex]:
    return GroupIndex


@pytest.fixture(params=["standalone", "cluster"])
def race_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """Standalone Redis, and Redis Cluster (no WATCH: an uncontended round through INSERT_ALONE_LUA)."""
    prefix = f"neardup-test-{uuid.uuid4().hex[:10]}"
    if request.param == "standalone":
        base = request.getfixturevalue("redis_url")
        yield with_query(base, prefix=prefix, layout="group")
        drop_namespace(base, prefix)
    else:
        base = cluster_url(request.getfixturevalue("redis_cluster_url"))
        yield with_query(base, prefix=prefix, layout="group")
        drop_cluster_namespace(base, prefix)


def test_a_stream_leaves_its_records_in_groups_of_the_slice_hash(make: Callable[..., RedisIndex], redis_url: str,
                                                                  prefix: str) -> None:
    """After a stream: one slice hash, its fields the groups `g<j>` (records of 20 bytes: each entry's id record
    once), the entries keyed by seq, the counts; the meta hash says the layout and the bits of the slice; the
    verdicts and entries of the slot layout."""
    index = make()
    verdicts = NearDupFilter(FilterConfig(window=WINDOW), index=index).check_batch(generated_messages(600, seed=3))
    assert sum(not v.duplicate for v in verdicts) >= 100
    with redis.Redis.from_url(redis_url) as client:
        meta = client.hgetall(f"{{{prefix}:ns}}:meta")
        assert meta[b"layout"] == b"group"
        (slice_field,) = [f for f in meta if f.startswith(b"k:")]
        assert int(meta[slice_field]) == gc.K_FIRST
        keys = sorted(client.scan_iter(match=f"{{{prefix}:ns}}:*"))
        slice_key = f"{{{prefix}:ns}}:g:{slice_field[2:].decode()}".encode()
        assert keys == sorted([f"{{{prefix}:ns}}:meta".encode(), slice_key])
        fields = client.hgetall(slice_key)
    groups = {f: v for f, v in fields.items() if f.startswith(b"g")}
    entries = [f for f in fields if f.startswith(b"e")]
    memos = [f for f in fields if f.startswith(b"d")]
    assert set(fields) == {*groups, *entries, *memos, b"n", b"m"} and all(len(f) == 9 for f in entries)
    assert all(len(v) % gc.RECORD_SIZE == 0 for v in groups.values())
    records = [v[r : r + gc.RECORD_SIZE] for v in groups.values() for r in range(0, len(v), gc.RECORD_SIZE)]
    assert sum(1 for r in records if r[12] & 0x80) == int(fields[b"n"]) == len(entries) == index.stats()["entries"]
    slot = RedisIndex(with_query(redis_url, prefix=prefix), window=WINDOW, bucket_cap=8, namespace="slot")
    try:  # the same verdicts as the slot layout, as many entries and buckets
        assert NearDupFilter(FilterConfig(window=WINDOW), index=slot).check_batch(generated_messages(600, seed=3)) \
            == verdicts
        assert slot.stats()["entries"] == len(entries)
        assert slot.stats()["buckets"] == index.stats()["buckets"]
    finally:
        slot.close()


def test_the_mixed_values_of_many_keys_are_each_keys_mixed_value() -> None:
    """`mixed_keys` (a round's bucket keys at once, for the checking script) is `mixed` of each key."""
    rng = random.Random(3)
    keys = [0, 1, (1 << 64) - 1, 1 << 63, *(rng.getrandbits(64) for _ in range(500))]
    flat = gc.mixed_keys(b"".join(k.to_bytes(8, "big") for k in keys))
    assert flat == b"".join(gc.mixed(k).to_bytes(8, "big") for k in keys)
    assert gc.mixed_keys(b"") == b""
    with pytest.raises(ValueError):
        gc.mixed_keys(b"\x00" * 7)


@pytest.mark.parametrize("other", ["slot", "compact"])
def test_a_namespace_of_another_layout_is_refused_with_one_line(make: Callable[..., RedisIndex], redis_url: str,
                                                                 prefix: str, other: str) -> None:
    cls = RedisIndex if other == "slot" else CompactIndex
    query = {"prefix": prefix, **({"layout": "compact"} if other == "compact" else {})}
    old = cls(with_query(redis_url, **query), window=WINDOW, bucket_cap=8, namespace="old")
    assert_refused_after(old, make, "another layout.*group layout: give a new prefix")


@pytest.mark.parametrize(("window", "cap"), [(3600.0, 8), (30.0, 2)])
def test_uncontended_inserts_store_what_the_checking_script_stores(make: Callable[..., GroupIndex], redis_url: str,
                                                                    prefix: str, window: float, cap: int) -> None:
    """The uncontended rounds (the watched transaction), the contended round alone (the checking script) and the
    uncontended rounds on the Python references leave the very same keys and bytes (records in their groups and
    their order, trims, entries, bits, seq and high-water mark, slices unlinked)."""
    config = FilterConfig(window=window, bucket_cap=cap)
    fast, checked = make("fast", window=window, bucket_cap=cap), make("checked", window=window, bucket_cap=cap)
    checked.alone_inserts = False
    reference = make("reference", window=window, bucket_cap=cap)
    reference._alone_compact, reference._rank_compact = cc.alone_round, cc.rank_records
    reference._read_fields, reference._group_column = gc.read_fields, gc.column_of  # type: ignore[assignment]
    reference._apply_round = gc.apply_round  # type: ignore[assignment]
    reference._alone_groups, reference._keep_written = gc.alone_groups, gc.keep_written  # type: ignore[assignment]
    reference._pack_group_writes = gc.pack_writes  # type: ignore[assignment]
    assert_stored_alike(config, fast, checked, reference, redis_url, prefix)


def test_an_id_record_of_another_id_alike_in_its_32_bits_is_not_a_replay(make: Callable[..., GroupIndex],
                                                                           redis_url: str, prefix: str) -> None:
    """The record of id a, copied under the record key of id q in q's group (as two ids alike in their 32 bits
    and group would be, 2^-32 a pair): q's lookup reads a's entry for it, whose id is not q's, so q is not a
    replay; a's entry is its candidate as any entry sharing its buckets; q is then inserted."""
    index = make()
    index.lookup([Query("a", 1000.0, (1, 2))], 8)
    assert index.insert([(entry("a"), (1, 2))]) == [None]
    with redis.Redis.from_url(redis_url) as client:
        meta = client.hgetall(f"{{{prefix}:ns}}:meta")
        (slice_field,) = [f for f in meta if f.startswith(b"k:")]
        bits = int(meta[slice_field])
        key = f"{{{prefix}:ns}}:g:{slice_field[2:].decode()}"
        a_hash, q_hash = cc.id_hash("a"), cc.id_hash("q")
        a_group = client.hget(key, gc.group_field(gc.group_of(a_hash, bits)))
        assert a_group is not None
        (record,) = [a_group[r : r + 20] for r in range(0, len(a_group), 20)
                     if a_group[r : r + 4] == gc.record_key(a_hash)]
        q_field = gc.group_field(gc.group_of(q_hash, bits))
        client.hset(key, q_field, (client.hget(key, q_field) or b"") + gc.record_key(q_hash) + record[4:])
    other = make()
    [(own, cands)] = other.lookup([Query("q", 1000.0, (2, 3))], 8)
    assert own is None and ids(cands) == ["a"]
    assert other.insert([(entry("q", seed=1), (2, 3))]) == [None]
    [(own, _)] = other.lookup([Query("q", 1000.0, (2, 3))], 8)
    assert own is not None and own.id == "q"  # its own record now, the newest of the two alike
    [(own, cands)] = make().lookup([Query("a", 1000.0, (1,))], 8)
    assert own is not None and own.id == "a" and cands == []


class _PausedGroup(PausedLookup, GroupIndex):
    """The group layout, paused between lookup and insert (`PausedLookup`)."""


@pytest.mark.parametrize("paused", [True, False], ids=["paused-between-lookup-and-insert", "free-running"])
def test_near_duplicates_at_the_same_moment_make_exactly_one_unique(race_url: str, paused: bool) -> None:
    """Real threads on real Redis: each worker's copy of a spam at the same moment; the contended rounds (a
    refused transaction, then the checking script; on Redis Cluster INSERT_ALONE_LUA refusing, then the script)
    let exactly one through."""
    uniques = race(race_url, racy=False, paused=paused, index=_PausedGroup)
    assert uniques == [1] * len(uniques)


def test_contended_workers_all_get_through(make: Callable[..., GroupIndex]) -> None:
    """Four threads inserting distinct messages into the same buckets at once: every round gets through (a refused
    transaction is tried again), each entry once."""
    workers = [make() for _ in range(4)]
    errors: list[BaseException] = []

    def run(w: int) -> None:
        try:
            for k in range(25):
                id = f"w{w}-{k}"
                workers[w].lookup([Query(id, 1000.0 + k, (1, 2, 3))], 8)
                for _ in range(50):  # a conflict: verified (unique: distinct messages) and inserted again
                    if workers[w].insert([(entry(id, 1000.0 + k, seed=w * 100 + k), (1, 2, 3))]) == [None]:
                        break
                else:
                    raise AssertionError(f"{id} never got in")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert workers[0].stats()["entries"] == 100


def test_the_first_slice_gets_the_groups_of_the_rate_the_url_names(make: Callable[..., GroupIndex], redis_url: str,
                                                                   prefix: str) -> None:
    """`?rate=` sizes a slice made with no slice before it: 100 a second over a window of 1,000 s is 100,000."""
    index = make(window=1000.0, rate="100")
    NearDupFilter(FilterConfig(window=1000.0), index=index).check_batch(generated_messages(50, seed=5))
    with redis.Redis.from_url(redis_url) as client:
        (bits,) = [int(v) for f, v in client.hgetall(f"{{{prefix}:ns}}:meta").items() if f.startswith(b"k:")]
    assert bits == gc.slice_bits(100_000) > gc.K_FIRST
    assert RedisTarget.parse("redis://h/0?layout=group&rate=2.5").rate == 2.5


def _cluster_dump(url: str, prefix: str, namespace: str) -> dict[bytes, dict[bytes, bytes]]:
    """Every key of a namespace on a Redis Cluster (one slot: one master) and what it holds."""
    with redis.RedisCluster.from_url(url.replace("+cluster", "")) as cluster:
        keys = sorted({key for node in cluster.get_primaries()
                       for key in cluster.scan_iter(match=f"{{{prefix}:{namespace}}}:*", target_nodes=node)})
        return {key.split(b"}", 1)[1]: cluster.hgetall(key) for key in keys}


@pytest.mark.parametrize(("window", "cap"), [(3600.0, 8), (30.0, 2)])
def test_uncontended_rounds_on_a_cluster_store_what_the_checking_script_stores(redis_cluster_url: str, window: float,
                                                                               cap: int) -> None:
    """On Redis Cluster (no WATCH) an uncontended round's groups go through INSERT_ALONE_LUA: the same batches
    through it and through the checking script alone (`alone_inserts` off) leave the very same keys and bytes
    (groups, entries, counts, bits, layout, seq, high-water mark, the token, slices unlinked: a window of 30 s
    makes several), and the verdicts of the memory index."""
    base = cluster_url(redis_cluster_url)
    prefix = f"neardup-test-{uuid.uuid4().hex[:10]}"
    url = with_query(base, prefix=prefix, layout="group")
    config = FilterConfig(window=window, bucket_cap=cap)
    fast = GroupIndex(url, window=window, bucket_cap=cap, namespace="fast")
    checked = GroupIndex(url, window=window, bucket_cap=cap, namespace="checked")
    checked.alone_inserts = False
    checked._token = fast._token  # the `gen` each first writer leaves: the same here, compared too
    scripts: dict[str, list[Any]] = {"fast": [], "checked": []}
    for name, index in (("fast", fast), ("checked", checked)):
        def counted(script: Any, calls: Any, then: Any = (), run: Any = index._eval_pipelined,
                    seen: list[Any] = scripts[name]) -> list[Any]:
            replies = run(script, calls, then)
            seen.extend((script.sha, reply) for reply in replies)
            return cast("list[Any]", replies)

        index._eval_pipelined = counted  # type: ignore[method-assign]
    messages = generated_messages(600, seed=3)
    try:
        verdicts = []
        for index in (fast, checked):
            engine = NearDupFilter(config, index=index)
            verdicts.append([v for at in range(0, 600, 50) for v in engine.check_batch(messages[at : at + 50])])
        memory = NearDupFilter(config)
        assert verdicts[0] == verdicts[1] == [v for at in range(0, 600, 50)
                                              for v in memory.check_batch(messages[at : at + 50])]
        alone = slot._INSERT_ALONE.sha
        assert sum(1 for sha, reply in scripts["fast"] if sha == alone and reply == 1) >= 10  # it did the work
        assert all(sha != alone for sha, _ in scripts["checked"])
        fast_dump = _cluster_dump(base, prefix, "fast")
        assert fast_dump == _cluster_dump(base, prefix, "checked")
        assert len(fast_dump) >= (4 if window < 60 else 2) and b"gen" in fast_dump[b":meta"]
    finally:
        fast.close()
        checked.close()
        drop_cluster_namespace(base, prefix)


@pytest.mark.parametrize("seed", range(40))
def test_the_checking_script_writes_the_groups_apply_round_writes(make: Callable[..., GroupIndex], redis_url: str,
                                                                   prefix: str, seed: int) -> None:
    """Seeded random rounds: a slice of few groups holding records already (buckets past twice the cap, other ids'
    records, equal event times), then a round of entries through the checking script (`_guarded_round`, nothing
    to compare), whose buckets crowd those groups (a key given twice too): the groups Redis then holds are
    `group_codec.apply_round`'s of the groups before, byte for byte, and the entries, count, seq and high-water
    mark are the round's."""
    rng = random.Random(seed)
    window, cap = 100.0, rng.choice([1, 2, 3])
    bits = rng.choice([0, 1, 2, 4, gc.K_FIRST])
    s = rng.choice([17, -3])
    low = s * window
    pool = [rng.getrandbits(64) for _ in range(rng.choice([3, 8]))]
    times = [low + rng.choice([0.0, 1.5, 1.5, 40.25, 99.0]) for _ in range(60)]
    # What the slice holds before: records of the pool's buckets (some with more than twice the cap), ids' records.
    before: dict[bytes, bytes] = {}
    start = 50
    for n in range(1, start + 1):
        h, is_id = (cc.id_hash(f"old-{n}"), True) if rng.random() < 0.2 else (rng.choice(pool), False)
        field = gc.group_field(gc.group_of(h, bits))
        rec = gc.record_key(h) + gc._TS.pack(rng.choice(times)) + gc._SEQ.pack(n | (gc.ID_TAG if is_id else 0))
        before[field] = before.get(field, b"") + rec
    index = make(window=window, bucket_cap=cap)
    meta, key = f"{{{prefix}:ns}}:meta", f"{{{prefix}:ns}}:g:{s}"
    with redis.Redis.from_url(redis_url) as client:
        client.hset(meta, mapping={"seq": start, "hwm": repr(low), "layout": "group", f"k:{s}": bits})
        client.hset(key, mapping=before)
        count = rng.randint(1, 14)
        ids = [f"new-{seed}-{i}" for i in range(count)]
        entry_times = [rng.choice(times) for _ in ids]
        fields_of = []
        for _ in ids:
            keys = rng.sample(pool, rng.randint(1, len(pool)))
            if rng.random() < 0.4:
                keys.append(keys[0])  # a key given twice: appended twice, as `apply_round` appends it
            fields_of.append([b"b" + k.to_bytes(8, "big") for k in keys])
        blobs = [rng.randbytes(rng.randint(0, 40)) for _ in ids]
        results, hwm = index._guarded_round(ids, entry_times, blobs, fields_of, [False] * count)
        assert results == list(range(start + 1, start + count + 1))
        names = list(dict.fromkeys([*(f for fields in fields_of for f in fields), *map(cc.id_field, ids)]))
        at = {name: p for p, name in enumerate(names)}
        rows = [(seq, ts, [at[f] for f in fields], at[cc.id_field(id)])
                for seq, ts, fields, id in zip(results, entry_times, fields_of, ids)]
        expected = dict(before)
        gc.apply_round(expected, names, bits, rows, cap)
        stored = client.hgetall(key)
        assert {f: v for f, v in stored.items() if f.startswith(b"g")} == expected
        assert {f: v for f, v in stored.items() if f.startswith(b"e")} == {
            cc.entry_field(seq): cc.entry_value(blob, id) for seq, blob, id in zip(results, blobs, ids)}
        assert int(stored[b"n"]) == count
        state = client.hmget(meta, "seq", "hwm", f"k:{s}")
    top = max(low, *entry_times)
    assert state == [str(start + count).encode(), hwm, str(bits).encode()]
    assert hwm == (repr(low).encode() if top == low else b"%.17g" % top)


def _bucket_tops(url: str, prefix: str, pool: Sequence[int], cap: int) -> tuple[dict[int, list[tuple[float, str]]],
                                                                                 list[str]]:
    """Per bucket key of `pool`, the `cap` newest (event time, id) of its records in the namespace's slices, and
    the ids whose records the slices hold (each once per entry)."""
    client: Any = redis.RedisCluster.from_url(url.replace("+cluster", "")) if "+cluster" in url \
        else redis.Redis.from_url(url)
    with client:
        meta = client.hgetall(f"{{{prefix}:ns}}:meta")
        slices = {int(f[2:]): int(v) for f, v in meta.items() if f.startswith(b"k:")}
        stored = {s: client.hgetall(f"{{{prefix}:ns}}:g:{s}") for s in slices}
    by_seq = {}
    for fields in stored.values():
        for f, v in fields.items():
            if f.startswith(b"e"):
                by_seq[int.from_bytes(f[1:], "big")] = cc.split_entry_value(v)[1]
    tops = {}
    for h in pool:
        records = []
        for s, bits in slices.items():
            value = gc.bucket_records(stored[s].get(gc.group_field(gc.group_of(h, bits))), gc.record_key(h)) or b""
            for r in range(0, len(value), 16):
                records.append((gc._TS.unpack_from(value, r)[0], by_seq[int.from_bytes(value[r + 8 : r + 16], "big")]))
        tops[h] = sorted(records, reverse=True)[:cap]
    owners = []
    for fields in stored.values():
        for f, v in fields.items():
            if f.startswith(b"g"):
                for r in range(0, len(v), gc.RECORD_SIZE):
                    if v[r + 12] & 0x80:
                        owners.append(by_seq[int.from_bytes(v[r + 12 : r + 20], "big") & ~gc.ID_TAG])
    return tops, sorted(owners)


@pytest.mark.parametrize(("where", "alone"), [("standalone", True), ("standalone", False), ("cluster", False)],
                         ids=["standalone-transactions-and-script", "standalone-script", "cluster-script"])
def test_two_clients_writing_the_same_buckets_at_once_store_what_one_after_the_other_stores(
        request: pytest.FixtureRequest, where: str, alone: bool) -> None:
    """Two clients insert distinct messages into the same few buckets, each step looked up by both before either
    inserts (a conflict every step: re-read, then inserted again through the checking script); against the same
    messages inserted by one client after the other: every entry once, each id's record once, and every bucket's
    newest records (what a lookup ranks) the same."""
    base = request.getfixturevalue("redis_url") if where == "standalone" else \
        cluster_url(request.getfixturevalue("redis_cluster_url"))
    rng = random.Random(7)
    pool = [rng.getrandbits(64) for _ in range(6)]
    cap, steps = 4, 30
    plan = [[(f"w{w}-{k}", 1000.0 + 2 * k + w, tuple(rng.sample(pool, 3))) for k in range(steps)] for w in range(2)]
    got = {}
    for run in ("together", "serial"):
        prefix = f"neardup-test-{uuid.uuid4().hex[:10]}"
        url = with_query(base, prefix=prefix, layout="group")
        workers = [GroupIndex(url, window=WINDOW, bucket_cap=cap, namespace="ns") for _ in range(2)]
        for w in workers:
            w.alone_inserts = alone
        step = threading.Barrier(2) if run == "together" else None
        errors: list[BaseException] = []
        conflicts = [0, 0]

        def work(w: int, step: threading.Barrier | None = step, workers: list[GroupIndex] = workers,
                 conflicts: list[int] = conflicts, errors: list[BaseException] = errors) -> None:
            try:
                for id, ts, keys in plan[w]:
                    workers[w].lookup([Query(id, ts, keys)], 8)
                    if step is not None:
                        step.wait()
                    while workers[w].insert([(entry(id, ts, seed=int(ts)), keys)]) != [None]:
                        conflicts[w] += 1  # distinct messages: verified unique, inserted again
            except BaseException as exc:
                errors.append(exc)
                if step is not None:
                    step.abort()

        try:
            if step is None:
                for w in range(2):
                    work(w)
            else:
                threads = [threading.Thread(target=work, args=(w,)) for w in range(2)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            assert errors == []
            assert workers[0].stats()["entries"] == 2 * steps
            got[run] = _bucket_tops(base, prefix, pool, cap)
            if run == "together":
                assert sum(conflicts) >= steps // 2  # they did contend
            else:
                assert conflicts == [0, 0]
        finally:
            for w in workers:
                w.close()
            (drop_namespace if where == "standalone" else drop_cluster_namespace)(base, prefix)
    assert got["together"] == got["serial"]
    assert got["serial"][1] == sorted(id for mine in plan for id, _, _ in mine)


# -- rebuilding ----------------------------------------------------------------------------------------------

def _hours(n: int = 310) -> list[tuple[Entry, tuple[int, ...]]]:
    """A changelog over three slices of an hour: 158 entries in the first (the bits of the second follow its
    count as a guarded chunk read it), 142 in the second, a few in the third (the first leaves the window);
    buckets shared by many entries (trimmed), ids made again, a key given twice."""
    times = [3000.0 + i * 3 if i < 158 else 3600.0 + (i - 158) * 25 if i < 300 else 7200.0 + (i - 300) * 20
             for i in range(n)]
    return [(Entry(f"j{i % 250}", ts, i, 30, np.arange(8, dtype=np.uint64) + i), (i % 7, 100 + i % 3, 1000 + i, i % 7))
            for i, ts in enumerate(times)]


_LATER = [Query("q", 7400.0, (3, 101)), Query("j5", 7400.0, (5,)), Query("x", 7400.0, (1290,)),
          Query("j260", 7400.0, (1, 2, 3, 4, 5, 6))]


def _restored(redis_url: str, journal: list[tuple[Entry, tuple[int, ...]]], cap: int, *, fenced: bool,
              clock: float | None = None) -> tuple[GroupIndex, str, bytearray, int]:
    """A group index of a namespace of its own that restored `journal` (`fenced`: a rebuild, no marker yet; `clock`:
    the window's clock its `expire` set first), its prefix, what it sent meanwhile (`_recording`) and the entries
    it wrote."""
    prefix = f"neardup-test-{uuid.uuid4().hex[:10]}"
    index = GroupIndex(with_query(redis_url, prefix=prefix, layout="group"), window=3600.0, bucket_cap=cap,
                       namespace="ns", fenced=fenced)
    if clock is not None:
        index.expire(clock)
    raw = _recording(index)
    if fenced:
        index._restore_watched = None  # type: ignore[assignment,method-assign] # never called
    return index, prefix, raw, index.restore([stored_of(journal)], rebuild=b"t" if fenced else b"")


def _assert_decides_alike(redis_url: str, prefix: str, rebuilt: GroupIndex, guarded: GroupIndex,
                          queries: Sequence[Query]) -> None:
    """`rebuilt` (of namespace `ns` under `prefix`), once the guard marked it, decides `queries` as `guarded`."""
    with redis.Redis.from_url(redis_url) as client:
        client.hset(f"{{{prefix}:ns}}:meta", MARKER, "e1")
    assert _view(rebuilt.lookup(queries, 8)) == _view(guarded.lookup(queries, 8))


def _dropped(redis_url: str, *made: tuple[GroupIndex, str]) -> None:
    """Closes each index and drops its namespace (its prefix)."""
    for index, prefix in made:
        index.close()
        drop_namespace(redis_url, prefix)


@pytest.mark.parametrize(("cap", "clock"), [(8, None), (2, None), (8, 8000.0)])
@pytest.mark.parametrize("held", ["all", "30 records"])
def test_a_rebuild_writes_each_group_once_and_leaves_what_the_guarded_chunks_leave(
        redis_url: str, monkeypatch: pytest.MonkeyPatch, cap: int, clock: float | None, held: str) -> None:
    """A fenced index without its marker (lost: the guard rebuilds it from the changelog) takes a restore with
    no transaction and no script: it holds the records and writes each group once, and leaves the very bytes
    that guarded chunks leave (an unfenced index's restore: records, trims, entries, counts, bits, the slices
    that left the window unlinked as they unlink them), every key with a TTL; it decides as they do. Past
    `HOLD_RECORDS` (30 here, for 2^24) it writes what it holds and goes on: a group written is read back and
    goes on from what Redis holds, and the bytes are the same. With the window's clock set (`expire`: aligned
    workers), each round unlinks the slice before the clock's window, as the entries come."""
    import filters.index.redis as slot
    import filters.index.redis_compact as compact

    monkeypatch.setattr(slot, "RESTORE_CHUNK", 11)  # the guarded chunks' boundaries, which the rebuild follows
    monkeypatch.setattr(slot, "REBUILD_CHUNK", 7)
    monkeypatch.setattr(gc, "K_MIN", 1)  # few groups: each slice's bits follow the counts the guarded chunks read
    monkeypatch.setattr(gc, "K_FIRST", 2)
    journal = _hours()
    guarded, guarded_prefix, _, written = _restored(redis_url, journal, cap, fenced=False, clock=clock)
    if held != "all":
        monkeypatch.setattr(compact, "HOLD_RECORDS", 30)
    rebuilt, prefix, raw, rewritten = _restored(redis_url, journal, cap, fenced=True, clock=clock)
    try:
        assert rewritten == written == (250 if clock is None else 310)  # (ids again: live, unless their slice went)
        sent = _unpacked(bytes(raw))
        names = [c[0] for c in sent]
        assert "MULTI" not in names and "WATCH" not in names and "EVALSHA" not in names
        fields = [(c[1], f) for c in sent if c[0] == "HSET" and ":g:" in c[1] for f in c[2::2] if f[:1] == b"g"]
        assert fields
        if held == "all":
            assert len(fields) == len(set(fields))
        else:
            assert len(fields) > len(set(fields))  # groups written more than once ...
            assert [c for c in sent if c[0] == "HMGET" and ":g:" in c[1]]  # ... and read back
        assert any(c[0] == "UNLINK" and ":g:" in c[1] for c in sent)  # a slice left the window
        dumps = [_namespace_dump(redis_url, p, "ns") for p in (guarded_prefix, prefix)]
        assert dumps[1] == dumps[0]
        assert len([k for k in dumps[0] if b":g:" in k]) > 1
        assert len({v for f, v in dumps[0][b":meta"].items() if f[:2] == b"k:"}) > 1
        with redis.Redis.from_url(redis_url) as client:
            keys = list(client.scan_iter(match=f"{{{prefix}:*"))
            assert keys and all(client.pttl(k) > 0 for k in keys)
        _assert_decides_alike(redis_url, prefix, rebuilt, guarded, _LATER)
    finally:
        _dropped(redis_url, (rebuilt, prefix), (guarded, guarded_prefix))


def test_a_rebuild_after_one_that_died_drops_what_it_left(redis_url: str) -> None:
    """A rebuild that died left entries whose records it still held (its `rebuilding` field says so): the next
    rebuild unlinks what the namespace holds first, and leaves what a rebuild of an empty namespace leaves."""
    journal = _hours(60)
    clean, clean_prefix, _, _ = _restored(redis_url, journal, 8, fenced=True)
    prefix = f"neardup-test-{uuid.uuid4().hex[:10]}"
    with redis.Redis.from_url(redis_url) as client:
        client.hset(f"{{{prefix}:ns}}:meta", mapping={"rebuilding": "1", "seq": "7", "hwm": "9000", "layout": "group"})
        client.hset(f"{{{prefix}:ns}}:g:99", "n", "3")
    rebuilt = GroupIndex(with_query(redis_url, prefix=prefix, layout="group"), window=3600.0, bucket_cap=8,
                         namespace="ns", fenced=True)
    try:
        assert rebuilt.restore([stored_of(journal)], rebuild=b"t") == 60
        dumps = [_namespace_dump(redis_url, p, "ns") for p in (clean_prefix, prefix)]
        # The meta hash went with what the rebuild that died left: the rebuild's stamp is written again (the
        # guard, which wrote it before the rebuild began, requires it where it sets the marker, and removes it).
        assert dumps[1][b":meta"].pop(STAMP.encode()) == b"t"
        assert dumps[1] == dumps[0] and b":g:99" not in dumps[1]
    finally:
        _dropped(redis_url, (rebuilt, prefix), (clean, clean_prefix))


def test_a_rebuild_that_finds_another_writer_hands_the_rest_to_guarded_chunks(redis_url: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Somebody else writes during a rebuild (an unfenced client): the rebuild sees the seq move, writes what it
    holds merged with what Redis holds, and restores the rest in guarded transactions. Both are kept, and the
    rebuilt index decides on the journal as the one that restored it in guarded chunks."""
    import filters.index.redis as slot

    monkeypatch.setattr(slot, "REBUILD_CHUNK", 10)
    journal = _hours(40)
    guarded, guarded_prefix, _, _ = _restored(redis_url, journal, 8, fenced=False)
    prefix = f"neardup-test-{uuid.uuid4().hex[:10]}"
    url = with_query(redis_url, prefix=prefix, layout="group")
    rebuilt = GroupIndex(url, window=3600.0, bucket_cap=8, namespace="ns", fenced=True)
    other = GroupIndex(url, window=3600.0, bucket_cap=8, namespace="ns")
    try:
        _assert_rebuilt_beside_an_intruder(rebuilt, other, journal)
        _assert_decides_alike(redis_url, prefix, rebuilt, guarded,
                              [Query("q", 1100.0, (5, 101)), Query("j5", 1100.0, (5,))])
        _assert_the_intruder_kept(rebuilt)
    finally:
        other.close()
        _dropped(redis_url, (rebuilt, prefix), (guarded, guarded_prefix))


def test_a_rebuild_past_its_ids_hands_the_rest_to_guarded_chunks(redis_url: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Past `HOLD_IDS` ids inside the window (20 here, for 2^22), a rebuild writes what it holds and restores the
    rest in guarded chunks: the namespace holds what guarded chunks alone leave, and decides as it."""
    import filters.index.redis as slot
    import filters.index.redis_compact as compact

    monkeypatch.setattr(slot, "REBUILD_CHUNK", 12)
    monkeypatch.setattr(slot, "RESTORE_CHUNK", 12)  # (the chunks after the hand-off begin where the guarded ones do)
    journal = _hours()
    guarded, guarded_prefix, _, written = _restored(redis_url, journal, 8, fenced=False)
    monkeypatch.setattr(compact, "HOLD_IDS", 20)
    prefix = f"neardup-test-{uuid.uuid4().hex[:10]}"
    rebuilt = GroupIndex(with_query(redis_url, prefix=prefix, layout="group"), window=3600.0, bucket_cap=8,
                         namespace="ns", fenced=True)
    watched = _watched_rounds(rebuilt)
    try:
        assert rebuilt.restore([stored_of(journal)], rebuild=b"t") == written
        assert watched and all(watched) and len(watched) < -(-len(journal) // 12)  # (not every chunk guarded)
        dumps = [_namespace_dump(redis_url, p, "ns") for p in (guarded_prefix, prefix)]
        assert dumps[1] == dumps[0]
        _assert_decides_alike(redis_url, prefix, rebuilt, guarded, _LATER)
    finally:
        _dropped(redis_url, (rebuilt, prefix), (guarded, guarded_prefix))


def test_a_rebuild_without_the_compiled_core_leaves_the_same_bytes(redis_url: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The rebuild's Python references (`held_groups`, `mixed_ids`, and the compact layout's) leave what the
    compiled core leaves."""
    import filters.index.redis as slot
    import filters.index.redis_compact as redis_compact
    import filters.index.redis_group as redis_group

    monkeypatch.setattr(slot, "REBUILD_CHUNK", 7)
    journal = _hours()
    compiled, compiled_prefix, _, written = _restored(redis_url, journal, 2, fenced=True)
    for module in (slot, redis_compact, redis_group):
        monkeypatch.setattr(module, "_native", None)
    reference, prefix, _, rewritten = _restored(redis_url, journal, 2, fenced=True)
    try:
        assert rewritten == written
        assert _namespace_dump(redis_url, prefix, "ns") == _namespace_dump(redis_url, compiled_prefix, "ns")
    finally:
        _dropped(redis_url, (reference, prefix), (compiled, compiled_prefix))


def test_a_read_sent_ahead_takes_the_batchs_writes_by_place(make: Callable[..., GroupIndex]) -> None:
    """The next batch's read goes out before this batch's insert; its lookup puts the groups and memos that insert
    wrote in their place among the values read (`_taken`): its columns and the groups it keeps are those of a read
    made after the insert, nothing is kept beside the read, and the columns are not overlaid again (only after the
    batch that made a slice, whose groups the read could not read)."""
    from tests.test_redis_index import _decide_reading_ahead

    index, other = make(), make()
    overlays: list[object] = []
    overlay = index._overlay

    def counted(*args: Any) -> None:
        overlays.append(args)
        overlay(*args)

    index._overlay = counted
    checked: list[bool] = []
    lookup = index.lookup

    def compared(queries: Sequence[Query], limit: int) -> Any:
        ahead = index._ahead is not None and index._ahead.queries is queries
        got = lookup(queries, limit)
        view = index._view
        if ahead and view.slices:
            _, _, columns = other._read(view.names, list(view.slices))
            assert [view.columns[s] for s in view.slices] == columns
            for s in view.slices:
                if s in index._last_read:
                    assert index._last_read[s][2] == other._last_read[s][2]
            checked.append(not index._last_raw)
        return got

    index.lookup = compared  # type: ignore[method-assign]
    messages = generated_messages(500, seed=11)
    verdicts = _decide_reading_ahead(NearDupFilter(FilterConfig(window=WINDOW), index=index), messages, 50)
    assert sum(v.duplicate for v in verdicts) >= 20  # memos written, and read back by the reads sent ahead
    # (The batches' event times span a few slices: a lookup after the batch that made one overlays its columns.)
    assert checked.count(True) >= 6 and len(overlays) == checked.count(False) <= 3


def test_the_tails_a_checked_round_expects_after_uncontended_rounds_are_those_redis_holds(
        make: Callable[..., GroupIndex]) -> None:
    """The uncontended rounds keep no bucket values in the view (`alone_groups`): the tails a checking round then
    expects of each id the lookup covered (`_View.settle_tails`, `expected`: the seq of the last entry those rounds
    wrote in a bucket, else what the lookup read) are the newest seqs Redis holds in its buckets, as a read made
    now finds them (in the slices Redis still holds: a round unlinks the slice that left the window)."""
    index, other = make(), make()
    engine = NearDupFilter(FilterConfig(window=WINDOW), index=index)
    messages = generated_messages(400, seed=7)
    compared = rounds = 0
    for at in range(0, len(messages), 50):
        batch = messages[at : at + 50]
        engine.decide(batch, engine.prepare([m.text for m in batch]))
        view = index._view
        assert view.exact
        rounds += len(view._unsettled)
        view.settle_tails()
        _, _, columns = other._read(view.names, list(view.slices))
        held = [k for k, column in enumerate(columns) if any(v is not None for v in column)]
        for id, q in view.looked.items():
            places = view.places_of[q]
            expected, size = view.expected(id, places), 8 * len(places)
            assert [expected[k * size : (k + 1) * size] for k in held] == [
                b"".join((columns[k][p] or b"")[-8:] or slot.ABSENT for p in places) for k in held]
            compared += 1
    assert rounds >= 8 and compared >= 350  # (a message a batch decides on its own is not looked up)
