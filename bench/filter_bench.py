"""Benchmark: neardup's embedded filter against the libraries a user would reach for, in one process.

Runs each tool over the same messages, in stream order, starting empty, several times, and prints
the median messages/s, the ratio of neardup to each peer, memory per million indexed messages
(tracemalloc, in a separate untimed pass) and the quality measured as in shared/eval/README.md.

    python bench/filter_bench.py [--stream PATH --truth PATH] [--runs 3] [--limit N] [--corpora sms_en,...]

Peers are used as their documentation shows: datasketch MinHashLSH (128 permutations, threshold 0.5,
character 5-grams of NFKC + lower-case + punctuation-stripped text; query, then insert if no match)
and simhash.SimhashIndex (k=3, character 3-gram features as in its README; get_near_dups, then add).
"""

from __future__ import annotations

import argparse
import gc
import re
import statistics
import sys
import time
import tracemalloc
import unicodedata
from collections.abc import Callable, Sequence
from pathlib import Path

import orjson

from bench import needs
from filters.config import FilterConfig
from filters.engine import Message, NearDupFilter, Verdict
from stream.evaluate import score
from stream.runner import FILE_BATCH

_PUNCT = re.compile(r"[\W_]+")
ROOT = Path(__file__).resolve().parents[1]


def _norm(text: str) -> str:
    return _PUNCT.sub("", unicodedata.normalize("NFKC", text).lower())


def run_neardup(msgs: Sequence[Message], batch: int = FILE_BATCH, native: bool | None = None,
                index: str = "memory://") -> tuple[list[Verdict], object]:
    nd = NearDupFilter(FilterConfig(window=1e9), index=index, native=native)
    out: list[Verdict] = []
    for i in range(0, len(msgs), batch):
        out.extend(nd.check_batch(msgs[i : i + batch]))
    return out, nd


def run_datasketch(msgs: Sequence[Message]) -> tuple[list[Verdict], object]:
    from datasketch import MinHash, MinHashLSH

    lsh = MinHashLSH(threshold=0.5, num_perm=128)
    out = []
    for m in msgs:
        t = _norm(m.text)
        mh = MinHash(num_perm=128)
        mh.update_batch([t[i : i + 5].encode("utf8") for i in range(max(len(t) - 4, 1))])
        hits = lsh.query(mh)
        if hits:
            out.append(Verdict(m.id, True, hits[0], 0.0, "minhash"))
        else:
            lsh.insert(m.id, mh)
            out.append(Verdict(m.id, False))
    return out, lsh


def run_simhash(msgs: Sequence[Message]) -> tuple[list[Verdict], object]:
    import logging

    from simhash import Simhash, SimhashIndex

    logging.getLogger().setLevel(logging.ERROR)  # SimhashIndex logs every oversized bucket
    index = SimhashIndex([], k=3)
    out = []
    for m in msgs:
        t = _norm(m.text)
        sh = Simhash([t[i : i + 3] for i in range(max(len(t) - 2, 1))])
        hits = index.get_near_dups(sh)
        if hits:
            out.append(Verdict(m.id, True, hits[0], 0.0, "simhash"))
        else:
            index.add(m.id, sh)
            out.append(Verdict(m.id, False))
    return out, index


def run_neardup_reference(msgs: Sequence[Message]) -> tuple[list[Verdict], object]:
    """neardup on its numpy/Python reference (what installs without a C++ compiler): same verdicts."""
    return run_neardup(msgs, native=False)


TOOLS: dict[str, Callable[[Sequence[Message]], tuple[list[Verdict], object]]] = {
    "neardup": run_neardup,
    "datasketch MinHashLSH": run_datasketch,
    "simhash SimhashIndex": run_simhash,
}
OPTIONAL_TOOLS = {"neardup reference": run_neardup_reference}  # only with --tools


def memory_per_million(fn: Callable[[Sequence[Message]], tuple[list[Verdict], object]],
                       msgs: Sequence[Message]) -> float:
    gc.collect()
    tracemalloc.start()
    verdicts, keep = fn(msgs)
    current, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    indexed = sum(not v.duplicate for v in verdicts)
    del keep
    return current / max(indexed, 1) * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stream", default=str(ROOT.parent / "shared" / "eval" / "stream.jsonl"))
    p.add_argument("--truth", default=str(ROOT.parent / "shared" / "eval" / "truth.jsonl"))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--corpora", default="", help="only these corpora, e.g. sms_en,tweets_en,reviews_zh")
    p.add_argument("--tools", default=",".join(TOOLS), help=f"of {', '.join([*TOOLS, *OPTIONAL_TOOLS])}")
    args = p.parse_args(argv)
    needs.files(__file__, args.stream, args.truth)

    stream = [orjson.loads(x) for x in open(args.stream, "rb") if x.strip()]
    truth = [orjson.loads(x) for x in open(args.truth, "rb") if x.strip()]
    if args.corpora:
        wanted = set(args.corpora.split(","))
        keep = [i for i, t in enumerate(truth) if t["corpus"] in wanted]
        stream, truth = [stream[i] for i in keep], [truth[i] for i in keep]
    if args.limit:
        stream, truth = stream[: args.limit], truth[: args.limit]
    msgs = [Message(r["id"], r["text"], r["ts"]) for r in stream]
    chars = sum(len(m.text) for m in msgs) / max(len(msgs), 1)
    print(f"{len(msgs)} messages, mean {chars:.0f} characters, {args.runs} runs each (median)\n")

    rows = []
    for name in args.tools.split(","):
        fn = TOOLS.get(name) or OPTIONAL_TOOLS[name]
        rates = []
        verdicts: list[Verdict] = []
        for _ in range(args.runs):
            gc.collect()
            t0 = time.perf_counter()
            verdicts, _ = fn(msgs)
            rates.append(len(msgs) / (time.perf_counter() - t0))
        report = score(truth, verdicts)
        mem = memory_per_million(fn, msgs)
        rows.append((name, statistics.median(rates), min(rates), max(rates), mem, report.overall))
        print(f"  {name}: {statistics.median(rates):,.0f} msg/s", file=sys.stderr)

    base = rows[0][1] if rows and rows[0][0] == "neardup" else None
    print("| tool | messages/s (median) | min–max | neardup ÷ tool | MB per 1M indexed | precision | recall | F1 |")
    print("|---|---|---|---|---|---|---|---|")
    for name, med, lo, hi, mem, o in rows:
        ratio = f"{base / med:.1f}×" if base else "–"
        print(f"| {name} | {med:,.0f} | {lo:,.0f}–{hi:,.0f} | {ratio} | {mem / 2**20:,.0f} | "
              f"{o.precision:.3f} | {o.recall:.3f} | {o.f1:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
