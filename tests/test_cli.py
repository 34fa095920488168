"""`neardup filter|explain|eval` and the embedded runner behind them: bad input of every kind is routed to
--rejected with its reason, counts add up, outputs keep the original records."""

from __future__ import annotations

import gc
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import orjson
import pytest

from filters.config import FilterConfig
from filters.engine import NearDupFilter
from stream.cli import main
from stream.codec import RecordFormat
from stream.collector import OLDER_THRESHOLDS, YOUNG_THRESHOLD
from stream.runner import DUPLICATE, REJECTED, UNIQUE, RawRecord, route_batch, run_filter
from stream.testing import ListSink, ListSource, ManualClock

REPO = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(r"in (\d+) = unique (\d+) \+ duplicate (\d+) \+ rejected (\d+)")

SPAM = "WIN a FREE iPhone now!!! call 555-0100 to claim your prize today"
SPAM_COPY = "w i n a free iphone NOW, call 555-0199 to claim your prize today"
NEWS = "The central bank kept interest rates unchanged on Tuesday, citing steady growth."
NEWS_COPY = "The central bank kept interest rates unchanged on Tuesday, citing steady growth and low inflation."
OTHER = "Completely unrelated message about growing tomatoes in a small garden."


def jl(obj: object) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode()


def write_lines(path: Path, lines: Sequence[bytes]) -> Path:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def counts(stderr: str) -> tuple[int, int, int, int]:
    m = SUMMARY.search(stderr)
    assert m, stderr
    total, unique, duplicate, rejected = map(int, m.groups())
    assert total == unique + duplicate + rejected
    return total, unique, duplicate, rejected


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []


class Run:
    def __init__(self, tmp: Path, capsys: pytest.CaptureFixture[str], lines: Sequence[bytes], *extra: str,
                 name: str = "in.jsonl") -> None:
        self.input = write_lines(tmp / name, lines)
        self.unique, self.duplicates, self.rejected = tmp / "u.jsonl", tmp / "d.jsonl", tmp / "r.jsonl"
        for p in (self.unique, self.duplicates, self.rejected):
            p.unlink(missing_ok=True)
        self.rc = main(["filter", str(self.input), "--unique", str(self.unique), "--duplicates",
                        str(self.duplicates), "--rejected", str(self.rejected), *extra])
        self.out, self.err = capsys.readouterr()

    @property
    def counts(self) -> tuple[int, int, int, int]:
        return counts(self.err)

    def rejects(self) -> dict[str, dict]:
        return {r["position"]: r for r in read_jsonl(self.rejected)}


# -- bad input ------------------------------------------------------------------------------------

BAD = [
    (b"not json at all", "invalid_json"),
    (b"{\"text\": \"unterminated", "invalid_json"),
    (b"[1, 2, 3]", "not_an_object"),
    (b"[{\"text\": \"inside an array\"}]", "not_an_object"),
    (b"42", "not_an_object"),
    (b"3.5", "not_an_object"),
    (b"\"just a string\"", "not_an_object"),
    (b"null", "not_an_object"),
    (b"true", "not_an_object"),
    (b"{\"id\": \"x\"}", "no_text"),
    (b"{\"body\": \"wrong field\"}", "no_text"),
    (b"{\"text\": 5}", "text_not_string"),
    (b"{\"text\": null}", "text_not_string"),
    (b"{\"text\": {\"a\": 1}}", "text_not_string"),
    (b"{\"text\": [\"a\"]}", "text_not_string"),
    (b"{\"text\": false}", "text_not_string"),
    (b"{\"text\": \"\"}", "empty_text"),
    (b"{\"text\": \"   \\t\\n \\r  \"}", "empty_text"),
    (b"{\"text\": \"\\u3000\\u2003\"}", "empty_text"),  # Unicode spaces are whitespace too
    (b"{\"text\": \"caf\xc3 au lait\"}", "invalid_utf8"),
    (b"\xff\xfe{\"text\": \"bom16\"}", "invalid_utf8"),
    (b"{\"text\": \"\xed\xa0\x80 encoded surrogate\"}", "invalid_utf8"),
    (b"[" * 5000 + b"]" * 5000, "invalid_json"),
    (b"{\"text\": " + b"[" * 5000 + b"]" * 5000 + b"}", "invalid_json"),
    (b"{\"text\": \"ok\", \"x\": " + b"{\"a\":" * 3000 + b"1" + b"}" * 3000 + b"}", "invalid_json"),
    (b"{\"text\": \"bad ts one\", \"ts\": \"abc\"}", "bad_timestamp"),
    (b"{\"text\": \"bad ts two\", \"ts\": -5}", "bad_timestamp"),
    (b"{\"text\": \"bad ts three\", \"ts\": \"-1.5\"}", "bad_timestamp"),
    (b"{\"text\": \"bad ts four\", \"ts\": true}", "bad_timestamp"),
    (b"{\"text\": \"bad ts five\", \"ts\": [1]}", "bad_timestamp"),
    (b"{\"text\": \"bad ts six\", \"ts\": \"inf\"}", "bad_timestamp"),
    (b"{\"text\": \"bad ts nano\", \"ts\": 1700000000000000000}", "bad_timestamp"),  # nanoseconds
    (b"{\"text\": \"bad ts milli\", \"ts\": 1.7e12}", "bad_timestamp"),  # milliseconds
    (b"{\"text\": \"bad ts seven\", \"ts\": NaN}", "invalid_json"),
    (b"{\"text\": \"bad id one\", \"id\": true}", "bad_id"),
    (b"{\"text\": \"bad id two\", \"id\": \"\"}", "bad_id"),
    (b"{\"text\": \"bad id three\", \"id\": {\"a\": 1}}", "bad_id"),
    (b"{\"text\": \"raw\x01control\"}", "invalid_json"),  # unescaped control characters are not JSON
    (b"{\"text\": \"\\ud800 lone surrogate\"}", "invalid_json"),
]


def test_blank_lines_between_records_are_skipped_and_reported_and_a_bom_is_not_content(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [b"\xef\xbb\xbf" + jl({"id": "g1", "text": SPAM, "ts": 1}), b"", b"   \t",
             jl({"id": "g2", "text": OTHER, "ts": 2}), b""]
    run = Run(tmp_path, capsys, lines)
    assert run.rc == 0
    assert run.counts == (2, 2, 0, 0)  # blank lines are not records: in = unique + duplicate + rejected
    assert "skipped 3 blank lines" in run.err
    assert [r["id"] for r in read_jsonl(run.unique)] == ["g1", "g2"]
    text = Run(tmp_path, capsys, [b"hello there", b"", b"general kenobi"], "--format", "text", name="in.txt")
    assert text.counts == (3, 2, 0, 1)  # in text format a line is a message: a blank one is rejected
    assert [r["reason"] for r in read_jsonl(text.rejected)] == ["empty_text"]


def test_every_kind_of_bad_input_is_rejected_with_its_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = [jl({"id": "g1", "text": SPAM, "ts": 1}), jl({"id": "g2", "text": OTHER, "ts": 2})]
    lines = [good[0], *(line for line, _ in BAD), good[1]]
    run = Run(tmp_path, capsys, lines)
    assert run.rc == 0
    assert run.counts == (len(lines), 2, 0, len(BAD))
    rejects = run.rejects()
    assert set(rejects) == {str(i + 2) for i in range(len(BAD))}
    for i, (line, reason) in enumerate(BAD):
        record = rejects[str(i + 2)]
        assert record["reason"] == reason, (line[:60], record)
        assert record["error"]  # a human-readable message
        assert record["line"] == line.decode("utf-8", "replace")
    assert [json.loads(x)["id"] for x in run.unique.read_bytes().splitlines()] == ["g1", "g2"]
    summary_reasons = dict(re.findall(r"(\w+) (\d+)", run.err.split("rejected: ")[1]))
    assert sum(int(n) for n in summary_reasons.values()) == len(BAD)


def test_inputs_handled_by_the_codec_rules_are_filtered_not_rejected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    lines = [
        jl({"id": "ctrl", "text": "ctrl \u0000\u0001\u0007 chars around words", "ts": 1}),
        jl({"id": "emoji", "text": "😀🎉📱", "ts": 2}),
        jl({"id": "zw", "text": "\u200b\u200d", "ts": 3}),
        jl({"id": "numts", "text": "timestamp as a numeric string here", "ts": "1700000000.5"}),
        jl({"id": 42, "text": "numeric id is fine for this one", "ts": 1.5e9}),
        jl({"id": 3.5, "text": "float id is fine for this one too", "ts": 0}),
        jl({"id": None, "text": "null id falls back to the line number"}),
        b'  {"text": "surrounding whitespace is valid JSON", "id": "ws"}  ',
        b'{"text": "crlf line ending", "id": "crlf"}\r',
    ]
    run = Run(tmp_path, capsys, lines)
    assert run.counts[3] == 0, run.rejects()
    ids = [json.loads(x).get("id") for x in run.unique.read_bytes().splitlines()]
    dup_ids = [d.get("id") for d in read_jsonl(run.duplicates)]
    assert sorted(map(str, ids + dup_ids)) == sorted(map(str, ["ctrl", "emoji", "zw", "numts", 42, 3.5, None, "ws",
                                                               "crlf"]))
    # A text that normalizes to nothing is still filtered (README): here it matches the emoji-only one.
    assert {"emoji"} <= set(ids)


def test_two_megabyte_text_is_filtered_and_passed_through_unchanged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    big = jl({"id": "big", "text": "spam and eggs " * (2 * 1024 * 1024 // 14), "ts": 5})
    assert len(big) > 2 * 1024 * 1024
    copy = jl({"id": "big2", "text": "SPAM AND EGGS " * (2 * 1024 * 1024 // 14), "ts": 6})
    run = Run(tmp_path, capsys, [big, copy])
    assert run.counts == (2, 1, 1, 0)
    assert run.unique.read_bytes() == big + b"\n"
    assert read_jsonl(run.duplicates)[0]["duplicate_of"] == "big"


def test_record_larger_than_the_limit_is_rejected() -> None:
    nd = NearDupFilter()
    fmt = RecordFormat(max_record_bytes=1000)
    raw = RawRecord(jl({"text": "x" * 2000}), "1", 0.0)
    (routed,) = route_batch(nd, [raw], fmt)
    assert routed.kind == REJECTED and routed.error is not None and routed.error.reason == "too_large"


# -- outputs --------------------------------------------------------------------------------------


def test_counts_add_up_and_outputs_hold_every_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [
        jl({"id": "a", "text": SPAM, "ts": 0}),
        b"garbage",
        jl({"id": "b", "text": SPAM_COPY, "ts": 1}),
        jl({"id": "c", "text": NEWS, "ts": 2}),
        jl({"id": "d", "text": NEWS_COPY, "ts": 3}),
        jl({"id": "e", "text": ""}),
        jl({"id": "f", "text": OTHER, "ts": 4}),
        jl({"id": "g", "text": SPAM.upper(), "ts": 5}),
    ]
    run = Run(tmp_path, capsys, lines)
    total, unique, duplicate, rejected = run.counts
    assert (total, unique, duplicate, rejected) == (8, 3, 3, 2)
    assert len(run.unique.read_bytes().splitlines()) == unique
    assert len(read_jsonl(run.duplicates)) == duplicate
    assert len(read_jsonl(run.rejected)) == rejected
    assert "duplicate ratio 50.00%" in run.err
    assert re.search(r"matched by: .*\d", run.err)


def test_unique_output_is_the_original_line_unchanged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [
        b'{ "ts" : 1 ,  "text":"caf\\u00e9 \xe2\x98\x95 with odd   spacing", "id":"x", "extra": [1, {"k": null}] }',
        b'{"text": "\\u5988\\u5988\\u53eb\\u4f60\\u6765\\u5403\\u996d", "n": 1.50}',
    ]
    run = Run(tmp_path, capsys, lines)
    assert run.counts == (2, 2, 0, 0)
    assert run.unique.read_bytes() == lines[0] + b"\n" + lines[1] + b"\n"


def test_duplicates_carry_duplicate_of_similarity_and_method(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [
        jl({"id": "a", "text": SPAM, "ts": 0, "user": "u1"}),
        jl({"id": "b", "text": SPAM_COPY, "ts": 1, "user": "u2", "meta": {"k": [1, 2]}}),
        jl({"id": "c", "text": NEWS, "ts": 2}),
        jl({"id": "d", "text": NEWS_COPY, "ts": 3}),
    ]
    run = Run(tmp_path, capsys, lines)
    b, d = read_jsonl(run.duplicates)
    assert b == {"id": "b", "text": SPAM_COPY, "ts": 1, "user": "u2", "meta": {"k": [1, 2]},
                 "duplicate_of": "a", "similarity": 1.0, "method": "exact"}
    assert d["id"] == "d" and d["duplicate_of"] == "c" and d["method"] == "mgram"
    assert 0.5 <= d["similarity"] < 1.0
    assert "exact 1" in run.err and "mgram 1" in run.err


def test_ids_default_to_line_numbers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [jl({"text": OTHER}), b"oops", jl({"text": SPAM}), jl({"text": SPAM_COPY}), jl({"text": SPAM})]
    run = Run(tmp_path, capsys, lines)
    assert [(d["duplicate_of"], d.get("id")) for d in read_jsonl(run.duplicates)] == [("3", None), ("3", None)]
    assert set(run.rejects()) == {"2"}


def test_custom_field_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [jl({"key": "k1", "body": SPAM, "time": 10}), jl({"key": "k2", "body": SPAM_COPY, "time": 11}),
             jl({"key": "k3", "text": SPAM})]
    run = Run(tmp_path, capsys, lines, "--text-field", "body", "--id-field", "key", "--ts-field", "time")
    assert run.counts == (3, 1, 1, 1)
    assert read_jsonl(run.duplicates)[0]["duplicate_of"] == "k1"
    assert run.rejects()["3"]["reason"] == "no_text"


def test_format_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [SPAM.encode(), b"", SPAM_COPY.encode(), b"   ", b"caf\xc3 broken", OTHER.encode() + b"\r",
             b'{"text": "json is just text here"}']
    run = Run(tmp_path, capsys, lines, "--format", "text", name="in.txt")
    assert run.counts == (7, 3, 1, 3)
    assert run.unique.read_bytes() == b"\n".join([SPAM.encode(), OTHER.encode(), lines[6]]) + b"\n"
    (dup,) = read_jsonl(run.duplicates)
    assert dup == {"id": "3", "text": SPAM_COPY, "duplicate_of": "1", "similarity": 1.0, "method": "exact"}
    assert {k: v["reason"] for k, v in run.rejects().items()} == {
        "2": "empty_text", "4": "empty_text", "5": "invalid_utf8"}


def test_batch_size_does_not_change_the_routing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [jl({"text": t, "ts": i}) for i, t in enumerate(
        [SPAM, NEWS, SPAM_COPY, OTHER, NEWS_COPY, SPAM.upper(), OTHER + "!", "x"] * 3)]
    outputs = []
    for size in ("1", "3", "512"):
        run = Run(tmp_path, capsys, lines, "--batch-size", size)
        outputs.append((run.counts, run.unique.read_bytes(), run.duplicates.read_bytes()))
    assert outputs[0] == outputs[1] == outputs[2]


def test_default_sinks_stdin_stdout_stderr(monkeypatch: pytest.MonkeyPatch, capsysbinary: pytest.CaptureFixture[bytes],
                                           ) -> None:
    data = b"\n".join([jl({"id": "a", "text": SPAM}), b"[1]", jl({"id": "b", "text": SPAM_COPY})]) + b"\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    assert main(["filter", "-"]) == 0
    out, err = capsysbinary.readouterr()
    assert out == jl({"id": "a", "text": SPAM}) + b"\n"  # unique to stdout; duplicates only counted
    assert b"neardup: rejected record 2 (not_an_object): [1]\n" in err  # a notice; the record is not written
    assert counts(err.decode()) == (3, 1, 1, 1)


def test_quiet_prints_no_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = Run(tmp_path, capsys, [jl({"text": SPAM})], "-q")
    assert run.rc == 0 and run.err == "" and run.out == ""
    assert run.unique.exists()


def test_several_input_files_continue_line_numbers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = write_lines(tmp_path / "1.jsonl", [jl({"text": SPAM})])
    second = write_lines(tmp_path / "2.jsonl", [jl({"text": SPAM_COPY})])
    dup = tmp_path / "d.jsonl"
    assert main(["filter", str(first), str(second), "--duplicates", str(dup), "--unique", str(tmp_path / "u")]) == 0
    assert counts(capsys.readouterr().err) == (2, 1, 1, 0)
    assert read_jsonl(dup)[0]["duplicate_of"] == "1"


# -- options --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("window", "gap", "duplicate"), [
    ("90s", 80, True), ("90s", 100, False), ("1.5m", 80, True), ("1.5m", 100, False),
    ("24h", 100, True), ("100ms", 0, True),
])
def test_window_option_is_parsed_and_applied(tmp_path: Path, capsys: pytest.CaptureFixture[str], window: str,
                                             gap: int, duplicate: bool) -> None:
    lines = [jl({"id": "a", "text": SPAM, "ts": 1_000}), jl({"id": "b", "text": SPAM_COPY, "ts": 1_000 + gap})]
    run = Run(tmp_path, capsys, lines, "--window", window)
    assert run.rc == 0
    assert run.counts[2] == (1 if duplicate else 0)


@pytest.mark.parametrize(("args", "message"), [
    (["--window", "banana"], "not a duration: 'banana'"),
    (["--window", "0s"], "duration must be positive"),
    (["--window=-5m"], "not a duration"),
    (["--window", "24"], "24: a duration needs a unit: 30s, 15m, 24h, 7d"),
    (["--mgram-keys", "many"], "mgram_keys from flag --mgram-keys: not a number"),
    (["--bucket-cap", "0"], "bucket_cap must be >= 1"),
    (["--methods", "exact,bogus"], "methods must be"),
    (["--normalize=-nonsense"], "unknown normalization step 'nonsense'"),
    (["--normalize", "+nonsense"], "unknown normalization step 'nonsense'"),
    (["--threshold", "0"], "threshold"),
])
def test_bad_options_exit_2_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                                           message: str) -> None:
    src = write_lines(tmp_path / "in.jsonl", [jl({"text": SPAM})])
    out = tmp_path / "u.jsonl"
    assert main(["filter", str(src), "--unique", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("neardup: ") and message in err
    assert not out.exists() or out.read_bytes() == b""


def test_methods_and_normalize_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [jl({"text": "我在家里吃饭呢，你来不来"}), jl({"text": "我再家里吃饭呢，你来不来"})]
    assert Run(tmp_path, capsys, lines, "--methods", "exact").counts == (2, 1, 1, 0)
    assert Run(tmp_path, capsys, lines, "--methods", "exact", "--normalize=-pinyin").counts == (2, 2, 0, 0)
    run = Run(tmp_path, capsys, [jl({"text": NEWS}), jl({"text": NEWS_COPY})], "--methods", "minhash",
              "--verify", "native")
    assert run.counts[2] == 1 and read_jsonl(run.duplicates)[0]["method"] == "minhash"
    assert Run(tmp_path, capsys, [jl({"text": NEWS}), jl({"text": NEWS_COPY})], "--methods", "exact").counts[2] == 0


def test_argparse_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["filter", "--format", "xml"])
    assert exc.value.code == 2
    assert "invalid choice: 'xml'" in capsys.readouterr().err


def test_normalize_option_accepts_the_documented_form(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "在家", "再家", "--normalize", "-pinyin,-mask_numbers"]) == 0
    assert "unique" in capsys.readouterr().out.splitlines()[-1]


@pytest.mark.parametrize("value", ["-pinyin", "no-pinyin", "!pinyin", "-pinyin,+leet", " no-pinyin , -mask_urls "])
@pytest.mark.parametrize("glued", [True, False])
def test_normalize_option_turns_a_step_off_in_every_spelling(capsys: pytest.CaptureFixture[str], value: str,
                                                             glued: bool) -> None:
    args = [f"--normalize={value}"] if glued else ["--normalize", value]
    assert main(["explain", "在家", "再家", *args]) == 0
    out = capsys.readouterr().out
    assert "pinyin" not in out.split("== comparison")[0]  # the step is gone from the trace
    assert "unique" in out.splitlines()[-1]  # and the homophones no longer meet
    assert main(["explain", "在家", "再家", "--normalize", "+pinyin"]) == 0
    assert "duplicate" in capsys.readouterr().out.splitlines()[-1]


def test_normalize_option_value_is_not_glued_after_double_dash(capsys: pytest.CaptureFixture[str]) -> None:
    # After `--` every argument is positional: `--normalize` there is text B, not the option.
    assert main(["explain", "--", "--normalize", "-pinyin"]) == 0
    assert "== B: '-pinyin'" in capsys.readouterr().out


def test_unreadable_input_file_is_an_error_not_a_crash(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["filter", str(tmp_path / "missing.jsonl"), "-q"]) == 2
    assert capsys.readouterr().err == f"neardup: {tmp_path / 'missing.jsonl'}: no such file\n"


# -- explain and eval -----------------------------------------------------------------------------


def test_explain_prints_normalized_forms_and_a_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "WIN a FREE iPhone, call 555-0100", "w i n a fr33 iPhone!! call 555-0199"]) == 0
    out = capsys.readouterr().out
    assert "== A: 'WIN a FREE iPhone, call 555-0100'" in out
    assert "== B: 'w i n a fr33 iPhone!! call 555-0199'" in out
    steps = re.findall(r"^  (\w+)\s+'(.*)'$", out, flags=re.M)
    assert [s for s, _ in steps][:12] == ["strip_markers", "nfkc", "strip_invisible", "strip_accents", "confusables",
                                          "traditional_to_simplified", "casefold", "mask_urls", "leet",
                                          "mask_numbers", "strip_separators", "pinyin"]
    finals = [v for s, v in steps if s == "pinyin"]
    assert finals == ["winafreeiphonecaii‹num›", "winafreeiphonecaii‹num›"]
    assert "== verdict for B after A: duplicate of A" in out


def test_explain_unrelated_texts_and_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "the cat sat on the mat", "we all scream for ice cream", "--methods", "simhash"]) == 0
    out = capsys.readouterr().out
    assert "== verdict for B after A: unique" in out
    assert "simhash hamming" in out
    assert main(["explain", "在", "再", "--normalize=-pinyin"]) == 0
    out = capsys.readouterr().out
    assert "pinyin" not in out.split("== comparison")[0]
    assert "unique" in out.splitlines()[-1]


def test_eval_prints_precision_and_recall(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [
        ("a1", "c1", SPAM, "base"),
        ("a2", "c1", SPAM_COPY, "space_insertion"),  # TP
        ("b1", "c2", NEWS, "base"),
        ("b2", "c2", NEWS_COPY, "ad_prefix_suffix"),  # TP
        ("e1", "c3", OTHER, "base"),
        ("e2", "c4", OTHER.upper(), "base"),  # said duplicate, truly another cluster: FP
        ("f1", "c2", "A totally different sentence about the weather on Mars.", "word_edit"),  # FN
        ("g1", "c5", "妈妈叫你回家吃饭啦，今天做了红烧肉。", "base"),
        ("g2", "c5", "媽媽叫你回家吃飯啦，今天做了紅燒肉。", "width_swap"),  # TP
    ]
    stream = write_lines(tmp_path / "stream.jsonl", [jl({"id": i, "text": t, "ts": n}) for n, (i, _, t, _) in
                                                    enumerate(rows)] + [b""])
    truth = write_lines(tmp_path / "truth.jsonl", [jl({"id": i, "cluster": c, "corpus": "test", "ptype": p})
                                                   for i, c, _, p in rows])
    assert main(["eval", str(stream), str(truth)]) == 0
    out = capsys.readouterr().out
    assert "messages 9  routed 9  rejected 0  lost 0" in out
    assert "| precision | 0.7500 |" in out
    assert "| recall | 0.7500 |" in out
    assert "| F1 | 0.7500 |" in out
    assert "| TP / FP / FN | 3 / 1 / 1 |" in out
    assert "| word_edit | 1 | 0.000 |" in out
    assert "| width_swap | 1 | 1.000 |" in out
    assert "| <=30 | 1 | 1.000 | 1.0000 |" in out and "| 31-70 | 2 | 0.500 | 0.5000 |" in out  # by text length
    assert "## Misses" not in out and "## False positives" not in out  # only when asked for

    # The worst misses and false positives, each with the rule that refused or accepted the pair.
    assert main(["eval", str(stream), str(truth), "--misses", "5", "--fps", "5"]) == 0
    worst = capsys.readouterr().out.split("## Misses (1)", 1)[1]
    misses, fps = worst.split("## False positives (1)")
    assert "| no shared bucket key |" in misses and "weather on Mars" in misses
    assert "[test, 70 chars, similarity 1.00 via exact]" in fps and "verified True; matches alone via exact" in fps
    assert repr(OTHER) in fps and repr(OTHER.upper()) in fps  # A (what it matched), then B
    assert main(["eval", str(stream), str(truth), "--fps", "1"]) == 0
    out = capsys.readouterr().out
    assert "## False positives (1)" in out and "## Misses" not in out
    # One kind's: the miss is a word_edit, the false positive a base message; the measures stay the whole stream's.
    assert main(["eval", str(stream), str(truth), "--misses", "5", "--fps", "5", "--kind", "word_edit"]) == 0
    out = capsys.readouterr().out
    assert "| TP / FP / FN | 3 / 1 / 1 |" in out
    assert "## Misses of kind word_edit (1)" in out and "weather on Mars" in out
    assert "## False positives of kind word_edit (0)" in out and repr(OTHER.upper()) not in out
    assert main(["eval", str(stream), str(truth), "--misses", "5", "--kind", "base"]) == 0
    out = capsys.readouterr().out
    assert "## Misses of kind base (0)" in out and "refusing rule" not in out  # no empty table


def test_eval_names_a_miss_whose_cluster_the_index_never_held(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """X (gray) is routed a duplicate of Y, another cluster's, so it is not indexed; Z, a copy of X that is not
    near Y, finds nothing: the miss is not the ranking's, and `--misses` says so."""
    words = ("river stone cloud market yellow window garden silver morning engine paper orange forest bridge "
             "candle winter harbor pencil mirror castle rocket velvet planet copper meadow thunder violin lantern "
             "pepper falcon").split()
    added = "zebra quartz nectar walnut jigsaw kettle lemon mango".split()
    y, x = " ".join(words), " ".join(words[:22] + added)
    z = " ".join(words[:17] + "tulip ocean puzzle sparrow tiger".split() + added)
    stream = write_lines(tmp_path / "s.jsonl", [jl({"id": i, "text": t, "ts": n})
                                                for n, (i, t) in enumerate([("y", y), ("x", x), ("z", z)])])
    truth = write_lines(tmp_path / "t.jsonl", [jl({"id": "y", "cluster": "a", "corpus": "c", "ptype": "base"}),
                                               jl({"id": "x", "cluster": "b", "corpus": "c", "ptype": "base",
                                                   "gray": True}),
                                               jl({"id": "z", "cluster": "b", "corpus": "c", "ptype": "word_edit"})])
    assert main(["eval", str(stream), str(truth), "--misses", "1"]) == 0
    out = capsys.readouterr().out
    assert "| TP / FP / FN | 0 / 0 / 1 |" in out  # x routed duplicate (gray: no false positive), z unique
    assert "| matches alone, but its cluster's earlier messages were all routed duplicate | 1 |" in out


# -- the embedded runner --------------------------------------------------------------------------


def test_run_filter_with_list_source_and_sinks_uses_arrival_time_for_the_window() -> None:
    clock = ManualClock(1_000.0)

    def arrival() -> float:  # every record arrives 40 s after the previous one
        clock.advance(40)
        return clock()

    nd = NearDupFilter(FilterConfig(window=100.0), clock=clock)
    source = ListSource([jl({"id": "a", "text": SPAM}), jl({"id": "b", "text": SPAM_COPY}), b"{}",
                         jl({"id": "c", "text": NEWS}), jl({"id": "d", "text": OTHER}),
                         jl({"id": "e", "text": SPAM.upper()})])
    unique, duplicates, rejected = ListSink(), ListSink(), ListSink()
    summary = run_filter(nd, source, unique=unique, duplicates=duplicates, rejected=rejected, fmt=RecordFormat(),
                         batch_size=2, clock=arrival)
    assert (summary.seen, summary.unique, summary.duplicate, summary.rejected) == (6, 4, 1, 1)
    assert summary.seen == summary.unique + summary.duplicate + summary.rejected
    assert [orjson.loads(r)["id"] for r in unique.records] == ["a", "c", "d", "e"]  # a expired 200 s before e
    assert orjson.loads(duplicates.records[0])["duplicate_of"] == "a"
    assert orjson.loads(rejected.records[0]) == {"error": "no 'text' field", "reason": "no_text", "position": "3",
                                                 "line": "{}"}
    assert summary.reasons == {"no_text": 1} and summary.methods == {"exact": 1}


def test_outputs_that_share_a_stream_keep_the_input_order() -> None:
    """Unique records are written a batch at a time, yet one sink given as two outputs (`--duplicates -`,
    `--rejected -`) gets every record in input order."""
    source = ListSource([jl({"id": "a", "text": SPAM}), jl({"id": "b", "text": NEWS}), jl({"id": "c", "text": SPAM_COPY}),
                         jl({"id": "d", "text": OTHER}), b"{}", jl({"id": "e", "text": SPAM.upper()}),
                         jl({"id": "f", "text": "a text of its own, unlike the others"})])
    one = ListSink()
    summary = run_filter(NearDupFilter(), source, unique=one, duplicates=one, rejected=one, fmt=RecordFormat())
    assert (summary.unique, summary.duplicate, summary.rejected) == (4, 2, 1)
    got = [orjson.loads(r) for r in one.records]
    assert [r.get("id") or r.get("position") for r in got] == ["a", "b", "c", "d", "5", "e", "f"]


def test_route_batch_returns_one_routed_per_record_in_order() -> None:
    nd = NearDupFilter()
    batch = [RawRecord(raw, str(i), 0.0) for i, raw in enumerate(
        [jl({"text": SPAM}), b"nope", jl({"text": SPAM_COPY}), jl({"text": 1}), jl({"text": OTHER})])]
    routed = route_batch(nd, batch, RecordFormat())
    assert [r.kind for r in routed] == [UNIQUE, REJECTED, DUPLICATE, REJECTED, UNIQUE]
    assert [r.raw for r in routed] == batch
    assert routed[2].verdict is not None and routed[2].verdict.duplicate_of == "0"
    assert routed[3].error is not None and routed[3].error.reason == "text_not_string"


# -- the installed command, in a real process -------------------------------------------------------


def test_console_script_end_to_end(tmp_path: Path) -> None:
    data = b"\n".join([jl({"id": "a", "text": SPAM}), b"[]", jl({"id": "b", "text": SPAM_COPY}),
                       b"\xff\xfe", jl({"id": "c", "text": OTHER})]) + b"\n"
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run([installed_neardup(), "filter", "-", "--rejected", str(tmp_path / "r")],
                          input=data, capture_output=True, cwd=REPO, env=env, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout == jl({"id": "a", "text": SPAM}) + b"\n" + jl({"id": "c", "text": OTHER}) + b"\n"
    assert counts(done.stderr.decode()) == (5, 2, 1, 2)
    assert [r["reason"] for r in read_jsonl(tmp_path / "r")] == ["not_an_object", "invalid_utf8"]
    bad = subprocess.run(["neardup", "filter", "--window", "banana"], input=b"", capture_output=True, env=env,
                         timeout=60, check=False)
    assert bad.returncode == 2
    assert b"not a duration: 'banana'" in bad.stderr


def test_filter_tunes_the_garbage_collector(tmp_path: Path) -> None:
    """A routing process spaces the collector's runs out and freezes what start-up made (`stream.collector`)."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"id": "1", "text": "hello there"}\n')
    assert main(["filter", str(src), "--unique", str(tmp_path / "u"), "-q"]) == 0
    assert gc.get_threshold() == (YOUNG_THRESHOLD, *OLDER_THRESHOLDS)
    assert gc.get_freeze_count() > 1000


# -- the command line as a user meets it (subprocesses of `python -m stream.cli`) ------------------------


def installed_neardup() -> str:
    """The `neardup` console script installed for the Python running the tests (else the one on PATH): CLI
    tests run the command a user runs. PYTHONPATH (cli_env) still points it at this checkout's code."""
    beside = Path(sys.executable).parent / "neardup"
    found = str(beside) if beside.is_file() else shutil.which("neardup")
    assert found, "neardup is not installed: pip install -e '.[test]'"
    return found


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEARDUP_") or k.startswith("NEARDUP_TEST_")}
    return {**env, "PYTHONPATH": str(REPO), **extra}


def neardup(*args: str, stdin: bytes = b"", timeout: float = 60) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([installed_neardup(), *args], input=stdin, capture_output=True, cwd=REPO,
                          env=cli_env(), timeout=timeout, check=False)


def one_line(done: subprocess.CompletedProcess[bytes]) -> str:
    err = done.stderr.decode()
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def test_version() -> None:
    done = neardup("--version")
    assert done.returncode == 0 and re.fullmatch(rb"neardup \S+\n", done.stdout), done


# Runs the CLI with the Kafka extra's modules unimportable, as in an install without neardup[kafka].
BLOCK_EXTRA = """
import signal
import sys
import time
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("aiokafka", "redis", "faust", "aiohttp", "prometheus_client"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
from stream.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(("args", "command"), [
    (["serve"], "neardup serve"),
    (["produce", "-", "--topic", "t"], "neardup produce"),
    (["tail", "t"], "neardup tail"),
    (["filter", "--index", "redis://127.0.0.1:1/0"], "neardup filter --index redis://"),
])
def test_commands_without_the_kafka_extra_say_so_in_one_line(args: list[str], command: str) -> None:
    done = subprocess.run([sys.executable, "-c", BLOCK_EXTRA, *args], input=b"", capture_output=True, cwd=REPO,
                          env=cli_env(), timeout=60, check=False)
    assert done.returncode == 2
    assert one_line(done) == f"{command} needs the Kafka extra: pip install 'neardup[kafka]'"
    ok = subprocess.run([sys.executable, "-c", BLOCK_EXTRA, "filter", "-q"], input=jl({"text": SPAM}) + b"\n",
                        capture_output=True, cwd=REPO, env=cli_env(), timeout=60, check=False)
    assert ok.returncode == 0 and ok.stdout == jl({"text": SPAM}) + b"\n"  # the core needs no extra


def test_input_errors_are_one_line_and_exit_2(tmp_path: Path) -> None:
    unreadable = tmp_path / "secret.jsonl"
    unreadable.write_bytes(b"{}\n")
    unreadable.chmod(0)
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 8)
    cases = [
        ([str(tmp_path / "missing.jsonl")], "no such file"),
        ([str(tmp_path)], "is a directory"),
        ([str(binary)], "binary input, not text or JSON lines"),
    ]
    if os.geteuid() != 0:  # root reads any file
        cases.append(([str(unreadable)], "cannot read: Permission denied"))
    # A file that opens but cannot be read, for root too: the process's own memory at address 0 (Linux).
    cases.append((["/proc/self/mem"], "cannot read: Input/output error"))
    for args, message in cases:
        done = neardup("filter", *args)
        assert done.returncode == 2 and done.stdout == b""
        line = one_line(done)
        assert line.startswith(f"neardup: {args[0]}: ") and message in line
    done = neardup("filter", "-", stdin=b"\x00\x01\x02 binary \x00" * 100)
    assert done.returncode == 2 and "stdin: binary input" in one_line(done)


def test_gzip_input_is_read_transparently(tmp_path: Path) -> None:
    import gzip

    data = b"".join(jl({"id": str(i), "text": t}) + b"\n" for i, t in enumerate([SPAM, SPAM_COPY, OTHER]))
    plain = neardup("filter", "-", stdin=data)
    named = tmp_path / "in.jsonl.gz"
    named.write_bytes(gzip.compress(data))
    unnamed = tmp_path / "in.jsonl"  # gzip recognised by its magic bytes, not its name
    unnamed.write_bytes(gzip.compress(data))
    for done in (neardup("filter", str(named)), neardup("filter", str(unnamed)),
                 neardup("filter", "-", stdin=gzip.compress(data))):
        assert done.returncode == 0, done.stderr
        assert done.stdout == plain.stdout == jl({"id": "0", "text": SPAM}) + b"\n" + jl({"id": "2", "text": OTHER}) + b"\n"
        assert counts(done.stderr.decode()) == (3, 2, 1, 0)


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupt_flushes_whole_lines_prints_the_summary_and_exits_128_plus_signal(
        tmp_path: Path, sig: signal.Signals, code: int) -> None:
    unique, duplicates = tmp_path / "u.jsonl", tmp_path / "d.jsonl"
    proc = subprocess.Popen([installed_neardup(), "filter", "-", "--unique", str(unique),
                             "--duplicates", str(duplicates)], stdin=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=REPO, env=cli_env())
    assert proc.stdin is not None and proc.stderr is not None
    sent = 0
    for i in range(3000):  # more than a batch, then the pipe stays open
        proc.stdin.write(jl({"id": str(i), "text": f"{OTHER} number {i} " + "x" * (i % 50)}) + b"\n")
        sent += 1
    proc.stdin.flush()
    deadline = time.monotonic() + 30
    def routed() -> int:
        return sum(p.read_bytes().count(b"\n") for p in (unique, duplicates) if p.exists())

    while time.monotonic() < deadline and routed() < 600:  # the first batches are out, the rest waits in the pipe
        time.sleep(0.05)
    assert routed() >= 600
    proc.send_signal(sig)
    assert proc.wait(timeout=20) == code
    err = proc.stderr.read().decode()
    proc.stdin.close()
    total, u, d, _ = counts(err)
    assert f"interrupted by {sig.name}" in err
    lines = unique.read_bytes()
    assert lines.endswith(b"\n")
    assert all(json.loads(line) for line in lines.splitlines())  # whole records only
    assert lines.count(b"\n") == u and 0 < total <= sent
    assert duplicates.read_bytes().count(b"\n") == d


def test_a_line_piped_in_is_routed_at_once_while_the_pipe_stays_open() -> None:
    proc = subprocess.Popen([installed_neardup(), "filter", "-", "-q"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO, env=cli_env())
    assert proc.stdin is not None and proc.stdout is not None
    try:
        time.sleep(1.0)  # started up (imports, index)
        for record in (jl({"id": "1", "text": SPAM}), jl({"id": "2", "text": OTHER})):
            started = time.monotonic()
            proc.stdin.write(record + b"\n")
            proc.stdin.flush()
            line = proc.stdout.readline()  # blocks until routed: the pipe is still open
            assert line == record + b"\n"
            assert time.monotonic() - started < 1.0
    finally:
        proc.stdin.close()
        assert proc.wait(timeout=20) == 0


def test_rejected_records_show_reason_and_start_on_stderr_whole_in_the_rejected_output(tmp_path: Path) -> None:
    long_bad = b"not json " + b"y" * 5000
    done = neardup("filter", "-", "--rejected", str(tmp_path / "r.jsonl"),
                   stdin=jl({"text": SPAM}) + b"\n" + long_bad + b"\n")
    assert done.returncode == 0
    notices = [line for line in done.stderr.decode().splitlines() if line.startswith("neardup: rejected")]
    assert notices == [f"neardup: rejected record 2 (invalid_json): {long_bad[:200].decode()}... (5,009 bytes)"]
    assert [r["line"].encode() for r in read_jsonl(tmp_path / "r.jsonl")] == [long_bad]


def test_progress_shows_percent_rate_and_eta(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from contextlib import ExitStack

    from stream.cli import Progress
    from stream.inputs import Inputs
    from stream.runner import Summary

    src = write_lines(tmp_path / "in.jsonl", [jl({"text": f"{OTHER} {i}"}) for i in range(1000)])
    with ExitStack() as stack:
        inputs = Inputs([str(src)], stack)
        progress = Progress(True, inputs)
        lines = inputs.lines()
        for _ in range(500):
            next(lines)
        progress.show(Summary(seen=1))
        time.sleep(0.25)
        for _ in range(200):
            next(lines)
        progress.show(Summary(seen=700))
    err = capsys.readouterr().err.split("\r\033[K")[-1]
    assert re.match(r"^\s*\d\d\.\d% {2}700 messages {2}0 duplicates {2}0 rejected {2}[\d,]+/s {2}ETA 0:00:0\d$", err), err
    quiet = neardup("filter", str(src), "--unique", str(tmp_path / "u"))  # stderr a pipe: no progress line
    assert "\r" not in quiet.stderr.decode()


def test_eval_of_the_shipped_sample_and_without_data() -> None:
    done = neardup("eval", "--sample")
    assert done.returncode == 0, done.stderr
    assert "messages 302  routed 300  rejected 2  lost 0" in done.stdout.decode()
    assert re.search(r"\| F1 \| 0\.9\d+|\| F1 \| 1\.0000", done.stdout.decode())
    listed = neardup("eval", "--sample", "--misses", "3", "--fps", "3")  # the rejected records have no pair to show
    assert listed.returncode == 0, listed.stderr
    assert "## Misses (" in listed.stdout.decode() and "## False positives (" in listed.stdout.decode()
    assert neardup("eval", "--sample", "--misses", "-1").returncode == 2
    bare = neardup("eval")
    assert bare.returncode == 2
    assert "eval needs a labelled stream" in one_line(bare)


def test_every_option_of_every_command_has_a_help_line() -> None:
    import argparse

    from stream.cli import build_parser

    def walk(parser: argparse.ArgumentParser, path: str) -> list[str]:
        missing = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    missing += walk(sub, f"{path} {name}")
            elif action.help in (None, "") and not isinstance(action, argparse._HelpAction):
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
        return missing

    assert walk(build_parser(), "neardup") == []
    commands = {name for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction) for name in a.choices}
    assert {"filter", "explain", "eval", "serve", "produce", "tail", "top", "config"} <= commands


# -- serve against real services ------------------------------------------------------------------


@pytest.mark.services
@pytest.mark.parametrize(("flags", "says"), [
    (["--index", "redis://127.0.0.1:1/0"], "redis://127.0.0.1:1/0"),
    (["--kafka-bootstrap", "127.0.0.1:1"], "Kafka at 127.0.0.1:1"),
])
def test_serve_with_an_unreachable_service_says_so_within_seconds(kafka_bootstrap: str, flags: list[str],
                                                                  says: str) -> None:
    started = time.monotonic()
    done = subprocess.run([installed_neardup(), "serve", "--kafka-bootstrap", kafka_bootstrap,
                           "--metrics-port", "0", *flags], capture_output=True, cwd=REPO, env=cli_env(), timeout=30,
                          check=False)
    assert time.monotonic() - started <= 10
    assert done.returncode != 0
    last = done.stderr.decode().strip().splitlines()[-1]
    assert last.startswith("neardup: ") and says in last and "Traceback" not in done.stderr.decode()


@pytest.mark.services
def test_serve_starting_a_new_group_logs_no_errors(kafka_bootstrap: str) -> None:
    name = f"cli-start-{os.getpid()}-{time.monotonic_ns()}"
    proc = subprocess.Popen([installed_neardup(), "serve", "--kafka-bootstrap", kafka_bootstrap,
                             "--group-id", name, "--input-topics", f"{name}-in", "--unique-topic", f"{name}-u",
                             "--duplicate-topic", f"{name}-d", "--dead-letter-topic", f"{name}-x",
                             "--metrics-port", "0"], stderr=subprocess.PIPE, cwd=REPO, env=cli_env())
    assert proc.stderr is not None
    lines = []
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline:
            line = proc.stderr.readline().decode()
            if not line:
                break
            lines.append(line)
            if "assigned" in line:
                break
    finally:
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=30)[1].decode()
    assert any("assigned" in line for line in lines), "".join(lines) + rest
    assert not [line for line in [*lines, *rest.splitlines()] if " ERROR " in line], "".join(lines) + rest
    assert proc.returncode == 0


@pytest.mark.services
def test_tail_waits_for_a_topic_and_names_one_that_never_comes_without_creating_it(kafka_bootstrap: str) -> None:
    import asyncio

    from bench.kafka_support import produce, settings_for
    from stream.kafka_tools import ensure_topics, missing_topics

    settings = settings_for(kafka_bootstrap, "memory://")
    never, later = f"{settings.unique_topic}-typo", settings.unique_topic
    started = time.monotonic()
    done = subprocess.run([installed_neardup(), "tail", never, "--from-beginning", "--timeout", "2s",
                           "--kafka-bootstrap", kafka_bootstrap], capture_output=True, cwd=REPO, env=cli_env(),
                          timeout=60, check=False)
    assert done.returncode == 2 and done.stdout == b"" and time.monotonic() - started < 15
    assert one_line(done) == f"neardup: no topic {never} on Kafka at {kafka_bootstrap}"
    assert asyncio.run(missing_topics(settings, [never])) == [never]  # not auto-created by subscribing
    # The README's order: `neardup serve &` then `neardup tail` at once: the topic comes a moment later.
    proc = subprocess.Popen([installed_neardup(), "tail", later, "--from-beginning", "--timeout", "3s",
                             "--kafka-bootstrap", kafka_bootstrap], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=REPO, env=cli_env())
    time.sleep(1.5)

    async def create() -> None:
        await ensure_topics(settings, [later], partitions=1)
        await produce(settings, later, [(None, b"hello", ())])

    asyncio.run(create())
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert [json.loads(line)["value"] for line in out.splitlines()] == ["hello"]


# Not benchmarks: what they share (needs), and the support of the Kafka and fault tests (imported, not run).
BENCHES = sorted(p.name for p in (REPO / "bench").glob("*.py")
                 if p.name not in ("__init__.py", "needs.py", "kafka_support.py", "reliability.py"))


@pytest.mark.parametrize("script", BENCHES)
def test_every_benchmark_says_in_one_line_what_it_needs(tmp_path: Path, script: str) -> None:
    """Run from a clone without the eval data or the services: exit 2 and one line, never a traceback."""
    env = {k: v for k, v in cli_env().items() if not k.startswith("NEARDUP_TEST_")}
    env["NEARDUP_TEST_KAFKA"] = "127.0.0.1:1"  # nothing listens there
    help_text = subprocess.run([sys.executable, f"bench/{script}", "--help"], capture_output=True, cwd=REPO, env=env,
                               timeout=60, check=False).stdout
    args = [arg for option in ("--stream", "--truth") if option.encode() in help_text
            for arg in (option, str(tmp_path / "none.jsonl"))]
    done = subprocess.run([sys.executable, f"bench/{script}", *args], capture_output=True, cwd=REPO, env=env,
                          timeout=60, check=False)
    assert done.returncode == 2
    assert one_line(done).startswith(f"{script} needs ")


# -- what a newcomer meets: packaging, refused values, the terminal, the README ----------------------------


def test_every_file_the_packages_read_is_installed_with_them() -> None:
    """A non-editable `pip install .` ships only Python files and the declared package data: a Lua script
    read at import time and missing from the wheel made `neardup serve` a traceback in a fresh venv."""
    import fnmatch
    import tomllib

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    code = {".py", ".pyx", ".pxd", ".cpp", ".so", ".pyc"}
    for package in ("filters", "stream"):
        data = [p.relative_to(REPO / package).as_posix() for p in (REPO / package).rglob("*")
                if p.is_file() and p.suffix not in code and "__pycache__" not in p.parts]
        missing = [f for f in data if not any(fnmatch.fnmatch(f, g) for g in declared.get(package, []))]
        assert missing == [], f"{package}: not in [tool.setuptools.package-data]: {missing}"


@pytest.mark.parametrize(("args", "env", "toml", "says"), [
    (["filter", "--window", "24"], {}, None, "window from flag --window: 24: a duration needs a unit"),
    (["filter"], {"NEARDUP_WINDOW": "86400"}, None, "window from env NEARDUP_WINDOW: 86400: a duration needs a unit"),
    (["filter"], {}, "window = 86400\n", "86400: a duration needs a unit"),
    (["filter", "--window", "a day"], {}, None, "not a duration: 'a day'"),
    (["serve", "--max-skew", "5"], {}, None, "max_skew from flag --max-skew: 5: a duration needs a unit"),
    (["tail", "t", "--timeout", "3"], {}, None, "neardup tail: argument --timeout: 3: a duration needs a unit"),
    (["top", "--once", "--interval", "2"], {}, None, "neardup top: argument --interval: 2: a duration needs a unit"),
    (["filter", "--format", "xml"], {}, None, "invalid choice: 'xml' (choose from 'json', 'text')"),
])
def test_refused_values_are_one_line_with_the_accepted_forms(tmp_path: Path, args: list[str], env: dict[str, str],
                                                             toml: str | None, says: str) -> None:
    if toml is not None:
        (tmp_path / "neardup.toml").write_text(toml)
        env = {**env, "NEARDUP_CONFIG": str(tmp_path / "neardup.toml")}
    done = subprocess.run([installed_neardup(), *args], input=b"", capture_output=True, cwd=REPO,
                          env=cli_env(**env), timeout=60, check=False)
    assert done.returncode == 2 and done.stdout == b""
    line = one_line(done)
    assert line.startswith("neardup") and says in line
    if "duration" in says:
        assert "30s, 15m, 24h, 7d" in line


def test_progress_on_a_terminal_shows_percent_rate_and_eta_and_the_summary_stays(tmp_path: Path) -> None:
    """stderr a terminal: the installed command redraws one line with the percent of bytes read, the rate and
    the time left, and clears it before the summary. (stderr a pipe: test_progress_shows_percent_rate_and_eta.)"""
    import pty
    import select

    src = write_lines(tmp_path / "in.jsonl", [jl({"id": str(i), "text": f"{OTHER} {i} {i * 7919 % 10007}"})
                                               for i in range(150_000)])
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen([installed_neardup(), "filter", str(src), "--unique", str(tmp_path / "u.jsonl")],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=slave, cwd=REPO,
                                env=cli_env())
        os.close(slave)
        shown = b""
        while True:
            if select.select([master], [], [], 120)[0]:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the last writer closed the terminal
                    chunk = b""
                if not chunk:
                    break
                shown += chunk
        assert proc.wait(timeout=60) == 0
    finally:
        os.close(master)
    parts = shown.decode().replace("\r\n", "\n").split("\r\033[K")
    lines = [p for p in parts if p.strip() and not p.startswith("in ")]
    progress = re.compile(r"^\s*(\d+\.\d)% {2}[\d,]+ messages {2}[\d,]+ duplicates {2}0 rejected {2}([\d,]+)/s {2}"
                          r"ETA \d+:\d\d:\d\d$")
    matched = [progress.match(p) for p in lines]
    assert matched and all(matched), lines[:5]
    percents = [float(m[1]) for m in matched if m]
    assert percents == sorted(percents) and 0 < percents[0] < 100
    assert all(int(m[2].replace(",", "")) > 0 for m in matched if m)
    assert counts(parts[-1])[0] == 150_000  # the summary, after the cleared line


def test_readme_says_how_to_choose_the_window_and_the_method_and_its_flags_exist() -> None:
    from filters.config import FilterConfig
    from stream.cli import build_parser
    from stream.config import parse_duration

    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    window = readme.partition("**Choosing the window.**")[2].partition("\n\n")[0]
    assert "`--window`" in window
    forms = re.findall(r"`(\d+(?:\.\d+)?[a-z]+)`", window)
    assert len(forms) >= 3 and all(parse_duration(f) > 0 for f in forms)
    method = readme.partition("### Which method when")[2].partition("\n## ")[0]
    rows = re.findall(r"^\| `([a-z,]+)`", method, flags=re.M)
    assert {"exact,mgram", "minhash", "simhash", "sentences"} <= set(rows)
    for row in rows:
        FilterConfig(methods=tuple(row.split(",")))  # each is a value --methods takes
    assert "Use the default" in method

    import argparse

    def options(parser: argparse.ArgumentParser) -> set[str]:
        found = {o for a in parser._actions for o in a.option_strings}
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub in a.choices.values():
                    found |= options(sub)
        return found

    known = options(build_parser())
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]+)", readme))
    assert named - known == set(), "README names options no command has"
