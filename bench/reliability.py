"""Fault-injection scenarios for the Kafka worker: serve processes, clusters of near-duplicates, outages, readers.

Shared by tests/test_reliability.py (which asserts on the results) and bench/faults.py (which prints
them as the README table). Each scenario runs real `neardup serve` processes against the real broker
and Redis, with topics, consumer group and Redis namespace of its own.

Run as `python -m bench.reliability serve [flags]`, it is `neardup serve` with an optional test
hook on the Redis index, chosen by $RELIABILITY_INDEX_HOOK (comma-separated):
`pause=SECONDS` sleeps after every lookup (widens the window in which two workers race, or slows a
worker down so that a fault lands mid-stream); `racy` turns the atomic check-and-insert (the spread
layout's claims) into a plain check-then-insert (the design the concurrency test must catch); `barrier=N` (after
`racy`) holds each insert round until N workers have reached it, so that their lookups all come first;
`hold_commit=SECONDS` keeps each exactly-once transaction open that long after its outputs were sent
(so that a kill lands in an open transaction); `request_timeout=SECONDS` makes the
worker's producer give up on a delivery after SECONDS instead of aiokafka's 40 (so that a broker
restart of a few seconds fails deliveries, which the worker must send again).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson
import redis
from aiokafka import AIOKafkaConsumer
from prometheus_client.parser import text_string_to_metric_families

from bench.kafka_support import TcpProxy, free_port, redis_namespace, settings_for
from filters.config import FilterConfig
from filters.engine import NearDupFilter
from filters.index.redis_codec import parse_records
from filters.index.shared import AnsweredRounds
from stream.config import Settings, setting_fields
from stream.kafka_tools import KafkaRecord, client_options, ensure_topics, producer
from stream.runner import RawRecord, route_batch

REPO = Path(__file__).resolve().parents[1]
HOOK_ENV = "RELIABILITY_INDEX_HOOK"
EVAL_STREAM = REPO.parent / "shared" / "eval" / "stream.jsonl"
SAMPLE = REPO / "tests" / "data" / "sample.jsonl"

H_SOURCE, H_VERDICT, H_ID, H_DUP_OF, H_REASON = (
    "neardup-source", "neardup-verdict", "neardup-id", "neardup-duplicate-of", "neardup-reason")


# -- the serve process -------------------------------------------------------------------------


def serve_env(settings: Settings, hook: str = "") -> dict[str, str]:
    """Every setting as a NEARDUP_* variable (secrets included: the environment is how they should be
    passed), the rest of the environment without other NEARDUP_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEARDUP_") or k.startswith("NEARDUP_TEST_")}
    env.update(settings.env())  # durations with their unit: a bare number is refused
    env["PYTHONPATH"] = str(REPO)
    env[HOOK_ENV] = hook
    return env


class Serve:
    """One `neardup serve` subprocess; its stderr (the log) goes to a file."""

    def __init__(self, settings: Settings, log_dir: Path, name: str, *, hook: str = "",
                 args: Sequence[str] = ()) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}-{uuid.uuid4().hex[:6]}.log"
        self._log = open(self.log_path, "wb")  # closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.reliability", "serve", *args],
                                     cwd=REPO, env=serve_env(settings, hook), stdout=subprocess.DEVNULL,
                                     stderr=self._log)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def assigned(self) -> set[int]:
        """The partitions of this worker's latest assignment, from its log."""
        lines = re.findall(r"neardup\.worker: assigned (.+)", self.log())
        if not lines:
            return set()
        return {int(tp.rsplit("/", 1)[1]) for tp in lines[-1].split(", ")}

    def alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.name} exited {self.proc.returncode}: {self.log()[-3000:]}")

    def rss_kb(self) -> int:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+)", status).group(1))  # type: ignore[union-attr]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                self._log.close()
                raise AssertionError(f"{self.name} did not stop on signal {sig}: {self.log()[-3000:]}") from None
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        self.stop(signal.SIGKILL)


@contextmanager
def serving(*workers: Serve) -> Iterator[list[Serve]]:
    """Makes sure every worker started here is gone afterwards, whatever the test did."""
    started = list(workers)
    try:
        yield started
    finally:
        for w in started:
            if w.proc.poll() is None:
                w.kill()


def wait_until(condition: Callable[[], bool], timeout: float, what: str, *,
               check: Callable[[], None] = lambda: None, interval: float = 0.1) -> float:
    """Polls `condition`; returns the seconds it took. `check` runs each round (e.g. workers alive)."""
    start = time.monotonic()
    while not condition():
        check()
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not within {timeout}s")
        time.sleep(interval)
    return time.monotonic() - start


def wait_assigned(workers: Sequence[Serve], partitions: int, timeout: float = 60.0) -> None:
    """Until the workers' latest assignments split all partitions between them, each having some."""
    def stable() -> bool:
        sets = [w.assigned() for w in workers]
        union = set().union(*sets)
        return all(sets) and union == set(range(partitions)) and sum(map(len, sets)) == partitions

    def check() -> None:
        for w in workers:
            w.alive()

    wait_until(stable, timeout, f"{len(workers)} workers sharing {partitions} partitions", check=check)


def _install_hook(spec: str) -> None:
    from filters.index.redis import RedisIndex
    from filters.index.redis_spread import SpreadIndex

    for part in filter(None, spec.split(",")):
        if part.startswith("pause="):
            pause = float(part.split("=", 1)[1])
            for cls in (RedisIndex, SpreadIndex):
                lookup = cls.lookup

                def paused_lookup(self: Any, queries: Any, limit: int, _lookup: Any = lookup,
                                  _pause: float = pause) -> Any:
                    found = _lookup(self, queries, limit)
                    time.sleep(_pause)
                    return found

                cls.lookup = paused_lookup  # type: ignore[method-assign]
        elif part.startswith("barrier="):
            # With `racy`: each insert round waits (up to 2 s) until every one of N workers has made its round
            # of the same number, so that their lookups all come before their inserts, however the machine
            # schedules them (the check-then-insert test then lets through near-duplicates deterministically).
            parties = int(part.split("=", 1)[1])
            barrier_insert = RedisIndex.insert
            rounds = itertools.count(1)

            def barrier(self: RedisIndex, entries: Any, memos: Any = (), _insert: Any = barrier_insert,
                        _n: int = parties, _rounds: Any = rounds) -> Any:
                if not entries:
                    return _insert(self, entries, memos)  # memos alone: no insert round to line up
                key = f"{self.prefix}:{self.namespace}:barrier:{next(_rounds)}"
                client = self._client
                client.incr(key)
                client.expire(key, 60)
                deadline = time.monotonic() + 2.0
                while int(client.get(key) or 0) < _n and time.monotonic() < deadline:
                    time.sleep(0.005)
                return _insert(self, entries, memos)

            RedisIndex.insert = barrier  # type: ignore[method-assign]
            RedisIndex.insert_ahead = AnsweredRounds.insert_ahead  # type: ignore[method-assign]  # all through `insert`
        elif part == "racy":
            insert = RedisIndex.insert

            def racy_insert(self: RedisIndex, entries: Any, memos: Any = (), _insert: Any = insert) -> Any:
                # Forget what the lookup saw: the script then inserts without checking what others
                # inserted since the lookup (check-then-insert).
                self._view.looked.clear()
                return _insert(self, entries, memos)

            spread_insert = SpreadIndex.insert

            def racy_claims(self: SpreadIndex, entries: Any, memos: Any = (), _insert: Any = spread_insert) -> Any:
                # Write the entries committed at once, unchecked, without claiming (check-then-insert).
                self.restore(entries)
                _insert(self, [], memos)
                return [None] * len(entries)

            RedisIndex.insert = racy_insert  # type: ignore[method-assign]
            RedisIndex.insert_ahead = AnsweredRounds.insert_ahead  # type: ignore[method-assign]  # all through `insert`
            SpreadIndex.insert = racy_claims  # type: ignore[method-assign]
        elif part.startswith("request_timeout="):
            import stream.worker

            timeout_ms = round(float(part.split("=", 1)[1]) * 1000)
            make_producer = stream.worker.producer

            def short_producer(settings: Settings, _make: Any = make_producer, _timeout_ms: int = timeout_ms,
                               **overrides: Any) -> Any:
                return _make(settings, **{"request_timeout_ms": _timeout_ms, **overrides})

            stream.worker.producer = short_producer  # type: ignore[assignment]
            import stream.kafka_tools

            stream.kafka_tools.REQUEST_TIMEOUT = timeout_ms / 1000  # what the faust runtime's producer is given
        elif part.startswith("hold_commit="):
            import stream.delivery

            hold = float(part.split("=", 1)[1])
            commit = stream.delivery.ExactlyOnce.commit

            async def held_commit(self: Any, _commit: Any = commit, _hold: float = hold) -> None:
                if self._in_flight is not None:
                    await asyncio.sleep(_hold)  # the transaction stays open, its outputs sent
                await _commit(self)

            stream.delivery.ExactlyOnce.commit = held_commit  # type: ignore[method-assign]
        else:
            raise SystemExit(f"unknown {HOOK_ENV} part {part!r}")


# -- inputs ------------------------------------------------------------------------------------

_VOCABULARY = ["".join(random.Random(i).choices("abcdefghijklmnopqrstuvwxyz", k=6)) for i in range(400)]


def cluster_text(cluster: int, copy: int) -> str:
    """Copy `copy` of cluster `cluster`: the cluster's 30 random words with one word and the phone
    number changed. Copies of one cluster are near-duplicates; different clusters are not."""
    words = random.Random(cluster).choices(_VOCABULARY, k=30)
    if copy:
        words[(cluster + copy) % 30] = _VOCABULARY[(cluster * 7 + copy) % len(_VOCABULARY)]
    return " ".join(words) + f" call now 555-{copy:02d}{cluster:04d}"


def cluster_value(cluster: int, copy: int) -> bytes:
    return orjson.dumps({"id": f"c{cluster}-{copy}", "text": cluster_text(cluster, copy)})


def cluster_of(message_id: str) -> int:
    return int(message_id[1:].split("-", 1)[0])


def stream_lines(limit: int) -> list[bytes]:
    """The first `limit` records of the eval stream (the sample when it is absent), plus two bad ones."""
    path = EVAL_STREAM if EVAL_STREAM.is_file() else SAMPLE
    lines = [line.rstrip(b"\r\n") for line in path.read_bytes().splitlines() if line.strip()][:limit]
    lines.insert(len(lines) // 3, b"\xff\xfe not UTF-8")
    lines.insert(2 * len(lines) // 3, b'{"id": "no-text-here"}')
    return lines


# -- Kafka -------------------------------------------------------------------------------------


def scenario_settings(bootstrap: str, index: str, **overrides: Any) -> Settings:
    values: dict[str, Any] = {"id_field": "id", "session_timeout": 6.0, "log_level": "info"}
    if "metrics_port" in {f.name for f in setting_fields()}:
        values["metrics_port"] = 0  # several workers on one host: no HTTP server each
    values.update(overrides)
    return settings_for(bootstrap, index, **values)


# The scenarios' records carry event times of the development stream (2023) as their Kafka timestamps: a topic's
# time retention (7 days by default) would delete a backlog the moment the broker next checks, mid-run.
KEEP = {"retention.ms": "-1"}


async def create_topics(settings: Settings, partitions: int) -> None:
    await ensure_topics(settings, [*settings.input_topics, *settings.output_topics], partitions=partitions,
                        configs=KEEP)


async def produce_to(settings: Settings, records: Sequence[tuple[int | None, bytes | None, bytes | None]],
                     topic: str | None = None, **options: Any) -> None:
    """(partition, key, value) records, in order, all acknowledged."""
    topic = topic or settings.input_topics[0]
    async with producer(settings, **options) as p:
        futures = [await p.send(topic, key=k, value=v, partition=part) for part, k, v in records]
        await asyncio.gather(*futures)


async def read_outputs(settings: Settings, *, committed: bool = False, sources: int | None = None,
                       timeout: float = 60.0, settle: float = 1.0,
                       during: Callable[[list[KafkaRecord]], None] | None = None) -> list[KafkaRecord]:
    """All output records (read_committed when `committed`): until `sources` distinct inputs were
    seen and then `settle` seconds pass without a record (so late copies are counted too), or until
    `timeout`. `during` is called with what was read so far after every poll."""
    consumer = AIOKafkaConsumer(*settings.output_topics, group_id=None, enable_auto_commit=False,
                                auto_offset_reset="earliest",
                                isolation_level="read_committed" if committed else "read_uncommitted",
                                max_partition_fetch_bytes=32 * 1024 * 1024, fetch_max_bytes=64 * 1024 * 1024,
                                **client_options(settings))
    await consumer.start()
    got: list[KafkaRecord] = []
    seen: set[bytes | None] = set()
    deadline = time.monotonic() + timeout
    last = time.monotonic()
    try:
        while time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=200, max_records=5000)
            for messages in batches.values():
                for m in messages:
                    record = KafkaRecord.of(m)
                    got.append(record)
                    seen.add(record.header(H_SOURCE))
                    last = time.monotonic()
            if during is not None:
                during(got)
            if sources is not None and len(seen) >= sources and time.monotonic() - last >= settle:
                break
            if sources is None and time.monotonic() - last >= settle:
                break
    finally:
        await consumer.stop()
    return got


def read(settings: Settings, **kwargs: Any) -> list[KafkaRecord]:
    return asyncio.run(read_outputs(settings, **kwargs))


def restart_kafka() -> float:
    """`docker/services.sh restart kafka`: the broker stops and starts on its data; returns seconds."""
    return _services("restart", "kafka")


def freeze_kafka(seconds: float) -> float:
    """`docker/services.sh freeze kafka SECONDS`: a hung broker (stopped, its connections open); returns seconds."""
    return _services("freeze", "kafka", str(seconds))


def _services(*args: str) -> float:
    start = time.monotonic()
    done = subprocess.run(["bash", str(REPO / "docker" / "services.sh"), *args], capture_output=True, text=True,
                          timeout=180)
    if done.returncode != 0:
        raise AssertionError(f"services.sh {' '.join(args)} failed: {done.stderr[-2000:]}")
    return time.monotonic() - start


# -- verdicts ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Out:
    """One output record as the tests see it."""

    source: str
    kind: str  # unique | duplicate | rejected (from the topic; checked against the verdict header)
    id: str
    duplicate_of: str | None
    reason: str | None


def outs(records: Sequence[KafkaRecord], settings: Settings) -> list[Out]:
    kinds = {settings.unique_topic: "unique", settings.duplicate_topic: "duplicate",
             settings.dead_letter_topic: "rejected"}
    result = []
    for r in records:
        kind = kinds[r.topic]
        assert (r.header(H_VERDICT) or b"").decode() == kind, r
        dup = r.header(H_DUP_OF)
        reason = r.header(H_REASON)
        result.append(Out((r.header(H_SOURCE) or b"").decode(), kind, (r.header(H_ID) or b"").decode(),
                          dup.decode() if dup is not None else None, reason.decode() if reason is not None else None))
    return result


@dataclass
class Tally:
    """What came out, against what went in: the figures of the README table."""

    scenario: str
    messages: int
    faults: str
    lost: int = 0  # inputs with no output at all
    repeated: int = 0  # output copies beyond one per input
    let_through: int = 0  # near-duplicate clusters with more than one unique (a race lost)
    wrong_verdicts: int = 0  # inputs whose verdict differs from a single worker's
    recovery_s: float | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    def row(self) -> str:
        rec = "" if self.recovery_s is None else f"{self.recovery_s:.1f}"
        return (f"| {self.scenario} | {self.messages} | {self.faults} | {self.lost} | {self.repeated} | "
                f"{self.let_through} | {self.wrong_verdicts} | {rec} |")


TABLE_HEAD = ("| scenario | messages | faults injected | lost | repeated outputs | near-duplicates let through "
              "| verdicts ≠ single run | recovery s |\n|---|---|---|---|---|---|---|---|")


MEMORY_HEAD = "| memory scenario | messages | measured |\n|---|---|---|"


@dataclass(frozen=True, slots=True)
class Figure:
    """A row of the memory table."""

    scenario: str
    messages: int
    measured: str

    def row(self) -> str:
        return f"| {self.scenario} | {self.messages:,} | {self.measured} |"


def print_tables(tallies: Sequence[Tally], figures: Sequence[Figure]) -> None:
    """The README's two tables: faults, then memory (each only when it has rows)."""
    if tallies:
        print("\n" + TABLE_HEAD)
        for tally in tallies:
            print(tally.row())
    if figures:
        print("\n" + MEMORY_HEAD)
        for figure in figures:
            print(figure.row())


def tally_sources(tally: Tally, got: Sequence[Out], sources: set[str]) -> Counter[str]:
    copies = Counter(o.source for o in got)
    tally.lost = len(sources - set(copies))
    tally.repeated = sum(n - 1 for n in copies.values())
    assert set(copies) <= sources, sorted(set(copies) - sources)[:5]
    return copies


def tally_clusters(tally: Tally, got: Sequence[Out]) -> dict[int, int]:
    """Uniques per cluster (distinct message ids), and whether every copy of an input says the same."""
    kinds: dict[str, set[str]] = {}
    for o in got:
        kinds.setdefault(o.id, set()).add(o.kind)
        if o.kind == "duplicate":
            assert o.duplicate_of is not None and cluster_of(o.duplicate_of) == cluster_of(o.id), o
    uniques: Counter[int] = Counter()
    for message_id, ks in kinds.items():
        if len(ks) > 1:
            tally.wrong_verdicts += 1  # a replayed copy disagrees with the first
        if "unique" in ks:
            uniques[cluster_of(message_id)] += 1
    clusters = {cluster_of(i) for i in kinds}
    per_cluster = {c: uniques[c] for c in clusters}
    tally.let_through = sum(n > 1 for n in per_cluster.values())
    return per_cluster


def reference_clusters(values: Sequence[bytes], settings: Settings) -> dict[int, int]:
    """Uniques per cluster when one worker (memory index) reads `values` in this order."""
    nd = NearDupFilter(settings.filter_config(), index="memory://")
    routed = route_batch(nd, [RawRecord(v, f"ref/{i}", 0.0) for i, v in enumerate(values)],
                         settings.record_format())
    uniques: Counter[int] = Counter()
    for r in routed:
        assert r.verdict is not None
        uniques[cluster_of(r.verdict.id)] += not r.verdict.duplicate
    return dict(uniques)


def reference_stream(lines: Sequence[bytes], settings: Settings) -> dict[str, tuple[str, str | None]]:
    """(kind, duplicate_of or reason) per source of a single-partition topic read by one worker."""
    nd = NearDupFilter(settings.filter_config(), index="memory://")
    topic = settings.input_topics[0]
    routed = route_batch(nd, [RawRecord(v, f"{topic}/0/{i}", 0.0) for i, v in enumerate(lines)],
                         settings.record_format())
    out = {}
    for r in routed:
        if r.kind == "rejected":
            assert r.error is not None
            out[r.raw.fallback_id] = ("rejected", r.error.reason)
        else:
            assert r.verdict is not None
            out[r.raw.fallback_id] = (r.kind, r.verdict.duplicate_of)
    return out


def tally_stream(tally: Tally, got: Sequence[Out], reference: dict[str, tuple[str, str | None]]) -> None:
    tally_sources(tally, got, set(reference))
    wrong = {o.source for o in got if (o.kind, o.duplicate_of if o.kind != "rejected" else o.reason)
             != reference[o.source]}
    tally.wrong_verdicts = len(wrong)


# -- Redis -------------------------------------------------------------------------------------


def cluster_index_url(cluster_node_url: str, *, layout: str = "slot") -> str:
    parts = urlsplit(cluster_node_url)
    return f"{parts.scheme}+cluster://{parts.netloc}?prefix=ndtest-{uuid.uuid4().hex[:10]}&layout={layout}"


def drop_cluster_index(url: str) -> None:
    base, _, query = url.partition("?")
    prefix = dict(item.split("=", 1) for item in query.split("&"))["prefix"]
    with redis.RedisCluster.from_url(base.replace("+cluster", "")) as client:
        for node in client.get_primaries():
            keys = list(client.scan_iter(match=f"{{{prefix}:*", target_nodes=node))
            for at in range(0, len(keys), 500):
                client.delete(*keys[at : at + 500])


def namespace_keys(redis_url: str, prefix: str) -> list[bytes]:
    with redis.Redis.from_url(redis_url) as client:
        return list(client.scan_iter(match=f"{{{prefix}:*", count=5000))


# -- scenarios ---------------------------------------------------------------------------------


def concurrency(bootstrap: str, index: str, log_dir: Path, *, workers: int = 3, clusters: int = 150,
                singletons: int = 60, hook: str = "", name: str = "concurrency",
                fault: Callable[[], str] | None = None, **overrides: Any) -> tuple[Tally, dict[int, int]]:
    """`workers` serve processes, one group, one partition each; cluster c's copy w goes to partition
    w, all produced in one burst once every worker has its partition. Returns the tally and the
    uniques per cluster. `fault`: run (in a thread) once a fifth of the inputs are out, mid-run; what it
    returns is noted as the faults injected. `overrides`: settings."""
    settings = scenario_settings(bootstrap, index, partitions=workers, **overrides)
    records: list[tuple[int | None, bytes | None, bytes | None]] = []
    for c in range(clusters):
        records += [(w, f"c{c}".encode(), cluster_value(c, w)) for w in range(workers)]
    for s in range(singletons):  # a cluster of one: must stay unique
        records.append((s % workers, None, cluster_value(clusters + s, 0)))
    tally = Tally(f"{name}: {workers} workers, {workers} partitions", len(records),
                  f"{clusters} near-duplicate clusters, a copy in each partition at once"
                  + (f" ({hook})" if hook else ""))
    asyncio.run(create_topics(settings, workers))
    faulted: list[str] = []
    errors: list[BaseException] = []
    injecting: list[threading.Thread] = []

    def inject() -> None:
        try:
            faulted.append(fault())  # type: ignore[misc]
        except BaseException as exc:
            errors.append(exc)

    def during(got: list[KafkaRecord]) -> None:
        if fault is not None and not injecting and len({r.header(H_SOURCE) for r in got}) >= len(records) // 5:
            injecting.append(threading.Thread(target=inject))
            injecting[0].start()

    with serving(*[Serve(settings, log_dir, f"w{i}", hook=hook) for i in range(workers)]) as procs:
        wait_assigned(procs, workers)
        asyncio.run(produce_to(settings, records))
        got = outs(read(settings, sources=len(records), timeout=120, settle=1.0, during=during), settings)
        for thread in injecting:
            thread.join()
        if errors:
            raise errors[0]
        if faulted:
            tally.faults = f"{tally.faults}; {faulted[0]}"
        for p in procs:
            p.alive()
        for p in procs:
            assert p.stop() == 0, p.log()[-2000:]
    topic = settings.input_topics[0]
    sources = set()
    offsets: Counter[int] = Counter()
    for part, _, _ in records:
        assert part is not None
        sources.add(f"{topic}/{part}/{offsets[part]}")
        offsets[part] += 1
    tally_sources(tally, got, sources)
    per_cluster = tally_clusters(tally, got)
    reference = reference_clusters([v for _, _, v in records if v is not None], settings)
    tally.wrong_verdicts += sum(per_cluster.get(c, 0) != n for c, n in reference.items())
    tally.notes["reference_let_through"] = sum(n != 1 for n in reference.values())
    return tally, per_cluster


CRASH_BATCH = 50


def crash(bootstrap: str, index: str, log_dir: Path, *, exactly_once: bool, messages: int = 1000) -> Tally:
    """kill -9 one worker mid-run (static membership, batches of 50, each held 0.2 s after its lookup, so
    that the previous batch's outputs are out and uncommitted when the kill lands), restart it; read
    the outputs as a read_committed consumer."""
    guarantee = "exactly_once" if exactly_once else "at_least_once"
    settings = scenario_settings(bootstrap, index, max_batch=CRASH_BATCH, ts_field="ts",
                                 group_instance_id="worker-1", processing_guarantee=guarantee)
    lines = stream_lines(messages)
    tally = Tally(f"kill -9 mid-run, restart ({guarantee})", len(lines), "1 SIGKILL")
    asyncio.run(create_topics(settings, 1))
    asyncio.run(produce_to(settings, [(0, None, v) for v in lines]))
    with serving(Serve(settings, log_dir, "first", hook="pause=0.2")) as (first,):
        # Kill once a good part is out (committed), so that the kill lands mid-run.
        read(settings, committed=True, sources=len(lines) // 4, timeout=60, settle=0.0)
        time.sleep(0.1)  # mid-batch: the previous batch's outputs sent, not committed
        first.alive()
        first.kill()
    before = outs(read(settings, committed=True, timeout=5, settle=0.5), settings)
    assert 0 < len({o.source for o in before}) < len(lines), "the worker was not killed mid-run"
    with serving(Serve(settings, log_dir, "restarted")) as (again,):
        records = read(settings, committed=True, sources=len(lines), timeout=60, settle=1.5)
        again.alive()
        assert again.stop() == 0, again.log()[-2000:]
    tally_stream(tally, outs(records, settings), reference_stream(lines, settings))
    tally.recovery_s = longest_gap(records)
    everything = outs(read(settings, committed=False, timeout=10, settle=0.5), settings)
    tally.notes["repeated_in_log_read_uncommitted"] = len(everything) - len({o.source for o in everything})
    tally.notes["before_kill"] = len(before)
    return tally


def rebalance(bootstrap: str, index: str, log_dir: Path, *, exactly_once: bool, clusters: int = 240) -> Tally:
    """Three partitions, a copy of each near-duplicate cluster in each; worker A starts alone (slowed
    down, so that batches are in flight all the time), worker B joins once a quarter is out, A leaves
    (SIGTERM) once half is out, B finishes."""
    guarantee = "exactly_once" if exactly_once else "at_least_once"
    settings = scenario_settings(bootstrap, index, partitions=3, max_batch=20, processing_guarantee=guarantee)
    committed = exactly_once
    records = [(copy, None, cluster_value(c, copy)) for c in range(clusters) for copy in range(3)]
    tally = Tally(f"worker added, then one removed ({guarantee})", len(records), "2 rebalances")
    asyncio.run(create_topics(settings, 3))
    asyncio.run(produce_to(settings, records))
    topic = settings.input_topics[0]
    sources = {f"{topic}/{copy}/{c}" for c in range(clusters) for copy in range(3)}
    hook = "pause=0.1"
    with serving(Serve(settings, log_dir, "a", hook=hook)) as procs:
        read(settings, committed=committed, sources=len(records) // 4, timeout=60, settle=0.0)
        procs.append(Serve(settings, log_dir, "b", hook=hook))
        wait_assigned(procs, 3)
        read(settings, committed=committed, sources=len(records) // 2, timeout=60, settle=0.0)
        assert procs[0].stop() == 0, procs[0].log()[-2000:]
        got = outs(read(settings, committed=committed, sources=len(records), timeout=90, settle=1.5), settings)
        procs[1].alive()
        assert procs[1].stop() == 0, procs[1].log()[-2000:]
        tally.notes["aborted_batches"] = sum(p.log().count("its transaction is aborted") for p in procs)
        tally.notes["commit_failed"] = sum(p.log().count("commit failed") for p in procs)
        # For a failure's message: what the workers warned of, and their rebalances.
        tally.notes["worker_lines"] = [line for name, p in zip("ab", procs) for line in
                                       (f"{name}: {text}" for text in p.log().splitlines())
                                       if " WARNING " in line or " ERROR " in line or "assigned" in line][-40:]
    tally_sources(tally, got, sources)
    tally_clusters(tally, got)
    return tally


class MetricsPoller:
    """Scrapes a worker's /metrics every `every` seconds in a thread; keeps (seconds, samples) of each
    answered scrape (a scrape the worker does not answer is skipped)."""

    def __init__(self, url: str, names: Sequence[str], every: float = 0.2) -> None:
        self.url = url
        self.names = set(names)
        self.every = every
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._start = time.monotonic()

    def scrape(self) -> dict[str, float] | None:
        try:
            with urllib.request.urlopen(self.url, timeout=2) as r:
                text = r.read().decode()
        except OSError:
            return None
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name in self.names}

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            if (got := self.scrape()) is not None:
                self.samples.append((time.monotonic() - self._start, got))

    def __enter__(self) -> MetricsPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def values(self, name: str) -> list[float]:
        return [got[name] for _, got in self.samples if name in got]


def broker_restart(bootstrap: str, index: str, log_dir: Path, *, messages: int = 1000,
                   runtime: str = "aiokafka", freeze: float = 0.0) -> Tally:
    """The broker stops and starts (same data) while one worker (of `runtime`) is mid-stream, or with `freeze`
    hangs that many seconds (stopped, its connections open; the group's session then 30 s); its /metrics is
    scraped all along (kafka_up, kafka_errors_total) and its log is checked for the outage's two lines."""
    port = free_port()
    # A freeze outlasts the default session of 6 s: the group would expel the worker (the broker judges once it
    # runs again), and it would read again what it routed since its last commit (faust commits once a second).
    settings = scenario_settings(bootstrap, index, max_batch=10, ts_field="ts", group_instance_id="worker-1",
                                 metrics_port=port, metrics_host="127.0.0.1", runtime=runtime,
                                 **({"session_timeout": 30.0} if freeze else {}))
    lines = stream_lines(messages)
    tally = Tally(("Kafka broker hung mid-stream" if freeze else "Kafka broker restarted mid-stream")
                  + (f" ({runtime} runtime)" if runtime != "aiokafka" else ""), len(lines),
                  f"1 broker freeze of {freeze:g} s" if freeze else "1 broker stop/start")
    asyncio.run(create_topics(settings, 1))
    asyncio.run(produce_to(settings, [(0, None, v) for v in lines]))
    names = ("neardup_kafka_up", "neardup_kafka_errors_total")
    with serving(Serve(settings, log_dir, "w", hook="pause=0.03,request_timeout=2")) as (worker,), \
            MetricsPoller(f"http://127.0.0.1:{port}/metrics", names) as poller:
        read(settings, sources=len(lines) // 5, timeout=60, settle=0.0)
        worker.alive()
        before = poller.scrape()
        down = freeze_kafka(freeze) if freeze else restart_kafka()
        worker.alive()
        records = read(settings, sources=len(lines), timeout=90, settle=1.0)
        worker.alive()
        # The probe that ends the outage runs every second: give the gauge that long to come back.
        wait_until(lambda: (poller.scrape() or {}).get("neardup_kafka_up") == 1.0, 10, "kafka_up back to 1")
        after = poller.scrape()
        assert worker.stop() == 0, worker.log()[-2000:]
    log = worker.log()
    tally_stream(tally, outs(records, settings), reference_stream(lines, settings))
    tally.recovery_s = longest_gap(records)
    tally.notes["broker_restart_s"] = round(down, 1)
    tally.notes["unavailable_lines"] = log.count("neardup.worker: kafka unavailable: ")
    tally.notes["available_lines"] = len(re.findall(r"neardup\.worker: kafka available again after [0-9.]+s", log))
    tally.notes["log_lines"] = log.count("\n")
    tally.notes["resent_lines"] = log.count("not delivered during the outage sent again")
    tally.notes["scrapes"] = len(poller.samples)
    tally.notes["kafka_up_min"] = min(poller.values("neardup_kafka_up"), default=None)
    tally.notes["kafka_up"] = (before or {}).get("neardup_kafka_up"), (after or {}).get("neardup_kafka_up")
    tally.notes["kafka_errors"] = ((before or {}).get("neardup_kafka_errors_total"),
                                   (after or {}).get("neardup_kafka_errors_total"))
    return tally


def redis_outage(bootstrap: str, redis_url: str, log_dir: Path, *, outage: float = 10.0,
                 messages: int = 1000) -> Tally:
    """Redis (behind a proxy the test switches off) is gone for `outage` seconds while one worker is
    mid-stream, policy block: the worker stops routing, retries with backoff, resumes by itself."""
    host, port = urlsplit(redis_url).hostname or "127.0.0.1", urlsplit(redis_url).port or 6379
    lines = stream_lines(messages)
    tally = Tally(f"Redis unreachable for {outage:.0f} s mid-stream (block)", len(lines), "1 Redis outage")
    with ProxyThread(host, port) as proxy, redis_namespace(redis_url) as direct:
        index = direct.replace(f"{host}:{port}", f"127.0.0.1:{proxy.port}", 1)
        settings = scenario_settings(bootstrap, index, max_batch=10, ts_field="ts", retry_initial=0.2,
                                     retry_max=2.0)
        asyncio.run(create_topics(settings, 1))
        asyncio.run(produce_to(settings, [(0, None, v) for v in lines]))
        with serving(Serve(settings, log_dir, "w", hook="pause=0.02")) as (worker,):
            read(settings, sources=len(lines) // 5, timeout=60, settle=0.0)
            proxy.down()
            time.sleep(2.0)  # what was routed before the outage is delivered meanwhile
            during = len(read(settings, timeout=5, settle=0.3))
            time.sleep(max(0.0, outage - 4.0))
            after = len(read(settings, timeout=5, settle=0.3))
            worker.alive()
            proxy.up()
            records = read(settings, sources=len(lines), timeout=90, settle=1.0)
            worker.alive()
            assert worker.stop() == 0, worker.log()[-2000:]
            log = worker.log()
    tally_stream(tally, outs(records, settings), reference_stream(lines, settings))
    tally.recovery_s = longest_gap(records)
    tally.notes["routed_while_down"] = after - during
    tally.notes["paused_lines"] = log.count("index unavailable: consumption paused")
    tally.notes["resumed_lines"] = log.count("index available again")
    return tally


class ProxyThread:
    """`TcpProxy` on an event loop of its own, so that a test can cut a service off from a subprocess."""

    def __init__(self, host: str, port: int) -> None:
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._proxy = TcpProxy(host, port, self.port)

    def __enter__(self) -> ProxyThread:
        self._thread.start()
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def up(self) -> None:
        asyncio.run_coroutine_threadsafe(self._proxy.start(), self._loop).result(10)

    def down(self) -> None:
        asyncio.run_coroutine_threadsafe(self._proxy.stop(), self._loop).result(10)


# -- memory ------------------------------------------------------------------------------------


def rss_mb() -> float:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024  # type: ignore[union-attr]


def namespace_usage(redis_url: str, prefix: str) -> tuple[int, int]:
    """(keys, bytes by MEMORY USAGE) of one namespace (the shared Redis' used_memory moves with others).
    Every element counted (SAMPLES 0): the default estimate from 5 fields of a slice's big hash swings
    by 2x from one call to the next."""
    keys = namespace_keys(redis_url, prefix)
    with redis.Redis.from_url(redis_url) as client:
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.memory_usage(key, samples=0)
        return len(keys), sum(n or 0 for n in pipe.execute())


def largest_bucket(redis_url: str, prefix: str) -> int:
    """The most records any bucket field of any slice holds."""
    slices = [k for k in namespace_keys(redis_url, prefix) if b":s:" in k]
    largest = 0
    with redis.Redis.from_url(redis_url) as client:
        for key in slices:
            for name, value in client.hscan_iter(key, count=1000):
                if name.startswith(b"b"):
                    largest = max(largest, len(parse_records(value)))
    return largest


def drop_prefix(redis_url: str, prefix: str) -> None:
    keys = namespace_keys(redis_url, prefix)
    with redis.Redis.from_url(redis_url) as client:
        for at in range(0, len(keys), 500):
            client.delete(*keys[at : at + 500])


SPAM = ("Congratulations! You have been selected to receive a $1000 gift card. Click http://spam.example/claim "
        "now to claim your prize before it expires tonight. Reply STOP to opt out.")


def spam_edit(rng: random.Random, base: str = SPAM) -> str:
    """`base` with three characters changed and a reference number added."""
    chars = list(base)
    for _ in range(3):
        chars[rng.randrange(len(chars))] = rng.choice("abcdefghijklmnopqrstuvwxyz0123456789 !")
    return "".join(chars) + f" ref {rng.randrange(10**6)}"


@dataclass(frozen=True, slots=True)
class Sample:
    at: float  # messages so far, or seconds
    rss_mb: float
    keys: int
    bytes: int


def spam_wave(redis_url: str, messages: int = 200_000, every: int = 40_000) -> tuple[Counter[str], list[Sample]]:
    """One message with small edits, `messages` times, through route_batch and the Redis index."""
    prefix = f"ndtest-spam-{uuid.uuid4().hex[:8]}"
    nd = NearDupFilter(FilterConfig(), index=f"{redis_url}?prefix={prefix}")
    fmt = Settings(id_field="id").record_format()
    rng = random.Random(7)
    kinds: Counter[str] = Counter()
    samples = []
    try:
        for start in range(0, messages, 2000):
            raws = [RawRecord(orjson.dumps({"id": f"s{i}", "text": spam_edit(rng)}), f"s{i}", 1.7e9 + i / 100)
                    for i in range(start, start + 2000)]
            kinds.update(r.kind for r in route_batch(nd, raws, fmt))
            if (start + 2000) % every == 0:
                samples.append(Sample(start + 2000, rss_mb(), *namespace_usage(redis_url, prefix)))
    finally:
        nd.index.close()
        drop_prefix(redis_url, prefix)
    return kinds, samples


def long_stream(redis_url: str, seconds: float = 12.0, rate: int = 1000) -> tuple[int, int, list[Sample]]:
    """Unique messages at `rate`/s for `seconds` of wall clock, event time = now, window 2 s, TTL grace
    1 s; every message ends in the same boilerplate (shared buckets). Returns (messages, largest
    bucket, samples by elapsed seconds)."""
    prefix = f"ndtest-window-{uuid.uuid4().hex[:8]}"
    config = FilterConfig(window=2.0)
    nd = NearDupFilter(config, index=f"{redis_url}?prefix={prefix}&grace=1")
    rng = random.Random(3)
    vocabulary = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=6)) for _ in range(2000)]
    tail = " -- Reply STOP to unsubscribe from these alerts, standard message rates apply."
    samples: list[Sample] = []
    sent = 0
    step = rate // 5
    started = time.time()
    try:
        while time.time() - started < seconds:
            now = time.time()
            nd.check_batch([nd.message(" ".join(rng.choices(vocabulary, k=12)) + tail, f"m{sent + i}", now)
                            for i in range(step)])
            sent += step
            # Every step: a namespace holds one to two windows of entries (a slice is one window), so
            # its bytes swing with a period of one window, and a sparse sample could miss the crests.
            samples.append(Sample(time.time() - started, rss_mb(), *namespace_usage(redis_url, prefix)))
            time.sleep(max(0.0, 0.2 - (time.time() - now)))
        largest = largest_bucket(redis_url, prefix)
    finally:
        nd.index.close()
        drop_prefix(redis_url, prefix)
    return sent, largest, samples


def longest_gap(records: Sequence[KafkaRecord]) -> float:
    """The longest time without output (by the records' create times): how long a fault stopped the flow."""
    stamps = sorted(r.timestamp for r in records)
    return max((b - a for a, b in itertools.pairwise(stamps)), default=0) / 1000.0


def main(argv: Sequence[str]) -> int:
    """`serve [flags]`: neardup serve, with the index hook of $RELIABILITY_INDEX_HOOK installed."""
    if not argv or argv[0] != "serve":
        raise SystemExit("usage: python -m bench.reliability serve [neardup serve flags]")
    _install_hook(os.environ.get(HOOK_ENV, ""))
    from stream.commands import main as neardup

    return neardup(list(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
