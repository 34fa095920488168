"""Probe: how long a Kafka transaction's consumed offsets take to show in the group after the commit.

    eval "$(bash docker/services.sh env)"
    python bench/txn_offsets.py [--bootstrap HOST:PORT] [--commits 200]

The exactly-once worker commits each batch's offsets inside its transaction
(`send_offsets_to_transaction`, then `commit_transaction`). The group coordinator applies them when
the transaction's commit marker is written, which happens after `commit_transaction` returned, and
aiokafka's offset fetch (OffsetFetch below v7, no require_stable) answers the offset before until
then. A partition's next owner starts from that answer, which is why the worker waits for it before it
lets partitions go (stream/delivery.py `ExactlyOnce.release`). This probe commits `--commits` one-record
transactions on a fresh topic, each with the next offset, reads the group's committed offset right
after each commit (a consumer of the group that already knows its coordinator), and prints how many
first reads were stale and how long it took until the offset showed (median, p99, max).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

try:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
except ModuleNotFoundError as exc:  # one line naming what to install, not a traceback
    print(f"txn_offsets.py needs the Python package {exc.name}: pip install 'neardup[kafka]'", file=sys.stderr)
    raise SystemExit(2) from None

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import needs


async def probe(bootstrap: str, commits: int) -> tuple[int, list[float]]:
    """(stale first reads, seconds until each commit's offset showed)."""
    topic, group = f"txn-probe-{uuid.uuid4().hex[:8]}", f"txn-probe-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 1, 1)])
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, transactional_id=f"txn-probe-{uuid.uuid4().hex[:8]}")
        reader = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
        await producer.start()
        await reader.start()
        tp = TopicPartition(topic, 0)
        stale, waits = 0, []
        try:
            await reader.committed(tp)  # the reader finds the group's coordinator before the clock runs
            for offset in range(1, commits + 1):
                await producer.begin_transaction()
                await producer.send_and_wait(topic, b"x", partition=0)
                await producer.send_offsets_to_transaction({tp: offset}, group)
                await producer.commit_transaction()
                t0 = time.perf_counter()
                first = True
                while await reader.committed(tp) != offset:
                    stale += first
                    first = False
                waits.append(time.perf_counter() - t0)
        finally:
            await producer.stop()
            await reader.stop()
        await admin.delete_topics([topic])
    finally:
        await admin.close()
    return stale, waits


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bootstrap", default=os.environ.get("NEARDUP_TEST_KAFKA", "127.0.0.1:9092"))
    p.add_argument("--commits", type=int, default=200)
    args = p.parse_args(argv)
    needs.kafka(__file__, args.bootstrap)
    stale, waits = asyncio.run(probe(args.bootstrap, args.commits))
    ms = sorted(w * 1000 for w in waits)
    print("| commits | first read stale | ms until shown: median | p99 | max |")
    print("|---|---|---|---|---|")
    print(f"| {len(ms)} | {stale} | {statistics.median(ms):.1f} | {ms[int(0.99 * (len(ms) - 1))]:.1f} | {ms[-1]:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
