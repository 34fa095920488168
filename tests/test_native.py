"""The compiled core (`filters._native`) against its numpy/Python reference: the same hashes, the same
table answers, the same verdicts, and memory that tracemalloc (the benchmark's meter) can see."""

from __future__ import annotations

import dataclasses
import functools
import math
import random
import struct
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import hiredis
import mmh3
import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from filters import _native
from filters.config import FilterConfig
from filters.edits import edit_match, lcs_length
from filters.engine import Message, NearDupFilter, Verdict
from filters.errors import IndexCorrupt
from filters.fingerprint import _MGRAM_TAG, _TAG_ROOM, Fingerprinter
from filters.index import Candidate, Entry, compact_codec, redis_codec
from filters.index.memory import MemoryIndex, PyTable, make_table, native_available
from filters.index.redis_codec import decode_entry, encode_entry, encode_entry_v2, rank_records
from filters.index.shared import against
from filters.normalize import (
    _BARE_DOMAIN,
    _EMAIL,
    _PINYIN_CODE,
    _SCHEME_URL,
    _SPACED,
    _TLD_WORDS,
    _UNITS,
    NormalizeOptions,
    Normalizer,
    _fusable,
    _leet_or_keep,
    _leet_or_mask,
    _number_or_leet,
    _stages,
)
from filters.shingles import Batch
from filters.sketch import Probe
from tests.test_index_contract import assert_same_entry

SAMPLE = Path(__file__).parent / "data" / "sample.jsonl"

# Texts as normalization leaves them, and worse: empty, shorter than an n-gram, astral, lone surrogates.
_TEXT = st.one_of(
    st.text(max_size=40),
    st.text(alphabet="abcdefgh", max_size=400),
    st.text(alphabet="ab你好世界\U0001e802\U000f0001", max_size=30),  # wide characters: the short m-gram keys
    st.text(alphabet=st.characters(blacklist_categories=()), max_size=30),
    st.sampled_from(["", "a", "\ud800", "x\udfff\ud800y", "😀😀", "a" * 3000]),
)


def test_the_compiled_core_is_built() -> None:
    """`pip install` builds it wherever a C++ compiler is (the README's test command has one): a
    build that silently fell back to the reference would make every figure in the README wrong."""
    assert native_available()
    assert NearDupFilter().fingerprinter.native and NearDupFilter().index.native  # type: ignore[attr-defined]


@settings(max_examples=300, deadline=None)
@given(bits=st.integers(0, 44), data=st.data())
def test_the_sketch_sort_sorts(bits: int, data: st.DataObject) -> None:
    """The kernel's sort of a text's kept hashes (buckets by their top bits, then insertion): sorted(), for
    any values under the bound, spread or not: few distinct ones, repeats interleaved, all at the bound,
    more than it buckets (std::sort's)."""
    top = (1 << bits) - 1
    value = st.integers(0, top)
    values = data.draw(st.one_of(
        st.lists(value, max_size=1100),
        st.lists(st.sampled_from(data.draw(st.lists(value, min_size=1, max_size=3))), max_size=1100),
        st.lists(st.just(top), max_size=40),
    ))
    assert _native.sorted_hashes(values, top) == sorted(values)


@settings(max_examples=300, deadline=None)
@given(code_points=st.lists(st.integers(0, 0x10FFFF) | st.integers(97, 122), max_size=40), n=st.integers(1, 9),
       seed=st.integers(0, 2**64 - 1))
def test_gram_hashes_on_wide_lanes_as_one_at_a_time(code_points: list[int], n: int, seed: int) -> None:
    """The n-gram hashes eight positions at a time (512-bit lanes, where the processor has them: the kernel's
    path here when `wide_lanes()`) are the one-at-a-time loop's, for any length (the rest after the last
    eight) and gram size (4 and 6 written out, the others by the general loop)."""
    assert _native.gram_hashes(code_points, n, seed, True) == _native.gram_hashes(code_points, n, seed, False)


@settings(max_examples=400, deadline=None)
@given(wide=st.booleans(), data=st.data())
def test_compiled_estimates_as_the_probe(wide: bool, data: st.DataObject) -> None:
    """The compiled sketch comparison (its merge steps without a branch) gives `Probe.estimates`' three
    figures, on 32- and 64-bit sketches: repeated values (a 32-bit sketch may hold one twice), few distinct
    values shared many times, sketches that hold their whole text or a sample of it, empty ones."""
    dtype = np.uint64 if wide else np.uint32
    top = data.draw(st.sampled_from([3, 40, 2**32 - 1] + ([2**64 - 1] if wide else [])))
    value = st.integers(0, top)
    a, b = (np.array(sorted(data.draw(st.lists(value, max_size=40))), dtype=dtype) for _ in range(2))
    size_a = data.draw(st.integers(0, 2 * len(a) + 1))
    size_b = data.draw(st.integers(0, 2 * len(b) + 1))
    assert _native.sketch_estimates(a, size_a, b, size_b) == Probe(a, size_a).estimates(b, size_b)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts=st.lists(_TEXT, max_size=12), n=st.integers(1, 7), k=st.integers(1, 64), m=st.integers(1, 9),
       target=st.integers(0, 20), seed=st.integers(0, 2**63 - 1), short_m=st.integers(1, 4),
       short_keys=st.integers(0, 30), short_text=st.integers(0, 40))
def test_kernel_hashes_as_the_numpy_reference(texts: list[str], n: int, k: int, m: int, target: int,
                                              seed: int, short_m: int, short_keys: int, short_text: int) -> None:
    done = _native.shingle(texts, n, k, m, target, seed, 0, target > 0, short_m, short_keys, short_text)
    batch = Batch(texts, max(n, m, short_m), seed)
    sketches = batch.sketches(n, k)
    assert done.sizes() == sketches.sizes
    for got, want in zip(done.sketches(), sketches.hashes, strict=True):
        assert got.dtype == np.uint32 and np.array_equal(got, want)
    assert done.exacts() == [mmh3.hash128(t.encode("utf-8", "surrogatepass"), seed=seed & 0xFFFFFFFF)
                             for t in texts]
    flat, bounds = done.mgram_keys()
    if target:  # each text's sample, then the wide m-grams of a short one
        grams, at = batch.samples(m, target)
        wide, wide_at = batch.wide_grams(short_m, short_keys)
        want = [((part >> _TAG_ROOM) | _MGRAM_TAG).tolist()
                for i in range(len(texts)) for part in (grams[at[i] : at[i + 1]], wide[wide_at[i] : wide_at[i + 1]])]
        assert flat == [key for part in want for key in part] and bounds == (at + wide_at).tolist()
    else:
        assert flat == [] and bounds == [0] * (len(texts) + 1)
    fps = done.fingerprints(texts, lambda *values: values[-1])  # the short texts' characters
    assert fps == [t if len(t) <= short_text else "" for t in texts]


@pytest.mark.parametrize("methods", [("exact", "mgram"), ("mgram", "exact"), ("mgram",), ("exact",),
                                     ("exact", "simhash", "mgram", "minhash", "sentences")])
def test_fingerprints_are_the_same_either_way(methods: tuple[str, ...]) -> None:
    texts = [orjson.loads(line).get("text", "") for line in SAMPLE.read_bytes().splitlines() if line.startswith(b"{")]
    texts = [t for t in texts if isinstance(t, str)] + ["", "ab", "x\ud800y"]
    config = FilterConfig(methods=methods)
    compiled = Fingerprinter(config, native=True).fingerprint_batch(texts)
    reference = Fingerprinter(config, native=False).fingerprint_batch(texts)
    for a, b in zip(compiled, reference, strict=True):
        assert (a.normalized, a.exact, a.size, a.keys, a.simhash, a.sentences, a.chars) == \
            (b.normalized, b.exact, b.size, b.keys, b.simhash, b.sentences, b.chars)
        assert a.sketch.dtype == b.sketch.dtype and np.array_equal(a.sketch, b.sketch)
        assert (a.minhash is None) == (b.minhash is None)
    if set(methods) <= {"exact", "mgram"}:
        hashed = Fingerprinter(config, native=True).shingle(texts)
        assert hashed.bucket_keys() == [fp.keys for fp in reference]


_EDITED = st.text(alphabet="ab你好世界\U000f0001", max_size=90) | st.text(alphabet="abcd", min_size=200, max_size=256)


@settings(max_examples=400, deadline=None)
@given(a=_EDITED, b=_EDITED, shuffled=st.booleans(), threshold=st.floats(0.3, 1.0), rnd=st.randoms())
def test_edit_measures_as_the_python_reference(a: str, b: str, shuffled: bool, threshold: float,
                                               rnd: random.Random) -> None:
    """LCS (in one 64-bit word and in several, up to the 256 characters of the longest short text) and the
    edit rule, the same characters in another order included."""
    if shuffled:
        b = "".join(rnd.sample(a, len(a)))
    assert _native.lcs_length_of(a, b) == lcs_length(a, b)
    assert _native.edit_match_of(a, b, threshold) == edit_match(a, b, threshold)


def test_hash128_is_mmh3() -> None:
    rng = random.Random(3)
    for size in [*range(40), 100, 1000]:
        data = rng.randbytes(size)
        for seed in (0, 1, 0x6E656172, 2**32 - 1):
            assert _native.hash128(data, seed) == mmh3.hash128(data, seed=seed)


# --- the table ----------------------------------------------------------------------------------------

_OPS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "lookup", "lookup", "expire", "remember"]),
        st.integers(0, 11),  # id
        st.floats(0, 60, allow_nan=False).map(lambda x: round(x, 1)),  # event time
        st.lists(st.integers(0, 14), min_size=0, max_size=6),  # keys (a few shared by many entries)
        st.integers(-1, 4),  # lookup floor
        st.integers(0, 5),  # lookup limit
        st.integers(0, 3),  # sketch
    ),
    max_size=60,
)


def _entry(id: str, ts: float, which: int) -> Entry:
    rng = np.random.default_rng(which)
    sketch = np.sort(rng.integers(0, 2**32 if which % 2 else 2**63, size=5 + which, dtype=np.uint64))
    return Entry(id, ts, which * 7919, 20 + which, sketch.astype(np.uint32) if which % 2 else sketch)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_OPS, window=st.sampled_from([5.0, 20.0, 1e9]), cap=st.integers(1, 4))
def test_compiled_table_answers_as_the_reference(ops: list[tuple], window: float, cap: int) -> None:
    """Random inserts, lookups, memos of duplicates and expiries, out of order in event time, over few
    keys (so buckets fill and the cap evicts): the compiled table and `PyTable` agree on every answer
    (memos recalled included) and every count."""
    tables = [make_table(window, cap, native=True), PyTable(window, cap)]
    for op, ident, ts, keys, floor, limit, which in ops:
        id = f"m{ident}"
        answers = []
        memo = Verdict(id, True, f"m{which}", which / 4, "mgram" if which % 2 else "exact")
        for table in tables:
            if op == "insert":
                answers.append(table.insert(_entry(id, ts, which), tuple(dict.fromkeys(keys))))
            elif op == "remember":
                answers.append(table.remember(memo, ts))
            elif op == "lookup":
                own, found = table.lookup(id, ts, tuple(keys), floor, limit)
                answers.append((table.get(own).id if own else None, table.recall(id),
                                [(table.get(seq).id, shared, key) for seq, shared, key in found]))
            else:
                answers.append(table.expire(ts))
        assert answers[0] == answers[1], (op, id, ts, keys)
    assert tables[0].stats() == tables[1].stats()
    assert [tables[0].get(s).id for s in tables[0].seqs()] == [tables[1].get(s).id for s in tables[1].seqs()]


def test_compiled_table_finds_ids_as_the_reference_as_they_come_and_go() -> None:
    """The compiled table's own map of live ids (open addressing on their hashes, grown, emptied by expiry
    with its runs moved up): thousands of ids inserted out of order, expired as the window slides, some
    inserted again; every id's live entry (or none) is `PyTable`'s at every step."""
    rng = random.Random(7)
    tables = [make_table(10.0, 4, native=True), PyTable(10.0, 4)]
    names = [f"id{i}" for i in range(1500)] + [str(i) for i in range(300)]
    for step in range(4000):
        id = rng.choice(names)
        ts = step / 100 + rng.uniform(-3, 3)
        answers = [table.insert(_entry(id, ts, step % 4), (step % 17, 100 + step % 5)) for table in tables]
        assert answers[0] == answers[1]
        if step % 250 == 0:
            for probe in rng.sample(names, 200):
                own = [table.lookup(probe, ts, (), 1, 1)[0] for table in tables]
                got = [(table.get(seq).id, table.get(seq).ts) if seq else None
                       for table, seq in zip(tables, own, strict=True)]
                assert got[0] == got[1], (step, probe)
    assert tables[0].stats() == tables[1].stats()
    assert [tables[0].get(s).id for s in tables[0].seqs()] == [tables[1].get(s).id for s in tables[1].seqs()]


def test_entries_made_by_decide_read_back_as_their_fingerprint() -> None:
    nd = NearDupFilter(native=True)
    text = "WIN a FREE iPhone now!!! call 555-0100"
    nd.check(text, id="a", ts=5.0)
    [entry] = nd.index.entries()  # type: ignore[attr-defined]
    fp = Fingerprinter(nd.config, native=False).fingerprint(text)
    assert (entry.id, entry.ts, entry.exact, entry.size) == ("a", 5.0, fp.exact, fp.size)
    assert entry.sketch.dtype == np.uint32 and np.array_equal(entry.sketch, fp.sketch)


# --- the engine ---------------------------------------------------------------------------------------


_SHORT_ZH = ["钢琴烤漆容易磨花", "房间很旧，有霉味，居然还有蟑螂！", "明天下午三点开会", "外形很漂亮，系统界面漂亮",
             "送货超快，包装完好", "散热不太好，触摸板那里温度高"]


def _perturbed_stream(seed: int, n: int) -> list[Message]:
    """The shipped sample's texts and short Chinese texts, and edited copies of them (cut, added, replaced,
    swapped characters), shuffled a little in event time: duplicates, near misses and unrelated messages."""
    rng = random.Random(seed)
    texts = [orjson.loads(line)["text"] for line in SAMPLE.read_bytes().splitlines()
             if line.startswith(b"{") and isinstance(orjson.loads(line).get("text"), str)] + _SHORT_ZH * 10
    out = []
    for i in range(n):
        t = rng.choice(texts)
        for _ in range(rng.randrange(4)):
            at = rng.randrange(len(t) + 1)
            t = rng.choice([t[:at] + rng.choice("xyz 12!很") + t[at:], t[:at] + t[at + 3 :], t[: max(at, 8)],
                            t[:at] + t[at + 2 : at + 4] + t[at : at + 2] + t[at + 4 :]])
        ident = i - 1 if i % 50 == 49 else i  # a redelivery of the message before
        out.append(Message(f"m{ident}", t, float(i + rng.choice([0, 0, 0, -30, 15]))))
    return out


_TEMPLATE = "{} corp raises quarterly qtly div {} cts vs eight cts prior pay {} record {} reuter"
_FILL = ["zayre", "nucor", "nine", "june four", "may", "march", "sorry", "in meeting", "i'll call later", "钢琴烤漆"]


@settings(max_examples=150, deadline=None)
@given(slots=st.lists(st.tuples(st.sampled_from(_FILL), st.sampled_from(_FILL), st.sampled_from(_FILL),
                                st.sampled_from(_FILL)), min_size=2, max_size=6),
       cut=st.integers(0, 90), tail=st.sampled_from(["", " (more)", " and a clause of its own", " 详询微信"]),
       threshold_long=st.sampled_from([0.5, 0.55, 0.7, 1.0]), share=st.sampled_from([0.0, 0.125, 0.3, 1.0]),
       short_text=st.sampled_from([0, 40, 70]))
def test_template_and_containment_rules_decide_as_the_reference(slots: list[tuple[str, str, str, str]], cut: int,
                                                                 tail: str, threshold_long: float, share: float,
                                                                 short_text: int) -> None:
    """`threshold_long` and `containment_slack_share` in the compiled verification (`_sketch.pxi` similarity)
    against `NearDupFilter._sketch_match`: texts of one template with other names and figures, parts of them
    with a marker or a clause of their own, long and short (the edit rule on or off)."""
    texts = [_TEMPLATE.format(*s) for s in slots]
    texts.append(texts[0][: max(cut, 1)] + tail)
    config = FilterConfig(threshold_long=threshold_long, containment_slack_share=share, short_text=short_text)
    msgs = [Message(f"m{i}", t, float(i)) for i, t in enumerate(texts)]
    compiled, reference = NearDupFilter(config, native=True), NearDupFilter(config, native=False)
    assert compiled.check_batch(msgs) == reference.check_batch(msgs)


@pytest.mark.parametrize(("window", "cap"), [(1e9, 64), (40.0, 64), (1e9, 2)])
def test_batch_in_the_table_decides_as_the_reference(window: float, cap: int) -> None:
    """The whole-batch path (`Table.decide`) against the reference engine (numpy fingerprints, PyTable,
    Python verification), over replays, late messages, a short window and a tiny bucket cap."""
    msgs = _perturbed_stream(11, 1500)
    config = FilterConfig(window=window, bucket_cap=cap)
    compiled, reference = NearDupFilter(config, native=True), NearDupFilter(config, native=False)
    assert compiled._batch_in_table and not reference._batch_in_table
    got = [v for at in range(0, len(msgs), 200) for v in compiled.check_batch(msgs[at : at + 200])]
    want = [v for at in range(0, len(msgs), 200) for v in reference.check_batch(msgs[at : at + 200])]
    assert got == want
    assert sum(v.duplicate for v in got) > 150 and sum(v.method == "replay" for v in got) > 0
    assert compiled.index.stats() == reference.index.stats()


@pytest.mark.parametrize("native", [True, False])
def test_a_replayed_duplicate_gets_its_first_verdict_though_the_cap_evicted_its_original(native: bool) -> None:
    """Redeliveries (the same id, text and event time) of messages decided up to 300 messages earlier, with a
    bucket cap of 2 that evicts representatives all the time: every replayed duplicate gets the verdict it
    got the first time (its memo), in the compiled table (`Table.decide`) and in the reference alike."""
    rng = random.Random(4)
    msgs = _perturbed_stream(13, 1500)
    stream = []
    for i, m in enumerate(msgs):
        stream.append(m)
        if i > 10 and i % 7 == 0:
            stream.append(msgs[rng.randrange(max(0, i - 300), i)])  # a redelivery of an earlier record
    nd = NearDupFilter(FilterConfig(window=1e9, bucket_cap=2), native=native)
    got = [v for at in range(0, len(stream), 100) for v in nd.check_batch(stream[at : at + 100])]
    first: dict[tuple[str, float], Verdict] = {}
    replayed = 0
    for m, v in zip(stream, got, strict=True):
        was = first.get((m.id, m.ts))
        if was is None:
            first[m.id, m.ts] = v
        elif was.duplicate:
            replayed += 1
            assert v == was, m.id
    assert replayed > 40 and nd.index.stats()["evicted_by_cap"] > 500


@pytest.mark.parametrize("verify", ["sketch", "native"])
def test_compiled_table_under_the_python_engine(verify: str) -> None:
    """Configurations the whole-batch path does not take (other methods, native verification) still use
    the compiled table through the Python engine, with the reference's verdicts."""
    msgs = _perturbed_stream(5, 600)
    config = FilterConfig(methods=("exact", "mgram", "simhash", "minhash"), verify=verify)
    compiled, reference = NearDupFilter(config, native=True), NearDupFilter(config, native=False)
    assert not compiled._batch_in_table
    assert compiled.check_batch(msgs) == reference.check_batch(msgs)


def test_memory_is_visible_to_tracemalloc_and_freed_by_the_window() -> None:
    """bench/filter_bench.py meters memory with tracemalloc: the compiled table allocates where it looks.
    Expired entries give their memory back; the bucket table keeps its size for the next ones (as a
    dict does), so a second window's worth of entries costs nothing more than the first."""
    index = MemoryIndex(10.0, 64, native=True)
    sketch = np.arange(128, dtype=np.uint32)

    def fill(ts: float, tag: str) -> None:
        for i in range(2000):
            index.insert_one(Entry(f"{tag}{i}", ts, i, 128, sketch), tuple(range(i * 16, i * 16 + 16)))

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        fill(0.0, "a")
        first = tracemalloc.get_traced_memory()[0] - before
        index.expire(100.0)
        emptied = tracemalloc.get_traced_memory()[0] - before
        fill(200.0, "b")
        second = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert first > 2000 * (128 * 8 + 16 * 8)  # at least the sketches and keys themselves
    assert len(index) == 2000 and emptied < first / 2 and second <= first * 1.05


# --- the Redis client's hot loops --------------------------------------------------------------------

# A seq names one record of the namespace (one id at one event time), as the insert's counter makes it; ids
# and event times still repeat across seqs (an id inserted again, records of one event time).
_TIMES = (990.0, 995.0, 1000.0, 1000.0, 1005.0)
_IDS = ("a", "b", "c", "ünï", "q", "x\udc80", "sixteen-bytes-id", "an id of 21 bytes, ü")  # (hashed 8 bytes at a time)
_record = st.integers(1, 60).map(lambda seq: (_TIMES[seq % 5], seq, _IDS[(seq * 7) % len(_IDS)]))


def _bucket(records: list[tuple[float, int, str]]) -> bytes | None:
    if not records:
        return None
    return b"".join(struct.pack("<dI", ts, len(b := id.encode("utf-8", "surrogatepass"))) + b + seq.to_bytes(8, "big")
                    for ts, seq, id in records)


@settings(max_examples=400, deadline=None)
@given(buckets=st.lists(st.lists(st.lists(_record, max_size=6), min_size=1, max_size=3), max_size=8),
       floor=st.integers(-1, 4), limit=st.integers(0, 5), horizon=st.sampled_from([-1e9, 994.0, 1000.0]),
       cap=st.integers(1, 4), since=st.sampled_from([-1, 0, 20, 40]), own=st.sets(st.integers(1, 60), max_size=5))
def test_rank_records_as_the_reference(buckets: list[list[list[tuple[float, int, str]]]], floor: int, limit: int,
                                       horizon: float, cap: int, since: int, own: set[int]) -> None:
    """The compiled ranking of a Redis lookup's buckets (two slices read, records in and out of the
    window, over the cap, an id twice in a bucket, the query's own id) against `rank_records`."""
    slices = max((len(b) for b in buckets), default=1)
    values = [[_bucket(b[s]) if s < len(b) else None for b in buckets] for s in range(slices)]
    positions = list(range(len(buckets)))
    args = (values, positions, "q", floor, limit, horizon, cap, since, own if since >= 0 else None)
    assert _native.rank_records(*args) == rank_records(*args)


# The compact layout's records: (event time, seq), a seq one entry (its event time fixed by it).
_compact_record = st.integers(1, 60).map(lambda seq: (_TIMES[seq % 5], seq))


def _compact_bucket(records: list[tuple[float, int]]) -> bytes | None:
    return b"".join(compact_codec.record(ts, seq) for ts, seq in records) if records else None


@settings(max_examples=400, deadline=None)
@given(buckets=st.lists(st.lists(st.lists(_compact_record, max_size=6), min_size=1, max_size=3), max_size=8),
       floor=st.integers(-1, 4), limit=st.integers(0, 5), horizon=st.sampled_from([-1e9, 994.0, 1000.0]),
       cap=st.integers(1, 4), since=st.sampled_from([-1, 0, 20, 40]), mine=st.sets(st.integers(1, 60), max_size=5),
       own=st.sampled_from([0, 1, 7, 30]))
def test_rank_compact_as_the_reference(buckets: list[list[list[tuple[float, int]]]], floor: int, limit: int,
                                       horizon: float, cap: int, since: int, mine: set[int], own: int) -> None:
    """The compiled ranking of the compact layout's buckets (two slices read, records in and out of the window,
    over the cap, a seq twice in a bucket, the query's own seq) against `compact_codec.rank_records`."""
    slices = max((len(b) for b in buckets), default=1)
    values = [[_compact_bucket(b[s]) if s < len(b) else None for b in buckets] for s in range(slices)]
    positions = list(range(len(buckets)))
    args = (values, positions, own, floor, limit, horizon, cap, since, mine if since >= 0 else None)
    assert _native.rank_compact(*args) == compact_codec.rank_records(*args)


def test_rank_compact_refuses_what_is_not_records() -> None:
    for rank in (_native.rank_compact, compact_codec.rank_records):
        with pytest.raises(IndexCorrupt):
            rank([[compact_codec.record(1.0, 1) + b"x"]], [0], 0, 1, 8, -1e9, 8, -1, None)


@settings(max_examples=300, deadline=None)
@given(key=st.integers(0, 2**64 - 1), bits=st.integers(0, 64), id=st.text(max_size=20) | st.sampled_from(["x\udc80"]))
def test_small_hashes_as_the_reference(key: int, bits: int, id: str) -> None:
    """Which small hash a bucket field and an `i<id>` field go to: the compiled twins give the reference's."""
    assert _native.small_hash(key, bits) == compact_codec.small_hash(key, bits) < 2**bits
    assert _native.id_small_hash(id, bits) == compact_codec.id_small_hash(id, bits) < 2**bits


_compact_value = st.none() | st.lists(_compact_record, min_size=1, max_size=10).map(_compact_bucket)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), n_buckets=st.integers(1, 6), n_entries=st.integers(0, 6), cap=st.integers(1, 3),
       hwm=st.sampled_from([-math.inf, 120.0, 180.0]))
def test_alone_compact_as_the_reference(data: st.DataObject, n_buckets: int, n_entries: int, cap: int,
                                        hwm: float) -> None:
    """The compiled uncontended round of the compact layout (live ids read or written earlier in the round,
    entries outside the window, buckets shared within the round, values trimmed) against
    `compact_codec.alone_round`: the same results, writes, pairs and seqs."""
    ids = data.draw(st.lists(st.sampled_from(["a", "b", "ü", "x\udc80"]), min_size=n_entries, max_size=n_entries))
    names = [b"b" + k.to_bytes(8, "big") for k in range(n_buckets)] + [compact_codec.id_field(id) for id in dict.fromkeys(ids)]
    id_at = {id: n_buckets + k for k, id in enumerate(dict.fromkeys(ids))}
    slices = (0, 1)
    columns = {s: data.draw(st.lists(_compact_value, min_size=len(names), max_size=len(names))) for s in slices}
    for s in slices:  # an i<id> holds one record
        for p in id_at.values():
            if columns[s][p] is not None:
                columns[s][p] = columns[s][p][:16]  # type: ignore[index]
    places_of = [data.draw(st.lists(st.integers(0, n_buckets - 1), unique=True, max_size=n_buckets)) for _ in ids]
    fields_of = [[names[p] for p in places] for places in places_of]
    times = [data.draw(st.sampled_from([20.0, 90.0, 150.0, 199.0])) for _ in ids]
    blobs = [b"\x03entry%d" % i for i in range(len(ids))]

    def run(round_: object) -> tuple[object, ...]:
        writes: dict[int, dict[int, bytes]] = {s: {} for s in slices}
        out = round_(list(ids), list(times), blobs, fields_of, places_of, [id_at[id] for id in ids], slices,  # type: ignore[operator]
                     {s: list(c) for s, c in columns.items()}, writes, hwm, 100.0, 100.0, cap, 40)
        return (*out, writes)

    assert run(_native.alone_compact) == run(compact_codec.alone_round)


_HELD_IDS = ["a", "b", "ü", "x\udc80", "l" * 70]


@settings(max_examples=300, deadline=None)
@given(data=st.data(), n_entries=st.integers(0, 14), cap=st.integers(1, 3), old_ids=st.booleans())
def test_held_pairs_as_the_reference(data: st.DataObject, n_entries: int, cap: int, old_ids: bool) -> None:
    """A rebuild's held fields of a slice as the pairs it writes (buckets shared, a key given twice by an entry,
    values trimmed, an id written twice, an id left to another share, values Redis holds already, ids kept or
    not, long ids): the compiled twin gives the reference's pairs, in the same order; and the shares of ids."""
    ids = data.draw(st.lists(st.sampled_from([*_HELD_IDS, None]), min_size=n_entries, max_size=n_entries))
    keys_of = [data.draw(st.lists(st.integers(0, 5) | st.integers(0, 2**64 - 1), max_size=5)) for _ in ids]
    bounds = np.cumsum([0, *map(len, keys_of)]).astype(np.int64)
    keys = np.asarray([k for keys in keys_of for k in keys], dtype=np.uint64)
    times = np.asarray([data.draw(st.sampled_from([20.0, 90.0, 150.0])) for _ in ids], dtype=np.float64)
    seqs = np.arange(1, len(ids) + 1, dtype=np.uint64) * 3
    names = [b"b" + k.to_bytes(8, "big") for k in range(6)] + [compact_codec.id_field(id) for id in _HELD_IDS]
    olds = {name: value for name in data.draw(st.lists(st.sampled_from(names), unique=True, max_size=4))
            if (value := data.draw(st.lists(_compact_record, min_size=1, max_size=10).map(_compact_bucket)))}
    args = (keys, bounds, times, seqs, ids, olds, cap, old_ids)
    assert _native.held_pairs(*args) == compact_codec.held_pairs(*args)
    bits = data.draw(st.integers(0, 8))
    assert _native.id_shares(_HELD_IDS, bits) == compact_codec.id_shares(_HELD_IDS, bits)
    taken = [data.draw(st.integers(0, 3)) for _ in ids]
    slices = [data.draw(st.integers(-1, 1)) for _ in ids]
    blobs = [b"\x03entry%d" % i for i in range(len(ids))]
    named = [id or "z" for id in ids]
    assert _native.entry_pairs(named, blobs, taken, slices) == compact_codec.entry_pairs(named, blobs, taken, slices)


def test_held_pairs_refuse_bounds_outside_the_keys() -> None:
    for held in (_native.held_pairs, compact_codec.held_pairs):
        with pytest.raises((ValueError, IndexError)):
            held(np.zeros(2, np.uint64), np.asarray([0, 3]), np.zeros(1), np.ones(1, np.uint64), ["a"], {}, 2, False)


@settings(max_examples=300, deadline=None)
@given(records=st.lists(_compact_record, max_size=12), cap=st.integers(1, 6))
def test_trim_compact_as_the_reference(records: list[tuple[float, int]], cap: int) -> None:
    value = _compact_bucket(records) or b""
    assert _native.trim_compact(value, cap) == compact_codec.trim_records(value, cap)


@settings(max_examples=300, deadline=None)
@given(records=st.lists(_record, max_size=12), cap=st.integers(0, 6))
def test_trim_slot_as_the_reference(records: list[tuple[float, int, str]], cap: int) -> None:
    """The compiled trim of a slot-layout bucket value (`alone_round` trims with it) against `trim_records`."""
    value = _bucket(records) or b""
    assert _native.trim_slot(value, cap) == redis_codec.trim_records(value, cap)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), n_buckets=st.integers(1, 6), n_entries=st.integers(0, 6), cap=st.integers(1, 3),
       hwm=st.sampled_from([-math.inf, 995.0, 1100.0]))
def test_alone_round_as_the_reference(data: st.DataObject, n_buckets: int, n_entries: int, cap: int, hwm: float) -> None:
    """The compiled uncontended round of the slot layout (live ids read or written earlier in the round, or
    written before it, entries outside the window, buckets shared within the round, values trimmed) against
    `redis_codec.alone_round`: the same results, writes, pairs and seqs."""
    ids = data.draw(st.lists(st.sampled_from(_IDS), min_size=n_entries, max_size=n_entries))
    distinct = list(dict.fromkeys(ids))
    names = [b"b" + k.to_bytes(8, "big") for k in range(n_buckets)]
    id_at = {}
    for id in distinct:  # an entry field, its memo field right after it (`plan_fields`)
        id_at[id] = len(names)
        names += [redis_codec.id_field(id), redis_codec.memo_field(id)]
    slices = (9, 10)
    entry = st.none() | st.sampled_from([900.0, 1000.0, 1080.0]).map(lambda ts: struct.pack("<Bd", 3, ts) + b"rest")
    columns: dict[int, list[bytes | None]] = {}
    for s in slices:
        columns[s] = [_bucket(data.draw(st.lists(_record, max_size=7))) for _ in range(n_buckets)]
        for _ in distinct:
            columns[s] += [data.draw(entry), None]
    earlier = {s: {p: data.draw(st.sampled_from([b"\x03", struct.pack("<Bd", 3, 1050.0)]))
                   for p in data.draw(st.lists(st.sampled_from(list(id_at.values()) or [0]), max_size=2))
                   if p in id_at.values()} for s in slices}  # entries the caller wrote since the lookup
    places_of = [data.draw(st.lists(st.integers(0, n_buckets - 1), unique=True, max_size=n_buckets)) for _ in ids]
    fields_of = [[names[p] for p in places] for places in places_of]
    times = [data.draw(st.sampled_from([950.0, 1000.0, 1040.0, 1099.0])) for _ in ids]
    blobs = [struct.pack("<Bd", 3, ts) + b"entry%d" % i for i, ts in enumerate(times)]

    def run(round_: object) -> tuple[object, ...]:
        writes = {s: dict(earlier[s]) for s in slices}
        try:
            out = round_(list(ids), list(times), blobs, fields_of, places_of, [id_at[id] for id in ids], slices,  # type: ignore[operator]
                         {s: list(c) for s, c in columns.items()}, writes, hwm, 100.0, 100.0, cap, 40,
                         redis_codec.entry_time)
        except IndexCorrupt as exc:
            return ("corrupt", str(exc))
        return (*out, writes)

    assert run(_native.alone_round) == run(redis_codec.alone_round)


_FIELD_NAME = st.one_of(st.binary(min_size=8, max_size=8).map(lambda k: b"b" + k),
                        st.binary(max_size=70).map(lambda id: b"i" + id), st.binary(max_size=12).map(lambda x: b"e" + x),
                        st.sampled_from([b"dmemo", b"n", b"b", b"i"]))


@settings(max_examples=300, deadline=None)
@given(names=st.lists(_FIELD_NAME, unique=True, max_size=30), bits=st.integers(0, 12), per=st.integers(1, 5),
       data=st.data())
def test_field_routing_as_the_reference(names: list[bytes], bits: int, per: int, data: st.DataObject) -> None:
    """Where the compact layout reads and writes a slice's fields (small hash, slice hash, the mark of a bucket
    kept there): the compiled twins give the reference's commands, places and column."""
    marked = set(data.draw(st.lists(st.sampled_from(names), max_size=3))) if names else set()
    for name in names:
        assert _native.field_hash(name, bits) == compact_codec.field_hash(name, bits)
    reads = _native.read_commands("{p:ns}:c:3", names, bits, marked, per)
    assert reads == compact_codec.read_commands("{p:ns}:c:3", names, bits, marked, per)
    replies = [[data.draw(st.none() | st.binary(max_size=4)) for _ in command[2:]] for command in reads[0]]
    column = _native.column_of(replies, reads[1], len(names))
    assert column == compact_codec.column_of(replies, reads[1], len(names))
    column += [compact_codec.MARK, b"\x00\x00", b"", None, b"\x01"]
    assert _native.marked_places(column) == compact_codec.marked_places(column)
    values = [data.draw(st.binary(max_size=80)) for _ in names]
    pairs = [x for kv in zip(names, values) for x in kv]
    entries, memos = data.draw(st.integers(0, 2)), data.draw(st.integers(0, 2))
    assert (_native.write_commands("{p:ns}:c:3", pairs, bits, marked, entries, memos, 500, per)
            == compact_codec.write_commands("{p:ns}:c:3", pairs, bits, marked, entries, memos, 500, per))
    # Packed as RESP at once: the reference's bytes (hiredis's packing of its commands), places and renewals.
    for known in (bits, None):
        packed = _native.pack_reads("{p:ns}:c:3", names, known, marked, per)
        assert packed == compact_codec.pack_reads("{p:ns}:c:3", names, known, marked, per)
    commands, places = compact_codec.read_commands("{p:ns}:c:3", names, bits, marked, per)
    assert compact_codec.pack_reads("{p:ns}:c:3", names, bits, marked, per) == (
        b"".join(hiredis.pack_command(c) for c in commands), places)
    renewed = data.draw(st.none() | st.binary(max_size=1 << max(0, bits - 3)).map(bytearray))
    written = _native.pack_writes("{p:ns}:c:3", pairs, bits, marked, entries, memos, 500, per, renewed)
    assert written == compact_codec.pack_writes("{p:ns}:c:3", pairs, bits, marked, entries, memos, 500, per, renewed)
    kept = [c for c in compact_codec.write_commands("{p:ns}:c:3", pairs, bits, marked, entries, memos, 500, per)
            if renewed is None or c[0] != "PEXPIRE" or c[1] == "{p:ns}:c:3"
            or int(c[1].rsplit(":", 1)[1]) not in _set_bits(renewed)]
    assert written[:2] == (b"".join(hiredis.pack_command(c) for c in kept), len(kept))


def _set_bits(bitset: bytearray) -> set[int]:
    return {j for j in range(8 * len(bitset)) if bitset[j >> 3] >> (j & 7) & 1}


def test_small_hashes_refuse_keys_and_bits_out_of_range() -> None:
    for small in (_native.small_hash, compact_codec.small_hash):
        for key, bits in ((-1, 4), (2**64, 4), (1, 65), (1, -1)):
            with pytest.raises(ValueError):
                small(key, bits)


def test_small_hashes_spread_keys_evenly() -> None:
    """Bucket keys share their method's tag in the top bits: the small hashes still get equal shares."""
    keys = [(4 << 60) | (i * 0x2545F4914F6CDD1D & (1 << 60) - 1) for i in range(1 << 14)]
    counts = np.bincount([compact_codec.small_hash(k, 6) for k in keys], minlength=64)
    assert counts.min() > 0.7 * len(keys) / 64 and counts.max() < 1.3 * len(keys) / 64


def test_rank_records_refuses_what_is_not_records() -> None:
    for bad in (b"short", _bucket([(1.0, 1, "a")])[:-1]):  # type: ignore[index]
        for rank in (_native.rank_records, rank_records):
            with pytest.raises(IndexCorrupt):
                rank([[bad]], [0], "q", 1, 8, -1e9, 8, -1, None)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.one_of(st.binary(max_size=40), st.text(max_size=10), st.integers(0, 2**63)),
                         min_size=1, max_size=12), min_size=1, max_size=5))
def test_pack_commands_as_hiredis(commands: list[list[object]]) -> None:
    assert _native.pack_commands(commands) == b"".join(hiredis.pack_command(tuple(c)) for c in commands)


def test_the_cli_says_when_it_runs_without_the_compiled_core(monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    import filters.index.memory
    from stream.logs import warn_if_interpreted

    warn_if_interpreted()
    assert not caplog.records
    monkeypatch.setattr(filters.index.memory, "_native", None)
    warn_if_interpreted()
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "reinstall with a C++ compiler" in caplog.records[0].getMessage()


_SPAM = ["win a free cruise call now", "your parcel waits confirm the fee", "cheap loans approved today",
         "meet singles near you tonight", "claim the prize code before noon"]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), count=st.integers(1, 40), limit=st.integers(1, 6),
       threshold=st.sampled_from([0.5, 0.8]))
def test_the_shared_loop_decides_as_the_python_reference(seed: int, count: int, limit: int, threshold: float) -> None:
    """`Table.decide_shared` against `filters.index.shared.against`'s Python loop on made-up lookups: stored
    entries that are near-duplicates of the message or not, exact copies, random shared counts, first
    keys and event times (ties), replays stored or earlier in the batch, memos (stored, or of a duplicate
    earlier in the batch), and candidate limits that truncate the merge of the batch's own candidates with
    the shared index's."""
    rng = random.Random(seed)

    def text() -> str:
        if rng.random() < 0.3:  # short Chinese texts: the 3-gram keys and the edit rule
            base = list(rng.choice(_SHORT_ZH))
            for _ in range(rng.randint(0, 2)):
                base.insert(rng.randrange(len(base) + 1), rng.choice("很也都了"))
            return "".join(base)
        base = rng.choice(_SPAM).split()
        for _ in range(rng.randint(0, 3)):
            base.insert(rng.randrange(len(base) + 1), rng.choice(["now", "sms", "promo", "stop", "today"]))
        return " ".join(base) + f" {rng.randint(0, 99)}"

    config = FilterConfig(window=1000.0, threshold=threshold, max_candidates=limit)
    engine = NearDupFilter(config, index="redis://127.0.0.1:1/0")  # never connected: only `against` runs
    assert engine.compiled
    ids = [f"m{rng.randint(0, count + 5)}" for _ in range(count)]
    messages = [Message(id, text(), 1000.0 + rng.choice([0.0, 1.0, 2.0])) for id in ids]
    fps = engine.fingerprinter.fingerprint_batch([m.text for m in messages])
    stored_texts = [text() for _ in range(8)] + [m.text for m in rng.sample(messages, min(2, count))]
    stored = [Entry.of(f"s{j}", 1000.0 - rng.choice([0.0, 5.0]), fp)
              for j, fp in enumerate(engine.fingerprinter.fingerprint_batch(stored_texts))]
    looked: list[tuple[Entry | Verdict | None, list[Candidate]]] = []
    for m, fp in zip(messages, fps):
        roll = rng.random()
        own = rng.choice(stored) if roll < 0.05 else Verdict(m.id, True, "s0", 0.5, "mgram") if roll < 0.1 else None
        cands = [Candidate(entry, rng.randint(0, len(fp.keys)), rng.choice(fp.keys))
                 for entry in rng.sample(stored, rng.randint(0, 4))]
        looked.append((own, cands))
    results = []
    for compiled in (True, False):
        engine.compiled = compiled
        verdicts, pending, remembered = against(engine, messages, fps, looked)
        results.append((verdicts, sorted(pending), [e.id for _, e in sorted(pending.items())], remembered))
    assert results[0] == results[1]


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 160), wide=st.booleans(), simhash=st.none() | st.integers(0, 2**64 - 1),
       minhash=st.none() | st.integers(0, 8), sentences=st.lists(st.integers(0, 2**64 - 1), max_size=3),
       exact=st.integers(0, 2**128 - 1), size=st.integers(0, 2**32 - 1), ts=st.floats(-1e9, 1e11),
       cut=st.integers(0, 60), version=st.integers(0, 4), flags=st.integers(0, 255), mangle=st.booleans(),
       chars=st.text(max_size=12), old=st.booleans(), spread=st.sampled_from([2**32, 2**20, 64]),
       flip=st.integers(0, 400))
def test_stored_entries_decode_as_the_python_reference(n: int, wide: bool, simhash: int | None, minhash: int | None,
                                                       sentences: list[int], exact: int, size: int, ts: float,
                                                       cut: int, version: int, flags: int, mangle: bool,
                                                       chars: str, old: bool, spread: int, flip: int) -> None:
    """`decode_entries` reads the common forms (a uint32 sketch, packed or not, perhaps a short text's
    characters, nothing else; version 3 or 2) itself and hands every other form, and anything malformed
    (short, other version or flags, wrong length, a packing this neardup does not write, characters that are
    not UTF-8), to the Python decoder: the same entries, or the same `IndexCorrupt`."""
    rng = np.random.default_rng(n)
    sketch = np.sort(rng.integers(0, 2**32 if not wide else 2**63, n, dtype=np.uint64))
    if not wide and spread < 2**32:  # values close together (repeats: not packed), or a few bits apart
        sketch = np.sort(rng.integers(0, spread, n, dtype=np.uint64))
    entry = Entry("e-1", ts, exact, size, sketch if wide else sketch.astype(np.uint32), simhash,
                  None if minhash is None else rng.integers(0, 2**32, minhash, dtype=np.uint64).astype(np.uint32),
                  frozenset(sentences), chars)
    blob = (encode_entry_v2 if old else encode_entry)(entry)
    if mangle:  # a header, length or bit that this neardup did not write
        at = 29 if old else 25
        blob = bytes([version]) + blob[1:at] + bytes([flags]) + blob[at + 1 :]
        blob = blob[: max(0, len(blob) - cut)] if cut % 2 else blob + bytes(cut)
    elif flip and flip < 8 * len(blob) and not old:
        blob = bytearray(blob)
        blob[flip // 8] ^= 1 << (flip % 8)
        blob = bytes(blob)
    try:
        want = decode_entry(blob, "e-1")
    except IndexCorrupt:
        with pytest.raises(IndexCorrupt):
            _native.decode_entries(["e-1"], [blob], Entry, decode_entry)
        return
    got = _native.decode_entries(["e-1", "gone"], [blob, None], Entry, decode_entry)
    assert list(got) == ["e-1"]
    assert_same_entry(got["e-1"], want)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 160), wide=st.booleans(), simhash=st.none() | st.integers(0, 2**64 - 1),
       minhash=st.none() | st.integers(0, 8), sentences=st.lists(st.integers(0, 2**64 - 1), max_size=3),
       exact=st.integers(0, 2**128 - 1), size=st.integers(0, 2**32 - 1), ts=st.floats(allow_nan=False),
       chars=st.text(max_size=12))
def test_entries_encode_as_the_python_reference(n: int, wide: bool, simhash: int | None, minhash: int | None,
                                                sentences: list[int], exact: int, size: int, ts: float,
                                                chars: str) -> None:
    rng = np.random.default_rng(n)
    sketch = np.sort(rng.integers(0, 2**32 if not wide else 2**63, n, dtype=np.uint64))
    entry = Entry("e-1", ts, exact, size, sketch if wide else sketch.astype(np.uint32), simhash,
                  None if minhash is None else rng.integers(0, 2**32, minhash, dtype=np.uint64).astype(np.uint32),
                  frozenset(sentences), chars)
    assert _native.encode_entries([(entry, ()), (entry, (1,))], encode_entry) == [encode_entry(entry)] * 2


def test_characters_that_are_not_utf8_are_refused_as_by_the_python_reference() -> None:
    blob = encode_entry(Entry("e", 1.0, 3, 2, np.zeros(2, dtype=np.uint32), chars="ab"))[:-2] + b"\xff\xfe"
    for decode in (lambda: decode_entry(blob, "e"), lambda: _native.decode_entries(["e"], [blob], Entry, decode_entry)):
        with pytest.raises(IndexCorrupt, match="UTF-8"):
            decode()


def test_an_entry_outside_the_stored_ranges_is_refused_as_by_the_python_reference() -> None:
    for exact, size in ((-1, 3), (1 << 128, 3)):
        entry = Entry("e", 1.0, exact, size, np.zeros(2, dtype=np.uint32))
        with pytest.raises(ValueError):
            _native.encode_entries([(entry, ())], encode_entry)


# Keys from a few values (so queries share fields), the extremes, and values that differ only in the low
# bits (the top bits pick the table slot: they collide there).
_KEY = st.one_of(st.integers(0, 7), st.sampled_from([0, 2**64 - 1, 2**63]), st.integers(0, 2**64 - 1),
                 st.integers(0, 255).map(lambda low: (2 << 60) | low))


@settings(max_examples=300, deadline=None)
@given(keys_of=st.lists(st.lists(_KEY, max_size=30).map(tuple), max_size=40),
       ids=st.lists(st.sampled_from([b"ea", b"eb", b"ec", b"b\x00"]), max_size=40))
def test_plan_fields_as_the_python_reference(keys_of: list[tuple[int, ...]], ids: list[bytes]) -> None:
    from filters.index.redis_codec import plan_fields

    assert _native.plan_fields(keys_of, ids) == plan_fields(keys_of, ids)


_RESTORED = st.lists(st.tuples(st.sampled_from(["a", "b", "c", "ü", "x\udcff", "d"]),  # ids (replays among them)
                                st.sampled_from([0.0, 5.0, 99.5, 100.0, 150.0, 220.0]),  # times: 3 slices of 100
                                st.lists(_KEY, max_size=6)), max_size=30)


@settings(max_examples=300, deadline=None)
@given(entries=_RESTORED, held_ids=st.sets(st.sampled_from(["a", "c"])), held_keys=st.lists(_KEY, max_size=6),
       old=st.lists(st.tuples(st.floats(0, 300), st.integers(1, 99)), max_size=20), hwm=st.sampled_from([-1e18, 120.0]),
       cap=st.integers(1, 3), seq=st.integers(0, 9))
def test_restore_round_as_the_python_reference(entries: list[tuple[str, float, list[int]]], held_ids: set[str],
                                               held_keys: list[int], old: list[tuple[float, int]], hwm: float,
                                               cap: int, seq: int) -> None:
    """What a restore writes for a chunk (`restore_round`), compiled and in Python: live ids held or written
    earlier in the chunk, entries out of the window, keys given twice, fields that hold records (trimmed
    past twice the cap), several slices."""
    from filters.index.redis_codec import field_of, restore_round

    times = [ts for _, ts, _ in entries]
    slices = [int(ts // 100) for ts in times]
    bounds = [0]
    for _, _, keys in entries:
        bounds.append(bounds[-1] + len(keys))
    keys = [k for _, _, ks in entries for k in ks]
    blobs = [bytes([2]) + struct.pack("<d", ts) + bytes(33) for ts in times]
    records = _bucket([(ts, n, "o") for ts, n in old])
    held: dict[int, dict[bytes, bytes]] = {s: {} for s in set(slices)}
    for s, values in held.items():
        values.update({b"e" + id.encode(): bytes([2]) + struct.pack("<d", 100.0 * s) + bytes(33) for id in held_ids})
        if records is not None:
            values.update({field_of(k): records for k in held_keys})
    ids = [id for id, _, _ in entries]
    want = restore_round(ids, times, slices, bounds, keys, blobs, held, hwm, 100.0, cap, seq)
    got = _native.restore_round(ids, np.array(times), np.array(slices, np.int64), np.array(bounds, np.int64),
                                np.array(keys, np.uint64), blobs, held, hwm, 100.0, cap, seq)
    assert got == want


@settings(max_examples=300, deadline=None)
@given(entries=_RESTORED, stored=st.dictionaries(st.sampled_from(["a", "c", "ü"]), st.sampled_from([0.0, 60.0, 150.0])),
       hwm=st.sampled_from([-math.inf, 120.0]), cap=st.integers(1, 3), seq=st.integers(0, 9),
       old=st.lists(st.tuples(st.floats(0, 300), st.integers(1, 99)), max_size=8), old_keys=st.lists(_KEY, max_size=4))
def test_a_rebuilds_writes_as_the_python_reference(entries: list[tuple[str, float, list[int]]], stored: dict[str, float],
                                                   hwm: float, cap: int, seq: int, old: list[tuple[float, int]],
                                                   old_keys: list[int]) -> None:
    """What a rebuild writes (`restore_accept`, `newest_records`, `bucket_pairs`, `bucket_commands`: the latter
    as `pack_commands` packs the former), compiled and in Python: ids
    stored before (live or not), replays, entries out of the window, keys given twice, busy keys past the cap,
    a flush in two parts (what the first kept, then a later chunk's records: still in insertion order), and
    values held before (their records first, trimmed with the new ones)."""
    from filters.index.redis_codec import bucket_commands, bucket_pairs, newest_records, restore_accept

    ids = [id for id, _, _ in entries]
    times = np.array([ts for _, ts, _ in entries])
    live, theirs = dict(stored), dict(stored)
    want = restore_accept(ids, times, live, hwm, 100.0, seq)
    got = _native.restore_accept(ids, times, theirs, hwm, 100.0, seq)
    assert got[0].tolist() == want[0].tolist() and got[1:] == want[1:] and theirs == live
    took = np.flatnonzero(want[0])
    keys = np.array([k for i in took.tolist() for k in entries[i][2]], np.uint64)
    numbers = np.array([n for n, i in enumerate(took.tolist()) for _ in entries[i][2]], np.int64)
    e_times, e_seqs = times[took], want[0][took]
    half = len(keys) // 2  # the first half kept (as a compaction does), then the rest after it
    first = newest_records(keys[:half], numbers[:half], e_times, e_seqs, cap)
    assert _native.newest_records(keys[:half], numbers[:half], e_times, e_seqs, cap).tolist() == first.tolist()
    keys = np.concatenate([keys[:half][first], keys[half:]])
    numbers = np.concatenate([numbers[:half][first], numbers[half:]])
    order = newest_records(keys, numbers, e_times, e_seqs, cap)
    assert _native.newest_records(keys, numbers, e_times, e_seqs, cap).tolist() == order.tolist()
    id_bytes = [ids[i].encode("utf-8", "surrogatepass") for i in took.tolist()]
    id_ends = np.cumsum([len(b) for b in id_bytes], dtype=np.int64)
    records = _bucket([(ts, n, "o") for ts, n in old])
    olds = {k: records for k in old_keys} if records is not None else {}
    args = (keys[order], numbers[order], e_times, e_seqs, b"".join(id_bytes), id_ends, olds, cap)
    pairs = bucket_pairs(*args)
    assert _native.bucket_pairs(*args) == pairs
    for per_call in (1, 2, 5):
        packed = bucket_commands(b"{p:ns}:s:1", *args, per_call)
        assert _native.bucket_commands(b"{p:ns}:s:1", *args, per_call) == packed
        commands = [("HSET", b"{p:ns}:s:1", *pairs[a : a + 2 * per_call]) for a in range(0, len(pairs), 2 * per_call)]
        assert packed == (_native.pack_commands(commands) if commands else b"", len(commands))


# Field names from a small pool (so the batches share some), with equal names as distinct objects too.
_NAME_POOL = [b"b" + bytes([i]) * 8 for i in range(24)] + [b"ea", b"eb", b"ec"]


@settings(max_examples=300, deadline=None)
@given(names=st.lists(st.sampled_from(_NAME_POOL), unique=True, max_size=27),
       written_names=st.lists(st.sampled_from(_NAME_POOL), unique=True, min_size=1, max_size=27),
       data=st.data())
def test_overlay_writes_as_the_python_reference(names: list[bytes], written_names: list[bytes],
                                                data: st.DataObject) -> None:
    """The next batch's columns read ahead get the last batch's written values by field name, in the
    slices kept: the compiled overlay puts exactly what the Python one puts, and nothing else."""
    from filters.index.redis_codec import overlay_writes

    slices = data.draw(st.lists(st.integers(0, 3), unique=True, min_size=1, max_size=3))
    written = {s: data.draw(st.dictionaries(st.integers(0, len(written_names) - 1),
                                            st.binary(min_size=1, max_size=4), max_size=len(written_names)))
               for s in data.draw(st.lists(st.integers(0, 3), unique=True, max_size=4))}
    columns = {s: data.draw(st.lists(st.one_of(st.none(), st.binary(max_size=4)), min_size=len(names),
                                     max_size=len(names))) for s in slices}
    copies = [bytes(bytearray(name)) for name in written_names]  # equal, not the same objects
    compiled = [(s, list(columns[s])) for s in slices]
    reference = [(s, list(columns[s])) for s in slices]
    _native.overlay_writes(list(names), copies, compiled, written)
    overlay_writes(list(names), list(written_names), reference, written)
    assert compiled == reference


def test_plan_fields_refuses_a_key_outside_64_bits() -> None:
    with pytest.raises(OverflowError):
        _native.plan_fields([(1, 2**64)], [b"ea"])
    with pytest.raises(OverflowError):
        _native.plan_fields([(-1,)], [b"ea"])


def test_frozen_makes_what_the_class_makes() -> None:
    """`_native.Frozen(cls)(*values)` is `cls(*values)`: equal, same repr and hash, still frozen."""
    from filters.engine import Message, Verdict
    from filters.fingerprint import Fingerprint
    from filters.index import Query
    from stream.codec import Decoded
    from stream.kafka_tools import KafkaRecord
    from stream.outputs import OutRecord
    from stream.runner import RawRecord, Routed

    sketch = np.array([3, 9], dtype=np.uint32)
    cases = [
        (Verdict, ("a", True, "b", 0.75, "mgram")), (Query, ("a", 1.5, (1, 2), 2)), (Message, ("a", "text", 2.0)),
        (Candidate, (Entry("e", 1.0, 7, 2, sketch, None, None, frozenset()), 3, 1 << 61)),
        (Decoded, (Message("a", "t", 1.0), {"text": "t"})), (RawRecord, (b"{}", "7", 1.0, None)),
        (RawRecord, (b"{}", "7", 1.0, Decoded(Message("7", "t", 1.0), {"text": "t"}))),
        (Routed, ("unique", RawRecord(b"{}", "7", 1.0), None, Verdict("a", False), None)),
        (KafkaRecord, ("in", 0, 5, 1_700_000_000_000, b"k", b"v", (("h", b"x"),), None)),
        (KafkaRecord, ("in", 0, 5, 1_700_000_000_000, b"k", b"v", (), RawRecord(b"v", "in/0/5", 1.7e9))),
        (OutRecord, ("unique", None, b"v", (("neardup-verdict", b"unique"),))),
    ]
    for cls, values in cases:
        made, reference = _native.Frozen(cls)(*values), cls(*values)
        assert type(made) is cls and made == reference and repr(made) == repr(reference)
        if cls.__hash__ is not None and cls is not Decoded:
            assert hash(made) == hash(reference)
        for obj in (made, reference):  # (Python 3.11's slotted frozen __setattr__ raises a TypeError of its own)
            with pytest.raises((dataclasses.FrozenInstanceError, TypeError)):
                obj.id = "other"  # type: ignore[misc, union-attr]
    made = _native.Frozen(Fingerprint)("n", 1 << 100, 2, sketch, (1,), None, None, frozenset(), "n")
    assert [getattr(made, f.name) is not None for f in dataclasses.fields(Fingerprint)][:5] == [True] * 5
    with pytest.raises(TypeError):
        _native.Frozen(Verdict)("a", True)  # defaults are not filled in: every value, in order


def test_frozen_refuses_what_its_init_does_more_for() -> None:
    @dataclasses.dataclass(frozen=True)
    class NoSlots:
        a: int

    @dataclasses.dataclass(slots=True)
    class NotFrozen:
        a: int

    @dataclasses.dataclass(frozen=True, slots=True)
    class Checked:
        a: int

        def __post_init__(self) -> None:
            raise AssertionError

    @dataclasses.dataclass(frozen=True, slots=True)
    class WithInitVar:
        a: int
        b: dataclasses.InitVar[int] = 0

    @dataclasses.dataclass(frozen=True, slots=True)
    class NotInInit:
        a: int
        b: int = dataclasses.field(init=False, default=0)

    for cls in (NoSlots, NotFrozen, Checked, WithInitVar, NotInInit, int, tuple):
        with pytest.raises(TypeError):
            _native.Frozen(cls)


def test_without_the_compiled_core_the_pipeline_routes_as_with_it() -> None:
    """An install without a C++ compiler has no `filters._native`: every record maker falls back to its
    class and the engine to its reference. Run in a fresh interpreter where the import fails, the sample
    routes exactly as here."""
    import subprocess
    import sys

    script = (
        "import sys, json; sys.modules['filters._native'] = None\n"
        "from filters import records, index; assert records.maker(index.Entry) is index.Entry\n"
        "from filters.engine import NearDupFilter; from stream.codec import RecordFormat\n"
        "from stream.runner import RawRecord, route_batch\n"
        f"lines = open({str(SAMPLE)!r}, 'rb').read().splitlines()\n"
        "nd = NearDupFilter(); assert not nd.fingerprinter.native\n"
        "rows = route_batch(nd, [RawRecord(l, str(i), 0.0) for i, l in enumerate(lines)], RecordFormat())\n"
        "print(json.dumps([[r.kind, r.verdict and r.verdict.duplicate_of] for r in rows]))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False,
                          cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    from stream.codec import RecordFormat
    from stream.runner import RawRecord, route_batch

    lines = SAMPLE.read_bytes().splitlines()
    nd = NearDupFilter()
    assert nd.fingerprinter.native
    rows = route_batch(nd, [RawRecord(line, str(i), 0.0) for i, line in enumerate(lines)], RecordFormat())
    assert orjson.loads(done.stdout) == [[r.kind, r.verdict and r.verdict.duplicate_of] for r in rows]


# -- normalization's compiled stages (filters/_normalize.pxi) against the numpy tables ---------------------

# Random texts with what each step acts on: emoji, zero-width and control characters, full-width forms,
# Cyrillic/Greek look-alikes, digits, URLs, e-mails, Han (traditional too), pinyin runs, spaced-out leet.
_NORM_PIECES = st.sampled_from([
    *"ab lIi1059@$!.-_/:wthpcomru\n\t", "https://x.co/a", "www.", ".com", "me@x.io", "\x1e", "\u200b", "\u200d",
    "\ufe0f", "\u0301", "\u0323", "\u05bc", "\u3099", "ß", "ẞ", "Г", "Σ", "ς", "ϲ", "р", "ｆ", "Ｆ", "１", "①", "ℹ",
    "🈶", "媽", "在", "转", "发", "微博", "shanghai", "fa", "lai", "😀", "🎉", "\U000f0002", "\ud800", "한",
    "f r 3 3", "p @ y", "  ", "ǅ", "ﬁ", "㎏", "\U00020000", "\U000e0041", "啊", "吧", "哈哈", "诶", "喲", "ba",
    "(more)", "...[cont]", "…全文", "（未完）", "【cont】", " ", "\u3000",
])
_NORM_TEXTS = st.lists(st.one_of(st.text(max_size=8), st.text(alphabet=st.characters(), max_size=4), _NORM_PIECES),
                       max_size=14).map("".join)
_NORM_OPTIONS = [NormalizeOptions(), *(NormalizeOptions().with_steps(**{s: False})
                                       for s in ("nfkc", "strip_accents", "confusables", "traditional_to_simplified",
                                                 "casefold", "mask_urls", "leet", "mask_numbers", "pinyin")),
                 NormalizeOptions().with_steps(nfkc=False, strip_accents=False),
                 NormalizeOptions().with_steps(strip_separators=False)]  # not fused: the steps, both ways


@given(texts=st.lists(_NORM_TEXTS, max_size=12))
def test_marker_candidates_as_the_reference(texts: list[str]) -> None:
    """The texts `strip_markers` looks at (last or first character one a marker can end or start with)."""
    from filters.normalize import EDGE_FIRST, EDGE_LAST, marker_candidates

    assert _native.marker_candidates(texts, EDGE_LAST, EDGE_FIRST) == marker_candidates(texts)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts=st.lists(_NORM_TEXTS, max_size=8), options=st.sampled_from(_NORM_OPTIONS))
def test_compiled_normalization_as_the_numpy_reference(texts: list[str], options: NormalizeOptions) -> None:
    compiled, reference = Normalizer(options, native=True), Normalizer(options, native=False)
    assert (compiled._core is not None) == _fusable(options)
    want = reference.normalize_batch(texts)
    assert compiled.normalize_batch(texts) == want
    assert [compiled(t) for t in texts] == want == [reference(t) for t in texts]


def test_compiled_stages_map_every_code_point_as_the_tables() -> None:
    """Stage 1 with the decomposition (asked per code point met: `_decomposed`) against NFKD of the whole text and
    the tables, and stage 3 (`\\w` as Py_UNICODE_ISALNUM), over all of Unicode in order (combining marks next to
    each other, which the whole text's NFKD reorders)."""
    options = NormalizeOptions()
    core = Normalizer(options, native=True)._core
    reference = Normalizer(options, native=False)
    tables = _stages(options)
    every = "".join(map(chr, range(0x110000)))
    assert core.chars(every) == reference._chars_batch(every, tables)
    for o in _NORM_OPTIONS:  # and by each option's own decomposition, where the stages are fused
        if _fusable(o):
            assert Normalizer(o, native=True)._core.chars(every) == Normalizer(o, native=False)._chars_batch(
                every, _stages(o))
    texts, touching = core.words(every)
    want, want_touching = reference._words_batch(every, tables)
    assert "\x1e".join(texts) == want and set(touching) == want_touching


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=st.sampled_from([*" \n\x1eab1@$!_.z9", "é", "\u3000", "😀"]), max_size=40))
@example("\x1e1 1 1")  # the joiner starts a run (the scan's first test once let only a space or line break)
@example("😀" + "q" * 20 + "\x1e1 1 1 z")  # the same in the 16-wide scan of a 4-byte text
def test_spaced_runs_are_where_the_pattern_matches(text: str) -> None:
    assert _native.spaced_runs(text) == [(m.start() - 1, m.end() - 1) for m in _SPACED().finditer(" " + text)]


# What the number/leet pattern looks at: digits (look-alike or not), letters and units, the separators between
# them (`_` among them), the batch joiner, `$`, other scripts' letters and digits (\\w but not [a-z0-9]).
_NUMBER_PIECES = st.sampled_from([*"0123456789abelostxyzA_ -.,\n\x1e$@!é中٣²", "pm", "mins", "kg", "nd", "1x", "ghz",
                                  "  ", "   ", "    ", "😀", "\U0001e802"])


@settings(max_examples=1000, deadline=None)
@given(text=st.lists(_NUMBER_PIECES, max_size=30).map("".join), mask=st.booleans())
def test_numbers_or_leet_as_the_pattern(text: str, mask: bool) -> None:
    """The compiled scan of numbers against `_number_or_leet().sub`: every alternative of the pattern (leet after a
    letter, look-alike runs, word starts but units, one-letter tokens), masked or kept."""
    want = _number_or_leet().sub(_leet_or_mask if mask else _leet_or_keep, text)
    assert _native.numbers_or_leet(text, mask, _UNITS) == want


_URL_PIECES = st.sampled_from([*"ab.-+_@ :/\x1e\u3000\u00a0é中1", "://", "www.", "http", "https", "ftp", "x@y.z", "..",
                               "@@", "😀", "\U0001e802", "com", "co", "comx", "uk", "a.io", "ru/x", "-"])


@settings(max_examples=1000, deadline=None)
@given(text=st.lists(_URL_PIECES, max_size=24).map("".join))
def test_url_and_email_spans_are_where_the_patterns_match(text: str) -> None:
    """The compiled scans of `_SCHEME_URL`, `_EMAIL` and `_BARE_DOMAIN`: schemes with and without something after
    them, any whitespace ending one (Unicode's, the batch joiner), addresses back to back, local parts shared by
    two @, domains whose last labels are no TLD (backing off a label), TLDs inside words, paths."""
    assert _native.scheme_url_spans(text) == [m.span() for m in _SCHEME_URL().finditer(text)]
    assert _native.email_spans(text) == [m.span() for m in _EMAIL().finditer(text)]
    assert _native.domain_spans(text, _TLD_WORDS) == [m.span() for m in _BARE_DOMAIN().finditer(text)]


# What the word stage acts on, packed close together: schemes, addresses, domains and paths, spaced-out runs
# (one, two and three spaces apart), `!@$` between letters and digits, numbers with units and separators, the
# placeholders themselves, and characters that put a text among the decomposed ones or widen it.
_WORD_STAGE_PIECES = st.sampled_from([
    *"ab1l0$@!.:/- \n_", "https://", "http://x", "ftp://", "www.", "x.co", ".com/p", "me@x.io", "a.b@c.uk",
    "f r 3 3", "c 4 $ h", "p @ y", "w i n  n o w", "  ", "   ", "fr33", "he11o", "10pm", "3mins", "2nd", "555-0100",
    "$100", "ca$h", "pr!ze", "w@17", "\U0001e802", "\U0001e800", "é", "Ａ", "在", "转fa", "😀", "\u200b", "ß",
])
_WORD_STAGE_TEXTS = st.lists(_WORD_STAGE_PIECES, max_size=16).map("".join)


# Latin runs and pinyin syllable codes side by side: syllables that split one way or several, letters that are
# no pinyin, runs longer than the pattern's 40, other characters between.
_LATIN_PINYIN_PIECES = st.sampled_from([
    "fa", "xian", "fangan", "minguo", "zhongguo", "ni", "hao", "abc", "q", "x" * 45, "nihao" * 9, " ", "A", "转", "1",
    *(chr(_PINYIN_CODE + j) for j in (0, 1, 7, 0xFFF)), chr(_PINYIN_CODE + 0x1000), chr(_PINYIN_CODE - 1),
])


@settings(max_examples=400, deadline=None)
@given(texts=st.lists(st.lists(_LATIN_PINYIN_PIECES, max_size=12).map("".join), max_size=8))
def test_compiled_latin_pinyin_as_the_reference(texts: list[str]) -> None:
    """`_native.latin_pinyin` (what the compiled stages call) is `Normalizer._latin_pinyin` (a pattern and a Python
    call per run), text by text, with the memo of splits filled by either and shared."""
    compiled, reference = Normalizer(native=True), Normalizer(native=False)
    for text in texts:
        got = _native.latin_pinyin(text, compiled._segmented, compiled._split_run, _PINYIN_CODE, _PINYIN_CODE + 0x1000)
        assert got == reference._latin_pinyin(text)
        assert got == compiled._latin_pinyin(text)  # (its memo as the compiled one left it)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts=st.lists(_WORD_STAGE_TEXTS, max_size=6), options=st.sampled_from(_NORM_OPTIONS))
def test_compiled_word_stage_as_the_patterns(texts: list[str], options: NormalizeOptions) -> None:
    """The compiled stages text by text (`NormalizeStages.each`) against the reference's patterns on the joined
    batch: masks next to spaced-out runs, leet symbols and numbers,
    each stage on the output of the one before, with each option of the word stage on and off."""
    compiled, reference = Normalizer(options, native=True), Normalizer(options, native=False)
    assert compiled.normalize_batch(texts) == reference.normalize_batch(texts)


def test_the_stages_of_a_text_called_while_another_writes_have_buffers_of_their_own() -> None:
    """`each` keeps its buffers from batch to batch, as `chars` does: a call made meanwhile (from `stage1`, which
    is Python) writes to buffers of its own."""
    from filters import charmaps

    inner: list[tuple[list[str], list[int], list[int]]] = []

    def stage1(cp: int) -> str:
        if cp == ord("é") and not inner:
            inner.append(stages.each(["w i n 5 x.co"]))
        return chr(cp)

    stages = _native.NormalizeStages(stage1, True, True, charmaps.PINYIN_CODES, charmaps.PINYIN_BASE, True, True,
                                     _UNITS, _TLD_WORDS)
    assert stages.each(["ab cd" * 1000, "é 1"]) == (["abcd" * 1000, "é\U0001e802"], [], [])
    assert inner == [(["win\U0001e802\U0001e800"], [], [])] == [stages.each(["w i n 5 x.co"])]  # (5 before no letter)
    assert stages.each(["x 1", "", " !", "a\x1eb"]) == (["xi", "", "", "ab"], [], [2])  # the kept buffers lent again


def test_normalization_matches_the_reference_on_the_sample() -> None:
    texts = [orjson.loads(line).get("text", "") for line in SAMPLE.read_bytes().splitlines() if line.startswith(b"{")]
    assert Normalizer(native=True).normalize_batch(texts) == Normalizer(native=False).normalize_batch(texts)


def test_a_stage_called_while_another_writes_has_a_buffer_of_its_own() -> None:
    """The compiled stages write to a buffer kept from batch to batch; `stage1` is Python, so a stage may be
    called (on another string) while one is writing: it must not write over the first one's output."""
    from filters import charmaps

    inner: list[str] = []

    def stage1(cp: int) -> str:
        if cp == ord("é") and not inner:
            inner.append(stages.chars("xyz" * 1000))
        return chr(cp).upper()

    stages = _native.NormalizeStages(stage1, True, True, charmaps.PINYIN_CODES, charmaps.PINYIN_BASE)
    assert stages.chars("abc" * 1000 + "é" + "def") == "ABC" * 1000 + "É" + "DEF"
    assert inner == ["XYZ" * 1000]
    assert stages.chars("abcé") == "ABCÉ"  # and the kept buffer is lent again afterwards


_REPLY = st.one_of(st.none(), st.binary(max_size=4), st.integers(-5, 5),
                   st.lists(st.none() | st.binary(max_size=3), max_size=3),
                   st.sampled_from([ValueError("x"), KeyError("y")]))


class _Fatal(Exception):
    """A reply of the kind a reader raises at once (redis-py's `ConnectionError` replies: LOADING)."""


@given(replies=st.lists(_REPLY | st.just(_Fatal("loading")), max_size=12), gaps=st.lists(st.integers(0, 3), max_size=12))
def test_replies_gathered_and_their_first_error_as_the_reference(replies: list[object], gaps: list[int]) -> None:
    """Every layout's reading of replies (a reader that has none yet now and then, a fatal reply raised at once)
    and the compact layout's check for an error reply among them: the compiled twins give the reference's
    replies, calls, raised reply and error."""
    fatal = next((at for at, r in enumerate(replies) if isinstance(r, _Fatal)), None)
    for gather in (_native.gather_replies, redis_codec.gather_replies):
        not_enough = object()
        script = [r for at, reply in enumerate(replies) for r in [not_enough] * (gaps[at] if at < len(gaps) else 0)
                  + [reply]]
        feed: Iterator[object] = iter(script)
        reads: list[int] = []
        if fatal is None:
            got = gather(feed.__next__, functools.partial(reads.append, 1), len(replies), not_enough, _Fatal)
            assert got == replies and len(reads) == len(script) - len(replies)
        else:
            with pytest.raises(_Fatal) as raised:
                gather(feed.__next__, functools.partial(reads.append, 1), len(replies), not_enough, _Fatal)
            assert raised.value is replies[fatal]
            assert next(feed, None) is (script[script.index(replies[fatal]) + 1]
                                        if script.index(replies[fatal]) + 1 < len(script) else None)
    kept = [r for r in replies if not isinstance(r, _Fatal)]
    first = compact_codec.first_error(kept)
    assert _native.first_error(kept) is first
    assert first is next((r for r in kept if isinstance(r, Exception)), None)


# Ranking buffers an index keeps from lookup to lookup: shared by every example below, so that each ranks with
# buffers an earlier one grew and stamped.
_KEPT_SCRATCH = _native.rank_scratch()


@settings(max_examples=200, deadline=None)
@given(data=st.data(), n_buckets=st.integers(1, 6), n_queries=st.integers(1, 4), n_slices=st.integers(1, 2),
       limit=st.integers(1, 6), cap=st.integers(1, 4))
def test_rank_all_compact_as_the_reference(data: st.DataObject, n_buckets: int, n_queries: int, n_slices: int,
                                           limit: int, cap: int) -> None:
    """A compact lookup's per-query work in one call (own entry by `i<id>` inside the window, else the memo,
    then the ranking): the compiled twin gives `compact_codec.rank_all`'s answers, and its refusal of an id
    value that is not one record."""
    ids = [f"q{q}" for q in range(n_queries)]
    own = st.none() | _compact_record.map(lambda r: compact_codec.record(*r))
    columns = []
    for _ in range(n_slices):
        column = [data.draw(_compact_value) for _ in range(n_buckets)]
        for _ in ids:
            column += [data.draw(own), data.draw(st.none() | st.binary(min_size=1, max_size=6))]
        columns.append(column)
    positions = [data.draw(st.lists(st.integers(0, n_buckets - 1), min_size=1, max_size=n_buckets, unique=True))
                 for _ in ids]
    id_places = [n_buckets + 2 * q for q in range(n_queries)]
    floors = [data.draw(st.integers(1, 3)) for _ in ids]
    horizons = [data.draw(st.sampled_from(_TIMES)) - 0.5 for _ in ids]

    def memo_time(blob: bytes, id: str) -> float:
        return float(len(blob) + len(id))

    args = (columns, positions, id_places, ids, floors, limit, horizons, cap, memo_time)
    assert _native.rank_all_compact(*args) == compact_codec.rank_all(*args)
    assert _native.rank_all_compact(*args, scratch=_KEPT_SCRATCH) == compact_codec.rank_all(*args)
    columns[0][id_places[0]] = compact_codec.record(1.0, 1) + b"x"
    for rank in (_native.rank_all_compact, compact_codec.rank_all):
        with pytest.raises(IndexCorrupt):
            rank(*args)
