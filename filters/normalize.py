"""Text normalization: undo what spammers and reposters do to a message before it is fingerprinted.

Each step is a named option (see `NormalizeOptions`) so that `neardup explain` can show what every step
did. The order matters and is fixed:

    strip_markers → nfkc → strip_invisible → strip_accents → confusables → traditional_to_simplified
    → casefold → mask_urls → leet → mask_numbers → strip_separators → pinyin

- `strip_markers` removes the marker a platform or a reposter puts where it cut a text: at its end
  `(more)`, `[cont]`, `(continued)`, `（未完）`, `(待续)`, or an ellipsis and `全文` (`…全文`, `...展开全文`); at its
  start `(more)` or `[cont]` (what a continuation begins with), after an ellipsis or not; the word in the brackets
  read past leet, look-alikes and spaces (`(m0r3)`). Its letters would otherwise be the cut copy's own shingles. A
  text that is a marker only keeps it.

- `strip_accents` decomposes (NFD) and drops every combining mark (nonzero combining class, and the
  combining diacritic blocks), so the result never depends on the order of stacked marks.
- `confusables` maps Cyrillic/Greek/... look-alikes to ASCII. It runs before `casefold`, so a
  character without a target of its own takes its lower case's (Г as г → r, Σ as σ → o); one with
  its own keeps it (Υ → y, υ → u: capitals are what spammers put in Latin words).
- `nfkc` first maps the few characters NFKC would turn into something they do not look like
  (`charmaps.BEFORE_NFKC_FROM`): lunate sigma ϲ stays a c look-alike (NFKC gives ς, read as o), and
  emoji that NFKC makes letters (🈶 → 有, 🉐 → 得, ℹ → i) become placeholders that are separators, so an
  emoji inserted into a word is decoration like any other.
- A number is a run of digits joined only by separators (`555-0100`, `+1 (555) 010 0100`).
- `leet` reads digits, `@`, `$` and `!` as letters only where they are part of a word, decided while the
  separators are still there. First, spaced-out text (three or more one-character tokens, `f r 3 3`,
  `p @ y`) is joined into its words. Then `!` inside a word (`pr!ze`, `1!k3`), `@` after a letter or
  between a digit and a letter (`p@ypal`, `w@17`, `5@nt@`; never a word-initial mention), `$` before a
  letter or ending a word (`$ale`, `ca$h`, `0n3$`; never before a digit: a price). Then a number of one
  or two digits that is part of a word: right after a letter and followed (after any separators) by a
  letter or the end of the text (`fr33 c4sh` → `free cash`, `he11o`); starting a word, after a letter up
  to three separators before (`h 3llo`) or after no word character at all (`7rump`, `48ou7`), unless
  it is a number with its unit (`10pm`, `3mins`, `2nd`, `5kg`); or in spaced-out text between one-letter
  tokens. Three or four look-alike digits (no 2 or 6) between letters are leet too (`p011cy`). A number
  that stands alone among words (`meet at 10 pm`, `save 50% now`, `$100`, `room 101a`) or follows a Han
  character (`2月22日`) stays a number. `l`, `1` and `I` are one visual class: `l` is folded to `i`.
- `mask_numbers` replaces each number by one placeholder; `mask_urls` does the same for URLs and
  e-mail addresses.
- After `strip_separators` the text has no spaces, punctuation, symbols or emoji at all, so inserting
  them between letters changes nothing; shingles are then taken over the remaining characters. Chinese
  modal particles and interjections (`PARTICLES`: 啊 吧 呢 嘛 哈 ...) go with them: padding with them is
  an evasion, and they carry no content.
- Empty result: a text with no letters or digits (only emoji and punctuation) would normalize to ""
  and so equal every other such text. Instead, when removing the separators would leave nothing,
  `strip_separators` removes only the whitespace ("😀 🎉!" → "😀🎉!"; the earlier steps already did
  NFKC and removed invisible characters). Such a form is all separators, so it never equals the form
  of a text with words; only texts of whitespace and invisible characters still normalize to "".
- `pinyin` codes each Han character as its toneless syllable (homophones meet), and a Latin run next to
  a syllable code that splits into pinyin syllables as the same codes (`转fa微博` = `转发微博`): the split
  with the fewest syllables that uses the whole run (`minguo` is min|guo, `xian` one syllable), with the
  `l` that leet folded into `i` read back (`chiii` is chi|li). A run with letters that are no pinyin
  (`LEDping`, `XPjicheng`) stays as it is.

Placeholders for masked URLs and numbers are letters of a script never seen in messages, so they can
never collide with real text; pinyin syllables are coded in the Supplementary Private Use Area-A.

Speed: `Normalizer.normalize_batch` gives exactly `[normalizer(t) for t in texts]` but runs each step
once over the whole batch: the texts are joined with a character every step treats as the end of a
text, the per-character steps (everything up to `casefold`; then `l` → `i`, separator stripping and
the pinyin codes) are lookups in one table per stage applied with numpy, and the patterns run once
per stage (URL and e-mail patterns only where a literal such as `://`, `@` or `.com` says they can
match). A single text takes the same stages with `str.translate`/`bytes.translate`
(and pure-ASCII text skips the Unicode ones). With the compiled core (`filters/_normalize.pxi`) every stage
runs text by text on code points instead (`Normalizer._compiled`). The step-by-step path (`trace`, and options
the fused stages do not cover) is the reference; tests hold both to it.
"""

from __future__ import annotations

import functools
import itertools
import re
import unicodedata
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Literal

from filters import charmaps

if TYPE_CHECKING:  # numpy is imported where the tables are used: the compiled stages never need it
    import numpy as np

try:  # the compiled stages (filters/_normalize.pxi); without a compiler, the numpy tables below
    import filters._native as _native
except ImportError:  # pragma: no cover - depends on the install
    _native = None

# Bumped whenever a step changes its output: stored fingerprints carry it (FilterConfig.digest), so a
# shared index never mixes fingerprints of two normalizations.
NORMALIZE_VERSION = 4

# Chinese modal particles and interjections (啊 吧 呢 嘛 ...): `strip_separators` removes them as it removes
# punctuation. They carry tone, not content, and padding a message with them is how a copy evades a filter
# ("免费注啊册", "源于啊实践"); in a word that holds one (酒吧, 哈尔滨) it goes from both texts alike.
# 吗 (a question), 了 and 的 (grammar) stay: they change what a sentence says.
PARTICLES = "啊吧呢嘛呀哦哈啦嗯哎喔哇呗咯噢呵嘿唉哟呐嗨呃诶"

# Placeholders are letters of the Mende Kikakui script: word characters (so separator stripping
# keeps them), untouched by NFKC, and never seen in the messages neardup filters.
URL_MARK = "\U0001E800"
EMAIL_MARK = "\U0001E801"
NUMBER_MARK = "\U0001E802"

# Joins the texts of a batch: a control character (strip_invisible deletes it from every text, so no
# text contains it) that is also whitespace and a separator, so each pattern below ends a match there
# (`\S`, `[\w.+-]`, `_SEP`) and treats it like the end of the text (`_END`, `\b`, lookbehinds).
_JOIN = "\x1e"


def _lazy(source: str) -> Callable[[], re.Pattern[str]]:
    """A pattern compiled when first used (call it), as the `functools.cache`d patterns below: the compiled stages
    use none of these, and compiling them all was ≈ 1.5 ms of every process's start."""
    return functools.cache(functools.partial(re.compile, source))


_TLD_WORDS = ("com", "net", "org", "info", "biz", "co", "uk", "cn", "io", "ly", "me", "us", "de", "ru", "jp", "tv")
_TLDS = f"(?:{'|'.join(_TLD_WORDS)})"
# URL and e-mail masking runs after casefold, so the patterns are lower-case only. Each starts with
# something literal or rare so the regex engine skips most positions.
_SCHEME_URL = _lazy(r"(?:(?:https?|ftp)://|www\.)\S+")
_EMAIL = _lazy(r"(?<![\w.+-])[\w.+-]+@[\w-]+(?:\.[\w-]+)+")
_HAS_TLD = _lazy(r"\." + _TLDS + r"\b")
_BARE_DOMAIN = _lazy(r"\b(?:[a-z0-9-]+\.)+" + _TLDS + r"\b(?:/\S*)?")
_DOMAIN_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789.-")
_SEPARATORS = _lazy(rf"[\W_{PARTICLES}]+")  # what `strip_separators` removes
_SEP = r"(?:[^\w\x1e]|_)"  # one separator character, never the batch joiner
_END = r"(?:[a-z]|\x1e|\Z)"  # a letter, or the end of the text
# Symbols read as letters: `@` after a letter (`c@sh`, `w@17`, `sant@`) or between a digit and a letter
# (`5@nt@`), never at the start of a word (a mention); `$` before a letter (`$ale`) or ending a word after
# a letter, or a letter and a digit (`ca$`, `0n3$`), never before a digit (a price); `!` inside a word
# (`pr!ze`, `1!k3`, `hour!5h`), not ending one (an exclamation).
_LEET_AT = _lazy(r"@(?:(?<=[a-z]@)|(?<=[0-9]@)(?=[a-z]))")
_LEET_DOLLAR = _lazy(r"\$(?:(?=[a-z])|(?:(?<=[a-z]\$)|(?<=[a-z][0-9]\$))(?![0-9a-z]))")
_LEET_BANG = _lazy(r"!(?:(?<=[a-z0-9]!)(?=[a-z@$])|(?<=[a-z]!)(?=[0-9]))")
# Spaced-out text ("f r 3 3  c 4 $ h", "p @ y"): three or more one-character tokens at most three spaces
# apart, starting after a space, a line break or the batch joiner; joined when they hold a letter, two
# letters or @ $ !, and a digit or symbol, so that the rules for words apply to them.
_SPACED = _lazy(r"[ \n\x1e][a-z0-9@$!](?: {1,3}[a-z0-9@$!]){2,}(?![\w@$!])")
_SPACED_LEET = frozenset("0123456789@$!")
_WORD_GAP = _lazy(" {2,}")
_LEET_DIGITS = str.maketrans("0123456789", "oizeasgtbg")
_NUMBER = _lazy(rf"[0-9]++(?:{_SEP}*+[0-9]++)*+")
# Every number, the leet ones in the group `leet`: at most two digits, and right after a letter and
# followed by a letter or the end; or right before a letter and 1-3 separators after one; or between
# one-letter tokens 1-3 separators away (spaced-out text: " ".join("hav3 won") puts three between words).
_TWO_DIGITS_AT_MOST = rf"(?:{_SEP}*+[0-9])?+(?!{_SEP}*+[0-9])"
_AFTER_ONE_LETTER_TOKEN = "|".join(
    rf"(?<=[a-z]{_SEP}{{{k}}}[0-9])(?<!\w[a-z]{_SEP}{{{k}}}[0-9])" for k in (1, 2, 3)
)
_AFTER_A_LETTER = "|".join(rf"(?<=[a-z]{_SEP}{{{k}}}[0-9])" for k in (1, 2, 3))
# A number followed by a unit (10pm, 3mins, 2nd, 4g, 5kg) is a number even where it starts a word.
_UNIT_WORDS = ("am pm s st nd rd th k m b bn g gb mb kb tb kg km mg ml cm mm min mins h hr hrs x d p ppm yo yr yrs mph ft"
               " lb lbs oz px v w hz ghz mhz fps mp pc pcs pct").split()
_UNIT = rf"(?:{'|'.join(_UNIT_WORDS)})(?![a-z0-9])"
_UNITS = frozenset(_UNIT_WORDS)  # for the compiled `numbers_or_leet`: _UNIT matches where one of them is a whole word
@functools.cache
def _number_or_leet() -> re.Pattern[str]:
    """The pattern of every number and of the leet ones (compiled on first use, ≈ 2 ms: the compiled stages
    scan numbers with `numbers_or_leet` and never need it)."""
    return re.compile(  # starts with [0-9] so the regex engine skips to digits quickly
        rf"[0-9](?:(?P<leet>(?<=[a-z][0-9]){_TWO_DIGITS_AT_MOST}(?={_SEP}*+{_END})"
        rf"|(?<=[a-z][013457-9])[013457-9]{{2,3}}(?=[a-z])"  # three or four look-alike digits inside a word
        rf"|(?:{_AFTER_A_LETTER}){_TWO_DIGITS_AT_MOST}(?=[a-z])(?!{_UNIT})"
        rf"|(?<![^\W_][0-9])(?<!\$[0-9])[0-9]?+(?![0-9])(?=[a-z])(?!{_UNIT})"  # one or two digits starting a word
        rf"|(?:{_AFTER_ONE_LETTER_TOKEN}){_TWO_DIGITS_AT_MOST}"
        rf"(?={_SEP}{{1,3}}[a-z](?!\w)|{_SEP}*+(?:\x1e|\Z)))"
        rf"|[0-9]*+(?:{_SEP}*+[0-9]++)*+)"
    )


_LATIN_RUN = _lazy(r"[a-z]{1,40}")
_han = _lazy(r"[\u3400-\u9fff]")  # 1 ms to compile, and the compiled stages never need it
_PINYIN_CODE = 0xF0000
_COMBINING_RANGES = ((0x300, 0x36F), (0x1AB0, 0x1AFF), (0x1DC0, 0x1DFF), (0x20D0, 0x20FF), (0xFE20, 0xFE2F))
_COMBINING_STARTS = tuple(lo for lo, _ in _COMBINING_RANGES)
_DROP = 0xFFFFFFFF  # in the uint32 tables
_MULTI = 0xFFFFFFFE


def _scanned_chars() -> Iterator[str]:
    """Characters outside these ranges are never changed by a per-character step (casefold, marks,
    invisibles, the tables): planes 0-1 and the tags/variation selectors of plane 14. (Not a constant:
    4 ms of every start-up to build, and only the reference's tables use it.)"""
    return map(chr, itertools.chain(range(0x20000), range(0xE0000, 0xE1000)))


def _char_class(chars: Sequence[str]) -> str:
    ranges: list[tuple[int, int]] = []
    for cp in sorted(map(ord, chars)):
        if ranges and ranges[-1][1] == cp - 1:
            ranges[-1] = (ranges[-1][0], cp)
        else:
            ranges.append((cp, cp))
    return "".join(re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}" for a, b in ranges)


def _scanned(cp: int) -> bool:
    return cp < 0x20000 or 0xE0000 <= cp < 0xE1000


def _is_invisible(ch: str) -> bool:
    """Format (Cf) and control (Cc, except tab, LF, CR) characters plus variation selectors."""
    cp = ord(ch)
    return _scanned(cp) and cp not in (0x09, 0x0A, 0x0D) and (
        unicodedata.category(ch) in ("Cf", "Cc") or 0xFE00 <= cp <= 0xFE0F or 0xE0100 <= cp <= 0xE01EF)


def _is_mark(ch: str) -> bool:
    """A combining mark strip_accents drops: in the combining diacritic blocks, or with a nonzero combining
    class (the only ones canonical ordering moves, so none is left to reorder)."""
    cp = ord(ch)
    if not _scanned(cp):
        return False
    if unicodedata.combining(ch):
        return True
    at = bisect_right(_COMBINING_STARTS, cp) - 1  # (asked once per code point a text brings: no generator)
    return at >= 0 and cp <= _COMBINING_RANGES[at][1]


@functools.cache
def _invisible_chars() -> tuple[str, ...]:
    return tuple(ch for ch in _scanned_chars() if _is_invisible(ch))


@functools.cache
def _invisible_pattern() -> re.Pattern[str]:
    return re.compile(f"[{_char_class(_invisible_chars())}]+")


@functools.cache
def _marks_pattern() -> re.Pattern[str]:
    return re.compile(f"[{_char_class([ch for ch in _scanned_chars() if _is_mark(ch)])}]+")


# Characters NFKC would make something they do not look like (see `charmaps.BEFORE_NFKC_FROM`): the nfkc
# step maps them first.
_BEFORE_NFKC = _lazy(f"[{_char_class(charmaps.BEFORE_NFKC_FROM)}]")
_BEFORE_NFKC_MAP = dict(zip(charmaps.BEFORE_NFKC_FROM, charmaps.BEFORE_NFKC_TO, strict=True))


_UNSEEN = object()
_SEGMENTED_MAX = 1 << 16  # remembered pinyin splits per Normalizer (a bound on its memory)


def _keep_look(text: str) -> str:
    # A substitution, not str.translate: they are rare, and translate looks up every character (5x slower).
    return _BEFORE_NFKC().sub(_keep_look_char, text)


def _keep_look_char(m: re.Match[str]) -> str:
    return _BEFORE_NFKC_MAP[m.group()]


@functools.cache
def _translation_tables() -> tuple[dict[int, int], dict[int, int], dict[str, str]]:
    """Built once per process from the constant tables in `filters.charmaps` (they never change)."""
    confusables = str.maketrans(charmaps.CONFUSABLE_FROM, charmaps.CONFUSABLE_TO)
    t2s = str.maketrans(charmaps.TRADITIONAL, charmaps.SIMPLIFIED)
    syllables = {syl: chr(_PINYIN_CODE + i) for i, syl in enumerate(charmaps.PINYIN_SYLLABLES)}
    # The leet step folds l into i before the pinyin step: "lai" arrives as "iai". No syllable starts
    # with i, so the folded spellings never collide with another syllable.
    syllables.update({syl.replace("l", "i"): code for syl, code in syllables.items() if "l" in syl})
    return confusables, t2s, syllables


@functools.cache
def _pinyin_table() -> dict[int, str]:
    """Han character → its syllable's code, for `str.translate` (the steps and the numpy tables: the compiled
    stages read `charmaps.PINYIN_CODES` themselves, so a process on them never builds it)."""
    base = charmaps.PINYIN_BASE
    return {base + i: c for i, c in enumerate(charmaps.PINYIN_CODES) if c != "\x00"}


@functools.cache
def _word_code_points() -> np.ndarray:
    """Every code point that `\\w` matches (what strip_separators keeps), as uint32."""
    import numpy as np

    every = np.arange(0x110000, dtype=np.uint32)
    every = every[(every < 0xD800) | (every > 0xDFFF)]
    words = re.sub(r"[\W_]+", "", every.tobytes().decode("utf-32-le"))
    return np.frombuffer(words.encode("utf-32-le"), dtype=np.uint32)


@dataclass(frozen=True, slots=True)
class NormalizeOptions:
    """Which normalization steps run. The defaults are what `neardup filter` uses."""

    strip_markers: bool = True
    nfkc: bool = True
    strip_invisible: bool = True
    strip_accents: bool = True
    confusables: bool = True
    traditional_to_simplified: bool = True
    casefold: bool = True
    mask_urls: bool = True
    leet: bool = True
    mask_numbers: bool = True
    strip_separators: bool = True
    pinyin: bool = True

    @classmethod
    def step_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def with_steps(self, **changes: bool) -> NormalizeOptions:
        return replace(self, **changes)


@dataclass(frozen=True, slots=True)
class _Stages:
    """The fused per-character tables of one `NormalizeOptions` (see the module docstring)."""

    decompose: Literal["NFKD", "NFD"] | None  # NFKD (nfkc + strip_accents), NFD (strip_accents alone) or nothing
    chars: dict[int, str]  # stage 1 for str.translate: decomposed character → its form after casefold
    chars_lut: np.ndarray  # the same as uint32 code points, _DROP or _MULTI (see `multi`)
    multi: dict[str, str]  # stage 1 characters that become several (ß → ss)
    ascii_chars: bytes  # stage 1 of ASCII text for bytes.translate, with ascii_drop deleted
    ascii_drop: bytes
    words: dict[int, str]  # stage 3 for str.translate after separators are gone: leet digits, l, pinyin
    words_lut: np.ndarray  # stage 3 as uint32 code points or _DROP (separators)
    kinds_lut: np.ndarray  # uint8 per stage 3 output: 1 for a-z, 2 for a pinyin code, else 0
    ascii_words: bytes  # stage 3 of ASCII(+placeholder) text for bytes.translate of its UTF-8
    ascii_words_drop: bytes


class Normalizer:
    """Applies the enabled steps of `NormalizeOptions`; pure and deterministic."""

    def __init__(self, options: NormalizeOptions | None = None, native: bool | None = None) -> None:
        """`native`: the compiled stages (`filters._native.NormalizeStages`) if built (None) or if True and
        built; False: the numpy tables. The same results either way."""
        self.options = options or NormalizeOptions()
        self._tab_confusables, self._tab_t2s, self._syllable_code = _translation_tables()
        self._max_syllable = max(len(s) for s in charmaps.PINYIN_SYLLABLES)
        # Latin runs between Han characters repeat ("app", "ok", "hao"): their splits are remembered.
        self._segmented: dict[str, str | None] = {}
        order = NormalizeOptions.step_names()
        # The steps after `strip_markers`, which `__call__` and `normalize_batch` take first (not idempotent: a text
        # may end in two markers).
        self._steps: list[tuple[str, Callable[[str], str]]] = [
            (name, getattr(self, f"_{name}")) for name in order if getattr(self.options, name) and name != "strip_markers"
        ]
        twins = {"strip_invisible": _drop_invisible, "strip_accents": _drop_marks, "pinyin": _code_han}
        self._candidates = _native.marker_candidates if _native is not None and native is not False else marker_candidates
        self._steps_unpatterned = [(name, twins.get(name, step)) for name, step in self._steps]
        fusable = _fusable(self.options)
        self._core = None
        if fusable and _native is not None and native is not False:
            o = self.options
            self._core = _native.NormalizeStages(_decomposed(o), o.leet, o.pinyin, charmaps.PINYIN_CODES,
                                                 charmaps.PINYIN_BASE, o.mask_urls, o.mask_numbers, _UNITS, _TLD_WORDS,
                                                 PARTICLES)
        # The numpy tables take ≈ 0.3 s to build: only without the compiled stages.
        self._stages = _stages(self.options) if fusable and self._core is None else None

    # -- public ------------------------------------------------------------------------------
    def __call__(self, text: str) -> str:
        return self._one(_strip_markers(text) if self.options.strip_markers else text)

    def normalize_batch(self, texts: Sequence[str]) -> list[str]:
        """`[self(t) for t in texts]`, computed with one pass of each stage over the whole batch."""
        if self.options.strip_markers:
            texts = texts if isinstance(texts, list) else list(texts)
            at = self._candidates(texts, EDGE_LAST, EDGE_FIRST)
            if at:
                texts = texts[:]
                for k in at:
                    texts[k] = _markers_stripped(texts[k])
        return self._many(texts)

    def trace(self, text: str) -> list[tuple[str, str]]:
        """The text after each enabled step, for `neardup explain`."""
        out = []
        steps = [("strip_markers", _strip_markers), *self._steps] if self.options.strip_markers else self._steps
        for name, step in steps:
            text = step(text)
            out.append((name, text))
        return out

    def _one(self, text: str) -> str:
        """`__call__` after `strip_markers`."""
        if self._core is not None:
            return self._compiled([text])[0]
        st = self._stages
        if st is None:
            return self._stepwise(text)
        out = self._fused(text, st)
        # The fused stage 3 drops every separator; strip_separators' rule for texts made only of them
        # (see the module docstring) is left to the steps: such texts are rare.
        return out if out or not text else self._stepwise(text)

    def _many(self, texts: Sequence[str]) -> list[str]:
        """`normalize_batch` after `strip_markers`."""
        if self._core is not None:
            return self._compiled(texts)
        st = self._stages
        if st is None or len(texts) < 2:
            return [self._one(t) for t in texts]
        clean = [t.replace(_JOIN, "") if _JOIN in t else t for t in texts]
        ascii_at = [i for i, t in enumerate(clean) if t.isascii()]
        other_at = [i for i, t in enumerate(clean) if not t.isascii()] if len(ascii_at) < len(clean) else []
        out: list[str] = [""] * len(texts)
        if ascii_at:
            joined = _JOIN.join([clean[i] for i in ascii_at])
            joined = joined.encode("ascii").translate(st.ascii_chars, st.ascii_drop).decode("ascii")
            joined = self._words_stage(joined)
            done = joined.encode("utf-8").translate(st.ascii_words, st.ascii_words_drop).decode("utf-8")
            for i, s in zip(ascii_at, done.split(_JOIN), strict=True):
                out[i] = s
        if other_at:
            joined = _JOIN.join([clean[i] for i in other_at])
            joined = self._chars_batch(joined, st)
            joined = self._words_stage(joined)
            done, latin_next_to_pinyin = self._words_batch(joined, st)
            for k, (i, s) in enumerate(zip(other_at, done.split(_JOIN), strict=True)):
                out[i] = self._latin_pinyin(s) if k in latin_next_to_pinyin else s
        return [s if s or not t else self._stepwise(t) for s, t in zip(out, texts, strict=True)]

    def _stepwise(self, text: str, steps: list[tuple[str, Callable[[str], str]]] | None = None) -> str:
        for _, step in steps or self._steps:
            text = step(text)
        return text

    # -- fused stages ------------------------------------------------------------------------
    def _compiled(self, texts: Sequence[str]) -> list[str]:
        """`normalize_batch` by the compiled stages (`NormalizeStages.each`: the decomposition with stage 1, the word
        stage and stage 3, text by text; see `_decomposed`)."""
        core = self._core
        assert core is not None
        done, latin_next_to_pinyin, emptied = core.each(texts if isinstance(texts, list) else list(texts))
        for k in latin_next_to_pinyin:  # (`_latin_pinyin`, compiled: `_native.latin_pinyin`)
            done[k] = _native.latin_pinyin(done[k], self._segmented, self._split_run, _PINYIN_CODE, _PINYIN_CODE + 0x1000)
        # Texts of separators only: by the steps, with the per-character twins of the two steps that use a
        # pattern (building those patterns would cost every process ≈ 0.5 s, the texts are short).
        for k in emptied:
            done[k] = self._stepwise(texts[k], self._steps_unpatterned)
        return done  # type: ignore[no-any-return]

    def _fused(self, text: str, st: _Stages) -> str:
        if _JOIN in text:
            text = text.replace(_JOIN, "")  # strip_invisible would delete it; stage 1 keeps it
        if text.isascii():
            text = text.encode("ascii").translate(st.ascii_chars, st.ascii_drop).decode("ascii")
            text = self._words_stage(text)
            return text.encode("utf-8").translate(st.ascii_words, st.ascii_words_drop).decode("utf-8")
        if st.decompose:
            if self.options.nfkc:
                text = _keep_look(text)
            text = unicodedata.normalize(st.decompose, text)
        text = self._words_stage(text.translate(st.chars))
        han = self.options.pinyin and _han().search(text) is not None
        text = _SEPARATORS().sub("", text)
        if st.words:
            text = text.translate(st.words)
        return self._latin_pinyin(text) if han else text

    def _chars_batch(self, joined: str, st: _Stages) -> str:
        if st.decompose:
            if self.options.nfkc:
                joined = _keep_look(joined)
            joined = unicodedata.normalize(st.decompose, joined)
        import numpy as np

        codes = np.frombuffer(joined.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        mapped = st.chars_lut[codes]
        multi = mapped == _MULTI
        has_multi = bool(multi.any())
        if has_multi:
            mapped[multi] = codes[multi]  # replaced after decoding, they are rare (ß)
        mapped = mapped[mapped != _DROP]
        joined = mapped.tobytes().decode("utf-32-le", "surrogatepass")
        if has_multi:
            for ch, value in st.multi.items():
                if ch in joined:
                    joined = joined.replace(ch, value)
        return joined

    def _words_stage(self, text: str) -> str:
        """mask_urls, then leet and mask_numbers as far as they need context (patterns)."""
        o = self.options
        if o.mask_urls:
            text = self._mask_urls(text)
        if o.leet:
            text = _leet_symbols(text)
            text = _number_or_leet().sub(_leet_or_mask if o.mask_numbers else _leet_or_keep, text)
        elif o.mask_numbers:
            text = _NUMBER().sub(NUMBER_MARK, text)
        return text

    def _words_batch(self, joined: str, st: _Stages) -> tuple[str, set[int]]:
        import numpy as np

        codes = np.frombuffer(joined.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        mapped = st.words_lut[codes]
        mapped = mapped[mapped != _DROP]
        latin_next_to_pinyin: set[int] = set()
        if self.options.pinyin:
            kind = st.kinds_lut[mapped]  # 1: Latin letter, 2: pinyin code
            touching = np.flatnonzero((kind[:-1] | kind[1:]) == 3)
            if len(touching):
                # Like the pinyin step: only in texts with a Han character.
                text_ends = np.flatnonzero(mapped == ord(_JOIN))
                touched = np.searchsorted(text_ends, touching, side="right")
                # The text of each position is the number of joiners before it (one pass, no search per Han).
                text_of = np.cumsum(codes == ord(_JOIN))
                has_han = np.zeros(len(text_ends) + 1, dtype=bool)
                has_han[text_of[(codes >= 0x3400) & (codes <= 0x9FFF)]] = True
                touched = touched[np.flatnonzero(np.diff(touched, prepend=-1))]  # sorted: drop repeats
                latin_next_to_pinyin = set(touched[has_han[touched]].tolist())
        return mapped.tobytes().decode("utf-32-le", "surrogatepass"), latin_next_to_pinyin

    # -- steps -----------------------------------------------------------------------------
    @staticmethod
    def _nfkc(text: str) -> str:
        return text if text.isascii() else unicodedata.normalize("NFKC", _keep_look(text))

    def _strip_invisible(self, text: str) -> str:
        return text if text.isascii() and text.isprintable() else _invisible_pattern().sub("", text)

    @staticmethod
    def _strip_accents(text: str) -> str:
        return text if text.isascii() else _marks_pattern().sub("", unicodedata.normalize("NFD", text))

    def _confusables(self, text: str) -> str:
        return text if text.isascii() else text.translate(self._tab_confusables)

    def _traditional_to_simplified(self, text: str) -> str:
        return text if text.isascii() else text.translate(self._tab_t2s)

    @staticmethod
    def _casefold(text: str) -> str:
        return text.lower() if text.isascii() else text.casefold()

    @staticmethod
    def _mask_urls(text: str) -> str:
        """The patterns are tried where a literal says they may match (the compiled stages: `scheme_url_spans`,
        `email_spans` and `domain_spans`)."""
        if "://" in text or "www." in text:
            text = _sub_at(_SCHEME_URL(), text, f" {URL_MARK} ", _scheme_starts(text))
        if "@" in text:
            text = _sub_at(_EMAIL(), text, f" {EMAIL_MARK} ", _email_starts(text))
        if "." in text:
            text = _sub_at(_BARE_DOMAIN(), text, f" {URL_MARK} ", _domain_starts(text))
        return text

    @staticmethod
    def _leet(text: str) -> str:
        return _number_or_leet().sub(_leet_or_keep, _leet_symbols(text)).replace("l", "i")

    @staticmethod
    def _mask_numbers(text: str) -> str:
        return _NUMBER().sub(NUMBER_MARK, text)

    @staticmethod
    def _strip_separators(text: str) -> str:
        out = _SEPARATORS().sub("", text)
        return out if out or not text else "".join(text.split())

    def _pinyin(self, text: str) -> str:
        if text.isascii() or not _han().search(text):
            return text
        return self._latin_pinyin(text.translate(_pinyin_table()))

    def _latin_pinyin(self, coded: str) -> str:
        # Latin letters that stand between Han characters are pinyin substitutions ("转fa微博").
        return _LATIN_RUN().sub(self._pinyin_run, coded) if _LATIN_RUN().search(coded) else coded

    def _pinyin_run(self, m: re.Match[str]) -> str:
        s, start, end = m.string, m.start(), m.end()
        before = s[start - 1] if start else ""
        after = s[end] if end < len(s) else ""
        if not (_is_syllable_code(before) or _is_syllable_code(after)):
            return m.group()
        run = m.group()
        done = self._segmented.get(run, _UNSEEN)
        if done is _UNSEEN:
            done = self._split_run(run)
        return done or run  # type: ignore[return-value]

    def _split_run(self, run: str) -> str | None:
        """`_segment_pinyin(run)`, remembered in `_segmented` (emptied when full)."""
        if len(self._segmented) >= _SEGMENTED_MAX:
            self._segmented.clear()
        done = self._segmented[run] = self._segment_pinyin(run)
        return done

    def _segment_pinyin(self, run: str) -> str | None:
        """Split a Latin run into pinyin syllables, None if it is not pinyin. Of the ways to split it, the
        one with the fewest syllables, then the longest first ("xian" is one syllable, "fangan" fang|an),
        but never a dead end: "minguo" is min|guo, not ming + "uo"."""
        n = len(run)
        codes = self._syllable_code
        # best[i]: (syllables, size of the first one) of the best split of run[i:], None if there is none
        best: list[tuple[int, int] | None] = [None] * n + [(0, 0)]
        for i in range(n - 1, -1, -1):
            for size in range(min(self._max_syllable, n - i), 0, -1):
                rest = best[i + size]
                if rest is not None and run[i : i + size] in codes:
                    here = best[i]
                    if here is None or rest[0] + 1 < here[0]:
                        best[i] = (rest[0] + 1, size)
        if best[0] is None:
            return None
        out = []
        i = 0
        while i < n:
            size = best[i][1]  # type: ignore[index]
            out.append(codes[run[i : i + size]])
            i += size
        return "".join(out)


def _sub_at(pattern: re.Pattern[str], text: str, repl: str, starts: Sequence[int]) -> str:
    """`pattern.sub(repl, text)` given, in ascending order, every position where a match can start:
    the same result without the regex engine trying every other position (the costly part)."""
    out = []
    pos = 0
    for p in starts:
        if p >= pos and (m := pattern.match(text, p)):
            out.append(text[pos:p])
            out.append(repl)
            pos = m.end()
    if not out:
        return text
    out.append(text[pos:])
    return "".join(out)


def _find_all(text: str, literal: str) -> list[int]:
    out = []
    at = text.find(literal)
    while at >= 0:
        out.append(at)
        at = text.find(literal, at + 1)
    return out


def _scheme_starts(text: str) -> list[int]:
    """A scheme URL starts with https://, http://, ftp:// or www."""
    starts = {q - k for q in _find_all(text, "://") for k in (5, 4, 3) if q >= k}
    starts.update(_find_all(text, "www."))
    return sorted(starts)


def _email_starts(text: str) -> list[int]:
    """An e-mail address starts where the run of local-part characters before its @ starts."""
    out = []
    for at in _find_all(text, "@"):
        p = at
        while p and (text[p - 1].isalnum() or text[p - 1] in "_.+-"):
            p -= 1
        if p < at:
            out.append(p)
    return out


def _domain_starts(text: str) -> list[int]:
    """A bare domain starts at a word boundary inside the run of [a-z0-9.-] before one of its TLDs."""
    starts: set[int] = set()
    for m in _HAS_TLD().finditer(text):
        q = m.start()
        p = q
        while p and text[p - 1] in _DOMAIN_CHARS:
            p -= 1
        starts.add(p)
        for i in range(p + 1, q):
            before, here = text[i - 1], text[i]
            if (before in ".-" and here.isalnum()) or (here == "-" and before.isalnum()):
                starts.add(i)
    return sorted(starts)


def _join_spaced(m: re.Match[str]) -> str:
    return _join_run(m.group())


def _join_run(run: str) -> str:
    letters = sum(c.isalpha() for c in run)
    if not letters or letters + sum(c in "@$!" for c in run) < 2 or not _SPACED_LEET.intersection(run):
        return run
    # One space between the letters of a word, more between words (" ".join("y0u won") → "y 0 u   w o n").
    return run[0] + " ".join(word.replace(" ", "") for word in _WORD_GAP().split(run[1:]))


def _leet_symbols(text: str) -> str:
    """Spaced-out runs joined, then `!`, `@` and `$` read as letters where they are part of a word (the compiled
    stages: `spaced_runs` and `_leet_symbol`)."""
    if " " in text:
        text = _SPACED().sub(_join_spaced, " " + text)[1:]
    if "!" in text:
        text = _sub_at(_LEET_BANG(), text, "i", _find_all(text, "!"))
    if "@" in text:
        text = _sub_at(_LEET_AT(), text, "a", _find_all(text, "@"))
    if "$" in text:
        text = _sub_at(_LEET_DOLLAR(), text, "s", _find_all(text, "$"))
    return text


def _leet_or_keep(m: re.Match[str]) -> str:
    return m.group().translate(_LEET_DIGITS) if m.lastgroup else m.group()  # lastgroup: "leet" or None


def _leet_or_mask(m: re.Match[str]) -> str:
    return m.group().translate(_LEET_DIGITS) if m.lastgroup else NUMBER_MARK


def _is_syllable_code(ch: str) -> bool:
    return bool(ch) and _PINYIN_CODE <= ord(ch) < _PINYIN_CODE + 0x1000


def _stage1(o: NormalizeOptions) -> Callable[[int], str]:
    """Stage 1 of `_stages(o)` for one code point, without its tables: the steps applied to the
    character if it is one `_stages` looks at (else it is its own value). For the compiled stages
    (`_decomposed`), which ask once per code point they meet."""
    confusables, t2s, _ = _translation_tables()
    n = Normalizer(NormalizeOptions(**{name: False for name in NormalizeOptions.step_names()}), native=False)
    per_char = [
        step
        for name, step in (
            ("strip_invisible", _drop_invisible),
            ("strip_accents", _drop_marks),
            ("confusables", n._confusables),
            ("traditional_to_simplified", n._traditional_to_simplified),
            ("casefold", n._casefold),
        )
        if getattr(o, name)
    ]

    def value(cp: int) -> str:
        ch = chr(cp)
        if not (cp < 0x80 or cp in confusables or cp in t2s or _is_invisible(ch) or _is_mark(ch)
                or (_scanned(cp) and ch.casefold() != ch)):
            return ch
        for step in per_char:
            ch = step(ch)
        return ch

    return value


def _decomposed(o: NormalizeOptions) -> Callable[[int], str]:
    """`_stage1(o)` of each character of a code point's decomposition (NFKD after the nfkc step's `_keep_look`, or
    NFD with strip_accents alone), for the compiled stages, which ask once per code point they meet: no text is
    decomposed whole. A text's decomposition is each character's, then its combining marks reordered where they
    meet; stage 1 drops every mark (strip_accents: `_fusable` decomposes only with it), so the order of those it
    reorders never shows."""
    value = _stage1(o)
    form: Literal["NFKD", "NFD"] | None = "NFKD" if o.nfkc else "NFD" if o.strip_accents else None
    if form is None:
        return value

    def decomposed(cp: int) -> str:
        ch = chr(cp)
        parts = unicodedata.normalize(form, _BEFORE_NFKC_MAP.get(ch, ch) if o.nfkc else ch)
        return value(cp) if parts == ch else "".join([value(ord(c)) for c in parts])

    return decomposed


_MARKER_WORDS = frozenset(["more", "cont", "cont.", "continued", "未完", "待续", "未完待续"])  # in brackets
_OPENING = {")": "(", "]": "[", "）": "（", "】": "【"}  # the closing brackets a marker ends in, and their openings
_MORE_TEXT = ("展开全文", "阅读全文", "查看全文", "全文")  # after an ellipsis: the rest of a folded post
_SPACES = " \t\n\r\u3000"
# What a text's last or first character must be for `_strip_markers` to look further (`marker_candidates`).
EDGE_LAST = "".join(_OPENING) + "文" + _SPACES
EDGE_FIRST = "".join(_OPENING.values()) + ".…" + _SPACES


def marker_candidates(texts: Sequence[str], last: str = EDGE_LAST, first: str = EDGE_FIRST) -> list[int]:
    """The places of the texts whose last character is one of `last` or whose first is one of `first`: those
    `_strip_markers` may change, 7 % of the development stream (`_native.marker_candidates` is the compiled twin: a
    test in Python costs ~0.2 µs a text, a sixth of all normalization)."""
    return [k for k, t in enumerate(texts) if t[-1:] and (t[-1] in last or t[0] in first)]


# A marker's word as the tricks the later steps undo leave it (`(m0r3)`, `[c0n7]`, `( m o r 3 )`, `(mσꭇe)`): the
# look-alikes and the leet digits and symbols read as letters, spaces gone, lower case.
_LEET_FOLD = str.maketrans("013457@$!", "oieastasi", " \t")


def _marker_word(inside: str) -> bool:
    """Is `inside` (what stands between a marker's brackets) one of `_MARKER_WORDS`, read past the tricks?"""
    if inside.lower() in _MARKER_WORDS:
        return True
    return inside.translate(_translation_tables()[0]).lower().translate(_LEET_FOLD) in _MARKER_WORDS


def _bracketed_end(text: str) -> int:
    """Where a bracketed marker (`_MARKER_WORDS`) that `text` ends in starts, else -1."""
    opening = _OPENING.get(text[-1:])
    if opening is None:
        return -1
    at = text.rfind(opening, max(0, len(text) - 24), len(text) - 1)
    return at if at >= 0 and _marker_word(text[at + 1 : -1]) else -1


def _strip_markers(text: str) -> str:
    """The strip_markers step (see the module docstring): at most one marker from the end, then one from the start;
    a text that is a marker only is kept. The ellipsis and spaces around a marker are separators: they are left. A
    text that `marker_candidates` passes over is returned as it is, as `normalize_batch` leaves it."""
    return _markers_stripped(text) if marker_candidates((text,)) else text


def _markers_stripped(text: str) -> str:
    """`_strip_markers` of a text `marker_candidates` took (`normalize_batch` asks it once for the whole batch)."""
    body = text.rstrip()
    at = _bracketed_end(body)
    if at < 0 and body.endswith("全文"):
        more = next(m for m in _MORE_TEXT if body.endswith(m))
        before = body[: len(body) - len(more)].rstrip()
        at = len(before) if before.endswith(("..", "…")) else -1
    if at >= 0:
        body = body[:at]
    head = body.lstrip()
    if head[:1] in (".", "…"):
        head = head.lstrip(".…" + _SPACES)
    close = min((i for i in (head.find(c, 1, 24) for c in _OPENING) if i > 0), default=-1)
    if close > 0 and _OPENING[head[close]] == head[0] and _marker_word(head[1:close]):
        body = head[close + 1 :]
    elif at < 0:
        return text
    return body if body.strip() else text


def _drop_invisible(text: str) -> str:
    """The strip_invisible step without its pattern (for one character at a time)."""
    return "".join(c for c in text if not _is_invisible(c))


def _drop_marks(text: str) -> str:
    """The strip_accents step without its pattern (for one character at a time)."""
    return text if text.isascii() else "".join(c for c in unicodedata.normalize("NFD", text) if not _is_mark(c))


def _code_han(text: str) -> str:
    """The pinyin step for a text of separators only (its Han characters are particles, `PARTICLES`; it has no
    Latin letter): each Han character as its syllable's code, read from `charmaps.PINYIN_CODES` as the compiled
    stages read it, so a process on them never builds `_pinyin_table` (megabytes) for such a text."""
    base, codes = charmaps.PINYIN_BASE, charmaps.PINYIN_CODES
    out = []
    for c in text:
        i = ord(c) - base
        code = codes[i] if 0 <= i < len(codes) else "\x00"
        out.append(c if code == "\x00" else code)
    return "".join(out)


def _fusable(o: NormalizeOptions) -> bool:
    """The fused stages equal the steps when the per-character steps act character by character:
    NFKC composes, so it is fused only with strip_accents (NFD(NFKC(s)) = NFKD(s)); the batch joiner
    needs strip_invisible; stage 3 deletes separators."""
    return o.strip_invisible and o.strip_separators and (o.strip_accents or not o.nfkc)


@functools.cache
def _stages(o: NormalizeOptions) -> _Stages:
    """Derive the fused tables from the step functions themselves, character by character."""
    import numpy as np

    n = Normalizer(NormalizeOptions(**{name: False for name in NormalizeOptions.step_names()}))
    per_char = [
        step
        for name, step in (
            ("strip_invisible", n._strip_invisible),
            ("strip_accents", n._strip_accents),
            ("confusables", n._confusables),
            ("traditional_to_simplified", n._traditional_to_simplified),
            ("casefold", n._casefold),
        )
        if getattr(o, name)
    ]
    candidates = {chr(cp) for cp in range(0x80)}
    candidates.update(_invisible_chars())
    candidates.update(charmaps.CONFUSABLE_FROM, charmaps.TRADITIONAL)
    candidates.update(ch for ch in _scanned_chars() if ch.casefold() != ch or unicodedata.combining(ch))
    candidates.update(chr(lo + i) for lo, hi in _COMBINING_RANGES for i in range(hi - lo + 1))
    chars: dict[int, str] = {}
    for ch in candidates:
        value = ch
        for step in per_char:
            value = step(value)
        if value != ch:
            chars[ord(ch)] = value
    chars_lut = np.arange(0x110000, dtype=np.uint32)
    multi = {}
    for cp, value in chars.items():
        if len(value) == 1:
            chars_lut[cp] = ord(value)
        elif not value:
            chars_lut[cp] = _DROP
        else:
            chars_lut[cp] = _MULTI
            multi[chr(cp)] = value
    chars_lut[ord(_JOIN)] = ord(_JOIN)
    ascii_chars = bytes(ord(chars.get(b, chr(b))) if b < 0x80 and len(chars.get(b, "x")) == 1 else b
                        for b in range(256))
    ascii_drop = bytes(b for b in range(0x80) if chars.get(b) == "" and b != ord(_JOIN))

    words: dict[int, str] = {}
    if o.leet:
        words[ord("l")] = "i"
    if o.pinyin:
        words.update(_pinyin_table())
    words_lut = np.full(0x110000, _DROP, dtype=np.uint32)
    kept = _word_code_points()
    words_lut[kept] = kept
    for cp, value in words.items():
        words_lut[cp] = ord(value)
    words_lut[[ord(ch) for ch in PARTICLES]] = _DROP  # separators, though `\w` (and after pinyin)
    words_lut[ord(_JOIN)] = ord(_JOIN)
    kinds_lut = np.zeros(0x110000, dtype=np.uint8)
    kinds_lut[ord("a") : ord("z") + 1] = 1
    kinds_lut[_PINYIN_CODE : _PINYIN_CODE + 0x1000] = 2
    ascii_words = bytes(ord(words.get(b, chr(b))) if b < 0x80 else b for b in range(256))
    ascii_words_drop = bytes(b for b in range(0x80) if words_lut[b] == _DROP and b != ord(_JOIN))
    return _Stages(
        decompose="NFKD" if o.nfkc else "NFD" if o.strip_accents else None,
        chars=chars,
        chars_lut=chars_lut,
        multi=multi,
        ascii_chars=ascii_chars,
        ascii_drop=ascii_drop,
        words=words,
        words_lut=words_lut,
        kinds_lut=kinds_lut,
        ascii_words=ascii_words,
        ascii_words_drop=ascii_words_drop,
    )
