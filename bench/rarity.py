"""Measurement: would rarity evidence (how many representatives hold a shared bucket key) refuse template siblings?

A template sibling (dividend notices of two companies, the same spam body under another subject) shares mostly
keys that many other messages of the window hold too; a copy should share the rare ones as well. This runs
the default filter on the development stream (and on a `python -m bench.perturb --dump` stream) with one
refusal added after the sketch and edit rules, each reading the sizes of the query's buckets at lookup time,
and prints what each costs (docs/quality-recall.md):

    python bench/rarity.py [--stream S --truth T] [--gen /tmp/gen] [--fps] [--idf]

A bucket's size is the number of representatives (messages routed unique) indexed under the key before the
message, capped at `bucket_cap`, which is what a lookup in either index could count; the whole stream fits the
window. The verifier sees it through `first_match`, the per-message path of the Python memory index.

`--idf` measures the same evidence on every shingle instead of the sampled keys, outside the filter: each
accepted pair's Jaccard of its 4-character shingles weighted by log((R + 1) / (r + 1)), R the representatives
before the message and r those holding the shingle, and how many accepted true positives fall at or below each
false positive.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a clone

from bench import needs  # noqa: E402
from filters.config import FilterConfig  # noqa: E402
from filters.engine import NearDupFilter  # noqa: E402
from filters.fingerprint import Fingerprint  # noqa: E402
from filters.index import Candidate  # noqa: E402
from filters.index.memory import MemoryIndex  # noqa: E402
from filters.records import Message, Verdict  # noqa: E402
from filters.sketch import Probe  # noqa: E402
from stream.eval_report import load  # noqa: E402


@dataclass(frozen=True, slots=True)
class Keys:
    """What a rule sees of one candidate: the query's bucket sizes and which of its keys the candidate holds."""

    sizes: tuple[int, ...]
    shared: tuple[bool, ...]
    jaccard: float
    exact: bool = False  # found by the exact key (same normalized text)

    def shared_sizes(self) -> list[int]:
        return [s for s, h in zip(self.sizes, self.shared, strict=True) if h]


Rule = Callable[[Keys], bool]  # True: refuse the candidate


def no_key_below(size: int, jaccard: float) -> Rule:
    """Refuse when every shared key's bucket holds at least `size` representatives (and Jaccard < `jaccard`)."""
    return lambda k: k.jaccard < jaccard and min(k.shared_sizes(), default=0) >= size


def rare_below_floor(size: int, jaccard: float, min_shared: float) -> Rule:
    """Refuse when fewer shared keys than the `min_shared` floor have a bucket of at most `size`."""
    def rule(k: Keys) -> bool:
        rare = sum(1 for s in k.shared_sizes() if s <= size)
        return k.jaccard < jaccard and rare < max(1, math.ceil(min_shared * len(k.sizes)))
    return rule


def weighted_share(below: float, jaccard: float) -> Rule:
    """Refuse when the shared keys weigh less than `below` of the query's keys, each weighing 1 / bucket size."""
    def rule(k: Keys) -> bool:
        total = sum(1.0 / max(s, 1) for s in k.sizes)
        share = sum(1.0 / s for s in k.shared_sizes()) / total if total else 0.0
        return k.jaccard < jaccard and share < below
    return rule


RULES: tuple[tuple[str, Rule | None], ...] = (
    ("defaults", None),
    ("no shared key held by the candidate alone, Jaccard < 0.6", no_key_below(2, 0.6)),
    ("no shared key held by the candidate alone, Jaccard < 0.7", no_key_below(2, 0.7)),
    ("no shared key in a bucket of fewer than 3, Jaccard < 0.6", no_key_below(3, 0.6)),
    ("no shared key in a bucket of fewer than 5, Jaccard < 0.6", no_key_below(5, 0.6)),
    ("shared keys held by the candidate alone fewer than the min_shared floor, Jaccard < 0.6",
     rare_below_floor(1, 0.6, 0.2)),
    ("shared keys in buckets of at most 2 fewer than the floor, Jaccard < 0.6", rare_below_floor(2, 0.6, 0.2)),
    ("shared keys in buckets of at most 4 fewer than the floor, Jaccard < 0.6", rare_below_floor(4, 0.6, 0.2)),
    ("key share weighted by 1 / bucket size < 0.15, Jaccard < 0.6", weighted_share(0.15, 0.6)),
    ("key share weighted by 1 / bucket size < 0.2, Jaccard < 0.6", weighted_share(0.2, 0.6)),
)


class RarityFilter(NearDupFilter):
    """The default filter on the Python memory index, one message at a time, with a refusal `rule` that sees the
    sizes of the message's buckets; `seen` records, per accepted pair, those sizes (for the table of pairs)."""

    def __init__(self, rule: Rule | None, config: FilterConfig | None = None) -> None:
        cfg = config or FilterConfig()
        super().__init__(cfg, index=MemoryIndex(cfg.window, cfg.bucket_cap, native=False))
        self.rule = rule
        self.held: Counter[int] = Counter()  # representatives per key (nothing expires: the stream fits the window)
        self.keys_of: dict[str, frozenset[int]] = {}
        self.seen: dict[str, Keys] = {}
        self.idf = False  # `run` also weighs each accepted pair's shingles by their rarity (`weighted`)
        self.weighted: dict[str, float] = {}

    def first_match(self, msg: Message, fp: Fingerprint, candidates: Sequence[Candidate]) -> Verdict:
        cap = self.config.bucket_cap
        sizes = tuple(min(self.held[k], cap) for k in fp.keys)
        probe = Probe(fp.sketch, fp.size)
        floor = self.floor(len(fp.keys))
        for cand in candidates:
            if cand.entry.exact != fp.exact and cand.shared < floor:
                continue
            m = self.verify(fp, cand, probe)
            if not m.ok:
                continue
            own = self.keys_of[cand.entry.id]
            keys = Keys(sizes, tuple(k in own for k in fp.keys), probe.estimates(cand.entry.sketch, cand.entry.size)[0],
                        m.method == "exact")
            if m.method != "exact" and self.rule is not None and self.rule(keys):
                continue
            self.seen[msg.id] = keys
            return Verdict(msg.id, True, cand.entry.id, round(m.similarity, 4), m.method)
        return Verdict(msg.id, False)

    def run(self, stream: Sequence[dict[str, Any]]) -> list[Verdict]:
        out: list[Verdict] = []
        shingles: dict[str, frozenset[str]] = {}
        df: Counter[str] = Counter()
        reps = 0
        for start in range(0, len(stream), 512):
            part = stream[start : start + 512]
            fps = self.prepare([r["text"] for r in part])
            for r, fp in zip(part, fps, strict=True):
                v = self.decide([Message(r["id"], r["text"], float(r.get("ts", 0.0)))], [fp])[0]
                out.append(v)
                if self.idf:
                    own = shingles[r["id"]] = frozenset(fp.normalized[i : i + 4]
                                                        for i in range(max(1, len(fp.normalized) - 3)))
                    if v.duplicate and v.method != "exact":
                        other = shingles[v.duplicate_of or ""]
                        weight = {x: math.log((reps + 1) / (df[x] + 1)) + 0.01 for x in own | other}
                        union = sum(weight.values())
                        self.weighted[r["id"]] = sum(weight[x] for x in own & other) / union if union else 0.0
                if not v.duplicate:
                    keys = frozenset(fp.keys)
                    self.keys_of[r["id"]] = keys
                    self.held.update(keys)
                    if self.idf:
                        df.update(shingles[r["id"]])
                        reps += 1
        return out


WEAK = ("word_edit", "truncation", "ad_prefix_suffix", "name_substitution")


def idf_table(dev: Sequence[dict[str, Any]], truth: Sequence[dict[str, Any]]) -> str:
    """For each false positive's rarity-weighted Jaccard: false positives and true positives at or below it."""
    nd = RarityFilter(None)
    nd.idf = True
    nd.run(dev)
    seen: set[str] = set()
    tps: list[tuple[float, str]] = []
    fps: list[float] = []
    for row in truth:
        truly = row["cluster"] in seen
        seen.add(row["cluster"])
        if row["id"] not in nd.weighted:
            continue
        if truly:
            tps.append((nd.weighted[row["id"]], row["ptype"]))
        elif not row.get("gray", False):
            fps.append(nd.weighted[row["id"]])
    lines = ["| rarity-weighted Jaccard at or below | false positives | true positives | of them word_edit, truncation, "
             "ad_prefix_suffix, name_substitution |", "|---|---|---|---|"]
    for value in sorted(set(round(f, 2) for f in fps)):
        below = [k for w, k in tps if w <= value]
        lines.append(f"| {value:.2f} | {sum(1 for f in fps if f <= value)} | {len(below)} | "
                     f"{sum(1 for k in below if k in WEAK)} |")
    return "\n".join(lines)


def tally(truth: Sequence[dict[str, Any]], verdicts: Sequence[Verdict], kinds_of: Callable[[dict[str, Any]], bool],
          ) -> tuple[int, int, int, int, list[tuple[str, float]], list[int]]:
    """TP, FP, FN, FP not of a hard-negative kind, the three lowest kinds' recall (rows `kinds_of` picks), FPs."""
    seen: set[str] = set()
    tp = fp = fn = fp_plain = 0
    kinds: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    fps: list[int] = []
    for i, (row, v) in enumerate(zip(truth, verdicts, strict=True)):
        truly = row["cluster"] in seen
        seen.add(row["cluster"])
        if truly and kinds_of(row):
            kinds[row["ptype"]][0] += v.duplicate
            kinds[row["ptype"]][1] += 1
        if v.duplicate and truly:
            tp += 1
        elif v.duplicate and not row.get("gray", False):
            fp += 1
            fp_plain += not row["ptype"].startswith("hn_")
            fps.append(i)
        elif truly:
            fn += 1
    lowest = sorted(((k, a / b) for k, (a, b) in kinds.items()), key=lambda kv: kv[1])[:3]
    return tp, fp, fn, fp_plain, lowest, fps


def accepted_kinds(nd: RarityFilter, stream: Sequence[dict[str, Any]], truth: Sequence[dict[str, Any]],
                   kinds_of: Callable[[dict[str, Any]], bool]) -> tuple[Counter[str], Counter[str], Counter[str]]:
    """Per kind, of the true positives `nd` accepted not by the exact key: all, those sharing no key that their
    candidate holds alone (every shared bucket holds another representative), and those under Jaccard 0.6."""
    total: Counter[str] = Counter()
    alone: Counter[str] = Counter()
    low: Counter[str] = Counter()
    seen: set[str] = set()
    for msg, row in zip(stream, truth, strict=True):
        truly = row["cluster"] in seen
        seen.add(row["cluster"])
        keys = nd.seen.get(msg["id"])
        if not truly or keys is None or not kinds_of(row) or keys.exact or not keys.shared_sizes():
            continue
        total[row["ptype"]] += 1
        alone[row["ptype"]] += min(keys.shared_sizes()) >= 2
        low[row["ptype"]] += keys.jaccard < 0.6
    return total, alone, low


def top(counts: Counter[str]) -> str:
    """The weak kinds' counts (those near 0.95), then the largest others."""
    shown = [k for k in (*WEAK, "name_sub") if k in counts] + [k for k, _ in counts.most_common(2)]
    return ", ".join(f"{k} {counts[k]}" for k in dict.fromkeys(shown))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stream", default=str(ROOT.parent / "shared" / "eval" / "stream.jsonl"))
    p.add_argument("--truth", default=str(ROOT.parent / "shared" / "eval" / "truth.jsonl"))
    p.add_argument("--gen", default="", help="also score PATH.stream.jsonl / PATH.truth.jsonl (bench.perturb --dump)")
    p.add_argument("--fps", action="store_true", help="print the defaults' false positives with their bucket sizes")
    p.add_argument("--idf", action="store_true", help="print the shingle-rarity table (below) instead of the rules")
    args = p.parse_args(argv)
    needs.files(__file__, args.stream, args.truth, *([args.gen + ".stream.jsonl", args.gen + ".truth.jsonl"] if args.gen else []))
    pairs: list[tuple[int, Keys]] = []
    counts: list[tuple[str, tuple[Counter[str], Counter[str], Counter[str]]]] = []
    dev, dev_truth = load(args.stream), load(args.truth)
    gen = gen_truth = None
    if args.gen:
        gen, gen_truth = load(args.gen + ".stream.jsonl"), load(args.gen + ".truth.jsonl")
    if args.idf:
        print(idf_table(dev, dev_truth))
        return 0
    print("| refusal added | dev TP / FP / FN | dev lowest kinds | generated TP / FP / FN (not hn_*) | "
          "generated lowest kinds |")
    print("|---|---|---|---|---|")
    for name, rule in RULES:
        nd = RarityFilter(rule)
        verdicts = nd.run(dev)
        tp, fp, fn, _, lowest, fps = tally(dev_truth, verdicts, lambda row: True)
        cells = [name, f"{tp} / {fp} / {fn}", ", ".join(f"{k} {r:.3f}" for k, r in lowest), "", ""]
        if gen is not None and gen_truth is not None:
            g = tally(gen_truth, RarityFilter(rule).run(gen), lambda row: "source" in row)
            cells[3] = f"{g[0]} / {g[1]} / {g[2]} ({g[3]})"
            cells[4] = ", ".join(f"{k} {r:.3f}" for k, r in g[4])
        print("| " + " | ".join(cells) + " |", flush=True)
        if args.fps and rule is None:
            pairs = [(i, nd.seen[dev[i]["id"]]) for i in fps]
            counts = [("dev", accepted_kinds(nd, dev, dev_truth, lambda row: True))]
            if gen is not None and gen_truth is not None:
                gnd = RarityFilter(None)
                gnd.run(gen)
                counts.append(("generated", accepted_kinds(gnd, gen, gen_truth, lambda row: "source" in row)))
    if args.fps:
        print("\n| stream | accepted true positives (not exact) | with no shared key held by the candidate alone | "
              "under Jaccard 0.6 |")
        print("|---|---|---|---|")
        for name, (total, alone, low) in counts:
            print(f"| {name} | {sum(total.values())} | {sum(alone.values())} ({top(alone)}) | "
                  f"{sum(low.values())} ({top(low)}) |")
        print("\n| false positive (the later text) | Jaccard | shared keys: bucket sizes | query keys |")
        print("|---|---|---|---|")
        for i, keys in pairs:
            text = dev[i]["text"][:40].replace("\n", " ").replace("|", "/")
            print(f"| {text} | {keys.jaccard:.2f} | {sorted(keys.shared_sizes())} | {len(keys.sizes)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
