"""The filter engine: fingerprint a batch, look up candidates, verify greedily, insert the unique ones.

`NearDupFilter.check_batch` is the pure "process a batch" function that the file runner and the Kafka
worker both wrap. Verification is greedy per message: candidates come ranked (most shared bucket keys
first, then newest), and the message is a duplicate of the first one whose verified similarity passes.
Messages of the same batch are checked against each other in order, so a batch decides what the same
messages would decide one at a time. On a shared index there is one exception: the whole batch is
looked up before its inserts, so a message still sees a representative that an earlier message of the
same batch pushed out of a full bucket (the newest `bucket_cap` stay): see `filters.index.shared`.

The engine prepares a batch and hands it, with itself as the verifier, to the index (`CandidateIndex.decide`):
the index is its only door, and each backend decides a batch its own best way.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from filters.config import FilterConfig
from filters.edits import edit_match
from filters.fingerprint import Fingerprint, Fingerprinter, hamming, key_method, minhash_jaccard
from filters.index import Batch, Candidate, CandidateIndex, Entry, Prepared
from filters.index.backends import open_index
from filters.records import Message, Verdict
from filters.sketch import Probe, size_ratio

__all__ = ["Match", "Message", "NearDupFilter", "Prepared", "Verdict"]


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
        cfg = self.config
        self.native = self.fingerprinter.native
        # The compiled loops decide the batch (`Table.decide` in an embedded compiled table, `Table.decide_shared`
        # in a shared index's batch-local one): sketch verification and exact/mgram bucket keys only.
        self.compiled = self.native and cfg.verify == "sketch" and set(cfg.methods) <= {"exact", "mgram"}
        self._batch_in_table = self.compiled and index.compiled_table
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
        `Fingerprint`s, or, for an index that decides in its compiled table, the hashed batch alone)."""
        if self._batch_in_table:
            return self.fingerprinter.shingle(texts)
        return self.fingerprinter.fingerprint_batch(texts)

    def decide(self, messages: Sequence[Message], prepared: Prepared,
               meanwhile: Callable[[], bool] | None = None,
               upcoming: tuple[Sequence[Message], Prepared] | None = None) -> list[Verdict]:
        """The second step: look up, verify and insert, in order (`prepared` from `prepare`, or a list of
        `Fingerprint`s), by the index (`CandidateIndex.decide`). `meanwhile`: work that needs no index (the
        next batch's `prepare`), in shares, run while a shared index waits for its round trips, the rest
        after; `upcoming`: the next batch, whose buckets a shared index may read ahead (see `Batch`)."""
        return self.index.decide(Batch(messages, prepared, meanwhile, upcoming), self)

    def floor(self, n_keys: int) -> int:
        """The fewest of a message's `n_keys` bucket keys a candidate must share (`min_shared`)."""
        floor = self._floors.get(n_keys)
        if floor is None:
            floor = self._floors[n_keys] = max(1, math.ceil(self.config.min_shared * n_keys))
        return floor

    # -- verification ------------------------------------------------------------------------
    def first_match(self, msg: Message, fp: Fingerprint, candidates: Sequence[Candidate]) -> Verdict:
        """A duplicate of the first of the ranked candidates that verifies, else unique."""
        probe: Probe | None = None
        floor = self.floor(len(fp.keys))
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
                native = self._native_match(name, fp, entry)
                if native is None:
                    continue
                m = native
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
        """The sketch rules, then the edit rule of two short texts (`filters._sketch.similarity` is the twin)."""
        cfg = self.config
        size_a, size_b = fp.size, entry.size
        jaccard, containment_a, containment_b = (probe or Probe(fp.sketch, size_a)).estimates(entry.sketch, size_b)
        inside, containment = (size_a, containment_a) if containment_a >= containment_b else (size_b, containment_b)
        # A pair the edit rule cannot judge (one text longer than `short_text`) of which neither is contained in the
        # other needs `threshold_long`: a template with other names and figures shares half its shingles.
        if jaccard >= cfg.threshold and (jaccard >= cfg.threshold_long or containment >= cfg.containment
                                         or (fp.chars and entry.chars)):
            return Match(True, jaccard, method)
        # Containment of the smaller text in the larger (Overlap's), when the contained text adds at most a few
        # shingles of its own: `containment_slack` and `containment_slack_share` of them, or 1/16 of a long text's
        # (its sketch is a sample).
        if containment >= cfg.containment and size_ratio(size_a, size_b) >= cfg.containment_min_ratio \
                and min(size_a, size_b) >= cfg.containment_min_size \
                and inside * (1.0 - containment) <= max(min(cfg.containment_slack, inside * cfg.containment_slack_share),
                                                        inside / 16):
            return Match(True, containment, method)
        if fp.chars and entry.chars:
            edited = edit_match(fp.chars, entry.chars, cfg.edit_similarity)
            if edited >= 0.0:
                return Match(True, edited, method)
        return Match(False, max(jaccard, containment), method)
