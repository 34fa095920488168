"""Deciding a batch on a shared index: one lookup round, the batch checked against itself, insert rounds that resolve races.

A shared index (Redis) is written by many workers. The whole batch is looked up before its inserts, so a
message still sees a representative that an earlier message of the same batch pushed out of a full bucket
(the newest `bucket_cap` stay). Measured: 1 of 16,946 short messages of the development stream
(`bench/redis_bench.py --sets short`), where the shared index finds a true copy that the memory index lost.
A batch of more messages than the index's round (`SharedDecider.most`: `?round=`) is decided in parts of
that many, one after the other, each as a batch of its own: Redis spends less a message on small rounds
(docs/benchmarks.md, "Rounds of 128 messages"). A part's first insert round may go without waiting for its
answer (`Rounds.insert_ahead`): the next part is looked up and checked while Redis writes it, and the answer
is read before that part inserts; if Redis refused it, the part is inserted again and the next one looked up
again. The verdicts are those of the parts decided one after the other.

The duplicates' verdicts (memos) go with the batch's first insert round, or in a round of their own when
the batch inserts nothing; a verdict changed after a lost race is written again. So every memo is stored
before `decide` returns, thus before the batch's outputs can be committed: a replay of the batch (after a
crash or an aborted transaction) finds them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from filters.fingerprint import METHOD_NAMES, Fingerprint
from filters.index import Batch, Candidate, Entry, Memo, Prepared, Query, Verifier, new_entry, new_query
from filters.index.memory import MemoryIndex
from filters.records import Message, Verdict, new_verdict

_MAX_INSERT_ROUNDS = 8

T = TypeVar("T")

Looked = Sequence[tuple[Entry | Verdict | None, list[Candidate]]]


class Rounds(Protocol):
    """The round trips of a shared index that `SharedDecider` drives."""

    def lookup(self, queries: Sequence[Query], limit: int) -> list[tuple[Entry | Verdict | None, list[Candidate]]]: ...

    def insert(self, entries: Sequence[tuple[Entry, tuple[int, ...]]],
               memos: Sequence[Memo] = ()) -> list[list[Candidate] | None]: ...

    def prefetch(self, queries: Sequence[Query]) -> None:
        """Sends the read of the next lookup (of these queries) ahead; it is used if that lookup comes."""
        ...

    def insert_ahead(self, entries: Sequence[tuple[Entry, tuple[int, ...]]], memos: Sequence[Memo] = ()) -> bool:
        """Sends an insert round whose answer its results do not depend on (nobody else wrote since the lookup:
        every entry goes in as the lookup saw), without waiting for that answer; True if sent, False if the
        round needs its answer (then `insert` it). What is sent is taken as written by the next lookup, and
        `settle` reads the answer."""
        ...

    def settle(self) -> tuple[bool, bool]:
        """Reads the answer of the round `insert_ahead` sent, if any: (written, the lookups since stand). Not
        written: Redis refused it (somebody else wrote first), nothing of it is, and its entries are to be
        inserted again with `insert`. The lookups made since it was sent do not stand when it was refused or
        somebody wrote right after it: they are to be made again."""
        ...


class AnsweredRounds:
    """`Rounds.insert_ahead` and `Rounds.settle` of rounds that wait for every insert's answer: none goes ahead
    (a layout, or a wrapper, whose insert round decides by its answer)."""

    def insert_ahead(self, entries: Sequence[tuple[Entry, tuple[int, ...]]], memos: Sequence[Memo] = ()) -> bool:
        return False

    def settle(self) -> tuple[bool, bool]:
        return True, True


def _timed(observe: Callable[[str, float], None] | None, op: str, call: Callable[[], T]) -> T:
    if observe is None:
        return call()
    t0 = time.perf_counter()
    try:
        return call()
    finally:
        observe(op, time.perf_counter() - t0)


class SharedDecider:
    """A shared index's `decide`, with the queries of the next batch whose read went ahead."""

    def __init__(self, most: int | None = None) -> None:
        # The next batch's queries, whose read was sent ahead (`Batch.upcoming`), with the very message and
        # fingerprint lists they were made from.
        self._upcoming: tuple[Sequence[Message], Sequence[Fingerprint], list[Query]] | None = None
        self.most = most  # messages a round takes at most (None: a batch is one round)
        # The parts of the batch to come (`Batch.upcoming`), as cut when its first part's read went ahead, by
        # the lists they were cut from: the same part objects are then decided, so that read is taken.
        self._following: tuple[Sequence[Message], Prepared, list[tuple[Sequence[Message], Prepared]]] | None = None

    def decide(self, rounds: Rounds, batch: Batch, verifier: Verifier) -> list[Verdict]:
        """`batch`'s verdicts, in parts of at most `most` messages decided in turn (each as a batch of its
        own: looked up, checked against itself, inserted), the next part's read sent ahead meanwhile: the
        verdicts of deciding the parts as batches one after the other."""
        parts = self._parts(batch.messages, batch.prepared)
        self._following = None
        following = None
        if batch.upcoming is not None:
            following = self._parts(*batch.upcoming)
            self._following = (*batch.upcoming, following)
        # Each part's successor, whose read goes ahead: the next part, after the last the next batch's first.
        successors = [*parts[1:], following[0] if following is not None else None]
        out: list[Verdict] = []
        # A part whose insert round went without waiting for its answer (`Rounds.insert_ahead`): Redis writes
        # it while the next part is looked up and checked here; its answer is read before that part inserts.
        held: _Held | None = None
        for (messages, prepared), upcoming in zip(parts, successors, strict=True):
            part = Batch(messages, prepared, batch.meanwhile, upcoming, batch.observe)
            looked = self._look(rounds, part, verifier)
            if held is not None:
                verdicts, stood = self._settle(rounds, held, verifier)
                out += verdicts
                held = None
                if not stood:
                    looked = self._look(rounds, part, verifier)  # it went by what was not written
            verdicts, pending, remembered = looked
            if pending:
                first = self._first_round(part, verdicts, pending, remembered)
                if _timed(part.observe, "insert", lambda: rounds.insert_ahead(*first)):  # noqa: B023
                    held = _Held(part, verdicts, pending, remembered)
                    continue
            out += self._insert(rounds, part, verifier, verdicts, pending, remembered)
        if held is not None:
            out += self._settle(rounds, held, verifier)[0]
        return out

    def _parts(self, messages: Sequence[Message], prepared: Prepared) -> list[tuple[Sequence[Message], Prepared]]:
        """`messages` and `prepared` cut in parts of at most `most` (the very parts cut when their read went
        ahead, if it did)."""
        most = self.most
        if most is None or len(messages) <= most or not isinstance(prepared, list | tuple):
            return [(messages, prepared)]
        cut = self._following
        if cut is not None and cut[0] is messages and cut[1] is prepared:
            return cut[2]
        return [(messages[i:i + most], prepared[i:i + most]) for i in range(0, len(messages), most)]

    def _look(self, rounds: Rounds, batch: Batch, verifier: Verifier) -> tuple[list[Verdict], dict[int, Entry], list[int]]:
        """A part looked up (the next part's read sent ahead meanwhile) and checked against what was found and
        itself (`against`): its verdicts, the entries of its unique messages by place, its duplicates' places."""
        messages, fps = batch.messages, batch.prepared
        limit = verifier.config.max_candidates
        sent, self._upcoming = self._upcoming, None
        if sent is not None and sent[0] is messages and sent[1] is fps:
            queries = sent[2]
        else:
            queries = _queries(verifier, messages, fps)
        looked = _timed(batch.observe, "lookup", lambda: rounds.lookup(queries, limit))
        upcoming = batch.upcoming
        if upcoming is not None and upcoming[0] and isinstance(upcoming[1], list | tuple):
            following = _queries(verifier, *upcoming)
            self._upcoming = (upcoming[0], upcoming[1], following)
            rounds.prefetch(following)
        return against(verifier, messages, fps, looked)

    @staticmethod
    def _first_round(batch: Batch, verdicts: list[Verdict], pending: dict[int, Entry],
                     remembered: list[int]) -> tuple[list[tuple[Entry, tuple[int, ...]]], list[Memo]]:
        """A part's first insert round: its entries with their keys, and its duplicates' memos."""
        messages, fps = batch.messages, batch.prepared
        return ([(entry, fps[i].keys) for i, entry in pending.items()],
                [(verdicts[i], messages[i].ts) for i in remembered])

    def _settle(self, rounds: Rounds, held: _Held, verifier: Verifier) -> tuple[list[Verdict], bool]:
        """The verdicts of the part whose first insert round went ahead, once its answer is read (inserted
        again if Redis refused it), and whether the lookups made since stand (`Rounds.settle`)."""
        written, stood = _timed(held.batch.observe, "insert", rounds.settle)
        if written:
            return held.verdicts, stood
        return self._insert(rounds, held.batch, verifier, held.verdicts, held.pending, held.remembered), stood

    def _insert(self, rounds: Rounds, batch: Batch, verifier: Verifier, verdicts: list[Verdict],
                pending: dict[int, Entry], remembered: list[int]) -> list[Verdict]:
        """A part's insert rounds: its unique messages' entries and its duplicates' memos written; a message
        that lost a race (another worker inserted into its buckets since the lookup) verified again against
        what won, and inserted again if still unique. Its verdicts."""
        messages, fps = batch.messages, batch.prepared
        unsent = remembered  # places of duplicates whose memo is not written yet
        written: dict[int, Verdict] = {}  # place -> the memo written
        for _ in range(_MAX_INSERT_ROUNDS):
            if not pending:
                break
            order = list(pending)
            entries = [(pending[i], fps[i].keys) for i in order]
            # A memo naming an entry of this round waits for that entry's answer (it goes with the next round):
            # beside a checking script a memo is written whatever the script answers, and one left naming an
            # entry that lost its race (the batch failed before the memo was written again) would, on the
            # batch's retry, make its duplicate name a message that was never indexed.
            held: list[int] = []
            if unsent:
                ids = {pending[i].id for i in order}
                held = [i for i in unsent if verdicts[i].duplicate_of in ids]
                if held:
                    unsent = [i for i in unsent if verdicts[i].duplicate_of not in ids]
            memos = [(verdicts[i], messages[i].ts) for i in unsent]
            results = _timed(batch.observe, "insert", lambda: rounds.insert(entries, memos))  # noqa: B023
            written.update((i, verdicts[i]) for i in unsent)
            unsent = held
            retry: dict[int, Entry] = {}
            lost = False
            for i, conflicts in zip(order, results):
                if conflicts is None:
                    continue
                verdict = verifier.first_match(messages[i], fps[i], conflicts)
                verdicts[i] = verdict
                if verdict.duplicate:
                    lost = True
                    unsent.append(i)
                else:
                    retry[i] = pending[i]
            pending = retry
            if lost:  # its duplicates name what it matched now, before any memo of theirs goes (again)
                _point_at_representatives(messages, verdicts)
                again = set(unsent)
                unsent += [i for i, memo in written.items() if verdicts[i] is not memo and i not in again]
        # A bucket this contended is a spam wave; the message stays unique but is not indexed.
        if unsent:
            memos = [(verdicts[i], messages[i].ts) for i in unsent]
            _timed(batch.observe, "insert", lambda: rounds.insert([], memos))
        return verdicts


@dataclass(frozen=True, slots=True)
class _Held:
    """A part whose first insert round went ahead (`Rounds.insert_ahead`): what deciding it left to do if
    Redis refuses that round."""

    batch: Batch
    verdicts: list[Verdict]
    pending: dict[int, Entry]
    remembered: list[int]


def _point_at_representatives(messages: Sequence[Message], verdicts: list[Verdict]) -> None:
    """A duplicate names a message that went to unique: one that matched an earlier message of its batch
    which then lost an insert race (and became a duplicate itself) names what that one matched."""
    place = {m.id: i for i, m in enumerate(messages)}
    for i, v in enumerate(verdicts):
        target = v.duplicate_of
        hops = 0
        while target in place and verdicts[place[target]].duplicate and hops < len(verdicts):
            target = verdicts[place[target]].duplicate_of
            hops += 1
        if target != v.duplicate_of:
            verdicts[i] = Verdict(v.id, True, target, v.similarity, v.method)


def _queries(verifier: Verifier, messages: Sequence[Message], fps: Sequence[Fingerprint]) -> list[Query]:
    """A batch's queries: no Python call a message (a batch's messages have a few numbers of keys: the
    verifier's floor is asked once for each)."""
    floors: dict[int, int] = {}
    out = []
    for m, fp in zip(messages, fps):
        keys = fp.keys
        n = len(keys)
        floor = floors.get(n)
        if floor is None:
            floor = floors[n] = verifier.floor(n)
        out.append(new_query(m.id, m.ts, keys, floor))
    return out


def against(verifier: Verifier, messages: Sequence[Message], fps: Sequence[Fingerprint],
            looked: Looked) -> tuple[list[Verdict], dict[int, Entry], list[int]]:
    """The verdicts of a batch against what the shared index's lookup found (`looked`) and the batch's
    own earlier messages, in order; the entries of the unique ones (by place) to insert; and the places
    of the duplicates decided here, whose memos to write. A replay (the id stored, or earlier in the
    batch unique) is unique; an id with a memo (stored, or earlier in the batch a duplicate) gets that
    verdict again; else the first of the candidates, the batch's and the index's merged (most shared
    keys, then newest; the batch's first on ties), that verifies. Compiled (`Table.decide_shared`) when
    the verifier is `compiled`."""
    cfg = verifier.config
    batch_local = MemoryIndex(cfg.window, cfg.bucket_cap, native=verifier.native)
    pending: dict[int, Entry] = {}
    if verifier.compiled:
        verdicts, unique, remembered = batch_local.table.decide_shared(  # type: ignore[attr-defined]
            [m.id for m in messages], [m.ts for m in messages], list(fps), list(looked), cfg, METHOD_NAMES,
            new_verdict)
        for i in unique:  # `Entry.of`, inline: one call an entry fewer
            m, fp = messages[i], fps[i]
            pending[i] = new_entry(m.id, m.ts, fp.exact, fp.size, fp.sketch, fp.simhash, fp.minhash, fp.sentences, fp.chars)
        return verdicts, pending, remembered
    verdicts = []
    remembered = []
    for i, (msg, fp) in enumerate(zip(messages, fps)):
        own, remote = looked[i]
        local_own, local = batch_local.lookup_keys(msg.id, msg.ts, fp.keys, verifier.floor(len(fp.keys)),
                                                   cfg.max_candidates)
        if isinstance(own, Entry) or isinstance(local_own, Entry):
            verdicts.append(Verdict(msg.id, False, method="replay"))
            continue
        memo = own if own is not None else local_own
        if memo is not None:
            verdicts.append(memo)
            continue
        verdict = verifier.first_match(msg, fp, _merge(local, remote, cfg.max_candidates))
        verdicts.append(verdict)
        if verdict.duplicate:
            batch_local.table.remember(verdict, msg.ts)
            remembered.append(i)
        else:
            entry = Entry.of(msg.id, msg.ts, fp)
            pending[i] = entry
            batch_local.insert_one(entry, fp.keys)
    return verdicts, pending, remembered


def _merge(local: list[Candidate], remote: list[Candidate], limit: int) -> list[Candidate]:
    if not local:
        return remote
    if not remote:
        return local
    merged = sorted([*local, *remote], key=lambda c: (-c.shared, -c.entry.ts))
    return merged[:limit]
