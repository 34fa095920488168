"""The group layout of the Redis index (docs/design.md, "The group layout"): the compact layout's protocol and
records by seq, its bucket records grouped in fields `g<j>` of the slice hash (`group_codec`).

Chosen by `?layout=group`. A lookup reads one `HMGET` a slice (the distinct groups of the batch's buckets and
ids, its memos: `group_codec.pack_reads`), which `slice_column` turns into the compact layout's columns, so the
ranking, the uncontended round, the tails and the read sent ahead are the compact layout's (`CompactIndex`); a
round's writes go back into whole groups (`slice_writes`, `pack_writes`, as `apply_round` writes them) in the
watched transaction (on Redis Cluster, where there is no WATCH and a namespace's keys share one hash tag as the
slot layout's, through the slot layout's `lua/insert_alone.lua`), and are kept where the next round finds them
(`keep_written`). Any other round (a contended one, a restore's chunk refused) is the checking script,
`lua/group_insert.lua`, which writes `apply_round`'s bytes. A
rebuild (a fenced index without its marker) holds its entries' records and writes each group once
(`group_codec.held_groups`), leaving the bytes the guarded chunks of any other restore leave.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain
from typing import Any, cast

import numpy as np

from filters.errors import ConfigError
from filters.index import Candidate, Entry, Query, Stored, new_candidate, new_entry
from filters.index import compact_codec as cc
from filters.index import group_codec as gc
from filters.index import redis as slot
from filters.index import redis_compact as compact  # its rebuild's holding limits, read when rebuilding
from filters.index.redis import (
    _MAX_SLICE,
    _MIN_TS,
    FIELDS_PER_CALL,
    FIELDS_PER_HMGET,
    MARKER,
    REBUILDING,
    _event_time,
    _lua,
    _Script,
    _SentRead,
    _stored_time,
)
from filters.index.redis_codec import SEQ, decode_entry, decode_memo, encode_entry, live_memo, memo_time
from filters.index.redis_compact import (
    _FIB,
    READ_COMMANDS,
    REAP_KEYS,
    SEND_BYTES,
    WRITE_SHARE_BITS,
    CompactIndex,
    _HeldFields,
    _pack,
    _Packed,
    _read_replies,
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
    return _Script.of(_lua("insert_slices.lua", "group_insert.lua").replace("GROUP_BITS", bits))


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

    def __init__(self, url: str, *, window: float, bucket_cap: int, namespace: str, fenced: bool = False) -> None:
        super().__init__(url, window=window, bucket_cap=bucket_cap, namespace=namespace, fenced=fenced)
        self._spre = f"{{{self.prefix}:{namespace}}}:g:"
        # The groups of the last read (slice -> group field -> value), with this client's writes since: what an
        # uncontended round rewrites whole; and the groups written since the view's read (a read sent ahead
        # lacks them).
        self._last_raw: dict[int, dict[bytes, bytes]] = {}
        self._raw_written: dict[int, dict[bytes, bytes]] = {}
        # The last read itself: per slice (of known bits) its fields, each name's place among them, their values
        # and its bits (`slice_writes` finds a group there by its name's place), and the names it read. `_last_raw`
        # then holds only the groups written since.
        self._last_read: dict[int, tuple[list[bytes], list[int], list[bytes | None], int]] = {}
        self._read_names: Sequence[bytes] | None = None
        self._names_kept: list[bytes | None] = []  # group j's field at j, once made (`_group_names`)
        self._read_fields = _native.group_read_fields if _native is not None else gc.read_fields
        self._pack_group_reads = _native.group_pack_reads if _native is not None else gc.pack_reads
        self._slice_column = _native.group_slice_column if _native is not None else gc.slice_column
        self._slice_writes = _native.group_slice_writes if _native is not None else gc.slice_writes
        self._keep_written = _native.group_keep_written if _native is not None else gc.keep_written
        self._pack_group_writes = _native.group_pack_writes if _native is not None else gc.pack_writes
        self._count_buckets = _native.group_count_buckets if _native is not None else gc.count_buckets

    @staticmethod
    def _pack_send(conn: Any, commands: Sequence[Sequence[str | int | bytes] | _Packed]) -> int:
        """`CompactIndex._pack_send`, its pieces (the commands packed already, and each run of the others packed)
        sent one after the other, not joined first: a round's groups (megabytes a batch) are not copied once more
        on their way. Returns the number of replies."""
        if not any(type(c) is _Packed for c in commands):
            return CompactIndex._pack_send(conn, commands)
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
                    plans: Sequence[Any], probes: Sequence[int]) -> tuple[
                        int, bytes, list[list[bytes | None]], dict[int, int | None]]:
        """(seq, stored high-water mark, columns in the compact layout's terms, the bits of each slice as the meta
        hash says) of `_read_plan`'s replies; refuses a namespace of another layout; keeps the groups read
        (`_last_read`)."""
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
            column, values = self._slice_column(list(replies[at : at + n]), places, listed, bits, fields)
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
        read = super()._read_view(queries)
        self._raw_written = {}  # the groups written since this read
        return read

    def _taken(self, ahead: _SentRead, low_mark: float, high_mark: float) -> tuple[int, bytes, tuple[int, ...],
                                                                              list[list[bytes | None]]] | None:
        """`CompactIndex._taken`, the groups read ahead overlaid with those this batch wrote since (whole)."""
        written = self._raw_written
        got = super()._taken(ahead, low_mark, high_mark)
        if got is not None:
            for s, groups in written.items():
                self._last_raw.setdefault(s, {}).update(groups)
        return got

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

    def _entries_by_seq(self, wanted: set[tuple[int, float]]) -> dict[int, Entry]:
        """`CompactIndex._entries_by_seq`, the entries read decoded at once by the compiled decoder of the slot
        layout (`decode_entries`; numpy's unpacking of one entry at a time cost ~80,000 instructions an entry)."""
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
        out.update(read)
        self._keep(read)
        return out

    # -- inserting -----------------------------------------------------------------------------------
    def _alone_rows(self, ids: list[str], times: list[float], blobs: list[bytes], fields_of: Sequence[list[bytes]],
                    places_of: Sequence[list[int] | None], low: float | None = None) -> list[int] | None:
        """`CompactIndex._alone_rows`, its writes put into whole groups (`_write_groups`)."""
        view = self._view
        window, cap = self.window, self.bucket_cap
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
        results, groups, pending, hwm, seq = self._alone_compact(
            ids, times, blobs, list(fields_of), cast("list[list[int]]", list(places_of)), id_places, tuple(slices),
            view.columns, writes, hwm, window, self.slice_length, cap, seq)
        hwm_bytes = view.hwm if hwm <= stored_hwm else (b"%.17g" % hwm)
        rows = [(r, ts, places, e) for r, ts, places, e in zip(results, times, places_of, id_places) if r > 0]
        written = self._write_groups(start, seq, view.hwm, hwm_bytes, hwm, groups, rows, view.names, self._last_raw)
        if written is None:
            return None
        if not written:
            view.watch = -1
        self._wrote_round(hwm_bytes, pending, groups, writes)
        return list(results)

    def _alone_unwatched(self) -> bool:
        """Without WATCH (Redis Cluster), an uncontended round's groups go through INSERT_ALONE_LUA (`_transact`)."""
        return not self._watchable()

    def _write_groups(self, start: int, seq: int, stored_hwm: bytes, hwm_bytes: bytes, hwm: float,
                      groups: dict[int, list[Any]], rows: Sequence[tuple[int, float, Any, int]],
                      names: Sequence[bytes], raw: dict[int, dict[bytes, bytes]]) -> bool | None:
        """The uncontended round's writes (`_transact`), under the lookup's WATCH, or through INSERT_ALONE_LUA."""
        return self._transact(start, seq, stored_hwm, hwm_bytes, hwm, groups, rows, names, raw)

    def _transact(self, start: int, seq: int, stored_hwm: bytes, hwm_bytes: bytes, hwm: float,
                  groups: dict[int, list[Any]], rows: Sequence[tuple[int, float, Any, int]],
                  names: Sequence[bytes], raw: dict[int, dict[bytes, bytes]]) -> bool | None:
        """A round's writes (`groups`: per slice its count and the compact layout's field-value pairs, of which
        the entries are taken; `rows`: (seq, event time, places of its buckets in `names`, place of its id) of
        each entry written) as a watched MULTI/EXEC: each group touched rewritten whole from `raw` (the groups
        read, updated once Redis took the transaction), a slice written for the first time given its bits.
        Where no WATCH guards the round (Redis Cluster) the same writes go through INSERT_ALONE_LUA, which checks
        that the seq and high-water mark are still what the lookup read. None: refused, nothing written; else
        whether the meta hash still held what this wrote (after the script, True)."""
        meta, ttl, cap = self._meta, self._ttl_ms, self.bucket_cap
        watched = self._watchable()
        commands: list[Any] = [("MULTI",)]
        made: dict[int, int] = {}
        kept: list[tuple[int, list[bytes | None] | None, list[bytes], list[int]]] = []
        slices: list[Any] = []  # INSERT_ALONE_LUA's: per slice its key, entries, pairs and the pairs
        step = 2 * FIELDS_PER_CALL
        listed, listed_rows = list(names), list(rows)
        for s, (count, pairs) in groups.items():
            bits = self._bits.get(s)
            if bits is None:
                bits = made[s] = max(gc.slice_bits(self._counts.get(s - 1)),
                                     gc.slice_bits(self._expected.get(s, self._rate_count)))
                commands.append(("HSET", meta, f"k:{s}", bits))
            # The slice's groups changed (each built once from those read and written since, which stay as they
            # are until Redis takes the transaction) and its HSET arguments, entries last.
            written, read = raw.get(s, {}), self._last_read.get(s)
            if read is not None and (read[3] != bits or names is not self._read_names):  # (not so: the read's terms)
                if read[3] == bits:
                    written = {**gc.groups_read(read[0], read[2]), **written}
                read = None
            flat, taken = self._slice_writes(written, read[:3] if read is not None else None, listed, bits,
                                             listed_rows, s, self.slice_length, cap, pairs)
            kept.append((s, read[2] if read is not None else None, flat, taken))
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
            if seq != start:
                commands += [("HSET", meta, "seq", seq, "layout", gc.LAYOUT), ("HSETNX", meta, "gen", self._token)]
            if hwm_bytes != stored_hwm:
                commands.append(("HSET", meta, "hwm", hwm_bytes))
            if seq != start or hwm_bytes != stored_hwm or made:
                commands.append(("PEXPIRE", meta, ttl))
            if gone is not None:
                commands += [("UNLINK", f"{self._spre}{gone}"), ("HDEL", meta, f"k:{gone}")]
            commands += self._memo_commands()
            commands += [("EXEC",), ("WATCH", meta), ("HMGET", meta, "seq", "hwm")]
            replies = self._exec_watched(cast("list[Sequence[str | int | bytes]]", commands))
            if replies is None:
                return None
            now_seq, now_hwm = replies[-1]
            held = int(now_seq or 0) == seq and (now_hwm or b"") == hwm_bytes
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
            held = True
        self._bits.update(made)
        ahead = self._ahead is not None  # a read sent ahead lacks these groups (`_taken`); one sent after has them
        for s, values, flat, taken in kept:
            self._keep_written(raw.setdefault(s, {}), values, flat, taken,
                               self._raw_written.setdefault(s, {}) if ahead else None)
        self._stored_top = max(self._stored_top, _stored_time(hwm_bytes))
        return held

    def _guarded_round(self, ids: list[str], times: list[float], blobs: list[bytes], fields_of: Sequence[list[bytes]],
                 check: Sequence[bool]) -> tuple[list[int], bytes]:
        """The contended round: one call of the checking script (`GROUP_INSERT`), which reads the entries' groups,
        counts an entry whose id is live 0, one whose buckets changed since its lookup (`check`: compared with
        the view's tails) -1, and inserts the others as the uncontended round inserts them (`apply_round`'s
        bytes), atomically; the memos go with it. Returns (per entry its seq, 0 or -1; the high-water mark
        stored)."""
        view = self._view
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
        for id, ts, blob, fields, expected in rows:
            args += [id.encode("utf-8", "surrogatepass"), repr(ts), blob, len(fields), expected,
                     _mixed(cc.id_hash(id)) + b"".join([_mixed(int.from_bytes(f[1:], "big")) for f in fields])]
        [(lost, hwm, results)] = self._eval_pipelined(GROUP_INSERT, [args], self._memo_commands())
        self._memos_sent()  # written beside the script, whatever it answered
        if lost == -1:
            raise self._lost()
        if lost == -2:
            raise ConfigError(f"the Redis index at {self._where} holds namespace {self.namespace!r} in another "
                              "layout; this one is the group layout: give a new prefix (?prefix=...)")
        self._stored_top = max(self._stored_top, _stored_time(hwm))
        return list(results), hwm

    def _checked(self, entries: Sequence[tuple[Entry, tuple[int, ...]]],
                 fields_of: Sequence[list[bytes]]) -> list[int]:
        view = self._view
        ids = [entry.id for entry, _ in entries]
        times = [_event_time(entry.ts, entry.id, self.slice_length) for entry, _ in entries]
        results, hwm = self._guarded_round(ids, times, [encode_entry(e) for e, _ in entries], fields_of,
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

    # -- restoring, stats ----------------------------------------------------------------------------
    def restore(self, parts: Iterable[Stored]) -> int:
        """See `CandidateIndex.restore`. A fenced index without its marker, empty (or left by a rebuild that
        died), is being rebuilt: nobody else writes it, and `_rebuild_groups` holds the entries' records and
        writes each group once. Otherwise (and for what a rebuild hands on) per chunk of `RESTORE_CHUNK`
        entries, as the uncontended insert (a read after a WATCH of the meta hash, the writes computed here, one
        MULTI/EXEC), the guarded round after `RESTORE_ATTEMPTS` refusals. A fenced index without its marker is
        being rebuilt: its marker is not asked for (the guard sets it after)."""
        self._forget_view()
        self._restoring = True
        written = 0
        with self._errors():
            replies = self._execute([("HMGET", self._meta, "hwm", MARKER, "seq", REBUILDING, "layout")])
            self._raise_any(replies)
        stored_hwm, marker, stored_seq, rebuilding, layout = replies[0]
        died = rebuilding is not None and layout == gc.LAYOUT.encode()  # (another layout is refused by the reads)
        self._stored_top = max(self._stored_top, _stored_time(stored_hwm or b""))
        try:
            rest: Iterable[tuple[Stored, int]] = ((part, 0) for part in parts)
            if self.fenced and marker is None and (stored_seq is None or died):
                rest, written = self._rebuild_groups(iter(parts), died)
            for part, begin in rest:
                times = [_event_time(float(t), id, self.slice_length) for id, t in zip(part.ids, part.times)]
                self._expected = cc.expected_counts(times, self.slice_length)
                chunk = slot.RESTORE_CHUNK
                for at in range(begin, len(part.ids), chunk):
                    written += self._restore_rows(self._rows(part, times, at, min(at + chunk, len(part.ids))))
        finally:
            self._restoring = False
            self._expected = {}
            self._forget_view()
        return written

    def _rebuild_groups(self, parts: Iterator[Stored], died: bool) -> tuple[Iterator[tuple[Stored, int]], int]:
        """Restores `parts` into a fenced namespace without its marker that nobody else writes (`restore`; `died`:
        a rebuild before this one left its `rebuilding` field: what it wrote goes first), leaving what the
        guarded chunks would leave (the same bytes, key by key, field by field). As the compact layout's rebuild
        (`CompactIndex._rebuild_compact`): per chunk of `REBUILD_CHUNK` entries, which entries the insert would
        take and their seqs told here (`restore_accept`), their entries written at once (with the seq, by
        HINCRBY, and a read of the seq and the marker: anybody else writing shows), their bucket keys and ids
        held (`_HeldFields`) and each slice's groups made once at the end (`held_groups`, `_write_held_groups`).
        What the guarded chunks decide chunk by chunk is told here the same way (`_GuardedPlan`): the bits of a
        slice they make, and the slice each of their rounds unlinks. Past `HOLD_RECORDS` bucket records held,
        what is held is written and the rebuild goes on (a group written is read back when written again); past
        `HOLD_IDS` ids inside the window, or once somebody else wrote, what is held goes (merged with what Redis
        holds, in the latter case) and the rest is handed to the guarded chunks. Returns (the rest: (part, first
        entry not restored); entries written)."""
        meta, ttl, window, length = self._meta, self._ttl_ms, self.window, self.slice_length
        held = _HeldFields()
        counts: dict[int, int] = {}  # slice -> entries written there (its count `n`)
        live: dict[str, float] = {}  # id -> event time of its newest entry taken (`restore_accept`)
        written = 0
        start: list[Sequence[Any]] = []
        if died:  # its entries would pass for live, its groups are held nowhere: the changelog has them all
            with self._errors():
                keys = list(dict.fromkeys(self._client.scan_iter(match=f"{self._spre}*", count=1000)))
            start += [("UNLINK", *keys[a : a + REAP_KEYS]) for a in range(0, len(keys), REAP_KEYS)]
            start.append(("DEL", meta))
            self._stored_top = -math.inf
        start += [("HSET", meta, REBUILDING, "1", "layout", gc.LAYOUT), ("HSETNX", meta, "gen", self._token),
                  ("PEXPIRE", meta, ttl), ("HMGET", meta, "seq", "hwm")]
        with self._errors():
            replies = self._execute(start)
            self._raise_any(replies)
        seq = int(replies[-1][0] or 0)
        hwm = max(self._hwm, self._stored_top, _stored_time(replies[-1][1] or b""))
        plan = _GuardedPlan(self, counts)
        step = 2 * FIELDS_PER_CALL
        for part in parts:
            array = np.asarray(part.times, dtype=np.float64)
            bad = ~(np.isfinite(array) & (array > _MIN_TS) & (np.abs(array / length) < _MAX_SLICE))
            if bad.any():
                at = int(np.flatnonzero(bad)[0])
                _event_time(float(array[at]), part.ids[at], length)  # raises its ValueError
            of_slice = np.floor(array / length).astype(np.int64)
            plan.part(array)
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
                # The entries up to each round that unlinks a slice (the slice before the window), then the unlink.
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
                        commands += [("UNLINK", f"{self._spre}{unlinked}"), ("HDEL", meta, f"k:{unlinked}")]
                        held.drop(unlinked)
                    begin = end
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
                if alone and len(live) > compact.HOLD_IDS:  # those that left the window are never live again
                    live = {id: ts for id, ts in live.items() if ts >= hwm - window}
                if not alone or len(live) > compact.HOLD_IDS:
                    self._write_held_groups(held, counts, plan.bits, intruded=not alone, done=True)
                    self._stored_top = max(self._stored_top, hwm)  # the guarded chunks' first live ids
                    rest = chain([(part, stop)], ((p, 0) for p in parts))
                    return rest, written
                if held.records > compact.HOLD_RECORDS:  # written now, read back where named again
                    self._write_held_groups(held, counts, plan.bits, intruded=False, done=False)
        self._write_held_groups(held, counts, plan.bits, intruded=False, done=True)
        self._stored_top = max(self._stored_top, hwm)
        return iter(()), written

    def _write_held_groups(self, held: _HeldFields, counts: dict[int, int], bits_of: dict[int, int], *,
                           intruded: bool, done: bool) -> None:
        """Writes a rebuild's held records (`_rebuild_groups`), each group once, a slice with the bits the meta
        hash gives it (set by an earlier write, or by somebody else meanwhile), else those the guarded chunks
        would have given it (`bits_of`), and the count of entries written since; then sets the bits, and drops
        `rebuilding` when `done`. A group that Redis may hold already (`intruded`: somebody else wrote too; or
        in a slice written before) goes on from the value there. A slice's groups are made a share at a time
        (`WRITE_SHARE_BITS`), each packed while the one before is sent (`_Sender`)."""
        meta, ttl, cap = self._meta, self._ttl_ms, self.bucket_cap
        fold = _native.group_held_groups if _native is not None else gc.held_groups
        mix = _native.group_mixed_ids if _native is not None else gc.mixed_ids
        slices = sorted(held.parts)
        with self._errors():
            replies = self._execute([("HMGET", meta, *(f"k:{s}" for s in slices))] if slices else [])
            self._raise_any(replies)
        known = replies[0] if slices else []
        made: list[Any] = []
        # Per slice: its key, bits, entries to count, and what `held_groups` takes.
        pieces: list[tuple[str, int, int, tuple[Any, ...]]] = []
        for s, k in zip(slices, known):
            if k is not None:
                bits = int(k)
            else:
                bits = bits_of[s]
                made += (f"k:{s}", bits)
            key = f"{self._spre}{s}"
            keys, bounds, times, seqs, ids = held.columns(s)
            mixed = mix(ids)
            olds = self._held_groups_read(key, keys, mixed, bits) if intruded or s in held.written else {}
            entries = counts.get(s, 0) - held.counted.get(s, 0)
            held.counted[s] = counts.get(s, 0)
            held.written[s] = bits
            pieces.append((key, bits, entries, (keys, bounds, times, seqs, mixed, olds)))
        held.clear()  # its arrays are in `pieces` now: not twice in memory while written
        commands: list[Sequence[Any]] = []
        if made:
            commands.append(("HSET", meta, *made))
        if done:
            commands.append(("HDEL", meta, REBUILDING))
        commands.append(("PEXPIRE", meta, ttl))
        step = 2 * FIELDS_PER_CALL

        def shares() -> Iterator[list[Sequence[Any]]]:
            """Each share's writes, its groups made when it is asked for."""
            for key, bits, entries, (keys, bounds, times, seqs, mixed, olds) in pieces:
                share_bits = min(WRITE_SHARE_BITS, bits)
                for j in range(1 << share_bits):
                    pairs = fold(keys, bounds, times, seqs, mixed, bits, cap, olds, j, share_bits)
                    writes: list[Sequence[Any]] = [("HSET", key, *pairs[a : a + step])
                                                   for a in range(0, len(pairs), step)]
                    if j == 0 and entries:
                        writes.append(("HINCRBY", key, "n", entries))
                    if j == (1 << share_bits) - 1:
                        writes.append(("PEXPIRE", key, ttl))
                    yield writes

        if not self._packs:  # Cluster: redis-py's pipeline, as the compact rebuild's
            with self._errors():
                replies = self._execute([*(c for writes in shares() for c in writes), *commands])
                self._raise_any(replies)
            return
        with self._errors():  # each share packed while the one before is sent (a thread of its own)
            conn = self._pinned()
            self._drain()
            sender = slot._Sender(conn)
            try:
                for writes in shares():
                    blob = _pack(writes)
                    for a in range(0, len(blob), SEND_BYTES):  # the socket's timeout bounds each piece's send
                        sender.send(blob[a : a + SEND_BYTES], len(writes) if a == 0 else 0)
                sender.send(_pack(commands), len(commands))
                replies = _read_replies(conn, sender.close())
            except BaseException:
                sender.close(raising=False)
                conn.disconnect()  # replies may still be on their way: never reuse it (it reconnects)
                raise
            self._raise_any(replies)

    def _held_groups_read(self, key: str, keys: np.ndarray, mixed: np.ndarray, bits: int) -> dict[bytes, bytes]:
        """What Redis holds of the groups of a slice's held records (bucket `keys`, `mixed` ids)."""
        shift = np.uint64(64 - bits)
        found = np.concatenate(((keys * np.uint64(_FIB)) >> shift, mixed >> shift)) if bits else np.zeros(1, np.uint64)
        fields = [gc.group_field(j) for j in np.unique(found).tolist()]
        step = FIELDS_PER_HMGET
        named = [fields[a : a + step] for a in range(0, len(fields), step)]
        olds: dict[bytes, bytes] = {}
        for a in range(0, len(named), READ_COMMANDS):
            with self._errors():
                got = self._execute([("HMGET", key, *some) for some in named[a : a + READ_COMMANDS]])
                self._raise_any(got)
            for some, values in zip(named[a : a + READ_COMMANDS], got):
                olds.update((f, v) for f, v in zip(some, values) if v is not None)
        return olds

    def stats(self) -> dict[str, int]:
        """`entries` and `memos` of the slices of the window, `inserted`, and `buckets`: the distinct record keys
        of each group, counted exactly in a slice hash of up to `STATS_FIELDS` fields, estimated from
        `STATS_FIELDS` of its groups in a bigger one."""
        with self._errors():
            seq, stored = self._client.hmget(self._meta, "seq", "hwm")
            top = _stored_time(cast("bytes | None", stored) or b"")
            slices = self._slices(top, top)
            bits = self._client.hmget(self._meta, [f"k:{s}" for s in slices]) if slices else []
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
            replies = self._execute(commands, pinned=False)
            self._raise_any(replies)
        entries = memos = buckets = 0
        rest = iter(replies)
        for n, taken in sampled:
            count, memo = next(rest)
            entries += int(count or 0)
            memos += int(memo or 0)
            got = next(rest)
            if isinstance(got, dict):
                values = [v for f, v in got.items() if f[:1] == b"g"]
            else:
                values = [v for v in got if v is not None]
            buckets += round(self._count_buckets(values) * n / taken) if taken else 0
        return {"entries": entries, "buckets": buckets, "memos": memos, "inserted": int(seq or 0)}

    def __repr__(self) -> str:
        return f"GroupIndex({self._where!r}, namespace={self.namespace!r}, window={self.window})"


class _GuardedPlan:
    """What the guarded chunks of a restore (`GroupIndex.restore`: a read, then a round, each `RESTORE_CHUNK`
    entries of a part) decide that stays in Redis, told from the entries alone for a rebuild that leaves the
    same (`GroupIndex._rebuild_groups`): which entries the insert takes and their seqs (`restore_accept`, chunk
    by chunk), the bits of each slice they make (from the count of the slice before as their read found it, and
    the rate of the part's entries there: `GroupIndex._transact`), and the slice each round that wrote unlinks
    (the one before the window)."""

    def __init__(self, index: GroupIndex, counts: dict[int, int]) -> None:
        self._index = index
        self.counts = counts  # slice -> entries stored there (the rebuild's)
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

    def part(self, times: np.ndarray) -> None:
        """A part begins (its event times): its chunks count from its first entry, its rate is its own."""
        self._times = times
        self._expected = cc.expected_counts(times.tolist(), self._index.slice_length)

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
