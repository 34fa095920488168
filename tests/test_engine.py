"""The engine: verdicts per method, greedy verification, insertion of representatives only, replays,
the event-time window, memory plateau, and batch ≡ one by one (embedded and shared-index paths)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

import numpy as np
import pytest

from filters.config import METHODS, FilterConfig
from filters.engine import Match, Message, NearDupFilter, Verdict
from filters.fingerprint import hamming, key_method, minhash_jaccard
from filters.index import Batch, Candidate, CandidateIndex, Entry, IndexWrapper, Memo, Query, Verifier, finish
from filters.index.memory import MemoryIndex
from filters.index.shared import AnsweredRounds, SharedDecider
from stream.testing import ManualClock

LETTERS = "abcdefghjkmnpqrstuvwxyz"

LONG = (
    "The quick brown fox jumps over the lazy dog. It was a sunny day in the park and everyone was happy to be "
    "outside. Children played on the swings while their parents talked on the benches nearby. The ice cream van "
    "came by at noon and every child ran to it with coins in hand. Later the clouds rolled in and a light rain "
    "began to fall, sending the families home for supper."
)
UNRELATED = "Quarterly earnings beat expectations as revenue grew twelve percent year over year in the third quarter."


def words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 8))) for _ in range(n))


class ProxyIndex(AnsweredRounds, IndexWrapper):
    """A `CandidateIndex` that is not a `MemoryIndex`: makes the engine take its shared-index path
    (one lookup and one insert round per batch) over a MemoryIndex, counting the rounds."""

    def __init__(self, window: float, bucket_cap: int = 64) -> None:
        super().__init__(MemoryIndex(window, bucket_cap))
        self.lookups = 0
        self.inserts = 0
        self._decider = SharedDecider()

    @property
    def compiled_table(self) -> bool:
        return False  # decided from fingerprints, as a shared index does

    def decide(self, batch: Batch, verifier: Verifier) -> list[Verdict]:
        verdicts = self._decider.decide(self, batch, verifier)
        finish(batch.meanwhile)
        return verdicts

    def prefetch(self, queries: Sequence[Query]) -> None:
        pass  # nothing to read ahead in memory


    def lookup(self, queries: Sequence[Query], limit: int) -> list[tuple[Entry | Verdict | None, list[Candidate]]]:
        self.lookups += 1
        return super().lookup(queries, limit)

    def insert(self, entries: Sequence[tuple[Entry, tuple[int, ...]]],
               memos: Sequence[Memo] = ()) -> list[list[Candidate] | None]:
        self.inserts += 1
        return super().insert(entries, memos)


def test_proxy_index_satisfies_the_protocol() -> None:
    assert isinstance(ProxyIndex(10.0), CandidateIndex)
    assert isinstance(MemoryIndex(10.0, 64), CandidateIndex)


@pytest.mark.parametrize("shared", [False, True])
def test_every_share_of_the_work_given_to_decide_runs_before_it_returns(shared: bool) -> None:
    """`decide(..., meanwhile=...)` through the door: whatever the backend, every share has run when the
    verdicts come back, and none runs after the one that said it was the last."""
    cfg = FilterConfig(window=3600.0)
    nd = NearDupFilter(cfg, index=ProxyIndex(cfg.window) if shared else "memory://")
    calls = []

    def share() -> bool:
        calls.append(1)
        return len(calls) >= 3

    messages = [nd.message(f"message number {i} about nothing in particular", id=str(i), ts=i) for i in range(5)]
    assert nd.decide(messages, nd.prepare([m.text for m in messages]), meanwhile=share) == \
        NearDupFilter(cfg).check_batch(messages)
    assert len(calls) == 3


# -- basic verdicts -------------------------------------------------------------------------------


def test_docstring_example() -> None:
    f = NearDupFilter()
    first = f.check("WIN a FREE iPhone now!!! call 555-0100", id="a", ts=0)
    second = f.check("w i n a free iphone NOW, call 555-0199", id="b", ts=1)
    assert first == Verdict("a", False)
    assert first.label == "unique"
    assert second.duplicate and second.duplicate_of == "a" and second.label == "duplicate"


def test_exact_same_normalized_text_gives_exact_verdict() -> None:
    f = NearDupFilter()
    assert not f.check("Hello, World! Call 555-0100", id="a", ts=0).duplicate
    v = f.check("h e l l o   w o r l d  call 555 0199", id="b", ts=1)
    assert v == Verdict("b", True, "a", 1.0, "exact")
    assert len(f.index) == 1


def test_unrelated_messages_are_unique_and_all_indexed() -> None:
    f = NearDupFilter()
    rng = random.Random(1)
    verdicts = [f.check(words(rng, 12), id=str(i), ts=i) for i in range(50)]
    assert not any(v.duplicate for v in verdicts)
    assert all(v.duplicate_of is None and v.method is None and v.similarity == 0.0 for v in verdicts)
    assert len(f.index) == 50


def test_auto_ids_and_clock_timestamps() -> None:
    clock = ManualClock(1000.0)
    f = NearDupFilter(clock=clock)
    assert f.check("first message text").id == "auto-1"
    assert f.message("second").id == "auto-2"
    assert f.message("third").ts == 1000.0
    assert f.message("third", ts=5).ts == 5.0
    assert f.check_batch([]) == []


def test_check_batch_checks_messages_of_one_batch_against_each_other() -> None:
    f = NearDupFilter()
    v = f.check_batch([Message("a", LONG, 0.0), Message("b", LONG.upper(), 1.0), Message("c", UNRELATED, 2.0)])
    assert [x.duplicate for x in v] == [False, True, False]
    assert v[1].duplicate_of == "a"


# -- each method alone ----------------------------------------------------------------------------

NEAR = LONG.replace("sunny", "sunnny")  # one character inserted


@pytest.mark.parametrize("verify", ["sketch", "native"])
@pytest.mark.parametrize("method", METHODS)
def test_each_method_alone_catches_an_obvious_near_duplicate(method: str, verify: str) -> None:
    f = NearDupFilter(FilterConfig(methods=(method,), verify=verify))
    assert not f.check(LONG, id="a", ts=0).duplicate
    assert f.check(LONG.upper() + "!!!", id="b", ts=1) == Verdict("b", True, "a", 1.0, "exact")
    near = f.check(NEAR, id="c", ts=2)
    if method == "exact":
        assert not near.duplicate  # exact only catches copies that normalize to the same text
    else:
        assert near.duplicate and near.duplicate_of == "a" and near.method == method
        assert 0.5 <= near.similarity <= 1.0
    assert not f.check(UNRELATED, id="d", ts=3).duplicate


def test_verify_native_uses_each_methods_own_measure() -> None:
    for method in ("simhash", "minhash", "sentences"):
        f = NearDupFilter(FilterConfig(methods=(method,), verify="native"))
        f.check(LONG, id="a", ts=0)
        a, b = f.fingerprinter.fingerprint_batch([LONG, NEAR])
        near = f.check(NEAR, id="b", ts=1)
        assert near.duplicate and near.duplicate_of == "a" and near.method == method
        if method == "simhash":
            assert hamming(a.simhash, b.simhash) <= f.config.simhash_k
            assert near.similarity == round(1 - hamming(a.simhash, b.simhash) / 64, 4)
        elif method == "minhash":
            assert near.similarity == round(minhash_jaccard(a.minhash, b.minhash), 4)
        else:
            shared = len(a.sentences & b.sentences)
            assert near.similarity == round(shared / min(len(a.sentences), len(b.sentences)), 4)


def _verify_both(method: str, **entry_changes: object) -> tuple[Match, Match]:
    """Verify LONG against a candidate with LONG's own sketch (Jaccard 1) but altered `entry_changes`,
    found through `method`'s first key, in sketch and in native mode."""
    out = []
    for verify in ("sketch", "native"):
        f = NearDupFilter(FilterConfig(methods=(method,), verify=verify))
        fp = f.fingerprinter.fingerprint(LONG)
        entry = dataclasses.replace(Entry.of("x", 0.0, fp), exact=fp.exact ^ 1, **entry_changes)
        out.append(f.verify(fp, Candidate(entry, len(fp.keys), fp.keys[0])))
    return out[0], out[1]


def test_verify_native_simhash_is_hamming_within_k() -> None:
    fp = NearDupFilter(FilterConfig(methods=("simhash",))).fingerprinter.fingerprint(LONG)
    sketch, native = _verify_both("simhash", simhash=fp.simhash ^ 0b1111)  # Hamming 4 > k = 3
    assert sketch == Match(True, 1.0, "simhash")
    assert native == Match(False, 1 - 4 / 64, "simhash")
    _, native = _verify_both("simhash", simhash=fp.simhash ^ 0b111)  # Hamming 3
    assert native == Match(True, 1 - 3 / 64, "simhash")


def test_verify_native_minhash_is_signature_agreement() -> None:
    fp = NearDupFilter(FilterConfig(methods=("minhash",))).fingerprinter.fingerprint(LONG)
    sig = fp.minhash.copy()
    sig[: int(len(sig) * 0.6)] ^= np.uint32(1)  # 40 % of the rows agree
    sketch, native = _verify_both("minhash", minhash=sig)
    assert sketch.ok and not native.ok
    assert native.similarity == pytest.approx(0.4, abs=0.01) and native.method == "minhash"
    sig = fp.minhash.copy()
    sig[: int(len(sig) * 0.4)] ^= np.uint32(1)  # 60 % agree
    assert _verify_both("minhash", minhash=sig)[1].ok


def test_verify_native_sentences_needs_a_shared_sentence() -> None:
    sketch, native = _verify_both("sentences", sentences=frozenset({1, 2, 3}))
    assert sketch.ok and native == Match(False, 0.0, "sentences")


def test_verify_native_mgram_and_exact_use_the_sketch() -> None:
    rng = random.Random(2)
    text = words(rng, 60)
    for method in ("mgram", "exact"):
        sketch, native = _verify_both(method)
        assert sketch == native == Match(True, 1.0, method)
    f = NearDupFilter(FilterConfig(verify="native"))
    f.check(text, id="a", ts=0)
    v = f.check(text.replace(text.split()[5], "zzzzzz"), id="b", ts=1)
    assert v.duplicate and v.method == "mgram" and 0.5 <= v.similarity < 1.0


def test_native_verdict_does_not_depend_on_method_order_or_lose_a_duplicate_when_a_method_is_added() -> None:
    base = "The central bank kept interest rates unchanged on Tuesday, citing steady growth."
    copy = "The central bank kept interest rates unchanged on Tuesday, citing steady growth and low inflation."
    verdicts = {}
    for methods in [("minhash",), ("minhash", "simhash"), ("simhash", "minhash")]:
        f = NearDupFilter(FilterConfig(methods=methods, verify="native"))
        f.check(base, id="a", ts=0)
        verdicts[methods] = f.check(copy, id="b", ts=1).duplicate
    assert verdicts[("minhash",)] and verdicts[("minhash", "simhash")]  # holds today
    assert verdicts[("simhash", "minhash")]


def test_containment_catches_a_truncated_copy() -> None:
    rng = random.Random(2)
    text = words(rng, 200)
    f = NearDupFilter()
    f.check(text, id="full", ts=0)
    v = f.check(text[: len(text) // 2], id="half", ts=1)
    assert v.duplicate and v.duplicate_of == "full" and v.method == "mgram"
    assert v.similarity >= 0.5
    assert not f.check(text[: len(text) // 5], id="fifth", ts=2).duplicate  # below the size ratio


@pytest.mark.parametrize("native", [True, False], ids=["compiled", "reference"])
def test_containment_refuses_a_part_that_adds_words_of_its_own(native: bool) -> None:
    """A truncated copy adds to what it keeps at most its junction and a marker; a part of a message with a
    clause of its own (a summary, a reworded headline) is another message, however much it shares."""
    rng = random.Random(4)
    text = words(rng, 60)
    f = NearDupFilter(native=native)
    f.check(text, id="full", ts=0)
    cut = text[: len(text) * 2 // 5]
    v = f.check(cut + " (more)", id="cut", ts=1)
    assert v.duplicate_of == "full" and v.similarity == 1.0  # the marker is dropped (strip_markers)
    v = f.check(cut + "lo", id="junction", ts=1)  # a cut inside a word: the junction is its own
    assert v.duplicate_of == "full" and v.similarity < 1.0
    assert not f.check(cut + " and then a few words of its own", id="own", ts=2).duplicate


@pytest.mark.parametrize("native", [True, False], ids=["compiled", "reference"])
def test_a_short_part_with_a_clause_of_its_own_is_not_contained(native: bool) -> None:
    """`containment_slack_share`: a short text contained in another but for a few shingles of its own (a 14-shingle
    text with two of them, 14 %) is another message; the same text with nothing of its own, or a long part whose
    six own shingles are a junction and a marker, is still contained."""
    def verdict(a: str, b: str, **changes: object) -> Verdict:
        f = NearDupFilter(FilterConfig().replace(**changes), native=native)
        f.check(a, id="a", ts=0)
        return f.check(b, id="b", ts=1)

    assert not verdict("Sorry, I'll call later", "Sorry,in meeting I'll call later").duplicate
    assert verdict("Sorry, I'll call later", "Sorry,in meeting I'll call later",
                   containment_slack_share=1.0).duplicate  # the share is what refuses it
    assert verdict("Are you staying in town ?", "Are you staying in town ? (msg&data rates may apply)").duplicate
    rng = random.Random(4)
    text = words(rng, 60)
    assert verdict(text, text[: len(text) * 2 // 5] + " (more)").duplicate


@pytest.mark.parametrize("native", [True, False], ids=["compiled", "reference"])
def test_long_texts_of_one_template_need_more_than_half_their_shingles(native: bool) -> None:
    """`threshold_long`: two dividend notices of other companies share half their shingles (Jaccard 0.50, the
    smaller 69 % inside the larger): not duplicates, though `threshold` alone would take them; a long copy with a
    word edited, and a long copy cut short (contained), are still duplicates."""
    zayre = "zayre corp zy raises quarterly qtly div cts vs eight cts prior pay june four record may reuter"
    nucor = "nucor corp nue raises quarterly qtly div nine cts vs eight cts prior pay may record march reuter"
    for threshold_long, duplicate in ((0.55, False), (0.5, True)):
        f = NearDupFilter(FilterConfig(threshold_long=threshold_long), native=native)
        f.check(zayre, id="a", ts=0)
        assert f.check(nucor, id="b", ts=1).duplicate is duplicate
    rng = random.Random(7)
    text = words(rng, 40)
    f = NearDupFilter(native=native)
    f.check(text, id="full", ts=0)
    swapped = text.split()
    swapped[20] = "zzzzzz"
    assert f.check(" ".join(swapped), id="edited", ts=1).duplicate_of == "full"
    assert f.check(text[: len(text) * 3 // 5], id="cut", ts=2).duplicate_of == "full"


@pytest.mark.parametrize("native", [True, False], ids=["compiled", "reference"])
def test_a_short_text_with_a_word_inserted_deleted_or_swapped_is_a_duplicate(native: bool) -> None:
    """One edit in an 8-character Chinese text leaves no 6-gram key and a shingle Jaccard near 0.2: the
    3-gram keys of short texts find the original and the edit rule (LCS similarity, or the same characters
    in another order) verifies it; another word in the same frame is still another text."""
    f = NearDupFilter(native=native)
    f.check("钢琴烤漆容易磨花", id="a", ts=0)
    for i, copy in enumerate(["钢琴烤漆易磨花", "钢琴烤漆很容易磨花", "烤漆钢琴容易磨花"]):
        assert f.check(copy, id=f"b{i}", ts=1).duplicate_of == "a", copy
    f.check("明天下午三点开会", id="c", ts=2)
    assert not f.check("明天上午九点开会", id="d", ts=3).duplicate


@pytest.mark.parametrize("native", [True, False], ids=["compiled", "reference"])
def test_a_short_chinese_copy_padded_with_particles_and_a_word_deleted_is_a_duplicate(native: bool) -> None:
    """Particles inserted (normalize.PARTICLES) cost nothing; the edit left is the deleted character."""
    f = NearDupFilter(native=native)
    f.check("源于实践的思考", id="a", ts=0)
    f.check("优点：价格适中，位置方便", id="b", ts=1)
    assert f.check("源于啊实践的考吧", id="c", ts=2).duplicate_of == "a"
    assert f.check("优点啦：价格适中哦，位置方便呀", id="d", ts=3).duplicate_of == "b"
    assert not f.check("源于书本的思考", id="e", ts=4).duplicate


def test_the_edit_check_is_for_short_texts() -> None:
    from filters.errors import ConfigError

    assert FilterConfig(short_text=256).short_text == 256
    with pytest.raises(ConfigError, match="short_text"):
        FilterConfig(short_text=257)


def test_short_chinese_texts_get_three_character_keys() -> None:
    config = FilterConfig()
    fp = NearDupFilter(config).fingerprinter.fingerprint("钢琴烤漆容易磨花")
    assert len(fp.keys) == 1 + 3 + 6  # the exact key, every 6-gram, every 3-gram
    assert fp.chars == fp.normalized
    assert len(NearDupFilter(config.replace(short_mgram_chars=0)).fingerprinter.fingerprint("钢琴烤漆容易磨花").keys) == 4
    latin = NearDupFilter(config).fingerprinter.fingerprint("see you at noon then")  # six letters carry as much
    assert len(latin.keys) == 1 + len(latin.normalized) - 5


def test_simhash_buckets_of_unrelated_messages_do_not_overflow() -> None:
    # Regression: simhash's upper 32 bits used to be always 0, so two of its four block keys were shared by
    # every message and unrelated messages filled those buckets to bucket_cap.
    f = NearDupFilter(FilterConfig(methods=("simhash",)))
    rng = random.Random(3)
    for i in range(100):
        f.check(words(rng, 15), id=str(i), ts=i)
    stats = f.index.stats()
    assert stats["evicted_by_cap"] == 0
    assert stats["max_bucket"] < f.config.bucket_cap


# -- greedy verification --------------------------------------------------------------------------

QUERY = "Congratulations, you have won a prize today"
VERIFIES = "Congratulations, you won a prize today"  # Jaccard ≈ 0.72 with QUERY
FAILS = "Totally different words here and there"


def crafted(**cfg: object) -> tuple[NearDupFilter, tuple[int, ...], dict[str, object]]:
    f = NearDupFilter(FilterConfig(**cfg))
    q, ok, bad = f.fingerprinter.fingerprint_batch([QUERY, VERIFIES, FAILS])
    mgram = tuple(k for k in q.keys if key_method(k) == "mgram")  # realistic: entries never share an exact key
    assert len(mgram) >= 12 and q.exact != ok.exact
    return f, mgram, {"ok": ok, "bad": bad}


def put(f: NearDupFilter, id: str, ts: float, fp: object, keys: Sequence[int]) -> None:
    f.index.insert([(Entry.of(id, ts, fp), tuple(keys))])  # type: ignore[arg-type]


def test_greedy_most_shared_keys_first_and_first_verified_wins() -> None:
    f, keys, fp = crafted()
    put(f, "unverifiable", 10, fp["bad"], keys)  # shares every key, but is not similar
    put(f, "more-shared", 0, fp["ok"], keys[:8])  # older, but shares more keys ...
    put(f, "fewer-shared", 5, fp["ok"], keys[:5])  # ... than this newer one
    v = f.check(QUERY, id="q", ts=20)
    assert v.duplicate and v.duplicate_of == "more-shared" and v.method == "mgram"
    _, ranked = f.index.lookup_one(Query("probe", 20, keys), 8)
    assert [c.entry.id for c in ranked] == ["unverifiable", "more-shared", "fewer-shared"]
    assert [c.shared for c in ranked] == [len(keys), 8, 5]


def test_greedy_ties_go_to_the_newest() -> None:
    f, keys, fp = crafted()
    put(f, "old", 1, fp["ok"], keys[:6])
    put(f, "new", 2, fp["ok"], keys[:6])
    put(f, "same-ts-earlier", 0.5, fp["ok"], keys[:3])
    assert f.check(QUERY, id="q", ts=3).duplicate_of == "new"
    f, keys, fp = crafted()
    put(f, "first", 1, fp["ok"], keys[:6])
    put(f, "second", 1, fp["ok"], keys[:6])  # same event time: the later inserted is newer
    assert f.check(QUERY, id="q", ts=3).duplicate_of == "second"


def test_greedy_verifies_at_most_max_candidates() -> None:
    f, keys, fp = crafted(max_candidates=2)
    put(f, "bad1", 3, fp["bad"], keys)
    put(f, "bad2", 2, fp["bad"], keys)
    put(f, "good", 1, fp["ok"], keys[:6])  # ranked third: never verified
    assert not f.check(QUERY, id="q", ts=4).duplicate
    g, keys, fp = crafted(max_candidates=3)
    put(g, "bad1", 3, fp["bad"], keys)
    put(g, "bad2", 2, fp["bad"], keys)
    put(g, "good", 1, fp["ok"], keys[:6])
    assert g.check(QUERY, id="q", ts=4).duplicate_of == "good"


def test_candidates_sharing_too_few_keys_are_not_verified() -> None:
    f, keys, fp = crafted(min_shared=0.1)  # with ≥ 12 keys a candidate needs ≥ 2 of them
    put(f, "one-key", 1, fp["ok"], keys[:1])
    assert not f.check(QUERY, id="q", ts=2).duplicate
    g, keys, fp = crafted(min_shared=0.1)
    put(g, "two-keys", 1, fp["ok"], keys[:2])
    assert g.check(QUERY, id="q", ts=2).duplicate_of == "two-keys"


def test_spam_wave_leaves_one_representative() -> None:
    base = ("Congratulations! You have won a $1000 Walmart gift card. Click http://bit.ly/abc123 to claim your "
            "prize before it expires tonight.")
    rng = random.Random(4)
    edits = [
        lambda s: s.upper(),
        lambda s: " ".join(s),
        lambda s: s.replace("o", "0"),
        lambda s: s + " " + str(rng.randint(0, 999)),
        lambda s: "!! " + s,
        lambda s: s.replace("http://bit.ly/abc123", f"https://bit.ly/x{rng.randint(0, 10**6)}"),
        lambda s: s.replace(" ", "\u200b "),
        lambda s: s.replace("1000", str(rng.randint(100, 9999))),
        lambda s: s.replace("tonight", "today"),
    ]
    copies = [base]
    for _ in range(199):
        text = base
        for edit in rng.sample(edits, rng.randint(1, 3)):
            text = edit(text)
        copies.append(text)
    assert len(set(copies)) > 100
    f = NearDupFilter()
    verdicts = [f.check(text, id=f"m{i}", ts=i) for i, text in enumerate(copies)]
    assert not verdicts[0].duplicate
    assert all(v.duplicate and v.duplicate_of == "m0" for v in verdicts[1:])
    assert len(f.index) == 1
    assert [e.id for e in f.index.entries()] == ["m0"]


# -- replay ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("shared", [False, True], ids=["memory", "shared-path"])
def test_replay_is_not_a_duplicate_of_itself(shared: bool) -> None:
    cfg = FilterConfig()
    f = NearDupFilter(cfg, index=ProxyIndex(cfg.window) if shared else "memory://")
    assert not f.check(LONG, id="a", ts=0).duplicate
    again = f.check(LONG, id="a", ts=5)
    assert again == Verdict("a", False, method="replay")
    assert f.check(LONG, id="b", ts=6).duplicate_of == "a"  # a different id is still a copy
    assert f.index.stats()["entries"] == 1
    # Replays inside one batch: the second occurrence of an id is a replay.
    g = NearDupFilter(cfg, index=ProxyIndex(cfg.window) if shared else "memory://")
    v = g.check_batch([Message("x", UNRELATED, 0), Message("x", UNRELATED, 1), Message("y", UNRELATED, 2)])
    assert [(x.duplicate, x.method, x.duplicate_of) for x in v] == [
        (False, None, None), (False, "replay", None), (True, "exact", "x")]


def test_replay_of_a_duplicate_is_judged_again() -> None:
    f = NearDupFilter()
    f.check(LONG, id="a", ts=0)
    assert f.check(NEAR, id="b", ts=1).duplicate_of == "a"
    assert f.check(NEAR, id="b", ts=2).duplicate_of == "a"  # b was never indexed, so it is no replay


# -- window ---------------------------------------------------------------------------------------


def test_window_with_manual_clock() -> None:
    clock = ManualClock()
    f = NearDupFilter(FilterConfig(window=60.0), clock=clock)
    assert not f.check(LONG, id="a").duplicate
    clock.advance(59.5)
    assert f.check(NEAR, id="b").duplicate_of == "a"
    clock.advance(1.0)  # 60.5 s after a
    v = f.check(NEAR, id="c")
    assert not v.duplicate
    assert {e.id for e in f.index.entries()} == {"c"}  # a was forgotten, c is the new representative


def test_window_with_explicit_timestamps_and_memory_is_freed() -> None:
    f = NearDupFilter(FilterConfig(window=100.0))
    f.check(LONG, id="a", ts=1000)
    f.check(UNRELATED, id="u", ts=1050)
    assert f.check(NEAR, id="b", ts=1099.9).duplicate_of == "a"
    assert len(f.index) == 2
    assert not f.check(NEAR, id="c", ts=1100.1).duplicate
    assert {e.id for e in f.index.entries()} == {"u", "c"}
    assert f.check(UNRELATED.upper(), id="d", ts=1149).duplicate_of == "u"
    f.check("something else entirely, nothing like before", id="e", ts=1300)
    assert {e.id for e in f.index.entries()} == {"e"}


def test_late_message_matches_a_newer_entry_in_its_window() -> None:
    f = NearDupFilter(FilterConfig(window=100.0))
    f.check(LONG, id="a", ts=1000)
    assert f.check(NEAR, id="late", ts=950).duplicate_of == "a"


def test_memory_plateaus_as_the_window_slides() -> None:
    window = 100.0
    f = NearDupFilter(FilterConfig(window=window))
    rng = random.Random(5)
    n = 30_000
    messages = [Message(f"m{i}", words(rng, rng.randint(6, 20)), float(i)) for i in range(n)]
    in_window = int(window) + 1  # messages whose ts lies within one window of the newest
    entries, buckets = [], []
    for start in range(0, n, 250):
        verdicts = f.check_batch(messages[start : start + 250])
        assert not any(v.duplicate for v in verdicts)
        stats = f.index.stats()
        entries.append(len(f.index))
        buckets.append(stats["buckets"])
        assert stats["entries"] == len(f.index)
    assert max(entries) <= 2 * in_window
    assert entries[-1] == in_window
    first_full = buckets[1]  # the first sample taken after one window of messages
    assert max(buckets) <= 2 * first_full
    keys_in_window = sum(len(fp.keys) for fp in f.fingerprinter.fingerprint_batch(
        [m.text for m in messages[-in_window:]]))
    assert buckets[-1] <= keys_in_window


# -- batch ≡ one by one ---------------------------------------------------------------------------


def mixed_stream(seed: int, n: int = 500) -> list[Message]:
    rng = random.Random(seed)
    bases = [words(rng, rng.randint(5, 25)) for _ in range(150)]
    out: list[Message] = []

    def mutate(s: str) -> str:
        r = rng.random()
        parts = s.split()
        if r < 0.25:
            return s.upper()
        if r < 0.5:
            return s + " " + words(rng, 1)
        if r < 0.75:
            return " ".join(parts[1:]) if len(parts) > 3 else s + "!"
        parts[rng.randrange(len(parts))] = words(rng, 1)
        return " ".join(parts)

    for i in range(n):
        r = rng.random()
        if r < 0.3 or not out:
            text = rng.choice(bases)
        elif r < 0.85:
            text = mutate(rng.choice(out).text)
        else:
            text = rng.choice(out).text
        mid = rng.choice(out).id if out and rng.random() < 0.03 else f"m{i}"  # a few replays
        out.append(Message(mid, text, float(i // 3)))
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_check_batch_equals_check_one_by_one(seed: int) -> None:
    messages = mixed_stream(seed)
    cfg = FilterConfig()
    one = NearDupFilter(cfg)
    expected = [one.check(m.text, id=m.id, ts=m.ts) for m in messages]
    kinds = {("replay" if v.method == "replay" else v.label) for v in expected}
    assert kinds == {"unique", "duplicate", "replay"}
    assert NearDupFilter(cfg).check_batch(messages) == expected
    chunked = NearDupFilter(cfg)
    assert [v for s in range(0, 500, 37) for v in chunked.check_batch(messages[s : s + 37])] == expected
    # The shared-index path (one lookup round per batch, a batch-local index) decides the same: one insert round,
    # and one more for the memos of the duplicates of the batch's own messages (written once those are indexed).
    proxy = ProxyIndex(cfg.window, cfg.bucket_cap)
    assert NearDupFilter(cfg, index=proxy).check_batch(messages) == expected
    assert proxy.lookups == 1 and proxy.inserts == 2
    proxy = ProxyIndex(cfg.window, cfg.bucket_cap)
    shared = NearDupFilter(cfg, index=proxy)
    assert [v for s in range(0, 500, 64) for v in shared.check_batch(messages[s : s + 64])] == expected


def test_check_batch_equals_one_by_one_with_all_methods() -> None:
    messages = mixed_stream(7, 300)
    cfg = FilterConfig(methods=METHODS, verify="native")
    one = NearDupFilter(cfg)
    expected = [one.check(m.text, id=m.id, ts=m.ts) for m in messages]
    assert NearDupFilter(cfg).check_batch(messages) == expected
    assert NearDupFilter(cfg, index=ProxyIndex(cfg.window)).check_batch(messages) == expected


# -- insert races on a shared index ---------------------------------------------------------------


class RacingIndex(ProxyIndex):
    """Another worker indexes `rival` between this worker's lookup and its insert."""

    def __init__(self, rival: Entry, rival_keys: tuple[int, ...]) -> None:
        super().__init__(3600.0)
        self.rival, self.rival_keys = rival, rival_keys
        self.raced = False

    def insert(self, entries: Sequence[tuple[Entry, tuple[int, ...]]],
               memos: Sequence[Memo] = ()) -> list[list[Candidate] | None]:
        self.inserts += 1
        if not self.raced:
            self.raced = True
            self.inner.insert([(self.rival, self.rival_keys)])
            out: list[list[Candidate] | None] = []
            for entry, keys in entries:
                shared = len(set(keys) & set(self.rival_keys))
                out.append([Candidate(self.rival, shared, keys[0])] if shared else None)
                if not shared:
                    self.inner.insert([(entry, keys)])
            self.inner.insert([], memos)
            return out
        return self.inner.insert(entries, memos)


def test_insert_race_lost_to_a_near_duplicate_makes_a_duplicate() -> None:
    cfg = FilterConfig()
    fp = NearDupFilter(cfg).fingerprinter.fingerprint(LONG)
    index = RacingIndex(Entry.of("rival", 0.0, fp), fp.keys)
    f = NearDupFilter(cfg, index=index)
    v = f.check(NEAR, id="mine", ts=1)
    assert v.duplicate and v.duplicate_of == "rival"
    assert {e.id for e in index.inner.entries()} == {"rival"}


def test_insert_race_against_an_unrelated_message_retries_and_inserts() -> None:
    cfg = FilterConfig()
    f0 = NearDupFilter(cfg)
    fp_rival, fp_mine = f0.fingerprinter.fingerprint_batch([UNRELATED, LONG])
    index = RacingIndex(Entry.of("rival", 0.0, fp_rival), fp_mine.keys[:3])  # shares buckets, not text
    f = NearDupFilter(cfg, index=index)
    v = f.check(LONG, id="mine", ts=1)
    assert not v.duplicate
    assert index.inserts == 2
    assert {e.id for e in index.inner.entries()} == {"rival", "mine"}
