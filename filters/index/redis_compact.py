"""The compact slot layout of the Redis index (docs/design.md, "The compact slot layout"): `RedisIndex`'s
protocol, its records of (event time, seq) in small listpack hashes and its entries keyed by seq.

Chosen by `?layout=compact`: about 0.56 of the slot layout's memory a message for 1.1-1.3 times its CPU. What
it does not do, against `RedisIndex`: the uncontended round without WATCH (Redis Cluster runs the checking
script), a rebuild of a window of more than `HOLD_IDS` ids at its speed (the rest goes in guarded
transactions).
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import chain, islice
from typing import Any, ClassVar, Protocol, cast

import numpy as np

from filters.errors import ConfigError, IndexCorrupt
from filters.index import Candidate, Entry, Query, Stored, new_candidate
from filters.index import compact_codec as cc
from filters.index import redis as slot  # its restore's chunk and attempts, read when restoring
from filters.index.redis import (
    _MAX_SLICE,
    _MIN_TS,
    FIELDS_PER_CALL,
    FIELDS_PER_HMGET,
    INSERT_CHUNK,
    MARKER,
    REBUILDING,
    STAMP,
    RedisIndex,
    RedisTarget,
    _event_time,
    _lua,
    _Script,
    _SentRead,
    _stored_time,
    _View,
    kept_ranking,
)
from filters.index.redis_codec import ABSENT, SEQ, decode_entry, decode_memo, encode_entry, memo_time
from filters.records import Verdict

try:  # the compiled core; absent when it could not be built at install time (no C++ compiler)
    import filters._native as _native
except ImportError:  # pragma: no cover - exercised on machines without a compiler
    _native = None

try:  # redis-py's C protocol parser (the `redis` extra); packs commands where the compiled core is absent
    import hiredis
except ImportError:  # pragma: no cover - without the extra, the commands go through redis-py's pipeline
    hiredis = None  # type: ignore[assignment]

_FIB = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
STATS_SAMPLE = 1 << cc.K_MIN  # small hashes a slice whose fields `stats` counts (all of a slice of the fewest)
MARKS_KEPT = 1 << 16  # marked buckets a client remembers a slice (read in the slice hash at once)
REAP_KEYS = 1024  # small hashes an UNLINK of a slice that left the window names ...
REAP_COMMANDS = 4  # ... and such commands sent with a lookup
HOLD_RECORDS = 1 << 24  # bucket records a rebuild holds (~20 bytes each) before it writes them and goes on ...
HOLD_IDS = 1 << 22  # ... and ids inside the window it knows (~100 bytes each) before it hands the rest on
# A rebuild writes a slice's small hashes in 16 shares (a slice has at least 2^K_MIN), each made while the one
# before is sent: what a share's values take in memory a sixteenth of the slice's.
WRITE_SHARE_BITS = 4
SEND_BYTES = 1 << 20  # ... sent in pieces of at most this many bytes, each within the socket's timeout
READ_COMMANDS = 1 << 16  # a rebuild's reads of what Redis holds go this many commands a round trip


def _script() -> _Script:
    bits = f"{cc.K_FIRST}, {cc.K_MIN}, {cc.K_MAX}, {cc.FIELDS_PER_ENTRY}, {cc.SMALL_FILL}, {cc.UNLINK_INLINE_BITS}"
    source = _lua("trim16.lua", "insert_slices.lua", "round_start.lua", "compact_insert.lua")
    return _Script.of(source.replace("ROUND_LAYOUT", f"'{cc.LAYOUT}'").replace("ROUND_FIXED", "false")
                      .replace("COMPACT_BITS", bits))


COMPACT_INSERT = _script()


@dataclass(frozen=True, slots=True)
class _Packed:
    """Commands packed as RESP already (`compact_codec.pack_reads`, `pack_writes`), in a list of commands that
    `CompactIndex._send` sends: their bytes and their number (of replies)."""

    data: bytes
    count: int


def _replies(commands: Sequence[Sequence[Any] | _Packed]) -> int:
    """The number of replies `commands` get."""
    return sum(c.count if type(c) is _Packed else 1 for c in commands)


def _pack(commands: list[Sequence[Any]]) -> bytes:
    """Commands as one RESP request (as `RedisIndex._pack_and_send` packs them)."""
    if _native is not None:
        return cast(bytes, _native.pack_commands(commands))
    return b"".join(hiredis.pack_command(tuple(command)) for command in commands)


def _pieces(commands: Sequence[Sequence[Any] | _Packed]) -> tuple[list[bytes], int]:
    """Commands some of which are packed already (`_Packed`) as pieces of RESP (the packed ones, and each run of
    the others packed), and the number of replies they get."""
    blobs: list[bytes] = []
    run: list[Any] = []
    count = 0
    for command in commands:
        if type(command) is _Packed:
            if run:
                blobs.append(_pack(run))
                run = []
            blobs.append(command.data)
            count += command.count
        else:
            run.append(command)
            count += 1
    if run:
        blobs.append(_pack(run))
    return blobs, count


@dataclass(slots=True)
class _HeldFields:
    """A rebuild's bucket and id fields not written yet (`CompactIndex._rebuild_compact`), in flat arrays: per
    slice, a chunk at a time, the bucket keys of the entries it took there (all of them, in order) and each
    entry's number of keys, event time, seq and id (`held_pairs` makes the fields of them); and per slice the
    rebuild wrote entries to, the bits an earlier write of what was held gave it (its fields are read back
    when written again) and the entries its count holds."""

    parts: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[str]]]] = field(
        default_factory=dict)
    slices: set[int] = field(default_factory=set)  # slices the rebuild wrote entries to, not dropped
    written: dict[int, int] = field(default_factory=dict)  # slice -> its bits, once held fields were written there
    counted: dict[int, int] = field(default_factory=dict)  # slice -> the entries its count `n` holds
    records: int = 0  # bucket records held

    def add(self, s: int, keys: np.ndarray, sizes: np.ndarray, times: np.ndarray, seqs: np.ndarray,
            ids: list[str]) -> None:
        """Entries taken into slice `s`: their bucket keys, number of keys, event times, seqs and ids."""
        self.parts.setdefault(s, []).append((keys, sizes, times, seqs, ids))
        self.slices.add(s)
        self.records += len(keys)

    def columns(self, s: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[str]]:
        """What is held of slice `s` as `held_pairs` takes it: keys, bounds, event times, seqs, ids."""
        parts = self.parts.get(s, [])
        sizes = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, np.int64)
        return (np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.uint64),
                np.concatenate(([0], np.cumsum(sizes))).astype(np.int64),
                np.concatenate([p[2] for p in parts]) if parts else np.zeros(0),
                np.concatenate([p[3] for p in parts]) if parts else np.zeros(0, np.uint64),
                [id for p in parts for id in p[4]])

    def drop(self, s: int) -> int | None:
        """Forgets slice `s` (it left the window); returns the bits it was written with, None if never."""
        self.records -= sum(len(p[0]) for p in self.parts.pop(s, []))
        self.slices.discard(s)
        self.counted.pop(s, None)
        return self.written.pop(s, None)

    def clear(self) -> None:
        """Forgets what is held (it was written), not the slices written."""
        self.parts = {}
        self.records = 0


class _RebuildPlan(Protocol):
    """What a rebuild (`CompactIndex._rebuild_compact`) tells from its entries alone, as its layout's guarded
    chunks would decide it: which entries the insert takes and their seqs, the entries of each slice, the bits
    of a slice it makes and the slices that leave the window."""

    counts: dict[int, int]  # slice -> entries taken there (its count `n`)

    def part(self, times: np.ndarray, slices: np.ndarray) -> None:
        """A part begins: its entries' event times and slices."""

    def accept(self, ids: Sequence[str], at: int, live: dict[str, float], hwm: float,
               seq: int) -> tuple[np.ndarray, float, int, list[tuple[int, int]]]:
        """Entries `at` to `at + len(ids)` of the part: (seq or 0 each, as uint64; high-water mark; seq; the
        slices unlinked among them, in order, each after the entries before `at` + its first number)."""
        ...

    def left(self, slices: Iterable[int], hwm: float) -> list[int]:
        """Those of the `slices` held that left the window once the chunk's high-water mark is `hwm`."""
        ...

    def bits_of(self, s: int) -> int:
        """The bits of slice `s`, which the rebuild makes."""
        ...


class _RatePlan:
    """The compact layout's `_RebuildPlan`: the entries the insert takes (`restore_accept`), the rate they show
    in each slice (a slice made gets the bits of its count, the count of the slice before, the rate restored
    there: `expected_counts`), and the slices before the window of the chunk's high-water mark."""

    def __init__(self, index: CompactIndex) -> None:
        self._index = index
        self.counts: dict[int, int] = {}
        self._rates: dict[int, list[float]] = {}  # slice -> [entries, earliest, latest event time] restored there
        self._times: np.ndarray = np.zeros(0)
        self._slices: np.ndarray = np.zeros(0, np.int64)

    def part(self, times: np.ndarray, slices: np.ndarray) -> None:
        self._times, self._slices = times, slices
        for s in np.unique(slices).tolist():
            there = times[slices == s]
            rate = self._rates.setdefault(int(s), [0, math.inf, -math.inf])
            rate[0] += len(there)
            rate[1], rate[2] = min(rate[1], float(there.min())), max(rate[2], float(there.max()))

    def accept(self, ids: Sequence[str], at: int, live: dict[str, float], hwm: float,
               seq: int) -> tuple[np.ndarray, float, int, list[tuple[int, int]]]:
        index, stop = self._index, at + len(ids)
        seqs, hwm, seq = index._restore_accept(ids, self._times[at:stop], live, hwm, index.window, seq)
        slices, many = np.unique(self._slices[at:stop][seqs > 0], return_counts=True)
        for s, count in zip(slices.tolist(), many.tolist()):
            self.counts[s] = self.counts.get(s, 0) + count
        return seqs, hwm, seq, []

    def left(self, slices: Iterable[int], hwm: float) -> list[int]:
        low = self._index._slice(hwm - self._index.window)
        return [s for s in slices if s < low]

    def bits_of(self, s: int) -> int:
        length = self._index.slice_length
        count, low, high = self._rates.get(s, [0, 0.0, 0.0])
        expected = math.ceil(count * length / max(high - low, length / 1024))
        return max(cc.slice_bits(self.counts.get(s - 1)), cc.slice_bits(self.counts.get(s, 0)),
                   cc.slice_bits(expected), cc.slice_bits(self._index._rate_count))


def _distinct_keys(keys: np.ndarray) -> list[bytes]:
    """The distinct bucket keys of `keys`, each as its 8 bytes big-endian."""
    raw = np.unique(keys).astype(">u8").tobytes()
    return [raw[a : a + 8] for a in range(0, len(raw), 8)]


def _mixed32(h: int) -> bytes:
    """The top 32 bits of a 64-bit hash times the Fibonacci constant: a small hash is their top k bits."""
    return ((h * _FIB & _MASK64) >> 32).to_bytes(4, "big")


class CompactIndex(RedisIndex):
    """`RedisIndex` in the compact layout (`?layout=compact`); see the module's docstring for what it does not
    do yet."""

    LAYOUT: ClassVar[str] = cc.LAYOUT  # the meta hash's `layout` of a namespace of this layout
    CHECKING: ClassVar[_Script] = COMPACT_INSERT  # the checking script: a contended round

    def __init__(self, url: str, *, window: float, bucket_cap: int, namespace: str, fenced: bool = False) -> None:
        super().__init__(url, window=window, bucket_cap=bucket_cap, namespace=namespace, fenced=fenced)
        self._spre = f"{{{self.prefix}:{namespace}}}:c:"
        # The plan of the read sent ahead (`prefetch`): per slice its reads' places, the bits it was read with,
        # and its number of replies.
        self._ahead_plan: tuple[list[list[list[int]]], dict[int, int | None], int, list[int]] | None = None
        self._bits: dict[int, int] = {}  # slice -> its bits, as its meta field `k:<n>` says (never changes)
        self._marks: dict[int, set[bytes]] = {}  # slice -> buckets read as the mark (kept in the slice hash)
        self._counts: dict[int, int] = {}  # slice -> its count of entries as last read
        self._by_seq: dict[int, Entry] = {}  # entries written or read lately, by seq
        # Slices that left the window whose small hashes this client unlinks, a few commands a lookup:
        # [slice, bits, the next small hash to unlink] (`_reap_commands`).
        self._reaping: list[list[int]] = []
        self._stored_top = -math.inf  # the namespace's high-water mark as the last read found it
        # The namespace as the last read found it: its seq, marker and token (`_check_continuity`); the token
        # this client leaves if it makes the namespace.
        self._top_seq = 0
        self._seen_marker: bytes | None = None
        self._gen: bytes | None = None
        self._token = uuid.uuid4().hex
        # Small hashes whose TTL this client set in the current period, a bitset a slice (`_renewing`).
        self._renew_period = max(0.0, self._ttl_ms / 1000 - self.window) / 2
        self._renewed: dict[int, bytearray] = {}
        self._renewed_at = -math.inf
        self._restoring = False  # a restore is running (`restore`): the reads ask for no marker
        # Entries a restore expects in each slice, from the rate its entries show there (`restore`): a slice it
        # makes gets the bits for them, not only for the slice before it (a rebuilt namespace has none).
        self._expected: dict[int, int] = {}
        # Entries a slice is expected to hold at the rate the URL names (`rate`, messages a second; 0 for none):
        # a slice made with no slice before it (or after one that held fewer) gets the small hashes for them.
        rate = RedisTarget.parse(url).rate
        self._rate_count = math.ceil(rate * self.slice_length) if rate else 0
        self._alone_compact = _native.alone_compact if _native is not None else cc.alone_round
        self._rank_compact = _native.rank_compact if _native is not None else cc.rank_records
        self._rank_batch = kept_ranking("rank_all_compact", cc.rank_all)
        self._read_commands_of = _native.read_commands if _native is not None else cc.read_commands
        self._column_of = _native.column_of if _native is not None else cc.column_of
        self._marked_places = _native.marked_places if _native is not None else cc.marked_places
        self._write_commands_of = _native.write_commands if _native is not None else cc.write_commands
        self._pack_reads = _native.pack_reads if _native is not None else cc.pack_reads
        self._first_error = _native.first_error if _native is not None else cc.first_error
        self._pack_writes = _native.pack_writes if _native is not None else cc.pack_writes
        self._entry_pairs = _native.entry_pairs if _native is not None else cc.entry_pairs
        self._held_pairs = _native.held_pairs if _native is not None else cc.held_pairs
        self._id_shares = _native.id_shares if _native is not None else cc.id_shares
        # A slice's reads and writes go packed at once (`_Packed`) where the commands go packed on one connection.
        self._packs = self._direct()

    # -- plumbing ------------------------------------------------------------------------------------
    def _raise_any(self, replies: Sequence[Any]) -> None:
        """Raises the first error reply among `replies`, if any (`RedisIndex`'s `_raise_any`, compiled)."""
        error = self._first_error(replies)
        if error is not None:
            raise error

    @staticmethod
    def _pack_send(conn: Any, commands: Sequence[Sequence[str | int | bytes] | _Packed]) -> int:
        """`RedisIndex._pack_and_send` of commands some of which are packed already (`_Packed`); returns the
        number of replies they get."""
        if not any(type(c) is _Packed for c in commands):
            RedisIndex._pack_and_send(conn, cast("Sequence[Sequence[str | int | bytes]]", commands))
            return len(commands)
        blobs, count = _pieces(commands)
        conn.send_packed_command([b"".join(blobs)])
        return count

    # -- reading -------------------------------------------------------------------------------------
    def _planned(self, queries: Sequence[Query]) -> tuple[list[bytes], list[list[bytes]], list[list[int]], list[int]]:
        try:
            return cast("tuple[list[bytes], list[list[bytes]], list[list[int]], list[int]]",
                        self._plan([q.keys for q in queries], [cc.id_field(q.id) for q in queries]))
        except (OverflowError, ValueError):
            raise ValueError(f"bucket keys must be unsigned 64-bit ints: {[q.keys for q in queries]!r}") from None

    def _read(self, names: Sequence[bytes], slices: Sequence[int], *,
              watch: bool = False) -> tuple[int, bytes, list[list[bytes | None]]]:
        """(seq, stored high-water mark, per slice the values of `names`, a bucket kept in the slice hash read
        there): the meta hash first (its layout and the bits of each slice), then each slice's small hashes
        and slice hash; a slice whose bits the client did not know is read again with them."""
        known: dict[int, int | None] = {s: self._bits.get(s) for s in slices}
        gone = self._gone()
        probes = [gone - 1, gone] if gone is not None else []
        reap = self._reap_commands()
        for _ in range(3):
            # The reaping first: its HDEL of the meta hash must come before the WATCH, not dirty it.
            commands: list[Sequence[Any]] = [*reap, ("UNWATCH",), ("WATCH", self._meta)] if watch else [*reap]
            skip = _replies(commands)
            reads, plans = self._read_plan(names, slices, known, probes)
            with self._errors():
                replies = self._execute(commands + reads)
                self._raise_any(replies)
            reap = []
            seq, stored, columns, read = self._parse_read(replies[skip:], names, slices, plans, probes)
            if all(read[s] == known[s] for s in slices):
                break
            known = read  # made (or made again) meanwhile: read with its bits
        else:
            raise IndexCorrupt(f"the Redis index at {self._where}: the bits of its slices keep changing")
        self._resolve_marks(names, slices, columns)
        low = min(slices, default=0) - 1
        for cache in (self._bits, self._marks, self._counts, self._renewed):
            for s in [s for s in cache if s < low]:
                del cache[s]
        return seq, stored, columns

    def _read_plan(self, names: Sequence[bytes], slices: Sequence[int], known: dict[int, int | None],
                   probes: Sequence[int]) -> tuple[list[Sequence[Any]], list[list[list[int]]]]:
        """A read's commands (the meta hash's `HMGET`, then per slice its reads and its count) and, per slice,
        the places of the names each of its reads reads. A slice of unknown bits reads its slice hash only."""
        commands: list[Any] = [("HMGET", self._meta, "seq", "hwm", *((MARKER,) if self.fenced else ()),
                                "layout", "gen", *(f"k:{s}" for s in slices), *(f"k:{g}" for g in probes))]
        plans = []
        for s in slices:
            key = f"{self._spre}{s}"
            bits = known[s]
            if self._packs:  # packed at once; bits None (no small hash yet): the slice hash's fields only
                blob, places = self._pack_reads(key, list(names), bits, self._marks.get(s, set()), FIELDS_PER_HMGET)
                commands += [_Packed(blob, len(places)), ("HGET", key, "n")]
                plans.append(places)
                continue
            if bits is None:  # no small hash yet: only the fields of the slice hash
                reads, places = self._read_commands_of(key, list(names), 0, set(), FIELDS_PER_HMGET)
                kept = [k for k, command in enumerate(reads) if command[1] == key]
                reads, places = [reads[k] for k in kept], [places[k] for k in kept]
            else:
                reads, places = self._read_commands_of(key, list(names), bits, self._marks.get(s, set()),
                                                       FIELDS_PER_HMGET)
            commands += [*reads, ("HGET", key, "n")]
            plans.append(places)
        return commands, plans

    def _parse_read(self, replies: Sequence[Any], names: Sequence[bytes], slices: Sequence[int],
                    plans: Sequence[list[list[int]]], probes: Sequence[int]) -> tuple[
                        int, bytes, list[list[bytes | None]], dict[int, int | None]]:
        """(seq, stored high-water mark, columns, the bits of each slice as the meta hash says) of the replies of
        `_read_plan`'s commands; refuses a namespace of another layout; learns the bits and counts."""
        state = replies[0]
        extra = 3 if self.fenced else 2
        self._check_continuity(state, state[extra + 1])
        if self._restoring:  # a rebuild writes before the guard sets the marker: none is asked for
            seq, stored = int(state[0] or 0), state[1] or b""
        else:
            seq, stored = self._state(state)
        layout = state[extra]
        if state[0] is not None and layout != cc.LAYOUT.encode():
            raise ConfigError(f"the Redis index at {self._where} holds namespace {self.namespace!r} in another "
                              f"layout ({(layout or b'slot, records by id').decode()}); this one is the compact "
                              "layout: give a new prefix (?prefix=...), which starts empty or is rebuilt from "
                              "the index changelog")
        read = {s: int(k) if k is not None else None for s, k in zip(slices, state[extra + 2 :])}
        self._stored_top = max(self._stored_top, _stored_time(stored))
        for g, k in zip(probes, state[extra + 2 + len(slices) :]):
            if k is not None and all(r[0] != g for r in self._reaping):
                self._reaping.append([g, int(k), 0])
        for s, bits in read.items():
            if bits is not None:
                self._bits[s] = bits
        columns = []
        at = 1
        for s, places in zip(slices, plans):
            got = list(replies[at : at + len(places)])
            count = replies[at + len(places)]
            at += len(places) + 1
            if count is not None:
                self._counts[s] = int(count)
            columns.append(self._column_of(got, places, len(names)))
        return seq, stored, columns, read

    def prefetch(self, queries: Sequence[Query]) -> None:
        """`RedisIndex.prefetch` in this layout: the first round of the next lookup's read sent now; its
        marks are read, and this batch's writes added, when the lookup takes it (`_taken`)."""
        self._ahead = None
        self._ahead_plan = None
        view = self._view
        planned = self._plan_ahead(queries)
        if planned is None:
            return
        names, key_fields, positions, id_places, slices = planned
        known: dict[int, int | None] = {s: self._bits.get(s) for s in slices}
        gone = self._gone()
        probes = [gone - 1, gone] if gone is not None else []
        commands, plans = self._read_plan(names, slices, known, probes)
        with self._errors():
            conn = self._pinned()
            self._drain()
            count = self._pack_send(conn, commands)
            epoch = self._epoch
        self._ahead = _SentRead(queries, names, key_fields, positions, id_places, slices, epoch, view, count)
        self._ahead_plan = (plans, known, count, probes)

    def _taken(self, ahead: _SentRead, low_mark: float, high_mark: float) -> tuple[int, bytes, tuple[int, ...],
                                                                              list[list[bytes | None]]] | None:
        """`RedisIndex._taken` in this layout: the read sent ahead, its marks read now and the batch's writes
        added; None if it cannot stand for a read made now (then the lookup reads afresh)."""
        view, plan = ahead.view, self._ahead_plan
        self._ahead_plan = None
        if plan is None:
            return None
        plans, known, count, probes = plan
        if (ahead.epoch != self._epoch or view is not self._view or view.watch != self._epoch or not view.exact
                or view.reread or len(ahead.replies) != count or not self._ahead_usable(ahead, known)):
            return None
        with self._errors():
            self._raise_any(ahead.replies)
        seq_read, stored, columns, read = self._parse_ahead(ahead, plans, probes)
        if seq_read != view.mark or any(read[s] != known[s] for s in ahead.slices):
            return None  # somebody inserted, or made a slice, between the last lookup and this read
        seq, stored = view.mark + view.inserted, view.hwm if view.inserted else stored
        need = set(self._slices(low_mark, high_mark)) | set(self._slices(low_mark, max(high_mark, _stored_time(stored))))
        if not need <= set(ahead.slices):
            return None
        kept = [(s, column) for s, column in zip(ahead.slices, columns) if s in need]
        self._overlay_ahead(ahead, kept, known)
        return seq, stored, tuple(s for s, _ in kept), [column for _, column in kept]

    def _ahead_usable(self, ahead: _SentRead, known: dict[int, int | None]) -> bool:
        """Can the read sent ahead (its slices' bits as known when it went out: `known`) stand for one made now,
        as far as this layout can tell before parsing it? Here, always."""
        return True

    def _parse_ahead(self, ahead: _SentRead, plans: Sequence[Any], probes: Sequence[int]) -> tuple[
            int, bytes, list[list[bytes | None]], dict[int, int | None]]:
        """`_parse_read` of the read sent ahead."""
        return self._parse_read(ahead.replies, ahead.names, ahead.slices, plans, probes)

    def _overlay_ahead(self, ahead: _SentRead, kept: list[tuple[int, list[bytes | None]]],
                       known: dict[int, int | None]) -> None:
        """The batch's writes added to the columns read ahead (`kept`: per slice needed its column)."""
        view = self._view
        # The marks read now see this batch's writes too (the transaction went through before this).
        self._resolve_marks(ahead.names, [s for s, _ in kept], [column for _, column in kept])
        if view.written:
            self._overlay(ahead.names, view.names, kept, view.written)

    def _check_continuity(self, state: Sequence[Any], gen: bytes | None) -> None:
        """Forgets what this client keeps of the namespace (entries by seq, bits, marks, counts) when the meta
        hash read (`state`: seq, hwm, [marker]; `gen`: the token its first writer left) says the namespace is
        not the one it was: lost, or expired, and made again (another token, or none yet), or rebuilt (another
        marker). A seq of a namespace made again names another entry, which may have the same event time: a
        kept entry would stand for it."""
        marker = state[2] if self.fenced else None
        if gen != self._gen or (self.fenced and marker != self._seen_marker) or int(state[0] or 0) < self._top_seq:
            self._by_seq.clear()
            self._bits.clear()
            self._marks.clear()
            self._counts.clear()
            self._reaping.clear()
            self._renewed.clear()
            self._stored_top = -math.inf
        self._gen, self._seen_marker, self._top_seq = gen, marker, int(state[0] or 0)

    def _gone(self) -> int | None:
        """The newest slice that left the window of the window's clock (as the insert's unlink tells it:
        the caller's clock if set, else the newest event time stored), None before anything was read."""
        clock = self._clock if self._clock is not None else self._stored_top
        return math.floor((clock - self.window) / self.slice_length) - 1 if math.isfinite(clock) else None

    def _reap_commands(self) -> list[Sequence[Any]]:
        """The next `REAP_COMMANDS` UNLINKs of the small hashes of slices that left the window (their slice
        hash went with the insert that moved the window), and the HDEL of a slice's bits once all its small
        hashes were named. Keys the TTL took first are simply absent; a client that stops midway leaves the
        rest to the TTL and the bits to the next client that reads them."""
        commands: list[Sequence[Any]] = []
        while self._reaping and len(commands) < REAP_COMMANDS:
            job = self._reaping[0]
            g, bits, at = job
            stop = min(1 << bits, at + REAP_KEYS)
            commands.append(("UNLINK", *(f"{self._spre}{g}:{j}" for j in range(at, stop))))
            job[2] = stop
            if stop == 1 << bits:
                commands.append(("HDEL", self._meta, f"k:{g}"))
                self._reaping.pop(0)
        return commands

    def _resolve_marks(self, names: Sequence[bytes], slices: Sequence[int],
                       columns: list[list[bytes | None]]) -> None:
        """Reads the buckets read as the mark in their slice hash (one round trip, when any), and remembers them."""
        wanted = [(s, column, self._marked_places(column)) for s, column in zip(slices, columns)]
        wanted = [w for w in wanted if w[2]]
        if not wanted:
            return
        with self._errors():
            replies = self._execute([("HMGET", f"{self._spre}{s}", *(names[p] for p in at)) for s, _, at in wanted])
            self._raise_any(replies)
        for (s, column, at), values in zip(wanted, replies):
            marks = self._marks.setdefault(s, set())
            for p, value in zip(at, values):
                column[p] = value
                if len(marks) < MARKS_KEPT:
                    marks.add(names[p])

    def lookup(self, queries: Sequence[Query], limit: int) -> list[tuple[Entry | Verdict | None, list[Candidate]]]:
        read = self._read_view(queries)
        if read is None:
            return []
        marks, ids, columns, positions, id_places = read
        window = self.window
        found = self._rank_batch(columns, positions, id_places, ids, [q.min_shared for q in queries], limit,
                                 [mark - window for mark in marks], self.bucket_cap, memo_time)
        wanted: set[tuple[int, float]] = {(s, ts) for _, _, ranked in found for s, _, _, ts in ranked}
        wanted.update(own for own, _, _ in found if own is not None)
        entries = self._entries_by_seq(wanted)
        out: list[tuple[Entry | Verdict | None, list[Candidate]]] = []
        for q, (own, memo, ranked) in zip(queries, found):
            cands = [new_candidate(entries[s], shared, q.keys[first]) for s, shared, first, _ in ranked if s in entries]
            mine: Entry | Verdict | None = None
            if own is not None and own[0] in entries:
                mine = entries[own[0]]
            elif memo is not None:
                mine = decode_memo(memo, q.id)
            out.append((mine, cands))
        return out

    def _entries_by_seq(self, wanted: set[tuple[int, float]]) -> dict[int, Entry]:
        """The stored entries of (seq, event time) pairs; one that is gone (its slice expired) is left out. An
        entry of a seq never changes: those written or read lately are kept and not read again."""
        out: dict[int, Entry] = {}
        by_slice: dict[int, list[int]] = {}
        for seq, ts in sorted(wanted):
            entry = self._by_seq.get(seq)
            if entry is not None:
                out[seq] = entry
            else:
                by_slice.setdefault(self._slice(ts), []).append(seq)
        if not by_slice:
            return out
        with self._errors():
            replies = self._execute([("HMGET", f"{self._spre}{s}", *map(cc.entry_field, seqs))
                                     for s, seqs in by_slice.items()], share=False)
            self._raise_any(replies)
        read = self._entries_read(by_slice, replies)
        out.update(read)
        self._keep(read)
        return out

    def _entries_read(self, by_slice: dict[int, list[int]], replies: Sequence[Any]) -> dict[int, Entry]:
        """The entries of `_entries_by_seq`'s reads (per slice its seqs, and the values read of them) by seq."""
        read = {}
        for seqs, values in zip(by_slice.values(), replies):
            for seq, value in zip(seqs, values):
                if value is not None:
                    blob, id = cc.split_entry_value(value)
                    read[seq] = decode_entry(blob, id)
        return read

    def _keep(self, entries: dict[int, Entry]) -> None:
        cap = self._known_cap
        if not cap:
            return
        known = self._by_seq
        known.update(entries)
        if len(known) > cap + cap // 4:  # the oldest go, in place: the newest `cap` are not copied again
            for seq in list(islice(known, len(known) - cap)):
                del known[seq]

    # -- inserting -----------------------------------------------------------------------------------
    def _keep_inserted(self, entries: Sequence[tuple[Entry, tuple[int, ...]]], results: Sequence[int]) -> None:
        """Keeps the inserted entries by their seq (the result > 0)."""
        self._keep({seq: entry for (entry, _), seq in zip(entries, results) if seq > 0})

    def _alone(self, entries: Sequence[tuple[Entry, tuple[int, ...]]], fields_of: Sequence[list[bytes]],
               places_of: Sequence[list[int] | None], *, ahead: bool = False) -> list[int] | None:
        """`RedisIndex._alone` in this layout, as a WATCH-guarded transaction only (None otherwise: the script),
        or where there is no WATCH through INSERT_ALONE_LUA if the layout writes so (`_alone_unwatched`)."""
        view = self._view
        if not view.exact or not view.slices or any(p is None for p in places_of) \
                or (view.watch != self._epoch and (ahead or not self._alone_unwatched())):
            return None
        return self._alone_rows([e.id for e, _ in entries],
                                [_event_time(e.ts, e.id, self.slice_length) for e, _ in entries],
                                self._encode(list(entries), encode_entry), fields_of, places_of, ahead=ahead)

    def _alone_unwatched(self) -> bool:
        """Does an uncontended round go through INSERT_ALONE_LUA where no WATCH guards it (Redis Cluster)? Not in
        this layout: its writes name small hashes, which that script does not make (the checking script does)."""
        return False

    def _alone_rows(self, ids: list[str], times: list[float], blobs: list[bytes], fields_of: Sequence[list[bytes]],
                    places_of: Sequence[list[int] | None], low: float | None = None, *,
                    ahead: bool = False) -> list[int] | None:
        """`_alone` of entries given by id, event time and stored bytes (an insert's, or a restore's). `low`: the
        event time whose window the first entry's live id is looked for in (a restore's: the namespace's newest
        event time before it, as the slot layout's restore reads it), else the insert script's. `ahead`: the
        transaction sent without reading its answer (`insert_ahead`)."""
        view = self._view
        window = self.window
        stored_hwm = _stored_time(view.hwm)
        hwm = max(self._hwm, stored_hwm)
        first = max(hwm, min(times)) if low is None else low
        slices = range(self._slice(first - window), self._slice(max(hwm, max(times))) + 1)
        if slices[0] < view.slices[0] or slices[-1] > view.slices[-1]:
            return None
        start = seq = view.mark + view.inserted
        writes: dict[int, dict[int, bytes]] = {s: dict(view.written.get(s, {})) for s in slices}
        looked = view.looked
        id_places = [view.entry_places[looked[id]] for id in ids]
        results, groups, pending, hwm, seq = self._alone_round(
            ids, times, blobs, list(fields_of), cast("list[list[int]]", list(places_of)), id_places, tuple(slices),
            writes, hwm, seq)
        hwm_bytes = view.hwm if hwm <= stored_hwm else (b"%.17g" % hwm)
        written = self._write_alone(start, seq, hwm_bytes, hwm, groups, ahead)
        if written is None:
            return None
        if not written:
            view.watch = -1
        self._wrote_round(hwm_bytes, pending, groups, writes)
        return list(results)

    def _alone_round(self, ids: list[str], times: list[float], blobs: list[bytes], fields_of: list[list[bytes]],
                     places_of: list[list[int]], id_places: list[int], slices: tuple[int, ...],
                     writes: dict[int, dict[int, bytes]], hwm: float, seq: int) -> tuple[
                         list[int], dict[int, Any], list[tuple[int, int, list[int]]], float, int]:
        """`_alone_rows`' round over the view's columns (`alone_compact`: its results, its writes per slice as
        `_write_alone` takes them, its entries (seq, slice, places), high-water mark and seq); `writes` updated."""
        return cast("tuple[list[int], dict[int, Any], list[tuple[int, int, list[int]]], float, int]",
                    self._alone_compact(ids, times, blobs, fields_of, places_of, id_places, slices, self._view.columns,
                                        writes, hwm, self.window, self.slice_length, self.bucket_cap, seq))

    def _write_alone(self, start: int, seq: int, hwm_bytes: bytes, hwm: float, groups: dict[int, list[Any]],
                     ahead: bool) -> bool | None:
        """The transaction of `_alone_rows`' round (`_write_watched_compact`), under the lookup's WATCH: None when
        refused, else whether the meta hash still held what it wrote (sent ahead: True, `settle` tells)."""
        clock = hwm if self._clock is None else self._clock
        gone = self._slice(clock - self.window) - 1 if seq > start else None
        return self._write_watched_compact(start, seq, self._view.hwm, hwm_bytes, gone, groups, ahead)

    def _meta_writes(self, start: int, seq: int, stored_hwm: bytes, hwm: bytes, made: bool) -> list[Sequence[Any]]:
        """The meta hash's writes in a round's transaction: the seq and layout (and `gen`, where it has none)
        when the round inserted, the high-water mark when it rose, the TTL renewed when either changed or the
        round made a slice (`made`)."""
        meta = self._meta
        out: list[Sequence[Any]] = []
        if seq != start:
            out += [("HSET", meta, "seq", seq, "layout", self.LAYOUT), ("HSETNX", meta, "gen", self._token)]
        if hwm != stored_hwm:
            out.append(("HSET", meta, "hwm", hwm))
        if seq != start or hwm != stored_hwm or made:
            out.append(("PEXPIRE", meta, self._ttl_ms))
        return out

    def _write_watched_compact(self, start: int, seq: int, stored_hwm: bytes, hwm: bytes, gone: int | None,
                               groups: dict[int, list[Any]], ahead: bool) -> bool | None:
        """`RedisIndex._write_watched` with the writes where this layout keeps them; a slice written for the
        first time gets its bits."""
        meta, ttl = self._meta, self._ttl_ms
        commands: list[Any] = [("MULTI",)]
        made = {}
        now = time.monotonic()
        if now - self._renewed_at >= self._renew_period:  # a new period: every small hash written is renewed
            self._renewed.clear()
            self._renewed_at = now
        renewed: list[tuple[int, int]] = []  # (slice, small hash) renewed by this transaction
        for s, (count, pairs) in groups.items():
            bits = self._bits.get(s)
            if bits is None:
                bits = made[s] = max(cc.slice_bits(self._counts.get(s - 1)),
                                     cc.slice_bits(self._expected.get(s, self._rate_count)))
                commands.append(("HSET", meta, f"k:{s}", bits))
            if self._packs:
                blob, n, renewing = self._pack_writes(f"{self._spre}{s}", pairs, bits, self._marks.get(s, set()),
                                                      count, 0, ttl, FIELDS_PER_CALL, self._renewal_bits(s, bits))
                commands.append(_Packed(blob, n))
                renewed += [(s, j) for j in renewing]
                continue
            written = cast("list[Sequence[Any]]", self._write_commands_of(
                f"{self._spre}{s}", pairs, bits, self._marks.get(s, set()), count, 0, ttl, FIELDS_PER_CALL))
            commands += self._renewing(s, bits, written, renewed)
        commands += self._meta_writes(start, seq, stored_hwm, hwm, bool(made))
        if gone is not None:
            commands.append(("UNLINK", f"{self._spre}{gone}"))
            bits = self._bits.get(gone)
            if bits is not None and bits <= cc.UNLINK_INLINE_BITS:  # its small hashes too, as the script does
                keys = [f"{self._spre}{gone}:{j}" for j in range(1 << bits)]
                commands += [("UNLINK", *keys[a : a + REAP_KEYS]) for a in range(0, len(keys), REAP_KEYS)]
                commands.append(("HDEL", meta, f"k:{gone}"))
        return self._exec_round(commands, made, start, seq, hwm, ahead=ahead, renewed=renewed)

    def _exec_round(self, commands: list[Any], made: dict[int, int], start: int, seq: int, hwm: bytes, *,
                    ahead: bool = False, renewed: Sequence[tuple[int, int]] = ()) -> bool | None:
        """A round's transaction (`commands`, from its MULTI), closed with the reaps and memos that go with it,
        then the meta hash watched and read again. None if Redis refused it (nothing written); else whether the
        meta hash still held the seq and high-water mark it wrote. Once taken (`ahead`: once sent, undone by
        `_forget_round` if `settle` finds it refused), the bits of the slices it `made` and the small hashes it
        `renewed` are kept."""
        meta = self._meta
        commands += self._reap_commands()  # in the transaction: its HDEL does not dirty the WATCH
        commands += self._memo_commands()
        commands += [("EXEC",), ("WATCH", meta), ("HMGET", meta, "seq", "hwm")]
        watched = cast("list[Sequence[str | int | bytes]]", commands)
        top = max(self._stored_top, _stored_time(hwm))
        if ahead:
            if not self._send_watched(watched, seq, hwm, partial(self._forget_round, made, start, seq, top,
                                                                 self._stored_top, renewed)):
                return None
            clean = True
        else:
            replies = self._exec_watched(watched)
            if replies is None:
                return None
            now_seq, now_hwm = replies[-1]
            clean = int(now_seq or 0) == seq and (now_hwm or b"") == hwm
        self._bits.update(made)
        for s, j in renewed:  # only now: a transaction refused renewed nothing
            self._renewed[s][j >> 3] |= 1 << (j & 7)
        self._stored_top = top
        return clean

    def _forget_round(self, made: dict[int, int], start: int, seq: int, top: float, top_before: float,
                      renewed: Sequence[tuple[int, int]]) -> None:
        """What a round sent ahead and refused left kept, forgotten where nothing changed it since: the bits of
        the slices it made, the small hashes it renewed, the namespace's high-water mark it raised, its entries
        by seq (others took those seqs)."""
        for s, bits in made.items():
            if self._bits.get(s) == bits:
                del self._bits[s]
        for s, j in renewed:
            seen = self._renewed.get(s)
            if seen is not None and len(seen) > j >> 3:
                seen[j >> 3] &= ~(1 << (j & 7))
        if self._stored_top == top:
            self._stored_top = top_before
        for s in range(start + 1, seq + 1):
            self._by_seq.pop(s, None)

    def _renewing(self, s: int, bits: int, commands: list[Sequence[Any]],
                  renewed: list[tuple[int, int]]) -> list[Sequence[Any]]:
        """`commands` of slice `s` without the `PEXPIRE` of a small hash whose TTL this client set in the current
        period (grace / 2 of wall clock): its TTL runs at least window + grace / 2 past any write since, and
        the key cannot have gone meanwhile (the TTL is not up; a slice is unlinked only behind the window; a
        loss moves the meta hash, so the WATCH refuses the transaction, and the next read forgets the periods:
        `_check_continuity`). The small hashes renewed here go to `renewed`. About a third of a round's
        commands."""
        seen = self._renewal_bits(s, bits)
        if seen is None:
            return commands
        out = []
        prefix = f"{self._spre}{s}:"
        for command in commands:
            if command[0] == "PEXPIRE" and command[1].startswith(prefix):
                j = int(command[1][len(prefix) :])
                if seen[j >> 3] >> (j & 7) & 1:
                    continue
                renewed.append((s, j))
            out.append(command)
        return out

    def _renewal_bits(self, s: int, bits: int) -> bytearray | None:
        """The bitset of slice `s`'s small hashes whose TTL this client set in the current period (`_renewing`),
        None when every write sets it (no period: no grace)."""
        if not self._renew_period:
            return None
        seen = self._renewed.get(s)
        if seen is None or len(seen) * 8 < 1 << bits:
            seen = self._renewed[s] = bytearray(((1 << bits) + 7) // 8)
        return seen

    def _script_args(self, entries: Sequence[tuple[str, float, bytes, Sequence[bytes], bytes]],
                     marker: bytes, slices: str, mark: int, inserted: int) -> list[Any]:
        """COMPACT_INSERT's arguments; `entries`: (id, event time, stored bytes, field names, expected tails)."""
        args: list[Any] = [self._spre, repr(self.window), repr(self.slice_length), self.bucket_cap, self._ttl_ms,
                           repr(self._hwm), slices, mark, inserted, self._clock_arg(), marker, self._token,
                           self._rate_count]
        for id, ts, blob, fields, expected in entries:
            hashes = b"".join(_mixed32(int.from_bytes(f[1:], "big")) for f in fields) + _mixed32(cc.id_hash(id))
            args += [id.encode("utf-8", "surrogatepass"), repr(ts), blob, len(fields), expected, hashes, *fields]
        return args

    def _run_script(self, args: list[Any]) -> tuple[int, bytes, list[int]]:
        """One call of this layout's checking script (`CHECKING`), the memos beside it: (its first reply, the
        high-water mark stored, per entry its result); a lost index or a namespace of another layout raised."""
        [(lost, hwm, results)] = self._eval_pipelined(self.CHECKING, [args], self._memo_commands())
        self._memos_sent()  # written beside the script, whatever it answered
        if lost == -1:
            raise self._lost()
        if lost == -2:
            raise ConfigError(f"the Redis index at {self._where} holds namespace {self.namespace!r} in another "
                              f"layout; this one is the {self.LAYOUT} layout: give a new prefix (?prefix=...)")
        self._stored_top = max(self._stored_top, _stored_time(hwm))
        return lost, hwm, list(results)

    def _checked(self, entries: Sequence[tuple[Entry, tuple[int, ...]]],
                 fields_of: Sequence[list[bytes]]) -> list[int]:
        view = self._view
        places_of = [self._places(entry.id, fields) for (entry, _), fields in zip(entries, fields_of)]
        blobs = self._encode(list(entries), encode_entry)  # (compiled: one call a round, not one an entry)
        rows = []
        for (entry, _), fields, places, blob in zip(entries, fields_of, places_of, blobs):
            expected = b"" if None in places else view.expected(entry.id, places)  # type: ignore[arg-type]
            rows.append((entry.id, _event_time(entry.ts, entry.id, self.slice_length), blob, fields, expected))
        _, hwm, results = self._run_script(self._script_args(rows, self._expected_marker(),
                                                             ",".join(map(str, view.slices)), view.mark, view.inserted))
        view.hwm = hwm
        view.exact = False
        for (entry, _), places, result in zip(entries, places_of, results):
            if result > 0:
                self._inserted(result, self._slice(float(entry.ts)), places, SEQ.pack(result), view.basis(entry.id))
        return results

    def _insert_unchecked(self, entries: Sequence[tuple[str, float, bytes, tuple[int, ...]]]) -> int:
        rows = [(id, ts, blob, [b"b" + k.to_bytes(8, "big") for k in keys], b"") for id, ts, blob, keys in entries]
        _, _, results = self._run_script(self._script_args(rows, b"", "", 0, 0))
        self._view.exact = False
        return sum(1 for r in results if r > 0)

    def _reread(self, entries: Sequence[tuple[Entry, tuple[int, ...]]],
                fields_of: Sequence[list[bytes]]) -> list[list[Candidate]]:
        view = self._view
        names = list(dict.fromkeys(f for fields in fields_of for f in fields))
        wanted = tuple(sorted(set(view.slices) | set(self._slices(self._hwm, self._hwm))))
        seq, _, slices, columns = self._read_covering(names, wanted, self._hwm, self._hwm)
        if view.marker and self._marker != view.marker:
            raise self._lost()
        horizon = self._hwm - self.window
        at = {name: i for i, name in enumerate(names)}
        view.slices = slices
        ranked = []
        for (entry, _), fields in zip(entries, fields_of):
            since = view.reread[entry.id][0] if entry.id in view.reread else view.mark
            places = [at[f] for f in fields]
            ranked.append(self._rank_compact(columns, places, 0, 1, len(fields) * self.bucket_cap + 1, horizon,
                                             self.bucket_cap, since, view.own))
            view.reread[entry.id] = (seq, {s: [(column[p] or b"")[-8:] or ABSENT for p in places]
                                           for s, column in zip(slices, columns)})
        found = self._entries_by_seq({(s, ts) for cands in ranked for s, _, _, ts in cands})
        return [[Candidate(found[s], shared, keys[first]) for s, shared, first, _ in cands if s in found]
                for (_, keys), cands in zip(entries, ranked)]

    # -- restoring, stats ----------------------------------------------------------------------------
    def restore(self, parts: Iterable[Stored], *, rebuild: bytes = b"") -> int:
        """See `CandidateIndex.restore`. A rebuild (`rebuild`, by the guard's lock holder) of a fenced index
        without its marker, empty (or left by a rebuild that died): nobody else writes it unguarded, and
        `_rebuild_compact` holds the bucket records and writes each small hash (group) once. Otherwise (and for
        what a rebuild hands on) per chunk of
        `RESTORE_CHUNK` entries, as the uncontended insert: a read of what its fields hold (after a WATCH of the
        meta hash), the writes computed here (as the insert script would insert them with nothing to compare) and
        one MULTI/EXEC, which Redis refuses if anybody wrote meanwhile; after `RESTORE_ATTEMPTS` refusals, and
        on Redis Cluster, the checking script with nothing to compare. A fenced index without its marker is
        being rebuilt: its marker is not asked for here (the guard sets it after)."""
        self._forget_view()
        self._restoring = True
        written = 0
        with self._errors():  # the namespace's newest event time: the window its first entries' live ids are in
            replies = self._execute([("HMGET", self._meta, "hwm", MARKER, "seq", REBUILDING, "layout")])
            self._raise_any(replies)
        stored_hwm, marker, stored_seq, rebuilding, layout = replies[0]
        died = rebuilding is not None and layout == self.LAYOUT.encode()  # (another layout is refused by the reads)
        self._stored_top = max(self._stored_top, _stored_time(stored_hwm or b""))
        try:
            rest: Iterable[tuple[Stored, int]] = ((part, 0) for part in parts)
            if rebuild and self.fenced and marker is None and (stored_seq is None or died):
                rest, written = self._rebuild_compact(iter(parts), died, rebuild)
            for part, begin in rest:
                times = [_event_time(float(t), id, self.slice_length) for id, t in zip(part.ids, part.times)]
                self._expected = cc.expected_counts(times, self.slice_length)
                chunk = slot.RESTORE_CHUNK
                for at in range(begin, len(part.ids), chunk):
                    stop = min(at + chunk, len(part.ids))
                    written += self._restore_rows(self._rows(part, times, at, stop))
        finally:
            self._restoring = False
            self._expected = {}
            self._forget_view()
        return written

    @staticmethod
    def _rows(part: Stored, times: Sequence[float], at: int, stop: int) -> list[tuple[str, float, bytes, tuple[int, ...]]]:
        """Entries `at` to `stop` of `part` as rows (id, event time, stored bytes, keys). A key given twice
        counts once (as the memory index and the slot layout's restore count it)."""
        return [(part.ids[i], times[i], part.blobs[i], tuple(dict.fromkeys(part.keys_of(i)))) for i in range(at, stop)]

    def _rebuild_compact(self, parts: Iterator[Stored], died: bool,
                         stamp: bytes) -> tuple[Iterator[tuple[Stored, int]], int]:
        """Restores `parts` into a fenced namespace without its marker that nobody else writes (`restore`; `died`:
        a rebuild before this one left its `rebuilding` field: what it wrote goes first, the meta hash with it,
        which is given the rebuild's `stamp` again), the compact and the
        group layout's alike. Per chunk of `REBUILD_CHUNK` entries, which entries the insert would take and their
        seqs are told here from the ids it took (`_rebuild_plan`'s `accept`: an id stays live as long as its
        newest entry is inside the window; nothing is read from Redis), their entries written at once (with the
        seq, by HINCRBY, and a read of the seq and the marker: anybody else writing shows); their bucket keys and
        ids are held in flat arrays (`_HeldFields`) and each slice written at the end (`_write_held`), each small
        hash (group) once. A slice that left the window (as the plan tells) is forgotten and unlinked
        (`_forget_slice`: its entries went). Once more than `HOLD_RECORDS` bucket records are held, what is held
        is written and the rebuild goes on (a field written is read back when written again); once more than
        `HOLD_IDS` ids are inside the window, or somebody else wrote, what is held goes (merged with what Redis
        holds, in the latter case) and the rest is handed to the guarded chunks. Returns (the rest: (part, first
        entry not restored); entries written)."""
        meta, ttl, window, length = self._meta, self._ttl_ms, self.window, self.slice_length
        held = _HeldFields()
        live: dict[str, float] = {}  # id -> event time of its newest entry taken (`restore_accept`)
        written = 0
        start: list[Sequence[Any]] = []
        if died:  # its entries would pass for live, its fields are held nowhere: the changelog has them all
            with self._errors():
                keys = list(dict.fromkeys(self._client.scan_iter(match=f"{self._spre}*", count=1000)))
            start += [("UNLINK", *keys[a : a + REAP_KEYS]) for a in range(0, len(keys), REAP_KEYS)]
            start += [("DEL", meta), ("HSET", meta, STAMP, stamp)]
            self._stored_top = -math.inf
        start += [("HSET", meta, REBUILDING, "1", "layout", self.LAYOUT), ("HSETNX", meta, "gen", self._token),
                  ("PEXPIRE", meta, ttl), ("HMGET", meta, "seq", "hwm")]
        with self._errors():
            replies = self._execute(start)
            self._raise_any(replies)
        seq = int(replies[-1][0] or 0)
        hwm = max(self._hwm, self._stored_top, _stored_time(replies[-1][1] or b""))
        plan = self._rebuild_plan()
        step = 2 * FIELDS_PER_CALL
        for part in parts:
            array = np.asarray(part.times, dtype=np.float64)
            bad = ~(np.isfinite(array) & (array > _MIN_TS) & (np.abs(array / length) < _MAX_SLICE))
            if bad.any():
                at = int(np.flatnonzero(bad)[0])
                _event_time(float(array[at]), part.ids[at], length)  # raises its ValueError
            of_slice = np.floor(array / length).astype(np.int64)
            plan.part(array, of_slice)
            sizes: np.ndarray = np.diff(np.asarray(part.bounds, dtype=np.int64))
            chunk = slot.REBUILD_CHUNK
            for at in range(0, len(part.ids), chunk):
                stop = min(at + chunk, len(part.ids))
                ids, tss, slices = part.ids[at:stop], array[at:stop], of_slice[at:stop]
                seqs, new_hwm, new_seq, gone = plan.accept(ids, at, live, hwm, seq)
                alone = True
                if new_seq != seq:  # its seqs taken first: a seq names one entry, whoever else inserts
                    with self._errors():
                        replies = self._execute([("HINCRBY", meta, "seq", new_seq - seq)])
                        self._raise_any(replies)
                    if replies[0] != new_seq:  # somebody else took some meanwhile: the chunk's are those after
                        alone = False
                        seqs[seqs > 0] += np.uint64(replies[0] - new_seq)
                        new_seq = replies[0]
                taken = seqs > 0
                commands: list[Sequence[Any]] = []
                begin = 0
                # The entries up to each slice the plan unlinks among them, then the unlink.
                for end, unlinked in [*gone, (stop - at, None)]:
                    groups = self._entry_pairs(ids[begin:end], part.blobs[at + begin : at + end],
                                               seqs[begin:end].tolist(), slices[begin:end].tolist())
                    for s, pairs in groups.items():
                        key = f"{self._spre}{s}"
                        commands += [("HSET", key, *pairs[a : a + step]) for a in range(0, len(pairs), step)]
                        commands.append(("PEXPIRE", key, ttl))
                    its_keys = np.asarray(part.keys[int(part.bounds[at + begin]) : int(part.bounds[at + end])],
                                          dtype=np.uint64)
                    counted = sizes[at + begin : at + end]
                    for s in groups:
                        mine = taken[begin:end] & (slices[begin:end] == s)
                        held.add(s, its_keys[np.repeat(mine, counted)], counted[mine], tss[begin:end][mine],
                                 seqs[begin:end][mine], [ids[begin + i] for i in np.flatnonzero(mine).tolist()])
                    if unlinked is not None:
                        commands += self._forget_slice(held, unlinked)
                    begin = end
                for s in plan.left(held.slices, new_hwm):
                    commands += self._forget_slice(held, s)
                if new_seq != seq:
                    commands.append(("HSET", meta, "hwm", b"%.17g" % new_hwm))
                commands += [("PEXPIRE", meta, ttl), ("HMGET", meta, "seq", MARKER)]
                with self._errors():
                    replies = self._execute(commands)
                    self._raise_any(replies)
                written += int(np.count_nonzero(taken))
                now_seq, marker = replies[-1]
                alone = alone and marker is None and int(now_seq or 0) == new_seq
                seq, hwm = new_seq, new_hwm
                if alone and len(live) > HOLD_IDS:  # those that left the window are never live again
                    live = {id: ts for id, ts in live.items() if ts >= hwm - window}
                if not alone or len(live) > HOLD_IDS:
                    self._write_held(held, plan, intruded=not alone, done=True)
                    self._stored_top = max(self._stored_top, hwm)  # the guarded chunks' first live ids
                    rest = chain([(part, stop)], ((p, 0) for p in parts))
                    return rest, written
                if held.records > HOLD_RECORDS:  # written now, read back where named again
                    self._write_held(held, plan, intruded=False, done=False)
        self._write_held(held, plan, intruded=False, done=True)
        self._stored_top = max(self._stored_top, hwm)
        return iter(()), written

    def _rebuild_plan(self) -> _RebuildPlan:
        """What a rebuild tells from its entries alone (`_RatePlan`: the rate they show)."""
        return _RatePlan(self)

    def _forget_slice(self, held: _HeldFields, s: int) -> list[Sequence[Any]]:
        """The commands that unlink slice `s` of a rebuild, which left the window (its small hashes too where an
        earlier write of what was held made them), and forgets what is held of it."""
        commands: list[Sequence[Any]] = [("UNLINK", f"{self._spre}{s}")]
        bits = held.drop(s)
        if bits is not None:
            keys = [f"{self._spre}{s}:{j}" for j in range(1 << bits)]
            commands += [("UNLINK", *keys[a : a + REAP_KEYS]) for a in range(0, len(keys), REAP_KEYS)]
            commands.append(("HDEL", self._meta, f"k:{s}"))
        return commands

    def _write_held(self, held: _HeldFields, plan: _RebuildPlan, *, intruded: bool, done: bool) -> None:
        """Writes a rebuild's held records (`_rebuild_compact`), each small hash (group) once, a slice with the
        bits the meta hash gives it (set by an earlier write, or by somebody else meanwhile), else those the plan
        gives it (`_RebuildPlan.bits_of`), and the count of entries written since; then sets the bits, and drops
        `rebuilding` when `done`. What Redis may hold already (`intruded`: somebody else wrote too; or in a slice
        written before) is read (`_held_slice`) and goes on from the value there. A slice's small hashes (groups)
        are made a share at a time (`_held_shares`), each packed while the one before is sent (`_Sender`)."""
        meta, ttl, counts = self._meta, self._ttl_ms, plan.counts
        slices = sorted(held.parts)
        with self._errors():
            replies = self._execute([("HMGET", meta, *(f"k:{s}" for s in slices))] if slices else [])
            self._raise_any(replies)
        known = replies[0] if slices else []
        made: list[Any] = []
        # Per slice: its key, bits, entries to count, and what `_held_shares` takes of it (`_held_slice`).
        pieces: list[tuple[str, int, int, tuple[Any, ...]]] = []
        for s, k in zip(slices, known):
            if k is not None:
                bits = int(k)
            else:
                bits = plan.bits_of(s)
                made += (f"k:{s}", bits)
            key = f"{self._spre}{s}"
            piece = self._held_slice(key, bits, held.columns(s), intruded or s in held.written)
            entries = counts.get(s, 0) - held.counted.get(s, 0)
            held.counted[s] = counts.get(s, 0)
            held.written[s] = bits
            pieces.append((key, bits, entries, piece))
        held.clear()  # its arrays are in `pieces` now: not twice in memory while written
        commands: list[Sequence[Any]] = []
        if made:
            commands.append(("HSET", meta, *made))
        if done:
            commands.append(("HDEL", meta, REBUILDING))
        commands.append(("PEXPIRE", meta, ttl))
        if not self._packs:  # Cluster: redis-py's pipeline
            writes = [c for share in self._held_shares(pieces, intruded) for c in self._share_commands(share)]
            with self._errors():
                replies = self._execute([*writes, *commands])
                self._raise_any(replies)
            return
        with self._errors():  # each share packed while the one before is sent (a thread of its own)
            conn = self._pinned()
            self._drain()
            sender = slot._Sender(conn)
            try:
                for share in self._held_shares(pieces, intruded):
                    blob, n = self._share_packed(share)
                    for a in range(0, len(blob), SEND_BYTES):  # the socket's timeout bounds each piece's send
                        sender.send(blob[a : a + SEND_BYTES], n if a == 0 else 0)
                sender.send(_pack(commands), len(commands))
                replies = slot.read_replies(conn, sender.close())
            except BaseException:
                sender.close(raising=False)
                conn.disconnect()  # replies may still be on their way: never reuse it (it reconnects)
                raise
            self._raise_any(replies)

    def _held_slice(self, key: str, bits: int, columns: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                                                list[str]], read: bool) -> tuple[Any, ...]:
        """What `_held_shares` takes of a slice's held records (`_HeldFields.columns`): them, the bucket and id
        fields that Redis holds of them where `read` (`_held_olds`), and the buckets of those read as the mark."""
        keys, bounds, times, seqs, ids = columns
        marked: set[bytes] = set()
        olds: dict[bytes, bytes] = {}
        if read:
            names = [b"b" + raw for raw in _distinct_keys(keys)] + list(dict.fromkeys(map(cc.id_field, ids)))
            olds = self._held_olds(key, names, bits, marked)
        return keys, bounds, times, seqs, ids, olds, marked

    def _held_shares(self, pieces: Sequence[tuple[str, int, int, tuple[Any, ...]]], intruded: bool) -> Iterator[Any]:
        """Each slice's fields a share of its small hashes at a time (its bucket keys and ids in that share:
        `held_pairs` of them, what it holds of the slice a sixteenth at a time), its count with the first; each
        share as `_share_commands` and `_share_packed` take it. An id that somebody else wrote (`intruded`) is
        kept."""
        top = np.uint64(64 - WRITE_SHARE_BITS)
        cap = self.bucket_cap
        for key, bits, entries, (keys, bounds, times, seqs, ids, olds, marked) in pieces:
            key_shares = (keys * np.uint64(_FIB)) >> top  # (wraps: the product mod 2^64, as `small_hash`)
            id_shares = np.asarray(self._id_shares(ids, WRITE_SHARE_BITS), dtype=np.int64)
            for j in range(1 << WRITE_SHARE_BITS):
                mine = key_shares == j
                before = np.concatenate(([0], np.cumsum(mine)))
                sizes = before[bounds[1:]] - before[bounds[:-1]]
                has_id = id_shares == j
                took = np.flatnonzero((sizes > 0) | has_id)
                pairs = self._held_pairs(keys[mine], np.concatenate(([0], np.cumsum(sizes[took]))), times[took],
                                         seqs[took], [ids[i] if has_id[i] else None for i in took.tolist()],
                                         olds, cap, intruded)
                yield key, pairs, bits, marked, entries if j == 0 else 0

    def _share_commands(self, share: Any) -> list[Sequence[Any]]:
        """A share of `_held_shares` as commands (`write_commands`)."""
        key, pairs, bits, marked, entries = share
        return cast("list[Sequence[Any]]",
                    self._write_commands_of(key, pairs, bits, marked, entries, 0, self._ttl_ms, FIELDS_PER_CALL))

    def _share_packed(self, share: Any) -> tuple[bytes, int]:
        """A share of `_held_shares` packed (`pack_writes`): its bytes and number of replies."""
        key, pairs, bits, marked, entries = share
        blob, n, _ = self._pack_writes(key, pairs, bits, marked, entries, 0, self._ttl_ms, FIELDS_PER_CALL, None)
        return blob, n

    def _held_olds(self, key: str, names: list[bytes], bits: int, marked: set[bytes]) -> dict[bytes, bytes]:
        """What Redis holds of a slice's `names` (its small hashes, and the slice hash for those read as the mark,
        which go to `marked`)."""
        reads, places = self._read_commands_of(key, names, bits, set(), FIELDS_PER_HMGET)
        column = self._column_of(self._read_many_calls(reads), places, len(names))
        olds = {name: value for name, value in zip(names, column) if value is not None}
        marked.update(name for name, value in olds.items() if value == cc.MARK)
        if marked:
            at = sorted(marked)
            with self._errors():
                replies = self._execute([("HMGET", key, *at)])
                self._raise_any(replies)
            olds.update({name: value for name, value in zip(at, replies[0]) if value is not None})
        return olds

    def _read_many_calls(self, reads: Sequence[Sequence[Any]]) -> list[Any]:
        """The replies of a rebuild's `reads`, `READ_COMMANDS` a round trip (a command a small hash or a few
        thousand groups: millions in a slice of many)."""
        replies: list[Any] = []
        for a in range(0, len(reads), READ_COMMANDS):
            with self._errors():
                got = self._execute(reads[a : a + READ_COMMANDS])
                self._raise_any(got)
            replies += got
        return replies

    def _restore_rows(self, rows: list[tuple[str, float, bytes, tuple[int, ...]]]) -> int:
        for _ in range(slot.RESTORE_ATTEMPTS if self._watchable() else 0):
            done = self._restore_watched(rows)
            if done is not None:
                return done
        return sum(self._insert_unchecked(rows[a : a + INSERT_CHUNK]) for a in range(0, len(rows), INSERT_CHUNK))

    def _restore_watched(self, rows: list[tuple[str, float, bytes, tuple[int, ...]]]) -> int | None:
        """One chunk of a restore as an uncontended insert round; None if Redis refused it (nothing written)."""
        ids = [id for id, _, _, _ in rows]
        times = [ts for _, ts, _, _ in rows]
        names, key_fields, positions, id_places = self._planned([Query(id, ts, keys) for id, ts, _, keys in rows])
        # An id is live as the slot layout's restore sees it: stored inside the window of the newest event time
        # before it, which is the namespace's for the chunk's first entry, whatever event times come after.
        top = max(self._hwm, self._stored_top)
        low = top if math.isfinite(top) else min(times)
        high = max(low, max(times))
        with self._errors():
            self._pinned()
        epoch = self._epoch
        seq, stored, slices, columns = self._read_covering(names, self._slices(low, high), low, high, watch=True)
        if self._epoch != epoch:
            return None
        self._view = _View(slices, dict(zip(slices, columns)), names, seq, stored, dict(zip(ids, range(len(ids)))),
                           [keys for _, _, _, keys in rows], key_fields, positions, id_places, watch=epoch,
                           marker=self._marker)
        try:
            results = self._alone_rows(ids, times, [blob for _, _, blob, _ in rows], key_fields,
                                       cast("list[list[int] | None]", positions), low)
        finally:
            self._view = _View()
        return None if results is None else sum(1 for r in results if r > 0)

    def stats(self) -> dict[str, int]:
        """`entries` and `memos` of the slices of the window, `inserted`, and `buckets` from the fields of the
        small hashes less the ids: counted in a slice of up to `STATS_SAMPLE` small hashes, estimated from that
        many in a bigger one (the exact count would take a command per small hash)."""
        with self._errors():
            seq, stored = self._client.hmget(self._meta, "seq", "hwm")
            top = _stored_time(cast("bytes | None", stored) or b"")
            slices = self._slices(top, top)
            bits = self._client.hmget(self._meta, [f"k:{s}" for s in slices]) if slices else []
            commands, sampled = self._stats_reads(slices, bits)
            replies = self._execute(commands, pinned=False)
            self._raise_any(replies)
        entries = memos = buckets = 0
        rest = iter(replies)
        for n, taken in sampled:
            count, memo = next(rest)
            entries += int(count or 0)
            memos += int(memo or 0)
            buckets += self._stats_buckets(rest, n, taken, int(count or 0))
        return {"entries": entries, "buckets": buckets, "memos": memos, "inserted": int(seq or 0)}

    def _stats_reads(self, slices: Sequence[int], bits: Sequence[Any]) -> tuple[list[Sequence[Any]],
                                                                            list[tuple[int, int]]]:
        """The reads of `stats`: per slice (of `bits`, as the meta hash holds them), its counts (`HMGET n m`) and
        those its buckets are counted from (`_stats_buckets`); and per slice (its small hashes, those sampled)."""
        commands: list[Sequence[Any]] = []
        sampled = []
        for s, k in zip(slices, bits):
            commands.append(("HMGET", f"{self._spre}{s}", "n", "m"))
            n = 1 << int(k) if k is not None else 0
            step = max(1, n // STATS_SAMPLE)
            sample = list(range(0, n, step))
            sampled.append((n, len(sample)))
            commands += [("HLEN", f"{self._spre}{s}:{j}") for j in sample]
        return commands, sampled

    def _stats_buckets(self, rest: Iterator[Any], n: int, taken: int, count: int) -> int:
        """A slice's buckets from the replies of its `_stats_reads` (next in `rest`; `count`: its entries)."""
        lengths = [next(rest) for _ in range(taken)]
        fields = sum(lengths) * n / taken if taken else 0
        return max(0, round(fields) - count)

    def __repr__(self) -> str:
        return f"CompactIndex({self._where!r}, namespace={self.namespace!r}, window={self.window})"
