"""Fault injection: the README's "Guarantees" figures (messages, faults, lost, repeated, let through, recovery).

    eval "$(bash docker/services.sh env)"
    python bench/faults.py [--skip broker-restart,redis-outage] [--runs 1]

Runs the scenarios of bench/reliability.py against the real broker and Redis of
docker/services.sh (NEARDUP_TEST_* variables): three and four `neardup serve` processes racing on
near-duplicates (standalone Redis and Redis Cluster), the same against a check-then-insert index,
kill -9 and restart (at-least-once and exactly-once), a worker added and one removed mid-run, a
broker restart (`docker/services.sh restart kafka`: other users of the broker see a short outage), the
broker hung for 10 s (`docker/services.sh freeze kafka 10`: the same), Redis unreachable for 10 s, a
200,000-message spam wave and a long stream with a 2 s window. Prints two Markdown tables. Each scenario
uses topics and a Redis namespace of its own.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import needs
from bench import reliability as rs
from bench.kafka_support import redis_namespace

SCENARIOS = ("concurrency", "check-then-insert", "cluster", "crash", "rebalance", "broker-restart",
             "broker-freeze", "redis-outage", "memory")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip", default="", help=f"comma-separated, of {', '.join(SCENARIOS)}")
    parser.add_argument("--runs", type=int, default=1, help="repeat each Kafka scenario this many times")
    args = parser.parse_args()
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    bootstrap = os.environ.get("NEARDUP_TEST_KAFKA")
    redis_url = os.environ.get("NEARDUP_TEST_REDIS_URL")
    cluster_url = os.environ.get("NEARDUP_TEST_REDIS_CLUSTER_URL")
    if not bootstrap or not redis_url:
        print('faults.py needs Kafka and Redis: run `eval "$(bash docker/services.sh env)"` first '
              '(NEARDUP_TEST_KAFKA, NEARDUP_TEST_REDIS_URL)', file=sys.stderr)
        return 2
    needs.kafka(__file__, bootstrap)
    needs.redis(__file__, redis_url)
    tallies: list[rs.Tally] = []
    figures: list[rs.Figure] = []
    logs = Path(tempfile.mkdtemp(prefix="neardup-faults-"))

    def run(name: str, scenario: Callable[[str], rs.Tally]) -> None:
        if name in skip:
            return
        for _ in range(args.runs):
            with redis_namespace(redis_url) as index:
                tally = scenario(index)
            print(tally.row(), tally.notes or "", file=sys.stderr)
            tallies.append(tally)

    run("concurrency", lambda ix: rs.concurrency(bootstrap, ix, logs, workers=3)[0])
    run("concurrency", lambda ix: rs.concurrency(bootstrap, ix, logs, workers=3, hook="pause=0.3")[0])
    run("check-then-insert", lambda ix: rs.concurrency(bootstrap, ix, logs, workers=3, hook="racy",
                                                       name="check-then-insert")[0])
    run("check-then-insert", lambda ix: rs.concurrency(bootstrap, ix, logs, workers=3, hook="racy,pause=0.3",
                                                       name="check-then-insert")[0])
    if cluster_url and "cluster" not in skip:
        for _ in range(args.runs):
            index = rs.cluster_index_url(cluster_url)
            try:
                tally = rs.concurrency(bootstrap, index, logs, workers=4, clusters=100, hook="pause=0.3",
                                       name="Redis Cluster")[0]
            finally:
                rs.drop_cluster_index(index)
            tallies.append(tally)
    for exactly_once in (False, True):
        run("crash", lambda ix, eo=exactly_once: rs.crash(bootstrap, ix, logs, exactly_once=eo))
        run("rebalance", lambda ix, eo=exactly_once: rs.rebalance(bootstrap, ix, logs, exactly_once=eo))
    run("broker-restart", lambda ix: rs.broker_restart(bootstrap, ix, logs))
    run("broker-freeze", lambda ix: rs.broker_restart(bootstrap, ix, logs, freeze=10.0))
    if "redis-outage" not in skip:
        for _ in range(args.runs):
            tallies.append(rs.redis_outage(bootstrap, redis_url, logs, outage=10.0))
    if "memory" not in skip:
        kinds, samples = rs.spam_wave(redis_url, 200_000)
        first, last = samples[0], samples[-1]
        figures.append(rs.Figure("spam wave: one message, 3 characters edited each time (Redis index)", 200_000,
                                 f"{kinds['unique']} unique; Redis namespace {first.keys} → {last.keys} keys, "
                                 f"{first.bytes // 1024} → {last.bytes // 1024} KiB from 40k to 200k; "
                                 f"RSS {first.rss_mb:.0f} → {last.rss_mb:.0f} MB"))
        sent, largest, samples = rs.long_stream(redis_url, seconds=12.0)
        middle = max(s.keys for s in samples if 4 <= s.at < 8)
        late = [s for s in samples if s.at >= 8]
        figures.append(rs.Figure("long stream of unique messages, window 2 s, 1,000/s for 12 s", sent,
                                 f"keys {middle:,} (4-8 s) → {max(s.keys for s in late):,} (8-12 s), "
                                 f"{max(s.bytes for s in late) // 1024:,} KiB; largest bucket {largest}"))
    rs.print_tables(tallies, figures)
    print(f"\nworker logs: {logs}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
