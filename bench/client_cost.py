"""Benchmark: the client's instructions per message on the Redis index, counted by callgrind.

    eval "$(bash docker/services.sh env)"
    python bench/client_cost.py [--redis URL | --memory] [--messages 8192] [--batch 512] [--layout slot|compact|group]
                                [--round N] [--corpora sms_en,tweets_en,reviews_zh | --corpora all] [--keep FILE]

Wall and CPU time drift by up to 2× within minutes on a shared machine; an instruction count does not
(runs differ by under 0.2 %: Python's per-process string hashing changes set and dict orders), so two
versions of the client can be compared with a run or two each. The script runs itself under valgrind's
callgrind (`apt-get install valgrind`), routes the first `--messages` messages of the eval stream's
`--corpora` (by default the short-message ones; `--corpora all --messages 36650`: the whole stream)
(`route_batch`, as the Kafka worker does, on a fresh Redis namespace) and counts only the instructions
executed inside that loop (callgrind's `--toggle-collect` on the one C function that wraps it): the
Redis server's work is not counted, the client's waiting costs nothing. The first batch warms up
(connection, tables, caches) and is not counted; the garbage collector runs as `neardup serve` runs it
(`stream/collector.py`). Prints instructions per message. It imports the
`filters` and `stream` packages of the checkout it lives in, so copying it into an older checkout
measures that release the same way. `--memory`: the same on the embedded index (`memory://`), no Redis.
`--layout compact` / `group`: the compact or the group layout of the Redis index; `--keep FILE`: callgrind's output kept there
(`callgrind_annotate FILE`: where the instructions go).
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHORT = "sms_en,tweets_en,reviews_zh"


def measure(args: argparse.Namespace) -> None:
    """The part that runs under callgrind."""
    import orjson

    sys.path.insert(0, str(ROOT))
    from filters.config import FilterConfig
    from filters.engine import NearDupFilter
    from stream.codec import RecordFormat
    from stream.collector import tune_collector
    from stream.runner import RawRecord, route_batch

    tune_collector()  # as `neardup filter` and `serve` run
    wanted = set(args.corpora.split(","))
    with open(args.stream, "rb") as s, open(args.truth, "rb") as t:
        lines = [orjson.dumps(r) for r, label in zip(map(orjson.loads, s), map(orjson.loads, t))
                 if args.corpora == "all" or label["corpus"] in wanted][: args.messages]
    fmt = RecordFormat()
    batches = [[RawRecord(line, str(i + j), 0.0) for j, line in enumerate(lines[i : i + args.batch])]
               for i in range(0, len(lines), args.batch)]
    index = ("memory://" if args.memory else
             f"{args.redis.split('?')[0]}?prefix=cost-{uuid.uuid4().hex[:10]}"
             + (f"&layout={args.layout}" if args.layout != "slot" else "")  # (the default: an older checkout takes it)
             + (f"&round={args.round}" if args.round else ""))
    nd = NearDupFilter(FilterConfig(window=1e9), index=index)
    route_batch(nd, batches[0], fmt)  # warm-up, not counted
    # Counted: everything inside this reduce (callgrind --toggle-collect=functools_reduce).
    functools.reduce(lambda _, batch: route_batch(nd, batch, fmt), batches[1:], None)
    nd.index.close()
    print(f"counted {sum(map(len, batches[1:]))}")  # read by main()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--redis", default=os.environ.get("NEARDUP_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--stream", default=str(ROOT.parent / "shared" / "eval" / "stream.jsonl"))
    p.add_argument("--truth", default=str(ROOT.parent / "shared" / "eval" / "truth.jsonl"))
    p.add_argument("--messages", type=int, default=8192)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--memory", action="store_true", help="the embedded index (memory://) instead of Redis")
    p.add_argument("--corpora", default=SHORT,
                   help="the corpora whose messages are routed, comma-separated; all: the whole stream")
    p.add_argument("--layout", choices=("slot", "compact", "group"), default="slot", help="the Redis index's layout")
    p.add_argument("--round", type=int, help="messages a lookup and insert round takes at most (the index's ?round=; "
                                             "default: the index's)")
    p.add_argument("--keep", help="keep callgrind's output in this file")
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if not args.inside:
        sys.path.insert(0, str(ROOT))
        from bench import needs

        needs.tool(__file__, "valgrind", "apt-get install valgrind")
        needs.files(__file__, args.stream, args.truth)
        if not args.memory:
            needs.modules(__file__, "redis", install="neardup[kafka]")
            needs.redis(__file__, args.redis)
    if args.inside:
        measure(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=functools_reduce",
             f"--callgrind-out-file={args.keep or f'{tmp}/callgrind.out'}", sys.executable, __file__, "--inside",
             *sys.argv[1:]],
            capture_output=True, text=True, check=False)
    found = re.search(r"Collected : ([\d,]+)", out.stderr)
    routed = re.search(r"^counted (\d+)$", out.stdout, re.M)
    if out.returncode != 0 or found is None or routed is None or int(routed.group(1)) == 0:
        print(out.stderr[-3000:], file=sys.stderr)
        return 1
    counted = int(found.group(1).replace(",", ""))
    messages = int(routed.group(1))
    where = "memory://" if args.memory else f"Redis ({args.layout} layout{f', rounds of {args.round}' if args.round else ''})"
    which = "short message" if args.corpora == SHORT else "message" if args.corpora == "all" else f"message of {args.corpora}"
    print(f"client instructions per {which} on {where} (callgrind, {messages} messages after a warm-up batch): "
          f"{counted / messages:,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
