"""Benchmark: the aiokafka worker's steady throughput in this process (Kafka → Redis index → Kafka).

    eval "$(bash docker/services.sh env)"
    python bench/worker_steady.py [--bootstrap HOST:PORT] [--redis URL] [--messages 16946] [--runs 3]

`bench/kafka_e2e.py` times a `neardup serve` process from its start, and its steady window on 10,000
messages is about a second: start-up and the first batches weigh in. Here the worker runs in this
process (as `serve` runs it, with the garbage collector tuned the same way) over the short messages of
the eval stream preloaded into a fresh single-partition topic, and the clock runs from the first batch
committed to the last: messages/s, and this process's CPU per message (the worker's threads: the
event loop and the routing thread). Each run uses its own topics and Redis namespace (deleted
afterwards). It imports the packages of the checkout it lives in, so copying it into an older checkout
(next to its bench/kafka_e2e.py) measures that release the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import kafka_e2e  # noqa: E402

from bench.alignment import modes  # noqa: E402
from stream.collector import tune_collector  # noqa: E402
from stream.worker import make_worker  # noqa: E402


async def steady(settings: object, count: int) -> tuple[float, float]:
    """(messages/s, CPU µs a message) from the first committed batch to the last."""
    worker = make_worker(settings)  # type: ignore[arg-type]
    task = asyncio.ensure_future(worker.run())
    while worker.stats.seen == 0:
        if task.done():
            task.result()
        await asyncio.sleep(0.005)
    seen, t0, c0 = worker.stats.seen, time.perf_counter(), time.process_time()
    while worker.stats.seen < count:
        if task.done():
            task.result()
        await asyncio.sleep(0.005)
    wall, cpu, n = time.perf_counter() - t0, time.process_time() - c0, worker.stats.seen - seen
    worker.stop()
    await task
    return n / wall, cpu / n * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    kafka_e2e.add_service_arguments(p, messages=16_946)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--partitions", type=int, default=1, help="of the input topic (messages dealt round-robin)")
    p.add_argument("--align", type=modes, default="on", help="comma-separated: on, off (event-time alignment; alternating)")
    args = p.parse_args()
    kafka_e2e.check_needs(args)
    aligns: list[str] = args.align
    lines = kafka_e2e.short_messages(args.stream, args.truth, args.corpora, args.messages)
    tune_collector()
    rates: dict[str, list[float]] = {a: [] for a in aligns}
    cpus: dict[str, list[float]] = {a: [] for a in aligns}
    for run in range(args.runs):
        for a in aligns:  # alternating
            settings = replace(kafka_e2e.settings(args, "aiokafka"), align=a == "on")
            try:
                asyncio.run(kafka_e2e.preload(settings, lines, partitions=args.partitions))
                rate, cpu = asyncio.run(steady(settings, len(lines)))
            finally:
                kafka_e2e.cleanup(settings)
            rates[a].append(rate)
            cpus[a].append(cpu)
            print(f"  run {run + 1}, align {a}: {rate:,.0f} msg/s, {cpu:.1f} µs CPU a message", file=sys.stderr)
    print(f"{len(lines)} messages of {args.corpora}, {args.partitions} partition(s), max_batch {args.max_batch}, "
          f"{args.runs} runs\n")
    print("| worker (in process) | alignment | msg/s steady (median) | min–max | CPU µs a message (median) |")
    print("|---|---|---|---|---|")
    for a in aligns:
        print(f"| aiokafka | {a} | {statistics.median(rates[a]):,.0f} | {min(rates[a]):,.0f}–{max(rates[a]):,.0f} | "
              f"{statistics.median(cpus[a]):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
