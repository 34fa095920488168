"""Benchmark: the compact layout's server and client CPU a message against how full its small hashes get.

    eval "$(bash docker/services.sh env)"
    python bench/compact_fill.py [--configs slot,128:10,64:10,64:11,32:11] [--runs 3] [--set all|short]
                                 [--redis URL] [--stream FILE --truth FILE]

A config `FILL:KFIRST` runs the compact layout (`?layout=compact`) with `compact_codec.SMALL_FILL` = FILL (the
fields a small hash is sized for) and `K_FIRST` = `K_MIN` = KFIRST (the bits of a slice with no slice before
it) set in this process (the checked-in values are the defaults; the checking script, which runs only when
contended, keeps them); `slot` runs the slot layout. Every config runs `NearDupFilter.check_batch` over the
set in batches of 512 on a fresh namespace, `--runs` times, alternating (run 1 of every config, then run 2,
...), and the medians of the server's CPU (`INFO cpu`), this process's CPU and messages/s are printed. `all`:
the whole development stream with the default window (two slices, the first a part of one); `short`: its
short-message corpora with a window of 1e9 s (one slice, of K_FIRST bits), as bench/redis_cpu.py runs them.
"""

from __future__ import annotations

import argparse
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
    print(f"compact_fill.py needs the Python package {exc.name}: pip install 'neardup[kafka]'", file=sys.stderr)
    raise SystemExit(2) from None

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import needs  # noqa: E402
from filters.config import FilterConfig  # noqa: E402
from filters.engine import Message, NearDupFilter  # noqa: E402
from filters.index import compact_codec as cc  # noqa: E402
from stream.collector import tune_collector  # noqa: E402

SHORT = {"sms_en", "tweets_en", "reviews_zh"}


def server_cpu(server: redis.Redis) -> float:
    info = server.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--redis", default=os.environ.get("NEARDUP_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--stream", default=str(ROOT.parent / "shared" / "eval" / "stream.jsonl"))
    p.add_argument("--truth", default=str(ROOT.parent / "shared" / "eval" / "truth.jsonl"))
    p.add_argument("--configs", default="slot,128:10,64:10,64:11,32:11")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--set", choices=("all", "short"), default="all")
    args = p.parse_args()
    needs.files(__file__, args.stream, args.truth)
    needs.redis(__file__, args.redis)
    configs = args.configs.split(",")
    for config in configs:
        if config != "slot" and (len(config.split(":")) != 2 or not all(x.isdigit() for x in config.split(":"))):
            p.error(f"--configs: slot or FILL:KFIRST, not {config!r}")
    tune_collector()
    with open(args.stream, "rb") as s, open(args.truth, "rb") as t:
        msgs = [Message(r["id"], r["text"], r["ts"]) for r, label in zip(map(orjson.loads, s), map(orjson.loads, t))
                if args.set == "all" or label["corpus"] in SHORT]
    server = redis.Redis.from_url(args.redis)
    results: dict[str, list[tuple[float, float, float]]] = {config: [] for config in configs}
    for _ in range(args.runs):
        for config in configs:
            if config != "slot":
                cc.SMALL_FILL, cc.K_FIRST = map(int, config.split(":"))
                cc.K_MIN = cc.K_FIRST
            prefix = f"fill-{uuid.uuid4().hex[:10]}"
            url = f"{args.redis.split('?')[0]}?prefix={prefix}&layout={'slot' if config == 'slot' else 'compact'}"
            nd = NearDupFilter(FilterConfig(window=1e9) if args.set == "short" else FilterConfig(), index=url)
            c0, p0, t0 = server_cpu(server), time.process_time(), time.perf_counter()
            for at in range(0, len(msgs), 512):
                nd.check_batch(msgs[at : at + 512])
            wall, client, used = time.perf_counter() - t0, time.process_time() - p0, server_cpu(server) - c0
            results[config].append((used / len(msgs) * 1e6, client / len(msgs) * 1e6, len(msgs) / wall))
            nd.index.close()
            keys = list(server.scan_iter(match=f"{{{prefix}:*", count=1000))
            for at in range(0, len(keys), 500):
                server.delete(*keys[at : at + 500])
    print(f"{len(msgs)} messages ({args.set}), {args.runs} runs (medians)\n")
    print("| config | server CPU µs a message | client CPU µs a message | messages/s |\n|---|---|---|---|")
    for config in configs:
        s, c, r = zip(*results[config])
        print(f"| {config} | {statistics.median(s):.1f} | {statistics.median(c):.1f} | {statistics.median(r):,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
