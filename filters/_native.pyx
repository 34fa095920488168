# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# distutils: language = c++
"""The compiled hot path of the embedded filter: n-gram sketches, m-gram samples, the exact hash, and the
memory index's table with its look up → verify → insert loop.

Everything here computes bit for bit what the numpy/Python reference computes (`filters/shingles.py`,
`filters/index.py` `PyTable`, `filters/engine.py` verification); `tests/test_native.py` proves it on
the development stream and with hypothesis. The reference stays the specification and the fallback
where no compiler was available at install time.

Why compiled: per short message the reference spends ≈ 30 µs in Python bookkeeping (a `Fingerprint`, a
`Counter`, `Candidate` and `Entry` records, dict probes); the work itself is ≈ 2 µs of hashing and a
few hundred memory reads. Memory comes from `PyMem_Malloc`, so tracemalloc (bench/filter_bench.py) sees it.
"""

from cpython.bytearray cimport PyByteArray_AS_STRING
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.object cimport PyObject_Hash
from cpython.ref cimport Py_DECREF, Py_INCREF, PyObject
from libc.math cimport ceil, floor, rint
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memmove, memset
from libcpp.algorithm cimport sort as cpp_sort

import builtins
import inspect
from sys import intern as sys_intern

import numpy as np

py_round = builtins.round  # verdicts carry Python's round(similarity, 4), digit for digit
cdef frozenset NO_SENTENCES = frozenset()

cdef extern from "Python.h":
    const char *PyUnicode_AsUTF8AndSize(object unicode, Py_ssize_t *size) except NULL
    object PyTuple_New(Py_ssize_t n)
    void PyTuple_SET_ITEM(object p, Py_ssize_t pos, object o)
    object PyLong_FromUnsignedLongLong(unsigned long long v)

    object PyBytes_FromStringAndSize(const char *v, Py_ssize_t len)
    char *PyBytes_AS_STRING(object o)
    object PyList_New(Py_ssize_t n)
    void PyList_SET_ITEM(object p, Py_ssize_t pos, object o)


# --- hashing --------------------------------------------------------------------------------------

cdef uint64_t MUL = 0x9E3779B97F4A7C15ULL
cdef uint32_t PAD = 0x100000  # the pad code point of shingles.Batch: texts shorter than n still give one n-gram
cdef int HASH_BITS = 44  # shingles._HASH_BITS: sketch precision before the top 32 bits are kept
cdef uint64_t MGRAM_TAG = 2ULL << 60
cdef uint64_t EXACT_TAG = 1ULL << 60
cdef uint64_t LOW60 = (1ULL << 60) - 1


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


cdef inline void ngram_hashes(const uint32_t *cps, Py_ssize_t length, int n, uint64_t seedc,
                              uint64_t *out, Py_ssize_t count) noexcept nogil:
    """The hash of every n-gram position of one text (`Batch.ngrams`): `cps` is followed by ≥ n - 1 pads."""
    cdef Py_ssize_t p
    cdef int j
    cdef uint64_t h
    for p in range(count):
        h = seedc
        for j in range(n):
            h = (h ^ cps[p + j]) * MUL
        out[p] = mix64(h)


# --- the batch kernel -------------------------------------------------------------------------------

cdef class Shingled:
    """One batch of normalized texts, hashed: per text the 128-bit exact hash, the bottom-k sketch
    (top 32 bits, sorted), the estimated number of distinct shingles, the sampled m-gram keys, and the
    bucket keys in the configured order (exact and m-gram keys, without repeats)."""

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

    def __cinit__(self):
        self.n = 0

    def __dealloc__(self):
        PyMem_Free(self.exact_lo); PyMem_Free(self.exact_hi); PyMem_Free(self.size)
        PyMem_Free(self.sketch); PyMem_Free(self.sk_start); PyMem_Free(self.mgram)
        PyMem_Free(self.mg_start); PyMem_Free(self.keys); PyMem_Free(self.key_start)

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
        """`make(normalized, exact, size, sketch, keys, None, None, frozenset())` per text: the `Fingerprint`s
        of exact and m-gram bucket keys, without a Python step per text (each sketch its own copy, as an entry keeps it)."""
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
            out.append(make(normalized[i], (<object>self.exact_hi[i]) << 64 | self.exact_lo[i], self.size[i],
                            sketch, keys, None, None, NO_SENTENCES))
        return out


def shingle(list texts, int n, int k, int m, int target, uint64_t seed, int exact_at, bint with_mgram):
    """Hash a batch of normalized texts (see `Shingled`): n-grams of `n` for the bottom-`k` sketch,
    m-grams of `m` sampled to about `target` keys (none when `target` is 0), the exact hash with the
    low 32 bits of `seed`. Bucket keys: the exact key at position `exact_at` (0 first, 1 after the
    m-gram keys, -1 none), the m-gram keys when `with_mgram`."""
    cdef Py_ssize_t count = len(texts), i, total_cps = 0, length, max_len = 1, mg_cap = 0, p, j, c
    cdef Py_ssize_t width = max(n, m)
    cdef Shingled out = Shingled()
    cdef Py_ssize_t *cp_start = <Py_ssize_t *>PyMem_Malloc((count + 1) * sizeof(Py_ssize_t))
    cdef Py_ssize_t *lengths = <Py_ssize_t *>PyMem_Malloc((count + 1) * sizeof(Py_ssize_t))
    cdef const char **utf8 = <const char **>PyMem_Malloc((count + 1) * sizeof(char *))
    cdef Py_ssize_t *utf8_len = <Py_ssize_t *>PyMem_Malloc((count + 1) * sizeof(Py_ssize_t))
    cdef uint32_t *cps = NULL
    cdef uint64_t *hashes = NULL
    cdef uint64_t *kept = NULL
    cdef Py_UCS4 ch
    cdef str text
    keep_alive = []  # surrogate-carrying texts' UTF-8 (surrogatepass), alive until the hashing is done
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
        cps = <uint32_t *>PyMem_Malloc((total_cps + 1) * sizeof(uint32_t))
        hashes = <uint64_t *>PyMem_Malloc((max_len + 1) * sizeof(uint64_t))
        kept = <uint64_t *>PyMem_Malloc((max_len + 1) * sizeof(uint64_t))
        out.exact_lo = <uint64_t *>PyMem_Malloc((count + 1) * sizeof(uint64_t))
        out.exact_hi = <uint64_t *>PyMem_Malloc((count + 1) * sizeof(uint64_t))
        out.size = <int64_t *>PyMem_Malloc((count + 1) * sizeof(int64_t))
        out.sketch = <uint32_t *>PyMem_Malloc((count * k + 1) * sizeof(uint32_t))
        out.sk_start = <Py_ssize_t *>PyMem_Malloc((count + 1) * sizeof(Py_ssize_t))
        out.mgram = <uint64_t *>PyMem_Malloc((mg_cap + 1) * sizeof(uint64_t))
        out.mg_start = <Py_ssize_t *>PyMem_Malloc((count + 1) * sizeof(Py_ssize_t))
        out.keys = <uint64_t *>PyMem_Malloc((mg_cap + count + 1) * sizeof(uint64_t))
        out.key_start = <Py_ssize_t *>PyMem_Malloc((count + 1) * sizeof(Py_ssize_t))
        if (not cps or not hashes or not kept or not out.exact_lo or not out.exact_hi or not out.size
                or not out.sketch or not out.sk_start or not out.mgram or not out.mg_start or not out.keys
                or not out.key_start):
            raise MemoryError()
        out.n = count
        for i in range(count):
            text = texts[i]
            p = cp_start[i]
            for ch in text:
                cps[p] = ch
                p += 1
            for j in range(width):
                cps[p + j] = PAD
            try:
                utf8[i] = PyUnicode_AsUTF8AndSize(text, &utf8_len[i])
            except UnicodeEncodeError:  # lone surrogates: hashed as "surrogatepass" encodes them
                data = text.encode("utf-8", "surrogatepass")
                keep_alive.append(data)
                utf8[i] = <const char *>(<bytes>data)
                utf8_len[i] = len(<bytes>data)
        with nogil:
            _hash_batch(out, cps, cp_start, lengths, utf8, utf8_len, hashes, kept, n, k, m, target, seed,
                        exact_at, with_mgram)
        return out
    finally:
        PyMem_Free(cp_start); PyMem_Free(lengths); PyMem_Free(utf8); PyMem_Free(utf8_len)
        PyMem_Free(cps); PyMem_Free(hashes); PyMem_Free(kept)


cdef inline Py_ssize_t add_new(uint64_t *keys, Py_ssize_t start, Py_ssize_t end, uint64_t v) noexcept nogil:
    """Appends `v` to keys[start:end] unless it is there already; returns the new end."""
    cdef Py_ssize_t j
    for j in range(start, end):
        if keys[j] == v:
            return end
    keys[end] = v
    return end + 1


cdef void _hash_batch(Shingled out, const uint32_t *cps, const Py_ssize_t *cp_start, const Py_ssize_t *lengths,
                      const char **utf8, const Py_ssize_t *utf8_len, uint64_t *hashes, uint64_t *kept,
                      int n, int k, int m, int target, uint64_t seed, int exact_at, bint with_mgram) noexcept nogil:
    cdef uint64_t seed_n = mix64(seed + <uint64_t>n) | 1
    cdef uint64_t seed_m = mix64(seed + <uint64_t>m) | 1
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
        for p in range(count):
            if hashes[p] <= limit:
                kept[q] = hashes[p] >> (64 - HASH_BITS)
                q += 1
        cpp_sort(kept, kept + q)
        distinct = 0
        out.sk_start[i] = sk
        for p in range(q):
            if p == 0 or kept[p] != kept[p - 1]:
                if distinct < k:
                    out.sketch[sk] = <uint32_t>(kept[p] >> (HASH_BITS - 32))
                    sk += 1
                distinct += 1
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
            for p in range(count):
                v = hashes[p]
                if (v & (rate - 1)) == 0:
                    out.mgram[mg] = (v >> 4) | MGRAM_TAG
                    mg += 1
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


# --- sketch comparison -----------------------------------------------------------------------------

cdef struct Estimates:
    double jaccard
    double containment_a
    double containment_b


cdef inline Py_ssize_t bisect_right(const uint64_t *a, Py_ssize_t n, uint64_t x) noexcept nogil:
    cdef Py_ssize_t lo = 0, hi = n, mid
    while lo < hi:
        mid = (lo + hi) // 2
        if x < a[mid]:
            hi = mid
        else:
            lo = mid + 1
    return lo


cdef Estimates estimates(const uint64_t *a, Py_ssize_t na, int64_t size_a,
                         const uint64_t *b, Py_ssize_t nb, int64_t size_b) noexcept nogil:
    """`sketch.Probe.estimates` on two sorted sketches: Jaccard, |A∩B|/|A| and |A∩B|/|B| counted below
    the smaller of the largest kept hashes of the sketches that do not hold their whole text."""
    cdef Estimates r
    r.jaccard = 0.0; r.containment_a = 0.0; r.containment_b = 0.0
    if na == 0 or nb == 0:
        return r
    cdef bint has_tau = False
    cdef uint64_t tau = 0xFFFFFFFFFFFFFFFFULL
    if size_a > na:
        tau = a[na - 1]; has_tau = True
    if size_b > nb and (not has_tau or b[nb - 1] < tau):
        tau = b[nb - 1]; has_tau = True
    if has_tau:
        if a[na - 1] > tau:
            na = bisect_right(a, na, tau)
        if b[nb - 1] > tau:
            nb = bisect_right(b, nb, tau)
        if na == 0 or nb == 0:
            return r
    # Distinct common values (a set intersection: a sketch may repeat a 32-bit value), all <= tau now.
    cdef Py_ssize_t i = 0, j = 0, inter = 0
    cdef uint64_t v
    while i < na and j < nb:
        if a[i] < b[j]:
            i += 1
        elif b[j] < a[i]:
            j += 1
        else:
            v = a[i]
            inter += 1
            while i < na and a[i] == v:
                i += 1
            while j < nb and b[j] == v:
                j += 1
    r.jaccard = <double>inter / <double>(na + nb - inter)
    r.containment_a = <double>inter / <double>na
    r.containment_b = <double>inter / <double>nb
    return r


cdef inline double similarity(Estimates est, int64_t size_a, int64_t size_b, double threshold,
                              double containment, double min_ratio, int64_t min_size) noexcept nogil:
    """`NearDupFilter._sketch_match` on the estimates: the Jaccard if it passes `threshold`, else the
    containment of the smaller text if it passes (with the size ratio and minimum size), else -1."""
    if est.jaccard >= threshold:
        return est.jaccard
    cdef double best = est.containment_a if est.containment_a > est.containment_b else est.containment_b
    cdef int64_t small = size_a if size_a < size_b else size_b
    cdef int64_t big = size_a if size_a > size_b else size_b
    if big < 1:
        big = 1
    if best >= containment and <double>small / <double>big >= min_ratio and small >= min_size:
        return best
    return -1.0


# --- the table of the memory index ----------------------------------------------------------------------

cdef struct CEntry:
    uint64_t seq
    double ts
    uint64_t exact_lo
    uint64_t exact_hi
    int64_t size
    PyObject *id  # owned
    PyObject *payload  # owned, or NULL: the Entry the Python API inserted (else it is built on demand)
    uint32_t nkeys
    uint32_t nsk
    bint narrow  # the sketch's values fit 32 bits (a fingerprint's): stored as uint32, else uint64
    uint64_t *keys  # inside this allocation
    void *sketch  # inside this allocation, after the keys


cdef union BucketData:
    uint64_t one  # the seq of a bucket's only entry (most buckets: m-gram keys of unique texts rarely repeat)
    uint64_t *many  # seqs sorted by (event time, seq)


cdef struct Bucket:
    uint64_t key
    uint32_t n  # 0: an empty slot
    uint32_t alloc
    BucketData d


cdef struct Due:
    double ts
    uint64_t seq


cdef struct Hit:  # one candidate while counting: how many of the query's buckets hold it, and the first
    uint64_t seq
    uint32_t shared
    uint32_t first
    uint32_t stamp


cdef int regrow(void **buf, Py_ssize_t *cap, Py_ssize_t need, size_t item) except -1:
    """Makes `buf` a scratch buffer of at least `need` items of `item` bytes (twice that, for the next
    time); what it held is not kept."""
    PyMem_Free(buf[0])
    buf[0] = PyMem_Malloc(need * 2 * item)
    cap[0] = need * 2 if buf[0] else 0
    if not buf[0]:
        raise MemoryError()
    return 0


cdef inline bint due_before(Due a, Due b) noexcept nogil:
    return a.ts < b.ts or (a.ts == b.ts and a.seq < b.seq)


cdef struct Merged:  # one candidate of decide_shared: from the batch's own table (seq) or the shared index
    uint32_t shared
    double ts
    bint local
    uint64_t seq  # local: the entry's seq
    Py_ssize_t at  # shared: its place in the message's candidate list
    uint64_t first_key


cdef Py_ssize_t widen_sketch(object sketch, uint64_t **buf, Py_ssize_t *cap) except -1:
    """A stored entry's sketch (a uint32 or uint64 array) as uint64 values in `buf`; returns how many."""
    cdef const uint32_t[::1] narrow
    cdef const uint64_t[::1] wide
    cdef Py_ssize_t n = len(sketch), j
    if n >= cap[0]:
        regrow(<void **>buf, cap, n + 1, sizeof(uint64_t))
    if sketch.dtype.itemsize == 4:
        narrow = sketch
        for j in range(n):
            buf[0][j] = narrow[j]
    else:
        wide = sketch
        for j in range(n):
            buf[0][j] = wide[j]
    return n


cdef inline bint ranks_before(Hit *a, Hit *b) noexcept nogil:
    return a.shared > b.shared or (a.shared == b.shared and a.seq > b.seq)


cdef class Table:
    """The memory index's storage: buckets (key → seqs sorted by event time, then seq), entries by seq,
    an expiry heap on (event time, seq), and ids → seq. The same behaviour as `filters.index.PyTable`.

    `lookup`, `insert` and `get` serve `MemoryIndex`'s Python API; `decide` runs the embedded engine's
    whole per-message loop (look up, verify by sketch, insert the unique) without a Python object per
    message but its verdict.
    """

    cdef readonly double window
    cdef readonly int bucket_cap
    cdef object make_entry
    cdef Bucket *slots
    cdef uint64_t mask
    cdef Py_ssize_t used
    cdef CEntry **ents
    cdef uint64_t ebase
    cdef Py_ssize_t ecap
    cdef uint64_t seq
    cdef Py_ssize_t live
    cdef Due *heap
    cdef Py_ssize_t hlen, hcap
    cdef dict by_id
    cdef double watermark, newest
    cdef public Py_ssize_t evicted_by_cap
    # scratch of one lookup
    cdef Hit *hits
    cdef uint64_t hmask
    cdef uint32_t stamp
    cdef Hit **ranked
    cdef Py_ssize_t ranked_cap
    cdef Bucket **found
    cdef Py_ssize_t found_cap
    cdef uint64_t *probe
    cdef uint64_t *other
    cdef Py_ssize_t probe_cap, other_cap
    cdef uint64_t *qkeys  # decide_shared: the message's keys (`other` holds a candidate's sketch meanwhile)
    cdef Py_ssize_t qkeys_cap
    cdef Merged *merged
    cdef Py_ssize_t merged_cap

    def __cinit__(self, double window, int bucket_cap, make_entry):
        self.window = window
        self.bucket_cap = bucket_cap
        self.make_entry = make_entry
        self.mask = 1023
        self.slots = <Bucket *>PyMem_Malloc((self.mask + 1) * sizeof(Bucket))
        self.ecap = 1024
        self.ents = <CEntry **>PyMem_Malloc(self.ecap * sizeof(CEntry *))
        self.ebase = 1
        self.hcap = 1024
        self.heap = <Due *>PyMem_Malloc(self.hcap * sizeof(Due))
        self.hmask = 255
        self.hits = <Hit *>PyMem_Malloc((self.hmask + 1) * sizeof(Hit))
        self.ranked_cap = 256
        self.ranked = <Hit **>PyMem_Malloc(self.ranked_cap * sizeof(Hit *))
        self.found_cap = 64
        self.found = <Bucket **>PyMem_Malloc(self.found_cap * sizeof(Bucket *))
        self.probe_cap = self.other_cap = 256
        self.probe = <uint64_t *>PyMem_Malloc(self.probe_cap * sizeof(uint64_t))
        self.other = <uint64_t *>PyMem_Malloc(self.other_cap * sizeof(uint64_t))
        if (not self.slots or not self.ents or not self.heap or not self.hits or not self.ranked
                or not self.found or not self.probe or not self.other):
            raise MemoryError()
        memset(self.slots, 0, (self.mask + 1) * sizeof(Bucket))
        memset(self.ents, 0, self.ecap * sizeof(CEntry *))
        memset(self.hits, 0, (self.hmask + 1) * sizeof(Hit))
        self.by_id = {}
        self.watermark = -float("inf")
        self.newest = -float("inf")

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self.slots:
            for i in range(<Py_ssize_t>self.mask + 1):
                if self.slots[i].n > 1:
                    PyMem_Free(self.slots[i].d.many)
            PyMem_Free(self.slots)
        if self.ents:
            for i in range(self.ecap):
                if self.ents[i]:
                    self._free_entry(self.ents[i])
            PyMem_Free(self.ents)
        PyMem_Free(self.heap); PyMem_Free(self.hits); PyMem_Free(self.ranked); PyMem_Free(self.found)
        PyMem_Free(self.probe); PyMem_Free(self.other); PyMem_Free(self.qkeys); PyMem_Free(self.merged)

    def __len__(self):
        return self.live

    # -- buckets -----------------------------------------------------------------------------------
    cdef inline Bucket *_find(self, uint64_t key) noexcept:
        cdef uint64_t i = mix64(key) & self.mask
        cdef Bucket *b
        while True:
            b = &self.slots[i]
            if b.n == 0:
                return NULL
            if b.key == key:
                return b
            i = (i + 1) & self.mask

    cdef Bucket *_claim(self, uint64_t key) except NULL:
        """The bucket of `key`, made (empty: n == 0 until the caller fills it) if there was none."""
        if (self.used + 1) * 10 > (<Py_ssize_t>self.mask + 1) * 7:
            self._grow_slots()
        cdef uint64_t i = mix64(key) & self.mask
        cdef Bucket *b
        while True:
            b = &self.slots[i]
            if b.n == 0:
                b.key = key
                b.alloc = 0
                self.used += 1
                return b
            if b.key == key:
                return b
            i = (i + 1) & self.mask

    cdef int _grow_slots(self) except -1:
        cdef uint64_t old_mask = self.mask, i, j
        cdef Bucket *old = self.slots
        cdef uint64_t mask = old_mask * 2 + 1
        cdef Bucket *slots = <Bucket *>PyMem_Malloc((mask + 1) * sizeof(Bucket))
        if not slots:
            raise MemoryError()
        memset(slots, 0, (mask + 1) * sizeof(Bucket))
        for i in range(old_mask + 1):
            if old[i].n:
                j = mix64(old[i].key) & mask
                while slots[j].n:
                    j = (j + 1) & mask
                slots[j] = old[i]
        self.slots = slots
        self.mask = mask
        PyMem_Free(old)
        return 0

    cdef void _drop_slot(self, Bucket *b) noexcept:
        """Empties a slot; later slots of its probe run move up (backward-shift deletion, no tombstones)."""
        cdef uint64_t i = b - self.slots, j = i, home
        self.used -= 1
        while True:
            j = (j + 1) & self.mask
            if self.slots[j].n == 0:
                break
            home = mix64(self.slots[j].key) & self.mask
            # Move j into the hole at i unless its home lies cyclically in (i, j].
            if (j > i and (home <= i or home > j)) or (j < i and (home <= i and home > j)):
                self.slots[i] = self.slots[j]
                i = j
        self.slots[i].n = 0
        self.slots[i].alloc = 0

    cdef inline uint64_t *_members(self, Bucket *b) noexcept:
        return &b.d.one if b.n == 1 else b.d.many

    # -- entries -----------------------------------------------------------------------------------
    cdef inline CEntry *_entry(self, uint64_t seq) noexcept:
        if seq < self.ebase or seq - self.ebase >= <uint64_t>self.ecap:
            return NULL
        return self.ents[seq - self.ebase]

    cdef int _place(self, CEntry *e) except -1:
        """Stores `e` under its seq (the newest), moving or growing the seq-indexed array as needed."""
        cdef Py_ssize_t lead = 0, live_span, new_cap
        cdef CEntry **grown
        if e.seq - self.ebase >= <uint64_t>self.ecap:
            while lead < self.ecap and self.ents[lead] == NULL:
                lead += 1
            if lead:
                memmove(self.ents, self.ents + lead, (self.ecap - lead) * sizeof(CEntry *))
                memset(self.ents + self.ecap - lead, 0, lead * sizeof(CEntry *))
                self.ebase += lead
            live_span = <Py_ssize_t>(e.seq - self.ebase)
            if live_span >= self.ecap:
                new_cap = self.ecap
                while live_span >= new_cap:
                    new_cap *= 2
                grown = <CEntry **>PyMem_Realloc(self.ents, new_cap * sizeof(CEntry *))
                if not grown:
                    raise MemoryError()
                memset(grown + self.ecap, 0, (new_cap - self.ecap) * sizeof(CEntry *))
                self.ents = grown
                self.ecap = new_cap
        self.ents[e.seq - self.ebase] = e
        return 0

    cdef void _free_entry(self, CEntry *e) noexcept:
        Py_DECREF(<object>e.id)
        if e.payload:
            Py_DECREF(<object>e.payload)
        PyMem_Free(e)

    cdef inline double _ts(self, uint64_t seq) noexcept:
        return self._entry(seq).ts

    # -- the window --------------------------------------------------------------------------------
    cdef int _advance(self, double ts) except -1:
        if ts > self.watermark:
            self.watermark = ts
            if self.hlen and self.heap[0].ts < ts - self.window:
                self._expire(ts)
        return 0

    cdef int _push_due(self, double ts, uint64_t seq) except -1:
        cdef Due *grown
        cdef Due item, parent
        cdef Py_ssize_t pos, up
        if self.hlen == self.hcap:
            grown = <Due *>PyMem_Realloc(self.heap, self.hcap * 2 * sizeof(Due))
            if not grown:
                raise MemoryError()
            self.heap = grown
            self.hcap *= 2
        item.ts = ts
        item.seq = seq
        pos = self.hlen
        self.hlen += 1
        while pos > 0:
            up = (pos - 1) // 2
            parent = self.heap[up]
            if not due_before(item, parent):
                break
            self.heap[pos] = parent
            pos = up
        self.heap[pos] = item
        return 0

    cdef Due _pop_due(self) noexcept:
        cdef Due top = self.heap[0], last
        cdef Py_ssize_t pos = 0, child
        self.hlen -= 1
        if self.hlen == 0:
            return top
        last = self.heap[self.hlen]
        while True:
            child = 2 * pos + 1
            if child >= self.hlen:
                break
            if child + 1 < self.hlen and due_before(self.heap[child + 1], self.heap[child]):
                child += 1
            if not due_before(self.heap[child], last):
                break
            self.heap[pos] = self.heap[child]
            pos = child
        self.heap[pos] = last
        return top

    cdef Py_ssize_t _expire(self, double now) except -1:
        cdef double horizon = now - self.window
        cdef Py_ssize_t gone = 0, j, at
        cdef uint32_t k
        cdef Due due
        cdef CEntry *e
        cdef Bucket *b
        cdef uint64_t *seqs
        while self.hlen and self.heap[0].ts < horizon:
            due = self._pop_due()
            e = self._entry(due.seq)
            if e == NULL:
                continue
            self.ents[due.seq - self.ebase] = NULL
            self.live -= 1
            gone += 1
            held = self.by_id.get(<object>e.id)
            if held is not None and <uint64_t>held == e.seq:
                del self.by_id[<object>e.id]
            for k in range(e.nkeys):
                b = self._find(e.keys[k])
                if b == NULL:
                    continue
                if b.n == 1:
                    if b.d.one == e.seq:
                        self._drop_slot(b)
                    continue  # else the bucket cap evicted it earlier
                seqs = b.d.many
                at = -1
                for j in range(b.n):
                    if seqs[j] == e.seq:
                        at = j
                        break
                if at < 0:
                    continue  # evicted earlier by the bucket cap
                memmove(seqs + at, seqs + at + 1, (b.n - at - 1) * sizeof(uint64_t))
                b.n -= 1
                if b.n == 1:
                    b.d.one = seqs[0]
                    b.alloc = 0
                    PyMem_Free(seqs)
            self._free_entry(e)
        return gone

    def expire(self, double now) -> int:
        return self._expire(now)

    # -- insert ------------------------------------------------------------------------------------
    cdef int _insert(self, object id, double ts, uint64_t exact_lo, uint64_t exact_hi, int64_t size,
                     const uint64_t *sketch, Py_ssize_t nsk, const uint64_t *keys, Py_ssize_t nkeys,
                     object payload) except -1:
        """`MemoryIndex.insert_one`: nothing when the id is live or the event time already left the window."""
        if id in self.by_id:
            return 0
        if ts > self.watermark:
            self._advance(ts)
        if ts < self.watermark - self.window:
            return 0
        cdef bint narrow = True
        cdef Py_ssize_t j
        for j in range(nsk):
            if sketch[j] > 0xFFFFFFFFULL:
                narrow = False
                break
        cdef CEntry *e = <CEntry *>PyMem_Malloc(sizeof(CEntry) + nkeys * sizeof(uint64_t)
                                                + nsk * (sizeof(uint32_t) if narrow else sizeof(uint64_t)))
        if not e:
            raise MemoryError()
        self.seq += 1
        e.seq = self.seq
        e.ts = ts
        e.exact_lo = exact_lo
        e.exact_hi = exact_hi
        e.size = size
        e.id = <PyObject *>id
        Py_INCREF(id)
        e.payload = NULL
        if payload is not None:
            e.payload = <PyObject *>payload
            Py_INCREF(payload)
        e.nkeys = <uint32_t>nkeys
        e.nsk = <uint32_t>nsk
        e.narrow = narrow
        e.keys = <uint64_t *>(<char *>e + sizeof(CEntry))
        e.sketch = <void *>(e.keys + nkeys)
        if nkeys:
            memcpy(e.keys, keys, nkeys * sizeof(uint64_t))
        if narrow:
            for j in range(nsk):
                (<uint32_t *>e.sketch)[j] = <uint32_t>sketch[j]
        elif nsk:
            memcpy(e.sketch, sketch, nsk * sizeof(uint64_t))
        try:
            self._place(e)
        except MemoryError:
            self._free_entry(e)
            raise
        self.live += 1
        self.by_id[id] = e.seq
        self._push_due(ts, e.seq)
        cdef bint in_order = ts >= self.newest
        if in_order:
            self.newest = ts
        cdef Py_ssize_t k, pos
        cdef Bucket *b
        cdef uint64_t *seqs
        cdef uint64_t seq = e.seq
        cdef uint32_t alloc
        for k in range(nkeys):
            b = self._claim(keys[k])
            if b.n == 0:
                b.n = 1
                b.d.one = seq
                continue
            if b.n == 1:
                seqs = <uint64_t *>PyMem_Malloc(4 * sizeof(uint64_t))
                if not seqs:
                    raise MemoryError()
                seqs[0] = b.d.one
                b.d.many = seqs
                b.alloc = 4
            if b.n == b.alloc:
                alloc = b.alloc * 2
                seqs = <uint64_t *>PyMem_Realloc(b.d.many, alloc * sizeof(uint64_t))
                if not seqs:
                    raise MemoryError()
                b.d.many = seqs
                b.alloc = alloc
            seqs = b.d.many
            # Buckets stay sorted by (event time, seq): seqs[0] is the oldest, the one the cap evicts.
            pos = b.n
            if not in_order:
                while pos > 0 and self._ts(seqs[pos - 1]) > ts:
                    pos -= 1
                memmove(seqs + pos + 1, seqs + pos, (b.n - pos) * sizeof(uint64_t))
            seqs[pos] = seq
            b.n += 1
            if b.n > <uint32_t>self.bucket_cap:
                memmove(seqs, seqs + 1, (b.n - 1) * sizeof(uint64_t))
                b.n -= 1
                self.evicted_by_cap += 1
                if b.n == 1:
                    b.d.one = seqs[0]
                    b.alloc = 0
                    PyMem_Free(seqs)
        return 1

    def insert(self, entry, tuple keys) -> bool:
        """Inserts an `Entry` (kept as is, and returned by `get`) under `keys`; False when it was not."""
        cdef Py_ssize_t nkeys = len(keys), nsk, i
        sketch = entry.sketch
        cdef uint32_t[::1] narrow
        cdef uint64_t[::1] wide
        if sketch.dtype == np.uint32 and sketch.flags.c_contiguous:
            narrow = sketch
            nsk = narrow.shape[0]
            if nsk >= self.other_cap:
                self._grow_scratch(&self.other, &self.other_cap, nsk + 1)
            for i in range(nsk):
                self.other[i] = narrow[i]
        else:
            wide = np.ascontiguousarray(sketch, dtype=np.uint64)
            nsk = wide.shape[0]
            if nsk >= self.other_cap:
                self._grow_scratch(&self.other, &self.other_cap, nsk + 1)
            for i in range(nsk):
                self.other[i] = wide[i]
        if nkeys >= self.probe_cap:
            self._grow_scratch(&self.probe, &self.probe_cap, nkeys + 1)
        cdef Py_ssize_t kept = 0, j
        cdef uint64_t key
        for i in range(nkeys):  # a key given twice counts once
            key = keys[i]
            for j in range(kept):
                if self.probe[j] == key:
                    break
            else:
                self.probe[kept] = key
                kept += 1
        nkeys = kept
        exact = entry.exact
        return bool(self._insert(entry.id, entry.ts, exact & 0xFFFFFFFFFFFFFFFF, exact >> 64, entry.size,
                                 self.other, nsk, self.probe, nkeys, entry))

    # -- lookup ------------------------------------------------------------------------------------
    cdef Py_ssize_t _gather(self, const uint64_t *keys, Py_ssize_t nkeys, Py_ssize_t floor, double ts,
                            Py_ssize_t limit, uint64_t own) except -1:
        """`MemoryIndex.lookup_keys` after the own-entry check: fills `self.ranked` with the candidates
        that share ≥ `floor` of `keys`, most shared first, then newest, inside the window of `ts`;
        returns how many (at most `limit`, but at least one found is kept even when limit < 1)."""
        cdef Py_ssize_t k, j, present = 0, total = 0, n_ranked = 0, out, pos
        cdef Bucket *b
        cdef uint64_t *seqs
        cdef uint64_t s, h
        cdef Hit *hit
        cdef Hit *x
        cdef double oldest
        if nkeys > self.found_cap:
            regrow(<void **>&self.found, &self.found_cap, nkeys, sizeof(Bucket *))
        for k in range(nkeys):
            b = self._find(keys[k])
            self.found[k] = b
            if b != NULL:
                present += 1
                total += b.n
        if present < floor or present == 0:
            return 0  # pigeonhole: nothing can share `floor` keys with it
        # Count the members of the query's buckets (a stamped open-addressing map, never cleared).
        if <uint64_t>(total * 2) > self.hmask:
            h = self.hmask
            while <uint64_t>(total * 2) > h:
                h = h * 2 + 1
            PyMem_Free(self.hits)
            self.hits = <Hit *>PyMem_Malloc((h + 1) * sizeof(Hit))
            if not self.hits:
                raise MemoryError()
            memset(self.hits, 0, (h + 1) * sizeof(Hit))
            self.hmask = h
            self.stamp = 0
        self.stamp += 1
        if self.stamp == 0:
            memset(self.hits, 0, (self.hmask + 1) * sizeof(Hit))
            self.stamp = 1
        if total > self.ranked_cap:
            regrow(<void **>&self.ranked, &self.ranked_cap, total, sizeof(Hit *))
        cdef Py_ssize_t distinct = 0
        for k in range(nkeys):
            b = self.found[k]
            if b == NULL:
                continue
            seqs = self._members(b)
            for j in range(b.n):
                s = seqs[j]
                h = mix64(s) & self.hmask
                while True:
                    hit = &self.hits[h]
                    if hit.stamp != self.stamp:
                        hit.stamp = self.stamp
                        hit.seq = s
                        hit.shared = 1
                        hit.first = <uint32_t>k
                        distinct += 1
                        if s != own:
                            self.ranked[n_ranked] = hit
                            n_ranked += 1
                        break
                    if hit.seq == s:
                        hit.shared += 1
                        break
                    h = (h + 1) & self.hmask
        if floor > 1 and distinct == total:
            return 0  # every entry was in one bucket only
        # Keep those with enough shared keys, then rank (insertion sort: a handful, nearly always).
        out = 0
        for j in range(n_ranked):
            if <Py_ssize_t>self.ranked[j].shared >= floor:
                self.ranked[out] = self.ranked[j]
                out += 1
        for j in range(1, out):
            x = self.ranked[j]
            pos = j
            while pos > 0 and ranks_before(x, self.ranked[pos - 1]):
                self.ranked[pos] = self.ranked[pos - 1]
                pos -= 1
            self.ranked[pos] = x
        oldest = ts - self.window
        n_ranked = 0
        for j in range(out):
            if self._ts(self.ranked[j].seq) < oldest:
                continue
            self.ranked[n_ranked] = self.ranked[j]
            n_ranked += 1
            if n_ranked >= limit:
                break
        return n_ranked

    def lookup(self, object id, double ts, tuple keys, Py_ssize_t floor, Py_ssize_t limit) -> tuple:
        """(own seq or 0, [(seq, shared, first key)]): `MemoryIndex.lookup_keys` by seq."""
        self._advance(ts)
        own = self.by_id.get(id)
        cdef uint64_t own_seq = 0 if own is None else <uint64_t>own
        cdef Py_ssize_t nkeys = len(keys), n, j
        if nkeys >= self.other_cap:
            self._grow_scratch(&self.other, &self.other_cap, nkeys + 1)
        for j in range(nkeys):
            self.other[j] = keys[j]
        n = self._gather(self.other, nkeys, floor, ts, limit, own_seq)
        return own_seq, [(self.ranked[j].seq, self.ranked[j].shared, keys[self.ranked[j].first]) for j in range(n)]

    def get(self, uint64_t seq):
        """The entry of `seq`: the `Entry` inserted through `insert`, or one made from what `decide` stored."""
        cdef CEntry *e = self._entry(seq)
        if e == NULL:
            raise KeyError(seq)
        if e.payload:
            return <object>e.payload
        sketch = np.empty(e.nsk, dtype=np.uint32)
        cdef uint32_t[::1] view = sketch
        cdef uint32_t i
        for i in range(e.nsk):
            view[i] = (<uint32_t *>e.sketch)[i] if e.narrow else <uint32_t>(<uint64_t *>e.sketch)[i]
        return self.make_entry(<object>e.id, e.ts, (<object>e.exact_hi) << 64 | e.exact_lo, e.size, sketch)

    def seqs(self) -> list:
        """The live entries' seqs, oldest insert first."""
        return [self.ebase + i for i in range(self.ecap) if self.ents[i] != NULL]

    def stats(self) -> dict:
        cdef Py_ssize_t i, buckets = 0, biggest = 0
        for i in range(<Py_ssize_t>self.mask + 1):
            if self.slots[i].n:
                buckets += 1
                if self.slots[i].n > biggest:
                    biggest = self.slots[i].n
        return {"entries": self.live, "buckets": buckets, "max_bucket": biggest,
                "evicted_by_cap": self.evicted_by_cap}

    # -- the embedded engine's loop -----------------------------------------------------------------
    def decide(self, list ids, list tss, Shingled batch, double min_shared, Py_ssize_t limit, double threshold,
               double containment, double min_ratio, int64_t min_size, tuple method_names, verdict) -> list:
        """`NearDupFilter._decide_local` for every message of a hashed batch, in order: the verdicts,
        made by calling `verdict(id, duplicate, duplicate_of, similarity, method)`. Verification is by
        sketch (`verify="sketch"`), exactly as `NearDupFilter._sketch_match`."""
        cdef Py_ssize_t i, nkeys, floor, n, c, j, nsk
        cdef double ts, sim
        cdef const uint64_t *keys
        cdef CEntry *e
        cdef int64_t size_a
        cdef bint matched
        if len(ids) != batch.n or len(tss) != batch.n:
            raise ValueError("ids, event times and the hashed batch differ in length")
        out = []
        for i in range(batch.n):
            id = ids[i]
            ts = tss[i]
            self._advance(ts)
            if id in self.by_id:
                out.append(verdict(id, False, None, 0.0, "replay"))
                continue
            keys = batch.keys + batch.key_start[i]
            nkeys = batch.key_start[i + 1] - batch.key_start[i]
            floor = <Py_ssize_t>ceil(min_shared * nkeys)
            if floor < 1:
                floor = 1
            n = self._gather(keys, nkeys, floor, ts, limit, 0)
            nsk = batch.sk_start[i + 1] - batch.sk_start[i]
            size_a = batch.size[i]
            matched = False
            if nsk > self.probe_cap:
                self._grow_scratch(&self.probe, &self.probe_cap, nsk)
            for j in range(nsk):
                self.probe[j] = batch.sketch[batch.sk_start[i] + j]
            for c in range(n):
                e = self._entry(self.ranked[c].seq)
                if e.exact_lo == batch.exact_lo[i] and e.exact_hi == batch.exact_hi[i]:
                    out.append(verdict(id, True, <object>e.id, 1.0, "exact"))
                    matched = True
                    break
                sim = similarity(estimates(self.probe, nsk, size_a, self._wide(e), e.nsk, e.size), size_a, e.size,
                                 threshold, containment, min_ratio, min_size)
                if sim >= 0.0:
                    out.append(verdict(id, True, <object>e.id, py_round(sim, 4),
                                       method_names[keys[self.ranked[c].first] >> 60]))
                    matched = True
                    break
            if not matched:
                self._insert(id, ts, batch.exact_lo[i], batch.exact_hi[i], size_a, self.probe, nsk, keys, nkeys, None)
                out.append(verdict(id, False, None, 0.0, None))
        return out

    def decide_shared(self, list ids, list tss, list fps, list looked, double min_shared, Py_ssize_t limit,
                      double threshold, double containment, double min_ratio, int64_t min_size,
                      tuple method_names, verdict) -> tuple:
        """`NearDupFilter._decide_shared`'s loop on this (fresh, batch-local) table, for a batch whose
        shared-index lookup gave `looked` (per message: its stored entry or None, and its ranked
        `Candidate`s): replays, the batch's own earlier messages merged with the shared candidates
        (most shared keys first, then newest; the batch's first on ties), verification by sketch exactly
        as `NearDupFilter._first_match`, and the unique ones inserted here. Returns (the verdicts, made
        by `verdict(id, duplicate, duplicate_of, similarity, method)`, and the places of the unique)."""
        cdef Py_ssize_t count = len(ids), i, j, c, nkeys, floor, n_local, n_remote, n, nsk, nsk_b, pos
        cdef double ts, sim
        cdef int64_t size_a, size_b
        cdef uint64_t lo, hi
        cdef const uint32_t[::1] sk
        cdef Estimates est
        cdef CEntry *e
        cdef Merged item
        cdef bint matched
        cdef const uint64_t *other
        cdef list cands
        if len(tss) != count or len(fps) != count or len(looked) != count:
            raise ValueError("ids, event times, fingerprints and lookups differ in length")
        out = []
        unique = []
        for i in range(count):
            id = ids[i]
            ts = tss[i]
            self._advance(ts)
            own, cands = looked[i]
            if own is not None or id in self.by_id:
                out.append(verdict(id, False, None, 0.0, "replay"))
                continue
            fp = fps[i]
            keys = fp.keys
            nkeys = len(keys)
            if nkeys >= self.qkeys_cap:
                regrow(<void **>&self.qkeys, &self.qkeys_cap, nkeys + 1, sizeof(uint64_t))
            for j in range(nkeys):
                self.qkeys[j] = keys[j]
            floor = <Py_ssize_t>ceil(min_shared * nkeys)
            if floor < 1:
                floor = 1
            n_local = self._gather(self.qkeys, nkeys, floor, ts, limit, 0)
            n_remote = len(cands)
            if n_local + n_remote > self.merged_cap:
                regrow(<void **>&self.merged, &self.merged_cap, n_local + n_remote, sizeof(Merged))
            for j in range(n_local):
                item.shared = self.ranked[j].shared
                item.ts = self._ts(self.ranked[j].seq)
                item.local = True
                item.seq = self.ranked[j].seq
                item.at = -1
                item.first_key = self.qkeys[self.ranked[j].first]
                self.merged[j] = item
            for j in range(n_remote):
                cand = cands[j]
                item.shared = cand.shared
                item.ts = cand.entry.ts
                item.local = False
                item.seq = 0
                item.at = j
                item.first_key = cand.first_key
                self.merged[n_local + j] = item
            n = n_local + n_remote
            if n_local and n_remote:  # `_merge`: a stable sort on (most shared, newest), then the limit
                for j in range(1, n):
                    item = self.merged[j]
                    pos = j
                    while pos > 0 and (item.shared > self.merged[pos - 1].shared or (
                            item.shared == self.merged[pos - 1].shared and item.ts > self.merged[pos - 1].ts)):
                        self.merged[pos] = self.merged[pos - 1]
                        pos -= 1
                    self.merged[pos] = item
                if n > limit:
                    n = limit
            exact = fp.exact
            lo = <uint64_t>(exact & 0xFFFFFFFFFFFFFFFF)
            hi = <uint64_t>(exact >> 64)
            size_a = fp.size
            sk = fp.sketch
            nsk = sk.shape[0]
            if nsk > self.probe_cap:
                self._grow_scratch(&self.probe, &self.probe_cap, nsk)
            for j in range(nsk):
                self.probe[j] = sk[j]
            matched = False
            for c in range(n):
                item = self.merged[c]
                if item.local:
                    e = self._entry(item.seq)
                    if e.exact_lo == lo and e.exact_hi == hi:
                        out.append(verdict(id, True, <object>e.id, 1.0, "exact"))
                        matched = True
                        break
                    other = self._wide(e)
                    nsk_b = e.nsk
                    size_b = e.size
                    match_id = <object>e.id
                else:
                    entry = (<object>cands[item.at]).entry
                    if entry.exact == exact:
                        out.append(verdict(id, True, entry.id, 1.0, "exact"))
                        matched = True
                        break
                    if <Py_ssize_t>item.shared < floor:
                        continue
                    nsk_b = widen_sketch(entry.sketch, &self.other, &self.other_cap)
                    other = self.other
                    size_b = entry.size
                    match_id = entry.id
                sim = similarity(estimates(self.probe, nsk, size_a, other, nsk_b, size_b), size_a, size_b,
                                 threshold, containment, min_ratio, min_size)
                if sim >= 0.0:
                    out.append(verdict(id, True, match_id, py_round(sim, 4), method_names[item.first_key >> 60]))
                    matched = True
                    break
            if not matched:
                self._insert(id, ts, lo, hi, size_a, self.probe, nsk, self.qkeys, nkeys, None)
                out.append(verdict(id, False, None, 0.0, None))
                unique.append(i)
        return out, unique

    cdef const uint64_t *_wide(self, CEntry *e) except NULL:
        """An entry's sketch as uint64 values: itself, or widened into the scratch buffer `other`."""
        cdef uint32_t j
        if not e.narrow:
            return <uint64_t *>e.sketch
        if e.nsk >= self.other_cap:
            self._grow_scratch(&self.other, &self.other_cap, e.nsk + 1)
        for j in range(e.nsk):
            self.other[j] = (<uint32_t *>e.sketch)[j]
        return self.other

    cdef int _grow_scratch(self, uint64_t **buf, Py_ssize_t *cap, Py_ssize_t need) except -1:
        return regrow(<void **>buf, cap, need, sizeof(uint64_t))


# --- ranking the records of a Redis lookup -----------------------------------------------------------

cdef struct Tally:  # one candidate id: its buckets, first bucket, newest seq and that record's event time
    uint64_t hash
    const char *id
    uint32_t n
    uint32_t shared
    uint32_t first
    uint32_t last_key  # 1 + the last bucket that counted it: an id counts once per bucket
    uint64_t seq
    double ts
    uint32_t stamp


cdef inline uint64_t id_hash(const char *p, uint32_t n) noexcept nogil:
    cdef uint64_t h = 0xcbf29ce484222325ULL
    cdef uint32_t i
    for i in range(n):
        h = (h ^ <uint8_t>p[i]) * 0x100000001b3ULL
    return mix64(h)


cdef extern from * nogil:
    """
    #include <algorithm>
    #include <stdint.h>
    struct nd_record { double ts; uint64_t seq; const char *id; uint32_t n; };
    static void nd_sort_newest_first(nd_record *first, nd_record *last) {
        std::sort(first, last, [](const nd_record &a, const nd_record &b) {
            return a.ts > b.ts || (a.ts == b.ts && a.seq > b.seq);
        });
    }
    """
    struct nd_record:  # one bucket record of a Redis lookup
        double ts
        uint64_t seq
        const char *id
        uint32_t n
    void nd_sort_newest_first(nd_record *first, nd_record *last)


cdef inline uint64_t be64(const char *p) noexcept nogil:
    cdef uint64_t v = 0
    cdef int j
    for j in range(8):
        v = (v << 8) | <uint8_t>p[j]
    return v


cdef class _RankScratch:
    """Buffers `rank_records` reuses from query to query of one lookup: the records of a bucket, the tally
    table (a slot is taken when its stamp is this query's: no clearing between queries) and the hits."""

    cdef nd_record *recs
    cdef Py_ssize_t recs_cap
    cdef Tally *table
    cdef Py_ssize_t table_cap
    cdef Tally **hits
    cdef Py_ssize_t hits_cap
    cdef uint32_t stamp

    def __dealloc__(self):
        PyMem_Free(self.recs); PyMem_Free(self.table); PyMem_Free(self.hits)

    cdef int reserve(self, Py_ssize_t records, Py_ssize_t slots, Py_ssize_t hits) except -1:
        if records > self.recs_cap:
            regrow(<void **>&self.recs, &self.recs_cap, records, sizeof(nd_record))
        if hits > self.hits_cap:
            regrow(<void **>&self.hits, &self.hits_cap, hits, sizeof(Tally *))
        if slots > self.table_cap or self.stamp == 0xFFFFFFFF:
            if slots > self.table_cap:
                PyMem_Free(self.table)
                self.table = <Tally *>PyMem_Malloc(slots * sizeof(Tally))
                if self.table == NULL:
                    self.table_cap = 0
                    raise MemoryError()
                self.table_cap = slots
            memset(self.table, 0, self.table_cap * sizeof(Tally))
            self.stamp = 0
        self.stamp += 1
        return 0


def rank_records(list values, list positions, str id, Py_ssize_t floor, Py_ssize_t limit, double horizon,
                 Py_ssize_t cap, long long since, object own) -> list:
    """`filters.redis_index.rank_records`, compiled: the ranked candidates of one lookup, given the bucket
    values read per slice (`values[s][positions[k]]`: bucket k's value in slice s, bytes or None)."""
    return _rank_records(values, positions, id, floor, limit, horizon, cap, since, own, _RankScratch())


cdef list _rank_records(list values, list positions, str id, Py_ssize_t floor, Py_ssize_t limit, double horizon,
                        Py_ssize_t cap, long long since, object own, _RankScratch scratch):
    cdef Py_ssize_t nkeys = len(positions), nslices = len(values), k, s, present = 0, total = 0, nrec, j, t
    cdef Py_ssize_t pos, end, size
    cdef object v
    cdef const char *buf
    cdef bytes own_id = id.encode("utf-8", "surrogatepass")
    cdef const char *own_p = own_id
    cdef uint32_t own_n = <uint32_t>len(own_id)
    cdef uint32_t n, stamp
    cdef nd_record *recs
    cdef Tally *table
    cdef Tally **hits
    cdef Tally *tally
    cdef uint64_t mask, h, seq
    cdef Py_ssize_t nhits = 0, cap_recs = 0
    cdef double ts
    cdef bint bad = False
    for k in range(nkeys):
        t = positions[k]
        for s in range(nslices):
            v = (<list>values[s])[t]
            if v is not None:
                present += 1
                break
    if present < floor or present == 0:
        return []  # pigeonhole: nothing can share `floor` keys with it
    for k in range(nkeys):  # the most records any bucket holds, and all of them
        t = positions[k]
        size = 0
        for s in range(nslices):
            v = (<list>values[s])[t]
            if v is not None:
                size += len(<bytes>v) // 20 + 1
        total += size
        if size > cap_recs:
            cap_recs = size
    mask = 15
    while mask < <uint64_t>(2 * total):
        mask = mask * 2 + 1
    scratch.reserve(cap_recs + 1, <Py_ssize_t>mask + 1, total + 1)
    recs, table, hits, stamp = scratch.recs, scratch.table, scratch.hits, scratch.stamp
    for k in range(nkeys):
        t = positions[k]
        nrec = 0
        for s in range(nslices):
            v = (<list>values[s])[t]
            if v is None:
                continue
            buf = <const char *>(<bytes>v)
            end = len(<bytes>v)
            pos = 0
            while pos < end:
                if pos + 12 > end:
                    bad = True
                    break
                memcpy(&ts, buf + pos, 8)
                memcpy(&n, buf + pos + 8, 4)
                if pos + 12 + <Py_ssize_t>n + 8 > end:
                    bad = True
                    break
                if ts >= horizon:
                    recs[nrec].ts = ts
                    recs[nrec].id = buf + pos + 12
                    recs[nrec].n = n
                    recs[nrec].seq = be64(buf + pos + 12 + n)
                    nrec += 1
                pos += 12 + n + 8
            if bad:
                break
        if bad:
            break
        if nrec > cap:
            nd_sort_newest_first(recs, recs + nrec)
            nrec = cap
        for j in range(nrec):
            if recs[j].n == own_n and memcmp(recs[j].id, own_p, own_n) == 0:
                continue
            h = id_hash(recs[j].id, recs[j].n)
            tally = &table[h & mask]
            while tally.stamp == stamp and not (tally.hash == h and tally.n == recs[j].n
                                                and memcmp(tally.id, recs[j].id, recs[j].n) == 0):
                tally = &table[((tally - table) + 1) & mask]
            if tally.stamp == stamp and tally.last_key == k + 1:
                continue  # the same id twice in one bucket
            if since >= 0 and (recs[j].seq <= <uint64_t>since or (own is not None and recs[j].seq in own)):
                continue
            if tally.stamp != stamp:
                tally.stamp = stamp
                tally.hash = h
                tally.id = recs[j].id
                tally.n = recs[j].n
                tally.shared = 1
                tally.first = <uint32_t>k
                tally.seq = recs[j].seq
                tally.ts = recs[j].ts
                hits[nhits] = tally
                nhits += 1
            else:
                tally.shared += 1
                if recs[j].seq > tally.seq:
                    tally.seq = recs[j].seq
                    tally.ts = recs[j].ts
            tally.last_key = <uint32_t>(k + 1)
    if bad:
        from filters.errors import IndexCorrupt
        raise IndexCorrupt("a bucket holds bytes that are not bucket records")
    # Most shared first, then the newest insert (insertion sort: a handful, nearly always).
    kept = 0
    for j in range(nhits):
        if <Py_ssize_t>hits[j].shared >= floor:
            hits[kept] = hits[j]
            kept += 1
    for j in range(1, kept):
        tally = hits[j]
        t = j
        while t > 0 and (tally.shared > hits[t - 1].shared
                         or (tally.shared == hits[t - 1].shared and tally.seq > hits[t - 1].seq)):
            hits[t] = hits[t - 1]
            t -= 1
        hits[t] = tally
    out = []
    for j in range(kept):
        try:
            rid = hits[j].id[:hits[j].n].decode("utf-8", "surrogatepass")
        except UnicodeDecodeError as exc:
            from filters.errors import IndexCorrupt
            raise IndexCorrupt(f"a bucket record's id is not UTF-8: {exc}") from exc
        out.append((rid, hits[j].shared, hits[j].first, hits[j].ts))
        if len(out) >= limit:
            break
    return out


# --- the Redis protocol -----------------------------------------------------------------------------

cdef inline Py_ssize_t decimal_size(Py_ssize_t n) noexcept:
    cdef Py_ssize_t size = 1
    while n >= 10:
        n //= 10
        size += 1
    return size


cdef inline char *put_header(char *p, char mark, Py_ssize_t n) noexcept:
    """Writes `<mark><n>\\r\\n` (n >= 0)."""
    cdef Py_ssize_t size = decimal_size(n), j
    p[0] = mark
    for j in range(size, 0, -1):
        p[j] = <char>(48 + n % 10)
        n //= 10
    p[size + 1] = 13
    p[size + 2] = 10
    return p + size + 3


def pack_commands(list commands) -> bytes:
    """Redis commands (sequences of bytes, str or int arguments) as one RESP request: the bytes
    `hiredis.pack_command` gives for each, joined, without Python work per argument. Two passes over
    the commands: the size, then the bytes (an int is written out twice; they are few: counts, TTLs)."""
    cdef Py_ssize_t size = 0, n, j, length
    cdef const char *data
    cdef object arg
    cdef tuple command
    commands = [c if type(c) is tuple else tuple(c) for c in commands]  # tuples: indexed without a call
    for command in commands:
        n = len(command)
        size += 3 + decimal_size(n)
        for j in range(n):
            arg = command[j]
            if type(arg) is bytes:
                length = len(<bytes>arg)
            elif type(arg) is str:
                PyUnicode_AsUTF8AndSize(arg, &length)
            elif type(arg) is int:
                length = len(<str>str(arg))
            else:
                raise TypeError(f"a Redis argument must be bytes, str or int, got {type(arg).__name__}")
            size += 3 + decimal_size(length) + length + 2
    out = PyBytes_FromStringAndSize(NULL, size)
    cdef char *p = PyBytes_AS_STRING(out)
    for command in commands:
        n = len(command)
        p = put_header(p, 42, n)
        for j in range(n):
            arg = command[j]
            if type(arg) is bytes:
                data = <const char *>(<bytes>arg)
                length = len(<bytes>arg)
            else:
                if type(arg) is int:
                    arg = str(arg)
                data = PyUnicode_AsUTF8AndSize(arg, &length)
            p = put_header(p, 36, length)
            memcpy(p, data, length)
            p[length] = 13
            p[length + 1] = 10
            p += length + 2
    return out


# --- naming the fields of a Redis lookup ------------------------------------------------------------------

cdef inline bytes bucket_field(uint64_t key):
    """`redis_index._FIELD(b"b", key)`: b"b" and the key, 8 bytes big-endian."""
    cdef char buf[9]
    cdef int j
    buf[0] = 98  # b"b"
    for j in range(8):
        buf[1 + j] = <char>((key >> (56 - 8 * j)) & 0xFF)
    return PyBytes_FromStringAndSize(buf, 9)


cdef Py_ssize_t open_table(Py_ssize_t n, uint64_t **slot_key, Py_ssize_t **slot_at) except -1:
    """An open-addressing table for `n` distinct keys, at most half full: returns its size (a power of
    two, at least 16) and allocates its key slots and its place slots (all -1: empty). The caller frees
    both with PyMem_Free."""
    cdef Py_ssize_t cap = 16
    while cap < 2 * n:
        cap *= 2
    slot_key[0] = <uint64_t *>PyMem_Malloc(cap * sizeof(uint64_t))
    slot_at[0] = <Py_ssize_t *>PyMem_Malloc(cap * sizeof(Py_ssize_t))
    if slot_key[0] == NULL or slot_at[0] == NULL:
        PyMem_Free(slot_key[0]); PyMem_Free(slot_at[0])
        raise MemoryError()
    memset(slot_at[0], 0xFF, cap * sizeof(Py_ssize_t))
    return cap


def plan_fields(list keys_of, list id_fields) -> tuple:
    """`RedisIndex.lookup`'s naming of what a batch reads: per query its bucket keys' field names and their
    places, then per query its entry field's place, every distinct name placed once in first-seen order.
    Returns (names, fields per query, places per query, entry places)."""
    cdef dict id_at = {}
    cdef list names = [], fields_of = [], places_of = [], id_places = []
    cdef list fields, places, place_objs = []
    cdef object place, name
    cdef uint64_t key
    cdef Py_ssize_t at, j, n, total = 0, slot, mask, cap, size
    cdef int shift = 64
    cdef tuple keys
    cdef uint64_t *slot_key
    cdef Py_ssize_t *slot_at
    for keys in keys_of:
        total += len(keys)
    # Open addressing, power-of-two size, Fibonacci hashing: no allocation per key, no division.
    cap = open_table(total, &slot_key, &slot_at)
    mask = cap - 1
    size = cap
    while size > 1:
        size >>= 1
        shift -= 1
    try:
        for keys in keys_of:
            n = len(keys)
            fields = PyList_New(n)
            places = PyList_New(n)
            for j in range(n):
                key = keys[j]  # OverflowError for a key outside 0..2^64-1, as struct.pack would refuse it
                slot = <Py_ssize_t>((key * MUL) >> shift)
                while slot_at[slot] >= 0 and slot_key[slot] != key:
                    slot = (slot + 1) & mask
                at = slot_at[slot]
                if at < 0:
                    at = len(names)
                    slot_at[slot] = at
                    slot_key[slot] = key
                    names.append(bucket_field(key))
                    place_objs.append(at)
                name = names[at]
                place = place_objs[at]  # one int object per place, shared by every query naming it
                Py_INCREF(name)
                PyList_SET_ITEM(fields, j, name)
                Py_INCREF(place)
                PyList_SET_ITEM(places, j, place)
            fields_of.append(fields)
            places_of.append(places)
    finally:
        PyMem_Free(slot_key)
        PyMem_Free(slot_at)
    for name in id_fields:
        place = id_at.get(name)
        if place is None:
            place = len(names)
            id_at[name] = place
            names.append(name)
        id_places.append(place)
    return names, fields_of, places_of, id_places


# --- the uncontended insert of the Redis index ------------------------------------------------------------

cdef inline void put_be64(char *p, uint64_t v) noexcept nogil:
    cdef int j
    for j in range(8):
        p[j] = <char>((v >> (56 - 8 * j)) & 0xFF)


def alone_round(list ids, list tss, list blobs, list fields_of, list places_of, list entry_places, tuple slices,
                dict columns, dict writes, double hwm, double window, double slice_length,
                Py_ssize_t cap, uint64_t seq, entry_time, trim) -> tuple:
    """The loop of `RedisIndex._alone` (which it documents), compiled: per entry, live already (0), out
    of the window (0) or its seq; the writes per slice (`groups`: slice -> [entries, field-value pairs]);
    `writes` (slice -> place -> value) updated; (seq, slice, places) per entry written. Returns
    (results, groups, written, hwm, seq)."""
    cdef Py_ssize_t count = len(ids), i, j, nf, n_id
    cdef double ts, old_ts
    cdef bint live
    cdef object e, old, column, mine, p, v, f
    cdef list fields, places, pairs, results = [], written = []
    cdef dict groups = {}, at_of = {}
    cdef bytearray at_buf
    cdef Py_ssize_t *at  # per place of the slice: where its value is in the slice's pairs, or -1
    cdef Py_ssize_t place, k
    cdef bytes id_bytes, record, blob
    cdef char *rp
    cdef Py_ssize_t too_long
    cdef long long s, sl
    for i in range(count):
        e = entry_places[i]
        id_bytes = (<str>ids[i]).encode("utf-8", "surrogatepass")
        live = False
        for s in slices:
            old = (<dict>writes[s]).get(e)
            if old is None:
                column = columns.get(s)
                old = (<list>column)[e] if column is not None else None
            if old:
                if len(<bytes>old) >= 9:
                    memcpy(&old_ts, <const char *>(<bytes>old) + 1, 8)
                else:
                    old_ts = entry_time(old, ids[i])  # raises: too short for an entry
                if old_ts >= hwm - window:
                    live = True
                    break
        if live:
            results.append(0)
            continue
        ts = tss[i]
        if ts > hwm:
            hwm = ts
        if not ts >= hwm - window:
            results.append(0)
            continue
        seq += 1
        n_id = len(id_bytes)
        record = PyBytes_FromStringAndSize(NULL, 12 + n_id + 8)
        rp = PyBytes_AS_STRING(record)
        memcpy(rp, &ts, 8)
        (<uint32_t *>(rp + 8))[0] = <uint32_t>n_id  # little-endian machines only (x86-64, arm64)
        memcpy(rp + 12, <const char *>id_bytes, n_id)
        put_be64(rp + 12 + n_id, seq)
        sl = <long long>floor_div(ts, slice_length)
        mine = writes[sl]
        column = columns[sl]
        fields = fields_of[i]
        places = places_of[i]
        nf = len(fields)
        group = groups.get(sl)
        if group is None:
            group = groups[sl] = [0, []]
            at_of[sl] = bytearray(b"\xff" * (len(<list>column) * sizeof(Py_ssize_t)))
        group[0] += 1
        pairs = <list>group[1]
        at_buf = <bytearray>at_of[sl]
        at = <Py_ssize_t *>PyByteArray_AS_STRING(at_buf)
        too_long = 2 * cap * len(record)
        for j in range(nf):
            f = fields[j]
            p = places[j]
            v = (<dict>mine).get(p)
            if v is None:
                v = (<list>column)[p]
            if v is None:
                v = record
            else:
                if len(<bytes>v) > too_long:
                    v = trim(v, cap)
                v = <bytes>v + record
            (<dict>mine)[p] = v
            # Each field once in the slice's pairs, with its last value: a bucket several entries of the
            # batch share is sent once, not once per entry with every record again.
            place = p
            if place < 0 or place >= len(<list>column):  # `at` is a C array: no place outside it
                raise IndexError(f"field place {place} outside the {len(<list>column)} read")
            k = at[place]
            if k < 0:
                at[place] = len(pairs) + 1
                pairs.append(f)
                pairs.append(v)
            else:
                pairs[k] = v
        blob = blobs[i]
        (<dict>mine)[e] = blob
        pairs.append(b"e" + id_bytes)
        pairs.append(blob)
        written.append((seq, sl, places))
        results.append(seq)
    return results, groups, written, hwm, seq


cdef inline double floor_div(double ts, double length) noexcept:
    return floor(ts / length)


# --- reading stored entries -------------------------------------------------------------------------------



def decode_entries(list ids, list blobs, make, fallback) -> dict:
    """{id: entry} of the stored entries `blobs` (None: gone, left out), decoded as
    `redis_index.decode_entry` decodes them. The common form (version 2, a uint32 sketch and nothing
    else) is read here, into `make(id, ts, exact, size, sketch, None, None, frozenset())`; any other,
    and anything malformed, goes to `fallback(blob, id)`, which decodes it or raises."""
    cdef dict out = {}
    cdef Py_ssize_t i, n, length
    cdef const char *p
    cdef double ts
    cdef uint64_t lo, hi
    cdef uint32_t size, n_sketch, n_minhash, n_sentences
    cdef uint8_t version, flags
    cdef uint32_t[::1] view
    if len(ids) != len(blobs):
        raise ValueError("ids and blobs differ in length")
    for i in range(len(ids)):
        blob = blobs[i]
        if blob is None:
            continue
        id = ids[i]
        length = len(<bytes>blob)
        p = <const char *>(<bytes>blob)
        if length >= 42:
            version = <uint8_t>p[0]
            memcpy(&ts, p + 1, 8)
            memcpy(&lo, p + 9, 8)
            memcpy(&hi, p + 17, 8)
            memcpy(&size, p + 25, 4)
            flags = <uint8_t>p[29]
            memcpy(&n_sketch, p + 30, 4)
            memcpy(&n_minhash, p + 34, 4)
            memcpy(&n_sentences, p + 38, 4)
            if (version == 2 and flags == 4 and n_minhash == 0 and n_sentences == 0
                    and length == 42 + 4 * <Py_ssize_t>n_sketch):
                sketch = np.empty(n_sketch, dtype=np.uint32)
                if n_sketch:
                    view = sketch
                    memcpy(&view[0], p + 42, 4 * <size_t>n_sketch)
                out[id] = make(id, ts, (<object>hi) << 64 | lo, size, sketch, None, None, NO_SENTENCES)
                continue
        out[id] = fallback(blob, id)
    return out


def overlay_writes(list names, list written_names, list kept, dict written) -> None:
    """`redis_index.overlay_writes`, compiled: `names` in an open-addressing table of their (cached)
    hashes, then each written field looked up by hash and compared only on a hash match."""
    cdef Py_ssize_t n = len(names), mask, slot, i
    cdef uint64_t h
    cdef uint64_t *slot_hash
    cdef Py_ssize_t *slot_at
    cdef object name, other, p, value, w, column
    cdef tuple pair
    if not written or not kept:
        return
    mask = open_table(n, &slot_hash, &slot_at) - 1
    try:
        for i in range(n):
            h = <uint64_t>PyObject_Hash(names[i])
            slot = <Py_ssize_t>(h & <uint64_t>mask)
            while slot_at[slot] >= 0:  # the names are distinct: no comparison needed to place one
                slot = (slot + 1) & mask
            slot_at[slot] = i
            slot_hash[slot] = h
        for pair in kept:
            w = written.get(pair[0])
            if not w:
                continue
            column = pair[1]
            for p, value in (<dict>w).items():
                name = written_names[p]
                h = <uint64_t>PyObject_Hash(name)
                slot = <Py_ssize_t>(h & <uint64_t>mask)
                while True:
                    i = slot_at[slot]
                    if i < 0:
                        break
                    if slot_hash[slot] == h:
                        other = names[i]
                        if other is name or other == name:
                            (<list>column)[i] = value
                            break
                    slot = (slot + 1) & mask
    finally:
        PyMem_Free(slot_hash)
        PyMem_Free(slot_at)


def rank_lookup(list columns, list positions_of, list id_places, list ids, list floors, Py_ssize_t limit,
                list horizons, Py_ssize_t cap, entry_time) -> list:
    """`redis_index.rank_lookup`, compiled: per query of a lookup, (its stored entry's bytes if live, else
    None; `rank_records` of its buckets)."""
    cdef Py_ssize_t i, n = len(ids)
    cdef double horizon, ts
    cdef object own, blob
    cdef _RankScratch scratch = _RankScratch()
    out = []
    for i in range(n):
        e = id_places[i]
        horizon = horizons[i]
        own = None
        for column in columns:
            blob = (<list>column)[e]
            if blob is None:
                continue
            if len(<bytes>blob) >= 9:
                memcpy(&ts, <const char *>(<bytes>blob) + 1, 8)
            else:
                ts = entry_time(blob, ids[i])  # raises: too short for an entry
            if ts >= horizon:
                own = blob
                break
        out.append((own, _rank_records(columns, positions_of[i], ids[i], floors[i], limit, horizon, cap, -1, None,
                                       scratch)))
    return out


def encode_entries(list entries, fallback) -> list:
    """`redis_index.encode_entry` of each entry of `entries` ((Entry, keys) pairs): the common form (a
    uint32 sketch, no simhash, minhash or sentences) written here, any other by `fallback(entry)`."""
    cdef list out = []
    cdef const uint32_t[::1] sketch
    cdef Py_ssize_t n
    cdef char *p
    cdef double ts
    cdef uint64_t lo, hi
    cdef uint32_t size, count
    for item in entries:
        entry = (<tuple>item)[0]
        sk = entry.sketch
        exact = entry.exact
        if (entry.simhash is None and entry.minhash is None and not entry.sentences and sk.dtype == np.uint32
                and 0 <= exact < (1 << 128) and 0 <= entry.size < (1 << 32)):
            sketch = sk
            n = sketch.shape[0]
            blob = PyBytes_FromStringAndSize(NULL, 42 + 4 * n)
            p = PyBytes_AS_STRING(blob)
            ts = entry.ts
            lo = <uint64_t>(exact & 0xFFFFFFFFFFFFFFFF)
            hi = <uint64_t>(exact >> 64)
            size = entry.size
            count = <uint32_t>n
            p[0] = 2  # ENCODING_VERSION
            memcpy(p + 1, &ts, 8)
            memcpy(p + 9, &lo, 8)
            memcpy(p + 17, &hi, 8)
            memcpy(p + 25, &size, 4)
            p[29] = 4  # the sketch is uint32
            memcpy(p + 30, &count, 4)
            memset(p + 34, 0, 8)  # no minhash, no sentences
            if n:
                memcpy(p + 42, &sketch[0], 4 * n)
            out.append(blob)
        else:
            out.append(fallback(entry))
    return out


# --- records made without their generated __init__ ---------------------------------------------------

cdef extern from "Python.h":
    int PyObject_GenericSetAttr(object o, object name, object value) except -1

cdef object object_new = object.__new__


cdef class Frozen:
    """Makes instances of a frozen, slotted dataclass from all its field values, in field order: what
    `cls(*values)` makes. The generated `__init__` of a frozen dataclass sets each field through a
    Python-level `object.__setattr__` call (≈ 0.15 µs a field); here each is one generic set, which
    like `object.__setattr__` goes past the class's refusing `__setattr__`. Only for classes where that
    is all `__init__` does: no `__post_init__`, no `__new__` of their own, every field an init slot."""

    cdef readonly object cls
    cdef tuple names

    def __init__(self, cls):
        import dataclasses

        params = getattr(cls, "__dataclass_params__", None)
        names = tuple(f.name for f in dataclasses.fields(cls)) if params is not None else ()
        if (params is None or not params.frozen or cls.__dict__.get("__slots__") != names
                or hasattr(cls, "__post_init__") or cls.__new__ is not object.__new__
                or tuple(inspect.signature(cls.__init__).parameters)[1:] != names):
            raise TypeError(f"{cls!r} is not a frozen, slotted dataclass whose __init__ only sets its fields")
        self.cls = cls
        self.names = tuple(sys_intern(name) for name in names)

    def __call__(self, *values):
        cdef Py_ssize_t i, n = len(self.names)
        cdef object obj
        if len(values) != n:
            raise TypeError(f"{self.cls.__name__} takes {n} values, got {len(values)}")
        obj = object_new(self.cls)
        for i in range(n):
            PyObject_GenericSetAttr(obj, self.names[i], values[i])
        return obj

