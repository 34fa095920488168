"""The compact slot layout's stored forms (filters/index/compact_codec.py): records, the bits of a slice, trimming."""

from __future__ import annotations

import pytest

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
    assert cc.slice_bits(15_000) == 10  # the development stream: 195,000 fields in 1,024 hashes of ~190
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
