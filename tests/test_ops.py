"""Operations: /metrics, /health, /ready, the campaign view (Redis and memory), `neardup top`, log formats, docker configs."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import inspect
import io
import json
import logging
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.kafka_support import (
    TcpProxy,
    free_port,
    outputs,
    produce,
    redis_namespace,
    settings_for,
    unique_name,
)
from filters.errors import ConfigError
from stream.campaigns import Campaign, CampaignDetail, CampaignView, MemoryCampaigns, RedisCampaigns, Sighting, open_campaigns
from stream.cli import main as cli_main
from stream.config import Settings, format_duration
from stream.faust_worker import FaustWorker
from stream.kafka_tools import KafkaRecord, ensure_topics
from stream.logs import setup_logging
from stream.metrics import STAGES, WorkerMetrics
from stream.ops import Ops
from stream.ops_http import render_page, sparkline, start_server
from stream.top import CLEAR, SHOW_CURSOR, fit, render, run_top, safe
from stream.worker import AiokafkaWorker, make_worker
from tests.test_cli import installed_neardup
from tests.test_kafka_e2e import REPO, alive, serve_env, stop

DOCKER = REPO / "docker"
EVAL_STREAM = REPO.parent / "shared" / "eval" / "stream.jsonl"
SAMPLE = REPO / "tests" / "data" / "sample.jsonl"

# Spam waves with hostile markup: the campaign view must count them and every display must escape them.
CAMPAIGNS = {
    "spam-a": "WIN a FREE iPhone 15 today!!! Click http://win.example/claim to get your prize before midnight, only 3 left",
    "spam-b": '<script>alert("pwned")</script> Cheap meds online: best prices, fast discreet shipping, order today, save 80%',
    "spam-c": "<img src=x onerror=alert(1)> Work from home & earn $5000 a week, no experience needed, reply YES to start",
}
COPIES = {"spam-a": 6, "spam-b": 4, "spam-c": 3}  # copies after the original


def variant(text: str, i: int) -> str:
    """The i-th copy of a spam text (0: the original), as spammers vary them."""
    return [text, text.replace(" ", "  "), text.upper(), "RE: " + text, text + " reply STOP to end",
            text.replace("e", "3"), text.lower(), " ".join(text)][i % 8]


def campaign_lines(ts: float = 1_700_000_000.0) -> list[bytes]:
    lines = []
    for name, text in CAMPAIGNS.items():
        for i in range(COPIES[name] + 1):
            lines.append(orjson.dumps({"id": f"{name}-{i}", "text": variant(text, i), "ts": ts + i}))
    return lines


def stream_lines(limit: int) -> list[bytes]:
    """Up to `limit` good records (the sample shipped in the repository has two bad ones on purpose:
    only BAD's lines may be dead-lettered here)."""
    path = EVAL_STREAM if EVAL_STREAM.is_file() else SAMPLE
    with open(path, "rb") as f:
        lines = [line.rstrip(b"\r\n") for line, _ in zip(f, range(limit)) if line.strip()]
    return [line for line in lines if _is_good(line)]


def _is_good(line: bytes) -> bool:
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        return False
    return isinstance(record, dict) and isinstance(record.get("text"), str) and bool(record["text"].strip())


BAD = [b"\xff\xfe not UTF-8", b'{"id": "no-text-here"}', b"[1, 2, 3]"]


# -- HTTP and metrics helpers ------------------------------------------------------------------------


def get(url: str) -> tuple[int, bytes, dict[str, str]]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


async def aget(url: str) -> tuple[int, bytes, dict[str, str]]:
    return await asyncio.to_thread(get, url)


async def _status(url: str, status: int) -> bool:
    return (await aget(url))[0] == status


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value of a Prometheus exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def routed_counts(got: Sequence[KafkaRecord], settings: Settings) -> dict[str, Counter[str]]:
    """Per input topic: in, unique, duplicate, dead:<reason>, from the output records themselves."""
    kinds = {settings.unique_topic: "unique", settings.duplicate_topic: "duplicate",
             settings.dead_letter_topic: "dead"}
    per: dict[str, Counter[str]] = {}
    for r in got:
        source = (r.header("neardup-source") or b"").decode()
        topic = source.rsplit("/", 2)[0]
        c = per.setdefault(topic, Counter())
        c["in"] += 1
        kind = kinds[r.topic]
        c[f"dead:{(r.header('neardup-reason') or b'').decode()}" if kind == "dead" else kind] += 1
    return per


def duplicates_per_representative(got: Sequence[KafkaRecord]) -> Counter[str]:
    return Counter((r.header("neardup-duplicate-of") or b"").decode() for r in got
                   if r.header("neardup-verdict") == b"duplicate")


@contextlib.asynccontextmanager
async def running(settings: Settings) -> AsyncIterator[tuple[AiokafkaWorker | FaustWorker, Ops, str]]:
    """A worker with its Ops (HTTP server on settings.metrics_port) in this event loop."""
    worker = make_worker(settings)
    ops = Ops(settings, worker)
    ops.attach()
    await ops.start()
    assert ops.http_port == settings.metrics_port
    task = asyncio.ensure_future(worker.run())
    try:
        yield worker, ops, f"http://127.0.0.1:{ops.http_port}"
        assert not task.done() or task.exception() is None
    finally:
        worker.stop()
        await asyncio.wait_for(asyncio.shield(task), 30)
        await ops.stop()
        worker.nd.index.close()


async def until(predicate: Callable[[], Any], timeout: float, what: str) -> None:
    """Wait until `predicate()` (a bool, or an awaitable of one) holds."""
    deadline = time.monotonic() + timeout
    while not await _truth(predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.05)


async def _truth(result: Any) -> bool:
    return bool(await result) if inspect.isawaitable(result) else bool(result)


@pytest.fixture
def index_url(redis_url: str) -> Iterator[str]:
    with redis_namespace(redis_url) as url:
        yield url


# -- end to end: serve → metrics and campaign view ----------------------------------------------------


@pytest.mark.services
@pytest.mark.timeout(120)
def test_serve_metrics_and_campaigns_equal_the_routed_outputs(kafka_bootstrap: str, index_url: str) -> None:
    """`neardup serve` (a subprocess, Redis index, two input topics, JSON logs): after the run, every
    count of /metrics equals what reached the output topics, and the campaign view (HTTP, Redis,
    `neardup top`) has one cluster per representative with its number of duplicates."""
    port = free_port()
    name = unique_name("ops")
    settings = settings_for(kafka_bootstrap, index_url, id_field="id", ts_field="ts", max_batch=64,
                            input_topics=(f"{name}-a", f"{name}-b"), metrics_port=port, log_format="json")
    first, second = settings.input_topics
    spam = campaign_lines()
    # Two thirds of the good records to a, the rest to b, whichever file they come from (the sample shipped
    # has 300: were b given only bad records, a first batch of b's would index nothing).
    good = stream_lines(450)
    cut = len(good) * 2 // 3
    lines_a = good[:cut] + spam + BAD[:2]  # a wave's copies in one partition: its original comes first
    lines_b = good[cut:] + BAD[2:]
    total = len(lines_a) + len(lines_b)

    async def load() -> None:
        await ensure_topics(settings, [*settings.input_topics, *settings.output_topics], partitions=1)
        await produce(settings, first, [(None, line, ()) for line in lines_a])
        await produce(settings, second, [(None, line, ()) for line in lines_b])

    asyncio.run(load())
    proc = subprocess.Popen([sys.executable, "-m", "stream.commands", "serve"], cwd=REPO, env=serve_env(settings),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        got = asyncio.run(outputs(settings, total, timeout=60))
        assert len(got) == total
        alive(proc)
        expected = routed_counts(got, settings)
        # The observer counts a batch after its outputs were acknowledged: poll until the last one is in.
        deadline = time.monotonic() + 10
        while True:
            status, body, headers = get(f"{base}/metrics")
            assert status == 200 and headers["Content-Type"].startswith("text/plain")
            m = samples(body.decode())
            if sum(value(m, "neardup_messages_in_total", topic=t) for t in settings.input_topics) == total:
                break
            assert time.monotonic() < deadline, f"/metrics counted fewer than {total}"
            time.sleep(0.1)
        health = get(f"{base}/health")
        ready = get(f"{base}/ready")
        campaigns = get(f"{base}/campaigns?limit=1000")
        page = get(f"{base}/?refresh=7")
        top_http = subprocess.run([installed_neardup(), "top", "--once", "--from", base, "--limit", "3"],
                                  cwd=REPO, capture_output=True, text=True, timeout=30)
    finally:
        err = stop(proc)
    assert proc.returncode == 0, err[-3000:]

    # Counts per input topic and verdict, and dead letters per reason, equal the routed outputs.
    for topic in settings.input_topics:
        c = expected[topic]
        assert value(m, "neardup_messages_in_total", topic=topic) == c["in"]
        assert value(m, "neardup_messages_unique_total", topic=topic) == c["unique"]
        assert value(m, "neardup_messages_duplicate_total", topic=topic) == c["duplicate"]
        dead = {k.removeprefix("dead:"): n for k, n in c.items() if k.startswith("dead:")}
        assert dead and sum(dead.values()) == sum(1 for line in (lines_a if topic == first else lines_b) if line in BAD)
        for reason, n in dead.items():
            assert value(m, "neardup_messages_dead_lettered_total", topic=topic, reason=reason) == n
    uniq = sum(c["unique"] for c in expected.values())
    dups = sum(c["duplicate"] for c in expected.values())
    assert dups >= sum(COPIES.values())
    assert value(m, "neardup_duplicate_ratio") == pytest.approx(dups / (uniq + dups))
    batches = value(m, "neardup_batches_total")
    assert batches >= 2 and value(m, "neardup_batch_size_sum") == total
    assert value(m, "neardup_batch_size_count") == batches
    for stage in STAGES:
        assert value(m, "neardup_stage_seconds_count", stage=stage) == batches, stage
        assert value(m, "neardup_stage_seconds_sum", stage=stage) > 0, stage
    # One lookup per batch with a message to decide: a batch of rejected records only has none.
    bad = sum(1 for line in (*lines_a, *lines_b) if line in BAD)
    assert batches - bad <= value(m, "neardup_redis_seconds_count", op="lookup") <= batches
    assert value(m, "neardup_redis_seconds_count", op="campaigns") >= 1
    assert value(m, "neardup_index_up") == 1 and value(m, "neardup_index_errors_total") == 0
    for topic in settings.input_topics:  # everything was consumed
        assert value(m, "neardup_consumer_lag", topic=topic, partition="0") == 0
        assert ("neardup_consumer_lag", (("partition", "0"), ("topic", topic))) in m
    # Refreshed after the first batch, then every 30 s: the entries of the first batch(es).
    assert 0 < value(m, "neardup_index_size", stat="entries") <= uniq

    assert health[0] == 200 and orjson.loads(health[1])["status"] == "ok"
    assert ready[0] == 200, ready[1]
    assert orjson.loads(ready[1])["checks"] == {"kafka": "ok", "redis": "ok", "index": "ok", "worker": "ok"}

    # The campaign view: one cluster per representative, its size the number of its duplicates.
    per_rep = duplicates_per_representative(got)
    assert campaigns[0] == 200
    view = CampaignView.from_dict(orjson.loads(campaigns[1]))
    assert {c.id: c.size for c in view.campaigns} == dict(per_rep)
    assert view.total == len(per_rep)
    assert [c.size for c in view.campaigns] == sorted(per_rep.values(), reverse=True)
    for c in view.campaigns:
        assert c.first_seen <= c.last_seen <= view.now and sum(c.per_minute) == c.size  # all within a minute or two
    for name, copies in COPIES.items():
        assert per_rep[f"{name}-0"] == copies
    # ... the same in Redis for any other reader (another worker, `neardup top`):
    store = RedisCampaigns(settings.index, namespace=settings.filter_config().digest(), window=settings.window)
    try:
        assert {c.id: c.size for c in store.top(1000).campaigns} == dict(per_rep)
    finally:
        store.close()
    top = subprocess.run([installed_neardup(), "top", "--once", "--index", settings.index,
                          "--window", format_duration(settings.window), "--limit", "2"], cwd=REPO, capture_output=True,
                         text=True, timeout=30)
    assert top.returncode == 0, top.stderr
    biggest = per_rep.most_common(1)[0]
    rows = [line for line in top.stdout.splitlines() if re.match(r"\s+\d+ ", line)]
    assert len(rows) == 2 and rows[0].split()[1] == str(biggest[1]) and biggest[0] in rows[0]
    assert "\x1b" not in top.stdout  # not a terminal: no colours
    assert top_http.returncode == 0 and top_http.stdout.splitlines()[2].split()[1] == str(biggest[1])

    # The page: escaped texts, refreshing itself, script-free by policy.
    assert page[0] == 200 and '<meta http-equiv="refresh" content="7">' in page[1].decode()
    assert b"<script>" not in page[1] and b"&lt;script&gt;alert(&quot;pwned&quot;)&lt;/script&gt;" in page[1]
    assert "default-src 'none'" in page[2]["Content-Security-Policy"]

    # JSON log lines only; one per batch (DEBUG here), none of them more than one INFO line per batch.
    records = [json.loads(line) for line in err.splitlines() if line.strip()]
    per_batch = [r for r in records if r.get("logger") == "neardup.ops" and "batch" in r]
    assert len(per_batch) == batches
    assert sum(r["records"] for r in per_batch) == total
    assert 1 <= sum(r["level"] == "info" for r in per_batch) <= batches
    assert any(r["msg"].startswith(f"stopped: {total} routed") for r in records)

    # Nothing neardup wrote outlives the window: every key under the run's prefix (index slices and
    # metadata, campaign views, the group's marks, the changelog's epoch, the size counter) has a TTL.
    base, _, query = settings.index.partition("?")
    prefix = dict(item.split("=", 1) for item in query.split("&"))["prefix"]
    with redis.Redis.from_url(base) as client:
        ttls = {k.decode(): client.pttl(k) for k in client.scan_iter(match=f"{{{prefix}:*", count=1000)}
    assert len(ttls) >= 5 and any(":marks:" in k for k in ttls) and any(":c:" in k for k in ttls), sorted(ttls)
    assert [k for k, ttl in ttls.items() if ttl < 0] == []


INFO_LINE = re.compile(r" INFO .*batch \d+: .*; total (\d+), (\d+) msg/s over the last (\d+)s$")


@pytest.mark.services
@pytest.mark.timeout(120)
def test_serve_logs_the_rate_of_the_last_interval_not_the_average_since_start(kafka_bootstrap: str) -> None:
    """A burst, a record after 10 s, then a trickle after 10 s more: the trickle's INFO line shows the
    trickle's rate over the seconds since the line before (a few msg/s), not the average since start (tens)."""
    from stream.ops import INFO_EVERY

    settings = settings_for(kafka_bootstrap, "memory://", id_field="id", max_batch=64, metrics_port=free_port(),
                            campaigns=False)
    (topic,) = settings.input_topics

    def records(start: int, n: int) -> list[tuple[None, bytes, tuple[()]]]:
        return [(None, orjson.dumps({"id": str(i), "text": f"message {i}: {' '.join(str(i * k) for k in range(9))}"}), ())
                for i in range(start, start + n)]

    asyncio.run(ensure_topics(settings, [*settings.input_topics, *settings.output_topics], partitions=1))
    asyncio.run(produce(settings, topic, records(0, 1000)))
    launched = time.monotonic()
    proc = subprocess.Popen([installed_neardup(), "serve"], cwd=REPO, env=serve_env(settings),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    seen: list[tuple[float, str]] = []
    threading.Thread(target=lambda: seen.extend((time.monotonic(), line.decode().rstrip())
                                                for line in iter(proc.stderr.readline, b"")), daemon=True).start()

    def info_lines(count: int, timeout: float = 30) -> list[tuple[float, re.Match[str]]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [(t, m) for t, line in list(seen) if (m := INFO_LINE.search(line))]
            if len(found) >= count:
                return found
            time.sleep(0.1)
        raise AssertionError("\n".join(line for _, line in seen))

    try:
        assert len(asyncio.run(outputs(settings, 1000, timeout=60))) == 1000
        info_lines(1)
        time.sleep(INFO_EVERY + 0.5)
        asyncio.run(produce(settings, topic, records(1000, 1)))
        info_lines(2)
        time.sleep(INFO_EVERY + 0.5)
        asyncio.run(produce(settings, topic, records(1001, 20)))
        (t1, before), (t2, last) = info_lines(3)[1:3]
    finally:
        err = stop(proc)
    assert proc.returncode == 0, err[-3000:]
    total1, total2 = int(before[1]), int(last[1])
    rate, seconds = int(last[2]), int(last[3])
    assert (total1, total2) == (1001, 1021)
    assert abs(seconds - (t2 - t1)) <= 1.5  # the interval is the time since the line before
    assert abs(rate - (total2 - total1) / (t2 - t1)) <= 1.5  # ~2 msg/s
    assert total2 / (t2 - launched) > 3 * (rate + 1)  # the average since start is much higher


@pytest.mark.services
@pytest.mark.timeout(90)
def test_ready_is_503_while_redis_is_unreachable_and_metrics_count_the_errors_and_retries(
        kafka_bootstrap: str, index_url: str) -> None:
    """Redis behind a proxy that the test switches off: /ready says 503 (redis unreachable, index in an
    outage), /metrics shows index_up 0 and counts errors and retries; back on, both recover."""
    base_url, _, query = index_url.partition("?")
    host, redis_port = base_url.removeprefix("redis://").split("/")[0].split(":")
    proxy_port = free_port()
    settings = settings_for(kafka_bootstrap, f"redis://127.0.0.1:{proxy_port}/0?{query}", metrics_port=free_port(),
                            id_field="id", ts_field="ts", retry_initial=0.05, retry_max=0.2)
    proxy = TcpProxy(host, int(redis_port), proxy_port)
    spam = campaign_lines()

    async def scenario() -> None:
        await proxy.start()
        async with running(settings) as (worker, _, base):
            await produce(settings, settings.input_topics[0], [(None, line, ()) for line in spam[:5]])
            await until(lambda: worker.stats.seen >= 5, 30, "first records routed")
            status, body, _ = await aget(f"{base}/ready")
            assert status == 200, body

            await proxy.stop()
            await produce(settings, settings.input_topics[0], [(None, line, ()) for line in spam[5:]])
            await until(lambda: worker.stats.index_errors >= 3, 30, "index errors")
            status, body, _ = await aget(f"{base}/ready")
            assert status == 503
            checks = orjson.loads(body)["checks"]
            assert checks["redis"].startswith("unreachable") and checks["index"].startswith("outage")
            assert checks["kafka"] == "ok"
            assert (await aget(f"{base}/health"))[0] == 200  # alive: waiting for Redis is not a reason to restart
            m = samples((await aget(f"{base}/metrics"))[1].decode())
            assert value(m, "neardup_index_up") == 0
            assert value(m, "neardup_index_errors_total") >= 3 and value(m, "neardup_index_retries_total") >= 2
            assert (await aget(f"{base}/campaigns"))[0] == 503  # the view lives in the same Redis

            await proxy.start()
            await until(lambda: worker.stats.seen >= len(spam), 30, "routed after the outage")

            await until(lambda: _status(f"{base}/ready", 200), 10, "ready again")
            m = samples((await aget(f"{base}/metrics"))[1].decode())
            assert value(m, "neardup_index_up") == 1
            assert value(m, "neardup_index_retries_total") >= 2
            assert value(m, "neardup_messages_in_total", topic=settings.input_topics[0]) == len(spam)
        await proxy.stop()

    asyncio.run(scenario())


@pytest.mark.services
@pytest.mark.timeout(60)
def test_memory_index_keeps_campaigns_in_the_worker_and_a_taken_port_does_not_stop_it(
        kafka_bootstrap: str, capsys: pytest.CaptureFixture[str]) -> None:
    """memory://: the view lives in the worker (served over HTTP, `top` needs --from); /ready does not ask
    for Redis. A second worker on the same metrics port logs the error and routes anyway."""
    port = free_port()
    settings = settings_for(kafka_bootstrap, "memory://", metrics_port=port, id_field="id", ts_field="ts")
    spam = campaign_lines()

    async def scenario() -> None:
        await produce(settings, settings.input_topics[0], [(None, line, ()) for line in spam])
        async with running(settings) as (worker, _, base):
            await until(lambda: worker.stats.seen >= len(spam), 30, "routed")
            status, body, _ = await aget(f"{base}/campaigns")
            view = CampaignView.from_dict(orjson.loads(body))
            assert {c.id: c.size for c in view.campaigns} == {f"{k}-0": n for k, n in COPIES.items()}
            status, body, _ = await aget(f"{base}/ready")
            assert status == 200 and orjson.loads(body)["checks"]["redis"] == "not used"

            other = make_worker(settings)
            ops = Ops(settings, other)
            await ops.start()  # the port is taken: logged, not raised
            assert ops.http_port is None
            await ops.stop()

    asyncio.run(scenario())
    assert cli_main(["top", "--once", "--index", "memory://"]) == 2
    assert "--from" in capsys.readouterr().err


# -- the campaign store --------------------------------------------------------------------------------


class Clock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["memory", "redis", "cluster"])
def store(request: pytest.FixtureRequest) -> Iterator[MemoryCampaigns | RedisCampaigns]:
    if request.param == "memory":
        yield MemoryCampaigns(3600, minutes=5)
        return
    if request.param == "redis":
        with redis_namespace(request.getfixturevalue("redis_url")) as index:
            s = RedisCampaigns(index, namespace="ns", window=3600, minutes=5)
            yield s
            s.close()
        return
    # Redis Cluster: every key of the view carries the namespace's hash tag, so each script runs on one slot.
    node = request.getfixturevalue("redis_cluster_url").partition("://")[2].split("/")[0]
    prefix = unique_name("ndtest")
    s = RedisCampaigns(f"redis+cluster://{node}?prefix={prefix}", namespace="ns", window=3600, minutes=5)
    yield s
    s.close()
    cluster = redis.RedisCluster.from_url(f"redis://{node}")
    try:
        for key in list(cluster.scan_iter(match=f"{{{prefix}:*", target_nodes=redis.RedisCluster.PRIMARIES)):
            cluster.delete(key)
    finally:
        cluster.close()


def sightings(**sizes: int) -> list[Sighting]:
    return [Sighting(rep, f"text of {rep} copy {i}") for rep, n in sizes.items() for i in range(n)]


def test_store_counts_batches_and_ranks_by_size_growth_and_last_seen(store: MemoryCampaigns | RedisCampaigns) -> None:
    store.record(sightings(a=3, b=1))
    store.record(sightings(b=1, c=5))
    time.sleep(0.01)  # last seen: b after the others
    store.record(sightings(b=1))
    view = store.top(10)
    # Equal sizes: the one seen last first.
    assert [(c.id, c.size) for c in view.campaigns] == [("c", 5), ("b", 3), ("a", 3)]
    assert view.total == 3 and view.minutes == 5 and view.sort == "size"
    by_id = {c.id: c for c in view.campaigns}
    assert by_id["a"].text == "text of a copy 0"  # the first copy's text stays
    assert by_id["b"].first_seen < by_id["b"].last_seen
    assert by_id["c"].per_minute[-1] + by_id["c"].per_minute[-2] == 5 and len(by_id["c"].per_minute) == 5
    assert store.top(10, "last").campaigns[0].id == "b"
    assert [c.id for c in store.top(1, "growth").campaigns] == ["c"]
    assert len(store.top(2).campaigns) == 2 and store.top(2).total == 3
    with pytest.raises(ConfigError):
        store.top(5, "biggest")


def test_store_keeps_hostile_text_verbatim_but_bounded(store: MemoryCampaigns | RedisCampaigns) -> None:
    hostile = "<script>alert('x')</script>\x1b[2J\u202e  spaced\n\nout " + "y" * 500
    store.record([Sighting("r", hostile)])
    (c,) = store.top().campaigns
    assert c.text.startswith("<script>alert('x')</script>\x1b[2J\u202e spaced out yyy")  # whitespace collapsed
    assert len(c.text) == 160


def test_memory_store_expires_clusters_and_minutes_with_the_clock() -> None:
    clock = Clock()
    store = MemoryCampaigns(600, minutes=3, clock=clock)
    store.record(sightings(old=2))
    clock.now += 60
    store.record(sightings(old=1, new=1))
    clock.now += 60
    store.record(sightings(new=4))
    view = store.top()
    assert {c.id: c.per_minute for c in view.campaigns} == {"old": (2, 1, 0), "new": (0, 1, 4)}
    clock.now += 120
    assert {c.id: c.per_minute for c in store.top().campaigns} == {"old": (0, 0, 0), "new": (4, 0, 0)}
    assert store.top(sort="growth").campaigns[0].id == "new"
    clock.now += 600 - 180 + 1  # `old` last seen 601 s ago, `new` 541 s ago
    assert [c.id for c in store.top().campaigns] == ["new"]
    clock.now += 120
    assert store.top().total == 0 and store.top().campaigns == ()


@pytest.mark.services
def test_redis_store_is_shared_by_workers_and_expires_with_the_window(redis_url: str) -> None:
    with redis_namespace(redis_url) as url:
        one = RedisCampaigns(url, namespace="ns", window=1.0)
        two = RedisCampaigns(url, namespace="ns", window=1.0)
        other = RedisCampaigns(url, namespace="other", window=1.0)
        try:
            one.record(sightings(a=2))
            two.record(sightings(a=3, b=1))
            assert {c.id: c.size for c in one.top().campaigns} == {"a": 5, "b": 1}
            assert two.top().total == 2 and other.top().total == 0
            client = redis.Redis.from_url(url.partition("?")[0])
            ttl = client.pttl(one.size_key)
            assert 0 < ttl <= (1.0 + 3600) * 1000  # window + grace
            time.sleep(1.1)
            assert one.top().total == 0 and one.top().campaigns == ()
            one.record(sightings(c=1))  # a write drops the clusters that left the window
            assert {c.id for c in two.top().campaigns} == {"c"}
            assert client.zcard(one.size_key) == 1
            assert client.hexists(one.size_key.replace(":c:size", ":c:first"), "a") == 0
            client.close()
        finally:
            for s in (one, two, other):
                s.close()


def test_open_campaigns_follows_the_index_url() -> None:
    assert isinstance(open_campaigns("memory://", namespace="ns", window=60), MemoryCampaigns)
    assert isinstance(open_campaigns("redis://127.0.0.1:1/0", namespace="ns", window=60), RedisCampaigns)
    with pytest.raises(ConfigError):
        open_campaigns("mongodb://x", namespace="ns", window=60)


# -- rendering -------------------------------------------------------------------------------------------


def view_of(*campaigns: Campaign, sort: str = "size") -> CampaignView:
    return CampaignView(1_800_000_600.0, 86400.0, 5, sort, len(campaigns), campaigns)


HOSTILE = Campaign("<b>id</b>", '<script>alert("x")</script>\x1b[31mred\x1b]0;title\x07 <img src=x onerror=alert(1)>', 7,
                   1_800_000_000.0, 1_800_000_590.0, (0, 1, 0, 2, 4))


def test_page_escapes_every_text_and_runs_no_script() -> None:
    page = render_page(view_of(HOSTILE, Campaign("ok", "fine", 2, 1_800_000_000.0, 1_800_000_500.0, (0, 0, 0, 0, 2))),
                       refresh=3)
    assert "<script" not in page and "<img" not in page and "<b>" not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page and 'data-id="&lt;b&gt;id&lt;/b&gt;"' in page
    assert '<meta http-equiv="refresh" content="3">' in page
    assert re.findall(r'data-size="(\d+)"', page) == ["7", "2"]
    empty = render_page(view_of(), refresh=0)
    assert "No duplicate clusters" in empty and 'http-equiv="refresh"' not in empty


def test_terminal_view_is_safe_fitted_and_ranked() -> None:
    assert "\x1b" not in safe(HOSTILE.text) and "\u202e" not in safe("a\u202eb") and "\u200b" not in safe("a\u200bb")
    assert fit("转发微博转发微博", 7) == "转发微…" and fit("abc", 5) == "abc  "
    text = render(view_of(HOSTILE, Campaign("ok", "fine", 2, 1_800_000_000.0, 1_800_000_500.0, (0, 0, 0, 0, 2))),
                  width=100, color=False)
    lines = text.splitlines()
    assert "2 duplicate clusters" in lines[0] and lines[2].split()[:3] == ["1", "7", "7"]
    assert lines[3].split()[:3] == ["2", "2", "2"] and all(len(line) <= 100 for line in lines)
    assert "\x1b" not in text and "10m" in lines[2] and "10s" in lines[2]  # first seen 10 min, last 10 s ago
    assert sparkline((0, 1, 0, 2, 4)) == "·▃·▅█"
    assert "\x1b[1m" in render(view_of(HOSTILE), width=100, color=True)


# -- `neardup top` under a terminal ------------------------------------------------------------------------


class StoreEndpoints:
    """The worker's HTTP endpoints over a campaign store alone (what `top --from` reads)."""

    def __init__(self, store: MemoryCampaigns) -> None:
        self.store = store

    async def metrics_text(self) -> bytes:
        return b""

    async def health(self) -> tuple[bool, dict[str, Any]]:
        return True, {"status": "ok"}

    async def ready(self) -> tuple[bool, dict[str, Any]]:
        return True, {"status": "ready"}

    async def campaigns(self, limit: int, sort: str) -> CampaignView:
        return self.store.top(limit, sort)

    async def campaign(self, campaign_id: str) -> CampaignDetail | None:
        return self.store.detail(campaign_id)


@contextlib.contextmanager
def serving(store: MemoryCampaigns) -> Iterator[str]:
    """The real HTTP app (`stream.ops_http`) over `store`, on its own event loop thread; yields its URL."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner, port = asyncio.run_coroutine_threadsafe(start_server(StoreEndpoints(store), "127.0.0.1", 0), loop).result(10)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def wave_store() -> MemoryCampaigns:
    """`big` (8 copies) sent 20 minutes ago, `fast` (3 copies) now: by size big leads, by growth fast."""
    clock = Clock()
    store = MemoryCampaigns(3600, minutes=10, clock=clock)
    store.record([Sighting("big", f"old wave {i}") for i in range(8)])
    clock.now += 20 * 60
    store.record([Sighting("fast", f"new wave {i}") for i in range(3)])
    return store


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class Terminal:
    """A pseudo-terminal (150 columns) whose slave side is a subprocess's stdin, stdout and stderr."""

    def __init__(self) -> None:
        self.master, self.slave = pty.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 150, 0, 0))
        self.saved = termios.tcgetattr(self.slave)
        self.output = b""

    def screens(self) -> list[str]:
        """What was drawn, one text per redraw (colours removed)."""
        return [ANSI.sub("", part) for part in self.output.decode(errors="replace").split(CLEAR)[1:]]

    def read_until(self, predicate: Callable[[list[str]], bool], timeout: float = 20.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while not predicate(self.screens()):
            left = deadline - time.monotonic()
            assert left > 0, f"not on the screen within {timeout}s: {self.output[-2000:]!r}"
            if select.select([self.master], [], [], left)[0]:
                self.output += os.read(self.master, 65536)
        return self.screens()

    def drain(self) -> None:
        while select.select([self.master], [], [], 0.2)[0]:
            self.output += os.read(self.master, 65536)

    def lflags(self) -> int:
        return termios.tcgetattr(self.slave)[3]

    def close(self) -> None:
        os.close(self.master)
        os.close(self.slave)


def ranked_ids(screen: str) -> list[str]:
    return [line.split()[7] for line in screen.splitlines() if re.match(r"\s+\d+ ", line)]


def drawn(count: int) -> Callable[[list[str]], bool]:
    """Until `count` screens are on the terminal, the last one whole: as many ranked rows as its header
    counts clusters (a read can end in the middle of a redraw)."""
    def whole(screens: list[str]) -> bool:
        clusters = re.search(r"(\d+) duplicate clusters", screens[-1]) if len(screens) >= count else None
        return clusters is not None and len(ranked_ids(screens[-1])) == int(clusters[1])
    return whole


@contextlib.contextmanager
def top_in_terminal(*args: str) -> Iterator[tuple[Terminal, subprocess.Popen[bytes]]]:
    term = Terminal()
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEARDUP_") and k != "NO_COLOR"}
    env.update(PYTHONPATH=str(REPO), TERM="xterm")
    proc = subprocess.Popen([installed_neardup(), "top", *args], cwd=REPO, env=env,
                            stdin=term.slave, stdout=term.slave, stderr=term.slave)
    try:
        yield term, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        term.close()


def test_top_keys_change_the_sort_under_a_terminal_and_q_restores_it() -> None:
    """`neardup top` in a pseudo-terminal: the first screen is by size with the keys in the header; `g`
    redraws at once (the interval is a minute) by growth; `q` exits 0 and the terminal's settings are
    the ones it had before (echo and line mode back), the cursor shown again."""
    with serving(wave_store()) as base, top_in_terminal("--from", base, "--interval", "60s") as (term, proc):
        first = term.read_until(drawn(1))[-1]
        header = first.splitlines()[0]
        assert "sorted by size" in header and "2 duplicate clusters" in header
        assert "[s]ize [g]rowth [l]ast seen [r]efresh [q]uit" in header
        assert ranked_ids(first) == ["big", "fast"]
        assert "\x1b[7m[s]ize\x1b[0m" in term.output.decode()  # the current sort's key highlighted
        # While it runs, keys arrive one by one, unechoed.
        assert not term.lflags() & (termios.ICANON | termios.ECHO)
        assert term.saved[3] & termios.ICANON and term.saved[3] & termios.ECHO

        os.write(term.master, b"g")
        screens = term.read_until(drawn(2))
        assert len(screens) == 2  # one redraw, from the key
        second = screens[-1]
        assert "sorted by growth" in second.splitlines()[0]
        assert ranked_ids(second) == ["fast", "big"]
        assert [line.split()[1:3] for line in second.splitlines() if re.match(r"\s+\d+ ", line)] == \
            [["3", "3"], ["8", "0"]]  # size, copies in the last 10 minutes
        assert "\x1b[7m[g]rowth\x1b[0m" in term.output.decode()

        os.write(term.master, b"q")
        assert proc.wait(10) == 0
        term.drain()
        assert term.output.endswith(SHOW_CURSOR.encode())
        assert termios.tcgetattr(term.slave) == term.saved
        assert len(term.screens()) == 2


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 0), (signal.SIGTERM, 128 + signal.SIGTERM)])
def test_top_restores_the_terminal_on_ctrl_c_and_sigterm(signum: int, status: int) -> None:
    with serving(wave_store()) as base, top_in_terminal("--from", base, "--sort", "last") as (term, proc):
        screen = term.read_until(drawn(1))[-1]
        assert "sorted by last seen" in screen and ranked_ids(screen) == ["fast", "big"]
        assert not term.lflags() & termios.ICANON
        proc.send_signal(signum)
        assert proc.wait(10) == status
        term.drain()
        assert termios.tcgetattr(term.slave) == term.saved
        assert term.output.endswith(SHOW_CURSOR.encode())
        assert b"Traceback" not in term.output


def test_top_restores_the_terminal_when_the_view_fails() -> None:
    """In-process, keys from a pseudo-terminal: an unexpected error in the second fetch propagates, and
    the terminal is back in line mode with echo; the `r` key redraws at once, without waiting."""
    master, slave = pty.openpty()
    saved = termios.tcgetattr(slave)
    modes: list[int] = []
    store = wave_store()

    def fetch(limit: int, sort: str) -> CampaignView:
        modes.append(termios.tcgetattr(slave)[3])
        if len(modes) == 1:
            os.write(master, b"xr")  # an unknown key, then refresh
            return store.top(limit, sort)
        raise RuntimeError("the view broke")

    out = io.StringIO()
    keys = os.fdopen(slave, "r", closefd=False)
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="the view broke"):
            run_top(fetch, limit=5, sort="growth", interval=60, once=False, out=out, keys=keys)
        assert time.monotonic() - started < 30  # `r` redrew; the interval did not pass
        assert len(modes) == 2 and all(not m & termios.ICANON for m in modes)
        assert termios.tcgetattr(slave) == saved
        assert "sorted by growth" in out.getvalue() and "[r]efresh" in out.getvalue()
    finally:
        keys.close()
        os.close(master)
        os.close(slave)


# -- logs -------------------------------------------------------------------------------------------------


def test_log_formats_plain_and_json() -> None:
    out = io.StringIO()
    setup_logging("info", "json", stream=out)
    log = logging.getLogger("neardup.test")
    log.info("batch %d done", 3, extra={"records": 5})
    log.debug("not shown at info")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert first["msg"] == "batch 3 done" and first["records"] == 5 and first["level"] == "info"
    assert first["logger"] == "neardup.test" and re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", first["ts"])
    assert second["level"] == "error" and "ValueError: boom" in second["exc"]

    out = io.StringIO()
    handler = setup_logging("info", "plain", stream=out)
    log.info("plain %s", "line")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO neardup\.test: plain line\n", out.getvalue())
    assert sum(h.get_name() == "neardup" for h in logging.getLogger().handlers) == 1  # replaced, not added
    logging.getLogger().removeHandler(handler)
    with pytest.raises(ConfigError):
        setup_logging("info", "xml")


def test_filter_summary_as_text_or_one_json_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join([*campaign_lines(), b"[1]"]) + b"\n")
    sinks = ["--unique", str(tmp_path / "u"), "--rejected", str(tmp_path / "r")]
    try:
        assert cli_main(["filter", str(path), *sinks]) == 0
        plain = capsys.readouterr().err
        notice, summary_text = plain.split("\n", 1)  # a rejected record's notice, then the summary
        assert notice == "neardup: rejected record 17 (not_an_object): [1]"
        assert summary_text.startswith("in 17 = unique 3 + duplicate 13 + rejected 1\n")
        assert cli_main(["filter", str(path), *sinks, "--log-format", "json"]) == 0
        (line,) = capsys.readouterr().err.splitlines()
        summary = json.loads(line)
        assert (summary["in"], summary["unique"], summary["duplicate"], summary["rejected"]) == (17, 3, 13, 1)
        assert summary["reasons"] == {"not_an_object": 1} and summary["logger"] == "neardup.filter"
        assert summary["duplicate_ratio"] == pytest.approx(13 / 16)
        assert cli_main(["filter", str(path), "--index", "mongodb://x", "--log-format", "json"]) == 2
        error = json.loads(capsys.readouterr().err.splitlines()[-1])
        assert error["level"] == "error" and "mongodb" in error["msg"] and error["error"] == "ConfigError"
    finally:
        for h in [h for h in logging.getLogger().handlers if h.get_name() == "neardup"]:
            logging.getLogger().removeHandler(h)


# -- docker: Prometheus and Grafana ---------------------------------------------------------------------------


def exposed_names() -> set[str]:
    """Sample names of a worker's /metrics once every family has samples."""
    metrics = WorkerMetrics()
    metrics.count(["in"], ["dead"], ["invalid_json"])
    metrics.count(["in", "in"], ["unique", "duplicate"], [None, None])
    metrics.count(["in"], ["unchecked"], [None])
    metrics.lag({("in", 0): 3})
    metrics.index_stats({"entries": 1})
    metrics.redis_seconds.labels("lookup").observe(0.001)
    metrics.index_state(1, 1, down=False)
    return {s.name for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}


def test_prometheus_grafana_and_compose_configs_fit_the_worker() -> None:
    prom = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    (job,) = [j for j in prom["scrape_configs"] if j["job_name"] == "neardup"]
    assert job["static_configs"][0]["targets"] == ["neardup:9464"]

    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    assert services["neardup"]["environment"]["NEARDUP_METRICS_HOST"] == "0.0.0.0"
    assert {"prometheus", "grafana"} <= set(services)
    for service in ("prometheus", "grafana"):
        for volume in services[service].get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DOCKER / source).exists(), volume

    provisioning = DOCKER / "grafana" / "provisioning"
    datasources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    assert datasources["datasources"][0]["url"] == "http://prometheus:9090"
    dashboards = yaml.safe_load((provisioning / "dashboards" / "neardup.yml").read_text())
    assert dashboards["providers"][0]["options"]["path"]
    dashboard = json.loads((DOCKER / "grafana" / "dashboards" / "neardup.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 8
    used = {n for e in exprs for n in re.findall(r"\bneardup_[a-z_]+\b", e)}
    assert used and used <= exposed_names(), used - exposed_names()
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
