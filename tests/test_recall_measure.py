"""The recall measures: length bands, the refusing rule of a miss, and the evasion generators of bench.perturb."""

from __future__ import annotations

import random

import pytest

from filters.config import FilterConfig
from filters.engine import NearDupFilter, Verdict
from stream.eval_report import length_band, pair_detail, score_lengths

SPAM = "Congratulations! You have won a 1000 pound prize. Call 09061701461 now to claim, T&Cs apply."


def test_length_bands_split_at_30_70_200() -> None:
    assert [length_band("x" * n) for n in (1, 30, 31, 70, 71, 200, 201)] == \
        ["<=30", "<=30", "31-70", "31-70", "71-200", "71-200", ">200"]


def test_score_lengths_counts_a_short_miss_in_its_band() -> None:
    truth = [{"id": "a", "cluster": 1, "ptype": "base"}, {"id": "b", "cluster": 1, "ptype": "word_edit"},
             {"id": "c", "cluster": 2, "ptype": "base"}, {"id": "d", "cluster": 2, "ptype": "base"}]
    texts = ["short one", "short 1", "x" * 100, "x" * 99]
    verdicts = [Verdict("a", False), Verdict("b", False), Verdict("c", False), Verdict("d", True, "c")]
    lengths = score_lengths(truth, texts, verdicts)
    assert (lengths.by_length["<=30"].fn, lengths.by_length["<=30"].tp) == (1, 0)
    assert (lengths.by_length["71-200"].tp, lengths.by_length["71-200"].fn) == (1, 0)
    assert lengths.by_ptype_length[("word_edit", "<=30")].recall == 0.0


def test_pair_detail_names_the_rule_that_refuses() -> None:
    nd = NearDupFilter(FilterConfig())
    assert pair_detail(nd, SPAM, SPAM.replace("09061701461", "09061709999")).verified
    unrelated = pair_detail(nd, SPAM, "The committee will meet again on Thursday to review the budget.")
    assert not unrelated.verified and unrelated.rule.startswith(("no shared", "too few", "similarity below"))
    # A short text inside a long one: containment holds but the text has too few shingles for it.
    inside = pair_detail(nd, "Watching tv lor...", "Dear Customer, Watching tv lor... see you at the mall today")
    assert not inside.verified and "containment" in inside.rule
    # Long texts of one template with other names: half their shingles shared, neither inside the other.
    template = pair_detail(nd, "zayre corp zy raises quarterly qtly div cts vs eight cts prior pay june four record may reuter",
                           "nucor corp nue raises quarterly qtly div nine cts vs eight cts prior pay may record march reuter")
    assert not template.verified and "threshold_long" in template.rule
    clause = pair_detail(nd, "Sorry, I'll call later", "Sorry,in meeting I'll call later")
    assert not clause.verified and "containment_slack_share" in clause.rule


@pytest.fixture(scope="module")
def generators():  # type: ignore[no-untyped-def]
    pytest.importorskip("pypinyin")
    pytest.importorskip("jieba")
    from bench.perturb import Generators

    return Generators(["This is one donor sentence for padding.", "另一个用来添加的句子在这里。"])


@pytest.mark.parametrize("kind", ["word_insert", "word_delete", "word_swap", "emoji_pad", "sentence_prefix",
                                  "sentence_suffix", "name_sub", "number_sub", "url_sub", "price_sub",
                                  "sentence_reorder"])
def test_each_latin_generator_changes_the_text_and_keeps_it_a_duplicate(generators, kind: str) -> None:
    text = ("Dear Kevin, your parcel 48213 is waiting at the depot. Pay $25 at http://bit.ly/abc123 today. "
            "Reply STOP to opt out of these messages from our delivery team.")
    assert kind in generators.applicable(text)
    out = generators.apply(kind, text, random.Random(3))
    assert out is not None and out != text
    nd = NearDupFilter()
    nd.check(text, id="a", ts=0)
    assert nd.check(out, id="b", ts=1).duplicate_of == "a"


def test_mixed_pinyin_writes_some_han_in_pinyin(generators) -> None:
    text = "本店今天全场八折优惠，欢迎加微信咨询详情，名额有限先到先得。"
    assert "mixed_pinyin" in generators.applicable(text)
    out = generators.apply("mixed_pinyin", text, random.Random(5))
    assert out is not None and any("a" <= ch <= "z" for ch in out) and any("\u4e00" <= ch <= "\u9fff" for ch in out)


def test_han_word_edits_work_on_words_and_names_are_names(generators) -> None:
    """A spammer edits words: in Han text jieba's, never half of one; a name substitution replaces a name (a
    person jieba tags, a capitalised word inside a sentence), not whatever word starts the message."""
    text = "新华社记者王永治报道，本店今天全场八折优惠，欢迎加微信咨询详情。"
    words = generators._words(text)
    for seed in range(20):
        swapped = generators.apply("word_swap", text, random.Random(seed))
        assert swapped is not None and sorted(swapped) == sorted(text)
        assert sorted(generators._words(swapped)) == sorted(words)  # whole words moved
        deleted = generators.apply("word_delete", text, random.Random(seed))
        assert deleted is not None and any(deleted == text.replace(w, "", 1) for w in words)
    assert generators.apply("name_sub", text, random.Random(1)).replace("王永治", "") != text.replace("王永治", "")
    assert "name_sub" not in generators.applicable("Sorry, I'll call later")
    assert generators._names("Why is he urging voters to support Hillary now")[0] == ["Hillary"]


def test_an_added_sentence_is_no_longer_than_the_message(generators) -> None:
    assert generators.apply("sentence_suffix", "Short note.", random.Random(1)) is None  # every donor is longer
    out = generators.apply("sentence_prefix", "A message long enough for the donor to fit in front of it.",
                           random.Random(1))
    assert out == "This is one donor sentence for padding. A message long enough for the donor to fit in front of it."


def test_build_takes_added_and_quoted_text_from_messages_seen_before() -> None:
    pytest.importorskip("jieba")
    from bench.perturb import build

    texts = [f"Message number {i} talks about topic {i * 7}. It goes on at some length, enough for a quote."
             for i in range(200)]
    stream = [{"id": f"m{i}", "text": t, "ts": float(i)} for i, t in enumerate(texts)]
    truth = [{"id": f"m{i}", "cluster": f"c{i}", "corpus": "c", "ptype": "base", "gray": False} for i in range(200)]
    out_s, out_t = build(stream, truth, sample=1.0, seed=3, n_negatives=10)
    seen: list[str] = []
    for rec, row in zip(out_s, out_t, strict=True):
        if row["ptype"] in ("sentence_prefix", "sentence_suffix"):
            added = rec["text"].replace(stream[int(row["source"][1:])]["text"], "").strip()
            assert any(added in t for t in seen), added
        if row["ptype"] == "hn_quote":
            quote, reply = rec["text"].split("\n")
            assert any(quote[2:] in t for t in seen) and not any(reply in t for t in texts)
        if row["ptype"] == "base":
            seen.append(rec["text"])


def test_hard_negatives_are_clusters_of_their_own() -> None:
    from bench.perturb import NEGATIVES, negatives

    negs = negatives(random.Random(1), 5, ["first donor sentence here ok", "second donor sentence here"])
    assert {k for k, _ in negs} == set(NEGATIVES) and len(negs) == 15


def test_the_frontier_scores_each_combination_and_keeps_the_feasible_ones() -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    grid = ["--threshold", "0.5,0.9", "--threshold-long", "0.9", "--containment", "0.8", "--edit-similarity", "0.85",
            "--min-shared", "0.2"]
    out = subprocess.run([sys.executable, str(root / "bench" / "frontier.py"), "--stream", str(root / "tests/data/sample.jsonl"),
                          "--truth", str(root / "tests/data/sample_truth.jsonl"), *grid, "--f1", "0.9", "--top", "2"],
                         capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[0].startswith("302 messages, 2 combinations")  # the 2 rejected records counted
    rows = [line for line in out.splitlines() if line.startswith("| threshold")]
    assert rows[0].startswith("| threshold 0.5, threshold_long 0.55, containment 0.8")  # the defaults
    # A Jaccard of 0.9 refuses copies that 0.5 takes: its recall of a kind falls under 0.95, so only 0.5 is feasible.
    feasible = out.split("Feasible")[1].split("All,")[0]
    assert "threshold 0.5, threshold_long 0.9" in feasible and "threshold 0.9," not in feasible
    by_threshold = {line.split(",")[0]: [float(x) for x in line.split("|")[2:4]] for line in rows[-2:]}
    (p_strict, r_strict), (p_loose, r_loose) = by_threshold["| threshold 0.9"], by_threshold["| threshold 0.5"]
    assert p_strict >= p_loose and r_strict < r_loose
    bad = subprocess.run([sys.executable, str(root / "bench" / "frontier.py"), "--stream", str(root / "tests/data/sample.jsonl"),
                          "--truth", str(root / "tests/data/sample_truth.jsonl"), "--threshold", "half"],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and bad.stderr.startswith("frontier: ") and "Traceback" not in bad.stderr
