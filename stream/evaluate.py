"""Scores routing against a labelled stream: precision, recall, F1 overall, per perturbation kind and per corpus.

The measure is the one defined in shared/eval/README.md: a message is truly a duplicate when an earlier
message of the stream has the same cluster; a gray message routed duplicate is not a false positive.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from filters.engine import Verdict
from filters.errors import ConfigError


@dataclass
class Tally:
    tp: int = 0
    fp: int = 0
    fn: int = 0
    tn: int = 0

    @property
    def precision(self) -> float:
        return self.tp / (self.tp + self.fp) if self.tp + self.fp else 1.0

    @property
    def recall(self) -> float:
        return self.tp / (self.tp + self.fn) if self.tp + self.fn else 1.0

    @property
    def f1(self) -> float:
        p, r = self.precision, self.recall
        return 2 * p * r / (p + r) if p + r else 0.0


@dataclass
class Report:
    overall: Tally = field(default_factory=Tally)
    by_ptype: dict[str, Tally] = field(default_factory=lambda: defaultdict(Tally))
    by_corpus: dict[str, Tally] = field(default_factory=lambda: defaultdict(Tally))
    wrong_cluster: int = 0  # true positives whose duplicate_of belongs to another cluster
    messages: int = 0
    routed: int = 0
    rejected: int = 0
    seconds: float = 0.0

    def table(self) -> str:
        o = self.overall
        rate = self.messages / self.seconds if self.seconds else 0.0
        lines = [
            f"messages {self.messages}  routed {self.routed}  rejected {self.rejected}  "
            f"lost {self.messages - self.routed - self.rejected}  ({rate:,.0f} messages/s)",
            "",
            "| measure | value |",
            "|---|---|",
            f"| precision | {o.precision:.4f} |",
            f"| recall | {o.recall:.4f} |",
            f"| F1 | {o.f1:.4f} |",
            f"| TP / FP / FN | {o.tp} / {o.fp} / {o.fn} |",
            f"| matched another cluster | {self.wrong_cluster} ({self.wrong_cluster / max(o.tp, 1):.2%} of TP) |",
            "",
            "| perturbation | duplicates | recall |",
            "|---|---|---|",
        ]
        for name, t in sorted(self.by_ptype.items()):
            if t.tp + t.fn:
                lines.append(f"| {name} | {t.tp + t.fn} | {t.recall:.3f} |")
        lines += ["", "| corpus | precision | recall | F1 |", "|---|---|---|---|"]
        for name, t in sorted(self.by_corpus.items()):
            lines.append(f"| {name} | {t.precision:.4f} | {t.recall:.4f} | {t.f1:.4f} |")
        return "\n".join(lines)


TRUTH_FIELDS = ("id", "cluster", "corpus", "ptype")


def read_truth(lines: Iterable[bytes], name: str) -> list[dict[str, Any]]:
    """Truth rows (JSONL, one per stream record, in stream order): id, cluster, corpus, ptype, optional gray."""
    rows = []
    for number, line in enumerate((line for line in lines if line.strip()), start=1):
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError:
            raise ConfigError(f"{name}: row {number} is not JSON") from None
        if not isinstance(row, dict) or (missing := [f for f in TRUTH_FIELDS if f not in row]):
            raise ConfigError(f"{name}: row {number} needs the fields {', '.join(TRUTH_FIELDS)} (and optionally gray)"
                              + (f"; missing {', '.join(missing)}" if isinstance(row, dict) else ""))
        rows.append(row)
    return rows


def score(truth: Sequence[dict[str, Any]], verdicts: Iterable[Verdict | None]) -> Report:
    """`truth` rows in stream order; `verdicts[i]` for row i, None when it was rejected."""
    report = Report()
    cluster_of = {row["id"]: row["cluster"] for row in truth}
    seen: set[str] = set()
    for row, verdict in zip(truth, verdicts, strict=True):
        report.messages += 1
        truly = row["cluster"] in seen
        seen.add(row["cluster"])
        if verdict is None:
            report.rejected += 1
            said = False
        else:
            report.routed += 1
            said = verdict.duplicate
        for t in (report.overall, report.by_corpus[row["corpus"]]):
            _count(t, said, truly, row.get("gray", False))
        if truly or said:
            _count(report.by_ptype[row["ptype"]], said, truly, row.get("gray", False))
        if said and truly and verdict is not None and cluster_of.get(verdict.duplicate_of) != row["cluster"]:
            report.wrong_cluster += 1
    return report


def _count(t: Tally, said: bool, truly: bool, gray: bool) -> None:
    if said and truly:
        t.tp += 1
    elif said and not gray:
        t.fp += 1
    elif truly:
        t.fn += 1
    elif not said:
        t.tn += 1
