# The group layout's compiled per-batch work (included by filters/_native.pyx, after index/_compact_codec.pxi):
# the twins of filters/index/group_codec.py, held to it by tests/test_group_codec.py.

cdef enum:
    GROUP_RECORD = 20
    GROUP_K_MAX = 30


cdef inline uint64_t _load_be64(const unsigned char *p) noexcept nogil:
    cdef uint64_t v = 0
    cdef int i
    for i in range(8):
        v = (v << 8) | p[i]
    return v


cdef inline void _store_be32(unsigned char *p, uint32_t v) noexcept nogil:
    p[0] = <unsigned char>(v >> 24)
    p[1] = <unsigned char>(v >> 16)
    p[2] = <unsigned char>(v >> 8)
    p[3] = <unsigned char>v


cdef inline void _store_be64(unsigned char *p, uint64_t v) noexcept nogil:
    cdef int i
    for i in range(8):
        p[i] = <unsigned char>(v >> (56 - 8 * i))


cdef inline int _group_place(bytes name, int bits, uint64_t *j, uint32_t *key) except -1:
    """1 for a bucket, 2 for an id, 0 for a field of the slice hash itself (`group_codec.place`)."""
    cdef Py_ssize_t n = len(name), i
    cdef const unsigned char *p = <const unsigned char *>PyBytes_AS_STRING(name)
    cdef uint64_t h, m
    cdef int kind
    if n == 9 and p[0] == 98:  # b"b"
        h = _load_be64(p + 1)
        kind = 1
    elif n >= 1 and p[0] == 105:  # b"i"
        h = 0xcbf29ce484222325ULL
        for i in range(1, n):
            h = (h ^ p[i]) * 0x100000001b3ULL
        kind = 2
    else:
        return 0
    m = h * 0x9E3779B97F4A7C15ULL
    j[0] = (m >> (64 - bits)) if bits else 0
    key[0] = <uint32_t>m
    return kind


cdef inline bint _rec_is(const unsigned char *r, uint32_t key, bint is_id) noexcept nogil:
    return (((<uint32_t>r[0] << 24) | (<uint32_t>r[1] << 16) | (<uint32_t>r[2] << 8) | r[3]) == key
            and ((r[12] & 0x80) != 0) == is_id)


cdef inline Py_ssize_t _group_len(object group) except -1:
    cdef Py_ssize_t n = len(<bytes>group)
    if n % GROUP_RECORD:
        from filters.errors import IndexCorrupt
        raise IndexCorrupt(f"a group holds {n} bytes that are not records of {GROUP_RECORD}")
    return n // GROUP_RECORD


cdef object _bucket_records(object group, uint32_t key):
    if group is None:
        return None
    cdef Py_ssize_t n = _group_len(group), r, found = 0
    if n == 0:
        return None
    cdef const unsigned char *g = <const unsigned char *>PyBytes_AS_STRING(group)
    for r in range(n):
        if _rec_is(g + r * GROUP_RECORD, key, False):
            found += 1
    if not found:
        return None
    cdef bytes out = PyBytes_FromStringAndSize(NULL, found * 16)
    cdef char *o = PyBytes_AS_STRING(out)
    for r in range(n):
        if _rec_is(g + r * GROUP_RECORD, key, False):
            memcpy(o, g + r * GROUP_RECORD + 4, 16)
            o += 16
    return out


cdef object _id_record(object group, uint32_t key):
    if group is None:
        return None
    cdef Py_ssize_t n = _group_len(group), r, best = -1
    cdef const unsigned char *g = <const unsigned char *>PyBytes_AS_STRING(group)
    cdef double ts, best_ts = 0
    cdef uint64_t seq, best_seq = 0
    for r in range(n):
        if _rec_is(g + r * GROUP_RECORD, key, True):
            memcpy(&ts, g + r * GROUP_RECORD + 4, 8)
            seq = _load_be64(g + r * GROUP_RECORD + 12) & 0x7FFFFFFFFFFFFFFFULL
            if best < 0 or ts > best_ts or (ts == best_ts and seq > best_seq):
                best, best_ts, best_seq = r, ts, seq
    if best < 0:
        return None
    cdef bytes out = PyBytes_FromStringAndSize(<const char *>(g + best * GROUP_RECORD + 4), 16)
    (<unsigned char *>PyBytes_AS_STRING(out))[8] &= 0x7F
    return out


def group_bucket_records(group, bytes key) -> object:
    """`filters.index.group_codec.bucket_records`, compiled."""
    if len(key) != 4:
        raise ValueError("a record key is 4 bytes")
    return _bucket_records(group if group else None, _key32(key))


def group_id_record(group, bytes key) -> object:
    """`filters.index.group_codec.id_record`, compiled."""
    if len(key) != 4:
        raise ValueError("a record key is 4 bytes")
    return _id_record(group if group else None, _key32(key))


cdef inline uint32_t _key32(bytes key) noexcept:
    cdef const unsigned char *p = <const unsigned char *>PyBytes_AS_STRING(key)
    return (<uint32_t>p[0] << 24) | (<uint32_t>p[1] << 16) | (<uint32_t>p[2] << 8) | p[3]


cdef bytes _trim_bucket(bytes group, uint32_t key, Py_ssize_t cap):
    """`group_codec.trim_bucket`: the bucket's `cap` newest (event time, then seq bytes) kept in place."""
    cdef Py_ssize_t n = _group_len(group), r, m = 0, k
    cdef const unsigned char *g = <const unsigned char *>PyBytes_AS_STRING(group)
    for r in range(n):
        if _rec_is(g + r * GROUP_RECORD, key, False):
            m += 1
    if m <= cap:
        return group
    cdef vector[pair[pair[double, uint64_t], Py_ssize_t]] mine
    cdef double ts
    for r in range(n):
        if _rec_is(g + r * GROUP_RECORD, key, False):
            memcpy(&ts, g + r * GROUP_RECORD + 4, 8)
            mine.push_back(pair[pair[double, uint64_t], Py_ssize_t](
                pair[double, uint64_t](ts, _load_be64(g + r * GROUP_RECORD + 12)), r))
    cpp_sort(mine.begin(), mine.end())  # oldest first: the first m - cap go
    cdef vector[char] drop = vector[char](n, 0)
    for k in range(m - cap):
        drop[mine[k].second] = 1
    cdef bytes out = PyBytes_FromStringAndSize(NULL, (n - (m - cap)) * GROUP_RECORD)
    cdef char *o = PyBytes_AS_STRING(out)
    for r in range(n):
        if not drop[r]:
            memcpy(o, g + r * GROUP_RECORD, GROUP_RECORD)
            o += GROUP_RECORD
    return out


def group_trim_bucket(bytes group, bytes key, Py_ssize_t cap) -> bytes:
    """`filters.index.group_codec.trim_bucket`, compiled."""
    if len(key) != 4:
        raise ValueError("a record key is 4 bytes")
    return _trim_bucket(group, _key32(key), cap)


cdef bytes _append(bytes group, uint32_t key, double ts, uint64_t seq, Py_ssize_t cap, bint is_id):
    cdef Py_ssize_t n = _group_len(group), r, m = 0
    cdef const unsigned char *g
    if not is_id:
        g = <const unsigned char *>PyBytes_AS_STRING(group)
        for r in range(n):
            if _rec_is(g + r * GROUP_RECORD, key, False):
                m += 1
        if m > 2 * cap:
            group = _trim_bucket(group, key, cap)
    cdef Py_ssize_t size = len(group)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, size + GROUP_RECORD)
    cdef unsigned char *o = <unsigned char *>PyBytes_AS_STRING(out)
    memcpy(o, PyBytes_AS_STRING(group), size)
    _store_be32(o + size, key)
    memcpy(o + size + 4, &ts, 8)
    _store_be64(o + size + 12, seq | (0x8000000000000000ULL if is_id else 0))
    return out


def group_append_record(bytes group, bytes key, double ts, uint64_t seq, Py_ssize_t cap) -> bytes:
    """`filters.index.group_codec.append_record`, compiled."""
    if len(key) != 4:
        raise ValueError("a record key is 4 bytes")
    return _append(group, _key32(key), ts, seq, cap, False)


def group_append_id(bytes group, bytes key, double ts, uint64_t seq) -> bytes:
    """`filters.index.group_codec.append_id`, compiled."""
    if len(key) != 4:
        raise ValueError("a record key is 4 bytes")
    return _append(group, _key32(key), ts, seq, 0, True)


cdef inline bytes _group_name(uint64_t j):
    return b"g%d" % j


def group_read_fields(list names, object bits) -> tuple:
    """`filters.index.group_codec.read_fields`, compiled."""
    cdef list fields = [], places = []
    cdef dict at = {}
    cdef bytes name, field
    cdef uint64_t j
    cdef uint32_t key
    cdef int kind, b = 0 if bits is None else bits
    cdef bint unknown = bits is None
    cdef object k
    if not 0 <= b <= GROUP_K_MAX:
        raise ValueError(f"bits must be 0 to {GROUP_K_MAX}, got {bits!r}")
    for name in names:
        kind = _group_place(name, b, &j, &key)
        if kind and unknown:
            places.append(-1)
            continue
        field = _group_name(j) if kind else name
        k = at.get(field)
        if k is None:
            k = at[field] = len(fields)
            fields.append(field)
        places.append(k)
    return fields, places


def group_column_of(list values, list places, list names, object bits) -> list:
    """`filters.index.group_codec.column_of`, compiled."""
    cdef Py_ssize_t n = len(names), p, k
    cdef list column = PyList_New(n)
    cdef object value, out
    cdef uint64_t j
    cdef uint32_t key
    cdef int kind, b = 0 if bits is None else bits
    if len(places) != n:
        raise ValueError("one place a name expected")
    for p in range(n):
        k = places[p]
        if k < 0:
            out = None
        else:
            value = values[k]
            kind = 0 if bits is None else _group_place(<bytes>names[p], b, &j, &key)
            if kind == 0:
                out = value
            elif kind == 2:
                out = _id_record(value if value else None, key)
            else:
                out = _bucket_records(value if value else None, key)
        Py_INCREF(out)
        PyList_SET_ITEM(column, p, out)
    return column


def group_apply_round(dict groups, list names, int bits, list entries, Py_ssize_t cap) -> list:
    """`filters.index.group_codec.apply_round`, compiled."""
    cdef dict changed = {}
    cdef object entry, p, old
    cdef uint64_t j, seq
    cdef uint32_t key
    cdef double ts
    cdef bytes field
    cdef int kind
    if not 0 <= bits <= GROUP_K_MAX:
        raise ValueError(f"bits must be 0 to {GROUP_K_MAX}, got {bits!r}")
    for entry in entries:
        seq, ts = entry[0], entry[1]
        for p in entry[2]:
            kind = _group_place(<bytes>names[p], bits, &j, &key)
            if kind != 1:
                raise ValueError(f"not a bucket field: {names[p]!r}")
            field = _group_name(j)
            old = groups.get(field, b"")
            groups[field] = _append(<bytes>old, key, ts, seq, cap, False)
            changed[field] = None
        kind = _group_place(<bytes>names[entry[3]], bits, &j, &key)
        if kind != 2:
            raise ValueError(f"not an id field: {names[entry[3]]!r}")
        field = _group_name(j)
        old = groups.get(field, b"")
        groups[field] = _append(<bytes>old, key, ts, seq, 0, True)
        changed[field] = None
    return list(changed)


def group_count_buckets(list groups) -> int:
    """`filters.index.group_codec.count_buckets`, compiled."""
    cdef Py_ssize_t total = 0, n, r
    cdef const unsigned char *g
    cdef object group
    cdef set keys
    for group in groups:
        n = _group_len(group)
        g = <const unsigned char *>PyBytes_AS_STRING(group)
        keys = set()
        for r in range(n):
            if not (g[r * GROUP_RECORD + 12] & 0x80):
                keys.add(PyBytes_FromStringAndSize(<const char *>(g + r * GROUP_RECORD), 4))
        total += len(keys)
    return total


# --- a rebuild's groups, each field made once (filters/index/redis_group.py, `GroupIndex._rebuild_groups`) -----

def group_mixed_ids(list ids):
    """`filters.index.group_codec.mixed_ids`, compiled."""
    np = np_()
    cdef Py_ssize_t n = len(ids), i, k, size
    out = np.empty(n, dtype=np.uint64)
    cdef uint64_t[::1] o = out
    cdef uint64_t h
    cdef bytes raw
    cdef const unsigned char *p
    for i in range(n):
        raw = (<str>ids[i]).encode("utf-8", "surrogatepass")
        p = <const unsigned char *>PyBytes_AS_STRING(raw)
        size = len(raw)
        h = 0xcbf29ce484222325ULL
        for k in range(size):
            h = (h ^ p[k]) * 0x100000001b3ULL
        o[i] = h * 0x9E3779B97F4A7C15ULL
    return out


cdef struct _GroupRec:  # a record of a rebuild's fold, listed in fold order
    uint64_t j      # its group
    uint32_t key
    uint32_t e      # its entry
    bint is_id


cdef void _trim_vec(vector[unsigned char] &buf, uint32_t key, Py_ssize_t cap) except *:
    """`group_codec.trim_bucket` in place: the bucket's `cap` newest (event time, then seq; of records alike, the
    first) kept, in order."""
    cdef Py_ssize_t n = buf.size() // GROUP_RECORD, r, m = 0, k, w = 0
    cdef unsigned char *g = buf.data()
    cdef vector[pair[pair[double, uint64_t], Py_ssize_t]] mine
    cdef double ts
    for r in range(n):
        if _rec_is(g + r * GROUP_RECORD, key, False):
            memcpy(&ts, g + r * GROUP_RECORD + 4, 8)
            mine.push_back(pair[pair[double, uint64_t], Py_ssize_t](
                pair[double, uint64_t](ts, _load_be64(g + r * GROUP_RECORD + 12)), -r))
    m = mine.size()
    if m <= cap:
        return
    cpp_sort(mine.begin(), mine.end())  # oldest first: the first m - cap go
    cdef vector[char] drop = vector[char](n, 0)
    for k in range(m - cap):
        drop[-mine[k].second] = 1
    for r in range(n):
        if not drop[r]:
            if w != r:
                memmove(g + w * GROUP_RECORD, g + r * GROUP_RECORD, GROUP_RECORD)
            w += 1
    buf.resize(w * GROUP_RECORD)


cdef inline Py_ssize_t _group_name_into(char *out, uint64_t j) noexcept nogil:
    """`group_field(j)` written into `out` (24 bytes at least); returns its length."""
    cdef char digits[21]
    cdef Py_ssize_t n = 0, i
    while True:
        digits[n] = <char>(48 + j % 10)
        n += 1
        j //= 10
        if j == 0:
            break
    out[0] = 103  # "g"
    for i in range(n):
        out[1 + i] = digits[n - 1 - i]
    return n + 1


cdef inline uint32_t _key_at(const unsigned char *r) noexcept nogil:
    return (<uint32_t>r[0] << 24) | (<uint32_t>r[1] << 16) | (<uint32_t>r[2] << 8) | r[3]


cdef inline Py_ssize_t _count_key(vector[pair[uint32_t, Py_ssize_t]] &held, uint32_t key) noexcept nogil:
    """One more record of bucket `key` in the group's counts; returns its place there."""
    cdef Py_ssize_t i
    for i in range(<Py_ssize_t>held.size()):
        if held[i].first == key:
            held[i].second += 1
            return i
    held.push_back(pair[uint32_t, Py_ssize_t](key, 1))
    return held.size() - 1


def group_held_groups(keys, bounds, times, seqs, ids_mixed, int bits, Py_ssize_t cap, dict olds, int share=0,
                      int share_bits=0) -> list:
    """`filters.index.group_codec.held_groups`, compiled: the share's records listed in fold order, put in order
    of group (then that order), each group folded in a buffer of its own, a bucket trimmed in place."""
    np = np_()
    cdef const uint64_t[::1] k = np.ascontiguousarray(keys, dtype=np.uint64)
    cdef const int64_t[::1] b = np.ascontiguousarray(bounds, dtype=np.int64)
    cdef const double[::1] t = np.ascontiguousarray(times, dtype=np.float64)
    cdef const uint64_t[::1] q = np.ascontiguousarray(seqs, dtype=np.uint64)
    cdef const uint64_t[::1] idm = np.ascontiguousarray(ids_mixed, dtype=np.uint64)
    cdef Py_ssize_t n = len(q), n_rec = len(k), e, r, r2, at, stop, m, size
    cdef uint64_t mk, j
    cdef int shift, top
    cdef bint dup
    cdef vector[_GroupRec] recs
    cdef _GroupRec rec
    cdef vector[unsigned char] buf
    cdef vector[pair[uint32_t, Py_ssize_t]] held
    cdef Py_ssize_t k_at
    cdef char name[24]
    cdef unsigned char one[GROUP_RECORD]
    cdef list out = []
    cdef bytes field
    cdef object old
    cdef double ts
    cdef uint64_t seq
    if not 0 <= bits <= GROUP_K_MAX:
        raise ValueError(f"bits must be 0 to {GROUP_K_MAX}, got {bits!r}")
    if not 0 <= share_bits <= bits:
        raise ValueError(f"share_bits must be 0 to bits ({bits}), got {share_bits!r}")
    if not (len(t) == len(idm) == n and len(b) == n + 1):
        raise ValueError("one event time, seq and id an entry, and one more bound, expected")
    for e in range(n):
        if b[e] < 0 or b[e] > b[e + 1] or b[e + 1] > n_rec:
            raise ValueError(f"bounds must rise within the {n_rec} keys")
    shift = bits - share_bits
    top = 64 - share_bits  # a group's share: the top share_bits bits of the mixed value, as of its group
    rec.is_id = False
    for e in range(n):
        rec.e = <uint32_t>e
        for r in range(b[e], b[e + 1]):
            mk = k[r] * 0x9E3779B97F4A7C15ULL
            if share_bits and (mk >> top) != <uint64_t>share:
                continue
            j = (mk >> (64 - bits)) if bits else 0
            dup = False
            for r2 in range(b[e], r):  # a key given twice by one entry: its record once
                if k[r2] == k[r]:
                    dup = True
                    break
            if dup:
                continue
            rec.j = j
            rec.key = <uint32_t>mk
            rec.is_id = False
            recs.push_back(rec)
        mk = idm[e]
        if not share_bits or (mk >> top) == <uint64_t>share:
            rec.j = (mk >> (64 - bits)) if bits else 0
            rec.key = <uint32_t>mk
            rec.is_id = True
            recs.push_back(rec)
    # The records by group, each group's in fold order: counted into place (stable) where the share has few groups
    # for its records, else sorted as (group, place) in one 64-bit number.
    m = recs.size()
    cdef vector[uint32_t] by_group
    cdef vector[uint64_t] packed
    cdef vector[int64_t] sorted_at = vector[int64_t](m)
    cdef uint64_t base = (<uint64_t>share) << shift, span = (<uint64_t>1) << shift
    if span <= <uint64_t>(2 * m + 4096):
        by_group.resize(span + 1, 0)
        for r in range(m):
            by_group[recs[r].j - base + 1] += 1
        for r in range(<Py_ssize_t>span):
            by_group[r + 1] += by_group[r]
        for r in range(m):
            sorted_at[by_group[recs[r].j - base]] = r
            by_group[recs[r].j - base] += 1
    else:
        packed.resize(m)
        for r in range(m):
            packed[r] = ((recs[r].j - base) << 34) | <uint64_t>r
        cpp_sort(packed.begin(), packed.end())
        for r in range(m):
            sorted_at[r] = <int64_t>(packed[r] & ((<uint64_t>1 << 34) - 1))
    at = 0
    while at < m:
        j = recs[sorted_at[at]].j
        field = PyBytes_FromStringAndSize(name, _group_name_into(name, j))
        buf.clear()
        old = olds.get(field) if olds else None
        if old:
            _group_len(old)
            size = len(<bytes>old)
            buf.resize(size)
            memcpy(buf.data(), PyBytes_AS_STRING(old), size)
        # Per bucket of the group, its records there (few buckets a group: a list looked through).
        held.clear()
        for r in range(<Py_ssize_t>(buf.size() // GROUP_RECORD)):
            if not (buf[r * GROUP_RECORD + 12] & 0x80):
                _count_key(held, _key_at(buf.data() + r * GROUP_RECORD))
        stop = at
        while stop < m and recs[sorted_at[stop]].j == j:
            rec = recs[sorted_at[stop]]
            if not rec.is_id:
                k_at = _count_key(held, rec.key)
                if held[k_at].second > 2 * cap + 1:  # (counted with the one appended below)
                    _trim_vec(buf, rec.key, cap)
                    held[k_at].second = cap + 1
            _store_be32(one, rec.key)
            ts = t[rec.e]
            memcpy(one + 4, &ts, 8)
            seq = q[rec.e]
            _store_be64(one + 12, seq | (0x8000000000000000ULL if rec.is_id else 0))
            buf.insert(buf.end(), one, one + GROUP_RECORD)
            stop += 1
        out.append(field)
        out.append(PyBytes_FromStringAndSize(<const char *>buf.data(), buf.size()))
        at = stop
    return out
