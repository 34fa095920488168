"""Filter parameters: one frozen record, its validation, and the digest that namespaces stored fingerprints."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace

import mmh3

from filters.errors import ConfigError
from filters.normalize import NORMALIZE_VERSION, NormalizeOptions

METHODS = ("exact", "mgram", "simhash", "minhash", "sentences")
VERIFY_MODES = ("sketch", "native")


@dataclass(frozen=True, slots=True)
class FilterConfig:
    """Everything that decides a verdict. The defaults need no tuning (see README for their F1)."""

    normalize: NormalizeOptions = field(default_factory=NormalizeOptions)
    # Candidate generators, in the order their buckets are consulted.
    methods: tuple[str, ...] = ("exact", "mgram")
    # "sketch": every candidate is verified by the bottom-k shingle overlap below.
    # "native": each method verifies its own candidates (simhash: Hamming distance, minhash: estimated
    # Jaccard, sentences: shared sentences, mgram/exact: sketch).
    verify: str = "sketch"
    shingle: int = 4  # character n-gram size of the verification shingles
    sketch_size: int = 128  # bottom-k sketch kept per indexed message
    threshold: float = 0.5  # Jaccard at or above which a candidate is a duplicate
    # ... and when one of the two texts is longer than `short_text` and neither is contained in the other (at
    # `containment`), at or above this too (at or below `threshold`: off): long texts of one template with other
    # names and figures (dividend notices of other companies) share half their shingles; a long copy with words
    # edited keeps more (docs/quality-recall.md).
    threshold_long: float = 0.55
    containment: float = 0.8  # ... or containment of the smaller text in the larger, at or above this
    containment_min_ratio: float = 0.35  # ... when the smaller has at least this share of the larger's size
    containment_min_size: int = 12  # ... and at least this many shingles (short texts need Jaccard)
    # ... and the smaller text has at most this many shingles the larger lacks: a truncated copy adds at most the
    # junction and a marker ("(more)"); a reworded summary or a reply that quotes adds more (docs/quality-recall.md).
    containment_slack: int = 6
    # ... and at most this share of the contained text's shingles: a short text's few shingles of its own are a clause
    # ("Sorry, in meeting I'll call later"), a long one's six a junction and a marker.
    containment_slack_share: float = 0.125
    # Short texts (at most this many normalized characters) keep their normalized text for the edit check: a
    # candidate is a duplicate when both are short and their LCS similarity 2·LCS/(|a|+|b|) reaches `edit_similarity`
    # (a few words inserted, deleted or swapped), or when one is the other's characters in another order.
    short_text: int = 70
    edit_similarity: float = 0.85
    mgram: int = 6  # m-gram size of the substring-index bucket keys
    mgram_keys: int = 10  # sampled m-gram keys per message (all of them for short texts); 12 found no more (README)
    # Texts of at most `short_mgram_chars` normalized characters also get every m-gram of `short_mgram` wide
    # characters (Han, kana, hangul, placeholders) as bucket keys: one edit in a 10-character Chinese text leaves
    # no 6-gram in common, three characters carry as much as six Latin letters.
    short_mgram: int = 3
    short_mgram_chars: int = 20
    simhash_k: int = 3  # Hamming distance bound; the 64 bits split into k + 1 blocks
    minhash_perm: int = 128
    minhash_bands: int = 32
    sentences_top: int = 3  # the Baidu signature: this many longest sentences
    sentences_min_chars: int = 10
    max_candidates: int = 8  # candidates verified per message, best-ranked first
    # A candidate is verified only if it shares at least this fraction of the message's bucket keys;
    # unrelated texts share a key or two by chance, true copies share many (see README, tuning).
    min_shared: float = 0.2
    bucket_cap: int = 64  # representatives kept per bucket (newest win)
    max_chars: int = 20_000  # longer texts are truncated before fingerprinting
    window: float = 24 * 3600.0  # seconds of event time an indexed message keeps matching
    seed: int = 0x6E656172

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ConfigError(f"methods must be a non-empty subset of {METHODS}, got {self.methods!r}")
        if self.verify not in VERIFY_MODES:
            raise ConfigError(f"verify must be one of {VERIFY_MODES}, got {self.verify!r}")
        if not 0.0 < self.threshold <= 1.0 or not 0.0 < self.containment <= 1.0 or not 0.0 < self.edit_similarity <= 1.0:
            raise ConfigError("threshold, containment and edit_similarity must be in (0, 1]")
        if not 0.0 <= self.threshold_long <= 1.0 or not 0.0 <= self.containment_slack_share <= 1.0:
            raise ConfigError("threshold_long and containment_slack_share must be in [0, 1]")
        if self.minhash_perm % self.minhash_bands:
            raise ConfigError("minhash_perm must be a multiple of minhash_bands")
        if not 0 <= self.simhash_k < 16:
            raise ConfigError("simhash_k must be in [0, 15]")
        for name in ("shingle", "sketch_size", "mgram", "mgram_keys", "max_candidates", "bucket_cap",
                     "max_chars", "sentences_top", "short_mgram"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        for name in ("containment_slack", "short_text", "short_mgram_chars"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0")
        if self.short_text > 256:
            raise ConfigError("short_text must be <= 256 (the edit check is for short texts)")
        if self.window <= 0:
            raise ConfigError("window must be > 0 seconds")

    def replace(self, **changes: object) -> FilterConfig:
        return replace(self, **changes)  # type: ignore[arg-type]

    def fingerprint_params(self) -> dict[str, object]:
        """The parameters that change what is stored; thresholds and the window do not."""
        d = asdict(self)
        d["normalize_version"] = NORMALIZE_VERSION  # a changed normalization never meets old stored fingerprints
        for volatile in ("threshold", "threshold_long", "containment", "containment_min_ratio", "containment_min_size",
                         "containment_slack", "containment_slack_share", "edit_similarity", "max_candidates", "window",
                         "verify", "min_shared"):
            d.pop(volatile)
        return d

    def digest(self) -> str:
        """Short stable id of the fingerprint parameters; stored keys carry it so configs never mix."""
        canonical = json.dumps(self.fingerprint_params(), sort_keys=True, separators=(",", ":"))
        return format(mmh3.hash64(canonical.encode(), seed=7, signed=False)[0], "016x")[:12]
