"""The Redis candidate index: buckets and entries shared by many workers, with atomic check-and-insert.

Key layout (every key of one namespace carries the hash tag `{<prefix>:<namespace>}`):

    {p:ns}:meta     hash  seq = the last insert's sequence number, hwm = the highest event time inserted,
                          epoch = the marker of a changelogged index (see Fence)
    {p:ns}:s:<n>    hash  event-time slice n = floor(ts / window): the entries and bucket records whose
                          event time falls in it
                            e<id>   the entry, `encode_entry`
                            b<key>  bucket records, <key> the 64-bit bucket key as 8 bytes big-endian:
                                    <ts: f64 LE><id length: u32 LE><id: UTF-8><seq: u64 BE> each, in
                                    insertion order, so the value's last 8 bytes are its newest seq
                            d<id>   a duplicate's verdict (a memo), `encode_memo`: event time,
                                    similarity, method and the id it duplicates (a few tens of bytes)
                            n       how many entries were inserted into the slice (for `stats`)
                            m       how many memos were written into it (for `stats`)

Bucket keys (64-bit fingerprints) are field names, never scores or numbers: nothing here goes through a
double but event times. A lookup at event time T reads the slices from (T - window) to T: two. A slice
key's TTL is window + grace (wall clock) from its last write, and the insert script unlinks the slice
that fell wholly out of the window, so the index holds at most two windows of entries. What matches is
decided by event time: a message matches the records within the window of its own event time (of the
highest event time this instance decided, for a message that comes later than that), as the memory index
decides. Which slice may go is told by the window's clock: the newest event time stored, or, once a caller
sets it (`expire`), the caller's clock, which workers aligned in event time set to their group's low
watermark (stream/align.py), so that a worker running ahead never unlinks what one behind still needs.

Why this layout (bench/redis_bench.py, and measurements of the layouts that were tried; see README):
the earlier one, a sorted set per bucket, cost Redis ≈ 140 µs of CPU per short message, nearly all of
it `redis.call`s inside Lua (2–3 µs each, whatever they do: ZADD and PEXPIRE per bucket, ZRANGEBYSCORE
per bucket) and the Lua VM counting members. Here a lookup is no script at all: per slice, one HMGET of
every field the chunk's queries name (pipelined: one round trip), and the client counts, ranks and
caps; a second round trip reads the winners' entries (those the client did not keep: an entry never
changes once written, see `_entries`). An insert round is one script whose calls do not
grow with the number of buckets: one HMGET and one HSET per slice; the uncontended round (below) no
script at all, ≈ 25 µs of Redis CPU a short message in all (bench/redis_cpu.py).

Atomicity. The lookup is not one moment: it reads `seq` first, then the slices. What makes the index
safe is the insert: for each entry, the script compares the last 8 bytes (the newest seq) of each of
the entry's bucket fields, in every live slice, with what the caller saw at its lookup (plus what the
caller itself inserted since: its own inserts never conflict). Any difference means somebody else
inserted into one of its buckets since: the entry is not inserted and the caller gets it back as a
conflict; it then reads those buckets again (`RedisIndex.insert` does), verifies the new records'
entries, and either calls the message a duplicate or inserts again with what it saw now. Redis runs a
script to the end alone, so of two workers that looked up near-duplicates at the same moment, the
second to insert always sees the first. Optimistic concurrency per bucket, like WATCH, without a retry
of the whole transaction. The common round, where nobody else inserted since the lookup, needs no
comparison: the caller computes the writes from what it read and sends them as a MULTI/EXEC transaction
on its own connection, guarded by a WATCH of the meta hash set just before the lookup read `seq` (any
insert by anybody writes the meta hash, so Redis refuses the transaction then, and the round goes
through the script). On Redis Cluster the same writes go through a script that compares `seq` instead.

Reading ahead (`prefetch`): the next batch's read can go out before this batch's transaction, so that
Redis reads while the client verifies. Its lookup then adds this batch's writes (computed here) to what
it read, which stands for a read right after the transaction as long as that transaction went through
under the WATCH armed before the read: nobody inserted in between. Anything else reads afresh.

Memos. A duplicate is not indexed, so a replay of it (after a crash, or an aborted transaction) would be
decided afresh, and differently if its representative left every shared bucket (the cap) or the window
meanwhile. So its verdict is remembered under `d<id>` in the slice of its event time (it expires with the
slice, and a lookup ignores one older than its window): the lookup reads `d<id>` beside `e<id>` in the same
HMGETs, and a live one is the verdict. They are written in the batch's insert round (inside its MULTI/EXEC,
or pipelined with the insert script), or, for a batch that inserts nothing, in a round trip of their own
(HSET, HINCRBY, PEXPIRE per slice: no reply to wait for but these); a verdict changed after a lost race
is written again. Always before `decide` returns: before the batch's outputs can be committed.

Fence. A changelogged index (`fenced=True`: `neardup serve` with its index changelog, stream/changelog.py)
is used only while the meta hash holds its marker (`epoch`, set when the index was built or rebuilt
from the changelog). Data lost (a restart without persistence, FLUSHALL, a failover to an empty
replica, an eviction) takes the meta hash, so the marker, with it. The lookup's first read of the
meta hash (`HMGET meta seq hwm epoch`: no extra command) raises `IndexLost` when it is missing, and
remembers it; an insert writes only while the marker is the one its lookup read: the MULTI/EXEC round
is guarded by the WATCH of the meta hash (a flush or a rebuild touches it), the scripts compare the
marker themselves, and a re-read after a conflict compares it too. So no batch is decided against an
empty index, and one whose lookup ran before the loss while its insert comes after (whether the index
is still empty or rebuilt meanwhile) is refused as a whole: nothing of it is written, and the worker
decides it again. Without a changelog (`neardup filter --index redis://`) nothing is fenced.

Bucket cap: a lookup keeps, per bucket, the `bucket_cap` newest records by (event time, seq) inside the
window (across slices: the newest of the union are among the newest of each); the insert script trims
a bucket field back to the cap once it holds about twice as many, so storage stays bounded.

Cluster. `redis+cluster://` / `rediss+cluster://` use `RedisCluster`. All keys of a namespace carry
the same hash tag, so each command and script runs on one slot: one namespace (one filter
configuration) lives on one master; different namespaces spread over the cluster. The insert script
declares only the meta key and builds the slice names from the prefix it is given (as BullMQ does).

Errors are mapped where they enter: unreachable, timed out, loading, failing over, out of memory →
`IndexUnavailable` (retriable); wrong password or missing permission → `ConfigError` (retrying cannot
help: the URL is wrong); anything else the server refuses, or data that does not decode →
`IndexCorrupt`. There is no retry loop here (the worker decides the policy), except that a script
the server does not know (NOSCRIPT, e.g. after a restart or failover) is loaded and run again.
"""

from __future__ import annotations

import hashlib
import math
import queue
import re
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from functools import partial
from importlib import resources
from itertools import chain, islice, pairwise
from pathlib import Path
from typing import Any, cast
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import mmh3
import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    AuthorizationError,
    BusyLoadingError,
    ClusterDownError,
    MasterDownError,
    NoPermissionError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.retry import Retry

try:  # redis-py's C protocol parser (the `redis` extra); packs commands too
    import hiredis
except ImportError:  # pragma: no cover - redis-py works without it, slower
    hiredis = None  # type: ignore[assignment]

from filters.errors import ConfigError, IndexCorrupt, IndexLost, IndexUnavailable, NeardupError, ServiceError
from filters.index import Batch, Candidate, Entry, Memo, Query, Stored, Verifier, finish, new_candidate, new_entry
from filters.index.redis_codec import (
    ABSENT,
    SEQ,
    alone_round,
    bloom_add,
    bloom_bits,
    bloom_has,
    bucket_commands,
    bucket_pairs,
    decode_entries,
    decode_entry,
    decode_memo,
    encode_entries,
    encode_entry,
    encode_memo,
    entry_time,
    field_of,
    gather_replies,
    id_field,
    memo_time,
    newest_records,
    overlay_writes,
    plan_fields,
    rank_lookup,
    rank_records,
    restore_accept,
    restore_round,
)
from filters.index.shared import SharedDecider
from filters.records import Verdict

try:  # the compiled core; absent when it could not be built at install time (no C++ compiler)
    import filters._native as _native
except ImportError:  # pragma: no cover - exercised on machines without a compiler
    _native = None

_HIREDIS: tuple[Any, Any] | None  # redis-py's hiredis parser and its "not enough data yet" (`read_replies`)
try:
    from redis._parsers import hiredis as _parsers

    _HIREDIS = (_parsers._HiredisParser, _parsers.NOT_ENOUGH_DATA)
except (ImportError, AttributeError):  # pragma: no cover - another redis-py: replies are read one by one
    _HIREDIS = None

_gather = _native.gather_replies if _native is not None else gather_replies

__all__ = [
    "INSERT_ALONE_LUA",
    "INSERT_LUA",
    "MARKER",
    "RedisIndex",
    "RedisTarget",
    "map_redis_error",
    "meta_key",
    "one_marker",
    "redact_url",
    "redis_errors",
]

DEFAULT_PREFIX = "neardup"
DEFAULT_GRACE = 3600.0  # seconds of wall clock that keys outlive the window
DEFAULT_ENTRY_CACHE = 16384  # entries (≈ 1 KB each, Python objects) a client keeps decoded: see `RedisIndex._entries`
# Messages a lookup and insert round takes at most (`?round=`): a larger batch is decided in parts of this many
# (`SharedDecider`), each part's read sent ahead (standalone Redis) while the one before is verified and
# inserted. Redis spends less a message on a round of 128 than on one of 512 (its transaction's `HSET`s and
# `EXEC` above all) though it sends more bytes, and the client's CPU stays the same: 128 measured 1.1-1.3 times
# the messages a second of whole batches of 512 to 2,000 on the development stream (docs/benchmarks.md), and
# 1.05-1.27 on Redis Cluster, where no read goes ahead. Each part costs its round trips: a Redis a millisecond
# away wants a larger round.
DEFAULT_ROUND = 128
INSERT_CHUNK = 512  # entries per insert script: bounds how long one script blocks the server
RESTORE_CHUNK = 4096  # entries per restore transaction: bounds how long one MULTI/EXEC blocks the server (≈ 50 ms)
RESTORE_ATTEMPTS = 3  # transactions refused (others wrote meanwhile) before a restore chunk goes through the script
REBUILD_CHUNK = 65536  # entries per round of a rebuild (no transaction: Redis serves others between its commands)
HOLD_RECORDS = 1 << 24  # bucket records a rebuild holds (16 bytes each) before it drops those no field keeps ...
FLUSH_FIELDS = 32768  # ... (and writes them if still more than half); bucket fields made at a time when written
HOLD_IDS = 1 << 22  # ids a rebuild knows (≈ 100 bytes each) before it reads them from the slices instead
LOOKUP_CHUNK = 256  # queries' worth of field names (up to 16 each) one HMGET reads: bounds a command's size
FIELDS_PER_HMGET = 16 * LOOKUP_CHUNK
FIELDS_PER_CALL = 2000  # fields per HMGET, pairs per HSET, inside the script (Lua's unpack stops near 8,000 values)
DEFAULT_SOCKET_TIMEOUT = 5.0  # without one, a stalled server would hang a worker forever
_MIN_TS = -float(2**52)  # event times must be above it
_MAX_SLICE = float(2**50)  # ... and less than this many slices (windows) from 0
_NAME = re.compile(r"[A-Za-z0-9_.:-]+")  # prefix and namespace: no glob or hash-tag characters
MARKER = "epoch"  # the meta hash's field a fenced index requires (see Fence)
STAMP = "rebuild"  # the meta hash's field a rebuild's stamp is in until the guard sets the marker (stream/changelog.py)


def one_marker(found: Sequence[bytes | None]) -> bytes | None:
    """The marker of an index whose meta hashes (one, or one a shard of the spread layout) hold `found`: None
    unless they all hold the same one (one without it lost its data, or a rebuild is setting them)."""
    return found[0] if found and found[0] is not None and all(m == found[0] for m in found) else None
REBUILDING = "rebuilding"  # the meta hash's field a rebuild sets until it wrote its bucket fields (`RedisIndex._rebuild`)
SPREAD_OPTIONS = ("shards", "claim_ttl")  # URL options of layout=spread (filters/index/redis_spread.py)


def meta_key(prefix: str, namespace: str) -> str:
    """The meta hash of a namespace: its seq, high-water mark and marker."""
    return f"{{{prefix}:{namespace}}}:meta"


# --- the insert scripts ----------------------------------------------------------------------------


def kept_ranking(name: str, reference: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
    """The compiled ranking `_native.<name>` bound to buffers an index keeps from lookup to lookup (`rank_scratch`:
    made afresh each lookup, they were grown and cleared each round); the Python `reference` without the core."""
    if _native is None:
        return reference
    return partial(getattr(_native, name), scratch=_native.rank_scratch())


def _lua(*names: str) -> str:
    """Scripts of filters/index/lua/ (package data), one after the other, with FIELDS_PER_CALL filled in."""
    sources = [resources.files("filters.index").joinpath("lua", name).read_text(encoding="utf-8") for name in names]
    return "\n".join(sources).replace("FIELDS_PER_CALL", str(FIELDS_PER_CALL))


INSERT_LUA = _lua("trim.lua", "insert_slices.lua", "insert.lua")

# The insert of a caller that nobody else inserted anything since its lookup: it read every field its
# batch writes, so it computed the writes itself (`RedisIndex._alone`), and this only checks that the
# namespace's seq and high-water mark are still what it saw, and writes. Same result as INSERT_LUA
# (tests/test_redis_index.py compares the stored bytes), a fraction of the server's work. On standalone
# Redis the same writes go as a MULTI/EXEC transaction guarded by WATCH instead (no Lua at all: about a
# third of the server's time per message went into moving arguments in and out of the Lua VM).
INSERT_ALONE_LUA = _lua("insert_alone.lua")


@dataclass(frozen=True, slots=True)
class _Script:
    """A Lua script run by its SHA1, as redis-py's `Script` does, but also inside our own pipelines."""

    source: str
    sha: str

    @classmethod
    def of(cls, source: str) -> _Script:
        return cls(source, hashlib.sha1(source.encode()).hexdigest())


_INSERT = _Script.of(INSERT_LUA)
_INSERT_ALONE = _Script.of(INSERT_ALONE_LUA)


# --- connection -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """What an index URL says: how to connect, and our own options taken out of its query string."""

    client_url: str  # the URL redis-py gets: our options removed, `+cluster` removed
    cluster: bool
    prefix: str
    grace: float
    entry_cache: int = DEFAULT_ENTRY_CACHE
    layout: str = "slot"  # "slot": a namespace is one hash tag; "spread": over many (filters/index/redis_spread.py);
    # "compact": the slot layout's records by seq in small hashes (filters/index/redis_compact.py); "group": its
    # records grouped in fields of the slice hash (filters/index/redis_group.py)
    spread: tuple[tuple[str, str], ...] = ()  # the spread layout's own options, checked there
    rate: float = 0.0  # layout=compact: messages a second a namespace expects (its first slice's size); 0: unsaid
    round_size: int = DEFAULT_ROUND  # `?round=`: messages a lookup and insert round takes at most (not layout=spread)

    @classmethod
    def parse(cls, url: str) -> RedisTarget:
        parts = urlsplit(url)
        scheme = parts.scheme
        cluster = scheme.endswith("+cluster")
        if cluster:
            scheme = scheme.removesuffix("+cluster")
        if scheme not in ("redis", "rediss", "unix"):
            raise ConfigError(f"not a Redis URL: {redact_url(url)}")
        query: list[tuple[str, str]] = []
        prefix, grace, entry_cache, layout, rate = DEFAULT_PREFIX, DEFAULT_GRACE, DEFAULT_ENTRY_CACHE, "slot", 0.0
        most: int | None = None
        spread: list[tuple[str, str]] = []
        for name, value in parse_qsl(parts.query, keep_blank_values=True):
            if name == "prefix":
                prefix = value
            elif name == "layout":
                if value not in ("slot", "spread", "compact", "group"):
                    raise ConfigError(f"layout must be slot, spread, compact or group, got {value!r}")
                layout = value
            elif name in SPREAD_OPTIONS:
                spread.append((name, value))
            elif name == "entry_cache":
                entry_cache = _count(name, value, "entries", 0)
            elif name == "round":
                most = _count(name, value, "messages", 1)
            elif name == "rate":
                try:
                    rate = float(value)
                except ValueError:
                    raise ConfigError(f"rate must be messages a second, got {value!r}") from None
                if not math.isfinite(rate) or rate <= 0:
                    raise ConfigError(f"rate must be > 0 messages a second, got {value!r}")
            elif name == "grace":
                try:
                    grace = float(value)
                except ValueError:
                    raise ConfigError(f"grace must be seconds, got {value!r}") from None
                if not math.isfinite(grace) or grace < 0:
                    raise ConfigError(f"grace must be >= 0 seconds, got {value!r}")
            else:
                query.append((name, value))
        if not _NAME.fullmatch(prefix):
            raise ConfigError(f"prefix must match {_NAME.pattern}, got {prefix!r}")
        if spread and layout != "spread":
            raise ConfigError(f"{', '.join(name for name, _ in spread)}: options of layout=spread only")
        if rate and layout not in ("compact", "group"):
            raise ConfigError("rate: an option of layout=compact and layout=group only")
        if most is not None and layout == "spread":
            raise ConfigError("round: an option of layout=slot, compact and group only")
        path = parts.path
        if cluster:
            if path.strip("/") not in ("", "0"):
                raise ConfigError(f"Redis Cluster has only database 0: {redact_url(url)}")
            path = ""
        client_url = urlunsplit((scheme, parts.netloc, path, urlencode(query), ""))
        return cls(client_url, cluster, prefix, grace, entry_cache, layout, tuple(spread), rate,
                   DEFAULT_ROUND if most is None else most)


def _count(name: str, value: str, unit: str, least: int) -> int:
    """A URL option's whole number of `unit`, at least `least`; `ConfigError` otherwise."""
    try:
        count = int(value)
    except ValueError:
        raise ConfigError(f"{name} must be a number of {unit}, got {value!r}") from None
    if count < least:
        raise ConfigError(f"{name} must be >= {least}, got {value!r}")
    return count


def redact_url(url: str) -> str:
    """`url` with its password replaced by `***`, fit for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


# Server replies that mean "not now" rather than "never": a worker may retry them later.
_UNAVAILABLE = (redis.ConnectionError, redis.TimeoutError, BusyLoadingError, ClusterDownError,
                MasterDownError, TryAgainError, ReadOnlyError, OutOfMemoryError, RedisClusterException)
_REFUSED = (AuthenticationError, AuthorizationError, AuthenticationWrongNumberOfArgsError,
            NoPermissionError)


def map_redis_error(exc: BaseException, where: str) -> NeardupError:
    """The neardup error for a redis-py error (raise it `from exc`); `where` names the server (`redact_url`).

    Refused credentials are a `ConfigError`, a server that is down, loading, failing over or out of
    memory is `IndexUnavailable` (retry later), any other error reply `IndexCorrupt`, the rest `ServiceError`.
    Shared by every Redis client of neardup (the index, the campaign view), so they fail alike."""
    detail = f"Redis index at {where}: {type(exc).__name__}: {exc}"
    if isinstance(exc, _REFUSED):  # before _UNAVAILABLE: AuthenticationError is a ConnectionError
        return ConfigError(f"{detail} (check the password/user in the index URL)")
    if isinstance(exc, _UNAVAILABLE):
        return IndexUnavailable(detail)
    if isinstance(exc, ResponseError):
        return IndexCorrupt(detail)
    return ServiceError(detail)


_REDIS_PY = str(Path(redis.__file__).parent)  # redis-py's own source files


def _reset_mid_command(exc: AttributeError) -> bool:
    """An attribute of None read inside redis-py itself: its asyncio connection reset while a command was being
    written leaves a writer (or reader) of None (redis/redis-py#3546, #4287), not a ConnectionError. (Any other
    error of redis-py that is not its own, a bad keyword of a URL's say, is not an outage.)"""
    if not str(exc).startswith("'NoneType' object has no attribute"):
        return False
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.startswith(_REDIS_PY)


@contextmanager
def redis_errors(where: str) -> Iterator[None]:
    """Maps redis-py's errors inside the block to the exception tree (`map_redis_error`), at the boundary."""
    try:
        yield
    except (RedisError, RedisClusterException) as exc:
        raise map_redis_error(exc, where) from exc
    except AttributeError as exc:
        if not _reset_mid_command(exc):
            raise  # neardup's own: a bug, not an outage
        raise IndexUnavailable(f"Redis index at {where}: the connection was reset mid-command "
                               f"({type(exc).__name__} in redis-py: {exc})") from exc


@dataclass(slots=True)
class _View:
    """What the caller's last lookup read, and what it inserted since: what its inserts are checked against.

    An entry's expected bucket tails (the newest seq of each bucket field, per slice read) are those its
    verification covered, plus the caller's own inserts since that were verified against the same read:
    such an insert succeeded only if nothing foreign had arrived in its buckets, so its seq is the
    exact new tail. Entries looked up together share the lookup's read (basis 0); one whose insert
    conflicted was verified again against a later read (basis: that read's seq, its tails in `reread`).
    An own insert of another basis may have let in what this entry never verified, so where one
    happened the entry expects its own read's tail: the check fails and it is verified again. Fields
    are known by their place in the read's columns.
    """

    slices: tuple[int, ...] = ()
    columns: dict[int, list[bytes | None]] = field(default_factory=dict)  # slice -> the value of each field read
    names: list[bytes] = field(default_factory=list)  # the fields read, in their places in a column
    mark: int = 0  # the namespace's seq when the lookup began: records above it may be unseen
    hwm: bytes = b""  # the namespace's high-water mark as stored then ('' if none)
    looked: dict[str, int] = field(default_factory=dict)  # the ids the lookup covered -> their query's number
    keys_of: list[tuple[int, ...]] = field(default_factory=list)  # per query: its keys (the very tuple)
    fields_of: list[list[bytes]] = field(default_factory=list)  # ... their field names
    places_of: list[list[int]] = field(default_factory=list)  # ... and places
    entry_places: list[int] = field(default_factory=list)  # ... and its entry field's place (its memo's: the next)
    inserted: int = 0  # how many the caller inserted since: seq is mark + inserted while it is alone
    written: dict[int, dict[int, bytes]] = field(default_factory=dict)  # slice -> place -> value (or its tail)
    bases: dict[int, dict[int, int]] = field(default_factory=dict)  # slice -> place -> basis of its writer
    own: set[int] = field(default_factory=set)  # seqs the caller inserted since
    reread: dict[str, tuple[int, dict[int, list[bytes]]]] = field(default_factory=dict)  # id -> (seq, slice -> tails)
    exact: bool = True  # `written` holds whole values (no insert went through INSERT_LUA since)
    watch: int = -1  # the pinned connection's epoch in which the read's WATCH of meta guards the view, or -1
    marker: bytes = b""  # a fenced index's marker as the lookup read it (its inserts require it)
    _at: dict[bytes, int] | None = None
    # Uncontended rounds' (seq, slice, places), whose places' basis (0) is recorded in `bases` when
    # first needed: only a later round of the same lookup reads it (a conflict, or another chunk).
    _unsettled: list[list[tuple[int, int, list[int]]]] = field(default_factory=list)

    def settle_tails(self) -> None:
        """For a layout whose uncontended rounds keep no bucket values in `written` (`GroupIndex`): the tail of
        each field those rounds wrote, the seq of the last entry written there (what its value ends with), put
        in `written` and its basis settled; before `expected` or `_inserted` reads them."""
        for written in self._unsettled:
            for seq, s, places in written:
                self.written.setdefault(s, {}).update(dict.fromkeys(places, SEQ.pack(seq)))
        self.settled_bases()

    def settled_bases(self) -> dict[int, dict[int, int]]:
        for written in self._unsettled:
            for _, s, places in written:
                self.bases.setdefault(s, {}).update(dict.fromkeys(places, 0))
        self._unsettled.clear()
        return self.bases

    @property
    def at(self) -> dict[bytes, int]:
        """Field -> its place in a column (made when first needed: an insert of an id not looked up)."""
        if self._at is None:
            self._at = {name: place for place, name in enumerate(self.names)}
        return self._at

    def basis(self, id: str) -> int:
        """What `id` was verified against: 0 the lookup, a seq a re-read, -1 nothing (not looked up)."""
        reread = self.reread.get(id)
        return reread[0] if reread is not None else 0 if id in self.looked else -1

    def expected(self, id: str, places: Sequence[int]) -> bytes:
        """The tails `id`'s insert expects, per slice read, per field: b"" for an id never looked up."""
        if id not in self.looked:
            return b""
        reread = self.reread.get(id)
        basis = self.basis(id)
        settled = self.settled_bases()
        parts: list[bytes] = []
        for s in self.slices:
            written, bases = self.written.get(s, {}), settled.get(s, {})
            column = self.columns.get(s)
            if reread is None and not written and column is not None:  # (the lookup's tails only: no call a field)
                parts += [(column[p] or b"")[-8:] or ABSENT for p in places]
                continue
            tails = reread[1].get(s) if reread is not None else None
            for j, p in enumerate(places):
                mine = written.get(p)
                if mine is not None and bases[p] == basis:
                    tail = mine[-8:]
                elif reread is not None:
                    tail = tails[j] if tails is not None else ABSENT
                else:
                    v = column[p] if column is not None else None
                    tail = v[-8:] if v else ABSENT
                parts.append(tail)
        return b"".join(parts)


@dataclass(slots=True)
class _SentRead:
    """A lookup's read sent ahead (`RedisIndex.prefetch`): the next batch's buckets, read while the client
    still verifies and inserts the batch in hand (`view`), whose writes it then lacks."""

    queries: Sequence[Query]  # the very list the lookup will be given
    names: list[bytes]
    key_fields: list[list[bytes]]
    positions: list[list[int]]
    id_places: list[int]
    slices: tuple[int, ...]
    epoch: int  # the pinned connection's epoch it was sent on: its replies are lost with it
    view: _View  # the batch in hand's view, which its inserts update
    pending: int  # replies not read yet (the next round trip reads them first)
    replies: list[Any] = field(default_factory=list)


@dataclass(slots=True)
class _HeldRound:
    """An insert round sent without reading its answer (`RedisIndex.insert_ahead`), until `settle` reads it."""

    view: _View  # the view of the lookup it was decided from, its writes kept in it
    epoch: int  # the pinned connection's epoch it was sent on
    pending: int  # replies not read yet
    seq: int  # the namespace's seq and high-water mark it leaves if nobody else writes right after
    stored: bytes
    view_hwm: bytes  # the view's high-water mark before it (restored if refused)
    before: _SentRead | None  # the read sent ahead before it (its replies come first)
    hwm_before: float  # the index's high-water mark when it was sent (restored if refused)
    # If refused: forgets what it left in the layout's keeping beside the view (its entries kept, ...).
    forget: Callable[[], None]
    replies: list[Any] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Memos:
    """Memos to write with the next round trip that writes (`RedisIndex.insert`): the commands, and
    (slice, id, value) of each, for the view of the lookup (a read sent ahead lacks them)."""

    commands: list[Sequence[str | int | bytes]]
    written: list[tuple[int, str, bytes]]


class RedisIndex:
    """`CandidateIndex` on Redis (standalone, TLS or Cluster), shared by any number of workers.

    One instance is used by one thread at a time (the engine's contract), except `stats`, which any
    thread may call meanwhile (it uses a pooled connection). It remembers what its last `lookup` read
    until the next one; `insert` of an id that lookup did not cover is a plain insert (like
    `MemoryIndex`: nothing to compare against).
    """

    def __init__(self, url: str, *, window: float, bucket_cap: int, namespace: str, fenced: bool = False) -> None:
        """`fenced`: lookups and inserts require the marker an index changelog keeps (see Fence)."""
        if not window > 0 or bucket_cap < 1:
            raise ConfigError("window must be > 0 seconds and bucket_cap >= 1")
        if not _NAME.fullmatch(namespace):
            raise ConfigError(f"namespace must match {_NAME.pattern}, got {namespace!r}")
        target = RedisTarget.parse(url)
        self.window = float(window)
        self.slice_length = self.window
        self.bucket_cap = bucket_cap
        self.namespace = namespace
        self.prefix = target.prefix
        self._where = redact_url(url)
        tag = f"{{{target.prefix}:{namespace}}}"
        self._meta = meta_key(target.prefix, namespace)
        self.fenced = fenced
        self._marker = b""  # the marker the last read of the meta hash found (fenced)
        self._spre = f"{tag}:s:"
        self._ttl_ms = max(1, round((self.window + target.grace) * 1000))
        self._hwm = -math.inf  # highest event time this instance decided (MemoryIndex's watermark)
        # The window's clock (`expire`): nothing older than it less the window will be looked for by anybody;
        # None until a caller sets it, and then the newest event time stored stands for it.
        self._clock: float | None = None
        self._view = _View()
        self._ahead: _SentRead | None = None  # the next lookup's read, sent ahead (`prefetch`)
        self._memos: _Memos | None = None  # memos the insert in progress has still to write
        # Entries this instance wrote or read lately, by (id, event time): what a bucket record names.
        self._known: dict[tuple[str, float], Entry] = {}
        self._known_cap = target.entry_cache
        self._rank = _native.rank_records if _native is not None else rank_records
        self._plan = _native.plan_fields if _native is not None else plan_fields
        self._numbers: list[int] = []  # the ints `plan_fields` takes a batch's places from, kept from batch to batch
        self._round = _native.alone_round if _native is not None else alone_round
        self._restore_round = _native.restore_round if _native is not None else restore_round
        self._restore_accept = _native.restore_accept if _native is not None else restore_accept
        self._newest = _native.newest_records if _native is not None else newest_records
        self._bucket_pairs = _native.bucket_pairs if _native is not None else bucket_pairs
        self._bucket_commands = _native.bucket_commands if _native is not None else bucket_commands
        self._decode = _native.decode_entries if _native is not None else decode_entries
        self._rank_all = kept_ranking("rank_lookup", rank_lookup)
        self._encode = _native.encode_entries if _native is not None else encode_entries
        self._overlay = _native.overlay_writes if _native is not None else overlay_writes
        self.alone_inserts = True  # INSERT_ALONE_LUA when nobody else inserted since the lookup
        self.read_ahead = True  # `prefetch` sends the read (off: every lookup reads when it is made)
        self.write_ahead = True  # `insert_ahead` sends an uncontended round (off: every insert waits for its answer)
        # The round `insert_ahead` sent, whose answer is not read yet (`settle` reads it).
        self._held: _HeldRound | None = None
        # Standalone Redis: one connection for the instance's round trips, so that the lookup's WATCH
        # still guards the insert's MULTI/EXEC; a reconnect drops the WATCH, so it moves the epoch.
        self._conn: Any = None
        self._epoch = 0
        self._guarded = False  # a transaction is being sent: a reconnect now would lose its WATCH
        # Others write the namespace beside this client (workers racing): its last lookup found writes not its
        # own since the lookup before. Then no read goes ahead: the next lookup would find others' writes since
        # and read afresh, Redis having read it for nothing (docs/benchmarks.md, "Workers racing on one
        # namespace"). Each lookup decides it again, before the read ahead that follows it.
        self._contended = False
        # Set by `decide` from its batch (`Batch.meanwhile`): a share of other work to run after a request went out
        # and before its replies are read (the next batch's fingerprints, while Redis works on this one):
        # during the lookup's read and the insert's write, not the short read of entries between them.
        # It returns True when nothing is left.
        self.meanwhile: Callable[[], bool] | None = None
        self._decider = SharedDecider(target.round_size)
        self._rebuilt = _Rebuilt()
        options: dict[str, Any] = {
            "decode_responses": False,  # entries are bytes
            "retry": Retry(NoBackoff(), 0),  # no hidden retry loop: the worker decides
        }
        query = dict(parse_qsl(urlsplit(target.client_url).query))
        for name in ("socket_timeout", "socket_connect_timeout"):
            if name not in query:
                options[name] = DEFAULT_SOCKET_TIMEOUT
        try:
            with self._errors():  # RedisCluster connects here to learn the slots; Redis on first use
                if target.cluster:
                    self._client: redis.Redis | RedisCluster = RedisCluster.from_url(target.client_url,
                                                                                    **options)
                else:
                    self._client = redis.Redis.from_url(target.client_url, **options)
                    pool = self._client.connection_pool  # connects lazily: check the options now
                    pool.connection_class(**pool.connection_kwargs)
        except (ValueError, TypeError) as exc:  # redis-py rejects a query option or its value
            raise ConfigError(f"Redis index URL {self._where}: {exc}") from exc

    # -- CandidateIndex ------------------------------------------------------------------------
    in_process = False
    compiled_table = False  # a batch is decided from fingerprints (`filters.index.shared`), never the hashed batch

    def decide(self, batch: Batch, verifier: Verifier) -> list[Verdict]:
        """One lookup round for the batch, verification against it and the batch itself, insert rounds
        (`SharedDecider`); the batch's `meanwhile` shares run during the round trips, the next batch's read
        goes ahead (`prefetch`)."""
        self.meanwhile = batch.meanwhile
        if self._rebuilt.fresh:
            self._rebuilt = _Rebuilt()  # a restore's memory (megabytes): not needed once batches flow again
        try:
            verdicts = self._decider.decide(self, batch, verifier)
        except BaseException:
            if self._held is not None and self._conn is not None:  # its answer may still be on its way
                self._lose(self._conn)
            self._drop_held()
            raise
        finally:
            left, self.meanwhile = self.meanwhile, None
        finish(left)
        return verdicts

    def _read_view(self, queries: Sequence[Query]) -> tuple[list[float], list[str], list[list[bytes | None]],
                                                            list[list[int]], list[int]] | None:
        """A lookup's read (the one sent ahead by `prefetch`, when it is still good, else a new one), kept as
        the view the batch's inserts go by: each query's high-water mark, the ids, and the columns read with
        the queries' places in them; None for no queries. Shared by the layouts that read by slice."""
        ahead = self._ahead
        if ahead is not None:
            with self._errors():
                self._drain()  # its replies come first on the connection
            self._ahead = None
        if not queries:
            return None
        marks = high_marks(queries, self._hwm, self.slice_length)
        hwm = marks[-1]
        read = self._taken(ahead, marks[0], hwm) if ahead is not None and ahead.queries is queries else None
        if read is not None:
            assert ahead is not None
            names, key_fields, positions, id_places = ahead.names, ahead.key_fields, ahead.positions, ahead.id_places
            seq, stored, slices, columns = read
            epoch, watch = self._epoch, True
        else:
            names, key_fields, positions, id_places = self._planned(queries)
            watch = self._watchable()
            if watch:
                with self._errors():
                    self._pinned()  # the epoch below must be that of the connection the reads go on
            epoch = self._epoch
            seq, stored, slices, columns = self._read_covering(names, self._slices(marks[0], hwm), marks[0], hwm,
                                                               watch=watch)
            watch = watch and self._epoch == epoch  # both reads on the connection whose WATCH guards the view
        self._hwm = hwm
        last = self._view
        if last.slices:  # (a lookup before this one: did anybody else write since?)
            self._contended = seq != last.mark + last.inserted
        ids = [q.id for q in queries]
        keys_of = [q.keys for q in queries]
        self._view = _View(slices, dict(zip(slices, columns)), names, seq, stored, dict(zip(ids, range(len(ids)))),
                           keys_of, key_fields, positions, id_places, watch=epoch if watch else -1,
                           marker=self._marker)
        return marks, ids, columns, positions, id_places

    def lookup(self, queries: Sequence[Query], limit: int) -> list[tuple[Entry | Verdict | None, list[Candidate]]]:
        read = self._read_view(queries)
        if read is None:
            return []
        marks, ids, columns, positions, id_places = read
        window = self.window
        found = self._rank_all(columns, positions, id_places, ids, [q.min_shared for q in queries], limit,
                               [mark - window for mark in marks], self.bucket_cap,
                               entry_time, memo_time)
        entries = self._entries({(id, ts) for _, _, ranked in found for id, _, _, ts in ranked})
        out: list[tuple[Entry | Verdict | None, list[Candidate]]] = []
        for q, (own, memo, ranked) in zip(queries, found):
            if ranked:  # (a comprehension is a call: none for a query without candidates, most of them)
                keys = q.keys
                cands = [new_candidate(entries[id], shared, keys[first]) for id, shared, first, _ in ranked if id in entries]
            else:
                cands = []
            out.append((decode_entry(own, q.id) if own is not None else None if memo is None else decode_memo(memo, q.id),
                        cands))
        return out

    def prefetch(self, queries: Sequence[Query]) -> None:
        """Sends the read of `lookup(queries)` now, without waiting for it: Redis reads the next batch's
        buckets while this client still verifies and inserts the batch it looked up last, and that
        `lookup` (given the very same list) takes the read instead of making one.

        The read then lacks what that batch inserts; the lookup adds those writes (known here: the
        uncontended round computed them) and is as if it had read after them. That holds only if
        nobody else wrote meanwhile, which the WATCH of the meta hash armed before this read tells: the
        batch's transaction is refused if anybody wrote since, and anything else than an uncontended,
        still guarded round (a refused transaction, the checking script, a re-read, a reconnect, an
        error) makes the lookup read afresh. Standalone Redis only (Cluster has no WATCH here)."""
        self._ahead = None
        view = self._view
        planned = self._plan_ahead(queries)
        if planned is None:
            return
        names, key_fields, positions, id_places, slices = planned
        commands = self._read_commands(names, slices, watch=False)
        with self._errors():
            conn = self._pinned()
            self._drain()
            count = self._pack_send(conn, commands)
            epoch = self._epoch  # after sending: a reconnect on the way sent it on the new connection
        self._ahead = _SentRead(queries, names, key_fields, positions, id_places, slices, epoch, view, count)

    def _plan_ahead(self, queries: Sequence[Query]) -> tuple[list[bytes], list[list[bytes]], list[list[int]],
                                                             list[int], tuple[int, ...]] | None:
        """What `prefetch` reads (`_planned`, and the slices the queries' marks cover), or None when no read
        may go ahead: see `prefetch`."""
        view = self._view
        if not self.read_ahead or not queries or not self._watchable() or view.watch != self._epoch \
                or not view.exact or view.inserted or view.reread or self._contended:
            return None
        try:
            marks = high_marks(queries, self._hwm, self.slice_length)
            names, key_fields, positions, id_places = self._planned(queries)
        except ValueError:
            return None  # the lookup raises it
        return names, key_fields, positions, id_places, self._slices(marks[0], marks[-1])

    def _planned(self, queries: Sequence[Query]) -> tuple[list[bytes], list[list[bytes]], list[list[int]], list[int]]:
        """Every field name the batch reads, and its place in a column (`plan_fields`: each query's entry
        field, and its memo field right after it)."""
        try:
            # (`id_field` of each, inline: no Python call a query)
            return self._plan([q.keys for q in queries], [b"e" + q.id.encode("utf-8", "surrogatepass") for q in queries],
                              self._numbers)
        except (struct.error, OverflowError):
            raise ValueError(f"bucket keys must be unsigned 64-bit ints: {[q.keys for q in queries]!r}") from None

    def _taken(self, ahead: _SentRead, low_mark: float, high_mark: float) -> tuple[int, bytes, tuple[int, ...],
                                                                              list[list[bytes | None]]] | None:
        """The read sent ahead, with the writes of the batch inserted since (see `prefetch`), as `_read_covering`
        would have read it now; None if it cannot stand for that (then the lookup reads afresh)."""
        view = ahead.view
        if (ahead.epoch != self._epoch or view is not self._view or view.watch != self._epoch or not view.exact
                or view.reread or len(ahead.replies) != 1 + len(ahead.slices) * _parts(len(ahead.names))):
            return None
        with self._errors():
            _raise_any(ahead.replies)
        (seq_read, stored), columns = self._state(ahead.replies[0]), _columns(ahead.replies[1:], len(ahead.slices),
                                                                              len(ahead.names))
        if seq_read != view.mark:
            return None  # somebody inserted between the last lookup and this read: read afresh
        seq, stored = view.mark + view.inserted, view.hwm if view.inserted else stored
        # The slices `_read_covering` would read now: some read ahead may be gone by now (they left the window).
        need = set(self._slices(low_mark, high_mark)) | set(self._slices(low_mark, max(high_mark, _stored_time(stored))))
        if not need <= set(ahead.slices):
            return None
        kept = [(s, column) for s, column in zip(ahead.slices, columns) if s in need]
        if view.written:
            self._overlay(ahead.names, view.names, kept, view.written)
        return seq, stored, tuple(s for s, _ in kept), [column for _, column in kept]

    def insert(self, entries: Sequence[tuple[Entry, tuple[int, ...]]],
               memos: Sequence[Memo] = ()) -> list[list[Candidate] | None]:
        """See `CandidateIndex.insert`. The memos go with the first round trip that writes entries (inside
        its transaction, or pipelined with the insert script), or in one of their own if none does. If it
        raises, some entries and memos may have been written: inserting is idempotent by id, so the worker
        retries the batch and finds those as replays (of a unique, of a duplicate)."""
        if not entries and not memos:
            return []
        self._memos = self._memo_writes(memos)
        try:
            out: list[list[Candidate] | None] = []
            for at in range(0, len(entries), INSERT_CHUNK):
                out.extend(self._insert_chunk(entries[at : at + INSERT_CHUNK]))
            if self._memos is not None:
                with self._errors():
                    _raise_any(self._execute(self._memos.commands))
                self._memos_sent()
        finally:
            self._memos = None
        return out

    def insert_ahead(self, entries: Sequence[tuple[Entry, tuple[int, ...]]], memos: Sequence[Memo] = ()) -> bool:
        """See `Rounds.insert_ahead`: the lookup's first insert round, when it is uncontended and guarded by
        the lookup's WATCH (`_alone` as a transaction), sent without reading its answer; its writes are kept
        in the view as if it had been answered (the next lookup adds them to its read, as after an answered
        round), and undone by `settle` if Redis refused it."""
        view = self._view
        # Not while others write beside (`_contended`): Redis would likely refuse it, and the next part's lookup
        # made meanwhile would be made again.
        if (not self.write_ahead or not self.alone_inserts or self._contended or not entries
                or len(entries) > INSERT_CHUNK or self._held is not None or view.watch != self._epoch
                or not view.exact or view.inserted or view.written or view.reread or view.own or view._unsettled):
            return False
        fields_of, places_of = self._fields_of(entries)
        if any(places is None for places in places_of):
            return False
        self._memos = self._memo_writes(memos)
        try:
            results = self._alone(entries, fields_of, places_of, ahead=True)
        finally:
            self._memos = None
        if results is None:
            return False
        self._keep_inserted(entries, results)
        return True

    def settle(self) -> tuple[bool, bool]:
        """See `Rounds.settle`: the answer of the round `insert_ahead` sent, read as `_exec_watched` reads it.
        Refused: its writes leave the view (as if it had never been sent) and its entries the ones kept; the
        view goes by the checking script from here. Refused, or somebody wrote right after it: the lookups
        since went by a view that does not hold, so the view is the round's again (the next lookup reads
        afresh: `_taken` takes no read that went ahead for another view)."""
        held = self._held
        if held is None:
            return True, True
        if held.pending and self.meanwhile is not None and self.meanwhile():  # the engine's work while Redis writes
            self.meanwhile = None
        try:
            with self._errors():  # (a read sent ahead before the round is drained first: its errors too)
                self._read_held()
        except BaseException:
            self._drop_held()
            raise
        self._held = None
        replies = held.replies
        try:
            with self._errors():
                self._raise_any(replies)
                done = replies[-3]
                if done is not None:
                    self._raise_any(done)  # a command that failed inside the transaction (the others did run)
        except BaseException:
            if self._conn is not None:  # Redis before 6.2 stays in MULTI after refusing EXEC itself
                self._lose(self._conn)
            held.forget()  # (some of it may have been written: what it kept is read again)
            raise
        view = held.view
        if done is None:
            self._view = view
            view.hwm, view.inserted, view.watch = held.view_hwm, 0, -1
            view.own.clear()
            view.written.clear()
            view.bases.clear()
            view._unsettled.clear()
            self._hwm = held.hwm_before
            held.forget()
            return False, False
        now_seq, now_hwm = replies[-1]
        if int(now_seq or 0) == held.seq and (now_hwm or b"") == held.stored:
            return True, True  # the lookups since stand: their view stays
        self._view = view
        view.watch = -1  # somebody wrote right after: later rounds go through the script's check
        return True, False

    def _read_held(self) -> None:
        """Reads the answer of the round `insert_ahead` sent, if not read yet (after the replies of a read
        sent ahead before it)."""
        held = self._held
        if held is None or not held.pending:
            return
        if held.epoch != self._epoch or self._conn is None:
            with self._errors():
                raise redis.exceptions.ConnectionError("the connection an insert went on was lost before its answer")
        ahead = self._ahead
        if ahead is not None and ahead.pending and ahead is held.before:
            self._drain()  # sent before the round: its replies come first
        conn, n, held.pending = self._conn, held.pending, 0
        try:
            with self._errors():
                held.replies = read_replies(conn, n)
        except BaseException:
            self._lose(conn)
            raise

    def _memo_writes(self, memos: Sequence[Memo]) -> _Memos | None:
        """The commands that write `memos` in the slices of their event times (each slice's TTL renewed and
        its memo count moved, for `stats`); a memo no lookup could read any more (outside the window) is
        left out. None if nothing is left."""
        horizon = self._hwm - self.window
        pairs: dict[int, list[bytes]] = {}
        written = []
        length = self.slice_length
        for verdict, ts in memos:
            ts = float(ts)
            if not (_MIN_TS < ts < math.inf and abs(ts / length) < _MAX_SLICE):  # `_event_time`'s check, inline
                _event_time(ts, verdict.id, length)  # raises
            if ts < horizon:
                continue
            # (`_slice` and `memo_field`, inline: a duplicate's memo costs one Python call, its encoding)
            value, s = encode_memo(verdict, ts), math.floor(ts / length)
            pairs.setdefault(s, []).extend((b"d" + verdict.id.encode("utf-8", "surrogatepass"), value))
            written.append((s, verdict.id, value))
        if not written:
            return None
        step = 2 * FIELDS_PER_CALL
        commands: list[Sequence[str | int | bytes]] = []
        for s, fields in pairs.items():
            key = f"{self._spre}{s}"
            commands += [("HSET", key, *fields[a : a + step]) for a in range(0, len(fields), step)]
            commands += [("HINCRBY", key, "m", len(fields) // 2), ("PEXPIRE", key, self._ttl_ms)]
        return _Memos(commands, written)

    def _memo_commands(self) -> list[Sequence[str | int | bytes]]:
        """The commands of the memos still to write, for the round trip about to go out."""
        return self._memos.commands if self._memos is not None else []

    def _memos_sent(self) -> None:
        """The memos are written: the lookup's view gets them (a read sent ahead adds them, as it adds the
        entries this batch wrote: `_taken`)."""
        memos, self._memos = self._memos, None
        if memos is None:
            return
        view = self._view
        for s, id, value in memos.written:
            q = view.looked.get(id)
            if q is not None:
                view.written.setdefault(s, {})[view.entry_places[q] + 1] = value  # its memo field (`plan_fields`)

    def restore(self, parts: Iterable[Stored], *, rebuild: bytes = b"") -> int:
        """See `CandidateIndex.restore`. The entries' stored bytes pass through; per chunk, one read of what
        their fields hold and the writes computed here (`restore_round`, as the insert script would insert
        them with nothing to compare). A rebuild (`rebuild`, by the guard's lock holder) of a fenced index
        without its marker: nobody else writes it unguarded (the fence keeps the workers out, the lock other
        restorers, and a worker's write-back goes guarded whatever the marker), so chunks of REBUILD_CHUNK
        stream without transactions, the next chunk computed while Redis writes the last (`_rebuild`).
        Otherwise each chunk of RESTORE_CHUNK is a MULTI/EXEC guarded by WATCH (`_restore_chunk`), or on Redis
        Cluster, and for a chunk others kept writing beside, the insert script with nothing to compare."""
        self._forget_view()
        with self._errors():  # the high-water mark (the slices a live id may be in), and a fenced index's marker
            replies = self._execute([("HMGET", self._meta, "hwm", MARKER)])
            _raise_any(replies)
        self._rebuilt.hwm = max(self._rebuilt.hwm, self._hwm, _stored_time(replies[0][0] or b""))
        chunks: Iterator[_Chunk] = (c for part in parts for c in self._chunks(part, REBUILD_CHUNK))
        written = 0
        if rebuild and self.fenced and replies[0][1] is None:
            chunks, written = self._rebuild(chunks)
        for chunk in chunks:
            for at in range(0, len(chunk.ids), RESTORE_CHUNK):
                written += self._restore_guarded(chunk.part(at, at + RESTORE_CHUNK))
        return written

    def _chunks(self, stored: Stored, size: int) -> Iterator[_Chunk]:
        """`stored` in chunks of `size`, its event times checked (`_event_time`) and their slices told."""
        times = np.asarray(stored.times, dtype=np.float64)
        bad = ~(np.isfinite(times) & (times > _MIN_TS) & (np.abs(times / self.slice_length) < _MAX_SLICE))
        if bad.any():
            at = int(np.flatnonzero(bad)[0])
            _event_time(float(times[at]), stored.ids[at], self.slice_length)  # raises its ValueError
        whole = _Chunk(stored.ids, times, np.floor(times / self.slice_length).astype(np.int64),
                       np.asarray(stored.bounds, dtype=np.int64), np.asarray(stored.keys, dtype=np.uint64),
                       stored.blobs)
        for at in range(0, len(stored), size):
            yield whole.part(at, at + size)

    def _restore_guarded(self, part: _Chunk) -> int:
        """A chunk restored beside other writers: guarded transactions (`_restore_chunk`), else the script."""
        for _ in range(RESTORE_ATTEMPTS if self._watchable() else 0):
            done = self._restore_chunk(part)
            if done is not None:
                return done
        # Cluster, or others kept writing meanwhile: the script appends atomically (a key given twice counts once,
        # as everywhere else: the script would append it twice).
        flat, ends = part.keys.tolist(), part.bounds.tolist()
        entries = [(id, ts, blob, tuple(dict.fromkeys(flat[a:b])))
                   for id, ts, blob, a, b in zip(part.ids, part.times.tolist(), part.blobs, ends, ends[1:])]
        return sum(self._insert_unchecked(entries[a : a + INSERT_CHUNK]) for a in range(0, len(entries), INSERT_CHUNK))

    def _rebuild(self, chunks: Iterator[_Chunk]) -> tuple[Iterator[_Chunk], int]:
        """Restores `chunks` into an index nobody else writes (see `restore`): no WATCH, no transaction, and
        nothing read back that the rebuild wrote. Per chunk, which entries the insert script would insert
        and their seqs are told here (`restore_accept`: the ids the rebuild stored are known, and those of a
        slice that existed before it are read), and their entry fields sent at once (Redis writes them while
        the next chunk is computed); their bucket records are held (`_Held`) and each bucket field written
        once, at the end, with its final value (`_flush`). Each chunk's writes end with a read of the
        namespace's seq and marker, checked before the next chunk's go: if somebody else writes too, what is
        held is written over what they wrote (merged with it) and the rest is left to `_restore_chunk`.
        Returns (the chunks not written: those from where it stopped; entries written)."""
        rebuilt = self._rebuilt
        conn = None if isinstance(self._client, RedisCluster) else self._pinned()
        held = _Held()
        existed: dict[int, bool] = {}  # slice -> whether it existed before the rebuild wrote it
        live: dict[str, float] = {}  # id -> event time of its newest entry stored (`restore_accept`)
        written = 0
        pending: list[Any] = []  # the last chunk's writes, sent: [sent, the seq they leave]
        try:
            state = self._receive(conn, self._send_only(conn, [("HMGET", self._meta, "seq", "hwm", MARKER, REBUILDING)]))[0]
            if state[2] is not None:
                return chunks, 0
            if state[3] is not None:  # a rebuild died before it wrote its bucket fields: its entries would pass for live
                self._drop_slices(conn)
            self._receive(conn, self._send_only(conn, [("HSET", self._meta, REBUILDING, "1"),
                                                       ("PEXPIRE", self._meta, self._ttl_ms)]))
            seq, hwm_bytes = int(state[0] or 0), state[1] or b""
            hwm = max(rebuilt.hwm, _stored_time(hwm_bytes))

            def settle() -> bool:
                """Reads the replies of the writes in flight; False if somebody else wrote meanwhile."""
                if not pending:
                    return True
                sent, expected = pending
                pending.clear()
                check = self._receive(conn, sent)[-1]
                return check[1] is None and int(check[0] or 0) == expected

            for part in chunks:
                own = part.slices.tolist()
                low = self._slice((hwm if math.isfinite(hwm) else float(part.times.min())) - self.window)
                slices = sorted(set(own) | set(range(low, self._slice(max(hwm, float(part.times.max()))) + 1)))
                unknown = [s for s in slices if s not in existed]
                if unknown:
                    if not settle():
                        return self._intruded(conn, held, seq, hwm, chain([part], chunks), written)
                    found = self._receive(conn, self._send_only(conn, [("EXISTS", f"{self._spre}{s}") for s in unknown]))
                    existed.update(zip(unknown, (bool(x) for x in found)))
                old_slices = [s for s in slices if existed[s]]
                if old_slices:  # its entries may keep an id live
                    if not settle():
                        return self._intruded(conn, held, seq, hwm, chain([part], chunks), written)
                    names = [id_field(id) for id in part.ids]
                    step = FIELDS_PER_HMGET
                    blobs = self._receive(conn, self._send_only(conn, [
                        ("HMGET", f"{self._spre}{s}", *names[a : a + step])
                        for s in old_slices for a in range(0, len(names), step)]))
                    for got in (chain.from_iterable(blobs[k : k + _parts(len(names))])
                                for k in range(0, len(blobs), _parts(len(names)))):
                        for id, blob in zip(part.ids, got):
                            if blob is not None:
                                live[id] = max(live.get(id, -math.inf), entry_time(blob, id))
                seqs, new_hwm, new_seq = self._restore_accept(part.ids, part.times, live, hwm, self.window, seq)
                took = np.flatnonzero(seqs)
                groups: dict[int, list[Any]] = {}
                id_bytes = [part.ids[i].encode("utf-8", "surrogatepass") for i in took.tolist()]
                for i, idb, s in zip(took.tolist(), id_bytes, part.slices[took].tolist()):
                    group = groups.setdefault(s, [0, []])
                    group[0] += 1
                    group[1] += (b"e" + idb, part.blobs[i])
                new_hwm_bytes = hwm_bytes if new_hwm <= _stored_time(hwm_bytes) else (b"%.17g" % new_hwm)
                writes = self._restore_writes(groups, seq, hwm_bytes, new_seq, new_hwm_bytes, transaction=False,
                                              increment=True)
                writes.append(("HMGET", self._meta, "seq", MARKER))
                if not settle():
                    return self._intruded(conn, held, seq, hwm, chain([part], chunks), written)
                pending[:] = [self._send_only(conn, writes), new_seq]
                held.add(part, seqs, took, id_bytes)
                written += len(took)
                seq, hwm, hwm_bytes = new_seq, new_hwm, new_hwm_bytes
                rebuilt.hwm = max(rebuilt.hwm, hwm)
                if held.count > HOLD_RECORDS:
                    held.compact(self._newest, self.bucket_cap)
                    if held.count > HOLD_RECORDS // 2:  # still too many: written now, read back when named again
                        if not settle():
                            return self._intruded(conn, held, seq, hwm, chunks, written)
                        self._flush(conn, held, existed, keep_track=True)
                if len(live) > HOLD_IDS:  # from now on as if the rebuild found its slices: what they hold is read
                    if not settle():
                        return self._intruded(conn, held, seq, hwm, chunks, written)
                    self._flush(conn, held, existed, keep_track=True)
                    existed = dict.fromkeys(existed, True)
                    live.clear()
            if not settle():
                return self._intruded(conn, held, seq, hwm, iter(()), written)
            self._flush(conn, held, existed)
            self._receive(conn, self._send_only(conn, [("HDEL", self._meta, REBUILDING)]))
            rebuilt.seq = seq
            return iter(()), written
        except BaseException:
            if conn is not None:
                conn.disconnect()
            # What it held never reached Redis: the next restore starts from what Redis holds.
            self._rebuilt = _Rebuilt()
            raise

    def _intruded(self, conn: Any, held: _Held, seq: int, hwm: float, rest: Iterator[_Chunk],
                  written: int) -> tuple[Iterator[_Chunk], int]:
        """Somebody else writes too (`_rebuild`): what the rebuild holds goes now, merged with what every
        field holds (a rebuild is meant to run alone), and the rest is left to `_restore_chunk`."""
        self._flush(conn, held, {}, merge_all=True)
        self._receive(conn, self._send_only(conn, [("HDEL", self._meta, REBUILDING)]))
        self._rebuilt.fresh.clear()
        self._rebuilt.seq = seq
        self._rebuilt.hwm = max(self._rebuilt.hwm, hwm)
        return rest, written

    def _drop_slices(self, conn: Any) -> None:
        """Unlinks every slice of the namespace: a rebuild that died wrote entries whose bucket records it still
        held (the changelog has them all)."""
        with self._errors():
            keys = list(self._client.scan_iter(match=f"{self._spre}*", count=1000))
        for a in range(0, len(keys), 500):
            self._receive(conn, self._send_only(conn, [("UNLINK", *keys[a : a + 500])]))

    def _flush(self, conn: Any, held: _Held, existed: dict[int, bool], *, keep_track: bool = False,
               merge_all: bool = False) -> None:
        """Writes the bucket fields `held` holds, each once (`newest_records`, `bucket_commands`, sent by a thread
        of their own: `_Sender`), and forgets them. A field's value is read first (and its records put before
        the held ones) where it may hold some: in a slice that existed before the rebuild, a field an earlier
        flush wrote (`keep_track` keeps their keys), every field (`merge_all`)."""
        times, seqs, ids, id_ends = held.columns()
        step, pair_step = FIELDS_PER_HMGET, 2 * FIELDS_PER_CALL
        sent: list[Any] = []
        sender: _Sender | None = None

        def settle() -> None:
            """Waits for what was sent and reads its replies."""
            nonlocal sender
            if sender is not None:
                with self._errors():
                    sent.append(sender.close())
                sender = None
            for one in sent:
                self._receive(conn, one)
            sent.clear()

        try:
            for (s, _), parts in sorted(held.records.items()):
                keys = np.concatenate([k for k, _ in parts])
                entries = np.concatenate([e for _, e in parts])
                order = self._newest(keys, entries, times, seqs, self.bucket_cap)
                keys, entries = keys[order], entries[order]
                starts = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1]))) if len(keys) \
                    else np.zeros(0, np.int64)
                distinct = keys[starts]
                before = held.flushed.get(s)
                if merge_all or existed.get(s, True):
                    need = distinct
                elif before is not None:
                    need = distinct[np.isin(distinct, before, assume_unique=True)]
                else:
                    need = distinct[:0]
                olds: dict[int, bytes] = {}
                if len(need):
                    settle()  # the replies in flight come first
                    raw = need.astype(">u8").tobytes()
                    names = [b"b" + raw[a : a + 8] for a in range(0, len(raw), 8)]
                    got = self._receive(conn, self._send_only(conn, [
                        ("HMGET", f"{self._spre}{s}", *names[a : a + step]) for a in range(0, len(names), step)]))
                    olds = {k: v for k, v in zip(need.tolist(), chain.from_iterable(got)) if v is not None}
                key = f"{self._spre}{s}"
                bounds = [*starts[::FLUSH_FIELDS].tolist(), len(keys)]
                for a, b in pairwise(bounds):
                    if conn is None:  # Cluster: redis-py's pipeline, which knows where the slot lives
                        pairs = self._bucket_pairs(keys[a:b], entries[a:b], times, seqs, ids, id_ends, olds,
                                                   self.bucket_cap)
                        sent.append(self._send_only(conn, [
                            ("HSET", key, *pairs[x : x + pair_step]) for x in range(0, len(pairs), pair_step)]))
                        continue
                    if sender is None:
                        sender = _Sender(conn)
                    with self._errors():
                        sender.send(*self._bucket_commands(key.encode(), keys[a:b], entries[a:b], times, seqs, ids,
                                                           id_ends, olds, self.bucket_cap, FIELDS_PER_CALL))
                if keep_track:
                    held.flushed[s] = distinct if before is None else np.union1d(before, distinct)
            settle()
        finally:
            if sender is not None:  # stopped by an error: the thread ends, the caller drops the connection
                sender.close(raising=False)
        self._receive(conn, self._send_only(conn, [("PEXPIRE", f"{self._spre}{s}", self._ttl_ms)
                                                   for s in sorted({s for s, _ in held.records})]))
        held.clear()

    def _restore_chunk(self, part: _Chunk) -> int | None:
        """Restores a chunk beside other writers: reads what its fields hold (after a WATCH of the meta hash),
        computes the writes (`restore_round`) and writes them in one MULTI/EXEC, which Redis refuses if
        anybody wrote meanwhile (None: nothing written, try again)."""
        rebuilt = self._rebuilt
        commands = [("UNWATCH",), ("WATCH", self._meta), *self._restore_reads(part)]
        with self._errors():
            self._pinned()
            epoch = self._epoch
            replies = self._execute(commands)
            _raise_any(replies)
        replies = replies[2:]
        seq_read, stored_hwm = int(replies[0][0] or 0), replies[0][1] or b""
        if rebuilt.fresh and rebuilt.seq != seq_read:  # somebody else wrote since: what they wrote is unknown
            rebuilt.fresh.clear()
            return None
        if stored_hwm and self._slice(_stored_time(stored_hwm)) > part.chunk_slices[-1]:  # others moved the window
            rebuilt.hwm = max(rebuilt.hwm, _stored_time(stored_hwm))
            return None
        held = self._restore_held(part, replies)
        results, groups, hwm, seq = self._restore_round(
            part.ids, part.times, part.slices, part.bounds, part.keys, part.blobs, held,
            max(rebuilt.hwm, _stored_time(stored_hwm)), self.window, self.bucket_cap, seq_read)
        hwm_bytes = stored_hwm if hwm <= _stored_time(stored_hwm) else (b"%.17g" % hwm)
        writes = self._restore_writes(groups, seq_read, stored_hwm, seq, hwm_bytes, transaction=True)
        self._guarded = True
        try:
            with self._errors():
                if self._epoch != epoch:
                    raise _WatchLost()
                done = self._execute(writes)
                _raise_any(done)
                if done[-1] is None:
                    return None  # somebody wrote meanwhile: nothing was written
                _raise_any(done[-1])
        except _WatchLost:
            return None  # reconnected since the read: its WATCH is gone, nothing was sent
        except BaseException:
            if self._conn is not None:  # Redis before 6.2 stays in MULTI after refusing EXEC itself
                self._conn.disconnect()
            raise
        finally:
            self._guarded = False
        rebuilt.hwm = max(rebuilt.hwm, hwm)
        rebuilt.seq = seq
        self._remember_fresh(part)
        return sum(1 for r in results if r > 0)

    def _restore_reads(self, part: _Chunk) -> list[Sequence[str | int | bytes]]:
        """A restore chunk's read (its plan kept in `part`): the meta hash, whether each slice
        exists, the bucket fields the chunk names in the slices its entries go to, and its entry fields in
        every slice that can hold a live one (as a lookup's window: an id stored inside the window is
        kept). A slice a restore of ours found missing, and alone wrote since (`_Rebuilt`), is read only
        for the fields its Bloom filter says they may have written."""
        fresh = self._rebuilt.fresh
        own = set(part.slices.tolist())
        hwm = self._rebuilt.hwm  # the namespace's newest event time, as far as the restore knows
        # An id is live as the insert script sees it: stored inside the window of the newest event time before
        # it, which is the namespace's (`hwm`) for the chunk's first entry, whatever event times come after.
        low = self._slice((hwm if math.isfinite(hwm) else float(part.times.min())) - self.window)
        part.chunk_slices = sorted(own | set(range(low, self._slice(max(hwm, float(part.times.max()))) + 1)))
        pair_slices = np.repeat(part.slices, np.diff(part.bounds)) if len(own) > 1 else None
        for s in part.chunk_slices:
            bits = fresh.get(s)
            names: list[bytes] = []
            if s in own:
                ks = part.named[s] = _distinct(part.keys if pair_slices is None else part.keys[pair_slices == s])
                if bits is not None:
                    ks = ks[bloom_has(bits, ks)]
                raw = ks.astype(">u8").tobytes()
                names = [b"b" + raw[a : a + 8] for a in range(0, len(raw), 8)]
            ids = part.ids if bits is None else [part.ids[i] for i in np.flatnonzero(bloom_has(bits, part.id_keys))]
            part.wanted[s] = names + [id_field(id) for id in ids]
        step = FIELDS_PER_HMGET
        commands: list[Sequence[str | int | bytes]] = [("HMGET", self._meta, "seq", "hwm")]
        commands += [("EXISTS", f"{self._spre}{s}") for s in part.chunk_slices]
        for s, names in part.wanted.items():
            key = f"{self._spre}{s}"
            commands += [("HMGET", key, *names[a : a + step]) for a in range(0, len(names), step)]
        return commands

    def _restore_held(self, part: _Chunk, replies: list[Any]) -> dict[int, dict[bytes, bytes]]:
        """What the fields a chunk reads hold (`_restore_reads`' replies, the meta hash's first)."""
        n = len(part.chunk_slices)
        part.present = [bool(x) for x in replies[1 : 1 + n]]
        values = iter(replies[1 + n :])
        step = FIELDS_PER_HMGET
        held: dict[int, dict[bytes, bytes]] = {}
        for s, names in part.wanted.items():
            got = [v for a in range(0, len(names), step) for v in next(values)]
            held[s] = {f: v for f, v in zip(names, got) if v is not None}
        return held

    def _restore_writes(self, groups: dict[int, list[Any]], seq_read: int, stored_hwm: bytes, seq: int,
                        hwm: bytes, *, transaction: bool, increment: bool = False) -> list[Sequence[str | int | bytes]]:
        """A restore chunk's writes: `groups` (slice -> [entries, field-value pairs]) and the meta hash's seq and
        high-water mark (`increment`: the seq moved by what this chunk took, so that a rebuild's next check
        still sees what anybody else added)."""
        writes: list[Sequence[str | int | bytes]] = [("MULTI",)] if transaction else []
        pair_step = 2 * FIELDS_PER_CALL
        for s, (count, pairs) in groups.items():
            key = f"{self._spre}{s}"
            writes += [("HSET", key, *pairs[a : a + pair_step]) for a in range(0, len(pairs), pair_step)]
            writes += [("HINCRBY", key, "n", count), ("PEXPIRE", key, self._ttl_ms)]
        if increment and (seq != seq_read or hwm != stored_hwm):
            writes += [("HINCRBY", self._meta, "seq", seq - seq_read), ("HSET", self._meta, "hwm", hwm),
                       ("PEXPIRE", self._meta, self._ttl_ms)]
        elif seq != seq_read or hwm != stored_hwm:
            writes += [("HSET", self._meta, "seq", seq, "hwm", hwm), ("PEXPIRE", self._meta, self._ttl_ms)]
        if transaction:
            writes.append(("EXEC",))
        return writes

    def _remember_fresh(self, part: _Chunk) -> None:
        """After a chunk's writes: the slices its read found missing are fresh (only restores of ours wrote
        them), and what it wrote goes into each fresh slice's Bloom filter."""
        fresh = self._rebuilt.fresh
        for s, present in zip(part.chunk_slices, part.present):
            bits = fresh.get(s)
            if bits is None and not present:
                bits = fresh[s] = bloom_bits()
            if bits is not None:
                part.remember(s, bits)

    def _send_only(self, conn: Any, commands: Sequence[Sequence[str | int | bytes]]) -> Any:
        """Sends `commands` without reading their replies (`_receive` does); on Cluster, runs them. A command
        at a time: the socket timeout bounds each send, and a rebuild's chunk of writes (megabytes) is sent
        as fast as a busy server takes it."""
        with self._errors():
            if conn is None:
                return self._execute(commands)
            for command in commands:
                self._pack_and_send(conn, [command])
            return len(commands)

    def _receive(self, conn: Any, sent: Any) -> list[Any]:
        """The replies of `_send_only`'s commands, in order; raises the first error reply."""
        with self._errors():
            if conn is None:
                replies: list[Any] = sent
            else:
                replies = read_replies(conn, sent)
            _raise_any(replies)
        return replies

    def _forget_view(self) -> None:
        """A restore re-arms the pinned connection's WATCH: what the last lookup read guards nothing now."""
        if self._ahead is not None:
            with self._errors():
                self._drain()
            self._ahead = None
        self._view = _View()

    def _insert_unchecked(self, entries: Sequence[tuple[str, float, bytes, tuple[int, ...]]]) -> int:
        """The insert script with every tail empty and no marker: no comparison with what a lookup saw.
        `entries`: (id, event time, stored bytes, bucket keys)."""
        args: list[str | int | bytes] = [self._spre, repr(self.window), repr(self.slice_length), self.bucket_cap,
                                         self._ttl_ms, repr(self._hwm), "", 0, 0, self._clock_arg(), b""]
        for id, ts, blob, keys in entries:
            fields = [field_of(key) for key in keys]
            args += [id.encode("utf-8", "surrogatepass"), repr(ts), blob, len(fields), b"", *fields]
        [(_, _, results)] = self._eval_pipelined(_INSERT, [args])
        self._view.exact = False  # the script wrote values no lookup of this instance read
        return sum(1 for r in results if r > 0)

    def expire(self, now: float) -> int:
        """Sets the window's clock to `now` (it only moves forward): no caller will look for anything older
        than `now - window` any more, so this instance's inserts may unlink a slice wholly older than that.
        Without a call the newest event time stored is the clock. Aligned workers set their group's low
        watermark: a worker running ahead of another then never unlinks what that one still needs.

        Redis forgets by slice (the inserts unlink, key TTLs do the rest): nothing is deleted here, and
        the count of what went is unknown: 0."""
        self._clock = now if self._clock is None else max(self._clock, now)
        return 0

    def _clock_arg(self) -> str:
        """The window's clock for the insert script ('' for the newest event time stored)."""
        return "" if self._clock is None else repr(self._clock)

    def stats(self) -> dict[str, int]:
        """`entries`, `buckets` and `memos` in the slices of the window (a bucket with records in two slices
        counts twice; a memo written again, after a lost race or a retried batch, too), and `inserted`, the
        seq counter: a few O(1) commands, whatever the namespace holds. Entries, records and memos that
        left the window by event time count until their slice goes."""
        with self._errors():
            seq, stored = self._client.hmget(self._meta, "seq", "hwm")
            top = _stored_time(cast("bytes | None", stored) or b"")
            slices = self._slices(top, top)
            replies = self._execute([c for s in slices for c in (("HLEN", f"{self._spre}{s}"),
                                                                  ("HMGET", f"{self._spre}{s}", "n", "m"))],
                                    pinned=False)
            _raise_any(replies)
        fields = sum(replies[0::2])
        counts = [c for pair in replies[1::2] for c in pair]
        entries = sum(int(n) for n in counts[0::2] if n is not None)
        memos = sum(int(m) for m in counts[1::2] if m is not None)
        counters = sum(c is not None for c in counts)
        return {"entries": entries, "buckets": fields - entries - memos - counters, "memos": memos,
                "inserted": int(seq or 0)}

    def close(self) -> None:
        self._ahead = None
        self._drop_held()
        if self._conn is not None:
            self._conn.deregister_connect_callback(self._connected)
            self._conn.disconnect()
            cast(redis.Redis, self._client).connection_pool.release(self._conn)
            self._conn = None
            self._epoch += 1  # its WATCH is gone: a lookup's view from before guards nothing now
        self._client.close()

    # -- reading ---------------------------------------------------------------------------------
    def _slice(self, ts: float) -> int:
        return math.floor(ts / self.slice_length)

    def _slices(self, low_mark: float, high_mark: float) -> tuple[int, ...]:
        """The slices that can hold a record inside the window of event times from `low_mark` to
        `high_mark` (high-water marks): from the slice of low_mark - window to that of high_mark."""
        if not math.isfinite(high_mark):
            return ()
        low = low_mark if math.isfinite(low_mark) else high_mark
        return tuple(range(self._slice(low - self.window), self._slice(high_mark) + 1))

    def _read_covering(self, names: Sequence[bytes], slices: Sequence[int], low_mark: float,
                       high_mark: float, *, watch: bool = False) -> tuple[int, bytes, tuple[int, ...],
                                                                          list[list[bytes | None]]]:
        """`_read` of `names` in `slices` and whatever more it takes for the seq read to be a mark: every
        record with a seq up to it that can still match (`low_mark`'s window and on) is in the columns.

        A record's event time is at most the high-water mark stored with its seq, so the slices must
        reach the slice of the mark read together with the seq. If another worker moved it beyond
        `slices` already, one more read covers that slice too; the seq and mark stay those of the first
        read (records inserted after it count as unseen, which is safe: they are checked at insert)."""
        slices = tuple(slices)
        seq, stored, columns = self._read(names, slices, watch=watch)
        need = self._slices(low_mark, max(high_mark, _stored_time(stored)))
        if not set(need) <= set(slices):
            slices = tuple(sorted(set(slices) | set(need)))
            _, _, columns = self._read(names, slices)
        return seq, stored, slices, columns

    def _read(self, names: Sequence[bytes], slices: Sequence[int], *,
              watch: bool = False) -> tuple[int, bytes, list[list[bytes | None]]]:
        """(seq, stored high-water mark as stored, per slice the values of `names`): one round trip,
        the seq read first; `watch`: WATCH the meta hash afresh just before (`_write_watched`)."""
        with self._errors():
            replies = self._execute(self._read_commands(names, slices, watch=watch))
            _raise_any(replies)
        if watch:
            replies = replies[2:]
        seq, stored = self._state(replies[0])
        return seq, stored, _columns(replies[1:], len(slices), len(names))

    def _state(self, reply: Sequence[Any]) -> tuple[int, bytes]:
        """(seq, high-water mark as stored) of a read of the meta hash (`_read_commands`). A fenced index
        also finds its marker there (`IndexLost` when it is missing) and keeps it for the inserts."""
        if self.fenced:
            if reply[2] is None:
                self._marker = b""  # the loss is told (the caller rebuilds or waits): the next marker is taken as it is
                raise IndexLost(f"the Redis index at {self._where} holds no marker ({self._meta} {MARKER}): "
                                "its data was lost, or it is being rebuilt from the changelog")
            rebuilt = bool(self._marker) and reply[2] != self._marker
            self._marker = reply[2]
            if rebuilt:
                # Lost and rebuilt by another worker between two batches of this one: the rebuild read the
                # changelog before this worker committed its last batches, so their entries may be missing.
                # Told once, so that its worker writes them back before deciding anything against the index.
                raise IndexLost(f"the Redis index at {self._where} was rebuilt since this worker's last batch "
                                f"(its marker {self._meta} {MARKER} changed)")
        return int(reply[0] or 0), reply[1] or b""

    def _lost(self) -> IndexLost:
        return IndexLost(f"the Redis index at {self._where} was lost or rebuilt since this batch's lookup "
                         f"(its marker {self._meta} {MARKER} changed): nothing of the batch was written")

    def _expected_marker(self) -> bytes:
        """The marker an insert requires (b"" when not fenced: no check): its lookup's, else the last read."""
        if not self.fenced:
            return b""
        if not self._view.marker and not self._marker:
            with self._errors():
                replies = self._execute([("HMGET", self._meta, "seq", "hwm", MARKER)])
                _raise_any(replies)
            self._state(replies[0])
        return self._view.marker or self._marker

    def _read_commands(self, names: Sequence[bytes], slices: Sequence[int], *,
                       watch: bool) -> list[Sequence[str | int | bytes]]:
        step = FIELDS_PER_HMGET
        commands: list[Sequence[str | int | bytes]] = [("HMGET", self._meta, "seq", "hwm",
                                                         *((MARKER,) if self.fenced else ()))]
        if watch:  # UNWATCH first: a WATCH of a key already watched would keep its old dirty flag
            commands[:0] = [("UNWATCH",), ("WATCH", self._meta)]
        for s in slices:
            key = f"{self._spre}{s}"
            commands += [("HMGET", key, *names[a : a + step]) for a in range(0, len(names), step)]
        return commands

    def _entries(self, wanted: set[tuple[str, float]]) -> dict[str, Entry]:
        """The stored entries named by (id, event time) pairs, as bucket records name them; one that is
        gone (its slice expired) is left out.

        An id's entry at one event time never changes: it is written once, and an id is written again
        only after its entry left the window, so at a later event time. So the entries this instance
        wrote or read lately are kept (`entry_cache` of them, the newest) and only the others are read:
        with one worker, or a wave of near-duplicates, a lookup's candidates are mostly recent entries,
        and the round trip, Redis's HMGET and the decoding go."""
        out: dict[str, Entry] = {}
        if not wanted:
            return out
        known = self._known
        by_slice: dict[int, list[str]] = {}
        for id, ts in sorted(wanted):
            entry = known.get((id, ts))
            if entry is not None:
                out[id] = entry
            else:
                by_slice.setdefault(self._slice(ts), []).append(id)
        if not by_slice:
            return out
        with self._errors():
            # No share of other work here: Redis answers this short read sooner than a share takes, and the
            # insert's transaction, the longest wait, comes next.
            replies = self._execute([("HMGET", f"{self._spre}{s}", *map(id_field, ids)) for s, ids in by_slice.items()],
                                    share=False)
            _raise_any(replies)
        for ids, blobs in zip(by_slice.values(), replies):
            read = self._decode(ids, blobs, new_entry, decode_entry)
            out.update(read)
            self._remember(read.values())
        return out

    def _remember(self, entries: Iterable[Entry]) -> None:
        """Keeps `entries` for `_entries`: the newest `entry_cache` at least (the oldest go in bulk, once a
        quarter more are kept)."""
        cap = self._known_cap
        if not cap:
            return
        known = self._known
        known.update({(entry.id, float(entry.ts)): entry for entry in entries})
        if len(known) > cap + cap // 4:
            self._known = dict(islice(known.items(), len(known) - cap, None))

    # -- inserting -------------------------------------------------------------------------------
    def _fields_of(self, entries: Sequence[tuple[Entry, tuple[int, ...]]]) -> tuple[list[list[bytes]],
                                                                                    list[list[int] | None]]:
        """Each entry's bucket fields, and their places in the lookup's columns (None: the lookup did not cover
        it with these keys)."""
        view = self._view
        looked = view.looked
        fields_of: list[list[bytes]] = []
        places_of: list[list[int] | None] = []
        for entry, keys in entries:
            q = looked.get(entry.id)
            if q is not None and (view.keys_of[q] is keys or view.keys_of[q] == keys):
                fields_of.append(view.fields_of[q])
                places_of.append(view.places_of[q])
            else:
                fields_of.append([field_of(key) for key in keys])
                places_of.append(None)
        return fields_of, places_of

    def _insert_chunk(self, entries: Sequence[tuple[Entry, tuple[int, ...]]]) -> list[list[Candidate] | None]:
        fields_of, places_of = self._fields_of(entries)
        results = self._alone(entries, fields_of, places_of) if self.alone_inserts else None
        if results is None:
            results = self._checked(entries, fields_of)
        self._keep_inserted(entries, results)
        out: list[list[Candidate] | None] = [None] * len(entries)
        again = [i for i, result in enumerate(results) if result < 0]
        if again:
            conflicts = self._reread([entries[i] for i in again], [fields_of[i] for i in again])
            for i, cands in zip(again, conflicts):
                out[i] = cands
        return out

    def _keep_inserted(self, entries: Sequence[tuple[Entry, tuple[int, ...]]], results: Sequence[int]) -> None:
        """Keeps the entries `_insert_chunk` inserted (a result > 0) for later reads of them."""
        self._remember([entry for (entry, _), result in zip(entries, results) if result > 0])

    def _places(self, id: str, fields: Sequence[bytes]) -> Sequence[int | None]:
        view = self._view
        q = view.looked.get(id)
        return view.places_of[q] if q is not None and view.fields_of[q] is fields else [view.at.get(f) for f in fields]

    def _checked(self, entries: Sequence[tuple[Entry, tuple[int, ...]]],
                 fields_of: Sequence[list[bytes]]) -> list[int]:
        """One INSERT_LUA call: the script compares each entry's buckets with what the caller saw."""
        view = self._view
        args: list[str | int | bytes] = [self._spre, repr(self.window), repr(self.slice_length), self.bucket_cap,
                                         self._ttl_ms, repr(self._hwm), ",".join(map(str, view.slices)),
                                         view.mark, view.inserted, self._clock_arg(), self._expected_marker()]
        places_of = [self._places(entry.id, fields) for (entry, _), fields in zip(entries, fields_of)]
        blobs = self._encode(list(entries), encode_entry)  # (compiled: one call a round, not one an entry)
        for (entry, _), fields, places, blob in zip(entries, fields_of, places_of, blobs):
            expected = b"" if None in places else view.expected(entry.id, places)  # type: ignore[arg-type]
            args += [entry.id.encode("utf-8", "surrogatepass"), repr(_event_time(entry.ts, entry.id, self.slice_length)),
                     blob, len(fields), expected, *fields]
        [(lost, hwm, results)] = self._eval_pipelined(_INSERT, [args], self._memo_commands())
        self._memos_sent()  # written beside the script, whatever it answered
        if lost == -1:
            raise self._lost()
        view.hwm = hwm
        view.exact = False  # the script wrote values this caller did not compute
        for (entry, _), places, result in zip(entries, places_of, results):
            if result > 0:
                self._inserted(result, self._slice(float(entry.ts)), places, SEQ.pack(result), view.basis(entry.id))
        return list(results)

    def _inserted(self, seq: int, s: int, places: Sequence[int | None], value_or_tail: bytes | None,
                  basis: int) -> None:
        view = self._view
        view.own.add(seq)
        view.inserted += 1
        # A field no lookup read (place None) is not needed: no later insert of this batch names it.
        known = [p for p in places if p is not None]
        if value_or_tail is not None:
            view.written.setdefault(s, {}).update(dict.fromkeys(known, value_or_tail))
        view.settled_bases().setdefault(s, {}).update(dict.fromkeys(known, basis))

    def _alone(self, entries: Sequence[tuple[Entry, tuple[int, ...]]], fields_of: Sequence[list[bytes]],
               places_of: Sequence[list[int] | None], *, ahead: bool = False) -> list[int] | None:
        """What INSERT_LUA would do if nobody else inserted since the lookup, computed here from what
        the lookup read and written with INSERT_ALONE_LUA; None if it cannot be (an id not looked up,
        a slice not read, an earlier INSERT_LUA call, or somebody else wrote after all). `ahead`: as the
        WATCH-guarded transaction only, sent without reading its answer (`insert_ahead`; None if it cannot
        go so: nothing sent)."""
        view = self._view
        if not view.exact or not view.slices or any(p is None for p in places_of) \
                or (ahead and view.watch != self._epoch):
            return None
        window, cap = self.window, self.bucket_cap
        times = _event_times(entries, self.slice_length)
        stored_hwm = _stored_time(view.hwm)
        hwm = max(self._hwm, stored_hwm)
        slices = range(self._slice(max(hwm, min(times)) - window), self._slice(max(hwm, max(times))) + 1)
        if slices[0] < view.slices[0] or slices[-1] > view.slices[-1]:
            return None
        start = seq = view.mark + view.inserted
        # This call's writes, slice -> place -> value, over what the caller wrote before (kept apart:
        # if the script finds that somebody else wrote, they never happened).
        writes: dict[int, dict[int, bytes]] = {s: dict(view.written.get(s, {})) for s in slices}
        looked = view.looked
        results, groups, pending, hwm, seq = self._round(
            [e.id for e, _ in entries], times, self._encode(list(entries), encode_entry), list(fields_of),
            cast("list[list[int]]", list(places_of)), [view.entry_places[looked[e.id]] for e, _ in entries],
            tuple(slices), view.columns, writes,
            hwm, window, self.slice_length, cap, seq, entry_time)
        hwm_bytes = view.hwm if hwm <= stored_hwm else (b"%.17g" % hwm)
        clock = hwm if self._clock is None else self._clock
        gone = f"{self._spre}{self._slice(clock - window) - 1}" if seq > start else ""
        if ahead:
            if not self._send_watched(self._watched_commands(start, seq, view.hwm, hwm_bytes, gone, groups),
                                      seq, hwm_bytes, partial(self._forget_kept, entries)):
                return None
        elif view.watch == self._epoch:  # -1 never is: epochs start at 1 with the first connection
            written = self._write_watched(start, seq, view.hwm, hwm_bytes, gone, groups)
            if written is None:
                return None
            if not written:
                view.watch = -1  # somebody wrote right after: later rounds go through the script's check
        else:
            args: list[str | int | bytes] = [str(start), view.hwm, str(seq), hwm_bytes, self._ttl_ms, gone,
                                             self._expected_marker(), 0, "", ""]
            for s, (count, pairs) in groups.items():
                args += [f"{self._spre}{s}", count, len(pairs) // 2, *pairs]
            [done] = self._eval_pipelined(_INSERT_ALONE, [args], self._memo_commands())
            if done == -1:
                raise self._lost()
            if not done:
                self._memos_sent()  # written beside the script, whatever it answered
                return None
        self._wrote_round(hwm_bytes, pending, groups, writes)
        return results

    def _wrote_round(self, hwm: bytes, pending: list[tuple[int, int, list[int]]], groups: dict[int, list[Any]],
                     writes: dict[int, dict[int, bytes]]) -> None:
        """Keeps in the view what an uncontended round wrote (the high-water mark, its entries (seq, slice,
        places) and the slices' values); its memos went with it, in the transaction or beside the script."""
        view = self._view
        view.hwm = hwm
        view.own.update([seq_i for seq_i, _, _ in pending])
        view.inserted += len(pending)
        view._unsettled.append(pending)
        for s in groups:
            view.written[s] = writes[s]
        self._memos_sent()

    def _write_watched(self, start: int, seq: int, stored_hwm: bytes, hwm: bytes, gone: str,
                       groups: dict[int, list[Any]]) -> bool | None:
        """INSERT_ALONE_LUA's writes as a MULTI/EXEC transaction on the pinned connection, whose WATCH of
        the meta hash (armed by the lookup's read, or re-armed by the previous call) makes Redis refuse it
        if anybody else wrote since. None: refused, nothing written. Else written, and WATCH re-armed:
        True if the meta hash then still held what this wrote (the next round may go the same way)."""
        replies = self._exec_watched(self._watched_commands(start, seq, stored_hwm, hwm, gone, groups))
        if replies is None:
            return None
        now_seq, now_hwm = replies[-1]
        return int(now_seq or 0) == seq and (now_hwm or b"") == hwm

    def _watched_commands(self, start: int, seq: int, stored_hwm: bytes, hwm: bytes, gone: str,
                          groups: dict[int, list[Any]]) -> list[Sequence[str | int | bytes]]:
        """`_write_watched`'s transaction: MULTI, the writes, EXEC, then WATCH and HMGET of the meta hash."""
        meta, ttl = self._meta, self._ttl_ms
        step = 2 * FIELDS_PER_CALL
        commands: list[Sequence[str | int | bytes]] = [("MULTI",)]
        for s, (count, pairs) in groups.items():
            key = f"{self._spre}{s}"
            commands += [("HSET", key, *pairs[a : a + step]) for a in range(0, len(pairs), step)]
            commands += [("HINCRBY", key, "n", count), ("PEXPIRE", key, ttl)]
        if seq != start:
            commands.append(("HSET", meta, "seq", seq))
        if hwm != stored_hwm:
            commands.append(("HSET", meta, "hwm", hwm))
        if seq != start or hwm != stored_hwm:
            commands.append(("PEXPIRE", meta, ttl))
        if gone:
            commands.append(("UNLINK", gone))
        commands += self._memo_commands()  # in the transaction: written with the entries, or not at all
        commands += [("EXEC",), ("WATCH", meta), ("HMGET", meta, "seq", "hwm")]
        return commands

    def _send_watched(self, commands: Sequence[Sequence[str | int | bytes]], seq: int, hwm: bytes,
                      forget: Callable[[], None]) -> bool:
        """Sends a `_write_watched` transaction on the pinned connection without reading its replies, kept as
        the round sent ahead (`_held`, read by `settle`, which calls `forget` if Redis refused it); False if it
        could not go guarded (nothing sent)."""
        self._guarded = True
        try:
            with self._errors():
                conn = self._pinned()
                try:
                    count = self._pack_send(conn, commands)
                except _WatchLost:
                    return False
                except BaseException:
                    self._lose(conn)  # some of it may have gone: never reuse it (it reconnects)
                    raise
        finally:
            self._guarded = False
        view = self._view
        self._held = _HeldRound(view, self._epoch, count, seq, hwm, view.hwm, self._ahead, self._hwm, forget)
        return True

    def _forget_kept(self, entries: Sequence[tuple[Entry, tuple[int, ...]]]) -> None:
        """A refused round's entries are no longer kept (`_remember`)."""
        for entry, _ in entries:
            self._known.pop((entry.id, float(entry.ts)), None)

    def _raise_any(self, replies: Sequence[Any]) -> None:
        """`_raise_any` of the module; a layout may read its replies' errors its own way."""
        _raise_any(replies)

    def _exec_watched(self, commands: Sequence[Sequence[str | int | bytes]]) -> list[Any] | None:
        """Sends a `_write_watched` transaction (MULTI ... EXEC, WATCH, HMGET of the meta hash) on the pinned
        connection; its replies, or None if Redis refused it (nothing written)."""
        self._guarded = True
        try:
            with self._errors():
                replies = self._execute(commands)
        except _WatchLost:
            return None  # nothing was sent
        finally:
            self._guarded = False
        try:
            with self._errors():
                self._raise_any(replies)
                done = replies[-3]
                if done is None:
                    return None
                self._raise_any(done)  # a command that failed inside the transaction (the others did run)
        except BaseException:
            # Redis before 6.2 stays in MULTI after refusing EXEC itself: start afresh, whatever happened.
            if self._conn is not None:
                self._conn.disconnect()
            raise
        return replies

    def _reread(self, entries: Sequence[tuple[Entry, tuple[int, ...]]],
                fields_of: Sequence[list[bytes]]) -> list[list[Candidate]]:
        """After a conflict: read the entries' buckets again and return, per entry, the records others
        inserted since it was last verified; its retry is checked against this read."""
        view = self._view
        names = list(dict.fromkeys(f for fields in fields_of for f in fields))
        wanted = tuple(sorted(set(view.slices) | set(self._slices(self._hwm, self._hwm))))
        seq, _, slices, columns = self._read_covering(names, wanted, self._hwm, self._hwm)
        if view.marker and self._marker != view.marker:
            raise self._lost()
        horizon = self._hwm - self.window
        at = {name: i for i, name in enumerate(names)}
        view.slices = slices  # a slice the lookup did not read: what it holds is unknown, absent there
        ranked = []
        for (entry, _), fields in zip(entries, fields_of):
            # Only a looked-up entry can conflict: the others were inserted without a comparison.
            since = view.reread[entry.id][0] if entry.id in view.reread else view.mark
            places = [at[f] for f in fields]
            ranked.append(self._rank(columns, places, entry.id, 1, len(fields) * self.bucket_cap + 1, horizon,
                                     self.bucket_cap, since, view.own))
            view.reread[entry.id] = (seq, {s: [(column[p] or b"")[-8:] or ABSENT for p in places]
                                           for s, column in zip(slices, columns)})
        found = self._entries({(id, ts) for cands in ranked for id, _, _, ts in cands})
        return [[Candidate(found[id], shared, keys[first]) for id, shared, first, _ in cands if id in found]
                for (_, keys), cands in zip(entries, ranked)]

    # -- plumbing ----------------------------------------------------------------------------------
    def _eval_pipelined(self, script: _Script, calls: Sequence[Sequence[str | int | bytes]],
                        then: Sequence[Sequence[str | int | bytes]] = ()) -> list[Any]:
        """Runs `script` once per call in one round trip, and the commands `then` after them; reloads the
        script once if the server forgot it. Returns the script's replies."""
        with self._errors():
            replies = self._execute([*(("EVALSHA", script.sha, 1, self._meta, *args) for args in calls), *then])
            _raise_any(replies[len(calls):])
            replies = replies[: len(calls)]
            missing = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
            if missing:
                self._client.script_load(script.source)
                again = self._execute([("EVALSHA", script.sha, 1, self._meta, *calls[i]) for i in missing])
                for i, reply in zip(missing, again, strict=True):
                    replies[i] = reply
            _raise_any(replies)
            return replies

    def _execute(self, commands: Sequence[Sequence[str | int | bytes]], *, pinned: bool = True,
                 share: bool = True) -> list[Any]:
        """Runs `commands` in one round trip; an error reply comes back in its place (`_raise_any`).

        On standalone Redis the commands are packed in C (the compiled core's `pack_commands`, else
        hiredis) and sent on one connection: redis-py's own pipeline inspects every argument in Python
        first, which cost more than the rest of a lookup (tens of thousands of field names a batch). The
        lookups and inserts (`pinned`) all go on the instance's own connection, whose WATCH guards the
        uncontended insert; anything else (`stats`, which a metrics thread may call while a batch is
        routed) on one from the pool. A cluster client keeps redis-py's pipeline, which knows where a
        slot lives (a namespace is one slot, so one node)."""
        if isinstance(self._client, RedisCluster) or (hiredis is None and _native is None):
            pipe = self._client.pipeline(transaction=False)  # type: ignore[no-untyped-call]
            for command in commands:
                pipe.execute_command(*command)
            replies: list[Any] = pipe.execute(raise_on_error=False)
            return replies
        pool = self._client.connection_pool
        if not pinned:
            conn = pool.get_connection()
            try:
                return self._send(conn, commands)
            finally:
                pool.release(conn)
        return self._send(self._pinned(), commands, pinned=True, share=share)

    def _pinned(self) -> Any:
        """The instance's own connection (made on first use: a new connection is a new epoch)."""
        if self._conn is None:
            conn = cast(redis.Redis, self._client).connection_pool.get_connection()  # connected already: no callback for it
            conn.register_connect_callback(self._connected)  # type: ignore[no-untyped-call]
            self._conn = conn
            self._epoch += 1
        return self._conn

    def _send(self, conn: Any, commands: Sequence[Sequence[str | int | bytes]], *, pinned: bool = False,
              share: bool = True) -> list[Any]:
        try:
            count = self._pack_send(conn, commands)
            if pinned and share and self.meanwhile is not None and self.meanwhile():  # the engine's thread: its work
                self.meanwhile = None
            if pinned:
                self._drain()  # a read sent ahead on this connection: its replies come first
                self._read_held()  # ... and those of a round sent ahead
            return read_replies(conn, count)
        except BaseException:
            self._lose(conn)  # replies may still be on their way: never reuse it (it reconnects)
            raise

    @staticmethod
    def _pack_send(conn: Any, commands: Sequence[Sequence[str | int | bytes]]) -> int:
        """Sends `commands` (`_pack_and_send`); the number of replies they get (a layout may send commands
        packed already among them)."""
        RedisIndex._pack_and_send(conn, commands)
        return len(commands)

    @staticmethod
    def _pack_and_send(conn: Any, commands: Sequence[Sequence[str | int | bytes]]) -> None:
        if _native is not None:
            conn.send_packed_command([_native.pack_commands(list(commands))])
        else:
            conn.send_packed_command([hiredis.pack_command(tuple(command))  # type: ignore[arg-type]
                                      for command in commands])

    def _drain(self) -> None:
        """Reads the replies of the read sent ahead (`prefetch`), if not read yet, and keeps them for the
        lookup; forgets it if the connection it went on is gone (its replies went with it)."""
        ahead = self._ahead
        if ahead is None or not ahead.pending:
            return
        held = self._held
        if held is not None and held.pending and ahead is not held.before:
            self._read_held()  # the round `insert_ahead` sent went before this read: its answer comes first
        if ahead.epoch != self._epoch or self._conn is None:
            self._ahead = None
            return
        conn, n, ahead.pending = self._conn, ahead.pending, 0
        try:
            ahead.replies.extend(read_replies(conn, n))
        except BaseException:
            self._lose(conn)
            raise

    def _lose(self, conn: Any) -> None:
        """`conn` is not to be used again (replies may still be on their way): disconnected (the next send
        reconnects); if it is the pinned one, what went on it unanswered (a read or a round sent ahead) goes
        with it."""
        conn.disconnect()
        if conn is self._conn:
            self._ahead = None
            self._drop_held()

    def _drop_held(self) -> None:
        """The round sent ahead is dropped with its answer unread (its connection lost, its batch failed, the
        index closed): whether Redis wrote it is unknown, so what it left in the layout's keeping is forgotten
        (`_HeldRound.forget`) and read again when needed. Its view goes too: the next lookup reads afresh."""
        held, self._held = self._held, None
        if held is not None:
            held.forget()

    def _watchable(self) -> bool:
        """Can the uncontended insert go as a transaction guarded by WATCH (`_write_watched`)?"""
        return self.alone_inserts and self._direct()

    def _direct(self) -> bool:
        """Do `_execute`'s commands go packed as RESP on one connection (standalone Redis, packed in C), not
        through redis-py's pipeline?"""
        return not isinstance(self._client, RedisCluster) and (hiredis is not None or _native is not None)

    def _connected(self, conn: Any) -> None:
        self._epoch += 1  # a new connection watches nothing
        if self._guarded:  # refuse to send the transaction unguarded (redis-py reconnects on send)
            raise _WatchLost()

    def _errors(self) -> AbstractContextManager[None]:
        return redis_errors(self._where)

    def __repr__(self) -> str:
        return f"RedisIndex({self._where!r}, namespace={self.namespace!r}, window={self.window})"


@dataclass(slots=True)
class _Chunk:
    """A chunk of a restore: its entries (`Stored`'s columns, `bounds` from 0) and its read's plan."""

    ids: list[str]
    times: np.ndarray
    slices: np.ndarray
    bounds: np.ndarray
    keys: np.ndarray
    blobs: list[bytes]
    chunk_slices: list[int] = field(default_factory=list)  # the slices its entries go to
    named: dict[int, np.ndarray] = field(default_factory=dict)  # per slice: the bucket keys named there
    wanted: dict[int, list[bytes]] = field(default_factory=dict)  # per slice: the fields read
    present: list[bool] = field(default_factory=list)  # per slice: whether it existed when read

    def part(self, at: int, stop: int) -> _Chunk:
        """Its entries from `at` to `stop`."""
        first, last = int(self.bounds[at]), int(self.bounds[min(stop, len(self.ids))])
        return _Chunk(self.ids[at:stop], self.times[at:stop], self.slices[at:stop],
                      self.bounds[at : stop + 1] - first, self.keys[first:last], self.blobs[at:stop])
    _id_keys: np.ndarray | None = None

    @property
    def id_keys(self) -> np.ndarray:
        """Its ids as 64-bit keys of a Bloom filter (mmh3)."""
        if self._id_keys is None:
            self._id_keys = np.fromiter((mmh3.hash64(id.encode("utf-8", "surrogatepass"), signed=False)[0]
                                         for id in self.ids), np.uint64, len(self.ids))
        return self._id_keys

    def remember(self, s: int, bits: np.ndarray) -> None:
        """Adds what it writes into slice `s` to `bits`: the bucket keys named there, the ids that go there."""
        if s in self.named:
            bloom_add(bits, self.named[s])
            bloom_add(bits, self.id_keys[self.slices == s])


@dataclass(slots=True)
class _Rebuilt:
    """What this instance's restores wrote since the namespace's seq last moved by another hand (every write
    of the namespace moves it): the slices they found missing, and per such slice a Bloom filter of the
    bucket fields they wrote there. A field not in it is absent: a restore need not read it. Forgotten at
    the next batch (`decide`): only a restore chunk after chunk (`_restore_chunk`) gains from it."""

    seq: int = -1  # the seq the last restore wrote
    hwm: float = -math.inf  # the namespace's newest event time as the restores know it (this instance's clock is its own)
    fresh: dict[int, np.ndarray] = field(default_factory=dict)  # slice -> `bloom_bits`


class _Sender:
    """Sends a rebuild's bucket writes (packed commands) from a thread of its own: the next piece is made while
    the last one is sent, as fast as Redis takes it. `close` waits for the sends and tells how many replies
    to read; an error of the thread is raised by the next `send` or `close`."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._queue: queue.Queue[bytes | None] = queue.Queue(4)
        self._error: BaseException | None = None
        self._count = 0
        self._thread = threading.Thread(target=self._run, name="neardup-rebuild-send", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (packed := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._conn.send_packed_command([packed])
                except BaseException as exc:  # raised in the caller's thread
                    self._error = exc

    def send(self, packed: bytes, count: int) -> None:
        """Queues `packed` (`count` commands)."""
        if self._error is not None:
            raise self._error
        self._queue.put(packed)
        self._count += count

    def close(self, *, raising: bool = True) -> int:
        """Waits for the sends; returns the number of replies to read."""
        self._queue.put(None)
        self._thread.join()
        if raising and self._error is not None:
            raise self._error
        return self._count


@dataclass(slots=True)
class _Held:
    """A rebuild's bucket records not written yet (`RedisIndex._rebuild`): per slice and share of the keys (their
    low bits), (bucket keys, entry numbers) arrays, each chunk's records in order; per entry (numbered in
    insertion order) its event time, seq and id; and per slice the bucket keys an earlier flush wrote (read
    back when named again)."""

    records: dict[tuple[int, int], list[tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)
    times: list[np.ndarray] = field(default_factory=list)
    seqs: list[np.ndarray] = field(default_factory=list)
    ids: list[bytes] = field(default_factory=list)
    id_lengths: list[np.ndarray] = field(default_factory=list)
    entries: int = 0
    count: int = 0  # records held
    flushed: dict[int, np.ndarray] = field(default_factory=dict)

    def add(self, part: _Chunk, seqs: np.ndarray, took: np.ndarray, id_bytes: list[bytes]) -> None:
        """The records of the entries `took` of `part` (their seqs in `seqs`, their ids in `id_bytes`)."""
        if not len(took):
            return
        counts = np.diff(part.bounds)
        numbers = np.repeat(np.arange(self.entries, self.entries + len(took), dtype=np.int64), counts[took])
        keys = part.keys[np.repeat(seqs > 0, counts)]
        if len(keys):
            self._add_records(keys, numbers, np.repeat(part.slices[took], counts[took]))
        self.times.append(part.times[took])
        self.seqs.append(seqs[took])
        self.ids.append(b"".join(id_bytes))
        self.id_lengths.append(np.fromiter(map(len, id_bytes), np.int64, len(id_bytes)))
        self.entries += len(took)
        self.count += len(keys)

    def _add_records(self, keys: np.ndarray, numbers: np.ndarray, slices: np.ndarray) -> None:
        """Records (bucket key, entry number, slice) put with the others of their slice and share."""
        # Apart by slice and by the key's low bits (the top ones tell the method): a flush groups a share at a
        # time (a sixteenth of the memory), and Redis writes the share before while the next is made.
        group = (slices - slices.min()) * _SHARES + (keys & np.uint64(_SHARES - 1)).astype(np.int64)
        # Few groups (slices × shares): as uint16 numpy's stable sort is a radix sort.
        order = np.argsort(group.astype(np.uint16) if group.max() < 1 << 16 else group, kind="stable")
        group = group[order]
        bounds = np.flatnonzero(np.concatenate(([True], group[1:] != group[:-1], [True])))
        base = int(slices.min())
        for a, b in pairwise(bounds.tolist()):
            at = order[a:b]
            s, share = divmod(int(group[a]), _SHARES)
            self.records.setdefault((base + s, share), []).append((keys[at], numbers[at]))

    def columns(self) -> tuple[np.ndarray, np.ndarray, bytes, np.ndarray]:
        """Per entry: event times, seqs, the ids joined and where each ends."""
        if not self.times:
            return np.zeros(0), np.zeros(0, np.uint64), b"", np.zeros(0, np.int64)
        return (np.concatenate(self.times), np.concatenate(self.seqs), b"".join(self.ids),
                np.cumsum(np.concatenate(self.id_lengths)))

    def compact(self, newest: Callable[..., np.ndarray], cap: int) -> None:
        """Drops the records no bucket field keeps (`newest_records`)."""
        times, seqs, _, _ = self.columns()
        self.count = 0
        for s, parts in self.records.items():
            keys = np.concatenate([k for k, _ in parts])
            entries = np.concatenate([e for _, e in parts])
            order = newest(keys, entries, times, seqs, cap)
            self.records[s] = [(keys[order], entries[order])]
            self.count += len(order)

    def clear(self) -> None:
        """Forgets the records and entries (not what was flushed)."""
        self.records, self.times, self.seqs, self.ids, self.id_lengths = {}, [], [], [], []
        self.entries = self.count = 0


_SHARES = 16


class _WatchLost(Exception):
    """The pinned connection reconnected while a WATCH-guarded transaction was being sent."""


def _raise_any(replies: Sequence[Any]) -> None:
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply


def _parts(n_names: int) -> int:
    """How many HMGETs read `n_names` fields of one slice."""
    return -(-n_names // FIELDS_PER_HMGET)


def _columns(replies: Sequence[Any], n_slices: int, n_names: int) -> list[list[bytes | None]]:
    """The HMGET replies of a read (`_read_commands`, after the meta hash's) as one column per slice."""
    parts, columns = iter(replies), []
    for _ in range(n_slices):
        column: list[bytes | None] = []
        for _ in range(_parts(n_names)):
            column.extend(next(parts))
        columns.append(column)
    return columns



def _distinct(keys: np.ndarray) -> np.ndarray:
    """The distinct keys, sorted (`np.unique`, whose hashing path is 25 times slower on a million uint64)."""
    ordered = np.sort(keys)
    return ordered[np.concatenate(([True], ordered[1:] != ordered[:-1]))] if len(ordered) else ordered


def _stored_time(stored: bytes) -> float:
    return float(stored) if stored else -math.inf



def _event_time(ts: float, id: str, slice_length: float) -> float:
    ts = float(ts)
    # Slice numbers must stay exact integers, in Lua (doubles) as in Python: |ts / slice| < 2^50. The same test
    # is written inline in `high_marks` and `_memo_writes` (a call a message counts there), each calling this
    # one to raise; tests/test_redis_index.py refuses the same bad times through lookup and insert.
    if not (_MIN_TS < ts < math.inf and abs(ts / slice_length) < _MAX_SLICE):  # also rejects NaN
        raise ValueError(f"event time of {id!r} must be finite, > -2^52 and below 2^50 windows, got {ts!r}")
    return ts


def _event_times(entries: Sequence[tuple[Entry, tuple[int, ...]]], slice_length: float) -> list[float]:
    """`_event_time` of each entry, checked all at once (the first bad one raises its error)."""
    times = [float(e.ts) for e, _ in entries]
    if times and not (_MIN_TS < min(times) and max(times) < math.inf and math.isfinite(math.fsum(times))
                      and max(abs(min(times)), abs(max(times))) / slice_length < _MAX_SLICE):
        for (e, _), ts in zip(entries, times):
            _event_time(ts, e.id, slice_length)
    return times


def high_marks(queries: Sequence[Query], hwm: float, slice_length: float) -> list[float]:
    """Each query's high-water mark, from `hwm` on: its own event time and those before it count."""
    marks: list[float] = []
    mark = marks.append
    for q in queries:
        ts = float(q.ts)
        if not (_MIN_TS < ts < math.inf and abs(ts / slice_length) < _MAX_SLICE):  # `_event_time`'s check, inline
            _event_time(ts, q.id, slice_length)  # raises
        if ts > hwm:
            hwm = ts
        mark(hwm)
    return marks


def read_replies(conn: Any, n: int) -> list[Any]:
    """The next `n` replies on `conn`, an error reply in its place (read whole: the connection stays in step),
    for every layout. Straight from redis-py's hiredis reader when the connection has one: redis-py's own
    path (`read_response`, a few µs a reply) costs more than a small reply, and a compact round has thousands.
    What `read_response` raises is raised: a reply saying the server cannot serve (a `ConnectionError`:
    LOADING), the socket's errors as redis-py's errors. The caller drops the connection when it raises."""
    parser: Any = getattr(conn, "_parser", None)
    reader: Any = getattr(parser, "_reader", None)
    if _HIREDIS is None or type(parser) is not _HIREDIS[0] or reader is None:
        out: list[Any] = []
        for _ in range(n):
            try:
                out.append(conn.read_response())
            except ResponseError as exc:
                out.append(exc)
        return out
    try:
        return cast("list[Any]", _gather(reader.gets, parser.read_from_socket, n, _HIREDIS[1], redis.ConnectionError))
    except OSError as exc:  # a reset socket: what redis-py's own read makes of it (timeouts it maps itself)
        raise redis.ConnectionError(f"Error while reading from the socket: {exc}") from exc
