"""The campaign view: duplicate clusters of the current window (size, first/last seen, growth, samples), in Redis or memory.

A campaign is everything routed as a duplicate of one representative (the unique message the copies
matched). Workers report what each batch found (`record`, one call per batch); `top` answers the view
that `neardup top` and the HTTP server show. Times are wall-clock seconds: the Redis store takes them
from the Redis server (`TIME` inside its scripts), so every worker writes on one clock.

A campaign's id is its representative's id, so it stays the same for as long as the campaign lives
(until no copy has been seen for a window). Growth compares the copies of the last `minutes` minutes
with those of the `minutes` before, smoothed (`growth_score`): a new wave ranks above an old big
campaign that merely keeps going.

Redis key layout, under the index's hash tag (so a cluster keeps all of it on the index's slot). The
number of keys does not grow with the number of clusters: five keys plus one per minute kept.

    {p:ns}:c:size      zset   member = representative id, score = copies seen (ZINCRBY)
    {p:ns}:c:last      zset   member = representative id, score = last seen
    {p:ns}:c:first     hash   representative id -> first seen
    {p:ns}:c:text      hash   representative id -> a snippet of the first copy seen
    {p:ns}:c:samples   hash   representative id -> JSON list of the latest `SAMPLES` copies' snippets
    {p:ns}:c:m:<min>   zset   member = representative id, score = copies in that minute since the epoch;
                              at most 2 x `minutes` + 1 of them, each expiring once it has left both growth windows

One Lua script per batch updates every cluster the batch touched (atomic; one round trip) and drops
up to 256 clusters not seen for a window. Every key gets a TTL on each write (window + grace; a minute
key, the minutes it is read for), so a namespace that nobody writes to any more disappears on its own.
"""

from __future__ import annotations

import heapq
import json
import math
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Protocol
from urllib.parse import urlparse

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from filters.errors import ConfigError, IndexCorrupt
from filters.index.redis import RedisTarget, redact_url, redis_errors

SORTS = ("size", "growth", "last")
DEFAULT_MINUTES = 10
SNIPPET = 160  # characters of the first copy's text kept per cluster
GROWTH_CANDIDATES = 5000  # clusters seen in the last minutes that `top --sort growth` ranks, at most
SAMPLES = 8  # latest copies kept per cluster for its detail view
GROWTH_SMOOTHING = 5.0  # copies added to both windows of the growth ratio, so a handful of copies is no wave
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
    before: int = 0  # copies in the as many minutes before `per_minute`

    @property
    def recent(self) -> int:
        """Copies in the minutes of `per_minute`."""
        return sum(self.per_minute)

    @property
    def growth(self) -> float:
        """How much faster the campaign runs now than before: `growth_score(recent, before)`."""
        return growth_score(self.recent, self.before)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "text": self.text, "size": self.size, "first_seen": self.first_seen,
                "last_seen": self.last_seen, "recent": self.recent, "before": self.before,
                "growth": round(self.growth, 3), "per_minute": list(self.per_minute)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Campaign:
        return cls(str(d["id"]), str(d["text"]), int(d["size"]), float(d["first_seen"]), float(d["last_seen"]),
                   tuple(int(n) for n in d["per_minute"]), int(d.get("before", 0)))


def growth_score(recent: int, before: int) -> float:
    """The rate of the last window against the rate of the window before, smoothed: 1 for a steady
    campaign, above 1 for one speeding up (a new wave: before = 0), below 1 for one dying down."""
    return (recent + GROWTH_SMOOTHING) / (before + GROWTH_SMOOTHING)


@dataclass(frozen=True, slots=True)
class CampaignDetail:
    """One campaign opened: its row, the latest copies' snippets, and its copies per minute."""

    campaign: Campaign
    samples: tuple[str, ...]  # snippets of the latest copies, oldest first (hostile input: escape them)
    series: tuple[int, ...]  # copies per minute over both growth windows, oldest first
    series_start: float  # unix seconds of the first minute of `series`

    def to_dict(self) -> dict[str, Any]:
        return {"campaign": self.campaign.to_dict(), "samples": list(self.samples), "series": list(self.series),
                "series_start": self.series_start}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CampaignDetail:
        return cls(Campaign.from_dict(d["campaign"]), tuple(str(t) for t in d["samples"]),
                   tuple(int(n) for n in d["series"]), float(d["series_start"]))


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
    in_process: bool  # whether `record` runs in this process (else it waits on the network: run it off the loop)

    def record(self, sightings: Sequence[Sighting]) -> None:
        """Count one batch's duplicates (atomically for the batch)."""
        ...

    def top(self, limit: int = 20, sort: str = "size") -> CampaignView:
        """The `limit` largest (`size`), fastest-growing (`growth`) or latest (`last`) clusters."""
        ...

    def detail(self, campaign_id: str) -> CampaignDetail | None:
        """One cluster of the window opened, or None when there is none with that id."""
        ...

    def ping(self) -> None:
        """Raise `IndexUnavailable` when the store cannot be reached."""
        ...

    def unknown_view(self) -> str | None:
        """One line saying that the store holds campaign views, none of them for these settings (a wrong
        `prefix=` or other filter settings than the workers'), and which it holds; None when that is not so."""
        ...

    def close(self) -> None: ...


def _snippet(text: str, snippet: int) -> str:
    return " ".join(text[: snippet * 2].split())[:snippet]


def summarize(sightings: Sequence[Sighting], snippet: int = SNIPPET,
              samples: int = SAMPLES) -> list[tuple[str, int, str, list[str]]]:
    """(representative, copies, text of its first copy, texts of its last `samples` copies) per
    representative, in order of first appearance."""
    counts = Counter(s.representative for s in sightings)
    texts: dict[str, str] = {}
    latest: dict[str, deque[str]] = {}
    for s in sightings:
        text = _snippet(s.text, snippet)
        texts.setdefault(s.representative, text)
        latest.setdefault(s.representative, deque(maxlen=samples)).append(text)
    return [(rep, counts[rep], text, list(latest[rep])) for rep, text in texts.items()]


def _check_sort(sort: str) -> None:
    if sort not in SORTS:
        raise ConfigError(f"sort must be one of {', '.join(SORTS)}, got {sort!r}")


def _ranked(campaigns: list[Campaign], sort: str, limit: int) -> tuple[Campaign, ...]:
    key: Callable[[Campaign], tuple[float, ...]] = {
        "size": lambda c: (c.size, c.last_seen),
        "growth": lambda c: (c.growth, c.recent, c.last_seen),
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
    samples: deque[str] = field(default_factory=lambda: deque(maxlen=SAMPLES))


class MemoryCampaigns:
    """The campaign view of one process (the embedded mode, `memory://` index). Thread-safe."""

    in_process = True

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
            for rep, count, text, latest in summarize(sightings, self.snippet):
                c = self._clusters.get(rep)
                if c is None:
                    c = self._clusters[rep] = _Cluster(text, now)
                c.size += count
                c.last = max(c.last, now)
                c.minutes[minute] = c.minutes.get(minute, 0) + count
                c.samples.extend(latest)
                for m in [m for m in c.minutes if m <= minute - 2 * self.minutes]:
                    del c.minutes[m]
                self._clusters.move_to_end(rep)

    def top(self, limit: int = 20, sort: str = "size") -> CampaignView:
        _check_sort(sort)
        with self._lock:
            now = self.clock()
            self._expire(now)
            minute = math.floor(now / 60)
            campaigns = [self._campaign(rep, c, minute) for rep, c in self._clusters.items()]
        return CampaignView(now, self.window, self.minutes, sort, len(campaigns), _ranked(campaigns, sort, limit))

    def detail(self, campaign_id: str) -> CampaignDetail | None:
        with self._lock:
            now = self.clock()
            self._expire(now)
            c = self._clusters.get(campaign_id)
            if c is None:
                return None
            minute = math.floor(now / 60)
            start = minute - 2 * self.minutes + 1
            series = tuple(c.minutes.get(m, 0) for m in range(start, minute + 1))
            return CampaignDetail(self._campaign(campaign_id, c, minute), tuple(c.samples), series, start * 60.0)

    def _campaign(self, rep: str, c: _Cluster, minute: int) -> Campaign:
        series = [c.minutes.get(m, 0) for m in range(minute - 2 * self.minutes + 1, minute + 1)]
        return Campaign(rep, c.text, c.size, c.first, c.last, tuple(series[self.minutes:]), sum(series[: self.minutes]))

    def _expire(self, now: float) -> None:
        horizon = now - self.window
        while self._clusters:
            rep, c = next(iter(self._clusters.items()))
            if c.last > horizon:
                break
            del self._clusters[rep]

    def ping(self) -> None:
        pass

    def unknown_view(self) -> str | None:
        return None  # one process's view: there is no other to mistake it for

    def close(self) -> None:
        pass


# -- Redis -----------------------------------------------------------------------------------------


def _lua(name: str) -> str:
    return resources.files("stream").joinpath(f"lua/{name}").read_text(encoding="utf-8")


# The campaign view's scripts: what each takes and returns is at the top of its file.
RECORD_LUA = _lua("campaign_record.lua")
TOP_LUA = _lua("campaign_entry.lua") + _lua("campaign_top.lua")
DETAIL_LUA = _lua("campaign_entry.lua") + _lua("campaign_detail.lua")

REDIS_SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster", "unix")
DEFAULT_SOCKET_TIMEOUT = 5.0


class RedisCampaigns:
    """The campaign view in Redis, shared by every worker of one index namespace."""

    in_process = False

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
        self.prefix = target.prefix
        self.namespace = namespace
        tag = f"{{{target.prefix}:{namespace}}}"
        self._pre = f"{tag}:c:"
        self.size_key = f"{self._pre}size"
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
        self._detail = self._client.register_script(DETAIL_LUA)

    def record(self, sightings: Sequence[Sighting]) -> None:
        if not sightings:
            return
        args: list[str | int | float] = [self._pre, repr(self.window), 2 * self.minutes, self._ttl_ms, SAMPLES,
                                            _STALE_PER_BATCH]
        for rep, count, text, latest in summarize(sightings, self.snippet):
            args += [rep, count, text, json.dumps(latest, ensure_ascii=False)]
        with self._errors():
            self._record(keys=[self.size_key], args=args)

    def top(self, limit: int = 20, sort: str = "size") -> CampaignView:
        _check_sort(sort)
        # Growth needs every recently seen cluster; the script returns them and they are ranked here.
        shown = GROWTH_CANDIDATES if sort == "growth" else limit
        with self._errors():
            reply = self._top(keys=[self.size_key], args=[self._pre, repr(self.window), sort, max(1, shown),
                                                          2 * self.minutes, GROWTH_CANDIDATES])
        try:
            now, total = float(reply[0]), int(reply[1])
            campaigns = [self._campaign(e)[0] for e in reply[2:]]
        except (KeyError, ValueError, IndexError, TypeError) as exc:
            raise IndexCorrupt(f"campaign view at {self._where}: unreadable reply: {exc!r}") from exc
        return CampaignView(now, self.window, self.minutes, sort, total, _ranked(campaigns, sort, limit))

    def detail(self, campaign_id: str) -> CampaignDetail | None:
        with self._errors():
            reply = self._detail(keys=[self.size_key], args=[self._pre, repr(self.window), 2 * self.minutes,
                                                             campaign_id])
        if len(reply) < 3:
            return None
        try:
            campaign, series = self._campaign(reply[1])
            samples = tuple(str(t) for t in json.loads(reply[2]))
            start = (math.floor(float(reply[0]) / 60) - 2 * self.minutes + 1) * 60.0
        except (KeyError, ValueError, IndexError, TypeError) as exc:
            raise IndexCorrupt(f"campaign view at {self._where}: unreadable reply: {exc!r}") from exc
        return CampaignDetail(campaign, samples, series, start)

    def _campaign(self, e: Sequence[Any]) -> tuple[Campaign, tuple[int, ...]]:
        """A cluster from a script's `entry`, and its copies per minute over both growth windows."""
        series = tuple(round(float(n)) for n in e[5])
        last = float(e[2])
        # first seen is a hash value (Lua writes 14 significant digits: milliseconds), last seen a sorted
        # set's score (a double): the same moment can read a little later as first than as last.
        campaign = Campaign(e[0].decode(errors="replace"), e[3].decode(errors="replace"), round(float(e[4])),
                            min(float(e[1]), last), last, series[self.minutes:], sum(series[: self.minutes]))
        return campaign, series

    @property
    def where(self) -> str:
        """The Redis URL, its password hidden."""
        return self._where

    def exists(self) -> bool:
        """Whether this namespace has a campaign view in Redis (a cluster in the window or expired)."""
        with self._errors():
            return bool(self._client.exists(self.size_key))

    def prefixes(self) -> list[str]:
        """The `prefix:namespace` of every campaign view in this Redis (all nodes of a cluster)."""
        found: set[str] = set()
        with self._errors():
            if isinstance(self._client, RedisCluster):
                keys = self._client.scan_iter(match="{*}:c:size", count=1000, target_nodes=RedisCluster.PRIMARIES)
            else:
                keys = self._client.scan_iter(match="{*}:c:size", count=1000)
            for key in keys:
                found.add(key.decode(errors="replace").partition("}")[0].lstrip("{"))
        return sorted(found)

    def unknown_view(self) -> str | None:
        # An empty Redis is no error: the view is empty until a worker records a duplicate.
        if self.exists():  # the usual case, without scanning the keyspace
            return None
        found = self.prefixes()
        mine = f"{self.prefix}:{self.namespace}"
        if not found or mine in found:
            return None
        prefixes = sorted({f.partition(":")[0] for f in found})
        if self.prefix in prefixes:
            what = f"no campaign view for these filter settings (namespace {self.namespace}) under prefix {self.prefix!r}"
        else:
            what = f"unknown prefix {self.prefix!r}: no campaign view under it"
        return (f"{what} at {self.where}; found prefix:namespace "
                f"{', '.join(found[:10])}{' …' if len(found) > 10 else ''}")

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
