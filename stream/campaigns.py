"""The campaign view: duplicate clusters of the current window (size, first/last seen, per-minute growth), in Redis or memory.

A campaign is everything routed as a duplicate of one representative (the unique message the copies
matched). Workers report what each batch found (`record`, one call per batch); `top` answers the view
that `neardup top` and the HTTP server show. Times are wall-clock seconds: the Redis store takes them
from the Redis server (`TIME` inside its scripts), so every worker writes on one clock.

Redis key layout, under the index's hash tag (so a cluster keeps all of it on the index's slot):

    {p:ns}:c:size      zset   member = representative id, score = copies seen (ZINCRBY)
    {p:ns}:c:last      zset   member = representative id, score = last seen
    {p:ns}:c:h:<id>    hash   first, last, text (a snippet of the first copy seen), minute (the last
                              minute counted), m<minute since the epoch> = copies in that minute

One Lua script per batch updates every cluster the batch touched (atomic; one round trip) and drops
up to 256 clusters not seen for a window. Every key gets a TTL of window + grace on each write, so a
namespace that nobody writes to any more disappears on its own.
"""

from __future__ import annotations

import heapq
import math
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlparse

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from filters.errors import ConfigError, IndexCorrupt
from filters.redis_index import RedisTarget, redact_url, redis_errors

SORTS = ("size", "growth", "last")
DEFAULT_MINUTES = 10
SNIPPET = 160  # characters of the first copy's text kept per cluster
GROWTH_CANDIDATES = 5000  # clusters seen in the last minutes that `top --sort growth` ranks, at most
_STALE_PER_BATCH = 256  # clusters out of the window that one write drops, at most


@dataclass(frozen=True, slots=True)
class Sighting:
    """One duplicate as a batch saw it: the representative it matched, and its text."""

    representative: str
    text: str


@dataclass(frozen=True, slots=True)
class Campaign:
    """One duplicate cluster of the window."""

    id: str  # the representative's id
    text: str  # a snippet of the first copy seen (hostile input: escape it wherever it is shown)
    size: int  # copies routed as duplicates of the representative (the representative not counted)
    first_seen: float  # unix seconds
    last_seen: float
    per_minute: tuple[int, ...]  # copies per minute, oldest first; the last is the current minute

    @property
    def growth(self) -> int:
        """Copies in the minutes of `per_minute`."""
        return sum(self.per_minute)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "text": self.text, "size": self.size, "first_seen": self.first_seen,
                "last_seen": self.last_seen, "growth": self.growth, "per_minute": list(self.per_minute)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Campaign:
        return cls(str(d["id"]), str(d["text"]), int(d["size"]), float(d["first_seen"]), float(d["last_seen"]),
                   tuple(int(n) for n in d["per_minute"]))


@dataclass(frozen=True, slots=True)
class CampaignView:
    """The answer of `top`: the clusters of the window, ranked, and how many there are in all."""

    now: float
    window: float
    minutes: int
    sort: str
    total: int  # clusters in the window (not only those shown)
    campaigns: tuple[Campaign, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return {"now": self.now, "window": self.window, "minutes": self.minutes, "sort": self.sort,
                "total": self.total, "campaigns": [c.to_dict() for c in self.campaigns]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CampaignView:
        return cls(float(d["now"]), float(d["window"]), int(d["minutes"]), str(d["sort"]), int(d["total"]),
                   tuple(Campaign.from_dict(c) for c in d["campaigns"]))


class CampaignStore(Protocol):
    """Where the clusters live: `MemoryCampaigns` (one process) or `RedisCampaigns` (every worker)."""

    window: float
    minutes: int

    def record(self, sightings: Sequence[Sighting]) -> None:
        """Count one batch's duplicates (atomically for the batch)."""
        ...

    def top(self, limit: int = 20, sort: str = "size") -> CampaignView:
        """The `limit` largest (`size`), fastest-growing (`growth`) or latest (`last`) clusters."""
        ...

    def ping(self) -> None:
        """Raise `IndexUnavailable` when the store cannot be reached."""
        ...

    def close(self) -> None: ...


def summarize(sightings: Sequence[Sighting], snippet: int = SNIPPET) -> list[tuple[str, int, str]]:
    """(representative, copies, text of its first copy) per representative, in order of first appearance."""
    counts = Counter(s.representative for s in sightings)
    texts: dict[str, str] = {}
    for s in sightings:
        texts.setdefault(s.representative, " ".join(s.text[: snippet * 2].split())[:snippet])
    return [(rep, counts[rep], text) for rep, text in texts.items()]


def _check_sort(sort: str) -> None:
    if sort not in SORTS:
        raise ConfigError(f"sort must be one of {', '.join(SORTS)}, got {sort!r}")


def _ranked(campaigns: list[Campaign], sort: str, limit: int) -> tuple[Campaign, ...]:
    key: Callable[[Campaign], tuple[float, ...]] = {
        "size": lambda c: (c.size, c.last_seen),
        "growth": lambda c: (c.growth, c.per_minute[-1] if c.per_minute else 0, c.last_seen),
        "last": lambda c: (c.last_seen, c.size),
    }[sort]
    return tuple(heapq.nlargest(max(0, limit), campaigns, key=key))


# -- memory ----------------------------------------------------------------------------------------


@dataclass
class _Cluster:
    """Mutable state of one cluster in `MemoryCampaigns`."""

    text: str
    first: float
    last: float = 0.0
    size: int = 0
    minutes: dict[int, int] = field(default_factory=dict)


class MemoryCampaigns:
    """The campaign view of one process (the embedded mode, `memory://` index). Thread-safe."""

    def __init__(self, window: float, minutes: int = DEFAULT_MINUTES, *, clock: Callable[[], float] = time.time,
                 snippet: int = SNIPPET) -> None:
        if not window > 0 or minutes < 1:
            raise ConfigError("campaigns need window > 0 seconds and minutes >= 1")
        self.window = float(window)
        self.minutes = minutes
        self.clock = clock
        self.snippet = snippet
        # Least recently seen first: expiry pops from the front.
        self._clusters: OrderedDict[str, _Cluster] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, sightings: Sequence[Sighting]) -> None:
        if not sightings:
            return
        with self._lock:
            now = self.clock()
            minute = math.floor(now / 60)
            self._expire(now)
            for rep, count, text in summarize(sightings, self.snippet):
                c = self._clusters.get(rep)
                if c is None:
                    c = self._clusters[rep] = _Cluster(text, now)
                c.size += count
                c.last = max(c.last, now)
                c.minutes[minute] = c.minutes.get(minute, 0) + count
                for m in [m for m in c.minutes if m <= minute - self.minutes]:
                    del c.minutes[m]
                self._clusters.move_to_end(rep)

    def top(self, limit: int = 20, sort: str = "size") -> CampaignView:
        _check_sort(sort)
        with self._lock:
            now = self.clock()
            self._expire(now)
            minute = math.floor(now / 60)
            window = range(minute - self.minutes + 1, minute + 1)
            campaigns = [Campaign(rep, c.text, c.size, c.first, c.last, tuple(c.minutes.get(m, 0) for m in window))
                         for rep, c in self._clusters.items()]
        return CampaignView(now, self.window, self.minutes, sort, len(campaigns), _ranked(campaigns, sort, limit))

    def _expire(self, now: float) -> None:
        horizon = now - self.window
        while self._clusters:
            rep, c = next(iter(self._clusters.items()))
            if c.last > horizon:
                break
            del self._clusters[rep]

    def ping(self) -> None:
        pass

    def close(self) -> None:
        pass


# -- Redis -----------------------------------------------------------------------------------------

# KEYS[1]: the size zset. ARGV: the last-seen zset, the cluster hash prefix, window (s), minutes of
# per-minute counts kept, TTL (ms), then (representative, copies, text) per cluster of the batch.
RECORD_LUA = """
if redis.replicate_commands then redis.replicate_commands() end  -- TIME before writes (Redis < 7)
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local minute = math.floor(now / 60)
local size_key, last_key, hpre = KEYS[1], ARGV[1], ARGV[2]
local window, keep, ttl = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local stale = redis.call('ZRANGEBYSCORE', last_key, '-inf', '(' .. (now - window), 'LIMIT', 0, STALE_PER_BATCH)
for _, id in ipairs(stale) do
  redis.call('ZREM', size_key, id)
  redis.call('ZREM', last_key, id)
  redis.call('DEL', hpre .. id)
end
local stamp = string.format('%.3f', now)
local mfield = string.format('m%d', minute)
local mtext = string.format('%d', minute)
for i = 6, #ARGV, 3 do
  local id, n, text = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2]
  local h = hpre .. id
  redis.call('ZINCRBY', size_key, n, id)
  redis.call('ZADD', last_key, now, id)
  redis.call('HSETNX', h, 'first', stamp)
  redis.call('HSETNX', h, 'text', text)
  redis.call('HSET', h, 'last', stamp)
  redis.call('HINCRBY', h, mfield, n)
  -- Once per minute per cluster: forget the minutes that left the view.
  if redis.call('HGET', h, 'minute') ~= mtext then
    redis.call('HSET', h, 'minute', mtext)
    for _, f in ipairs(redis.call('HKEYS', h)) do
      local m = string.match(f, '^m(%d+)$')
      if m and tonumber(m) <= minute - keep then redis.call('HDEL', h, f) end
    end
  end
  redis.call('PEXPIRE', h, ttl)
end
redis.call('PEXPIRE', size_key, ttl)
redis.call('PEXPIRE', last_key, ttl)
return #stale
""".replace("STALE_PER_BATCH", str(_STALE_PER_BATCH))

# Read-only. KEYS[1]: the size zset. ARGV: the last-seen zset, the cluster hash prefix, window (s),
# sort, limit, minutes, growth candidates. Returns now, the clusters in the window, then per cluster
# shown: id, its hash as a flat array, its size.
TOP_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local size_key, last_key, hpre = KEYS[1], ARGV[1], ARGV[2]
local cutoff = string.format('(%.6f', now - tonumber(ARGV[3]))
local sort, limit = ARGV[4], tonumber(ARGV[5])
local total = redis.call('ZCOUNT', last_key, cutoff, '+inf')
local ids = {}
if sort == 'size' then
  -- The largest may include clusters out of the window that no write has dropped yet: skip them.
  local start = 0
  while #ids < limit do
    local page = redis.call('ZREVRANGE', size_key, start, start + limit - 1)
    if #page == 0 then break end
    for _, id in ipairs(page) do
      local last = redis.call('ZSCORE', last_key, id)
      if last and tonumber(last) > now - tonumber(ARGV[3]) and #ids < limit then ids[#ids + 1] = id end
    end
    start = start + limit
  end
elseif sort == 'last' then
  ids = redis.call('ZREVRANGEBYSCORE', last_key, '+inf', cutoff, 'LIMIT', 0, limit)
else
  local since = (math.floor(now / 60) - tonumber(ARGV[6]) + 1) * 60
  ids = redis.call('ZREVRANGEBYSCORE', last_key, '+inf', since, 'LIMIT', 0, tonumber(ARGV[7]))
end
local out = {string.format('%.6f', now), total}
for _, id in ipairs(ids) do
  local h = redis.call('HGETALL', hpre .. id)
  if #h > 0 then
    out[#out + 1] = id
    out[#out + 1] = h
    out[#out + 1] = redis.call('ZSCORE', size_key, id) or '0'
  end
end
return out
"""

REDIS_SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster", "unix")
DEFAULT_SOCKET_TIMEOUT = 5.0


class RedisCampaigns:
    """The campaign view in Redis, shared by every worker of one index namespace."""

    def __init__(self, url: str, *, namespace: str, window: float, minutes: int = DEFAULT_MINUTES,
                 snippet: int = SNIPPET) -> None:
        if not window > 0 or minutes < 1:
            raise ConfigError("campaigns need window > 0 seconds and minutes >= 1")
        # The index's URL parser and error mapping: both Redis clients read one URL and fail alike.
        target = RedisTarget.parse(url)
        self.window = float(window)
        self.minutes = minutes
        self.snippet = snippet
        self._where = redact_url(url)
        tag = f"{{{target.prefix}:{namespace}}}"
        self.size_key = f"{tag}:c:size"
        self._last_key = f"{tag}:c:last"
        self._hpre = f"{tag}:c:h:"
        self._ttl_ms = max(1, round((self.window + target.grace) * 1000))
        options: dict[str, Any] = {"decode_responses": False, "retry": Retry(NoBackoff(), 0),
                                   "socket_timeout": DEFAULT_SOCKET_TIMEOUT,
                                   "socket_connect_timeout": DEFAULT_SOCKET_TIMEOUT}
        try:
            with self._errors():
                if target.cluster:
                    self._client: redis.Redis | RedisCluster = RedisCluster.from_url(target.client_url, **options)
                else:
                    self._client = redis.Redis.from_url(target.client_url, **options)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"Redis URL {self._where}: {exc}") from exc
        self._record = self._client.register_script(RECORD_LUA)
        self._top = self._client.register_script(TOP_LUA)

    def record(self, sightings: Sequence[Sighting]) -> None:
        if not sightings:
            return
        args: list[str | int | float] = [self._last_key, self._hpre, repr(self.window), self.minutes, self._ttl_ms]
        for rep, count, text in summarize(sightings, self.snippet):
            args += [rep, count, text]
        with self._errors():
            self._record(keys=[self.size_key], args=args)

    def top(self, limit: int = 20, sort: str = "size") -> CampaignView:
        _check_sort(sort)
        # Growth needs every recently seen cluster; the script returns them and they are ranked here.
        shown = GROWTH_CANDIDATES if sort == "growth" else limit
        with self._errors():
            reply = self._top(keys=[self.size_key], args=[self._last_key, self._hpre, repr(self.window), sort,
                                                          max(1, shown), self.minutes, GROWTH_CANDIDATES])
        try:
            now, total = float(reply[0]), int(reply[1])
            minute = math.floor(now / 60)
            campaigns = []
            for i in range(2, len(reply), 3):
                h = dict(zip(reply[i + 1][::2], reply[i + 1][1::2]))
                per_minute = tuple(int(h.get(b"m%d" % m, 0)) for m in range(minute - self.minutes + 1, minute + 1))
                campaigns.append(Campaign(reply[i].decode(errors="replace"), h.get(b"text", b"").decode(errors="replace"),
                                          round(float(reply[i + 2])), float(h[b"first"]), float(h[b"last"]),
                                          per_minute))
        except (KeyError, ValueError, IndexError, TypeError) as exc:
            raise IndexCorrupt(f"campaign view at {self._where}: unreadable reply: {exc!r}") from exc
        return CampaignView(now, self.window, self.minutes, sort, total, _ranked(campaigns, sort, limit))

    def ping(self) -> None:
        with self._errors():
            if isinstance(self._client, RedisCluster):
                self._client.ping(target_nodes=self._client.get_node_from_key(self.size_key))
            else:
                self._client.ping()

    def close(self) -> None:
        self._client.close()

    def _errors(self) -> AbstractContextManager[None]:
        return redis_errors(self._where)


def open_campaigns(index_url: str, *, namespace: str, window: float, minutes: int = DEFAULT_MINUTES) -> CampaignStore:
    """The campaign store that goes with an index URL: memory for `memory://`, else the index's Redis."""
    scheme = urlparse(index_url).scheme
    if scheme == "memory":
        return MemoryCampaigns(window, minutes)
    if scheme in REDIS_SCHEMES:
        return RedisCampaigns(index_url, namespace=namespace, window=window, minutes=minutes)
    raise ConfigError(f"unknown index URL scheme {scheme!r}: use memory:// or redis://")
