"""The group layout's stored forms (filters/index/group_codec.py) and their compiled twins (filters/_native's
`group_*`, from filters/index/_group_codec.pxi): the same bytes, by hypothesis."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from filters import _native
from filters.errors import IndexCorrupt
from filters.index import compact_codec as cc
from filters.index import group_codec as gc
from filters.index.redis_codec import SEQ

U64 = (1 << 64) - 1
_TIMES = [1.0, 2.5, 2.5, 7.0, -3.0]


def _rec(key: bytes, ts: float, seq: int, is_id: bool = False) -> bytes:
    return key + gc._TS.pack(ts) + gc._SEQ.pack(seq | (gc.ID_TAG if is_id else 0))


# A group: records of a few keys (some of them ids), seqs distinct.
_keys = st.sampled_from([b"\x00\x00\x00\x01", b"\xff\x00\x00\x01", b"abcd", b"\x00\x00\x00\x00"])


@st.composite
def groups(draw: st.DrawFn) -> bytes:
    rows = draw(st.lists(st.tuples(_keys, st.sampled_from(_TIMES), st.booleans()), max_size=40))
    return b"".join(_rec(key, ts, seq + 1, is_id) for seq, (key, ts, is_id) in enumerate(rows))


def test_a_record_is_20_bytes_its_seq_last() -> None:
    value = gc.append_record(b"", b"abcd", 1700000000.5, 42, 4)
    assert len(value) == gc.RECORD_SIZE == 20
    assert value[:4] == b"abcd" and value[-8:] == (42).to_bytes(8, "big")
    assert gc.bucket_records(value, b"abcd") == cc.record(1700000000.5, 42)  # the compact layout's value
    assert gc.bucket_tail(value, b"abcd") == (42).to_bytes(8, "big")
    assert gc.bucket_tail(value, b"abce") == gc.ABSENT


def test_a_key_and_an_id_name_their_group_and_record_key_from_one_mixed_value() -> None:
    key = 0x0123456789ABCDEF
    m = key * 0x9E3779B97F4A7C15 & U64
    assert gc.group_of(key, 15) == m >> 49 == cc.small_hash(key, 15)  # compact's small hash: the same top bits
    assert gc.record_key(key) == (m & 0xFFFFFFFF).to_bytes(4, "big")
    assert gc.place(b"b" + key.to_bytes(8, "big"), 15) == (m >> 49, gc.record_key(key), False)
    h = cc.id_hash("msg-1")
    assert gc.place(b"imsg-1", 12) == (gc.group_of(h, 12), gc.record_key(h), True)
    assert gc.place(b"dmsg-1", 12) is None and gc.place(b"e" + bytes(8), 12) is None
    with pytest.raises(ValueError):
        gc.group_of(1 << 64, 3)


def test_a_slice_gets_the_groups_the_slice_before_it_filled() -> None:
    assert gc.slice_bits(None) == gc.K_FIRST
    assert gc.slice_bits(0) == gc.slice_bits(5) == gc.K_MIN
    assert gc.slice_bits(10**12) == gc.K_MAX
    for previous in (100, 45_000, 200_000, 5_600_000_000):
        bits = gc.slice_bits(previous)
        assert previous * cc.FIELDS_PER_ENTRY / 2**bits <= gc.GROUP_FILL or bits == gc.K_MAX
        assert previous * cc.FIELDS_PER_ENTRY / 2**bits > gc.GROUP_FILL / 2 or bits == gc.K_MIN


def test_a_bucket_is_found_among_others_and_ids_apart() -> None:
    g = (_rec(b"aaaa", 1.0, 1) + _rec(b"bbbb", 2.0, 2) + _rec(b"aaaa", 3.0, 3, is_id=True) + _rec(b"aaaa", 4.0, 4)
         + _rec(b"aaaa", 0.5, 9, is_id=True))
    assert gc.bucket_records(g, b"aaaa") == cc.record(1.0, 1) + cc.record(4.0, 4)
    assert gc.id_record(g, b"aaaa") == cc.record(3.0, 3)  # the newest of an id's records, its tag cleared
    assert gc.id_record(g, b"bbbb") is None and gc.bucket_records(g, b"cccc") is None
    assert gc.bucket_records(None, b"aaaa") is None and gc.id_record(b"", b"aaaa") is None
    with pytest.raises(IndexCorrupt):
        gc.bucket_records(g[:-1], b"aaaa")


def test_trimming_keeps_a_buckets_newest_in_place() -> None:
    recs = [(5.0, 1), (9.0, 2), (1.0, 3), (9.0, 4), (7.0, 5)]
    g = b"".join(_rec(b"aaaa", ts, seq) + _rec(b"bbbb", ts, 100 + seq) for ts, seq in recs)
    out = gc.trim_bucket(g, b"aaaa", 3)
    assert gc.bucket_records(out, b"aaaa") == cc.trim_records(gc.bucket_records(g, b"aaaa") or b"", 3)
    assert gc.bucket_records(out, b"bbbb") == gc.bucket_records(g, b"bbbb")
    assert gc.trim_bucket(g, b"aaaa", 5) == g
    # Appending trims first once the bucket holds more than twice the cap, as the compact layout's round does.
    assert gc.append_record(g, b"aaaa", 8.0, 6, 2) == gc.trim_bucket(g, b"aaaa", 2) + _rec(b"aaaa", 8.0, 6)
    assert gc.append_record(g, b"aaaa", 8.0, 6, 3) == g + _rec(b"aaaa", 8.0, 6)


@settings(max_examples=300, deadline=None)
@given(group=groups(), key=_keys, cap=st.integers(1, 8), ts=st.sampled_from(_TIMES), seq=st.integers(1, U64 >> 1))
def test_the_compiled_record_loops_as_the_reference(group: bytes, key: bytes, cap: int, ts: float, seq: int) -> None:
    assert _native.group_bucket_records(group, key) == gc.bucket_records(group, key)
    assert _native.group_id_record(group, key) == gc.id_record(group, key)
    assert _native.group_trim_bucket(group, key, cap) == gc.trim_bucket(group, key, cap)
    assert _native.group_append_record(group, key, ts, seq, cap) == gc.append_record(group, key, ts, seq, cap)
    assert _native.group_append_id(group, key, ts, seq) == gc.append_id(group, key, ts, seq)
    assert _native.group_count_buckets([group, group]) == gc.count_buckets([group, group])
    # What a bucket's records are after an append: the compact layout's value, trimmed past twice the cap.
    before = gc.bucket_records(group, key) or b""
    after = gc.bucket_records(gc.append_record(group, key, ts, seq, cap), key)
    kept = cc.trim_records(before, cap) if len(before) > 2 * cap * 16 else before
    assert after == kept + cc.record(ts, seq)


_names = st.one_of(
    st.integers(0, 40).map(lambda k: b"b" + ((k * 0x0101010101 if k % 3 else k << 59) & U64).to_bytes(8, "big")),
    st.sampled_from(["a", "b", "é", "x" * 70]).map(lambda id: b"i" + id.encode()),
    st.sampled_from([b"da", b"db", b"n"]),
)


@settings(max_examples=200, deadline=None)
@given(names=st.lists(_names, unique=True, max_size=20), bits=st.one_of(st.none(), st.integers(0, 4)),
       data=st.data())
def test_the_compiled_reads_as_the_reference(names: list[bytes], bits: int | None, data: st.DataObject) -> None:
    fields, places = gc.read_fields(names, bits)
    assert _native.group_read_fields(names, bits) == (fields, places)
    assert len(set(fields)) == len(fields)
    values = [data.draw(st.one_of(st.none(), groups())) for _ in fields]
    column = gc.column_of(values, places, names, bits)
    assert _native.group_column_of(values, places, names, bits) == column
    for name, k, value in zip(names, places, column):
        where = gc.place(name, bits or 0)
        if bits is None and where is not None:
            assert k == -1 and value is None
        elif where is None:
            assert fields[k] == name and value == values[k]
        else:
            assert fields[k] == gc.group_field(where[0])


@settings(max_examples=200, deadline=None)
@given(bits=st.integers(0, 3), cap=st.integers(1, 3),
       rows=st.lists(st.tuples(st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True), st.integers(0, 2),
                               st.sampled_from(_TIMES)), max_size=12))
def test_a_round_goes_into_the_groups_as_the_compact_round_into_its_fields(
        bits: int, cap: int, rows: list[tuple[list[int], int, float]]) -> None:
    """`apply_round` (and its twin) leaves each bucket and id of the groups with what the compact layout's
    round leaves in its fields: the view's columns stay the compact layout's."""
    names = [b"b" + (k * 0x0123456789).to_bytes(8, "big") for k in range(8)] + [b"ia", b"ib", b"ic"]
    entries = [(seq, ts, keys, 8 + who) for seq, (keys, who, ts) in enumerate(rows, start=1)]
    groups_py: dict[bytes, bytes] = {}
    groups_c: dict[bytes, bytes] = {}
    changed = gc.apply_round(groups_py, names, bits, entries, cap)
    assert _native.group_apply_round(groups_c, names, bits, entries, cap) == changed
    assert groups_c == groups_py
    compact: dict[int, bytes] = {}
    for seq, ts, keys, e in entries:
        rec = cc.record(ts, seq)
        for p in keys:
            v = compact.get(p)
            compact[p] = rec if v is None else (cc.trim_records(v, cap) if len(v) > 2 * cap * 16 else v) + rec
        compact[e] = rec
    fields, places = gc.read_fields(names, bits)
    column = gc.column_of([groups_py.get(f) for f in fields], places, names, bits)
    for p, name in enumerate(names):
        if name[:1] == b"b":
            assert column[p] == compact.get(p)
        else:
            newest = max(((ts, seq) for seq, ts, _, e in entries if e == p), default=None)
            assert column[p] == (None if newest is None else cc.record(*newest))


@settings(max_examples=200, deadline=None)
@given(names=st.lists(_names, unique=True, max_size=24), bits=st.one_of(st.none(), st.integers(0, 4)),
       per_command=st.integers(1, 5), data=st.data())
def test_a_slices_packed_read_and_its_column_as_the_reference(names: list[bytes], bits: int | None, per_command: int,
                                                              data: st.DataObject) -> None:
    """`pack_reads` (the HMGETs of `read_fields` and the count's HGET, as RESP) and `slice_column` (the column
    and the groups read, from those HMGETs' replies), compiled as the reference."""
    blob, n, fields, places = gc.pack_reads("{p:ns}:g:7", names, bits, per_command)
    assert _native.group_pack_reads("{p:ns}:g:7", names, bits, per_command) == (blob, n, fields, places)
    cache: list[bytes | None] = [None] * 8  # the fields made kept from call to call (groups 0-7): the same result
    for _ in range(2):
        assert _native.group_pack_reads("{p:ns}:g:7", names, bits, per_command, cache) == (blob, n, fields, places)
    assert all(f is None or f == gc.group_field(j) for j, f in enumerate(cache))
    assert (fields, places) == gc.read_fields(names, bits)
    reads = [("HMGET", "{p:ns}:g:7", *fields[a : a + per_command]) for a in range(0, len(fields), per_command)]
    assert blob == cc.resp([*reads, ("HGET", "{p:ns}:g:7", "n")]) and n == len(reads)
    values = [data.draw(st.one_of(st.none(), groups())) for _ in fields]
    replies = [values[a : a + per_command] for a in range(0, len(values), per_command)]
    column, flat = gc.slice_column(replies, places, names, bits, fields)
    assert _native.group_slice_column(replies, places, names, bits, fields) == (column, flat)
    assert column == gc.column_of(values, places, names, bits) and flat == values
    assert gc.groups_read(fields, values) == {f: v for f, v in zip(fields, values) if v is not None and f[:1] == b"g"}
    with pytest.raises(ValueError):
        _native.group_slice_column([*replies, [None]], places, names, bits, fields)
    # Fields written since the read went out (whole groups, memos; some the read did not read), each put in its
    # place first: the column and values of a read made after them.
    written = {f: data.draw(groups()) for f in data.draw(st.lists(st.sampled_from([*fields, b"g99", b"g007", b"dx"]),
                                                                  unique=True))}
    now = [written.get(f, v) for f, v in zip(fields, values)]
    over = gc.slice_column(replies, places, names, bits, fields, written)
    assert over == (gc.column_of(now, places, names, bits), now)
    assert _native.group_slice_column(replies, places, names, bits, fields, written) == over
    assert _native.group_slice_column(replies, places, names, bits, fields, {}) == (column, flat)


def test_a_name_spelt_as_a_group_is_read_as_the_reference() -> None:
    """A field of the slice hash spelt b"g<j>" shares the group's field (the reference's one dict of fields)."""
    key = b"b" + (5).to_bytes(8, "big")
    j = gc.place(key, 3)
    assert j is not None
    names = [key, b"g%d" % j[0], b"g99", b"imsg"]
    assert _native.group_pack_reads("k", names, 3, 2) == gc.pack_reads("k", names, 3, 2)
    assert gc.read_fields(names, 3)[1][:2] == [0, 0]
    _, _, fields, places = gc.pack_reads("k", names, 3, 2)
    replies = [[None] * len(fields)]
    written = {b"g%d" % j[0]: _rec(j[1], 1.0, 3), b"g99": _rec(b"abcd", 2.0, 4), b"imsg": b"x"}
    over = gc.slice_column(replies, places, names, 3, fields, written)
    assert over[0][0] == cc.record(1.0, 3) and over[0][2] == _rec(b"abcd", 2.0, 4)
    assert _native.group_slice_column(replies, places, names, 3, fields, written) == over


_GROUP_NAMES = [b"b" + (k * 0x0123456789).to_bytes(8, "big") for k in range(8)] + [b"ia", b"ib", b"ic"]


@settings(max_examples=300, deadline=None)
@given(bits=st.integers(0, 3), cap=st.integers(1, 3),
       rows=st.lists(st.tuples(st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True), st.integers(0, 2),
                               st.sampled_from(_TIMES)), max_size=16),
       base=st.lists(st.one_of(st.none(), groups()), min_size=8, max_size=8),
       since=st.lists(st.one_of(st.none(), groups()), min_size=8, max_size=8), unread=st.booleans(),
       length=st.sampled_from([1.0, 2.5, 4.0]), s=st.integers(-1, 2))
def test_a_slices_writes_as_the_reference(bits: int, cap: int, rows: list[tuple[list[int], int, float]],
                                          base: list[bytes | None], since: list[bytes | None], unread: bool,
                                          length: float, s: int) -> None:
    """`slice_writes`, compiled as the reference: the groups read (by the place of each name's field) and those
    written since (in their place) left as they were, the groups changed those `apply_round` leaves of the
    slice's rows, then the entries of the compact layout's pairs."""
    names = [*_GROUP_NAMES, b"dmemo"]
    fields, places = gc.read_fields(names, bits)
    read = None if unread else (fields, places, [base[k % 8] if f[:1] == b"g" else b"memo" for k, f in enumerate(fields)])
    written = {gc.group_field(j): g for j, g in enumerate(since) if g is not None and j < 1 << bits}
    entries = [(seq, ts, keys, 8 + who) for seq, (keys, who, ts) in enumerate(rows, start=1)]
    pairs = [b"ia", b"x" * 16, cc.entry_field(3), b"entry-3", names[0], b"y" * 16, cc.entry_field(9), b"e9"]
    before = (dict(written), None if read is None else list(read[2]))
    flat, taken = gc.slice_writes(written, read, names, bits, entries, s, length, cap, pairs)
    assert _native.group_slice_writes(written, read, names, bits, entries, s, length, cap, pairs) == (flat, taken)
    assert (written, None if read is None else read[2]) == before
    applied = {**(gc.groups_read(fields, read[2]) if read is not None else {}), **written}
    mine = [e for e in entries if e[1] // length == s]
    changed = gc.apply_round(applied, names, bits, mine, cap)
    assert flat == [x for f in changed for x in (f, applied[f])] + pairs[2:4] + pairs[6:8]
    assert list(taken) == [fields.index(f) if read is not None and f not in written else -1 for f in changed]
    twin = {**(gc.groups_read(fields, read[2]) if read is not None else {}), **written}
    assert _native.group_apply_round(twin, names, bits, mine, cap) == changed and twin == applied
    # Kept once Redis took them: the next round finds what this one left, compiled as the reference.
    kept = []
    for keep in (gc.keep_written, _native.group_keep_written):
        groups, values, also = dict(written), None if read is None else list(read[2]), {}
        keep(groups, values, flat, taken, also)
        assert also == {f: applied[f] for f in changed}
        assert {**(gc.groups_read(fields, values) if values is not None else {}), **groups} == applied
        kept.append((groups, values))
    assert kept[0] == kept[1]


_ROUND_IDS = ["a", "b", "ü", "x\udc80"]


def _compact_value(records: list[tuple[float, int]]) -> bytes | None:
    return b"".join(cc.record(ts, seq) for ts, seq in records) if records else None


@settings(max_examples=300, deadline=None)
@given(data=st.data(), n_buckets=st.integers(1, 6), n_entries=st.integers(0, 8), cap=st.integers(1, 3),
       hwm=st.sampled_from([-float("inf"), 120.0, 180.0]), bits=st.sampled_from([0, 1, 2, 3]))
def test_a_rounds_decisions_and_groups_at_once_as_the_reference(data: st.DataObject, n_buckets: int, n_entries: int,
                                                                cap: int, hwm: float, bits: int) -> None:
    """`alone_groups`, compiled as the reference: the compact layout's round over the columns (live ids read or
    written earlier in the round, entries outside the window, entries in two slices, buckets shared, values
    trimmed: the same results, seqs, writes and entries), its records put into each slice's groups as
    `slice_writes` puts them (groups read, written since, not read; trims), without the pairs of buckets and ids."""
    ids = data.draw(st.lists(st.sampled_from(_ROUND_IDS), min_size=n_entries, max_size=n_entries))
    names = [b"b" + (k * 0x0123456789ABCD).to_bytes(8, "big") for k in range(n_buckets)]
    names += [cc.id_field(id) for id in _ROUND_IDS] + [b"dmemo"]
    id_at = {id: n_buckets + k for k, id in enumerate(_ROUND_IDS)}
    slices = (0, 1)
    record = st.integers(1, 60).map(lambda seq: (_TIMES[seq % 5] * 30, seq))
    columns = {s: data.draw(st.lists(st.none() | st.lists(record, min_size=1, max_size=10).map(_compact_value),
                                     min_size=len(names), max_size=len(names))) for s in slices}
    for s in slices:  # an i<id> holds one record
        for p in id_at.values():
            if columns[s][p] is not None:
                columns[s][p] = columns[s][p][:16]  # type: ignore[index]
    places_of = [data.draw(st.lists(st.integers(0, n_buckets - 1), unique=True, max_size=n_buckets)) for _ in ids]
    times = [data.draw(st.sampled_from([20.0, 90.0, 150.0, 199.0])) for _ in ids]
    blobs = [b"\x03entry%d" % i for i in range(len(ids))]
    sides = {}
    for s in slices:
        fields, places = gc.read_fields(names, bits)
        base = data.draw(st.lists(st.one_of(st.none(), groups()), min_size=len(fields), max_size=len(fields)))
        read = None if data.draw(st.booleans()) else (
            fields, places, [base[k] if f[:1] == b"g" else b"memo" for k, f in enumerate(fields)])
        since = data.draw(st.lists(st.one_of(st.none(), groups()), min_size=1 << bits, max_size=1 << bits))
        sides[s] = (bits, {gc.group_field(j): g for j, g in enumerate(since) if g is not None}, read,
                    data.draw(st.booleans()))
    before = {s: (dict(w), None if r is None else list(r[2])) for s, (_, w, r, _) in sides.items()}
    # What earlier rounds of the view wrote: ids everywhere, bucket values where a slice keeps them whole.
    earlier: dict[int, dict[int, bytes]] = {s: {} for s in slices}
    for s in slices:
        for p in data.draw(st.lists(st.sampled_from(sorted(id_at.values())), unique=True, max_size=2)):
            earlier[s][p] = cc.record(data.draw(st.sampled_from([20.0, 150.0])), 41)
        if sides[s][3]:
            for p in data.draw(st.lists(st.integers(0, n_buckets - 1), unique=True, max_size=n_buckets)):
                earlier[s][p] = _compact_value(data.draw(st.lists(record, min_size=1, max_size=8)))  # type: ignore[assignment]

    def run(round_: object, *also: bool) -> tuple[object, ...]:
        writes: dict[int, dict[int, bytes]] = {s: dict(w) for s, w in earlier.items()}
        out = round_(list(ids), list(times), blobs, places_of, [id_at[id] for id in ids], slices,  # type: ignore[operator]
                     {s: list(c) for s, c in columns.items()}, writes, hwm, 100.0, 100.0, cap, 40, names, sides, *also)
        return (*out, writes)

    got = run(gc.alone_groups)
    assert run(_native.group_alone_groups) == got
    assert run(_native.group_alone_groups, False) == got == run(gc.alone_groups, False)
    with_also = run(gc.alone_groups, True)
    assert run(_native.group_alone_groups, True) == with_also
    for s, (count, flat, taken, changed) in with_also[1].items():  # type: ignore[attr-defined]
        assert changed == dict(zip(flat[0 : 2 * len(taken) : 2], flat[1 : 2 * len(taken) : 2]))
        assert got[1][s] == (count, flat, taken, None)  # type: ignore[index]
    assert {s: (dict(w), None if r is None else list(r[2])) for s, (_, w, r, _) in sides.items()} == before
    # The reference is the compact layout's round (less its pairs of buckets and ids) and `slice_writes` after it;
    # its writes those of the compact round, but a slice not kept whole keeps its bucket values as they were.
    results, out, pending, _, seq, writes = got
    compact = run(lambda *a: cc.alone_round(*a[:3], [[names[p] for p in ps] for ps in a[3]], *a[3:13]))
    assert (compact[0], compact[2], compact[4]) == (results, pending, seq)
    bucket_places = set(range(n_buckets))
    for s in slices:
        want = dict(compact[5][s]) if sides[s][3] else {  # type: ignore[index]
            p: v for p, v in compact[5][s].items() if p not in bucket_places or p in earlier[s]}  # type: ignore[index]
        assert writes[s] == want  # type: ignore[index]
    # A field's tail (`_View.settle_tails`): the seq of the round's last entry written there, as its value ends.
    last: dict[tuple[int, int], int] = {}
    for entry_seq, s, ps in pending:  # type: ignore[attr-defined]
        last.update(dict.fromkeys(((s, p) for p in ps), entry_seq))
    assert all(compact[5][s][p][-8:] == SEQ.pack(t) for (s, p), t in last.items())  # type: ignore[index]
    assert set(out) == set(compact[1]) and all(out[s][0] == compact[1][s][0] for s in out)  # type: ignore[index]
    assert all(sum(1 for _, t, _ in pending if t == s) == count for s, (count, _, _, _) in out.items())
    for s, (count, flat, _, _) in out.items():
        assert flat[-2 * count :] == [x for a in range(0, len(compact[1][s][1]), 2)  # type: ignore[index]
                                      if compact[1][s][1][a][:1] == b"e" for x in compact[1][s][1][a : a + 2]]  # type: ignore[index]


def test_trimming_equal_records_keeps_the_first_as_the_reference() -> None:
    """Of a bucket's records equal in event time and seq (0.0 and -0.0: equal, not the same bytes; never written so,
    but a group read may hold anything), the trim keeps the first, compiled as the reference."""
    key = gc.record_key(7)
    group = b"".join(_rec(key, ts, 5) for ts in (0.0, -0.0, -0.0, 0.0, -0.0, 0.0))
    names = [b"b" + (7).to_bytes(8, "big"), b"ia"]
    field = gc.group_field(gc.group_of(7, 0))
    got = gc.slice_writes({field: group}, None, names, 0, [(99, -1.0, [0], 1)], -1, 10.0, 2, [])
    assert _native.group_slice_writes({field: group}, None, names, 0, [(99, -1.0, [0], 1)], -1, 10.0, 2, []) == got
    assert got[0][0] == field and got[0][1][:40] == group[:40]  # the first two kept
    assert gc.trim_bucket(group, key, 2) == _native.group_trim_bucket(group, key, 2) == group[:40]


def test_a_corrupt_group_is_refused_when_written() -> None:
    names = [b"b" + (7).to_bytes(8, "big"), b"ia"]
    field = gc.group_field(gc.group_of(7, 0))
    for slice_writes in (gc.slice_writes, _native.group_slice_writes):
        with pytest.raises(IndexCorrupt):
            slice_writes({field: b"x" * 21}, None, names, 0, [(1, 1.0, [0], 1)], 0, 10.0, 2, [])
        with pytest.raises(IndexCorrupt):  # read so
            slice_writes({}, ([field], [0, 0], [b"x" * 21]), names, 0, [(1, 1.0, [0], 1)], 0, 10.0, 2, [])


@settings(max_examples=100, deadline=None)
@given(flat=st.lists(st.binary(max_size=30), max_size=14).map(lambda xs: xs[: len(xs) // 2 * 2]),
       per_command=st.sampled_from([2, 4, 6]), entries=st.integers(-3, 600), ttl=st.integers(0, 10**12))
def test_a_slices_packed_writes_as_the_reference(flat: list[bytes], per_command: int, entries: int, ttl: int) -> None:
    """`pack_writes`: the HSETs of a round's arguments, the count's HINCRBY and the TTL, as RESP; compiled as the
    reference."""
    blob, n = gc.pack_writes("{p:ns}:g:3", flat, per_command, entries, ttl)
    assert _native.group_pack_writes("{p:ns}:g:3", flat, per_command, entries, ttl) == (blob, n)
    hsets = [("HSET", "{p:ns}:g:3", *flat[a : a + per_command]) for a in range(0, len(flat), per_command)]
    assert blob == cc.resp([*hsets, ("HINCRBY", "{p:ns}:g:3", "n", entries), ("PEXPIRE", "{p:ns}:g:3", ttl)])
    assert n == len(hsets) + 2
    for pack in (gc.pack_writes, _native.group_pack_writes):
        with pytest.raises(ValueError):
            pack("k", [b"a"], 2, 1, 1)

_ids = ["a", "b", "é", "x" * 70, "\udcff"]


@settings(max_examples=200, deadline=None)
@given(bits=st.sampled_from([0, 1, 2, 3, 4, 20, gc.K_MAX]), cap=st.integers(0, 3), share_bits=st.integers(0, 2),
       data=st.data(),
       rows=st.lists(st.tuples(st.lists(st.integers(0, 9), max_size=5), st.sampled_from(_ids),
                               st.sampled_from(_TIMES)), max_size=16))
def test_a_rebuilds_groups_are_what_its_rounds_leave_entry_after_entry(
        bits: int, cap: int, share_bits: int, data: st.DataObject, rows: list[tuple[list[int], str, float]]) -> None:
    """`held_groups` (and its twin) makes each group once, as `apply_round` leaves it after the same entries one
    after another from what Redis held (`olds`; a key given twice by an entry counts once), share by share (the
    twin counts the records of a share of few groups into place, and sorts those of many)."""
    share_bits = min(share_bits, bits)
    hashes = [(k * 0x0123456789ABCDEF if k % 4 else k << 60) & U64 for k in range(10)]
    names = [b"b" + h.to_bytes(8, "big") for h in hashes] + [cc.id_field(id) for id in _ids]
    olds = {gc.group_field(j): data.draw(groups()) for j in data.draw(st.sets(st.integers(0, (1 << bits) - 1)))}
    expected = dict(olds)
    entries = [(seq, ts, list(dict.fromkeys(keys)), 10 + _ids.index(id))
               for seq, (keys, id, ts) in enumerate(rows, start=1)]
    changed = gc.apply_round(expected, names, bits, entries, cap)
    keys = [hashes[k] for keys, _, _ in rows for k in keys]
    bounds = [0]
    for row in rows:
        bounds.append(bounds[-1] + len(row[0]))
    times = [ts for _, _, ts in rows]
    seqs = list(range(1, len(rows) + 1))
    mixed = gc.mixed_ids([id for _, id, _ in rows])
    assert _native.group_mixed_ids([id for _, id, _ in rows]).tolist() == mixed.tolist()
    made: dict[bytes, bytes] = {}
    for share in range(1 << share_bits):
        pairs = gc.held_groups(keys, bounds, times, seqs, mixed, bits, cap, olds, share, share_bits)
        assert _native.group_held_groups(keys, bounds, times, seqs, mixed, bits, cap, olds, share,
                                         share_bits) == pairs
        fields = pairs[0::2]
        assert fields == sorted(fields, key=lambda f: int(f[1:]))
        assert all(int(f[1:]) >> (bits - share_bits) == share for f in fields)
        made.update(zip(fields, pairs[1::2]))
    assert made == {f: expected[f] for f in changed}


def test_a_rebuilds_groups_refuse_what_is_not_a_slice_of_entries() -> None:
    for fold in (gc.held_groups, _native.group_held_groups):
        with pytest.raises(ValueError):
            fold([1], [0, 1], [1.0], [1], gc.mixed_ids(["a"]), gc.K_MAX + 1, 2, {})
        with pytest.raises(ValueError):
            fold([1], [0, 2], [1.0], [1], gc.mixed_ids(["a"]), 3, 2, {})
        with pytest.raises(ValueError):
            fold([1], [0, 1], [1.0, 2.0], [1], gc.mixed_ids(["a"]), 3, 2, {})
        with pytest.raises(IndexCorrupt):
            fold([1], [0, 1], [1.0], [1], gc.mixed_ids(["a"]), 0, 2, {b"g0": b"x"})


@settings(max_examples=200, deadline=None)
@given(shape=st.lists(st.tuples(st.lists(st.integers(0, 9), max_size=300), st.booleans()), max_size=6))
def test_release_drops_what_only_it_holds_and_leaves_the_rest(shape: list[tuple[list[int], bool]]) -> None:
    """`release` (the lists of the view and the read before, freed with their items fetched ahead): the twin and
    the reference leave the same objects alive, with the same references; a list held elsewhere is untouched, and
    an object held elsewhere too survives a list freed."""
    import sys
    import weakref

    class Item:  # (weak-referable: which ones are freed is seen)
        pass

    def run(release: object) -> tuple[list[int], list[bool]]:
        pool = [Item() for _ in range(10)]
        made = [([pool[i] for i in items] + [Item() for _ in items], held) for items, held in shape]
        # A list of lists too, its lists held by it alone or also elsewhere.
        nest = [([pool[i] for i in items] + [Item()], held) for items, held in shape]
        made.append(([lst for lst, _ in nest], False))
        alone = [weakref.ref(lst[-1]) for lst, held in made + nest if lst and not held and type(lst[-1]) is Item]
        kept = [(lst, list(lst)) for lst, held in made + nest if held]
        lists = [lst for lst, _ in made]
        del made, nest
        release(lists)  # type: ignore[operator]
        assert lists == []
        assert all(lst == copy for lst, copy in kept)  # held elsewhere: as it was
        del kept
        assert all(ref() is None for ref in alone)
        return [sys.getrefcount(item) for item in pool], [ref() is None for ref in alone]

    assert run(_native.group_release) == run(gc.release)
