"""Where `neardup filter`'s CPU goes, stage by stage, on a JSONL stream (default: the dev stream):

    python bench/filter_stages.py --stream STREAM

Each stage runs alone over the whole stream in batches of 512, as `neardup filter` runs it: decoding
(`decode_batch`, JSON and the input rules), normalization, hashing (`Fingerprinter.shingle`'s compiled
kernel), the memory index's compiled `decide`, and the whole `run_filter` loop (all of them, plus the
batching, the routing records and the unique output); then the start-up, as the CPU of a process that
imports the command line and builds the filter (`--runs` times each, the fastest: CPU seconds of this
process, `time.process_time`). The stages use the same batches, so their sum is what `run_filter`'s
routing costs without its own bookkeeping.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BATCH = 512
STARTUP = ("import time; from stream.cli import build_parser; from filters.engine import NearDupFilter; "
           "build_parser(); NearDupFilter(); print(time.process_time())")


def fastest(runs: int, work: Callable[[], Any]) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(runs):
        started = time.process_time()
        out = work()
        best = min(best, time.process_time() - started)
    return best, out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stream", default=str(ROOT.parent / "shared" / "eval" / "stream.jsonl"),
                   help="JSONL stream (default: the shared dev stream)")
    p.add_argument("--runs", type=int, default=3, help="runs of each stage; the fastest is printed (default 3)")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from bench import needs

    needs.files(__file__, args.stream, what="a JSONL stream")
    from filters.engine import NearDupFilter
    from stream.cli import FileSink
    from stream.codec import Decoded, RecordFormat, decode_batch
    from stream.runner import RawRecord, run_filter

    lines = Path(args.stream).read_bytes().splitlines(keepends=True)
    fmt = RecordFormat()
    raws = [RawRecord(line, str(i + 1), 0.0) for i, line in enumerate(lines) if line.strip()]
    batches = [raws[i : i + BATCH] for i in range(0, len(raws), BATCH)]
    rows: list[tuple[str, float]] = []

    seconds, decoded = fastest(args.runs, lambda: [decode_batch(b, fmt) for b in batches])
    rows.append(("decode (decode_batch: orjson, input rules, records)", seconds))
    messages = [[d.message for d in ds if isinstance(d, Decoded)] for ds in decoded]
    nd = NearDupFilter()
    fp, cut = nd.fingerprinter, nd.config.max_chars
    seconds, normalized = fastest(args.runs, lambda: [fp.normalizer.normalize_batch([m.text[:cut] for m in ms])
                                                      for ms in messages])
    rows.append(("normalize (Normalizer.normalize_batch)", seconds))
    seconds, shingled = fastest(args.runs, lambda: [fp._shingled(texts) for texts in normalized])
    rows.append(("hash (compiled shingle: sketch, m-gram and exact keys)", seconds))

    def decide() -> None:
        fresh = NearDupFilter()
        for ms, prepared in zip(messages, shingled, strict=True):
            fresh.decide(ms, prepared)

    seconds, _ = fastest(args.runs, decide)
    rows.append(("decide (memory index: look up, verify, insert)", seconds))
    seconds, _ = fastest(args.runs, lambda: run_filter(NearDupFilter(), iter(lines), unique=FileSink(io.BytesIO()),
                                                       duplicates=None, rejected=None, fmt=fmt))
    rows.append(("run_filter (all of the above, batching, routing, output)", seconds))
    startups = [float(subprocess.run([sys.executable, "-c", STARTUP], capture_output=True, cwd=ROOT, check=True,
                                     text=True).stdout) for _ in range(args.runs)]
    rows.append(("start-up (a process importing the CLI, building the filter)", min(startups)))
    print(f"{len(raws):,} messages, batches of {BATCH}, fastest of {args.runs} runs, CPU seconds")
    for name, seconds in rows:
        print(f"{seconds:7.3f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
