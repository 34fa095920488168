"""The group layout's stored forms and pure loops (docs/design.md, "The group layout"): bucket records grouped in
fields `g<j>` of the slice hash, records of 20 bytes. No I/O; the compiled twins are in
`filters/index/_group_codec.pxi`, held to these by tests/test_group_codec.py.

A record is <key: 4 bytes><event time: f64 LE><seq: u64 BE>. Its key is the low 32 bits of its bucket key (or of
its id's FNV-1a hash) times the Fibonacci constant mod 2^64; its group is the top k bits of that product. A bucket
is thus known by 32 + k bits of its key's mixed value: two buckets of one group alike in their 32 bits (2^-32 a
pair) read as one, which only adds candidates that verification judges. An id's record (the seq's top bit set,
`ID_TAG`) names its entry `e<seq>`, whose stored id confirms it.

To the index above it, a read of groups looks like the compact layout's columns (`column_of`: per name read,
a bucket's records as <event time: f64 LE><seq: u64 BE>, an id's newest record, a memo as read): its ranking,
its uncontended round and its tails are the compact layout's. A round's writes go back into the groups as the
checking script would make them, entry after entry (`apply_round`; `slice_writes` for a slice's round, from its
read). `pack_reads`, `slice_column`, `alone_groups` (the compact layout's round and each slice's `slice_writes`),
`keep_written` and `pack_writes` are a batch's read and round as the client makes them, the compiled twins doing
each at once.
"""

from __future__ import annotations

import math
import struct
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from filters.errors import IndexCorrupt
from filters.index.compact_codec import FIELDS_PER_ENTRY, alone_round, id_hash, resp

LAYOUT = "group"  # the meta hash's `layout` of a namespace of this layout
RECORD_SIZE = 20
KEY_SIZE = 4
ID_TAG = 1 << 63  # the seq of an id's record has its top bit set: never a bucket's
# Records a group holds on average at the rate of the slice before: the measured choice (docs/benchmarks.md,
# "Grouped buckets": `groupshort16`, 873 bytes a message, 0.77 of the slot layout's server CPU; 32 saves ~30
# bytes a message for 1.35 times the bytes a lookup reads).
GROUP_FILL = 16
# Bits of a slice with no slice before it (a new namespace's first): 2^15 groups hold ~40,000 messages at the
# fill; a group unwritten costs nothing, a group of few records ~60 bytes of Redis's own a record.
K_FIRST = 15
K_MIN = K_FIRST
K_MAX = 30  # with the 32 bits a record carries: at most 62 of a key's 64 bits tell buckets apart
_FIB = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
_TS = struct.Struct("<d")
_SEQ = struct.Struct(">Q")
ABSENT = b"\x00" * 8


def mixed(h: int) -> int:
    """A 64-bit key (or id hash) times the Fibonacci constant mod 2^64: its group is the top bits, its record's
    key the low 32."""
    if not 0 <= h <= _MASK64:
        raise ValueError(f"bucket keys must be unsigned 64-bit ints, got {h!r}")
    return h * _FIB & _MASK64


def mixed_keys(keys: bytes) -> bytes:
    """`mixed` of each 64-bit key of `keys` (8 bytes big-endian each), 8 bytes big-endian each, at once."""
    if len(keys) % 8:
        raise ValueError(f"{len(keys)} bytes are not 64-bit keys")
    return (np.frombuffer(keys, ">u8").astype(np.uint64) * np.uint64(_FIB)).astype(">u8").tobytes()


def group_of(h: int, bits: int) -> int:
    """The group (0 .. 2^bits - 1) of a bucket key or id hash `h` in a slice of `bits`."""
    if not 0 <= bits <= K_MAX:
        raise ValueError(f"bits must be 0 to {K_MAX}, got {bits!r}")
    return mixed(h) >> (64 - bits) if bits else 0


def record_key(h: int) -> bytes:
    """The 4 bytes a record of bucket key (or id hash) `h` carries: the low 32 bits of its mixed value."""
    return (mixed(h) & 0xFFFFFFFF).to_bytes(4, "big")


def group_field(j: int) -> bytes:
    return b"g%d" % j


def slice_bits(previous: int | None) -> int:
    """The bits of a slice made after one that counted `previous` entries (None: no slice before it): enough
    groups for `previous` × `FIELDS_PER_ENTRY` records at `GROUP_FILL` each."""
    if previous is None:
        return K_FIRST
    groups = math.ceil(max(0, previous) * FIELDS_PER_ENTRY / GROUP_FILL)
    return min(K_MAX, max(K_MIN, (groups - 1).bit_length() if groups > 1 else 0))


def place(name: bytes, bits: int) -> tuple[int, bytes, bool] | None:
    """Where a field name of the compact layout's columns lives here: (group, record key, an id's) for a bucket
    (`b` and 8 bytes) or an id (`i<id>`); None for a field of the slice hash itself (memos, entries, counts)."""
    kind = name[:1]
    if kind == b"b" and len(name) == 9:
        h = int.from_bytes(name[1:], "big")
        return group_of(h, bits), record_key(h), False
    if kind == b"i":
        h = _fnv(name[1:])
        return group_of(h, bits), record_key(h), True
    return None


def _fnv(raw: bytes) -> int:
    return id_hash(raw.decode("utf-8", "surrogatepass"))


def _records(group: bytes) -> int:
    if len(group) % RECORD_SIZE:
        raise IndexCorrupt(f"a group holds {len(group)} bytes that are not records of {RECORD_SIZE}")
    return len(group) // RECORD_SIZE


def bucket_records(group: bytes | None, key: bytes) -> bytes | None:
    """A bucket's records in its group, as the compact layout's value (<event time><seq> each, in insertion
    order); None when it has none."""
    if not group:
        return None
    out = []
    for r in range(_records(group)):
        at = r * RECORD_SIZE
        if group[at : at + 4] == key and not group[at + 12] & 0x80:
            out.append(group[at + 4 : at + 20])
    return b"".join(out) if out else None


def id_record(group: bytes | None, key: bytes) -> bytes | None:
    """The newest (event time, then seq) record of an id of record key `key` in its group, as the compact layout's
    `i<id>` value (<event time><seq>, the seq's tag cleared); None when it has none. Its entry's stored id tells
    whether it is the id's (another id alike in its 32 bits: 2^-32 a pair)."""
    if not group:
        return None
    best: tuple[float, int] | None = None
    for r in range(_records(group)):
        at = r * RECORD_SIZE
        if group[at : at + 4] == key and group[at + 12] & 0x80:
            ts = _TS.unpack_from(group, at + 4)[0]
            seq = _SEQ.unpack_from(group, at + 12)[0] & ~ID_TAG
            if best is None or (ts, seq) > best:
                best = (ts, seq)
    return None if best is None else _TS.pack(best[0]) + _SEQ.pack(best[1])


def bucket_tail(group: bytes | None, key: bytes) -> bytes:
    """The seq (8 bytes BE) of a bucket's newest record (its last) in its group, `ABSENT` when it has none: what
    an insert's check compares with what its lookup saw."""
    value = bucket_records(group, key)
    return value[-8:] if value else ABSENT


def trim_bucket(group: bytes, key: bytes, cap: int) -> bytes:
    """The group with one bucket's records cut to the `cap` newest (event time, then seq); every other record,
    and the order, kept."""
    mine = [r for r in range(_records(group)) if group[r * RECORD_SIZE : r * RECORD_SIZE + 4] == key
            and not group[r * RECORD_SIZE + 12] & 0x80]
    if len(mine) <= cap:
        return group

    def rank(r: int) -> tuple[float, bytes]:
        return _TS.unpack_from(group, r * RECORD_SIZE + 4)[0], group[r * RECORD_SIZE + 12 : r * RECORD_SIZE + 20]

    dropped = set(sorted(mine, key=rank, reverse=True)[cap:])
    return b"".join(group[r * RECORD_SIZE : (r + 1) * RECORD_SIZE] for r in range(_records(group)) if r not in dropped)


def append_record(group: bytes, key: bytes, ts: float, seq: int, cap: int) -> bytes:
    """A bucket's record appended to its group, the bucket trimmed to the cap first when it holds more than
    twice as many (as the compact layout trims a bucket's value)."""
    if sum(1 for r in range(_records(group)) if group[r * RECORD_SIZE : r * RECORD_SIZE + 4] == key
           and not group[r * RECORD_SIZE + 12] & 0x80) > 2 * cap:
        group = trim_bucket(group, key, cap)
    return group + key + _TS.pack(ts) + _SEQ.pack(seq)


def append_id(group: bytes, key: bytes, ts: float, seq: int) -> bytes:
    """An id's record appended to its group (its seq tagged)."""
    _records(group)
    return group + key + _TS.pack(ts) + _SEQ.pack(seq | ID_TAG)


# --- a slice's reads and writes -----------------------------------------------------------------------------

def read_fields(names: Sequence[bytes], bits: int | None) -> tuple[list[bytes], list[int]]:
    """The distinct fields of one slice hash that hold `names` (a column's names): their group for buckets and
    ids, the name itself for the rest; `bits` None (a slice whose groups are not known yet): the rest only, a
    bucket or id absent. Returns the fields in first-seen order and, per name, the place of its field (-1 for
    none)."""
    fields: list[bytes] = []
    at: dict[bytes, int] = {}
    places: list[int] = []
    for name in names:
        where = place(name, bits or 0)
        if where is not None and bits is None:
            places.append(-1)
            continue
        field = group_field(where[0]) if where is not None else name
        k = at.get(field)
        if k is None:
            k = at[field] = len(fields)
            fields.append(field)
        places.append(k)
    return fields, places


def column_of(values: Sequence[bytes | None], places: Sequence[int], names: Sequence[bytes],
              bits: int | None) -> list[bytes | None]:
    """A slice's column in the compact layout's terms from the values of its fields (`read_fields`): per name,
    a bucket's records in its group (`bucket_records`), an id's newest record (`id_record`), else the value."""
    column: list[bytes | None] = []
    for name, k in zip(names, places, strict=True):
        if k < 0:
            column.append(None)
            continue
        value = values[k]
        where = place(name, bits or 0) if bits is not None else None
        if where is None:
            column.append(value)
        elif where[2]:
            column.append(id_record(value, where[1]))
        else:
            column.append(bucket_records(value, where[1]))
    return column


def pack_reads(slice_key: str, names: Sequence[bytes], bits: int | None, per_command: int,
               cache: list[bytes | None] | None = None) -> tuple[bytes, int, list[bytes], list[int]]:
    """A slice's read as RESP: the `HMGET`s of `read_fields` (at most `per_command` fields each), then the `HGET`
    of its count `n`. Returns (the bytes, the number of HMGETs, the fields, the place of each name's field).
    `cache`: where the compiled twin keeps the groups' fields it made (`cache[j]`, j inside it), from call to
    call; the same result."""
    if per_command < 1:
        raise ValueError(f"per_command must be >= 1, got {per_command}")
    fields, places = read_fields(names, bits)
    reads = [("HMGET", slice_key, *fields[a : a + per_command]) for a in range(0, len(fields), per_command)]
    return resp([*reads, ("HGET", slice_key, "n")]), len(reads), fields, places


def slice_column(replies: Sequence[Sequence[bytes | None]], places: Sequence[int], names: Sequence[bytes],
                 bits: int | None, fields: Sequence[bytes], written: Mapping[bytes, bytes] | None = None) -> tuple[
                     list[bytes | None], list[bytes | None]]:
    """A slice's column in the compact layout's terms (`column_of`) from the replies of its HMGETs (`pack_reads`),
    and the values of its fields (`fields`, in order): the groups read, which a round's writes start from
    (`slice_writes`). `written`: fields written since the read was sent (field -> value: whole groups, memos),
    each put in its field's place first: the column and values of a read made after those writes."""
    values = [v for reply in replies for v in reply]
    if len(values) != len(fields):
        raise ValueError(f"{len(values)} values for {len(fields)} fields")
    if written:
        values = [written.get(f, v) for f, v in zip(fields, values)]
    return column_of(values, places, names, bits), values


def groups_read(fields: Sequence[bytes], values: Sequence[bytes | None]) -> dict[bytes, bytes]:
    """The groups of a slice's read (field -> value; those Redis holds) from its fields and their values."""
    return {f: v for f, v in zip(fields, values, strict=True) if v is not None and f[:1] == b"g"}


def slice_writes(groups: dict[bytes, bytes], read: tuple[list[bytes], list[int], list[bytes | None]] | None,
                 names: Sequence[bytes], bits: int, rows: Sequence[tuple[int, float, Sequence[int], int]], s: int,
                 slice_length: float, cap: int, pairs: Sequence[bytes]) -> tuple[list[bytes], array[int]]:
    """A round's writes to slice `s`: its rows (seq, event time, places of its buckets in `names`, place of its id;
    those whose event time is in slice `s`, by `slice_length`) applied as `apply_round` applies them to the
    slice's groups: those of its read of `names` (`read`: its fields, each name's place among them, their values;
    `pack_reads`, `slice_column`), those in `groups` (written since) in their place; both left as they are.
    Returns the slice's `HSET` arguments (each group changed, in the order first changed, with its value; then the
    entries (`e<seq>`) of the compact layout's `pairs`) and, per group changed, the place of its field in the read
    (-1: not read, or in `groups`, which holds it before the read; as machine integers, `array("q")`): what
    `keep_written` keeps once Redis took them."""
    mine = [row for row in rows if math.floor(row[1] / slice_length) == s]
    current = groups_read(read[0], read[2]) if read is not None else {}
    current.update(groups)
    changed = apply_round(current, names, bits, mine, cap)
    flat: list[bytes] = []
    for f in changed:
        flat += (f, current[f])
    for a in range(0, len(pairs), 2):
        if pairs[a][:1] == b"e":
            flat += (pairs[a], pairs[a + 1])
    at = {f: k for k, f in enumerate(read[0])} if read is not None else {}
    return flat, array("q", [-1 if f in groups else at.get(f, -1) for f in changed])


def alone_groups(ids: list[str], times: list[float], blobs: list[bytes], places_of: list[list[int]],
                 id_places: list[int], slices: tuple[int, ...], columns: dict[int, list[bytes | None]],
                 writes: dict[int, dict[int, bytes]], hwm: float, window: float, slice_length: float, cap: int,
                 seq: int, names: list[bytes],
                 sides: dict[int, tuple[int, dict[bytes, bytes], tuple[list[bytes], list[int], list[bytes | None]] | None,
                                        bool]],
                 also: bool = False) -> tuple[
                     list[int], dict[int, tuple[int, list[bytes], array[int], dict[bytes, bytes] | None]],
                     list[tuple[int, int, list[int]]], float, int]:
    """An uncontended round in this layout, at once: the compact layout's round (`compact_codec.alone_round`, over
    the columns of `names` read: what it decides, its entries) and each slice's writes (`slice_writes`; per slice
    of `slices` in `sides`: its bits, the groups written since its read, its read or None, and whether `writes`
    keeps its bucket values whole). `writes` is updated as `alone_round` updates it, except the bucket values of a
    slice not kept whole, left as they were: the round's ids (what a later round finds live) are kept in every
    slice. Returns (results, per slice written (its entries, `slice_writes`' HSET arguments, the places of the
    groups changed in the read, with `also` the groups changed as a dict (field -> value: what a read sent ahead
    lacks), else None), (seq, slice, places) per entry written, high-water mark, seq): the compact layout's
    field-value pairs of buckets and ids, which this layout does not write, are not made by the compiled twin
    (`_native.group_alone_groups`), which makes the dict while the groups are fresh, and a bucket's value only
    where it is kept whole."""
    fields_of = [[names[p] for p in places] for places in places_of]
    before = {s: dict(writes[s]) for s in slices if s in sides and not sides[s][3]}
    results, groups, pending, hwm, seq = alone_round(ids, times, blobs, fields_of, places_of, id_places, slices,
                                                     columns, writes, hwm, window, slice_length, cap, seq)
    for _, s, places in pending:
        if s in before:
            for p in places:
                if p in before[s]:
                    writes[s][p] = before[s][p]
                else:
                    writes[s].pop(p, None)
    rows = [(r, ts, places, e) for r, ts, places, e in zip(results, times, places_of, id_places) if r > 0]
    out: dict[int, tuple[int, list[bytes], array[int], dict[bytes, bytes] | None]] = {}
    for s, (count, pairs) in groups.items():
        bits, written, read, _ = sides[s]
        flat, taken = slice_writes(written, read, names, bits, rows, s, slice_length, cap, pairs)
        changed = 2 * len(taken)
        out[s] = (count, flat, taken, dict(zip(flat[0:changed:2], flat[1:changed:2])) if also else None)
    return results, out, pending, hwm, seq


def keep_written(groups: dict[bytes, bytes], values: list[bytes | None] | None, flat: Sequence[bytes],
                 taken: array[int], also: dict[bytes, bytes] | None) -> None:
    """Once Redis took a round's writes to a slice (`slice_writes`: `flat`, `taken`), each group changed kept
    where the next round finds it: at its place in the read's `values` (a group `groups` does not hold), else in
    `groups` (written since the read: before the read's value); and in `also` too, when given (the groups a read
    sent ahead lacks)."""
    for i, k in enumerate(taken):
        field, value = flat[2 * i], flat[2 * i + 1]
        if k >= 0:
            assert values is not None
            values[k] = value
        else:
            groups[field] = value
        if also is not None:
            also[field] = value


def pack_writes(slice_key: str, flat: Sequence[bytes], per_command: int, entries: int, ttl_ms: int) -> tuple[bytes, int]:
    """A round's writes to a slice as RESP: the `HSET`s of its arguments (`slice_writes`; at most `per_command`
    arguments each), the `HINCRBY` of its count `n` by `entries`, its `PEXPIRE`. Returns (the bytes, the number of
    commands)."""
    if per_command < 2 or per_command % 2 or len(flat) % 2:
        raise ValueError("pairs of arguments, an even per_command >= 2 expected")
    commands: list[tuple[str | int | bytes, ...]] = [
        ("HSET", slice_key, *flat[a : a + per_command]) for a in range(0, len(flat), per_command)]
    commands += [("HINCRBY", slice_key, "n", entries), ("PEXPIRE", slice_key, ttl_ms)]
    return resp(commands), len(commands)


def apply_round(groups: dict[bytes, bytes], names: Sequence[bytes], bits: int,
                entries: Sequence[tuple[int, float, Sequence[int], int]], cap: int) -> list[bytes]:
    """An uncontended round's entries of one slice written into its groups, as the checking script writes them:
    per entry (seq, event time, places of its bucket names, place of its `i<id>`), in order, its record appended
    to each of its buckets' groups (a bucket trimmed first past twice the cap), then its id's record. `groups`
    (field -> value, as read or written before; absent: empty) is updated. Returns the fields changed, in the
    order first changed."""
    changed: dict[bytes, None] = {}
    for seq, ts, places, e in entries:
        for p in places:
            where = place(names[p], bits)
            if where is None or where[2]:
                raise ValueError(f"not a bucket field: {names[p]!r}")
            field = group_field(where[0])
            groups[field] = append_record(groups.get(field, b""), where[1], ts, seq, cap)
            changed[field] = None
        where = place(names[e], bits)
        if where is None or not where[2]:
            raise ValueError(f"not an id field: {names[e]!r}")
        field = group_field(where[0])
        groups[field] = append_id(groups.get(field, b""), where[1], ts, seq)
        changed[field] = None
    return list(changed)


def release(lists: list[list[Any]]) -> None:
    """Drops `lists` (emptied: a list that only it holds is freed with its items' references). The compiled twin
    frees each such list's items with their memory fetched ahead, the same objects freed."""
    lists.clear()


def count_buckets(groups: Sequence[bytes]) -> int:
    """The distinct buckets (record keys a group) of a slice's groups (`stats`)."""
    total = 0
    for group in groups:
        keys = set()
        for r in range(_records(group)):
            at = r * RECORD_SIZE
            if not group[at + 12] & 0x80:
                keys.add(group[at : at + 4])
        total += len(keys)
    return total


# --- a rebuild's groups, each field made once (filters/index/redis_group.py, `GroupIndex._held_shares`) --------

def mixed_ids(ids: Sequence[str]) -> np.ndarray:
    """Each id's FNV-1a hash (`compact_codec.id_hash`) mixed (`mixed`), as uint64: its group and record key."""
    return np.array([mixed(id_hash(id)) for id in ids], dtype=np.uint64)


def held_groups(keys: Sequence[int] | np.ndarray, bounds: Sequence[int] | np.ndarray,
                times: Sequence[float] | np.ndarray, seqs: Sequence[int] | np.ndarray,
                ids_mixed: Sequence[int] | np.ndarray, bits: int, cap: int, olds: dict[bytes, bytes],
                share: int = 0, share_bits: int = 0) -> list[bytes]:
    """The groups of a rebuild's entries of one slice, each made once, as `apply_round` makes them entry after
    entry: entry e (its bucket keys `keys[bounds[e]:bounds[e + 1]]`, a key given twice once; event time, seq,
    mixed id `ids_mixed[e]`: `mixed_ids`) appends its record to each of its buckets' groups (a bucket trimmed
    first past twice the cap), then its id's record; a group starts from `olds` (field -> value Redis holds),
    else empty. Only the groups of share `share` (their top `share_bits` bits) are made. Returns the field-value
    pairs, groups in ascending order (`_native.group_held_groups` is the compiled twin)."""
    if not 0 <= bits <= K_MAX:
        raise ValueError(f"bits must be 0 to {K_MAX}, got {bits!r}")
    if not 0 <= share_bits <= bits:
        raise ValueError(f"share_bits must be 0 to bits ({bits}), got {share_bits!r}")
    if not (len(times) == len(ids_mixed) == len(seqs) and len(bounds) == len(seqs) + 1):
        raise ValueError("one event time, seq and id an entry, and one more bound, expected")
    groups: dict[int, bytes] = {}
    shift = bits - share_bits

    def group(m: int) -> int:
        return m >> (64 - bits) if bits else 0

    for e in range(len(seqs)):
        ts, seq = float(times[e]), int(seqs[e])
        a, b = int(bounds[e]), int(bounds[e + 1])
        if not 0 <= a <= b <= len(keys):
            raise ValueError(f"bounds must rise within the {len(keys)} keys")
        for key in dict.fromkeys(int(h) for h in keys[a:b]):
            m = mixed(key)
            j = group(m)
            if j >> shift == share:
                old = groups.get(j, olds.get(group_field(j), b""))
                groups[j] = append_record(old, (m & 0xFFFFFFFF).to_bytes(4, "big"), ts, seq, cap)
        m = int(ids_mixed[e])
        j = group(m)
        if j >> shift == share:
            groups[j] = append_id(groups.get(j, olds.get(group_field(j), b"")), (m & 0xFFFFFFFF).to_bytes(4, "big"),
                                  ts, seq)
    out: list[bytes] = []
    for j in sorted(groups):
        out += (group_field(j), groups[j])
    return out
