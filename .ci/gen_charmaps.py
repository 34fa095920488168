"""Generate filters/charmaps.py from installed data packages.

Usage: python .ci/gen_charmaps.py > filters/charmaps.py

Needs: opencc-python-reimplemented, pypinyin, confusable-homoglyphs (pip install them).
The output is deterministic for a given set of package versions and Python ``unicodedata``
version (both are recorded in the generated header).
"""

from __future__ import annotations

import base64
import importlib.metadata
import json
import re
import sys
import unicodedata
from pathlib import Path

import confusable_homoglyphs
import opencc
from pypinyin import Style, lazy_pinyin
from pypinyin.contrib.tone_convert import to_normal
from pypinyin.pinyin_dict import pinyin_dict

PINYIN_BASE = 0x3400
PINYIN_LAST = 0x9FFF
PUA_BASE = 0xF0000
NO_READING = "\x00"
WIDTH = 100  # target source-line width (ruff line-length is 110)

# Ranges treated as CJK (never confusable sources): Han ideographs, radicals, CJK symbols,
# kana, bopomofo, hangul, enclosed/compatibility CJK, CJK compatibility forms.
CJK_RANGES = (
    (0x1100, 0x11FF),  # Hangul Jamo
    (0x2E80, 0x2FDF),  # CJK Radicals Supplement, Kangxi Radicals
    (0x2FF0, 0x2FFF),  # Ideographic Description Characters
    (0x3000, 0x33FF),  # CJK Symbols/Punct., Kana, Bopomofo, Hangul Compat. Jamo, Kanbun, enclosed
    (0x3400, 0x4DBF),  # CJK Ext. A
    (0x4E00, 0x9FFF),  # CJK Unified Ideographs
    (0xA960, 0xA97F),  # Hangul Jamo Extended-A
    (0xAC00, 0xD7FF),  # Hangul Syllables, Jamo Extended-B
    (0xF900, 0xFAFF),  # CJK Compatibility Ideographs
    (0xFE30, 0xFE4F),  # CJK Compatibility Forms
    (0xFF00, 0xFFEF),  # Halfwidth and Fullwidth Forms
    (0x1B000, 0x1B16F),  # Kana Supplement / Extended
    (0x20000, 0x3FFFF),  # SIP / TIP (Han ext. B..)
)


def is_cjk(ch: str) -> bool:
    cp = ord(ch)
    return any(lo <= cp <= hi for lo, hi in CJK_RANGES)


def version(dist: str) -> str:
    return importlib.metadata.version(dist)


# ----------------------------------------------------------------------------- OpenCC


def traditional_to_simplified() -> list[tuple[str, str]]:
    path = Path(opencc.__file__).parent / "dictionary" / "TSCharacters.txt"
    pairs: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        trad, cands = line.split("\t", 1)
        simp = cands.split()[0]
        if len(trad) == 1 and len(simp) == 1 and trad != simp:
            if trad in pairs:
                raise SystemExit(f"duplicate TSCharacters key {trad!r}")
            pairs[trad] = simp
    # Resolve chains (A->B and B->C becomes A->C) so that translating twice equals translating once.
    for trad, simp in pairs.items():
        seen = {trad}
        while simp in pairs and simp not in seen:
            seen.add(simp)
            simp = pairs[simp]
        pairs[trad] = simp
    return sorted((t, s) for t, s in pairs.items() if t != s)


# ----------------------------------------------------------------------------- pinyin


def pinyin_tables() -> tuple[list[str], list[str], str]:
    readings = {cp: [to_normal(r) for r in v.split(",")] for cp, v in pinyin_dict.items()}
    syllables = sorted({s for rs in readings.values() for s in rs})
    index = {s: i for i, s in enumerate(syllables)}
    initials = []
    for s in syllables:
        initials.append(s[:2] if s[:2] in ("zh", "ch", "sh") else s[0])
    codes = []
    for cp in range(PINYIN_BASE, PINYIN_LAST + 1):
        rs = readings.get(cp)
        codes.append(chr(PUA_BASE + index[rs[0]]) if rs else NO_READING)
    codes_s = "".join(codes)
    # Cross-check against pypinyin's public API (NORMAL style, no heteronyms).
    for cp in range(PINYIN_BASE, PINYIN_LAST + 1):
        ch = chr(cp)
        got = lazy_pinyin(ch, style=Style.NORMAL, errors=lambda _: [""])[0]
        mine = codes_s[cp - PINYIN_BASE]
        want = syllables[ord(mine) - PUA_BASE] if mine != NO_READING else ""
        if got != want:
            raise SystemExit(f"pinyin mismatch for U+{cp:04X}: lazy_pinyin={got!r} table={want!r}")
    return syllables, initials, codes_s


def encode_codes(codes: str, n_syllables: int) -> str:
    """Encode as base64 of UTF-16-LE where index i is stored as chr(i + 1) and "no reading" as \\x00."""
    assert n_syllables + 1 < 0xD800
    small = "".join("\x00" if c == NO_READING else chr(ord(c) - PUA_BASE + 1) for c in codes)
    return base64.b64encode(small.encode("utf-16-le")).decode("ascii")


# ----------------------------------------------------------------------------- confusables


def _strip_marks(s: str) -> str:
    # The package keeps the LRM/RLM marks that confusables.txt puts around RTL text.
    return s.replace("\u200e", "").replace("\u200f", "")


def _ascii_target(t: str, marks: bool = False) -> str | None:
    t = unicodedata.normalize("NFKC", t).casefold()
    if marks:  # "n̩" for η, "d̔" for ɗ: the letter under the marks
        t = "".join(c for c in unicodedata.normalize("NFD", t) if not unicodedata.combining(c))
    if len(t) == 1 and t.isascii() and t.isalnum():
        return t
    return None


# Latin letters confusables.txt leaves out that spammers use for the plain letter: small capitals (ꜰʀᴇᴇ)
# and letters with a stroke, hook, bar ... that have no decomposition (ɗ, ƈ, ł, ø, ħ, ƙ).
_LATIN_LOOKALIKE_NAMES = (
    re.compile(r"LATIN (?:SMALL|CAPITAL) LETTER ([A-Z]) WITH (?!.*\bAND\b)"),
    re.compile(r"LATIN LETTER SMALL CAPITAL ([A-Z])$"),
)


def _borrowed_letter(ch: str) -> bool:
    name = unicodedata.name(ch, "")
    return unicodedata.category(ch).startswith("L") and name.startswith(
        ("LATIN ", "GREEK ", "CYRILLIC ", "ARMENIAN ", "CHEROKEE ", "COPTIC ")
    )


def _accented_ascii(ch: str) -> bool:
    """strip_accents already makes it ASCII (À, ç)."""
    return "".join(c for c in unicodedata.normalize("NFKD", ch) if not unicodedata.combining(c)).isascii()


def _named_target(ch: str) -> str | None:
    name = unicodedata.name(ch, "")
    for pattern in _LATIN_LOOKALIKE_NAMES:
        m = pattern.match(name)
        if m:
            return m.group(1).lower()
    return None


def _excluded_source(ch: str, target: str) -> str | None:
    if ch.isascii():
        return "ascii"
    if is_cjk(ch):
        return "cjk"
    if unicodedata.normalize("NFKC", ch).isascii():
        return "nfkc-ascii"  # NFKC (full-width, math alphanumerics, ...) already handles it
    dec = unicodedata.decimal(ch, None)
    if dec is not None and str(dec) != target:
        return "digit"  # a digit of another script: remapping would change its value
    return None


def confusables() -> tuple[list[tuple[str, str]], dict[str, int]]:
    path = Path(confusable_homoglyphs.__file__).parent / "confusables.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    direct: dict[str, set[str]] = {}
    for marks in (False, True):
        # A target under marks only for a small letter of the scripts spammers borrow from that has no
        # plain one and that strip_accents leaves alone: η (n̩) → n, ɗ (d̔) → d. Capitals keep their
        # case class's (Б as б), like Η → h: the capital is the look-alike of another letter.
        for key, entries in data.items():
            src = _strip_marks(key)
            if len(src) != 1:
                continue
            if marks and (src in direct or src.casefold() != src or not _borrowed_letter(src)
                          or _accented_ascii(src)):
                continue
            for e in entries:
                t = _ascii_target(_strip_marks(e["c"]), marks)
                if t is not None:
                    direct.setdefault(src, set()).add(t)
    named = 0
    for cp in range(0x20000):
        ch = chr(cp)
        t = _named_target(ch)
        # Not where the lower case has a target already: Ʋ follows ʋ (→ u) like Б follows б.
        if t is not None and ch not in direct and ch.casefold() not in direct and not _accented_ascii(ch):
            direct[ch] = {t}
            named += 1
    # The table runs before case folding, so a character without a target of its own takes the target of
    # its case class (the characters with the same one-character casefold: Г/г, Σ/σ/ς, В/в), or 'ГОРОД'
    # and 'город' would normalize differently: the folded (lower-case) form's target, else the one
    # target its members agree on. A character with its own target keeps it: capital Υ looks like Y
    # and small υ like u, and the capitals are what spammers put in Latin words.
    classes: dict[str, set[str]] = {}
    for cp in range(0x110000):
        ch = chr(cp)
        folded = ch.casefold()
        if len(folded) == 1 and folded != ch and not (0xD800 <= cp <= 0xDFFF):
            if folded.casefold() != folded:
                raise SystemExit(f"casefold is not idempotent for U+{cp:04X}")
            classes.setdefault(folded, {folded}).add(ch)
    resolved = dict(direct)
    for folded, members in classes.items():
        targets = direct.get(folded) or set().union(*(direct.get(m, set()) for m in members))
        for m in members:
            if m not in direct and targets:
                resolved[m] = targets
    derived = {src: ts for src, ts in resolved.items() if src not in direct or direct[src] != ts}
    stats = {"ambiguous": 0, "ascii": 0, "cjk": 0, "nfkc-ascii": 0, "digit": 0}
    table: dict[str, str] = {}
    for src, ts in resolved.items():
        if len(ts) != 1:
            stats["ambiguous"] += 1
            continue
        (t,) = ts
        why = _excluded_source(src, t)
        if why:
            stats[why] += 1
            continue
        table[src] = t
    stats["direct"] = sum(1 for s in table if s in direct)
    stats["derived"] = sum(1 for s in table if s in derived)
    stats["named"] = named
    return sorted(table.items(), key=lambda kv: (kv[1], ord(kv[0]))), stats


# ----------------------------------------------------------------------------- before NFKC

# Emoji (Emoji=Yes in emoji-data.txt) that NFKC turns into letters: 🈶 → 有, 🉐 → 得, ㊙ → 秘, ℹ → i, Ⓜ → M.
# Inserted into a word they are decoration like any other emoji, not a syllable or a letter.
LETTER_EMOJI = (0x2139, 0x24C2, 0x3297, 0x3299, 0x1F201, 0x1F202, 0x1F21A, 0x1F22F,
                *range(0x1F232, 0x1F23B), 0x1F250, 0x1F251)
EMOJI_MARK_BASE = 0xF1000  # placeholders: private use (so separators), after the pinyin codes


def before_nfkc(conf: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Characters NFKC would turn into something that no longer looks like them: look-alikes whose NFKC
    form has another target (lunate sigma ϲ looks like c, its NFKC form ς does not) become a look-alike
    of theirs that NFKC keeps (ƈ); letter emoji become placeholders of their own."""
    table = dict(conf)
    stable: dict[str, str] = {}
    for src, t in conf:
        if unicodedata.normalize("NFKC", src) == src and src.casefold() == src and src.isalpha():
            stable.setdefault(t, src)
    pairs = []
    for src, t in conf:
        folded = unicodedata.normalize("NFKC", src)
        if folded != src and len(folded) == 1 and table.get(folded, table.get(folded.casefold())) != t:
            pairs.append((src, stable[t]))
    for i, cp in enumerate(LETTER_EMOJI):
        assert unicodedata.normalize("NFKC", chr(cp)) != chr(cp)
        pairs.append((chr(cp), chr(EMOJI_MARK_BASE + i)))
    return sorted(pairs)


# ----------------------------------------------------------------------------- emit


def _safe_raw(ch: str) -> bool:
    """Characters that can appear unescaped in the source: printable, left-to-right letters."""
    return unicodedata.category(ch).startswith("L") and unicodedata.bidirectional(ch) == "L"


def _lit(chars: str, escape_all: bool = False) -> str:
    out = []
    for ch in chars:
        if ch.isascii() and ch.isprintable() and ch not in "\\\"'":
            out.append(ch)
        elif not escape_all and _safe_raw(ch):
            out.append(ch)
        elif ord(ch) <= 0xFFFF:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    return '"' + "".join(out) + '"'


def _width(s: str) -> int:
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in s)


def _chunks(items: list[str], width: int) -> list[list[str]]:
    """Split items (already-escaped tokens) into runs whose rendered width stays under width."""
    runs: list[list[str]] = [[]]
    w = 0
    for tok in items:
        tw = _width(tok)
        if runs[-1] and w + tw > width:
            runs.append([])
            w = 0
        runs[-1].append(tok)
        w += tw
    return runs


def emit_parallel(names: tuple[str, str], pairs: list[tuple[str, str]], per_line: int,
                  escape_all: bool = False) -> list[str]:
    a_lines, b_lines = [f"{names[0]}: str = ("], [f"{names[1]}: str = ("]
    for i in range(0, len(pairs), per_line):
        part = pairs[i : i + per_line]
        a_lines.append(f"    {_lit(''.join(p[0] for p in part), escape_all)}")
        b_lines.append(f"    {_lit(''.join(p[1] for p in part), escape_all)}")
    return [*a_lines, ")", "", *b_lines, ")"]


def emit_confusables(pairs: list[tuple[str, str]]) -> list[str]:
    by_target: dict[str, list[str]] = {}
    for src, t in pairs:
        by_target.setdefault(t, []).append(src)
    from_lines, to_lines = ["CONFUSABLE_FROM: str = ("], ["CONFUSABLE_TO: str = ("]
    for t in sorted(by_target):
        toks = [_lit(s, escape_all=True)[1:-1] for s in by_target[t]]
        for run in _chunks(toks, WIDTH - 16):
            from_lines.append(f'    "{"".join(run)}"  # -> {t}')
            to_lines.append(f'    "{t * len(run)}"')
    return [*from_lines, ")", "", *to_lines, ")"]


def emit_tuple(name: str, items: list[str]) -> list[str]:
    toks = [_lit(s) + "," for s in items]
    lines = [f"{name}: tuple[str, ...] = ("]
    for run in _chunks([t + " " for t in toks], WIDTH - 4):
        lines.append("    " + "".join(run).rstrip())
    lines.append(")")
    return lines


def main() -> None:
    ts = traditional_to_simplified()
    syllables, initials, codes = pinyin_tables()
    conf, stats = confusables()
    pre = before_nfkc(conf)
    b64 = encode_codes(codes, len(syllables))
    n_read = sum(1 for c in codes if c != NO_READING)

    out: list[str] = [
        '"""Generated character tables for normalization: traditional->simplified Han, Han->pinyin '
        'syllable codes, confusable->ASCII. Do not edit; regenerate with .ci/gen_charmaps.py."""',
        "# ruff: noqa: E501",
        "# fmt: off",
        "",
        "# Sources and licenses:",
        "#   OpenCC TSCharacters.txt (via opencc-python-reimplemented "
        f"{version('opencc-python-reimplemented')}): Apache-2.0",
        f"#   pypinyin {version('pypinyin')} pinyin_dict (pinyin-data): MIT",
        f"#   Unicode confusables.txt (via confusable-homoglyphs {version('confusable-homoglyphs')}):"
        " Unicode License",
        f"# NFKC/casefold from Python unicodedata {unicodedata.unidata_version}.",
        "",
        "from binascii import a2b_base64 as _a2b_base64",
        "",
        f"# Traditional -> simplified, char level, first OpenCC candidate: {len(ts)} entries",
        "# (chains such as A->B, B->C are resolved to A->C so translation is idempotent).",
        "# Use: str.maketrans(TRADITIONAL, SIMPLIFIED).",
        *emit_parallel(("TRADITIONAL", "SIMPLIFIED"), ts, 40),
        "",
        f"# {len(syllables)} toneless pinyin syllables (u-umlaut written as v), sorted.",
        *emit_tuple("PINYIN_SYLLABLES", syllables),
        "",
        "# Initial of each PINYIN_SYLLABLES entry (zh/ch/sh, a consonant, or the first letter).",
        *emit_tuple("PINYIN_INITIALS", initials),
        "",
        f"PINYIN_BASE: int = 0x{PINYIN_BASE:04X}",
        "# PINYIN_CODES[cp - PINYIN_BASE] for cp in PINYIN_BASE..U+9FFF is chr(0xF0000 + i), i the index in",
        "# PINYIN_SYLLABLES of the character's first (most common) pypinyin reading, or '\\x00' if it has",
        f"# none ({n_read} of {len(codes)} code points have a reading). Stored as base64 of UTF-16-LE",
        "# with index i encoded as chr(i + 1).",
        "_PINYIN_CODES_B64 = (",
    ]
    for i in range(0, len(b64), WIDTH - 4):
        out.append(f'    "{b64[i : i + WIDTH - 4]}"')
    out += [
        ")",
        "PINYIN_CODES: str = (",
        '    _a2b_base64(_PINYIN_CODES_B64).decode("utf-16-le")',
        "    .translate({i + 1: 0xF0000 + i for i in range(len(PINYIN_SYLLABLES))})",
        ")",
        "del _PINYIN_CODES_B64, _a2b_base64",
        "",
        f"# Confusable -> ASCII lower-case letter/digit: {len(conf)} entries "
        f"({stats['direct']} from confusables.txt, {stats['derived']} from their case class).",
        "# Never maps ASCII, CJK, characters NFKC already folds to ASCII, or other-script digits.",
        "# A character with no target of its own has its case class's (Г as г), so case changes of",
        "# homoglyph text give the same result; one with its own keeps it (Υ → y, υ → u).",
        "# Use: str.maketrans(CONFUSABLE_FROM, CONFUSABLE_TO).",
        *emit_confusables(conf),
        "",
        f"# Applied before NFKC: {len(pre)} characters NFKC would make something they do not look like. A",
        "# look-alike whose NFKC form has another target becomes one NFKC keeps (lunate sigma ϲ: NFKC gives ς,",
        "# whose case class is σ → o; it becomes ƈ → c). Emoji that NFKC turns into letters (🈶 → 有,",
        "# ℹ → i) become placeholders of their own in the Supplementary Private Use Area-A: separators.",
        "# Use: str.maketrans(BEFORE_NFKC_FROM, BEFORE_NFKC_TO).",
        *emit_parallel(("BEFORE_NFKC_FROM", "BEFORE_NFKC_TO"), pre, 8, escape_all=True),
        "",
    ]
    text = "\n".join(out)
    sys.stdout.buffer.write(text.encode("utf-8"))
    print(f"confusables stats: {stats}", file=sys.stderr)


if __name__ == "__main__":
    main()
