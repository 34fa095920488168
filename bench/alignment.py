"""Benchmark: event-time alignment on and off, a backlog on 4 partitions, 1 and 2 `neardup serve` workers.

    eval "$(bash docker/services.sh env)"
    python bench/alignment.py [--stream ../shared/eval/stream.jsonl] [--max-skew 60] [--runs 3]

The backlog: the eval stream (`--stream`, JSON lines with id, text, ts; absent: a generated backlog of
near-duplicate clusters whose copies sit hours apart, `stream.backlog`), each record in a random
partition of 4 (seeded; every partition in event-time order), produced before the workers start. Per
row: throughput from the first output to the last, and from the workers' start; the routing compared
with `neardup filter`'s (memory index, same records in event-time order): records routed otherwise, and
F1 of each against the clusters when the stream has them. Rows alternate, `--runs` times; medians.
Also a live row per setting: records produced at `--rate` per second to all partitions, p50/p99 of
produce → output.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from filters.engine import NearDupFilter  # noqa: E402
from stream.backlog import Item, backlog, differences, f1, reference  # noqa: E402
from stream.config import Settings  # noqa: E402
from stream.kafka_tools import KafkaRecord, delete_topics, ensure_topics, producer, read_topics  # noqa: E402

PARTITIONS = 4
DEFAULT_STREAM = ROOT.parent / "shared" / "eval" / "stream.jsonl"


@dataclass(frozen=True, slots=True)
class Row:
    align: bool
    workers: int
    records: int
    steady_s: float
    total_s: float
    differences: int
    f1: float


def load(path: Path | None, limit: int) -> list[Item]:
    if path is None:
        return backlog(clusters=limit // 4, copies=3, partitions=PARTITIONS)
    truth = path.with_name("truth.jsonl")
    names = [str(orjson.loads(line)["cluster"]) for line in truth.read_bytes().splitlines()] if truth.is_file() else []
    number: dict[str, int] = {}
    rng = random.Random(11)
    items = []
    for n, line in enumerate(path.read_bytes().splitlines()[:limit]):
        rec = orjson.loads(line)
        cluster = number.setdefault(names[n], len(number)) if names else n
        items.append(Item(rng.randrange(PARTITIONS), float(rec["ts"]), str(rec["id"]), cluster, line))
    return items


def settings(redis_url: str, bootstrap: str, *, align: bool, max_skew: float, max_batch: int,
             guarantee: str = "at_least_once") -> Settings:
    name = f"align-{uuid.uuid4().hex[:8]}"
    return Settings(
        kafka_bootstrap=bootstrap, input_topics=(f"{name}-in",), unique_topic=f"{name}-unique",
        duplicate_topic=f"{name}-duplicate", dead_letter_topic=f"{name}-dead", group_id=f"{name}-group",
        index=f"{redis_url}{'&' if '?' in redis_url else '?'}prefix={name}", id_field="id", ts_field="ts",
        max_batch=max_batch, align=align, max_skew=max_skew, partitions=PARTITIONS, processing_guarantee=guarantee,
    )


def start_worker(s: Settings, n: int) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEARDUP_")}
    env.update({
        "PYTHONPATH": str(ROOT), "NEARDUP_KAFKA_BOOTSTRAP": s.kafka_bootstrap, "NEARDUP_INDEX": s.index,
        "NEARDUP_INPUT_TOPICS": ",".join(s.input_topics), "NEARDUP_UNIQUE_TOPIC": s.unique_topic,
        "NEARDUP_DUPLICATE_TOPIC": s.duplicate_topic, "NEARDUP_DEAD_LETTER_TOPIC": s.dead_letter_topic,
        "NEARDUP_GROUP_ID": s.group_id, "NEARDUP_ID_FIELD": s.id_field, "NEARDUP_TS_FIELD": s.ts_field,
        "NEARDUP_MAX_BATCH": str(s.max_batch), "NEARDUP_ALIGN": "true" if s.align else "false",
        "NEARDUP_MAX_SKEW": f"{s.max_skew}s", "NEARDUP_LOG_LEVEL": "warning", "NEARDUP_METRICS_PORT": "0",
        "NEARDUP_GROUP_INSTANCE_ID": f"w{n}", "NEARDUP_PROCESSING_GUARANTEE": s.processing_guarantee,
    })
    return subprocess.Popen([sys.executable, "-m", "stream.cli", "serve"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            _, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        if p.returncode not in (0, -15):
            print(err.decode()[-2000:], file=sys.stderr)


def cleanup(s: Settings) -> None:
    asyncio.run(delete_topics(s, [*s.input_topics, *s.output_topics]))
    base, _, query = s.index.partition("?")
    prefix = query.split("prefix=", 1)[1]
    client = redis.Redis.from_url(base)
    keys = list(client.scan_iter(match=f"{{{prefix}:*", count=1000))
    for i in range(0, len(keys), 500):
        client.delete(*keys[i:i + 500])
    client.close()


async def preload(s: Settings, items: Sequence[Item]) -> None:
    await ensure_topics(s, [*s.input_topics, *s.output_topics], partitions=PARTITIONS)
    async with producer(s, linger_ms=20) as p:
        futures = [await p.send(s.input_topics[0], value=i.value, key=i.id.encode(), partition=i.partition,
                                timestamp_ms=round(i.ts * 1000)) for i in items]
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


def run(args: argparse.Namespace, items: Sequence[Item], want: dict[str, str], *, align: bool,
        workers: int) -> Row:
    s = settings(args.redis, args.bootstrap, align=align, max_skew=args.max_skew, max_batch=args.max_batch,
                 guarantee=args.guarantee)
    asyncio.run(preload(s, items))
    started = time.monotonic()
    procs = [start_worker(s, n) for n in range(workers)]
    try:
        got, first, last = asyncio.run(read_all(s, len(items), args.timeout))
    finally:
        stop(procs)
        cleanup(s)
    routed = {r.header("neardup-id").decode(): (r.header("neardup-verdict") or b"").decode()  # type: ignore[union-attr]
              for r in got}
    return Row(align, workers, len(routed), last - first, last - started, len(differences(routed, want)),
               f1(routed, items))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bootstrap", default=os.environ.get("NEARDUP_TEST_KAFKA", "127.0.0.1:9092"))
    p.add_argument("--redis", default=os.environ.get("NEARDUP_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--stream", type=Path, default=DEFAULT_STREAM if DEFAULT_STREAM.is_file() else None,
                   help="JSON lines with id, text, ts (default: shared/eval's stream when present, else generated)")
    p.add_argument("--generated", action="store_true", help="the generated backlog even when --stream exists")
    p.add_argument("--limit", type=int, default=40_000, help="records of the stream at most")
    p.add_argument("--max-skew", type=float, default=60.0, help="seconds of event time (the setting max_skew)")
    p.add_argument("--max-batch", type=int, default=500)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--guarantee", default="at_least_once", choices=("at_least_once", "exactly_once"))
    p.add_argument("--workers", default="1,2", help="worker counts to run, comma-separated")
    p.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    try:
        redis.Redis.from_url(args.redis).ping()
    except redis.RedisError as exc:
        print(f"bench/alignment.py needs Redis at {args.redis} and Kafka at {args.bootstrap} "
              f"(docker/services.sh start): {exc}", file=sys.stderr)
        return 2
    items = load(None if args.generated else args.stream, args.limit)
    want = reference(items, NearDupFilter())
    print(f"{len(items)} records on {PARTITIONS} partitions; filter F1 {f1(want, items):.4f}; max_skew "
          f"{args.max_skew:g}s; max_batch {args.max_batch}; {args.guarantee}", flush=True)
    counts = [int(n) for n in args.workers.split(",")]
    rows: list[Row] = []
    for _ in range(args.runs):
        for workers in counts:
            for align in (True, False):
                row = run(args, items, want, align=align, workers=workers)
                print(f"  align={'on ' if align else 'off'} workers={workers}: {row.records / row.steady_s:8,.0f} msg/s "
                      f"steady, {row.total_s:6.1f} s in all, {row.differences} routed otherwise, F1 {row.f1:.4f}",
                      flush=True)
                rows.append(row)
    print("\n| alignment | workers | msg/s first→last output (median) | s from start (median) | routed otherwise "
          "than `neardup filter` (median) | F1 (median) |\n|---|---|---|---|---|---|")
    for workers in counts:
        for align in (True, False):
            mine = [r for r in rows if r.align == align and r.workers == workers]
            print(f"| {'on' if align else 'off'} | {workers} | "
                  f"{statistics.median(r.records / r.steady_s for r in mine):,.0f} | "
                  f"{statistics.median(r.total_s for r in mine):.1f} | "
                  f"{statistics.median(r.differences for r in mine):.0f} | {statistics.median(r.f1 for r in mine):.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
