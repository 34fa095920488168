"""Benchmark: the highest precision the verification rules reach on a labelled stream while the recall targets hold.

    python bench/frontier.py [--stream ../shared/eval/stream.jsonl --truth ../shared/eval/truth.jsonl]
                             [--threshold 0.5,0.55,0.6,0.65] [--threshold-long 0.55,0.6,0.65,0.7]
                             [--containment 0.8,0.85,0.9] [--edit-similarity 0.85,0.88,0.9]
                             [--min-shared 0.2,0.25,0.3] [--f1 0.99] [--kind 0.95] [--short 0.95] [--top 5]

Every combination of the rule parameters given (`threshold_long` below `threshold` is skipped: it would be
off) routes the stream through the embedded filter (`check_batch`, batches of 512, the memory index), scored
as `neardup eval` scores it. A combination is feasible when F1, the recall of every perturbation kind and the
recall of texts of at most 30 and of 31-70 characters reach the bounds given (#19's targets by default).
Printed: the defaults' row, the `--top` feasible rows of highest precision, and the `--top` rows of highest
precision of all. The other parameters stay at their defaults.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import needs  # noqa: E402
from filters.config import FilterConfig  # noqa: E402
from filters.engine import NearDupFilter  # noqa: E402
from filters.errors import ConfigError  # noqa: E402
from filters.records import Message  # noqa: E402
from stream.codec import Decoded, RecordFormat, decode_batch  # noqa: E402
from stream.eval_report import score_lengths  # noqa: E402
from stream.evaluate import read_truth, score  # noqa: E402
from stream.runner import RawRecord  # noqa: E402

GRID = {"threshold": "0.5,0.55,0.6,0.65", "threshold_long": "0.55,0.6,0.65,0.7", "containment": "0.8,0.85,0.9",
        "edit_similarity": "0.85,0.88,0.9", "min_shared": "0.2,0.25,0.3"}


@dataclass(frozen=True, slots=True)
class Point:
    """One combination's scores."""

    params: tuple[tuple[str, float], ...]
    precision: float
    recall: float
    f1: float
    tp: int
    fp: int
    fn: int
    weakest_kind: tuple[str, float]
    weakest_short: float  # the lower recall of texts <= 30 and 31-70 characters

    def feasible(self, f1: float, kind: float, short: float) -> bool:
        return self.f1 >= f1 and self.weakest_kind[1] >= kind and self.weakest_short >= short

    def row(self) -> str:
        params = ", ".join(f"{k} {v:g}" for k, v in self.params)
        name, recall = self.weakest_kind
        return (f"| {params} | {self.precision:.4f} | {self.recall:.4f} | {self.f1:.4f} | {self.tp} / {self.fp} / "
                f"{self.fn} | {name} {recall:.3f} | {self.weakest_short:.3f} |")


def measure(messages: list[Message | None], truth: list[dict[str, Any]], texts: list[str],
            params: dict[str, float]) -> Point:
    nd = NearDupFilter(FilterConfig(**params))  # type: ignore[arg-type]
    routed = [m for m in messages if m is not None]
    decided = iter([v for i in range(0, len(routed), 512) for v in nd.check_batch(routed[i : i + 512])])
    verdicts = [None if m is None else next(decided) for m in messages]  # a record that is not a message: rejected
    report = score(truth, verdicts)
    lengths = score_lengths(truth, texts, verdicts)
    o = report.overall
    kinds = [(name, t.recall) for name, t in report.by_ptype.items() if t.tp + t.fn]
    weakest = min(kinds, key=lambda k: k[1])
    short = min(lengths.by_length[band].recall for band in ("<=30", "31-70") if band in lengths.by_length)
    return Point(tuple(params.items()), o.precision, o.recall, o.f1, o.tp, o.fp, o.fn, weakest, short)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stream", type=Path, default=ROOT.parent / "shared" / "eval" / "stream.jsonl")
    p.add_argument("--truth", type=Path, default=ROOT.parent / "shared" / "eval" / "truth.jsonl")
    for name, tried in GRID.items():
        p.add_argument("--" + name.replace("_", "-"), default=tried, help=f"values to try (default {tried})")
    p.add_argument("--f1", type=float, default=0.99)
    p.add_argument("--kind", type=float, default=0.95, help="the lowest recall of a perturbation kind")
    p.add_argument("--short", type=float, default=0.95, help="the lowest recall of texts <= 30 and 31-70 chars")
    p.add_argument("--top", type=int, default=5)
    args = p.parse_args()
    needs.files(__file__, args.stream, args.truth)
    try:
        grid = {name: [float(v) for v in getattr(args, name).split(",")] for name in GRID}
        with open(args.stream, "rb") as s, open(args.truth, "rb") as t:
            lines = [line.rstrip(b"\r\n") for line in s if line.strip()]
            truth = read_truth(t, str(args.truth))
    except (OSError, ValueError, ConfigError) as exc:
        raise SystemExit(f"frontier: {exc}") from None
    if len(lines) != len(truth):
        raise SystemExit(f"frontier: {args.truth} has {len(truth)} rows but {args.stream} has {len(lines)} records")
    # Decoded as `neardup eval` decodes them: a record it rejects has no verdict.
    decoded = decode_batch([RawRecord(line, str(n + 1), 0.0) for n, line in enumerate(lines)], RecordFormat())
    messages = [d.message if isinstance(d, Decoded) else None for d in decoded]
    texts = [m.text if m is not None else "" for m in messages]
    defaults = FilterConfig()
    started = time.perf_counter()
    base = measure(messages, truth, texts, {name: getattr(defaults, name) for name in GRID})
    points = []
    for values in itertools.product(*grid.values()):
        params = dict(zip(grid, values))
        if params["threshold_long"] < params["threshold"]:
            continue
        points.append(measure(messages, truth, texts, params))
    feasible = [pt for pt in points if pt.feasible(args.f1, args.kind, args.short)]
    head = ["| parameters | precision | recall | F1 | TP / FP / FN | weakest kind | weakest short band |",
            "|---|---|---|---|---|---|---|"]
    print(f"{len(messages)} messages, {len(points)} combinations in {time.perf_counter() - started:.0f} s; "
          f"feasible (F1 >= {args.f1}, every kind >= {args.kind}, <= 70 chars >= {args.short}): {len(feasible)}")
    print("\nThe defaults:\n")
    print("\n".join([*head, base.row()]))
    print(f"\nFeasible, highest precision first ({len(feasible)}):\n")
    print("\n".join([*head, *(pt.row() for pt in sorted(feasible, key=lambda q: (-q.precision, -q.f1))[: args.top])]))
    print("\nAll, highest precision first:\n")
    print("\n".join([*head, *(pt.row() for pt in sorted(points, key=lambda q: (-q.precision, -q.f1))[: args.top])]))


if __name__ == "__main__":
    main()
