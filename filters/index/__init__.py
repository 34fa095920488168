"""The candidate index seam: the `CandidateIndex` protocol (the engine's one door, `decide`) and the types
every backend shares (`Entry`, `Query`, `Candidate`, `Batch`, `Verifier`).

An index maps bucket keys to the representatives (unique messages) indexed under them, within a
sliding window of event time. The engine hands it a prepared batch and its verifier (`decide`); the
index looks up candidates, has the verifier verify them, and inserts only messages found unique, so
buckets hold representatives, not every copy of a spam wave. It also remembers, by id, the verdict of
each message it found a duplicate (a memo), for the window: a message decided again (a replay after a
crash or an aborted transaction) gets the verdict it got the first time, whatever left the buckets since.
Each backend decides a batch its own best way: the memory index in its (compiled) table, the Redis index
in a few pipelined round trips.

The backends live beside this protocol: `memory.py` (`MemoryIndex`, its `Table`), `redis.py`
(`RedisIndex`, with its stored forms in `redis_codec.py` and its scripts in `lua/`) and `shared.py`
(how a shared index decides a batch). They are chosen by URL (`filters.index.backends.open_index`), as
faust chooses stores: `memory://` (the embedded mode; a product feature, not a test double) and
`redis://` / `rediss://` (shared by many workers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: the compiled path never imports numpy
    import numpy as np

from filters.config import FilterConfig
from filters.fingerprint import Fingerprint
from filters.records import Message, Verdict, maker


@dataclass(frozen=True, slots=True, eq=False)
class Entry:
    """An indexed representative: its id, event time and what verification needs of it."""

    id: str
    ts: float
    exact: int
    size: int
    sketch: np.ndarray
    simhash: int | None = None
    minhash: np.ndarray | None = None
    sentences: frozenset[int] = frozenset()
    chars: str = ""  # the normalized text of a short message (`FilterConfig.short_text`), for the edit check

    @staticmethod
    def of(id: str, ts: float, fp: Fingerprint) -> Entry:
        return new_entry(id, ts, fp.exact, fp.size, fp.sketch, fp.simhash, fp.minhash, fp.sentences, fp.chars)


@dataclass(frozen=True, slots=True)
class Candidate:
    entry: Entry
    shared: int  # how many of the message's bucket keys hold this entry
    first_key: int  # the first of the message's keys (in method order) that found it


@dataclass(frozen=True, slots=True)
class Query:
    id: str
    ts: float
    keys: tuple[int, ...]
    min_shared: int = 1  # candidates sharing fewer keys need not be returned


# A duplicate's verdict to remember (a memo), with the event time of its message: the memo lives as long
# as that event time is inside the window.
Memo = tuple[Verdict, float]


@dataclass(frozen=True, slots=True, eq=False)
class Stored:
    """Entries in their stored form, column by column: what an index changelog carries and
    `CandidateIndex.restore` writes back. Entry i is `ids[i]`, at event time `times[i]`, its bucket keys
    `keys[bounds[i]:bounds[i + 1]]` and `blobs[i]` its encoding (`filters.index.redis_codec.encode_entry`,
    the very bytes the Redis index stores: a restore passes them through)."""

    ids: list[str]
    times: np.ndarray  # float64
    bounds: np.ndarray  # int64, one more than entries
    keys: np.ndarray  # uint64
    blobs: list[bytes]

    def __len__(self) -> int:
        return len(self.ids)

    def keys_of(self, i: int) -> tuple[int, ...]:
        return tuple(self.keys[self.bounds[i] : self.bounds[i + 1]].tolist())


# Made once or more per message: from all field values in order, without the dataclass __init__'s cost.
new_entry = maker(Entry)
new_candidate = maker(Candidate)
new_query = maker(Query)


# What `NearDupFilter.prepare` gives `decide`: the batch's fingerprints, or the compiled core's hashed
# batch (`filters._native.Shingled`) when the index decides whole batches in its compiled table.
Prepared = Sequence[Fingerprint] | Any


@dataclass(frozen=True, slots=True)
class Batch:
    """A batch to decide, as the engine hands it to the index (`CandidateIndex.decide`).

    `meanwhile` is work that needs no index (the next batch's `prepare`), in shares: each call does one
    and says whether that was the last; it must not raise. A shared index runs a share while it waits for
    each of the batch's round trips, so that the client's CPU and the server's overlap; every backend runs
    what is left before `decide` returns (`finish`). `upcoming`, the next batch to be decided (its messages
    and prepared fingerprints, the very objects that will be passed then): a shared index may read its
    buckets while this batch is verified and inserted. `observe(op, seconds)`, if given, is told the time
    of each lookup and insert round (a wrapper's timing: `stream.metrics.TimedIndex`)."""

    messages: Sequence[Message]
    prepared: Prepared
    meanwhile: Callable[[], bool] | None = None
    upcoming: tuple[Sequence[Message], Prepared] | None = None
    observe: Callable[[str, float], None] | None = None


class Verifier(Protocol):
    """What an index needs of the engine to decide a batch: the configuration, the key floor and the
    verification of a message against ranked candidates (`NearDupFilter`)."""

    config: FilterConfig
    # The fingerprints are the compiled core's and the configuration is one the compiled loops decide
    # (sketch verification, exact/mgram keys): `Table.decide` / `Table.decide_shared` may be used.
    compiled: bool
    native: bool  # the compiled core is in use (a batch-local table is the compiled one)

    def floor(self, n_keys: int) -> int:
        """The fewest of a message's `n_keys` bucket keys a candidate must share (`min_shared`)."""
        ...

    def first_match(self, msg: Message, fp: Fingerprint, candidates: Sequence[Candidate]) -> Verdict:
        """The verdict of `msg` against ranked candidates: a duplicate of the first that verifies."""
        ...


def finish(meanwhile: Callable[[], bool] | None) -> None:
    """Runs what is left of a batch's `meanwhile` work (every backend does before `decide` returns)."""
    while meanwhile is not None and meanwhile() is False:
        pass


@runtime_checkable
class CandidateIndex(Protocol):
    """What the engine needs of an index: `decide` is its only door; the rest serves tests, operations
    and wrappers. All calls for one batch come from one thread."""

    @property
    def compiled_table(self) -> bool:
        """Whether `decide` takes the compiled core's hashed batch (`Fingerprinter.shingle`) when the
        verifier is `compiled`, rather than a list of `Fingerprint`s."""
        ...

    @property
    def in_process(self) -> bool:
        """Whether the index lives in this process: no round trips to time, `stats` cheap (operations)."""
        ...

    def decide(self, batch: Batch, verifier: Verifier) -> list[Verdict]:
        """The verdicts of the batch's messages, in order, as if decided one at a time: look up, verify
        (by `verifier`), insert the unique ones, remember the duplicates' verdicts. A message whose id is
        stored (a replay) is unique (method "replay"); one whose id has a memo gets that verdict again.
        Every write (entries and memos) is done before it returns. Runs all of `batch.meanwhile` before it
        returns."""
        ...

    def lookup(self, queries: Sequence[Query], limit: int) -> list[tuple[Entry | Verdict | None, list[Candidate]]]:
        """For each query: the entry already stored under its id (a replay), else the verdict remembered
        for its id (a duplicate's memo) if its event time is inside the window, else None; and up to
        `limit` candidates that share a key with it and are inside the window of its event time, ranked
        by shared keys, then by recency (the most recently inserted first). An entry never is its own
        candidate."""
        ...

    def insert(self, entries: Sequence[tuple[Entry, tuple[int, ...]]],
               memos: Sequence[Memo] = ()) -> list[list[Candidate] | None]:
        """Insert representatives under their keys, and remember the duplicates' verdicts `memos` (in the
        same round trip). For each entry: None when inserted, or the candidates that entered its buckets
        since its lookup (another worker won the race): then nothing was inserted, and the engine
        verifies those and either calls it a duplicate or inserts again. A memo whose event time is
        already outside the window is not kept; a later one of the same id replaces it."""
        ...

    def restore(self, parts: Iterable[Stored], *, rebuild: bytes = b"") -> int:
        """Write representatives that were decided unique before (an index changelog's entries, chunk after
        chunk, in order) under their keys, with no verification: a lost index is rebuilt so. An id that is
        live already (stored, or earlier in `parts`) is kept as it is, and an entry outside the window is
        skipped; returns how many were written. Safe beside other writers (they may insert meanwhile).

        `rebuild` (the stamp of a rebuild, not empty): the caller holds the group's restore lock
        (`stream.changelog.IndexGuard`) and writes the whole window of a fenced index found without its marker,
        so nobody else writes it meanwhile: a layout may then write without guards, and discard what a loss or a
        rebuild that died left; a meta hash it discards it stamps again (field `STAMP`, which the guard wrote
        before and requires when it sets the marker: a meta hash without it lost its data since). Empty (a
        worker writing back what it delivered): the write only adds, guarded, whatever the marker says."""
        ...

    def expire(self, now: float) -> int:
        """Forget entries older than `now - window`; returns how many went."""
        ...

    def stats(self) -> dict[str, int]:
        ...

    def close(self) -> None:
        ...


class IndexWrapper:
    """A `CandidateIndex` around another that forwards every call to it: a wrapper (timing, the changelog's
    journal) overrides only what it adds to, so it cannot lose a feature of the index it wraps."""

    def __init__(self, inner: CandidateIndex) -> None:
        self.inner = inner

    @property
    def compiled_table(self) -> bool:
        return self.inner.compiled_table

    @property
    def in_process(self) -> bool:
        return self.inner.in_process

    def decide(self, batch: Batch, verifier: Verifier) -> list[Verdict]:
        return self.inner.decide(batch, verifier)

    def lookup(self, queries: Sequence[Query], limit: int) -> list[tuple[Entry | Verdict | None, list[Candidate]]]:
        return self.inner.lookup(queries, limit)

    def insert(self, entries: Sequence[tuple[Entry, tuple[int, ...]]],
               memos: Sequence[Memo] = ()) -> list[list[Candidate] | None]:
        return self.inner.insert(entries, memos)

    def restore(self, parts: Iterable[Stored], *, rebuild: bytes = b"") -> int:
        return self.inner.restore(parts, rebuild=rebuild)

    def expire(self, now: float) -> int:
        return self.inner.expire(now)

    def stats(self) -> dict[str, int]:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:  # backend extras (namespace, prefix, ...) stay reachable
        return getattr(self.inner, name)
