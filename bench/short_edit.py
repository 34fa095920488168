"""What a short-text edit-distance check would add to the sketch rule: precision/recall on a labelled stream.

A measuring probe, not part of the filter: it runs the Python reference path (`NearDupFilter(native=False)`)
and, after the sketch rule refuses a candidate, accepts it when both normalized texts have at most
`--short` characters (and at least 4) and their Levenshtein similarity `1 - distance / longer length` is at
least `--ratio`. Shipping the rule needs the short normalized text stored with each entry and the rule in
the compiled table (docs/quality-recall.md).

    python -m bench.short_edit STREAM TRUTH [--short 70 --ratio 0.8 --min-shared 0.2]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a clone

from bench import needs  # noqa: E402
from filters.config import FilterConfig  # noqa: E402
from filters.engine import Match, Message, NearDupFilter, Verdict  # noqa: E402
from filters.fingerprint import Fingerprint  # noqa: E402
from filters.index import Entry  # noqa: E402
from filters.sketch import Probe  # noqa: E402
from stream.eval_report import load, score_lengths  # noqa: E402
from stream.evaluate import score  # noqa: E402


def levenshtein(a: str, b: str) -> int:
    if len(a) < len(b):
        a, b = b, a
    prev = np.arange(len(b) + 1)
    codes = np.array([ord(c) for c in b])
    for i, ca in enumerate(a, 1):
        cost = (codes != ord(ca)).astype(np.int64)
        cur = np.empty_like(prev)
        cur[0] = i
        sub = np.minimum(prev[1:] + 1, prev[:-1] + cost)
        for j in range(1, len(b) + 1):  # the insertion term runs along the row
            cur[j] = min(sub[j - 1], cur[j - 1] + 1)
        prev = cur
    return int(prev[-1])


class ShortEditFilter(NearDupFilter):
    def __init__(self, config: FilterConfig, short: int, ratio: float) -> None:
        super().__init__(config, native=False)
        self.short, self.ratio = short, ratio
        self._normalized: dict[str, str] = {}

    def check_batch(self, messages: Sequence[Message]) -> list[Verdict]:
        texts = self.fingerprinter.normalizer.normalize_batch([m.text for m in messages])
        self._normalized.update((m.id, t) for m, t in zip(messages, texts, strict=True) if len(t) <= self.short)
        return super().check_batch(messages)

    def _sketch_match(self, fp: Fingerprint, entry: Entry, method: str, probe: Probe | None) -> Match:
        m = super()._sketch_match(fp, entry, method, probe)
        other = self._normalized.get(entry.id)
        if m.ok or other is None or not 4 <= len(fp.normalized) <= self.short or len(other) < 4:
            return m
        similarity = 1 - levenshtein(fp.normalized, other) / max(len(fp.normalized), len(other))
        return Match(True, similarity, "edit") if similarity >= self.ratio else m


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stream", default=str(ROOT.parent / "shared" / "eval" / "stream.jsonl"))
    p.add_argument("--truth", default=str(ROOT.parent / "shared" / "eval" / "truth.jsonl"))
    p.add_argument("--short", type=int, default=70, help="0: the sketch rule alone")
    p.add_argument("--ratio", type=float, default=0.8)
    p.add_argument("--min-shared", type=float, default=FilterConfig().min_shared)
    args = p.parse_args(argv)
    needs.files(__file__, args.stream, args.truth)
    stream, truth = load(args.stream), load(args.truth)
    nd = ShortEditFilter(FilterConfig(min_shared=args.min_shared), args.short, args.ratio)
    verdicts: list[Verdict] = []
    for i in range(0, len(stream), 512):
        verdicts += nd.check_batch([Message(r["id"], r["text"], r["ts"]) for r in stream[i : i + 512]])
    rep = score(truth, verdicts)
    lengths = score_lengths(truth, [r["text"] for r in stream], verdicts)
    o = rep.overall
    print(f"precision {o.precision:.4f} recall {o.recall:.4f} F1 {o.f1:.4f} FP {o.fp} FN {o.fn}")
    print("recall by length: " + ", ".join(f"{b} {t.recall:.3f}" for b, t in sorted(lengths.by_length.items())))
    print("recall below 0.97: " + ", ".join(f"{k} {t.recall:.3f}" for k, t in sorted(rep.by_ptype.items())
                                            if t.tp + t.fn and t.recall < 0.97))
    return 0


if __name__ == "__main__":
    sys.exit(main())
