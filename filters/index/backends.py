"""Choosing the candidate index by URL: `memory://` (embedded) or `redis://` and its variants (shared)."""

from __future__ import annotations

from urllib.parse import urlparse

from filters.errors import ConfigError
from filters.index import CandidateIndex
from filters.index.memory import MemoryIndex


def open_index(url: str, *, window: float, bucket_cap: int, namespace: str,
               native: bool | None = None, fenced: bool = False) -> CandidateIndex:
    """`memory://` or `redis://[:password@]host:port/db` / `rediss://...` (TLS) / `redis+cluster://`, with
    `?layout=spread` a namespace spread over the cluster's slots (`filters.index.redis_spread`).

    `native` picks the memory index's table (see `filters.index.memory.make_table`); `fenced`, whether a shared
    index requires the marker an index changelog keeps (see `RedisIndex`)."""
    scheme = urlparse(url).scheme
    if scheme == "memory":
        return MemoryIndex(window, bucket_cap, native=native)
    if scheme in ("redis", "rediss", "redis+cluster", "rediss+cluster", "unix"):
        from filters.index.redis import RedisIndex, RedisTarget  # the backend that does I/O; loaded on demand

        if RedisTarget.parse(url).layout == "spread":
            from filters.index.redis_spread import SpreadIndex

            return SpreadIndex(url, window=window, bucket_cap=bucket_cap, namespace=namespace, fenced=fenced)
        if RedisTarget.parse(url).layout == "compact":
            from filters.index.redis_compact import CompactIndex

            return CompactIndex(url, window=window, bucket_cap=bucket_cap, namespace=namespace, fenced=fenced)
        if RedisTarget.parse(url).layout == "group":
            from filters.index.redis_group import GroupIndex

            return GroupIndex(url, window=window, bucket_cap=bucket_cap, namespace=namespace, fenced=fenced)
        return RedisIndex(url, window=window, bucket_cap=bucket_cap, namespace=namespace, fenced=fenced)
    raise ConfigError(f"unknown index URL scheme {scheme!r} in {url!r}: use memory:// or redis://")


def marker_keys(url: str, namespace: str) -> list[str]:
    """The keys whose `epoch` field holds the marker of a changelogged shared index (see `RedisIndex`, "Fence"):
    the namespace's meta hash, or on the spread layout every shard's (`filters.index.redis_spread`)."""
    from filters.index.redis import RedisTarget, meta_key

    target = RedisTarget.parse(url)
    if target.layout == "spread":
        from filters.index.redis_spread import shard_meta_keys

        return shard_meta_keys(target, namespace)
    return [meta_key(target.prefix, namespace)]
