"""Benchmark: routing quality when Redis loses the index mid-stream, two `neardup serve` workers, against `neardup filter`.

    eval "$(bash docker/services.sh env)"
    python bench/index_loss.py [--stream ../shared/eval/stream.jsonl] [--losses restart,flushall,kill,none]
                               [--guarantee exactly_once] [--at 0.5] [--max-batch 2000] [--runs 1]
                               [--align on,off] [--max-skew 5] [--compress 1] [--layout slot|spread]

The labelled development stream (`--stream`, its `truth.jsonl` beside it), each record in a random partition
of 4 (seeded; every partition in event-time order), is produced at once to a fresh topic after two workers
joined the group, on a redis-server of this benchmark's own (no persistence). Once `--at` of the records
were routed (committed), Redis loses its data: `restart` (killed and started again, empty) or `flushall`;
`kill`: at once, one worker is killed with kill -9, Redis restarted empty and the worker started again
under its instance id (its open transaction aborted); `none` is the same run without a loss. The workers
find the index lost (its marker missing), rebuild it from the index changelog and route on. Per run:
records lost and doubled, routing F1 of the workers and of the filter on the same records in stream order
(the shared/eval measure: stream/evaluate.py), records routed otherwise than the filter did, the restores
the workers' logs report, the throughput (records over seconds from the produce to the last output), and
the outputs that break the header contract (a duplicate naming a record not routed unique; a replay
header), and those marked late (`neardup-late`: here, when the workers start on an empty topic and the
backlog is produced after them, a partition whose first records arrive after another one advanced more
than `max_skew`: the documented rule for a quiet partition that wakes up with old records).
`--align on,off` runs each loss with event-time alignment on and off (`--max-skew` seconds of event time;
`--compress K` makes the stream K times denser in event time), alternating, and gives their throughput ratio.
`--layout spread`: the index in the spread layout (its 64 shards on the one redis-server).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import needs  # noqa: E402
from bench.alignment import PARTITIONS, load, modes, preload  # noqa: E402
from bench.kafka_support import PrivateRedis  # noqa: E402
from bench.reliability import Serve, create_topics, read, scenario_settings, serving, wait_assigned  # noqa: E402
from filters.engine import NearDupFilter  # noqa: E402
from filters.records import Verdict  # noqa: E402
from stream.backlog import Item, differences, reference  # noqa: E402
from stream.config import Settings  # noqa: E402
from stream.evaluate import read_truth, score  # noqa: E402

DEFAULT_STREAM = ROOT.parent / "shared" / "eval" / "stream.jsonl"
_REBUILT = re.compile(r"index rebuilt from the changelog: (\d+) entries read, (\d+) written, in ([0-9.]+)s")


def f1_of(truth: Sequence[dict[str, object]], routed: dict[str, str]) -> float:
    """The shared/eval F1 of id → unique/duplicate (a record without a verdict counts as not a duplicate)."""
    return score(truth, [Verdict(str(row["id"]), routed.get(str(row["id"])) == "duplicate") for row in truth]).overall.f1


def run(args: argparse.Namespace, items: Sequence[Item], truth: Sequence[dict[str, object]], want: dict[str, str],
        loss: str, workdir: Path, align: bool = True) -> dict[str, float]:
    server = PrivateRedis(workdir)
    server.start()
    try:
        layout = "" if args.layout == "slot" else f"&layout={args.layout}"
        settings = scenario_settings(args.bootstrap, f"{server.url}?prefix=loss{layout}", ts_field="ts",
                                     max_batch=args.max_batch, processing_guarantee=args.guarantee,
                                     partitions=PARTITIONS, log_level="info", align=align, max_skew=args.max_skew)
        asyncio.run(create_topics(settings, PARTITIONS))
        committed = args.guarantee == "exactly_once"
        with serving() as started:
            started += [Serve(settings, workdir, name, args=["--group-instance-id", name]) for name in ("a", "b")]
            wait_assigned(started, PARTITIONS)
            t0 = time.monotonic()
            asyncio.run(preload(settings, items))
            read(settings, committed=committed, sources=round(len(items) * args.at), settle=0.0, timeout=args.timeout)
            if loss == "kill":  # its open transaction is aborted when it comes back (its instance id)
                started[0].kill()
                server.lose("restart")
                started.append(Serve(settings, workdir, "a-again", args=["--group-instance-id", "a"]))
            elif loss != "none":
                server.lose(loss)
            got = read(settings, committed=committed, sources=len(items), settle=3.0, timeout=args.timeout)
            seconds = time.monotonic() - t0
            for w in started[1 if loss == "kill" else 0 :]:  # the killed one is not
                w.alive()
            logs = "".join(w.log() for w in started)
            if args.logs is not None:  # every run's workers' logs, for whoever looks at one that went wrong
                args.logs.mkdir(parents=True, exist_ok=True)
                (args.logs / f"{time.strftime('%H%M%S')}-{loss}-{'on' if align else 'off'}.log").write_text(logs)
    finally:
        server.stop()
    sources = [r.header("neardup-source") for r in got]
    if len(set(sources)) < len(items):  # what went wrong, for whoever looks
        print("\n".join(line for line in logs.splitlines() if " WARNING " in line or " ERROR " in line
                        or "Traceback" in line)[-6000:], file=sys.stderr)
    routed = {(r.header("neardup-id") or b"").decode(): (r.header("neardup-verdict") or b"").decode() for r in got}
    # The header contract: a duplicate names a record routed unique; no trace of a crash, a retry or lateness.
    unique = {id for id, verdict in routed.items() if verdict == "unique"}
    dangling = sum(1 for r in got if r.header("neardup-verdict") == b"duplicate"
                   and (r.header("neardup-duplicate-of") or b"").decode() not in unique)
    replays = sum(1 for r in got if r.header("neardup-method") == b"replay")
    late = sum(1 for r in got if r.header("neardup-late") is not None)
    broken = dangling + replays
    if broken or late:
        print(f"  headers: {dangling} duplicates naming a record not routed unique, {replays} replays, {late} late",
              file=sys.stderr)
    rebuilt = [(int(n), float(s)) for n, _, s in _REBUILT.findall(logs)]
    return {"lost": len(items) - len(set(sources)), "doubled": len(sources) - len(set(sources)),
            "f1": f1_of(truth, routed), "otherwise": len(differences(routed, want)), "seconds": seconds,
            "restored": max((n for n, _ in rebuilt), default=0), "restore_s": max((s for _, s in rebuilt), default=0.0),
            "rate": len(items) / seconds, "headers": broken, "late": late}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bootstrap", default=os.environ.get("NEARDUP_TEST_KAFKA", "127.0.0.1:9092"))
    p.add_argument("--stream", type=Path, default=DEFAULT_STREAM)
    p.add_argument("--truth", type=Path, default=None, help="its truth (default: truth.jsonl beside the stream)")
    p.add_argument("--limit", type=int, default=40_000, help="records of the stream at most")
    p.add_argument("--losses", default="restart,flushall,none", help="comma-separated: restart, flushall, none")
    p.add_argument("--guarantee", default="exactly_once", choices=("at_least_once", "exactly_once"))
    p.add_argument("--at", type=float, default=0.5, help="fraction of the records routed when Redis loses its data")
    p.add_argument("--max-batch", type=int, default=Settings().max_batch)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--align", type=modes, default="on", help="comma-separated: on, off (each loss with each, alternating)")
    p.add_argument("--max-skew", type=float, default=5.0, help="seconds of event time (the setting max_skew)")
    p.add_argument("--compress", type=float, default=1.0, help="divide the stream's event time by this (denser)")
    p.add_argument("--logs", type=Path, default=None, help="a directory to keep every run's workers' logs in")
    p.add_argument("--layout", default="slot", choices=("slot", "spread"), help="the Redis index's layout")
    args = p.parse_args(argv)
    truth_path = args.truth or args.stream.with_name("truth.jsonl")
    needs.files(__file__, args.stream, truth_path)
    needs.kafka(__file__, args.bootstrap)
    needs.tool(__file__, "redis-server", install="apt-get install redis-server")
    items = load(args.stream, args.limit, truth_path, args.compress)
    aligns: list[str] = args.align
    truth = read_truth(truth_path.read_bytes().splitlines()[: len(items)], str(truth_path))
    want = reference(items, NearDupFilter())
    filter_f1 = f1_of(truth, want)
    print(f"{len(items)} records on {PARTITIONS} partitions, 2 workers, {args.layout} layout, {args.guarantee}, "
          f"max_batch {args.max_batch}, "
          f"max_skew {args.max_skew:g}s; Redis loses its data once {args.at:.0%} are routed; neardup filter F1 "
          f"{filter_f1:.4f}", flush=True)
    print("| loss | align | runs | lost | doubled | F1 (workers) | F1 − filter's | routed otherwise | entries restored "
          "| restore s | seconds | msg/s | aligned ÷ unaligned | headers broken | late |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="neardup-loss-") as tmp:
        for loss in [x for x in args.losses.split(",") if x]:
            runs: dict[str, list[dict[str, float]]] = {a: [] for a in aligns}
            for _ in range(args.runs):  # alternating: on, off, on, off, ...
                for a in aligns:
                    runs[a].append(run(args, items, truth, want, loss, Path(tmp), align=a == "on"))
            for a, rows in runs.items():

                def med(key: str, rows: list[dict[str, float]] = rows) -> float:
                    return statistics.median(r[key] for r in rows)

                ratio = (f"{statistics.median(x['rate'] / y['rate'] for x, y in zip(runs['on'], runs['off'])):.0%}"
                         if a == "on" and "off" in runs else "–")
                print(f"| {loss} | {a} | {len(rows)} | {max(r['lost'] for r in rows):.0f} "
                      f"| {max(r['doubled'] for r in rows):.0f} | {med('f1'):.4f} | {med('f1') - filter_f1:+.4f} "
                      f"| {med('otherwise'):.0f} | {med('restored'):,.0f} | {med('restore_s'):.1f} | {med('seconds'):.0f} "
                      f"| {med('rate'):,.0f} | {ratio} | {max(r['headers'] for r in rows):.0f} "
                      f"| {max(r['late'] for r in rows):.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
