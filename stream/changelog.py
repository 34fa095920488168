"""The index changelog: every entry of the shared index is also in a Kafka record, so an index that lost its data is rebuilt.

Kafka is the truth, Redis the cache (as Kafka Streams backs each state store with a changelog topic):

- `Journal` wraps the index's door (`decide`) and keeps, for each decided batch, the entries it made unique
  (inserted, or found under their own id: a replay); the worker sends them to the changelog topic with the
  batch's outputs: in the same transaction under exactly-once, acknowledged before the commit otherwise.
  Entries of an aborted transaction never reach a `read_committed` reader of the changelog; the records
  that made them are decided again (as replays: the same verdict) and journaled then.
- `IndexGuard` sets the marker of a fenced index (`MARKER` in its meta hash, filters/index/redis.py) once it
  holds the changelog's window. A missing marker means the index lost its data (a restart without
  persistence, a failover to an empty replica, an eviction, FLUSHALL) or was never built: the index
  refuses lookups and inserts (`IndexLost`), one worker of the group takes a lock and restores the window's
  entries from the changelog (`CandidateIndex.restore`), the others wait; the marker is set when the
  restore is complete, and routing resumes.

A changelog record holds the entries a routed batch made unique, column by column (`encode_records`, at most
RECORD_BYTES a record): few records to produce and to read, and the entries' stored bytes pass straight
into Redis on a restore. Key = the first entry's id; value (little-endian) =

    u8 format (2), 3 bytes zero, u32 entries n, u32 bucket keys k, u32 id bytes
    f64[n] event times, u64[k] bucket keys, u32[n] keys per entry, u32[n] id lengths, u32[n] entry lengths,
    the ids (UTF-8), the entries (`filters.index.redis_codec.encode_entry`, as the Redis index stores them)

Format 1 (one entry a record: u8 1, u32 number of keys, the keys, the entry) is still read. Header
`neardup-namespace` = the filter configuration's digest (records of another configuration are skipped:
their keys mean nothing to this one). Timestamps are the wall clock of writing, so the topic's time
retention (the window plus a margin) keeps what a restore needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import struct
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, Protocol, cast

import numpy as np

from filters.errors import IndexCorrupt, IndexLost
from filters.index import Batch, CandidateIndex, Entry, IndexWrapper, Stored, Verifier
from filters.index.redis_codec import ENTRY_MIN, VERSIONS, encode_entries, entry_time, join_stored, stored_of
from filters.records import Verdict

try:  # the compiled core's encoder of entries; absent when it could not be built at install time
    from filters._native import encode_entries as _encode_entries
except ImportError:  # pragma: no cover - exercised on machines without a compiler
    _encode_entries = encode_entries

log = logging.getLogger("neardup.changelog")

FORMAT = 2
NAMESPACE_HEADER = "neardup-namespace"
RECORD_BYTES = 512 * 1024  # a record's value at most (a single larger entry gets a record of its own)
_HEAD = struct.Struct("<B3xIII")  # format, entries, bucket keys, id bytes
_HEAD_1 = struct.Struct("<BI")  # format 1: format, number of bucket keys
_F64, _U64, _U32 = np.dtype("<f8"), np.dtype("<u8"), np.dtype("<u4")
MARKER_LUA = resources.files("stream").joinpath("lua/marker.lua").read_text(encoding="utf-8")
RESTORE_CHUNK = 65536  # entries handed to `CandidateIndex.restore` at once
LOCK_TTL = 15.0  # seconds a restorer's lock lives unless it is refreshed (a dead restorer's lock expires)
PROGRESS_EVERY = 500_000  # entries read between two progress lines of a restore


def encode_records(made: Sequence[tuple[Entry, Sequence[int]]]) -> list[tuple[bytes, bytes]]:
    """The changelog records (key, value) of the entries a batch made unique, in order."""
    if not made:
        return []
    stored = stored_of(made, _encode_entries)
    ids = [id.encode("utf-8", "surrogatepass") for id in stored.ids]
    counts = np.diff(stored.bounds)
    id_lens = np.fromiter(map(len, ids), np.int64, len(ids))
    blob_lens = np.fromiter(map(len, stored.blobs), np.int64, len(ids))
    sizes = 20 + 8 * counts + id_lens + blob_lens
    out = []
    at = 0
    while at < len(ids):
        # As many entries as fit in RECORD_BYTES, at least one.
        stop = at + max(1, int(np.searchsorted(np.cumsum(sizes[at:]), RECORD_BYTES - _HEAD.size, "right")))
        a, b = int(stored.bounds[at]), int(stored.bounds[stop])
        part_ids = ids[at:stop]
        value = b"".join([
            _HEAD.pack(FORMAT, stop - at, b - a, int(id_lens[at:stop].sum())),
            stored.times[at:stop].astype(_F64).tobytes(), stored.keys[a:b].astype(_U64).tobytes(),
            counts[at:stop].astype(_U32).tobytes(), id_lens[at:stop].astype(_U32).tobytes(),
            blob_lens[at:stop].astype(_U32).tobytes(), *part_ids, *stored.blobs[at:stop]])
        out.append((part_ids[0], value))
        at = stop
    return out


def decode_records(key: bytes, value: bytes) -> Stored:
    """The entries of a changelog record (`encode_records`, or format 1); `IndexCorrupt` on anything else."""
    where = key.decode("utf-8", "replace")
    if value[:1] == b"\x01":
        return _decode_one(key.decode("utf-8", "surrogatepass"), value)
    try:
        version, n, k, id_bytes = _HEAD.unpack_from(value)
    except struct.error as exc:
        raise IndexCorrupt(f"changelog record {where!r}: {len(value)} bytes are too short") from exc
    if version != FORMAT:
        raise IndexCorrupt(f"changelog record {where!r}: format {version}, this neardup reads 1 and {FORMAT}")
    at = _HEAD.size
    fixed = at + 8 * n + 8 * k + 12 * n
    if len(value) < fixed + id_bytes:
        raise IndexCorrupt(f"changelog record {where!r}: {len(value)} bytes where the header promises more")
    times = np.frombuffer(value, _F64, n, at).astype(np.float64)
    keys = np.frombuffer(value, _U64, k, at + 8 * n).astype(np.uint64)
    counts, id_lens, blob_lens = np.frombuffer(value, _U32, 3 * n, at + 8 * n + 8 * k).astype(np.int64).reshape(3, n)
    bounds = np.zeros(n + 1, np.int64)
    np.cumsum(counts, out=bounds[1:])
    id_ends = np.cumsum(id_lens) + fixed
    blob_ends = np.cumsum(blob_lens) + (fixed + id_bytes)
    if bounds[-1] != k or (n and (id_ends[-1] != fixed + id_bytes or blob_ends[-1] != len(value))) \
            or (n and blob_lens.min() < ENTRY_MIN):
        raise IndexCorrupt(f"changelog record {where!r}: its lengths do not add up")
    raw = np.frombuffer(value, np.uint8)
    if n and not np.isin(raw[blob_ends - blob_lens], VERSIONS).all():
        raise IndexCorrupt(f"changelog record {where!r}: an entry of another encoding than {VERSIONS}")
    id_list = id_ends.tolist()
    blob_list = blob_ends.tolist()
    starts = [fixed, *id_list[:-1]]
    ids = [value[a:b].decode("utf-8", "surrogatepass") for a, b in zip(starts, id_list)]
    blob_starts = [fixed + id_bytes, *blob_list[:-1]]
    return Stored(ids, times, bounds, keys, [value[a:b] for a, b in zip(blob_starts, blob_list)])


def entries_of(records: Sequence[tuple[bytes, bytes]]) -> Stored:
    """The entries of changelog records (key, value), in order."""
    return join_stored([decode_records(key, value) for key, value in records])


def _decode_one(id: str, value: bytes) -> Stored:
    """A format 1 record: one entry."""
    try:
        _, n = _HEAD_1.unpack_from(value)
    except struct.error as exc:
        raise IndexCorrupt(f"changelog record {id!r}: {len(value)} bytes are too short") from exc
    end = _HEAD_1.size + 8 * n
    if len(value) < end + ENTRY_MIN or value[end] not in VERSIONS:
        raise IndexCorrupt(f"changelog record {id!r}: {n} keys promised, {len(value)} bytes in all")
    blob = value[end:]
    return Stored([id], np.array([entry_time(blob, id)]), np.array([0, n], np.int64),
                  np.frombuffer(value, _U64, n, _HEAD_1.size).astype(np.uint64), [blob])


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


Write = Callable[[Stored], Awaitable[int]]  # takes a chunk of entries read (for `Restore`)
# Reads the changelog whole (what its retention keeps) and hands the entries, in chunks, to a `Write`.
ChangelogReader = Callable[[Write], Awaitable[int]]


class Restore(Protocol):
    """Writes entries into the index: `CandidateIndex.restore`."""

    def __call__(self, parts: Iterable[Stored], *, rebuild: bytes = b"") -> int: ...


class _Feed:
    """Chunks of entries from the changelog's reader (the event loop) to the restore (a thread), a few ahead."""

    _END = object()

    def __init__(self, ahead: int = 2) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(ahead)

    async def put(self, item: Any, consumer: asyncio.Future[int]) -> None:
        """Waits for room; raises what the restore raised if it stopped taking."""
        while True:
            if consumer.done():
                consumer.result()  # its error, if it failed
                if item is self._END:
                    return
                raise RuntimeError("the index's restore returned before the changelog was read")
            try:
                self._queue.put_nowait(item)
                return
            except queue.Full:
                await asyncio.sleep(0.002)

    def __iter__(self) -> Iterator[Stored]:
        while (item := self._queue.get()) is not self._END:
            yield item


async def restore_from(read: ChangelogReader, restore: Restore, progress: Callable[[int], None] = lambda n: None,
                       *, stamp: bytes) -> tuple[int, int]:
    """Reads the changelog (`read`) into `restore`, which runs in a thread meanwhile, chunk after chunk as they
    come (the index's restore sees the whole changelog in one call: it may keep what recurs until the end).
    A rebuild (`rebuild=stamp`, see `CandidateIndex.restore`): the caller holds the group's restore lock, or is
    alone. `progress` is told the entries read so far. Returns (entries read, entries written)."""
    feed = _Feed()
    writing = asyncio.ensure_future(asyncio.to_thread(restore, feed, rebuild=stamp))
    read_n = 0

    async def hand(entries: Stored) -> int:
        nonlocal read_n
        await feed.put(entries, writing)
        read_n += len(entries)
        progress(read_n)
        return len(entries)

    try:
        await read(hand)
        await feed.put(_Feed._END, writing)
    except BaseException:
        if not writing.done():
            with contextlib.suppress(BaseException):
                await feed.put(_Feed._END, writing)
                await writing
        raise
    return read_n, await writing


class IndexGuard:
    """The marker that says the shared index holds the changelog's window, and the restore when it does not."""

    def __init__(self, url: str, *, namespace: str, window: float, member: str = "") -> None:
        import redis.asyncio as aioredis
        from redis.asyncio.cluster import RedisCluster

        from filters.index.backends import marker_keys
        from filters.index.redis import RedisTarget, redact_url

        target = RedisTarget.parse(url)
        self.where = redact_url(url)
        self.metas = marker_keys(url, namespace)  # one, or on the spread layout one a shard
        self.meta = self.metas[0]
        self.lock = f"{{{target.prefix}:{namespace}}}:restoring"
        self.member = member or uuid.uuid4().hex[:12]
        self.ttl_ms = max(1, round((window + target.grace) * 1000))  # as long as the index's own keys
        options: dict[str, Any] = {"decode_responses": False, "socket_timeout": 5.0, "socket_connect_timeout": 5.0}
        self._client = (RedisCluster.from_url(target.client_url, **options) if target.cluster
                        else aioredis.Redis.from_url(target.client_url, **options))
        self.restoring = False
        self.losses = 0  # times the marker was found missing
        self.restored_entries = 0
        self.restore_read = 0  # entries of the changelog the restore going on has read so far (its progress)
        self.last: Restored | None = None
        self.epoch: bytes | None = None  # the marker this worker last found (or set)

    async def marker(self) -> bytes | None:
        """The index's marker (None: missing, from any of its meta hashes, or not the same in all)."""
        from filters.index.redis import MARKER, one_marker, redis_errors

        with redis_errors(self.where):
            async with self._client.pipeline(transaction=False) as pipe:  # (on a cluster: a pipeline a node)
                for meta in self.metas:
                    pipe.hget(meta, MARKER)
                return one_marker(cast("list[bytes | None]", await pipe.execute()))

    async def intact(self) -> bool:
        """Whether the index holds its marker."""
        return await self.marker() is not None

    async def ensure(self, read: ChangelogReader, write: Restore,
                     before: Callable[[], Awaitable[None]] | None = None) -> bool:
        """False if the marker is there, as this worker last found it; else the index is restored from the
        changelog (`read`, `write`) by this worker or by another of the group (then this one waits for it),
        the marker set, and True. `before` runs first when the marker is missing (the worker delivers what it
        routed). True too, after `before`, when another worker rebuilt the index since this one last looked:
        that rebuild may have read the changelog before this worker committed its last batches, whose entries
        it then writes back (so does a worker that waited for a rebuild)."""
        marker = await self.marker()
        if marker is not None:
            known, self.epoch = self.epoch, marker
            if known is None or known == marker:
                return False
            self.losses += 1
            log.warning("the index at %s was rebuilt by another worker since this one last looked; writing back "
                        "what this worker routed meanwhile", self.where)
            if before is not None:
                await before()
            return True
        self.losses += 1
        self.restoring = True
        try:
            log.warning("the index at %s holds no marker of this window (%s %s%s): its data was lost or never "
                        "built; rebuilding it from the changelog before routing on", self.where, self.meta, "epoch",
                        f" and {len(self.metas) - 1} more" if len(self.metas) > 1 else "")
            if before is not None:
                await before()
            await self._restore_or_wait(read, write)
            return True
        finally:
            self.restoring = False

    async def _restore_or_wait(self, read: ChangelogReader, write: Restore) -> Restored | None:
        from filters.index.redis import MARKER, STAMP, redis_errors

        lock_ms = round(LOCK_TTL * 1000)
        while True:
            marker = await self.marker()
            if marker is not None:
                self.epoch = marker
                log.info("the index was rebuilt by another worker; routing on")
                return None
            with redis_errors(self.where):
                got = await self._client.set(self.lock, self.member.encode(), nx=True, px=lock_ms)
            if got:
                break
            await asyncio.sleep(0.1)
        t0 = time.monotonic()
        refresh = asyncio.ensure_future(self._keep_lock(lock_ms))
        told = [0]

        def progress(n: int) -> None:
            self.restore_read = n
            if n >= told[0] + PROGRESS_EVERY:
                told[0] = n
                log.info("rebuilding the index from the changelog: %d entries read in %.1fs", n, time.monotonic() - t0)

        stamp = uuid.uuid4().hex[:12].encode()
        try:
            # Every meta hash stamped before the rebuild writes: the marker is set only where the stamp still is.
            with redis_errors(self.where):
                async with self._client.pipeline(transaction=False) as pipe:
                    for meta in self.metas:
                        pipe.hset(meta, STAMP, stamp)
                        pipe.pexpire(meta, self.ttl_ms)
                    await pipe.execute()
            read_n, written = await restore_from(read, write, progress, stamp=stamp)
        except Exception:
            # Let the lock go at once: this worker's retry, and the others, would wait out LOCK_TTL for it.
            with contextlib.suppress(Exception):
                await self._release_lock()
            raise
        finally:
            refresh.cancel()
            self.restore_read = 0
        self.restored_entries += written
        epoch = uuid.uuid4().hex[:12].encode()
        try:
            with redis_errors(self.where):
                # Only where the stamp still is (stream/lua/marker.lua), in one round trip per node: a master that
                # restarted just now has no script loaded, so EVAL (300 bytes) rather than EVALSHA and a reload.
                async with self._client.pipeline(transaction=False) as pipe:
                    for meta in self.metas:
                        pipe.eval(MARKER_LUA, 1, meta, STAMP, stamp, MARKER, epoch, self.ttl_ms)
                    set_ = await pipe.execute()
        finally:
            with contextlib.suppress(Exception):
                await self._release_lock()
        if not all(set_):
            lost = len(self.metas) - sum(map(int, set_))
            raise IndexLost(f"the index at {self.where} lost data while it was rebuilt ({lost} of its {len(self.metas)} "
                            "meta hashes no longer hold the rebuild's stamp): rebuilding again")
        self.epoch = epoch
        done = Restored(read_n, written, time.monotonic() - t0)
        self.last = done
        log.info("index rebuilt from the changelog: %d entries read, %d written, in %.1fs", done.read, done.written,
                 done.seconds)
        return done

    async def _release_lock(self) -> None:
        """Deletes the restore lock if this worker holds it."""
        if await self._client.get(self.lock) == self.member.encode():
            await self._client.delete(self.lock)

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
                         write: Write) -> int:
    """Reads `partitions` of `topic` from `since_ms` (wall clock) to their end, as a `read_committed`
    `consumer` (started, in no group) sees it, and hands the entries of `namespace` to `write` in chunks
    of about RESTORE_CHUNK, in the order they were journaled: the partitions merged by their records'
    timestamps, the lowest head first (as Kafka Streams restores and processes), each partition in its own
    order. A restore gives its entries seqs in the order it gets them, and a full bucket keeps the newest:
    read in another order, it would keep other representatives. The end is taken again once reached, until
    a pass finds nothing new. Returns the number of entries read."""
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
    parts: list[Stored] = []
    held = 0
    heads: dict[Any, deque[tuple[int, Stored]]] = {tp: deque() for tp in tps}  # per partition: (timestamp, entries) read

    async def hand() -> None:
        nonlocal parts, held, read
        entries = join_stored(parts)
        parts, held = [], 0
        read += len(entries)
        await write(entries)

    def merged(remaining: set[Any]) -> None:
        """Moves records to `parts`, the lowest timestamp first, while no partition still being read has
        none waiting (its next record could be the lowest)."""
        nonlocal held
        while not any(not heads[tp] for tp in remaining):
            waiting = [(q[0][0], tp.partition, tp) for tp, q in heads.items() if q]
            if not waiting:
                return
            _, _, tp = min(waiting)
            part = heads[tp].popleft()[1]
            parts.append(part)
            held += len(part)

    for _ in range(10):  # passes: until the end stops moving
        remaining = {tp for tp in tps if await consumer.position(tp) < ends[tp]}
        if not remaining:
            break
        while remaining:
            fetched = await consumer.getmany(*remaining, timeout_ms=200, max_records=2_000)
            for tp, msgs in fetched.items():
                # (Records past the end taken are kept: the position moves past them, and the next pass, which
                # reads from the end taken again, would never see them.)
                for m in msgs:
                    if m.key is None or m.value is None:
                        continue
                    if dict(m.headers or ()).get(NAMESPACE_HEADER) != wanted:
                        continue
                    heads[tp].append((m.timestamp, decode_records(m.key, m.value)))
            for tp in list(remaining):
                if await consumer.position(tp) >= ends[tp]:
                    remaining.discard(tp)
            merged(remaining)
            if held >= RESTORE_CHUNK:
                await hand()
        newer = await consumer.end_offsets(tps)
        if newer == ends:
            break
        ends = newer
    merged(set())
    if parts:
        await hand()
    return read
