"""Benchmark: the aiokafka worker's steady throughput in this process (Kafka → Redis index → Kafka).

    eval "$(bash docker/services.sh env)"
    python bench/worker_steady.py [--bootstrap HOST:PORT] [--redis URL] [--messages 16946] [--runs 3]

`bench/kafka_e2e.py` times a `neardup serve` process from its start, and its steady window on 10,000
messages is about a second: start-up and the first batches weigh in. Here the worker runs in this
process (as `serve` runs it, with the garbage collector tuned the same way) over the short messages of
the eval stream preloaded into a fresh single-partition topic, and the clock runs from the first batch
committed to the last: messages/s, and this process's CPU per message (the worker's threads: the
event loop and the routing thread); also the most records the aligner held at once and the most this
process's resident memory rose above what it was before the worker started (Python keeps freed memory
for reuse, so that rise means what it says in a run of its own: compare settings with `--runs 1` each, in
processes of their own, alternating). Each run uses its own topics and Redis namespace (deleted
afterwards). It imports the packages of the checkout it lives in, so copying it into an older checkout
(next to its bench/kafka_e2e.py) measures that release the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import os
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

PAGE = os.sysconf("SC_PAGE_SIZE")


def resident() -> int:
    """This process's resident memory now, in bytes (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


async def steady(settings: object, count: int) -> tuple[float, float, int, int]:
    """(messages/s, CPU µs a message) from the first committed batch to the last, the most records the
    aligner held at once, and the most this process's resident memory rose above what it was before the
    worker started (the end looked for every 5 ms, the memory read every 50 ms: reading /proc every 5 ms took
    about 7 % of the event loop's thread, which the worker shares)."""
    base = resident()
    worker = make_worker(settings)  # type: ignore[arg-type]
    task = asyncio.ensure_future(worker.run())
    held = rss = polls = 0

    def sample() -> None:
        nonlocal held, rss, polls
        held = max(held, worker.aligner.buffered())
        polls += 1
        if polls % 10 == 1:
            rss = max(rss, resident() - base)

    while worker.stats.seen == 0:
        if task.done():
            task.result()
        sample()
        await asyncio.sleep(0.005)
    seen, t0, c0 = worker.stats.seen, time.perf_counter(), time.process_time()
    while worker.stats.seen < count:
        if task.done():
            task.result()
        sample()
        await asyncio.sleep(0.005)
    wall, cpu, n = time.perf_counter() - t0, time.process_time() - c0, worker.stats.seen - seen
    worker.stop()
    await task
    return n / wall, cpu / n * 1e6, held, rss


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
    helds: dict[str, list[int]] = {a: [] for a in aligns}
    rsss: dict[str, list[int]] = {a: [] for a in aligns}
    for run in range(args.runs):
        for a in aligns:  # alternating
            settings = replace(kafka_e2e.settings(args, "aiokafka"), align=a == "on")
            try:
                asyncio.run(kafka_e2e.preload(settings, lines, partitions=args.partitions))
                rate, cpu, held, rss = asyncio.run(steady(settings, len(lines)))
            finally:
                kafka_e2e.cleanup(settings)
            rates[a].append(rate)
            cpus[a].append(cpu)
            helds[a].append(held)
            rsss[a].append(rss)
            print(f"  run {run + 1}, align {a}: {rate:,.0f} msg/s, {cpu:.1f} µs CPU a message, {held:,} records held "
                  f"at most, resident memory up {rss / 2**20:.0f} MB at most", file=sys.stderr)
    print(f"{len(lines)} messages of {args.corpora}, {args.partitions} partition(s), max_batch {args.max_batch}, "
          f"{args.runs} runs\n")
    print("| worker (in process) | alignment | msg/s steady (median) | min–max | CPU µs a message (median) "
          "| records held by the aligner at most | resident memory rise, MB (median of the runs' most) |")
    print("|---|---|---|---|---|---|---|")
    for a in aligns:
        print(f"| aiokafka | {a} | {statistics.median(rates[a]):,.0f} | {min(rates[a]):,.0f}–{max(rates[a]):,.0f} | "
              f"{statistics.median(cpus[a]):.1f} | {max(helds[a]):,} | {statistics.median(rsss[a]) / 2**20:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
