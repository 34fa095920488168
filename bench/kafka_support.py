"""Kafka worker test helpers: unique names, settings, producing, running a worker until a condition, a proxy, a
redis-server of one's own."""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import redis
from aiokafka.admin import AIOKafkaAdminClient

from filters.engine import NearDupFilter
from stream.config import Settings
from stream.faust_worker import FaustWorker
from stream.kafka_tools import Headers, KafkaRecord, client_options, collect, ensure_topics, producer, read_topics
from stream.router import WorkerStats
from stream.runner import RawRecord, Routed, route_batch
from stream.worker import AiokafkaWorker

Input = tuple[bytes | None, bytes | None, Headers]  # key, value, headers


def unique_name(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def index_url_with_prefix(redis_url: str) -> str:
    """The test's own namespace in the shared Redis: nothing to flush, nothing shared with other tests."""
    return f"{redis_url}{'&' if '?' in redis_url else '?'}prefix={unique_name('ndtest')}"


def drop_index(url: str) -> None:
    """Deletes every key of the index URL's prefix, on a standalone Redis or (`redis+cluster://`) every master."""
    base, _, query = url.partition("?")
    prefix = dict(item.split("=", 1) for item in query.split("&"))["prefix"]
    if "+cluster" in base:
        with redis.RedisCluster.from_url(base.replace("+cluster", "")) as cluster:
            for node in cluster.get_primaries():
                keys = list(cluster.scan_iter(match=f"{{{prefix}:*", count=1000, target_nodes=node))
                for i in range(0, len(keys), 500):
                    cluster.delete(*keys[i : i + 500])  # one prefix and namespace: one slot
        return
    client = redis.Redis.from_url(base)
    try:
        keys = list(client.scan_iter(match=f"{{{prefix}:*", count=1000))
        for i in range(0, len(keys), 500):
            client.delete(*keys[i : i + 500])
    finally:
        client.close()


def settings_for(bootstrap: str, index: str, **overrides: Any) -> Settings:
    """Settings with topic and group names of their own."""
    name = unique_name()
    values: dict[str, Any] = {
        "kafka_bootstrap": bootstrap,
        "input_topics": (f"{name}-in",),
        "unique_topic": f"{name}-unique",
        "duplicate_topic": f"{name}-duplicate",
        "dead_letter_topic": f"{name}-dead",
        "group_id": f"{name}-group",
        "index": index,
        "batch_within": 0.02,
        "linger": 0.001,
        "log_level": "debug",
    }
    values.update(overrides)
    return Settings(**values)


async def produce(settings: Settings, topic: str, records: Sequence[Input],
                  timestamps_ms: Sequence[int] | None = None) -> None:
    async with producer(settings) as p:
        futures = [await p.send(topic, key=k, value=v, headers=list(h),
                                timestamp_ms=None if timestamps_ms is None else timestamps_ms[i])
                   for i, (k, v, h) in enumerate(records)]
        await asyncio.gather(*futures)


async def run_until(
    worker: AiokafkaWorker | FaustWorker,
    done: Callable[[WorkerStats], bool],
    timeout: float = 30.0,
    during: Callable[[], Awaitable[None]] | None = None,
) -> WorkerStats:
    """Run `worker` until `done(stats)` (polled), then stop it gracefully; re-raises the worker's error."""
    task = asyncio.ensure_future(worker.run())
    deadline = time.monotonic() + timeout
    try:
        while not done(worker.stats):
            if task.done():
                task.result()  # raises the worker's exception
                raise AssertionError("worker stopped before the condition held")
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not met within {timeout}s: {worker.stats.line()}")
            if during is not None:
                await during()
            await asyncio.sleep(0.02)
    finally:
        worker.stop()
        await asyncio.wait_for(asyncio.shield(task), 30)
    return task.result()


async def outputs(settings: Settings, count: int, timeout: float = 20.0, settle: float = 0.0) -> list[KafkaRecord]:
    """The first `count` output records (fewer if `timeout` passes first). With `settle`: once `count`
    arrived, all output records as they are `settle` seconds later (to see that no more arrive)."""
    got = await collect(settings, settings.output_topics, count, timeout)
    if settle > 0 and len(got) >= count:
        got = [r async for r in read_topics(settings, settings.output_topics, max_records=10 * count + 10,
                                            idle_timeout=settle)]
    return got


def reference_verdicts(lines: Sequence[bytes], settings: Settings, topic: str) -> dict[str, Routed]:
    """What the filter decides with a memory index for `lines` in order (single partition: offsets 0..)."""
    nd = NearDupFilter(settings.filter_config(), index="memory://")
    raws = [RawRecord(line, f"{topic}/0/{i}", 0.0) for i, line in enumerate(lines)]
    return {r.raw.fallback_id: r for r in route_batch(nd, raws, settings.record_format())}


async def create_topics_with(settings: Settings, limits: dict[str, int]) -> None:
    """The settings' input and output topics, one partition each; those in `limits` with that
    max.message.bytes."""
    for topic, limit in limits.items():
        await ensure_topics(settings, [topic], 1, {"max.message.bytes": str(limit)})
    await ensure_topics(settings, [*settings.input_topics, *settings.output_topics], 1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_cluster_port() -> int:
    """A free port whose cluster bus port (10,000 above it, as Redis Cluster takes it) is free too."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 45000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue


def redis_server(port: int, workdir: Path, *options: str) -> subprocess.Popen[bytes]:
    """A redis-server of the caller's own on `port`, without persistence, started and answering."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise AssertionError("redis-server is not installed (.ci/run installs it)")
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(workdir), *options], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            if redis.Redis(port=port, socket_timeout=1).ping():
                return proc
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)


class PrivateRedis:
    """A redis-server of the caller's own, without persistence, that it may restart (losing everything) or
    flush: a Redis that loses its data."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = redis_server(self.port, self.workdir)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def lose(self, how: str) -> None:
        """Its data gone: `restart` (without persistence) or `flushall`."""
        if how == "restart":
            self.stop()
            time.sleep(1.0)
            self.start()
        else:
            with redis.Redis(port=self.port) as client:
                client.flushall()


class PrivateCluster:
    """A Redis Cluster of the caller's own (`masters` masters, no replicas, no persistence) whose masters it may
    restart empty: a master that loses its data, as after a crash without persistence, and rejoins with its
    slots (its cluster configuration kept)."""

    def __init__(self, workdir: Path, masters: int = 3) -> None:
        self.workdir = workdir
        self.ports = [free_cluster_port() for _ in range(masters)]
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.ports[0]}/0"

    def _start(self, port: int) -> None:
        home = self.workdir / f"cluster-{port}"
        home.mkdir(parents=True, exist_ok=True)
        self.procs[port] = redis_server(port, home, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                        "--cluster-node-timeout", "5000")

    def start(self) -> None:
        for port in self.ports:
            self._start(port)
        cli = shutil.which("redis-cli")
        if cli is None:
            raise AssertionError("redis-cli is not installed (.ci/run installs it)")
        subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports), "--cluster-replicas", "0",
                        "--cluster-yes"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ok()

    def _wait_ok(self) -> None:
        deadline = time.monotonic() + 30
        while True:
            states = []
            for port in self.ports:
                with redis.Redis(port=port, socket_timeout=1) as client:
                    states.append(b"cluster_state:ok" in client.execute_command("CLUSTER", "INFO"))
            if all(states):
                return
            assert time.monotonic() < deadline, f"the cluster did not form: {states}"
            time.sleep(0.1)

    def lose(self, master: int) -> None:
        """Master number `master` killed and started again empty (its slots kept): its data gone."""
        port = self.ports[master]
        proc = self.procs.pop(port)
        proc.kill()
        proc.wait()
        self._start(port)
        self._wait_ok()

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.kill()
            proc.wait()
        self.procs.clear()


class TcpProxy:
    """A TCP forwarder to a real service that the test can switch off and on (an outage, for real)."""

    def __init__(self, target_host: str, target_port: int, port: int) -> None:
        self.target = (target_host, target_port)
        self.port = port
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.close()
        self._writers.clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


@contextlib.contextmanager
def redis_namespace(redis_url: str) -> Iterator[str]:
    url = index_url_with_prefix(redis_url)
    try:
        yield url
    finally:
        drop_index(url)


async def committed(settings: Settings) -> dict[int, int | None]:
    """The group's committed offsets on the first input topic, by partition."""
    admin = AIOKafkaAdminClient(**client_options(settings))
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(settings.group_id)
    finally:
        await admin.close()
    topic = settings.input_topics[0]
    return {tp.partition: meta.offset for tp, meta in offsets.items() if tp.topic == topic}
