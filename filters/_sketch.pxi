# Compiled sketch comparison (included by filters/_native.pyx): `filters/sketch.py` `Probe.estimates` and the
# engine's sketch verdict, on two sorted sketches.

# --- sketch comparison -----------------------------------------------------------------------------

cdef struct Estimates:
    double jaccard
    double containment_a
    double containment_b


ctypedef fused sketch_t:  # a sketch's values: a fingerprint's fit 32 bits (stored so), others take 64
    uint32_t
    uint64_t


cdef inline Py_ssize_t bisect_right(const sketch_t *a, Py_ssize_t n, uint64_t x) noexcept nogil:
    cdef Py_ssize_t lo = 0, hi = n, mid
    while lo < hi:
        mid = (lo + hi) // 2
        if x < a[mid]:
            hi = mid
        else:
            lo = mid + 1
    return lo


cdef Estimates estimates(const sketch_t *a, Py_ssize_t na, int64_t size_a,
                         const sketch_t *b, Py_ssize_t nb, int64_t size_b) noexcept nogil:
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
    # Distinct common values (a set intersection: a sketch may repeat a 32-bit value), all <= tau now. The
    # merge steps without a branch on the values: which side moves is random, and a branch on it was
    # mispredicted every other step. A value met in both is counted unless it is the last one counted.
    cdef Py_ssize_t i = 0, j = 0, inter = 0
    cdef uint64_t x, y, last = 0
    cdef bint same, counted = False
    while i < na and j < nb:
        x = a[i]
        y = b[j]
        same = x == y
        inter += same & ((not counted) | (x != last))
        last = x if same else last
        counted = counted | same
        i += x <= y
        j += y <= x
    r.jaccard = <double>inter / <double>(na + nb - inter)
    r.containment_a = <double>inter / <double>na
    r.containment_b = <double>inter / <double>nb
    return r


def sketch_estimates(a, int64_t size_a, b, int64_t size_b) -> tuple:
    """`estimates` of two sorted sketches (uint32 or uint64 arrays, of one width), for the tests."""
    cdef const uint32_t[::1] a32, b32
    cdef const uint64_t[::1] a64, b64
    cdef Estimates r
    if a.dtype.itemsize == 4:
        a32, b32 = a, b
        r = estimates(&a32[0] if len(a32) else NULL, len(a32), size_a, &b32[0] if len(b32) else NULL, len(b32),
                      size_b)
    else:
        a64, b64 = a, b
        r = estimates(&a64[0] if len(a64) else NULL, len(a64), size_a, &b64[0] if len(b64) else NULL, len(b64),
                      size_b)
    return r.jaccard, r.containment_a, r.containment_b


cdef struct Rules:  # the verification parameters of a `FilterConfig`, read once per batch
    double min_shared
    Py_ssize_t limit
    double threshold
    double threshold_long
    double containment
    double min_ratio
    int64_t min_size
    int64_t slack
    double slack_share
    double edit


cdef Rules rules_of(cfg) except *:
    cdef Rules r
    r.min_shared = cfg.min_shared
    r.limit = cfg.max_candidates
    r.threshold = cfg.threshold
    r.threshold_long = cfg.threshold_long
    r.containment = cfg.containment
    r.min_ratio = cfg.containment_min_ratio
    r.min_size = cfg.containment_min_size
    r.slack = cfg.containment_slack
    r.slack_share = cfg.containment_slack_share
    r.edit = cfg.edit_similarity
    return r


cdef inline double similarity(Estimates est, int64_t size_a, int64_t size_b, const Rules *r,
                              const uint32_t *chars_a, Py_ssize_t na, const uint32_t *chars_b,
                              Py_ssize_t nb) noexcept nogil:
    """`NearDupFilter._sketch_match` on the estimates and the short texts' characters (`na`, `nb`: 0 for a text
    that is not short): the Jaccard if it passes `threshold` (`threshold_long` when one text is not short and
    neither is contained in the other); else the containment of the smaller text if it passes (with the size
    ratio, the minimum size and the slack); else the edit rule's LCS similarity if both texts are short and it
    passes; else -1."""
    cdef double best = est.containment_a
    cdef int64_t inside = size_a
    if est.containment_b > est.containment_a:
        best = est.containment_b
        inside = size_b
    if est.jaccard >= r.threshold and (est.jaccard >= r.threshold_long or best >= r.containment or (na and nb)):
        return est.jaccard
    cdef int64_t small = size_a if size_a < size_b else size_b
    cdef int64_t big = size_a if size_a > size_b else size_b
    if big < 1:
        big = 1
    cdef double slack = <double>r.slack
    if <double>inside * r.slack_share < slack:
        slack = <double>inside * r.slack_share
    if <double>inside / 16.0 > slack:
        slack = <double>inside / 16.0
    if (best >= r.containment and <double>small / <double>big >= r.min_ratio and small >= r.min_size
            and <double>inside * (1.0 - best) <= slack):
        return best
    if na and nb:
        return edit_match(chars_a, na, chars_b, nb, r.edit)
    return -1.0
