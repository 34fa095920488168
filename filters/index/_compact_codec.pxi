# The compact slot layout's compiled per-message work (included by filters/_native.pyx, after
# index/_redis_codec.pxi, whose scratch buffers and records it uses): the twins of
# filters/index/compact_codec.py, held to it by tests/test_native.py.

cdef inline uint64_t fib_hash(uint64_t key, int bits) noexcept nogil:
    return (key * 0x9E3779B97F4A7C15ULL) >> (64 - bits) if bits else 0


def small_hash(key, int bits) -> int:
    """`filters.index.compact_codec.small_hash`, compiled."""
    if not 0 <= key <= 0xFFFFFFFFFFFFFFFF:
        raise ValueError(f"bucket keys must be unsigned 64-bit ints, got {key!r}")
    if not 0 <= bits <= 64:
        raise ValueError(f"bits must be 0 to 64, got {bits!r}")
    return fib_hash(<uint64_t>key, bits)


def id_small_hash(str id, int bits) -> int:
    """`filters.index.compact_codec.id_small_hash`, compiled."""
    cdef bytes raw = id.encode("utf-8", "surrogatepass")
    cdef const char *p = raw
    cdef Py_ssize_t i
    cdef uint64_t h = 0xcbf29ce484222325ULL
    if not 0 <= bits <= 64:
        raise ValueError(f"bits must be 0 to 64, got {bits!r}")
    for i in range(len(raw)):
        h = (h ^ <uint8_t>p[i]) * 0x100000001b3ULL
    return fib_hash(h, bits)


def rank_compact(list values, list positions, uint64_t own, Py_ssize_t floor, Py_ssize_t limit, double horizon,
                 Py_ssize_t cap, long long since, object mine) -> list:
    """`filters.index.compact_codec.rank_records`, compiled: the ranked candidates (seqs) of one lookup, given
    the bucket values read per slice (`values[s][positions[k]]`: bucket k's value in slice s, bytes or None)."""
    return _rank_compact(values, positions, own, floor, limit, horizon, cap, since, mine, _RankScratch())


cdef list _rank_compact(list values, list positions, uint64_t own, Py_ssize_t floor, Py_ssize_t limit,
                        double horizon, Py_ssize_t cap, long long since, object mine, _RankScratch scratch):
    cdef Py_ssize_t nkeys = len(positions), nslices = len(values), k, s, present = 0, total = 0, nrec, j, t
    cdef Py_ssize_t pos, end, size
    cdef object v
    cdef const char *buf
    cdef uint32_t stamp
    cdef nd_record *recs
    cdef Tally *table
    cdef Tally **hits
    cdef Tally *tally
    cdef uint64_t mask, seq
    cdef Py_ssize_t nhits = 0, cap_recs = 0, kept
    cdef double ts
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
                if len(<bytes>v) % 16:
                    from filters.errors import IndexCorrupt
                    raise IndexCorrupt(f"a bucket holds {len(<bytes>v)} bytes that are not records of 16")
                size += len(<bytes>v) // 16
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
                memcpy(&ts, buf + pos, 8)
                if ts >= horizon:
                    recs[nrec].ts = ts
                    recs[nrec].seq = be64(buf + pos + 8)
                    recs[nrec].id = NULL
                    recs[nrec].n = 0
                    nrec += 1
                pos += 16
        if nrec > cap:
            nd_sort_newest_first(recs, recs + nrec)
            nrec = cap
        for j in range(nrec):
            seq = recs[j].seq
            if seq == own:
                continue
            tally = &table[mix64(seq) & mask]
            while tally.stamp == stamp and tally.seq != seq:
                tally = &table[((tally - table) + 1) & mask]
            if tally.stamp == stamp and tally.last_key == k + 1:
                continue  # the same seq twice in one bucket
            if since >= 0 and (seq <= <uint64_t>since or (mine is not None and seq in mine)):
                continue
            if tally.stamp != stamp:
                tally.stamp = stamp
                tally.shared = 1
                tally.first = <uint32_t>k
                tally.seq = seq
                tally.ts = recs[j].ts
                hits[nhits] = tally
                nhits += 1
            else:
                tally.shared += 1
            tally.last_key = <uint32_t>(k + 1)
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
        out.append((hits[j].seq, hits[j].shared, hits[j].first, hits[j].ts))
        if len(out) >= limit:
            break
    return out
