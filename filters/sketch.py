"""Bottom-k sketches of shingle sets and the Jaccard / containment estimates taken from two of them.

A sketch keeps the k smallest distinct shingle hashes of a text plus the exact number of distinct
shingles. For a text with at most k shingles the sketch is the whole set and every estimate is exact.
Two sketches are compared below τ = the smaller of their largest kept hashes: below τ each sketch
holds *every* shingle of its text, so the intersection counted there is exact for that hash range,
and |A∩B|/|A∪B|, |A∩B|/|A| and |A∩B|/|B| are estimated without bias from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_NO_LIMIT = np.uint64(0xFFFFFFFFFFFFFFFF)


def bottom_k(sorted_hashes: np.ndarray, k: int) -> np.ndarray:
    return sorted_hashes[:k]


@dataclass(frozen=True, slots=True)
class Overlap:
    """Estimated overlap of two shingle sets A (the new message) and B (a candidate)."""

    jaccard: float
    containment_a: float  # |A∩B| / |A|: how much of the new message is in the candidate
    containment_b: float  # |A∩B| / |B|: how much of the candidate is in the new message
    size_a: int
    size_b: int

    @property
    def containment(self) -> float:
        """Containment of the smaller set in the larger (the overlap coefficient)."""
        return max(self.containment_a, self.containment_b)

    @property
    def size_ratio(self) -> float:
        return min(self.size_a, self.size_b) / max(self.size_a, self.size_b, 1)


def overlap(a: np.ndarray, size_a: int, b: np.ndarray, size_b: int) -> Overlap:
    tau_a = a[-1] if size_a > len(a) and len(a) else _NO_LIMIT
    tau_b = b[-1] if size_b > len(b) and len(b) else _NO_LIMIT
    tau = min(tau_a, tau_b)
    a_low = a[: np.searchsorted(a, tau, side="right")] if tau != _NO_LIMIT else a
    b_low = b[: np.searchsorted(b, tau, side="right")] if tau != _NO_LIMIT else b
    na, nb = len(a_low), len(b_low)
    if not na or not nb:
        return Overlap(0.0, 0.0, 0.0, size_a, size_b)
    inter = len(set(a_low.tolist()).intersection(b_low.tolist()))
    return Overlap(inter / (na + nb - inter), inter / na, inter / nb, size_a, size_b)
