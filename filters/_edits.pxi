# Compiled edit measures (included by filters/_native.pyx): `filters/edits.py` on two arrays of code points.

# --- LCS similarity and the same characters in another order ----------------------------------------------

cdef extern from * nogil:
    """
    static inline int nd_popcount64(unsigned long long x) { return __builtin_popcountll(x); }
    """
    int nd_popcount64(unsigned long long x)

cdef enum:
    EDIT_MAX_CHARS = 256  # FilterConfig.short_text's bound: the measures work in stack buffers of this size
cdef Py_ssize_t EDIT_MIN_CHARS = 4  # edits.MIN_CHARS


cdef Py_ssize_t lcs_length(const uint32_t *a, Py_ssize_t na, const uint32_t *b, Py_ssize_t nb) noexcept nogil:
    """`edits.lcs_length` of two texts of at most `EDIT_MAX_CHARS`: the bit-parallel recurrence, one bit per
    character of the longer text `a` (in 64-bit words), the match mask of each character of `b` looked up
    in a small open-addressing table of `a`'s distinct characters."""
    if na < nb:
        a, b = b, a
        na, nb = nb, na
    if nb == 0:
        return 0
    cdef uint64_t masks[EDIT_MAX_CHARS * 4]
    cdef uint64_t v[4]
    cdef uint32_t keys[EDIT_MAX_CHARS * 2]
    cdef int32_t at[EDIT_MAX_CHARS * 2]
    cdef Py_ssize_t words = (na + 63) // 64, slots = 16, i, w, s, distinct = 0, lcs = 0
    cdef uint64_t carry, borrow, x, u, total, diff, mask
    cdef const uint64_t *m
    while slots < 2 * na:
        slots *= 2
    for s in range(slots):
        at[s] = -1
    for i in range(na):  # the mask of each distinct character of a: the places it holds
        s = <Py_ssize_t>(mix64(a[i]) & <uint64_t>(slots - 1))
        while at[s] >= 0 and keys[s] != a[i]:
            s = (s + 1) & (slots - 1)
        if at[s] < 0:
            at[s] = <int32_t>distinct
            keys[s] = a[i]
            memset(masks + distinct * words, 0, words * sizeof(uint64_t))
            distinct += 1
        masks[at[s] * words + i // 64] |= 1ULL << (i % 64)
    for w in range(words):
        v[w] = 0xFFFFFFFFFFFFFFFFULL
    for i in range(nb):
        s = <Py_ssize_t>(mix64(b[i]) & <uint64_t>(slots - 1))
        while at[s] >= 0 and keys[s] != b[i]:
            s = (s + 1) & (slots - 1)
        if at[s] < 0:
            continue  # no place of a holds it: V stays as it is
        m = masks + at[s] * words
        carry = 0
        borrow = 0
        for w in range(words):  # V = (V + U) | (V - U), U = V & M[b_i], in multi-word arithmetic
            x = v[w]
            u = x & m[w]
            total = x + u
            diff = x - u
            v[w] = (total + carry) | (diff - borrow)
            carry = <uint64_t>((total < x) | ((total + carry) < total))
            borrow = <uint64_t>((x < u) | (diff < borrow))
    for w in range(words):
        mask = 0xFFFFFFFFFFFFFFFFULL if (w + 1) * 64 <= na else (1ULL << (na - w * 64)) - 1
        lcs += nd_popcount64(v[w] & mask)
    return na - lcs


cdef bint same_characters(const uint32_t *a, Py_ssize_t na, const uint32_t *b, Py_ssize_t nb) noexcept nogil:
    """`edits.same_characters` of two texts of at most `EDIT_MAX_CHARS`: equal lengths, equal sorted code points."""
    if na != nb:
        return False
    cdef uint32_t sa[EDIT_MAX_CHARS]
    cdef uint32_t sb[EDIT_MAX_CHARS]
    memcpy(sa, a, na * sizeof(uint32_t))
    memcpy(sb, b, na * sizeof(uint32_t))
    cpp_sort(sa, sa + na)
    cpp_sort(sb, sb + na)
    return memcmp(sa, sb, na * sizeof(uint32_t)) == 0


cdef double edit_match(const uint32_t *a, Py_ssize_t na, const uint32_t *b, Py_ssize_t nb,
                       double threshold) noexcept nogil:
    """`edits.edit_match`: the LCS similarity of two texts of `EDIT_MIN_CHARS` to `EDIT_MAX_CHARS` characters
    when it reaches `threshold` or when they are the same characters in another order, else -1."""
    if na < EDIT_MIN_CHARS or nb < EDIT_MIN_CHARS or na > EDIT_MAX_CHARS or nb > EDIT_MAX_CHARS:
        return -1.0
    if <double>(2 * (na if na < nb else nb)) < threshold * <double>(na + nb):
        return -1.0
    cdef double similarity = <double>(2 * lcs_length(a, na, b, nb)) / <double>(na + nb)
    if similarity >= threshold or same_characters(a, na, b, nb):
        return similarity
    return -1.0


cdef Py_ssize_t code_points_of(str text, uint32_t **buf, Py_ssize_t *cap) except -1:
    """`text`'s code points in the scratch buffer `buf` (grown as needed); returns how many."""
    cdef Py_ssize_t n = len(text)
    if n >= cap[0]:
        PyMem_Free(buf[0])
        buf[0] = <uint32_t *>PyMem_Malloc((n + 1) * 2 * sizeof(uint32_t))
        cap[0] = (n + 1) * 2 if buf[0] else 0
        if not buf[0]:
            raise MemoryError()
    copy_code_points(text, n, buf[0])
    return n


def lcs_length_of(str a, str b) -> int:
    """`edits.lcs_length`, compiled (for the tests)."""
    cdef uint32_t *pa = NULL
    cdef uint32_t *pb = NULL
    cdef Py_ssize_t ca = 0, cb = 0, na, nb
    if len(a) > EDIT_MAX_CHARS or len(b) > EDIT_MAX_CHARS:
        raise ValueError(f"the edit measures take texts of at most {EDIT_MAX_CHARS} characters")
    try:
        na = code_points_of(a, &pa, &ca)
        nb = code_points_of(b, &pb, &cb)
        return lcs_length(pa, na, pb, nb)
    finally:
        PyMem_Free(pa); PyMem_Free(pb)


def edit_match_of(str a, str b, double threshold) -> float:
    """`edits.edit_match`, compiled (for the tests)."""
    cdef uint32_t *pa = NULL
    cdef uint32_t *pb = NULL
    cdef Py_ssize_t ca = 0, cb = 0, na, nb
    if len(a) > EDIT_MAX_CHARS or len(b) > EDIT_MAX_CHARS:
        raise ValueError(f"the edit measures take texts of at most {EDIT_MAX_CHARS} characters")
    try:
        na = code_points_of(a, &pa, &ca)
        nb = code_points_of(b, &pb, &cb)
        return edit_match(pa, na, pb, nb, threshold)
    finally:
        PyMem_Free(pa); PyMem_Free(pb)
