# The compiled n-gram kernel (included by filters/_native.pyx): the batch's exact hashes, bottom-k sketches
# and m-gram keys, as the reference filters/shingles.py and filters/fingerprint.py compute them.

# --- hashing --------------------------------------------------------------------------------------

cdef uint64_t MUL = 0x9E3779B97F4A7C15ULL
cdef uint32_t PAD = 0x100000  # the pad code point of shingles.Batch: texts shorter than n still give one n-gram
cdef int HASH_BITS = 44  # shingles._HASH_BITS: sketch precision before the top 32 bits are kept
cdef uint64_t MGRAM_TAG = 2ULL << 60
cdef uint64_t EXACT_TAG = 1ULL << 60
cdef uint64_t LOW60 = (1ULL << 60) - 1
cdef uint32_t WIDE = 0x2E80  # shingles._WIDE: wide characters (Han, kana, hangul, pinyin codes, placeholders) from here


cdef inline uint64_t mix64(uint64_t x) noexcept nogil:
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL
    return x ^ (x >> 31)


cdef inline uint64_t rotl64(uint64_t x, int r) noexcept nogil:
    return (x << r) | (x >> (64 - r))


cdef inline uint64_t fmix64(uint64_t k) noexcept nogil:
    k ^= k >> 33
    k *= 0xff51afd7ed558ccdULL
    k ^= k >> 33
    k *= 0xc4ceb9fe1a85ec53ULL
    k ^= k >> 33
    return k


cdef void murmur3_128(const uint8_t *data, Py_ssize_t n, uint32_t seed, uint64_t *lo, uint64_t *hi) noexcept nogil:
    """MurmurHash3_x64_128, as `mmh3.hash128(data, seed)`: that int is `hi << 64 | lo`."""
    cdef uint64_t h1 = seed, h2 = seed, k1, k2
    cdef uint64_t c1 = 0x87c37b91114253d5ULL, c2 = 0x4cf5ad432745937fULL
    cdef Py_ssize_t nblocks = n // 16, i
    cdef const uint8_t *tail
    for i in range(nblocks):
        memcpy(&k1, data + 16 * i, 8)
        memcpy(&k2, data + 16 * i + 8, 8)
        k1 *= c1; k1 = rotl64(k1, 31); k1 *= c2; h1 ^= k1
        h1 = rotl64(h1, 27); h1 += h2; h1 = h1 * 5 + 0x52dce729
        k2 *= c2; k2 = rotl64(k2, 33); k2 *= c1; h2 ^= k2
        h2 = rotl64(h2, 31); h2 += h1; h2 = h2 * 5 + 0x38495ab5
    tail = data + nblocks * 16
    k1 = 0
    k2 = 0
    cdef int rest = n & 15
    if rest >= 9:
        for i in range(rest - 1, 7, -1):
            k2 ^= (<uint64_t>tail[i]) << (8 * (i - 8))
        k2 *= c2; k2 = rotl64(k2, 33); k2 *= c1; h2 ^= k2
    if rest >= 1:
        for i in range(min(rest, 8) - 1, -1, -1):
            k1 ^= (<uint64_t>tail[i]) << (8 * i)
        k1 *= c1; k1 = rotl64(k1, 31); k1 *= c2; h1 ^= k1
    h1 ^= <uint64_t>n
    h2 ^= <uint64_t>n
    h1 += h2
    h2 += h1
    h1 = fmix64(h1)
    h2 = fmix64(h2)
    h1 += h2
    h2 += h1
    lo[0] = h1
    hi[0] = h2


def hash128(bytes data, uint32_t seed):
    """`mmh3.hash128(data, seed)`, for the tests."""
    cdef uint64_t lo, hi
    murmur3_128(<const uint8_t *>(<char *>data), len(data), seed, &lo, &hi)
    return (<object>hi) << 64 | lo


cdef extern from * nogil:
    """
    #include <stdint.h>
    #if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    #include <immintrin.h>
    /* `ngram_hashes` 8 positions at a time (AVX-512: 64-bit lanes, their products kept low as in C); returns how
       many positions it did, a multiple of 8: the caller does the rest. Compiled for these instructions only
       and called only where the processor has them (`nd_has_512`). */
    __attribute__((target("avx512f,avx512dq")))
    static Py_ssize_t nd_ngram_hashes_512(const uint32_t *cps, Py_ssize_t count, int n, uint64_t seedc,
                                          uint64_t *out) {
        const __m512i mul = _mm512_set1_epi64((long long)0x9E3779B97F4A7C15ULL);
        const __m512i m1 = _mm512_set1_epi64((long long)0xBF58476D1CE4E5B9ULL);
        const __m512i m2 = _mm512_set1_epi64((long long)0x94D049BB133111EBULL);
        const __m512i seed = _mm512_set1_epi64((long long)seedc);
        Py_ssize_t p = 0;
        for (; p + 8 <= count; p += 8) {
            __m512i h = seed;
            for (int j = 0; j < n; j++) {
                __m512i c = _mm512_cvtepu32_epi64(_mm256_loadu_si256((const __m256i *)(cps + p + j)));
                h = _mm512_mullo_epi64(_mm512_xor_si512(h, c), mul);
            }
            h = _mm512_mullo_epi64(_mm512_xor_si512(h, _mm512_srli_epi64(h, 30)), m1);
            h = _mm512_mullo_epi64(_mm512_xor_si512(h, _mm512_srli_epi64(h, 27)), m2);
            h = _mm512_xor_si512(h, _mm512_srli_epi64(h, 31));
            _mm512_storeu_si512((void *)(out + p), h);
        }
        return p;
    }
    /* The selections after hashing, 8 values at a time: `values[p] >> shift` of each `values[p] <= limit`
       (`nd_below_512`), `(values[p] >> 4) | tag` of each `values[p] & mask == 0` (`nd_sampled_512`), appended
       at out[*at] in order; each returns how many values it looked at (a multiple of 8). */
    __attribute__((target("avx512f,avx512dq")))
    static Py_ssize_t nd_below_512(const uint64_t *values, Py_ssize_t count, uint64_t limit, int shift,
                                   uint64_t *out, Py_ssize_t *at) {
        const __m512i lim = _mm512_set1_epi64((long long)limit);
        Py_ssize_t p = 0, q = *at;
        for (; p + 8 <= count; p += 8) {
            __m512i v = _mm512_loadu_si512((const void *)(values + p));
            __mmask8 keep = _mm512_cmple_epu64_mask(v, lim);
            _mm512_mask_compressstoreu_epi64((void *)(out + q), keep, _mm512_srli_epi64(v, (unsigned)shift));
            q += __builtin_popcount((unsigned)keep);
        }
        *at = q;
        return p;
    }
    __attribute__((target("avx512f,avx512dq")))
    static Py_ssize_t nd_sampled_512(const uint64_t *values, Py_ssize_t count, uint64_t mask, uint64_t tag,
                                     uint64_t *out, Py_ssize_t *at) {
        const __m512i m = _mm512_set1_epi64((long long)mask);
        const __m512i t = _mm512_set1_epi64((long long)tag);
        Py_ssize_t p = 0, q = *at;
        for (; p + 8 <= count; p += 8) {
            __m512i v = _mm512_loadu_si512((const void *)(values + p));
            __mmask8 keep = _mm512_testn_epi64_mask(v, m);
            _mm512_mask_compressstoreu_epi64((void *)(out + q), keep, _mm512_or_si512(_mm512_srli_epi64(v, 4), t));
            q += __builtin_popcount((unsigned)keep);
        }
        *at = q;
        return p;
    }
    static int nd_has_512(void) {
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
    }
    #else
    static Py_ssize_t nd_ngram_hashes_512(const uint32_t *cps, Py_ssize_t count, int n, uint64_t seedc,
                                          uint64_t *out) { (void)cps; (void)count; (void)n; (void)seedc; (void)out; return 0; }
    static Py_ssize_t nd_below_512(const uint64_t *values, Py_ssize_t count, uint64_t limit, int shift,
                                   uint64_t *out, Py_ssize_t *at) {
        (void)values; (void)count; (void)limit; (void)shift; (void)out; (void)at; return 0; }
    static Py_ssize_t nd_sampled_512(const uint64_t *values, Py_ssize_t count, uint64_t mask, uint64_t tag,
                                     uint64_t *out, Py_ssize_t *at) {
        (void)values; (void)count; (void)mask; (void)tag; (void)out; (void)at; return 0; }
    static int nd_has_512(void) { return 0; }
    #endif
    """
    Py_ssize_t nd_ngram_hashes_512(const uint32_t *cps, Py_ssize_t count, int n, uint64_t seedc, uint64_t *out)
    Py_ssize_t nd_below_512(const uint64_t *values, Py_ssize_t count, uint64_t limit, int shift, uint64_t *out,
                            Py_ssize_t *at)
    Py_ssize_t nd_sampled_512(const uint64_t *values, Py_ssize_t count, uint64_t mask, uint64_t tag, uint64_t *out,
                              Py_ssize_t *at)
    int nd_has_512()


# The processor's 512-bit lanes, where it has them: the n-gram hashes 8 at a time (a fact of the machine, read once).
cdef bint WIDE_LANES = nd_has_512()


cdef inline void ngram_hashes(const uint32_t *cps, Py_ssize_t length, int n, uint64_t seedc,
                              uint64_t *out, Py_ssize_t count, bint lanes=True) noexcept nogil:
    """The hash of every n-gram position of one text (`Batch.ngrams`): `cps` is followed by ≥ n - 1 pads.
    Eight positions at a time where the processor has 512-bit lanes (`lanes`: if so), then one at a time; the
    default sizes (shingles of 4, m-grams of 6) are written out: the loop over a gram's characters was half
    of the instructions of the whole hashing."""
    cdef Py_ssize_t p, start = 0
    cdef int j
    cdef uint64_t h
    if lanes and WIDE_LANES:
        start = nd_ngram_hashes_512(cps, count, n, seedc, out)
    if n == 4:
        for p in range(start, count):
            h = (seedc ^ cps[p]) * MUL
            h = (h ^ cps[p + 1]) * MUL
            h = (h ^ cps[p + 2]) * MUL
            out[p] = mix64((h ^ cps[p + 3]) * MUL)
    elif n == 6:
        for p in range(start, count):
            h = (seedc ^ cps[p]) * MUL
            h = (h ^ cps[p + 1]) * MUL
            h = (h ^ cps[p + 2]) * MUL
            h = (h ^ cps[p + 3]) * MUL
            h = (h ^ cps[p + 4]) * MUL
            out[p] = mix64((h ^ cps[p + 5]) * MUL)
    else:
        for p in range(start, count):
            h = seedc
            for j in range(n):
                h = (h ^ cps[p + j]) * MUL
            out[p] = mix64(h)


def gram_hashes(list code_points, int n, uint64_t seed, bint lanes) -> list:
    """`ngram_hashes` of a text's code points (pads after them), with the 512-bit lanes where the processor has
    them (`lanes`) or one position at a time: the same values, for the tests."""
    cdef Py_ssize_t length = len(code_points), count = length - n + 1 if length - n + 1 > 1 else 1, i
    cdef vector[uint32_t] cps
    cdef vector[uint64_t] out
    cps.resize(length + n + 8, PAD)
    for i in range(length):
        cps[i] = code_points[i]
    out.resize(count)
    ngram_hashes(cps.data(), length, n, mix64(seed + <uint64_t>n) | 1, out.data(), count, lanes)
    return [out[i] for i in range(count)]


def wide_lanes() -> bool:
    """Whether the n-gram hashes run on 512-bit lanes here."""
    return WIDE_LANES


cdef Py_ssize_t utf8_encode(const uint32_t *cps, Py_ssize_t length, uint8_t *out) noexcept nogil:
    """The UTF-8 of `length` code points into `out` (room for 4 bytes each); how many bytes. A surrogate is
    encoded as any code point of its range, which is what `str.encode("utf-8", "surrogatepass")` does."""
    cdef Py_ssize_t i, j = 0
    cdef uint32_t c
    for i in range(length):
        c = cps[i]
        if c < 0x80:
            out[j] = <uint8_t>c
            j += 1
        elif c < 0x800:
            out[j] = <uint8_t>(0xC0 | (c >> 6))
            out[j + 1] = <uint8_t>(0x80 | (c & 0x3F))
            j += 2
        elif c < 0x10000:
            out[j] = <uint8_t>(0xE0 | (c >> 12))
            out[j + 1] = <uint8_t>(0x80 | ((c >> 6) & 0x3F))
            out[j + 2] = <uint8_t>(0x80 | (c & 0x3F))
            j += 3
        else:
            out[j] = <uint8_t>(0xF0 | (c >> 18))
            out[j + 1] = <uint8_t>(0x80 | ((c >> 12) & 0x3F))
            out[j + 2] = <uint8_t>(0x80 | ((c >> 6) & 0x3F))
            out[j + 3] = <uint8_t>(0x80 | (c & 0x3F))
            j += 4
    return j


cdef inline void copy_code_points(str text, Py_ssize_t length, uint32_t *out) noexcept:
    """`text`'s `length` code points into `out`, by the width the string stores them in (no per-character
    dispatch on it)."""
    cdef int kind = PyUnicode_KIND(text)
    cdef const void *data = PyUnicode_DATA(text)
    cdef Py_ssize_t j
    if kind == PyUnicode_1BYTE_KIND:
        for j in range(length):
            out[j] = (<const uint8_t *>data)[j]
    elif kind == PyUnicode_2BYTE_KIND:
        for j in range(length):
            out[j] = (<const uint16_t *>data)[j]
    else:
        memcpy(out, data, length * sizeof(uint32_t))


# --- the batch kernel -------------------------------------------------------------------------------

cdef class Shingled:
    """One batch of normalized texts, hashed: per text the 128-bit exact hash, the bottom-k sketch
    (top 32 bits, sorted), the estimated number of distinct shingles, the sampled m-gram keys (then the wide
    m-grams of a short text), the bucket keys in the configured order (exact and m-gram keys, without
    repeats), and the code points of a short text (`FilterConfig.short_text`; none for a longer one)."""

    cdef Py_ssize_t n
    cdef uint64_t *exact_lo
    cdef uint64_t *exact_hi
    cdef int64_t *size
    cdef uint32_t *sketch
    cdef Py_ssize_t *sk_start
    cdef uint64_t *mgram
    cdef Py_ssize_t *mg_start
    cdef uint64_t *keys
    cdef Py_ssize_t *key_start
    cdef uint32_t *chars
    cdef Py_ssize_t *ch_start

    def __cinit__(self):
        self.n = 0

    def __dealloc__(self):
        PyMem_Free(self.exact_lo); PyMem_Free(self.exact_hi); PyMem_Free(self.size)
        PyMem_Free(self.sketch); PyMem_Free(self.sk_start); PyMem_Free(self.mgram)
        PyMem_Free(self.mg_start); PyMem_Free(self.keys); PyMem_Free(self.key_start)
        PyMem_Free(self.chars); PyMem_Free(self.ch_start)

    def __len__(self):
        return self.n

    def exacts(self) -> list:
        return [(<object>self.exact_hi[i]) << 64 | self.exact_lo[i] for i in range(self.n)]

    def sizes(self) -> list:
        return [self.size[i] for i in range(self.n)]

    def sketches(self) -> list:
        """One sorted uint32 array per text (a copy each: an entry keeps only its own)."""
        return [self._sketch(i) for i in range(self.n)]

    cdef object _sketch(self, Py_ssize_t i):
        """Text i's sketch as its own uint32 array."""
        cdef Py_ssize_t a = self.sk_start[i], b = self.sk_start[i + 1]
        cdef uint32_t[::1] view
        np = np_()
        sketch = np.empty(b - a, dtype=np.uint32)
        if b > a:
            view = sketch
            memcpy(&view[0], self.sketch + a, (b - a) * sizeof(uint32_t))
        return sketch

    def mgram_keys(self) -> tuple:
        """(every text's sampled m-gram keys end to end, bounds): text i has [bounds[i], bounds[i+1])."""
        flat = [self.mgram[j] for j in range(self.mg_start[self.n])]
        return flat, [self.mg_start[i] for i in range(self.n + 1)]

    def bucket_keys(self) -> list:
        return [tuple([self.keys[j] for j in range(self.key_start[i], self.key_start[i + 1])])
                for i in range(self.n)]

    def fingerprints(self, list normalized, make) -> list:
        """`make(normalized, exact, size, sketch, keys, None, None, frozenset(), chars)` per text: the
        `Fingerprint`s of exact and m-gram bucket keys, without a Python step per text (each sketch its own
        copy, as an entry keeps it; `chars` the normalized text when it is short, else "")."""
        if len(normalized) != self.n:
            raise ValueError("normalized texts and the hashed batch differ in length")
        cdef Py_ssize_t i, j
        out = []
        for i in range(self.n):
            sketch = self._sketch(i)
            keys = PyTuple_New(self.key_start[i + 1] - self.key_start[i])
            for j in range(self.key_start[i], self.key_start[i + 1]):
                value = PyLong_FromUnsignedLongLong(self.keys[j])
                Py_INCREF(value)
                PyTuple_SET_ITEM(keys, j - self.key_start[i], value)
            text = normalized[i]
            out.append(make(text, (<object>self.exact_hi[i]) << 64 | self.exact_lo[i], self.size[i],
                            sketch, keys, None, None, NO_SENTENCES,
                            text if self.ch_start[i + 1] > self.ch_start[i] else ""))
        return out


def shingle(list texts, int n, int k, int m, int target, uint64_t seed, int exact_at, bint with_mgram,
            int short_m, Py_ssize_t short_keys, Py_ssize_t short_text):
    """Hash a batch of normalized texts (see `Shingled`): n-grams of `n` for the bottom-`k` sketch,
    m-grams of `m` sampled to about `target` keys (none when `target` is 0) and, in texts of at most
    `short_keys` characters, every `short_m`-gram of wide characters; the exact hash with the low 32 bits
    of `seed`. Bucket keys: the exact key at position `exact_at` (0 first, 1 after the m-gram keys, -1
    none), the m-gram keys when `with_mgram`. The code points of texts of at most `short_text` characters
    (and at least one) are kept."""
    cdef Py_ssize_t count = len(texts), i, total_cps = 0, length, max_len = 1, mg_cap = 0, p, j, c
    cdef Py_ssize_t short_cps = 0
    cdef Py_ssize_t width = max(n, m, short_m)
    cdef Shingled out = Shingled()
    cdef Py_ssize_t *cp_start = <Py_ssize_t *>PyMem_Malloc((count + 1) * sizeof(Py_ssize_t))
    cdef Py_ssize_t *lengths = <Py_ssize_t *>PyMem_Malloc((count + 1) * sizeof(Py_ssize_t))
    cdef const char **utf8 = <const char **>PyMem_Malloc((count + 1) * sizeof(char *))
    cdef Py_ssize_t *utf8_len = <Py_ssize_t *>PyMem_Malloc((count + 1) * sizeof(Py_ssize_t))
    cdef uint32_t *cps = NULL
    cdef uint64_t *hashes = NULL
    cdef uint64_t *kept = NULL
    cdef uint64_t *scratch = NULL
    cdef uint32_t *counts = NULL
    cdef str text
    cdef uint8_t *wide_utf8 = NULL  # the UTF-8 of the texts that are not ASCII, end to end
    cdef Py_ssize_t wide_cps = 0, u = 0
    try:
        if not cp_start or not lengths or not utf8 or not utf8_len:
            raise MemoryError()
        for i in range(count):
            text = texts[i]
            length = len(text)
            lengths[i] = length
            cp_start[i] = total_cps
            total_cps += length + width
            if length > max_len:
                max_len = length
            mg_cap += max(length - m + 1, 1)
            if length <= short_keys:
                mg_cap += max(length - short_m + 1, 0)
            if length <= short_text:
                short_cps += length
            if not PyUnicode_IS_ASCII(text):
                wide_cps += length
        cps = <uint32_t *>PyMem_Malloc((total_cps + 1) * sizeof(uint32_t))
        wide_utf8 = <uint8_t *>PyMem_Malloc(4 * wide_cps + 1)
        hashes = <uint64_t *>PyMem_Malloc((max_len + 1) * sizeof(uint64_t))
        kept = <uint64_t *>PyMem_Malloc((max_len + 1) * sizeof(uint64_t))
        scratch = <uint64_t *>PyMem_Malloc((max_len + 1) * sizeof(uint64_t))
        counts = <uint32_t *>PyMem_Malloc((SORT_BUCKETS_MAX + 1) * sizeof(uint32_t))
        out.exact_lo = <uint64_t *>PyMem_Malloc((count + 1) * sizeof(uint64_t))
        out.exact_hi = <uint64_t *>PyMem_Malloc((count + 1) * sizeof(uint64_t))
        out.size = <int64_t *>PyMem_Malloc((count + 1) * sizeof(int64_t))
        out.sketch = <uint32_t *>PyMem_Malloc((count * k + 1) * sizeof(uint32_t))
        out.sk_start = <Py_ssize_t *>PyMem_Malloc((count + 1) * sizeof(Py_ssize_t))
        out.mgram = <uint64_t *>PyMem_Malloc((mg_cap + 1) * sizeof(uint64_t))
        out.mg_start = <Py_ssize_t *>PyMem_Malloc((count + 1) * sizeof(Py_ssize_t))
        out.keys = <uint64_t *>PyMem_Malloc((mg_cap + count + 1) * sizeof(uint64_t))
        out.key_start = <Py_ssize_t *>PyMem_Malloc((count + 1) * sizeof(Py_ssize_t))
        out.chars = <uint32_t *>PyMem_Malloc((short_cps + 1) * sizeof(uint32_t))
        out.ch_start = <Py_ssize_t *>PyMem_Malloc((count + 1) * sizeof(Py_ssize_t))
        if (not cps or not wide_utf8 or not hashes or not kept or not scratch or not counts or not out.exact_lo or not out.exact_hi or not out.size
                or not out.sketch or not out.sk_start or not out.mgram or not out.mg_start or not out.keys
                or not out.key_start or not out.chars or not out.ch_start):
            raise MemoryError()
        out.n = count
        c = 0
        for i in range(count):  # filled in below, with the code points
            out.ch_start[i] = c
            if lengths[i] <= short_text:
                c += lengths[i]
        out.ch_start[count] = c
        for i in range(count):
            text = texts[i]
            p = cp_start[i]
            copy_code_points(text, lengths[i], cps + p)
            p += lengths[i]
            for j in range(width):
                cps[p + j] = PAD
            if out.ch_start[i + 1] > out.ch_start[i]:
                memcpy(out.chars + out.ch_start[i], cps + cp_start[i], lengths[i] * sizeof(uint32_t))
            if PyUnicode_IS_ASCII(text):  # its own bytes are its UTF-8
                utf8[i] = <const char *>PyUnicode_DATA(text)
                utf8_len[i] = lengths[i]
            else:  # encoded from its code points here: str's encoder keeps a copy on the str, and is slower
                utf8[i] = <const char *>(wide_utf8 + u)
                utf8_len[i] = utf8_encode(cps + cp_start[i], lengths[i], wide_utf8 + u)
                u += utf8_len[i]
        with nogil:
            _hash_batch(out, cps, cp_start, lengths, utf8, utf8_len, hashes, kept, scratch, counts, n, k, m, target, seed,
                        exact_at, with_mgram, short_m, short_keys)
        return out
    finally:
        PyMem_Free(cp_start); PyMem_Free(lengths); PyMem_Free(utf8); PyMem_Free(utf8_len)
        PyMem_Free(cps); PyMem_Free(hashes); PyMem_Free(kept); PyMem_Free(scratch); PyMem_Free(counts)
        PyMem_Free(wide_utf8)


cdef enum:
    # Buckets of `sort_hashes`: more values than this are left to std::sort. A text keeps about 3k = 384 hashes
    # (and at most 3k when it has fewer n-grams); the bound caps the insertion sort's worst case (a few
    # repeated shingles whose hashes share a bucket, interleaved) at ≈ 0.25M moves.
    SORT_BUCKETS_MAX = 1024


cdef void sort_hashes(uint64_t *values, Py_ssize_t q, uint64_t top, uint64_t *scratch,
                      uint32_t *counts) noexcept nogil:
    """values[:q] (each at most `top`) sorted ascending, as std::sort sorts them. They are hashes below a limit,
    spread evenly under `top`: one counting pass by their top bits puts them in about as many buckets as
    there are values, in bucket order, and an insertion sort finishes the few in each bucket. std::sort's
    comparisons of random hashes are mispredicted half the time (it was a seventh of `neardup filter`'s
    CPU). `scratch` holds q values, `counts` SORT_BUCKETS_MAX + 1."""
    cdef Py_ssize_t i, j, buckets = 1
    cdef int shift = 0
    cdef uint64_t v
    if q <= 16 or q > SORT_BUCKETS_MAX:
        cpp_sort(values, values + q)
        return
    while buckets < q:
        buckets *= 2
    while (top >> shift) >= <uint64_t>buckets:
        shift += 1
    memset(counts, 0, (buckets + 1) * sizeof(uint32_t))
    for i in range(q):
        counts[(values[i] >> shift) + 1] += 1
    for i in range(buckets):
        counts[i + 1] += counts[i]
    for i in range(q):
        v = values[i]
        scratch[counts[v >> shift]] = v
        counts[v >> shift] += 1
    values[0] = scratch[0]
    for i in range(1, q):  # in bucket order already: each value moves past the few of its bucket before it
        v = scratch[i]
        j = i
        while j > 0 and values[j - 1] > v:
            values[j] = values[j - 1]
            j -= 1
        values[j] = v


def sorted_hashes(list values, uint64_t top) -> list:
    """`sort_hashes` of `values` (each at most `top`), for the tests."""
    cdef Py_ssize_t i, q = len(values)
    cdef vector[uint64_t] held, scratch
    cdef vector[uint32_t] counts
    held.resize(q + 1)
    scratch.resize(q + 1)
    counts.resize(SORT_BUCKETS_MAX + 1)
    for i in range(q):
        held[i] = values[i]
        if held[i] > top:
            raise ValueError("a value above top")
    sort_hashes(held.data(), q, top, scratch.data(), counts.data())
    return [held[i] for i in range(q)]


cdef inline Py_ssize_t add_new(uint64_t *keys, Py_ssize_t start, Py_ssize_t end, uint64_t v) noexcept nogil:
    """Appends `v` to keys[start:end] unless it is there already; returns the new end."""
    cdef Py_ssize_t j
    for j in range(start, end):
        if keys[j] == v:
            return end
    keys[end] = v
    return end + 1


cdef Py_ssize_t wide_gram_keys(const uint32_t *text, Py_ssize_t length, int m, uint64_t seedc, uint64_t *keys,
                               Py_ssize_t at) noexcept nogil:
    """A short text's m-grams of wide characters as m-gram keys (`Batch.wide_grams`), written from keys[at];
    returns the new end. Apart from `_hash_batch` (not inlined into it) so that its loops stay as they were."""
    cdef Py_ssize_t p, j
    cdef uint64_t h
    for p in range(length - m + 1):
        h = seedc
        for j in range(m):
            if text[p + j] < WIDE:
                break
            h = (h ^ text[p + j]) * MUL
        else:
            keys[at] = (mix64(h) >> 4) | MGRAM_TAG
            at += 1
    return at


cdef void _hash_batch(Shingled out, const uint32_t *cps, const Py_ssize_t *cp_start, const Py_ssize_t *lengths,
                      const char **utf8, const Py_ssize_t *utf8_len, uint64_t *hashes, uint64_t *kept,
                      uint64_t *scratch, uint32_t *counts,
                      int n, int k, int m, int target, uint64_t seed, int exact_at, bint with_mgram,
                      int short_m, Py_ssize_t short_keys) noexcept nogil:
    cdef uint64_t seed_n = mix64(seed + <uint64_t>n) | 1
    cdef uint64_t seed_m = mix64(seed + <uint64_t>m) | 1
    cdef uint64_t seed_s = mix64(seed + <uint64_t>short_m) | 1
    cdef uint32_t seed32 = <uint32_t>(seed & 0xFFFFFFFFULL)
    cdef Py_ssize_t i, count, p, distinct, sk = 0, mg = 0, kk = 0, start, j, q
    cdef double keep, fraction
    cdef uint64_t limit, rate, v, exact_key
    cdef const uint32_t *text
    for i in range(out.n):
        text = cps + cp_start[i]
        # The exact fast path: 128-bit hash of the normalized text's UTF-8.
        murmur3_128(<const uint8_t *>utf8[i], utf8_len[i], seed32, &out.exact_lo[i], &out.exact_hi[i])
        # Bottom-k sketch (`Batch.sketches`): only hashes under a per-text limit are sorted at all.
        count = lengths[i] - n + 1 if lengths[i] - n + 1 > 1 else 1
        ngram_hashes(text, lengths[i], n, seed_n, hashes, count)
        keep = (3.0 * k) / <double>count
        if keep > 1.0:
            keep = 1.0
        if keep >= 1.0:
            limit = 0xFFFFFFFFFFFFFFFFULL
        else:
            fraction = keep if keep < 0.999 else 0.999
            limit = <uint64_t>(fraction * 18446744073709551616.0)
        q = 0
        start = nd_below_512(hashes, count, limit, 64 - HASH_BITS, kept, &q) if WIDE_LANES else 0
        for p in range(start, count):  # without a branch: which hashes pass is random, a branch mispredicts
            kept[q] = hashes[p] >> (64 - HASH_BITS)
            q += hashes[p] <= limit
        sort_hashes(kept, q, limit >> (64 - HASH_BITS), scratch, counts)
        distinct = 0
        out.sk_start[i] = sk
        p = 0
        while p < q and distinct < k:  # the first k distinct values: the sketch
            if p == 0 or kept[p] != kept[p - 1]:
                out.sketch[sk] = <uint32_t>(kept[p] >> (HASH_BITS - 32))
                sk += 1
                distinct += 1
            p += 1
        if p == 0 and q > 0:  # (k == 0: the first value is still one)
            distinct = 1
            p = 1
        for j in range(p, q):  # the rest are only counted, without a branch
            distinct += kept[j] != kept[j - 1]
        if keep >= 1.0:
            out.size[i] = distinct
        else:
            out.size[i] = <int64_t>rint(<double>distinct / keep)
        # m-gram keys (`Batch.samples`): rate 1/2^j, the smallest that leaves < 2 * target of them.
        out.mg_start[i] = mg
        if target > 0:
            count = lengths[i] - m + 1 if lengths[i] - m + 1 > 1 else 1
            ngram_hashes(text, lengths[i], m, seed_m, hashes, count)
            rate = 1
            while <uint64_t>count >= 2 * rate * <uint64_t>target:
                rate *= 2
            start = nd_sampled_512(hashes, count, rate - 1, MGRAM_TAG, out.mgram, &mg) if WIDE_LANES else 0
            for p in range(start, count):  # (without a branch, as above: out.mgram has room for one per position)
                v = hashes[p]
                out.mgram[mg] = (v >> 4) | MGRAM_TAG
                mg += (v & (rate - 1)) == 0
            if short_m <= lengths[i] <= short_keys:
                mg = wide_gram_keys(text, lengths[i], short_m, seed_s, out.mgram, mg)
        # Bucket keys in the configured order, first occurrence kept (`tuple(dict.fromkeys(keys))`).
        out.key_start[i] = kk
        start = kk
        exact_key = EXACT_TAG | ((out.exact_lo[i] ^ out.exact_hi[i]) & LOW60)
        if exact_at == 0:
            kk = add_new(out.keys, start, kk, exact_key)
        if with_mgram:
            for p in range(out.mg_start[i], mg):
                kk = add_new(out.keys, start, kk, out.mgram[p])
        if exact_at == 1:
            kk = add_new(out.keys, start, kk, exact_key)
    out.sk_start[out.n] = sk
    out.mg_start[out.n] = mg
    out.key_start[out.n] = kk

