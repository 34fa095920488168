"""Benchmark: how long rebuilding a lost Redis index from its changelog takes, per million entries.

    eval "$(bash docker/services.sh env)"
    python bench/restore.py [--entries 1000000] [--partitions 4] [--runs 3] [--bootstrap HOST:PORT] [--redis URL]

Writes a changelog of `--entries` entries (distinct generated short messages, fingerprinted with the
default filter configuration, journaled as a worker does: one record per routed batch of `--batch`
messages) to a fresh topic of `--partitions` partitions, then times what a worker does when it finds its
index lost: read the changelog (`read_committed`) and write every entry into an empty Redis namespace
(`CandidateIndex.restore`), reading and writing overlapped. Prints entries read and written, seconds,
entries per second, seconds per million, the restore's CPU seconds (this process, and Redis's from
`INFO cpu`: nothing else should use that Redis meanwhile), the index's memory per entry (Redis
`MEMORY USAGE` over the namespace's keys) and the client's peak resident memory above where the restore began
(`PeakMemory`), per run (`--runs` restores of the same changelog, each into a
namespace of its own), and their median. The topic and the namespaces are deleted afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

try:
    import redis
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
except ModuleNotFoundError as exc:  # one line naming what to install, not a traceback
    print(f"restore.py needs the Python package {exc.name}: pip install 'neardup[kafka]'", file=sys.stderr)
    raise SystemExit(2) from None

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import needs
from bench.redis_bench import server_cpu
from filters.config import FilterConfig
from filters.engine import NearDupFilter
from filters.index import Entry
from filters.index.backends import open_index
from stream.changelog import NAMESPACE_HEADER, Write, encode_records, read_changelog, restore_from

_WORDS = ["".join(random.Random(i).choices("abcdefghijklmnopqrstuvwxyz", k=random.Random(-i).randint(3, 9)))
          for i in range(5000)]


def texts(n: int, seed: int = 11) -> list[str]:
    """Distinct short messages (8-20 words and a number), SMS-sized."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(_WORDS, k=rng.randint(8, 20))) + f" {i}" for i in range(n)]


async def write_changelog(bootstrap: str, topic: str, partitions: int, namespace: str, nd: NearDupFilter,
                          entries: int, batch: int) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, partitions, 1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, max_batch_size=1024 * 1024, acks=1,
                                max_request_size=2 * 1024 * 1024)
    await producer.start()
    headers = [(NAMESPACE_HEADER, namespace.encode())]
    try:
        step = 20_000
        start = time.time() - 3600  # an hour of event time before now, one entry after another
        for at in range(0, entries, step):
            chunk = texts(min(step, entries - at), seed=at)
            fps = nd.fingerprinter.fingerprint_batch(chunk)
            made = [(Entry.of(f"r{at + i:08d}", start + (at + i) * 3600 / entries, fp), fp.keys)
                    for i, fp in enumerate(fps)]
            futures = []
            for b in range(0, len(made), batch):
                for key, value in encode_records(made[b : b + batch]):
                    futures.append(await producer.send(topic, value, key=key, headers=headers))
            await asyncio.gather(*futures)
    finally:
        await producer.stop()


async def restore(bootstrap: str, topic: str, partitions: int, namespace: str, url: str,
                  cfg: FilterConfig) -> tuple[int, int, float]:
    # Fenced, as a worker's index with a changelog: without its marker it is being rebuilt, nobody else writes.
    index = open_index(url, window=cfg.window, bucket_cap=cfg.bucket_cap, namespace=namespace, fenced=True)
    reader = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                              isolation_level="read_committed", auto_offset_reset="earliest",
                              max_partition_fetch_bytes=8 * 1024 * 1024, fetch_max_bytes=32 * 1024 * 1024)
    await reader.start()

    async def read(write: Write) -> int:
        return await read_changelog(reader, topic, list(range(partitions)), namespace,
                                    round((time.time() - 2 * 86400) * 1000), write)

    try:
        t0 = time.perf_counter()
        read_n, written = await restore_from(read, index.restore, stamp=b"bench")  # as the worker's guard does
        seconds = time.perf_counter() - t0
    finally:
        await reader.stop()
        index.close()
    return read_n, written, seconds


class PeakMemory:
    """This process's resident memory sampled every few milliseconds from a thread of its own (Linux:
    /proc/self/statm) while in the `with`: `peak` is its highest above what it was on entering, in bytes (0
    where /proc is absent)."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-memory", daemon=True)

    @staticmethod
    def resident() -> int:
        try:
            with open("/proc/self/statm", "rb") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            return 0

    def _run(self) -> None:
        start = self.resident()
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.resident() - start)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def memory_per_entry(url: str, prefix: str, entries: int) -> float:
    client = redis.Redis.from_url(url.partition("?")[0])
    try:
        total = sum(client.memory_usage(k) or 0 for k in client.scan_iter(match=f"{{{prefix}:*", count=1000))
        for key in list(client.scan_iter(match=f"{{{prefix}:*", count=1000)):
            client.unlink(key)
    finally:
        client.close()
    return total / max(1, entries)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--entries", type=int, default=1_000_000)
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--runs", type=int, default=3, help="restores of the same changelog, each timed")
    p.add_argument("--batch", type=int, default=500, help="entries journaled per routed batch (one record each)")
    p.add_argument("--bootstrap", default=os.environ.get("NEARDUP_TEST_KAFKA", "127.0.0.1:9092"))
    p.add_argument("--redis", default=os.environ.get("NEARDUP_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))
    args = p.parse_args(argv)
    needs.kafka(__file__, args.bootstrap)
    needs.redis(__file__, args.redis)
    cfg = FilterConfig()
    nd = NearDupFilter(cfg)
    name = f"restore-{uuid.uuid4().hex[:8]}"
    namespace = cfg.digest()
    t0 = time.perf_counter()
    asyncio.run(write_changelog(args.bootstrap, name, args.partitions, namespace, nd, args.entries, args.batch))
    print(f"changelog of {args.entries:,} entries written in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    server = redis.Redis.from_url(args.redis.partition("?")[0])
    print("| run | entries read | written | seconds | entries/s | s per million | client CPU s | Redis CPU s "
          "| Redis bytes per entry | client peak MB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    per_million: list[float] = []
    ok = True
    try:
        for run in range(1, args.runs + 1):  # each into a namespace of its own, dropped after
            url = f"{args.redis}{'&' if '?' in args.redis else '?'}prefix={name}-{run}"
            redis_cpu, cpu = server_cpu(server), time.process_time()
            with PeakMemory() as memory:
                read, written, seconds = asyncio.run(restore(args.bootstrap, name, args.partitions, namespace, url,
                                                             cfg))
            cpu, redis_cpu = time.process_time() - cpu, server_cpu(server) - redis_cpu
            per_entry = memory_per_entry(url, f"{name}-{run}", written)
            per_million.append(seconds * 1e6 / max(1, read))
            ok = ok and written == read == args.entries
            print(f"| {run} | {read:,} | {written:,} | {seconds:.1f} | {read / seconds:,.0f} | {per_million[-1]:.1f} "
                  f"| {cpu:.1f} | {redis_cpu:.1f} | {per_entry:,.0f} | {memory.peak / 2**20:,.0f} |", flush=True)
    finally:
        async def drop() -> None:
            admin = AIOKafkaAdminClient(bootstrap_servers=args.bootstrap)
            await admin.start()
            try:
                await admin.delete_topics([name])
            finally:
                await admin.close()
        asyncio.run(drop())
    print(f"median of {len(per_million)} runs: {statistics.median(per_million):.1f} s per million entries")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
