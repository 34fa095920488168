"""Benchmark: event-time alignment on and off, 4 partitions, 1 and 2 `neardup serve` workers: backlog and live.

    eval "$(bash docker/services.sh env)"
    python bench/alignment.py [--stream ../shared/eval/stream.jsonl] [--max-skew 5] [--runs 3]
                              [--guarantee at_least_once|exactly_once] [--workers 1,2] [--rate 2000]
                              [--compress 30]

Backlog: the workers join the group first (all assigned), then the stream is produced at once, faster
than they route it: the eval stream (`--stream`: JSON lines with id, text, ts; absent, a generated backlog
whose copies sit hours apart, `stream.backlog`), each record in a random partition of 4 (seeded; every
partition in event-time order). Per row: throughput from the first output to the last; the routing
compared with the filter's (memory index, same records in event-time order): records routed otherwise,
and F1 of each against the stream's clusters. Live: records produced at `--rate` per second for
`--seconds` to all 4 partitions, event time = send time; p50 and p99 of produce to output. Rows
alternate, `--runs` times; medians. `--compress K` divides the stream's event time by K (the development
stream, one message a second, becomes a backlog of K a second: what max_skew holds grows K-fold).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from math import nan
from pathlib import Path

import orjson
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import needs  # noqa: E402
from bench.kafka_e2e import cleanup, stop_worker  # noqa: E402 (the same topics, key prefix and stop)
from bench.reliability import create_topics  # noqa: E402
from filters.engine import NearDupFilter  # noqa: E402
from stream.backlog import Item, backlog, differences, f1, reference  # noqa: E402
from stream.config import Settings  # noqa: E402
from stream.kafka_tools import (  # noqa: E402
    KafkaRecord,
    client_options,
    producer,
    read_topics,
)

PARTITIONS = 4
DEFAULT_STREAM = ROOT.parent / "shared" / "eval" / "stream.jsonl"


@dataclass(frozen=True, slots=True)
class Row:
    mode: str
    workers: int
    records: int
    steady_s: float
    total_s: float
    differences: int
    f1: float
    p50_ms: float
    p99_ms: float


def load(path: Path | None, limit: int, truth: Path | None = None, compress: float = 1.0) -> list[Item]:
    if path is None:
        return backlog(clusters=limit // 4, copies=3, partitions=PARTITIONS)
    start: float | None = None
    truth = truth or path.with_name("truth.jsonl")
    names = [str(orjson.loads(line)["cluster"]) for line in truth.read_bytes().splitlines()] if truth.is_file() else []
    number: dict[str, int] = {}
    rng = random.Random(11)
    items = []
    for n, line in enumerate(path.read_bytes().splitlines()[:limit]):
        rec = orjson.loads(line)
        cluster = number.setdefault(names[n], len(number)) if names else n
        start = float(rec["ts"]) if start is None else start
        if compress != 1.0:
            rec["ts"] = round(start + (float(rec["ts"]) - start) / compress, 6)
            line = orjson.dumps(rec)
        items.append(Item(rng.randrange(PARTITIONS), float(rec["ts"]), str(rec["id"]), cluster, line))
    return items


MODES = ("on", "off")


def modes(value: str) -> list[str]:
    """An option's comma-separated alignment modes (argparse `type`: a wrong one is a usage error)."""
    out = [m for m in value.split(",") if m]
    if not out or set(out) - set(MODES):
        raise argparse.ArgumentTypeError(f"comma-separated, of {', '.join(MODES)}: {value!r}")
    return out


def rounds(items: Sequence[Item], max_skew: float, workers: int) -> int:
    """The fewest rounds in which `workers` (partitions dealt out in ranges, as Kafka's range assignor does)
    can route `items` within `max_skew` when a record may be decided only after every record of the other
    workers more than `max_skew` older than it is in the index: the longest chain of such dependencies
    between workers. Each round costs at least a write to the index and a word to the other workers, so it
    bounds aligned throughput whatever the implementation (see docs/benchmarks.md)."""
    owner = {p: p * workers // PARTITIONS for p in range(PARTITIONS)}
    done: list[list[tuple[float, int]]] = [[] for _ in range(workers)]  # per worker: (event time, its round)
    deepest = 0
    for item in sorted(items, key=lambda i: i.ts):
        w = owner[item.partition]
        level = done[w][-1][1] if done[w] else 0
        for other, seen in enumerate(done):
            if other != w and seen:
                at = bisect.bisect_left(seen, (item.ts - max_skew, -1))
                if at:
                    level = max(level, seen[at - 1][1] + 1)
        done[w].append((item.ts, level))
        deepest = max(deepest, level)
    return deepest


def settings(redis_url: str, bootstrap: str, *, mode: str, max_skew: float, max_batch: int,
             guarantee: str = "at_least_once") -> Settings:
    name = f"align-{uuid.uuid4().hex[:8]}"
    return Settings(
        kafka_bootstrap=bootstrap, input_topics=(f"{name}-in",), unique_topic=f"{name}-unique",
        duplicate_topic=f"{name}-duplicate", dead_letter_topic=f"{name}-dead", group_id=f"{name}-group",
        index=f"{redis_url}{'&' if '?' in redis_url else '?'}prefix={name}", id_field="id", ts_field="ts",
        max_batch=max_batch, align=mode != "off", max_skew=max_skew, partitions=PARTITIONS,
        processing_guarantee=guarantee,
    )


def start_worker(s: Settings, n: int) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEARDUP_")}
    env.update({
        "PYTHONPATH": str(ROOT), "NEARDUP_KAFKA_BOOTSTRAP": s.kafka_bootstrap, "NEARDUP_INDEX": s.index,
        "NEARDUP_INPUT_TOPICS": ",".join(s.input_topics), "NEARDUP_UNIQUE_TOPIC": s.unique_topic,
        "NEARDUP_DUPLICATE_TOPIC": s.duplicate_topic, "NEARDUP_DEAD_LETTER_TOPIC": s.dead_letter_topic,
        "NEARDUP_GROUP_ID": s.group_id, "NEARDUP_ID_FIELD": s.id_field, "NEARDUP_TS_FIELD": s.ts_field,
        "NEARDUP_MAX_BATCH": str(s.max_batch), "NEARDUP_ALIGN": "true" if s.align else "false",
        "NEARDUP_MAX_SKEW": f"{s.max_skew}s", "NEARDUP_METRICS_PORT": "0",
        "NEARDUP_LOG_LEVEL": os.environ.get("BENCH_LOG_LEVEL", "warning"),
        "NEARDUP_GROUP_INSTANCE_ID": f"w{n}", "NEARDUP_PROCESSING_GUARANTEE": s.processing_guarantee,
    })
    # Its log goes to a file: a pipe nobody reads until the worker stops fills up (64 KB) under load, and a
    # worker blocked writing a warning stalls, loses its partitions and skews what is measured.
    log = tempfile.TemporaryFile()
    return subprocess.Popen([sys.executable, "-m", "stream.cli", "serve"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=log)


async def preload(s: Settings, items: Sequence[Item]) -> None:
    """Every item to its partition, in record batches of our own (a few hundred thousand records a second:
    produced at once, the stream is a backlog for the workers)."""
    # Idempotent: a batch retried after a leader election (the topic is new) is not appended twice.
    async with producer(s, linger_ms=20, enable_idempotence=True) as p:
        futures = []
        open_batches: dict[int, object] = {}
        for i in items:
            batch = open_batches.get(i.partition)
            if batch is None:
                batch = open_batches[i.partition] = p.create_batch()
            if batch.append(key=i.id.encode(), value=i.value, timestamp=round(i.ts * 1000)) is None:  # type: ignore[attr-defined]
                futures.append(await p.send_batch(batch, s.input_topics[0], partition=i.partition))
                batch = open_batches[i.partition] = p.create_batch()
                batch.append(key=i.id.encode(), value=i.value, timestamp=round(i.ts * 1000))  # type: ignore[attr-defined]
        for partition, batch in open_batches.items():
            futures.append(await p.send_batch(batch, s.input_topics[0], partition=partition))
        await asyncio.gather(*futures)


async def read_all(s: Settings, expected: int, timeout: float) -> tuple[list[KafkaRecord], float, float]:
    """The output records until one of every input arrived (at-least-once may repeat some after a rebalance)."""
    got: list[KafkaRecord] = []
    sources: set[bytes | None] = set()
    first = last = 0.0
    async for record in read_topics(s, s.output_topics, deadline=time.monotonic() + timeout):
        last = time.monotonic()
        first = first or last
        got.append(record)
        sources.add(record.header("neardup-source"))
        if len(sources) >= expected:
            break
    return got, first, last


async def members(s: Settings) -> int:
    """How many members of the group have partitions assigned, once the group is stable (else 0)."""
    admin = AIOKafkaAdminClient(**client_options(s))
    await admin.start()
    try:
        (response,) = await admin.describe_consumer_groups([s.group_id])
        (group,) = response.groups
        state, assigned = group[2], [m for m in group[5] if m[-1]]
        return len(assigned) if state == "Stable" else 0
    except KafkaError:  # the group's coordinator is not known yet (a broker just started): not yet
        return 0
    finally:
        await admin.close()


def run(args: argparse.Namespace, items: Sequence[Item], want: dict[str, str], *, mode: str,
        workers: int) -> Row:
    """The workers join the group first (all assigned), then the backlog is produced at once (faster than
    they route it), so that what is measured is the group at work, not one worker alone before the others
    joined."""
    s = settings(args.redis, args.bootstrap, mode=mode, max_skew=args.max_skew, max_batch=args.max_batch,
                 guarantee=args.guarantee)
    asyncio.run(create_topics(s, PARTITIONS))
    procs = [start_worker(s, n) for n in range(workers)]
    try:
        deadline = time.monotonic() + 60
        while asyncio.run(members(s)) < workers:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise SystemExit(f"the {workers} workers did not join the group within 60 s")
            time.sleep(0.5)
        started = time.monotonic()
        asyncio.run(preload(s, items))
        got, first, last = asyncio.run(read_all(s, len(items), args.timeout))
        latencies = asyncio.run(live(s, items, args.rate, args.seconds))
    finally:
        for proc in procs:
            stop_worker(proc)
        cleanup(s)
    routed = {r.header("neardup-id").decode(): (r.header("neardup-verdict") or b"").decode()  # type: ignore[union-attr]
              for r in got}
    latencies.sort()
    p50, p99 = (latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.99)]) if latencies else (nan, nan)
    return Row(mode, workers, len(routed), last - first, last - started, len(differences(routed, want)),
               f1(routed, items), p50, p99)


SENT = "bench-sent-ns"


async def live(s: Settings, items: Sequence[Item], rate: float, seconds: float) -> list[float]:
    """Milliseconds from produce to output of records produced at `rate` a second for `seconds`, round robin
    over the partitions, event time = send time (the texts of `items` again, under new ids)."""
    latencies: list[float] = []
    total = int(rate * seconds)

    async def reader() -> None:  # from the beginning: the backlog's outputs are skipped (no send time)
        async for record in read_topics(s, s.output_topics, deadline=time.monotonic() + seconds + 60):
            sent = record.header(SENT)
            if sent is not None:
                latencies.append((time.time_ns() - int(sent)) / 1e6)
                if len(latencies) >= total:
                    return

    task = asyncio.ensure_future(reader())
    async with producer(s, linger_ms=1) as p:
        start = time.monotonic()
        for n in range(total):
            await asyncio.sleep(max(0.0, start + n / rate - time.monotonic()))
            item = items[n % len(items)]
            text = orjson.loads(item.value)["text"]
            value = orjson.dumps({"id": f"live-{n}", "text": text, "ts": time.time()})
            await p.send(s.input_topics[0], value=value, partition=n % PARTITIONS,
                         headers=[(SENT, str(time.time_ns()).encode())])
        await p.flush()
    await task
    return latencies


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bootstrap", default=os.environ.get("NEARDUP_TEST_KAFKA", "127.0.0.1:9092"))
    p.add_argument("--redis", default=os.environ.get("NEARDUP_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--stream", type=Path, default=DEFAULT_STREAM if DEFAULT_STREAM.is_file() else None,
                   help="JSON lines with id, text, ts (default: shared/eval's stream when present, else generated)")
    p.add_argument("--truth", type=Path, default=None, help="its truth (default: truth.jsonl beside the stream)")
    p.add_argument("--generated", action="store_true", help="the generated backlog even when --stream exists")
    p.add_argument("--limit", type=int, default=40_000, help="records of the stream at most")
    p.add_argument("--max-skew", type=float, default=5.0, help="seconds of event time (the setting max_skew)")
    p.add_argument("--max-batch", type=int, default=Settings().max_batch)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--guarantee", default="at_least_once", choices=("at_least_once", "exactly_once"))
    p.add_argument("--workers", default="1,2", help="worker counts to run, comma-separated")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--rate", type=float, default=2000.0, help="live records a second")
    p.add_argument("--seconds", type=float, default=5.0, help="of live traffic")
    p.add_argument("--compress", type=float, default=1.0, help="divide the stream's event time by this (denser)")
    p.add_argument("--modes", type=modes, default="on,off", help=f"comma-separated, of {', '.join(MODES)}")
    args = p.parse_args(argv)
    if args.stream is not None and not args.generated:
        needs.files(__file__, args.stream, args.truth or args.stream.with_name("truth.jsonl"))
    needs.redis(__file__, args.redis)
    needs.kafka(__file__, args.bootstrap)
    items = load(None if args.generated else args.stream, args.limit, args.truth, args.compress)
    want = reference(items, NearDupFilter())
    print(f"{len(items)} records on {PARTITIONS} partitions; filter F1 {f1(want, items):.4f}; max_skew "
          f"{args.max_skew:g}s; max_batch {args.max_batch}; {args.guarantee}", flush=True)
    counts = [int(n) for n in args.workers.split(",")]
    for workers in counts:
        if workers > 1:
            n = rounds(items, args.max_skew, workers)
            print(f"  {workers} workers aligned need at least {n:,} rounds ({len(items) / max(n, 1):,.1f} records a round)",
                  flush=True)
    rows: list[Row] = []
    for _ in range(args.runs):
        for workers in counts:
            for mode in args.modes:
                row = run(args, items, want, mode=mode, workers=workers)
                print(f"  align={mode} workers={workers}: {row.records / row.steady_s:8,.0f} msg/s "
                      f"steady, {row.total_s:6.1f} s in all, {row.differences} routed otherwise, F1 {row.f1:.4f}; "
                      f"live p50 {row.p50_ms:.1f} ms, p99 {row.p99_ms:.1f} ms", flush=True)
                rows.append(row)
    print(f"\n| alignment | workers | backlog msg/s, first→last output | routed otherwise than the filter | F1 | "
          f"live p50 ms at {args.rate:g}/s | live p99 ms |\n|---|---|---|---|---|---|---|")
    for workers in counts:
        for mode in args.modes:
            mine = [r for r in rows if r.mode == mode and r.workers == workers]
            print(f"| {mode} | {workers} | "
                  f"{statistics.median(r.records / r.steady_s for r in mine):,.0f} | "
                  f"{statistics.median(r.differences for r in mine):.0f} | {statistics.median(r.f1 for r in mine):.4f} | "
                  f"{statistics.median(r.p50_ms for r in mine):.1f} | {statistics.median(r.p99_ms for r in mine):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
