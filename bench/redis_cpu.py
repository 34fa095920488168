"""Benchmark: what one message costs the Redis server (CPU µs, commands) and the client, for this checkout.

    eval "$(bash docker/services.sh env)"
    python bench/redis_cpu.py [--redis URL] [--corpora sms_en,tweets_en,reviews_zh|all] [--runs 3]
                              [--layout slot|compact|group|slot,compact,group] [--collector default|tuned]
                              [--rounds uncontended|checked]

Runs `NearDupFilter.check_batch` over the messages (batches of 512, a fresh namespace each run) on
the Redis index and reads the server's `INFO cpu` (user + sys), `INFO stats` (bytes in and out) and
`INFO commandstats` before and after: nothing else should use that Redis meanwhile. A Redis Cluster URL
(`redis+cluster://host:port`) sums those of every master (a namespace lives on one). `--rounds checked` makes
every insert round the contended one (the checking script: what a round that others wrote beside costs, and
every round of the compact layout on Redis Cluster). Prints the median
per message of the server's CPU, the client's CPU (this process), the wall time, the bytes Redis
received and sent, and the server's busiest commands. `--layout slot,compact` measures both layouts in the
one call, run after run alternating, and prints their ratios. It imports
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
from typing import Any
from urllib.parse import urlsplit, urlunsplit

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


class _Servers:
    """The Redis an index URL names: one server, or every master of a Redis Cluster (`redis+cluster://`), whose
    `INFO` figures are summed."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        base = urlunsplit((parts.scheme.removesuffix("+cluster"), parts.netloc, parts.path, "", ""))
        if parts.scheme.endswith("+cluster"):
            with redis.RedisCluster.from_url(base) as cluster:
                nodes = [(node.host, node.port) for node in cluster.get_primaries()]
            self.clients = [redis.Redis(host=host, port=port, username=parts.username, password=parts.password,
                                        ssl=parts.scheme.startswith("rediss")) for host, port in nodes]
        else:
            self.clients = [redis.Redis.from_url(base)]

    def config_resetstat(self) -> None:
        for client in self.clients:
            client.config_resetstat()

    def info(self, section: str) -> dict[str, Any]:
        """`INFO section` summed over the servers (per command, for `commandstats`)."""
        out: dict[str, Any] = {}
        for client in self.clients:
            for name, value in client.info(section).items():
                if isinstance(value, dict):
                    into = out.setdefault(name, {})
                    for k, v in value.items():
                        if isinstance(v, (int, float)):
                            into[k] = into.get(k, 0) + v
                elif isinstance(value, (int, float)):
                    out[name] = out.get(name, 0) + value
        return out

    def drop(self, prefix: str) -> None:
        for client in self.clients:
            keys = list(client.scan_iter(match=f"{{{prefix}:*", count=1000))
            for at in range(0, len(keys), 500):
                client.delete(*keys[at : at + 500])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--redis", default=os.environ.get("NEARDUP_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--layout", default="slot",
                   help="the index's layout, slot, compact or group (docs/design.md, \"The compact slot layout\", "
                        "\"The group layout\"); "
                        "several, comma-separated: measured alternating")
    p.add_argument("--stream", default=str(ROOT.parent / "shared" / "eval" / "stream.jsonl"))
    p.add_argument("--truth", default=str(ROOT.parent / "shared" / "eval" / "truth.jsonl"))
    p.add_argument("--corpora", default="sms_en,tweets_en,reviews_zh",
                   help="the corpora of the stream to take (comma-separated), or all")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--collector", choices=("default", "tuned"), default="default",
                   help="tuned: the garbage collector as `neardup filter` and `serve` run it (stream/collector.py)")
    p.add_argument("--rounds", choices=("uncontended", "checked"), default="uncontended",
                   help="checked: every insert round the contended one (the checking script), as if others always "
                        "wrote beside")
    args = p.parse_args()
    needs.files(__file__, args.stream, args.truth)
    needs.redis(__file__, args.redis)
    wanted = None if args.corpora == "all" else set(args.corpora.split(","))
    with open(args.stream, "rb") as s, open(args.truth, "rb") as t:
        msgs = [Message(r["id"], r["text"], r["ts"]) for r, label in zip(map(orjson.loads, s), map(orjson.loads, t))
                if wanted is None or label["corpus"] in wanted]
    if not msgs:
        p.error(f"no message of the stream is in the corpora {args.corpora!r}")
    server = _Servers(args.redis)
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
    layouts = args.layout.split(",")
    if not set(layouts) <= {"slot", "compact", "group"}:
        p.error(f"--layout: slot, compact or group, not {args.layout!r}")
    names = ("server CPU µs", "client CPU µs", "of it garbage collection µs", "wall µs", "bytes Redis received",
             "bytes Redis sent")
    rows: dict[str, dict[str, list[float]]] = {layout: {name: [] for name in names} for layout in layouts}
    commands: dict[str, dict[str, list[float]]] = {layout: {} for layout in layouts}
    calls: dict[str, dict[str, list[float]]] = {layout: {} for layout in layouts}
    for _ in range(args.runs):
        for layout in layouts:  # alternating: the machine's load moves both alike
            row = rows[layout]
            prefix = f"cpu-{uuid.uuid4().hex[:10]}"
            url = (f"{args.redis.split('?')[0]}?prefix={prefix}"
                   + (f"&layout={layout}" if layout != "slot" else ""))  # (the default: an older checkout takes it)
            nd = NearDupFilter(FilterConfig(window=1e9), index=url)
            if args.rounds == "checked":
                nd.index.alone_inserts = False  # type: ignore[attr-defined]
            server.config_resetstat()
            cpu, net = server.info("cpu"), server.info("stats")
            collections[0] = 0.0
            c0, p0, t0 = cpu["used_cpu_user"] + cpu["used_cpu_sys"], time.process_time(), time.perf_counter()
            for at in range(0, len(msgs), 512):
                nd.check_batch(msgs[at : at + 512])
            wall, client = time.perf_counter() - t0, time.process_time() - p0
            cpu, after = server.info("cpu"), server.info("stats")
            n = len(msgs)
            row["bytes Redis received"].append((after["total_net_input_bytes"] - net["total_net_input_bytes"]) / n)
            row["bytes Redis sent"].append((after["total_net_output_bytes"] - net["total_net_output_bytes"]) / n)
            row["server CPU µs"].append((cpu["used_cpu_user"] + cpu["used_cpu_sys"] - c0) / n * 1e6)
            row["client CPU µs"].append(client / n * 1e6)
            row["of it garbage collection µs"].append(collections[0] / n * 1e6)
            row["wall µs"].append(wall / n * 1e6)
            for name, stat in server.info("commandstats").items():
                commands[layout].setdefault(name.removeprefix("cmdstat_"), []).append(stat["usec"] / n)
                calls[layout].setdefault(name.removeprefix("cmdstat_"), []).append(stat["calls"] / n)
            nd.index.close()
            server.drop(prefix)
    print(f"{len(msgs)} messages of {args.corpora}, {args.runs} runs (median per message), {args.rounds} rounds, "
          f"{len(server.clients)} server(s)\n")
    first, others = layouts[0], layouts[1:]  # each of the others against the first
    print(f"| measure | {' | '.join(layouts)} |{''.join(f' {o} ÷ {first} |' for o in others)}")
    print(f"|---|{'---|' * (len(layouts) + len(others))}")
    med = {layout: {name: statistics.median(v) for name, v in rows[layout].items()} for layout in layouts}
    for name in names:
        ratio = "".join(f" {med[o][name] / med[first][name]:.2f} |" if med[first][name] else " – |" for o in others)
        print(f"| {name} | {' | '.join(f'{med[layout][name]:.1f}' for layout in layouts)} |{ratio}")
    rates = " | ".join(f"{1e6 / med[layout]['wall µs']:,.0f}" for layout in layouts)
    print(f"| messages/s | {rates} |")
    for layout in layouts:
        busiest = sorted(commands[layout].items(), key=lambda kv: -statistics.median(kv[1]))[:8]
        print(f"\n{layout}: | server command (incl. those run by scripts) | µs per message | calls per message |")
        print("|---|---|---|")
        for name, values in busiest:
            print(f"| {name} | {statistics.median(values):.2f} | {statistics.median(calls[layout][name]):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
