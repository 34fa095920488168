"""The index changelog: every entry of the shared index is also a Kafka record, so an index that lost its data is rebuilt.

Kafka is the truth, Redis the cache (as Kafka Streams backs each state store with a changelog topic):

- `Journal` wraps the index's door (`decide`) and keeps, for each decided batch, the entries it made unique
  (inserted, or found under their own id: a replay); the worker sends them to the changelog topic with the
  batch's outputs: in the same transaction under exactly-once, acknowledged before the commit otherwise.
  Entries of an aborted transaction never reach a `read_committed` reader of the changelog; the records
  that made them are decided again (as replays: the same verdict) and journaled then.
- `IndexGuard` keeps a marker key beside the index (`{prefix:namespace}:epoch`, with the index's TTL). A
  missing marker means the index lost its data (a restart without persistence, a failover to an empty
  replica, an eviction, FLUSHALL) or was never built: one worker of the group takes a lock and restores
  the window's entries from the changelog (`CandidateIndex.restore`, pipelined), the others wait; the
  marker is set when the restore is complete, and routing resumes.

A changelog record: key = the entry's id (UTF-8), value = `encode_record` (format byte, the number of
bucket keys, the keys as u64 little-endian, then the index's own entry encoding), header
`neardup-namespace` = the filter configuration's digest (records of another configuration are skipped:
their keys mean nothing to this one). Timestamps are the wall clock of writing, so the topic's
time retention (the window plus a margin) keeps what a restore needs.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from filters.errors import IndexCorrupt
from filters.index import Batch, CandidateIndex, Entry, IndexWrapper, Verifier
from filters.index.redis_codec import decode_entry, encode_entry
from filters.records import Verdict

log = logging.getLogger("neardup.changelog")

FORMAT = 1
NAMESPACE_HEADER = "neardup-namespace"
_HEAD = struct.Struct("<BI")  # format, number of bucket keys
_KEYS = np.dtype("<u8")
RESTORE_CHUNK = 4096  # entries handed to `CandidateIndex.restore` at once
LOCK_TTL = 15.0  # seconds a restorer's lock lives unless it is refreshed (a dead restorer's lock expires)


def encode_record(entry: Entry, keys: Sequence[int]) -> bytes:
    """A changelog record's value: the entry's bucket keys and its encoding in the index."""
    return b"".join((_HEAD.pack(FORMAT, len(keys)), np.asarray(keys, dtype=_KEYS).tobytes(), encode_entry(entry)))


def decode_record(id: str, value: bytes) -> tuple[Entry, tuple[int, ...]]:
    """The inverse of `encode_record`; raises `IndexCorrupt` on anything it did not write."""
    try:
        version, n = _HEAD.unpack_from(value)
    except struct.error as exc:
        raise IndexCorrupt(f"changelog record {id!r}: {len(value)} bytes are too short") from exc
    if version != FORMAT:
        raise IndexCorrupt(f"changelog record {id!r}: format {version}, this neardup reads {FORMAT}")
    end = _HEAD.size + 8 * n
    if len(value) < end:
        raise IndexCorrupt(f"changelog record {id!r}: {n} keys promised, {len(value)} bytes in all")
    keys = tuple(np.frombuffer(value, _KEYS, n, _HEAD.size).tolist())
    return decode_entry(value[end:], id), keys


class Journal(IndexWrapper):
    """A `CandidateIndex` that notes what each decided batch made unique (`take`), for the changelog.

    It wraps the door: the batch goes to the inner index whole. A shared index is decided from
    fingerprints (`compiled_table` is False), whose keys and entry the changelog needs; an index deciding
    batches in a compiled table of its own process (memory://) needs no changelog."""

    def __init__(self, inner: CandidateIndex) -> None:
        if inner.compiled_table:
            raise ValueError("the changelog journals a shared index (decided from fingerprints)")
        super().__init__(inner)
        self._made: list[tuple[Entry, tuple[int, ...]]] = []

    def decide(self, batch: Batch, verifier: Verifier) -> list[Verdict]:
        verdicts = self.inner.decide(batch, verifier)
        made = self._made
        for msg, fp, verdict in zip(batch.messages, batch.prepared, verdicts, strict=True):
            if not verdict.duplicate:
                made.append((Entry.of(msg.id, msg.ts, fp), fp.keys))
        return verdicts

    def take(self) -> list[tuple[Entry, tuple[int, ...]]]:
        """The entries made unique since the last `take`, in order."""
        made, self._made = self._made, []
        return made


@dataclass(frozen=True, slots=True)
class Restored:
    """What a restore did: entries read from the changelog, written to the index, and how long it took."""

    read: int
    written: int
    seconds: float


# Reads the changelog whole (what its retention keeps) and hands the entries, in chunks, to `write`.
ChangelogReader = Callable[[Callable[[list[tuple[Entry, tuple[int, ...]]]], Awaitable[int]]], Awaitable[int]]


class IndexGuard:
    """The marker that says the shared index holds the changelog's window, and the restore when it does not."""

    def __init__(self, url: str, *, namespace: str, window: float, member: str = "") -> None:
        import redis.asyncio as aioredis
        from redis.asyncio.cluster import RedisCluster

        from filters.index.redis import RedisTarget, redact_url

        target = RedisTarget.parse(url)
        self.where = redact_url(url)
        tag = f"{{{target.prefix}:{namespace}}}"
        self.marker = f"{tag}:epoch"
        self.lock = f"{tag}:restoring"
        self.member = member or uuid.uuid4().hex[:12]
        self.ttl_ms = max(1, round((window + target.grace) * 1000))  # as long as the index's own keys
        options: dict[str, Any] = {"decode_responses": False, "socket_timeout": 5.0, "socket_connect_timeout": 5.0}
        self._client = (RedisCluster.from_url(target.client_url, **options) if target.cluster
                        else aioredis.Redis.from_url(target.client_url, **options))
        self.restoring = False
        self.losses = 0  # times the marker was found missing
        self.restored_entries = 0
        self.last: Restored | None = None

    async def intact(self) -> bool:
        """Whether the marker is there (its TTL renewed: it lives as long as the index's keys)."""
        from filters.index.redis import redis_errors

        with redis_errors(self.where):
            return bool(await self._client.pexpire(self.marker, self.ttl_ms))

    async def ensure(self, read: ChangelogReader, write: Callable[[list[tuple[Entry, tuple[int, ...]]]], int],
                     before: Callable[[], Awaitable[None]] | None = None) -> Restored | None:
        """Nothing if the marker is there; else the index is restored from the changelog (`read`, `write`)
        by this worker or by another of the group (then this one waits for it), and the marker set.
        `before` runs first when the marker is missing (the worker delivers what it routed)."""
        if await self.intact():
            return None
        self.losses += 1
        self.restoring = True
        try:
            log.warning("the index at %s holds no marker of this window (%s): its data was lost or never built; "
                        "rebuilding it from the changelog before routing on", self.where, self.marker)
            if before is not None:
                await before()
            return await self._restore_or_wait(read, write)
        finally:
            self.restoring = False

    async def _restore_or_wait(self, read: ChangelogReader,
                               write: Callable[[list[tuple[Entry, tuple[int, ...]]]], int]) -> Restored | None:
        from filters.index.redis import redis_errors

        lock_ms = round(LOCK_TTL * 1000)
        while True:
            with redis_errors(self.where):
                if await self._client.exists(self.marker):
                    log.info("the index was rebuilt by another worker; routing on")
                    return None
                got = await self._client.set(self.lock, self.member.encode(), nx=True, px=lock_ms)
            if got:
                break
            await asyncio.sleep(0.1)
        t0 = time.monotonic()
        refresh = asyncio.ensure_future(self._keep_lock(lock_ms))
        written = 0

        async def chunk(entries: list[tuple[Entry, tuple[int, ...]]]) -> int:
            nonlocal written
            n = await asyncio.to_thread(write, entries)
            written += n
            self.restored_entries += n
            return n

        try:
            read_n = await read(chunk)
        finally:
            refresh.cancel()
        with redis_errors(self.where):
            epoch = uuid.uuid4().hex[:12].encode()
            await self._client.set(self.marker, epoch, px=self.ttl_ms)
            if await self._client.get(self.lock) == self.member.encode():
                await self._client.delete(self.lock)
        done = Restored(read_n, written, time.monotonic() - t0)
        self.last = done
        log.info("index rebuilt from the changelog: %d entries read, %d written, in %.1fs", done.read, done.written,
                 done.seconds)
        return done

    async def _keep_lock(self, lock_ms: int) -> None:
        while True:
            await asyncio.sleep(LOCK_TTL / 3)
            try:
                await self._client.pexpire(self.lock, lock_ms)
            except Exception as exc:  # the restore itself reports an unavailable index
                log.debug("could not refresh the restore lock: %r", exc)

    async def close(self) -> None:
        await self._client.aclose()


RETENTION_MARGIN = 3600.0  # seconds the changelog keeps beyond the window (a restore reads that far back)


def retention(window: float) -> float:
    """How long (wall clock) the changelog keeps an entry, and how far back a restore reads."""
    return window + RETENTION_MARGIN


async def read_changelog(consumer: Any, topic: str, partitions: Sequence[int], namespace: str, since_ms: int,
                         write: Callable[[list[tuple[Entry, tuple[int, ...]]]], Awaitable[int]]) -> int:
    """Reads `partitions` of `topic` from `since_ms` (wall clock) to their end, as a `read_committed`
    `consumer` (started, in no group) sees it, and hands the entries of `namespace` to `write` in chunks,
    one write overlapping the next read. The end is taken again once reached, until a pass finds nothing
    new: workers that noticed the loss later deliver what they routed before it meanwhile. Returns the
    number of entries read."""
    from aiokafka import TopicPartition

    tps = [TopicPartition(topic, p) for p in partitions]
    if not tps:
        return 0
    consumer.assign(tps)
    starts = await consumer.offsets_for_times(dict.fromkeys(tps, since_ms))
    ends = await consumer.end_offsets(tps)
    for tp in tps:
        start = starts.get(tp)
        consumer.seek(tp, start.offset if start is not None else ends[tp])
    wanted = namespace.encode()
    read = 0
    chunk: list[tuple[Entry, tuple[int, ...]]] = []
    writing: asyncio.Future[int] | None = None

    async def hand(entries: list[tuple[Entry, tuple[int, ...]]]) -> None:
        nonlocal writing
        if writing is not None:
            await writing
        writing = asyncio.ensure_future(write(entries))

    for _ in range(10):  # passes: until the end stops moving
        remaining = {tp for tp in tps if await consumer.position(tp) < ends[tp]}
        if not remaining:
            break
        while remaining:
            fetched = await consumer.getmany(*remaining, timeout_ms=200, max_records=20_000)
            for tp, msgs in fetched.items():
                end = ends[tp]
                for m in msgs:
                    if m.offset >= end or m.key is None or m.value is None:
                        continue
                    if dict(m.headers or ()).get(NAMESPACE_HEADER) != wanted:
                        continue
                    chunk.append(decode_record(m.key.decode("utf-8", "surrogatepass"), m.value))
            for tp in list(remaining):
                if await consumer.position(tp) >= ends[tp]:
                    remaining.discard(tp)
            if len(chunk) >= RESTORE_CHUNK:
                read += len(chunk)
                await hand(chunk)
                chunk = []
        newer = await consumer.end_offsets(tps)
        if newer == ends:
            break
        ends = newer
    if chunk:
        read += len(chunk)
        await hand(chunk)
    if writing is not None:
        await writing
    return read
