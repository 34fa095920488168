"""The compact slot layout's stored forms and pure loops (docs/design.md, "The compact slot layout"): records of
(event time, seq) in small hashes, the small hash of a field, the ranking by seq. No I/O; the compiled twins
are in `filters/index/_compact_codec.pxi`, held to these by tests/test_native.py.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any

from filters.errors import IndexCorrupt

LAYOUT = "compact"  # the meta hash's `layout` of a namespace of this layout
RECORD = struct.Struct("<d8s")  # a record: event time (f64 LE), then the seq (u64 BE: a value's last 8 bytes)
RECORD_SIZE = RECORD.size  # 16: four records fit in a listpack value (`LISTPACK_VALUE`)
SEQ = struct.Struct(">Q")
LISTPACK_VALUE = 64  # Redis's default hash-max-listpack-value: a longer value goes to the slice hash
MARK = b"\x00"  # a small hash's value for a bucket whose records are in the slice hash
FIELDS_PER_ENTRY = 13  # small-hash fields an indexed message adds (its ~12 bucket keys and its `i<id>`)
SMALL_FILL = 256  # fields a small hash holds at most when its slice's rate is that of the slice before
K_FIRST = 10  # bits of a slice with no slice before it (2^10 small hashes: ~15,000 messages a slice)
K_MIN = 4  # the fewest bits a slice gets
K_MAX = 30
_FIB = 0x9E3779B97F4A7C15  # Fibonacci hashing: a key's own top bits carry its method's tag
_MASK64 = (1 << 64) - 1
_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3


def record(ts: float, seq: int) -> bytes:
    """A bucket record of the compact layout (and an `i<id>` value): event time, seq."""
    return RECORD.pack(ts, SEQ.pack(seq))


def small_hash(key: int, bits: int) -> int:
    """The small hash (0 .. 2^bits - 1) of a bucket field of key `key` (64 bits) in a slice of `bits`."""
    if not 0 <= key <= _MASK64:
        raise ValueError(f"bucket keys must be unsigned 64-bit ints, got {key!r}")
    if not 0 <= bits <= 64:
        raise ValueError(f"bits must be 0 to 64, got {bits!r}")
    return (key * _FIB & _MASK64) >> (64 - bits) if bits else 0


def id_hash(id: str) -> int:
    """The 64-bit FNV-1a hash of an id's UTF-8 bytes (surrogatepass)."""
    h = _FNV_OFFSET
    for byte in id.encode("utf-8", "surrogatepass"):
        h = (h ^ byte) * _FNV_PRIME & _MASK64
    return h


def id_small_hash(id: str, bits: int) -> int:
    """The small hash of `id`'s `i<id>` field (`small_hash` of its `id_hash`)."""
    return small_hash(id_hash(id), bits)


def slice_bits(previous: int | None) -> int:
    """The bits of a slice made after one that counted `previous` entries (None: no slice before it): enough
    small hashes for `previous` × `FIELDS_PER_ENTRY` fields at `SMALL_FILL` each."""
    if previous is None:
        return K_FIRST
    hashes = math.ceil(max(0, previous) * FIELDS_PER_ENTRY / SMALL_FILL)
    return min(K_MAX, max(K_MIN, (hashes - 1).bit_length() if hashes > 1 else 0))


def parse_records(value: bytes) -> list[tuple[float, int]]:
    """A bucket value's records as (event time, seq), in insertion order."""
    if len(value) % RECORD_SIZE:
        raise IndexCorrupt(f"a bucket holds {len(value)} bytes that are not records of {RECORD_SIZE}")
    return [(ts, SEQ.unpack(seq)[0]) for ts, seq in RECORD.iter_unpack(value)]


def trim_records(value: bytes, cap: int) -> bytes:
    """The `cap` newest records (event time, then seq) of a bucket value, in insertion order."""
    records = parse_records(value)
    if len(records) <= cap:
        return value
    keep = sorted(sorted(range(len(records)), key=lambda j: records[j], reverse=True)[:cap])
    return b"".join(value[j * RECORD_SIZE : (j + 1) * RECORD_SIZE] for j in keep)


def rank_records(values: Sequence[Sequence[bytes | None]], positions: Sequence[int], own: int, floor: int,
                 limit: int, horizon: float, cap: int, since: int = -1,
                 mine: set[int] | None = None) -> list[tuple[int, int, int, float]]:
    """The candidates in one query's buckets, ranked as `MemoryIndex` ranks them (`redis_codec.rank_records`,
    by seq instead of id: a seq is one entry). `values[s][positions[k]]` is bucket k's value in slice s
    (None: absent; a mark is resolved before). Only records inside the window (event time >= `horizon`) and
    the `cap` newest of each bucket count, never the query's own entry's (seq `own`, 0 for none); with
    `since` >= 0, only records with a greater seq that are not in `mine`. Returns [(seq, shared buckets, first
    bucket, event time)] of those sharing at least `floor`, most shared first, then the newest, at most
    `limit` (but at least one found). `_native.rank_compact` is the compiled twin."""
    present = sum(1 for t in positions if any(column[t] is not None for column in values))
    if present < floor or not present:
        return []  # pigeonhole: nothing can share `floor` keys with it
    counts: dict[int, list[Any]] = {}  # seq -> [shared, first, its event time]
    for k, t in enumerate(positions):
        records = [r for column in values if (v := column[t]) is not None for r in parse_records(v) if r[0] >= horizon]
        if len(records) > cap:
            records = sorted(records, reverse=True)[:cap]  # the newest by (event time, seq)
        held = set()
        for ts, seq in records:
            if seq == own or seq in held:
                continue
            if since >= 0 and (seq <= since or (mine is not None and seq in mine)):
                continue
            held.add(seq)
            c = counts.get(seq)
            if c is None:
                counts[seq] = [1, k, ts]
            else:
                c[0] += 1
    items = [(seq, c) for seq, c in counts.items() if c[0] >= floor]
    items.sort(key=lambda item: (item[1][0], item[0]), reverse=True)
    return [(seq, shared, first, ts) for seq, (shared, first, ts) in items[: max(limit, 1)]]
