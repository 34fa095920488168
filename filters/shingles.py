"""Character n-gram hashing, vectorised with numpy over a whole batch of normalized texts.

A shingle hash is a seeded polynomial over the n code points followed by the splitmix64 finalizer,
computed in uint64 arithmetic (wrapping on overflow, which numpy does silently). It depends only
on the text, n and the seed: never on the process (no builtin `hash()`), so fingerprints written to
Redis by one worker are read correctly by every other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_MUL = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S32 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(32)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer: a bijection on uint64 that spreads every input bit over the output."""
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    return x ^ (x >> _S31)


def seed_constant(seed: int) -> np.uint64:
    return np.uint64(int(mix64(np.array([seed], dtype=np.uint64))[0]) | 1)


@dataclass(frozen=True, slots=True)
class ShingleSets:
    """For each text of a batch: the sorted, distinct 64-bit hashes of its character n-grams."""

    hashes: list[np.ndarray]

    def __len__(self) -> int:
        return len(self.hashes)


def code_points(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)


def shingle_sets(texts: Sequence[str], n: int, seed: int) -> ShingleSets:
    """Distinct n-gram hashes of every text. A text shorter than n is one shingle: itself.

    The whole batch is hashed in one pass over the concatenated code points and de-duplicated with
    one sort, so the per-message Python overhead is a slice, not a loop over characters.
    """
    if not texts:
        return ShingleSets([])
    # Pad each text to at least n code points with a marker, so short texts still yield one shingle
    # and no n-gram spans two texts (the window never crosses the separator run).
    pad = "\U00100000" * (n - 1)
    lengths = np.fromiter((max(len(t), 1) for t in texts), dtype=np.int64, count=len(texts))
    joined = pad.join(t if t else "\U00100000" for t in texts) + pad
    cps = code_points(joined).astype(np.uint64)
    total = len(cps)
    s = seed_constant(seed)
    count = total - n + 1
    h = np.full(count, s, dtype=np.uint64)
    for j in range(n):
        h = (h ^ cps[j : j + count]) * _MUL
    h = mix64(h)
    # Start offset of each text in `joined`; n-grams starting at [start, start + max(len - n + 1, 1)).
    starts = np.zeros(len(texts), dtype=np.int64)
    starts[1:] = np.cumsum(lengths[:-1] + (n - 1))
    counts = np.maximum(lengths - n + 1, 1)
    owner = np.repeat(np.arange(len(texts), dtype=np.int64), counts)
    offsets = np.arange(counts.sum(), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    values = h[np.repeat(starts, counts) + offsets]
    order = np.lexsort((values, owner))
    values, owner = values[order], owner[order]
    keep = np.ones(len(values), dtype=bool)
    keep[1:] = (values[1:] != values[:-1]) | (owner[1:] != owner[:-1])
    values, owner = values[keep], owner[keep]
    bounds = np.searchsorted(owner, np.arange(1, len(texts)))
    return ShingleSets(np.split(values, bounds))
