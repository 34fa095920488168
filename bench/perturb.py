"""Evasion generators over the development stream's originals, and hard negatives: recall per kind, precision on templates.

For a sample of the real messages (`ptype == base`), one variant per applicable kind is made from the
original text, labelled with its cluster and inserted right after it. Kinds: the five tricks of
`bench.robustness` (homoglyph, leet, traditional, pinyin_substitution, homophone) and

- `word_insert` / `word_delete` / `word_swap`: words (Latin) or characters (Han) inserted or deleted,
  one per ten tokens and one to three, or two neighbouring words swapped;
- `name_sub`, `number_sub`, `url_sub`, `price_sub`: a capitalised word (name, brand), a number, a URL,
  or a price (¥/$/元) replaced by another;
- `sentence_reorder`: the sentences in another order;
- `emoji_pad`: emoji and symbols (★ ☆ ✔ ➤ 🔥 ...) put between words and at both ends;
- `mixed_pinyin`: a run of Han characters written in pinyin next to characters kept (微信 → wei信);
- `sentence_prefix` / `sentence_suffix`: one sentence of another message added at the start / end.

Hard negatives, labelled with a cluster of their own (a "duplicate" verdict is a false positive): the
same notification template with other amounts and codes (`hn_template`), a reply that quotes a short
part of another message and says something else (`hn_quote`), and the same headline pattern about a
different event (`hn_headline`).

    python -m bench.perturb [--stream PATH --truth PATH] [--sample 0.3] [--seed 11] [--tools neardup,...]
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a clone

from bench import needs  # noqa: E402
from bench.filter_bench import run_datasketch, run_neardup  # noqa: E402
from bench.robustness import Tricks  # noqa: E402
from filters.engine import Message, Verdict  # noqa: E402
from stream.evaluate import score  # noqa: E402

OLD_KINDS = ("homoglyph", "leet", "traditional", "pinyin_substitution", "homophone")
NEW_KINDS = ("word_insert", "word_delete", "word_swap", "name_sub", "number_sub", "url_sub", "price_sub",
             "sentence_reorder", "emoji_pad", "mixed_pinyin", "sentence_prefix", "sentence_suffix")
KINDS = OLD_KINDS + NEW_KINDS
NEGATIVES = ("hn_template", "hn_quote", "hn_headline")

_HAN = re.compile(r"[\u3400-\u9fff]")
_LATIN = re.compile(r"[A-Za-z]")
_TOKEN = re.compile(r"[A-Za-z']+|[\u3400-\u9fff]|[0-9]+|\S")
_NAME = re.compile(r"\b[A-Z][a-z]{2,}\b")
_NUMBER = re.compile(r"\d{2,}")
_URL = re.compile(r"(?:https?://|www\.)\S+")
_PRICE = re.compile(r"(?:[$¥£€]\s?\d+(?:\.\d+)?|\d+(?:\.\d+)?\s?(?:元|块|dollars?))")
_SENTENCE = re.compile(r"[^.!?。！？\n]+[.!?。！？]*")
FILLER_EN = ("really", "just", "now", "very", "so", "all", "today", "also", "still", "please")
FILLER_ZH = "的了是也很都就还又再"
NAMES = ("Kevin", "Maria", "Apple", "Samsung", "Tesco", "Lucy", "Nokia", "Vodafone", "Oscar", "Wang")
PADS = ("★", "☆", "✔", "➤", "🔥", "💰", "🎁", "✨", "❤", "👉", "~", "*", "|")
HEADLINES = ("{a} reports first quarter profit up {n} pct", "{a} to buy {b} stake for {n} mln dlrs",
             "{a} says {b} talks ended", "{a} cuts {b} prices by {n} pct")
COMPANIES = ("acme corp", "globex inc", "initech ltd", "umbrella co", "hooli", "stark industries",
             "wayne enterprises", "cyberdyne", "soylent corp", "tyrell corp", "oscorp", "vandelay")
TEMPLATES = ("Your account {acct} was charged ${amt} on {d}/11. Not you? Call {tel}.",
             "您尾号{acct}的银行卡{d}日消费{amt}元，余额{bal}元。【银行】",
             "Your verification code is {code}. It expires in {d} minutes.",
             "【快递】您的包裹{code}已到{place}驿站，请凭取件码{acct}领取。")
PLACES = ("东门", "西门", "南区", "北苑", "中心")


def _words(text: str) -> list[str]:
    return text.split(" ") if len(_LATIN.findall(text)) >= len(_HAN.findall(text)) else list(text)


def _join(parts: list[str], latin: bool) -> str:
    return (" " if latin else "").join(parts)


class Generators:
    """The new kinds; every random choice comes from the `random.Random` passed in."""

    def __init__(self, donors: Sequence[str]) -> None:
        self.tricks = Tricks()
        self.donors = [s.strip() for d in donors for s in _SENTENCE.findall(d) if 15 <= len(s.strip()) <= 60]

    def _edit(self, text: str, rng: random.Random, op: str) -> str:
        latin = len(_LATIN.findall(text)) >= len(_HAN.findall(text))
        parts = _words(text)
        if len(parts) < 4:
            return text
        # A few edits: one per ten tokens, one to three (a 5-word SMS with three words changed is another text).
        for _ in range(max(1, min(3, len(parts) // 10)) if op != "swap" else 1):
            i = rng.randrange(len(parts))
            if op == "insert":
                parts.insert(i, rng.choice(FILLER_EN) if latin else rng.choice(FILLER_ZH))
            elif op == "delete" and len(parts) > 3:
                del parts[i]
            elif op == "swap" and i + 1 < len(parts):
                parts[i], parts[i + 1] = parts[i + 1], parts[i]
        return _join(parts, latin)

    def word_insert(self, text: str, rng: random.Random) -> str:
        return self._edit(text, rng, "insert")

    def word_delete(self, text: str, rng: random.Random) -> str:
        return self._edit(text, rng, "delete")

    def word_swap(self, text: str, rng: random.Random) -> str:
        return self._edit(text, rng, "swap")

    def name_sub(self, text: str, rng: random.Random) -> str:
        names = _NAME.findall(text)
        if not names:
            return text
        old = rng.choice(names)
        return text.replace(old, rng.choice([n for n in NAMES if n != old]))

    def number_sub(self, text: str, rng: random.Random) -> str:
        return _NUMBER.sub(lambda m: "".join(rng.choice("0123456789") for _ in m.group()), text)

    def url_sub(self, text: str, rng: random.Random) -> str:
        return _URL.sub(lambda m: "http://bit.ly/" + "".join(rng.choice("abcdefXYZ0123") for _ in range(6)), text)

    def price_sub(self, text: str, rng: random.Random) -> str:
        return _PRICE.sub(lambda m: re.sub(r"\d+", lambda d: str(rng.randint(1, 999)), m.group()), text)

    def sentence_reorder(self, text: str, rng: random.Random) -> str:
        sents = [s for s in _SENTENCE.findall(text) if s.strip()]
        if len(sents) < 2:
            return text
        rng.shuffle(sents)
        return "".join(sents)

    def emoji_pad(self, text: str, rng: random.Random) -> str:
        latin = len(_LATIN.findall(text)) >= len(_HAN.findall(text))
        parts = _words(text)
        out = [p + (rng.choice(PADS) if rng.random() < 0.2 else "") for p in parts]
        return rng.choice(PADS) * rng.randint(1, 3) + _join(out, latin) + rng.choice(PADS) * rng.randint(1, 3)

    def mixed_pinyin(self, text: str, rng: random.Random) -> str:
        out = []
        for ch in text:
            if _HAN.match(ch) and rng.random() < 0.25:
                out.append(self.tricks._pinyin(ch)[0])
            else:
                out.append(ch)
        return "".join(out)

    def sentence_prefix(self, text: str, rng: random.Random) -> str:
        return rng.choice(self.donors) + " " + text

    def sentence_suffix(self, text: str, rng: random.Random) -> str:
        return text + " " + rng.choice(self.donors)

    def applicable(self, text: str) -> tuple[str, ...]:
        han, latin = len(_HAN.findall(text)), len(_LATIN.findall(text))
        kinds = [k for k in self.tricks.applicable(text)]
        kinds += ["word_insert", "word_delete", "word_swap", "emoji_pad", "sentence_prefix", "sentence_suffix"]
        if _NAME.search(text):
            kinds.append("name_sub")
        if _NUMBER.search(text):
            kinds.append("number_sub")
        if _URL.search(text):
            kinds.append("url_sub")
        if _PRICE.search(text):
            kinds.append("price_sub")
        if len([s for s in _SENTENCE.findall(text) if s.strip()]) >= 2:
            kinds.append("sentence_reorder")
        if han >= 4 and han > latin:
            kinds.append("mixed_pinyin")
        return tuple(kinds)

    def apply(self, kind: str, text: str, rng: random.Random) -> str | None:
        fn: Callable[[str, random.Random], str] = (getattr(self.tricks, kind) if kind in OLD_KINDS
                                                   else getattr(self, kind))
        for _ in range(3):
            out = fn(text, rng)
            if out != text:
                return out
        return None


def negatives(rng: random.Random, n: int, donors: Sequence[str]) -> list[tuple[str, str]]:
    """(kind, text) pairs of hard negatives: every text is a message of its own cluster."""
    out: list[tuple[str, str]] = []
    for _ in range(n):
        t = rng.choice(TEMPLATES)
        out.append(("hn_template", t.format(acct=rng.randint(1000, 9999), amt=f"{rng.randint(1, 9999)}.{rng.randint(10, 99)}",
                                            d=rng.randint(1, 28), tel=f"0{rng.randint(100000000, 999999999)}",
                                            bal=rng.randint(100, 99999), code=rng.randint(100000, 999999),
                                            place=rng.choice(PLACES))))
        a, b = rng.sample(COMPANIES, 2)
        out.append(("hn_headline", rng.choice(HEADLINES).format(a=a, b=b, n=rng.randint(2, 90))))
        d = rng.choice(donors)
        out.append(("hn_quote", f"> {d[:25]}\n" + rng.choice(donors)))
    return out


def build(stream: Sequence[dict[str, Any]], truth: Sequence[dict[str, Any]], sample: float, seed: int,
          n_negatives: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    base = [r["text"] for r, t in zip(stream, truth, strict=True) if t["ptype"] == "base"]
    gen = Generators(base[::50])
    rng = random.Random(seed)
    out_s: list[dict[str, Any]] = []
    out_t: list[dict[str, Any]] = []
    for rec, row in zip(stream, truth, strict=True):
        out_s.append(rec)
        out_t.append(row)
        if row["ptype"] != "base" or rng.random() >= sample:
            continue
        for kind in gen.applicable(rec["text"]):
            text = gen.apply(kind, rec["text"], random.Random(f"{seed}/{rec['id']}/{kind}"))
            if text is None:
                continue
            vid = f"{rec['id']}~{kind}"
            out_s.append({"id": vid, "text": text, "ts": rec["ts"]})
            out_t.append({**row, "id": vid, "ptype": kind, "gray": False, "source": rec["id"]})
    # Hard negatives spread over the stream, each a cluster of its own.
    negs = negatives(random.Random(seed + 1), n_negatives, gen.donors)
    step = max(len(out_s) // max(len(negs), 1), 1)
    for k, (kind, text) in enumerate(negs):
        at = min(k * step + k, len(out_s))
        ts = out_s[at - 1]["ts"] if at else 0.0
        out_s.insert(at, {"id": f"neg{k}", "text": text, "ts": ts})
        out_t.insert(at, {"id": f"neg{k}", "cluster": f"neg{k}", "corpus": "negatives", "ptype": kind,
                          "gray": False})
    return out_s, out_t


def report(truth: Sequence[dict[str, Any]], stream: Sequence[dict[str, Any]],
           results: dict[str, list[Verdict]]) -> str:
    from stream.eval_report import length_band

    names = list(results)
    lines = ["| tool | precision | recall | F1 |", "|---|---|---|---|"]
    for name, verdicts in results.items():
        o = score(truth, verdicts).overall
        lines.append(f"| {name} | {o.precision:.4f} | {o.recall:.4f} | {o.f1:.4f} |")
    cells: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for i, row in enumerate(truth):
        kind = row["ptype"]
        for n in names:
            v = results[n][i]
            if kind in KINDS:
                cells[n, kind][0 if v.duplicate else 1] += 1
                cells[n, "len " + length_band(stream[i]["text"])][0 if v.duplicate else 1] += 1
            elif kind in NEGATIVES:
                cells[n, kind][0 if not v.duplicate else 1] += 1
    lines += ["", "Recall of each generated kind (variants of the stream's originals) and, for hard negatives, "
              "the share routed unique:", "", "| kind | variants | " + " | ".join(names) + " |",
              "|---|---|" + "---|" * len(names)]
    for kind in (*KINDS, *(f"len {b}" for b in ("<=30", "31-70", "71-200", ">200")), *NEGATIVES):
        tp, fn = cells[names[0], kind]
        if tp + fn:
            vals = " | ".join(f"{cells[n, kind][0] / max(sum(cells[n, kind]), 1):.3f}" for n in names)
            lines.append(f"| {kind} | {tp + fn} | {vals} |")
    return "\n".join(lines)


TOOLS: dict[str, Callable[[Sequence[Message]], tuple[list[Verdict], object]]] = {
    "neardup": run_neardup,
    "datasketch MinHashLSH": run_datasketch,
}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stream", default=str(ROOT.parent / "shared" / "eval" / "stream.jsonl"))
    p.add_argument("--truth", default=str(ROOT.parent / "shared" / "eval" / "truth.jsonl"))
    p.add_argument("--sample", type=float, default=0.3, help="share of the originals given variants")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--negatives", type=int, default=300, help="hard negatives of each kind")
    p.add_argument("--tools", default=",".join(TOOLS))
    p.add_argument("--dump", default="", help="write PATH.stream.jsonl and PATH.truth.jsonl")
    args = p.parse_args(argv)
    needs.files(__file__, args.stream, args.truth)
    try:
        stream = [orjson.loads(x) for x in open(args.stream, "rb") if x.strip()]
        truth = [orjson.loads(x) for x in open(args.truth, "rb") if x.strip()]
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    p_stream, p_truth = build(stream, truth, args.sample, args.seed, args.negatives)
    print(f"{len(stream)} messages + {len(p_stream) - len(stream)} variants and negatives (seed {args.seed}; "
          f"built in {time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    if args.dump:
        for suffix, rows in (("stream", p_stream), ("truth", p_truth)):
            with open(f"{args.dump}.{suffix}.jsonl", "wb") as f:
                f.writelines(orjson.dumps(r) + b"\n" for r in rows)
    msgs = [Message(r["id"], r["text"], r["ts"]) for r in p_stream]
    results: dict[str, list[Verdict]] = {}
    for name in args.tools.split(","):
        t0 = time.perf_counter()
        results[name], _ = TOOLS[name](msgs)
        print(f"  {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print(report(p_truth, p_stream, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
