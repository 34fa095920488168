"""Property tests (hypothesis): determinism across processes, duplicates of identical normalized texts,
symmetric similarity, and that nothing raises on arbitrary text or bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import orjson
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from filters.config import METHODS, FilterConfig
from filters.engine import NearDupFilter, Verdict
from filters.errors import RejectedInput
from filters.fingerprint import Fingerprinter, key_method
from filters.normalize import Normalizer
from filters.records import decode_common
from filters.sketch import overlap
from stream.codec import Decoded, RecordFormat, decode, decode_batch, decoded_batch
from stream.runner import RawRecord

REPO = Path(__file__).resolve().parents[1]
ALL = FilterConfig(methods=METHODS)
NORMALIZER = Normalizer()
FINGERPRINTER = Fingerprinter(ALL)

# Every plane, surrogates included (st.text() leaves them out by default).
ANY_CHAR = st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=())
ANY_TEXT = st.text(ANY_CHAR, max_size=80)
# Text that looks like messages: scripts, digits, punctuation, emoji, invisible characters, full-width forms.
MESSAGE_CHARS = st.one_of(
    st.sampled_from(list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,!?:/@-_$%")),
    st.sampled_from(list("妈媽叫你來来吃饭飯在再转发微博ΡΑΥраулГОРОДσςΣéüÅＡＢＣ１２３\u200b\u200d\ufeff\u00ad😀🎉📱")),
    st.characters(codec="utf-8"),
)
MESSAGE = st.text(MESSAGE_CHARS, max_size=120)

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from filters.config import METHODS, FilterConfig
    from filters.engine import NearDupFilter
    texts = json.loads(sys.stdin.read())
    nd = NearDupFilter(FilterConfig(methods=METHODS))
    for i, (text, fp) in enumerate(zip(texts, nd.fingerprinter.fingerprint_batch(texts))):
        v = nd.check(text, id=str(i), ts=float(i))
        print(json.dumps([fp.normalized, fp.exact, fp.size, fp.sketch.tolist(), list(fp.keys), fp.simhash,
                          fp.minhash.tolist(), sorted(fp.sentences), v.duplicate, v.duplicate_of, v.similarity,
                          v.method]))
    """
)

FIXED_TEXTS = [
    "WIN a FREE iPhone now!!! call 555-0100",
    "w i n a free iphone NOW, call 555-0199",
    "妈妈叫你来吃饭", "媽媽叫你來吃飯", "转fa微博 http://t.cn/x",
    "ΡΑΥΡΑL account locked, visit paypal.com/verify",
    "The central bank kept interest rates unchanged. Analysts had expected a cut. Markets rose.",
    "", " ", "😀", "x" * 3000, "a\u200bb\u0000c", "\ud800 lone surrogate",
]


def run_fingerprint_script(texts: list[str], seed: str) -> str:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], input=json.dumps(texts), capture_output=True, text=True, cwd=REPO,
        env=env, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(ANY_TEXT, min_size=20, max_size=30))
def test_fingerprints_and_verdicts_equal_across_processes_with_different_hash_seeds(generated: list[str]) -> None:
    texts = FIXED_TEXTS + generated
    one = run_fingerprint_script(texts, "1")
    two = run_fingerprint_script(texts, "2")
    assert one == two
    rows = [json.loads(line) for line in one.splitlines()]
    assert len(rows) == len(texts)
    # ... and equal to this process's (whatever its hash seed).
    for text, fp, row in zip(texts, FINGERPRINTER.fingerprint_batch(texts), rows):
        assert row[:8] == json.loads(json.dumps([
            fp.normalized, fp.exact, fp.size, fp.sketch.tolist(), list(fp.keys), fp.simhash, fp.minhash.tolist(),
            sorted(fp.sentences)])), text


@settings(max_examples=150, deadline=None)
@given(MESSAGE)
def test_fingerprint_is_deterministic_in_process(text: str) -> None:
    a = FINGERPRINTER.fingerprint(text)
    b = Fingerprinter(ALL).fingerprint(text)
    assert (a.normalized, a.exact, a.size, a.keys, a.simhash, a.sentences) == (
        b.normalized, b.exact, b.size, b.keys, b.simhash, b.sentences)
    assert a.sketch.tolist() == b.sketch.tolist()
    assert a.minhash.tolist() == b.minhash.tolist()


# -- duplicates ----------------------------------------------------------------------------------


@st.composite
def disguised(draw: st.DrawFn) -> tuple[str, str]:
    """A text and a copy with the edits normalization undoes: case, width, separators, invisibles."""
    text = draw(MESSAGE)
    out = []
    for ch in text:
        r = draw(st.integers(0, 9))
        if r == 0 and ch.isascii() and ch.isalpha():
            ch = ch.swapcase()
        elif r == 1 and "!" <= ch <= "~":
            ch = chr(ord(ch) + 0xFEE0)  # full-width form
        out.append(ch)
        if draw(st.integers(0, 4)) == 0:
            out.append(draw(st.sampled_from([" ", ".", "\u200b", "\u2060", "😀", "  ", "\ufeff"])))
    return text, "".join(out)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(disguised())
def test_identical_normalized_texts_are_duplicates(pair: tuple[str, str]) -> None:
    a, b = pair
    assume(NORMALIZER(a) == NORMALIZER(b))
    nd = NearDupFilter()
    assert nd.check(a, id="a", ts=0) == Verdict("a", False)
    assert nd.check(b, id="b", ts=1) == Verdict("b", True, "a", 1.0, "exact")
    assert nd.check(a, id="c", ts=2) == Verdict("c", True, "a", 1.0, "exact")


@settings(max_examples=100, deadline=None)
@given(ANY_TEXT)
def test_the_same_text_twice_is_a_duplicate_with_every_method(text: str) -> None:
    nd = NearDupFilter(ALL)
    nd.check(text, id="a", ts=0)
    assert nd.check(text, id="b", ts=1) == Verdict("b", True, "a", 1.0, "exact")


# -- similarity ----------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(MESSAGE, MESSAGE, st.integers(0, 3))
def test_overlap_is_symmetric(a: str, b: str, how: int) -> None:
    if how == 1:
        b = a + b  # containment
    elif how == 2:
        b = a[: len(a) // 2] + b  # partial overlap
    elif how == 3:
        b = (a + b) * 40  # long: sketches no longer hold every shingle
    fa, fb = FINGERPRINTER.fingerprint_batch([a, b])
    ab = overlap(fa.sketch, fa.size, fb.sketch, fb.size)
    ba = overlap(fb.sketch, fb.size, fa.sketch, fa.size)
    assert ab.jaccard == ba.jaccard
    assert ab.containment_a == ba.containment_b and ab.containment_b == ba.containment_a
    assert 0.0 <= ab.jaccard <= min(ab.containment_a, ab.containment_b) <= 1.0
    aa = overlap(fa.sketch, fa.size, fa.sketch, fa.size)
    assert aa.jaccard == 1.0


# -- never raises ----------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_normalizer_never_raises_on_text(text: str) -> None:
    out = NORMALIZER(text)
    assert isinstance(out, str)
    assert not any(ch.isspace() for ch in out)
    assert not any("A" <= ch <= "Z" for ch in out)
    assert [name for name, _ in NORMALIZER.trace(text)][-1] == "pinyin"
    assert NORMALIZER.trace(text)[-1][1] == out


@settings(max_examples=300, deadline=None)
@given(ANY_TEXT)
def test_normalizer_never_raises_on_any_code_point_including_surrogates(text: str) -> None:
    assert isinstance(NORMALIZER(text), str)


@settings(max_examples=200, deadline=None)
@given(st.text(st.characters(codec="ascii"), max_size=100))
def test_normalization_is_idempotent_on_ascii(text: str) -> None:
    once = NORMALIZER(text)
    assert NORMALIZER(once) == once
    # ... so the fingerprint of the normalized text is the fingerprint of the text (except the sentence
    # keys, which split the raw text at punctuation that normalization removes).
    a, b = FINGERPRINTER.fingerprint_batch([text, once])
    assert (a.exact, a.simhash, a.sketch.tolist(), a.minhash.tolist()) == (
        b.exact, b.simhash, b.sketch.tolist(), b.minhash.tolist())
    assert [k for k in a.keys if key_method(k) != "sentences"] == [k for k in b.keys if key_method(k) != "sentences"]


@settings(max_examples=200, deadline=None)
@given(MESSAGE)
def test_fingerprint_of_normalized_text_is_stable(text: str) -> None:
    # Normalizing twice is not the identity in general (pinyin codes are private-use characters that a
    # second pass strips), but a normalized text always fingerprints the same, and identical inputs agree.
    once = NORMALIZER(text)
    first, second = FINGERPRINTER.fingerprint_batch([once, once])
    assert first.exact == second.exact and first.keys == second.keys


_FILTER = NearDupFilter(ALL)


@settings(max_examples=300, deadline=None)
@given(ANY_TEXT, st.floats(min_value=0, max_value=2e9))
def test_filter_never_raises_and_always_returns_a_verdict(text: str, ts: float) -> None:
    v = _FILTER.check(text, ts=ts)
    assert isinstance(v, Verdict)
    assert v.duplicate == (v.duplicate_of is not None)
    assert 0.0 <= v.similarity <= 1.0


@settings(max_examples=50, deadline=None)
@given(st.lists(ANY_TEXT, min_size=1, max_size=20))
def test_check_batch_returns_one_verdict_per_message_in_order(texts: list[str]) -> None:
    nd = NearDupFilter(ALL)
    verdicts = nd.check_batch([nd.message(t, id=f"m{i}", ts=i) for i, t in enumerate(texts)])
    assert [v.id for v in verdicts] == [f"m{i}" for i in range(len(texts))]


# -- decode -------------------------------------------------------------------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)
RECORDS = st.fixed_dictionaries(
    {},
    optional={
        "text": st.text() | JSON_VALUES,
        "id": JSON_VALUES,
        "ts": JSON_VALUES | st.sampled_from(["1", "-1", "inf", "nan", "1e400", "abc", " 5 ", ""]),
    },
).map(orjson.dumps)


@settings(max_examples=500, deadline=None)
@given(st.one_of(st.binary(), RECORDS, JSON_VALUES.map(orjson.dumps)), st.sampled_from(["json", "text"]))
def test_decode_returns_decoded_or_raises_rejected_input(raw: bytes, fmt: str) -> None:
    try:
        d = decode(raw, RecordFormat(format=fmt), fallback_id="7", fallback_ts=1.5)
    except RejectedInput as exc:
        assert isinstance(exc.reason, str) and exc.reason
        return
    assert isinstance(d, Decoded)
    assert isinstance(d.message.text, str) and d.message.text.strip()
    assert isinstance(d.message.id, str) and d.message.id
    assert isinstance(d.message.ts, float) and d.message.ts >= 0
    if fmt == "json":
        assert isinstance(d.record, dict)
    else:
        assert d.record is None and d.message.id == "7" and d.message.ts == 1.5


# Records as the dev stream has them, and near misses of each rule decode_batch checks itself.
COMMON = st.fixed_dictionaries(
    {"text": st.text(MESSAGE_CHARS, max_size=20) | st.sampled_from(["", " ", "\u3000", "\n\t"])},
    optional={
        "id": st.text(max_size=4) | st.none() | st.integers(-(2**63), 2**63 - 1) | st.booleans(),
        "ts": st.sampled_from([0, 0.0, -0.0, -1e-300, 1e11, 100_000_000_000, 100_000_000_001, 1.0000001e11, "5"])
        | st.floats(-1.0, 2e11) | st.integers(-5, 2 * 10**11) | st.integers(-(2**63), 2**64 - 1) | st.none()
        | st.booleans(),
        "x": JSON_VALUES,
    },
).map(orjson.dumps)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(COMMON, RECORDS, st.binary(max_size=30), JSON_VALUES.map(orjson.dumps),
                          COMMON.map(lambda b: b"\xef\xbb\xbf" + b), COMMON.map(lambda b: b + b"\r\n")), max_size=12),
       st.sampled_from(["json", "text"]), st.sampled_from([1.5, 7, 2.5e11]))
def test_decode_batch_is_decode_of_each(raws: list[bytes], fmt: str, fallback_ts: float) -> None:
    """`decode_batch` decodes the common records itself: the same messages, records and refusals as `decode`."""
    form = RecordFormat(format=fmt, max_record_bytes=60)
    batch = [RawRecord(raw, f"line {i}", fallback_ts) for i, raw in enumerate(raws)]
    got = decode_batch(batch, form)
    assert len(got) == len(batch)
    # The Python reference of the common records' decoding gives the very same (the default is its compiled twin).
    reference, rejected = decoded_batch(batch, form, common=decode_common)
    assert rejected == sum(isinstance(d, RejectedInput) for d in got)
    for d, r in zip(got, reference, strict=True):
        assert type(d) is type(r)
        if isinstance(d, Decoded):
            assert isinstance(r, Decoded) and d.message == r.message and d.record == r.record
            assert type(d.message.ts) is type(r.message.ts) and type(d.message.id) is type(r.message.id)
        else:
            assert isinstance(r, RejectedInput) and (d.reason, str(d)) == (r.reason, str(r))
    for raw, d in zip(batch, got, strict=True):
        try:
            want: Decoded | RejectedInput = decode(raw.value, form, fallback_id=raw.fallback_id,
                                                   fallback_ts=raw.fallback_ts)
        except RejectedInput as exc:
            want = exc
        if isinstance(want, RejectedInput):
            assert isinstance(d, RejectedInput) and type(d) is type(want)
            assert (d.reason, str(d)) == (want.reason, str(want))
        else:
            assert isinstance(d, Decoded) and d.message == want.message and d.record == want.record
            assert type(d.message.ts) is type(want.message.ts)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(COMMON, RECORDS, st.binary(max_size=30), JSON_VALUES.map(orjson.dumps), st.none()),
                max_size=8),
       st.sampled_from(["json", "text"]), st.integers(0, 2 * 10**14))
def test_a_record_decoded_on_arrival_is_the_record_decoded_when_routed(values: list[bytes | None], fmt: str,
                                                                      stamp: int) -> None:
    """The worker decodes each fetched record once (`arrived`): the same record, the same raw record and
    decoding as when it is decoded at routing (`raw_record`, `decode_batch`), and the aligner's event time
    (`record_time`) is `event_time`'s."""
    from types import SimpleNamespace

    from stream.codec import event_time
    from stream.kafka_tools import KafkaRecord
    from stream.outputs import arrived, raw_record, record_time

    form = RecordFormat(format=fmt, max_record_bytes=60)
    msgs = [SimpleNamespace(topic="in", partition=3, offset=10 + i, timestamp=stamp + i, key=b"k", value=value,
                            headers=[("h", b"x")] if i % 2 else []) for i, value in enumerate(values)]
    got = arrived(msgs, form)
    plain = [KafkaRecord.of(m) for m in msgs]
    assert got == plain and all(p.raw is None for p in plain)
    raws = [raw_record(p) for p in plain]
    assert [raw_record(r) for r in got] == raws
    for r, p, want in zip(got, plain, decode_batch(raws, form), strict=True):
        assert r.raw is not None and r.raw.decoded is not None
        d = r.raw.decoded
        if isinstance(want, RejectedInput):
            assert type(d) is type(want) and (d.reason, str(d)) == (want.reason, str(want))
        else:
            assert isinstance(d, Decoded) and d.message == want.message and d.record == want.record
        assert record_time(r, form) == record_time(p, form) == event_time(p.value or b"", form, p.timestamp / 1000.0)
    assert decode_batch([raw_record(r) for r in got], form) == [r.raw.decoded for r in got if r.raw is not None]


# Valid JSON around bytes that may not be UTF-8: a text field of raw bytes (overlong forms, surrogates,
# stray continuation bytes, code points above U+10FFFF) spliced in after the JSON was encoded.
SPLICED = st.tuples(RECORDS, st.binary(max_size=8) | st.sampled_from(
    [b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80", b"\xef\xbb\xbf", b"\xe2\x82"])).map(
    lambda p: p[0][:-1] + (b"," if len(p[0]) > 2 else b"") + b'"x":"' + p[1] + b'"}')


@settings(max_examples=500, deadline=None)
@given(st.one_of(st.binary(), SPLICED), st.sampled_from(["json", "text"]))
def test_decode_says_invalid_utf8_exactly_when_the_bytes_are_not_utf8(raw: bytes, fmt: str) -> None:
    try:
        raw.decode("utf-8")
        valid = True
    except UnicodeDecodeError:
        valid = False
    try:
        decode(raw, RecordFormat(format=fmt), fallback_id="7", fallback_ts=1.5)
        reason = None
    except RejectedInput as exc:
        reason = exc.reason
    assert (reason == "invalid_utf8") == (not valid)
