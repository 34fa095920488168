"""End to end: a slice of the eval stream through Kafka → `neardup serve` (subprocess, Redis index) → Kafka."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from bench.kafka_support import outputs, produce, redis_namespace, reference_verdicts, settings_for
from stream.config import Settings
from stream.kafka_tools import KafkaRecord, ensure_topics, read_topics
from stream.runner import Routed

pytestmark = [pytest.mark.services, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[1]
# CI clones the repository with shared/ beside it: <parent>/shared/eval/stream.jsonl.
EVAL_STREAM = Path(__file__).resolve().parents[2] / "shared" / "eval" / "stream.jsonl"
SAMPLE = Path(__file__).resolve().parent / "data" / "sample.jsonl"
LIMIT = 2000
# Records no filter can read, spliced in at these positions: they must reach the dead-letter topic.
BAD = {17: b"\xff\xfe not UTF-8", 901: b'{"id": "no-text-here"}', 1503: b"[1, 2, 3]"}


def stream_slice() -> list[bytes]:
    path = EVAL_STREAM if EVAL_STREAM.is_file() else SAMPLE
    lines: list[bytes] = []
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                lines.append(line.rstrip(b"\r\n"))
            if len(lines) >= LIMIT:
                break
    for position, bad in sorted(BAD.items()):
        if position <= len(lines):
            lines.insert(position, bad)
    return lines


@pytest.fixture
def index_url(redis_url: str) -> Iterator[str]:
    with redis_namespace(redis_url) as url:
        yield url


def serve_env(settings: Settings) -> dict[str, str]:
    """The worker's settings as NEARDUP_* variables (the subprocess also proves the env layer)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEARDUP_") or k.startswith("NEARDUP_TEST_")}
    env.update({k: v for k, v in settings.env().items() if not k.endswith("PASSWORD")})
    env["NEARDUP_INDEX"] = settings.index
    env["PYTHONPATH"] = str(REPO)
    return env


def start_serve(settings: Settings, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "stream.commands", "serve", *extra], cwd=REPO,
                            env=serve_env(settings), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def alive(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        _, err = proc.communicate()
        raise AssertionError(f"serve exited {proc.returncode}: {err.decode()[-3000:]}")


async def until_every_source(settings: Settings, count: int, timeout: float) -> list[KafkaRecord]:
    """Output records until `count` distinct inputs are among them (re-read batches add copies)."""
    got: list[KafkaRecord] = []
    sources: set[bytes | None] = set()
    async for record in read_topics(settings, settings.output_topics, deadline=time.monotonic() + timeout):
        got.append(record)
        sources.add(record.header("neardup-source"))
        if len(sources) >= count:
            break
    assert len(sources) == count, f"{len(sources)} of {count} inputs routed"
    return got


def serve_until_every_source(settings: Settings, count: int) -> tuple[list[KafkaRecord], int | None, str]:
    """A fresh `neardup serve` until every source record has an output, then stopped: (outputs, exit code,
    stderr)."""
    proc = start_serve(settings)
    try:
        got = asyncio.run(until_every_source(settings, count, timeout=30))
        alive(proc)
    finally:
        err = stop(proc)
    return got, proc.returncode, err


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> str:
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"serve did not stop on signal {sig}: {err.decode()[-3000:]}") from None
    return err.decode()


def expected(ref: Routed) -> tuple[str, str, str | None]:
    if ref.kind == "rejected":
        assert ref.error is not None
        return "rejected", ref.error.reason, None
    assert ref.verdict is not None
    return ref.kind, ref.verdict.id, ref.verdict.duplicate_of


def observed(r: KafkaRecord, settings: Settings) -> tuple[str, str, str | None]:
    kind = {settings.unique_topic: "unique", settings.duplicate_topic: "duplicate",
            settings.dead_letter_topic: "rejected"}[r.topic]
    assert (r.header("neardup-verdict") or b"").decode() == kind
    if kind == "rejected":
        return kind, (r.header("neardup-reason") or b"").decode(), None
    dup_of = r.header("neardup-duplicate-of")
    return kind, (r.header("neardup-id") or b"").decode(), dup_of.decode() if dup_of is not None else None


def check_against_reference(got: Sequence[KafkaRecord], lines: Sequence[bytes], settings: Settings,
                            *, exactly_once: bool) -> Counter[str]:
    topic = settings.input_topics[0]
    reference = reference_verdicts(lines, settings, topic)
    seen: Counter[str] = Counter()
    mismatches = []
    for r in got:
        source = (r.header("neardup-source") or b"").decode()
        seen[source] += 1
        _, _, offset = source.rpartition("/")
        assert r.value == lines[int(offset)]  # value passed through unchanged
        if observed(r, settings) != expected(reference[source]):
            mismatches.append((source, observed(r, settings), expected(reference[source])))
    assert not mismatches, f"{len(mismatches)} verdicts differ from a single memory-index run: {mismatches[:5]}"
    assert set(seen) == set(reference)  # every message made it out
    if exactly_once:
        assert max(seen.values()) == 1
    return Counter(kind for kind, _, _ in map(expected, reference.values()))


def test_eval_slice_through_kafka_equals_the_embedded_filter(kafka_bootstrap: str, index_url: str) -> None:
    lines = stream_slice()
    settings = settings_for(kafka_bootstrap, index_url, id_field="id", ts_field="ts", max_batch=256)
    topic = settings.input_topics[0]

    async def load() -> None:
        await ensure_topics(settings, [topic, *settings.output_topics], partitions=1)
        await produce(settings, topic, [(None, line, ()) for line in lines])

    asyncio.run(load())
    proc = start_serve(settings)
    try:
        got = asyncio.run(outputs(settings, len(lines), timeout=8 + len(lines) / 200, settle=0.5))
        alive(proc)
    finally:
        err = stop(proc)
    assert proc.returncode == 0, err[-3000:]
    assert f"{len(lines)} routed" in err
    kinds = check_against_reference(got, lines, settings, exactly_once=True)
    assert len(got) == len(lines)
    assert kinds["duplicate"] > 0 and kinds["rejected"] == sum(p <= LIMIT for p in BAD)


def test_killed_mid_run_and_restarted_routes_everything(kafka_bootstrap: str, index_url: str) -> None:
    """SIGKILL (no graceful stop) while routing; the restarted worker re-reads what was not committed:
    every message comes out at least once, each copy with the single-run verdict."""
    lines = stream_slice()[:1000]
    # Static membership: the restarted worker takes the killed one's place without waiting for its session
    # to time out.
    settings = settings_for(kafka_bootstrap, index_url, id_field="id", ts_field="ts", max_batch=10,
                            group_instance_id="worker-1")
    topic = settings.input_topics[0]
    asyncio.run(produce(settings, topic, [(None, line, ()) for line in lines]))

    proc = start_serve(settings)
    try:
        early = asyncio.run(outputs(settings, 1, timeout=30))
        alive(proc)
        assert early, "no output before the kill"
    finally:
        proc.kill()
        proc.communicate()
    first = asyncio.run(outputs(settings, len(lines), timeout=1))
    assert 0 < len(first) < len(lines), "the worker was not killed mid-run"

    got, returncode, err = serve_until_every_source(settings, len(lines))
    assert returncode == 0, err[-3000:]
    check_against_reference(got, lines, settings, exactly_once=False)


def test_sigterm_mid_run_finishes_the_batch_and_commits(kafka_bootstrap: str, index_url: str) -> None:
    """A graceful stop delivers and commits what was routed: after a restart nothing comes out twice."""
    lines = stream_slice()[:1000]
    settings = settings_for(kafka_bootstrap, index_url, id_field="id", ts_field="ts", max_batch=10,
                            group_instance_id="worker-1")
    asyncio.run(produce(settings, settings.input_topics[0], [(None, line, ()) for line in lines]))
    proc = start_serve(settings)
    try:
        assert asyncio.run(outputs(settings, 1, timeout=30))
        alive(proc)
    finally:
        err = stop(proc)
    assert proc.returncode == 0, err[-3000:]
    first = asyncio.run(outputs(settings, len(lines), timeout=1))
    assert 0 < len(first) < len(lines), "the worker was not stopped mid-run"

    got, _, _ = serve_until_every_source(settings, len(lines))
    check_against_reference(got, lines, settings, exactly_once=True)
