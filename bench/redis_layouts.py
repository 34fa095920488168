"""Benchmark: what the Redis index holds per message, and the same content in other layouts, measured against each other.

    eval "$(bash docker/services.sh env)"       # or pass --redis
    python bench/redis_layouts.py [--stream ../shared/eval/stream.jsonl] [--db 10] [--runs 3] [--lookups 4096] [--batch 512]
                                  [--layouts today,short,shards256,compact128,compact256,compactboth256,zset,string]
                                  (also: group8, groupmark8, groupshort8, groupmarkshort8, any N)

1. The stream goes through `neardup filter --index redis://.../<db>` (the real index, default configuration) in
   a flushed database `--db` (FLUSHed before and after: do not point it at a database that holds anything
   else). Printed: Redis's `used_memory` after less before and the sum of `MEMORY USAGE` of the keys, per
   message indexed; per kind of field (bucket records `b`, entries `e`, memos `d`) its count and bytes (name
   and value) per message indexed; each key's type and encoding (`OBJECT ENCODING`); every key's TTL.
2. The same content (every bucket record, entry and memo the index holds) is written again in each layout
   into the flushed database, and measured the same way:
   - `today`: the index's layout (`filters/index/redis.py`): a hash per event-time slice, a field per bucket
     (`b<key>`: records of event time, id length, id and seq, 20 bytes and the id each), entries and memos.
   - `short`: the same hash, records of 12 bytes (event time and a number of the entry in its slice, which a
     field `q<number>` of the slice turns into the id: the id stored once).
   - `shardsN`: `short`'s records, the bucket fields in hashes of about N fields each (2^k of them a slice,
     k from the slice's field count), small enough for Redis's listpack encoding (`hash-max-listpack-entries`
     512, `-value` 64 bytes by default): a bucket whose records pass 64 bytes lives in the slice's hash and
     its shard holds a one-byte mark for it (a second read).
   - `compactN` (the design of docs/design.md, "Compact layout"): records of 16 bytes (event time, seq), the
     bucket fields and `i<id>` (event time and seq of the id's entry) in small hashes of about N fields
     (2^k a slice, k from the slice's count of those fields; a bucket field's by its key's mixed top bits,
     an `i<id>`'s by a hash of the id), the entries in the slice's hash keyed by seq (`e<seq>`, 8 bytes
     big-endian; the entry's bytes and then its id), the memos there as today. A bucket whose records
     pass 64 bytes lives in the slice's hash and its small hash holds a one-byte mark for it, read again
     in a second round when met. `compactbothN`: the same without the mark; the lookup reads every bucket
     field in the slice's hash as well, in the same round.
   - `groupN`: the slot layout's one big hash per slice, its buckets' records grouped: field `g<j>` holds
     the records of the buckets whose key's mixed top k bits (as compact's) are j, concatenated in seq order,
     each the bucket key (8 bytes), event time (f64) and seq (u64 BE), 24 bytes; k per slice, from the
     count of records its groups hold, for at most N a group on average. An id's entry is a record of the
     group of its FNV-1a hash (that hash as key, the seq's top bit set), for compact's `i<id>`; entries
     `e<seq>` and memos as compact's. `groupmarkN`: a bucket of more than 4 records lives in its own field
     `b<key>` of the slice (its records of event time and seq) and its group holds a mark record (its key,
     seq 0), read again in a second round when met. `groupshortN`, `groupmarkshortN`: records of 20 bytes,
     the key's 4 bytes the low 32 bits of its mixed value (with the group's k bits, 32 + k of the 64).
   - `zset`: a sorted set per bucket (member the id, score the event time), with its TTL.
   - `string`: a string per bucket (today's records appended), with its TTL.
3. Server CPU of lookups (`INFO cpu`, user + system of the server process, per message looked up): the
   fields `--lookups` indexed messages read (their bucket fields, in the slice of each of their records,
   and their entry and memo fields), in batches of `--batch` (512: as the index reads them; fewer: as many small
   hashes a field as a namespace of a higher rate has: one command a field read) (an `HMGET` per hash per
   batch, pipelined, each distinct field once, as the index reads them; `group*` read the groups of the
   messages' buckets and ids; `short` and `shardsN` also read the ids of up to 8 records a message; `today`,
   `compact*` and `group*` read, in a second round, the entries of up to 8 candidates a message: the first 8
   distinct ids of its buckets' records, as the index reads its `max_candidates` best-ranked), each layout in
   turn, `--runs` times; medians, and the bytes Redis sends a lookup (`INFO stats` total_net_output_bytes).
   And the server CPU of writing the content in each layout, per message indexed (each run; medians), and
   the bytes Redis receives for it (total_net_input_bytes): `today`, `compact*` and `group*` in the index's
   uncontended insert rounds (`--round` entries a MULTI/EXEC, `write_rounds`, `write_group_rounds`: a group
   touched is written whole), the others in pipelined `HSET`s of up to 500 fields. For `group*`, the records
   a bucket read scans (its group's) and a group holds, on average; for the others, the records a bucket
   read gets.
   A `compactN` of a small N (16) has as many small hashes a slice as a namespace of a high rate has with
   N = 256 (a field a small hash a round): its CPU columns are those of such a namespace, its memory is not.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

try:
    import redis
except ModuleNotFoundError as exc:  # one line naming what to install, not a traceback
    print(f"redis_layouts.py needs the Python package {exc.name}: pip install 'neardup[kafka]'", file=sys.stderr)
    raise SystemExit(2) from None

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import needs  # noqa: E402
from bench.redis_bench import server_cpu, with_db  # noqa: E402
from filters.index.redis_codec import parse_records  # noqa: E402

BATCH = 512
PER_HMGET = 256 * 16  # fields an HMGET reads at most (the index's LOOKUP_CHUNK queries of up to 16 fields)
MARK = b"\x00"  # a shard's value for a bucket kept in the slice's hash
TTL_MS = 3_600_000
_SHORT = struct.Struct("<dI")  # a short record: event time, the entry's number in its slice
_TS = struct.Struct("<d")
_RECORD = struct.Struct("<dI")  # today's record: event time, id length; then the id and the seq
_SEQ = struct.Struct(">Q")
LISTPACK_VALUE = 64  # Redis's default hash-max-listpack-value: a longer field or value makes a hash a hashtable
CANDIDATES = 8  # entries a lookup reads a message (FilterConfig.max_candidates)


@dataclass
class Slice:
    """One event-time slice of the index as read back: its bucket fields, entries and memos."""

    name: bytes  # the slice's key
    buckets: dict[bytes, list[tuple[float, int, str]]] = field(default_factory=dict)  # b<key> -> records
    raw: dict[bytes, bytes] = field(default_factory=dict)  # b<key> -> the stored value
    entries: dict[bytes, bytes] = field(default_factory=dict)  # e<id> -> entry
    memos: dict[bytes, bytes] = field(default_factory=dict)  # d<id> -> memo
    other: dict[bytes, bytes] = field(default_factory=dict)  # n, m
    number: dict[str, int] = field(default_factory=dict)  # id -> its number in the slice (insertion order)
    seq: dict[str, int] = field(default_factory=dict)  # id -> the seq of its entry
    ts: dict[str, float] = field(default_factory=dict)  # id -> its entry's event time


def client(url: str, db: int) -> redis.Redis:
    return redis.Redis.from_url(with_db(url, db))


def used(r: redis.Redis) -> int:
    time.sleep(0.5)  # a client's query buffer is given back by the server's cron
    return int(r.info("memory")["used_memory"])


def run_index(url: str, db: int, stream: Path, query: str = "") -> int:
    """The stream through `neardup filter` into the flushed db (`query`: the index URL's options): the
    used_memory it added."""
    r = client(url, db)
    r.flushdb()
    before = used(r)
    out = subprocess.run([sys.executable, "-c", "from stream.cli import main; raise SystemExit(main())", "filter",
                          str(stream), "--index", with_db(url, db) + query, "--unique", os.devnull, "-q"],
                         capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"neardup filter failed: {out.stderr.strip()[-500:]}")
    return used(r) - before


def read_back(r: redis.Redis) -> tuple[list[Slice], dict[str, object]]:
    """Every slice's fields, and the breakdown of today's layout."""
    slices = []
    kinds: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    keys: collections.Counter[tuple[str, str]] = collections.Counter()
    usage = 0
    no_ttl = 0
    for key in r.scan_iter(count=1000):
        usage += r.memory_usage(key, samples=0) or 0
        keys[(str(r.type(key), "ascii"), str(r.object("encoding", key), "ascii"))] += 1  # type: ignore[arg-type]
        no_ttl += r.pttl(key) < 0
        if b":s:" not in key:
            continue
        s = Slice(key)
        for f, v in r.hscan_iter(key, count=1000):
            kind = f[:1].decode()
            kinds[kind][0] += 1
            kinds[kind][1] += len(f) + len(v)
            if kind == "b":
                s.buckets[f] = parse_records(v)
                s.raw[f] = v
            elif kind == "e":
                s.entries[f] = v
            elif kind == "d":
                s.memos[f] = v
            else:
                s.other[f] = v
        seqs = {id: seq for records in s.buckets.values() for _, seq, id in records}
        s.seq = dict(seqs)
        for number, id in enumerate(sorted(seqs, key=seqs.__getitem__)):
            s.number[id] = number
        for f in s.entries:  # an entry without any record left (its buckets trimmed): numbered too
            s.number.setdefault(f[1:].decode("utf-8", "surrogatepass"), len(s.number))
        for f, v in s.entries.items():
            s.ts[f[1:].decode("utf-8", "surrogatepass")] = _TS.unpack_from(v, 1)[0]
        slices.append(s)
    top = max((seq for s in slices for seq in s.seq.values()), default=0)
    for s in slices:  # an entry without any record left: a seq of its own (the index gave it one)
        for id in s.ts:
            if id not in s.seq:
                top += 1
                s.seq[id] = top
    return slices, {"kinds": dict(kinds), "keys": dict(keys), "usage": usage, "no_ttl": no_ttl}


def short_value(s: Slice, records: list[tuple[float, int, str]]) -> bytes:
    return b"".join(_SHORT.pack(ts, s.number[id]) for ts, _, id in records)


def shard_bits(fields: int, fill: int) -> int:
    return max(0, math.ceil(math.log2(max(1, fields / fill))))


def shard_of(name: bytes, bits: int) -> int:
    """The shard of a bucket field: its key mixed (Fibonacci hashing: a key's own top bits carry its method's tag)."""
    return (int.from_bytes(name[1:9], "big") * 0x9E3779B97F4A7C15 & (1 << 64) - 1) >> (64 - bits) if bits else 0


def fnv(id: str) -> int:
    """The 64-bit FNV-1a hash of an id."""
    h = 0xCBF29CE484222325
    for byte in id.encode("utf-8", "surrogatepass"):
        h = (h ^ byte) * 0x100000001B3 & (1 << 64) - 1
    return h


def id_shard(id: str, bits: int) -> int:
    """The small hash of an `i<id>` field: the top bits of the id's FNV-1a hash (64 bits), mixed as a key."""
    return shard_of(b"i" + fnv(id).to_bytes(8, "big"), bits)


def compact_bits(s: Slice, fill: int) -> int:
    return shard_bits(len(s.buckets) + len(s.ts), fill)


def id_name(id: str) -> bytes:
    return b"i" + id.encode("utf-8", "surrogatepass")


def compact_small(name: bytes) -> bool:
    """Whether an `i<id>` field lives in a small hash (else in the slice's: a name a listpack does not hold)."""
    return len(name) <= LISTPACK_VALUE


def entry_name(seq: int) -> bytes:
    return b"e" + _SEQ.pack(seq)


MIX = 0x9E3779B97F4A7C15
MASK64 = (1 << 64) - 1
ID_TAG = 1 << 63  # the seq of a group's `i` record (the id's entry) has its top bit set: never a bucket's
GROUP_MARK_AFTER = 4  # groupmark: a bucket of more records than this lives in its own `b<key>` field


@dataclass
class Groups:
    """How `groupN` / `groupmarkN` / `groupshortN` / `groupmarkshortN` place one slice's records: per bucket
    field and per id, its group (the top `bits` of its key mixed) and the key its records carry."""

    bits: int
    key: dict[bytes, tuple[int, bytes]]  # b<key> -> (group, key bytes of its records)
    id_key: dict[str, tuple[int, bytes]]  # id -> (group, key bytes of its record)
    marked: set[bytes]  # bucket fields that live in the slice's hash (groupmark: more than 4 records)
    records: dict[int, list[tuple[int, bytes | None, bytes]]]  # group -> (seq, bucket field or None, record)


def group_spec(layout: str) -> tuple[int, bool, int]:
    """A group layout's (records a group, marks, bytes of key a record)."""
    rest = layout.removeprefix("group")
    mark = rest.startswith("mark")
    rest = rest.removeprefix("mark")
    short = rest.startswith("short")
    fill = rest.removeprefix("short")
    if not fill.isdigit() or not int(fill):
        raise SystemExit(f"unknown layout {layout!r}: group[mark][short]N, N records a group")
    return int(fill), mark, 4 if short else 8


def group_place(mixed: int, bits: int, width: int, key: bytes) -> tuple[int, bytes]:
    """A key's group (its mixed value's top bits) and what its records carry: the key (8 bytes), or the
    mixed value's low 32 bits (4: with the group's k bits, 32 + k of its 64 bits; two keys of a group
    alike in them by chance, 2^-32 a pair, read as one bucket)."""
    return (mixed >> (64 - bits) if bits else 0), (key if width == 8 else (mixed & 0xFFFFFFFF).to_bytes(4, "big"))


def group_plan(s: Slice, layout: str) -> Groups:
    """Where `layout` puts slice `s`'s records: k from the count of records its groups hold."""
    fill, mark, width = group_spec(layout)
    marked = {f for f, recs in s.buckets.items() if mark and len(recs) > GROUP_MARK_AFTER}
    held = sum(1 if f in marked else len(recs) for f, recs in s.buckets.items()) + len(s.ts)
    bits = shard_bits(held, fill)
    g = Groups(bits, {}, {}, marked, collections.defaultdict(list))
    for f in s.buckets:
        g.key[f] = group_place(int.from_bytes(f[1:9], "big") * MIX & MASK64, bits, width, f[1:9])
    for id in s.ts:
        h = fnv(id)
        g.id_key[id] = group_place(h * MIX & MASK64, bits, width, h.to_bytes(8, "big"))
    for f, recs in s.buckets.items():
        j, key = g.key[f]
        for ts, seq, _ in recs:
            g.records[j].append((seq, f, key + _TS.pack(ts) + _SEQ.pack(seq)))
    for id, (j, key) in g.id_key.items():
        g.records[j].append((s.seq[id], None, key + _TS.pack(s.ts[id]) + _SEQ.pack(s.seq[id] | ID_TAG)))
    for recs in g.records.values():
        recs.sort(key=lambda x: x[0])
    return g


def group_name(j: int) -> bytes:
    return b"g%d" % j


def group_value(g: Groups, j: int, top: int) -> bytes:
    """Group j as it is after the round whose last seq is `top`: its records in seq order; a bucket of more
    than 4 records so far (groupmark) is one mark record (its key, event time 0, seq 0) in its first's place."""
    recs = [(seq, f, rec) for seq, f, rec in g.records[j] if seq <= top]
    if not g.marked:
        return b"".join(rec for _, _, rec in recs)
    count = collections.Counter(f for _, f, _ in recs if f in g.marked)
    out, done = [], set()
    for _, f, rec in recs:
        if f is not None and count[f] > GROUP_MARK_AFTER:
            if f not in done:
                done.add(f)
                out.append(g.key[f][1] + _TS.pack(0.0) + _SEQ.pack(0))
        else:
            out.append(rec)
    return b"".join(out)


def write(r: redis.Redis, layout: str, slices: Sequence[Slice]) -> None:
    """The content of `slices` in `layout`, with a TTL on every key."""
    pipe = r.pipeline(transaction=False)
    n = 0

    def flush(force: bool = False) -> None:
        nonlocal n
        n += 1
        if force or n % 2000 == 0:
            pipe.execute()

    def write_small(name: bytes, small: dict[int, dict[bytes, bytes]]) -> None:
        """The small hashes of slice `name` (`name:<j>`), 500 fields a command, each with its TTL."""
        for j, pairs in small.items():
            key = name + b":%d" % j
            items = list(pairs.items())
            for a in range(0, len(items), 500):
                pipe.hset(key, mapping=dict(items[a : a + 500]))
                flush()
            pipe.pexpire(key, TTL_MS)

    for s in slices:
        base = dict(s.entries) | dict(s.memos) | dict(s.other)
        if layout == "today":
            base |= s.raw
        elif layout == "short":
            base |= {f: short_value(s, recs) for f, recs in s.buckets.items()}
            base |= {b"q" + struct.pack("<I", number): id.encode("utf-8", "surrogatepass")
                     for id, number in s.number.items()}
        elif layout.startswith("shards"):
            bits = shard_bits(len(s.buckets), int(layout[6:]))
            shards: dict[int, dict[bytes, bytes]] = collections.defaultdict(dict)
            for f, recs in s.buckets.items():
                value = short_value(s, recs)
                if len(value) > 64:
                    base[f] = value
                    value = MARK
                shards[shard_of(f, bits)][f] = value
            write_small(s.name, shards)
            base |= {b"q" + struct.pack("<I", number): id.encode("utf-8", "surrogatepass")
                     for id, number in s.number.items()}
        elif layout.startswith("compact"):
            both = layout.startswith("compactboth")
            bits = compact_bits(s, int(layout.removeprefix("compactboth").removeprefix("compact")))
            base = dict(s.memos) | dict(s.other)
            small: dict[int, dict[bytes, bytes]] = collections.defaultdict(dict)
            for f, recs in s.buckets.items():
                value = b"".join(_TS.pack(ts) + _SEQ.pack(seq) for ts, seq, _ in recs)
                if len(value) > LISTPACK_VALUE:
                    base[f] = value
                    if both:
                        continue
                    value = MARK
                small[shard_of(f, bits)][f] = value
            for f, blob in s.entries.items():
                id = f[1:].decode("utf-8", "surrogatepass")
                raw = f[1:]
                base[entry_name(s.seq[id])] = blob + raw + bytes([len(raw)])  # its id, then the id's length
                name = id_name(id)
                value = _TS.pack(s.ts[id]) + _SEQ.pack(s.seq[id])
                if compact_small(name):
                    small[id_shard(id, bits)][name] = value
                else:
                    base[name] = value
            write_small(s.name, small)
        elif layout in ("zset", "string"):
            for f, recs in s.buckets.items():
                key = s.name + b":" + f
                if layout == "zset":
                    pipe.zadd(key, {id: ts for ts, _, id in recs})
                else:
                    pipe.set(key, s.raw[f])
                pipe.pexpire(key, TTL_MS)
                flush()
        else:
            raise SystemExit(f"unknown layout {layout!r}")
        items = list(base.items())
        for a in range(0, len(items), 1000):
            pipe.hset(s.name, mapping=dict(items[a : a + 1000]))
            flush()
        pipe.pexpire(s.name, TTL_MS)
    flush(force=True)


def write_round(r: redis.Redis, writes: dict[bytes, dict[bytes, bytes]], count: collections.Counter[bytes]) -> None:
    """One uncontended insert round: each key's fields, a slice's count `n` raised, a TTL each, in one MULTI/EXEC."""
    pipe = r.pipeline(transaction=True)
    for key, pairs in writes.items():
        pipe.hset(key, mapping=pairs)
        if key in count:
            pipe.hincrby(key, "n", count[key])
        pipe.pexpire(key, TTL_MS)
    pipe.execute()


def write_rest(r: redis.Redis, slices: Sequence[Slice]) -> None:
    """The slices' memos and other fields (all but the count), after the rounds."""
    pipe = r.pipeline(transaction=False)
    for s in slices:
        pipe.hset(s.name, mapping=dict(s.memos) | {k: v for k, v in s.other.items() if k != b"n"})
        pipe.pexpire(s.name, TTL_MS)
    pipe.execute()


def write_rounds(r: redis.Redis, layout: str, slices: Sequence[Slice], per_round: int) -> None:
    """The content of `slices` in `today` or `compact*`, written as the index's uncontended insert rounds write
    it: `per_round` entries a round in seq order, one MULTI/EXEC each: the bucket fields the round's records
    touch (each with its value after the round), the entries, the count `n`, a PEXPIRE of every key written
    (compact: each small hash the round touches; a bucket value passing 64 bytes goes to the slice's hash and
    leaves its mark in its small hash). The memos and the other fields go in a last round."""
    compact = layout.startswith("compact")
    fill = int(layout.removeprefix("compactboth").removeprefix("compact")) if compact else 0
    both = layout.startswith("compactboth")
    touching: dict[int, list[tuple[Slice, bytes]]] = collections.defaultdict(list)  # seq -> its bucket fields
    order: list[tuple[int, Slice, str]] = []
    for s in slices:
        for f, recs in s.buckets.items():
            for _, seq, _ in recs:
                touching[seq].append((s, f))
        order += [(s.seq[id], s, id) for id in s.ts]
    order.sort(key=lambda x: x[0])
    bits = {s.name: compact_bits(s, fill) if compact else 0 for s in slices}
    marked: set[tuple[bytes, bytes]] = set()
    for at in range(0, len(order), per_round):
        part = order[at : at + per_round]
        top = part[-1][0]
        writes: dict[bytes, dict[bytes, bytes]] = collections.defaultdict(dict)
        count: collections.Counter[bytes] = collections.Counter()
        for seq, s, id in part:
            count[s.name] += 1
            raw = id.encode("utf-8", "surrogatepass")
            if compact:
                writes[s.name][entry_name(seq)] = s.entries[b"e" + raw] + raw + bytes([len(raw)])
                name, value = id_name(id), _TS.pack(s.ts[id]) + _SEQ.pack(seq)
                writes[s.name + b":%d" % id_shard(id, bits[s.name]) if compact_small(name) else s.name][name] = value
            else:
                writes[s.name][b"e" + raw] = s.entries[b"e" + raw]
            for s2, f in touching[seq]:
                recs = [x for x in s2.buckets[f] if x[1] <= top]
                if not compact:
                    writes[s2.name][f] = b"".join(_RECORD.pack(ts, len(i.encode("utf-8", "surrogatepass")))
                                                  + i.encode("utf-8", "surrogatepass") + _SEQ.pack(q)
                                                  for ts, q, i in recs)
                    continue
                value = b"".join(_TS.pack(ts) + _SEQ.pack(q) for ts, q, _ in recs)
                small = s2.name + b":%d" % shard_of(f, bits[s2.name])
                if len(value) > LISTPACK_VALUE:
                    writes[s2.name][f] = value
                    if not both and (s2.name, f) not in marked:
                        marked.add((s2.name, f))
                        writes[small][f] = MARK
                else:
                    writes[small][f] = value
        write_round(r, writes, count)
    write_rest(r, slices)


def write_group_rounds(r: redis.Redis, slices: Sequence[Slice], per_round: int, plans: dict[bytes, Groups]) -> None:
    """The content of `slices` in a group layout, in the index's uncontended insert rounds as `write_rounds`
    writes `today`: `per_round` entries a round in seq order, one MULTI/EXEC each: every group the round's
    records touch, whole (the client read it at its lookup), a marked bucket's own field (its records of
    event time and seq, 16 bytes each), the entries as `e<seq>` (compact's), the count `n`, a PEXPIRE of the
    slice hash. The memos and the other fields go in a last round."""
    touching: dict[int, list[tuple[Slice, bytes]]] = collections.defaultdict(list)  # seq -> its bucket fields
    order: list[tuple[int, Slice, str]] = []
    for s in slices:
        for f, recs in s.buckets.items():
            for _, seq, _ in recs:
                touching[seq].append((s, f))
        order += [(s.seq[id], s, id) for id in s.ts]
    order.sort(key=lambda x: x[0])
    for at in range(0, len(order), per_round):
        part = order[at : at + per_round]
        top = part[-1][0]
        writes: dict[bytes, dict[bytes, bytes]] = collections.defaultdict(dict)
        count: collections.Counter[bytes] = collections.Counter()
        touched: set[tuple[bytes, int]] = set()
        for seq, s, id in part:
            count[s.name] += 1
            raw = id.encode("utf-8", "surrogatepass")
            writes[s.name][entry_name(seq)] = s.entries[b"e" + raw] + raw + bytes([len(raw)])
            touched.add((s.name, plans[s.name].id_key[id][0]))
            for s2, f in touching[seq]:
                g = plans[s2.name]
                touched.add((s2.name, g.key[f][0]))
                if f in g.marked:
                    recs = [(ts, q) for ts, q, _ in s2.buckets[f] if q <= top]
                    if len(recs) > GROUP_MARK_AFTER:
                        writes[s2.name][f] = b"".join(_TS.pack(ts) + _SEQ.pack(q) for ts, q in recs)
        for name, j in touched:
            writes[name][group_name(j)] = group_value(plans[name], j, top)
        write_round(r, writes, count)
    write_rest(r, slices)


def value_bytes(replies: Sequence[object]) -> int:
    """The bytes of the values in a pipeline's replies (HMGET's lists, GET's and ZRANGE's)."""
    total = 0
    for reply in replies:
        for v in reply if isinstance(reply, list) else [reply]:
            if isinstance(v, bytes):
                total += len(v)
            elif isinstance(v, tuple):
                total += len(v[0]) + 8
    return total


def candidates(where: Sequence[tuple[Slice, bytes]], efield: bytes) -> list[tuple[Slice, str]]:
    """The first `CANDIDATES` distinct ids (and the slice of their entry) of the records of a message's
    buckets, itself left out: the entries its lookup reads."""
    out: dict[str, Slice] = {}
    me = efield[1:].decode("utf-8", "surrogatepass")
    for s, f in where:
        for _, _, id in reversed(s.buckets[f]):
            if id != me and id in s.ts and id not in out:
                out[id] = s
    return [(s, id) for id, s in list(out.items())[:CANDIDATES]]


def sample_lookups(slices: Sequence[Slice], n: int) -> list[tuple[bytes, list[tuple[Slice, bytes]]]]:
    """`n` indexed messages, spread over the stream: (entry field, [(slice, bucket field)] of its records)."""
    fields_of: dict[bytes, list[tuple[Slice, bytes]]] = collections.defaultdict(list)
    for s in slices:
        for f, recs in s.buckets.items():
            for _, _, id in recs:
                fields_of[b"e" + id.encode("utf-8", "surrogatepass")].append((s, f))
    ids = sorted(fields_of)
    step = max(1, len(ids) // n)
    return [(id, fields_of[id]) for id in ids[::step][:n]]


def lookup(r: redis.Redis, layout: str, slices: Sequence[Slice], batch: Sequence[tuple[bytes, list[tuple[Slice, bytes]]]],
           bits: dict[bytes, int]) -> int:
    """The reads of one batch of lookups in `layout`: every slice's fields (pipelined), then the ids. The bytes
    of the values its first round got."""
    if layout.startswith("compact"):
        return lookup_compact(r, layout, slices, batch, bits)
    pipe = r.pipeline(transaction=False)
    wanted: dict[bytes, list[bytes]] = collections.defaultdict(list)  # key -> fields
    for efield, where in batch:
        for s in slices:  # its entry and memo, in every slice read
            wanted[s.name] += [efield, b"d" + efield[1:]]
        for s, f in where:
            if layout in ("today", "short"):
                wanted[s.name].append(f)
            elif layout.startswith("shards"):
                wanted[s.name + b":%d" % shard_of(f, bits[s.name])].append(f)
            else:
                wanted[s.name + b":" + f].append(f)
    order = []
    for key, named in wanted.items():
        fields = list(dict.fromkeys(named))  # each field once, as the index's lookup reads it (plan_fields)
        if layout == "zset" and b":b" in key:
            pipe.zrange(key, 0, -1, withscores=True)
        elif layout == "string" and b":b" in key:
            pipe.get(key)
        else:
            for a in range(0, len(fields), PER_HMGET):
                pipe.hmget(key, fields[a : a + PER_HMGET])
                order.append((key, fields[a : a + PER_HMGET]))
    replies = pipe.execute()
    got = value_bytes(replies)
    if layout == "today":  # the candidates' entries, by id
        by_slice: dict[bytes, list[bytes]] = collections.defaultdict(list)
        for efield, where in batch:
            for s, id in candidates(where, efield):
                by_slice[s.name].append(b"e" + id.encode("utf-8", "surrogatepass"))
        for key, fields in by_slice.items():
            pipe.hmget(key, fields)
        pipe.execute()
    if layout not in ("short",) and not layout.startswith("shards"):
        return got
    # Second round: buckets kept in the slice's hash (shards: their mark), and the ids of up to 8 records a
    # message (the candidates whose entries the index reads).
    pipe = r.pipeline(transaction=False)
    values = [(key, f, v) for (key, fields), reply in zip(order, [x for x in replies if isinstance(x, list)])
              for f, v in zip(fields, reply)]
    for key, f, v in values:
        if v == MARK:
            pipe.hget(key.rsplit(b":", 1)[0], f)
    numbers: dict[bytes, set[bytes]] = collections.defaultdict(set)
    for key, f, v in values:
        if f[:1] == b"b" and v and v != MARK:
            name = key if layout == "short" else key.rsplit(b":", 1)[0]
            numbers[name].update(v[at + 8 : at + 12] for at in range(0, min(len(v), 8 * 12), 12))
    for name, found in numbers.items():
        pipe.hmget(name, [b"q" + x for x in found])
    pipe.execute()
    return got


def lookup_compact(r: redis.Redis, layout: str, slices: Sequence[Slice],
                   batch: Sequence[tuple[bytes, list[tuple[Slice, bytes]]]], bits: dict[bytes, int]) -> int:
    """One batch of lookups in `compactN` / `compactbothN`: per slice read, the small hashes' bucket and
    `i<id>` fields and the slice hash's memos (and, for `compactboth`, every bucket field again), in one
    round; then the buckets marked as kept in the slice hash (`compactN`, a round when any); then the
    candidates' entries, by seq."""
    both = layout.startswith("compactboth")
    pipe = r.pipeline(transaction=False)
    wanted: dict[bytes, list[bytes]] = collections.defaultdict(list)  # key -> fields
    for efield, where in batch:
        id = efield[1:].decode("utf-8", "surrogatepass")
        name = id_name(id)
        for s in slices:  # its i<id> and memo, in every slice read
            wanted[s.name + b":%d" % id_shard(id, bits[s.name]) if compact_small(name) else s.name].append(name)
            wanted[s.name].append(b"d" + efield[1:])
        for s, f in where:
            wanted[s.name + b":%d" % shard_of(f, bits[s.name])].append(f)
            if both:
                wanted[s.name].append(f)
    order = []
    for key, named in wanted.items():
        fields = list(dict.fromkeys(named))  # each field once, as the index's lookup reads it (plan_fields)
        for a in range(0, len(fields), PER_HMGET):
            pipe.hmget(key, fields[a : a + PER_HMGET])
            order.append((key, fields[a : a + PER_HMGET]))
    replies = pipe.execute()
    got = value_bytes(replies)
    marked = collections.defaultdict(list)
    for (key, fields), reply in zip(order, replies):
        for f, v in zip(fields, reply):
            if v == MARK:
                marked[key.rsplit(b":", 1)[0]].append(f)
    if marked:
        for key, fields in marked.items():
            pipe.hmget(key, fields)
        pipe.execute()
    read_entries(pipe, batch)
    return got


def read_entries(pipe: redis.client.Pipeline, batch: Sequence[tuple[bytes, list[tuple[Slice, bytes]]]]) -> None:
    """The second round of a lookup by seq (compact and group layouts): the candidates' entries `e<seq>`, an
    `HMGET` a slice."""
    by_slice: dict[bytes, list[bytes]] = collections.defaultdict(list)
    for efield, where in batch:
        for s, id in candidates(where, efield):
            by_slice[s.name].append(entry_name(s.seq[id]))
    for key, names in by_slice.items():
        pipe.hmget(key, names)
    pipe.execute()


def lookup_group(r: redis.Redis, slices: Sequence[Slice], batch: Sequence[tuple[bytes, list[tuple[Slice, bytes]]]],
                 plans: dict[bytes, Groups], layout: str) -> int:
    """One batch of lookups in a group layout: per slice one `HMGET` (chunked as today's) of every distinct
    group the batch's bucket fields and ids fall in, and of its memos; then the buckets marked as kept in
    their own field (groupmark, a round when any); then the candidates' entries, by seq."""
    width = group_spec(layout)[2]
    pipe = r.pipeline(transaction=False)
    wanted: dict[bytes, dict[bytes, None]] = collections.defaultdict(dict)  # key -> its fields, once each
    for efield, where in batch:
        id = efield[1:].decode("utf-8", "surrogatepass")
        mixed = fnv(id) * MIX & MASK64
        for s in slices:  # its id's group and its memo, in every slice read
            wanted[s.name][group_name(group_place(mixed, plans[s.name].bits, width, b"")[0])] = None
            wanted[s.name][b"d" + efield[1:]] = None
        for s, f in where:
            wanted[s.name][group_name(plans[s.name].key[f][0])] = None
    for key, fields in wanted.items():
        names = list(fields)
        for a in range(0, len(names), PER_HMGET):
            pipe.hmget(key, names[a : a + PER_HMGET])
    got = value_bytes(pipe.execute())
    marked: dict[bytes, dict[bytes, None]] = collections.defaultdict(dict)
    for _, where in batch:
        for s, f in where:
            if f in plans[s.name].marked:  # its group holds the mark (the client finds it scanning the group)
                marked[s.name][f] = None
    if marked:
        for key, fields in marked.items():
            pipe.hmget(key, list(fields))
        pipe.execute()
    read_entries(pipe, batch)
    return got


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stream", type=Path, default=ROOT.parent / "shared" / "eval" / "stream.jsonl")
    p.add_argument("--redis", default=os.environ.get("NEARDUP_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--db", type=int, default=10, help="the database this benchmark owns (FLUSHed)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--lookups", type=int, default=4096)
    p.add_argument("--compact-index", action="store_true",
                   help="also run the stream through the compact layout's index (?layout=compact) and measure it")
    p.add_argument("--round", type=int, default=512, help="entries a write round of `today`, `compact*` and `group*` writes")
    p.add_argument("--batch", type=int, default=BATCH, help="lookups a round reads (fewer: fewer fields per small hash)")
    p.add_argument("--layouts", default="today,short,shards256,compact128,compact256,compactboth256,zset,string")
    args = p.parse_args(argv)
    needs.files(__file__, args.stream, what="the stream (give --stream)")
    needs.redis(__file__, args.redis)
    r = client(args.redis, args.db)
    layouts = args.layouts.split(",")
    for layout in layouts:  # a misspelt group layout: one line before the stream's run
        if layout.startswith("group"):
            group_spec(layout)
    try:
        if args.compact_index:  # the compact layout's own index (?layout=compact), measured first
            compact_delta = run_index(args.redis, args.db, args.stream, "?layout=compact")
            usage, encodings, no_ttl, entries = 0, collections.Counter(), 0, 0
            for key in r.scan_iter(count=1000):
                usage += r.memory_usage(key, samples=0) or 0
                encodings[r.object("encoding", key).decode()] += 1
                no_ttl += r.pttl(key) < 0
                if key.count(b":") == 3 and b":c:" in key:  # a slice hash: its count of entries
                    entries += int(r.hget(key, "n") or 0)
            print(f"The compact index (?layout=compact) as `neardup filter` leaves it: {entries:,} messages indexed, "
                  f"used_memory {compact_delta / entries:,.0f} bytes per message indexed, MEMORY USAGE "
                  f"{usage / entries:,.0f}; keys by encoding {dict(encodings.most_common())}; keys without a TTL: "
                  f"{no_ttl}\n")
        delta = run_index(args.redis, args.db, args.stream)
        slices, today = read_back(r)
        indexed = sum(len(s.entries) for s in slices)
        kinds = today["kinds"]
        assert isinstance(kinds, dict)
        print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {args.stream.name}: {indexed:,} messages indexed")
        usage = today["usage"]
        assert isinstance(usage, int)
        print(f"\nThe index as `neardup filter` leaves it: used_memory {delta / indexed:,.0f} bytes per message indexed, "
              f"MEMORY USAGE {usage / indexed:,.0f}; keys by type and encoding {today['keys']}; "
              f"keys without a TTL: {today['no_ttl']}\n")
        print("| field | per message indexed | bytes of name and value per message indexed |")
        print("|---|---|---|")
        for kind, (count, size) in sorted(kinds.items()):
            print(f"| {kind} | {count / indexed:.2f} | {size / indexed:,.1f} |")
        records = collections.Counter(len(recs) for s in slices for recs in s.buckets.values())
        print(f"\nrecords per bucket field: 1: {records[1] / sum(records.values()):.1%}, 2-4: "
              f"{sum(records[k] for k in (2, 3, 4)) / sum(records.values()):.1%}, 5+: "
              f"{sum(v for k, v in records.items() if k >= 5) / sum(records.values()):.1%}")
        memory: dict[str, tuple[float, float, str]] = {}
        writing: dict[str, list[float]] = {layout: [] for layout in layouts}
        written: dict[str, float] = {}  # bytes Redis received a message written
        cpu: dict[str, list[float]] = {layout: [] for layout in layouts}
        sent: dict[str, list[float]] = {layout: [] for layout in layouts}  # bytes Redis sent a lookup
        first: dict[str, float] = {}  # bytes of the values a lookup's first round got
        sample = sample_lookups(slices, args.lookups)
        plans: dict[str, dict[bytes, Groups]] = {layout: {s.name: group_plan(s, layout) for s in slices}
                                                 for layout in layouts if layout.startswith("group")}
        for run in range(args.runs):
            for layout in layouts:  # alternating; what each layout holds: its first run's
                r.flushdb()
                if not run:
                    before = used(r)
                r.config_resetstat()
                start = server_cpu(r)
                if layout.startswith("group"):
                    write_group_rounds(r, slices, args.round, plans[layout])
                elif layout == "today" or layout.startswith("compact"):
                    write_rounds(r, layout, slices, args.round)
                else:
                    write(r, layout, slices)
                writing[layout].append((server_cpu(r) - start) / indexed * 1e6)
                if not run:
                    written[layout] = int(r.info("stats")["total_net_input_bytes"]) / indexed
                    after = used(r)
                    encodings: collections.Counter[str] = collections.Counter()
                    usage = 0
                    for key in r.scan_iter(count=1000):
                        usage += r.memory_usage(key, samples=0) or 0
                        encodings[r.object("encoding", key).decode()] += 1
                    memory[layout] = ((after - before) / indexed, usage / indexed,
                                      ", ".join(f"{k} {v:,}" for k, v in encodings.most_common()))
                bits = {s.name: shard_bits(len(s.buckets), int(layout[6:])) if layout.startswith("shards") else
                        compact_bits(s, int(layout.removeprefix("compactboth").removeprefix("compact")))
                        if layout.startswith("compact") else 0 for s in slices}
                r.config_resetstat()
                start = server_cpu(r)
                got = 0
                for at in range(0, len(sample), args.batch):
                    if layout.startswith("group"):
                        got += lookup_group(r, slices, sample[at : at + args.batch], plans[layout], layout)
                    else:
                        got += lookup(r, layout, slices, sample[at : at + args.batch], bits)
                first[layout] = got / len(sample)
                cpu[layout].append((server_cpu(r) - start) / len(sample) * 1e6)
                sent[layout].append(int(r.info("stats")["total_net_output_bytes"]) / len(sample))
        print(f"\n| layout | used_memory bytes per message indexed | MEMORY USAGE | ÷ today | keys by encoding "
              f"| server CPU µs per lookup (median of {args.runs}) | min–max | server CPU µs per message written "
              f"(median of {args.runs}) | min–max |")
        print("|---|---|---|---|---|---|---|---|---|")
        for layout in layouts:
            a, b, enc = memory[layout]
            ratio = f"{a / memory['today'][0]:.2f}" if "today" in memory else "–"
            w = writing[layout]
            print(f"| {layout} | {a:,.0f} | {b:,.0f} | {ratio} | {enc} | {statistics.median(cpu[layout]):.1f} | "
                  f"{min(cpu[layout]):.1f}–{max(cpu[layout]):.1f} | {statistics.median(w):.1f} | "
                  f"{min(w):.1f}–{max(w):.1f} |")
        print("\n| layout | used_memory ÷ today | server CPU µs per message, lookup + write | ÷ today | bytes Redis sends "
              "per lookup | ÷ today | of which values of the first round (buckets, memos, own entry) | bytes Redis "
              "receives per message written | ÷ today | records a bucket read scans (mean) | records per group "
              "(mean) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        base = "today" if "today" in layouts else layouts[0]

        def both(layout: str) -> float:
            return statistics.median(cpu[layout]) + statistics.median(writing[layout])

        for layout in layouts:
            scans, fill = "–", "–"
            if layout.startswith("group"):
                g = plans[layout]
                size = {(name, j): len(group_value(p, j, 1 << 62)) // (16 + group_spec(layout)[2])
                        for name, p in g.items() for j in p.records}
                reads = [(s, f) for _, where in sample for s, f in where]
                scans = f"{statistics.mean(size[(s.name, g[s.name].key[f][0])] for s, f in reads):.1f}"
                fill = f"{statistics.mean(size.values()):.1f}"
            elif layout in ("today", "short", "string", "zset"):
                scans = f"{statistics.mean(len(s.buckets[f]) for _, where in sample for s, f in where):.1f}"
            print(f"| {layout} | {memory[layout][0] / memory[base][0]:.2f} | {both(layout):.1f} | "
                  f"{both(layout) / both(base):.2f} | {statistics.median(sent[layout]):,.0f} | "
                  f"{statistics.median(sent[layout]) / statistics.median(sent[base]):.2f} | {first[layout]:,.0f} | "
                  f"{written[layout]:,.0f} | "
                  f"{written[layout] / written[base]:.2f} | {scans} | {fill} |")
    finally:
        r.flushdb()
        r.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
