"""Fingerprints: the design documents' examples, each candidate method, and the bottom-k sketch overlap."""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from filters.config import METHODS, FilterConfig
from filters.errors import ConfigError
from filters.fingerprint import Fingerprint, Fingerprinter, hamming, key_method, minhash_jaccard
from filters.sketch import overlap

ALL = FilterConfig(methods=METHODS)
LETTERS = "abcdefghjkmnopqrstuvwxyz"  # no l or i: the leet step folds them together


@functools.cache
def fingerprinter(**kw: object) -> Fingerprinter:
    return Fingerprinter(FilterConfig(**kw)) if kw else Fingerprinter(ALL)


def fps(*texts: str, **kw: object) -> list[Fingerprint]:
    return fingerprinter(**kw).fingerprint_batch(list(texts))


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(n))


def shingles(normalized: str, n: int) -> set[str]:
    return {normalized[i : i + n] for i in range(max(len(normalized) - n + 1, 1))}


def exact_jaccard(a: Fingerprint, b: Fingerprint, n: int = 4) -> float:
    sa, sb = shingles(a.normalized, n), shingles(b.normalized, n)
    return len(sa & sb) / len(sa | sb)


def ov(a: Fingerprint, b: Fingerprint):
    return overlap(a.sketch, a.size, b.sketch, b.size)


# -- the design documents' examples ----------------------------------------------------------------


def test_cat_on_mat_is_nearer_to_its_variant_than_to_ice_cream_by_sketch_overlap() -> None:
    mat, a_mat, cream = fps("the cat sat on the mat", "the cat sat on a mat", "we all scream for ice cream")
    near, far = ov(mat, a_mat), ov(mat, cream)
    assert near.jaccard > far.jaccard
    assert near.containment > far.containment
    assert far.jaccard == 0.0
    assert near.jaccard == pytest.approx(exact_jaccard(mat, a_mat))  # few shingles: the sketch is exact


def test_cat_on_mat_is_nearer_to_its_variant_than_to_ice_cream_by_simhash() -> None:
    mat, a_mat, cream = fps("the cat sat on the mat", "the cat sat on a mat", "we all scream for ice cream")
    assert None not in (mat.simhash, a_mat.simhash, cream.simhash)
    assert hamming(mat.simhash, a_mat.simhash) < hamming(mat.simhash, cream.simhash)


@pytest.mark.parametrize("unrelated", ["今天天气很好我们去公园散步吧", "股市今日大幅下跌投资者恐慌", "我爱北京天安门"])
def test_mama_calls_you_to_dinner_is_nearer_to_its_variant(unrelated: str) -> None:
    shout, call, other = fps("妈妈喊你来吃饭", "妈妈叫你来吃饭", unrelated)
    # By simhash Hamming distance ...
    assert hamming(shout.simhash, call.simhash) < hamming(shout.simhash, other.simhash)
    # ... and by shingle Jaccard (sketch estimate and exact): one shared 4-gram of seven vs none.
    assert ov(shout, call).jaccard > ov(shout, other).jaccard == 0.0
    assert exact_jaccard(shout, call) > exact_jaccard(shout, other)


# -- general properties of a fingerprint ------------------------------------------------------------


def test_batch_fingerprints_equal_single_fingerprints() -> None:
    rng = random.Random(3)
    texts = [random_text(rng, rng.randint(0, 60)) for _ in range(40)] + ["", "a", "在", "x" * 25_000]
    batch = fingerprinter().fingerprint_batch(texts)
    for text, b in zip(texts, batch):
        s = fingerprinter().fingerprint(text)
        assert s.normalized == b.normalized
        assert (s.exact, s.size, s.keys, s.simhash, s.sentences) == (b.exact, b.size, b.keys, b.simhash, b.sentences)
        assert np.array_equal(s.sketch, b.sketch)
        assert np.array_equal(s.minhash, b.minhash)


def test_keys_carry_their_method_tag() -> None:
    (fp,) = fps("The quick brown fox jumps over the lazy dog. It was a sunny day. Everyone was happy!")
    assert {key_method(k) for k in fp.keys} == set(METHODS)
    assert len(set(fp.keys)) == len(fp.keys)
    assert all(0 <= k < 2**64 for k in fp.keys)
    for method in METHODS:
        (one,) = fps("The quick brown fox jumps over the lazy dog.", methods=(method,))
        assert {key_method(k) for k in one.keys} == {method}


def test_sketch_is_sorted_distinct_and_bounded() -> None:
    rng = random.Random(4)
    for n in (0, 3, 50, 500, 5000):
        (fp,) = fps(random_text(rng, n))
        s = fp.sketch.tolist()
        assert s == sorted(set(s))
        assert 1 <= len(s) <= ALL.sketch_size
        if n <= 100:
            assert fp.size == len(shingles(fp.normalized, ALL.shingle)) == len(s)


def test_texts_longer_than_max_chars_are_fingerprinted_on_their_prefix() -> None:
    rng = random.Random(5)
    text = random_text(rng, 30_000)
    long, prefix = fps(text, text[: ALL.max_chars])
    assert long.exact == prefix.exact and long.keys == prefix.keys


def test_config_rejects_unknown_methods() -> None:
    with pytest.raises(ConfigError):
        FilterConfig(methods=("exact", "bogus"))
    with pytest.raises(ConfigError):
        FilterConfig(methods=())
    with pytest.raises(ConfigError):
        FilterConfig(verify="maybe")


# -- exact ----------------------------------------------------------------------------------------


def test_exact_same_normalized_text_same_hash() -> None:
    a, b, c = fps("Hello, World!", "h e l l o   w o r l d", "Hello, World?!", methods=("exact",))
    d, e = fps("Hello, Word!", "Hello World 2", methods=("exact",))
    assert a.normalized == b.normalized == c.normalized
    assert a.exact == b.exact == c.exact
    assert a.keys == b.keys == c.keys and len(a.keys) == 1
    assert len({a.exact, d.exact, e.exact}) == 3
    assert 0 <= a.exact < 2**128


# -- simhash --------------------------------------------------------------------------------------


def test_simhash_is_64_bit_with_k_plus_1_block_keys() -> None:
    for k in (0, 1, 3, 7, 15):
        (fp,) = fps("the quick brown fox jumps over the lazy dog", methods=("simhash",), simhash_k=k)
        assert fp.simhash is not None and 0 <= fp.simhash < 2**64
        assert len(fp.keys) == k + 1
    rng = random.Random(6)
    values = [fp.simhash for fp in fps(*(random_text(rng, 200) for _ in range(40)), methods=("simhash",))]
    assert len(set(values)) == 40


def test_simhash_uses_all_64_bits() -> None:
    # Regression: simhash used to vote over uint32 sketch hashes, leaving bits 32-63 always 0.
    rng = random.Random(6)
    values = [fp.simhash for fp in fps(*(random_text(rng, 200) for _ in range(40)), methods=("simhash",))]
    high = 0
    for v in values:
        high |= v >> 32
    assert high == 0xFFFFFFFF  # 40 random simhashes set every one of the upper 32 bits at least once


def test_simhash_unrelated_texts_share_no_block_key() -> None:
    a, b = fps("the quick brown fox jumps over the lazy dog", "股市今日大幅下跌投资者恐慌", methods=("simhash",))
    assert not set(a.keys) & set(b.keys)


def test_simhash_of_identical_and_near_identical_texts() -> None:
    # Simhash is for long text (the QQ write-up): one edit in ~80 shingles can flip a few more bits.
    base = ("The quick brown fox jumps over the lazy dog while the children played in the sunny park all afternoon. "
            "Later that evening the family gathered around the old wooden table to share stories about the day, "
            "laughing about the dog that refused to move and the fox that kept coming back for more bread crumbs.")
    a, b, c = fps(base, base.upper() + "!!", base.replace("sunny", "sunnny"), methods=("simhash",))
    assert a.simhash == b.simhash and a.keys == b.keys
    assert hamming(a.simhash, c.simhash) <= 3
    assert set(a.keys) & set(c.keys)


@settings(max_examples=300, deadline=None)
@given(
    value=st.integers(min_value=0, max_value=2**64 - 1),
    k=st.sampled_from([0, 1, 2, 3, 5, 7, 15]),
    data=st.data(),
)
def test_simhash_within_hamming_k_share_a_block_key(value: int, k: int, data: st.DataObject) -> None:
    f = fingerprinter(methods=("simhash",), simhash_k=k)
    bits = data.draw(st.sets(st.integers(0, 63), max_size=k))
    flipped = value
    for bit in bits:
        flipped ^= 1 << bit
    assert hamming(value, flipped) == len(bits) <= k
    keys, other = f._simhash_keys(value), f._simhash_keys(flipped)
    assert len(keys) == len(set(keys)) == k + 1
    assert set(keys) & set(other)
    assert all(key_method(key) == "simhash" for key in keys)


def test_simhash_block_keys_differ_when_every_block_differs() -> None:
    f = fingerprinter(methods=("simhash",), simhash_k=3)
    value = 0x0123_4567_89AB_CDEF
    flipped = value ^ (1 | 1 << 16 | 1 << 32 | 1 << 48)  # one bit in each of the four 16-bit blocks
    assert not set(f._simhash_keys(value)) & set(f._simhash_keys(flipped))


# -- m-gram keys ----------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [1, 5, 6, 7, 12, 20, 2 * ALL.mgram_keys + ALL.mgram - 2])  # the longest
def test_mgram_short_texts_use_all_mgrams(length: int) -> None:
    rng = random.Random(length)
    (fp,) = fps(random_text(rng, length), methods=("mgram",))
    grams = shingles(fp.normalized, ALL.mgram)
    assert len(grams) < 2 * ALL.mgram_keys
    assert len(fp.keys) == len(grams)


def test_mgram_keys_of_short_text_found_in_longer_text_containing_it() -> None:
    rng = random.Random(7)
    short = random_text(rng, 20)
    a, b = fps(short, short + random_text(rng, 4), methods=("mgram",))
    assert set(a.keys) <= set(b.keys)


@pytest.mark.parametrize("length", [200, 1_000, 5_000, 20_000, 60_000])
def test_mgram_long_texts_are_sampled_to_a_bounded_number(length: int) -> None:
    rng = random.Random(length)
    for _ in range(5):
        (fp,) = fps(random_text(rng, length), methods=("mgram",))
        assert 1 <= len(fp.keys) <= 4 * ALL.mgram_keys


def test_mgram_truncated_copy_shares_a_key_with_its_original() -> None:
    rng = random.Random(8)
    for _ in range(100):
        text = random_text(rng, rng.randint(100, 20_000))
        cut = rng.randint(len(text) // 3, len(text))
        original, truncated = fps(text, text[:cut], methods=("mgram",))
        assert set(original.keys) & set(truncated.keys), (len(text), cut)


def test_mgram_unrelated_texts_share_no_key() -> None:
    rng = random.Random(9)
    texts = [random_text(rng, 300) for _ in range(20)]
    key_sets = [set(fp.keys) for fp in fps(*texts, methods=("mgram",))]
    for i in range(len(key_sets)):
        for j in range(i):
            assert not key_sets[i] & key_sets[j]


# -- minhash + LSH bands --------------------------------------------------------------------------


def test_minhash_identical_sets_identical_signatures_and_band_keys() -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 3
    a, b = fps(text, text.upper(), methods=("minhash",))
    assert a.minhash is not None and b.minhash is not None
    assert len(a.minhash) == ALL.minhash_perm
    assert np.array_equal(a.minhash, b.minhash)
    assert minhash_jaccard(a.minhash, b.minhash) == 1.0
    assert a.keys == b.keys and len(a.keys) == ALL.minhash_bands
    f = fingerprinter(methods=("minhash",))
    hashes = np.sort(np.random.default_rng(0).choice(2**32, size=300, replace=False)).astype(np.uint32)
    assert np.array_equal(f._minhash(hashes), f._minhash(hashes.copy()))


def test_minhash_estimates_jaccard_of_random_sets_within_015() -> None:
    # 128 permutations: the estimate's standard deviation is ≤ 0.045, so ±0.15 is a 3.4σ bound; allow the
    # rare tail (at most 2 of 60) but no gross miss and no bias.
    f = fingerprinter(methods=("minhash",))
    rng = np.random.default_rng(1234)
    errors = []
    for _ in range(60):
        universe = np.unique(rng.integers(0, 2**64 - 1, size=600, dtype=np.uint64))[:450]
        rng.shuffle(universe)
        shift = int(rng.integers(0, 150))
        a = np.sort(universe[:300])
        b = np.sort(universe[shift : shift + 300])
        truth = len(np.intersect1d(a, b)) / len(np.union1d(a, b))
        errors.append(minhash_jaccard(f._minhash(a), f._minhash(b)) - truth)
    errors_abs = np.abs(errors)
    assert (errors_abs > 0.15).sum() <= 2
    assert errors_abs.max() <= 0.2
    assert errors_abs.mean() <= 0.05
    assert abs(np.mean(errors)) <= 0.03


def test_minhash_estimates_jaccard_of_texts_with_300_shingles_within_015() -> None:
    rng = random.Random(10)
    for _ in range(30):
        base = random_text(rng, 303)
        cut = rng.randint(0, 303)
        other = base[:cut] + random_text(rng, 303 - cut)
        a, b = fps(base, other, methods=("minhash",))
        assert 280 <= a.size <= 300
        assert abs(minhash_jaccard(a.minhash, b.minhash) - exact_jaccard(a, b)) <= 0.15


def test_minhash_near_duplicates_share_a_band_unrelated_do_not() -> None:
    rng = random.Random(11)
    base = random_text(rng, 400)
    near = base[:200] + "x" + base[201:]
    a, b, c = fps(base, near, random_text(rng, 400), methods=("minhash",))
    assert set(a.keys) & set(b.keys)
    assert not set(a.keys) & set(c.keys)


# -- top-k sentences ------------------------------------------------------------------------------

SENTENCES = [
    "The central bank kept interest rates unchanged on Tuesday",
    "Analysts had expected a small cut after weak retail figures",
    "Markets rose slightly in early trading",
    "The next meeting is scheduled for March",
    "Ok",
]


def test_sentences_reordering_keeps_the_sentence_keys() -> None:
    forward = ". ".join(SENTENCES) + "."
    rng = random.Random(12)
    for _ in range(5):
        shuffled = SENTENCES[:]
        rng.shuffle(shuffled)
        a, b = fps(forward, "! ".join(shuffled) + "?", methods=("sentences",))
        assert a.sentences == b.sentences
        assert set(a.keys) == set(b.keys)
        assert a.exact != b.exact  # the texts themselves differ


def test_sentences_keeps_the_top_k_longest() -> None:
    (fp,) = fps(". ".join(SENTENCES), methods=("sentences",))
    assert len(fp.sentences) == ALL.sentences_top == 3
    (two,) = fps(". ".join(SENTENCES[1:3]), methods=("sentences",))
    assert two.sentences < fp.sentences  # both are among the three longest of the full text
    (short,) = fps("Ok. Yes. No.", methods=("sentences",))
    assert short.sentences == frozenset() and short.keys == ()


def test_sentences_are_normalized() -> None:
    a, b = fps(". ".join(SENTENCES), ". ".join(s.upper() for s in SENTENCES), methods=("sentences",))
    assert a.sentences == b.sentences


# -- sketch overlap -------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    st.sets(st.integers(0, 2**32 - 1), min_size=1, max_size=128),
    st.sets(st.integers(0, 2**32 - 1), min_size=1, max_size=128),
    st.sets(st.integers(0, 2**32 - 1), max_size=64),
)
def test_overlap_is_exact_for_small_sets(a: set[int], b: set[int], shared: set[int]) -> None:
    a, b = a | shared, b | shared
    if len(a) > 128 or len(b) > 128:
        a, b = set(sorted(a)[:128]), set(sorted(b)[:128])
    sa, sb = np.array(sorted(a), dtype=np.uint32), np.array(sorted(b), dtype=np.uint32)
    o = overlap(sa, len(a), sb, len(b))
    inter = len(a & b)
    assert o.jaccard == inter / len(a | b)
    assert o.containment_a == inter / len(a)
    assert o.containment_b == inter / len(b)


def test_overlap_is_symmetric() -> None:
    rng = random.Random(13)
    texts = [random_text(rng, rng.randint(1, 2000)) for _ in range(8)]
    texts += [texts[0][: len(texts[0]) // 2], texts[1] + texts[2]]
    prints = fps(*texts)
    for a in prints:
        for b in prints:
            ab, ba = ov(a, b), ov(b, a)
            assert ab.jaccard == ba.jaccard
            assert (ab.containment_a, ab.containment_b) == (ba.containment_b, ba.containment_a)
            assert ab.containment == ba.containment


def test_overlap_of_identical_and_disjoint() -> None:
    rng = random.Random(14)
    text = random_text(rng, 5000)
    a, b, c = fps(text, text, random_text(rng, 5000))
    assert ov(a, b).jaccard == 1.0
    # Random 4-grams over 23 letters meet by chance (~1 % of them): the estimate stays near the truth.
    assert ov(a, c).jaccard == pytest.approx(exact_jaccard(a, c), abs=0.02)
    assert ov(a, c).containment < 0.05
    d, e = fps("the quick brown fox", "股市今日大幅下跌投资者恐慌")
    assert ov(d, e).jaccard == ov(d, e).containment == 0.0


@pytest.mark.parametrize("length", [400, 2000, 10_000])
def test_containment_of_a_truncated_half_is_about_one(length: int) -> None:
    rng = random.Random(length)
    text = random_text(rng, length)
    half, full = fps(text[: length // 2], text)
    o = ov(half, full)
    assert o.containment_a >= 0.95  # (nearly) all of the half is in the full text
    assert o.containment >= 0.95
    assert 0.4 <= o.jaccard <= 0.6
    assert 0.4 <= o.size_ratio <= 0.6


def test_overlap_estimates_jaccard_of_large_texts() -> None:
    rng = random.Random(15)
    for _ in range(10):
        base = random_text(rng, 3000)
        cut = rng.randint(0, 3000)
        a, b = fps(base, base[:cut] + random_text(rng, 3000 - cut))
        assert abs(ov(a, b).jaccard - exact_jaccard(a, b)) <= 0.15
