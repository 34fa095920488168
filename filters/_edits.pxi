# Compiled edit measures (included by filters/_native.pyx): `filters/edits.py` on two arrays of code points.

# --- LCS similarity and the same characters in another order ----------------------------------------------

cdef extern from * nogil:
    """
    static inline int nd_popcount64(unsigned long long x) { return __builtin_popcountll(x); }
    """
    int nd_popcount64(unsigned long long x)

cdef enum:
    EDIT_STACK_CHARS = 256  # texts up to this long are measured in stack buffers, longer ones in the heap
cdef Py_ssize_t EDIT_MIN_CHARS = 4  # edits.MIN_CHARS


cdef Py_ssize_t lcs_length(const uint32_t *a, Py_ssize_t na, const uint32_t *b, Py_ssize_t nb) except -1:
    """`edits.lcs_length`: the bit-parallel recurrence, one bit per character of the longer text `a` (in
    64-bit words), the match mask of each character of `b` looked up in a small open-addressing table."""
    if na < nb:
        a, b = b, a
        na, nb = nb, na
    if nb == 0:
        return 0
    cdef Py_ssize_t words = (na + 63) // 64, slots = 16, i, w, s, distinct = 0
    while slots < 2 * na:
        slots *= 2
    cdef uint64_t stack_masks[EDIT_STACK_CHARS * 4]
    cdef uint64_t stack_v[4]
    cdef uint32_t stack_keys[EDIT_STACK_CHARS * 2]
    cdef int32_t stack_at[EDIT_STACK_CHARS * 2]
    cdef uint64_t *masks = stack_masks
    cdef uint64_t *v = stack_v
    cdef uint32_t *keys = stack_keys
    cdef int32_t *at = stack_at
    cdef bint heap = na > EDIT_STACK_CHARS
    if heap:
        masks = <uint64_t *>PyMem_Malloc(na * words * sizeof(uint64_t))
        v = <uint64_t *>PyMem_Malloc(words * sizeof(uint64_t))
        keys = <uint32_t *>PyMem_Malloc(slots * sizeof(uint32_t))
        at = <int32_t *>PyMem_Malloc(slots * sizeof(int32_t))
        if not masks or not v or not keys or not at:
            PyMem_Free(masks); PyMem_Free(v); PyMem_Free(keys); PyMem_Free(at)
            raise MemoryError()
    cdef uint64_t carry, borrow, x, u, total, diff, mask
    cdef const uint64_t *m
    cdef Py_ssize_t lcs
    try:
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
        lcs = 0
        for w in range(words):
            mask = 0xFFFFFFFFFFFFFFFFULL if (w + 1) * 64 <= na else (1ULL << (na - w * 64)) - 1
            lcs += nd_popcount64(v[w] & mask)
        return na - lcs
    finally:
        if heap:
            PyMem_Free(masks); PyMem_Free(v); PyMem_Free(keys); PyMem_Free(at)


cdef bint same_characters(const uint32_t *a, Py_ssize_t na, const uint32_t *b, Py_ssize_t nb) except -1:
    """`edits.same_characters`: equal lengths and equal sorted code points."""
    if na != nb:
        return False
    cdef uint32_t stack_a[EDIT_STACK_CHARS]
    cdef uint32_t stack_b[EDIT_STACK_CHARS]
    cdef uint32_t *sa = stack_a
    cdef uint32_t *sb = stack_b
    cdef bint heap = na > EDIT_STACK_CHARS
    if heap:
        sa = <uint32_t *>PyMem_Malloc(na * sizeof(uint32_t))
        sb = <uint32_t *>PyMem_Malloc(na * sizeof(uint32_t))
        if not sa or not sb:
            PyMem_Free(sa); PyMem_Free(sb)
            raise MemoryError()
    try:
        memcpy(sa, a, na * sizeof(uint32_t))
        memcpy(sb, b, na * sizeof(uint32_t))
        cpp_sort(sa, sa + na)
        cpp_sort(sb, sb + na)
        return memcmp(sa, sb, na * sizeof(uint32_t)) == 0
    finally:
        if heap:
            PyMem_Free(sa); PyMem_Free(sb)


cdef double edit_match(const uint32_t *a, Py_ssize_t na, const uint32_t *b, Py_ssize_t nb,
                       double threshold) except -2.0:
    """`edits.edit_match`: the LCS similarity of two texts of at least `EDIT_MIN_CHARS` when it reaches
    `threshold` or when they are the same characters in another order, else -1."""
    if na < EDIT_MIN_CHARS or nb < EDIT_MIN_CHARS:
        return -1.0
    if <double>(2 * (na if na < nb else nb)) < threshold * <double>(na + nb):
        return -1.0
    cdef double similarity = <double>(2 * lcs_length(a, na, b, nb)) / <double>(na + nb)
    if similarity >= threshold or same_characters(a, na, b, nb):
        return similarity
    return -1.0


cdef Py_ssize_t code_points_of(str text, uint32_t **buf, Py_ssize_t *cap) except -1:
    """`text`'s code points in the scratch buffer `buf` (grown as needed); returns how many."""
    cdef Py_ssize_t n = len(text), j = 0
    cdef Py_UCS4 ch
    if n >= cap[0]:
        PyMem_Free(buf[0])
        buf[0] = <uint32_t *>PyMem_Malloc((n + 1) * 2 * sizeof(uint32_t))
        cap[0] = (n + 1) * 2 if buf[0] else 0
        if not buf[0]:
            raise MemoryError()
    for ch in text:
        buf[0][j] = ch
        j += 1
    return n


def lcs_length_of(str a, str b) -> int:
    """`edits.lcs_length`, compiled (for the tests)."""
    cdef uint32_t *pa = NULL
    cdef uint32_t *pb = NULL
    cdef Py_ssize_t ca = 0, cb = 0, na, nb
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
    try:
        na = code_points_of(a, &pa, &ca)
        nb = code_points_of(b, &pb, &cb)
        return edit_match(pa, na, pb, nb, threshold)
    finally:
        PyMem_Free(pa); PyMem_Free(pb)
