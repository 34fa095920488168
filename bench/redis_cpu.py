"""Benchmark: what one message costs the Redis server (CPU µs, commands) and the client, for this checkout.

    eval "$(bash docker/services.sh env)"
    python bench/redis_cpu.py [--redis URL] [--corpora sms_en,tweets_en,reviews_zh] [--runs 3] [--layout slot|compact]
                              [--collector default|tuned]

Runs `NearDupFilter.check_batch` over the messages (batches of 512, a fresh namespace each run) on
the Redis index and reads the server's `INFO cpu` (user + sys), `INFO stats` (bytes in and out) and
`INFO commandstats` before and after: nothing else should use that Redis meanwhile. Prints the median
per message of the server's CPU, the client's CPU (this process), the wall time, the bytes Redis
received and sent, and the server's busiest commands. It imports
the `filters` package of the checkout it lives in, so copying it into an older checkout measures that
release the same way (README: "What Redis spends").
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import orjson

try:
    import redis
except ModuleNotFoundError as exc:  # one line naming what to install, not a traceback
    print(f"redis_cpu.py needs the Python package {exc.name}: pip install 'neardup[kafka]'", file=sys.stderr)
    raise SystemExit(2) from None

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import needs  # noqa: E402
from filters.config import FilterConfig  # noqa: E402
from filters.engine import Message, NearDupFilter  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--redis", default=os.environ.get("NEARDUP_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--layout", default="slot", choices=["slot", "compact"],
                   help="the index's layout (compact: docs/design.md, \"The compact slot layout\")")
    p.add_argument("--stream", default=str(ROOT.parent / "shared" / "eval" / "stream.jsonl"))
    p.add_argument("--truth", default=str(ROOT.parent / "shared" / "eval" / "truth.jsonl"))
    p.add_argument("--corpora", default="sms_en,tweets_en,reviews_zh")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--collector", choices=("default", "tuned"), default="default",
                   help="tuned: the garbage collector as `neardup filter` and `serve` run it (stream/collector.py)")
    args = p.parse_args()
    needs.files(__file__, args.stream, args.truth)
    needs.redis(__file__, args.redis)
    wanted = set(args.corpora.split(","))
    with open(args.stream, "rb") as s, open(args.truth, "rb") as t:
        msgs = [Message(r["id"], r["text"], r["ts"]) for r, label in zip(map(orjson.loads, s), map(orjson.loads, t))
                if label["corpus"] in wanted]
    server = redis.Redis.from_url(args.redis)
    if args.collector == "tuned":
        from stream.collector import tune_collector

        tune_collector()
    collections = [0.0]
    started = [0.0]

    def collecting(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            collections[0] += time.perf_counter() - started[0]

    gc.callbacks.append(collecting)
    rows: dict[str, list[float]] = {"server CPU µs": [], "client CPU µs": [], "of it garbage collection µs": [],
                                    "wall µs": [], "bytes Redis received": [], "bytes Redis sent": []}
    commands: dict[str, list[float]] = {}
    for _ in range(args.runs):
        prefix = f"cpu-{uuid.uuid4().hex[:10]}"
        nd = NearDupFilter(FilterConfig(window=1e9), index=f"{args.redis.split('?')[0]}?prefix={prefix}&layout={args.layout}")
        server.config_resetstat()
        cpu, net = server.info("cpu"), server.info("stats")
        collections[0] = 0.0
        c0, p0, t0 = cpu["used_cpu_user"] + cpu["used_cpu_sys"], time.process_time(), time.perf_counter()
        for at in range(0, len(msgs), 512):
            nd.check_batch(msgs[at : at + 512])
        wall, client = time.perf_counter() - t0, time.process_time() - p0
        cpu, after = server.info("cpu"), server.info("stats")
        n = len(msgs)
        rows["bytes Redis received"].append((after["total_net_input_bytes"] - net["total_net_input_bytes"]) / n)
        rows["bytes Redis sent"].append((after["total_net_output_bytes"] - net["total_net_output_bytes"]) / n)
        rows["server CPU µs"].append((cpu["used_cpu_user"] + cpu["used_cpu_sys"] - c0) / n * 1e6)
        rows["client CPU µs"].append(client / n * 1e6)
        rows["of it garbage collection µs"].append(collections[0] / n * 1e6)
        rows["wall µs"].append(wall / n * 1e6)
        for name, stat in server.info("commandstats").items():
            commands.setdefault(name.removeprefix("cmdstat_"), []).append(stat["usec"] / n)
        nd.index.close()
        keys = list(server.scan_iter(match=f"{{{prefix}:*", count=1000))
        for at in range(0, len(keys), 500):
            server.delete(*keys[at : at + 500])
    print(f"{len(msgs)} messages of {args.corpora}, {args.runs} runs (median per message)\n")
    print("| measure | per message |\n|---|---|")
    for name, values in rows.items():
        print(f"| {name} | {statistics.median(values):.1f} |")
    print(f"| messages/s | {1e6 / statistics.median(rows['wall µs']):,.0f} |")
    busiest = sorted(commands.items(), key=lambda kv: -statistics.median(kv[1]))[:5]
    print("\n| server command (incl. those run by scripts) | µs per message |\n|---|---|")
    for name, values in busiest:
        print(f"| {name} | {statistics.median(values):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
