"""Text normalization: undo what spammers and reposters do to a message before it is fingerprinted.

Each step is a named option (see `NormalizeOptions`) so that `neardup explain` can show what every step
did. The order matters and is fixed:

    nfkc → strip_invisible → strip_accents → confusables → traditional_to_simplified → casefold
    → mask_urls → strip_separators → leet → mask_numbers → pinyin

After `strip_separators` the text has no spaces or punctuation at all, so inserting spaces, dots,
emoji or zero-width characters between letters changes nothing; shingles are then taken over the
remaining characters. Placeholders for masked URLs and numbers live in the Supplementary Private
Use Area-B so they can never collide with real text.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from dataclasses import dataclass, fields, replace

from filters import charmaps

# Placeholders are letters of the Mende Kikakui script: word characters (so separator stripping
# keeps them), untouched by NFKC, and never seen in the messages neardup filters.
URL_MARK = "\U0001E800"
EMAIL_MARK = "\U0001E801"
NUMBER_MARK = "\U0001E802"

_TLDS = r"(?:com|net|org|info|biz|co|uk|cn|io|ly|me|us|de|ru|jp|tv)"
# Three cheap patterns instead of one: each starts with something literal or rare, so the regex engine
# skips most positions; the costly ones only run when a quick search says they can match.
_SCHEME_URL = re.compile(r"(?:(?:https?|ftp)://|www\.)\S+", re.IGNORECASE)
_EMAIL = re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+")
_HAS_TLD = re.compile(r"\." + _TLDS + r"\b", re.IGNORECASE)
_BARE_DOMAIN = re.compile(r"\b(?:[a-z0-9-]+\.)+" + _TLDS + r"\b(?:/\S*)?", re.IGNORECASE)
_SEPARATOR = re.compile(r"[\W_]+")
_COMBINING = re.compile(r"[\u0300-\u036f\u1ab0-\u1aff\u1dc0-\u1dff\u20d0-\u20ff\ufe20-\ufe2f]")
# Leetspeak: one or two digits (or @, $) between Latin letters stand for letters.
_LEET_RUN = re.compile(r"(?<=[a-z])[0-9]{1,2}(?=[a-z])")
_LEET_DIGITS = str.maketrans("0123456789", "oizeasgtbg")
# `l`, `1`, `|`, `ı` and friends are one visual class; folding them lets "he11o", "heIIo", "hello" meet.
_DIGIT_RUN = re.compile(r"[0-9]+")
_LATIN_RUN = re.compile(r"[a-z]{1,12}")
_HAN = re.compile(r"[\u3400-\u9fff]")


@functools.cache
def _invisible_pattern() -> re.Pattern[str]:
    """Format (Cf) and control (Cc) characters plus variation selectors: they render as nothing."""
    ranges: list[tuple[int, int]] = []
    for cp in [*range(0x20000), *range(0xE0000, 0xE0200)]:
        if cp in (0x09, 0x0A, 0x0D):
            continue
        ch = chr(cp)
        if unicodedata.category(ch) in ("Cf", "Cc") or 0xFE00 <= cp <= 0xFE0F or 0xE0100 <= cp <= 0xE01EF:
            if ranges and ranges[-1][1] == cp - 1:
                ranges[-1] = (ranges[-1][0], cp)
            else:
                ranges.append((cp, cp))
    body = "".join(
        re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}" for a, b in ranges
    )
    return re.compile(f"[{body}]+")


@dataclass(frozen=True, slots=True)
class NormalizeOptions:
    """Which normalization steps run. The defaults are what `neardup filter` uses."""

    nfkc: bool = True
    strip_invisible: bool = True
    strip_accents: bool = True
    confusables: bool = True
    traditional_to_simplified: bool = True
    casefold: bool = True
    mask_urls: bool = True
    strip_separators: bool = True
    leet: bool = True
    mask_numbers: bool = True
    pinyin: bool = True

    @classmethod
    def step_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def with_steps(self, **changes: bool) -> NormalizeOptions:
        return replace(self, **changes)


class Normalizer:
    """Applies the enabled steps of `NormalizeOptions`; pure and deterministic."""

    def __init__(self, options: NormalizeOptions | None = None) -> None:
        self.options = options or NormalizeOptions()
        self._invisible = _invisible_pattern()
        self._tab_confusables, self._tab_t2s, self._tab_pinyin, self._syllable_code = _translation_tables()
        self._max_syllable = max(len(s) for s in charmaps.PINYIN_SYLLABLES)
        order = NormalizeOptions.step_names()
        self._steps = [(name, getattr(self, f"_{name}")) for name in order if getattr(self.options, name)]
        self._fast = [step for _, step in self._steps]
        if self.options.confusables and self.options.traditional_to_simplified:
            # Adjacent table lookups fuse into one pass over the text; `trace` still shows both.
            self._tab_fused = {**self._tab_confusables, **self._tab_t2s}
            at = self._fast.index(self._confusables)
            self._fast[at : at + 2] = [self._confusables_and_t2s]

    def __call__(self, text: str) -> str:
        for step in self._fast:
            text = step(text)
        return text

    def _confusables_and_t2s(self, text: str) -> str:
        return text if text.isascii() else text.translate(self._tab_fused)

    def trace(self, text: str) -> list[tuple[str, str]]:
        """The text after each enabled step, for `neardup explain`."""
        out = []
        for name, step in self._steps:
            text = step(text)
            out.append((name, text))
        return out

    # -- steps -----------------------------------------------------------------------------
    @staticmethod
    def _nfkc(text: str) -> str:
        return text if text.isascii() else unicodedata.normalize("NFKC", text)

    def _strip_invisible(self, text: str) -> str:
        # ASCII control characters are separators, which a later step removes anyway.
        return text if text.isascii() else self._invisible.sub("", text)

    def _confusables(self, text: str) -> str:
        return text if text.isascii() else text.translate(self._tab_confusables)

    @staticmethod
    def _casefold(text: str) -> str:
        return text.lower() if text.isascii() else text.casefold()

    @staticmethod
    def _strip_accents(text: str) -> str:
        if text.isascii():
            return text
        return _COMBINING.sub("", unicodedata.normalize("NFD", text))

    def _traditional_to_simplified(self, text: str) -> str:
        return text if text.isascii() else text.translate(self._tab_t2s)

    @staticmethod
    def _mask_urls(text: str) -> str:
        if "/" in text or "www" in text or "WWW" in text:
            text = _SCHEME_URL.sub(f" {URL_MARK} ", text)
        if "@" in text:
            text = _EMAIL.sub(f" {EMAIL_MARK} ", text)
        if "." in text and _HAS_TLD.search(text):
            text = _BARE_DOMAIN.sub(f" {URL_MARK} ", text)
        return text

    @staticmethod
    def _strip_separators(text: str) -> str:
        return _SEPARATOR.sub("", text)

    @staticmethod
    def _leet(text: str) -> str:
        if _DIGIT_RUN.search(text):
            text = _LEET_RUN.sub(lambda m: m.group().translate(_LEET_DIGITS), text)
        return text.replace("l", "i")

    @staticmethod
    def _mask_numbers(text: str) -> str:
        return _DIGIT_RUN.sub(NUMBER_MARK, text)

    def _pinyin(self, text: str) -> str:
        if text.isascii() or not _HAN.search(text):
            return text
        coded = text.translate(self._tab_pinyin)
        # Latin letters that stand between Han characters are pinyin substitutions ("转fa微博").
        return _LATIN_RUN.sub(self._pinyin_run, coded) if _LATIN_RUN.search(coded) else coded

    def _pinyin_run(self, m: re.Match[str]) -> str:
        s, start, end = m.string, m.start(), m.end()
        before = s[start - 1] if start else ""
        after = s[end] if end < len(s) else ""
        if not (_is_syllable_code(before) or _is_syllable_code(after)):
            return m.group()
        return self._segment_pinyin(m.group()) or m.group()

    def _segment_pinyin(self, run: str) -> str | None:
        """Split a Latin run into pinyin syllables (longest match first); None if it is not pinyin."""
        out = []
        i = 0
        while i < len(run):
            for size in range(min(self._max_syllable, len(run) - i), 0, -1):
                code = self._syllable_code.get(run[i : i + size])
                if code is not None:
                    out.append(code)
                    i += size
                    break
            else:
                return None
        return "".join(out)


@functools.cache
def _translation_tables() -> tuple[dict[int, str], dict[int, int], dict[int, str], dict[str, str]]:
    """Built once per process from the constant tables in `filters.charmaps` (they never change)."""
    confusables = str.maketrans(charmaps.CONFUSABLE_FROM, charmaps.CONFUSABLE_TO)
    t2s = str.maketrans(charmaps.TRADITIONAL, charmaps.SIMPLIFIED)
    base = charmaps.PINYIN_BASE
    pinyin = {base + i: c for i, c in enumerate(charmaps.PINYIN_CODES) if c != "\x00"}
    syllables = {syl: chr(0xF0000 + i) for i, syl in enumerate(charmaps.PINYIN_SYLLABLES)}
    return confusables, t2s, pinyin, syllables


def _is_syllable_code(ch: str) -> bool:
    return bool(ch) and 0xF0000 <= ord(ch) < 0xF1000
