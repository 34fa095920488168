"""`neardup explain A B`: every intermediate of the filter for two texts, the tool a user tunes with."""

from __future__ import annotations

from collections import Counter

from filters.config import FilterConfig
from filters.edits import lcs_similarity, same_characters
from filters.engine import NearDupFilter
from filters.fingerprint import Fingerprint, hamming, key_method, minhash_jaccard
from filters.index import Candidate, Entry
from filters.sketch import overlap
from filters.tokens import WordTokenizer


def _visible(text: str) -> str:
    """Placeholders and pinyin codes are private-use characters; show them as readable tags."""
    from filters import charmaps
    from filters.normalize import EMAIL_MARK, NUMBER_MARK, URL_MARK

    marks = {URL_MARK: "‹url›", EMAIL_MARK: "‹email›", NUMBER_MARK: "‹num›"}
    out = []
    for ch in text:
        if ch in marks:
            out.append(marks[ch])
        elif 0xF0000 <= ord(ch) < 0xF0000 + len(charmaps.PINYIN_SYLLABLES):
            out.append(f"‹{charmaps.PINYIN_SYLLABLES[ord(ch) - 0xF0000]}›")
        else:
            out.append(ch)
    return "".join(out)


def explain(a: str, b: str, config: FilterConfig | None = None) -> str:
    cfg = config or FilterConfig()
    nd = NearDupFilter(cfg)
    fa, fb = nd.fingerprinter.fingerprint_batch([a, b])
    words = WordTokenizer()
    lines: list[str] = []
    for name, text, fp in (("A", a, fa), ("B", b, fb)):
        lines.append(f"== {name}: {text!r}")
        for step, value in nd.fingerprinter.normalizer.trace(text[: cfg.max_chars]):
            lines.append(f"  {step:<26} {_visible(value)!r}")
        lines.append(f"  words                      {words(text)[:40]}")
        lines.append(f"  shingles ({cfg.shingle}-grams)         {fp.size} distinct; sketch keeps {len(fp.sketch)}")
        per_method = Counter(key_method(k) for k in fp.keys)
        lines.append(f"  bucket keys                {dict(per_method)}")
        if fp.simhash is not None:
            lines.append(f"  simhash                    {fp.simhash:016x}")
    shared = [k for k in fa.keys if k in set(fb.keys)]
    lines.append("== comparison")
    lines.append(f"  shared buckets             {dict(Counter(key_method(k) for k in shared))} "
                 f"of {len(fb.keys)} keys of B")
    ov = overlap(fb.sketch, fb.size, fa.sketch, fa.size)
    lines.append(f"  exact (normalized)         {fa.exact == fb.exact}")
    lines.append(f"  jaccard (sketch estimate)  {ov.jaccard:.3f}")
    lines.append(f"  containment of B in A      {ov.containment_a:.3f}   of A in B {ov.containment_b:.3f}")
    lines.append(f"  exact jaccard ({cfg.shingle}-grams)    {_exact_jaccard(fa, fb, cfg.shingle):.3f}")
    if fa.simhash is not None and fb.simhash is not None:
        lines.append(f"  simhash hamming            {hamming(fa.simhash, fb.simhash)} (k={cfg.simhash_k})")
    if fa.minhash is not None and fb.minhash is not None:
        lines.append(f"  minhash jaccard            {minhash_jaccard(fa.minhash, fb.minhash):.3f}")
    if fa.chars and fb.chars:  # both short: the edit rule compares them as sequences
        same = "; the same characters in another order" if same_characters(fa.chars, fb.chars) else ""
        lines.append(f"  LCS similarity (short)     {lcs_similarity(fb.chars, fa.chars):.3f} "
                     f"(edit_similarity={cfg.edit_similarity}){same}")
    first_key = shared[0] if shared else (fa.keys[0] if fa.keys else 0)
    match = nd.verify(fb, Candidate(Entry.of("A", 0.0, fa), len(shared), first_key))
    lines.append(f"  verified                   {match.ok} (similarity {match.similarity:.3f}, via {match.method})")
    nd.check(a, id="A", ts=0.0)
    verdict = nd.check(b, id="B", ts=1.0)
    lines.append(f"== verdict for B after A: {verdict.label}"
                 + (f" of {verdict.duplicate_of} (similarity {verdict.similarity}, {verdict.method})"
                    if verdict.duplicate else ""))
    return "\n".join(lines)


def _exact_jaccard(a: Fingerprint, b: Fingerprint, n: int) -> float:
    def grams(s: str) -> set[str]:
        return {s[i : i + n] for i in range(max(len(s) - n + 1, 1))}

    ga, gb = grams(a.normalized), grams(b.normalized)
    return len(ga & gb) / max(len(ga | gb), 1)
