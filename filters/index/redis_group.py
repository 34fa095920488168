"""The group layout of the Redis index (docs/design.md, "The group layout"): the compact layout's protocol and
records by seq, its bucket records grouped in fields `g<j>` of the slice hash (`group_codec`).

Chosen by `?layout=group`. A lookup reads one `HMGET` a slice (the distinct groups of the batch's buckets and
ids, its memos: `group_codec.pack_reads`), which `slice_column` turns into the compact layout's columns, so the
ranking and the tails are the compact layout's (`CompactIndex`); a read sent ahead gets the batch's writes
(groups, memos) among its values by place before its columns are made (`_taken`); an uncontended round is the
compact layout's round with its writes put at once into whole groups (`alone_groups`, `pack_writes`, as
`apply_round` writes them) in the watched transaction (on Redis Cluster, where there is no WATCH and a
namespace's keys share one hash tag as the slot layout's, through the slot layout's `lua/insert_alone.lua`), and
are kept where the next round finds them (`keep_written`). Any other round (a contended one, a restore's chunk
refused) is the checking script, `lua/group_insert.lua`, which writes `apply_round`'s bytes. A rebuild (a fenced
index without its marker) holds its entries' records and writes each group once (`group_codec.held_groups`),
leaving the bytes the guarded chunks of any other restore leave.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain
from typing import Any, ClassVar, cast

import numpy as np

from filters.errors import ConfigError
from filters.index import Candidate, Entry, Query, new_candidate, new_entry
from filters.index import compact_codec as cc
from filters.index import group_codec as gc
from filters.index import redis as slot
from filters.index.redis import (
    FIELDS_PER_CALL,
    FIELDS_PER_HMGET,
    MARKER,
    _event_time,
    _lua,
    _Script,
    _SentRead,
    _stored_time,
)
from filters.index.redis_codec import SEQ, decode_entry, decode_memo, encode_entry, live_memo, memo_time
from filters.index.redis_compact import (
    _FIB,
    WRITE_SHARE_BITS,
    CompactIndex,
    _HeldFields,
    _pack,
    _Packed,
    _pieces,
)
from filters.records import Verdict

try:  # the compiled core; absent when it could not be built at install time (no C++ compiler)
    import filters._native as _native
except ImportError:  # pragma: no cover - exercised on machines without a compiler
    _native = None

STATS_FIELDS = 4096  # fields of a slice hash `stats` reads all of; of a bigger one, that many of its groups
NAMES_KEPT_BITS = 17  # the groups' fields a client keeps made: those of 2^17 groups at most (~6 MB)


def _script() -> _Script:
    bits = f"{gc.K_FIRST}, {gc.K_MIN}, {gc.K_MAX}, {cc.FIELDS_PER_ENTRY}, {gc.GROUP_FILL}"
    source = _lua("insert_slices.lua", "round_start.lua", "group_insert.lua")  # (an entry's buckets: one argument)
    return _Script.of(source.replace("ROUND_LAYOUT", f"'{gc.LAYOUT}'").replace("ROUND_FIXED", "true")
                      .replace("GROUP_BITS", bits))


GROUP_INSERT = _script()  # the checking script: a contended round (on Redis Cluster, one INSERT_ALONE_LUA refused)


def _mixed(h: int) -> bytes:
    """A bucket key's (or an id hash's) mixed value as the checking script takes it (8 bytes big-endian: its group
    the top bits, its records' key the low 32)."""
    return gc.mixed(h).to_bytes(8, "big")


# A slice's read plan: its fields, the place of each name's field, the bits it was read with, its HMGETs.
_Plan = tuple[list[bytes], list[int], "int | None", int]


class GroupIndex(CompactIndex):
    """`RedisIndex` in the group layout (`?layout=group`); see the module's docstring for what it does not do
    yet."""

    LAYOUT: ClassVar[str] = gc.LAYOUT
    CHECKING: ClassVar[_Script] = GROUP_INSERT

    def __init__(self, url: str, *, window: float, bucket_cap: int, namespace: str, fenced: bool = False) -> None:
        super().__init__(url, window=window, bucket_cap=bucket_cap, namespace=namespace, fenced=fenced)
        self._spre = f"{{{self.prefix}:{namespace}}}:g:"
        # The groups of the last read (slice -> group field -> value), with this client's writes since: what an
        # uncontended round rewrites whole; and the groups written since the view's read (a read sent ahead
        # lacks them).
        self._last_raw: dict[int, dict[bytes, bytes]] = {}
        self._raw_written: dict[int, dict[bytes, bytes]] = {}
        # Per slice the view's rounds wrote, whether they keep its bucket values whole in `_View.written` (only
        # a slice its read found without bits: a read sent ahead without its groups takes them, `_taken`); the
        # tails a checked round expects are the rounds' seqs (`_settle_tails`).
        self._kept_whole: dict[int, bool] = {}
        # The last read itself: per slice (of known bits) its fields, each name's place among them, their values
        # and its bits (`slice_writes` finds a group there by its name's place), and the names it read. `_last_raw`
        # then holds only the groups written since.
        self._last_read: dict[int, tuple[list[bytes], list[int], list[bytes | None], int]] = {}
        self._read_names: Sequence[bytes] | None = None
        self._names_kept: list[bytes | None] = []  # group j's field at j, once made (`_group_names`)
        self._read_fields = _native.group_read_fields if _native is not None else gc.read_fields
        self._pack_group_reads = _native.group_pack_reads if _native is not None else gc.pack_reads
        self._slice_column = _native.group_slice_column if _native is not None else gc.slice_column
        self._alone_groups = _native.group_alone_groups if _native is not None else gc.alone_groups
        self._keep_written = _native.group_keep_written if _native is not None else gc.keep_written
        self._pack_group_writes = _native.group_pack_writes if _native is not None else gc.pack_writes
        self._count_buckets = _native.group_count_buckets if _native is not None else gc.count_buckets
        self._release = _native.group_release if _native is not None else gc.release

    @staticmethod
    def _pack_send(conn: Any, commands: Sequence[Sequence[str | int | bytes] | _Packed]) -> int:
        """`CompactIndex._pack_send`, its pieces (the commands packed already, and each run of the others packed)
        sent one after the other, not joined first: a round's groups (megabytes a batch) are not copied once more
        on their way. Returns the number of replies."""
        if not any(type(c) is _Packed for c in commands):
            return CompactIndex._pack_send(conn, commands)
        blobs, count = _pieces(commands)
        conn.send_packed_command(blobs)
        return count

    # -- reading -------------------------------------------------------------------------------------
    def _planned(self, queries: Sequence[Query]) -> tuple[list[bytes], list[list[bytes]], list[list[int]], list[int]]:
        """`CompactIndex._planned`, its places taken from the ints kept from batch to batch (as the slot layout's)
        and each id's field made inline (no Python call a query)."""
        try:
            return cast("tuple[list[bytes], list[list[bytes]], list[list[int]], list[int]]",
                        self._plan([q.keys for q in queries],
                                   [b"i" + q.id.encode("utf-8", "surrogatepass") for q in queries], self._numbers))
        except (struct.error, OverflowError, ValueError):
            raise ValueError(f"bucket keys must be unsigned 64-bit ints: {[q.keys for q in queries]!r}") from None

    def _gone(self) -> int | None:
        return None  # no small hashes to reap: a slice's groups go with its hash

    def _reap_commands(self) -> list[Sequence[Any]]:
        return []

    def _read_plan(self, names: Sequence[bytes], slices: Sequence[int], known: dict[int, int | None],
                   probes: Sequence[int]) -> tuple[list[Sequence[Any]], list[Any]]:
        """A read's commands (the meta hash's `HMGET`, then per slice the `HMGET` of its groups and other fields,
        and its count) and, per slice, its plan (`_Plan`). A slice of unknown bits reads its other fields only."""
        commands: list[Any] = [("HMGET", self._meta, "seq", "hwm", *((MARKER,) if self.fenced else ()),
                                "layout", "gen", *(f"k:{s}" for s in slices))]
        plans: list[_Plan] = []
        listed = list(names)
        step = FIELDS_PER_HMGET
        for s in slices:
            key = f"{self._spre}{s}"
            bits = known[s]
            if self._packs:  # packed at once (`pack_reads`), with the count's HGET
                blob, n, fields, places = self._pack_group_reads(key, listed, bits, step, self._group_names(bits))
                commands.append(_Packed(blob, n + 1))
                plans.append((fields, places, bits, n))
                continue
            fields, places = self._read_fields(listed, bits)
            reads = [("HMGET", key, *fields[a : a + step]) for a in range(0, len(fields), step)]
            commands += [*reads, ("HGET", key, "n")]
            plans.append((fields, places, bits, len(reads)))
        return commands, plans

    def _group_names(self, bits: int | None) -> list[bytes | None] | None:
        """The groups' fields made so far (`pack_reads`' cache), as many as a slice of `bits` has, up to
        2^`NAMES_KEPT_BITS`: a batch reads thousands of groups, most of them read by the batches before."""
        if bits is None:
            return None
        want = 1 << min(bits, NAMES_KEPT_BITS)
        if len(self._names_kept) < want:
            self._names_kept += [None] * (want - len(self._names_kept))
        return self._names_kept

    def _parse_read(self, replies: Sequence[Any], names: Sequence[bytes], slices: Sequence[int],
                    plans: Sequence[Any], probes: Sequence[int],
                    written: dict[int, dict[bytes, bytes]] | None = None) -> tuple[
                        int, bytes, list[list[bytes | None]], dict[int, int | None]]:
        """(seq, stored high-water mark, columns in the compact layout's terms, the bits of each slice as the meta
        hash says) of `_read_plan`'s replies; refuses a namespace of another layout; keeps the groups read
        (`_last_read`). `written`: per slice the fields written since the read went out (`_taken`), put in their
        place among the values read first."""
        state = replies[0]
        extra = 3 if self.fenced else 2
        self._check_continuity(state, state[extra + 1])
        if self._restoring:
            seq, stored = int(state[0] or 0), state[1] or b""
        else:
            seq, stored = self._state(state)
        layout = state[extra]
        if state[0] is not None and layout != gc.LAYOUT.encode():
            raise ConfigError(f"the Redis index at {self._where} holds namespace {self.namespace!r} in another "
                              f"layout ({(layout or b'slot, records by id').decode()}); this one is the group "
                              "layout: give a new prefix (?prefix=...), which starts empty or is rebuilt from the "
                              "index changelog")
        read = {s: int(k) if k is not None else None for s, k in zip(slices, state[extra + 2 :])}
        self._stored_top = max(self._stored_top, _stored_time(stored))
        for s, bits in read.items():
            if bits is not None:
                self._bits[s] = bits
        listed = list(names)
        columns = []
        kept: dict[int, tuple[list[bytes], list[int], list[bytes | None], int]] = {}
        at = 1
        for s, (fields, places, bits, n) in zip(slices, plans):
            count = replies[at + n]
            if count is not None:
                self._counts[s] = int(count)
            column, values = self._slice_column(list(replies[at : at + n]), places, listed, bits, fields,
                                                written.get(s) if written is not None and bits is not None else None)
            columns.append(column)
            if bits is not None:
                kept[s] = (fields, places, values, bits)
            at += n + 1
        self._last_read, self._read_names, self._last_raw = kept, names, {}
        return seq, stored, columns, read

    def _resolve_marks(self, names: Sequence[bytes], slices: Sequence[int],
                       columns: list[list[bytes | None]]) -> None:
        return  # no marks: a bucket of any length lives in its group

    def _read_view(self, queries: Sequence[Query]) -> tuple[list[float], list[str], list[list[bytes | None]],
                                                            list[list[int]], list[int]] | None:
        view, last = self._view, self._last_read
        read = super()._read_view(queries)
        self._raw_written = {}  # the groups written since this read
        self._kept_whole = {}
        # What the view and the read before held (~20,000 values and names a batch, and the names of each query)
        # freed at once (`release`: a list still held elsewhere is left as it is).
        old: list[list[Any]] = [*view.columns.values(), view.names, view.fields_of, view.places_of] \
            if self._view is not view else []
        if self._last_read is not last:
            old += [items for fields, places, values, _ in last.values() for items in (fields, places, values)]
        del view, last
        self._release(old)
        return read

    def _ahead_usable(self, ahead: _SentRead, known: dict[int, int | None]) -> bool:
        """Not when a slice the read found without bits was written by a round that kept only its ids there
        (`_kept_whole` False): no values to overlay it with (the lookup reads afresh)."""
        return not any(known[s] is None and self._kept_whole.get(s) is False for s in ahead.slices)

    def _parse_ahead(self, ahead: _SentRead, plans: Sequence[Any], probes: Sequence[int]) -> tuple[
            int, bytes, list[list[bytes | None]], dict[int, int | None]]:
        """The read sent ahead (`CompactIndex._taken`) parsed with the fields this batch wrote since it went out
        (its groups, whole, and its memos: `_raw_written`) put in their place among the values read before the
        columns are made (`slice_column`), so that the columns and the groups kept are those of a read made now; one overlay,
        by place. A group written that the read did not read is no group of its names: the next round, which
        writes only those, never needs it. A slice the read found without bits but this batch wrote (it made
        it) has no groups read to put them in: its column is the view's values written there (`_View.written`,
        which the rounds keep whole in a slice their view's read found without bits: `_alone_round`), and its
        groups written are kept beside the read."""
        return self._parse_read(ahead.replies, ahead.names, ahead.slices, plans, probes, self._raw_written)

    def _overlay_ahead(self, ahead: _SentRead, kept: list[tuple[int, list[bytes | None]]],
                       known: dict[int, int | None]) -> None:
        """Only a slice the read found without bits (the batch made it) is overlaid, with the view's values
        written there; its groups written are kept beside the read."""
        view, written = self._view, self._raw_written
        made = [(s, column) for s, column in kept if known[s] is None and s in view.written]
        if made:
            self._overlay(ahead.names, view.names, made, view.written)
        for s in ahead.slices:
            if known[s] is None and s in written:
                self._last_raw[s] = {f: v for f, v in written[s].items() if f[:1] == b"g"}

    def _memos_sent(self) -> None:
        """`RedisIndex._memos_sent`; with a read sent ahead, the memos also among the fields written since it
        (`_taken` puts them in their place)."""
        memos = self._memos
        super()._memos_sent()
        if memos is not None and self._ahead is not None:
            for s, id, value in memos.written:
                self._raw_written.setdefault(s, {})[b"d" + id.encode("utf-8", "surrogatepass")] = value

    def lookup(self, queries: Sequence[Query], limit: int) -> list[tuple[Entry | Verdict | None, list[Candidate]]]:
        """`CompactIndex.lookup`; an id's record is its own only when its entry holds the id (another id alike in
        its 32 bits is not), and a candidate holding the query's id is its own entry (a replay)."""
        read = self._read_view(queries)
        if read is None:
            return []
        marks, ids, columns, positions, id_places = read
        window, cap = self.window, self.bucket_cap
        floors = [q.min_shared for q in queries]
        found = self._rank_batch(columns, positions, id_places, ids, floors, limit, [m - window for m in marks], cap,
                                 memo_time)
        wanted: set[tuple[int, float]] = {(s, ts) for _, _, ranked in found for s, _, _, ts in ranked}
        wanted.update(own for own, _, _ in found if own is not None)
        entries = self._entries_by_seq(wanted)
        for i, (own, _, _) in enumerate(found):
            if own is not None and own[0] in entries and entries[own[0]].id != ids[i]:
                # Another id's record: this id is not stored. Ranked again with that seq a candidate, its memo
                # looked for, and its place in the view emptied (the insert must not take it as live).
                horizon = marks[i] - window
                ranked = self._rank_compact(columns, positions[i], 0, floors[i], limit, horizon, cap, -1, None)
                found[i] = (None, live_memo(columns, id_places[i], ids[i], horizon, memo_time), ranked)
                entries.update(self._entries_by_seq({(s, ts) for s, _, _, ts in ranked}))
                for column in self._view.columns.values():
                    column[id_places[i]] = None
        out: list[tuple[Entry | Verdict | None, list[Candidate]]] = []
        for q, (own, memo, ranked) in zip(queries, found):
            mine: Entry | Verdict | None = None
            if own is not None and own[0] in entries:
                mine = entries[own[0]]
            cands = []
            for s, shared, first, _ in ranked:
                entry = entries.get(s)
                if entry is None:
                    continue
                if entry.id == q.id:  # its own entry, its id's record lost among others alike: a replay
                    mine = entry
                    continue
                cands.append(new_candidate(entry, shared, q.keys[first]))
            if mine is None and memo is not None:
                mine = decode_memo(memo, q.id)
            out.append((mine, cands))
        return out

    def _entries_read(self, by_slice: dict[int, list[int]], replies: Sequence[Any]) -> dict[int, Entry]:
        """`CompactIndex._entries_read`, the entries decoded at once by the compiled decoder of the slot layout
        (`decode_entries`; numpy's unpacking of one entry at a time cost ~80,000 instructions an entry)."""
        seqs, ids, blobs = [], [], []
        for at, values in zip(by_slice.values(), replies):
            for seq, value in zip(at, values):
                if value is not None:
                    blob, id = cc.split_entry_value(value)
                    seqs.append(seq)
                    ids.append(id)
                    blobs.append(blob)
        if len(set(ids)) == len(ids):  # (decoded by id: an id of two entries read, each on its own)
            by_id = self._decode(ids, blobs, new_entry, decode_entry)
            read = {seq: by_id[id] for seq, id in zip(seqs, ids)}
        else:
            read = {seq: self._decode([id], [blob], new_entry, decode_entry)[id] for seq, id, blob in zip(seqs, ids, blobs)}
        return read

    # -- inserting -----------------------------------------------------------------------------------
    def _alone_round(self, ids: list[str], times: list[float], blobs: list[bytes], fields_of: list[list[bytes]],
                     places_of: list[list[int]], id_places: list[int], slices: tuple[int, ...],
                     writes: dict[int, dict[int, bytes]], hwm: float, seq: int) -> tuple[
                         list[int], dict[int, Any], list[tuple[int, int, list[int]]], float, int]:
        """`CompactIndex._alone_round`, its writes put into whole groups at once (`alone_groups`: no field-value
        pairs of buckets and ids made): per slice written (its entries, its `HSET` arguments, the places of its
        groups changed in the read, the read's values, its bits if this round makes the slice, the groups changed
        as a dict where a read was sent ahead), as `_write_groups` takes them. A slice's groups are those read,
        and those written since (`_last_raw`)."""
        view = self._view
        names, raw = view.names, self._last_raw
        sides: dict[int, tuple[int, dict[bytes, bytes], Any, bool]] = {}
        made: dict[int, int] = {}
        for s in slices:
            bits = self._bits.get(s)
            if bits is None:
                bits = made[s] = max(gc.slice_bits(self._counts.get(s - 1)),
                                     gc.slice_bits(self._expected.get(s, self._rate_count)))
            # The slice's groups as they stand (each built once from those read and written since, which stay as
            # they are until Redis takes the transaction).
            written, read = raw.get(s, {}), self._last_read.get(s)
            if read is not None and (read[3] != bits or names is not self._read_names):  # (not so: the read's terms)
                if read[3] == bits:
                    written = {**gc.groups_read(read[0], read[2]), **written}
                read = None
            whole = self._kept_whole.setdefault(s, s not in self._last_read)
            sides[s] = (bits, written, read[:3] if read is not None else None, whole)
        # A read sent ahead lacks the groups this round writes (`_taken`): they are kept for it, as made.
        results, out, pending, hwm, seq = self._alone_groups(
            ids, times, blobs, places_of, id_places, slices, view.columns, writes, hwm, self.window,
            self.slice_length, self.bucket_cap, seq, names, sides, self._ahead is not None)
        groups = {s: (count, flat, taken, None if sides[s][2] is None else sides[s][2][2], made.get(s), changed)
                  for s, (count, flat, taken, changed) in out.items()}
        return results, groups, pending, hwm, seq

    def _write_alone(self, start: int, seq: int, hwm_bytes: bytes, hwm: float, groups: dict[int, Any],
                     ahead: bool) -> bool | None:
        """`CompactIndex._write_alone`, its writes those of whole groups (`_alone_round`, `_write_groups`)."""
        return self._write_groups(start, seq, self._view.hwm, hwm_bytes, hwm, groups, self._last_raw, ahead=ahead)

    def _alone_unwatched(self) -> bool:
        """Without WATCH (Redis Cluster), an uncontended round's groups go through INSERT_ALONE_LUA (`_write_groups`)."""
        return not self._watchable()

    def _write_groups(self, start: int, seq: int, stored_hwm: bytes, hwm_bytes: bytes, hwm: float,
                      groups: dict[int, Any], raw: dict[int, dict[bytes, bytes]], *, ahead: bool = False) -> bool | None:
        """A round's writes (`groups`, per slice: its entries, its `HSET` arguments (`slice_writes`: the groups
        changed, whole, then the entries), the places of its groups in the read, the read's values (None: not
        read), its bits if the round makes the slice, and the groups changed as a dict or None) as a watched
        MULTI/EXEC, a slice written for the first time given its bits; once Redis took it, the groups written are
        kept where the next round finds them (`keep_written`: in the read's values, else in `raw`), and where a
        read was sent ahead, for it (`_raw_written`). Where no WATCH guards the round (Redis Cluster)
        the same writes go through INSERT_ALONE_LUA, which checks that the seq and high-water mark are still what
        the lookup read. None: refused, nothing written; else whether the meta hash still held what this wrote
        (after the script, True)."""
        meta, ttl = self._meta, self._ttl_ms
        watched = self._watchable()
        commands: list[Any] = [("MULTI",)]
        made: dict[int, int] = {}
        slices: list[Any] = []  # INSERT_ALONE_LUA's: per slice its key, entries, pairs and the pairs
        step = 2 * FIELDS_PER_CALL
        for s, (count, flat, _, _, bits, _) in groups.items():
            if bits is not None:
                made[s] = bits
                commands.append(("HSET", meta, f"k:{s}", bits))
            key = f"{self._spre}{s}"
            if not watched:
                slices += [key, count, len(flat) // 2, *flat]
            elif self._packs:  # packed at once (`pack_writes`)
                commands.append(_Packed(*self._pack_group_writes(key, flat, step, count, ttl)))
            else:
                commands += [("HSET", key, *flat[a : a + step]) for a in range(0, len(flat), step)]
                commands += [("HINCRBY", key, "n", count), ("PEXPIRE", key, ttl)]
        gone = None
        if seq != start:
            clock = hwm if self._clock is None else self._clock
            gone = self._slice(clock - self.window) - 1
        if watched:
            commands += self._meta_writes(start, seq, stored_hwm, hwm_bytes, bool(made))
            if gone is not None:
                commands += [("UNLINK", f"{self._spre}{gone}"), ("HDEL", meta, f"k:{gone}")]
            held = self._exec_round(commands, made, start, seq, hwm_bytes, ahead=ahead)
            if held is None:
                return None
        else:
            fields: list[Any] = [f for s, bits in made.items() for f in (f"k:{s}", bits)]
            if seq != start:
                fields += ["layout", gc.LAYOUT]
            args = [str(start), stored_hwm, str(seq), hwm_bytes, ttl, "" if gone is None else f"{self._spre}{gone}",
                    self._expected_marker(), len(fields) // 2, *fields, self._token if seq != start else "",
                    "" if gone is None else f"k:{gone}", *slices]
            [done] = self._eval_pipelined(slot._INSERT_ALONE, [args], self._memo_commands())
            if done == -1:
                raise self._lost()
            if not done:
                self._memos_sent()  # written beside the script, whatever it answered
                return None
            self._bits.update(made)
            self._stored_top = max(self._stored_top, _stored_time(hwm_bytes))
            held = True
        # Kept at once, also for a round sent ahead: if Redis refuses it, the view goes by the checking script
        # (which needs none of these) until a read made afresh replaces them all (`_parse_read`, `_read_view`).
        before = self._ahead is not None  # a read sent ahead lacks these groups (`_taken`); one sent after has them
        for s, (_, flat, taken, values, _, changed) in groups.items():
            kept = self._raw_written.get(s) if before else None
            if before and changed is None and kept is None:  # (sent after the round was made)
                kept = self._raw_written[s] = {}
            self._keep_written(raw.setdefault(s, {}), values, flat, taken, kept if changed is None else None)
            if before and changed is not None:  # made with the groups, no group touched again
                if kept is None:
                    self._raw_written[s] = changed
                else:
                    kept.update(changed)
        return held

    def _guarded_round(self, ids: list[str], times: list[float], blobs: list[bytes], fields_of: Sequence[list[bytes]],
                 check: Sequence[bool]) -> tuple[list[int], bytes]:
        """The contended round: one call of the checking script (`GROUP_INSERT`), which reads the entries' groups,
        counts an entry whose id is live 0, one whose buckets changed since its lookup (`check`: compared with
        the view's tails) -1, and inserts the others as the uncontended round inserts them (`apply_round`'s
        bytes), atomically; the memos go with it. Returns (per entry its seq, 0 or -1; the high-water mark
        stored)."""
        view = self._view
        view.settle_tails()  # (the uncontended rounds kept their seqs, not their bucket values)
        rows = []
        for id, ts, blob, fields, checked in zip(ids, times, blobs, fields_of, check, strict=True):
            expected = b""
            if checked:
                mine = self._places(id, fields)
                expected = view.expected(id, cast("list[int]", mine)) if None not in mine else b""
            rows.append((id, ts, blob, fields, expected))
        marker = self._expected_marker() if any(check) else b""
        rate = max([self._rate_count, *(self._expected.get(self._slice(ts), 0) for ts in times)])
        args: list[Any] = [self._spre, repr(self.window), repr(self.slice_length), self.bucket_cap, self._ttl_ms,
                           repr(self._hwm), ",".join(map(str, view.slices)), view.mark, view.inserted,
                           self._clock_arg(), marker, self._token, rate]
        # The buckets' mixed values of the whole round at once (a bucket's field: b"b" and its key's 8 bytes).
        if any(len(f) != 9 for f in chain.from_iterable(fields_of)):
            raise ValueError("bucket fields are b'b' and a 64-bit key")
        flat = gc.mixed_keys(b"".join([f[1:] for f in chain.from_iterable(fields_of)]))
        at = 0
        for id, ts, blob, fields, expected in rows:
            args += [id.encode("utf-8", "surrogatepass"), repr(ts), blob, len(fields), expected,
                     _mixed(cc.id_hash(id)) + flat[at : at + 8 * len(fields)]]
            at += 8 * len(fields)
        _, hwm, results = self._run_script(args)
        return results, hwm

    def _checked(self, entries: Sequence[tuple[Entry, tuple[int, ...]]],
                 fields_of: Sequence[list[bytes]]) -> list[int]:
        view = self._view
        ids = [entry.id for entry, _ in entries]
        times = [_event_time(entry.ts, entry.id, self.slice_length) for entry, _ in entries]
        results, hwm = self._guarded_round(ids, times, self._encode(list(entries), encode_entry), fields_of,
                                           [True] * len(entries))
        view.hwm = hwm
        view.exact = False  # the view's columns are not what Redis holds now
        for (entry, _), fields, result in zip(entries, fields_of, results):
            if result > 0:
                self._inserted(result, self._slice(float(entry.ts)), self._places(entry.id, fields),
                               SEQ.pack(result), view.basis(entry.id))
        return results

    def _insert_unchecked(self, entries: Sequence[tuple[str, float, bytes, tuple[int, ...]]]) -> int:
        rows = list(entries)
        fields_of = [[b"b" + k.to_bytes(8, "big") for k in keys] for _, _, _, keys in rows]
        results, _ = self._guarded_round([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], fields_of,
                                   [False] * len(rows))
        self._view.exact = False
        return sum(1 for r in results if r > 0)

    # -- restoring (`CompactIndex.restore`, `_rebuild_compact`: the group layout's steps), stats ----------
    def _rebuild_plan(self) -> _GuardedPlan:
        """What the guarded chunks of a restore decide chunk by chunk, told from the entries alone
        (`_GuardedPlan`): the bits of a slice they make, and the slice each of their rounds unlinks."""
        return _GuardedPlan(self)

    def _forget_slice(self, held: _HeldFields, s: int) -> list[Sequence[Any]]:
        """The commands of a guarded round's unlink of slice `s` (its groups go with its hash), and forgets what
        is held of it."""
        held.drop(s)
        return [("UNLINK", f"{self._spre}{s}"), ("HDEL", self._meta, f"k:{s}")]

    def _held_slice(self, key: str, bits: int, columns: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                                                list[str]], read: bool) -> tuple[Any, ...]:
        """What `_held_shares` takes of a slice's held records (`_HeldFields.columns`): them, their ids mixed
        (`mixed_ids`), and the groups that Redis holds of them where `read` (`_held_groups_read`)."""
        keys, bounds, times, seqs, ids = columns
        mixed = _native.group_mixed_ids(ids) if _native is not None else gc.mixed_ids(ids)
        olds = self._held_groups_read(key, keys, mixed, bits) if read else {}
        return keys, bounds, times, seqs, mixed, olds

    def _held_shares(self, pieces: Sequence[tuple[str, int, int, tuple[Any, ...]]],
                     intruded: bool) -> Iterator[list[Sequence[Any]]]:
        """Each slice's groups a share at a time (`WRITE_SHARE_BITS`; `held_groups`, made when the share is asked
        for) as its writes, its count with the first and its TTL with the last. A group that Redis holds goes
        on from its value there (read, as `intruded` asks, by `_held_slice`)."""
        fold = _native.group_held_groups if _native is not None else gc.held_groups
        cap, ttl = self.bucket_cap, self._ttl_ms
        step = 2 * FIELDS_PER_CALL
        for key, bits, entries, (keys, bounds, times, seqs, mixed, olds) in pieces:
            share_bits = min(WRITE_SHARE_BITS, bits)
            for j in range(1 << share_bits):
                pairs = fold(keys, bounds, times, seqs, mixed, bits, cap, olds, j, share_bits)
                writes: list[Sequence[Any]] = [("HSET", key, *pairs[a : a + step]) for a in range(0, len(pairs), step)]
                if j == 0 and entries:
                    writes.append(("HINCRBY", key, "n", entries))
                if j == (1 << share_bits) - 1:
                    writes.append(("PEXPIRE", key, ttl))
                yield writes

    def _share_commands(self, share: Any) -> list[Sequence[Any]]:
        return cast("list[Sequence[Any]]", share)

    def _share_packed(self, share: Any) -> tuple[bytes, int]:
        return _pack(share), len(share)

    def _held_groups_read(self, key: str, keys: np.ndarray, mixed: np.ndarray, bits: int) -> dict[bytes, bytes]:
        """What Redis holds of the groups of a slice's held records (bucket `keys`, `mixed` ids)."""
        shift = np.uint64(64 - bits)
        found = np.concatenate(((keys * np.uint64(_FIB)) >> shift, mixed >> shift)) if bits else np.zeros(1, np.uint64)
        fields = [gc.group_field(j) for j in np.unique(found).tolist()]
        step = FIELDS_PER_HMGET
        named = [fields[a : a + step] for a in range(0, len(fields), step)]
        olds: dict[bytes, bytes] = {}
        for some, values in zip(named, self._read_many_calls([("HMGET", key, *some) for some in named])):
            olds.update((f, v) for f, v in zip(some, values) if v is not None)
        return olds

    def _stats_reads(self, slices: Sequence[int], bits: Sequence[Any]) -> tuple[list[Sequence[Any]],
                                                                            list[tuple[int, int]]]:
        """`CompactIndex._stats_reads`: `buckets` are the distinct record keys of each group, counted exactly in a
        slice hash of up to `STATS_FIELDS` fields, estimated from `STATS_FIELDS` of its groups in a bigger one."""
        sizes = self._execute([("HLEN", f"{self._spre}{s}") for s in slices], pinned=False)
        self._raise_any(sizes)
        commands: list[Sequence[Any]] = []
        sampled = []
        for s, k, size in zip(slices, bits, sizes):
            key = f"{self._spre}{s}"
            n = 1 << int(k) if k is not None else 0
            commands.append(("HMGET", key, "n", "m"))
            if size <= STATS_FIELDS:
                commands.append(("HGETALL", key))
                sampled.append((1, 1))
            else:
                step = max(1, n // STATS_FIELDS)
                sample = range(0, n, step)
                commands.append(("HMGET", key, *map(gc.group_field, sample)))
                sampled.append((n, len(sample)))
        return commands, sampled

    def _stats_buckets(self, rest: Iterator[Any], n: int, taken: int, count: int) -> int:
        got = next(rest)
        if isinstance(got, dict):
            values = [v for f, v in got.items() if f[:1] == b"g"]
        else:
            values = [v for v in got if v is not None]
        return round(self._count_buckets(values) * n / taken) if taken else 0

    def __repr__(self) -> str:
        return f"GroupIndex({self._where!r}, namespace={self.namespace!r}, window={self.window})"


class _GuardedPlan:
    """The group layout's `_RebuildPlan`: what the guarded chunks of a restore (`CompactIndex.restore`: a read,
    then a round, each `RESTORE_CHUNK` entries of a part) decide that stays in Redis, told from the entries alone
    for a rebuild that leaves the same (`CompactIndex._rebuild_compact`): which entries the insert takes and
    their seqs (`restore_accept`, chunk by chunk), the bits of each slice they make (from the count of the slice
    before as their read found it, and the rate of the part's entries there: `GroupIndex._write_groups`), and the
    slice each round that wrote unlinks (the one before the window)."""

    def __init__(self, index: GroupIndex) -> None:
        self._index = index
        self.counts: dict[int, int] = {}  # slice -> entries stored there (the rebuild's)
        # slice -> its count as the last chunk's read found it (`_counts`; those of a namespace before are
        # forgotten by the first read of one made again)
        self.seen: dict[int, int] = {}
        self.bits: dict[int, int] = {}  # slice -> its bits, once made
        self._times: np.ndarray = np.zeros(0)
        self._expected: dict[int, int] = {}
        self._start_seq = 0  # the seq before the current chunk's round
        # With the window's clock set (`expire`), slice -> the ids taken there: the slice a round unlinks may hold
        # entries inside the window of the event times, and their ids are live no more.
        self._ids_of: dict[int, list[str]] = {}

    def part(self, times: np.ndarray, slices: np.ndarray) -> None:
        """A part begins (its event times): its chunks count from its first entry, its rate is its own."""
        self._times = times
        self._expected = cc.expected_counts(times.tolist(), self._index.slice_length)

    def left(self, slices: Iterable[int], hwm: float) -> list[int]:
        return []  # what leaves the window goes with the round that unlinks it (`accept`)

    def bits_of(self, s: int) -> int:
        return self.bits[s]

    def accept(self, ids: Sequence[str], at: int, live: dict[str, float], hwm: float,
               seq: int) -> tuple[np.ndarray, float, int, list[tuple[int, int]]]:
        """Entries `at` to `at + len(ids)` of the part: (seq or 0 each, as uint64; high-water mark; seq; the
        slices unlinked among them, in order, each after the entries before `at` + its first number)."""
        index, small, times = self._index, slot.RESTORE_CHUNK, self._times
        length, window, n = index.slice_length, index.window, len(times)
        out = np.zeros(len(ids), np.uint64)
        gone: list[tuple[int, int]] = []
        a, stop = at, at + len(ids)
        while a < stop:
            b = min(stop, (a // small + 1) * small)
            if a % small == 0:  # a chunk's read: the counts of the slices it covers
                self._read(hwm, times[a : min(a + small, n)])
                self._start_seq = seq
            seqs, hwm, seq = index._restore_accept(ids[a - at : b - at], times[a:b], live, hwm, window, seq)
            out[a - at : b - at] = seqs
            took = seqs > 0
            if took.any():
                slices, many = np.unique(np.floor(times[a:b][took] / length).astype(np.int64), return_counts=True)
                for s, count in zip(slices.tolist(), many.tolist()):
                    if s not in self.bits:  # made by this chunk's round
                        self.bits[s] = max(gc.slice_bits(self.seen.get(s - 1)),
                                           gc.slice_bits(self._expected.get(s, index._rate_count)))
                    self.counts[s] = self.counts.get(s, 0) + count
                if index._clock is not None:
                    for i in np.flatnonzero(took).tolist():
                        self._ids_of.setdefault(math.floor(times[a + i] / length), []).append(ids[a - at + i])
            if (b % small == 0 or b == n) and seq != self._start_seq:  # the chunk's round wrote: its unlink
                clock = hwm if index._clock is None else index._clock
                g = index._slice(clock - window) - 1
                gone.append((b - at, g))
                self.counts.pop(g, None)
                self.bits.pop(g, None)
                for id in self._ids_of.pop(g, []):
                    ts = live.get(id)
                    if ts is not None and math.floor(ts / length) == g:
                        del live[id]
            a = b
        return out, hwm, seq, gone

    def _read(self, hwm: float, times: np.ndarray) -> None:
        """A chunk's read (`GroupIndex._restore_watched`): the count of each slice it covers that Redis holds;
        those before the slice before them forgotten (`_read`)."""
        low = hwm if math.isfinite(hwm) else float(times.min())
        slices = self._index._slices(low, max(low, float(times.max())))
        for s in slices:
            count = self.counts.get(s)
            if count:
                self.seen[s] = count
        lowest = min(slices, default=0) - 1
        for s in [s for s in self.seen if s < lowest]:
            del self.seen[s]
