"""Robustness benchmark: recall of neardup and datasketch MinHashLSH when spammers add one more evasion trick.

Builds, with a fixed seed, a perturbed copy of the development stream: for a sample of its duplicate
messages (non-`base` ptype), one new variant per applicable trick is made from the duplicate's text
(so it carries the original edit plus one trick), labelled with the same cluster and inserted right
after it, with the same timestamp. Only unique messages are indexed, so a variant has to match the
cluster's representative, not the copy it was made from. Tricks, each done the way spammers do it:

- `homoglyph`: 10-40 % of the letters swapped for Cyrillic/Greek/Armenian/IPA look-alikes (А, е, о, р,
  с, ѕ, і, ν, ρ, ɑ, ԁ, ո ...), and in some messages a few words put in capitals first (FRЕЕ, МОΝЕΥ).
- `leet`: a→4/@, e→3, i→1/!, o→0, s→5/$, t→7, l→1, b→8, g→9 in 30-70 % of the words, and in some
  messages a few words spaced out as well ("f r 3 3  c 4 $ h").
- `traditional`: the whole text converted to traditional Chinese, by the inverse of the T→S table of
  `filters.charmaps` (a random traditional form of each character) or by OpenCC s2t / s2tw / s2hk.
- `pinyin_substitution`: some words (jieba) written in toneless pinyin as pypinyin reads them in
  context (转发 → 转fa, 微信 → weixin / WeiXin / wei xin), 10-35 % of the Han characters.
- `homophone`: 10-35 % of the Han characters replaced by a common (GB2312 level 1) character whose
  usual reading is the pinyin of the original in context (微信 → 威信).

Prints, for neardup's defaults and for datasketch MinHashLSH used as bench/filter_bench.py uses it:
precision/recall/F1 over the whole perturbed stream, recall of each trick's variants next to the recall
of the copies they were made from (what the trick costs), and neardup's recall per trick and corpus.

    python -m bench.robustness [--stream PATH --truth PATH] [--sample 0.6] [--seed 7] [--tools ...]
        [--dump PATH]   # the perturbed stream + truth as JSONL, for `neardup eval` / `neardup explain`
        [--misses N]    # print N missed variants per trick with the text they were made from
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import time
import unicodedata
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson

from bench import needs
from bench.filter_bench import run_datasketch, run_neardup
from filters import charmaps
from filters.engine import Message, Verdict
from stream.evaluate import score

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("homoglyph", "leet", "traditional", "pinyin_substitution", "homophone")
LATIN_KINDS = ("homoglyph", "leet")

_HAN = re.compile(r"[\u3400-\u9fff]")
_LATIN_LETTER = re.compile(r"[A-Za-z]")
_WORD = re.compile(r"[A-Za-z]+")
# Spammers keep what has to work or be read exactly as it is: URLs, e-mail addresses, numbers and codes.
_KEEP = re.compile(r"\S*(?:://|www\.|@\w+\.|\.(?:com|net|org|co|ly|io|uk)\b|[0-9])\S*")

# Look-alikes a spammer pastes in for each ASCII letter (Cyrillic first: the most common source).
HOMOGLYPHS: dict[str, str] = {
    "a": "аɑα", "b": "Ьƅ", "c": "сϲ", "d": "ԁɗ", "e": "еҽ", "g": "ɡց", "h": "һհ", "i": "іιı",
    "j": "јϳ", "k": "κк", "l": "ӏⅼ", "m": "м", "n": "ոη", "o": "оοσ", "p": "рρ", "q": "ԛ",
    "r": "гꭇ", "s": "ѕ", "u": "υս", "v": "νѵ", "w": "ԝѡ", "x": "хχ", "y": "уγ", "z": "ᴢ",
    "A": "АΑ", "B": "ВΒ", "C": "СϹ", "D": "Ꭰ", "E": "ЕΕ", "G": "Ԍ", "H": "НΗ", "I": "ІΙӀ", "J": "ЈͿ",
    "K": "КΚ", "L": "Ꮮ", "M": "МΜ", "N": "Ν", "O": "ОΟ", "P": "РΡ", "S": "Ѕ", "T": "ТΤ",
    "V": "Ѵ", "W": "Ԝ", "X": "ХΧ", "Y": "ҮΥ", "Z": "Ζ",
}
LEET: dict[str, str] = {
    "a": "4@", "e": "3", "i": "1!", "o": "0", "s": "5$", "t": "7", "l": "1", "b": "8", "g": "9",
}


def _outside_kept(text: str, fn: Callable[[str], str]) -> str:
    """`fn` applied to the parts of `text` that are not URLs, e-mail addresses or numbers."""
    out, pos = [], 0
    for m in _KEEP.finditer(text):
        out += [fn(text[pos : m.start()]), m.group()]
        pos = m.end()
    out.append(fn(text[pos:]))
    return "".join(out)


class Tricks:
    """The five generators; every random choice comes from the `random.Random` passed in."""

    def __init__(self) -> None:
        import jieba
        from pypinyin import Style, lazy_pinyin
        from pypinyin.contrib.tone_convert import to_normal
        from pypinyin.pinyin_dict import pinyin_dict

        jieba.setLogLevel(60)
        self._cut = jieba.lcut
        self._pinyin = lambda s: lazy_pinyin(s, style=Style.NORMAL, errors=lambda x: list(x))
        # The inverse of the normalizer's traditional → simplified table.
        self.s2t: dict[str, list[str]] = defaultdict(list)
        for t, s in zip(charmaps.TRADITIONAL, charmaps.SIMPLIFIED, strict=True):
            self.s2t[s].append(t)
        self._opencc = {}
        try:
            import opencc

            self._opencc = {name: opencc.OpenCC(name) for name in ("s2t", "s2tw", "s2hk")}
        except ImportError:  # the inverse table alone still exercises the step
            pass
        # Common characters (GB2312 level 1) by their usual (first) toneless reading.
        self.homophones: dict[str, list[str]] = defaultdict(list)
        for cp, readings in sorted(pinyin_dict.items()):
            ch = chr(cp)
            try:
                code = ch.encode("gb2312")
            except UnicodeEncodeError:
                continue
            if len(code) == 2 and 0xB0 <= code[0] <= 0xD7:
                self.homophones[to_normal(readings.split(",")[0])].append(ch)

    # -- Latin ---------------------------------------------------------------------------------
    def homoglyph(self, text: str, rng: random.Random) -> str:
        rate = rng.uniform(0.10, 0.40)
        caps = rng.choice([0.0, 0.0, 0.0, 0.1, 0.25])  # some words put in capitals, where look-alikes abound

        def part(s: str) -> str:
            if caps:
                s = _WORD.sub(lambda m: m.group().upper() if rng.random() < caps else m.group(), s)
            return "".join(rng.choice(HOMOGLYPHS[c]) if c in HOMOGLYPHS and rng.random() < rate else c for c in s)

        return _outside_kept(text, part)

    def leet(self, text: str, rng: random.Random) -> str:
        word_rate = rng.uniform(0.3, 0.7)
        char_rate = rng.uniform(0.5, 1.0)
        spaced = rng.random() < 0.35

        def word(m: re.Match[str]) -> str:
            w = m.group()
            if len(w) < 3 or rng.random() >= word_rate:
                return w
            out = "".join(
                rng.choice(LEET[c.lower()]) if c.lower() in LEET and rng.random() < char_rate else c for c in w
            )
            if out == w:  # a word to leet always gets at least one symbol when it can
                at = [i for i, c in enumerate(w) if c.lower() in LEET]
                if at:
                    i = rng.choice(at)
                    out = w[:i] + rng.choice(LEET[w[i].lower()]) + w[i + 1 :]
            return out

        out = _outside_kept(text, lambda part: _WORD.sub(word, part))
        if spaced:  # "f r 3 3": a few leet words spelled out with spaces
            tokens = out.split(" ")
            leeted = set(out.split(" ")) - set(text.split(" "))
            cands = [i for i, t in enumerate(tokens) if 3 <= len(t) <= 10 and t in leeted]
            for i in rng.sample(cands, k=min(len(cands), rng.randint(1, 3))):
                tokens[i] = " ".join(tokens[i])
            out = " ".join(tokens)
        return out

    # -- Chinese -------------------------------------------------------------------------------
    def traditional(self, text: str, rng: random.Random) -> str:
        how = rng.choice(["table", "table", *self._opencc])
        if how == "table":
            return "".join(rng.choice(self.s2t[c]) if c in self.s2t else c for c in text)
        return str(self._opencc[how].convert(text))

    def _words(self, text: str) -> list[tuple[str, list[str] | None]]:
        """jieba words, each with its per-character readings in context when it is all Han."""
        out: list[tuple[str, list[str] | None]] = []
        for w in self._cut(text):
            if w and all(_HAN.match(c) for c in w):
                readings = self._pinyin(w)
                out.append((w, readings if len(readings) == len(w) else None))
            else:
                out.append((w, None))
        return out

    def pinyin_substitution(self, text: str, rng: random.Random) -> str:
        words = self._words(text)
        han = sum(len(w) for w, r in words if r)
        target = max(1, round(han * rng.uniform(0.10, 0.35)))
        order = [i for i, (_, r) in enumerate(words) if r]
        rng.shuffle(order)
        chosen: set[int] = set()
        done = 0
        for i in order:
            if done >= target:
                break
            chosen.add(i)
            done += len(words[i][0])
        style = rng.choice(["joined", "joined", "capitalized", "spaced"])
        out = []
        for i, (w, r) in enumerate(words):
            if i not in chosen or r is None:
                out.append(w)
            elif style == "joined":
                out.append("".join(r))
            elif style == "capitalized":
                out.append("".join(s.capitalize() for s in r))
            else:
                out.append(" " + " ".join(r) + " ")
        return "".join(out)

    def homophone(self, text: str, rng: random.Random) -> str:
        rate = rng.uniform(0.10, 0.35)
        out = []
        for w, r in self._words(text):
            if r is None:
                out.append(w)
                continue
            for c, syl in zip(w, r, strict=True):
                others = [h for h in self.homophones.get(syl, ()) if h != c]
                out.append(rng.choice(others) if others and rng.random() < rate else c)
        return "".join(out)

    def applicable(self, text: str) -> tuple[str, ...]:
        han = len(_HAN.findall(text))
        latin = len(_LATIN_LETTER.findall(text))
        kinds: list[str] = []
        if latin >= 10 and latin >= han:
            kinds += LATIN_KINDS
        if han >= 4:
            kinds += ["traditional", "pinyin_substitution", "homophone"]
        return tuple(kinds)

    def apply(self, kind: str, text: str, rng: random.Random) -> str | None:
        fn: Callable[[str, random.Random], str] = getattr(self, kind)
        for _ in range(3):  # a trick that happens to change nothing is drawn again
            out = fn(text, rng)
            if out != text:
                return out
        return None


def perturb(stream: Sequence[dict[str, Any]], truth: Sequence[dict[str, Any]], sample: float, seed: int,
            kinds: Sequence[str] = KINDS) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The perturbed stream and its truth rows; a variant's truth row has `ptype` = its trick and
    `source` = the id of the copy it was made from."""
    tricks = Tricks()
    rng = random.Random(seed)
    out_s: list[dict[str, Any]] = []
    out_t: list[dict[str, Any]] = []
    for rec, row in zip(stream, truth, strict=True):
        out_s.append(rec)
        out_t.append(row)
        if row["ptype"] == "base" or rng.random() >= sample:
            continue
        for kind in tricks.applicable(rec["text"]):
            if kind not in kinds:
                continue
            # One generator per (message, trick): a variant does not change when another trick changes.
            text = tricks.apply(kind, rec["text"], random.Random(f"{seed}/{rec['id']}/{kind}"))
            if text is None:
                continue
            vid = f"{rec['id']}~{kind}"
            out_s.append({"id": vid, "text": text, "ts": rec["ts"]})
            out_t.append({**row, "id": vid, "ptype": kind, "source": rec["id"]})
    return out_s, out_t


def _recall(tp_fn: tuple[int, int]) -> str:
    tp, fn = tp_fn
    return f"{tp / (tp + fn):.3f}" if tp + fn else "–"


def report(truth: Sequence[dict[str, Any]], results: dict[str, list[Verdict]]) -> str:
    """Markdown tables: overall, per trick (variants vs the copies they came from), per corpus."""
    names = list(results)
    lines = ["| tool | precision | recall | F1 | duplicates matched to another cluster |", "|---|---|---|---|---|"]
    for name, verdicts in results.items():
        r = score(truth, verdicts)
        o = r.overall
        lines.append(f"| {name} | {o.precision:.4f} | {o.recall:.4f} | {o.f1:.4f} | {r.wrong_cluster} |")

    said: dict[str, dict[str, bool]] = {n: {v.id: v.duplicate for v in vs} for n, vs in results.items()}
    # (tool, kind) -> [tp, fn]: of the variants, of the copies they were made from, and of the variants
    # whose copy was found (a copy routed unique is indexed, and its variants can then match it)
    var: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    src: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    kept: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    by_corpus: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    counts: dict[str, int] = defaultdict(int)
    for row in truth:
        kind = row["ptype"]
        if kind not in KINDS or "source" not in row:
            continue
        counts[kind] += 1
        for n in names:
            found = said[n][row["id"]]
            var[n, kind][0 if found else 1] += 1
            src[n, kind][0 if said[n][row["source"]] else 1] += 1
            if said[n][row["source"]]:
                kept[n, kind][0 if found else 1] += 1
        by_corpus[kind, row["corpus"]][0 if said[names[0]][row["id"]] else 1] += 1

    head = " | ".join(f"{n}: copies → variants (of found copies)" for n in names)
    lines += ["", "Recall of the variants of each trick, next to the recall of the copies they were made from:",
              "", f"| trick | variants | {head} |", "|---|---|" + "---|" * len(names)]
    for kind in KINDS:
        if counts[kind]:
            cells = " | ".join(f"{_recall(tuple(src[n, kind]))} → **{_recall(tuple(var[n, kind]))}** "
                               f"({_recall(tuple(kept[n, kind]))})" for n in names)
            lines.append(f"| {kind} | {counts[kind]} | {cells} |")
    corpora = sorted({c for _, c in by_corpus})
    lines += ["", f"{names[0]} recall of the variants per corpus (variants in brackets):", "",
              "| trick | " + " | ".join(corpora) + " |", "|---|" + "---|" * len(corpora)]
    for kind in KINDS:
        if counts[kind]:
            cells = []
            for c in corpora:
                tp, fn = by_corpus[kind, c]
                cells.append(f"{_recall((tp, fn))} ({tp + fn})" if tp + fn else "–")
            lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


TOOLS: dict[str, Callable[[Sequence[Message]], tuple[list[Verdict], object]]] = {
    "neardup": run_neardup,
    "datasketch MinHashLSH": run_datasketch,
}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stream", default=str(ROOT.parent / "shared" / "eval" / "stream.jsonl"))
    p.add_argument("--truth", default=str(ROOT.parent / "shared" / "eval" / "truth.jsonl"))
    p.add_argument("--sample", type=float, default=0.6, help="share of the duplicate copies given variants")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--tools", default=",".join(TOOLS))
    p.add_argument("--dump", default="", help="write PATH.stream.jsonl and PATH.truth.jsonl")
    p.add_argument("--misses", type=int, default=0, help="show this many missed variants per trick")
    args = p.parse_args(argv)
    needs.files(__file__, args.stream, args.truth)

    stream = [orjson.loads(x) for x in open(args.stream, "rb") if x.strip()]
    truth = [orjson.loads(x) for x in open(args.truth, "rb") if x.strip()]
    t0 = time.perf_counter()
    p_stream, p_truth = perturb(stream, truth, args.sample, args.seed, args.kinds.split(","))
    print(f"{len(stream)} messages + {len(p_stream) - len(stream)} variants (seed {args.seed}, sample "
          f"{args.sample}; built in {time.perf_counter() - t0:.0f} s)\n", file=sys.stderr)
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
    print(report(p_truth, results))

    if args.misses:
        first = next(iter(results.values()))
        text_of = {r["id"]: r["text"] for r in p_stream}
        shown: dict[str, int] = defaultdict(int)
        print()
        for row, v in zip(p_truth, first, strict=True):
            kind = row["ptype"]
            if "source" in row and not v.duplicate and shown[kind] < args.misses:
                shown[kind] += 1
                print(f"--- {kind} {row['id']} ({row['corpus']})")
                print(f"  from: {unicodedata.normalize('NFC', text_of[row['source']])[:300]!r}")
                print(f"  made: {text_of[row['id']][:300]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
