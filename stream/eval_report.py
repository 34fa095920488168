"""Where the filter misses on a labelled stream (`neardup eval`): recall per text length, worst misses and false positives.

What `neardup eval` adds to the measure of shared/eval/README.md (`stream.evaluate.score`, which gives recall per
perturbation kind): recall and precision per length band of the message (characters of the raw text: <= 30,
31-70, 71-200, > 200), and the worst misses and false positives, each with `explain`-style detail against the
message it should (or should not) have matched: shared bucket keys, sketch Jaccard and containment, and which
rule refused.

    neardup eval STREAM TRUTH [--index memory://|redis://...] [--misses 10] [--fps 10] [filter options]
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import orjson

from filters.config import FilterConfig
from filters.edits import lcs_similarity
from filters.engine import NearDupFilter, Verdict
from filters.fingerprint import key_method
from filters.index import Candidate, Entry
from filters.sketch import overlap, size_ratio
from stream.evaluate import Tally, _count

LENGTH_BANDS: tuple[tuple[str, int], ...] = (("<=30", 30), ("31-70", 70), ("71-200", 200), (">200", 1 << 62))


def length_band(text: str) -> str:
    n = len(text)
    for name, upper in LENGTH_BANDS:
        if n <= upper:
            return name
    return LENGTH_BANDS[-1][0]


@dataclass(frozen=True, slots=True)
class PairDetail:
    """Why a pair was (not) matched: what `neardup explain` prints, on one line."""

    shared_keys: int
    keys: int
    floor: int
    jaccard: float
    containment: float
    size_a: int
    size_b: int
    verified: bool
    rule: str
    edit: float = -1.0  # LCS similarity of the two normalized texts when both are short, else -1

    def line(self) -> str:
        edit = f", LCS {self.edit:.2f}" if self.edit >= 0 else ""
        return (f"shared keys {self.shared_keys}/{self.keys} (floor {self.floor}); jaccard {self.jaccard:.2f}, "
                f"containment {self.containment:.2f}{edit}; shingles {self.size_a}/{self.size_b}; "
                f"verified {self.verified}; {self.rule}")


def pair_detail(nd: NearDupFilter, earlier: str, later: str) -> PairDetail:
    """The decision of `later` against `earlier` alone, and the first rule that refuses it."""
    cfg = nd.config
    fa, fb = nd.fingerprinter.fingerprint_batch([earlier, later])
    shared = [k for k in fb.keys if k in set(fa.keys)]
    floor = nd.floor(len(fb.keys)) if fb.keys else 1
    ov = overlap(fb.sketch, fb.size, fa.sketch, fa.size)
    containment = max(ov.containment_a, ov.containment_b)
    match = nd.verify(fb, Candidate(Entry.of("A", 0.0, fa), len(shared), shared[0] if shared else 0))
    edit = lcs_similarity(fa.chars, fb.chars) if fa.chars and fb.chars else -1.0
    if not shared:
        rule = "no shared bucket key (candidate never found)"
    elif len(shared) < floor:
        rule = f"too few shared keys ({dict(Counter(key_method(k) for k in shared))} < min_shared floor)"
    elif match.ok:
        rule = f"matches alone via {match.method}"
    elif ov.jaccard >= cfg.threshold and edit < 0 and containment < cfg.containment:
        rule = (f"jaccard passes threshold {cfg.threshold} but not threshold_long {cfg.threshold_long} "
                "(a long pair of about one size)")
    elif containment >= cfg.containment and size_ratio(fa.size, fb.size) < cfg.containment_min_ratio:
        rule = "containment passes but size ratio below containment_min_ratio"
    elif containment >= cfg.containment and min(fa.size, fb.size) < cfg.containment_min_size:
        rule = "containment passes but text below containment_min_size shingles"
    elif containment >= cfg.containment:
        rule = ("containment passes but the contained text has more shingles of its own than containment_slack "
                "and containment_slack_share allow")
    elif edit >= 0:
        rule = f"similarity below threshold {cfg.threshold} / containment {cfg.containment} / LCS {cfg.edit_similarity}"
    else:
        rule = f"similarity below threshold {cfg.threshold} / containment {cfg.containment}"
    return PairDetail(len(shared), len(fb.keys), floor, ov.jaccard, containment, fa.size, fb.size,
                      match.ok, rule, edit)


@dataclass
class LengthReport:
    by_length: dict[str, Tally]
    by_ptype_length: dict[tuple[str, str], Tally]


def score_lengths(truth: Sequence[dict[str, Any]], texts: Sequence[str],
                  verdicts: Sequence[Verdict | None]) -> LengthReport:
    by_length: dict[str, Tally] = defaultdict(Tally)
    by_pl: dict[tuple[str, str], Tally] = defaultdict(Tally)
    seen: set[str] = set()
    for row, text, verdict in zip(truth, texts, verdicts, strict=True):
        truly = row["cluster"] in seen
        seen.add(row["cluster"])
        said = verdict is not None and verdict.duplicate
        band = length_band(text)
        _count(by_length[band], said, truly, row.get("gray", False))
        if truly or said:
            _count(by_pl[(row["ptype"], band)], said, truly, row.get("gray", False))
    return LengthReport(by_length, by_pl)


def length_table(lengths: LengthReport) -> str:
    lines = ["| length (chars) | duplicates | recall | precision |", "|---|---|---|---|"]
    for name, _ in LENGTH_BANDS:
        t = lengths.by_length.get(name, Tally())
        lines.append(f"| {name} | {t.tp + t.fn} | {t.recall:.3f} | {t.precision:.4f} |")
    return "\n".join(lines)


def worst(stream: Sequence[dict[str, Any]], truth: Sequence[dict[str, Any]], verdicts: Sequence[Verdict | None],
          config: FilterConfig, n_misses: int, n_fps: int, kind: str | None = None) -> str:
    """Misses (against the first message of their cluster) and false positives (against what they matched);
    with `kind`, only those whose truth row has that perturbation kind (`ptype`)."""
    first_of: dict[str, int] = {}
    by_id = {r["id"]: i for i, r in enumerate(stream)}
    misses: list[int] = []
    fps: list[tuple[int, Verdict]] = []
    indexed: set[str] = set()  # the clusters with a message routed unique so far: one the index holds
    unindexed: set[int] = set()  # the misses none of whose cluster's earlier messages the index holds
    for i, (row, v) in enumerate(zip(truth, verdicts, strict=True)):
        truly = row["cluster"] in first_of
        first_of.setdefault(row["cluster"], i)
        if v is None:
            continue  # rejected: `score` counts it, there is no pair to show
        listed = kind is None or row["ptype"] == kind
        if truly and not v.duplicate and listed:
            misses.append(i)
            if row["cluster"] not in indexed:
                unindexed.add(i)
        elif v.duplicate and not truly and not row.get("gray", False) and listed:
            fps.append((i, v))
        if not v.duplicate:
            indexed.add(row["cluster"])
    probe = NearDupFilter(config)
    out: list[str] = []
    of = f" of kind {kind}" if kind is not None else ""
    if n_misses:
        out.append(f"## Misses{of} ({len(misses)})")
    if n_misses and misses:
        rules: Counter[str] = Counter()
        details: list[tuple[float, int, PairDetail]] = []
        for i in misses:
            d = pair_detail(probe, stream[first_of[truth[i]["cluster"]]]["text"], stream[i]["text"])
            if d.verified and i in unindexed:  # a duplicate is not indexed: a copy of it finds only what it matched
                d = replace(d, rule="matches alone, but its cluster's earlier messages were all routed duplicate "
                                    "(none indexed)")
            rules[d.rule.split(" (")[0]] += 1
            details.append((max(d.jaccard, d.containment), i, d))
        out.append("| refusing rule | misses |")
        out.append("|---|---|")
        out += [f"| {r} | {c} |" for r, c in rules.most_common()]
        out.append("")
        out.append("(A miss that matches alone lost to the ranking, the bucket cap or another candidate.)")
        out.append("")
        details.sort(key=lambda t: -t[0])  # the nearest misses first: the cheapest to win back
        for _, i, d in details[:n_misses]:
            a = stream[first_of[truth[i]["cluster"]]]["text"]
            out.append(f"- [{truth[i]['ptype']}, {truth[i]['corpus']}, {len(stream[i]['text'])} chars] {d.line()}")
            out.append(f"  A: {a[:160]!r}")
            out.append(f"  B: {stream[i]['text'][:160]!r}")
    if n_fps:
        out += [""] * bool(out) + [f"## False positives{of} ({len(fps)})"]
        fp_details = []
        for i, v in fps:
            j = by_id.get(v.duplicate_of or "", i)
            fp_details.append((v.similarity, v.method, i, j, pair_detail(probe, stream[j]["text"], stream[i]["text"])))
        fp_details.sort(key=lambda t: t[0])  # the weakest wrong matches first: the cheapest to refuse
        for sim, method, i, j, d in fp_details[:n_fps]:
            out.append(f"- [{truth[i]['corpus']}, {len(stream[i]['text'])} chars, similarity {sim:.2f} via "
                       f"{method}] {d.line()}")
            out.append(f"  A: {stream[j]['text'][:160]!r}")
            out.append(f"  B: {stream[i]['text'][:160]!r}")
    return "\n".join(out)


def load(path: str) -> list[dict[str, Any]]:
    with open(path, "rb") as f:
        return [orjson.loads(line) for line in f if line.strip()]
