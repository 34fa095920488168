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


def rank_all_compact(list columns, list positions, list id_places, list ids, list floors, Py_ssize_t limit,
                     list horizons, Py_ssize_t cap, memo_time, _RankScratch scratch=None) -> list:
    """`filters.index.compact_codec.rank_all`, compiled. `scratch`: buffers kept by the caller (`rank_scratch`),
    else made for this call."""
    cdef list out = [], column
    cdef Py_ssize_t q, e, n = len(positions)
    cdef double horizon, ts
    cdef uint64_t own_seq
    cdef object value, own, memo
    if scratch is None:
        scratch = _RankScratch()
    if not (len(id_places) == len(ids) == len(floors) == len(horizons) == n):
        raise ValueError("one id place, id, floor and horizon a query expected")
    for q in range(n):
        e = id_places[q]
        horizon = horizons[q]
        own = None
        memo = None
        for column in columns:
            value = column[e]
            if value is not None:
                if len(<bytes>value) != 16:
                    from filters.errors import IndexCorrupt
                    raise IndexCorrupt(f"an id's field holds {len(<bytes>value)} bytes, not one record")
                memcpy(&ts, <const char *>(<bytes>value), 8)
                if ts >= horizon:
                    own = (be64(<const char *>(<bytes>value) + 8), ts)
                    break
        if own is None:
            for column in columns:
                value = column[e + 1]
                if value is not None and memo_time(value, ids[q]) >= horizon:
                    memo = value
                    break
        own_seq = own[0] if own is not None else 0
        out.append((own, memo, _rank_compact(columns, positions[q], own_seq, floors[q], limit, horizon, cap, -1,
                                             None, scratch)))
    return out


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


def alone_compact(list ids, list tss, list blobs, list fields_of, list places_of, list id_places, tuple slices,
                  dict columns, dict writes, double hwm, double window, double slice_length,
                  Py_ssize_t cap, uint64_t seq) -> tuple:
    """`filters.index.compact_codec.alone_round` (which documents it), compiled. Returns (results, groups,
    written, hwm, seq)."""
    cdef Py_ssize_t count = len(ids), i, j, nf, n_id
    cdef double ts, old_ts
    cdef bint live
    cdef object e, old, column, mine, p, v, f
    cdef list fields, places, pairs, results = [], written = []
    cdef dict groups = {}, at_of = {}
    cdef bytearray at_buf
    cdef Py_ssize_t *at  # per place of the slice: where its value is in the slice's pairs, or -1
    cdef Py_ssize_t place, k
    cdef bytes id_bytes, rec, blob, value, name
    cdef char *rp
    cdef Py_ssize_t too_long = 2 * cap * 16
    cdef long long s, sl
    for i in range(count):
        e = id_places[i]
        live = False
        for s in slices:
            old = (<dict>writes[s]).get(e)
            if old is None:
                column = columns.get(s)
                old = (<list>column)[e] if column is not None else None
            if old is not None:
                if len(<bytes>old) < 16 or len(<bytes>old) % 16:
                    from filters.errors import IndexCorrupt
                    raise IndexCorrupt(f"a bucket holds {len(<bytes>old)} bytes that are not records of 16")
                memcpy(&old_ts, <const char *>(<bytes>old), 8)
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
        rec = PyBytes_FromStringAndSize(NULL, 16)
        rp = PyBytes_AS_STRING(rec)
        memcpy(rp, &ts, 8)
        put_be64(rp + 8, seq)
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
        for j in range(nf):
            f = fields[j]
            p = places[j]
            v = (<dict>mine).get(p)
            if v is None:
                v = (<list>column)[p]
            if v is None:
                v = rec
            else:
                if len(<bytes>v) > too_long:
                    v = _trim16(<bytes>v, cap)
                v = <bytes>v + rec
            (<dict>mine)[p] = v
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
        (<dict>mine)[e] = rec
        id_bytes = (<str>ids[i]).encode("utf-8", "surrogatepass")
        n_id = len(id_bytes)
        if n_id > 0xFFFF:
            raise ValueError(f"ids must be at most 65,535 bytes of UTF-8, got {n_id:,}")
        blob = blobs[i]
        value = PyBytes_FromStringAndSize(NULL, len(blob) + n_id + 2)
        rp = PyBytes_AS_STRING(value)
        memcpy(rp, <const char *>blob, len(blob))
        memcpy(rp + len(blob), <const char *>id_bytes, n_id)
        rp[len(blob) + n_id] = <char>(n_id & 0xFF)
        rp[len(blob) + n_id + 1] = <char>(n_id >> 8)
        name = PyBytes_FromStringAndSize(NULL, 9)
        rp = PyBytes_AS_STRING(name)
        rp[0] = b'e'
        put_be64(rp + 1, seq)
        pairs.append(b"i" + id_bytes)
        pairs.append(rec)
        pairs.append(name)
        pairs.append(value)
        written.append((seq, sl, places))
        results.append(seq)
    return results, groups, written, hwm, seq


cdef bytes _trim16(bytes value, Py_ssize_t cap):
    """The `cap` newest records (event time, then seq) of a compact bucket value, in insertion order
    (`compact_codec.trim_records`)."""
    cdef Py_ssize_t n = len(value) // 16, j, kept = 0
    cdef const char *p = value
    cdef nd_record *recs
    cdef bytes out
    cdef char *op
    if len(value) % 16:
        from filters.errors import IndexCorrupt
        raise IndexCorrupt(f"a bucket holds {len(value)} bytes that are not records of 16")
    if n <= cap:
        return value
    recs = <nd_record *>PyMem_Malloc(n * sizeof(nd_record))
    if recs == NULL:
        raise MemoryError()
    try:
        for j in range(n):
            memcpy(&recs[j].ts, p + 16 * j, 8)
            recs[j].seq = be64(p + 16 * j + 8)
            recs[j].n = <uint32_t>j  # its place: kept in insertion order below
            recs[j].id = NULL
        nd_sort_newest_first(recs, recs + n)
        keep = bytearray(n)
        for j in range(cap):
            keep[recs[j].n] = 1
        out = PyBytes_FromStringAndSize(NULL, 16 * cap)
        op = PyBytes_AS_STRING(out)
        for j in range(n):
            if keep[j]:
                memcpy(op + 16 * kept, p + 16 * j, 16)
                kept += 1
        return out
    finally:
        PyMem_Free(recs)


def trim_compact(bytes value, Py_ssize_t cap) -> bytes:
    """`filters.index.compact_codec.trim_records`, compiled."""
    return _trim16(value, cap)


# --- where a slice's fields live (the twins of `compact_codec.field_hash`, `read_commands`, `column_of`,
# `write_commands`) -----------------------------------------------------------------------------------------

cdef inline long long field_small(bytes name, int bits) noexcept:
    """The small hash of a field of a slice (`compact_codec.field_hash`), -1 for the slice hash."""
    cdef const char *p = name
    cdef Py_ssize_t n = len(name), i
    cdef uint64_t h
    if n == 9 and p[0] == b'b':
        return <long long>fib_hash(be64(p + 1), bits)
    if n >= 1 and n <= 64 and p[0] == b'i':
        h = 0xcbf29ce484222325ULL
        for i in range(1, n):
            h = (h ^ <uint8_t>p[i]) * 0x100000001b3ULL
        return <long long>fib_hash(h, bits)
    return -1


def field_hash(bytes name, int bits):
    """`filters.index.compact_codec.field_hash`, compiled."""
    if not 0 <= bits <= 64:
        raise ValueError(f"bits must be 0 to 64, got {bits!r}")
    cdef long long j = field_small(name, bits)
    return None if j < 0 else j


def read_commands(str slice_key, list names, int bits, marked, Py_ssize_t per_command) -> tuple:
    """`filters.index.compact_codec.read_commands`, compiled."""
    cdef dict groups = {}
    cdef Py_ssize_t place, n = len(names), a, m
    cdef long long j
    cdef list at, commands = [], places = [], part
    cdef object name
    if not 0 <= bits <= 64:
        raise ValueError(f"bits must be 0 to 64, got {bits!r}")
    for place in range(n):
        name = names[place]
        j = -1 if name in marked else field_small(<bytes>name, bits)
        at = groups.get(j)
        if at is None:
            at = groups[j] = []
        at.append(place)
    for jj, at in sorted(groups.items()):  # the slice hash first, then the small hashes in order
        key = slice_key if jj < 0 else f"{slice_key}:{jj}"
        m = len(at)
        for a in range(0, m, per_command):
            part = at[a : a + per_command]
            commands.append(("HMGET", key, *[names[p] for p in part]))
            places.append(part)
    return commands, places


def column_of(list replies, list places, Py_ssize_t n) -> list:
    """`filters.index.compact_codec.column_of`, compiled."""
    cdef list column = [None] * n, reply, at
    cdef Py_ssize_t k, i
    if len(replies) != len(places):
        raise ValueError(f"{len(replies)} replies for {len(places)} reads")
    for k in range(len(replies)):
        reply = replies[k]
        at = places[k]
        if len(reply) != len(at):
            raise ValueError(f"a reply of {len(reply)} values for {len(at)} fields")
        for i in range(len(at)):
            column[<Py_ssize_t>at[i]] = reply[i]
    return column


def marked_places(list column) -> list:
    """`filters.index.compact_codec.marked_places`, compiled."""
    cdef list out = []
    cdef Py_ssize_t p
    cdef object value
    for p in range(len(column)):
        value = column[p]
        if type(value) is bytes and len(<bytes>value) == 1 and (<const char *>(<bytes>value))[0] == 0:
            out.append(p)
    return out


def write_commands(str slice_key, list pairs, int bits, marked, Py_ssize_t entries, Py_ssize_t memos,
                   ttl_ms, Py_ssize_t per_command) -> list:
    """`filters.index.compact_codec.write_commands`, compiled."""
    cdef dict groups = {}
    cdef Py_ssize_t a, n = len(pairs), step = 2 * per_command
    cdef long long j
    cdef list flat, commands = [], counts = []
    cdef object name, value
    if not 0 <= bits <= 64:
        raise ValueError(f"bits must be 0 to 64, got {bits!r}")
    for a in range(0, n, 2):
        name = pairs[a]
        value = pairs[a + 1]
        j = -1 if name in marked else field_small(<bytes>name, bits)
        if j >= 0 and len(<bytes>value) > 64:
            flat = groups.get(j)
            if flat is None:
                flat = groups[j] = []
            flat.append(name)
            flat.append(b"\x00")
            j = -1
        flat = groups.get(j)
        if flat is None:
            flat = groups[j] = []
        flat.append(name)
        flat.append(value)
    if entries:
        counts.append(("HINCRBY", slice_key, "n", entries))
    if memos:
        counts.append(("HINCRBY", slice_key, "m", memos))
    for jj, flat in sorted(groups.items()):  # the slice hash first, then the small hashes in order
        key = slice_key if jj < 0 else f"{slice_key}:{jj}"
        for a in range(0, len(flat), step):
            commands.append(("HSET", key, *flat[a : a + step]))
        if jj < 0:
            commands += counts
        commands.append(("PEXPIRE", key, ttl_ms))
    if -1 not in groups and counts:
        commands += counts
        commands.append(("PEXPIRE", slice_key, ttl_ms))
    return commands


# --- a slice's reads and writes packed as RESP at once (the twins of `compact_codec.pack_reads`,
# `pack_writes`): no Python object a command or an argument, the fields grouped by a sort ---------------------

ctypedef pair[long long, Py_ssize_t] _Placed  # (small hash, -1 the slice hash; a field's place)


cdef void _sort_placed(vector[_Placed] &placed, int bits):
    """Sorts `placed` (pushed in the order of their places) by small hash, then place: by counting where the
    small hashes are few against the fields (stable: places stay in order), else by `std::sort`."""
    cdef Py_ssize_t m = placed.size(), k, b, nb
    cdef vector[Py_ssize_t] starts
    cdef vector[_Placed] out
    if m < 2:
        return
    if bits > 20 or (<Py_ssize_t>1 << bits) > 4 * m:
        cpp_sort(placed.begin(), placed.end())
        return
    nb = (<Py_ssize_t>1 << bits) + 1  # bucket j + 1: the slice hash's (-1) first
    starts.assign(nb + 1, 0)
    for k in range(m):
        starts[placed[k].first + 2] += 1
    for b in range(1, nb + 1):
        starts[b] += starts[b - 1]
    out.resize(m)
    for k in range(m):
        b = placed[k].first + 1
        out[starts[b]] = placed[k]
        starts[b] += 1
    placed.swap(out)


cdef struct _Out:
    char *p  # where the next byte goes; NULL while only counting
    Py_ssize_t size
    Py_ssize_t commands


cdef inline void _o_header(_Out *o, char mark, Py_ssize_t n) noexcept:
    if o.p != NULL:
        o.p = put_header(o.p, mark, n)
    o.size += 3 + decimal_size(n)


cdef inline void _o_bulk(_Out *o, const char *data, Py_ssize_t n) noexcept:
    _o_header(o, 36, n)
    if o.p != NULL:
        memcpy(o.p, data, n)
        o.p[n] = 13
        o.p[n + 1] = 10
        o.p += n + 2
    o.size += n + 2


cdef inline Py_ssize_t _digits(char *buf, unsigned long long v) noexcept:
    """Writes `v` in decimal at `buf` (24 bytes); returns its length."""
    cdef char tmp[24]
    cdef Py_ssize_t d = 0, k
    while True:
        tmp[d] = <char>(48 + v % 10)
        d += 1
        v //= 10
        if v == 0:
            break
    for k in range(d):
        buf[k] = tmp[d - 1 - k]
    return d


cdef inline void _o_int(_Out *o, unsigned long long v) noexcept:
    cdef char buf[24]
    _o_bulk(o, buf, _digits(buf, v))


cdef inline void _o_key(_Out *o, const char *key, Py_ssize_t key_len, long long j) noexcept:
    """The bulk string of the slice hash's name (j < 0) or of its small hash j's (`<key>:<j>`)."""
    cdef char buf[24]
    cdef Py_ssize_t d
    if j < 0:
        _o_bulk(o, key, key_len)
        return
    d = _digits(buf, <unsigned long long>j)
    _o_header(o, 36, key_len + 1 + d)
    if o.p != NULL:
        memcpy(o.p, key, key_len)
        o.p[key_len] = 58
        memcpy(o.p + key_len + 1, buf, d)
        o.p[key_len + 1 + d] = 13
        o.p[key_len + 2 + d] = 10
        o.p += key_len + 3 + d
    o.size += key_len + 3 + d


# The places of a lookup's names as ints made once (a batch of 512 messages names ~7,200 fields): a read's places
# are taken from here, not allocated each lookup.
cdef list _PLACES = list(range(1 << 13))


cdef void _o_reads(_Out *o, vector[_Placed] &placed, list names, const char *key, Py_ssize_t key_len,
                   Py_ssize_t per_command, list places):
    """The HMGETs of `placed` (sorted): a command per small hash, at most `per_command` names each; `places`
    (not None) gets each command's places. While counting (`o.p` NULL) the names' bulk strings are left out
    (the caller counted them)."""
    cdef Py_ssize_t m = placed.size(), start = 0, stop, k
    cdef long long j
    cdef bytes name
    cdef list at
    while start < m:
        j = placed[start].first
        stop = start + 1
        while stop < m and placed[stop].first == j and stop - start < per_command:
            stop += 1
        _o_header(o, 42, 2 + stop - start)
        _o_bulk(o, "HMGET", 5)
        _o_key(o, key, key_len, j)
        if places is not None:
            at = []
            for k in range(start, stop):
                at.append(_PLACES[placed[k].second] if placed[k].second < (1 << 13) else placed[k].second)
            places.append(at)
        if o.p != NULL:
            for k in range(start, stop):
                name = <bytes>names[placed[k].second]
                _o_bulk(o, name, len(name))
        o.commands += 1
        start = stop


def pack_reads(str slice_key, list names, bits, marked, Py_ssize_t per_command) -> tuple:
    """`filters.index.compact_codec.pack_reads`, compiled."""
    cdef bint only_slice = bits is None
    cdef int b = 0 if only_slice else bits
    cdef Py_ssize_t n = len(names), i, key_len, size, names_size = 0
    cdef long long j
    cdef bint any_marked = len(marked) > 0
    cdef vector[_Placed] placed
    cdef object name
    cdef _Out o
    if not 0 <= b <= 64:
        raise ValueError(f"bits must be 0 to 64, got {bits!r}")
    if per_command < 1:
        raise ValueError(f"per_command must be >= 1, got {per_command}")
    placed.reserve(n)
    for i in range(n):
        name = names[i]
        if type(name) is not bytes:
            raise TypeError(f"a field name must be bytes, got {type(name).__name__}")
        j = -1 if any_marked and name in marked else field_small(<bytes>name, b)
        if not (only_slice and j >= 0):
            placed.push_back(_Placed(j, i))
            size = len(<bytes>name)
            names_size += 5 + decimal_size(size) + size
    _sort_placed(placed, b)
    cdef const char *key = PyUnicode_AsUTF8AndSize(slice_key, &key_len)
    o.p = NULL
    o.size = o.commands = 0
    _o_reads(&o, placed, names, key, key_len, per_command, None)
    out = PyBytes_FromStringAndSize(NULL, o.size + names_size)
    places = []
    o.p = PyBytes_AS_STRING(out)
    o.size = o.commands = 0
    _o_reads(&o, placed, names, key, key_len, per_command, places)
    if o.size != len(out):  # the two passes disagree: never send what was not written
        raise SystemError(f"pack_reads wrote {o.size} bytes of {len(out)}")
    return out, places


cdef void _o_writes(_Out *o, vector[_Placed] &placed, list pairs, const char *key, Py_ssize_t key_len,
                    Py_ssize_t per_command, unsigned long long entries, unsigned long long memos,
                    unsigned long long ttl, const unsigned char *renewed, Py_ssize_t renewed_bits,
                    list renewing):
    """`write_commands`' commands of `placed` (sorted; a place is 2 × the pair's index, + 1 for the mark in
    place of its value); `renewed` (not NULL): the PEXPIRE of a small hash whose bit is set left out, the others
    named in `renewing` (not None). While counting (`o.p` NULL) the names' and values' bulk strings are left
    out (the caller counted them)."""
    cdef Py_ssize_t m = placed.size(), start = 0, stop, k, a
    cdef long long j
    cdef bint slice_written = m > 0 and placed[0].first < 0
    cdef bytes name, value
    while start < m:
        j = placed[start].first
        stop = start
        while stop < m and placed[stop].first == j:  # a group: its HSETs, then its counts and TTL
            a = stop
            while stop < m and placed[stop].first == j and stop - a < per_command:
                stop += 1
            _o_header(o, 42, 2 + 2 * (stop - a))
            _o_bulk(o, "HSET", 4)
            _o_key(o, key, key_len, j)
            for k in range(a, stop):
                if o.p == NULL:
                    break
                name = <bytes>pairs[placed[k].second & ~1]
                _o_bulk(o, name, len(name))
                if placed[k].second & 1:
                    _o_bulk(o, "\x00", 1)
                else:
                    value = <bytes>pairs[(placed[k].second & ~1) + 1]
                    _o_bulk(o, value, len(value))
            o.commands += 1
        if j < 0:
            _o_counts(o, key, key_len, entries, memos)
        if j >= 0 and renewed != NULL:
            if j < renewed_bits and renewed[j >> 3] >> (j & 7) & 1:
                start = stop
                continue
            if renewing is not None:
                renewing.append(j)
        _o_expire(o, key, key_len, j, ttl)
        start = stop
    if not slice_written and (entries or memos):
        _o_counts(o, key, key_len, entries, memos)
        _o_expire(o, key, key_len, -1, ttl)


cdef inline void _o_counts(_Out *o, const char *key, Py_ssize_t key_len, unsigned long long entries,
                           unsigned long long memos) noexcept:
    if entries:
        _o_header(o, 42, 4)
        _o_bulk(o, "HINCRBY", 7)
        _o_bulk(o, key, key_len)
        _o_bulk(o, "n", 1)
        _o_int(o, entries)
        o.commands += 1
    if memos:
        _o_header(o, 42, 4)
        _o_bulk(o, "HINCRBY", 7)
        _o_bulk(o, key, key_len)
        _o_bulk(o, "m", 1)
        _o_int(o, memos)
        o.commands += 1


cdef inline void _o_expire(_Out *o, const char *key, Py_ssize_t key_len, long long j,
                           unsigned long long ttl) noexcept:
    _o_header(o, 42, 3)
    _o_bulk(o, "PEXPIRE", 7)
    _o_key(o, key, key_len, j)
    _o_int(o, ttl)
    o.commands += 1


def pack_writes(str slice_key, list pairs, int bits, marked, Py_ssize_t entries, Py_ssize_t memos, ttl_ms,
                Py_ssize_t per_command, renewed) -> tuple:
    """`filters.index.compact_codec.pack_writes`, compiled."""
    cdef Py_ssize_t n = len(pairs), a, key_len, renewed_bits = 0, size, pairs_size = 0
    cdef long long j
    cdef bint any_marked = len(marked) > 0
    cdef vector[_Placed] placed
    cdef object name, value
    cdef const unsigned char *seen = NULL
    cdef unsigned long long ttl = ttl_ms
    cdef _Out o
    if not 0 <= bits <= 64:
        raise ValueError(f"bits must be 0 to 64, got {bits!r}")
    if per_command < 1 or n % 2 or entries < 0 or memos < 0:
        raise ValueError("pairs of name and value, per_command >= 1 and counts >= 0 expected")
    if renewed is not None:
        seen = <const unsigned char *>PyByteArray_AS_STRING(<bytearray>renewed)
        renewed_bits = 8 * len(<bytearray>renewed)
    placed.reserve(n)
    for a in range(0, n, 2):
        name, value = pairs[a], pairs[a + 1]
        if type(name) is not bytes or type(value) is not bytes:
            raise TypeError("field names and values must be bytes")
        j = -1 if any_marked and name in marked else field_small(<bytes>name, bits)
        size = len(<bytes>name)
        size = 5 + decimal_size(size) + size
        pairs_size += size + 5 + decimal_size(len(<bytes>value)) + len(<bytes>value)
        if j >= 0 and len(<bytes>value) > 64:  # too long for a listpack: in the slice hash, the mark here
            placed.push_back(_Placed(j, a + 1))
            pairs_size += size + 7  # the name again, and the mark
            j = -1
        placed.push_back(_Placed(j, a))
    _sort_placed(placed, bits)
    cdef const char *key = PyUnicode_AsUTF8AndSize(slice_key, &key_len)
    o.p = NULL
    o.size = o.commands = 0
    _o_writes(&o, placed, pairs, key, key_len, per_command, entries, memos, ttl, seen, renewed_bits, None)
    out = PyBytes_FromStringAndSize(NULL, o.size + pairs_size)
    renewing: list = []
    o.p = PyBytes_AS_STRING(out)
    o.size = o.commands = 0
    _o_writes(&o, placed, pairs, key, key_len, per_command, entries, memos, ttl, seen, renewed_bits,
              renewing if renewed is not None else None)
    if o.size != len(out):  # the two passes disagree: never send what was not written
        raise SystemError(f"pack_writes wrote {o.size} bytes of {len(out)}")
    return out, o.commands, renewing


# --- replies (the twin of `compact_codec.first_error`) ----------------------------------------------------

def first_error(replies):
    """`filters.index.compact_codec.first_error`, compiled."""
    cdef object reply
    for reply in replies:
        if isinstance(reply, Exception):
            return reply
    return None


# --- a rebuild's held fields (the twins of `compact_codec.entry_pairs`, `held_pairs`) -------------------------

def entry_pairs(list ids, list blobs, list seqs, list slices) -> dict:
    """`filters.index.compact_codec.entry_pairs`, compiled: each value made in one piece."""
    cdef Py_ssize_t n = len(ids), i, n_id, n_blob
    cdef dict out = {}
    cdef list pairs
    cdef bytes id_bytes, blob, value, name
    cdef char *rp
    cdef object seq_obj, s
    cdef uint64_t seq
    if not (len(blobs) == len(seqs) == len(slices) == n):
        raise ValueError("one blob, seq and slice an id expected")
    for i in range(n):
        seq_obj = seqs[i]
        if seq_obj <= 0:
            continue
        seq = <uint64_t>seq_obj
        id_bytes = (<str>ids[i]).encode("utf-8", "surrogatepass")
        n_id = len(id_bytes)
        if n_id > 0xFFFF:
            raise ValueError(f"ids must be at most 65,535 bytes of UTF-8, got {n_id:,}")
        blob = blobs[i]
        n_blob = len(blob)
        value = PyBytes_FromStringAndSize(NULL, n_blob + n_id + 2)
        rp = PyBytes_AS_STRING(value)
        memcpy(rp, <const char *>blob, n_blob)
        memcpy(rp + n_blob, <const char *>id_bytes, n_id)
        rp[n_blob + n_id] = <char>(n_id & 0xFF)
        rp[n_blob + n_id + 1] = <char>(n_id >> 8)
        name = PyBytes_FromStringAndSize(NULL, 9)
        rp = PyBytes_AS_STRING(name)
        rp[0] = b'e'
        put_be64(rp + 1, seq)
        s = int(slices[i])
        pairs = out.get(s)
        if pairs is None:
            pairs = out[s] = []
        pairs.append(name)
        pairs.append(value)
    return out


cdef inline void _put_record(char *p, double ts, uint64_t seq) noexcept:
    memcpy(p, &ts, 8)
    put_be64(p + 8, seq)


def held_pairs(keys, bounds, times, seqs, list ids, dict olds, Py_ssize_t cap, bint old_ids) -> list:
    """`filters.index.compact_codec.held_pairs`, compiled: each bucket field's records chained in order through
    an open-addressing table (as `newest_records`); a value that is never trimmed (no old value, at most twice
    the cap's records and one) made in one piece, the others appended a record at a time as the insert does."""
    np = np_()
    cdef const uint64_t[::1] k = np.ascontiguousarray(keys, dtype=np.uint64)
    cdef const int64_t[::1] b = np.ascontiguousarray(bounds, dtype=np.int64)
    cdef const double[::1] t = np.ascontiguousarray(times, dtype=np.float64)
    cdef const uint64_t[::1] q = np.ascontiguousarray(seqs, dtype=np.uint64)
    cdef Py_ssize_t n = len(ids), n_rec = len(k), e, r, g, slot, mask, size, n_groups = 0, m, j
    cdef Py_ssize_t too_long = 2 * cap * 16
    cdef int shift = 64
    cdef uint64_t key
    cdef uint64_t *slot_key = NULL
    cdef Py_ssize_t *slot_at = NULL
    cdef vector[int64_t] order  # the fields as first written: a bucket field's group (>= 0), else -1 - its id's
    cdef vector[int64_t] id_entry  # per id field: the last entry that wrote it
    cdef dict id_at = {}
    cdef list id_names = [], out = []
    cdef bytes name, value, rec
    cdef object old, at
    cdef char *rp
    if not (len(t) == len(q) == n and len(b) == n + 1):
        raise ValueError("one event time and seq an id, and one more bound, expected")
    for e in range(n):
        if b[e] < 0 or b[e] > b[e + 1] or b[e + 1] > n_rec:
            raise ValueError(f"bounds must rise within the {n_rec} keys")
    # Per group (a bucket key, numbered as first seen): its first and last record and its count; per record the
    # next of its key (-1: none) and its entry.
    cdef Py_ssize_t *g_first = <Py_ssize_t *>PyMem_Malloc((n_rec + 1) * sizeof(Py_ssize_t))
    cdef Py_ssize_t *g_last = <Py_ssize_t *>PyMem_Malloc((n_rec + 1) * sizeof(Py_ssize_t))
    cdef Py_ssize_t *g_count = <Py_ssize_t *>PyMem_Malloc((n_rec + 1) * sizeof(Py_ssize_t))
    cdef Py_ssize_t *following = <Py_ssize_t *>PyMem_Malloc((n_rec + 1) * sizeof(Py_ssize_t))
    cdef Py_ssize_t *entry_of = <Py_ssize_t *>PyMem_Malloc((n_rec + 1) * sizeof(Py_ssize_t))
    try:
        if g_first == NULL or g_last == NULL or g_count == NULL or following == NULL or entry_of == NULL:
            raise MemoryError()
        size = open_table(n_rec, &slot_key, &slot_at)
        mask = size - 1
        while size > 1:
            size >>= 1
            shift -= 1
        for e in range(n):
            for r in range(b[e], b[e + 1]):
                key = k[r]
                entry_of[r] = e
                following[r] = -1
                slot = <Py_ssize_t>((mix64(key) * MUL) >> shift)
                while slot_at[slot] >= 0 and slot_key[slot] != key:
                    slot = (slot + 1) & mask
                if slot_at[slot] < 0:
                    slot_key[slot] = key
                    slot_at[slot] = n_groups
                    g_first[n_groups] = g_last[n_groups] = r
                    g_count[n_groups] = 1
                    order.push_back(n_groups)
                    n_groups += 1
                    continue
                g = slot_at[slot]
                if entry_of[g_last[g]] == e:  # the entry gave the key twice: its record once
                    continue
                following[g_last[g]] = r
                g_last[g] = r
                g_count[g] += 1
            if ids[e] is None:  # its id in another share
                continue
            name = b"i" + (<str>ids[e]).encode("utf-8", "surrogatepass")
            at = id_at.get(name)
            if at is None:
                id_at[name] = len(id_names)
                order.push_back(-1 - len(id_names))
                id_names.append(name)
                id_entry.push_back(e)
            else:
                id_entry[<Py_ssize_t>at] = e
        for j in range(<Py_ssize_t>order.size()):
            g = order[j]
            if g < 0:
                e = id_entry[-1 - g]
                name = id_names[-1 - g]
                if old_ids and name in olds:
                    continue
                value = PyBytes_FromStringAndSize(NULL, 16)
                _put_record(PyBytes_AS_STRING(value), t[e], q[e])
                out.append(name)
                out.append(value)
                continue
            name = PyBytes_FromStringAndSize(NULL, 9)
            rp = PyBytes_AS_STRING(name)
            rp[0] = b'b'
            put_be64(rp + 1, k[g_first[g]])
            old = olds.get(name) if olds else None
            m = g_count[g]
            r = g_first[g]
            if old is None and m <= 2 * cap + 1:  # never trimmed: its records as they come
                value = PyBytes_FromStringAndSize(NULL, 16 * m)
                rp = PyBytes_AS_STRING(value)
                while r >= 0:
                    _put_record(rp, t[entry_of[r]], q[entry_of[r]])
                    rp += 16
                    r = following[r]
            else:
                value = old
                while r >= 0:
                    rec = PyBytes_FromStringAndSize(NULL, 16)
                    _put_record(PyBytes_AS_STRING(rec), t[entry_of[r]], q[entry_of[r]])
                    if value is None:
                        value = rec
                    else:
                        if len(value) > too_long:
                            value = _trim16(value, cap)
                        value = value + rec
                    r = following[r]
            out.append(name)
            out.append(value)
    finally:
        PyMem_Free(slot_key); PyMem_Free(slot_at)
        PyMem_Free(g_first); PyMem_Free(g_last); PyMem_Free(g_count); PyMem_Free(following); PyMem_Free(entry_of)
    return out


def id_shares(list ids, int bits) -> list:
    """`filters.index.compact_codec.id_shares`, compiled."""
    cdef list out = []
    cdef bytes raw
    cdef long long j
    if not 0 <= bits <= 64:
        raise ValueError(f"bits must be 0 to 64, got {bits!r}")
    for id in ids:
        raw = b"i" + (<str>id).encode("utf-8", "surrogatepass")
        j = field_small(raw, bits)
        out.append(j if j > 0 else 0)
    return out
