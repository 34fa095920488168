"""Fingerprints of a message: exact hash, verification sketch, and the bucket keys of each method.

Bucket keys are 64-bit integers whose top four bits name the method that made them, so the buckets of
different methods never mix in one index:

- exact      128-bit mmh3 of the normalized text (the fast path; folded to one key).
- mgram      QQ's substring index: m-grams of the normalized text, sampled by hash so that a message
             has about `mgram_keys` keys (all of them when short). The sample is nested: a key kept
             at rate 1/2P is also kept at rate 1/P, so a short copy still meets its long original.
             A short text (`short_mgram_chars`) also gets every `short_mgram`-gram of wide characters.
- simhash    Charikar's 64-bit simhash over shingles weighted by their count, split into k + 1 blocks
             (Manku et al.): two fingerprints within Hamming distance k share at least one block.
- minhash    MinHash over the shingle set, b bands of r rows (LSH banding).
- sentences  Baidu's signature: hashes of the few longest sentences.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mmh3

from filters.config import FilterConfig
from filters.errors import ConfigError
from filters.normalize import Normalizer
from filters.records import maker

if TYPE_CHECKING:
    import numpy as np

try:  # the compiled core; absent when it could not be built at install time (no C++ compiler)
    import filters._native as _native
except ImportError:  # pragma: no cover - exercised on machines without a compiler
    _native = None

TAG_SHIFT = 60
TAGS = {"exact": 1, "mgram": 2, "simhash": 3, "minhash": 4, "sentences": 5}
METHOD_OF_TAG = {v: k for k, v in TAGS.items()}
METHOD_NAMES = tuple(METHOD_OF_TAG.get(tag, "?") for tag in range(16))  # by tag: what `key_method` says
_LOW60 = (1 << TAG_SHIFT) - 1
_EXACT_TAG = TAGS["exact"] << TAG_SHIFT
_TAG_ROOM = 64 - TAG_SHIFT  # an m-gram hash's top bits make room for the tag
_MGRAM_TAG = TAGS["mgram"] << TAG_SHIFT
_SENTENCE_END = re.compile(r"[.!?;。！？；\n]+")


@dataclass(frozen=True, slots=True, eq=False)
class Fingerprint:
    """What neardup keeps of a message: enough to find it (keys) and to verify it (the rest)."""

    normalized: str
    exact: int  # 128-bit hash of the normalized text
    size: int  # number of distinct verification shingles
    sketch: np.ndarray  # bottom-k of the shingle hashes (top 32 bits), sorted uint32
    keys: tuple[int, ...]  # bucket keys, method tag in the top four bits
    simhash: int | None = None
    minhash: np.ndarray | None = None
    sentences: frozenset[int] = frozenset()
    chars: str = ""  # the normalized text when it is short (`FilterConfig.short_text`): what the edit check compares


_new_fingerprint = maker(Fingerprint)  # one per message: from all field values, without the __init__'s cost


def key_method(key: int) -> str:
    return METHOD_NAMES[key >> TAG_SHIFT] if 0 <= key < 1 << 64 else "?"


def _tagged(tag: str, value: int) -> int:
    return (TAGS[tag] << TAG_SHIFT) | (value & _LOW60)


def hamming(a: int, b: int) -> int:
    return (a ^ b).bit_count()


class Fingerprinter:
    """Turns raw texts into `Fingerprint`s for one `FilterConfig`; pure and deterministic.

    The n-gram stage (exact hash, sketch, m-gram sample) runs in the compiled core when it was built
    (`native=None`: if available; `True`: required), else in numpy: the same values either way. numpy (and
    `filters.shingles`, the numpy reference) is imported where it is used: the compiled path with the
    default methods never needs it, and importing it would be a third of `neardup filter`'s start-up."""

    def __init__(self, config: FilterConfig, native: bool | None = None) -> None:
        self.config = config
        self.normalizer = Normalizer(config.normalize)
        c = config
        self._methods = frozenset(c.methods)
        if native and _native is None:
            raise ConfigError("the compiled core filters._native was not built: reinstall with a C++ compiler")
        self.native = _native is not None if native is None else native
        if "minhash" in self._methods:
            import numpy as np

            rng = np.random.Generator(np.random.PCG64(c.seed))
            self._perm_a = rng.integers(1, 2**63, size=c.minhash_perm, dtype=np.uint64) | np.uint64(1)
            self._perm_b = rng.integers(0, 2**63, size=c.minhash_perm, dtype=np.uint64)
        methods = [m for m in c.methods if m in ("exact", "mgram")]
        self._exact_at = methods.index("exact") if "exact" in methods else -1

    def fingerprint(self, text: str) -> Fingerprint:
        return self.fingerprint_batch([text])[0]

    def shingle(self, texts: Sequence[str]) -> Any:
        """The compiled core's hashed batch (`filters._native.Shingled`) of raw texts: what the compiled
        table's `decide` reads, with no `Fingerprint` per message. Needs `native`."""
        c = self.config
        normalized = self.normalizer.normalize_batch([t[: c.max_chars] for t in texts])
        return self._shingled(normalized)

    def _shingled(self, normalized: list[str]) -> Any:
        c = self.config
        mgram = "mgram" in self._methods
        return _native.shingle(normalized, c.shingle, c.sketch_size, c.mgram, c.mgram_keys if mgram else 0, c.seed,
                               self._exact_at, mgram, c.short_mgram, c.short_mgram_chars if mgram else 0,
                               c.short_text)

    def _hashed(self, normalized: list[str]) -> tuple[list[int], list[int], list[np.ndarray], list[int], list[int]]:
        """Per text: exact hash, shingle count, sketch; and the m-gram keys end to end with their bounds."""
        c = self.config
        if self.native:
            done = self._shingled(normalized)
            return (done.exacts(), done.sizes(), done.sketches(), *done.mgram_keys())
        import numpy as np

        from filters.shingles import Batch

        batch = Batch(normalized, max(c.shingle, c.mgram, c.short_mgram), c.seed)
        sketches = batch.sketches(c.shingle, c.sketch_size)
        mgram_keys: list[int] = []
        mgram_bounds: list[int] = []
        if "mgram" in self._methods:
            grams, bounds = batch.samples(c.mgram, c.mgram_keys)
            if c.short_mgram_chars:  # each text's sample, then its wide m-grams
                wide, wide_bounds = batch.wide_grams(c.short_mgram, c.short_mgram_chars)
                grams = np.concatenate([part for i in range(len(normalized)) for part in (
                    grams[bounds[i] : bounds[i + 1]], wide[wide_bounds[i] : wide_bounds[i + 1]])] or [grams])
                bounds = bounds + wide_bounds
            mgram_keys = ((grams >> np.uint64(_TAG_ROOM)) | np.uint64(_MGRAM_TAG)).tolist()
            mgram_bounds = bounds.tolist()
        seed32 = c.seed & 0xFFFFFFFF
        exacts = [mmh3.hash128(norm.encode("utf-8", "surrogatepass"), seed=seed32) for norm in normalized]
        return exacts, sketches.sizes, [h.copy() for h in sketches.hashes], mgram_keys, mgram_bounds

    def fingerprint_batch(self, texts: Sequence[str]) -> list[Fingerprint]:
        c = self.config
        normalized = self.normalizer.normalize_batch([t[: c.max_chars] for t in texts])
        if self.native and self._methods <= {"exact", "mgram"}:
            return self._shingled(normalized).fingerprints(normalized, _new_fingerprint)  # type: ignore[no-any-return]
        exacts, sizes, sketches, mgram_keys, mgram_bounds = self._hashed(normalized)
        features: list[np.ndarray] = []
        if "simhash" in self._methods or "minhash" in self._methods:
            import numpy as np

            from filters.shingles import Batch

            # simhash and minhash see every shingle (weighted by its count), not only the sketch.
            values, _, counts = Batch(normalized, c.shingle, c.seed).ngrams(c.shingle)
            bounds = np.concatenate(([0], np.cumsum(counts)))
            features = [values[bounds[j] : bounds[j + 1]] for j in range(len(normalized))]
        out = []
        for i, norm in enumerate(normalized):
            exact = exacts[i]
            keys: list[int] = []
            simhash = minhash = None
            sentences: frozenset[int] = frozenset()
            for method in c.methods:
                if method == "exact":
                    keys.append(_EXACT_TAG | ((exact ^ (exact >> 64)) & _LOW60))
                elif method == "mgram":
                    keys.extend(mgram_keys[mgram_bounds[i] : mgram_bounds[i + 1]])
                elif method == "simhash":
                    simhash = self._simhash(features[i])
                    keys.extend(self._simhash_keys(simhash))
                elif method == "minhash":
                    minhash = self._minhash(np.unique(features[i]))
                    keys.extend(self._band_keys(minhash))
                elif method == "sentences":
                    sentences = self._sentences(texts[i][: c.max_chars])
                    keys.extend(_tagged("sentences", s) for s in sentences)
            # Positional: this runs once per message, and keywords cost a dataclass __init__ more.
            out.append(Fingerprint(norm, exact, sizes[i], sketches[i], tuple(dict.fromkeys(keys)),
                                   simhash, minhash, sentences, norm if len(norm) <= c.short_text else ""))
        return out

    # -- methods ---------------------------------------------------------------------------
    def _simhash(self, hashes: np.ndarray) -> int:
        if not len(hashes):
            return 0
        import numpy as np

        bits = ((hashes[:, None] >> np.arange(64, dtype=np.uint64)[None, :]) & np.uint64(1)).astype(np.int32)
        votes = 2 * bits.sum(axis=0) - len(hashes)
        return int(np.packbits((votes > 0)[::-1]).view(">u8")[0])

    def _simhash_keys(self, fp: int) -> list[int]:
        blocks = self.config.simhash_k + 1
        width = 64 // blocks
        keys = []
        for b in range(blocks):
            lo = b * width
            hi = 64 if b == blocks - 1 else lo + width
            value = (fp >> lo) & ((1 << (hi - lo)) - 1)
            keys.append(_tagged("simhash", (b << 48) | value))
        return keys

    def _minhash(self, hashes: np.ndarray) -> np.ndarray:
        import numpy as np

        if not len(hashes):
            return np.full(self.config.minhash_perm, np.uint32(0xFFFFFFFF), dtype=np.uint32)
        permuted = (self._perm_a[:, None] * hashes[None, :] + self._perm_b[:, None]) >> np.uint64(32)
        signature: np.ndarray = permuted.min(axis=1).astype(np.uint32)
        return signature

    def _band_keys(self, sig: np.ndarray) -> list[int]:
        bands = self.config.minhash_bands
        rows = sig.reshape(bands, -1)
        keys = []
        for b in range(bands):
            h = mmh3.hash64(rows[b].tobytes(), seed=b, signed=False)[0]
            keys.append(_tagged("minhash", h))
        return keys

    def _sentences(self, raw: str) -> frozenset[int]:
        c = self.config
        parts = self.normalizer.normalize_batch(_SENTENCE_END.split(raw))
        parts = [p for p in parts if len(p) >= c.sentences_min_chars]
        longest = sorted(parts, key=lambda p: (-len(p), p))[: c.sentences_top]
        return frozenset(mmh3.hash64(p.encode("utf-8", "surrogatepass"), seed=c.seed & 0xFFFF, signed=False)[0]
                         for p in longest)


def minhash_jaccard(a: np.ndarray, b: np.ndarray) -> float:
    import numpy as np

    return float(np.count_nonzero(a == b)) / len(a)


__all__ = ["Fingerprint", "Fingerprinter", "hamming", "key_method", "minhash_jaccard"]
