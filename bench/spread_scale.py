"""Benchmark: one namespace spread over 1, 3 and 6 masters (`?layout=spread`): each master's server CPU and memory
per message, and the total throughput of the index; and the other layouts with workers racing on one namespace.

    eval "$(bash docker/services.sh env)"
    python bench/spread_scale.py --cluster redis://127.0.0.1:7156 --cluster redis://127.0.0.1:7001 \
        --cluster redis://127.0.0.1:7011 [--workers 4] [--warm 8000] [--messages 16000] [--runs 3] [--slot]
    python bench/spread_scale.py --cluster redis://127.0.0.1:6379/0 --layouts slot,group [--workers 4]

Each --cluster is a node of a Redis Cluster (of any number of masters). Per run and cluster, alternating
between the clusters: a fresh namespace; one worker decides the first --warm messages of the development
stream (unmeasured: every shard's slice hashes then hold enough fields to be real hash tables, as in a
long-running namespace), then --workers processes, an index each, decide the next --messages in batches of
512 dealt round-robin, started together. Read around that: each master's `INFO cpu` (used_cpu_user +
used_cpu_sys) and `INFO commandstats`, and `used_memory`. Printed, medians over the runs: per master its CPU
µs per message of the whole stream measured, the mean and the spread (max / min) over masters, the total;
the memory the namespace added on all masters per message indexed (warm-up included: `used_memory` after
less before, and the sum of `MEMORY USAGE` of its keys); the workers' own CPU µs per message (process
time, all workers); messages/s.
`--slot` adds the slot layout (one namespace on one master) on the first cluster, for comparison; `--layouts`
names the layouts (`spread` on every --cluster, any other on the first only). A --cluster that is a standalone
Redis is its own one master: there every round of the slot, compact and group layouts is a watched transaction,
and one that another worker's round got ahead of goes through the layout's checking script (what racing workers
cost the server; `bench/redis_cpu.py --rounds checked` runs that script with nobody else writing).
`--fenced` runs each layout also fenced, alternating with the unfenced runs: as a worker with the index
changelog, every lookup reads the marker (on the spread layout, in every shard's meta hash) and checks it,
the marker set before the warm-up as the guard sets it (what the fence costs).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import orjson

try:
    import redis
except ModuleNotFoundError as exc:  # one line naming what to install, not a traceback
    print(f"spread_scale.py needs the Python package {exc.name}: pip install 'neardup[kafka]'", file=sys.stderr)
    raise SystemExit(2) from None

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import needs  # noqa: E402
from filters.config import FilterConfig  # noqa: E402
from filters.engine import Message, NearDupFilter  # noqa: E402
from filters.index.backends import marker_keys, open_index  # noqa: E402
from filters.index.redis import MARKER  # noqa: E402

BATCH = 512


def clustered(node: str) -> bool:
    """Is `node` a node of a Redis Cluster (else a standalone Redis)?"""
    with redis.Redis.from_url(node) as probe:
        return bool(probe.info("cluster").get("cluster_enabled"))


def masters(node: str) -> list[redis.Redis]:
    """A client on each master of the cluster `node` belongs to (a standalone Redis: itself)."""
    if not clustered(node):
        return [redis.Redis.from_url(node)]
    with redis.RedisCluster.from_url(node) as cluster:
        return [redis.Redis(host=n.host or "127.0.0.1", port=n.port) for n in cluster.get_primaries()]


def first_messages(stream: str | Path, n: int) -> list[tuple[str, str, float]]:
    """(id, text, event time) of the first `n` records of `stream` (tuples: they go to worker processes)."""
    rows = orjson.loads(b"[" + b",".join(Path(stream).read_bytes().splitlines()[:n]) + b"]")
    return [(str(r["id"]), r["text"], float(r["ts"])) for r in rows]


def engine_at(url: str, namespace: str, fenced: bool = False) -> NearDupFilter:
    """The default filter on the index at `url` (close `engine.index` after); `fenced`: as a worker with the
    changelog (the marker must be set: `set_marker`)."""
    config = FilterConfig()
    return NearDupFilter(config, index=open_index(url, window=config.window, bucket_cap=config.bucket_cap,
                                                  namespace=namespace, fenced=fenced))


def set_marker(node: str, url: str, namespace: str) -> None:
    """What the changelog's guard does once the index holds its window: the marker in every meta hash."""
    with (redis.RedisCluster.from_url(node) if clustered(node) else redis.Redis.from_url(node)) as client:
        for meta in marker_keys(url, namespace):
            client.hset(meta, MARKER, "bench")


def decide(engine: NearDupFilter, messages: list[Message], start: int, stop: int) -> None:
    """messages[start:stop] decided in batches of BATCH."""
    for at in range(start, stop, BATCH):
        engine.check_batch(messages[at : min(at + BATCH, stop)])


def _work(url: str, messages: list[tuple[str, str, float]], w: int, workers: int, warm: int, fenced: bool,
          ready: Any, go: Any, done: Any) -> None:
    engine = engine_at(url, "scale", fenced)
    index = engine.index
    batch = [Message(*m) for m in messages]
    if w == 0:
        decide(engine, batch, 0, warm)
    mine = [batch[at : at + BATCH] for at in range(warm, len(batch), BATCH)][w::workers]
    ready.wait()
    go.wait()
    cpu = time.process_time()
    uniques = sum(not v.duplicate for b in mine for v in engine.check_batch(b))
    done.put((uniques, time.process_time() - cpu))
    index.close()


def _alive(procs: list[Any]) -> None:
    """Stops the benchmark with one line when a worker died (its traceback is above): the others would wait for
    it forever."""
    dead = [p for p in procs if p.exitcode not in (None, 0)]
    if dead:
        for p in procs:
            p.kill()
        raise SystemExit(f"spread_scale.py: a worker process exited with {dead[0].exitcode} (see above)")


def _wait(barrier: Any, procs: list[Any]) -> None:
    """`barrier.wait()` once every worker waits there (a timeout would break the barrier for them), for as long
    as every worker lives."""
    while barrier.n_waiting < barrier.parties - 1:
        _alive(procs)
        time.sleep(0.05)
    barrier.wait()


def run(node: str, url: str, messages: list[tuple[str, str, float]], workers: int, warm: int,
        fenced: bool = False) -> dict[str, Any]:
    servers = masters(node)
    if fenced:
        set_marker(node, url, "scale")
    memory0 = [s.info("memory")["used_memory"] for s in servers]
    ctx = mp.get_context("fork")
    ready, go, done = ctx.Barrier(workers + 1), ctx.Barrier(workers + 1), ctx.Queue()
    procs = [ctx.Process(target=_work, args=(url, messages, w, workers, warm, fenced, ready, go, done)) for w in range(workers)]
    for p in procs:
        p.start()
    _wait(ready, procs)
    for s in servers:
        s.config_resetstat()
    cpu0 = [s.info("cpu") for s in servers]
    _wait(go, procs)
    t0 = time.perf_counter()
    reports = []
    while len(reports) < len(procs):
        try:
            reports.append(done.get(timeout=1.0))
        except queue.Empty:
            _alive(procs)
    wall = time.perf_counter() - t0
    uniques = sum(u for u, _ in reports)
    for p in procs:
        p.join()
    cpu1 = [s.info("cpu") for s in servers]
    n = len(messages) - warm
    per_master = [((b["used_cpu_user"] + b["used_cpu_sys"]) - (a["used_cpu_user"] + a["used_cpu_sys"])) / n * 1e6
                  for a, b in zip(cpu0, cpu1)]
    commands: dict[str, float] = {}
    for s in servers:
        for name, stat in s.info("commandstats").items():
            commands[name.removeprefix("cmdstat_")] = commands.get(name.removeprefix("cmdstat_"), 0.0) + stat["usec"] / n
    memory = sum(s.info("memory")["used_memory"] for s in servers) - sum(memory0)
    indexed = _committed(servers, url)
    prefix = url.split("prefix=")[1].split("&")[0]
    usage = sum(s.memory_usage(key, samples=0) or 0 for s in servers
                for key in s.scan_iter(match=f"{{{prefix}:*", count=1000))
    for s in servers:
        s.close()
    return {"masters": len(servers), "per_master": per_master, "commands": commands, "rate": n / wall,
            "memory": memory / max(indexed, 1), "usage": usage / max(indexed, 1), "indexed": indexed,
            "uniques": uniques, "client": sum(c for _, c in reports) / n * 1e6}


def _committed(servers: list[redis.Redis], url: str) -> int:
    """Entries the namespace holds (committed), on all masters: its slices' `n` counters."""
    prefix = url.split("prefix=")[1].split("&")[0]
    return sum(int(s.hget(key, "n") or 0) for s in servers for key in s.scan_iter(match=f"{{{prefix}:*", count=1000)
               if any(part in key for part in (b":s:", b":c:", b":g:")))  # slice hashes: slot, compact, group


def drop(node: str, prefix: str) -> None:
    for s in masters(node):
        pipe = s.pipeline(transaction=False)
        for key in s.scan_iter(match=f"{{{prefix}:*", count=1000):
            pipe.unlink(key)  # one key a command: a namespace's keys are in many slots
        pipe.execute()
        # The keys unlinked are freed in the background: the next run's `used_memory` before is taken once they are.
        for _ in range(100):
            if not s.info("memory").get("lazyfree_pending_objects"):
                break
            time.sleep(0.05)
        s.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster", action="append", help="a node of a Redis Cluster (repeat; default: "
                   "$NEARDUP_TEST_REDIS_CLUSTER_URL, else redis://127.0.0.1:7001)")
    p.add_argument("--stream", default=str(ROOT.parent / "shared" / "eval" / "stream.jsonl"))
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--warm", type=int, default=8000)
    p.add_argument("--messages", type=int, default=16000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--shards", type=int, default=None, help="the spread layout's shards (default: its own)")
    p.add_argument("--slot", action="store_true", help="also the slot layout, on the first cluster")
    p.add_argument("--layouts", default="spread", help="comma-separated: spread (on every --cluster), slot, "
                   "compact, group (on the first; default: spread)")
    p.add_argument("--fenced", action="store_true", help="each layout also fenced (as with the index changelog), "
                   "alternating")
    args = p.parse_args()
    layouts = [name for name in args.layouts.split(",") if name]
    if args.slot and "slot" not in layouts:
        layouts.append("slot")
    if not layouts or not set(layouts) <= {"spread", "slot", "compact", "group"}:
        p.error(f"--layouts: spread, slot, compact or group, comma-separated (got {args.layouts!r})")
    needs.files(__file__, args.stream)
    args.cluster = args.cluster or [os.environ.get("NEARDUP_TEST_REDIS_CLUSTER_URL", "redis://127.0.0.1:7001")]
    for node in args.cluster:
        needs.redis(__file__, node)
    messages = first_messages(args.stream, args.warm + args.messages)
    setups = [(node, "spread") for node in args.cluster if "spread" in layouts] + [
        (args.cluster[0], layout) for layout in layouts if layout != "spread"]
    fences = [False, True] if args.fenced else [False]
    kinds = {node: clustered(node) for node in args.cluster}
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for _ in range(args.runs):
        for (node, layout), fenced in ((setup, fenced) for setup in setups for fenced in fences):
            prefix = f"scale-{uuid.uuid4().hex[:8]}"
            base = node.replace("redis://", "redis+cluster://").split("/0")[0] if kinds[node] else node.split("?")[0]
            shards = f"&shards={args.shards}" if args.shards and layout == "spread" else ""
            url = f"{base}?prefix={prefix}&layout={layout}{shards}"
            try:
                name = f"{layout} (fenced)" if fenced else layout
                results.setdefault((node, name), []).append(run(node, url, messages, args.workers, args.warm, fenced))
            finally:
                drop(node, prefix)
    print(f"{args.messages:,} messages of the development stream after {args.warm:,} of warm-up, {args.workers} "
          f"worker processes, batches of {BATCH}, {args.runs} runs (medians); {os.cpu_count()} cores shared by "
          f"the workers and every Redis node\n")
    print("| layout | masters | server CPU µs per message, each master | mean per master | max / min | total "
          "| bytes per message indexed (used_memory / MEMORY USAGE) | client CPU µs per message | messages/s "
          "|\n|---|---|---|---|---|---|---|---|---|")
    for (_, layout), runs in results.items():
        per = [statistics.median(r["per_master"][m] for r in runs) for m in range(len(runs[0]["per_master"]))]
        mean = statistics.mean(per)
        print(f"| {layout} | {runs[0]['masters']} | {', '.join(f'{x:.1f}' for x in per)} | {mean:.1f} "
              f"| {max(per) / max(min(per), 1e-9):.2f} | {sum(per):.1f} | {statistics.median(r['memory'] for r in runs):,.0f} / "
              f"{statistics.median(r['usage'] for r in runs):,.0f} "
              f"| {statistics.median(r['client'] for r in runs):.1f} | {statistics.median(r['rate'] for r in runs):,.0f} |")
    print("\nEach run (alternating): server CPU µs per message, total over masters; messages/s")
    for (_, layout), runs in results.items():
        print(f"- {layout}, {runs[0]['masters']} master(s): " + "; ".join(
            f"{sum(r['per_master']):.1f} µs, {r['rate']:,.0f}/s" for r in runs))
    print("\n| layout | masters | busiest server commands (all masters, incl. those run by scripts), µs per message |"
          "\n|---|---|---|")
    for (_, layout), runs in results.items():
        names = sorted(runs[0]["commands"], key=lambda c: -statistics.median(r["commands"].get(c, 0) for r in runs))[:5]
        print(f"| {layout} | {runs[0]['masters']} | " + ", ".join(
            f"{c} {statistics.median(r['commands'].get(c, 0) for r in runs):.1f}" for c in names) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
