"""The filter engine: fingerprint a batch, look up candidates, verify greedily, insert the unique ones.

`NearDupFilter.check_batch` is the pure "process a batch" function that the file runner and the Kafka
worker both wrap. Verification is greedy per message: candidates come ranked (most shared bucket keys
first, then newest), and the message is a duplicate of the first one whose verified similarity passes.
Messages of the same batch are checked against each other in order, so a batch decides what the same
messages would decide one at a time. On a shared index there is one exception: the whole batch is
looked up before its inserts, so a message still sees a representative that an earlier message of the
same batch pushed out of a full bucket (the newest `bucket_cap` stay). Measured: 1 of 16,946 short
messages of the development stream (`bench/redis_bench.py --sets short`), where the shared index finds
a true copy that the memory index lost.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from filters.config import FilterConfig
from filters.fingerprint import METHOD_NAMES, Fingerprint, Fingerprinter, hamming, key_method, minhash_jaccard
from filters.index import Candidate, CandidateIndex, Entry, MemoryIndex, Query, new_query, open_index
from filters.records import maker
from filters.sketch import Probe, size_ratio

_MAX_INSERT_ROUNDS = 8

# What `NearDupFilter.prepare` gives `decide`: the batch's fingerprints, or the compiled core's hashed
# batch (`filters._native.Shingled`) on the whole-batch path.
Prepared = Sequence[Fingerprint] | Any


@dataclass(frozen=True, slots=True)
class Message:
    id: str
    text: str
    ts: float


@dataclass(frozen=True, slots=True)
class Verdict:
    """The routing decision for one message."""

    id: str
    duplicate: bool
    duplicate_of: str | None = None
    similarity: float = 0.0
    method: str | None = None

    @property
    def label(self) -> str:
        return "duplicate" if self.duplicate else "unique"


# The compiled loops make a verdict per message: from all its field values, without the __init__'s cost.
_new_verdict = maker(Verdict)


@dataclass(frozen=True, slots=True)
class Match:
    ok: bool
    similarity: float
    method: str


class NearDupFilter:
    """Near-duplicate filter over a sliding window of event time.

    >>> f = NearDupFilter()
    >>> f.check("WIN a FREE iPhone now!!! call 555-0100", id="a", ts=0).duplicate
    False
    >>> f.check("w i n a free iphone NOW, call 555-0199", id="b", ts=1).duplicate_of
    'a'
    """

    def __init__(
        self,
        config: FilterConfig | None = None,
        index: CandidateIndex | str = "memory://",
        clock: Callable[[], float] = time.time,
        native: bool | None = None,
    ) -> None:
        """`native`: use the compiled core (`filters._native`) if it was built (None), require it (True),
        or run the numpy/Python reference (False). The verdicts are the same."""
        self.config = config or FilterConfig()
        self.fingerprinter = Fingerprinter(self.config, native)
        if isinstance(index, str):
            index = open_index(
                index, window=self.config.window, bucket_cap=self.config.bucket_cap,
                namespace=self.config.digest(), native=native,
            )
        self.index = index
        self.clock = clock
        self._auto_id = 0
        self._floors: dict[int, int] = {}
        # The next batch's queries, whose read a shared index sent ahead (`decide`'s `upcoming`), with the
        # very message and fingerprint lists they were made from.
        self._upcoming: tuple[Sequence[Message], Sequence[Fingerprint], list[Query]] | None = None
        cfg = self.config
        # The whole batch in the compiled table (`Table.decide`): what `_decide_local` does, message by
        # message, for an embedded compiled index, sketch verification and exact/mgram bucket keys.
        compiled = self.fingerprinter.native and cfg.verify == "sketch" and set(cfg.methods) <= {"exact", "mgram"}
        self._batch_in_table = compiled and isinstance(index, MemoryIndex) and index.native
        # A shared index: `_decide_shared`'s loop in a compiled batch-local table (`Table.decide_shared`).
        self._shared_in_table = compiled and not isinstance(index, MemoryIndex)
        # `prepare` of a batch in parts gives, joined, what it gives at once: a list of `Fingerprint`s.
        self.prepares_in_parts = not self._batch_in_table

    # -- public API --------------------------------------------------------------------------
    def check(self, text: str, id: str | None = None, ts: float | None = None) -> Verdict:
        return self.check_batch([self.message(text, id, ts)])[0]

    def message(self, text: str, id: str | None = None, ts: float | None = None) -> Message:
        if id is None:
            self._auto_id += 1
            id = f"auto-{self._auto_id}"
        return Message(id, text, self.clock() if ts is None else float(ts))

    def check_batch(self, messages: Sequence[Message]) -> list[Verdict]:
        if not messages:
            return []
        return self.decide(messages, self.prepare([m.text for m in messages]))

    def prepare(self, texts: Sequence[str]) -> Prepared:
        """The first step of `check_batch`, which needs no index: what `decide` needs of the texts (their
        `Fingerprint`s, or on the compiled whole-batch path the hashed batch alone)."""
        if self._batch_in_table:
            return self.fingerprinter.shingle(texts)
        return self.fingerprinter.fingerprint_batch(texts)

    def decide(self, messages: Sequence[Message], prepared: Prepared,
               meanwhile: Callable[[], bool] | None = None,
               upcoming: tuple[Sequence[Message], Prepared] | None = None) -> list[Verdict]:
        """The second step: look up, verify and insert, in order (`prepared` from `prepare`, or a list of
        `Fingerprint`s). `meanwhile` is work that needs no index (the next batch's `prepare`), in shares:
        each call does one and says whether that was the last; it must not raise. A shared index runs a
        share while it waits for each of this batch's round trips, so that the client's CPU and the
        server's overlap; what is left runs after the batch. `upcoming`, the next batch to be decided
        (its messages and prepared fingerprints, the very objects that will be passed then): a shared
        index reads its buckets while this batch is verified and inserted (`RedisIndex.prefetch`)."""
        if meanwhile is not None and hasattr(self.index, "meanwhile"):
            self.index.meanwhile = meanwhile
            try:
                verdicts = self._decide(messages, prepared, upcoming)
            finally:
                left, self.index.meanwhile = self.index.meanwhile, None
        else:
            verdicts = self._decide(messages, prepared, upcoming)
            left = meanwhile
        while left is not None and left() is False:
            pass
        return verdicts

    def _decide(self, messages: Sequence[Message], prepared: Prepared,
                upcoming: tuple[Sequence[Message], Prepared] | None = None) -> list[Verdict]:
        if not isinstance(prepared, list | tuple):
            cfg = self.config
            return self.index.table.decide(  # type: ignore[attr-defined, no-any-return]
                [m.id for m in messages], [m.ts for m in messages], prepared, cfg.min_shared,
                cfg.max_candidates, cfg.threshold, cfg.containment, cfg.containment_min_ratio,
                cfg.containment_min_size, METHOD_NAMES, _new_verdict)
        if isinstance(self.index, MemoryIndex):
            return [self._decide_local(m, fp) for m, fp in zip(messages, prepared)]
        return self._decide_shared(messages, prepared, upcoming)

    def _floor(self, n_keys: int) -> int:
        """The fewest of a message's `n_keys` bucket keys a candidate must share (`min_shared`)."""
        floor = self._floors.get(n_keys)
        if floor is None:
            floor = self._floors[n_keys] = max(1, math.ceil(self.config.min_shared * n_keys))
        return floor

    def _query(self, msg: Message, fp: Fingerprint) -> Query:
        return new_query(msg.id, msg.ts, fp.keys, self._floor(len(fp.keys)))

    def _decide_local(self, msg: Message, fp: Fingerprint) -> Verdict:
        """Embedded index: nothing else writes to it, so look up, verify and insert one by one."""
        index = self.index
        assert isinstance(index, MemoryIndex)
        keys = fp.keys
        own, candidates = index.lookup_keys(msg.id, msg.ts, keys, self._floor(len(keys)),
                                            self.config.max_candidates)
        if own is not None:
            return Verdict(msg.id, False, method="replay")
        if candidates:
            verdict = self._first_match(msg, fp, candidates)
            if verdict.duplicate:
                return verdict
        else:
            verdict = Verdict(msg.id, False)
        index.insert_one(Entry.of(msg.id, msg.ts, fp), keys)
        return verdict

    def _decide_shared(self, messages: Sequence[Message], fps: Sequence[Fingerprint],
                       upcoming: tuple[Sequence[Message], Prepared] | None = None) -> list[Verdict]:
        """Shared index: one lookup and one insert round for the whole batch; messages of the batch
        are checked against each other through a batch-local index, and insert conflicts (another
        worker indexed a near-duplicate meanwhile) are verified before anything is called unique."""
        sent, self._upcoming = self._upcoming, None
        if sent is not None and sent[0] is messages and sent[1] is fps:
            queries = sent[2]
        else:
            queries = [self._query(m, fp) for m, fp in zip(messages, fps)]
        looked = self.index.lookup(queries, self.config.max_candidates)
        if upcoming is not None and upcoming[0] and isinstance(upcoming[1], list | tuple) \
                and hasattr(self.index, "prefetch"):
            following = [self._query(m, fp) for m, fp in zip(*upcoming)]
            self._upcoming = (upcoming[0], upcoming[1], following)
            self.index.prefetch(following)
        verdicts, pending = self._against(messages, fps, looked)
        if self._insert(pending, messages, fps, verdicts):
            _point_at_representatives(messages, verdicts)
        return verdicts

    def _against(self, messages: Sequence[Message], fps: Sequence[Fingerprint],
                 looked: Sequence[tuple[Entry | None, list[Candidate]]]) -> tuple[list[Verdict], dict[int, Entry]]:
        """The verdicts of a batch against what the shared index's lookup found (`looked`) and the batch's
        own earlier messages, in order, and the entries of the unique ones (by place) to insert. A replay
        (the id stored, or earlier in the batch) is unique; else the first of the candidates, the batch's
        and the index's merged (most shared keys, then newest; the batch's first on ties), that
        verifies. Compiled (`Table.decide_shared`) when the fingerprints are the compiled core's."""
        cfg = self.config
        batch_local = MemoryIndex(cfg.window, cfg.bucket_cap, native=self.fingerprinter.native)
        pending: dict[int, Entry] = {}
        if self._shared_in_table:
            verdicts, unique = batch_local.table.decide_shared(
                [m.id for m in messages], [m.ts for m in messages], list(fps), list(looked), cfg.min_shared,
                cfg.max_candidates, cfg.threshold, cfg.containment, cfg.containment_min_ratio,
                cfg.containment_min_size, METHOD_NAMES, _new_verdict)
            for i in unique:
                pending[i] = Entry.of(messages[i].id, messages[i].ts, fps[i])
            return verdicts, pending
        verdicts = []
        for i, (msg, fp) in enumerate(zip(messages, fps)):
            own, remote = looked[i]
            local_own, local = batch_local.lookup_keys(msg.id, msg.ts, fp.keys, self._floor(len(fp.keys)),
                                                       cfg.max_candidates)
            if own is not None or local_own is not None:
                verdicts.append(Verdict(msg.id, False, method="replay"))
                continue
            verdict = self._first_match(msg, fp, _merge(local, remote, cfg.max_candidates))
            verdicts.append(verdict)
            if not verdict.duplicate:
                entry = Entry.of(msg.id, msg.ts, fp)
                pending[i] = entry
                batch_local.insert_one(entry, fp.keys)
        return verdicts, pending

    # -- verification ------------------------------------------------------------------------
    def _first_match(self, msg: Message, fp: Fingerprint, candidates: Sequence[Candidate]) -> Verdict:
        probe: Probe | None = None
        floor = self._floor(len(fp.keys))
        for cand in candidates:
            if cand.entry.exact == fp.exact:
                return Verdict(msg.id, True, cand.entry.id, 1.0, "exact")
            if cand.shared < floor:
                continue
            if probe is None:
                probe = Probe(fp.sketch, fp.size)
            m = self.verify(fp, cand, probe)
            if m.ok:
                return Verdict(msg.id, True, cand.entry.id, round(m.similarity, 4), m.method)
        return Verdict(msg.id, False)

    def verify(self, fp: Fingerprint, cand: Candidate, probe: Probe | None = None) -> Match:
        """Is the candidate a near-duplicate of the message? With verify="sketch", by the shingle-sketch
        overlap; with "native", by any configured method's own measure (in config order), so the verdict
        does not depend on which key happened to find the candidate."""
        entry = cand.entry
        if entry.exact == fp.exact:
            return Match(True, 1.0, "exact")
        method = key_method(cand.first_key)
        if self.config.verify == "sketch":
            return self._sketch_match(fp, entry, method, probe)
        best = Match(False, 0.0, method)
        sketched = False
        for name in self.config.methods:
            if name in ("mgram", "exact"):  # no measure of their own: the sketch verifies them, once
                if sketched:
                    continue
                sketched = True
                m = self._sketch_match(fp, entry, method, probe)
            else:
                m = self._native_match(name, fp, entry)
                if m is None:
                    continue
            if m.ok:
                return m
            if m.similarity > best.similarity:
                best = Match(False, m.similarity, method)
        return best

    def _native_match(self, method: str, fp: Fingerprint, entry: Entry) -> Match | None:
        cfg = self.config
        if method == "simhash" and fp.simhash is not None and entry.simhash is not None:
            d = hamming(fp.simhash, entry.simhash)
            return Match(d <= cfg.simhash_k, 1.0 - d / 64, method)
        if method == "minhash" and fp.minhash is not None and entry.minhash is not None:
            j = minhash_jaccard(fp.minhash, entry.minhash)
            return Match(j >= cfg.threshold, j, method)
        if method == "sentences" and fp.sentences and entry.sentences:
            shared = len(fp.sentences & entry.sentences)
            return Match(shared > 0, shared / min(len(fp.sentences), len(entry.sentences)), method)
        return None

    def _sketch_match(self, fp: Fingerprint, entry: Entry, method: str, probe: Probe | None) -> Match:
        cfg = self.config
        size_a, size_b = fp.size, entry.size
        jaccard, containment_a, containment_b = (probe or Probe(fp.sketch, size_a)).estimates(entry.sketch, size_b)
        if jaccard >= cfg.threshold:
            return Match(True, jaccard, method)
        containment = max(containment_a, containment_b)  # of the smaller text in the larger (Overlap's)
        if containment >= cfg.containment and size_ratio(size_a, size_b) >= cfg.containment_min_ratio \
                and min(size_a, size_b) >= cfg.containment_min_size:
            return Match(True, containment, method)
        return Match(False, max(jaccard, containment), method)

    # -- insertion with race resolution ------------------------------------------------------
    def _insert(
        self,
        pending: dict[int, Entry],
        messages: Sequence[Message],
        fps: Sequence[Fingerprint],
        verdicts: list[Verdict],
    ) -> bool:
        """Inserts the batch's unique messages; one whose buckets another worker wrote to meanwhile is
        verified against what arrived and may become a duplicate. Returns whether any did."""
        changed = False
        for _ in range(_MAX_INSERT_ROUNDS):
            if not pending:
                return changed
            order = list(pending)
            results = self.index.insert([(pending[i], fps[i].keys) for i in order])
            retry: dict[int, Entry] = {}
            for i, conflicts in zip(order, results):
                if conflicts is None:
                    continue
                verdict = self._first_match(messages[i], fps[i], conflicts)
                verdicts[i] = verdict
                changed = changed or verdict.duplicate
                if not verdict.duplicate:
                    retry[i] = pending[i]
            pending = retry
        # A bucket this contended is a spam wave; the message stays unique but is not indexed.
        return changed


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


def _merge(local: list[Candidate], remote: list[Candidate], limit: int) -> list[Candidate]:
    if not local:
        return remote
    if not remote:
        return local
    merged = sorted([*local, *remote], key=lambda c: (-c.shared, -c.entry.ts))
    return merged[:limit]
