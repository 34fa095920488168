"""Bottom-k sketches of shingle sets and the Jaccard / containment estimates taken from two of them.

A sketch keeps the k smallest distinct shingle hashes of a text plus the exact number of distinct
shingles. For a text with at most k shingles the sketch is the whole set and every estimate is exact.
Two sketches are compared below τ = the smaller of their largest kept hashes: below τ each sketch
holds *every* shingle of its text, so the intersection counted there is exact for that hash range,
and |A∩B|/|A∪B|, |A∩B|/|A| and |A∩B|/|B| are estimated without bias from it.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the compiled path never imports numpy
    import numpy as np


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
        return size_ratio(self.size_a, self.size_b)


def size_ratio(size_a: int, size_b: int) -> float:
    """The smaller shingle count over the larger (0 when both are empty)."""
    return min(size_a, size_b) / max(size_a, size_b, 1)


class Probe:
    """One sketch prepared for comparison with many others: the new message's, converted once per
    message instead of once per candidate."""

    __slots__ = ("hashes", "members", "size")

    def __init__(self, sketch: np.ndarray, size: int) -> None:
        self.hashes: list[int] = sketch.tolist()
        self.members = frozenset(self.hashes)
        self.size = size

    def overlap(self, other: np.ndarray, size_b: int) -> Overlap:
        jaccard, containment_a, containment_b = self.estimates(other, size_b)
        return Overlap(jaccard, containment_a, containment_b, self.size, size_b)

    def estimates(self, other: np.ndarray, size_b: int) -> tuple[float, float, float]:
        """(Jaccard, |A∩B|/|A|, |A∩B|/|B|): `overlap` without the record, for the engine's hot path."""
        la, lb = self.hashes, other.tolist()
        na, nb = len(la), len(lb)
        if not na or not nb:
            return 0.0, 0.0, 0.0
        common: frozenset[int] | list[int] = self.members.intersection(lb)
        # A sketch that holds fewer hashes than its text has shingles is complete only up to its largest.
        tau_a = la[-1] if self.size > na else None
        tau_b = lb[-1] if size_b > nb else None
        if tau_a is not None or tau_b is not None:
            tau = min(t for t in (tau_a, tau_b) if t is not None)
            if la[-1] > tau:
                na = bisect_right(la, tau)
            if lb[-1] > tau:
                nb = bisect_right(lb, tau)
            if common and max(common) > tau:
                common = [h for h in common if h <= tau]
            if not na or not nb:
                return 0.0, 0.0, 0.0
        inter = len(common)
        return inter / (na + nb - inter), inter / na, inter / nb


def overlap(a: np.ndarray, size_a: int, b: np.ndarray, size_b: int) -> Overlap:
    return Probe(a, size_a).overlap(b, size_b)
