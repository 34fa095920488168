"""The Redis index's stored forms: an entry's bytes (`encode_entry` / `decode_entry`), a bucket field's
records, a duplicate's remembered verdict (`encode_memo` / `decode_memo`), and the pure loops over what a
lookup read (ranking, the uncontended insert round, the field plan). No I/O: `filters/index/redis.py` sends
and receives; the compiled twins are in `filters/index/_redis_codec.pxi`, held to these by
tests/test_native.py and tests/test_redis_index.py.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from itertools import chain
from operator import itemgetter
from typing import Any

import numpy as np

from filters.errors import IndexCorrupt
from filters.index import Entry, Stored
from filters.records import Verdict, new_verdict

# --- the stored forms ------------------------------------------------------------------------------

ENCODING_VERSION = 3  # what this neardup writes; it reads VERSIONS
VERSIONS = (2, 3)  # 2: fixed-width header and sketch (written before; a namespace or changelog of it reads on)
# Version 3: version, ts, exact (low, high 64 bits), flags (a fixed head of 26 bytes); then LEB128 varints:
# size, the sketch's length, the minhash's (with _HAS_MINHASH), the sentences' (with _HAS_SENTENCES); then the
# sketch (packed, or 4 or 8 bytes a value), simhash, minhash, sentences, characters. The scripts read ts at
# byte 2 (1-based) as '<d': it stays right after the version byte in every version.
_HEAD3 = struct.Struct("<BdQQB")
ENTRY_MIN = _HEAD3.size + 2  # the shortest entry of any version: the fixed head, size and the sketch's length
# Version 2: version, ts, exact (low, high 64 bits), size, flags, lengths of sketch, minhash and sentences.
_HEAD = struct.Struct("<BdQQIBIII")
_HAS_SIMHASH = 1
_HAS_MINHASH = 2
_NARROW_SKETCH = 4  # the sketch is uint32 (a fingerprint's), stored in 4 bytes a value; else uint64
_HAS_CHARS = 8  # a short text's normalized characters (UTF-8, surrogatepass) are the bytes after the sentences
_PACKED_SKETCH = 16  # (version 3) a narrow sketch, strictly increasing, as its gaps packed at one width: `pack_sketch`
_HAS_SENTENCES = 32  # (version 3) a sentences' length follows (version 2 always has one)
_FLAGS = _HAS_SIMHASH | _HAS_MINHASH | _NARROW_SKETCH | _HAS_CHARS
_FLAGS3 = _FLAGS | _PACKED_SKETCH | _HAS_SENTENCES
_U64 = np.dtype("<u8")
_U32 = np.dtype("<u4")
_MASK64 = (1 << 64) - 1
_RECORD = struct.Struct("<dI")  # a bucket record's event time and id length; then the id and the seq
SEQ = struct.Struct(">Q")
_FIELD = struct.Struct(">cQ").pack  # a bucket's field name: b"b" and the key, 8 bytes big-endian
ABSENT = bytes(8)  # the tail of a field that does not exist (seqs start at 1)
# A memo (a duplicate's verdict, remembered for its replays): event time, similarity, the method's length;
# then the method (ASCII) and the representative's id (UTF-8). The event time comes first, as an entry's
# right after its version byte: both are read by the lookup's horizon check.
_MEMO = struct.Struct("<ddB")
_TS_SEQ = itemgetter(0, 1)
_TS = struct.Struct("<d")  # an entry's event time, right after its version byte


def _varint(n: int) -> bytes:
    """`n` (>= 0) as a minimal LEB128 varint."""
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_varint(data: bytes, pos: int, id: str) -> tuple[int, int]:
    """The minimal LEB128 varint at `pos` of at most 32 bits, and the position after it."""
    n = shift = 0
    for at in range(pos, min(pos + 5, len(data))):
        byte = data[at]
        n |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if (byte == 0 and at > pos) or n >= 1 << 32:
                raise IndexCorrupt(f"entry {id!r}: a length that this neardup does not write")
            return n, at + 1
        shift += 7
    raise IndexCorrupt(f"entry {id!r}: {len(data)} bytes end inside a length")


def packed_width(sketch: np.ndarray) -> int:
    """The width in bits at which `pack_sketch` packs a narrow sketch, 0 if it does not (not strictly
    increasing, empty, or no smaller packed than as 4 bytes a value): the bit length of its largest gap
    (the first value counts as the gap from 0)."""
    n = len(sketch)
    if not n:
        return 0
    values = sketch.astype(np.int64)
    gaps = np.diff(values, prepend=0)
    if n > 1 and gaps[1:].min() <= 0:
        return 0
    width = int(gaps.max()).bit_length()
    return width if width and 1 + (n * width + 7) // 8 < 4 * n else 0


def pack_sketch(sketch: np.ndarray, width: int) -> bytes:
    """A strictly increasing uint32 sketch as its width byte, then its gaps (the first value, then each value
    less the one before) at `width` bits each, least significant bit first, zero bits to the byte's end.
    Sorted bottom-k hashes are spread evenly: their gaps need 20-29 bits, not 32 (docs/design.md)."""
    gaps: np.ndarray = np.diff(sketch.astype(np.uint64), prepend=np.uint64(0))
    bits = ((gaps[:, None] >> np.arange(width, dtype=np.uint64)) & np.uint64(1)).astype(np.uint8)
    return bytes([width]) + np.packbits(bits.ravel(), bitorder="little").tobytes()


def unpack_sketch(data: bytes, pos: int, n: int, id: str) -> tuple[np.ndarray, int]:
    """The inverse of `pack_sketch` for `n` values at `pos`, and the position after them; raises
    `IndexCorrupt` on a packing that `pack_sketch` does not write."""
    if pos >= len(data) or not 1 <= data[pos] <= 32:
        raise IndexCorrupt(f"entry {id!r}: a packed sketch without a width of 1 to 32 bits")
    width = data[pos]
    stop = pos + 1 + (n * width + 7) // 8
    if stop > len(data):
        raise IndexCorrupt(f"entry {id!r}: {len(data)} bytes end inside its packed sketch")
    bits = np.unpackbits(np.frombuffer(data, np.uint8, stop - pos - 1, pos + 1), bitorder="little")
    if bits[n * width :].any():
        raise IndexCorrupt(f"entry {id!r}: bits set after its packed sketch")
    gaps = bits[: n * width].reshape(n, width).astype(np.uint64) @ (np.uint64(1) << np.arange(width, dtype=np.uint64))
    values = np.cumsum(gaps, dtype=np.uint64)
    if n and int(values[-1]) >= 1 << 32:
        raise IndexCorrupt(f"entry {id!r}: a packed sketch beyond 32 bits")
    # What `packed_width` asks of the sketch, read off the gaps themselves: strictly increasing, the width
    # that of the largest gap, and smaller than 4 bytes a value.
    if not n or (gaps[1:] == 0).any() or int(gaps.max()).bit_length() != width or stop - pos >= 4 * n:
        raise IndexCorrupt(f"entry {id!r}: a packed sketch that this neardup does not write")
    return values.astype(np.uint32), stop


def encode_entry(entry: Entry) -> bytes:
    """The compact binary form of `entry` (its id is not included: it is the field's name), version 3."""
    if not 0 <= entry.exact < 1 << 128:
        raise ValueError(f"exact must be an unsigned 128-bit int, got {entry.exact!r}")
    if not 0 <= entry.size < 1 << 32:
        raise ValueError(f"size must be an unsigned 32-bit int, got {entry.size!r}")
    chars = entry.chars.encode("utf-8", "surrogatepass")
    flags = _HAS_CHARS if chars else 0
    width = 0
    if entry.sketch.dtype == np.uint32:  # a fingerprint's sketch: 4 bytes a value at most, read back as it was
        flags |= _NARROW_SKETCH
        sketch = np.ascontiguousarray(entry.sketch, dtype=_U32)
        width = packed_width(sketch)
    else:
        sketch = np.ascontiguousarray(entry.sketch, dtype=_U64)
    lengths = [_varint(entry.size), _varint(len(sketch))]
    tail = [pack_sketch(sketch, width) if width else sketch.tobytes()]
    if width:
        flags |= _PACKED_SKETCH
    if entry.simhash is not None:
        flags |= _HAS_SIMHASH
        tail.append(struct.pack("<Q", entry.simhash))
    if entry.minhash is not None:
        flags |= _HAS_MINHASH
        minhash = np.ascontiguousarray(entry.minhash, dtype=_U32)
        lengths.append(_varint(len(minhash)))
        tail.append(minhash.tobytes())
    if entry.sentences:
        flags |= _HAS_SENTENCES
        sentences = np.array(sorted(entry.sentences), dtype=_U64)  # sorted: one entry, one encoding
        lengths.append(_varint(len(sentences)))
        tail.append(sentences.tobytes())
    tail.append(chars)
    head = _HEAD3.pack(ENCODING_VERSION, entry.ts, entry.exact & _MASK64, entry.exact >> 64, flags)
    return b"".join([head, *lengths, *tail])


def encode_entry_v2(entry: Entry) -> bytes:
    """`entry` in version 2, as neardup wrote entries before version 3 (the reference of what `decode_entry`
    still reads: a namespace or changelog written then)."""
    if not 0 <= entry.exact < 1 << 128:
        raise ValueError(f"exact must be an unsigned 128-bit int, got {entry.exact!r}")
    chars = entry.chars.encode("utf-8", "surrogatepass")
    flags = _HAS_CHARS if chars else 0
    if entry.sketch.dtype == np.uint32:
        flags |= _NARROW_SKETCH
        sketch = np.ascontiguousarray(entry.sketch, dtype=_U32)
    else:
        sketch = np.ascontiguousarray(entry.sketch, dtype=_U64)
    tail = [sketch.tobytes()]
    if entry.simhash is not None:
        flags |= _HAS_SIMHASH
        tail.append(struct.pack("<Q", entry.simhash))
    n_minhash = 0
    if entry.minhash is not None:
        flags |= _HAS_MINHASH
        minhash = np.ascontiguousarray(entry.minhash, dtype=_U32)
        n_minhash = len(minhash)
        tail.append(minhash.tobytes())
    sentences = np.array(sorted(entry.sentences), dtype=_U64)
    tail.append(sentences.tobytes())
    tail.append(chars)
    head = _HEAD.pack(2, entry.ts, entry.exact & _MASK64, entry.exact >> 64, entry.size,
                      flags, len(sketch), n_minhash, len(sentences))
    return b"".join([head, *tail])


def encode_entries(entries: Sequence[tuple[Entry, Any]], fallback: Any = None) -> list[bytes]:
    """`encode_entry` of each (entry, keys) pair (`_native.encode_entries` is the compiled twin)."""
    return [encode_entry(entry) for entry, _ in entries]


def stored_of(entries: Sequence[tuple[Entry, Sequence[int]]], encode: Any = encode_entries) -> Stored:
    """`entries` (entry, bucket keys) in their stored form (`encode`: `encode_entries` or its compiled twin)."""
    key_lists = [keys for _, keys in entries]  # (lists and `map`: no generator frame a key or an entry)
    bounds = np.zeros(len(entries) + 1, np.int64)
    np.cumsum(np.fromiter(map(len, key_lists), np.int64, len(entries)), out=bounds[1:])
    keys = np.fromiter(chain.from_iterable(key_lists), np.uint64, int(bounds[-1]))
    return Stored([e.id for e, _ in entries], np.array([e.ts for e, _ in entries], np.float64),
                  bounds, keys, encode(list(entries), encode_entry))


def stored_entries(stored: Stored) -> list[tuple[Entry, tuple[int, ...]]]:
    """The (entry, bucket keys) pairs of `stored`, decoded, in order."""
    return [(decode_entry(blob, id), stored.keys_of(i)) for i, (id, blob) in enumerate(zip(stored.ids, stored.blobs))]


def join_stored(parts: Sequence[Stored]) -> Stored:
    """One `Stored` of `parts`, in order."""
    if len(parts) == 1:
        return parts[0]
    bounds = [np.zeros(1, np.int64)]
    base = 0
    for part in parts:
        bounds.append(part.bounds[1:] - part.bounds[0] + base)
        base += int(part.bounds[-1] - part.bounds[0])
    return Stored([id for part in parts for id in part.ids], np.concatenate([part.times for part in parts]),
                  np.concatenate(bounds), np.concatenate([part.keys[part.bounds[0] : part.bounds[-1]] for part in parts]),
                  [blob for part in parts for blob in part.blobs])


def decode_entry(data: bytes, id: str) -> Entry:
    """The inverse of `encode_entry` (and of `encode_entry_v2`); raises `IndexCorrupt` on anything it did not
    write."""
    if data[:1] == b"\x02":
        return _decode_v2(data, id)
    try:
        version, ts, lo, hi, flags = _HEAD3.unpack_from(data)
    except struct.error as exc:
        raise IndexCorrupt(f"entry {id!r}: {len(data)} bytes are too short for an entry") from exc
    if version != ENCODING_VERSION:
        raise IndexCorrupt(f"entry {id!r}: encoding version {version}, this neardup reads {VERSIONS}")
    if flags & ~_FLAGS3 or (flags & _PACKED_SKETCH and not flags & _NARROW_SKETCH):
        raise IndexCorrupt(f"entry {id!r}: unknown flags {flags:#x}")
    size, pos = _read_varint(data, _HEAD3.size, id)
    n_sketch, pos = _read_varint(data, pos, id)
    n_minhash = n_sentences = 0
    if flags & _HAS_MINHASH:
        n_minhash, pos = _read_varint(data, pos, id)
    if flags & _HAS_SENTENCES:
        n_sentences, pos = _read_varint(data, pos, id)
        if not n_sentences:
            raise IndexCorrupt(f"entry {id!r}: a sentences' length of 0")
    if flags & _PACKED_SKETCH:
        sketch, pos = unpack_sketch(data, pos, n_sketch, id)
    else:
        width = 4 if flags & _NARROW_SKETCH else 8
        if pos + width * n_sketch > len(data):
            raise IndexCorrupt(f"entry {id!r}: {len(data)} bytes end inside its sketch")
        sketch_type = _U32 if width == 4 else _U64
        sketch = np.frombuffer(data, sketch_type, n_sketch, pos).astype(sketch_type.newbyteorder("="), copy=False)
        pos += width * n_sketch
        if width == 4 and packed_width(sketch):
            raise IndexCorrupt(f"entry {id!r}: a sketch that this neardup packs, not packed")
    return _decode_tail(data, id, pos, ts, lo | hi << 64, size, sketch, flags, n_minhash, n_sentences)


def _decode_tail(data: bytes, id: str, pos: int, ts: float, exact: int, size: int, sketch: np.ndarray, flags: int,
                 n_minhash: int, n_sentences: int) -> Entry:
    """An entry's simhash, minhash, sentences and characters from `pos` on (both versions)."""
    has_simhash = bool(flags & _HAS_SIMHASH)
    expected = pos + 8 * has_simhash + 4 * n_minhash + 8 * n_sentences
    if len(data) != expected and not (flags & _HAS_CHARS and len(data) > expected):
        raise IndexCorrupt(f"entry {id!r}: {len(data)} bytes where the header promises {expected}")
    simhash = None
    if has_simhash:
        (simhash,) = struct.unpack_from("<Q", data, pos)
        pos += 8
    minhash = None
    if flags & _HAS_MINHASH:
        minhash = np.frombuffer(data, _U32, n_minhash, pos).astype(np.uint32, copy=False)
        pos += 4 * n_minhash
    sentences = frozenset(np.frombuffer(data, _U64, n_sentences, pos).tolist())
    chars = ""
    if flags & _HAS_CHARS:
        try:
            chars = data[expected:].decode("utf-8", "surrogatepass")
        except UnicodeDecodeError as exc:
            raise IndexCorrupt(f"entry {id!r}: its characters are not UTF-8") from exc
    return Entry(id, ts, exact, size, sketch, simhash, minhash, sentences, chars)


def _decode_v2(data: bytes, id: str) -> Entry:
    """An entry of version 2 (`encode_entry_v2`)."""
    try:
        _, ts, lo, hi, size, flags, n_sketch, n_minhash, n_sentences = _HEAD.unpack_from(data)
    except struct.error as exc:
        raise IndexCorrupt(f"entry {id!r}: {len(data)} bytes are too short for an entry") from exc
    if flags & ~_FLAGS:
        raise IndexCorrupt(f"entry {id!r}: unknown flags {flags:#x}")
    if not flags & _HAS_MINHASH and n_minhash:
        raise IndexCorrupt(f"entry {id!r}: minhash length without minhash")
    sketch_type, width = (_U32, 4) if flags & _NARROW_SKETCH else (_U64, 8)
    if len(data) < _HEAD.size + width * n_sketch:
        raise IndexCorrupt(f"entry {id!r}: {len(data)} bytes end inside its sketch")
    # Read-only views of the reply's bytes: no copy, and nobody can change a stored entry by accident.
    sketch = np.frombuffer(data, sketch_type, n_sketch, _HEAD.size).astype(sketch_type.newbyteorder("="), copy=False)
    return _decode_tail(data, id, _HEAD.size + width * n_sketch, ts, lo | hi << 64, size, sketch, flags, n_minhash,
                        n_sentences)


def decode_entries(ids: Sequence[str], blobs: Sequence[bytes | None], make: Any = Entry,
                   fallback: Any = None) -> dict[str, Entry]:
    """{id: `decode_entry(blob, id)`} of the blobs that are not None (`_native.decode_entries` is the
    compiled twin, which decodes the common form itself and hands the rest to `fallback`)."""
    return {id: decode_entry(blob, id) for id, blob in zip(ids, blobs, strict=True) if blob is not None}


def encode_memo(verdict: Verdict, ts: float) -> bytes:
    """The stored form of a duplicate's verdict, remembered at the event time `ts` of its message (its id is
    the field's name, `memo_field`)."""
    method = (verdict.method or "").encode("ascii")
    return _MEMO.pack(ts, verdict.similarity, len(method)) + method + (verdict.duplicate_of or "").encode(
        "utf-8", "surrogatepass")


def decode_memo(data: bytes, id: str) -> Verdict:
    """The verdict `encode_memo` stored for `id`; raises `IndexCorrupt` on anything it did not write."""
    try:
        _, similarity, n = _MEMO.unpack_from(data)
        start = _MEMO.size + n
        if start > len(data):
            raise ValueError("its method runs past the end")
        method = data[_MEMO.size : start].decode("ascii")
        duplicate_of = data[start:].decode("utf-8", "surrogatepass")
    except (struct.error, ValueError) as exc:
        raise IndexCorrupt(f"memo of {id!r}: {len(data)} bytes that are not a memo: {exc}") from exc
    return new_verdict(id, True, duplicate_of, similarity, method or None)


def live_memo(columns: Sequence[Sequence[bytes | None]], e: int, id: str, horizon: float,
              memo_time: Any) -> bytes | None:
    """The first of the slices' memos of `id` (at `e + 1` of each column) whose event time (`memo_time`) is inside
    the window (from `horizon`), else None: the Python references of both layouts' lookups."""
    for column in columns:
        blob = column[e + 1]
        if blob is not None and memo_time(blob, id) >= horizon:
            return blob
    return None


def memo_time(blob: bytes, id: str) -> float:
    """The event time of a stored memo (`encode_memo`)."""
    try:
        return float(_MEMO.unpack_from(blob)[0])
    except struct.error as exc:
        raise IndexCorrupt(f"memo of {id!r}: {len(blob)} bytes are too short for a memo") from exc


def parse_records(value: bytes) -> list[tuple[float, int, str]]:
    """A bucket field's records as (event time, seq, id), in insertion order."""
    out = []
    pos, end = 0, len(value)
    unpack = _RECORD.unpack_from
    try:
        while pos < end:
            ts, n = unpack(value, pos)
            start = pos + 12
            pos = start + n + 8
            if pos > end:
                raise ValueError("a record runs past the end")
            out.append((ts, SEQ.unpack_from(value, pos - 8)[0],
                        value[start : start + n].decode("utf-8", "surrogatepass")))
    except (struct.error, ValueError) as exc:
        raise IndexCorrupt(f"a bucket holds {len(value)} bytes that are not bucket records: {exc}") from exc
    return out


def rank_records(values: Sequence[Sequence[bytes | None]], positions: Sequence[int], id: str, floor: int,
                 limit: int, horizon: float, cap: int, since: int = -1,
                 own: set[int] | None = None) -> list[tuple[str, int, int, float]]:
    """The candidates in one query's buckets, ranked as `MemoryIndex` ranks them. `values[s][positions[k]]`
    is bucket k's value in slice s (None: absent). Only records inside the window (event time >=
    `horizon`) and the `cap` newest of each bucket count, never `id`'s own; with `since` >= 0, only
    records with a greater seq that are not in `own`. Returns [(id, shared buckets, first bucket, event
    time of its newest record)] of those sharing at least `floor`, most shared first, then the newest
    insert, at most `limit` (but at least one found). The compiled core has the same function."""
    present = sum(1 for t in positions if any(column[t] is not None for column in values))
    if present < floor or not present:
        return []  # pigeonhole: nothing can share `floor` keys with it
    counts: dict[str, list[Any]] = {}  # id -> [shared, first, newest seq, its event time]
    for k, t in enumerate(positions):
        records = [r for column in values if (v := column[t]) is not None for r in parse_records(v) if r[0] >= horizon]
        if len(records) > cap:
            records = sorted(records, key=_TS_SEQ, reverse=True)[:cap]  # the newest by (event time, seq)
        held = set()
        for ts, seq, rid in records:
            if rid == id or rid in held:
                continue
            if since >= 0 and (seq <= since or (own is not None and seq in own)):
                continue
            held.add(rid)
            c = counts.get(rid)
            if c is None:
                counts[rid] = [1, k, seq, ts]
            else:
                c[0] += 1
                if seq > c[2]:
                    c[2], c[3] = seq, ts
    items = [(rid, c) for rid, c in counts.items() if c[0] >= floor]
    items.sort(key=lambda item: (item[1][0], item[1][2]), reverse=True)
    out = []
    for rid, (shared, first, _, ts) in items:
        out.append((rid, shared, first, ts))
        if len(out) >= limit:
            break
    return out


def alone_round(ids: list[str], times: list[float], blobs: list[bytes], fields_of: list[list[bytes]],
                places_of: list[list[int]], entry_places: list[int], slices: tuple[int, ...],
                columns: dict[int, list[bytes | None]], writes: dict[int, dict[int, bytes]], hwm: float,
                window: float, slice_length: float, cap: int, seq: int,
                entry_time: Any) -> tuple[list[int], dict[int, list[Any]], list[tuple[int, int, list[int]]], float, int]:
    """The loop of `RedisIndex._alone` (`_native.alone_round` is the compiled twin): per entry, in order,
    what INSERT_LUA would do when nobody else wrote since the lookup. An entry whose id is live (its
    entry stored inside the window, read or written) or whose event time left the window gets 0; else
    the next seq, its record appended to each of its bucket fields (trimmed back to the cap first when a
    value holds about twice as many) and its entry written. `writes` (slice -> place -> value, what the
    caller wrote since the lookup) is updated. Returns (results, per slice [entries, field-value pairs:
    each field once, with its last value], (seq, slice, places) per entry written, high-water mark, seq)."""
    results: list[int] = []
    groups: dict[int, list[Any]] = {}
    at_of: dict[int, dict[int, int]] = {}  # slice -> place -> where its value is in the slice's pairs
    written: list[tuple[int, int, list[int]]] = []
    for id, ts, blob, fields, places, e in zip(ids, times, blobs, fields_of, places_of, entry_places):
        live = False
        for s in slices:
            old = writes[s].get(e)
            if old is None:
                column = columns.get(s)
                old = column[e] if column is not None else None
            if old and entry_time(old, id) >= hwm - window:
                live = True
                break
        if live:
            results.append(0)
            continue
        hwm = max(hwm, ts)
        if not ts >= hwm - window:
            results.append(0)
            continue
        seq += 1
        id_bytes = id.encode("utf-8", "surrogatepass")
        record = _RECORD.pack(ts, len(id_bytes)) + id_bytes + SEQ.pack(seq)
        s = math.floor(ts / slice_length)
        mine, column = writes[s], columns[s]
        group = groups.setdefault(s, [0, []])
        group[0] += 1
        pairs, at = group[1], at_of.setdefault(s, {})
        too_long = 2 * cap * len(record)
        for f, p in zip(fields, places):
            v = mine.get(p)
            if v is None:
                v = column[p]
            # A field without a value when read, nobody wrote since: its value is the record.
            v = record if v is None else (trim_records(v, cap) if len(v) > too_long else v) + record
            mine[p] = v
            # Each field once in the slice's pairs, with its last value: a bucket several entries of the
            # batch share is sent once, not once per entry with every record again.
            k = at.get(p)
            if k is None:
                at[p] = len(pairs) + 1
                pairs += (f, v)
            else:
                pairs[k] = v
        mine[e] = blob
        pairs += (b"e" + id_bytes, blob)
        written.append((seq, s, places))
        results.append(seq)
    return results, groups, written, hwm, seq


def restore_round(ids: Sequence[str], times: Sequence[float] | np.ndarray, slices: Sequence[int] | np.ndarray,
                  bounds: Sequence[int] | np.ndarray, keys: Sequence[int] | np.ndarray, blobs: Sequence[bytes],
                  held: dict[int, dict[bytes, bytes]], hwm: float, window: float, cap: int,
                  seq: int) -> tuple[list[int], dict[int, list[Any]], float, int]:
    """What `RedisIndex.restore` writes for a chunk of entries (`_native.restore_round` is the compiled twin).
    Entry i: id `ids[i]`, event time `times[i]` in slice `slices[i]`, bucket keys `keys[bounds[i]:bounds[i + 1]]`,
    stored bytes `blobs[i]`. `held` (slice -> field -> value) is what the fields the chunk names hold in
    each slice it touches (a field missing there is absent). Per entry, in order, as the insert script
    would insert it: 0 if its id is live (its entry held, or written earlier in the chunk, in any of those
    slices, with an event time inside the window) or its event time is outside the window; else the next
    seq, its record appended to each of its bucket fields in its slice (a key given twice counts once)
    and its entry stored. A field's new value is what it held and then its new records, in order; one of
    more than 2 × `cap` records is trimmed to the `cap` newest (`trim_records`). Returns (per entry its seq
    or 0, per slice written [its entries written, field-value pairs: the bucket fields in the order first
    named, then the entries], high-water mark, seq)."""
    results: list[int] = []
    written: dict[int, dict[bytes, bytes]] = {s: {} for s in held}
    appended: dict[int, dict[bytes, list[bytes]]] = {}
    entries: dict[int, list[Any]] = {}
    for i, id in enumerate(ids):
        id_bytes = id.encode("utf-8", "surrogatepass")
        efield = b"e" + id_bytes
        live = False
        for s, values in held.items():
            old = written[s].get(efield) or values.get(efield)
            if old and entry_time(old, id) >= hwm - window:
                live = True
                break
        ts = float(times[i])
        if live or not ts >= max(hwm, ts) - window:
            results.append(0)
            continue
        hwm = max(hwm, ts)
        seq += 1
        record = _RECORD.pack(ts, len(id_bytes)) + id_bytes + SEQ.pack(seq)
        s = slices[i]
        mine = appended.setdefault(s, {})
        for key in dict.fromkeys(keys[bounds[i] : bounds[i + 1]]):
            mine.setdefault(field_of(key), []).append(record)
        written[s][efield] = blobs[i]
        group = entries.setdefault(s, [0, []])
        group[0] += 1
        group[1] += (efield, blobs[i])
        results.append(seq)
    groups: dict[int, list[Any]] = {}
    for s, (count, pairs) in entries.items():
        values = held[s]
        out: list[bytes] = []
        for f, records in appended.get(s, {}).items():
            v = b"".join([values.get(f, b""), *records])
            if count_records(v) > 2 * cap:
                v = trim_records(v, cap)
            out += (f, v)
        groups[s] = [count, out + pairs]
    return results, groups, hwm, seq


def count_records(value: bytes) -> int:
    """How many records a bucket value holds."""
    n = pos = 0
    while pos < len(value):
        pos += 20 + _RECORD.unpack_from(value, pos)[1]
        n += 1
    return n


def overlay_writes(names: list[bytes], written_names: list[bytes], kept: list[tuple[int, list[bytes | None]]],
                   written: dict[int, dict[int, bytes]]) -> None:
    """Puts `written` (slice -> place in `written_names` -> value) into the columns of `kept` ((slice,
    column of `names`) pairs), by field name; a field `names` does not hold is left out. `names` are
    distinct (`plan_fields`). (`_native.overlay_writes` is the compiled twin.)"""
    at = {name: place for place, name in enumerate(names)}
    for s, column in kept:
        for p, value in written.get(s, {}).items():
            place = at.get(written_names[p])
            if place is not None:
                column[place] = value


def rank_lookup(columns: list[list[bytes | None]], positions_of: list[list[int]], id_places: list[int], ids: list[str],
                floors: list[int], limit: int, horizons: list[float], cap: int, entry_time: Any,
                memo_time: Any) -> list[tuple[bytes | None, bytes | None, list[tuple[str, int, int, float]]]]:
    """Per query of a lookup: its stored entry's bytes if one is live (event time >= its horizon) in a
    slice read, else None; if not, its memo's bytes (the field after its entry's: `plan_fields`) if one is
    live (`encode_memo`; `memo_time` reads its event time), else None; and `rank_records` of its buckets
    (`_native.rank_lookup` is the compiled twin)."""
    out = []
    for where, e, id, floor, horizon in zip(positions_of, id_places, ids, floors, horizons, strict=True):
        own = memo = None
        for column in columns:
            blob = column[e]
            if blob is not None and entry_time(blob, id) >= horizon:
                own = blob
                break
        if own is None:
            memo = live_memo(columns, e, id, horizon, memo_time)
        out.append((own, memo, rank_records(columns, where, id, floor, limit, horizon, cap)))
    return out


def plan_fields(keys_of: Sequence[Sequence[int]], id_fields: Sequence[bytes], numbers: list[int] | None = None) -> tuple[
        list[bytes], list[list[bytes]], list[list[int]], list[int]]:
    """What a lookup reads: every distinct field name once, in first-seen order, and its place; per query
    its bucket keys' field names and places; per query its entry field's place, its memo field (`d` for
    the entry field's first byte: `memo_field`) right after it (`_native.plan_fields` is the compiled
    twin, which takes the places from `numbers`, the ints 0, 1, 2, ... the caller keeps: the same values)."""
    at: dict[bytes, int] = {}
    place = at.setdefault
    fields_of = [[_FIELD(b"b", key) for key in keys] for keys in keys_of]
    places_of = [[place(f, len(at)) for f in fields] for fields in fields_of]
    id_places = []
    for f in id_fields:
        e = at.get(f)
        if e is None:
            e = at[f] = len(at)
            at[b"d" + f[1:]] = e + 1
        id_places.append(e)
    return list(at), fields_of, places_of, id_places


def trim_records(value: bytes, cap: int) -> bytes:
    """The `cap` newest records (event time, then seq) of a bucket value, in insertion order: what the
    insert script's `trim` keeps."""
    spans = []
    pos, end = 0, len(value)
    while pos < end:
        ts, n = _RECORD.unpack_from(value, pos)
        stop = pos + 12 + n + 8
        spans.append((ts, value[stop - 8 : stop], pos, stop))
        pos = stop
    if len(spans) <= cap:
        return value
    newest = sorted(range(len(spans)), key=lambda j: spans[j][:2], reverse=True)[:cap]
    return b"".join(value[spans[j][2] : spans[j][3]] for j in sorted(newest))


# --- replies (filters/index/redis.py, `read_replies`) ------------------------------------------------------

def gather_replies(gets: Callable[[], Any], more: Callable[[], Any], n: int, not_enough: Any,
                   fatal: type[BaseException]) -> list[Any]:
    """The next `n` replies of a reader: `gets()` gives one, or `not_enough` while the bytes read so far hold
    none (then `more()` reads more). A reply of the `fatal` kind is raised at once, as redis-py's
    `read_response` raises it (a server that cannot serve yet: LOADING)."""
    out: list[Any] = []
    while len(out) < n:
        reply = gets()
        if reply is not_enough:
            more()
        elif isinstance(reply, fatal):
            raise reply
        else:
            out.append(reply)
    return out


# --- a restore's Bloom filter of the bucket fields it wrote (filters/index/redis.py, `_Rebuilt`) ------------

BLOOM_BITS = 1 << 27  # 16 MB a slice: ~2% false positives at 5 million fields, ~25% at 45 million
_BLOOM_SHIFT = np.uint64(64 - 27)
_BLOOM_MUL = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F))  # Fibonacci hashing, twice
_ONE = np.uint64(1)
_LOW6 = np.uint64(63)


def bloom_bits() -> np.ndarray:
    """An empty Bloom filter of 64-bit keys (bucket keys: hashes already), two probes a key."""
    return np.zeros(BLOOM_BITS // 64, np.uint64)


def _probes(keys: np.ndarray) -> list[np.ndarray]:
    keys = np.asarray(keys, dtype=np.uint64)
    return [(keys * mul) >> _BLOOM_SHIFT for mul in _BLOOM_MUL]


def bloom_add(bits: np.ndarray, keys: np.ndarray) -> None:
    for at in _probes(keys):
        np.bitwise_or.at(bits, at >> np.uint64(6), _ONE << (at & _LOW6))


def bloom_has(bits: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Per key: False if it was never added, True if it may have been."""
    found = np.ones(len(keys), dtype=bool)
    for at in _probes(keys):
        found &= ((bits[at >> np.uint64(6)] >> (at & _LOW6)) & _ONE).astype(bool)
    return found


def field_of(key: int) -> bytes:
    try:
        return _FIELD(b"b", key)
    except struct.error:
        raise ValueError(f"bucket keys must be unsigned 64-bit ints, got {key!r}") from None


def id_field(id: str) -> bytes:
    return b"e" + id.encode("utf-8", "surrogatepass")


def memo_field(id: str) -> bytes:
    return b"d" + id.encode("utf-8", "surrogatepass")


def entry_time(blob: bytes, id: str) -> float:
    try:
        return float(_TS.unpack_from(blob, 1)[0])
    except struct.error as exc:
        raise IndexCorrupt(f"entry {id!r}: {len(blob)} bytes are too short for an entry") from exc


# --- a rebuild's writes, each bucket field once (filters/index/redis.py, `RedisIndex._rebuild`) -------------

def restore_accept(ids: Sequence[str], times: Sequence[float] | np.ndarray, live: dict[str, float], hwm: float,
                   window: float, seq: int) -> tuple[np.ndarray, float, int]:
    """Which entries of a rebuild the insert script would insert, and their seqs (`_native.restore_accept` is the
    compiled twin). `live` (id -> event time of its newest stored entry, in any slice) is what the index holds
    so far, updated here. Per entry, in order: 0 if its id is live (stored with an event time inside the
    window of the newest event time before it, `hwm`) or its own event time is outside that window; else
    the next seq. Returns (seq or 0 per entry, as uint64; high-water mark; seq)."""
    out = np.zeros(len(ids), np.uint64)
    for i, id in enumerate(ids):
        ts = float(times[i])
        old = live.get(id)
        if (old is not None and old >= hwm - window) or not ts >= max(hwm, ts) - window:
            continue
        hwm = max(hwm, ts)
        seq += 1
        out[i] = seq
        live[id] = ts  # an entry it replaces (same slice) or leaves behind (another) is older than the window
    return out, hwm, seq


def newest_records(keys: np.ndarray, entries: np.ndarray, times: np.ndarray, seqs: np.ndarray,
                   cap: int) -> np.ndarray:
    """The records a bucket field keeps of `keys[r]` (its key) / `entries[r]` (its entry, numbered in insertion
    order; `times` and `seqs` are per entry), each key's records coming in insertion order: grouped by key
    (the keys in the order first seen), each entry once in a group, of a group of more than `cap` only the
    `cap` newest (event time, then seq), each group in insertion order. Returns the records' places, in that
    order (`_native.newest_records` is the compiled twin)."""
    groups: dict[int, list[int]] = {}
    for r, key in enumerate(keys.tolist()):
        groups.setdefault(key, []).append(r)
    out: list[int] = []
    for records in groups.values():
        seen: set[int] = set()
        group = []
        for r in records:
            if int(entries[r]) not in seen:  # a key given twice by one entry: its record once
                seen.add(int(entries[r]))
                group.append(r)
        if len(group) > cap:
            newest = sorted(group, key=lambda r: (float(times[entries[r]]), int(seqs[entries[r]])), reverse=True)[:cap]
            keep = set(newest)
            group = [r for r in group if r in keep]
        out += group
    return np.array(out, dtype=np.int64)


def bucket_pairs(keys: np.ndarray, entries: np.ndarray, times: np.ndarray, seqs: np.ndarray, ids: bytes,
                 id_ends: np.ndarray, olds: dict[int, bytes], cap: int) -> list[bytes]:
    """The field-value pairs of the bucket fields of records grouped by key (as `newest_records` orders them): per
    group, its key's field and value, the records of what `olds` (key -> value) holds for it first, then its
    own, in order, of more than `cap` only the `cap` newest (`trim_records`). Entry e's id is
    `ids[id_ends[e - 1]:id_ends[e]]` (from 0 for e = 0). (`_native.bucket_pairs` is the compiled twin.)"""
    out: list[bytes] = []
    at, n = 0, len(keys)
    while at < n:
        key = int(keys[at])
        parts = [olds.get(key, b"")]
        while at < n and int(keys[at]) == key:
            e = int(entries[at])
            id_bytes = ids[int(id_ends[e - 1]) if e else 0 : int(id_ends[e])]
            parts.append(_RECORD.pack(float(times[e]), len(id_bytes)) + id_bytes + SEQ.pack(int(seqs[e])))
            at += 1
        value = b"".join(parts)
        if key in olds and count_records(value) > cap:
            value = trim_records(value, cap)
        out += (field_of(key), value)
    return out


def bucket_commands(name: bytes, keys: np.ndarray, entries: np.ndarray, times: np.ndarray, seqs: np.ndarray,
                    ids: bytes, id_ends: np.ndarray, olds: dict[int, bytes], cap: int,
                    per_call: int) -> tuple[bytes, int]:
    """`bucket_pairs` as HSET commands of the hash `name`, `per_call` fields each, in the Redis protocol (the
    bytes `pack_commands` makes of them): (the bytes, the number of commands). `_native.bucket_commands` is
    the compiled twin, which makes no object per field."""
    if per_call < 1:
        raise ValueError("per_call must be >= 1")
    pairs = bucket_pairs(keys, entries, times, seqs, ids, id_ends, olds, cap)
    commands = [[b"HSET", name, *pairs[a : a + 2 * per_call]] for a in range(0, len(pairs), 2 * per_call)]
    return b"".join(b"*%d\r\n" % len(c) + b"".join(b"$%d\r\n%s\r\n" % (len(x), x) for x in c) for c in commands), len(commands)
