"""The `CandidateIndex` contract, run against every backend: `MemoryIndex` and `RedisIndex` must behave alike."""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable, Iterator, Sequence
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from filters.config import FilterConfig
from filters.engine import Message, NearDupFilter, Verdict
from filters.index import Candidate, CandidateIndex, Entry, Query, Stored
from filters.index.memory import MemoryIndex
from filters.index.redis_codec import stored_of

MakeIndex = Callable[..., CandidateIndex]
U64 = (1 << 64) - 1


def with_query(url: str, **params: str) -> str:
    parts = urlsplit(url)
    query = [*parse_qsl(parts.query), *params.items()]
    return urlunsplit(parts._replace(query=urlencode(query)))


def drop_namespace(url: str, prefix: str) -> None:
    """Deletes every key written under `prefix` (tests use a fresh prefix each)."""
    with redis.Redis.from_url(url) as client:
        keys = list(client.scan_iter(match=f"{{{prefix}:*", count=1000))
        for at in range(0, len(keys), 500):
            client.delete(*keys[at : at + 500])


def cluster_url(url: str) -> str:
    """The fixture's `redis://host:port/0` of a cluster node as this index spells a cluster."""
    parts = urlsplit(url)
    return f"{parts.scheme}+cluster://{parts.netloc}"


def drop_cluster_namespace(url: str, prefix: str) -> None:
    with redis.RedisCluster.from_url(url.replace("+cluster", "")) as cluster:
        for node in cluster.get_primaries():
            keys = list(cluster.scan_iter(match=f"{{{prefix}:*", target_nodes=node))
            for at in range(0, len(keys), 500):
                cluster.delete(*keys[at : at + 500])  # one namespace: one slot


def _base_url(request: pytest.FixtureRequest) -> str:
    """The Redis a backend of the fixtures below runs on: a `...-cluster` one on the 3-master Redis Cluster."""
    if request.param.endswith("-cluster") or "-cluster-" in request.param:
        return cluster_url(request.getfixturevalue("redis_cluster_url"))
    return request.getfixturevalue("redis_url") if request.param.startswith("redis") else ""


def _drop(url: str, prefix: str) -> None:
    (drop_cluster_namespace if "+cluster" in url else drop_namespace)(url, prefix)


@pytest.fixture(params=["memory", "memory-python", "redis", "redis-spread", "redis-compact", "redis-group",
                        "redis-cluster", "redis-compact-cluster", "redis-group-cluster"])
def make_index(request: pytest.FixtureRequest) -> Iterator[MakeIndex]:
    """A factory of fresh, empty indexes of one backend (Redis: a fresh prefix, cleaned up after).
    `memory` is the embedded index on its compiled table, `memory-python` on the reference `PyTable`;
    `redis-spread` the spread layout (filters/index/redis_spread.py) on one Redis, over 4 shards;
    `redis-compact` the compact layout (filters/index/redis_compact.py), `redis-group` the group layout
    (filters/index/redis_group.py); `redis-cluster`, `redis-compact-cluster`, `redis-group-cluster` the slot,
    compact and group layouts on a Redis Cluster (every round of the compact layout the checking script)."""
    made: list[CandidateIndex] = []
    prefix = f"neardup-test-{uuid.uuid4().hex[:10]}"
    url = _base_url(request)

    def make(window: float = 100.0, bucket_cap: int = 4) -> CandidateIndex:
        if request.param.startswith("memory"):
            return MemoryIndex(window, bucket_cap, native=request.param == "memory")
        from filters.index.backends import open_index

        query = {"prefix": prefix, **({"layout": "spread", "shards": "4"} if request.param == "redis-spread" else
                                      {"layout": "compact"} if request.param.startswith("redis-compact") else
                                      {"layout": "group"} if request.param.startswith("redis-group") else {})}
        index = open_index(with_query(url, **query), window=window, bucket_cap=bucket_cap,
                           namespace=uuid.uuid4().hex[:12])
        made.append(index)
        return index

    yield make
    for index in made:
        index.close()
    if url:
        _drop(url, prefix)


def entry(id: str, ts: float, seed: int = 0, **fields: object) -> Entry:
    rng = np.random.default_rng(seed)
    values: dict[str, object] = {
        "exact": int(rng.integers(0, 2**62)),
        "size": 40,
        "sketch": np.sort(rng.integers(0, 2**63, size=8, dtype=np.uint64)),
    }
    values.update(fields)
    return Entry(id, ts, **values)  # type: ignore[arg-type]


def add(index: CandidateIndex, e: Entry, keys: Sequence[int]) -> None:
    """What the engine does for a unique message: look it up, then insert it."""
    index.lookup([Query(e.id, e.ts, tuple(keys))], 8)
    assert index.insert([(e, tuple(keys))]) == [None]


def found(index: CandidateIndex, id: str, ts: float, keys: Sequence[int], limit: int = 16,
          min_shared: int = 1) -> tuple[str | None, list[tuple[str, int, int]]]:
    """One lookup, as (own id, [(candidate id, shared, first key)])."""
    [(own, cands)] = index.lookup([Query(id, ts, tuple(keys), min_shared)], limit)
    return (None if own is None else own.id), [(c.entry.id, c.shared, c.first_key) for c in cands]


def assert_same_entry(a: Entry, b: Entry) -> None:
    assert (a.id, a.ts, a.exact, a.size, a.simhash, a.sentences, a.chars) == (b.id, b.ts, b.exact, b.size, b.simhash,
                                                                                b.sentences, b.chars)
    assert a.sketch.dtype == b.sketch.dtype and a.sketch.dtype in (np.uint32, np.uint64)  # stored as given
    assert np.array_equal(a.sketch, b.sketch)
    if a.minhash is None or b.minhash is None:
        assert a.minhash is None and b.minhash is None
    else:
        assert a.minhash.dtype == b.minhash.dtype == np.uint32
        assert np.array_equal(a.minhash, b.minhash)


# --- lookup ------------------------------------------------------------------------------------------


def test_ranking_most_shared_then_newest(make_index: MakeIndex) -> None:
    index = make_index(bucket_cap=8)
    add(index, entry("a", 1), [1, 2, 3])
    add(index, entry("b", 2), [1, 2])
    add(index, entry("c", 3), [2])
    add(index, entry("d", 3), [2])
    add(index, entry("e", 0.5), [2])  # the oldest event time, but inserted last: the newest
    _, cands = found(index, "q", 5, [3, 2, 1])
    assert cands == [("a", 3, 3), ("b", 2, 2), ("e", 1, 2), ("d", 1, 2), ("c", 1, 2)]
    assert found(index, "q", 5, [3, 2, 1], limit=2)[1] == cands[:2]
    assert found(index, "q", 5, [3, 2, 1], min_shared=2)[1] == cands[:2]
    assert found(index, "q", 5, [9, 8])[1] == []


def test_first_key_is_the_first_query_key_whose_bucket_holds_it(make_index: MakeIndex) -> None:
    index = make_index(bucket_cap=1)
    add(index, entry("a", 1), [1, 2])
    add(index, entry("b", 2), [1])  # evicts a from bucket 1 (cap 1): a is found through 2 only
    assert found(index, "q", 3, [1, 2]) == (None, [("b", 1, 1), ("a", 1, 2)])


def test_window_on_event_time(make_index: MakeIndex) -> None:
    index = make_index(window=100)
    add(index, entry("a", 10), [1])
    assert found(index, "q1", 60, [1])[1] == [("a", 1, 1)]
    assert found(index, "q2", 110, [1])[1] == [("a", 1, 1)]  # entry.ts >= ts - window: still in
    assert found(index, "q3", 110.5, [1])[1] == []  # window seconds after its ts it stops matching
    # The stream has moved on: a late message no longer sees what the window let go.
    assert found(index, "q4", 50, [1])[1] == []


def test_inserting_outside_the_window_is_a_no_op(make_index: MakeIndex) -> None:
    index = make_index(window=100)
    add(index, entry("a", 1000), [1])
    add(index, entry("old", 10), [1])
    assert found(index, "q", 1000, [1])[1] == [("a", 1, 1)]


def test_expire_forgets_what_left_the_window(make_index: MakeIndex) -> None:
    index = make_index(window=100)
    add(index, entry("a", 10), [1])
    add(index, entry("b", 150), [1])
    assert isinstance(index.expire(200), int)
    assert found(index, "q", 120, [1])[1] == [("b", 1, 1)]


def test_an_entry_is_never_its_own_candidate(make_index: MakeIndex) -> None:
    index = make_index()
    add(index, entry("a", 1), [1, 2])
    add(index, entry("b", 1), [2])
    assert found(index, "a", 2, [1, 2]) == ("a", [("b", 1, 2)])


def test_replay_returns_the_stored_entry_and_the_first_insert_wins(make_index: MakeIndex) -> None:
    index = make_index()
    first = entry("a", 1, seed=1)
    add(index, first, [1])
    [(own, cands)] = index.lookup([Query("a", 2, (1,))], 8)
    assert own is not None and cands == []
    assert_same_entry(own, first)
    second = entry("a", 2, seed=2)
    assert index.insert([(second, (1, 5))]) == [None]
    [(own, _)] = index.lookup([Query("a", 3, (5,))], 8)
    assert own is not None
    assert_same_entry(own, first)
    assert found(index, "q", 3, [5])[1] == []  # the second insert did not index anything


def test_a_duplicates_verdict_is_remembered_for_the_window(make_index: MakeIndex) -> None:
    """A duplicate is not indexed: its verdict is remembered by id (a memo, written in the insert round)
    and is what a later lookup of that id finds, though the cap evicted its original from every bucket,
    for as long as its own event time is inside the window."""
    index = make_index(window=100, bucket_cap=1)
    add(index, entry("a", 10), [1, 2])
    memo = Verdict("b", True, "a", 0.8125, "mgram")
    assert found(index, "b", 20, [1, 2]) == (None, [("a", 2, 1)])
    assert index.insert([], [(memo, 20.0)]) == []
    add(index, entry("c", 30), [1, 2])  # the cap keeps c: a is in no bucket now
    [(own, cands)] = index.lookup([Query("b", 20, (1, 2))], 8)
    assert own == memo and [c.entry.id for c in cands] == ["c"]
    add(index, entry("d", 120), [9])
    assert index.lookup([Query("b", 20, (1, 2))], 8)[0][0] == memo  # a (10) left the window, b (20) did not
    add(index, entry("e", 121), [9])
    assert index.lookup([Query("b", 20, (1, 2))], 8)[0][0] is None  # b's own event time left it


def test_only_inserted_entries_are_candidates(make_index: MakeIndex) -> None:
    index = make_index()
    assert found(index, "x", 1, [1, 2]) == (None, [])  # looked up (a duplicate, say), never inserted
    assert found(index, "y", 2, [1, 2]) == (None, [])
    add(index, entry("y", 2), [1, 2])
    assert found(index, "z", 3, [1, 2]) == (None, [("y", 2, 1)])


def test_bucket_cap_keeps_the_newest(make_index: MakeIndex) -> None:
    index = make_index(bucket_cap=4)
    for i, ts in enumerate([5, 1, 6, 2, 4, 3]):  # out of event-time order: the cap goes by event time
        add(index, entry(f"e{ts}", ts, seed=i), [7, 100 + i])
    kept = [c[0] for c in found(index, "q", 10, [7])[1]]
    assert kept == ["e3", "e4", "e6", "e5"]  # the newest four by event time, ranked most recent insert first


def test_entry_round_trips_every_field(make_index: MakeIndex) -> None:
    index = make_index()
    full = Entry(
        id="ünïcode id:with{braces}",
        ts=1_700_000_000.123456,
        exact=(1 << 128) - 1,
        size=123_456,
        sketch=np.array([0, 1, 2**53 + 1, U64 - 1, U64], dtype=np.uint64),
        simhash=U64,
        minhash=np.array([0, 7, 0xFFFFFFFF], dtype=np.uint32),
        sentences=frozenset({0, 1, 2**63, U64}),
    )
    bare = Entry("bare", 1_700_000_001.0, 0, 0, np.array([], dtype=np.uint64))
    add(index, full, [U64, 1])
    add(index, bare, [U64])
    [(own, cands)] = index.lookup([Query(full.id, full.ts, (U64,))], 8)
    assert own is not None and [c.entry.id for c in cands] == ["bare"]
    assert_same_entry(own, full)
    assert_same_entry(cands[0].entry, bare)
    [(_, cands)] = index.lookup([Query("q", full.ts, (1, U64))], 8)
    assert [c.entry.id for c in cands] == [full.id, "bare"] and cands[0].first_key == 1
    assert_same_entry(cands[0].entry, full)


def test_stats_count_entries_and_buckets(make_index: MakeIndex) -> None:
    index = make_index()
    for i in range(5):
        add(index, entry(f"e{i}", i), [i, 100])
    stats = index.stats()
    assert (stats["entries"], stats["buckets"]) == (5, 6)


def test_a_batch_is_answered_in_order(make_index: MakeIndex) -> None:
    index = make_index()
    add(index, entry("a", 1), [1])
    add(index, entry("b", 1), [2])
    queries = [Query("q1", 2, (2,)), Query("a", 2, (1,)), Query("q3", 2, (3,)), Query("q4", 2, (1, 2))]
    looked = index.lookup(queries, 8)
    assert [(o and o.id, [c.entry.id for c in cs]) for o, cs in looked] == [
        (None, ["b"]), ("a", []), (None, []), (None, ["b", "a"]),  # b was inserted later
    ]
    assert index.lookup([], 8) == [] and index.insert([]) == []


# --- the same answers as the reference, for any sequence of batches -----------------------------------

_ids = st.sampled_from([f"m{i}" for i in range(12)])
_query = st.tuples(_ids, st.integers(0, 40).map(float), st.sets(st.integers(1, 6), min_size=1, max_size=4),
                   st.integers(1, 2))
_batch = st.tuples(st.lists(_query, min_size=1, max_size=6), st.lists(st.booleans(), min_size=6, max_size=6))


def _view(looked: list[tuple[Entry | Verdict | None, list[Candidate]]]) -> list[tuple[object, ...]]:
    return [((own.id, own.ts) if isinstance(own, Entry) else own, [(c.entry.id, c.entry.ts, c.shared, c.first_key)
                                                                   for c in cs])
            for own, cs in looked]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=st.lists(_batch, min_size=1, max_size=8), limit=st.integers(1, 4))
def test_matches_the_reference_for_any_batches(
    make_index: MakeIndex, batches: list[tuple[list[tuple[str, float, set[int], int]], list[bool]]], limit: int
) -> None:
    index, reference = make_index(window=10, bucket_cap=2), MemoryIndex(10, 2)
    for n, (batch, keep) in enumerate(batches):
        queries = [Query(id, ts, tuple(sorted(keys)), floor) for id, ts, keys, floor in batch]
        looked = index.lookup(queries, limit)
        assert _view(looked) == _view(reference.lookup(queries, limit))
        pending = [(Entry(q.id, q.ts, n, 1, np.zeros(1, np.uint64)), q.keys)
                   for q, (own, _), k in zip(queries, looked, keep, strict=False) if own is None and k]
        # The others are duplicates: each id's first one in the batch is remembered (as the engine does).
        memos = {q.id: (Verdict(q.id, True, f"x{n}", n / 8, "mgram"), q.ts)
                 for q, (own, _), k in reversed(list(zip(queries, looked, keep, strict=False))) if own is None and not k}
        assert index.insert(pending, list(memos.values())) == reference.insert(pending, list(memos.values()))


# --- restore ---------------------------------------------------------------------------------------------

RestoreInto = Callable[[float, int, Stored], tuple[CandidateIndex, int]]


@pytest.fixture(params=["memory", "memory-python", "redis", "redis-rebuild", "redis-compact",
                        "redis-compact-rebuild", "redis-group", "redis-group-rebuild", "redis-cluster",
                        "redis-compact-cluster", "redis-group-cluster", "redis-group-cluster-rebuild"])
def restore_into(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[RestoreInto]:
    """Restores entries into a fresh index of one backend: (the index, what `restore` returned). `redis`
    restores as beside other writers (a guarded transaction a chunk); `redis-rebuild` into a fenced index
    without its marker, as after a loss (streamed: nobody else writes), its marker set after. Redis chunks
    of 3 and 5 entries, and a rebuild holding 6 bucket records at most, written 2 fields at a time, so that
    every boundary is crossed. `redis-compact`: the compact layout (filters/index/redis_compact.py);
    `redis-compact-rebuild` its rebuild (held fields, each small hash written once), holding 6 bucket records at
    most (written and read back when named again), then handing on to guarded chunks past 8 ids inside the
    window. `redis-group`, `redis-group-rebuild`: the group layout (filters/index/redis_group.py) and its rebuild
    (held records, each group written once), with the compact rebuild's limits lowered alike; `redis-cluster`,
    `redis-compact-cluster`, `redis-group-cluster`, `redis-group-cluster-rebuild`: those on a Redis Cluster (the
    insert script a chunk, but for the rebuild)."""
    made: list[CandidateIndex] = []
    prefix = f"neardup-test-{uuid.uuid4().hex[:10]}"
    url = _base_url(request)
    if url:
        import filters.index.redis as redis_index

        monkeypatch.setattr(redis_index, "RESTORE_CHUNK", 3)
        monkeypatch.setattr(redis_index, "REBUILD_CHUNK", 5)
        monkeypatch.setattr(redis_index, "HOLD_RECORDS", 6)  # a rebuild's held records dropped and written early
        monkeypatch.setattr(redis_index, "FLUSH_FIELDS", 2)  # ... in pieces of 2 fields
        import filters.index.redis_compact as compact_index

        monkeypatch.setattr(compact_index, "HOLD_RECORDS", 6)  # a compact rebuild's held fields written, then on
        monkeypatch.setattr(compact_index, "HOLD_IDS", 8)  # ... until more ids are inside the window: guarded

    def restore(window: float, bucket_cap: int, stored: Stored) -> tuple[CandidateIndex, int]:
        if request.param.startswith("memory"):
            index: CandidateIndex = MemoryIndex(window, bucket_cap, native=request.param == "memory")
            return index, index.restore([stored])
        from filters.index.redis import MARKER, RedisIndex, meta_key

        namespace = uuid.uuid4().hex[:12]
        if request.param.startswith("redis-compact"):
            from filters.index.redis_compact import CompactIndex

            index = CompactIndex(with_query(url, prefix=prefix, layout="compact"), window=window,
                                 bucket_cap=bucket_cap, namespace=namespace,
                                 fenced=request.param == "redis-compact-rebuild")
        elif request.param.startswith("redis-group"):
            from filters.index.redis_group import GroupIndex

            index = GroupIndex(with_query(url, prefix=prefix, layout="group"), window=window, bucket_cap=bucket_cap,
                               namespace=namespace, fenced=request.param.endswith("-rebuild"))
        else:
            index = RedisIndex(with_query(url, prefix=prefix), window=window, bucket_cap=bucket_cap,
                               namespace=namespace, fenced=request.param == "redis-rebuild")
        made.append(index)
        written = index.restore([stored], rebuild=b"t" if request.param.endswith("-rebuild") else b"")
        if request.param.endswith("-rebuild"):
            client: redis.Redis | redis.RedisCluster = redis.RedisCluster.from_url(url.replace("+cluster", "")) \
                if "+cluster" in url else redis.Redis.from_url(url)
            with client:
                client.hset(meta_key(prefix, namespace), MARKER, "1")
        return index, written

    yield restore
    for index in made:
        index.close()
    if url:
        _drop(url, prefix)


_restored = st.lists(st.tuples(st.sampled_from("abcdefgh"), st.integers(0, 60).map(lambda t: t / 2),
                               st.lists(st.integers(1, 6), max_size=4)), max_size=24)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(entries=_restored)
# An id again after the window, first of a Redis chunk (3, 5): the old one is live as the insert saw it.
@example(entries=[("a", 0.0, [])] * 10 + [("a", 20.0, []), ("b", 20.0, []), ("a", 20.5, [])])
def test_a_restore_is_as_inserting_one_after_another(restore_into: RestoreInto,
                                                     entries: list[tuple[str, float, list[int]]]) -> None:
    """Entries restored (as a changelog holds them, in the order they were made) are found as if inserted one
    after another: the same own entries and candidates, ranked alike, the cap's newest kept; a live id is
    kept as it is, an entry outside the window skipped, a key given twice counts once; a second restore
    of distinct ids writes nothing."""
    made = [(entry(id, ts, seed=n), tuple(keys)) for n, (id, ts, keys) in enumerate(entries)]
    reference = MemoryIndex(10, 2, native=False)
    inserted = sum(reference.table.insert(e, keys) for e, keys in made)
    index, written = restore_into(10, 2, stored_of(made))
    assert written == inserted
    top = max((ts for _, ts, _ in entries), default=0.0)
    for id, ts in [("q", top), ("q", top - 4), *((id, top) for id in "aceg")]:
        for keys in [(1,), (2, 3), (1, 2, 3, 4, 5, 6)]:
            query = [Query(id, ts, keys)]
            assert _view(index.lookup(query, 8)) == _view(reference.lookup(query, 8))
    if len({id for id, _, _ in entries}) == len(entries):  # (an id made again after it left the window may be new)
        assert index.restore([stored_of(made)]) == 0


@pytest.mark.parametrize("layout", ["slot", "compact", "group", "spread"])
def test_a_write_back_beside_a_rebuild_drops_nothing(redis_url: str, layout: str) -> None:
    """A worker writing back what it delivered (`restore`) into a fenced index without its marker (lost again
    just after a rebuild) while the guard's lock holder rebuilds it (`restore(..., rebuild=b"t")`): only the
    rebuild may write unguarded or drop what a loss left; the write-back adds, guarded, and drops nothing of
    what the rebuild wrote before it. Every entry of both is found once the marker is set."""
    from filters.index.backends import marker_keys, open_index
    from filters.index.redis import MARKER

    prefix = f"neardup-test-{uuid.uuid4().hex[:10]}"
    url = with_query(redis_url, prefix=prefix, **({} if layout == "slot" else {"layout": layout}))
    made = [(entry(f"r{n}", 100.0 + n, seed=n), (1 + n % 5, 100 + n)) for n in range(40)]
    back = [(entry(f"w{n}", 110.0 + n, seed=100 + n), (1 + n % 5, 200 + n)) for n in range(10)]
    rebuilder, writer = (open_index(url, window=3600.0, bucket_cap=64, namespace="ns", fenced=True) for _ in "ab")

    def changelog() -> Iterator[Stored]:
        yield stored_of(made[:20])
        assert writer.restore([stored_of(back)]) == len(back)  # meanwhile, beside the rebuild
        yield stored_of(made[20:])

    try:
        assert rebuilder.restore(changelog(), rebuild=b"t") == len(made)
        with redis.Redis.from_url(redis_url) as client:
            for meta in marker_keys(url, "ns"):
                client.hset(meta, MARKER, "1")
        for key in range(1, 6):
            [(_, found)] = rebuilder.lookup([Query("q", 200.0, (key,))], 64)
            assert sorted(c.entry.id for c in found) == sorted(e.id for e, keys in made + back if key in keys)
    finally:
        rebuilder.close()
        writer.close()
        drop_namespace(redis_url, prefix)


# --- the engine on top ---------------------------------------------------------------------------------

_WORDS = ("free prize winner claim now call text stop reply urgent account bank verify offer limited "
          "meeting tomorrow lunch project report update deadline review thanks please today office "
          "weather train ticket holiday family dinner music game score team season").split()


def generated_messages(n: int, seed: int = 7) -> list[Message]:
    """Spam waves (near-duplicates with other numbers and small edits), unique chatter, replays of an
    id, event time mostly increasing with some disorder and a jump past the window."""
    rng = random.Random(seed)
    templates = [" ".join(rng.choices(_WORDS, k=rng.randint(8, 30))) for _ in range(12)]
    out: list[Message] = []
    ts = 1_700_000_000.0
    for i in range(n):
        ts += rng.uniform(0, 20)
        if i == n // 2:
            ts += 4000  # beyond the window: the first half's waves are forgotten
        roll = rng.random()
        if roll < 0.5:
            words = rng.choice(templates).split()
            if rng.random() < 0.5:
                words[rng.randrange(len(words))] = rng.choice(_WORDS)
            text = f"{' '.join(words)} call 555-{rng.randint(0, 9999):04d}"
            if rng.random() < 0.3:
                text = text.upper()
        elif roll < 0.9:
            text = " ".join(rng.choices(_WORDS, k=rng.randint(3, 25))) + f" #{i}"
        else:
            text = rng.choice(templates)
        if out and rng.random() < 0.05:
            prev = rng.choice(out)
            out.append(Message(prev.id, prev.text, ts))  # a replay (redelivery) of an earlier message
            continue
        out.append(Message(f"m{i}", text, ts + rng.uniform(-60, 0)))
    return out


def test_engine_gives_the_same_verdicts(make_index: MakeIndex) -> None:
    config = FilterConfig(window=3600.0, bucket_cap=8)
    messages = generated_messages(400)
    verdicts: list[list[Verdict]] = []
    for index in (MemoryIndex(config.window, config.bucket_cap), make_index(config.window, config.bucket_cap)):
        engine = NearDupFilter(config, index=index)
        rng = random.Random(3)
        got: list[Verdict] = []
        at = 0
        while at < len(messages):
            size = rng.choice([1, 2, 7, 32, 64])
            got += engine.check_batch(messages[at : at + size])
            at += size
        verdicts.append(got)
    assert verdicts[0] == verdicts[1]
    labels = [v.label for v in verdicts[0]]
    assert labels.count("duplicate") > 50 and labels.count("unique") > 50  # the stream tests something
    assert any(v.method == "replay" for v in verdicts[0])


# --- a replayed duplicate ------------------------------------------------------------------------------

ORIGINAL = "Congratulations! You have won a 1000 dollar gift card, call 555-0100 now to claim your prize today"
COPY = "Congratulations!! You have won a 1000 dollar gift voucher, call 555-0177 now to claim your prize"


def test_a_replayed_duplicate_keeps_its_verdict_though_the_cap_evicted_its_original(make_index: MakeIndex) -> None:
    """b is a copy of a. Then a unique message that shares every bucket of a, and is newer, pushes a out of
    all of them (bucket cap 1). b decided again (a redelivery: same id, text and event time) still names a,
    with the same similarity and method: its first verdict."""
    config = FilterConfig(window=3600.0, bucket_cap=1)
    index = make_index(config.window, config.bucket_cap)
    engine = NearDupFilter(config, index=index)
    a, b = Message("a", ORIGINAL, 100.0), Message("b", COPY, 101.0)
    assert not engine.check_batch([a])[0].duplicate
    [first] = engine.check_batch([b])
    assert (first.duplicate, first.duplicate_of, first.method) == (True, "a", "mgram") and first.similarity < 1
    keys = tuple(dict.fromkeys(engine.fingerprinter.fingerprint(ORIGINAL).keys
                               + engine.fingerprinter.fingerprint(COPY).keys))
    add(index, entry("filler", 102.0, sketch=np.arange(1, 129, dtype=np.uint32), size=500), keys)
    assert found(index, "q", 103.0, keys)[1][0][0] == "filler" and all(c[0] != "a" for c in found(index, "q", 103.0, keys)[1])
    assert engine.check_batch([b]) == [first]
    assert engine.check_batch([Message("z", "an unrelated note about lunch", 103.0), b]) == [Verdict("z", False), first]


def test_a_replayed_duplicate_keeps_its_verdict_after_its_original_left_the_window(make_index: MakeIndex) -> None:
    """a at 0, its copy b at 50, then the stream reaches 120 (window 100): a left the window, b did not. b
    decided again gets its first verdict; a copy under a new id is unique (a is gone)."""
    config = FilterConfig(window=100.0)
    engine = NearDupFilter(config, index=make_index(config.window, config.bucket_cap))
    first = engine.check_batch([Message("a", ORIGINAL, 0.0), Message("b", COPY, 50.0)])[1]
    assert (first.duplicate, first.duplicate_of) == (True, "a")
    assert not engine.check_batch([Message("z", "an unrelated note about lunch", 120.0)])[0].duplicate
    again, other = engine.check_batch([Message("b", COPY, 50.0), Message("c", COPY, 60.0)])
    assert again == first and not other.duplicate
