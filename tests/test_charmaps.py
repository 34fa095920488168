"""Sanity checks for the generated tables in filters/charmaps.py (see .ci/gen_charmaps.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from filters import charmaps

REPO = Path(__file__).resolve().parents[1]
T2S = str.maketrans(charmaps.TRADITIONAL, charmaps.SIMPLIFIED)
CONFUSABLES = str.maketrans(charmaps.CONFUSABLE_FROM, charmaps.CONFUSABLE_TO)
PUA_A = 0xF0000


def pinyin_code(ch: str) -> str:
    return charmaps.PINYIN_CODES[ord(ch) - charmaps.PINYIN_BASE]


def syllable(ch: str) -> str:
    return charmaps.PINYIN_SYLLABLES[ord(pinyin_code(ch)) - PUA_A]


def is_cjk(ch: str) -> bool:
    cp = ord(ch)
    return (
        0x2E80 <= cp <= 0x33FF  # radicals, CJK symbols, kana, bopomofo, enclosed CJK
        or 0x3400 <= cp <= 0x9FFF  # unified ideographs + ext. A
        or 0xF900 <= cp <= 0xFAFF  # compatibility ideographs
        or 0xFF00 <= cp <= 0xFFEF  # half/full-width forms
        or 0x20000 <= cp <= 0x3FFFF  # ext. B and later
    )


# -- traditional -> simplified ------------------------------------------------------------


def test_t2s_lengths_and_shape() -> None:
    assert len(charmaps.TRADITIONAL) == len(charmaps.SIMPLIFIED) > 4000
    assert len(set(charmaps.TRADITIONAL)) == len(charmaps.TRADITIONAL)
    assert all(t != s for t, s in zip(charmaps.TRADITIONAL, charmaps.SIMPLIFIED, strict=True))


@pytest.mark.parametrize(
    ("trad", "simp"), [("書", "书"), ("媽", "妈"), ("東", "东"), ("後", "后"), ("國", "国")]
)
def test_t2s_examples(trad: str, simp: str) -> None:
    assert trad.translate(T2S) == simp


def test_t2s_leaves_simplified_and_ascii_alone() -> None:
    text = "书妈东后国 我们的中文 hello 123"
    assert text.translate(T2S) == text


def test_t2s_is_idempotent() -> None:
    once = charmaps.TRADITIONAL.translate(T2S)
    assert once.translate(T2S) == once


# -- pinyin -------------------------------------------------------------------------------


def test_pinyin_shapes() -> None:
    syl = charmaps.PINYIN_SYLLABLES
    assert list(syl) == sorted(set(syl))
    assert len(charmaps.PINYIN_INITIALS) == len(syl)
    assert charmaps.PINYIN_BASE == 0x3400
    assert len(charmaps.PINYIN_CODES) == 0x9FFF - 0x3400 + 1
    assert "lv" in syl and "zhuang" in syl and "a" in syl
    assert not any(ch in s for s in syl for ch in "üāáǎàēéěè")


def test_pinyin_initials() -> None:
    initial = dict(zip(charmaps.PINYIN_SYLLABLES, charmaps.PINYIN_INITIALS, strict=True))
    assert initial["zhong"] == "zh"
    assert initial["chi"] == "ch"
    assert initial["shi"] == "sh"
    assert initial["han"] == "h"
    assert initial["an"] == "a"
    assert initial["er"] == "e"
    for s, i in initial.items():
        assert s.startswith(i) and len(i) in (1, 2)


def test_every_code_is_a_syllable_or_none() -> None:
    n = len(charmaps.PINYIN_SYLLABLES)
    for c in charmaps.PINYIN_CODES:
        assert c == "\x00" or 0 <= ord(c) - PUA_A < n


def test_pinyin_examples() -> None:
    assert syllable("汉") == "han"
    assert syllable("中") == "zhong"
    assert syllable("绿") == "lv"
    assert pinyin_code("喊") == pinyin_code("汉")
    assert pinyin_code("吃") != pinyin_code("是")
    assert pinyin_code("妈") == pinyin_code("媽".translate(T2S))
    assert pinyin_code("\u4dc0") == "\x00"  # hexagram symbol: no reading


# -- confusables --------------------------------------------------------------------------


def test_confusable_lengths_and_targets() -> None:
    frm, to = charmaps.CONFUSABLE_FROM, charmaps.CONFUSABLE_TO
    assert len(frm) == len(to) > 300
    assert len(set(frm)) == len(frm)
    assert set(to) <= set("abcdefghijklmnopqrstuvwxyz0123456789")


def test_confusable_examples() -> None:
    assert "раураl".translate(CONFUSABLES) == "paypal"  # Cyrillic р а у р а + ASCII l
    assert "ο".translate(CONFUSABLES) == "o"  # Greek omicron
    assert "ΡΑΥΡΑL".translate(CONFUSABLES) == "paypaL"  # Greek capitals; ASCII L untouched
    assert "аеорсухіјѕԁԛԝкмнтв".translate(CONFUSABLES) == "aeopcyxijsdqwkmhtb"
    assert "ναιιρτυχ".translate(CONFUSABLES) == "vaiiptux"


def test_confusables_never_remap_ascii_or_cjk() -> None:
    for ch in charmaps.CONFUSABLE_FROM:
        assert not ch.isascii(), repr(ch)
        assert not is_cjk(ch), repr(ch)
        assert not unicodedata.normalize("NFKC", ch).isascii(), repr(ch)  # NFKC's job already


def test_every_case_variant_of_a_homoglyph_is_mapped() -> None:
    # The table runs before casefold: a capital whose lower case is a homoglyph must be mapped too.
    frm = set(charmaps.CONFUSABLE_FROM)
    missing = [
        ch for ch in map(chr, range(0x20000))
        if ch not in frm and len(ch.casefold()) == 1 and ch.casefold() in frm
    ]
    assert missing == []
    for upper, lower in [("Г", "г"), ("Б", "б"), ("Σ", "σ"), ("ς", "σ"), ("В", "в"), ("Н", "н")]:
        assert upper.translate(CONFUSABLES) == lower.translate(CONFUSABLES) != lower, (upper, lower)
    assert "Υ".translate(CONFUSABLES) == "y" and "υ".translate(CONFUSABLES) == "u"  # each keeps its own


def test_confusables_are_idempotent() -> None:
    assert not set(charmaps.CONFUSABLE_TO) & set(charmaps.CONFUSABLE_FROM)


# -- module hygiene -----------------------------------------------------------------------


def test_import_is_fast() -> None:
    code = "import time; t = time.perf_counter(); import filters.charmaps; print(time.perf_counter() - t)"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1"}
    best = min(
        float(
            subprocess.run(
                [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True
            ).stdout
        )
        for _ in range(3)
    )
    assert best < 0.1, f"import took {best * 1000:.1f} ms"


def test_only_constants() -> None:
    public = {k: v for k, v in vars(charmaps).items() if not k.startswith("_")}
    assert public.keys() >= {
        "TRADITIONAL",
        "SIMPLIFIED",
        "PINYIN_SYLLABLES",
        "PINYIN_INITIALS",
        "PINYIN_BASE",
        "PINYIN_CODES",
        "CONFUSABLE_FROM",
        "CONFUSABLE_TO",
    }
    for name, value in public.items():
        if name.isupper():
            assert isinstance(value, str | int | tuple), name


# -- before NFKC ------------------------------------------------------------------------------


def test_before_nfkc_table() -> None:
    frm, to = charmaps.BEFORE_NFKC_FROM, charmaps.BEFORE_NFKC_TO
    assert len(frm) == len(to) == len(set(frm))
    for src, dst in zip(frm, to, strict=True):
        assert unicodedata.normalize("NFKC", src) != src, repr(src)  # only what NFKC would change
        assert unicodedata.normalize("NFKC", dst) == dst, repr(dst)  # into what it keeps
    keep = str.maketrans(frm, to)
    assert "ϲϹ".translate(keep).translate(CONFUSABLES) == "cc"  # lunate sigma stays a c look-alike
    assert all(0xF1000 <= ord(dst) < 0xF2000 for src, dst in zip(frm, to, strict=True) if ord(src) > 0x2000)


def test_confusables_beyond_confusables_txt() -> None:
    assert "ηɗƈꜰʀᴇᴇłøđħ".translate(CONFUSABLES) == "ndcfreelodh"
    assert "Η".translate(CONFUSABLES) == "h"  # the capital looks like H
