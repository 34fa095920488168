"""The Redis candidate index: buckets and entries shared by many workers, with atomic check-and-insert.

Key layout (all keys of one namespace share the hash tag `{<prefix>:<namespace>}`):

    {p:ns}:meta        hash   seq = last insert sequence number, hwm = highest event time inserted
    {p:ns}:b:<hex>     zset   one bucket: member `<seq as 16 hex>:<entry id>`, score = event time;
                              plus the sentinel member `#` with score -(2^52 + seq of the bucket's
                              last insert): below every event time (they must be > -2^52), exact as
                              a double, and it tells a writer in O(1) whether the bucket changed
                              since a lookup
    {p:ns}:e:<id>      string the entry, `encode_entry` (version byte, then little-endian fields)
    {p:ns}:own:<uuid>  string the seq ranges one caller inserted since its last lookup (see below)

Bucket keys (64-bit fingerprints) live in key names as hex, never in scores: a score is a double and
loses integer precision above 2^53. Scores are event times (and the sentinel's seq, below 2^52). A
bucket is trimmed to the window and to the `bucket_cap` newest (event time, then seq) whenever an
insert adds to it (a new bucket has nothing to trim, which saves most of the work: most buckets of a
unique message are new). Lookups filter by event time, so what a trim has not removed yet is never
seen; members that left the window are also the first the cap evicts. Every key gets a TTL of
window + grace (wall clock) on each write, so idle buckets and entries disappear on their own. The
TTL is a safety net only: what matches is decided by event time. (If a consumer stalls for longer
than the grace, entries whose event time is still inside the window may be gone when it resumes.)

Atomicity. `lookup` runs `LOOKUP_LUA` per chunk of `LOOKUP_CHUNK` queries (pipelined: one round trip
per batch), which also returns the namespace's `seq` at that moment: the watermark of the chunk's
queries. `insert` runs `INSERT_LUA` per chunk of `INSERT_CHUNK` entries (pipelined: one round trip per
insert round; chunks bound how long one script blocks the server). For each entry the script looks
at the sentinels of the entry's buckets; if any bucket received an entry with seq > watermark that
another caller inserted, it returns those entries (ranked like a lookup) and inserts nothing;
otherwise it assigns the next seq and writes. Redis runs a script atomically, so of two workers that
looked up near-duplicates at the same moment, the second to insert always sees the first. The
caller's own inserts since its lookup never count (the engine already checked its batch against
itself, as with `MemoryIndex`): seqs a chunk assigns itself are above the seq it started at, and each
chunk appends its range to the caller's `own:` record, which later chunks and retry rounds read. When
nobody else inserted since the watermark, the script does not even look at the buckets.

Cost (bench/redis_bench.py; INFO commandstats; perf on redis-server): a lookup is one EXISTS over the
query's bucket keys (fewer existing buckets than the query's `min_shared` floor cannot yield a
candidate: the pigeonhole exit of `MemoryIndex`, which skips most queries) and otherwise one
ZRANGEBYSCORE per key plus ~0.2 µs per bucket member returned; the chunk's own-entry checks are one
MGET. An insert is ~16 ZADD and PEXPIRE calls: creating a key with a TTL is the dearest thing Redis
does here, and one key per bucket is this layout's floor. Per short message Redis spends ≈ 50-60 µs
of CPU (key creation and dict lookups ≈ 1/3, the Lua VM ≈ 1/3, allocation); the client side
(hiredis parsing and packing, one command per chunk) is small.

Cluster. `redis+cluster://` / `rediss+cluster://` use `RedisCluster`. Because every script touches
keys of one namespace only, and all of them carry the same hash tag, each script runs on one slot:
one namespace (one filter configuration) therefore lives on one master; different namespaces spread
over the cluster. Standalone Redis uses the same hash tag, so both behave the same. The scripts
declare only the meta key and build the other names from the prefixes they are given (as BullMQ
does): the names share the declared key's hash tag, hence its slot.

Errors are mapped where they enter: unreachable, timed out, loading, failing over, out of memory →
`IndexUnavailable` (retriable); wrong password or missing permission → `ConfigError` (retrying cannot
help: the URL is wrong); anything else the server refuses, or data that does not decode →
`IndexCorrupt`. There is no retry loop here (the worker decides the policy), except that a script
the server does not know (NOSCRIPT, e.g. after a restart or failover) is loaded and run again.
"""

from __future__ import annotations

import hashlib
import math
import re
import struct
import uuid
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

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

from filters.errors import ConfigError, IndexCorrupt, IndexUnavailable, NeardupError, ServiceError
from filters.index import Candidate, Entry, Query

__all__ = [
    "ENCODING_VERSION",
    "INSERT_LUA",
    "LOOKUP_LUA",
    "RedisIndex",
    "decode_entry",
    "encode_entry",
    "map_redis_error",
    "redact_url",
    "redis_errors",
]

DEFAULT_PREFIX = "neardup"
DEFAULT_GRACE = 3600.0  # seconds of wall clock that keys outlive the window
INSERT_CHUNK = 64  # entries per insert script: bounds how long one script blocks the server
LOOKUP_CHUNK = 128  # queries per lookup script: the same, for lookups (which cost less each)
# A caller's record of its own inserts is needed only until its batch's insert rounds are over. Should
# it expire earlier, the caller's own batch-mates come back as conflicts: extra verification, no harm.
OWN_RECORD_TTL_MS = 600_000
DEFAULT_SOCKET_TIMEOUT = 5.0  # without one, a stalled server would hang a worker forever
_MIN_TS = -float(2**52)  # event times must be above it (MIN_TS in the scripts)
_NAME = re.compile(r"[A-Za-z0-9_.:-]+")  # prefix and namespace: no glob or hash-tag characters

# --- the stored form of an Entry ------------------------------------------------------------------

ENCODING_VERSION = 1
# version, ts, exact (low, high 64 bits), size, flags, lengths of sketch, minhash and sentences.
# The Lua scripts read ts at byte 2 (1-based) as '<d': keep it right after the version byte.
_HEAD = struct.Struct("<BdQQIBIII")
_HAS_SIMHASH = 1
_HAS_MINHASH = 2
_U64 = np.dtype("<u8")
_U32 = np.dtype("<u4")
_MASK64 = (1 << 64) - 1


def encode_entry(entry: Entry) -> bytes:
    """The compact binary form of `entry` (its id is not included: it is the key's name)."""
    if not 0 <= entry.exact < 1 << 128:
        raise ValueError(f"exact must be an unsigned 128-bit int, got {entry.exact!r}")
    sketch = np.ascontiguousarray(entry.sketch, dtype=_U64)
    flags = 0
    tail = [sketch.tobytes()]
    if entry.simhash is not None:
        flags |= _HAS_SIMHASH
        tail.append(struct.pack("<Q", entry.simhash))
    n_minhash = 0
    if entry.minhash is not None:
        flags |= _HAS_MINHASH
        minhash = np.ascontiguousarray(entry.minhash, dtype=_U32)
        n_minhash = len(minhash)
        tail.append(minhash.tobytes())
    sentences = np.array(sorted(entry.sentences), dtype=_U64)  # sorted: one entry, one encoding
    tail.append(sentences.tobytes())
    head = _HEAD.pack(ENCODING_VERSION, entry.ts, entry.exact & _MASK64, entry.exact >> 64, entry.size,
                      flags, len(sketch), n_minhash, len(sentences))
    return b"".join([head, *tail])


def decode_entry(data: bytes, id: str) -> Entry:
    """The inverse of `encode_entry`; raises `IndexCorrupt` on anything it did not write."""
    try:
        version, ts, lo, hi, size, flags, n_sketch, n_minhash, n_sentences = _HEAD.unpack_from(data)
    except struct.error as exc:
        raise IndexCorrupt(f"entry {id!r}: {len(data)} bytes are too short for an entry") from exc
    if version != ENCODING_VERSION:
        raise IndexCorrupt(f"entry {id!r}: encoding version {version}, this neardup reads {ENCODING_VERSION}")
    if flags & ~(_HAS_SIMHASH | _HAS_MINHASH):
        raise IndexCorrupt(f"entry {id!r}: unknown flags {flags:#x}")
    has_simhash = bool(flags & _HAS_SIMHASH)
    has_minhash = bool(flags & _HAS_MINHASH)
    if not has_minhash and n_minhash:
        raise IndexCorrupt(f"entry {id!r}: minhash length without minhash")
    expected = _HEAD.size + 8 * n_sketch + 8 * has_simhash + 4 * n_minhash + 8 * n_sentences
    if len(data) != expected:
        raise IndexCorrupt(f"entry {id!r}: {len(data)} bytes where the header promises {expected}")
    pos = _HEAD.size
    # Read-only views of the reply's bytes: no copy, and nobody can change a stored entry by accident.
    sketch = np.frombuffer(data, _U64, n_sketch, pos).astype(np.uint64, copy=False)
    pos += 8 * n_sketch
    simhash = None
    if has_simhash:
        (simhash,) = struct.unpack_from("<Q", data, pos)
        pos += 8
    minhash = None
    if has_minhash:
        minhash = np.frombuffer(data, _U32, n_minhash, pos).astype(np.uint32, copy=False)
        pos += 4 * n_minhash
    sentences = frozenset(np.frombuffer(data, _U64, n_sentences, pos).tolist())
    return Entry(id, ts, lo | hi << 64, size, sketch, simhash, minhash, sentences)


# --- server-side scripts -------------------------------------------------------------------------

# Shared by both scripts. `gather` is the member-counting loop: for the buckets `keys` it counts how many
# hold each member inside the window, and remembers the first that does; `emit` ranks candidates like
# MemoryIndex (most shared keys, then the most recently inserted: members start with the seq in
# fixed-width hex, so that is the larger member), keeps the best `limit`, and appends (id, shared,
# first key index, entry) to `out`. Beyond `limit` members, an insertion sort into `limit` slots: most
# members fail the first comparison. A query's buckets can hold hundreds of members, so the work per
# member is kept to a few table operations: no scores (the range query already applied the window),
# no own-id check until ranking, and the lookup passes no filters.
_LUA_COMMON = """
-- Event times are > MIN_TS; sentinel scores are below it (see the module docstring).
local MIN_TS = -4503599627370496
local SENTINEL = '#'
local function lower_bound(horizon)  -- ZRANGEBYSCORE's min for "inside the window", never a sentinel
  if horizon < MIN_TS then horizon = MIN_TS end
  return string.format('%.17g', horizon)
end
-- The bucket key names of `keys` (16 hex digits each, concatenated).
local function bucket_names(bpre, keys)
  local names = {}
  for p = 1, #keys, 16 do names[#names + 1] = bpre .. string.sub(keys, p, p + 15) end
  return names
end
-- `bucket_ok(key)` may skip a whole bucket and `member_ok(member)` a member; nil skips nothing.
local function gather(names, lo, bucket_ok, member_ok)
  local count, first, members, n = {}, {}, {}, 0
  for k = 1, #names do
    local bkey = names[k]
    if not bucket_ok or bucket_ok(bkey) then
      local rows = redis.call('ZRANGEBYSCORE', bkey, lo, '+inf')
      for j = 1, #rows do
        local m = rows[j]
        local c = count[m]
        if c then
          count[m] = c + 1
        elseif not member_ok or member_ok(m) then
          count[m] = 1; first[m] = k; n = n + 1; members[n] = m
        end
      end
    end
  end
  return members, count, first
end
local function emit(out, members, count, first, min_shared, own_suffix, limit, epre)
  local ranked, n = {}, 0
  local own_length = 16 + #own_suffix
  for _, m in ipairs(members) do
    if count[m] >= min_shared and not (#m == own_length and string.sub(m, 17) == own_suffix) then
      n = n + 1; ranked[n] = m
    end
  end
  local function before(a, b)
    if count[a] ~= count[b] then return count[a] > count[b] end
    return a > b
  end
  local top = {}
  if n <= limit then
    top = ranked
    if n > 1 then table.sort(top, before) end
  elseif limit > 0 then
    for _, m in ipairs(ranked) do
      local t = #top
      if t < limit or before(m, top[t]) then
        if t == limit then top[t] = nil; t = t - 1 end
        local pos = t + 1
        while pos > 1 and before(m, top[pos - 1]) do top[pos] = top[pos - 1]; pos = pos - 1 end
        top[pos] = m
      end
    end
  end
  for _, m in ipairs(top) do
    local id = string.sub(m, 18)
    local blob = redis.call('GET', epre .. id)
    -- A missing entry outlived its TTL (see the module docstring): it no longer exists.
    if blob then
      out[#out + 1] = id; out[#out + 1] = count[m]; out[#out + 1] = first[m]; out[#out + 1] = blob
    end
  end
  return out
end
"""

# A script per chunk of queries rather than ZRANGEBYSCORE per bucket and MGET of the winners: one reply
# per query instead of one per bucket, and no second round trip (measured 3-4x more lookups per second
# over the eval stream); and a chunk of queries per script rather than one: most of the cost of a
# short query was the client's encoding and parsing of its own command (see bench/redis_bench.py).
LOOKUP_LUA = _LUA_COMMON + """
-- A chunk of queries, read-only. KEYS[1]: the namespace's meta hash.
-- ARGV: bucket key prefix, entry key prefix, window, limit, the caller's high-water mark of event time
--       (its previous lookups and inserts), then per query: id, event time, the fewest shared keys a
--       candidate needs, the bucket keys (16 hex digits each, concatenated).
-- Returns {seq, per query: {own entry or false, (id, shared, first key index, entry) * up to limit}}.
-- Each query's horizon is the high-water mark including it and the queries before it.
local bpre, epre = ARGV[1], ARGV[2]
local window, limit = tonumber(ARGV[3]), tonumber(ARGV[4])
local hwm = tonumber(ARGV[5])
local state = redis.call('HMGET', KEYS[1], 'seq', 'hwm')
if state[2] and tonumber(state[2]) > hwm then hwm = tonumber(state[2]) end
local out = {state[1] or '0'}
local horizon, lo = nil, nil
local entry_names = {}  -- the queries' own entries (a replay), read with one MGET
for i = 6, #ARGV, 4 do entry_names[#entry_names + 1] = epre .. ARGV[i] end
local owns = #entry_names > 0 and redis.call('MGET', unpack(entry_names)) or {}
for i = 6, #ARGV, 4 do
  local id = ARGV[i]
  local ts = tonumber(ARGV[i + 1])
  if ts > hwm or not lo then
    if ts > hwm then hwm = ts end
    horizon = hwm - window
    lo = lower_bound(horizon)
  end
  local reply = {false}
  local own = owns[(i - 2) / 4]
  if own and struct.unpack('<d', own, 2) >= horizon then reply[1] = own end
  local names = bucket_names(bpre, ARGV[i + 3])
  local min_shared = tonumber(ARGV[i + 2])
  local members, count, first = {}, {}, {}
  -- Pigeonhole, as MemoryIndex: fewer existing buckets than the floor, no candidate (most queries).
  if #names > 0 and redis.call('EXISTS', unpack(names)) >= min_shared then
    members, count, first = gather(names, lo)
  end
  out[#out + 1] = emit(reply, members, count, first, min_shared, ':' .. id, limit, epre)
end
return out
"""

INSERT_LUA = _LUA_COMMON + """
-- A chunk of one caller's inserts, atomically. KEYS[1]: the namespace's meta hash.
-- ARGV: bucket key prefix, entry key prefix, window, bucket cap, TTL (ms), the caller's high-water
--       mark of event time, the key of the caller's own-inserts record for its current lookup ('' if
--       none) and that record's TTL (ms), then per entry: id, ts, watermark ('' when it was not
--       looked up), encoded entry, its bucket keys (16 hex digits each, concatenated).
-- Returns {seq, high-water mark, per entry: 0 (inserted, or kept the first of a replayed id, or too
--          old for the window) or the flat list of candidates that entered its buckets after its
--          watermark (then it was not inserted)}.
local meta, own_key, own_ttl = KEYS[1], ARGV[7], ARGV[8]
local bpre, epre = ARGV[1], ARGV[2]
local window, cap, ttl = tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local hwm = tonumber(ARGV[6])
local state = redis.call('HMGET', meta, 'seq', 'hwm')
local stored_hwm = tonumber(state[2] or '-inf')
if stored_hwm > hwm then hwm = stored_hwm end
local start = tonumber(state[1] or '0')
local seq = start
-- The caller's own inserts since its lookup never conflict (it checked its batch against itself):
-- seqs above `start` (this chunk) and the ranges (a, b] its other chunks recorded.
local own = {}
if own_key ~= '' then
  local text = redis.call('GET', own_key)
  if text then
    for a, b in string.gmatch(text, '(%d+) (%d+)') do own[#own + 1] = {tonumber(a), tonumber(b)} end
    table.sort(own, function(x, y) return x[1] < y[1] end)
  end
end
local function is_own(s)
  if s > start then return true end
  for _, r in ipairs(own) do
    if s > r[1] and s <= r[2] then return true end
  end
  return false
end
local function foreign_since(mark)  -- did anybody else insert anything after `mark`?
  local pos = mark
  for _, r in ipairs(own) do
    if r[1] <= pos and r[2] > pos then pos = r[2] end
  end
  return pos < start
end
local results = {}
for i = 9, #ARGV, 5 do
  local id, ts_arg, mark, blob, keys = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4]
  local ts = tonumber(ts_arg)
  local ekey = epre .. id
  local result = 0
  local old = redis.call('GET', ekey)
  -- As in MemoryIndex, a live id keeps its first entry and does not move the high-water mark.
  if not (old and struct.unpack('<d', old, 2) >= hwm - window) then
    if ts > hwm then hwm = ts end
    local horizon = hwm - window
    if ts >= horizon then  -- else it is already outside the window and could never match
      local conflicts = {}
      local names = bucket_names(bpre, keys)
      if mark ~= '' and foreign_since(tonumber(mark)) then
        -- Look into the buckets whose last insert (the sentinel) is newer than the watermark, at the
        -- members that others inserted after it.
        mark = tonumber(mark)
        local function bucket_ok(bkey)
          local head = redis.call('ZRANGE', bkey, 0, 0, 'WITHSCORES')
          return head[1] == SENTINEL and MIN_TS - tonumber(head[2]) > mark
        end
        local function member_ok(m)
          local s = tonumber(string.sub(m, 1, 16), 16)
          return s > mark and not is_own(s)
        end
        local members, count, first = gather(names, lower_bound(horizon), bucket_ok, member_ok)
        emit(conflicts, members, count, first, 1, ':' .. id, #members, epre)
      end
      if #conflicts > 0 then
        result = conflicts
      else
        seq = seq + 1
        local member = string.format('%016x', seq) .. ':' .. id
        local sentinel = string.format('%d', MIN_TS - seq)
        local floor = '(' .. string.format('%.17g', horizon)
        redis.call('SET', ekey, blob, 'PX', ttl)
        for _, bkey in ipairs(names) do
          -- 2 new members: the bucket is new, and has nothing to trim. Else drop what left the window
          -- and keep the sentinel (rank 0) and the `cap` newest entries.
          if redis.call('ZADD', bkey, sentinel, SENTINEL, ts_arg, member) < 2 then
            redis.call('ZREMRANGEBYSCORE', bkey, MIN_TS, floor)
            redis.call('ZREMRANGEBYRANK', bkey, 1, -(cap + 1))
          end
          redis.call('PEXPIRE', bkey, ttl)
        end
      end
    end
  end
  results[#results + 1] = result
end
local hwm_s = string.format('%.17g', hwm)
if seq > start then
  redis.call('HSET', meta, 'seq', seq)
  if own_key ~= '' then
    redis.call('APPEND', own_key, string.format(' %d %d', start, seq))
    redis.call('PEXPIRE', own_key, own_ttl)
  end
end
if hwm > stored_hwm then redis.call('HSET', meta, 'hwm', hwm_s) end
if seq > start or hwm > stored_hwm then redis.call('PEXPIRE', meta, ttl) end
return {seq, hwm_s, results}
"""


@dataclass(frozen=True, slots=True)
class _Script:
    """A Lua script run by its SHA1, as redis-py's `Script` does, but also inside our own pipelines."""

    source: str
    sha: str

    @classmethod
    def of(cls, source: str) -> _Script:
        return cls(source, hashlib.sha1(source.encode()).hexdigest())


_LOOKUP = _Script.of(LOOKUP_LUA)
_INSERT = _Script.of(INSERT_LUA)


# --- connection -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """What an index URL says: how to connect, and our own options taken out of its query string."""

    client_url: str  # the URL redis-py gets: our options removed, `+cluster` removed
    cluster: bool
    prefix: str
    grace: float

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
        prefix, grace = DEFAULT_PREFIX, DEFAULT_GRACE
        for name, value in parse_qsl(parts.query, keep_blank_values=True):
            if name == "prefix":
                prefix = value
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
        path = parts.path
        if cluster:
            if path.strip("/") not in ("", "0"):
                raise ConfigError(f"Redis Cluster has only database 0: {redact_url(url)}")
            path = ""
        client_url = urlunsplit((scheme, parts.netloc, path, urlencode(query), ""))
        return cls(client_url, cluster, prefix, grace)


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


@contextmanager
def redis_errors(where: str) -> Iterator[None]:
    """Maps redis-py's errors inside the block to the exception tree (`map_redis_error`), at the boundary."""
    try:
        yield
    except (RedisError, RedisClusterException) as exc:
        raise map_redis_error(exc, where) from exc


class RedisIndex:
    """`CandidateIndex` on Redis (standalone, TLS or Cluster), shared by any number of workers.

    One instance is used by one thread at a time (the engine's contract). It remembers, per query id,
    the watermark its last lookups returned, until the next-but-one `lookup` call; `insert` of an id
    it did not look up is a plain insert (like `MemoryIndex`: nothing to compare against).
    """

    def __init__(self, url: str, *, window: float, bucket_cap: int, namespace: str) -> None:
        if not window > 0 or bucket_cap < 1:
            raise ConfigError("window must be > 0 seconds and bucket_cap >= 1")
        if not _NAME.fullmatch(namespace):
            raise ConfigError(f"namespace must match {_NAME.pattern}, got {namespace!r}")
        target = RedisTarget.parse(url)
        self.window = float(window)
        self.bucket_cap = bucket_cap
        self.namespace = namespace
        self.prefix = target.prefix
        self._where = redact_url(url)
        tag = f"{{{target.prefix}:{namespace}}}"
        self._meta = f"{tag}:meta"
        self._bpre = f"{tag}:b:"
        self._epre = f"{tag}:e:"
        self._opre = f"{tag}:own:"
        self._own_key = ""  # where the inserts since the last lookup record their seq ranges
        self._pattern = f"{tag}:*"
        self._ttl_ms = max(1, round((self.window + target.grace) * 1000))
        self._static_args = (self._bpre, self._epre, repr(self.window))
        self._hwm = -math.inf  # highest event time this instance has seen (MemoryIndex's watermark)
        self._marks: dict[str, int] = {}  # query id -> namespace seq at its lookup (this batch)
        self._marks_before: dict[str, int] = {}  # ... and the batch before
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
    def lookup(self, queries: Sequence[Query], limit: int) -> list[tuple[Entry | None, list[Candidate]]]:
        if not queries:
            return []
        calls = []
        hwm = self._hwm
        for at in range(0, len(queries), LOOKUP_CHUNK):
            args: list[str | int] = [*self._static_args, limit, repr(hwm)]
            for q in queries[at : at + LOOKUP_CHUNK]:
                ts = _event_time(q.ts, q.id)
                hwm = max(hwm, ts)
                args += (q.id, repr(ts), q.min_shared, _hex(q.keys))
            calls.append(args)
        replies = self._eval_pipelined(_LOOKUP, calls)
        self._hwm = hwm
        self._marks_before, self._marks = self._marks, {}
        self._own_key = f"{self._opre}{uuid.uuid4().hex}"  # a new batch: a new record of own inserts
        decoded: dict[bytes, Entry] = {}  # a wave's representative is a candidate of many queries
        out: list[tuple[Entry | None, list[Candidate]]] = []
        marks = self._marks
        pairs = iter(queries)
        for reply in replies:
            mark = int(reply[0])
            for result in reply[1:]:
                q = next(pairs)
                marks.setdefault(q.id, mark)  # an id twice in a batch: the earlier mark
                own = None if not result[0] else self._decode(result[0], q.id, decoded)
                out.append((own, self._candidates(result, 1, q.keys, decoded)))
        return out

    def insert(self, entries: Sequence[tuple[Entry, tuple[int, ...]]]) -> list[list[Candidate] | None]:
        """See `CandidateIndex.insert`. If it raises, some chunks may have been written: inserting is
        idempotent by id, so the worker retries the batch and finds those as replays."""
        if not entries:
            return []
        calls = []
        for at in range(0, len(entries), INSERT_CHUNK):
            args: list[str | int | bytes] = [*self._static_args, self.bucket_cap, self._ttl_ms,
                                             repr(self._hwm), self._own_key, OWN_RECORD_TTL_MS]
            for entry, keys in entries[at : at + INSERT_CHUNK]:
                mark = self._marks.get(entry.id, self._marks_before.get(entry.id))
                args += [entry.id, repr(_event_time(entry.ts, entry.id)), "" if mark is None else mark,
                         encode_entry(entry), _hex(keys)]
            calls.append(args)
        decoded: dict[bytes, Entry] = {}
        out: list[list[Candidate] | None] = []
        pairs = iter(entries)
        for seq, hwm, results in self._eval_pipelined(_INSERT, calls):
            self._hwm = max(self._hwm, float(hwm))
            for result in results:
                entry, keys = next(pairs)
                if isinstance(result, list):
                    # The caller has now seen everything up to `seq`: a retry conflicts only with newer.
                    self._marks[entry.id] = int(seq)
                    out.append(self._candidates(result, 0, keys, decoded))
                else:
                    self._marks.pop(entry.id, None)
                    self._marks_before.pop(entry.id, None)
                    out.append(None)
        return out

    def expire(self, now: float) -> int:
        """Moves this instance's horizon to `now - window` (as `MemoryIndex.expire` forgets up to it).

        Redis itself forgets by trimming buckets inside the insert script and by key TTLs, so there
        is nothing to delete here, and the count of what went is unknown: returns 0.
        """
        self._hwm = max(self._hwm, now)
        return 0

    def stats(self) -> dict[str, int]:
        """`entries` and `buckets`: keys of this namespace, counted by SCAN on its node.

        O(keys of the namespace) and approximate: keys stay until their TTL, so entries that left the
        window by event time still count. For monitoring and tests, not for the hot path.
        `inserted`: entries inserted since the namespace was created (the seq counter).
        """
        entries = buckets = 0
        entry_prefix, bucket_prefix = self._epre.encode(), self._bpre.encode()
        with self._errors():
            for key in self._scan():
                entries += key.startswith(entry_prefix)
                buckets += key.startswith(bucket_prefix)
            inserted = int(self._client.hget(self._meta, "seq") or 0)
        return {"entries": entries, "buckets": buckets, "inserted": inserted}

    def close(self) -> None:
        self._client.close()

    # -- helpers -------------------------------------------------------------------------------
    def _candidates(self, flat: list[Any], start: int, keys: Sequence[int],
                    decoded: dict[bytes, Entry]) -> list[Candidate]:
        if len(flat) <= start:
            return []
        decode = self._decode
        return [Candidate(decode(blob, id.decode(), decoded), shared, keys[first - 1])
                for id, shared, first, blob in zip(*(iter(flat[start:]),) * 4, strict=True)]

    @staticmethod
    def _decode(blob: bytes, id: str, decoded: dict[bytes, Entry]) -> Entry:
        entry = decoded.get(blob)
        if entry is None or entry.id != id:
            entry = decoded[blob] = decode_entry(blob, id)
        return entry

    def _scan(self) -> Iterator[bytes]:
        if isinstance(self._client, RedisCluster):
            node = self._client.get_node_from_key(self._meta)  # the whole namespace is on this node
            yield from self._client.scan_iter(match=self._pattern, count=1000, target_nodes=node)
        else:
            yield from self._client.scan_iter(match=self._pattern, count=1000)

    def _eval_pipelined(self, script: _Script, calls: Sequence[Sequence[str | int | bytes]]) -> list[Any]:
        """Runs `script` once per call in one round trip; reloads it once if the server forgot it."""
        with self._errors():
            replies = self._pipeline(script, calls)
            missing = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
            if missing:
                self._client.script_load(script.source)
                again = self._pipeline(script, [calls[i] for i in missing])
                for i, reply in zip(missing, again, strict=True):
                    replies[i] = reply
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
            return replies

    def _pipeline(self, script: _Script, calls: Sequence[Sequence[str | int | bytes]]) -> list[Any]:
        pipe = self._client.pipeline(transaction=False)
        for args in calls:
            pipe.execute_command("EVALSHA", script.sha, 1, self._meta, *args)
        return pipe.execute(raise_on_error=False)

    def _errors(self) -> AbstractContextManager[None]:
        return redis_errors(self._where)

    def __repr__(self) -> str:
        return f"RedisIndex({self._where!r}, namespace={self.namespace!r}, window={self.window})"


def _hex(keys: Sequence[int]) -> str:
    """Bucket keys as one string of 16 hex digits each: one argument, split by the scripts."""
    try:
        return struct.pack(f">{len(keys)}Q", *keys).hex()
    except struct.error as exc:
        raise ValueError(f"bucket keys must be unsigned 64-bit ints: {exc}") from None


def _event_time(ts: float, id: str) -> float:
    ts = float(ts)
    if not _MIN_TS < ts < math.inf:  # also rejects NaN; below _MIN_TS are the buckets' sentinels
        raise ValueError(f"event time of {id!r} must be finite and > -2^52, got {ts!r}")
    return ts
