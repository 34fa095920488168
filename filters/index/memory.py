"""The embedded candidate index: `MemoryIndex` over its `Table`, the compiled one (`filters/index/_table.pxi`)
or `PyTable`, the Python reference it is held to (tests/test_native.py).

One process, nothing else writes to it (`memory://`, the embedded mode: a product feature, not a test double).
"""

from __future__ import annotations

import bisect
import heapq
from collections import Counter
from collections.abc import Iterable, Sequence
from itertools import repeat
from operator import itemgetter
from typing import TYPE_CHECKING, Protocol

from filters.errors import ConfigError
from filters.fingerprint import METHOD_NAMES, Fingerprint
from filters.index import Batch, Candidate, Entry, Memo, Query, Stored, Verifier, finish
from filters.records import Message, Verdict, new_verdict

if TYPE_CHECKING:  # annotations only: the compiled path never imports numpy
    import numpy as np

try:  # the compiled core; absent when it could not be built at install time (no C++ compiler)
    import filters._native as _native
except ImportError:  # pragma: no cover - exercised on machines without a compiler
    _native = None


_BY_SHARED_THEN_NEWEST = itemgetter(1, 0)


class Table(Protocol):
    """The storage under `MemoryIndex`, by sequence number (the order of insertion). Two implementations
    behave identically: `PyTable` below (the reference) and `filters._native.Table` (compiled, used
    when it was built; tests/test_native.py holds them to the same answers)."""

    window: float
    bucket_cap: int
    evicted_by_cap: int

    def __len__(self) -> int: ...

    def lookup(self, id: str, ts: float, keys: tuple[int, ...], floor: int,
               limit: int) -> tuple[int, list[tuple[int, int, int]]]:
        """(seq of the live entry stored under `id`, or 0; [(seq, shared keys, first key)] as `MemoryIndex.lookup_keys`)."""
        ...

    def insert(self, entry: Entry, keys: tuple[int, ...]) -> bool: ...

    def remember(self, verdict: Verdict, ts: float) -> bool:
        """Remembers a duplicate's verdict by its id, at its message's event time `ts`, for as long as that
        is inside the window; False when it was not (outside the window, or an equal one is held)."""
        ...

    def recall(self, id: str) -> Verdict | None:
        """The verdict remembered for `id` (a duplicate), if it is still inside the window."""
        ...

    def get(self, seq: int) -> Entry: ...

    def seqs(self) -> list[int]: ...

    def expire(self, now: float) -> int: ...

    def stats(self) -> dict[str, int]: ...


class PyTable:
    """The memory index's storage in Python: dict of buckets, entries by seq, an expiry heap.

    Most buckets hold one representative (m-gram keys of unique texts rarely repeat), so a bucket is a
    bare sequence number until a second entry arrives, and a list sorted by (event time, seq) after.
    The bucket cap keeps the newest by event time (then insertion order), as a bucket sorted by event
    time does (Redis): a late copy of an old message does not push out recent ones.

    Memos: the verdicts of duplicates by id (a duplicate is not indexed), with an expiry heap of their own,
    so that a replay gets its first verdict whatever the buckets lost since.
    """

    def __init__(self, window: float, bucket_cap: int) -> None:
        self.window = window
        self.bucket_cap = bucket_cap
        self._buckets: dict[int, int | list[int]] = {}
        self._entries: dict[int, Entry] = {}
        self._keys: dict[int, tuple[int, ...]] = {}
        self._by_id: dict[str, int] = {}
        self._expiry: list[tuple[float, int]] = []
        self._seq = 0
        self._watermark = float("-inf")
        self._newest = float("-inf")  # latest event time inserted: an entry at or after it sorts last everywhere
        self.evicted_by_cap = 0
        self._memos: dict[str, Verdict] = {}
        self._memo_expiry: list[tuple[float, int, Verdict]] = []  # (event time, order remembered, memo)
        self._memo_seq = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, seq: int) -> Entry:
        return self._entries[seq]

    def seqs(self) -> list[int]:
        return list(self._entries)

    def lookup(self, id: str, ts: float, keys: tuple[int, ...], floor: int,
               limit: int) -> tuple[int, list[tuple[int, int, int]]]:
        if ts > self._watermark:
            self._advance(ts)
        own = self._by_id.get(id, 0)
        hits = list(filter(None, map(self._buckets.get, keys)))  # buckets are never empty (nor seq 0)
        if len(hits) < floor:
            return own, []  # nothing can share `floor` keys with it
        flat: list[int] = []
        for bucket in hits:
            if bucket.__class__ is int:
                flat.append(bucket)
            else:
                flat.extend(bucket)  # type: ignore[arg-type]
        counts = Counter(flat)
        if own:
            counts.pop(own, None)
        if floor <= 1:
            items = list(counts.items())
        elif len(counts) == len(flat):
            return own, []  # every entry was in one bucket only
        else:
            items = [i for i in counts.items() if i[1] >= floor]
        if not items:
            return own, []
        items.sort(key=_BY_SHARED_THEN_NEWEST, reverse=True)  # most shared keys first, then the newest
        oldest = ts - self.window
        entries = self._entries
        out = []
        for seq, shared in items:
            if entries[seq].ts < oldest:
                continue
            out.append((seq, shared, self._first_key(keys, seq)))
            if len(out) >= limit:
                break
        return own, out

    def _first_key(self, keys: tuple[int, ...], seq: int) -> int:
        """The first key whose bucket holds `seq` (not merely one of its keys: the cap may have evicted it)."""
        get = self._buckets.get
        for key in keys:
            bucket = get(key)
            if bucket == seq or (bucket.__class__ is list and seq in bucket):
                return key
        raise AssertionError(f"entry {seq} was counted but is in none of the query's buckets")

    def insert(self, entry: Entry, keys: tuple[int, ...]) -> bool:
        """Inserts `entry` under `keys` (a key given twice counts once); False when it was not."""
        if entry.id in self._by_id:
            return False
        if len(set(keys)) < len(keys):
            keys = tuple(dict.fromkeys(keys))
        ts = entry.ts
        if ts > self._watermark:
            self._advance(ts)
        if ts < self._watermark - self.window:
            return False  # already outside the window: it could never match anything
        self._seq += 1
        seq = self._seq
        self._entries[seq] = entry
        self._keys[seq] = keys
        self._by_id[entry.id] = seq
        heapq.heappush(self._expiry, (ts, seq))
        in_order = ts >= self._newest
        if in_order:
            self._newest = ts
        # One C-level pass claims every new key; only keys that already had a bucket need Python.
        buckets = self._buckets
        held = list(map(buckets.setdefault, keys, repeat(seq)))
        if held.count(seq) == len(keys):
            return True
        cap = self.bucket_cap
        for key, bucket in zip(keys, held):
            if bucket is seq:
                continue
            if bucket.__class__ is int:
                bucket = buckets[key] = [bucket]
            # Buckets stay sorted by (event time, seq), so bucket[0] is the oldest one the cap evicts.
            if in_order or self._entries[bucket[-1]].ts <= ts:  # type: ignore[index]
                bucket.append(seq)  # type: ignore[union-attr]
            else:
                bisect.insort(bucket, seq, key=self._age)  # type: ignore[arg-type]
            if len(bucket) > cap:  # type: ignore[arg-type]
                del bucket[0]  # type: ignore[union-attr]
                self.evicted_by_cap += 1
                if len(bucket) == 1:  # type: ignore[arg-type]
                    buckets[key] = bucket[0]  # type: ignore[index]
        return True

    def _age(self, seq: int) -> tuple[float, int]:
        return self._entries[seq].ts, seq

    def remember(self, verdict: Verdict, ts: float) -> bool:
        if ts > self._watermark:
            self._advance(ts)
        if ts < self._watermark - self.window or self._memos.get(verdict.id) == verdict:
            return False
        self._memos[verdict.id] = verdict
        self._memo_seq += 1
        heapq.heappush(self._memo_expiry, (ts, self._memo_seq, verdict))
        return True

    def recall(self, id: str) -> Verdict | None:
        return self._memos.get(id)

    def _advance(self, ts: float) -> None:
        if ts > self._watermark:
            self._watermark = ts
            horizon = ts - self.window
            if (self._expiry and self._expiry[0][0] < horizon) or (self._memo_expiry and self._memo_expiry[0][0] < horizon):
                self.expire(ts)

    def expire(self, now: float) -> int:
        horizon = now - self.window
        memos, due = self._memos, self._memo_expiry
        while due and due[0][0] < horizon:
            memo = heapq.heappop(due)[2]
            if memos.get(memo.id) is memo:  # else another replaced it
                del memos[memo.id]
        buckets = self._buckets
        gone = 0
        while self._expiry and self._expiry[0][0] < horizon:
            _, seq = heapq.heappop(self._expiry)
            entry = self._entries.pop(seq, None)
            if entry is None:
                continue
            keys = self._keys.pop(seq)
            gone += 1
            if self._by_id.get(entry.id) == seq:
                del self._by_id[entry.id]
            for key in keys:
                bucket = buckets.get(key)
                if bucket is None:
                    continue
                if bucket.__class__ is int:
                    if bucket == seq:
                        del buckets[key]
                    continue  # else it was evicted earlier by the bucket cap
                try:
                    bucket.remove(seq)  # type: ignore[union-attr]
                except ValueError:
                    continue  # evicted earlier by the bucket cap
                if len(bucket) == 1:  # type: ignore[arg-type]
                    buckets[key] = bucket[0]  # type: ignore[index]
        return gone

    def stats(self) -> dict[str, int]:
        sizes = [1 if b.__class__ is int else len(b) for b in self._buckets.values()]  # type: ignore[arg-type]
        return {
            "entries": len(self._entries),
            "buckets": len(self._buckets),
            "max_bucket": max(sizes, default=0),
            "evicted_by_cap": self.evicted_by_cap,
            "memos": len(self._memos),
        }


def _made_entry(id: str, ts: float, exact: int, size: int, sketch: np.ndarray, chars: str) -> Entry:
    """An `Entry` of what the compiled table stored for a message its `decide` indexed."""
    return Entry(id, ts, exact, size, sketch, chars=chars)


def native_available() -> bool:
    """Whether the compiled core (`filters._native`) was built at install time."""
    return _native is not None


def make_table(window: float, bucket_cap: int, native: bool | None = None) -> Table:
    """The compiled table when it was built (or `native=True`, which requires it), else `PyTable`."""
    if native is None:
        native = _native is not None
    if native:
        if _native is None:
            raise ConfigError("the compiled core filters._native was not built: reinstall with a C++ compiler")
        return _native.Table(float(window), int(bucket_cap), _made_entry)  # type: ignore[no-any-return]
    return PyTable(window, bucket_cap)


class MemoryIndex:
    """The embedded index: one process, nothing else writes to it. Memory is freed as the window slides.

    Its storage is a `Table`: the compiled one when it was built, else `PyTable`; both answer alike.
    """

    def __init__(self, window: float, bucket_cap: int, *, native: bool | None = None) -> None:
        self.window = window
        self.bucket_cap = bucket_cap
        self.table = make_table(window, bucket_cap, native)

    @property
    def native(self) -> bool:
        return not isinstance(self.table, PyTable)

    @property
    def evicted_by_cap(self) -> int:
        return self.table.evicted_by_cap

    def __len__(self) -> int:
        return len(self.table)

    @property
    def compiled_table(self) -> bool:
        return self.native

    in_process = True

    def decide(self, batch: Batch, verifier: Verifier) -> list[Verdict]:
        """Nothing else writes to this index: look up, verify and insert message by message, or the whole
        batch in the compiled table (`Table.decide`) when the engine prepared it so."""
        messages, prepared = batch.messages, batch.prepared
        if isinstance(prepared, list | tuple):
            verdicts = [self._decide_one(m, fp, verifier) for m, fp in zip(messages, prepared)]
        else:
            verdicts = self.table.decide(  # type: ignore[attr-defined]
                [m.id for m in messages], [m.ts for m in messages], prepared, verifier.config, METHOD_NAMES,
                new_verdict)
        finish(batch.meanwhile)
        return verdicts

    def _decide_one(self, msg: Message, fp: Fingerprint, verifier: Verifier) -> Verdict:
        keys = fp.keys
        own, candidates = self.lookup_keys(msg.id, msg.ts, keys, verifier.floor(len(keys)),
                                           verifier.config.max_candidates)
        if own is not None:
            return own if isinstance(own, Verdict) else Verdict(msg.id, False, method="replay")
        if candidates:
            verdict = verifier.first_match(msg, fp, candidates)
            if verdict.duplicate:
                self.table.remember(verdict, msg.ts)
                return verdict
        else:
            verdict = Verdict(msg.id, False)
        self.insert_one(Entry.of(msg.id, msg.ts, fp), keys)
        return verdict

    def lookup(self, queries: Sequence[Query], limit: int) -> list[tuple[Entry | Verdict | None, list[Candidate]]]:
        return [self.lookup_one(q, limit) for q in queries]

    def lookup_one(self, q: Query, limit: int) -> tuple[Entry | Verdict | None, list[Candidate]]:
        return self.lookup_keys(q.id, q.ts, q.keys, q.min_shared, limit)

    def lookup_keys(self, id: str, ts: float, keys: tuple[int, ...], floor: int,
                    limit: int) -> tuple[Entry | Verdict | None, list[Candidate]]:
        """`lookup_one` without the `Query` record: the engine's per-message path."""
        own, found = self.table.lookup(id, ts, keys, floor, limit)
        get = self.table.get
        return (get(own) if own else self.table.recall(id)), [Candidate(get(seq), shared, key) for seq, shared, key in found]

    def insert(self, entries: Sequence[tuple[Entry, tuple[int, ...]]],
               memos: Sequence[Memo] = ()) -> list[list[Candidate] | None]:
        for entry, keys in entries:
            self.insert_one(entry, keys)
        for verdict, ts in memos:
            self.table.remember(verdict, ts)
        return [None] * len(entries)

    def restore(self, parts: Iterable[Stored], *, rebuild: bytes = b"") -> int:
        from filters.index.redis_codec import stored_entries  # numpy: imported when restoring, not by every process

        insert = self.table.insert
        written = 0
        for e, keys in (pair for stored in parts for pair in stored_entries(stored)):
            # Decoded entries are read-only views of the stored bytes; the table keeps arrays of its own.
            e = Entry(e.id, e.ts, e.exact, e.size, e.sketch.copy(), e.simhash,
                      None if e.minhash is None else e.minhash.copy(), e.sentences)
            written += insert(e, keys)
        return written

    def insert_one(self, entry: Entry, keys: tuple[int, ...]) -> None:
        """`insert` of one entry (never a conflict here). A key given twice counts once."""
        self.table.insert(entry, keys)

    def expire(self, now: float) -> int:
        return self.table.expire(now)

    def stats(self) -> dict[str, int]:
        return self.table.stats()

    def entries(self) -> Iterable[Entry]:
        get = self.table.get
        return (get(seq) for seq in self.table.seqs())

    def close(self) -> None:
        pass

