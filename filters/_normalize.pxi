# The compiled stages of normalization (included by filters/_native.pyx), as the reference
# `Normalizer.normalize_batch` in filters/normalize.py computes them with numpy lookup tables and patterns: stage 1
# (every per-character step up to casefold), the word stage (`Normalizer._words_stage`: URLs, e-mails and bare
# domains masked, spaced-out text joined, `!@$` read as letters, numbers masked or read as leet, each scan the twin
# of its pattern) and stage 3 (separators out, l → i, Han → pinyin codes, the texts whose Latin letters touch a
# pinyin code). `NormalizeStages.each` runs them all text by text on code points (`_text`).
#
# Why: the reference builds its tables for all 1.1M code points when the first Normalizer is made
# (≈ 0.3 s of every process's start) and runs each stage as several numpy passes with UTF-32 copies.
# Here stage 1 asks the reference's own per-character function (`normalize._decomposed`: the decomposition and
# stage 1, which acts on a text character by character) once per code point met and remembers the answer in pages
# of 256; stage 3 needs no table: `\w` is `Py_UNICODE_ISALNUM`
# (what the `re` module tests), and the pinyin codes come from `charmaps.PINYIN_CODES`. The word stage's scans
# ran once each over the joined batch, a str each between them (of 4 bytes a character once a mask was in):
# text by text, its code points stay in the cache from the first stage to the last.

cdef extern from "Python.h":
    int PyUnicode_KIND(object o)
    void *PyUnicode_DATA(object o)
    Py_ssize_t PyUnicode_GET_LENGTH(object o)
    uint32_t PyUnicode_READ(int kind, void *data, Py_ssize_t index) nogil
    object PyUnicode_FromKindAndData(int kind, const void *buffer, Py_ssize_t size)
    object PyUnicode_New(Py_ssize_t size, uint32_t maxchar)
    bint Py_UNICODE_ISALNUM(uint32_t ch) nogil
    bint Py_UNICODE_ISSPACE(uint32_t ch) nogil

from libc.stdint cimport int32_t, uint16_t, uint64_t


cdef extern from * nogil:
    """
    #if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    #include <immintrin.h>
    /* Scans of the word stage over 16 code points at a time (AVX-512, called where `nd_has_512`): each returns
       the first index from `i` where its test holds, or where it stopped (`n`; for `nd_spaced_512`, the first
       i with i + 2 >= n), as the one-at-a-time loop it stands in front of. */
    __attribute__((target("avx512f")))
    static Py_ssize_t nd_find2_512(const uint32_t *d, Py_ssize_t i, Py_ssize_t n, uint32_t a, uint32_t b) {
        const __m512i va = _mm512_set1_epi32((int)a), vb = _mm512_set1_epi32((int)b);
        for (; i + 16 <= n; i += 16) {
            __m512i v = _mm512_loadu_si512((const void *)(d + i));
            unsigned m = (unsigned)(_mm512_cmpeq_epi32_mask(v, va) | _mm512_cmpeq_epi32_mask(v, vb));
            if (m) return i + __builtin_ctz(m);
        }
        for (; i < n; i++) if (d[i] == a || d[i] == b) return i;
        return i;
    }
    __attribute__((target("avx512f")))
    static Py_ssize_t nd_digit_512(const uint32_t *d, Py_ssize_t i, Py_ssize_t n) {
        const __m512i zero = _mm512_set1_epi32(0x30), nine = _mm512_set1_epi32(9);
        for (; i + 16 <= n; i += 16) {
            __m512i v = _mm512_sub_epi32(_mm512_loadu_si512((const void *)(d + i)), zero);
            unsigned m = (unsigned)_mm512_cmple_epu32_mask(v, nine);
            if (m) return i + __builtin_ctz(m);
        }
        for (; i < n; i++) if (d[i] - 0x30u <= 9u) return i;
        return i;
    }
    __attribute__((target("avx512f")))
    static Py_ssize_t nd_spaced_512(const uint32_t *d, Py_ssize_t i, Py_ssize_t n) {
        const __m512i space = _mm512_set1_epi32(0x20), other = _mm512_set1_epi32((int)~0x2Au);
        const __m512i joiner = _mm512_set1_epi32(0x1E);
        for (; i + 18 <= n; i += 16) {
            __m512i here = _mm512_loadu_si512((const void *)(d + i));
            __m512i two = _mm512_loadu_si512((const void *)(d + i + 2));
            unsigned m = (unsigned)(_mm512_cmpeq_epi32_mask(two, space)
                                    & (_mm512_testn_epi32_mask(here, other) | _mm512_cmpeq_epi32_mask(here, joiner)));
            if (m) return i + __builtin_ctz(m);
        }
        for (; i + 2 < n; i++) if (d[i + 2] == 0x20u && ((d[i] & ~0x2Au) == 0 || d[i] == 0x1Eu)) return i;
        return i;
    }
    #else
    static Py_ssize_t nd_find2_512(const uint32_t *d, Py_ssize_t i, Py_ssize_t n, uint32_t a, uint32_t b) {
        (void)d; (void)n; (void)a; (void)b; return i; }
    static Py_ssize_t nd_digit_512(const uint32_t *d, Py_ssize_t i, Py_ssize_t n) { (void)d; (void)n; return i; }
    static Py_ssize_t nd_spaced_512(const uint32_t *d, Py_ssize_t i, Py_ssize_t n) { (void)d; (void)n; return i; }
    #endif
    """
    Py_ssize_t nd_find2_512(const uint32_t *d, Py_ssize_t i, Py_ssize_t n, uint32_t a, uint32_t b)
    Py_ssize_t nd_digit_512(const uint32_t *d, Py_ssize_t i, Py_ssize_t n)
    Py_ssize_t nd_spaced_512(const uint32_t *d, Py_ssize_t i, Py_ssize_t n)
from cython.operator cimport dereference as deref
from libcpp.algorithm cimport binary_search
from libcpp.vector cimport vector

cdef uint32_t NORM_JOIN = 0x1E  # normalize._JOIN: ends a text of the joined batch, kept by every stage
cdef uint32_t NORM_PINYIN_CODE = 0xF0000  # normalize._PINYIN_CODE
cdef int32_t STAGE_UNKNOWN = -1  # not asked yet
cdef int32_t STAGE_DROP = -2  # deleted; -3 - i: several characters, multi[i]
cdef Py_ssize_t STAGE_PAGES = 0x110000 >> 8

cdef struct NlUnits:  # normalize._UNIT's words, each packed a byte a character (`unit_keys`), sorted
    const uint64_t *keys
    Py_ssize_t count, longest


cdef cppclass TextBuffers:  # what the stages of one text write to (`_text`): its code points twice, spans
    vector[uint32_t] a, b
    vector[Py_ssize_t] spans


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


cdef list span_list(vector[Py_ssize_t] &spans):
    """Spans written end to end (start, end, start, end...) as the list of pairs `finditer` gives."""
    return [(spans[k], spans[k + 1]) for k in range(0, <Py_ssize_t>spans.size(), 2)]


cdef class NormalizeStages:
    """Stages 1 and 3 of one `NormalizeOptions` (`normalize._Stages` without its tables)."""

    cdef int32_t *pages[0x1100]
    cdef uint8_t *word_pages[0x1100]  # 1 where `\w` matches, 2 where not, 0 not asked yet
    cdef uint8_t ascii_words[0x80]  # stage 3 of an ASCII character: itself, i for l (leet), 0 for a separator
    # The stages' output, kept from batch to batch: a new one each time (a batch is ≈ 0.5-2 MB of code points)
    # was mapped, faulted in page by page and unmapped again. `lent` while a stage writes to it: a stage
    # called meanwhile (from `stage1`, which is Python) writes to one of its own.
    cdef vector[uint32_t] buffer
    cdef TextBuffers text_buffers  # `each`'s, kept as `buffer` is
    cdef bint lent
    cdef object stage1  # cp → its stage-1 string (normalize._decomposed for these options)
    cdef list multi
    cdef bint leet, pinyin, mask_urls, mask_numbers
    cdef vector[uint32_t] pinyin_codes  # charmaps.PINYIN_CODES as code points, 0 where none
    cdef uint32_t pinyin_base
    cdef vector[uint64_t] unit_words  # normalize._UNITS (`unit_keys`), for `nl_units`
    cdef NlUnits nl_units
    cdef bytes tlds  # normalize._TLD_WORDS in order, each ended by a NUL (`domain_spans`)
    cdef uint64_t particles[432]  # normalize.PARTICLES, a bit each from U+3400 to U+9FFF (27,648 ÷ 64): separators

    def __init__(self, stage1, bint leet, bint pinyin, str pinyin_codes, int pinyin_base, bint mask_urls=False, bint mask_numbers=False, frozenset units=frozenset(), tuple tlds=(), str particles=""):
        """`mask_urls`, `mask_numbers`, `units` (normalize._UNITS) and `tlds` (normalize._TLD_WORDS): what
        `each` needs of the word stage besides `leet`; `particles` (normalize.PARTICLES, Han characters): what stage 3
        drops as separators though they are `\w`."""
        self.stage1 = stage1
        self.multi = []
        self.leet = leet
        self.pinyin = pinyin
        self.pinyin_base = pinyin_base
        self.mask_urls = mask_urls
        self.mask_numbers = mask_numbers
        self.unit_words = unit_keys(units)
        self.nl_units = NlUnits(self.unit_words.data(), self.unit_words.size(), max([len(u) for u in units] or [0]))
        self.tlds = "\0".join(tlds).encode("ascii") + b"\0"
        cdef int c
        for c in range(0x80):  # [a-zA-Z0-9] are \w among ASCII characters, and `_` is a separator here
            if 0x61 <= c <= 0x7A or 0x30 <= c <= 0x39 or 0x41 <= c <= 0x5A:
                self.ascii_words[c] = 0x69 if c == 0x6C and leet else c
        for ch in pinyin_codes:
            self.pinyin_codes.push_back(ord(ch))
        cdef uint32_t cp
        for ch in particles:
            cp = ord(ch)
            if not 0x3400 <= cp <= 0x9FFF:
                raise ValueError(f"a particle must be a Han character (U+3400-U+9FFF), got {ch!r}")
            self.particles[(cp - 0x3400) >> 6] |= (<uint64_t>1) << ((cp - 0x3400) & 63)

    def __dealloc__(self):
        cdef Py_ssize_t i
        for i in range(STAGE_PAGES):
            if self.pages[i] != NULL:
                PyMem_Free(self.pages[i])
            if self.word_pages[i] != NULL:
                PyMem_Free(self.word_pages[i])

    cdef inline bint is_word(self, uint32_t cp) noexcept:
        """`\w` as the `re` module matches it (`Py_UNICODE_ISALNUM`, remembered per page)."""
        cdef uint8_t *page = self.word_pages[cp >> 8]
        if page == NULL:
            return self.word_page(cp)
        return page[cp & 0xFF] == 1

    cdef bint word_page(self, uint32_t cp) noexcept:
        """`is_word` of a page not met before: the page is made (asked each time when there is no memory for it).
        Not inline: the loops that call `is_word` keep their variables in registers."""
        cdef uint8_t *page = <uint8_t *>PyMem_Malloc(256)
        cdef int i
        if page == NULL:
            return Py_UNICODE_ISALNUM(cp)
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

    def chars(self, str joined):
        """Stage 1 of a joined batch already decomposed (`Normalizer._chars_batch` after NFKD/NFD)."""
        cdef int kind = PyUnicode_KIND(joined)
        cdef void *data = PyUnicode_DATA(joined)
        cdef Py_ssize_t n = PyUnicode_GET_LENGTH(joined), size
        cdef vector[uint32_t] own
        cdef vector[uint32_t] *out = &own if self.lent else &self.buffer
        cdef uint32_t bits = 0
        cdef uint64_t low
        cdef bint lending = out == &self.buffer
        if <size_t>(n + 16) > out.size():
            out.resize(n + 16)
        self.lent = True
        try:
            if kind == 1:
                size = _chars(self, <const uint8_t *>data, n, deref(out), &bits, &low)
            elif kind == 2:
                size = _chars(self, <const uint16_t *>data, n, deref(out), &bits, &low)
            else:
                size = _chars(self, <const uint32_t *>data, n, deref(out), &bits, &low)
            return ucs4_str(deref(out), 0, size, bits)
        finally:
            if lending:
                self.lent = False


    def each(self, list texts):
        """`words(<the word stage of> chars(<the texts joined>))` with the joiner dropped from each text (as
        `Normalizer.normalize_batch` takes it out first), and the word stage (`Normalizer._words_stage`: URLs and
        e-mails masked, spaced-out text joined, `!@$` read as letters, numbers masked or read as leet) compiled
        in between, text by text: each pass runs over one text (which stays in the cache) on its code points,
        with no str made between them. (the texts, the indexes of those whose Latin letters touch a pinyin code,
        the indexes of those left empty that were not)."""
        cdef list done = [], latin_next_to_pinyin = [], emptied = []
        cdef TextBuffers own
        cdef TextBuffers *buffers = &own if self.lent else &self.text_buffers
        cdef bint lending = buffers == &self.text_buffers
        cdef Py_ssize_t i, n
        cdef str text
        cdef int kind
        self.lent = True
        try:
            for i in range(len(texts)):
                text = texts[i]
                kind = PyUnicode_KIND(text)
                n = PyUnicode_GET_LENGTH(text)
                if kind == 1:
                    _one(self, <const uint8_t *>PyUnicode_DATA(text), n, deref(buffers), done, latin_next_to_pinyin, i)
                elif kind == 2:
                    _one(self, <const uint16_t *>PyUnicode_DATA(text), n, deref(buffers), done, latin_next_to_pinyin, i)
                else:
                    _one(self, <const uint32_t *>PyUnicode_DATA(text), n, deref(buffers), done, latin_next_to_pinyin, i)
                if n and not PyUnicode_GET_LENGTH(<str>done[i]):
                    emptied.append(i)
        finally:
            if lending:
                self.lent = False
        return done, latin_next_to_pinyin, emptied

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

cdef Py_ssize_t _chars(NormalizeStages self, const ucs_t *data, Py_ssize_t n, vector[uint32_t] &out,
                      uint32_t *bits_out, uint64_t *low_out, bint keep_join=True) except -1:
    """Writes stage 1 of data[:n] to `out`; returns its length, the OR of its code points in `bits_out`, and
    in `low_out` the bit of each character of U+0020 to U+005F written, less 0x20 (space, digits, punctuation).
    The joiner is kept (it ends a text of a joined batch) or, without `keep_join`, dropped as any invisible."""
    cdef Py_ssize_t i, j = 0
    cdef uint32_t cp, bits = 0
    cdef uint64_t low = 0
    cdef int32_t v
    cdef int32_t *page
    for i in range(n):
        cp = data[i]
        page = self.pages[cp >> 8]
        v = page[cp & 0xFF] if page != NULL else STAGE_UNKNOWN
        if v == STAGE_UNKNOWN:
            v = self.ask(cp)
        if v >= 0:
            if v == NORM_JOIN and not keep_join:  # (only the joiner is its own stage 1 of the invisibles)
                continue
            out[j] = <uint32_t>v
            bits |= <uint32_t>v
            j += 1
            low |= <uint64_t>(<uint32_t>v - 0x20 < 0x40) << ((v - 0x20) & 63)
        elif v != STAGE_DROP:
            value = <str>self.multi[-3 - v]
            if <size_t>(j + len(value) + (n - i)) > out.size():
                out.resize(2 * out.size() + len(value))
            for ch in value:
                cp = ord(ch)
                out[j] = cp
                bits |= cp
                j += 1
                low |= <uint64_t>(cp - 0x20 < 0x40) << ((cp - 0x20) & 63)
    bits_out[0] = bits
    low_out[0] = low
    return j

cdef int _words(NormalizeStages self, const ucs_t *data, Py_ssize_t n, vector[uint32_t] &out, list texts,
                list latin_next_to_pinyin) except -1:
    """Stage 3 of each text of the joined data[:n] (`_words1`), the texts appended to `texts`."""
    cdef Py_ssize_t i, start = 0, end, size, text = 0
    cdef uint32_t bits
    cdef bint touching
    while start <= n:
        end = start
        bits = 0
        while end < n and data[end] != NORM_JOIN:
            out[end - start] = data[end]
            bits |= data[end]
            end += 1
        size = _words1(self, out.data(), end - start, &bits, &touching)
        texts.append(ucs4_str(out, 0, size, bits))
        if touching:
            latin_next_to_pinyin.append(text)
        text += 1
        start = end + 1
    return 0


cdef Py_ssize_t _words1(NormalizeStages self, uint32_t *buf, Py_ssize_t n, uint32_t *bits_out,
                        bint *touching_out) except -1:
    """Stage 3 of one text, buf[:n], in place: separators out, l → i (leet), Han → pinyin codes. Returns the
    length, the OR of the code points in `bits_out`, and in `touching_out` whether the text has a Han character
    and a Latin letter next to a pinyin code. `bits_out` comes in as the OR of the text's characters before the
    word stage (whose masks are no Han): below U+3400, buf holds no Han and no pinyin code."""
    cdef Py_ssize_t npinyin = self.pinyin_codes.size(), i, j = 0
    cdef uint32_t cp, v, bits = 0
    cdef int here, before = 0
    cdef bint han = False, touching = False
    cdef const uint8_t *ascii_words = self.ascii_words
    if bits_out[0] < 0x3400:  # no Han and no pinyin code (U+3400 up): each character kept or not, no branch
        i = 0
        while i < n:
            while i < n and buf[i] < 0x80:  # (a run of ASCII: no call, its variables in registers)
                v = ascii_words[buf[i]]
                buf[j] = v
                bits |= v
                j += v != 0
                i += 1
            if i < n:
                cp = buf[i]
                v = cp if self.is_word(cp) else 0
                buf[j] = v
                bits |= v
                j += v != 0
                i += 1
        bits_out[0] = bits
        touching_out[0] = False
        return j
    for i in range(n):
        cp = buf[i]
        if cp < 0x80:
            v = self.ascii_words[cp]  # (l → i with leet)
            if v == 0:
                continue
        else:
            if 0x3400 <= cp <= 0x9FFF:
                if (self.particles[(cp - 0x3400) >> 6] >> ((cp - 0x3400) & 63)) & 1:
                    continue  # a particle: a separator (normalize.PARTICLES)
                han = True
            if self.pinyin and self.pinyin_base <= cp < self.pinyin_base + npinyin \
                    and self.pinyin_codes[cp - self.pinyin_base] != 0:
                v = self.pinyin_codes[cp - self.pinyin_base]
            elif self.is_word(cp):
                v = cp
            else:
                continue
        buf[j] = v
        bits |= v
        j += 1
        if self.pinyin:
            here = 1 if 0x61 <= v <= 0x7A else 2 if NORM_PINYIN_CODE <= v < NORM_PINYIN_CODE + 0x1000 else 0
            if here | before == 3:
                touching = True
            before = here
    bits_out[0] = bits
    touching_out[0] = han and touching
    return j


# -- the whole of `Normalizer._compiled`'s stages, text by text (`NormalizeStages.each`) --------------------

cdef uint32_t NORM_URL_MARK = 0x1E800  # normalize.URL_MARK
cdef uint32_t NORM_EMAIL_MARK = 0x1E801  # normalize.EMAIL_MARK


cdef inline bint seen(uint64_t low, uint32_t c) noexcept nogil:
    """Did stage 1 write the character c (U+0020 to U+005F: `_chars`' record of them)?"""
    return (low >> (c - 0x20)) & 1


cdef int _one(NormalizeStages self, const ucs_t *data, Py_ssize_t n, TextBuffers &buffers, list texts,
              list latin_next_to_pinyin, Py_ssize_t index) except -1:
    """The stages of one text, appended to `texts` (and `index` to `latin_next_to_pinyin` when its Latin letters
    touch a pinyin code)."""
    cdef uint32_t bits
    cdef bint touching
    cdef Py_ssize_t size = _text(self, data, n, buffers.a, buffers.b, buffers.spans, &bits, &touching)
    texts.append(ucs4_str(buffers.a, 0, size, bits))
    if touching:
        latin_next_to_pinyin.append(index)
    return 0


cdef Py_ssize_t _text(NormalizeStages self, const ucs_t *data, Py_ssize_t n, vector[uint32_t] &a, vector[uint32_t] &b,
                      vector[Py_ssize_t] &spans, uint32_t *bits_out, bint *touching_out) except -1:
    """Every stage of one text (a joiner in it dropped) into `a`: its length returned. A pass runs only when stage 1
    wrote a character it acts on (URLs need `:` or `w`, e-mails `@`, domains `.`, spaced-out text a space...):
    none of the passes writes one of those that was not there before, but the URL masks' spaces."""
    cdef uint64_t low
    cdef Py_ssize_t size, end
    cdef uint32_t bits
    cdef bint masked = False
    if a.size() < <size_t>(n + 16):
        a.resize(n + 16)
    size = _chars(self, data, n, a, bits_out, &low, False)
    if b.size() < a.size():
        b.resize(a.size())
    if self.mask_urls:
        if seen(low, 0x3A) or seen(low, 0x2E):  # "://" or "www."
            spans.clear()
            _scheme_url_spans(<const uint32_t *>a.data(), size, spans)
            size = _masked(a, b, size, spans, NORM_URL_MARK, &masked)
        if seen(low, 0x40):  # @
            spans.clear()
            _email_spans(<const uint32_t *>a.data(), size, spans)
            size = _masked(a, b, size, spans, NORM_EMAIL_MARK, &masked)
        if seen(low, 0x2E):  # .
            spans.clear()
            _domain_spans(<const uint32_t *>a.data(), size, self.tlds, spans)
            size = _masked(a, b, size, spans, NORM_URL_MARK, &masked)
    if self.leet:
        if masked or seen(low, 0x20):
            spans.clear()
            _spaced_runs(<const uint32_t *>a.data(), size, spans)
            if spans.size():
                size = _joined_runs(a.data(), size, spans, b.data())
                a.swap(b)
        if seen(low, 0x21):
            _leet_symbol(a.data(), size, 0x21)
        if seen(low, 0x40):
            _leet_symbol(a.data(), size, 0x40)
        if seen(low, 0x24):
            _leet_symbol(a.data(), size, 0x24)
    if (self.leet or self.mask_numbers) and (low >> (0x30 - 0x20)) & 0x3FF:  # a digit
        end = nl_scan(<const uint32_t *>a.data(), size, self.leet, self.mask_numbers, &self.nl_units, b.data(), &bits)
        if end >= 0:
            size = end
            a.swap(b)
    return _words1(self, a.data(), size, bits_out, touching_out)


cdef Py_ssize_t _masked(vector[uint32_t] &a, vector[uint32_t] &b, Py_ssize_t n, vector[Py_ssize_t] &spans,
                        uint32_t mark, bint *masked) noexcept:
    """`normalize._replaced(a[:n], spans, f" {mark} ")` into `a` (through `b`); its length. A span is at least
    four characters (`x.co`), so the text never grows."""
    cdef Py_ssize_t k, q, pos = 0, j = 0
    if not spans.size():
        return n
    masked[0] = True
    for k in range(0, <Py_ssize_t>spans.size(), 2):
        for q in range(pos, spans[k]):
            b[j] = a[q]
            j += 1
        b[j] = 0x20
        b[j + 1] = mark
        b[j + 2] = 0x20
        j += 3
        pos = spans[k + 1]
    for q in range(pos, n):
        b[j] = a[q]
        j += 1
    a.swap(b)
    return j


cdef Py_ssize_t _joined_runs(const uint32_t *a, Py_ssize_t n, vector[Py_ssize_t] &spans, uint32_t *out) noexcept nogil:
    """`normalize._leet_symbols`'s joining of spaced-out runs (`_SPACED`, `_join_run`) of `a[:n]` at `spans`, into
    `out` (never longer): each spaced-out run (`_spaced_runs`) that `_join_run` joins has its one-space gaps removed and its wider ones made one space."""
    cdef Py_ssize_t k, q, g, start, end, pos = 0, j = 0, letters, symbols
    cdef bint leet
    cdef uint32_t c
    for k in range(0, <Py_ssize_t>spans.size(), 2):
        start, end = spans[k], spans[k + 1]
        for q in range(pos, start + 1):  # up to the run's first character (a space, line break; -1: none)
            out[j] = a[q]
            j += 1
        letters = symbols = 0
        leet = False
        for q in range(start + 1, end):
            c = a[q]
            if nl_lower(c):
                letters += 1
            elif c != 0x20:  # a digit or one of @$!
                leet = True
                symbols += c == 0x40 or c == 0x24 or c == 0x21
        if not letters or letters + symbols < 2 or not leet:
            for q in range(start + 1, end):
                out[j] = a[q]
                j += 1
        else:
            q = start + 1
            while q < end:
                if a[q] != 0x20:
                    out[j] = a[q]
                    j += 1
                    q += 1
                    continue
                g = q
                while a[g] == 0x20:
                    g += 1
                if g - q >= 2:
                    out[j] = 0x20
                    j += 1
                q = g
        pos = end
    for q in range(pos, n):
        out[j] = a[q]
        j += 1
    return j


cdef void _leet_symbol(uint32_t *a, Py_ssize_t n, uint32_t symbol) noexcept nogil:
    """One substitution of `normalize._leet_symbols` after its spaced-out runs, in place: `_LEET_BANG` (! → i),
    `_LEET_AT` (@ → a) or `_LEET_DOLLAR` ($ → s), in that order, each looking around at what the one before
    left (`prev` and `prev2` keep what this one replaced)."""
    cdef Py_ssize_t p
    cdef uint32_t c, prev = 0, prev2 = 0, after
    for p in range(n):
        c = a[p]
        if c == symbol:
            after = a[p + 1] if p + 1 < n else 0
            if symbol == 0x21:  # !(?:(?<=[a-z0-9]!)(?=[a-z@$])|(?<=[a-z]!)(?=[0-9]))
                if (nl_lower(prev) or nl_digit(prev)) and (nl_lower(after) or after == 0x40 or after == 0x24) \
                        or nl_lower(prev) and nl_digit(after):
                    a[p] = 0x69
            elif symbol == 0x40:  # @(?:(?<=[a-z]@)|(?<=[0-9]@)(?=[a-z]))
                if nl_lower(prev) or nl_digit(prev) and nl_lower(after):
                    a[p] = 0x61
            elif nl_lower(after) or (nl_lower(prev) or nl_digit(prev) and nl_lower(prev2)) \
                    and not (nl_lower(after) or nl_digit(after)):  # \$(?:(?=[a-z])|(?:(?<=[a-z]\$)|(?<=[a-z][0-9]\$))(?![0-9a-z]))
                a[p] = 0x73
        prev2 = prev
        prev = c


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
    cdef vector[Py_ssize_t] out
    if kind == 1:
        _spaced_runs(<const uint8_t *>data, n, out)
    elif kind == 2:
        _spaced_runs(<const uint16_t *>data, n, out)
    else:
        _spaced_runs(<const uint32_t *>data, n, out)
    return span_list(out)


cdef inline bint spaced_start(const ucs_t *d, Py_ssize_t i) noexcept nogil:
    """A space, line break or joiner at i, a token of `_SPACED` after it, a space after that."""
    cdef uint32_t c = d[i], t = d[i + 1]
    return (d[i + 2] == 0x20) & ((c == 0x20) | (c == 0x0A) | (c == 0x1E)) \
        & ((t - 0x61 <= 25) | (t - 0x30 <= 9) | (t == 0x40) | (t == 0x24) | (t == 0x21))


cdef int _spaced_runs(const ucs_t *data, Py_ssize_t n, vector[Py_ssize_t] &out) except -1:
    cdef Py_ssize_t i = -1, p, q, tokens, last_end, prev_end
    cdef uint32_t c
    while i + 1 < n:
        # A run's first token is followed by a space (else it is one token: as the loop below would find)
        if i >= 0:
            while True:
                # A space two places further and a space, line break or joiner here (a few more characters pass,
                # 0x28 and others, and fail below): one test a character, without the token's.
                if ucs_t is uint32_t:
                    if WIDE_LANES:  # (16 at a time, then the loop below stops at once)
                        i = nd_spaced_512(data, i, n)
                while i + 2 < n and ((data[i + 2] ^ 0x20) | (data[i] & ~0x2Au)) != 0 \
                        and (data[i] != 0x1E or data[i + 2] != 0x20):
                    i += 1
                if i + 2 >= n or spaced_start(data, i):
                    break
                i += 1
            if i + 2 >= n:
                break
        elif i + 2 >= n or data[i + 2] != 0x20 or not spaced_token(data[i + 1]):  # after the text's start
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
                out.push_back(i)
                out.push_back(last_end)
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


cdef vector[uint64_t] unit_keys(frozenset units) except *:
    """The words of `units` packed for `nl_unit` (at most 8 characters each; one with a character outside
    [a-z0-9] never matches a run of them, so it is left out)."""
    cdef vector[uint64_t] keys
    cdef uint64_t key
    for u in units:
        if len(u) > 8:
            raise ValueError(f"a unit of more than 8 characters: {u!r}")
        key = 0
        for ch in u:
            if not ("a" <= ch <= "z" or "0" <= ch <= "9"):
                key = 0
                break
            key = key << 8 | <uint64_t>ord(ch)
        if key:
            keys.push_back(key)
    cpp_sort(keys.begin(), keys.end())
    return keys


cdef inline bint nl_unit(const ucs_t *data, Py_ssize_t n, Py_ssize_t y, const NlUnits *units) noexcept nogil:
    """normalize._UNIT at y: its words are letters followed by no [a-z0-9], so it matches where the run of
    [a-z0-9] at y is one of them."""
    cdef Py_ssize_t e = y, longest = units.longest
    cdef uint64_t key = 0
    while e < n and e - y <= longest and (nl_lower(data[e]) or nl_digit(data[e])):
        key = key << 8 | data[e]
        e += 1
    return y < e and e - y <= longest and binary_search(units.keys, units.keys + units.count, key)


cdef Py_ssize_t nl_match(const ucs_t *data, Py_ssize_t n, Py_ssize_t p, const NlUnits *units, bint *leet) noexcept nogil:
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
            if y >= 0 and y < n and nl_lower(data[y]) and not nl_unit(data, n, y, units):
                return y
            break
    if not (p >= 1 and (nl_alnum(data[p - 1]) or data[p - 1] == 0x24)):  # (?<![^\W_][0-9])(?<!\$[0-9])
        y = x + 1 if x < n and nl_digit(data[x]) else x  # [0-9]?+
        if not (y < n and nl_digit(data[y])) and y < n and nl_lower(data[y]) \
                and not nl_unit(data, n, y, units):
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
    leet[0] = False
    return nl_number(data, n, x)


cdef inline Py_ssize_t nl_number(const ucs_t *data, Py_ssize_t n, Py_ssize_t y) noexcept nogil:
    """The end of a number whose first digit ends at y: [0-9]*+(?:SEP*+[0-9]++)*+ (normalize._NUMBER)."""
    cdef Py_ssize_t s
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
    cdef Py_ssize_t n = PyUnicode_GET_LENGTH(text), size
    cdef vector[uint64_t] keys = unit_keys(units)
    cdef NlUnits u = NlUnits(keys.data(), keys.size(), max([len(w) for w in units]) if units else 0)
    cdef vector[uint32_t] out
    cdef uint32_t bits = 0
    out.resize(n + 1)
    if kind == 1:
        size = nl_scan(<const uint8_t *>data, n, True, mask, &u, out.data(), &bits)
    elif kind == 2:
        size = nl_scan(<const uint16_t *>data, n, True, mask, &u, out.data(), &bits)
    else:
        size = nl_scan(<const uint32_t *>data, n, True, mask, &u, out.data(), &bits)
    return text if size < 0 else ucs4_str(out, 0, size, bits)


cdef uint32_t NL_NUMBER_MARK = 0x1E802  # normalize.NUMBER_MARK
cdef const char *NL_LEET_DIGITS = b"oizeasgtbg"  # normalize._LEET_DIGITS


cdef Py_ssize_t nl_scan(const ucs_t *data, Py_ssize_t n, bint leet_on, bint mask, const NlUnits *units,
                        uint32_t *out, uint32_t *bits_out) noexcept nogil:
    """Writes data[:n] with its numbers masked or read as leet to `out` (room for n: a number never grows) and
    returns the length, the OR of the code points in `bits_out`; -1 (nothing written) when there is no digit.
    Without `leet_on`, every number is `normalize._NUMBER`'s (the pattern's last alternative): masked or kept."""
    cdef Py_ssize_t i = 0, j = 0, end, q
    cdef uint32_t c, bits = 0
    cdef bint leet, found = False
    if ucs_t is uint32_t:
        if WIDE_LANES:  # the text before its first number
            i = nd_digit_512(data, 0, n)
    while i < n:
        c = data[i]
        if not nl_digit(c):
            i += 1
            continue
        if not found:  # the text before the first number, copied
            found = True
            for q in range(i):
                out[q] = data[q]
                bits |= data[q]
            j = i
        if leet_on:
            end = nl_match(data, n, i, units, &leet)
        else:
            end = nl_number(data, n, i + 1)
            leet = False
        if leet:
            for q in range(i, end):
                c = data[q]
                c = <uint32_t>NL_LEET_DIGITS[c - 0x30] if nl_digit(c) else c
                out[j] = c
                bits |= c
                j += 1
        elif mask:
            out[j] = NL_NUMBER_MARK  # (one code point for at least one)
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
    bits_out[0] = bits
    return j if found else -1


# -- where `normalize._SCHEME_URL` and `normalize._EMAIL` match (`finditer`'s spans) --------------------------
# `Normalizer._mask_urls` replaces them. The patterns ran from Python at each place a literal says one may start
# (each "://" three times: https, http, ftp): ≈ 4 µs a URL, most of it the calls.

def scheme_url_spans(str text):
    """`[m.span() for m in normalize._SCHEME_URL.finditer(text)]`: `(?:(?:https?|ftp)://|www\\.)\\S+`."""
    cdef int kind = PyUnicode_KIND(text)
    cdef void *data = PyUnicode_DATA(text)
    cdef Py_ssize_t n = PyUnicode_GET_LENGTH(text)
    cdef vector[Py_ssize_t] out
    if kind == 1:
        _scheme_url_spans(<const uint8_t *>data, n, out)
    elif kind == 2:
        _scheme_url_spans(<const uint16_t *>data, n, out)
    else:
        _scheme_url_spans(<const uint32_t *>data, n, out)
    return span_list(out)


cdef inline bint at_literal(const ucs_t *data, Py_ssize_t n, Py_ssize_t i, const char *literal, Py_ssize_t k) noexcept nogil:
    cdef Py_ssize_t j
    if i + k > n:
        return False
    for j in range(k):
        if data[i + j] != <uint8_t>literal[j]:
            return False
    return True


cdef int _scheme_url_spans(const ucs_t *data, Py_ssize_t n, vector[Py_ssize_t] &out) except -1:
    """From the `:` of each "://" and the `.` of each "www." (rare, where a letter is not): each of the pattern's
    literals holds one of them at a fixed place, and at most one literal holds a given one, so the literals
    found come in the order of their starts."""
    cdef Py_ssize_t q = 0, s, k, e
    cdef uint32_t c
    while q < n:
        if ucs_t is uint32_t:
            if WIDE_LANES:
                q = nd_find2_512(data, q, n, 0x3A, 0x2E)
                if q >= n:
                    break
        c = data[q]
        if c != 0x3A and c != 0x2E:
            q += 1
            continue
        s = k = 0
        if c == 0x3A:  # https:// http:// ftp://
            if q >= 5 and at_literal(data, n, q - 5, b"https://", 8):
                s, k = q - 5, 8
            elif q >= 4 and at_literal(data, n, q - 4, b"http://", 7):
                s, k = q - 4, 7
            elif q >= 3 and at_literal(data, n, q - 3, b"ftp://", 6):
                s, k = q - 3, 6
        elif q >= 3 and at_literal(data, n, q - 3, b"www.", 4):
            s, k = q - 3, 4
        if k and s + k < n and not Py_UNICODE_ISSPACE(data[s + k]):  # \S+
            e = s + k
            while e < n and not Py_UNICODE_ISSPACE(data[e]):
                e += 1
            out.push_back(s)
            out.push_back(e)
            q = e
        else:
            q += 1
    return 0


def email_spans(str text):
    """`[m.span() for m in normalize._EMAIL.finditer(text)]`: `(?<![\\w.+-])[\\w.+-]+@[\\w-]+(?:\\.[\\w-]+)+`."""
    cdef int kind = PyUnicode_KIND(text)
    cdef void *data = PyUnicode_DATA(text)
    cdef Py_ssize_t n = PyUnicode_GET_LENGTH(text)
    cdef vector[Py_ssize_t] out
    if kind == 1:
        _email_spans(<const uint8_t *>data, n, out)
    elif kind == 2:
        _email_spans(<const uint16_t *>data, n, out)
    else:
        _email_spans(<const uint32_t *>data, n, out)
    return span_list(out)


cdef inline bint email_host(uint32_t c) noexcept nogil:  # [\w-]
    return c == 0x2D or nl_word(c)


cdef inline bint email_local(uint32_t c) noexcept nogil:  # [\w.+-]
    return c == 0x2E or c == 0x2B or email_host(c)


cdef int _email_spans(const ucs_t *data, Py_ssize_t n, vector[Py_ssize_t] &out) except -1:
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
            out.push_back(p)
            out.push_back(e)
            pos = e
    return 0


def domain_spans(str text, tuple tlds):
    """`[m.span() for m in normalize._BARE_DOMAIN.finditer(text)]`, `tlds` the words of `normalize._TLDS` in its
    order: `\\b(?:[a-z0-9-]+\\.)+(?:TLD)\\b(?:/\\S*)?`."""
    cdef int kind = PyUnicode_KIND(text)
    cdef void *data = PyUnicode_DATA(text)
    cdef Py_ssize_t n = PyUnicode_GET_LENGTH(text)
    cdef vector[Py_ssize_t] out
    cdef bytes words = "\0".join(tlds).encode("ascii") + b"\0"  # each TLD ended by a NUL
    if kind == 1:
        _domain_spans(<const uint8_t *>data, n, words, out)
    elif kind == 2:
        _domain_spans(<const uint16_t *>data, n, words, out)
    else:
        _domain_spans(<const uint32_t *>data, n, words, out)
    return span_list(out)


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


cdef int _domain_spans(const ucs_t *data, Py_ssize_t n, const char *words, vector[Py_ssize_t] &out) except -1:
    """From dot to dot (dots are rare): a match's first label is the run of [a-z0-9-] before its first dot, and
    it starts at the first word boundary in that run (at any later one the rest is the same, and fails the same)."""
    cdef Py_ssize_t pos = 0, d = 0, i, e, q, end
    cdef vector[Py_ssize_t] dots  # after each `label.` of the match: where the next one (or the TLD) starts
    while True:
        if ucs_t is uint32_t:
            if WIDE_LANES:
                d = nd_find2_512(data, d, n, 0x2E, 0x2E)
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
        out.push_back(i)
        out.push_back(end)
        pos = d = end


# -- Latin letters between pinyin codes (`Normalizer._latin_pinyin`) ----------------------------------------

def latin_pinyin(str coded, dict segmented, miss, uint32_t code_lo, uint32_t code_hi):
    """`Normalizer._latin_pinyin(coded)`: each run of [a-z] (in pieces of at most 40, as `_LATIN_RUN` matches) with
    a pinyin syllable code (`code_lo` <= c < `code_hi`) right before or after it becomes its pinyin split, the
    one in `segmented` (its memo of splits: None for a run that is not pinyin, kept as it is), or what
    `miss(run)` gives (it splits the run and remembers it there); without a Python call per run."""
    cdef Py_ssize_t n = len(coded), i = 0, start, end, last = 0
    cdef int kind = PyUnicode_KIND(coded)
    cdef void *data = PyUnicode_DATA(coded)
    cdef uint32_t c, before, after
    cdef PyObject *held
    cdef list parts = None
    while i < n:
        c = PyUnicode_READ(kind, data, i)
        if c < 0x61 or c > 0x7A:
            i += 1
            continue
        start = i
        end = i + 1
        while end < n and end - start < 40:
            c = PyUnicode_READ(kind, data, end)
            if c < 0x61 or c > 0x7A:
                break
            end += 1
        i = end
        before = PyUnicode_READ(kind, data, start - 1) if start else 0
        after = PyUnicode_READ(kind, data, end) if end < n else 0
        if not (code_lo <= before < code_hi or code_lo <= after < code_hi):
            continue
        run = coded[start:end]
        held = PyDict_GetItemWithError(segmented, run)
        done = <object>held if held != NULL else miss(run)
        if not done:  # (not pinyin: kept)
            continue
        if parts is None:
            parts = []
        parts.append(coded[last:start])
        parts.append(done)
        last = end
    if parts is None:
        return coded
    parts.append(coded[last:])
    return "".join(parts)


def marker_candidates(list texts, str last, str first) -> list:
    """`normalize.marker_candidates`, compiled: the places of the texts whose last character is one of `last` or whose
    first is one of `first` (two characters read a text, no object made)."""
    cdef list out = []
    cdef Py_ssize_t k, n, i, n_last = len(last), n_first = len(first)
    cdef str t
    cdef Py_UCS4 c
    cdef Py_UCS4 lasts[16]
    cdef Py_UCS4 firsts[16]
    if n_last > 16 or n_first > 16:
        raise ValueError("at most 16 last and 16 first characters")
    for i in range(n_last):
        lasts[i] = last[i]
    for i in range(n_first):
        firsts[i] = first[i]
    for k in range(len(texts)):
        t = texts[k]
        n = len(t)
        if n == 0:
            continue
        c = t[n - 1]
        for i in range(n_last):
            if c == lasts[i]:
                out.append(k)
                break
        else:
            c = t[0]
            for i in range(n_first):
                if c == firsts[i]:
                    out.append(k)
                    break
    return out
