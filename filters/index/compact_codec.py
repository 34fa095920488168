"""The compact slot layout's stored forms and pure loops (docs/design.md, "The compact slot layout"): records of
(event time, seq) in small hashes, the small hash of a field, the ranking by seq. No I/O; the compiled twins
are in `filters/index/_compact_codec.pxi`, held to these by tests/test_native.py.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Any

import numpy as np

from filters.errors import IndexCorrupt
from filters.index.redis_codec import live_memo

LAYOUT = "compact"  # the meta hash's `layout` of a namespace of this layout
RECORD = struct.Struct("<d8s")  # a record: event time (f64 LE), then the seq (u64 BE: a value's last 8 bytes)
RECORD_SIZE = RECORD.size  # 16: four records fit in a listpack value (`LISTPACK_VALUE`)
SEQ = struct.Struct(">Q")
LISTPACK_VALUE = 64  # Redis's default hash-max-listpack-value: a longer value goes to the slice hash
MARK = b"\x00"  # a small hash's value for a bucket whose records are in the slice hash
FIELDS_PER_ENTRY = 13  # small-hash fields an indexed message adds (its ~12 bucket keys and its `i<id>`)
# Fields a small hash holds at most when its slice's rate is that of the slice before: an eighth of Redis's
# hash-max-listpack-entries (512), so that a slice of 8 times the rate of the one before (or a first slice
# that was only a part of one) still stays in listpacks. A listpack is read and written by scanning it: half the
# fill halves the scans for a small hash's key more a slice (~3 bytes a message), and fewer fields a small hash
# (32) cost more commands than they save (docs/design.md, "Where the server's CPU goes").
SMALL_FILL = 64
K_FIRST = 11  # bits of a slice with no slice before it (2^11 small hashes: listpacks up to ~80,000 messages)
K_MIN = K_FIRST  # the fewest bits a slice gets: 2,048 small hashes cost ~200 KB, nothing against a slice's entries
K_MAX = 30
# A slice that left the window of up to 2^12 small hashes is unlinked whole by the insert that moves the window
# (a few ms of the server); a bigger one by the clients' next rounds, a few thousand keys each.
UNLINK_INLINE_BITS = 12
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
    return _fnv(id.encode("utf-8", "surrogatepass"))


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


def expected_counts(times: Sequence[float], slice_length: float) -> dict[int, int]:
    """Per slice of `times` (event times of entries to restore, in order), how many entries a slice of their
    rate holds: their count there, times the slice's length over the span of event times they cover (at
    least 1/1024 of a slice: a burst at one moment says little of the rate)."""
    seen: dict[int, list[float]] = {}
    for ts in times:
        s = math.floor(ts / slice_length)
        got = seen.get(s)
        if got is None:
            seen[s] = [1, ts, ts]
        else:
            got[0] += 1
            got[1] = min(got[1], ts)
            got[2] = max(got[2], ts)
    return {s: math.ceil(count * slice_length / max(high - low, slice_length / 1024))
            for s, (count, low, high) in seen.items()}


def parse_records(value: bytes) -> list[tuple[float, int]]:
    """A bucket value's records as (event time, seq), in insertion order."""
    if len(value) % RECORD_SIZE:
        raise IndexCorrupt(f"a bucket holds {len(value)} bytes that are not records of {RECORD_SIZE}")
    return [(ts, SEQ.unpack(seq)[0]) for ts, seq in RECORD.iter_unpack(value)]


def _first_time(value: bytes) -> float:
    """The event time of a value's first record (an `i<id>` holds one)."""
    records = parse_records(value)
    if not records:
        raise IndexCorrupt("a bucket holds 0 bytes that are not records of 16")
    return records[0][0]


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



def rank_all(columns: Sequence[Sequence[bytes | None]], positions: Sequence[Sequence[int]], id_places: Sequence[int],
             ids: Sequence[str], floors: Sequence[int], limit: int, horizons: Sequence[float], cap: int,
             memo_time: Callable[[bytes, str], float]) -> list[tuple[tuple[int, float] | None, bytes | None,
                                                                     list[tuple[int, int, int, float]]]]:
    """A lookup's per-query work over the columns it read: per query, its own entry (seq, event time) where its
    `i<id>` (at `id_places[q]`) is inside its window (`horizons[q]` on) in the first column that holds it, else
    its memo (right after it) inside the window, and `rank_records` of its buckets (`positions[q]`; its own seq
    left out). An `i<id>` value is one record."""
    out = []
    for where, e, id, floor, horizon in zip(positions, id_places, ids, floors, horizons, strict=True):
        own: tuple[int, float] | None = None
        memo = None
        for column in columns:
            value = column[e]
            if value is not None:
                if len(value) != RECORD_SIZE:
                    raise IndexCorrupt(f"an id's field holds {len(value)} bytes, not one record")
                ts, seq = RECORD.unpack(value)
                if ts >= horizon:
                    own = (SEQ.unpack(seq)[0], ts)
                    break
        if own is None:
            memo = live_memo(columns, e, id, horizon, memo_time)
        out.append((own, memo, rank_records(columns, where, own[0] if own else 0, floor, limit, horizon, cap, -1,
                                            None)))
    return out

# --- where a slice's fields live: its small hashes and its slice hash -----------------------------------------

Command = tuple[Any, ...]


def field_hash(name: bytes, bits: int) -> int | None:
    """The small hash of a slice's field `name` (its bits `bits`), None for the slice hash: a bucket field
    (`b` and 8 bytes) by its key, an `i<id>` by its id when the name fits a listpack value; the entries, memos
    and counts, and a bucket marked as kept there (the caller knows), live in the slice hash."""
    kind = name[:1]
    if kind == b"b" and len(name) == 9:
        return small_hash(int.from_bytes(name[1:], "big"), bits)
    if kind == b"i" and len(name) <= LISTPACK_VALUE:
        return small_hash(_fnv(name[1:]), bits)
    return None


def _fnv(raw: bytes) -> int:
    h = _FNV_OFFSET
    for byte in raw:
        h = (h ^ byte) * _FNV_PRIME & _MASK64
    return h


def small_key(slice_key: str, j: int) -> str:
    """The name of small hash `j` of the slice hash `slice_key`."""
    return f"{slice_key}:{j}"


def read_commands(slice_key: str, names: Sequence[bytes], bits: int, marked: frozenset[bytes] | set[bytes],
                  per_command: int) -> tuple[list[Command], list[list[int]]]:
    """The `HMGET`s that read `names` (distinct) of one slice: per small hash the names it holds, at most
    `per_command` a command, the slice hash the others (and the buckets in `marked`, known to be kept there);
    the slice hash's commands first, then the small hashes' in order. Returns the commands and, per command,
    the places in `names` of the names it reads, in order."""
    groups: dict[int, list[int]] = {}
    for place, name in enumerate(names):
        j = None if name in marked else field_hash(name, bits)
        groups.setdefault(-1 if j is None else j, []).append(place)
    commands: list[Command] = []
    places: list[list[int]] = []
    for j, at in sorted(groups.items()):  # the slice hash first, then the small hashes in order
        key = slice_key if j < 0 else small_key(slice_key, j)
        for a in range(0, len(at), per_command):
            part = at[a : a + per_command]
            commands.append(("HMGET", key, *(names[p] for p in part)))
            places.append(part)
    return commands, places


def column_of(replies: Sequence[Sequence[bytes | None]], places: Sequence[Sequence[int]],
              n: int) -> list[bytes | None]:
    """The values of a slice's `n` names from the replies of its `read_commands`, in the names' places."""
    column: list[bytes | None] = [None] * n
    for reply, at in zip(replies, places, strict=True):
        for p, value in zip(at, reply, strict=True):
            column[p] = value
    return column


def marked_places(column: Sequence[bytes | None]) -> list[int]:
    """The places of a column read as the mark: their buckets are read again in the slice hash."""
    return [p for p, value in enumerate(column) if value == MARK]


def write_commands(slice_key: str, pairs: Sequence[bytes], bits: int, marked: frozenset[bytes] | set[bytes],
                   entries: int, memos: int, ttl_ms: int, per_command: int) -> list[Command]:
    """The commands that write a slice's field-value `pairs` (name, value, name, value ...; each name once):
    each field in its small hash; a bucket in `marked` (read as the mark: kept in the slice hash) in the slice
    hash, and one whose value passes `LISTPACK_VALUE` bytes too, with the mark in its small hash (a mark never
    goes back: a bucket trimmed short again stays where it is); the counts of entries and memos moved; a TTL
    for every key written."""
    groups: dict[int, list[bytes]] = {}
    for a in range(0, len(pairs), 2):
        name, value = pairs[a], pairs[a + 1]
        j = None if name in marked else field_hash(name, bits)
        if j is not None and len(value) > LISTPACK_VALUE:
            groups.setdefault(j, []).extend((name, MARK))
            j = None
        groups.setdefault(-1 if j is None else j, []).extend((name, value))
    commands: list[Command] = []
    step = 2 * per_command
    for j, flat in sorted(groups.items()):  # the slice hash first, then the small hashes in order
        key = slice_key if j < 0 else small_key(slice_key, j)
        commands += [("HSET", key, *flat[a : a + step]) for a in range(0, len(flat), step)]
        if j < 0:
            commands += [("HINCRBY", key, field, count) for field, count in (("n", entries), ("m", memos)) if count]
        commands.append(("PEXPIRE", key, ttl_ms))
    if -1 not in groups and (entries or memos):
        commands += [("HINCRBY", slice_key, field, count) for field, count in (("n", entries), ("m", memos)) if count]
        commands.append(("PEXPIRE", slice_key, ttl_ms))
    return commands



def resp(commands: Sequence[Command]) -> bytes:
    """Redis commands (bytes, str or int arguments) as one RESP request: what `hiredis.pack_command` gives for
    each, joined."""
    out = bytearray()
    for command in commands:
        out += b"*%d\r\n" % len(command)
        for arg in command:
            raw = arg if isinstance(arg, bytes) else str(arg).encode()
            out += b"$%d\r\n%s\r\n" % (len(raw), raw)
    return bytes(out)


def pack_reads(slice_key: str, names: Sequence[bytes], bits: int | None, marked: frozenset[bytes] | set[bytes],
               per_command: int) -> tuple[bytes, list[list[int]]]:
    """`read_commands` packed as one RESP request (`resp`), and its places: a lookup's reads of a slice without a
    Python object a command (the compiled twin writes the bytes at once). `bits` None: a slice whose small
    hashes are not known yet: only the commands of its slice hash."""
    commands, places = read_commands(slice_key, names, 0 if bits is None else bits, marked, per_command)
    if bits is None:
        kept = [k for k, command in enumerate(commands) if command[1] == slice_key]
        commands, places = [commands[k] for k in kept], [places[k] for k in kept]
    return resp(commands), places


def pack_writes(slice_key: str, pairs: Sequence[bytes], bits: int, marked: frozenset[bytes] | set[bytes],
                entries: int, memos: int, ttl_ms: int, per_command: int,
                renewed: bytearray | None) -> tuple[bytes, int, list[int]]:
    """`write_commands` packed as one RESP request (`resp`): (the request, its number of commands, the small
    hashes whose TTL it sets). `renewed`: a bitset of the slice's small hashes whose TTL is set already in the
    current period (their `PEXPIRE` is left out), None for a TTL set on every small hash written."""
    prefix = f"{slice_key}:"
    kept: list[Command] = []
    renewing: list[int] = []
    for command in write_commands(slice_key, pairs, bits, marked, entries, memos, ttl_ms, per_command):
        if renewed is not None and command[0] == "PEXPIRE" and command[1].startswith(prefix):
            j = int(command[1][len(prefix) :])
            if j < 8 * len(renewed) and renewed[j >> 3] >> (j & 7) & 1:
                continue
            renewing.append(j)
        kept.append(command)
    return resp(kept), len(kept), renewing


def first_error(replies: Sequence[Any]) -> Exception | None:
    """The first error reply among `replies` (they come back in their places), None if there is none."""
    for reply in replies:
        if isinstance(reply, Exception):
            return reply
    return None

def entry_value(blob: bytes, id: str) -> bytes:
    """An `e<seq>` value: the entry's bytes (`encode_entry`), its id (UTF-8), the id's length (u16 LE)."""
    raw = id.encode("utf-8", "surrogatepass")
    if len(raw) > 0xFFFF:
        raise ValueError(f"ids must be at most 65,535 bytes of UTF-8, got {len(raw):,}")
    return blob + raw + len(raw).to_bytes(2, "little")


def split_entry_value(value: bytes) -> tuple[bytes, str]:
    """The entry's bytes and its id of an `e<seq>` value (`entry_value`)."""
    if len(value) < 2:
        raise IndexCorrupt(f"an entry of {len(value)} bytes has no id")
    n = int.from_bytes(value[-2:], "little")
    if n + 2 > len(value):
        raise IndexCorrupt(f"an entry of {len(value)} bytes with an id of {n}")
    try:
        return value[: -2 - n], value[-2 - n : -2].decode("utf-8", "surrogatepass")
    except UnicodeDecodeError as exc:
        raise IndexCorrupt(f"an entry's id is not UTF-8: {exc}") from exc


def entry_field(seq: int) -> bytes:
    """The slice hash's field of the entry of `seq`."""
    return b"e" + SEQ.pack(seq)


def id_field(id: str) -> bytes:
    return b"i" + id.encode("utf-8", "surrogatepass")


# --- the uncontended insert round ----------------------------------------------------------------------------

def alone_round(ids: list[str], times: list[float], blobs: list[bytes], fields_of: list[list[bytes]],
                places_of: list[list[int]], id_places: list[int], slices: tuple[int, ...],
                columns: dict[int, list[bytes | None]], writes: dict[int, dict[int, bytes]], hwm: float,
                window: float, slice_length: float, cap: int,
                seq: int) -> tuple[list[int], dict[int, list[Any]], list[tuple[int, int, list[int]]], float, int]:
    """`redis_codec.alone_round` in the compact layout (`_native.alone_compact` is the compiled twin): per
    entry, in order, what the insert script would do when nobody else wrote since the lookup. An entry whose
    id is live (its `i<id>`, at `id_places`, read or written, with an event time inside the window in a slice
    read) or whose event time left the window gets 0; else the next seq, its record (event time, seq) appended
    to each of its bucket fields (trimmed back to the cap first when a value holds more than twice as many),
    written as its `i<id>`, and its entry as `e<seq>` (`entry_value`). `writes` (slice -> place -> value, what
    the caller wrote since the lookup) is updated. Returns (results, per slice [entries, field-value pairs:
    each bucket field once, with its last value, then the ids and entries], (seq, slice, places) per entry
    written, high-water mark, seq)."""
    results: list[int] = []
    groups: dict[int, list[Any]] = {}
    at_of: dict[int, dict[int, int]] = {}  # slice -> place -> where its value is in the slice's pairs
    written: list[tuple[int, int, list[int]]] = []
    too_long = 2 * cap * RECORD_SIZE
    for id, ts, blob, fields, places, e in zip(ids, times, blobs, fields_of, places_of, id_places):
        live = False
        for s in slices:
            old = writes[s].get(e)
            if old is None:
                column = columns.get(s)
                old = column[e] if column is not None else None
            if old is not None and _first_time(old) >= hwm - window:
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
        rec = record(ts, seq)
        s = math.floor(ts / slice_length)
        mine, column = writes[s], columns[s]
        group = groups.setdefault(s, [0, []])
        group[0] += 1
        pairs, at = group[1], at_of.setdefault(s, {})
        for f, p in zip(fields, places):
            v = mine.get(p)
            if v is None:
                v = column[p]
            v = rec if v is None else (trim_records(v, cap) if len(v) > too_long else v) + rec
            mine[p] = v
            k = at.get(p)
            if k is None:
                at[p] = len(pairs) + 1
                pairs += (f, v)
            else:
                pairs[k] = v
        mine[e] = rec
        pairs += (id_field(id), rec, entry_field(seq), entry_value(blob, id))
        written.append((seq, s, places))
        results.append(seq)
    return results, groups, written, hwm, seq


# --- a rebuild's held fields (`CompactIndex._rebuild_compact`) ---------------------------------------------

def entry_pairs(ids: Sequence[str], blobs: Sequence[bytes], seqs: Sequence[int],
                slices: Sequence[int]) -> dict[int, list[bytes]]:
    """Per slice, the slice hash's field-value pairs (`e<seq>`, `entry_value`) of the entries a rebuild took
    (`seqs[i]` > 0; `slices[i]`: the slice of entry i), in order (`_native.entry_pairs` is the compiled twin)."""
    out: dict[int, list[bytes]] = {}
    for id, blob, seq, s in zip(ids, blobs, seqs, slices, strict=True):
        if seq > 0:
            out.setdefault(int(s), []).extend((entry_field(int(seq)), entry_value(blob, id)))
    return out


def held_pairs(keys: Sequence[int] | np.ndarray, bounds: Sequence[int] | np.ndarray,
               times: Sequence[float] | np.ndarray, seqs: Sequence[int] | np.ndarray, ids: Sequence[str | None],
               olds: dict[bytes, bytes], cap: int, old_ids: bool) -> list[bytes]:
    """The bucket and id fields of one slice that a rebuild held, as the field-value pairs to write (name, value,
    ...; each name once, in the order first written): per entry n in order (its bucket keys
    `keys[bounds[n]:bounds[n + 1]]`, a key given twice counting once; its event time, seq and id), what the
    insert writes (`alone_round`): its record appended to each of its bucket fields, a value that holds more
    than twice the cap's records trimmed to the cap's newest first, and written as its `i<id>` (an id None: not
    here, a share of the small hashes without it). A field of `olds` (what Redis holds of it: written by an
    earlier flush of the rebuild, or by somebody else) goes on from that value; with `old_ids`, an `i<id>` of
    `olds` is kept as it is (`_native.held_pairs` is the compiled twin)."""
    if len(bounds) != len(ids) + 1 or any(not 0 <= a <= b <= len(keys) for a, b in pairwise(bounds)):
        raise ValueError(f"bounds must rise within the {len(keys)} keys")
    values: dict[bytes, bytes] = {}
    last: dict[bytes, int] = {}  # field -> the entry that appended to it last (a key given twice counts once)
    too_long = 2 * cap * RECORD_SIZE
    for n, (ts, seq, id) in enumerate(zip(times, seqs, ids, strict=True)):
        rec = record(float(ts), int(seq))
        for key in keys[bounds[n] : bounds[n + 1]]:
            name = b"b" + int(key).to_bytes(8, "big")
            if last.get(name) == n:
                continue
            last[name] = n
            value = values.get(name, olds.get(name))
            values[name] = rec if value is None else (trim_records(value, cap) if len(value) > too_long else value) + rec
        if id is not None:
            name = id_field(id)
            if not (old_ids and name in olds):
                values[name] = rec
    return [x for pair in values.items() for x in pair]


def id_shares(ids: Sequence[str], bits: int) -> list[int]:
    """The share of each id's `i<id>` field among 2^`bits` shares of a slice's small hashes: the top `bits` bits of
    its small hash (`field_hash`), 0 for a name that lives in the slice hash (`_native.id_shares` is the compiled
    twin)."""
    return [field_hash(id_field(id), bits) or 0 for id in ids]
