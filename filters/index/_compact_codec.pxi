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
    for jj, at in groups.items():
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
    for jj, flat in groups.items():
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
