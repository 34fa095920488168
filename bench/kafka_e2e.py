"""Benchmark: `neardup serve` end to end, Kafka → worker (Redis index) → Kafka: throughput and latency.

    eval "$(bash docker/services.sh env)"
    python bench/kafka_e2e.py [--bootstrap HOST:PORT] [--redis URL] [--messages 10000] [--rate 2000]
                              [--seconds 20] [--runtime aiokafka,faust] [--max-batch 2000]

Throughput: the first `--messages` short messages of the eval stream (corpora `--corpora`, in stream
order) are preloaded into a fresh single-partition input topic; one `neardup serve` process is started
and the clock runs from its start until the last output record is read (also shown: from the first
output record, i.e. without process start-up). Latency: a fresh worker is started and warmed up, then
messages are produced at `--rate` per second for `--seconds` (each stamped with its send time in a
header); a separate consumer process reads the output topics and reports receive time minus send time.
Each run uses its own topics and its own Redis namespace (deleted afterwards).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

try:
    import aiokafka  # noqa: F401 (stream.kafka_tools needs it)
    import psutil
    import redis
except ModuleNotFoundError as exc:  # one line naming what to install, not a traceback
    print(f"kafka_e2e.py needs the Python package {exc.name}: pip install 'neardup[kafka,bench]'", file=sys.stderr)
    raise SystemExit(2) from None

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import needs  # noqa: E402
from stream.config import Settings  # noqa: E402
from stream.kafka_tools import delete_topics, ensure_topics, producer, read_topics  # noqa: E402

SENT = "bench-sent-ns"


@dataclass(frozen=True, slots=True)
class Throughput:
    runtime: str
    messages: int
    total_s: float
    steady_s: float
    cpu_s: float


@dataclass(frozen=True, slots=True)
class Latency:
    runtime: str
    sent: int
    received: int
    rate: float
    p50_ms: float
    p99_ms: float
    max_ms: float


def short_messages(stream: Path, truth: Path, corpora: str, limit: int) -> list[bytes]:
    """The first `limit` messages of the stream of those `corpora` (comma-separated, or all)."""
    wanted = None if corpora == "all" else corpora.split(",")
    out = []
    with open(stream, "rb") as s, open(truth, "rb") as t:
        for line, label in zip(s, t):
            if wanted is None or orjson.loads(label)["corpus"] in wanted:
                out.append(line.rstrip(b"\r\n"))
                if len(out) >= limit:
                    break
    return out


def settings(args: argparse.Namespace, runtime: str) -> Settings:
    name = f"bench-{uuid.uuid4().hex[:8]}"
    return Settings(
        kafka_bootstrap=args.bootstrap, input_topics=(f"{name}-in",), unique_topic=f"{name}-unique",
        duplicate_topic=f"{name}-duplicate", dead_letter_topic=f"{name}-dead", group_id=f"{name}-group",
        index=f"{args.redis}{'&' if '?' in args.redis else '?'}prefix={name}", id_field="id",
        runtime=runtime, max_batch=args.max_batch, window=12 * 3600.0,
    )


def start_worker(s: Settings) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEARDUP_")}
    env.update({
        "PYTHONPATH": str(ROOT), "NEARDUP_KAFKA_BOOTSTRAP": s.kafka_bootstrap, "NEARDUP_INDEX": s.index,
        "NEARDUP_INPUT_TOPICS": ",".join(s.input_topics), "NEARDUP_UNIQUE_TOPIC": s.unique_topic,
        "NEARDUP_DUPLICATE_TOPIC": s.duplicate_topic, "NEARDUP_DEAD_LETTER_TOPIC": s.dead_letter_topic,
        "NEARDUP_GROUP_ID": s.group_id, "NEARDUP_ID_FIELD": s.id_field, "NEARDUP_RUNTIME": s.runtime,
        "NEARDUP_MAX_BATCH": str(s.max_batch), "NEARDUP_WINDOW": f"{s.window}s", "NEARDUP_LOG_LEVEL": "warning",
    })
    return subprocess.Popen([sys.executable, "-m", "stream.commands", "serve"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def stop_worker(proc: subprocess.Popen[bytes]) -> float:
    """Stops the worker (SIGTERM); returns its CPU seconds."""
    try:
        times = psutil.Process(proc.pid).cpu_times()
        cpu = times.user + times.system
    except psutil.NoSuchProcess:
        cpu = float("nan")
    proc.terminate()
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    if proc.returncode not in (0, -15) and err is not None:
        print(err.decode()[-2000:], file=sys.stderr)
    return cpu


def cleanup(s: Settings) -> None:
    asyncio.run(delete_topics(s, [*s.input_topics, *s.output_topics]))
    base, _, query = s.index.partition("?")
    prefix = query.split("prefix=", 1)[1]
    client = redis.Redis.from_url(base)
    keys = list(client.scan_iter(match=f"{{{prefix}:*", count=1000))
    for i in range(0, len(keys), 500):
        client.delete(*keys[i : i + 500])
    client.close()


async def preload(s: Settings, lines: Sequence[bytes], partitions: int = 1) -> None:
    """`lines` into a fresh input topic of `partitions`, dealt round-robin."""
    await ensure_topics(s, [*s.input_topics, *s.output_topics], partitions=partitions)
    async with producer(s, linger_ms=20) as p:
        futures = [await p.send(s.input_topics[0], value=line, partition=i % partitions) for i, line in enumerate(lines)]
        await asyncio.gather(*futures)


def throughput(args: argparse.Namespace, runtime: str, lines: Sequence[bytes]) -> Throughput:
    s = settings(args, runtime)
    asyncio.run(preload(s, lines))

    async def read_all(started: float) -> tuple[float, float]:
        first = last = 0.0
        n = 0
        async for _ in read_topics(s, s.output_topics, max_records=len(lines), deadline=time.monotonic() + 600):
            n += 1
            last = time.monotonic()
            if n == 1:
                first = last
        if n < len(lines):
            raise RuntimeError(f"only {n} of {len(lines)} records routed")
        return first - started, last - started

    started = time.monotonic()
    proc = start_worker(s)
    try:
        to_first, to_last = asyncio.run(read_all(started))
    finally:
        cpu = stop_worker(proc)
        cleanup(s)
    return Throughput(runtime, len(lines), to_last, to_last - to_first, cpu)


def _latency_consumer(s: Settings, expected: int, timeout: float, ready: multiprocessing.synchronize.Event,
                      out: multiprocessing.Queue[list[float]]) -> None:
    async def run() -> list[float]:
        deltas: list[float] = []
        deadline = time.monotonic() + timeout
        reader = read_topics(s, s.output_topics, from_beginning=True, deadline=deadline, idle_timeout=10)
        ready.set()
        async for record in reader:
            sent = record.header(SENT)
            if sent is None:
                continue  # warm-up record
            deltas.append((time.time_ns() - int(sent)) / 1e6)
            if len(deltas) >= expected:
                break
        return deltas

    out.put(asyncio.run(run()))


def latency(args: argparse.Namespace, runtime: str, lines: Sequence[bytes]) -> Latency:
    s = settings(args, runtime)
    total = int(args.rate * args.seconds)

    async def warm_up() -> None:
        await ensure_topics(s, [*s.input_topics, *s.output_topics], partitions=1)
        async with producer(s) as p:
            await p.send_and_wait(s.input_topics[0], value=b'{"id": "warm-up", "text": "warm up message"}')
        async for _ in read_topics(s, s.output_topics, max_records=1, deadline=time.monotonic() + 120):
            return
        raise RuntimeError("the worker did not route the warm-up record")

    async def produce_at_rate() -> int:
        tick = 0.005
        per_tick = args.rate * tick
        sent = 0
        async with producer(s, linger_ms=0) as p:
            start = time.monotonic()
            futures = []
            while sent < total:
                due = min(total, int((time.monotonic() - start) / tick * per_tick) + 1)
                while sent < due:
                    line = lines[sent % len(lines)]
                    # A fresh id per copy, so that replayed text is a new message (duplicate), not a replay.
                    record = orjson.loads(line)
                    record["id"] = f"{record['id']}#{sent}"
                    futures.append(await p.send(s.input_topics[0], value=orjson.dumps(record),
                                                headers=[(SENT, str(time.time_ns()).encode())]))
                    sent += 1
                await asyncio.sleep(max(0.0, start + (sent / args.rate) - time.monotonic()))
            await asyncio.gather(*futures)
            return sent

    proc = start_worker(s)
    try:
        asyncio.run(warm_up())
        ctx = multiprocessing.get_context("spawn")
        ready = ctx.Event()
        queue: multiprocessing.Queue[list[float]] = ctx.Queue()
        consumer = ctx.Process(target=_latency_consumer, args=(s, total, args.seconds + 60, ready, queue))
        consumer.start()
        ready.wait(60)
        time.sleep(1.0)  # the consumer process has joined its partitions (no group: assignment is immediate)
        t0 = time.monotonic()
        sent = asyncio.run(produce_at_rate())
        elapsed = time.monotonic() - t0
        deltas = queue.get(timeout=args.seconds + 120)
        consumer.join(30)
    finally:
        stop_worker(proc)
        cleanup(s)
    deltas.sort()
    q = statistics.quantiles(deltas, n=100) if len(deltas) >= 100 else [float("nan")] * 99
    return Latency(runtime, sent, len(deltas), sent / elapsed, q[49], q[98], deltas[-1] if deltas else float("nan"))


def baseline(args: argparse.Namespace, lines: Sequence[bytes]) -> float:
    """messages/s of `route_batch` alone on the same messages and Redis index, in this process (no Kafka):
    the ceiling a worker can reach."""
    from filters.engine import NearDupFilter
    from stream.runner import RawRecord, route_batch

    s = settings(args, "aiokafka")
    nd = NearDupFilter(s.filter_config(), index=s.index)
    fmt = s.record_format()
    started = time.perf_counter()
    for i in range(0, len(lines), args.max_batch):
        chunk = lines[i : i + args.max_batch]
        route_batch(nd, [RawRecord(line, f"x/0/{i + j}", 1.7e9) for j, line in enumerate(chunk)], fmt)
    seconds = time.perf_counter() - started
    nd.index.close()
    cleanup(s)
    return len(lines) / seconds


def check_needs(args: argparse.Namespace) -> None:
    """The eval stream, Kafka and Redis (shared with bench/worker_steady.py)."""
    needs.files(__file__, args.stream, args.truth)
    needs.kafka(__file__, args.bootstrap)
    needs.redis(__file__, args.redis)


def add_service_arguments(p: argparse.ArgumentParser, messages: int) -> None:
    """The services, the messages and the batch size (shared with bench/worker_steady.py)."""
    p.add_argument("--bootstrap", default=os.environ.get("NEARDUP_TEST_KAFKA", "127.0.0.1:9092"))
    p.add_argument("--redis", default=os.environ.get("NEARDUP_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--stream", type=Path, default=ROOT.parent / "shared" / "eval" / "stream.jsonl")
    p.add_argument("--truth", type=Path, default=ROOT.parent / "shared" / "eval" / "truth.jsonl")
    p.add_argument("--corpora", default="sms_en,tweets_en,reviews_zh", help="comma-separated, or all")
    p.add_argument("--messages", type=int, default=messages)
    p.add_argument("--max-batch", type=int, default=Settings().max_batch)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_service_arguments(p, messages=10_000)
    p.add_argument("--rate", type=float, default=2000.0)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--runtime", default="aiokafka,faust")
    p.add_argument("--skip-latency", action="store_true")
    args = p.parse_args(argv)
    check_needs(args)

    lines = short_messages(args.stream, args.truth, args.corpora, args.messages)
    chars = statistics.median(len(orjson.loads(line)["text"]) for line in lines)
    print(f"{len(lines)} messages of {args.corpora} (median {chars:.0f} chars), max_batch {args.max_batch}, "
          f"Kafka {args.bootstrap}, Redis {args.redis}, {psutil.cpu_count()} CPUs", flush=True)
    ceiling = baseline(args, lines)
    rows = []
    for runtime in args.runtime.split(","):
        t = throughput(args, runtime, lines)
        lat = None if args.skip_latency else latency(args, runtime, lines)
        rows.append((t, lat))
        print(f"  {runtime}: done", file=sys.stderr, flush=True)

    print()
    print(f"{'runtime':<9} {'msgs':>6} {'total s':>8} {'msg/s':>7} {'steady msg/s':>13} {'worker CPU s':>13}"
          f" | {'rate/s':>7} {'recv':>6} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7}")
    for t, lat in rows:
        line = (f"{t.runtime:<9} {t.messages:>6} {t.total_s:>8.2f} {t.messages / t.total_s:>7,.0f}"
                f" {t.messages / t.steady_s:>13,.0f} {t.cpu_s:>13.1f}")
        if lat is not None:
            line += (f" | {lat.rate:>7,.0f} {lat.received:>6} {lat.p50_ms:>7.1f} {lat.p99_ms:>7.1f}"
                     f" {lat.max_ms:>7.1f}")
        print(line)
    print(f"\nroute_batch alone (same messages, same Redis, no Kafka, in-process): {ceiling:,.0f} msg/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
