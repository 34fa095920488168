"""Benchmark: the neardup filter on its memory index vs Redis (plain, TLS, Cluster), and datasketch on Redis.

    eval "$(bash docker/services.sh env)"       # or pass the URLs below
    python bench/redis_bench.py [--limit 20000] [--runs 3] [--batch 512] [--sets all,short]
                                [--backends memory,redis,redis-compact,redis-group,redis-serial,redis-unaided,
                                            redis-waiting,redis-compact-waiting,redis-group-waiting,redis-batch,
                                            redis-group-batch,rediss,cluster,datasketch]
                                [--db 9]
                                [--redis URL --tls URL --cluster URL]

Each set of messages is run through each backend in stream order, starting empty, `--runs` times,
interleaved (run 1 of every backend, then run 2, ...) so that drift of the shared machine hits all of
them alike; the table shows the median messages/s and the ratio to the memory index. neardup is timed
as `neardup filter FILE` works: `route_batches` over the raw JSONL records in batches of `--batch` (decode,
fingerprint, look up, verify, insert); `redis-serial` routes batch after batch as the Kafka worker does,
`redis-unaided` as `redis` without the next batch's read sent ahead and without the entries the client
keeps (every lookup reads when it is made, and every candidate's entry), `redis-waiting` as `redis` with every
insert round waiting for its answer (none sent ahead while the next part is looked up; `redis-compact-waiting`
and `redis-group-waiting` the same in the compact and group layouts), `redis-batch` and `redis-group-batch`
as `redis` and `redis-group` with a whole batch a lookup and insert round (`?round=` the batch: not in parts of
128, docs/design.md), `redis-compact` as `redis` in the
compact layout (`?layout=compact`: docs/design.md, "The compact slot layout"), `redis-group` in the group layout
(`?layout=group`: docs/design.md, "The group layout"). datasketch is used as
bench/filter_bench.py uses it (MinHashLSH, 128 permutations, threshold 0.5, character 5-grams of
normalized text; query, then insert if there is no match), on its Redis storage
(`storage_config={'type': 'redis', ...}`) on the same server.

Sets: `all` = the first `--limit` messages of the stream; `short` = the first `--limit` messages of
the short-message corpora (`--short-corpora`, as bench/kafka_e2e.py uses).

Redis memory per million indexed messages is measured in a separate, untimed pass on the plain Redis,
in database `--db` (default 9, which this benchmark FLUSHes before and after: do not point it at a
database that holds anything else): `used_memory` from INFO memory after minus before, divided by the
number of messages indexed (the unique ones; datasketch indexes every non-matching message too), and
the sum of MEMORY USAGE over the keys written (immune to what other clients of the same server do).
Each timed run uses its own key prefix (neardup) or basename (datasketch), deleted afterwards.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import orjson

try:
    import redis
except ModuleNotFoundError as exc:  # one line naming what to install, not a traceback
    print(f"redis_bench.py needs the Python package {exc.name}: pip install 'neardup[kafka]'", file=sys.stderr)
    raise SystemExit(2) from None

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import needs  # noqa: E402
from bench.filter_bench import _norm  # noqa: E402
from filters.config import FilterConfig  # noqa: E402
from filters.engine import NearDupFilter, Verdict  # noqa: E402
from filters.index.redis import RedisTarget  # noqa: E402
from stream.codec import RecordFormat  # noqa: E402
from stream.collector import tune_collector  # noqa: E402
from stream.evaluate import score  # noqa: E402
from stream.runner import FILE_BATCH, RawRecord, route_batch, route_batches  # noqa: E402

SHORT = "sms_en,tweets_en,reviews_zh"
FMT = RecordFormat()


@dataclass(frozen=True, slots=True)
class Corpus:
    name: str
    lines: list[bytes]
    truth: list[dict[str, object]]


@dataclass(frozen=True, slots=True)
class Run:
    verdicts: list[Verdict]
    seconds: float


def load(stream: Path, truth: Path, limit: int, corpora: set[str] | None, name: str) -> Corpus:
    lines, labels = [], []
    with open(stream, "rb") as s, open(truth, "rb") as t:
        for line, label in zip(s, t):
            row = orjson.loads(label)
            if corpora is None or row["corpus"] in corpora:
                lines.append(line.rstrip(b"\r\n"))
                labels.append(row)
                if len(lines) >= limit:
                    break
    return Corpus(name, lines, labels)


def with_db(url: str, db: int) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{db}"))


def server_cpu(r: redis.Redis) -> float:
    """The server's CPU seconds so far (`INFO cpu`: user and system)."""
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def with_option(url: str, name: str, value: object) -> str:
    return f"{url}{'&' if '?' in url else '?'}{name}={value}"


def with_layout(url: str, layout: str) -> str:
    return with_option(url, "layout", layout)


def with_prefix(url: str, prefix: str) -> str:
    return with_option(url, "prefix", prefix)


def client_for(url: str) -> redis.Redis | redis.RedisCluster:
    """A plain redis-py client for cleanup and INFO (our own query options removed)."""
    target = RedisTarget.parse(url)
    if target.cluster:
        return redis.RedisCluster.from_url(target.client_url)
    return redis.Redis.from_url(target.client_url)


def drop(url: str, pattern: str) -> int:
    client = client_for(url)
    n = 0
    try:
        if isinstance(client, redis.RedisCluster):
            keys = list(client.scan_iter(match=pattern, count=1000, target_nodes=redis.RedisCluster.ALL_NODES))
            for key in keys:  # keys of one namespace share a slot, but datasketch's do not
                n += client.unlink(key)
        else:
            keys = list(client.scan_iter(match=pattern, count=1000))
            for i in range(0, len(keys), 1000):
                n += client.unlink(*keys[i : i + 1000])
    finally:
        client.close()
    return n


# --- the runners ----------------------------------------------------------------------------------------


def run_neardup(index_url: str, corpus: Corpus, batch: int, serial: bool = False, unaided: bool = False,
                waiting: bool = False) -> Run:
    """`route_batches` over the raw records, in batches, as `neardup filter --index URL FILE` does (reading
    two batches ahead); `serial`: `route_batch` of one batch after the other, as the Kafka worker does;
    `unaided`: `route_batches` with no lookup read sent ahead and no entries kept by the client (every
    lookup reads its buckets when it is made, and every candidate's entry), for comparison; `waiting`: every
    insert round waits for its answer (`RedisIndex.write_ahead` off)."""
    nd = NearDupFilter(FilterConfig(window=1e9), index=f"{index_url}&entry_cache=0" if unaided else index_url)
    if unaided:
        nd.index.read_ahead = False  # type: ignore[attr-defined]
    if waiting:
        nd.index.write_ahead = False  # type: ignore[attr-defined]
    records = [RawRecord(line, str(i), 0.0) for i, line in enumerate(corpus.lines)]
    verdicts: list[Verdict] = []
    gc.collect()
    t0 = time.perf_counter()
    chunks = [records[i : i + batch] for i in range(0, len(records), batch)]
    for rows in (route_batch(nd, chunk, FMT) for chunk in chunks) if serial else route_batches(nd, chunks, FMT):
        for routed in rows:
            assert routed.verdict is not None, routed.error
            verdicts.append(routed.verdict)
    seconds = time.perf_counter() - t0
    nd.index.close()
    return Run(verdicts, seconds)


def run_datasketch(redis_url: str, corpus: Corpus, basename: bytes) -> Run:
    from datasketch import MinHash, MinHashLSH

    parts = urlsplit(redis_url)
    config = {"type": "redis", "basename": basename,
              "redis": {"host": parts.hostname, "port": parts.port or 6379, "db": int(parts.path.strip("/") or 0)}}
    lsh = MinHashLSH(threshold=0.5, num_perm=128, storage_config=config)
    messages = [orjson.loads(line) for line in corpus.lines]
    out = []
    gc.collect()
    t0 = time.perf_counter()
    for m in messages:
        t = _norm(m["text"])
        mh = MinHash(num_perm=128)
        mh.update_batch([t[i : i + 5].encode("utf8") for i in range(max(len(t) - 4, 1))])
        hits = lsh.query(mh)
        if hits:
            out.append(Verdict(m["id"], True, hits[0], 0.0, "minhash"))
        else:
            lsh.insert(m["id"], mh)
            out.append(Verdict(m["id"], False))
    seconds = time.perf_counter() - t0
    return Run(out, seconds)


@dataclass(frozen=True, slots=True)
class Backend:
    name: str
    url: str  # the server (with db), without prefix
    run: Callable[[Corpus, str], Run]  # (corpus, unique tag) -> timed run
    pattern: Callable[[str], str]  # unique tag -> key pattern to delete afterwards


def backends(args: argparse.Namespace) -> list[Backend]:
    plain = with_db(args.redis, args.db)
    out = []
    for name in args.backends.split(","):
        if name == "memory":
            out.append(Backend("neardup, memory://", "", lambda c, tag: run_neardup("memory://", c, args.batch),
                               lambda tag: ""))
        elif name in ("redis", "redis-compact", "redis-group", "redis-serial", "redis-unaided", "redis-waiting",
                      "redis-compact-waiting", "redis-group-waiting", "redis-batch", "redis-group-batch", "rediss",
                      "cluster"):
            url = {"redis": plain, "redis-compact": with_layout(plain, "compact"),
                   "redis-group": with_layout(plain, "group"), "redis-serial": plain,
                   "redis-unaided": plain, "redis-waiting": plain, "redis-compact-waiting": with_layout(plain, "compact"),
                   "redis-group-waiting": with_layout(plain, "group"),
                   "redis-batch": with_option(plain, "round", args.batch),
                   "redis-group-batch": with_option(with_layout(plain, "group"), "round", args.batch),
                   "rediss": with_db(args.tls, args.db) if args.tls else "", "cluster": args.cluster}[name]
            if not url:
                print(f"  (no URL for {name}: skipped)", file=sys.stderr)
                continue
            label = {"redis": "redis:// (plain)", "redis-compact": "redis://?layout=compact",
                     "redis-group": "redis://?layout=group",
                     "redis-serial": "redis:// (plain), batch after batch",
                     "redis-unaided": "redis:// (plain), no read sent ahead, no entries kept",
                     "redis-waiting": "redis:// (plain), every insert waited for",
                     "redis-compact-waiting": "redis://?layout=compact, every insert waited for",
                     "redis-group-waiting": "redis://?layout=group, every insert waited for",
                     "redis-batch": "redis:// (plain), a batch a round",
                     "redis-group-batch": "redis://?layout=group, a batch a round",
                     "rediss": "rediss:// (TLS)", "cluster": "Redis Cluster"}[name]
            out.append(Backend(f"neardup, {label}", url,
                               lambda c, tag, url=url, name=name: run_neardup(
                                   with_prefix(url, tag), c, args.batch, name == "redis-serial",
                                   unaided=name == "redis-unaided", waiting=name.endswith("-waiting")),
                               lambda tag: f"{{{tag}:*"))
        elif name == "datasketch":
            out.append(Backend("datasketch MinHashLSH, Redis", plain,
                               lambda c, tag: run_datasketch(plain, c, tag.encode()),
                               lambda tag: f"{tag}*"))
        else:
            raise SystemExit(f"unknown backend {name!r}")
    return out


def redis_memory(backend: Backend, corpus: Corpus) -> tuple[float, float, int]:
    """(used_memory delta, sum of MEMORY USAGE, messages indexed) for one untimed run in a flushed db."""
    client = client_for(backend.url)
    assert isinstance(client, redis.Redis)
    try:
        client.flushdb()
        gc.collect()
        time.sleep(0.2)
        before = int(client.info("memory")["used_memory"])
        run = backend.run(corpus, f"mem-{uuid.uuid4().hex[:8]}")
        after = int(client.info("memory")["used_memory"])
        pipe = client.pipeline(transaction=False)
        keys = list(client.scan_iter(count=1000))
        for key in keys:
            pipe.memory_usage(key, samples=0)
        usage = sum(x or 0 for x in pipe.execute())
        client.flushdb()
    finally:
        client.close()
    indexed = sum(not v.duplicate for v in run.verdicts)
    return after - before, usage, indexed


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stream", type=Path, default=ROOT.parent / "shared" / "eval" / "stream.jsonl")
    p.add_argument("--truth", type=Path, default=ROOT.parent / "shared" / "eval" / "truth.jsonl")
    p.add_argument("--limit", type=int, default=20_000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--batch", type=int, default=FILE_BATCH, help="records routed together (as neardup filter)")
    p.add_argument("--sets", default="all,short")
    p.add_argument("--short-corpora", default=SHORT)
    p.add_argument("--backends", default="memory,redis,rediss,cluster,datasketch")
    p.add_argument("--redis", default=os.environ.get("NEARDUP_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--tls", default=os.environ.get("NEARDUP_TEST_REDIS_TLS_URL", ""))
    p.add_argument("--cluster", default=os.environ.get("NEARDUP_TEST_REDIS_CLUSTER_URL", ""),
                   help="a cluster node, redis://host:port (used as redis+cluster://)")
    p.add_argument("--db", type=int, default=9, help="the database this benchmark owns (FLUSHed)")
    p.add_argument("--no-memory", action="store_true", help="skip the Redis memory pass")
    args = p.parse_args(argv)
    needs.files(__file__, args.stream, args.truth)
    needs.redis(__file__, args.redis)
    tune_collector()  # as `neardup filter` runs (stream/collector.py), for every backend alike
    if args.cluster:
        parts = urlsplit(args.cluster)
        args.cluster = urlunsplit(parts._replace(scheme=parts.scheme.removesuffix("+cluster") + "+cluster",
                                                 path=""))

    corpora = {"all": None, "short": set(args.short_corpora.split(","))}
    sets = [load(args.stream, args.truth, args.limit, corpora[s], s) for s in args.sets.split(",")]
    todo = backends(args)
    print(f"batch {args.batch}, {args.runs} runs each (median), Redis db {args.db}, "
          f"{os.cpu_count()} CPUs (Redis server and client share them)")
    for corpus in sets:
        chars = statistics.median(len(orjson.loads(x)["text"]) for x in corpus.lines)
        what = "stream" if corpus.name == "all" else args.short_corpora
        print(f"\n### {len(corpus.lines)} messages of {what} (median {chars:.0f} characters)\n")
        rates: dict[str, list[float]] = {b.name: [] for b in todo}
        verdicts: dict[str, list[Verdict]] = {}
        for r in range(args.runs):
            for b in todo:
                tag = f"bench-{uuid.uuid4().hex[:8]}"
                try:
                    run = b.run(corpus, tag)
                finally:
                    if b.url:
                        drop(b.url, b.pattern(tag))
                rates[b.name].append(len(corpus.lines) / run.seconds)
                verdicts[b.name] = run.verdicts
                print(f"  run {r + 1}: {b.name}: {rates[b.name][-1]:,.0f} msg/s", file=sys.stderr, flush=True)
        memory: dict[str, tuple[float, float, int]] = {}
        if not args.no_memory:
            for b in todo:
                if b.url and not b.url.startswith(("rediss", "redis+cluster")) and urlsplit(b.url).path == f"/{args.db}":
                    memory[b.name] = redis_memory(b, corpus)
        base = statistics.median(rates[todo[0].name]) if todo else 1.0
        reference = verdicts[todo[0].name] if todo else []
        print(f"| backend | messages/s (median) | min–max | ÷ {todo[0].name} | same verdicts as it | F1 "
              "| Redis MB per 1M indexed (used_memory) | (MEMORY USAGE) |")
        print("|---|---|---|---|---|---|---|---|")
        for b in todo:
            med = statistics.median(rates[b.name])
            same = sum(a.duplicate == c.duplicate and a.duplicate_of == c.duplicate_of
                       for a, c in zip(verdicts[b.name], reference))
            f1 = score(corpus.truth, verdicts[b.name]).overall.f1
            if b.name in memory:
                delta, usage, indexed = memory[b.name]
                mem = f"{delta / max(indexed, 1) * 1e6 / 2**20:,.0f} | {usage / max(indexed, 1) * 1e6 / 2**20:,.0f}"
            else:
                mem = "– | –"
            print(f"| {b.name} | {med:,.0f} | {min(rates[b.name]):,.0f}–{max(rates[b.name]):,.0f} | "
                  f"{med / base:.2f} | {same / max(len(reference), 1):.1%} ({same:,} of {len(reference):,}) | {f1:.3f} | {mem} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
