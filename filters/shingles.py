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
    mixed: np.ndarray = x ^ (x >> _S31)
    return mixed


def seed_constant(seed: int) -> np.uint64:
    return np.uint64(int(mix64(np.array([seed], dtype=np.uint64))[0]) | 1)


_HASH_BITS = 44  # precision kept in sketches; the rest of the 64 bits carries the owner when sorting
_LOW = np.uint64((1 << _HASH_BITS) - 1)
_DROP = np.uint64(64 - _HASH_BITS)


_WIDE = np.uint64(0x2E80)  # the first CJK block: from here on a character carries about two Latin letters' worth


def code_points(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)


@dataclass(frozen=True, slots=True)
class Sketches:
    """Per text: the smallest distinct shingle hashes (sorted, at most k) and the number of distinct
    shingles (exact when the text has few, else estimated from the sketch's density)."""

    hashes: list[np.ndarray]
    sizes: list[int]


class Batch:
    """The code points of a batch of normalized texts, laid end to end for vectorised n-gram hashing."""

    def __init__(self, texts: Sequence[str], width: int, seed: int) -> None:
        self.count = len(texts)
        self.seed = seed
        # Each text is followed by width - 1 pad markers, so no n-gram spans two texts and a text
        # shorter than n still yields one shingle: itself, padded.
        pad = "\U00100000" * (width - 1)
        self.lengths = np.fromiter((max(len(t), 1) for t in texts), dtype=np.int64, count=len(texts))
        self.empty = np.fromiter((not t for t in texts), dtype=bool, count=len(texts))
        joined = pad.join(t if t else "\U00100000" for t in texts) + pad
        self.cps = code_points(joined).astype(np.uint64)
        self.starts = np.zeros(len(texts), dtype=np.int64)
        self.starts[1:] = np.cumsum(self.lengths[:-1] + (width - 1))

    def ngrams(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(hashes, owner, per-text counts) of every n-gram position of every text."""
        count = len(self.cps) - n + 1
        h = np.full(count, seed_constant(self.seed + n), dtype=np.uint64)
        for j in range(n):
            h = (h ^ self.cps[j : j + count]) * _MUL
        h = mix64(h)
        counts = np.maximum(self.lengths - n + 1, 1)
        owner = np.repeat(np.arange(self.count, dtype=np.int64), counts)
        offsets = np.arange(counts.sum(), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        return h[np.repeat(self.starts, counts) + offsets], owner, counts

    def sketches(self, n: int, k: int) -> Sketches:
        """Bottom-k sketches. Only hashes below a per-text threshold (≈ 3k of them expected) are
        sorted at all, so long texts cost a filter, not a sort."""
        values, owner, counts = self.ngrams(n)
        keep_fraction = np.minimum(1.0, (3.0 * k) / counts)
        limit = np.where(keep_fraction >= 1.0, np.uint64(0xFFFFFFFFFFFFFFFF),
                         (np.minimum(keep_fraction, 0.999) * 2.0**64).astype(np.uint64))
        below = values <= limit[owner]
        values, owner = values[below], owner[below]
        keyed = np.sort((owner.astype(np.uint64) << np.uint64(_HASH_BITS)) | (values >> _DROP))
        distinct = np.ones(len(keyed), dtype=bool)
        distinct[1:] = keyed[1:] != keyed[:-1]
        keyed = keyed[distinct]
        owners = (keyed >> np.uint64(_HASH_BITS)).astype(np.int64)
        # Sketches keep the top 32 bits of each hash: half the memory, and a chance collision between
        # two sketches of 128 is about 4e-6.
        hashes = ((keyed & _LOW) >> np.uint64(_HASH_BITS - 32)).astype(np.uint32)
        bounds = np.searchsorted(owners, np.arange(self.count + 1))
        per_text = np.diff(bounds)
        sizes = np.where(keep_fraction >= 1.0, per_text, np.rint(per_text / keep_fraction)).astype(np.int64)
        out = [hashes[bounds[i] : min(bounds[i + 1], bounds[i] + k)] for i in range(self.count)]
        return Sketches(out, sizes.tolist())

    def samples(self, m: int, target: int) -> tuple[np.ndarray, np.ndarray]:
        """m-gram hashes kept by a nested sample: rate 1/2^j, the smallest j that leaves at most
        about 2 * target of a text's m-grams. A key kept at rate 1/2P is also kept at rate 1/P.
        Returns the kept hashes of all texts end to end, and the bounds of text i: [bounds[i], bounds[i+1])."""
        values, owner, counts = self.ngrams(m)
        rates = np.ones(self.count, dtype=np.uint64)
        while True:
            grow = counts >= 2 * rates.astype(np.int64) * target
            if not grow.any():
                break
            rates[grow] *= np.uint64(2)
        kept = (values & (rates[owner] - np.uint64(1))) == 0
        values, owner = values[kept], owner[kept]
        return values, np.searchsorted(owner, np.arange(self.count + 1))

    def wide_grams(self, n: int, max_len: int) -> tuple[np.ndarray, np.ndarray]:
        """The hashes of every n-gram of wide characters (code points from U+2E80 on: Han, kana, hangul,
        pinyin codes, placeholders) in the texts of at most `max_len` characters, in order; bounds as `samples`."""
        values, owner, counts = self.ngrams(n)
        offsets = np.arange(len(values), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        lengths = np.where(self.empty, 0, self.lengths)[owner]
        whole = (lengths >= n) & (lengths <= max_len)  # n-grams inside a short text
        wide = np.ones(len(values), dtype=bool)
        at = self.starts[owner] + offsets
        for j in range(n):
            wide &= self.cps[np.minimum(at + j, len(self.cps) - 1)] >= _WIDE
        kept = whole & wide
        return values[kept], np.searchsorted(owner[kept], np.arange(self.count + 1))
