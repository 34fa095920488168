"""The compact slot layout's stored forms (filters/index/compact_codec.py): records, the bits of a slice, trimming."""

from __future__ import annotations

import math
from itertools import pairwise

import numpy as np
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from filters.errors import IndexCorrupt
from filters.index import compact_codec as cc


def test_a_record_is_16_bytes_and_ends_with_its_seq() -> None:
    value = cc.record(1700000000.5, 42)
    assert len(value) == cc.RECORD_SIZE == 16
    assert value[-8:] == (42).to_bytes(8, "big")  # the tail the insert checks, as in the layout before
    assert cc.parse_records(value + cc.record(3.0, 7)) == [(1700000000.5, 42), (3.0, 7)]
    assert cc.LISTPACK_VALUE // cc.RECORD_SIZE == 4


def test_bytes_that_are_not_records_are_refused() -> None:
    with pytest.raises(IndexCorrupt):
        cc.parse_records(cc.record(1.0, 1)[:-1])


def test_a_slice_gets_the_small_hashes_the_slice_before_it_filled() -> None:
    assert cc.slice_bits(None) == cc.K_FIRST
    assert cc.slice_bits(15_000) == 12  # 195,000 fields in 4,096 hashes of ~48
    assert cc.slice_bits(0) == cc.slice_bits(5) == cc.K_MIN
    assert cc.slice_bits(10**12) == cc.K_MAX
    for previous in (100, 15_000, 5_600_000_000):
        bits = cc.slice_bits(previous)
        assert previous * cc.FIELDS_PER_ENTRY / 2**bits <= cc.SMALL_FILL or bits == cc.K_MAX
        assert previous * cc.FIELDS_PER_ENTRY / 2**bits > cc.SMALL_FILL / 2 or bits == cc.K_MIN


def test_trimming_keeps_the_newest_in_insertion_order() -> None:
    records = [(5.0, 1), (9.0, 2), (1.0, 3), (9.0, 4), (7.0, 5)]
    value = b"".join(cc.record(ts, seq) for ts, seq in records)
    assert cc.parse_records(cc.trim_records(value, 3)) == [(9.0, 2), (9.0, 4), (7.0, 5)]
    assert cc.trim_records(value, 5) == value


def test_ranking_counts_seqs_and_leaves_the_query_own_out() -> None:
    a = cc.record(10.0, 1) + cc.record(11.0, 2)
    b = cc.record(11.0, 2) + cc.record(12.0, 3)
    assert cc.rank_records([[a, b]], [0, 1], 0, 1, 8, 0.0, 64) == [(2, 2, 0, 11.0), (3, 1, 1, 12.0), (1, 1, 0, 10.0)]
    assert cc.rank_records([[a, b]], [0, 1], 2, 1, 8, 0.0, 64) == [(3, 1, 1, 12.0), (1, 1, 0, 10.0)]
    assert cc.rank_records([[a, b]], [0, 1], 0, 1, 8, 10.5, 64) == [(2, 2, 0, 11.0), (3, 1, 1, 12.0)]


def test_fields_land_in_small_hashes_that_stay_listpacks_and_read_back(redis_url: str) -> None:
    """A slice's fields written by `write_commands` into a real Redis read back by `read_commands` as written:
    buckets and ids in small listpack hashes, a bucket of more than 4 records in the slice hash behind its
    mark, entries and memos in the slice hash; every key with a TTL."""
    client = redis.Redis.from_url(redis_url)
    slice_key = "{test-compact:ns}:c:7"
    client.delete(slice_key, *(cc.small_key(slice_key, j) for j in range(16)))
    bits = 4
    buckets = {b"b" + (i * 0x9E3779B97F4A7C15 % 2**64).to_bytes(8, "big"): b"".join(
        cc.record(float(i), i * 10 + r) for r in range(1 + (i % 9 == 0) * 5)) for i in range(1, 400)}
    ids = {cc.id_field(f"msg-{i}"): cc.record(float(i), i) for i in range(200)}
    long_id = cc.id_field("x" * 80)
    entries = {cc.entry_field(i): cc.entry_value(b"\x03" + bytes(300), f"msg-{i}") for i in range(200)}
    memo = {b"dmsg-3": b"memo" * 30}
    fields = buckets | ids | entries | memo | {long_id: cc.record(1.0, 999)}
    pairs = [x for kv in fields.items() for x in kv]
    commands = cc.write_commands(slice_key, pairs, bits, set(), 200, 1, 60_000, 100)
    pipe = client.pipeline(transaction=False)
    for command in commands:
        pipe.execute_command(*command)
    pipe.execute()
    names = [*fields, b"b" + bytes(8), b"dmsg-4"]
    reads, places = cc.read_commands(slice_key, names, bits, set(), 50)
    pipe = client.pipeline(transaction=False)
    for command in reads:
        pipe.execute_command(*command)
    column = cc.column_of(pipe.execute(), places, len(names))
    marked = cc.marked_places(column)
    assert {names[p] for p in marked} == {f for f, v in buckets.items() if len(v) > cc.LISTPACK_VALUE} != set()
    again = client.hmget(slice_key, [names[p] for p in marked])
    for p, value in zip(marked, again):
        column[p] = value
    assert dict(zip(names, column)) == fields | {b"b" + bytes(8): None, b"dmsg-4": None}
    assert client.hmget(slice_key, "n", "m") == [b"200", b"1"]
    for j in range(2**bits):
        key = cc.small_key(slice_key, j)
        assert client.object("encoding", key) == b"listpack"
        assert 0 < client.pttl(key) <= 60_000
    assert client.object("encoding", slice_key) == b"hashtable" and 0 < client.pttl(slice_key) <= 60_000
    # A bucket known to be marked is read, and written, in the slice hash straight away.
    mark = names[marked[0]]
    reads, places = cc.read_commands(slice_key, [mark], bits, {mark}, 50)
    assert reads == [("HMGET", slice_key, mark)]
    assert cc.write_commands(slice_key, [mark, cc.record(1.0, 1)], bits, {mark}, 0, 0, 5, 100) == [
        ("HSET", slice_key, mark, cc.record(1.0, 1)), ("PEXPIRE", slice_key, 5)]
    client.delete(slice_key, *(cc.small_key(slice_key, j) for j in range(16)))


def test_an_entry_carries_its_id() -> None:
    for id in ("a", "ünï", "x\udc80", "y" * 300):
        assert cc.split_entry_value(cc.entry_value(b"\x03blob", id)) == (b"\x03blob", id)
    for bad in (b"", b"\x05\x00", b"ab\xff\x01\x00"):
        with pytest.raises(IndexCorrupt):
            cc.split_entry_value(bad)


def test_a_restore_expects_the_entries_of_its_rate_in_a_slice() -> None:
    times = [1000.0 + i * 0.02 for i in range(5000)]  # 5,000 in 100 s of a slice of 1,000 s: 50,000 a slice
    [(slice_, expected)] = cc.expected_counts(times, 1000.0).items()
    assert slice_ == 1 and 50_000 <= expected <= 50_020
    assert cc.expected_counts([5.0] * 10 + [995.0], 1000.0) == {0: 12}  # the whole slice covered: their count
    assert cc.expected_counts([7.0] * 3, 1000.0) == {0: 3 * 1024}  # one moment: at most 1,024 times


@settings(max_examples=200, deadline=None)
@given(data=st.data(), n=st.integers(0, 14), cap=st.integers(1, 3))
def test_a_rebuild_holds_what_the_insert_round_writes(data: st.DataObject, n: int, cap: int) -> None:
    """The bucket and id fields a rebuild holds and writes at the end (`held_pairs` of the entries it took) are
    what the uncontended insert round (`alone_round`) leaves, in the order it first writes them; held in two
    pieces, the second going on from what the first wrote (a rebuild that wrote what it held midway), the same
    values."""
    ids = data.draw(st.lists(st.sampled_from(["a", "b", "c"]), min_size=n, max_size=n))
    keys_of = [data.draw(st.lists(st.integers(0, 5), max_size=5)) for _ in ids]
    times = [data.draw(st.sampled_from([20.0, 90.0, 150.0, 199.0])) for _ in ids]
    names = [b"b" + k.to_bytes(8, "big") for k in range(6)] + [cc.id_field(id) for id in "abc"]
    fields_of = [[names[k] for k in dict.fromkeys(keys)] for keys in keys_of]
    places_of = [list(dict.fromkeys(keys)) for keys in keys_of]
    results, groups, _, _, _ = cc.alone_round(
        ids, times, [b"\x03x"] * n, fields_of, places_of, [6 + "abc".index(id) for id in ids], (0,),
        {0: [None] * len(names)}, {0: {}}, -math.inf, 100.0, 1000.0, cap, 0)
    pairs = groups[0][1] if groups else []
    expected = {name: value for name, value in zip(pairs[0::2], pairs[1::2], strict=True) if name[:1] != b"e"}
    took = [i for i, seq in enumerate(results) if seq > 0]

    def held(at: list[int], olds: dict[bytes, bytes]) -> list[bytes]:
        keys = np.asarray([k for i in at for k in keys_of[i]], dtype=np.uint64)
        bounds = np.cumsum([0, *(len(keys_of[i]) for i in at)])
        return cc.held_pairs(keys, bounds, [times[i] for i in at], [results[i] for i in at], [ids[i] for i in at],
                             olds, cap, False)

    assert held(took, {}) == [x for pair in expected.items() for x in pair]
    cut = data.draw(st.integers(0, len(took)))
    first = held(took[:cut], {})
    written = dict(zip(first[0::2], first[1::2], strict=True))
    second = held(took[cut:], written)
    assert written | dict(zip(second[0::2], second[1::2], strict=True)) == expected
    # Written a share of the small hashes at a time (each share its bucket keys and its ids): each share's
    # pairs are the whole's of that share, in the same order.
    keys = np.asarray([k for i in took for k in keys_of[i]], dtype=np.uint64)
    bounds = np.cumsum([0, *(len(keys_of[i]) for i in took)])
    whole = held(took, {})
    for share in range(4):
        mine = [cc.small_hash(int(k), 2) == share for k in keys]
        sizes = [sum(mine[a:b]) for a, b in pairwise(bounds)]
        shares = cc.id_shares([ids[i] for i in took], 2)
        part = cc.held_pairs(keys[mine] if len(keys) else keys, np.cumsum([0, *sizes]), [times[i] for i in took],
                             [results[i] for i in took], [ids[i] if j == share else None for i, j in zip(took, shares)],
                             {}, cap, False)
        assert part == [x for a in range(0, len(whole), 2) if (cc.field_hash(whole[a], 2) or 0) == share
                        for x in whole[a : a + 2]]
