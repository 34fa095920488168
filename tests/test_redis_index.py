"""What only the Redis index has: its encoding, keys, URLs, errors, and atomic inserts under real races."""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import numpy as np
import orjson
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from filters.config import FilterConfig
from filters.engine import Message, NearDupFilter, Verdict
from filters.errors import ConfigError, IndexCorrupt, IndexUnavailable, NeardupError
from filters.index import Candidate, Entry, Memo, Query, redis_codec
from filters.index.backends import open_index
from filters.index.memory import MemoryIndex
from filters.index.redis import INSERT_CHUNK, LOOKUP_CHUNK, RedisIndex
from filters.index.redis_codec import (
    ENCODING_VERSION,
    decode_entry,
    decode_memo,
    encode_entry,
    encode_entry_v2,
    encode_memo,
    entry_time,
    memo_time,
    parse_records,
)
from stream.align import RedisMarks
from stream.codec import RecordFormat
from stream.metrics import TimedIndex
from stream.runner import DUPLICATE, RawRecord, route_batch, route_batches
from tests.test_index_contract import (
    _view,
    assert_same_entry,
    cluster_url,
    drop_cluster_namespace,
    drop_namespace,
    generated_messages,
    with_query,
)

U64 = (1 << 64) - 1
WINDOW = 3600.0
SAMPLE = Path(__file__).parent / "data" / "sample.jsonl"


def made_indexes(cls: type[RedisIndex], redis_url: str, prefix: str,
                 **fixed: str) -> Iterator[Callable[..., RedisIndex]]:
    """A `make` fixture's body: indexes of `cls` on `redis_url` under `prefix` (and the query options
    `fixed`, unless a call names them), all closed after the test."""
    made: list[RedisIndex] = []

    def make(namespace: str = "ns", window: float = WINDOW, bucket_cap: int = 8, **query: str) -> RedisIndex:
        query = {"prefix": prefix, **fixed, **query}
        index = cls(with_query(redis_url, **query), window=window, bucket_cap=bucket_cap, namespace=namespace)
        made.append(index)
        return index

    yield make
    for index in made:
        index.close()


@pytest.fixture
def make(redis_url: str, prefix: str) -> Iterator[Callable[..., RedisIndex]]:
    yield from made_indexes(RedisIndex, redis_url, prefix)


@pytest.fixture
def layout() -> type[RedisIndex]:
    """The class of the index the tests that make their own run on (tests/test_redis_compact.py gives its own)."""
    return RedisIndex


@pytest.fixture
def watched() -> str:
    """The index's method that sends the WATCH-guarded transaction (`_counting_watched` counts its calls)."""
    return "_write_watched"


def entry(id: str, ts: float = 1000.0, seed: int = 0) -> Entry:
    rng = np.random.default_rng(seed)
    return Entry(id, ts, int(rng.integers(0, 2**62)), 30, np.sort(rng.integers(0, 2**63, 16, dtype=np.uint64)))


def ids(cands: Sequence[Candidate] | None) -> list[str]:
    assert cands is not None
    return [c.entry.id for c in cands]


# --- encoding ------------------------------------------------------------------------------------------

_u64 = st.integers(0, U64)
_entries = st.builds(
    Entry,
    id=st.just("x"),
    ts=st.floats(allow_nan=False, allow_infinity=False),
    exact=st.integers(0, (1 << 128) - 1),
    size=st.integers(0, 2**32 - 1),
    sketch=arrays(np.uint64, st.integers(0, 200)) | arrays(np.uint32, st.integers(0, 200)),
    simhash=st.none() | _u64,
    minhash=st.none() | arrays(np.uint32, st.integers(0, 256)),
    sentences=st.frozensets(_u64, max_size=5),
)


@given(_entries)
def test_encoding_round_trips(e: Entry) -> None:
    data = encode_entry(e)
    assert data[0] == ENCODING_VERSION == 3
    assert_same_entry(decode_entry(data, "x"), e)
    old = encode_entry_v2(e)  # what neardup wrote before: a namespace or changelog of it is read on
    assert old[0] == 2
    assert_same_entry(decode_entry(old, "x"), e)
    assert entry_time(data, "x") == entry_time(old, "x") == e.ts


@settings(max_examples=300)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=200, unique=True), st.text(max_size=70))
def test_a_fingerprints_sketch_is_stored_packed_and_smaller(values: list[int], chars: str) -> None:
    """A sketch as fingerprints make it (sorted bottom-k uint32 hashes) is stored as its gaps at one width:
    never more bytes than 4 a value, and read back exactly."""
    sketch = np.array(sorted(values), dtype=np.uint32)
    e = Entry("x", 1.0, 5, 7, sketch, chars=chars)
    data = encode_entry(e)
    assert len(data) <= len(encode_entry_v2(e)) - 14
    assert_same_entry(decode_entry(data, "x"), e)


def test_a_real_sketch_takes_about_three_quarters_of_its_bytes() -> None:
    """128 bottom-k hashes of a long text (gaps of about 2^32 / its shingles) pack in ~25 bits a value."""
    rng = np.random.default_rng(7)
    sketch = np.sort(rng.choice(2**32, 5000, replace=False))[:128].astype(np.uint32)
    data = encode_entry(Entry("x", 1.0, 5, 5000, sketch))
    assert len(data) < 28 + 128 * 26 // 8 + 2


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_garbage_never_decodes_silently(data: bytes) -> None:
    try:
        e = decode_entry(data, "x")
    except IndexCorrupt:
        return
    # only a valid encoding (of this version or the one before) decodes, and then exactly
    assert (encode_entry_v2 if data[0] == 2 else encode_entry)(e) == data


def test_damaged_encodings_are_corrupt() -> None:
    narrow = Entry("x", 1000.0, 12345, 30, np.arange(1, 2**31, 2**27, dtype=np.uint32))  # 16 values, gaps of 2^27
    data = encode_entry(narrow)
    assert data[25] & 16 and data[28] == 28  # packed at 28 bits
    old = encode_entry_v2(entry("x"))
    raw = data[:25] + bytes([data[25] & ~16]) + data[26:28] + narrow.sketch.astype("<u4").tobytes()
    for bad in (b"", data[:5], data[:-1], data + b"\0", b"\x01" + data[1:], b"\x04" + data[1:],
                data[:25] + b"\x80" + data[26:], data[:25] + b"\x10" + data[26:],  # unknown flag; packed, not narrow
                data[:26] + b"\x80\x00" + data[27:],  # a length not minimal
                data[:28] + b"\x00" + data[29:], data[:28] + b"\x21" + data[29:],  # widths 0 and 33
                data[:28] + bytes([data[28] + 1]) + data[29:],  # wider than needed
                raw,  # a sketch this neardup packs, not packed
                old[:-1], old + b"\0", old[:29] + b"\x80" + old[30:]):
        with pytest.raises(IndexCorrupt):
            decode_entry(bad, "x")
    with pytest.raises(ValueError):
        encode_entry(Entry("x", 0, -1, 0, np.zeros(0, np.uint64)))


_ids = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30) | st.sampled_from(["x\udc80", "ünï"])


@given(id=_ids, of=_ids, ts=st.floats(-1e15, 1e15), similarity=st.floats(0, 1),
       method=st.sampled_from(["exact", "mgram", "simhash", "minhash", "sentences", "?"]))
def test_memos_round_trip(id: str, of: str, ts: float, similarity: float, method: str) -> None:
    verdict = Verdict(id, True, of, similarity, method)
    data = encode_memo(verdict, ts)
    assert decode_memo(data, id) == verdict and memo_time(data, id) == ts
    assert len(data) == 17 + len(method) + len(of.encode("utf-8", "surrogatepass"))  # compact: 17 bytes and the id


def test_damaged_memos_are_corrupt() -> None:
    data = encode_memo(Verdict("b", True, "a", 0.5, "mgram"), 1000.0)
    for bad in (b"", data[:16], data[:17] + b"mgr", data[:16] + b"\x09" + data[17:], data[:17] + b"\xff" + data[18:]):
        with pytest.raises(IndexCorrupt):
            decode_memo(bad, "b")


def test_a_namespace_written_with_entries_of_version_2_is_read_on(make: Callable[..., RedisIndex], redis_url: str,
                                                                  prefix: str) -> None:
    """An upgrade keeps the window: entries the release before wrote (version 2) are found under their ids
    (replays), verified as candidates with the same contents, and sit beside the entries of version 3 that
    the new release inserts."""
    index = make()
    made = [Entry(f"old{i}", 1000.0 + i, 7 + i, 40, np.sort(np.random.default_rng(i).choice(2**32, 30, replace=False))
                  .astype(np.uint32), chars="short text" if i % 2 else "") for i in range(4)]
    index.lookup([Query(e.id, e.ts, (1, 2, 3)) for e in made], 8)
    assert index.insert([(e, (1, 2, 3)) for e in made]) == [None] * 4
    with redis.Redis.from_url(redis_url) as client:
        key = f"{{{prefix}:ns}}:s:0"
        assert all(client.hget(key, f"e{e.id}")[0] == 3 for e in made)  # type: ignore[index]
        client.hset(key, mapping={f"e{e.id}": encode_entry_v2(e) for e in made})  # as the release before wrote them
    reader = make()
    looked = reader.lookup([Query("old0", 1000.0, (1, 2, 3)), Query("new", 1001.0, (1, 2, 3))], 8)
    assert looked[0][0] is not None  # its own entry: a replay
    cands = looked[1][1]
    assert cands is not None and sorted(ids(cands)) == [e.id for e in made]
    for c in cands:
        assert_same_entry(c.entry, made[int(c.entry.id[3:])])
    assert reader.insert([(entry("new", 1001.0), (1, 2, 3))]) == [None]
    assert ids(make().lookup([Query("q", 1002.0, (1, 2, 3))], 8)[0][1])[0] == "new"


def test_stored_garbage_is_index_corrupt(make: Callable[..., RedisIndex], redis_url: str, prefix: str) -> None:
    index = make()
    index.lookup([Query("a", 1000, (1,))], 8)
    index.insert([(entry("a"), (1,))])
    key = f"{{{prefix}:ns}}:s:0"
    with redis.Redis.from_url(redis_url) as client:
        client.hset(key, "ea", b"\x09garbage-of-another-version-and-long-enough-for-a-header-....")
        client.hset(key, b"b" + (2).to_bytes(8, "big"), b"not records")
        with pytest.raises(IndexCorrupt) as caught:  # its own entry does not decode
            index.lookup([Query("a", 1000, (1,))], 8)
        assert not caught.value.retriable
        with pytest.raises(IndexCorrupt):  # a bucket that holds no records
            index.lookup([Query("q", 1000, (2,))], 8)
        client.delete(key)
        client.set(key, b"not a hash")
        with pytest.raises(IndexCorrupt) as caught:  # the server refuses: WRONGTYPE
            index.lookup([Query("q", 1000, (1,))], 8)
        assert isinstance(caught.value.__cause__, redis.ResponseError)


# --- keys -----------------------------------------------------------------------------------------------


def test_keys_carry_prefix_and_namespace_and_all_have_ttls(
    make: Callable[..., RedisIndex], redis_url: str, prefix: str
) -> None:
    index = make(grace="60")
    queries = [Query(f"m{i}", 1000 + i, (U64, 2**53 + 1, i)) for i in range(5)]
    index.lookup(queries, 8)
    assert index.insert([(entry(q.id, q.ts, i), q.keys) for i, q in enumerate(queries)]) == [None] * 5
    with redis.Redis.from_url(redis_url) as client:
        keys = sorted({k.decode() for k in client.scan_iter(match=f"{{{prefix}:*")})  # SCAN may name a key twice
        assert keys == [f"{{{prefix}:ns}}:meta", f"{{{prefix}:ns}}:s:0"]  # event time 1000, window 3600: slice 0
        fields = set(client.hkeys(f"{{{prefix}:ns}}:s:0"))
        assert fields == {b"n", b"em0", b"em1", b"em2", b"em3", b"em4"} | {
            b"b" + key.to_bytes(8, "big") for key in (U64, 2**53 + 1, 0, 1, 2, 3, 4)}
        for key in keys:
            assert 0 < client.pttl(key) <= (WINDOW + 60) * 1000, key


def test_after_a_stream_every_key_has_a_ttl(make: Callable[..., RedisIndex], redis_url: str, prefix: str) -> None:
    """The invariant that bounds Redis memory: after a stream, not one key that neardup wrote lives without
    a TTL of at most window + grace. The stream goes through every writer: a file routed with its reads sent
    ahead (uncontended transactions), two workers taking turns on one namespace (the checking script), memos
    of duplicates (replays included), event times over many slices of a window of 120 s (slices unlinked), a
    clock set by `expire`, and a restore into another namespace."""
    window, grace = 120.0, 60.0
    messages = generated_messages(900, seed=11)
    lines = [orjson.dumps({"id": m.id, "text": m.text, "ts": m.ts}) for m in messages[:300]]
    chunks = [[RawRecord(line, str(i), 0.0) for i, line in enumerate(lines)][at : at + 60] for at in range(0, 300, 60)]
    config = FilterConfig(window=window, bucket_cap=4)
    first = make("ttl", window=window, bucket_cap=4, grace=str(grace))
    verdicts = [r.verdict for rows in route_batches(NearDupFilter(config, index=first), chunks, RecordFormat())
                for r in rows]
    second = make("ttl", window=window, bucket_cap=4, grace=str(grace))
    engines = [NearDupFilter(config, index=first), NearDupFilter(config, index=second)]
    for turn, at in enumerate(range(300, 900, 40)):
        verdicts += engines[turn % 3 == 0].check_batch(messages[at : at + 40])
        if turn == 7:
            first.expire(messages[at].ts)
    assert sum(v.duplicate for v in verdicts) >= 50 and sum(not v.duplicate for v in verdicts) >= 100
    stored = redis_codec.stored_of([(entry(f"r{i}", 1_700_000_000.0 + 3 * i, i), (i, i + 1)) for i in range(50)])
    assert make("restored", window=window, bucket_cap=4, grace=str(grace)).restore([stored]) == 50
    with redis.Redis.from_url(redis_url) as client:
        keys = list(client.scan_iter(match=f"{{{prefix}:*", count=1000))
        assert len(keys) >= 4
        ttls = {key: client.pttl(key) for key in keys}
    assert all(0 < ttl <= (window + grace) * 1000 for ttl in ttls.values()), ttls


def test_fingerprints_and_seqs_never_pass_through_a_double(make: Callable[..., RedisIndex], redis_url: str,
                                                           prefix: str) -> None:
    """Bucket keys above 2^53 are field names, bit for bit; records carry their seq as 8 bytes."""
    index = make()
    rng = random.Random(1)
    wanted = set()
    for round in range(4):
        queries = [Query(f"r{round}m{i}", 1000 + round, tuple(rng.randrange(2**60, U64) for _ in range(8)))
                   for i in range(50)]
        wanted.update(key for q in queries for key in q.keys)
        index.lookup(queries, 8)
        index.insert([(entry(q.id, q.ts), q.keys) for q in queries])
    with redis.Redis.from_url(redis_url) as client:
        stored = client.hgetall(f"{{{prefix}:ns}}:s:0")
    assert stored.pop(b"n") == b"200"  # the slice's count of entries
    buckets = {name: value for name, value in stored.items() if name.startswith(b"b")}
    assert {int.from_bytes(name[1:], "big") for name in buckets} == wanted
    records = [r for value in buckets.values() for r in parse_records(value)]
    assert {seq for _, seq, _ in records} == set(range(1, 201)) and {ts for ts, _, _ in records} == {1000, 1001, 1002, 1003}


def test_namespaces_and_prefixes_are_isolated(make: Callable[..., RedisIndex]) -> None:
    a, b, c = make("digest-a"), make("digest-b"), make("digest-a", prefix="other-prefix")
    a.lookup([Query("x", 1000, (1, 2))], 8)
    assert a.insert([(entry("x"), (1, 2))]) == [None]
    for other in (b, c):
        assert other.lookup([Query("x", 1000, (1, 2))], 8) == [(None, [])]
        assert other.stats()["entries"] == 0
    assert ids(a.lookup([Query("y", 1000, (1,))], 8)[0][1]) == ["x"]


def test_stats(make: Callable[..., RedisIndex]) -> None:
    index = make()
    queries = [Query(f"m{i}", 1000, (i, 100)) for i in range(7)]
    index.lookup(queries, 8)
    index.insert([(entry(q.id), q.keys) for q in queries[:6]], [(Verdict("m6", True, "m0", 0.75, "mgram"), 1000.0)])
    assert index.stats() == {"entries": 6, "buckets": 7, "memos": 1, "inserted": 6}  # a memo is no bucket


# --- URLs and errors -----------------------------------------------------------------------------------


def test_open_index_by_url(redis_url: str, prefix: str) -> None:
    index = open_index(with_query(redis_url, prefix=prefix), window=60, bucket_cap=4, namespace="n")
    try:
        assert isinstance(index, RedisIndex) and index.prefix == prefix
    finally:
        index.close()


@pytest.mark.parametrize("url", [
    "redis://localhost:6379/0?no_such_option=1",
    "redis://localhost:6379/0?prefix=bad*prefix",
    "redis://localhost:6379/0?grace=soon",
    "redis://localhost:6379/0?grace=-1",
    "redis://localhost:6379/0?entry_cache=-1",
    "redis://localhost:6379/0?entry_cache=many",
    "redis://localhost:6379/0?round=0",
    "redis://localhost:6379/0?round=some",
    "redis://localhost:6379/0?layout=spread&round=64",
    "redis+cluster://localhost:7001/3",
    "http://localhost:6379",
])
def test_bad_urls_are_config_errors(url: str) -> None:
    with pytest.raises(ConfigError):
        RedisIndex(url, window=60, bucket_cap=4, namespace="n")


def test_bad_namespace_is_a_config_error(redis_url: str) -> None:
    with pytest.raises(ConfigError):
        RedisIndex(redis_url, window=60, bucket_cap=4, namespace="{x}")


def _roundtrip(index: RedisIndex) -> None:
    assert index.lookup([Query("a", 1000, (1, 2))], 8) == [(None, [])]
    assert index.insert([(entry("a"), (1, 2))]) == [None]
    assert ids(index.lookup([Query("b", 1000, (2,))], 8)[0][1]) == ["a"]


def test_auth_url(redis_auth_url: str) -> None:
    prefix = f"neardup-test-{uuid.uuid4().hex[:10]}"
    index = RedisIndex(with_query(redis_auth_url, prefix=prefix), window=60, bucket_cap=4, namespace="n")
    try:
        _roundtrip(index)
    finally:
        index.close()
        drop_namespace(redis_auth_url, prefix)


@pytest.mark.parametrize("password", ["wrong-password", None])
def test_refused_credentials_are_a_config_error_not_retriable(redis_auth_url: str, password: str | None) -> None:
    """Retrying cannot fix a wrong password: it is a configuration error, and says where."""
    parts = urlsplit(redis_auth_url)
    netloc = f":{password}@{parts.hostname}:{parts.port}" if password else f"{parts.hostname}:{parts.port}"
    index = RedisIndex(parts._replace(netloc=netloc).geturl(), window=60, bucket_cap=4, namespace="n")
    with pytest.raises(ConfigError) as caught:
        index.lookup([Query("a", 1000, (1,))], 8)
    assert not caught.value.retriable
    assert isinstance(caught.value.__cause__, redis.AuthenticationError)
    assert "wrong-password" not in str(caught.value)  # the URL in the message is redacted
    index.close()


def test_tls_url(redis_tls_url: str) -> None:
    prefix = f"neardup-test-{uuid.uuid4().hex[:10]}"
    index = RedisIndex(with_query(redis_tls_url, prefix=prefix), window=60, bucket_cap=4, namespace="n")
    try:
        _roundtrip(index)
    finally:
        index.close()
        drop_namespace(redis_tls_url, prefix)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_redis_down_is_retriable() -> None:
    index = RedisIndex(f"redis://127.0.0.1:{_closed_port()}/0", window=60, bucket_cap=4, namespace="n")
    for call in (lambda: index.lookup([Query("a", 1, (1,))], 8), lambda: index.insert([(entry("a"), (1,))]),
                 index.stats):
        with pytest.raises(IndexUnavailable) as caught:
            call()
        assert caught.value.retriable
        assert isinstance(caught.value, NeardupError)
        assert isinstance(caught.value.__cause__, redis.ConnectionError)


def test_cluster_down_is_retriable() -> None:
    with pytest.raises(IndexUnavailable) as caught:
        RedisIndex(f"redis+cluster://127.0.0.1:{_closed_port()}", window=60, bucket_cap=4, namespace="n")
    assert caught.value.retriable


def test_scripts_are_reloaded_after_a_script_flush(make: Callable[..., RedisIndex], redis_url: str) -> None:
    index = make()
    _roundtrip(index)
    with redis.Redis.from_url(redis_url) as client:
        client.script_flush()
    assert ids(index.lookup([Query("c", 1000, (1,))], 8)[0][1]) == ["a"]
    with redis.Redis.from_url(redis_url) as client:
        client.script_flush()
    assert index.insert([(entry("c"), (1,))]) == [None]


def test_a_batch_of_several_lookup_scripts_is_answered_like_the_reference(make: Callable[..., RedisIndex]) -> None:
    """Lookups go to the server a chunk of queries per script: a batch across chunks, with event time
    jumping past the window in the middle of a chunk (each query's horizon counts the queries before
    it), replays of an id inside the batch and ids looked up twice, answers as `MemoryIndex` does."""
    index, reference = make(window=100.0, bucket_cap=3), MemoryIndex(100.0, 3)
    rng = random.Random(5)
    for round in range(3):
        size = 2 * LOOKUP_CHUNK + 7
        jump = rng.randrange(LOOKUP_CHUNK // 2, size)  # where event time jumps past the window
        # Rounds 70 s apart in a window of 100 s: a round sees the previous one until its jump of 60 s.
        queries = [Query(f"m{rng.randrange(3 * size)}", 70.0 * round + rng.uniform(0, 60) + 60 * (i >= jump),
                         tuple(rng.sample(range(1, 40), rng.randint(1, 5))), rng.randint(1, 2))
                   for i in range(size)]
        looked = index.lookup(queries, 4)
        assert _view(looked) == _view(reference.lookup(queries, 4))
        assert round == 0 or sum(bool(cands) for _, cands in looked) > size // 4  # it tests something
        pending, seen = [], set()
        for q, (own, _) in zip(queries, looked):
            if own is None and q.id not in seen and rng.random() < 0.7:
                seen.add(q.id)
                pending.append((entry(q.id, q.ts, rng.randrange(10**6)), q.keys))
        assert index.insert(pending) == reference.insert(pending) == [None] * len(pending)


# --- insert conflicts ----------------------------------------------------------------------------------


def test_insert_returns_what_entered_the_buckets_since_the_lookup(make: Callable[..., RedisIndex]) -> None:
    one, two, reader = make(), make(), make()
    one.lookup([Query("a", 1000, (1, 2, 3))], 8)
    two.lookup([Query("b", 1000, (2, 3, 4))], 8)
    assert two.insert([(entry("b"), (2, 3, 4))]) == [None]
    [conflicts] = one.insert([(entry("a"), (1, 2, 3))])
    assert conflicts is not None
    assert [(c.entry.id, c.shared, c.first_key) for c in conflicts] == [("b", 2, 2)]
    assert ids(reader.lookup([Query("q", 1000, (1, 2, 3))], 8)[0][1]) == ["b"]  # a was not inserted
    # The engine verified b and found a unique after all: the retry conflicts only with newer inserts.
    assert one.insert([(entry("a"), (1, 2, 3))]) == [None]
    assert ids(reader.lookup([Query("q", 1000, (1, 2, 3))], 8)[0][1]) == ["a", "b"]


def _forget_entries_in_redis(redis_url: str, prefix: str, *ids: str) -> None:
    """Deletes the stored entries of `ids` (not their bucket records): what reads them finds them gone."""
    with redis.Redis.from_url(redis_url) as client:
        for key in client.scan_iter(match=f"{{{prefix}:ns}}:s:*"):
            client.hdel(key, *[f"e{id}" for id in ids])


def test_entries_written_or_read_lately_are_not_read_again(make: Callable[..., RedisIndex], redis_url: str,
                                                           prefix: str) -> None:
    """A candidate's entry that this instance wrote or read lately is kept (`entry_cache`, the newest
    that many): the lookup does not read it again. Shown by deleting the stored entries: what was
    kept is still a candidate, what was not is gone (a lookup leaves out entries it cannot read)."""
    writer, reader, forgetful, small = make(), make(), make(entry_cache="0"), make(entry_cache="2")
    batch = [(entry(f"m{i}", seed=i), (7, 100 + i)) for i in range(4)]
    writer.lookup([Query(e.id, e.ts, keys) for e, keys in batch], 8)
    assert writer.insert(batch) == [None] * 4
    assert ids(reader.lookup([Query("q", 1000, (7,))], 8)[0][1]) == ["m3", "m2", "m1", "m0"]  # read: kept
    assert ids(small.lookup([Query("q", 1000, (7,))], 8)[0][1]) == ["m3", "m2", "m1", "m0"]  # the last two kept
    _forget_entries_in_redis(redis_url, prefix, "m0", "m1", "m2", "m3")
    [(_, found)] = writer.lookup([Query("q", 1000, (7,))], 8)
    assert [(c.entry.id, c.entry.exact) for c in found] == [(e.id, e.exact) for e, _ in reversed(batch)]
    assert ids(reader.lookup([Query("q", 1000, (7,))], 8)[0][1]) == ["m3", "m2", "m1", "m0"]
    assert ids(small.lookup([Query("q", 1000, (7,))], 8)[0][1]) == ["m3", "m2"]  # read last (in id order)
    assert ids(forgetful.lookup([Query("q", 1000, (7,))], 8)[0][1]) == []


def test_an_id_written_again_at_a_later_event_time_is_read_not_taken_from_what_was_kept(
        make: Callable[..., RedisIndex]) -> None:
    """An id's entry is kept by (id, event time): once the id left the window and another worker wrote
    it again, at a later event time and with other content, a lookup returns the new entry."""
    one, other = make(window=100), make(window=100)
    one.lookup([Query("a", 1000, (1,))], 8)
    assert one.insert([(entry("a", 1000, seed=1), (1,))]) == [None]
    assert ids(one.lookup([Query("q", 1050, (1,))], 8)[0][1]) == ["a"]
    later = entry("a", 1200, seed=2)
    other.lookup([Query("a", 1200, (1,))], 8)
    assert other.insert([(later, (1,))]) == [None]  # the first a left the window: a is written again
    [(_, found)] = one.lookup([Query("q", 1250, (1,))], 8)
    assert [(c.entry.id, c.entry.ts, c.entry.exact) for c in found] == [("a", 1200, later.exact)]


def test_own_inserts_never_conflict(make: Callable[..., RedisIndex]) -> None:
    """One caller's batch, larger than a chunk, all under one key: its own inserts never conflict,
    neither across chunks nor in a retry round after another worker's insert."""
    index, other = make(bucket_cap=1000), make(bucket_cap=1000)
    size = 3 * INSERT_CHUNK + 5
    batch = [(entry(f"m{i}", 1000), (7, 1000 + i)) for i in range(size)]
    index.lookup([Query(e.id, e.ts, keys) for e, keys in batch], 8)
    assert index.insert(batch) == [None] * size

    batch = [(entry(f"n{i}", 1000), (7, 2000 + i)) for i in range(size)]
    index.lookup([Query(e.id, e.ts, keys) for e, keys in batch], 8)
    other.lookup([Query("x", 1000, (7,))], 8)
    assert other.insert([(entry("x"), (7,))]) == [None]
    assert [ids(c) for c in index.insert(batch)] == [["x"]] * size  # another worker's insert conflicts
    assert index.insert(batch) == [None] * size  # the retry: x is known now, and own inserts never count


def test_replay_of_an_id_never_conflicts_with_itself(make: Callable[..., RedisIndex]) -> None:
    one, two = make(), make()
    one.lookup([Query("a", 1000, (1,))], 8)
    two.lookup([Query("a", 1000, (1,))], 8)
    assert two.insert([(entry("a", seed=2), (1,))]) == [None]
    assert one.insert([(entry("a", seed=1), (1,))]) == [None]  # the first insert of an id wins
    [(own, _)] = one.lookup([Query("a", 1000, (1,))], 8)
    assert own is not None and own.exact == entry("a", seed=2).exact


def test_a_reread_excuses_only_the_entry_it_was_for(make: Callable[..., RedisIndex]) -> None:
    """a and b were looked up together and share bucket 2; another worker inserts x into it. a's insert
    conflicts and a is verified against x; b, inserted later in the same batch, never saw x: it must
    conflict too, not pass on what a's re-read learned."""
    one, other = make(), make()
    one.lookup([Query("a", 1000, (1, 2)), Query("b", 1000, (2, 3))], 8)
    other.lookup([Query("x", 1000, (2,))], 8)
    assert other.insert([(entry("x"), (2,))]) == [None]
    assert [ids(c) for c in one.insert([(entry("a"), (1, 2))])] == [["x"]]
    assert [ids(c) for c in one.insert([(entry("b"), (2, 3))])] == [["x"]]
    assert one.insert([(entry("a"), (1, 2)), (entry("b"), (2, 3))]) == [None, None]  # both verified x now


def _put(index: RedisIndex, id: str, ts: float, keys: tuple[int, ...]) -> None:
    index.lookup([Query(id, ts, keys)], 8)
    assert index.insert([(entry(id, ts), keys)]) == [None]


@pytest.mark.parametrize("after_read", [1, 2])
def test_a_near_duplicate_inserted_during_a_lookup_is_seen(make: Callable[..., RedisIndex], after_read: int) -> None:
    """Another worker inserts z, a near-duplicate of a, while a's lookup is reading. The stored
    high-water mark (310, slice 3) is ahead of this worker's batch (50 and 240: slices -1 to 2), so the
    lookup reads twice; z lands right after the first or the second read. z must be a candidate of a,
    or come back as a conflict at insert: never may both be unique (found by review: the second read's
    seq was taken as the mark, and the insert script then took the round for uncontended)."""
    a, b, setup = make(window=100.0), make(window=100.0), make(window=100.0)
    _put(setup, "p", 310.0, (99,))
    read, calls = a._read, []

    def racing_read(names: Sequence[bytes], slices: Sequence[int], **options: bool) -> object:
        calls.append(tuple(slices))
        result = read(names, slices, **options)
        if len(calls) == after_read:
            _put(b, "z", 300.0, (1, 2, 3))
        return result

    a._read = racing_read  # type: ignore[method-assign]
    looked = a.lookup([Query("old", 50.0, (50,)), Query("a", 240.0, (1, 2, 3))], 8)
    a._read = read  # type: ignore[method-assign]
    assert calls == [(-1, 0, 1, 2), (-1, 0, 1, 2, 3)]
    found = ids(looked[1][1])
    inserted = a.insert([(entry("a", 240.0), (1, 2, 3))])
    assert found == ["z"] or [ids(c) for c in inserted] == [["z"]], (found, inserted)


def test_a_reread_covers_the_slices_of_what_it_counts_as_seen(make: Callable[..., RedisIndex]) -> None:
    """a conflicts; between its insert script and its re-read, z lands in the next slice. The re-read
    must report z now or later, never count it as seen without reading it (found by review: a and z were
    both stored after three rounds)."""
    a, w, b = make(window=100.0), make(window=100.0), make(window=100.0)
    a.lookup([Query("a", 190.0, (1, 2, 3))], 8)
    _put(w, "w", 195.0, (1,))
    reread, rounds = a._reread, []

    def racing_reread(entries: Sequence[tuple[Entry, tuple[int, ...]]], fields_of: Sequence[list[bytes]]) -> object:
        if not rounds:
            _put(b, "z", 250.0, (1, 2, 3))
        return reread(entries, fields_of)

    a._reread = racing_reread  # type: ignore[method-assign]
    for _ in range(4):
        [result] = a.insert([(entry("a", 190.0), (1, 2, 3))])
        rounds.append(None if result is None else ids(result))
        if result is None:
            break
    assert any("z" in r for r in rounds if r is not None), rounds


def test_an_own_insert_verified_on_another_read_excuses_nobody(make: Callable[..., RedisIndex]) -> None:
    """a and b were looked up together and share bucket 2; x enters it. a is re-read (it verified x) and
    inserted; b never verified x and must not pass on a's insert (found by review)."""
    one, other = make(), make()
    one.lookup([Query("a", 1000, (1, 2)), Query("b", 1000, (2, 3))], 8)
    _put(other, "x", 1000, (2,))
    assert [ids(c) for c in one.insert([(entry("a"), (1, 2))])] == [["x"]]
    assert one.insert([(entry("a"), (1, 2))]) == [None]
    assert [ids(c) for c in one.insert([(entry("b"), (2, 3))])] == [["x"]]
    assert one.insert([(entry("b"), (2, 3))]) == [None]


def test_event_times_beyond_two_to_the_fifty_windows_are_refused(make: Callable[..., RedisIndex]) -> None:
    """Slice numbers must be exact in Lua's doubles: a nanosecond timestamp taken for seconds would have
    sent the insert script into an endless loop (found by review)."""
    index = make(window=60.0)
    for bad in (1.7e18, -1e300, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            index.lookup([Query("a", bad, (1,))], 8)
        with pytest.raises(ValueError):
            index.insert([(entry("a", bad), (1,))])


def test_an_entry_with_thousands_of_keys(make: Callable[..., RedisIndex]) -> None:
    keys = tuple(range(1, 4101))
    for name in ("alone", "checked"):
        index = make(name)
        index.alone_inserts = name == "alone"
        _put(index, "big", 1000.0, keys)
        assert ids(index.lookup([Query("q", 1000.0, keys[:10])], 8)[0][1]) == ["big"]


def _race(make: Callable[..., RedisIndex], seed: int) -> tuple[random.Random, list[RedisIndex],
                                                               list[tuple[str, float, tuple[int, ...]]]]:
    """The random interleaving tests' three workers (slices of 5 s in a 100 s window) and 40 waves of
    three messages, (id, event time, keys), the earliest last (`pop()` takes it)."""
    rng = random.Random(seed)
    workers = [make(window=100.0, bucket_cap=1000) for _ in range(3)]
    for index in workers:
        index.slice_length = 5.0
    waves = [(f"w{c}c{k}", 50.0 + 2 * c + rng.uniform(0, 1), tuple(rng.sample(range(3 * c + 1, 3 * c + 4), 2)))
             for c in range(40) for k in range(3)]
    return rng, workers, sorted(waves, key=lambda m: -m[1])


def _insert_unless_found(index: RedisIndex, id: str, ts: float, keys: tuple[int, ...],
                         unique: dict[str, tuple[int, ...]]) -> None:
    """Inserts a message its lookup found nothing for, retrying conflicts (the engine's rounds): unique
    if an insert goes through, a duplicate as soon as one finds anything."""
    for _ in range(8):
        [result] = index.insert([(entry(id, ts), keys)])
        if result is None:
            unique[id] = keys
            return
        if result:
            return


@pytest.mark.parametrize("seed", range(8))
def test_random_interleavings_never_make_two_near_duplicates_unique(make: Callable[..., RedisIndex], seed: int) -> None:
    """Three workers and 40 spam waves: each wave has fresh keys, three copies of two of its three keys
    (any two copies share one), arriving within a second of each other, waves 2 s apart, in slices of
    5 s inside a 100 s window (far shorter slices than the default, the window: many boundaries to
    race across). Before any Redis round trip of a worker, another worker may process a whole message:
    every interleaving of lookups, inserts and re-reads at round-trip granularity gets its chance. A
    message is a duplicate when its lookup or its insert finds anything (sharing a key is being a
    near-duplicate here); the invariant: no two unique messages share a key, one unique per wave."""
    rng, workers, pending = _race(make, seed)
    unique: dict[str, tuple[int, ...]] = {}
    busy = [False]

    def process(index: RedisIndex, id: str, ts: float, keys: tuple[int, ...]) -> None:
        [(own, cands)] = index.lookup([Query(id, ts, keys)], 100)
        if own is None and not cands:
            _insert_unless_found(index, id, ts, keys, unique)

    def interleaving(index: RedisIndex) -> None:
        execute = index._execute

        def hooked(commands: Sequence[Sequence[str | int | bytes]], **options: bool) -> list[object]:
            if not busy[0] and pending and rng.random() < 0.6:
                busy[0] = True
                try:
                    process(rng.choice([w for w in workers if w is not index]), *pending.pop())
                finally:
                    busy[0] = False
            return execute(commands, **options)

        index._execute = hooked  # type: ignore[method-assign]

    for index in workers:
        interleaving(index)
    while pending:
        process(rng.choice(workers), *pending.pop())
    assert sorted(int(id[1:].split("c")[0]) for id in unique) == list(range(40))  # one unique per wave


@pytest.mark.parametrize("seed", range(8))
def test_random_interleavings_of_workers_reading_ahead_never_make_two_near_duplicates_unique(
        make: Callable[..., RedisIndex], seed: int) -> None:
    """The waves of the test above, each worker sending the read of its next message ahead (`prefetch`)
    before it inserts the one in hand. Another worker may process a whole message before any of a
    worker's round trips, before it sends a read ahead, and before a lookup takes one."""
    rng, workers, pending = _race(make, seed)
    unique: dict[str, tuple[int, ...]] = {}
    busy = [False]
    sent: dict[int, tuple[tuple[str, float, tuple[int, ...]], list[Query]]] = {}  # worker -> its next, read ahead
    taken: list[bool] = []

    def process(index: RedisIndex) -> None:
        message, queries = sent.pop(id(index), None) or (pending.pop(), None)
        queries = queries or [Query(*message)]
        [(own, cands)] = index.lookup(queries, 100)
        if pending:
            following = pending.pop()
            sent[id(index)] = (following, [Query(*following)])
            index.prefetch(sent[id(index)][1])
        if own is None and not cands:
            _insert_unless_found(index, *message, unique)

    def maybe_another(index: RedisIndex) -> None:
        if not busy[0] and (pending or sent) and rng.random() < 0.6:
            busy[0] = True
            try:
                others = [w for w in workers if w is not index and (pending or id(w) in sent)]
                if others:
                    process(rng.choice(others))
            finally:
                busy[0] = False

    def interleaving(index: RedisIndex) -> None:
        execute, prefetch, lookup, took = index._execute, index.prefetch, index.lookup, index._taken

        def hooked(commands: Sequence[Sequence[str | int | bytes]], **options: bool) -> list[object]:
            maybe_another(index)
            return execute(commands, **options)

        def hooked_prefetch(queries: Sequence[Query]) -> None:
            maybe_another(index)
            prefetch(queries)

        def hooked_lookup(queries: Sequence[Query], limit: int) -> list[tuple[Entry | None, list[Candidate]]]:
            maybe_another(index)
            return lookup(queries, limit)

        def counted(*args: object) -> object:
            result = took(*args)  # type: ignore[arg-type]
            taken.append(result is not None)
            return result

        index._execute, index.prefetch, index.lookup = hooked, hooked_prefetch, hooked_lookup  # type: ignore[method-assign]
        index._taken = counted  # type: ignore[method-assign]

    for index in workers:
        interleaving(index)
    while pending or sent:
        process(rng.choice([w for w in workers if pending or id(w) in sent]))
    assert sorted(int(id[1:].split("c")[0]) for id in unique) == list(range(40))  # one unique per wave
    assert True in taken and False in taken  # reads ahead were taken, and some had to be read afresh


def _counting_watched(index: RedisIndex, watched: str) -> list[bool | None]:
    """Records what each WATCH-guarded transaction of `index` (its method `watched`) gave (None: Redis
    refused it)."""
    results: list[bool | None] = []
    write = getattr(index, watched)

    def counted(*args: object, **kwargs: object) -> bool | None:
        result: bool | None = write(*args, **kwargs)
        results.append(result)
        return result

    setattr(index, watched, counted)
    return results


def test_an_uncontended_insert_is_a_watched_transaction_that_a_foreign_write_refuses(
        make: Callable[..., RedisIndex], watched: str) -> None:
    """Alone, the round goes as MULTI/EXEC under the lookup's WATCH, and the next round of the same lookup
    too (re-armed); a foreign insert after the lookup makes Redis refuse the transaction: nothing of it is
    written and the script path reports the conflict."""
    a, b = make(), make()
    results = _counting_watched(a, watched)
    a.lookup([Query("a", 1000.0, (1, 2)), Query("c", 1000.0, (5, 6))], 8)
    assert a.insert([(entry("a"), (1, 2))]) == [None]
    assert a.insert([(entry("c"), (5, 6))]) == [None]
    assert results == [True, True]
    a.lookup([Query("d", 1000.0, (1, 3))], 8)
    _put(b, "x", 1000.0, (3,))
    assert [ids(c) for c in a.insert([(entry("d"), (1, 3))])] == [["x"]]
    assert results == [True, True, None]
    assert sorted(ids(b.lookup([Query("q", 1000.0, (1, 3, 5))], 8)[0][1])) == ["a", "c", "x"]


def test_a_reconnect_between_lookup_and_insert_never_sends_the_transaction_unguarded(
        make: Callable[..., RedisIndex], watched: str) -> None:
    """A new connection watches nothing: were the transaction sent on it, it would pass whatever arrived
    since the lookup. redis-py reconnects when it sends, so the reconnect itself must stop it."""
    a, b = make(), make()
    results = _counting_watched(a, watched)
    a.lookup([Query("a", 1000.0, (1, 2))], 8)
    _put(b, "x", 1000.0, (2,))
    a._conn.disconnect()  # as after an error of another command: the next send reconnects
    assert [ids(c) for c in a.insert([(entry("a"), (1, 2))])] == [["x"]]
    assert results == [None]


def test_an_insert_after_close_is_checked_by_the_script(make: Callable[..., RedisIndex], watched: str) -> None:
    """`close` drops the connection and its WATCH; an insert of the lookup's view after it (a routing
    thread still finishing at shutdown) opens a new one, which must not count as watched (found by
    review: the new connection was made without moving the epoch)."""
    a, b = make(), make()
    results = _counting_watched(a, watched)
    a.lookup([Query("a", 1000.0, (1, 2))], 8)
    _put(b, "x", 1000.0, (2,))
    a.close()
    assert [ids(c) for c in a.insert([(entry("a"), (1, 2))])] == [["x"]]
    assert results == []


def test_stats_from_another_thread_while_batches_are_routed(make: Callable[..., RedisIndex]) -> None:
    """The worker's metrics read `stats` on the event loop while a batch is routed in a thread: it must
    not share the connection whose replies the lookups and inserts are reading (found when it did)."""
    index = make()
    engine = NearDupFilter(FilterConfig(), index=index)
    messages = generated_messages(400, seed=5)
    stop, errors, polls = threading.Event(), [], [0]

    def poll() -> None:
        while not stop.is_set():
            try:
                index.stats()
                polls[0] += 1
            except Exception as exc:
                errors.append(exc)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        while polls[0] == 0 and not errors and poller.is_alive():  # the batches start once the polls have
            time.sleep(0.001)
        verdicts = [v for at in range(0, len(messages), 20) for v in engine.check_batch(messages[at : at + 20])]
        seen = polls[0]
    finally:
        stop.set()
        poller.join()
    # (how many polls fit in the routing depends on the layout's stats and the machine: at least one more did)
    assert errors == [] and seen > 1
    quiet = NearDupFilter(FilterConfig(), index=make("quiet"))
    assert verdicts == [v for at in range(0, len(messages), 20) for v in quiet.check_batch(messages[at : at + 20])]


@pytest.mark.parametrize(("seed", "batch", "cap", "limit"), [(11, 50, 8, 16), (12, 200, 2, 3), (13, 7, 8, 1)])
def test_the_compiled_shared_loop_decides_as_the_python_one(make: Callable[..., RedisIndex], seed: int, batch: int,
                                                             cap: int, limit: int) -> None:
    """`Table.decide_shared` (replays, the batch's own messages merged with the shared candidates,
    verification, the unique inserted) against `filters.shared.against`'s Python loop: the same
    verdicts, message for message, with tiny caps and candidate limits (ties and truncation matter)."""
    config = FilterConfig(window=WINDOW, bucket_cap=cap, max_candidates=limit)
    messages = generated_messages(900, seed=seed)
    verdicts = []
    for name in ("compiled", "python"):
        engine = NearDupFilter(config, index=make(name, bucket_cap=cap))
        assert engine.compiled
        engine.compiled = name == "compiled"
        verdicts.append([v for at in range(0, len(messages), batch) for v in engine.check_batch(messages[at : at + batch])])
    assert verdicts[0] == verdicts[1]
    kinds = Counter("replay" if v.method == "replay" else v.duplicate for v in verdicts[0])
    assert kinds["replay"] > 5 and kinds[True] > 100 and kinds[False] > 100, kinds


@pytest.mark.parametrize("race", ["before", "after"])
def test_a_round_sent_ahead_and_raced_is_decided_as_one_waited_for(make: Callable[..., RedisIndex], redis_url: str,
                                                                   prefix: str, race: str) -> None:
    """An insert round sent without waiting for its answer (`insert_ahead`), the next part looked up and checked
    meanwhile: when another worker writes just before it goes (Redis refuses it: its entries go again, through
    the checking script, and the next part is looked up again) or right after it, before its WATCH is armed
    again (its answer shows a seq it did not leave: the next part is looked up again), the verdicts and the
    bytes stored are those of the same rounds each waited for, with the same writes of the other worker at the
    same moments."""
    config = FilterConfig(window=WINDOW, bucket_cap=4)
    messages = generated_messages(400, seed=5)
    prepare = NearDupFilter(config)
    verdicts, dumps, settled = [], [], []
    for namespace in ("ahead", "waited"):
        index, other = make(namespace, bucket_cap=4, round="32"), make(namespace, bucket_cap=4)
        index.write_ahead = namespace == "ahead"
        turns, answers = [0], Counter[tuple[bool, bool]]()

        def intrude(commands: list[Any], index: RedisIndex = index, other: RedisIndex = other,
                    turns: list[int] = turns) -> None:
            turns[0] += 1
            if turns[0] % 3 == 0:
                if race == "before":  # the WATCH sees it: Redis refuses the transaction
                    # A copy of a message still to come: it takes the seq the refused round would have given its
                    # first entry, and that message, when it comes, is its duplicate (found by that seq).
                    ts, id = index._hwm, f"x{turns[0]}"
                    coming = next((m.text for m in messages if ts + 60 < m.ts < ts + 600 and "#" in m.text), id)
                    [fp] = prepare.fingerprinter.fingerprint_batch([coming + " reply now"])
                    other.lookup([Query(id, ts, fp.keys)], 8)
                    assert other.insert([(Entry.of(id, ts, fp), fp.keys)]) == [None]
                else:  # as if written right after it, before its WATCH went again: the answer shows a seq moved on
                    commands.insert(commands.index(("EXEC",)), ("HINCRBY", index._meta, "seq", 1))

        # Every watched transaction, sent ahead or waited for, in the order the rounds go.
        send, execute, settle = index._send_watched, index._exec_watched, index.settle

        def sending(commands: list[Any], *args: Any, send: Any = send, intrude: Any = intrude) -> bool:
            intrude(commands)
            return cast("bool", send(commands, *args))

        def executing(commands: list[Any], execute: Any = execute, intrude: Any = intrude) -> list[Any] | None:
            intrude(commands)
            return cast("list[Any] | None", execute(commands))

        def counted(settle: Any = settle, answers: Counter[tuple[bool, bool]] = answers) -> tuple[bool, bool]:
            answer = settle()
            answers[answer] += 1
            return cast("tuple[bool, bool]", answer)

        index._send_watched = sending  # type: ignore[method-assign]
        index._exec_watched = executing  # type: ignore[method-assign]
        index.settle = counted  # type: ignore[method-assign]
        engine = NearDupFilter(config, index=index)
        verdicts.append([v for at in range(0, len(messages), 100) for v in engine.check_batch(messages[at : at + 100])])
        dumps.append(_namespace_dump(redis_url, prefix, namespace))
        settled.append(answers)
    assert verdicts[0] == verdicts[1]
    assert dumps[0] == dumps[1]
    raced = (False, False) if race == "before" else (True, False)
    assert settled[0][raced] >= 5 and settled[0][(True, True)] >= 5, settled[0]
    assert sum(settled[1].values()) == 0  # waited for: nothing went ahead
    kinds = Counter(v.duplicate for v in verdicts[0])
    assert kinds[True] > 50 and kinds[False] > 50, kinds
    if race == "before":
        assert sum(1 for v in verdicts[0] if (v.duplicate_of or "").startswith("x")) >= 3


def test_work_given_to_decide_runs_while_redis_answers(make: Callable[..., RedisIndex],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`decide(..., meanwhile=...)`: a share of the work runs after a request of the batch went out and
    before its replies are read, until the work says it is done: during the lookup's read and the
    insert's transaction, not the short read of entries between them; what is left after the batch
    runs then. Routing a file reads one batch ahead this way (`route_batches`)."""
    index = make(entry_cache="0")  # the second batch's stored entries are read from Redis, not kept
    engine = NearDupFilter(FilterConfig(), index=index)
    messages = generated_messages(60, seed=9)
    events: list[str] = []
    index.lookup([Query("warm", 1.7e9, (1,))], 8)  # connects the pinned connection
    conn = index._conn
    import filters.index.redis as redis_index

    read = redis_index.read_replies

    def reading(*args: Any, **kwargs: Any) -> list[Any]:
        events.append("read")
        return read(*args, **kwargs)

    monkeypatch.setattr(redis_index, "read_replies", reading)
    send = conn.send_packed_command

    def sending(packed: list[bytes], *args: object, **kwargs: object) -> object:
        data = b"".join(packed)
        events.append("send insert" if b"MULTI" in data else "send lookup" if b"UNWATCH" in data else "send")
        return send(packed, *args, **kwargs)

    conn.send_packed_command = sending

    def shares(total: int) -> Callable[[], bool]:
        def share() -> bool:
            events.append("work")
            return events.count("work") >= total
        return share

    try:
        engine.decide(messages[:30], engine.prepare([m.text for m in messages[:30]]), meanwhile=shares(2))
        assert events[:2] == ["send lookup", "work"] and events.count("work") == 2  # the lookup's read
        second = events.index("work", 2)
        assert events[second - 1] == "send insert" and events[second + 1] == "read"  # the insert's
        events.clear()
        # Copies of stored messages (their entries are read) and new ones (inserted).
        second = [Message(f"copy-{m.id}", m.text, m.ts + 1) for m in messages[:15]] + messages[30:45]
        engine.decide(second, engine.prepare([m.text for m in second]), meanwhile=shares(9))
        assert events.count("work") == 9 and events[-1] == "work"  # the rest after the batch
        assert "send" in events  # this batch read stored entries: no share ran in that round trip
        inside = [events[i - 1] for i, e in enumerate(events) if e == "work" and events[i - 1] != "work"]
        assert inside[:-1] == ["send lookup", "send insert"] and inside[-1] == "read"
    finally:
        del conn.send_packed_command


def test_a_wrapped_index_keeps_the_overlap_and_the_read_ahead(make: Callable[..., RedisIndex],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Through a wrapper (`TimedIndex`, as `neardup serve` wraps the index), the batch's `meanwhile` work still
    runs while Redis answers the lookup, the next batch's read still goes ahead, and each round is timed."""
    index = make(bucket_cap=64)
    config = FilterConfig(window=WINDOW)
    timed: list[str] = []
    engine = NearDupFilter(config, index=TimedIndex(index, lambda op, s: timed.append(op)))
    messages = generated_messages(60, seed=10)
    index.lookup([Query("warm", 1.7e9, (1,))], 8)  # connects the pinned connection
    conn = index._conn
    events: list[str] = []
    import filters.index.redis as redis_index

    read, send = redis_index.read_replies, conn.send_packed_command

    def reading(*args: Any, **kwargs: Any) -> list[Any]:
        events.append("read")
        return read(*args, **kwargs)

    def sending(packed: list[bytes], *args: object, **kwargs: object) -> object:
        events.append("send lookup" if b"UNWATCH" in b"".join(packed) else "send")
        return send(packed, *args, **kwargs)

    def share() -> bool:
        events.append("work")
        return events.count("work") >= 2

    monkeypatch.setattr(redis_index, "read_replies", reading)
    conn.send_packed_command = sending
    try:
        first, following = messages[:30], messages[30:]
        later = engine.prepare([m.text for m in following])
        engine.decide(first, engine.prepare([m.text for m in first]), meanwhile=share, upcoming=(following, later))
        assert events[:2] == ["send lookup", "work"] and events.count("work") == 2
        assert index._ahead is not None  # the following batch's read went out
    finally:
        del conn.send_packed_command
    assert timed[:2] == ["lookup", "insert"]
    assert engine.decide(following, later) == NearDupFilter(config).check_batch(messages)[30:]


def test_reading_ahead_on_redis_routes_as_batch_after_batch(make: Callable[..., RedisIndex]) -> None:
    lines = [orjson.dumps({"id": m.id, "text": m.text, "ts": m.ts}) for m in generated_messages(700, seed=4)]
    batch = [RawRecord(line, str(i), 0.0) for i, line in enumerate(lines)]
    chunks = [batch[i : i + 150] for i in range(0, len(batch), 150)]
    fmt = RecordFormat()
    ahead = [r.verdict for rows in route_batches(NearDupFilter(index=make("ahead")), chunks, fmt) for r in rows]
    nd = NearDupFilter(index=make("serial"))
    assert ahead == [r.verdict for chunk in chunks for r in route_batch(nd, chunk, fmt)]


def _namespace_dump(redis_url: str, prefix: str, namespace: str) -> dict[bytes, object]:
    """Every key of a namespace and what it holds, but the token the compact layout's first writer leaves in the
    meta hash (`gen`: each client has its own)."""
    with redis.Redis.from_url(redis_url) as client:
        keys = sorted(set(client.scan_iter(match=f"{{{prefix}:{namespace}}}:*")))
        dump = {key.split(b"}", 1)[1]: client.hgetall(key) for key in keys}
    dump.get(b":meta", {}).pop(b"gen", None)
    return dump


@pytest.mark.parametrize(("window", "cap"), [(3600.0, 8), (30.0, 2)])
def test_uncontended_inserts_store_what_the_checking_script_stores(make: Callable[..., RedisIndex], redis_url: str,
                                                                   prefix: str, window: float, cap: int) -> None:
    """An insert round that nobody raced is computed by the caller and written by INSERT_ALONE_LUA; the
    same batches through INSERT_LUA alone must leave the very same bytes: records, trims (a cap of 2
    trims often), entries, seq and high-water mark, and slices (a window of 30 s makes several, and
    unlinks the old ones)."""
    config = FilterConfig(window=window, bucket_cap=cap)
    fast, checked = make("fast", window=window, bucket_cap=cap), make("checked", window=window, bucket_cap=cap)
    checked.alone_inserts = False
    reference = make("reference", window=window, bucket_cap=cap)  # the Python twins of the compiled helpers
    reference._plan, reference._rank, reference._round, reference._decode, reference._rank_all = (
        redis_codec.plan_fields, redis_codec.rank_records, redis_codec.alone_round, redis_codec.decode_entries,
        redis_codec.rank_lookup)
    reference._encode = redis_codec.encode_entries
    assert_stored_alike(config, fast, checked, reference, redis_url, prefix)


def assert_stored_alike(config: FilterConfig, fast: RedisIndex, checked: RedisIndex, reference: RedisIndex,
                        redis_url: str, prefix: str) -> None:
    """The same batches through `fast` (uncontended rounds), `checked` (the checking script alone) and
    `reference` (the Python references), namespaces "fast", "checked" and "reference" under `prefix`: the
    same verdicts and the very same keys and bytes stored."""
    calls = {"fast": 0}
    alone = fast._alone

    def counted(*args: object, **kwargs: bool) -> object:
        result = alone(*args, **kwargs)  # type: ignore[arg-type]
        calls["fast"] += result is not None
        return result

    fast._alone = counted  # type: ignore[method-assign]
    messages = generated_messages(600, seed=3)
    verdicts = []
    for index in (fast, checked, reference):
        engine = NearDupFilter(config, index=index)
        verdicts.append([v for at in range(0, len(messages), 50) for v in engine.check_batch(messages[at : at + 50])])
    assert verdicts[0] == verdicts[1] == verdicts[2]
    assert calls["fast"] >= 10  # the uncontended path did the work
    assert _namespace_dump(redis_url, prefix, "fast") == _namespace_dump(redis_url, prefix, "checked")
    assert _namespace_dump(redis_url, prefix, "reference") == _namespace_dump(redis_url, prefix, "checked")


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), cap=st.integers(1, 4), window=st.sampled_from([20.0, 3600.0]),
       turns=st.lists(st.tuples(st.booleans(), st.integers(1, 40)), min_size=1, max_size=8))
def test_the_claim_rule_is_one_rule_in_lua_compiled_and_python(redis_url: str, prefix: str, seed: int, cap: int,
                                                               window: float, turns: list[tuple[bool, int]]) -> None:
    """The insert/claim rule written three times: in Lua (filters/index/lua/insert.lua, every insert checked by the
    server), compiled (`_native.alone_round`) and in Python (`redis_codec.alone_round`), both of which compute
    an uncontended round on the client. Two workers share a namespace and take random turns with random
    batches (a turn after the other's is contended: the checked script decides it): the three variants leave
    the same verdicts and the very same bytes."""
    messages = generated_messages(sum(n for _, n in turns), seed=seed)
    config = FilterConfig(window=window, bucket_cap=cap)
    run = uuid.uuid4().hex[:8]
    dumps, verdicts = [], []
    for variant in ("lua", "compiled", "python"):
        namespace = f"{variant}-{run}"
        workers = [RedisIndex(with_query(redis_url, prefix=prefix), window=window, bucket_cap=cap, namespace=namespace)
                   for _ in range(2)]
        for index in workers:
            index.alone_inserts = variant != "lua"
            if variant == "python":
                index._plan, index._rank, index._round, index._decode, index._rank_all, index._encode = (
                    redis_codec.plan_fields, redis_codec.rank_records, redis_codec.alone_round,
                    redis_codec.decode_entries, redis_codec.rank_lookup, redis_codec.encode_entries)
        engines = [NearDupFilter(config, index=index) for index in workers]
        got, at = [], 0
        for second, n in turns:
            got += engines[second].check_batch(messages[at : at + n])
            at += n
        verdicts.append(got)
        dumps.append(_namespace_dump(redis_url, prefix, namespace))
        for index in workers:
            index.close()
    assert verdicts[0] == verdicts[1] == verdicts[2]
    assert dumps[0] == dumps[1] == dumps[2]


def _counting_taken(index: RedisIndex) -> list[bool]:
    """Records, for each lookup of `index` given a read sent ahead, whether it took that read."""
    results: list[bool] = []
    taken = index._taken

    def counted(*args: object) -> object:
        result = taken(*args)  # type: ignore[arg-type]
        results.append(result is not None)
        return result

    index._taken = counted  # type: ignore[method-assign]
    return results


def _decide_reading_ahead(engine: NearDupFilter, messages: Sequence[Message], size: int) -> list[Verdict]:
    """`decide` of each batch of `size`, the next one given as `upcoming` (its read sent ahead)."""
    batches = [messages[at : at + size] for at in range(0, len(messages), size)]
    prepared = [engine.prepare([m.text for m in batch]) for batch in batches]
    verdicts = []
    for i, batch in enumerate(batches):
        upcoming = (batches[i + 1], prepared[i + 1]) if i + 1 < len(batches) else None
        verdicts += engine.decide(batch, prepared[i], upcoming=upcoming)
    return verdicts


def test_no_read_goes_ahead_while_others_write_beside(make: Callable[..., RedisIndex]) -> None:
    """Workers racing on one namespace: a read sent ahead is read for nothing once another worker wrote after the
    lookup (the next lookup reads afresh). So while others write beside it, the index sends none; a lookup
    that finds no writes but its own since the lookup before starts them again. The verdicts are those of
    the same interleaving with no read ever sent ahead."""
    config = FilterConfig()
    mine = generated_messages(200, seed=5)
    theirs = [Message(f"b-{m.id}", m.text, m.ts) for m in generated_messages(100, seed=99)]
    runs = []
    for read_ahead in (True, False):
        namespace = f"race-{read_ahead}"
        a, b = make(namespace), make(namespace)
        a.read_ahead = read_ahead
        ours, other = NearDupFilter(config, index=a), NearDupFilter(config, index=b)
        sent: list[bool] = []
        prefetch, lookup = a.prefetch, a.lookup

        def counted(queries: Sequence[Query], prefetch: Callable[..., None] = prefetch, a: RedisIndex = a,
                    sent: list[bool] = sent) -> None:
            prefetch(queries)
            sent.append(a._ahead is not None)

        racing = iter(theirs[at : at + 20] for at in range(0, 100, 20))

        def raced(*args: Any, lookup: Callable[..., Any] = lookup, other: NearDupFilter = other,
                  racing: Iterator[list[Message]] = racing) -> Any:
            found = lookup(*args)
            batch = next(racing, None)
            if batch is not None:  # the other worker's batch, between this one's lookup and its insert
                other.check_batch(batch)
            return found

        a.prefetch, a.lookup = counted, raced  # type: ignore[method-assign]
        batches = [mine[at : at + 20] for at in range(0, len(mine), 20)]
        prepared = [ours.prepare([m.text for m in batch]) for batch in batches]
        verdicts = []
        for i, batch in enumerate(batches):
            upcoming = (batches[i + 1], prepared[i + 1]) if i + 1 < len(batches) else None
            verdicts += ours.decide(batch, prepared[i], upcoming=upcoming)
        runs.append((verdicts, sent))
    (verdicts, sent), (alone, _) = runs
    assert verdicts == alone
    # Lookups 1-5 found the other's writes since the one before (it wrote after lookups 0-4): none sent;
    # lookup 6 found none since lookup 5, and from there reads go ahead again.
    assert sent == [True, False, False, False, False, False, True, True, True]


@pytest.mark.parametrize(("window", "cap"), [(3600.0, 8), (30.0, 2)])
def test_a_read_sent_ahead_stores_and_decides_as_reading_after_the_insert(
        make: Callable[..., RedisIndex], redis_url: str, prefix: str, window: float, cap: int) -> None:
    """The next batch's read goes out before this batch's insert (`prefetch`), and its lookup adds what
    that insert wrote. The verdicts and every stored byte (records, trims, entries, seq, high-water mark,
    slices, unlinks) must be those of batches looked up one after the other's insert."""
    config = FilterConfig(window=window, bucket_cap=cap)
    ahead, serial = make("ahead", window=window, bucket_cap=cap), make("serial", window=window, bucket_cap=cap)
    taken = _counting_taken(ahead)
    messages = generated_messages(600, seed=3)
    verdicts = _decide_reading_ahead(NearDupFilter(config, index=ahead), messages, 50)
    engine = NearDupFilter(config, index=serial)
    assert verdicts == [v for at in range(0, len(messages), 50) for v in engine.check_batch(messages[at : at + 50])]
    assert taken.count(True) >= 10  # the reads sent ahead did the work
    assert _namespace_dump(redis_url, prefix, "ahead") == _namespace_dump(redis_url, prefix, "serial")


@pytest.mark.parametrize("most", [1, 37, 128])
def test_a_batch_is_decided_in_rounds_of_at_most_round_messages(make: Callable[..., RedisIndex], redis_url: str,
                                                                 prefix: str, most: int) -> None:
    """A batch of more than `?round=` messages is decided in parts of that many, each as a batch of its own, the
    next part's read sent ahead (the first part of the next batch's too): the verdicts and every stored byte of
    the parts decided one after the other as batches, and every read sent ahead taken."""
    config = FilterConfig(window=3600.0, bucket_cap=4)
    parted = make("parted", window=3600.0, bucket_cap=4, round=str(most))
    taken = _counting_taken(parted)
    messages = generated_messages(500, seed=6)
    verdicts = _decide_reading_ahead(NearDupFilter(config, index=parted), messages, 200)
    parts = [messages[at + part : min(at + part + most, at + 200, len(messages))]
             for at in range(0, len(messages), 200) for part in range(0, min(200, len(messages) - at), most)]
    whole = NearDupFilter(config, index=make("whole", window=3600.0, bucket_cap=4, round="1000"))
    assert verdicts == [v for part in parts for v in whole.check_batch(part)]
    assert sum(v.duplicate for v in verdicts) > 50  # it tests something
    assert taken == [True] * (len(parts) - 1)
    assert _namespace_dump(redis_url, prefix, "parted") == _namespace_dump(redis_url, prefix, "whole")


def test_a_batch_is_decided_in_rounds_on_redis_cluster_too(make: Callable[..., RedisIndex],
                                                            redis_cluster_url: str) -> None:
    """No read goes ahead on Redis Cluster; a batch is decided in rounds of `?round=` (128 by default) all the same,
    each part as a batch of its own."""
    assert make()._decider.most == 128
    prefix = f"neardup-test-{uuid.uuid4().hex[:10]}"
    config = FilterConfig(window=WINDOW)
    messages = generated_messages(300, seed=8)
    try:
        for query, most in (({}, 128), ({"round": "64"}, 64), ({"round": "300"}, 300)):
            url = with_query(cluster_url(redis_cluster_url), prefix=prefix, **query)
            index = RedisIndex(url, window=WINDOW, bucket_cap=config.bucket_cap, namespace=f"n{most}")
            try:
                assert index._decider.most == most
                got = NearDupFilter(config, index=index).check_batch(messages)
            finally:
                index.close()
            memory = NearDupFilter(config)
            assert got == [v for at in range(0, 300, most) for v in memory.check_batch(messages[at : at + most])]
    finally:
        drop_cluster_namespace(cluster_url(redis_cluster_url), prefix)


def test_a_foreign_insert_while_a_read_is_ahead_is_seen(make: Callable[..., RedisIndex]) -> None:
    """Another worker inserts into the next batch's bucket after its read went out, at any moment: before
    this batch's insert (whose transaction Redis then refuses: the next lookup reads afresh and sees
    it), after that insert, or with nothing inserted (the read sent ahead stands for a read at its
    moment, as any lookup's read does, and what came after it is seen by the insert's check)."""
    for moment in ("before the insert", "after the insert", "no insert"):
        namespace = moment.replace(" ", "-")
        index, other = make(namespace), make(namespace)
        taken = _counting_taken(index)
        index.lookup([Query("a", 1000, (1,))], 8)
        following = [Query("b", 1001, (2,))]
        index.prefetch(following)
        if moment == "before the insert":
            other.lookup([Query("x", 1000, (2,))], 8)
            assert other.insert([(entry("x"), (2,))]) == [None]
        if moment != "no insert":
            assert index.insert([(entry("a"), (1,))]) == [None]
        if moment != "before the insert":
            other.lookup([Query("x", 1000, (2,))], 8)
            assert other.insert([(entry("x"), (2,))]) == [None]
        [(_, found)] = index.lookup(following, 8)
        assert taken == [moment != "before the insert"], moment
        if moment == "before the insert":
            assert ids(found) == ["x"]
        else:
            assert ids(found) == []
            [conflicts] = index.insert([(entry("b", 1001), (2,))])
            assert ids(conflicts) == ["x"], moment


def test_the_next_lookup_sees_what_the_batch_inserted_after_the_read_went_out(make: Callable[..., RedisIndex]) -> None:
    index = make()
    taken = _counting_taken(index)
    index.lookup([Query("a", 1000, (1, 2)), Query("b", 1000, (3,))], 8)
    following = [Query("c", 1001, (2, 9)), Query("a", 1001, (1,)), Query("d", 1001, (3,))]
    index.prefetch(following)
    assert index.insert([(entry("a"), (1, 2)), (entry("b"), (3,))]) == [None, None]
    found = index.lookup(following, 8)
    assert taken == [True]
    assert [ids(cands) for _, cands in found] == [["a"], [], ["b"]]
    assert found[1][0] is not None and found[1][0].exact == entry("a").exact  # a replay of a: its entry
    # And the records the next batch writes keep those the first one wrote (whole values, not stale ones).
    assert index.insert([(entry("c", 1001), (2, 9)), (entry("d", 1001), (3,))]) == [None, None]
    assert [ids(cands) for _, cands in make().lookup([Query("q", 1002, (2, 3))], 8)[:1]] == [["d", "c", "b", "a"]]


@pytest.mark.parametrize("entries", [True, False], ids=["in-the-transaction", "in-a-round-of-their-own"])
def test_the_next_lookup_sees_the_memos_the_batch_wrote_after_the_read_went_out(make: Callable[..., RedisIndex],
                                                                                 entries: bool) -> None:
    """A batch's memos are written after the next batch's read went out (inside the insert's transaction, or,
    when the batch inserts nothing, in a round trip of their own): that read, taken, has them."""
    index = make()
    taken = _counting_taken(index)
    index.lookup([Query("a", 1000, (1,)), Query("b", 1000, (1,))], 8)
    following = [Query("c", 1001, (1,)), Query("b", 1000, (1,))]
    index.prefetch(following)
    memo = Verdict("b", True, "z", 0.625, "mgram")
    assert index.insert([(entry("a"), (1,))] if entries else [], [(memo, 1000.0)]) == ([None] if entries else [])
    found = index.lookup(following, 8)
    assert taken == [True]
    assert found[0][0] is None and found[1][0] == memo
    assert make().lookup([Query("b", 1000, (1,))], 8)[0][0] == memo  # and it is stored


def test_a_replayed_duplicate_finds_its_memo_on_any_redis(race_url: str, layout: type[RedisIndex]) -> None:
    """Standalone and Cluster (whose insert round is a script, not a transaction): a duplicate replayed after
    its original left every bucket (cap 1) gets its first verdict."""
    config = FilterConfig(bucket_cap=1)
    index = layout(race_url, window=config.window, bucket_cap=1, namespace=uuid.uuid4().hex[:12])
    engine = NearDupFilter(config, index=index)
    original = "Congratulations! You have won a 1000 dollar gift card, call 555-0100 now to claim your prize today"
    copy = "Congratulations!! You have won a 1000 dollar gift voucher, call 555-0177 now to claim your prize"
    assert not engine.check_batch([Message("a", original, 100.0)])[0].duplicate
    [first] = engine.check_batch([Message("b", copy, 101.0)])
    assert first.duplicate_of == "a"
    keys = tuple(dict.fromkeys(engine.fingerprinter.fingerprint(original).keys + engine.fingerprinter.fingerprint(copy).keys))
    index.lookup([Query("filler", 102.0, keys)], 8)
    assert index.insert([(Entry("filler", 102.0, 7, 500, np.arange(1, 129, dtype=np.uint32)), keys)]) == [None]
    assert engine.check_batch([Message("b", copy, 101.0)]) == [first]
    assert index.stats()["memos"] == 1
    index.close()


def test_reading_ahead_can_be_switched_off(make: Callable[..., RedisIndex]) -> None:
    index = make()
    index.read_ahead = False  # bench/redis_bench.py's comparison: every lookup reads when it is made
    taken = _counting_taken(index)
    index.lookup([Query("a", 1000, (1,))], 8)
    following = [Query("b", 1001, (1,))]
    index.prefetch(following)
    assert index.insert([(entry("a"), (1,))]) == [None]
    assert ids(index.lookup(following, 8)[0][1]) == ["a"]
    assert taken == []  # nothing was sent ahead


def test_a_read_ahead_lost_with_its_connection_is_read_again(make: Callable[..., RedisIndex], redis_url: str) -> None:
    index = make()
    index.lookup([Query("a", 1000, (1,))], 8)
    index.insert([(entry("a"), (1,))])
    [client_id] = index._execute([("CLIENT", "ID")])
    following = [Query("b", 1001, (1,))]
    index.prefetch(following)
    with redis.Redis.from_url(redis_url) as client:
        assert client.client_kill_filter(_id=client_id) == 1
    with pytest.raises(IndexUnavailable):
        index.lookup(following, 8)  # its replies went with the connection: a retriable error, never wrong ones
    [(_, found)] = index.lookup(following, 8)  # the worker's retry reads afresh, on a new connection
    assert ids(found) == ["a"]


def test_a_round_sent_ahead_lost_with_its_connection_fails_the_batch_and_its_retry_decides_it(
        make: Callable[..., RedisIndex], redis_url: str) -> None:
    """The connection goes while an insert round sent ahead (`insert_ahead`) waits for its answer: whether Redis
    wrote it is unknown, so the batch fails with the index's retriable error, never a verdict; the worker's retry
    (a new connection) decides the batch as if uninterrupted (what was written comes back as replays)."""
    index, uninterrupted = make(round="16"), make("uninterrupted", round="16")
    engine = NearDupFilter(FilterConfig(), index=index)
    messages = generated_messages(64, seed=4)
    expected = [(v.id, v.duplicate, v.duplicate_of)
                for v in NearDupFilter(FilterConfig(), index=uninterrupted).check_batch(messages)]
    index.lookup([Query("warm", 1.7e9, (1,))], 8)
    [client_id] = index._execute([("CLIENT", "ID")])
    send, killed = index._send_watched, []

    def killing(*args: Any) -> bool:
        sent = send(*args)
        if sent and not killed:
            with redis.Redis.from_url(redis_url) as client:
                killed.append(client.client_kill_filter(_id=client_id))
        return cast("bool", sent)

    index._send_watched = killing  # type: ignore[method-assign]
    with pytest.raises(IndexUnavailable):
        engine.check_batch(messages)
    assert killed == [1]
    assert [(v.id, v.duplicate, v.duplicate_of) for v in engine.check_batch(messages)] == expected


def test_a_connection_lost_under_a_round_sent_ahead_after_the_next_read_fails_the_batch_as_unavailable(
        make: Callable[..., RedisIndex]) -> None:
    """The next batch's read went ahead, then the batch's round without its answer, and the connection's socket
    fails before either is read: `settle` reads the read's replies first, and their loss fails the batch with the index's
    retriable error (not redis-py's own); the retry decides the batch as if uninterrupted."""
    index, uninterrupted = make(), make("uninterrupted")
    engine = NearDupFilter(FilterConfig(), index=index)
    messages = generated_messages(48, seed=6)
    first, following = messages[:24], messages[24:]
    expected = [(v.id, v.duplicate, v.duplicate_of)
                for v in NearDupFilter(FilterConfig(), index=uninterrupted).check_batch(first)]
    prepared, later = engine.prepare([m.text for m in first]), engine.prepare([m.text for m in following])
    send, cut = index.insert_ahead, []

    def cutting(*args: Any) -> bool:
        sent = send(*args)
        if sent and not cut:
            ahead = index._ahead
            cut.append(ahead is not None and ahead.pending > 0)  # the read went ahead before the round
            index._conn._sock.close()  # type: ignore[union-attr]  # (their replies may be on it already: gone too)
        return sent

    index.insert_ahead = cutting  # type: ignore[method-assign]
    with pytest.raises(IndexUnavailable):
        engine.decide(first, prepared, upcoming=(following, later))
    assert cut == [True]
    assert [(v.id, v.duplicate, v.duplicate_of) for v in engine.decide(first, prepared)] == expected


@pytest.mark.parametrize("ahead", [True, False], ids=["sent-ahead", "waited-for"])
def test_a_duplicate_never_names_a_message_that_lost_its_race_in_a_batch_that_failed(
        make: Callable[..., RedisIndex], redis_url: str, ahead: bool) -> None:
    """x2 copies x1, the first message of its batch; another worker inserts x0 (a copy too) while the batch's lookup
    is on its way, so x1 loses its race, and the connection goes before x1 is verified again. The batch fails; on
    its retry x1 is a duplicate of x0, and so is x2: no memo of x2 naming x1 was written beside the insert that x1
    lost (a duplicate must name a message that was indexed, never one routed as a duplicate)."""
    mine, other = make(), make()
    mine.write_ahead = ahead
    engine, rival = NearDupFilter(FilterConfig(), index=mine), NearDupFilter(FilterConfig(), index=other)
    text = "Limited offer: claim your free cruise to the Bahamas today, call 555-0199 before midnight to reserve"
    x0, x1, x2 = (Message(f"x{i}", text, 1_700_000_000.0 + i) for i in range(3))
    raced: list[bool] = []

    def meanwhile() -> bool:  # the batch's lookup went out: the other worker inserts x0 now, unseen by it
        if not raced:
            raced.append(not rival.check_batch([x0])[0].duplicate)
        return True

    mine.lookup([Query("warm", 1.7e9, (1,))], 8)
    [client_id] = mine._execute([("CLIENT", "ID")])
    reread, killed = mine._reread, []

    def killing(*args: Any, **kwargs: Any) -> Any:  # x1 lost its race: the connection goes before it is read again
        if not killed:
            with redis.Redis.from_url(redis_url) as client:
                killed.append(client.client_kill_filter(_id=client_id))
        return reread(*args, **kwargs)

    mine._reread = killing  # type: ignore[method-assign]
    prepared = engine.prepare([x1.text, x2.text])
    with pytest.raises(IndexUnavailable):
        engine.decide([x1, x2], prepared, meanwhile=meanwhile)
    assert raced == [True] and killed == [1]
    retried = [(v.id, v.duplicate, v.duplicate_of) for v in engine.decide([x1, x2], prepared)]
    assert retried == [("x1", True, "x0"), ("x2", True, "x0")]


def test_a_slice_that_left_the_window_is_unlinked(make: Callable[..., RedisIndex], redis_url: str, prefix: str) -> None:
    index = make(window=100.0)
    for id, ts in (("a", 10.0), ("b", 150.0), ("c", 250.0)):  # slices 0, 1, 2
        index.lookup([Query(id, ts, (1,))], 8)
        assert index.insert([(entry(id, ts), (1,))]) == [None]
    with redis.Redis.from_url(redis_url) as client:
        keys = sorted({k.decode().rsplit(":", 1)[1] for k in client.scan_iter(match=f"{{{prefix}:ns}}:s:*")})
    assert keys == ["1", "2"]  # at 250 the window starts at 150: slice 0 can hold nothing that matches


# --- workers racing on near-duplicates -----------------------------------------------------------------

_VOCABULARY = ["".join(random.Random(i).choices("abcdefghijklmnopqrstuvwxyz", k=6)) for i in range(400)]


class PausedLookup:
    """Holds every worker between its lookup and its insert until all have looked up: the race
    window of two workers that receive near-duplicates at the same moment, made certain. A mixin before
    the index class it pauses (`_PausedIndex`, and the spread layout's in tests/test_spread_index.py)."""

    barrier: threading.Barrier | None = None

    def lookup(self, queries: Sequence[Query], limit: int) -> list[tuple[Entry | Verdict | None, list[Candidate]]]:
        looked: list[tuple[Entry | Verdict | None, list[Candidate]]] = super().lookup(queries, limit)  # type: ignore[misc]
        if self.barrier is not None:
            self.barrier.wait(timeout=30)
        return looked


class _PausedIndex(PausedLookup, RedisIndex):
    """The slot layout, paused between lookup and insert (`PausedLookup`)."""


class _RacyIndex(_PausedIndex):
    """The non-atomic design: look up, verify, then insert without checking what arrived meanwhile."""

    def insert(self, entries: Sequence[tuple[Entry, tuple[int, ...]]],
               memos: Sequence[Memo] = ()) -> list[list[Candidate] | None]:
        self._view.looked.clear()  # no id was looked up, as far as the insert knows: nothing is compared
        return super().insert(entries, memos)


def _spam(cluster: int, worker: int) -> str:
    rng = random.Random(cluster)
    words = " ".join(rng.choices(_VOCABULARY, k=30))
    return f"{words} call now 555-{worker:02d}{cluster:04d} or text {worker * 7 + cluster}"


def race(url: str, *, racy: bool, paused: bool, workers: int = 3, clusters: int = 200,
         index: Callable[..., Any] | None = None) -> list[int]:
    """Each worker, its own index and filter, checks its copy of cluster c's spam at the same moment.
    Returns the number of unique verdicts per cluster. `index`: the class of the workers' indexes (one with
    a `barrier` between lookup and insert, as `_PausedIndex`), instead of the slot layout's."""
    config = FilterConfig()
    namespace = f"race-{uuid.uuid4().hex[:10]}"
    cls = index or (_RacyIndex if racy else _PausedIndex)
    indexes = [cls(url, window=config.window, bucket_cap=config.bucket_cap, namespace=namespace)
               for _ in range(workers)]
    pause = threading.Barrier(workers) if paused else None
    for index in indexes:
        index.barrier = pause
    start = threading.Barrier(workers)
    verdicts: list[list[Verdict]] = [[] for _ in range(workers)]
    errors: list[BaseException] = []

    def work(w: int) -> None:
        engine = NearDupFilter(config, index=indexes[w])
        try:
            for c in range(clusters):
                start.wait(timeout=30)
                verdicts[w].append(engine.check(_spam(c, w), id=f"c{c}-w{w}", ts=1_700_000_000 + c))
        except BaseException as exc:  # let the others out of the barriers, report it below
            errors.append(exc)
            start.abort()
            if pause is not None:
                pause.abort()

    threads = [threading.Thread(target=work, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for index in indexes:
        index.close()
    if errors:
        raise errors[0]
    uniques = [sum(not verdicts[w][c].duplicate for w in range(workers)) for c in range(clusters)]
    # Whatever the race, every message is a duplicate of one of its own cluster.
    for w in range(workers):
        for c, v in enumerate(verdicts[w]):
            assert not v.duplicate or (v.duplicate_of or "").startswith(f"c{c}-")
    return uniques


@pytest.fixture(params=["standalone", "cluster"])
def race_url(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "standalone":
        base = request.getfixturevalue("redis_url")
    else:
        base = cluster_url(request.getfixturevalue("redis_cluster_url"))
    prefix = f"neardup-test-{uuid.uuid4().hex[:10]}"
    yield with_query(base, prefix=prefix)
    if request.param == "standalone":
        drop_namespace(base, prefix)
    else:
        drop_cluster_namespace(base, prefix)


@pytest.mark.parametrize("paused", [True, False], ids=["paused-between-lookup-and-insert", "free-running"])
def test_near_duplicates_at_the_same_moment_make_exactly_one_unique(race_url: str, paused: bool) -> None:
    uniques = race(race_url, racy=False, paused=paused)
    assert uniques == [1] * len(uniques)


def test_the_race_test_catches_a_non_atomic_index(race_url: str) -> None:
    """The same race against lookup → verify → plain insert: several workers call the same spam unique."""
    uniques = race(race_url, racy=True, paused=True, clusters=50)
    assert all(u >= 1 for u in uniques)
    assert sum(u > 1 for u in uniques) >= 25, uniques


# --- the route step on a shared index ---------------------------------------------------------------------


def test_route_batch_on_redis_decides_like_the_memory_index(make: Callable[..., RedisIndex]) -> None:
    """`route_batch` over the shipped sample, with bad records among good ones: on Redis the verdicts are
    those of the compiled memory index, of the reference one, and of one record at a time."""
    lines = SAMPLE.read_bytes().splitlines()
    batch = [RawRecord(line, str(i), float(i)) for i, line in enumerate(lines)]
    config = FilterConfig()
    shared = NearDupFilter(config, index=make(window=config.window, bucket_cap=config.bucket_cap))
    on_redis = [(r.kind, r.verdict) for r in route_batch(shared, batch, RecordFormat())]
    in_memory = [(r.kind, r.verdict) for r in route_batch(NearDupFilter(config), batch, RecordFormat())]
    reference = [(r.kind, r.verdict) for r in route_batch(NearDupFilter(config, native=False), batch, RecordFormat())]
    one_by_one = NearDupFilter(config, index=make("single", window=config.window, bucket_cap=config.bucket_cap))
    alone = [(r.kind, r.verdict) for raw in batch for r in route_batch(one_by_one, [raw], RecordFormat())]
    assert on_redis == in_memory == reference == alone
    assert sum(kind == DUPLICATE for kind, _ in on_redis) > 10


@pytest.mark.parametrize(("hold", "hold_ids"), [(1 << 24, 1 << 22), (40, 1 << 22), (1 << 24, 50)])
def test_a_rebuild_holds_what_inserting_would(race_url: str, monkeypatch: pytest.MonkeyPatch,
                                              hold: int, hold_ids: int) -> None:
    """A rebuild (a fenced index without its marker: each bucket field written once, at its end) is found as
    the entries inserted one after another: busy buckets far over the cap, entries over three slices, ids
    made again inside the window (kept) and after it (in another slice), late entries out of the window, keys
    given twice, a second rebuild onto the slices the first wrote (they existed before it: read), and (hold
    40) records written early and read back when named again, or (hold_ids 50) the ids known read from the
    slices instead; on a standalone Redis and on a Redis Cluster. (Looked up at the newest event time: the
    reference forgets what is older than its window.)"""
    import filters.index.redis as redis_index

    monkeypatch.setattr(redis_index, "REBUILD_CHUNK", 37)
    monkeypatch.setattr(redis_index, "HOLD_RECORDS", hold)
    monkeypatch.setattr(redis_index, "HOLD_IDS", hold_ids)
    monkeypatch.setattr(redis_index, "FLUSH_FIELDS", 3)
    rng = random.Random(5)
    made: list[tuple[Entry, tuple[int, ...]]] = []
    ts = 0.0

    def spread(key: int) -> int:  # over the whole range, as hashes are (a rebuild holds keys apart by their low bits)
        return (key * 0x9E3779B97F4A7C15) & U64

    for n in range(400):
        ts += rng.uniform(0, 1.25)  # 400 entries over about 250 s: slices 0, 1 and 2 of 100 s
        at = ts - 120 if rng.random() < 0.03 else ts  # late: out of the window
        id = f"m{rng.randrange(n)}" if n and rng.random() < 0.15 else f"m{n}"  # made again, soon or much later
        # 12 busy keys, a key of 3 entries in a row, 2 rare ones (of its own, of another's)
        keys = tuple(map(spread, (*rng.sample(range(12), 3), 500 + (n + 1) // 3, 1000 + n, 1000 + rng.randrange(n + 1))))
        made.append((entry(id, at, seed=n), keys if n % 7 else (*keys, keys[0])))
    reference = MemoryIndex(100, 4, native=False)
    inserted = sum(reference.table.insert(e, keys) for e, keys in made)
    namespace = uuid.uuid4().hex[:12]
    index = RedisIndex(race_url, window=100, bucket_cap=4, namespace=namespace, fenced=True)
    try:
        written = index.restore([redis_codec.stored_of(made[:300])], rebuild=b"t")
        written += index.restore([redis_codec.stored_of(made[300:350]), redis_codec.stored_of(made[350:])], rebuild=b"t")
        assert written == inserted
        target = redis_index.RedisTarget.parse(race_url)
        with (redis.RedisCluster.from_url(target.client_url) if target.cluster
              else redis.Redis.from_url(target.client_url)) as client:
            client.hset(redis_index.meta_key(target.prefix, namespace), redis_index.MARKER, "1")
        top = max(e.ts for e, _ in made)
        queries = [Query(id, top, tuple(map(spread, keys))) for keys in [(0,), (1, 2), (3, 4, 5, 6), (11, 1379)]
                   for id in ("q", "m5", "m290", "m390")]
        queries += [Query(f"q{j}", top, (spread(1000 + j), spread(500 + j // 3))) for j in range(400)]
        assert _view(index.lookup(queries, 8)) == _view(reference.lookup(queries, 8))
    finally:
        index.close()


def test_a_rebuild_after_one_that_died_holds_what_inserting_would(redis_url: str, prefix: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A rebuild that dies after writing entries, before their bucket fields: the next one (the marker still
    missing) does not take those entries for live ids, and the index holds what inserting would."""
    import filters.index.redis as redis_index

    monkeypatch.setattr(redis_index, "REBUILD_CHUNK", 16)
    made = [(entry(f"m{n}", float(n), seed=n), (n % 5, 100 + n)) for n in range(60)]
    reference = MemoryIndex(100, 4, native=False)
    inserted = sum(reference.table.insert(e, keys) for e, keys in made)
    namespace = uuid.uuid4().hex[:12]
    url = with_query(redis_url, prefix=prefix)
    flush = RedisIndex._flush

    def dies(*args: Any, **kwargs: Any) -> None:
        raise IndexUnavailable("the connection went")

    monkeypatch.setattr(RedisIndex, "_flush", dies)
    first = RedisIndex(url, window=100, bucket_cap=4, namespace=namespace, fenced=True)
    with pytest.raises(IndexUnavailable):
        first.restore([redis_codec.stored_of(made)], rebuild=b"t")
    first.close()
    monkeypatch.setattr(RedisIndex, "_flush", flush)
    index = RedisIndex(url, window=100, bucket_cap=4, namespace=namespace, fenced=True)
    try:
        assert index.restore([redis_codec.stored_of(made)], rebuild=b"t") == inserted
        with redis.Redis.from_url(redis_url) as client:
            client.hset(redis_index.meta_key(prefix, namespace), redis_index.MARKER, "1")
            assert not client.hexists(redis_index.meta_key(prefix, namespace), redis_index.REBUILDING)
        queries = [Query("q", 59.0, keys) for keys in [(0,), (1, 2), (3, 4), (100, 130, 159)]]
        assert _view(index.lookup(queries, 8)) == _view(reference.lookup(queries, 8))
    finally:
        index.close()


def test_a_rebuild_that_finds_another_writer_hands_the_rest_to_guarded_chunks(redis_url: str, prefix: str,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Somebody else writes the namespace while it is rebuilt (its seq moves): the rebuild writes what it held,
    merged with what the fields hold, and restores the rest beside them; the index holds what inserting would."""
    import filters.index.redis as redis_index

    monkeypatch.setattr(redis_index, "REBUILD_CHUNK", 16)
    made = [(entry(f"m{n}", float(n), seed=n), (n % 5, 100 + n)) for n in range(80)]
    reference = MemoryIndex(100, 4, native=False)
    inserted = sum(reference.table.insert(e, keys) for e, keys in made)
    namespace = uuid.uuid4().hex[:12]
    meta = redis_index.meta_key(prefix, namespace)
    index = RedisIndex(with_query(redis_url, prefix=prefix), window=100, bucket_cap=4, namespace=namespace, fenced=True)
    accept, calls = index._restore_accept, []

    def accept_and_meddle(*args: Any) -> Any:
        calls.append(1)
        if len(calls) == 3:  # another writer, after the rebuild's second chunk went
            with redis.Redis.from_url(redis_url) as client:
                client.hincrby(meta, "seq", 1)
        return accept(*args)

    index._restore_accept = accept_and_meddle
    try:
        assert index.restore([redis_codec.stored_of(made)], rebuild=b"t") == inserted
        assert len(calls) < 5  # the rest (of 5 chunks) went as guarded chunks
        with redis.Redis.from_url(redis_url) as client:
            client.hset(meta, redis_index.MARKER, "1")
            assert not client.hexists(meta, redis_index.REBUILDING)
        queries = [Query("q", 79.0, keys) for keys in [(0,), (1, 2), (3, 4), (100, 130, 150, 179)]]
        assert _view(index.lookup(queries, 8)) == _view(reference.lookup(queries, 8))
    finally:
        index.close()


# --- a Redis ACL user made by the rule docs/operations.md gives ------------------------------------------------


def _acl_rule(user: str, password: str, prefix: str) -> list[str]:
    """The arguments after `ACL` of the `ACL SETUSER` line of docs/operations.md, for `user`, `password`, `prefix`."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()
    line = next(line for line in doc.splitlines() if line.startswith("ACL SETUSER neardup "))
    words = line.replace("PASSWORD", password).replace("PREFIX", prefix).split()
    return ["SETUSER", user, *words[3:]]


@contextlib.contextmanager
def _acl_user(node_url: str, prefix: str, *, cluster: bool = False) -> Iterator[str]:
    """`node_url` (a Redis, or a node of a cluster) as a fresh user that the documented rule made on every node."""
    user, password = f"nd-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    parts = urlsplit(node_url)
    nodes: list[tuple[str, int]] = [(str(parts.hostname), int(parts.port or 6379))]
    if cluster:
        with redis.Redis.from_url(node_url) as client:
            addresses = client.cluster("nodes")  # "host:port" -> what the node is
        nodes = [(host, int(port)) for host, port in (address.rsplit(":", 1) for address in addresses)]
    clients = [redis.Redis(host=host, port=port) for host, port in nodes]
    try:
        for client in clients:
            client.execute_command("ACL", *_acl_rule(user, password, prefix))
        yield parts._replace(netloc=f"{user}:{password}@{parts.hostname}:{parts.port}").geturl()
    finally:
        for client in clients:
            client.execute_command("ACL", "DELUSER", user)
            client.close()


def _routed_in_turn(*urls: str) -> list[tuple[str, str | None]]:
    """The sample's routing, its batches decided in turn by filters on the indexes at `urls` (two on one shared
    index: each finds the other's writes since its last lookup, the checking insert's way)."""
    lines = (Path(__file__).resolve().parent / "data" / "sample.jsonl").read_bytes().splitlines()
    fmt = RecordFormat()
    records = [RawRecord(line, str(i), 0.0) for i, line in enumerate(lines)]
    filters = [NearDupFilter(FilterConfig(), index=url) for url in urls]
    try:
        out = []
        for turn, at in enumerate(range(0, len(records), 40)):
            out += [(r.kind, r.verdict.duplicate_of if r.verdict else None)
                    for r in route_batch(filters[turn % len(filters)], records[at : at + 40], fmt)]
        return out
    finally:
        for nd in filters:
            nd.index.close()


def test_a_user_made_by_the_documented_acl_rule_runs_the_index_its_restore_and_the_marks(redis_url: str,
                                                                                     prefix: str) -> None:
    with _acl_user(redis_url, prefix) as url:
        routed = _routed_in_turn(*[with_query(url, prefix=prefix)] * 2)
        assert routed == _routed_in_turn("memory://")
        assert sum(kind == DUPLICATE for kind, _ in routed) > 50
        made = [(entry(f"m{n}", float(n), seed=n), (n % 5, 100 + n)) for n in range(60)]
        index = RedisIndex(with_query(url, prefix=prefix), window=100, bucket_cap=4, namespace="restored",
                           fenced=True)
        try:
            assert index.restore([redis_codec.stored_of(made)], rebuild=b"t") == 60
        finally:
            index.close()

        async def marks() -> tuple[float | None, float | None]:
            one, two = (RedisMarks(with_query(url, prefix=prefix), namespace="marks", group="g") for _ in range(2))
            try:
                await one.publish(10.0, [("in", 0)], [("in", 0), ("in", 1)])
                seen = (await two.publish(20.0, [("in", 1)], [("in", 0), ("in", 1)])).low
                moved = await one.moved(5.0)  # two's mark, published on the channel the rule grants
                return seen, None if moved is None else moved.low
            finally:
                await one.close()
                await two.close()

        assert asyncio.run(marks()) == (10.0, 20.0)


def test_a_user_made_by_the_documented_acl_rule_runs_the_spread_layout(redis_cluster_url: str) -> None:
    prefix = f"neardup-test-{uuid.uuid4().hex[:10]}"
    try:
        with _acl_user(redis_cluster_url, prefix, cluster=True) as url:
            spread = with_query(cluster_url(url), prefix=prefix, layout="spread")
            assert _routed_in_turn(spread, spread) == _routed_in_turn("memory://")
    finally:
        drop_cluster_namespace(cluster_url(redis_cluster_url), prefix)


# The tests above that hold for any layout of the Redis index, by name: tests/test_redis_compact.py and
# tests/test_redis_group.py collect them again (`globals().update(ANY_LAYOUT)`), each with its own `make`, `watched`
# and `race_url`.
ANY_LAYOUT: dict[str, Callable[..., None]] = {test.__name__: test for test in (
    test_a_batch_is_decided_in_rounds_of_at_most_round_messages,
    test_a_foreign_insert_while_a_read_is_ahead_is_seen,
    test_a_near_duplicate_inserted_during_a_lookup_is_seen,
    test_a_read_ahead_lost_with_its_connection_is_read_again,
    test_a_read_sent_ahead_stores_and_decides_as_reading_after_the_insert,
    test_a_reconnect_between_lookup_and_insert_never_sends_the_transaction_unguarded,
    test_a_round_sent_ahead_and_raced_is_decided_as_one_waited_for,
    test_a_round_sent_ahead_lost_with_its_connection_fails_the_batch_and_its_retry_decides_it,
    test_a_connection_lost_under_a_round_sent_ahead_after_the_next_read_fails_the_batch_as_unavailable,
    test_a_duplicate_never_names_a_message_that_lost_its_race_in_a_batch_that_failed,
    test_a_replayed_duplicate_finds_its_memo_on_any_redis,
    test_after_a_stream_every_key_has_a_ttl,
    test_an_insert_after_close_is_checked_by_the_script,
    test_an_uncontended_insert_is_a_watched_transaction_that_a_foreign_write_refuses,
    test_insert_returns_what_entered_the_buckets_since_the_lookup,
    test_own_inserts_never_conflict,
    test_random_interleavings_never_make_two_near_duplicates_unique,
    test_random_interleavings_of_workers_reading_ahead_never_make_two_near_duplicates_unique,
    test_reading_ahead_can_be_switched_off,
    test_reading_ahead_on_redis_routes_as_batch_after_batch,
    test_replay_of_an_id_never_conflicts_with_itself,
    test_route_batch_on_redis_decides_like_the_memory_index,
    test_stats_from_another_thread_while_batches_are_routed,
    test_the_next_lookup_sees_the_memos_the_batch_wrote_after_the_read_went_out,
    test_the_next_lookup_sees_what_the_batch_inserted_after_the_read_went_out,
)}


@pytest.mark.parametrize("parser", ["hiredis", "python"])
def test_replies_read_in_bulk_are_those_of_read_response(redis_url: str, parser: str) -> None:
    """Every layout's reading of replies (`read_replies`): values, nils, arrays and error replies, in order, with
    redis-py's hiredis reader or its Python one, the connection still in step afterwards."""
    from redis._parsers import _HiredisParser, _RESP2Parser

    from filters.index.redis import read_replies

    client = redis.Redis.from_url(redis_url, parser_class=_HiredisParser if parser == "hiredis" else _RESP2Parser)
    conn = client.connection_pool.get_connection()
    try:
        commands = [("SET", "{t}:x", "1"), ("HSET", "{t}:x", "f", "v"), ("GET", "{t}:x"), ("HMGET", "{t}:h", "a", "b"),
                    *[("ECHO", b"y" * 100)] * 2000]
        conn.send_packed_command(conn.pack_commands(commands))
        replies = read_replies(conn, len(commands))
        assert replies[0] is True or replies[0] == b"OK"
        assert isinstance(replies[1], redis.ResponseError) and "WRONGTYPE" in str(replies[1])
        assert replies[2:4] == [b"1", [None, None]]
        assert replies[4:] == [b"y" * 100] * 2000
        assert conn.send_command("PING") is None and conn.read_response() in (b"PONG", True)  # still in step
    finally:
        client.connection_pool.release(conn)
        client.delete("{t}:x")
        client.close()


@pytest.mark.parametrize("parser", ["hiredis", "python"])
def test_a_socket_failing_while_replies_are_read_is_a_redis_connection_error(redis_url: str, parser: str) -> None:
    """A read that the socket fails (here: closed under it) raises redis-py's ConnectionError, which the index maps
    to `IndexUnavailable`, not a bare OSError that the boundary would let through as a traceback."""
    from redis._parsers import _HiredisParser, _RESP2Parser

    from filters.index.redis import read_replies

    client = redis.Redis.from_url(redis_url, parser_class=_HiredisParser if parser == "hiredis" else _RESP2Parser)
    conn = client.connection_pool.get_connection()
    try:
        conn.send_packed_command(conn.pack_commands([("PING",)]))
        conn._sock.close()  # type: ignore[attr-defined]
        with pytest.raises(redis.ConnectionError):
            read_replies(conn, 1)
    finally:
        conn.disconnect()
        client.close()


def test_a_connection_reset_mid_command_is_an_outage_and_a_bug_of_ours_is_not(redis_url: str) -> None:
    """redis-py's asyncio connection reset while a command is written leaves its writer None and raises an
    AttributeError inside redis-py (not a ConnectionError): at the boundary it is an outage the worker waits
    out (`IndexUnavailable`), not a crash. An AttributeError of neardup's own code stays what it is."""
    import redis.asyncio as aioredis

    from filters.index.redis import redis_errors

    async def go() -> None:
        client = aioredis.Redis.from_url(redis_url)
        conn = await client.connection_pool.get_connection()
        try:
            await conn.connect()
            conn._writer = None  # what a reset of the peer, seen by another task, leaves while a command is sent
            with pytest.raises(IndexUnavailable, match="reset mid-command"), redis_errors("here"):
                await conn._send_packed_command(conn.pack_command("PING"))
            with pytest.raises(AttributeError), redis_errors("here"):
                cast(Any, None).writelines()
        finally:
            await conn.disconnect()
            await client.aclose()

    asyncio.run(go())
