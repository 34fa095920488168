# The compiled per-character stages of normalization (included by filters/_native.pyx), as the reference
# `Normalizer.normalize_batch` in filters/normalize.py computes them with numpy lookup tables: stage 1
# (every per-character step up to casefold) and stage 3 (separators out, l → i, Han → pinyin codes, the
# texts whose Latin letters touch a pinyin code), and the places where the `_SPACED` pattern matches.
#
# Why: the reference builds its tables for all 1.1M code points when the first Normalizer is made
# (≈ 0.3 s of every process's start) and runs each stage as several numpy passes with UTF-32 copies.
# Here stage 1 asks the reference's own per-character function (`normalize._stage1`) once per code point
# met and remembers the answer in pages of 256; stage 3 needs no table: `\w` is `Py_UNICODE_ISALNUM`
# (what the `re` module tests), and the pinyin codes come from `charmaps.PINYIN_CODES`.

cdef extern from "Python.h":
    int PyUnicode_KIND(object o)
    void *PyUnicode_DATA(object o)
    Py_ssize_t PyUnicode_GET_LENGTH(object o)
    uint32_t PyUnicode_READ(int kind, void *data, Py_ssize_t index) nogil
    object PyUnicode_FromKindAndData(int kind, const void *buffer, Py_ssize_t size)
    object PyUnicode_New(Py_ssize_t size, uint32_t maxchar)
    bint Py_UNICODE_ISALNUM(uint32_t ch) nogil
    bint Py_UNICODE_ISSPACE(uint32_t ch) nogil

from libc.stdint cimport int32_t, uint16_t
from cython.operator cimport dereference as deref
from libcpp.algorithm cimport lower_bound
from libcpp.vector cimport vector

cdef uint32_t NORM_JOIN = 0x1E  # normalize._JOIN: ends a text of the joined batch, kept by every stage
cdef uint32_t NORM_PINYIN_CODE = 0xF0000  # normalize._PINYIN_CODE
cdef int32_t STAGE_UNKNOWN = -1  # not asked yet
cdef int32_t STAGE_DROP = -2  # deleted; -3 - i: several characters, multi[i]
cdef Py_ssize_t STAGE_PAGES = 0x110000 >> 8

ctypedef fused ucs_t:  # the three widths of a str's characters (PEP 393)
    uint8_t
    uint16_t
    uint32_t


cdef object ucs4_str(vector[uint32_t] &buf, Py_ssize_t start, Py_ssize_t end, uint32_t bits):
    """The str of the code points buf[start:end], `bits` the OR of them all: that has the same highest bit as
    their largest, so it says the str's width (1, 2 or 4 bytes: the bounds are powers of two) and the str is
    made at that width without a pass to find the largest (`PyUnicode_FromKindAndData(4, ...)` makes one)."""
    cdef Py_ssize_t i, n = end - start
    cdef const uint32_t *src
    cdef uint8_t *narrow
    cdef uint16_t *half
    if n <= 0:
        return ""
    src = &buf[start]
    if bits < 0x100:
        s = PyUnicode_New(n, 0x7F if bits < 0x80 else 0xFF)
        narrow = <uint8_t *>PyUnicode_DATA(s)
        for i in range(n):
            narrow[i] = <uint8_t>src[i]
    elif bits < 0x10000:
        s = PyUnicode_New(n, 0xFFFF)
        half = <uint16_t *>PyUnicode_DATA(s)
        for i in range(n):
            half[i] = <uint16_t>src[i]
    else:
        s = PyUnicode_New(n, 0x10FFFF)
        memcpy(PyUnicode_DATA(s), src, n * sizeof(uint32_t))
    return s


cdef class NormalizeStages:
    """Stages 1 and 3 of one `NormalizeOptions` (`normalize._Stages` without its tables)."""

    cdef int32_t *pages[0x1100]
    cdef uint8_t *word_pages[0x1100]  # 1 where `\w` matches, 2 where not, 0 not asked yet
    cdef vector[uint32_t] before_from, before_to  # charmaps.BEFORE_NFKC_FROM/TO, sorted by the first
    cdef uint8_t before_pages[0x1100]  # 1 for each page of 256 code points holding one of before_from
    cdef uint8_t ascii_words[0x80]  # stage 3 of an ASCII character: itself, i for l (leet), 0 for a separator
    # The stages' output, kept from batch to batch: a new one each time (a batch is ≈ 0.5-2 MB of code points)
    # was mapped, faulted in page by page and unmapped again. `lent` while a stage writes to it: a stage
    # called meanwhile (from `stage1`, which is Python) writes to one of its own.
    cdef vector[uint32_t] buffer
    cdef bint lent
    cdef object stage1  # cp → its stage-1 string (normalize._stage1 for these options)
    cdef list multi
    cdef bint leet, pinyin
    cdef vector[uint32_t] pinyin_codes  # charmaps.PINYIN_CODES as code points, 0 where none
    cdef uint32_t pinyin_base

    def __init__(self, stage1, bint leet, bint pinyin, str pinyin_codes, int pinyin_base, dict before_nfkc):
        self.stage1 = stage1
        self.multi = []
        self.leet = leet
        self.pinyin = pinyin
        self.pinyin_base = pinyin_base
        cdef int c
        for c in range(0x80):  # [a-zA-Z0-9] are \w among ASCII characters, and `_` is a separator here
            if 0x61 <= c <= 0x7A or 0x30 <= c <= 0x39 or 0x41 <= c <= 0x5A:
                self.ascii_words[c] = 0x69 if c == 0x6C and leet else c
        for ch in pinyin_codes:
            self.pinyin_codes.push_back(ord(ch))
        for ch in sorted(before_nfkc):
            self.before_from.push_back(ord(ch))
            self.before_to.push_back(ord(before_nfkc[ch]))
            self.before_pages[ord(ch) >> 8] = 1

    def __dealloc__(self):
        cdef Py_ssize_t i
        for i in range(STAGE_PAGES):
            if self.pages[i] != NULL:
                PyMem_Free(self.pages[i])
            if self.word_pages[i] != NULL:
                PyMem_Free(self.word_pages[i])

    cdef inline bint is_word(self, uint32_t cp) except -1:
        """`\w` as the `re` module matches it (`Py_UNICODE_ISALNUM`, remembered per page)."""
        cdef uint8_t *page = self.word_pages[cp >> 8]
        cdef int i
        if page == NULL:
            page = <uint8_t *>PyMem_Malloc(256)
            if page == NULL:
                raise MemoryError()
            for i in range(256):
                page[i] = 1 if Py_UNICODE_ISALNUM((cp & ~0xFFu) | i) else 2
            self.word_pages[cp >> 8] = page
        return page[cp & 0xFF] == 1

    cdef int32_t ask(self, uint32_t cp) except? -9:
        """Stage 1 of a code point not met before, from the reference's function, remembered."""
        cdef int32_t *page = self.pages[cp >> 8]
        cdef int32_t v
        if page == NULL:
            page = <int32_t *>PyMem_Malloc(256 * sizeof(int32_t))
            if page == NULL:
                raise MemoryError()
            memset(page, 0xFF, 256 * sizeof(int32_t))  # STAGE_UNKNOWN
            self.pages[cp >> 8] = page
        value = self.stage1(cp) if cp != NORM_JOIN else chr(cp)
        if len(value) == 1:
            v = ord(value)
        elif not value:
            v = STAGE_DROP
        else:
            self.multi.append(value)
            v = -3 - (len(self.multi) - 1)
        page[cp & 0xFF] = v
        return v

    def keep_look(self, str text):
        """`normalize._keep_look(text)`: the characters NFKC would make something they do not look like,
        mapped first (the same string when there are none)."""
        cdef int kind = PyUnicode_KIND(text)
        cdef void *data = PyUnicode_DATA(text)
        cdef Py_ssize_t n = PyUnicode_GET_LENGTH(text)
        if kind == 1:
            return text  # all of them are above U+03F1
        if kind == 2:
            return _keep_look(self, text, <const uint16_t *>data, n)
        return _keep_look(self, text, <const uint32_t *>data, n)


    def chars(self, str joined):
        """Stage 1 of a joined batch already decomposed (`Normalizer._chars_batch` after NFKD/NFD)."""
        cdef int kind = PyUnicode_KIND(joined)
        cdef void *data = PyUnicode_DATA(joined)
        cdef Py_ssize_t n = PyUnicode_GET_LENGTH(joined), size
        cdef vector[uint32_t] own
        cdef vector[uint32_t] *out = &own if self.lent else &self.buffer
        cdef uint32_t bits = 0
        cdef bint lending = out == &self.buffer
        if <size_t>(n + 16) > out.size():
            out.resize(n + 16)
        self.lent = True
        try:
            if kind == 1:
                size = _chars(self, <const uint8_t *>data, n, deref(out), &bits)
            elif kind == 2:
                size = _chars(self, <const uint16_t *>data, n, deref(out), &bits)
            else:
                size = _chars(self, <const uint32_t *>data, n, deref(out), &bits)
            return ucs4_str(deref(out), 0, size, bits)
        finally:
            if lending:
                self.lent = False


    def words(self, str joined):
        """Stage 3 of a joined batch (`Normalizer._words_batch`), split into its texts: (the texts, the
        indexes of those with a Han character where a Latin letter touches a pinyin code)."""
        cdef int kind = PyUnicode_KIND(joined)
        cdef void *data = PyUnicode_DATA(joined)
        cdef Py_ssize_t n = PyUnicode_GET_LENGTH(joined)
        cdef vector[uint32_t] own
        cdef vector[uint32_t] *out = &own if self.lent else &self.buffer
        cdef bint lending = out == &self.buffer
        cdef list texts = [], latin_next_to_pinyin = []
        if <size_t>(n + 1) > out.size():
            out.resize(n + 1)
        self.lent = True
        try:
            if kind == 1:
                _words(self, <const uint8_t *>data, n, deref(out), texts, latin_next_to_pinyin)
            elif kind == 2:
                _words(self, <const uint16_t *>data, n, deref(out), texts, latin_next_to_pinyin)
            else:
                _words(self, <const uint32_t *>data, n, deref(out), texts, latin_next_to_pinyin)
        finally:
            if lending:
                self.lent = False
        return texts, latin_next_to_pinyin

cdef object _keep_look(NormalizeStages self, str text, const ucs_t *data, Py_ssize_t n):
    cdef Py_ssize_t i
    cdef uint32_t cp, lowest = self.before_from[0] if self.before_from.size() else 0x110000
    cdef vector[uint32_t] out
    cdef vector[uint32_t].iterator at
    cdef bint found = False
    for i in range(n):
        cp = data[i]
        if cp >= lowest and self.before_pages[cp >> 8]:  # (no search in the pages without one: Han, kana...)
            at = lower_bound(self.before_from.begin(), self.before_from.end(), cp)
            if at != self.before_from.end() and deref(at) == cp:
                found = True
                break
    if not found:
        return text
    out.resize(n)
    cdef uint32_t bits = 0
    for i in range(n):
        cp = data[i]
        if cp >= lowest and self.before_pages[cp >> 8]:
            at = lower_bound(self.before_from.begin(), self.before_from.end(), cp)
            if at != self.before_from.end() and deref(at) == cp:
                cp = self.before_to[at - self.before_from.begin()]
        out[i] = cp
        bits |= cp
    return ucs4_str(out, 0, n, bits)

cdef Py_ssize_t _chars(NormalizeStages self, const ucs_t *data, Py_ssize_t n, vector[uint32_t] &out,
                      uint32_t *bits_out) except -1:
    """Writes stage 1 of data[:n] to `out`; returns its length, the OR of its code points in `bits_out`."""
    cdef Py_ssize_t i, j = 0
    cdef uint32_t cp, bits = 0
    cdef int32_t v
    cdef int32_t *page
    for i in range(n):
        cp = data[i]
        page = self.pages[cp >> 8]
        v = page[cp & 0xFF] if page != NULL else STAGE_UNKNOWN
        if v == STAGE_UNKNOWN:
            v = self.ask(cp)
        if v >= 0:
            out[j] = <uint32_t>v
            bits |= <uint32_t>v
            j += 1
        elif v != STAGE_DROP:
            value = <str>self.multi[-3 - v]
            if <size_t>(j + len(value) + (n - i)) > out.size():
                out.resize(2 * out.size() + len(value))
            for ch in value:
                out[j] = ord(ch)
                bits |= <uint32_t>ord(ch)
                j += 1
    bits_out[0] = bits
    return j

cdef int _words(NormalizeStages self, const ucs_t *data, Py_ssize_t n, vector[uint32_t] &out, list texts,
                list latin_next_to_pinyin) except -1:
    cdef Py_ssize_t npinyin = self.pinyin_codes.size(), i, j = 0, start = 0, text = 0
    cdef uint32_t cp, v, bits = 0
    cdef int here, before = 0
    cdef bint han = False, touching = False
    if ucs_t is uint8_t:  # (the ASCII texts) no Han and no pinyin code: each character kept or not, no branch
        for i in range(n + 1):
            cp = data[i] if i < n else NORM_JOIN
            if cp == NORM_JOIN:
                texts.append(ucs4_str(out, start, j, bits))
                bits = 0
                start = j
                continue
            v = self.ascii_words[cp] if cp < 0x80 else cp if self.is_word(cp) else 0
            out[j] = v
            bits |= v
            j += v != 0
        return 0
    for i in range(n + 1):
        cp = data[i] if i < n else NORM_JOIN
        if cp == NORM_JOIN:
            texts.append(ucs4_str(out, start, j, bits))
            bits = 0
            if han and touching:
                latin_next_to_pinyin.append(text)
            text += 1
            start = j
            han = touching = False
            before = 0
            continue
        if cp < 0x80:
            v = self.ascii_words[cp]  # (l → i with leet)
            if v == 0:
                continue
        else:
            if 0x3400 <= cp <= 0x9FFF:
                han = True
            if self.pinyin and self.pinyin_base <= cp < self.pinyin_base + npinyin \
                    and self.pinyin_codes[cp - self.pinyin_base] != 0:
                v = self.pinyin_codes[cp - self.pinyin_base]
            elif self.is_word(cp):
                v = cp
            else:
                continue
        out[j] = v
        bits |= v
        j += 1
        if self.pinyin:
            here = 1 if 0x61 <= v <= 0x7A else 2 if NORM_PINYIN_CODE <= v < NORM_PINYIN_CODE + 0x1000 else 0
            if here | before == 3:
                touching = True
            before = here
    return 0


cdef inline bint spaced_token(uint32_t c) noexcept nogil:
    return (0x61 <= c <= 0x7A) or (0x30 <= c <= 0x39) or c == 0x40 or c == 0x24 or c == 0x21  # [a-z0-9@$!]


def spaced_runs(str text):
    """The spans of the non-overlapping matches of `normalize._SPACED` in `" " + text`, one less (a start of
    -1 is that space), as `_SPACED.finditer` gives them: a space, line break or joiner, then three or more
    tokens of one character of [a-z0-9@$!] each 1-3 spaces after the one before, the last not followed by
    [\\w@$!]."""
    cdef int kind = PyUnicode_KIND(text)
    cdef void *data = PyUnicode_DATA(text)
    cdef Py_ssize_t n = PyUnicode_GET_LENGTH(text)
    cdef list out = []
    if kind == 1:
        _spaced_runs(<const uint8_t *>data, n, out)
    elif kind == 2:
        _spaced_runs(<const uint16_t *>data, n, out)
    else:
        _spaced_runs(<const uint32_t *>data, n, out)
    return out


cdef int _spaced_runs(const ucs_t *data, Py_ssize_t n, list out) except -1:
    cdef Py_ssize_t i = -1, p, q, tokens, last_end, prev_end
    cdef uint32_t c
    while i + 1 < n:
        c = data[i] if i >= 0 else 0x20
        # A run's first token is followed by a space (else it is one token: as the loop below would find)
        if not (c == 0x20 or c == 0x0A or c == 0x1E) or i + 2 >= n or data[i + 2] != 0x20 \
                or not spaced_token(data[i + 1]):
            i += 1
            continue
        tokens = 1
        prev_end = -1
        last_end = i + 2  # the end of the last token
        p = last_end
        while True:  # (?: {1,3}[a-z0-9@$!]) as often as it goes (the spaces never give back a token)
            q = p
            while q < n and q - p < 3 and data[q] == 0x20:
                q += 1
            if q == p or q >= n or not spaced_token(data[q]):
                break
            tokens += 1
            prev_end = last_end
            last_end = q + 1
            p = last_end
        if tokens >= 3:
            c = data[last_end] if last_end < n else 0x20
            if (c < 0x80 and (0x61 <= c <= 0x7A or 0x30 <= c <= 0x39 or 0x41 <= c <= 0x5A or c == 0x5F or c == 0x40
                              or c == 0x24 or c == 0x21)) or (c >= 0x80 and Py_UNICODE_ISALNUM(c)):
                tokens -= 1  # (?![\\w@$!]) fails: give back the last token (a space follows the one before)
                last_end = prev_end
            if tokens >= 3:
                out.append((i, last_end))
                i = last_end
                continue
        i += 1
    return 0


# -- `normalize._number_or_leet().sub(...)`: every number, masked or read as leet ------------------------
# The pattern is tried at every digit not inside an earlier match (its non-leet alternative always matches
# there), so the scan below goes digit by digit and tries the alternatives in the pattern's order. The
# regular expression costs ≈ 1 µs a number (most of it the engine's search for the next digit in a wide
# string and its lookbehinds), and the dev stream has ≈ 45,000 numbers.

cdef inline bint nl_digit(uint32_t c) noexcept nogil:
    return 0x30 <= c <= 0x39


cdef inline bint nl_lower(uint32_t c) noexcept nogil:
    return 0x61 <= c <= 0x7A


cdef inline bint nl_alnum(uint32_t c) noexcept nogil:  # [^\W_]
    if c < 0x80:
        return (0x30 <= c <= 0x39) or (0x41 <= c <= 0x5A) or (0x61 <= c <= 0x7A)
    return Py_UNICODE_ISALNUM(c)


cdef inline bint nl_word(uint32_t c) noexcept nogil:  # \w
    return c == 0x5F or nl_alnum(c)


cdef inline bint nl_sep(uint32_t c) noexcept nogil:  # normalize._SEP: (?:[^\w\x1e]|_)
    return c != NORM_JOIN and not nl_alnum(c)


cdef inline bint nl_lookalike(uint32_t c) noexcept nogil:  # [013457-9]
    return nl_digit(c) and c != 0x32 and c != 0x36


cdef inline Py_ssize_t nl_seps(const ucs_t *data, Py_ssize_t n, Py_ssize_t x) noexcept nogil:
    """The end of the run of separators at x (SEP*+)."""
    while x < n and nl_sep(data[x]):
        x += 1
    return x


cdef inline Py_ssize_t nl_two(const ucs_t *data, Py_ssize_t n, Py_ssize_t x) noexcept nogil:
    """normalize._TWO_DIGITS_AT_MOST at x: where it ends, -1 if it fails."""
    cdef Py_ssize_t s = nl_seps(data, n, x)
    if s < n and nl_digit(data[s]):  # (?:SEP*+[0-9])?+
        x = s + 1
        s = nl_seps(data, n, x)
        if s < n and nl_digit(data[s]):  # (?!SEP*+[0-9])
            return -1
    return x


cdef inline bint nl_after_letter(const ucs_t *data, Py_ssize_t p, Py_ssize_t k, bint one_letter_token) noexcept nogil:
    """(?<=[a-z]SEP{k}[0-9]) at p + 1 (data[p] a digit), and with `one_letter_token` (?<!\w[a-z]SEP{k}[0-9])."""
    cdef Py_ssize_t i
    if p - k - 1 < 0 or not nl_lower(data[p - k - 1]):
        return False
    for i in range(p - k, p):
        if not nl_sep(data[i]):
            return False
    return not (one_letter_token and p - k - 2 >= 0 and nl_word(data[p - k - 2]))


cdef bint nl_unit(str text, const ucs_t *data, Py_ssize_t n, Py_ssize_t y, frozenset units, Py_ssize_t longest) except -1:
    """normalize._UNIT at y: its words are letters followed by no [a-z0-9], so it matches where the run of
    [a-z0-9] at y is one of them."""
    cdef Py_ssize_t e = y
    while e < n and e - y <= longest and (nl_lower(data[e]) or nl_digit(data[e])):
        e += 1
    return y < e and e - y <= longest and text[y:e] in units


cdef Py_ssize_t nl_match(str text, const ucs_t *data, Py_ssize_t n, Py_ssize_t p, frozenset units, Py_ssize_t longest,
                         bint *leet) except -2:
    """The end of `_number_or_leet()`'s match at p (data[p] a digit); `leet`: whether its group `leet` matched."""
    cdef Py_ssize_t x = p + 1, y, s, k
    cdef bint letter_before = p >= 1 and nl_lower(data[p - 1])
    leet[0] = True
    if letter_before:  # (?<=[a-z][0-9]) TWO (?=SEP*+END)
        y = nl_two(data, n, x)
        if y >= 0:
            s = nl_seps(data, n, y)
            if s == n or nl_lower(data[s]) or data[s] == NORM_JOIN:
                return y
        if nl_lookalike(data[p]):  # (?<=[a-z][013457-9])[013457-9]{2,3}(?=[a-z])
            if x + 3 < n and nl_lookalike(data[x]) and nl_lookalike(data[x + 1]) and nl_lookalike(data[x + 2]) \
                    and nl_lower(data[x + 3]):
                return x + 3
            if x + 2 < n and nl_lookalike(data[x]) and nl_lookalike(data[x + 1]) and nl_lower(data[x + 2]):
                return x + 2
    for k in range(1, 4):  # (?:_AFTER_A_LETTER) TWO (?=[a-z])(?!UNIT)
        if nl_after_letter(data, p, k, False):
            y = nl_two(data, n, x)
            if y >= 0 and y < n and nl_lower(data[y]) and not nl_unit(text, data, n, y, units, longest):
                return y
            break
    if not (p >= 1 and (nl_alnum(data[p - 1]) or data[p - 1] == 0x24)):  # (?<![^\W_][0-9])(?<!\$[0-9])
        y = x + 1 if x < n and nl_digit(data[x]) else x  # [0-9]?+
        if not (y < n and nl_digit(data[y])) and y < n and nl_lower(data[y]) \
                and not nl_unit(text, data, n, y, units, longest):
            return y
    for k in range(1, 4):  # (?:_AFTER_ONE_LETTER_TOKEN) TWO (?=SEP{1,3}[a-z](?!\w)|SEP*+(?:\x1e|\Z))
        if nl_after_letter(data, p, k, True):
            y = nl_two(data, n, x)
            if y >= 0:
                s = nl_seps(data, n, y)
                if 1 <= s - y <= 3 and s < n and nl_lower(data[s]) and not (s + 1 < n and nl_word(data[s + 1])):
                    return y
                if s == n or data[s] == NORM_JOIN:
                    return y
            break
    leet[0] = False  # [0-9]*+(?:SEP*+[0-9]++)*+
    y = x
    while True:
        while y < n and nl_digit(data[y]):
            y += 1
        s = nl_seps(data, n, y)
        if s < n and nl_digit(data[s]):
            y = s
        else:
            return y


def numbers_or_leet(str text, bint mask, frozenset units):
    """`normalize._number_or_leet().sub(_leet_or_mask if mask else _leet_or_keep, text)`: each number that the
    group `leet` matches has its digits read as letters (`_LEET_DIGITS`), the others become
    `normalize.NUMBER_MARK` (with `mask`) or stay. `units`: the words of `normalize._UNIT`."""
    cdef int kind = PyUnicode_KIND(text)
    cdef void *data = PyUnicode_DATA(text)
    cdef Py_ssize_t n = PyUnicode_GET_LENGTH(text)
    cdef Py_ssize_t longest = max([len(u) for u in units]) if units else 0
    if kind == 1:
        return _numbers_or_leet(text, <const uint8_t *>data, n, mask, units, longest)
    if kind == 2:
        return _numbers_or_leet(text, <const uint16_t *>data, n, mask, units, longest)
    return _numbers_or_leet(text, <const uint32_t *>data, n, mask, units, longest)


cdef uint32_t NL_NUMBER_MARK = 0x1E802  # normalize.NUMBER_MARK
cdef const char *NL_LEET_DIGITS = b"oizeasgtbg"  # normalize._LEET_DIGITS


cdef object _numbers_or_leet(str text, const ucs_t *data, Py_ssize_t n, bint mask, frozenset units, Py_ssize_t longest):
    cdef Py_ssize_t i = 0, j = 0, end, q
    cdef uint32_t c, bits = 0
    cdef bint leet, found = False
    cdef vector[uint32_t] out
    while i < n:
        c = data[i]
        if not nl_digit(c):
            i += 1
            continue
        if not found:  # the text before the first number, copied
            found = True
            out.resize(n + 1)
            for q in range(i):
                out[q] = data[q]
                bits |= data[q]
            j = i
        end = nl_match(text, data, n, i, units, longest, &leet)
        if leet:
            for q in range(i, end):
                c = data[q]
                c = <uint32_t>NL_LEET_DIGITS[c - 0x30] if nl_digit(c) else c
                out[j] = c
                bits |= c
                j += 1
        elif mask:
            out[j] = NL_NUMBER_MARK  # (one code point for at least one: `out` never grows past n)
            bits |= NL_NUMBER_MARK
            j += 1
        else:
            for q in range(i, end):
                out[j] = data[q]
                bits |= data[q]
                j += 1
        i = end
        while i < n and not nl_digit(data[i]):
            out[j] = data[i]
            bits |= data[i]
            j += 1
            i += 1
    if not found:
        return text
    return ucs4_str(out, 0, j, bits)


# -- where `normalize._SCHEME_URL` and `normalize._EMAIL` match (`finditer`'s spans) --------------------------
# `Normalizer._mask_urls` replaces them. The patterns ran from Python at each place a literal says one may start
# (each "://" three times: https, http, ftp): ≈ 4 µs a URL, most of it the calls.

def scheme_url_spans(str text):
    """`[m.span() for m in normalize._SCHEME_URL.finditer(text)]`: `(?:(?:https?|ftp)://|www\\.)\\S+`."""
    cdef int kind = PyUnicode_KIND(text)
    cdef void *data = PyUnicode_DATA(text)
    cdef Py_ssize_t n = PyUnicode_GET_LENGTH(text)
    cdef list out = []
    if kind == 1:
        _scheme_url_spans(<const uint8_t *>data, n, out)
    elif kind == 2:
        _scheme_url_spans(<const uint16_t *>data, n, out)
    else:
        _scheme_url_spans(<const uint32_t *>data, n, out)
    return out


cdef inline bint at_literal(const ucs_t *data, Py_ssize_t n, Py_ssize_t i, const char *literal, Py_ssize_t k) noexcept nogil:
    cdef Py_ssize_t j
    if i + k > n:
        return False
    for j in range(k):
        if data[i + j] != <uint8_t>literal[j]:
            return False
    return True


cdef int _scheme_url_spans(const ucs_t *data, Py_ssize_t n, list out) except -1:
    cdef Py_ssize_t i = 0, k, e
    cdef uint32_t c
    while i < n:
        c = data[i]
        k = 0
        if c == 0x68:  # h
            k = 8 if at_literal(data, n, i, b"https://", 8) else 7 if at_literal(data, n, i, b"http://", 7) else 0
        elif c == 0x66:  # f
            k = 6 if at_literal(data, n, i, b"ftp://", 6) else 0
        elif c == 0x77:  # w
            k = 4 if at_literal(data, n, i, b"www.", 4) else 0
        if k and i + k < n and not Py_UNICODE_ISSPACE(data[i + k]):
            e = i + k
            while e < n and not Py_UNICODE_ISSPACE(data[e]):
                e += 1
            out.append((i, e))
            i = e
        else:
            i += 1
    return 0


def email_spans(str text):
    """`[m.span() for m in normalize._EMAIL.finditer(text)]`: `(?<![\\w.+-])[\\w.+-]+@[\\w-]+(?:\\.[\\w-]+)+`."""
    cdef int kind = PyUnicode_KIND(text)
    cdef void *data = PyUnicode_DATA(text)
    cdef Py_ssize_t n = PyUnicode_GET_LENGTH(text)
    cdef list out = []
    if kind == 1:
        _email_spans(<const uint8_t *>data, n, out)
    elif kind == 2:
        _email_spans(<const uint16_t *>data, n, out)
    else:
        _email_spans(<const uint32_t *>data, n, out)
    return out


cdef inline bint email_host(uint32_t c) noexcept nogil:  # [\w-]
    return c == 0x2D or nl_word(c)


cdef inline bint email_local(uint32_t c) noexcept nogil:  # [\w.+-]
    return c == 0x2E or c == 0x2B or email_host(c)


cdef int _email_spans(const ucs_t *data, Py_ssize_t n, list out) except -1:
    cdef Py_ssize_t at, p, e, pos = 0
    cdef bint parts
    for at in range(n):
        if data[at] != 0x40:  # @
            continue
        p = at
        while p > pos and email_local(data[p - 1]):  # a match never starts inside the one before
            p -= 1
        # (?<![\w.+-]): the run of local characters starts at p (the one before a match's end is a host character)
        if p == at or (p > 0 and email_local(data[p - 1])):
            continue
        e = at + 1
        while e < n and email_host(data[e]):
            e += 1
        if e == at + 1:
            continue
        parts = False
        while e + 1 < n and data[e] == 0x2E and email_host(data[e + 1]):  # (?:\.[\w-]+)+
            e += 2
            while e < n and email_host(data[e]):
                e += 1
            parts = True
        if parts:
            out.append((p, e))
            pos = e
    return 0


def domain_spans(str text, tuple tlds):
    """`[m.span() for m in normalize._BARE_DOMAIN.finditer(text)]`, `tlds` the words of `normalize._TLDS` in its
    order: `\\b(?:[a-z0-9-]+\\.)+(?:TLD)\\b(?:/\\S*)?`."""
    cdef int kind = PyUnicode_KIND(text)
    cdef void *data = PyUnicode_DATA(text)
    cdef Py_ssize_t n = PyUnicode_GET_LENGTH(text)
    cdef list out = []
    cdef bytes words = "\0".join(tlds).encode("ascii") + b"\0"  # each TLD ended by a NUL
    if kind == 1:
        _domain_spans(<const uint8_t *>data, n, words, out)
    elif kind == 2:
        _domain_spans(<const uint16_t *>data, n, words, out)
    else:
        _domain_spans(<const uint32_t *>data, n, words, out)
    return out


cdef inline bint domain_char(uint32_t c) noexcept nogil:  # [a-z0-9-]
    return nl_lower(c) or nl_digit(c) or c == 0x2D


cdef inline bint word_boundary(const ucs_t *data, Py_ssize_t n, Py_ssize_t i) noexcept nogil:  # \b at i
    return (i > 0 and nl_word(data[i - 1])) != (i < n and nl_word(data[i]))


cdef Py_ssize_t tld_at(const ucs_t *data, Py_ssize_t n, Py_ssize_t t, const char *words) noexcept nogil:
    """The end of the first TLD (in the pattern's order) at t followed by \b, -1 if none."""
    cdef const char *w = words
    cdef Py_ssize_t k
    while w[0] != 0:
        k = 0
        while w[k] != 0 and t + k < n and data[t + k] == <uint8_t>w[k]:
            k += 1
        if w[k] == 0 and word_boundary(data, n, t + k):
            return t + k
        while w[0] != 0:
            w += 1
        w += 1
    return -1


cdef int _domain_spans(const ucs_t *data, Py_ssize_t n, const char *words, list out) except -1:
    """From dot to dot (dots are rare): a match's first label is the run of [a-z0-9-] before its first dot, and
    it starts at the first word boundary in that run (at any later one the rest is the same, and fails the same)."""
    cdef Py_ssize_t pos = 0, d = 0, i, e, q, end
    cdef vector[Py_ssize_t] dots  # after each `label.` of the match: where the next one (or the TLD) starts
    while True:
        while d < n and data[d] != 0x2E:
            d += 1
        if d >= n:
            return 0
        i = d
        while i > pos and domain_char(data[i - 1]):
            i -= 1
        while i < d and not word_boundary(data, n, i):
            i += 1
        if i == d:
            d += 1
            continue
        dots.clear()
        q = i
        while True:  # (?:[a-z0-9-]+\.)+ as far as it goes; then back off a label at a time (the regex's backtracking)
            e = q
            while e < n and domain_char(data[e]):
                e += 1
            if e == q or e >= n or data[e] != 0x2E:
                break
            q = e + 1
            dots.push_back(q)
        end = -1
        while dots.size():
            end = tld_at(data, n, dots.back(), words)
            if end >= 0:
                break
            dots.pop_back()
        if end < 0:
            d += 1
            continue
        if end < n and data[end] == 0x2F:  # (?:/\S*)?
            end += 1
            while end < n and not Py_UNICODE_ISSPACE(data[end]):
                end += 1
        out.append((i, end))
        pos = d = end
