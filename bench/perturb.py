"""Evasion generators over the development stream's originals, and hard negatives: recall per kind, precision on templates.

For a sample of the real messages (`ptype == base`), one variant per applicable kind is made from the
original text, labelled with its cluster and inserted right after it. Kinds: the five tricks of
`bench.robustness` (homoglyph, leet, traditional, pinyin_substitution, homophone) and

- `word_insert` / `word_delete` / `word_swap`: words (space-separated in Latin text, jieba's in Han text)
  inserted or deleted, one per ten words and one to three, or two neighbouring words swapped;
- `name_sub`, `number_sub`, `url_sub`, `price_sub`: a name (a capitalised word inside a sentence, a brand;
  a person name jieba tags in Han text), the numbers, a URL, or a price (¥/$/元) replaced by another;
- `sentence_reorder`: the sentences in another order;
- `emoji_pad`: emoji and symbols (★ ☆ ✔ ➤ 🔥 ...) put between words and at both ends;
- `mixed_pinyin`: a run of Han characters written in pinyin next to characters kept (微信 → wei信);
- `sentence_prefix` / `sentence_suffix`: one sentence (15-60 characters, no longer than the message) of a
  message seen earlier added at the start / end.

Hard negatives, labelled with a cluster of their own (a "duplicate" verdict is a false positive): the
same notification template with other amounts and codes (`hn_template`), a reply that quotes a short
part (25 characters) of an earlier message and says something new (`hn_quote`), and the same headline
pattern about a different event (`hn_headline`).

    python -m bench.perturb [--stream PATH --truth PATH] [--sample 0.3] [--seed 11] [--tools neardup,...]
    python -m bench.perturb --dump /tmp/gen                 # also writes the stream and truth it built
    python -m bench.perturb --load /tmp/gen --index redis://127.0.0.1:6379/15?socket_timeout=120
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
from stream.eval_report import length_band, load  # noqa: E402
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
_MID_SENTENCE = re.compile(r"[a-z0-9,;:]\s+$")  # what precedes a capitalised word that is a name, not a sentence start
_NUMBER = re.compile(r"\d{2,}")
_URL = re.compile(r"(?:https?://|www\.)\S+")
_PRICE = re.compile(r"(?:[$¥£€]\s?\d+(?:\.\d+)?|\d+(?:\.\d+)?\s?(?:元|块|dollars?))")
_SENTENCE = re.compile(r"[^.!?。！？\n]+[.!?。！？]*")
FILLER_EN = ("really", "just", "now", "very", "so", "all", "today", "also", "still", "please")
FILLER_ZH = "的了是也很都就还又再"
NAMES = ("Kevin", "Maria", "Apple", "Samsung", "Tesco", "Lucy", "Nokia", "Vodafone", "Oscar", "Wang")
NAMES_ZH = ("张伟", "王芳", "李娜", "刘洋", "陈静", "杨帆", "赵磊", "黄敏", "周杰", "吴昊")
PADS = ("★", "☆", "✔", "➤", "🔥", "💰", "🎁", "✨", "❤", "👉", "~", "*", "|")
HEADLINES = ("{a} reports first quarter profit up {n} pct", "{a} to buy {b} stake for {n} mln dlrs",
             "{a} says {b} talks ended", "{a} cuts {b} prices by {n} pct")
COMPANIES = ("acme corp", "globex inc", "initech ltd", "umbrella co", "hooli", "stark industries",
             "wayne enterprises", "cyberdyne", "soylent corp", "tyrell corp", "oscorp", "vandelay",
             "massive dynamic", "wonka industries", "gringotts", "monarch solutions", "dunder mifflin",
             "pied piper", "bluth co", "prestige worldwide", "sterling cooper", "nakatomi trading",
             "virtucon", "gekko and co", "duff brewing", "krusty corp", "planet express", "ollivanders",
             "blue sun corp", "weyland yutani", "rekall inc", "buy n large", "spacely sprockets",
             "cogswell cogs", "omni consumer", "wernham hogg", "kwik e mart", "vehement capital",
             "strickland propane", "mooby foods")
TEMPLATES = ("Your account {acct} was charged ${amt} on {d}/11. Not you? Call {tel}.",
             "您尾号{acct}的银行卡{d}日消费{amt}元，余额{bal}元。【银行】",
             "Your verification code is {code}. It expires in {d} minutes.",
             "【快递】您的包裹{code}已到{place}驿站，请凭取件码{acct}领取。")
PLACES = ("东门", "西门", "南区", "北苑", "中心")


def _latin(text: str) -> bool:
    return len(_LATIN.findall(text)) >= len(_HAN.findall(text))


def _join(parts: list[str], latin: bool) -> str:
    return (" " if latin else "").join(parts)


class Generators:
    """The new kinds; every random choice comes from the `random.Random` passed in."""

    def __init__(self, donors: Sequence[str]) -> None:
        self.tricks = Tricks()
        self._han_names: dict[str, list[str]] = {}
        self.donors: list[str] = []
        for d in donors:
            self.add_donor(d)

    def add_donor(self, text: str) -> None:
        """Offers the sentences of a message already seen to `sentence_prefix` / `sentence_suffix`: a
        sentence of a message that comes later would make that message look contained in the variant."""
        self.donors += [s.strip() for s in _SENTENCE.findall(text) if 15 <= len(s.strip()) <= 60]

    def _words(self, text: str) -> list[str]:
        """Words: space-separated in Latin text, jieba's in Han text (a spammer edits words, not characters)."""
        return text.split(" ") if _latin(text) else self.tricks._cut(text)

    def _edit(self, text: str, rng: random.Random, op: str) -> str:
        latin = _latin(text)
        parts = self._words(text)
        words = [i for i, p in enumerate(parts) if _LATIN.search(p) or _HAN.search(p)]
        if len(words) < 4:
            return text
        # A few edits: one per ten words, one to three (a 5-word SMS with three words changed is another text).
        for _ in range(max(1, min(3, len(words) // 10)) if op != "swap" else 1):
            k = rng.randrange(len(words))
            i = words[k]
            if op == "insert":
                parts.insert(i, rng.choice(FILLER_EN) if latin else rng.choice(FILLER_ZH))
            elif op == "delete":
                parts[i] = ""
            elif op == "swap":
                taken = set(words)
                pairs = [w for w in words if w + 1 in taken]  # neighbouring words
                if pairs:
                    i = rng.choice(pairs)
                    parts[i], parts[i + 1] = parts[i + 1], parts[i]
            words = [i for i, p in enumerate(parts) if _LATIN.search(p) or _HAN.search(p)]
        return _join([p for p in parts if p] if latin else parts, latin)

    def word_insert(self, text: str, rng: random.Random) -> str:
        return self._edit(text, rng, "insert")

    def word_delete(self, text: str, rng: random.Random) -> str:
        return self._edit(text, rng, "delete")

    def word_swap(self, text: str, rng: random.Random) -> str:
        return self._edit(text, rng, "swap")

    def _names(self, text: str) -> tuple[list[str], tuple[str, ...]]:
        """Names in the text and what may replace them: capitalised Latin words that do not start a sentence,
        or the person names jieba tags (nr) in Han text."""
        if _latin(text):
            return [m.group() for m in _NAME.finditer(text) if _MID_SENTENCE.search(text, 0, m.start())], NAMES
        if text not in self._han_names:  # jieba's tagger is slow: applicable() and name_sub() ask alike
            import jieba.posseg

            self._han_names = {text: [w for w, flag in jieba.posseg.lcut(text) if flag == "nr" and len(w) >= 2]}
        return self._han_names[text], NAMES_ZH

    def name_sub(self, text: str, rng: random.Random) -> str:
        names, pool = self._names(text)
        if not names:
            return text
        old = rng.choice(names)
        return text.replace(old, rng.choice([n for n in pool if n != old]))

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
        latin = _latin(text)
        parts = text.split(" ") if latin else list(text)
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

    def _sentence(self, text: str, rng: random.Random) -> str | None:
        """A donor sentence no longer than `text`: the message stays the larger part of its copy (a copy that is
        mostly another text is a new message that quotes it, the hard negative `hn_quote`)."""
        fitting = [d for d in self.donors if len(d) <= len(text)]
        return rng.choice(fitting) if fitting else None

    def sentence_prefix(self, text: str, rng: random.Random) -> str:
        sentence = self._sentence(text, rng)
        return text if sentence is None else sentence + " " + text

    def sentence_suffix(self, text: str, rng: random.Random) -> str:
        sentence = self._sentence(text, rng)
        return text if sentence is None else text + " " + sentence

    def applicable(self, text: str) -> tuple[str, ...]:
        han, latin = len(_HAN.findall(text)), len(_LATIN.findall(text))
        kinds = [k for k in self.tricks.applicable(text)]
        kinds += ["word_insert", "word_delete", "word_swap", "emoji_pad"]
        if len(text) >= 15:
            kinds += ["sentence_prefix", "sentence_suffix"]
        if self._names(text)[0]:
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


def negative(kind: str, rng: random.Random, donors: Sequence[str], quotable: Sequence[str]) -> str:
    """One hard negative of `kind`. A quote is 25 characters of a message of at least 50 (a part of it) from
    `quotable`, with a reply made of halves of two donor sentences: new text, no message of the stream."""
    if kind == "hn_template":
        return rng.choice(TEMPLATES).format(
            acct=rng.randint(1000, 9999), amt=f"{rng.randint(1, 9999)}.{rng.randint(10, 99)}", d=rng.randint(1, 28),
            tel=f"0{rng.randint(100000000, 999999999)}", bal=rng.randint(100, 99999),
            code=rng.randint(100000, 999999), place=rng.choice(PLACES))
    if kind == "hn_headline":
        a, b = rng.sample(COMPANIES, 2)
        return rng.choice(HEADLINES).format(a=a, b=b, n=rng.randint(2, 90))
    long_enough = [q for q in quotable if len(q) >= 50] or list(quotable) or list(donors)
    distinct = sorted(set(donors))
    first, second = rng.sample(distinct, 2) if len(distinct) > 1 else (distinct[0], "")
    reply = first[: len(first) // 2] + second[len(second) // 2 :]
    return f"> {rng.choice(long_enough)[:25]}\n{reply}"


def negatives(rng: random.Random, n: int, donors: Sequence[str]) -> list[tuple[str, str]]:
    """(kind, text) pairs of hard negatives, `n` of each kind, quoting the donors."""
    return [(kind, negative(kind, rng, donors, donors)) for _ in range(n) for kind in NEGATIVES]


def build(stream: Sequence[dict[str, Any]], truth: Sequence[dict[str, Any]], sample: float, seed: int,
          n_negatives: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The stream with its variants (right after their original) and the hard negatives spread over it. Sentences
    added to a variant and quoted by a negative come from every 50th original seen before it."""
    gen = Generators([])
    rng = random.Random(seed)
    out_s: list[dict[str, Any]] = []
    out_t: list[dict[str, Any]] = []
    n_base = 0
    for rec, row in zip(stream, truth, strict=True):
        out_s.append(rec)
        out_t.append(row)
        if row["ptype"] != "base":
            continue
        n_base += 1
        if rng.random() < sample:
            for kind in gen.applicable(rec["text"]):
                text = gen.apply(kind, rec["text"], random.Random(f"{seed}/{rec['id']}/{kind}"))
                if text is None:
                    continue
                vid = f"{rec['id']}~{kind}"
                out_s.append({"id": vid, "text": text, "ts": rec["ts"]})
                out_t.append({**row, "id": vid, "ptype": kind, "gray": False, "source": rec["id"]})
        if n_base % 50 == 1:
            gen.add_donor(rec["text"])
    # Hard negatives spread over the stream, each a cluster of its own, quoting what came before them.
    n_total = n_negatives * len(NEGATIVES)
    step = max(len(out_s) // max(n_total, 1), 1)
    neg_rng = random.Random(seed + 1)
    merged_s: list[dict[str, Any]] = []
    merged_t: list[dict[str, Any]] = []
    quotable: list[str] = []
    k = 0
    for i, (rec, row) in enumerate(zip(out_s, out_t, strict=True)):
        while k < n_total and k * step <= i:
            ts = merged_s[-1]["ts"] if merged_s else 0.0
            kind = NEGATIVES[k % len(NEGATIVES)]
            merged_s.append({"id": f"neg{k}", "text": negative(kind, neg_rng, gen.donors, quotable), "ts": ts})
            merged_t.append({"id": f"neg{k}", "cluster": f"neg{k}", "corpus": "negatives", "ptype": kind,
                             "gray": False})
            k += 1
        merged_s.append(rec)
        merged_t.append(row)
        if row["ptype"] == "base" and i % 50 == 0:
            quotable.append(rec["text"])
    return merged_s, merged_t


def report(truth: Sequence[dict[str, Any]], stream: Sequence[dict[str, Any]],
           results: dict[str, list[Verdict]]) -> str:
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
    p.add_argument("--load", default="", help="score PATH.stream.jsonl and PATH.truth.jsonl (a --dump) instead "
                                              "of building the stream again")
    p.add_argument("--index", default="memory://", help="neardup's index (redis://...: an empty database)")
    args = p.parse_args(argv)
    try:
        if args.load:
            p_stream, p_truth = (load(f"{args.load}.{suffix}.jsonl") for suffix in ("stream", "truth"))
        else:
            needs.files(__file__, args.stream, args.truth)
            stream, truth = load(args.stream), load(args.truth)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.load:
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
        results[name], _ = run_neardup(msgs, index=args.index) if name == "neardup" else TOOLS[name](msgs)
        print(f"  {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print(report(p_truth, p_stream, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
