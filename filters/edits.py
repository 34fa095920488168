"""Edit measures of two short normalized texts: LCS similarity, and whether one is the other's characters in another order.

The sketch compares sets of 4-character shingles, and one edit breaks four of them: on a 10-character
Chinese text one word inserted or deleted leaves a Jaccard of 0.2. What such a copy keeps is the order of
its characters, so short texts (`FilterConfig.short_text`) are also compared as sequences:

- LCS similarity, 2·LCS(a, b) / (|a| + |b|): a word inserted or deleted costs its own length once, a word
  moved costs it twice. Substitutions cost twice as much as under Levenshtein, which is what keeps
  apart short texts of one template with another word in a slot ("李鹏会见德国客人" / "李鹏会见英国客人").
- The same characters in another order (sorted code points equal): two neighbouring words swapped, or
  sentences reordered, in a text too short for its shingles to survive it.

`filters/_edits.pxi` is the compiled twin (tests/test_native.py holds them equal).
"""

from __future__ import annotations


def lcs_length(a: str, b: str) -> int:
    """Length of the longest common subsequence, by the bit-parallel recurrence of Allison and Dix (as
    Hyyrö writes it): one bit per character of `a`, one step per character of `b`."""
    if len(a) < len(b):
        a, b = b, a
    if not b:
        return 0
    masks: dict[str, int] = {}
    for i, ch in enumerate(a):
        masks[ch] = masks.get(ch, 0) | (1 << i)
    full = (1 << len(a)) - 1
    v = full
    for ch in b:
        u = v & masks.get(ch, 0)
        v = ((v + u) | (v - u)) & full
    return len(a) - v.bit_count()


def lcs_similarity(a: str, b: str) -> float:
    """2·LCS(a, b) / (|a| + |b|): 1.0 for equal texts, 0.0 when nothing is in common (or both are empty)."""
    total = len(a) + len(b)
    return 2 * lcs_length(a, b) / total if total else 0.0


def same_characters(a: str, b: str) -> bool:
    """One text is the other's characters in another order."""
    return len(a) == len(b) and sorted(a) == sorted(b)


MIN_CHARS = 4  # shorter texts differ in a character or two from too many others to be compared so
MAX_CHARS = 256  # the longest short text (`FilterConfig.short_text`): the compiled twin measures in stack buffers


def edit_match(a: str, b: str, threshold: float) -> float:
    """The edit rule on two short texts of `MIN_CHARS` to `MAX_CHARS` characters: their LCS similarity when it
    reaches `threshold` or when they are the same characters in another order, else -1.0. The bound
    2·min(|a|, |b|) / (|a| + |b|) on the similarity skips texts whose lengths already differ too much."""
    na, nb = len(a), len(b)
    if not MIN_CHARS <= na <= MAX_CHARS or not MIN_CHARS <= nb <= MAX_CHARS or 2 * min(na, nb) < threshold * (na + nb):
        return -1.0
    similarity = lcs_similarity(a, b)
    return similarity if similarity >= threshold or same_characters(a, b) else -1.0
