# The Redis index client's compiled per-message work (included by filters/_native.pyx): the twins of
# filters/index/redis_codec.py (ranking, field plans, the uncontended insert, entries) and command packing.

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


cdef extern from * nogil:
    """
    #include <stdint.h>
    #include <string.h>
    /* A bucket record's seq (8 bytes big-endian) in one load, not eight. */
    static inline uint64_t nd_load_be64(const char *p) {
        uint64_t v;
        memcpy(&v, p, 8);
    #if defined(__GNUC__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        return __builtin_bswap64(v);
    #else
        const unsigned char *b = (const unsigned char *)p;
        return ((uint64_t)b[0] << 56) | ((uint64_t)b[1] << 48) | ((uint64_t)b[2] << 40) | ((uint64_t)b[3] << 32)
             | ((uint64_t)b[4] << 24) | ((uint64_t)b[5] << 16) | ((uint64_t)b[6] << 8) | (uint64_t)b[7];
    #endif
    }
    static inline void nd_store_be64(char *p, uint64_t v) {
    #if defined(__GNUC__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        v = __builtin_bswap64(v);
        memcpy(p, &v, 8);
    #else
        for (int j = 0; j < 8; j++) p[j] = (char)((v >> (56 - 8 * j)) & 0xFF);
    #endif
    }
    /* The bytes of an id, 8 at a time (a tally table's hash: only its spread matters, never its value). */
    static inline uint64_t nd_bytes_hash(const char *p, uint32_t n) {
        uint64_t h = 0x9E3779B97F4A7C15ULL ^ ((uint64_t)n * 0xC2B2AE3D27D4EB4FULL), w;
        while (n >= 8) {
            memcpy(&w, p, 8);
            h = (h ^ w) * 0xFF51AFD7ED558CCDULL;
            h ^= h >> 32;
            p += 8;
            n -= 8;
        }
        if (n >= 4) {  /* 4 to 7 bytes: two loads of 4 that overlap */
            uint32_t a, b;
            memcpy(&a, p, 4);
            memcpy(&b, p + n - 4, 4);
            h = (h ^ ((uint64_t)a | ((uint64_t)b << 32))) * 0xFF51AFD7ED558CCDULL;
        } else if (n) {  /* 1 to 3 bytes: the first, the middle and the last */
            w = (uint64_t)(unsigned char)p[0] | ((uint64_t)(unsigned char)p[n >> 1] << 8)
                | ((uint64_t)(unsigned char)p[n - 1] << 16);
            h = (h ^ w) * 0xFF51AFD7ED558CCDULL;
        }
        return h;
    }
    """
    uint64_t nd_load_be64(const char *p)
    void nd_store_be64(char *p, uint64_t v)
    uint64_t nd_bytes_hash(const char *p, uint32_t n)


cdef inline uint64_t id_hash(const char *p, uint32_t n) noexcept nogil:
    return mix64(nd_bytes_hash(p, n))


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
    /* The `cap` newest records first, newest first (as `nd_sort_newest_first` puts them). A bucket's records
       come oldest first (in insertion order, slice after slice): reversed, they are nearly in order, and an
       insertion sort takes them in a pass or two. Records far out of order (event times that came late) make
       it give up after a few passes' worth of moves: then the newest are selected (of many) and sorted. */
    static void nd_select_newest(nd_record *first, Py_ssize_t cap, nd_record *last) {
        auto newer = [](const nd_record &a, const nd_record &b) {
            return a.ts > b.ts || (a.ts == b.ts && a.seq > b.seq);
        };
        Py_ssize_t n = last - first, moves = 0, limit = 4 * n, i, j;
        std::reverse(first, last);
        for (i = 1; i < n && moves <= limit; i++) {
            nd_record x = first[i];
            for (j = i; j > 0 && newer(x, first[j - 1]); j--) first[j] = first[j - 1];
            first[j] = x;
            moves += i - j;
        }
        if (i >= n && moves <= limit) return;
        if (n > 2 * cap) {
            std::nth_element(first, first + cap - 1, last, newer);
            std::sort(first, first + cap, newer);
        } else {
            std::sort(first, last, newer);
        }
    }
    """
    struct nd_record:  # one bucket record of a Redis lookup
        double ts
        uint64_t seq
        const char *id
        uint32_t n
    void nd_sort_newest_first(nd_record *first, nd_record *last)
    void nd_select_newest(nd_record *first, Py_ssize_t cap, nd_record *last)


cdef inline uint64_t be64(const char *p) noexcept nogil:
    return nd_load_be64(p)


cdef class _RankScratch:
    """Buffers `rank_records` reuses from query to query of one lookup, and an index from lookup to lookup
    (`rank_scratch`): the records of a bucket, the tally table (a slot is taken when its stamp is this query's: no
    clearing between queries; made afresh each lookup, it was grown and cleared each round, ~1,300 instructions a
    message of the whole stream) and the hits."""

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
    """`filters.index.redis_codec.rank_records`, compiled: the ranked candidates of one lookup, given the bucket
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
            nd_select_newest(recs, cap, recs + nrec)
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
    if n < 10:  # (most arguments: field names of 9 bytes, records, entries of a few hundred)
        return 1
    if n < 100:
        return 2
    if n < 1000:
        return 3
    while n >= 10:
        n //= 10
        size += 1
    return size


cdef inline char *put_header(char *p, char mark, Py_ssize_t n) noexcept:
    """Writes `<mark><n>\\r\\n` (n >= 0)."""
    cdef Py_ssize_t size, j
    p[0] = mark
    if n < 10:
        p[1] = <char>(48 + n)
        p[2] = 13
        p[3] = 10
        return p + 4
    size = decimal_size(n)
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


cdef extern from "Python.h":
    bint PyType_IsSubtype(PyTypeObject *a, PyTypeObject *b)
    PyTypeObject *Py_TYPE_OF "Py_TYPE" (object o)


def gather_replies(gets, more, Py_ssize_t n, not_enough, type fatal) -> list:
    """`filters.index.redis_codec.gather_replies`, compiled."""
    cdef list out = []
    cdef object reply
    while len(out) < n:
        reply = gets()
        if reply is not_enough:
            more()
        elif PyExceptionInstance_Check(reply) and PyType_IsSubtype(Py_TYPE_OF(reply), <PyTypeObject *>fatal):
            raise reply  # (`isinstance` looks `__class__` up on every reply that is not an instance: most)
        else:
            out.append(reply)
    return out


# --- naming the fields of a Redis lookup ------------------------------------------------------------------

cdef inline bytes bucket_field(uint64_t key):
    """`redis_codec._FIELD(b"b", key)`: b"b" and the key, 8 bytes big-endian."""
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


cdef inline object place_number(list numbers, Py_ssize_t at):
    """The int `at`, from `numbers` (0, 1, 2, ...: extended here as needed), so that a batch's places are not
    made (and freed) afresh each batch."""
    cdef Py_ssize_t n = len(numbers)
    while n <= at:
        numbers.append(n)
        n += 1
    return numbers[at]


def plan_fields(list keys_of, list id_fields, list numbers=None) -> tuple:
    """`RedisIndex.lookup`'s naming of what a batch reads: per query its bucket keys' field names and their
    places, then per query its entry field's place, its memo field (`d` for the entry field's first byte)
    right after it, every distinct name placed once in first-seen order. Returns (names, fields per
    query, places per query, entry places). `numbers`: the ints 0, 1, 2, ... to take the places from (kept
    by the caller from batch to batch; extended as needed)."""
    if numbers is None:
        numbers = []
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
                    place_objs.append(place_number(numbers, at))
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
    cdef bytes memo
    for name in id_fields:
        place = id_at.get(name)
        if place is None:
            place = place_number(numbers, len(names))
            id_at[name] = place
            names.append(name)
            n = len(<bytes>name)
            if n == 0:
                raise ValueError("an entry field name is never empty")
            memo = PyBytes_FromStringAndSize(<const char *>(<bytes>name), n)
            PyBytes_AS_STRING(memo)[0] = 100  # b"d"
            names.append(memo)
        id_places.append(place)
    return names, fields_of, places_of, id_places


# --- the uncontended insert of the Redis index ------------------------------------------------------------

cdef inline void put_be64(char *p, uint64_t v) noexcept nogil:
    nd_store_be64(p, v)


# --- a restore's writes (the twin of `redis_codec.restore_round`, which documents it) ---------------------

cdef extern from * nogil:
    """
    #include <algorithm>
    struct nd_piece { double ts; uint64_t seq; Py_ssize_t order; const char *p; Py_ssize_t n; };
    static void nd_sort_pieces_newest_first(nd_piece *first, nd_piece *last) {
        std::stable_sort(first, last, [](const nd_piece &a, const nd_piece &b) {
            return a.ts > b.ts || (a.ts == b.ts && a.seq > b.seq);
        });
    }
    static void nd_select_newest_pieces(nd_piece *first, nd_piece *last, Py_ssize_t cap) {
        std::nth_element(first, first + cap - 1, last, [](const nd_piece &a, const nd_piece &b) {
            return a.ts > b.ts || (a.ts == b.ts && a.seq > b.seq);
        });
    }
    static void nd_sort_pieces_by_order(nd_piece *first, nd_piece *last) {
        std::sort(first, last, [](const nd_piece &a, const nd_piece &b) { return a.order < b.order; });
    }
    """
    struct nd_piece:  # one record of a bucket value: its event time, seq, place in the value and bytes
        double ts
        uint64_t seq
        Py_ssize_t order
        const char *p
        Py_ssize_t n
    void nd_sort_pieces_newest_first(nd_piece *first, nd_piece *last)
    void nd_select_newest_pieces(nd_piece *first, nd_piece *last, Py_ssize_t cap)
    void nd_sort_pieces_by_order(nd_piece *first, nd_piece *last)


cdef Py_ssize_t record_count(const char *p, Py_ssize_t n) except -1:
    """`redis_codec.count_records`."""
    cdef Py_ssize_t pos = 0, count = 0
    cdef uint32_t idn
    while pos < n:
        if pos + 12 > n:
            from filters.errors import IndexCorrupt
            raise IndexCorrupt("a bucket holds bytes that are not bucket records")
        memcpy(&idn, p + pos + 8, 4)
        pos += 20 + idn
        count += 1
    return count


cdef Py_ssize_t add_pieces(nd_piece *pieces, Py_ssize_t at, const char *p, Py_ssize_t n) except -1:
    """The records of `p[:n]` as pieces from `pieces[at]` on; returns where the next goes."""
    cdef Py_ssize_t pos = 0
    cdef uint32_t idn
    while pos < n:
        memcpy(&pieces[at].ts, p + pos, 8)
        memcpy(&idn, p + pos + 8, 4)
        if pos + 20 + idn > n:
            from filters.errors import IndexCorrupt
            raise IndexCorrupt("a bucket holds bytes that are not bucket records")
        pieces[at].p = p + pos
        pieces[at].n = 20 + idn
        pieces[at].seq = be64(p + pos + 12 + idn)
        pieces[at].order = at
        pos += 20 + idn
        at += 1
    return at


cdef bytes newest_pieces(nd_piece *pieces, Py_ssize_t count, Py_ssize_t cap):
    """The bucket value of the `cap` newest of `count` pieces (event time, then seq), in their order:
    `redis_codec.trim_records` of their concatenation, without making it."""
    cdef Py_ssize_t j, size = 0
    cdef bytes out
    cdef char *o
    nd_sort_pieces_newest_first(pieces, pieces + count)
    nd_sort_pieces_by_order(pieces, pieces + cap)
    for j in range(cap):
        size += pieces[j].n
    out = PyBytes_FromStringAndSize(NULL, size)
    o = PyBytes_AS_STRING(out)
    for j in range(cap):
        memcpy(o, pieces[j].p, pieces[j].n)
        o += pieces[j].n
    return out


cdef extern from "Python.h":
    object _PyDict_NewPresized(Py_ssize_t minused)  # (CPython 3.11+) a dict that takes `minused` items unresized
    int PyDict_Update(object a, object b) except -1
    int PyDict_SetItem(object d, object key, object value) except -1


cdef inline bytes joined(bytes a, bytes b):
    """a + b, without the generic number protocol's dispatch."""
    cdef Py_ssize_t na = len(a), nb = len(b)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, na + nb)
    cdef char *o = PyBytes_AS_STRING(out)
    memcpy(o, <const char *>a, na)
    memcpy(o + na, <const char *>b, nb)
    return out


cdef bytes trim_value(bytes value, Py_ssize_t cap):
    """`redis_codec.trim_records`: the `cap` newest records (event time, then seq) of a bucket value, in their
    order; the value itself when it holds no more."""
    cdef const char *p = value
    cdef Py_ssize_t n = len(value), count = record_count(p, n)
    cdef nd_piece *pieces
    if count <= cap:
        return value
    pieces = <nd_piece *>PyMem_Malloc(count * sizeof(nd_piece))
    if pieces == NULL:
        raise MemoryError()
    try:
        add_pieces(pieces, 0, p, n)
        return newest_pieces(pieces, count, cap)
    finally:
        PyMem_Free(pieces)


def trim_slot(bytes value, Py_ssize_t cap) -> bytes:
    """`filters.index.redis_codec.trim_records`, compiled."""
    if cap < 0:
        raise ValueError("cap must be >= 0")
    return trim_value(value, cap)


def alone_round(list ids, list tss, list blobs, list fields_of, list places_of, list entry_places, tuple slices,
                dict columns, dict writes, double hwm, double window, double slice_length,
                Py_ssize_t cap, uint64_t seq, entry_time) -> tuple:
    """The loop of `RedisIndex._alone` (which it documents), compiled: per entry, live already (0), out
    of the window (0) or its seq; the writes per slice (`groups`: slice -> [entries, field-value pairs]);
    `writes` (slice -> place -> value) updated; (seq, slice, places) per entry written. Returns
    (results, groups, written, hwm, seq)."""
    cdef Py_ssize_t count = len(ids), i, j, nf, n_id, n_col
    cdef double ts, old_ts
    cdef bint live, prior
    cdef object e, column, mine, p, f
    cdef PyObject *got
    cdef object old, v
    cdef list fields, places, pairs, order, results = [], written = []
    cdef dict groups = {}, state_of = {}
    cdef tuple state
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
            got = PyDict_GetItemWithError(writes[s], e)
            if got != NULL:
                old = <object>got
            else:
                column = columns.get(s)
                if column is None:
                    old = None
                else:
                    place = e
                    if place < 0 or place >= len(<list>column):
                        raise IndexError(f"entry place {place} outside the {len(<list>column)} read")
                    old = (<list>column)[place]
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
        n_col = len(<list>column)
        fields = fields_of[i]
        places = places_of[i]
        nf = len(fields)
        if len(places) != nf:
            raise ValueError("an entry's fields and places differ in length")
        group = groups.get(sl)
        if group is None:
            group = groups[sl] = [0, []]
            # The slice's writes of this round, sized for all of them at once (a dict grown a field at a time
            # rehashes itself a dozen times over a batch): the same items.
            presized = _PyDict_NewPresized(len(<dict>mine) + (count - i) * (nf + 1))
            PyDict_Update(presized, mine)
            writes[sl] = mine = presized
            # A bucket field's value in this round is in the pairs (`at`); `mine` gets the last values once,
            # at the end, in the order of `order`. What it holds before them: values written before this round.
            state = state_of[sl] = (bytearray(b"\xff" * (n_col * sizeof(Py_ssize_t))), [], len(<dict>mine) > 0)
        else:
            state = <tuple>state_of[sl]
        group[0] += 1
        pairs = <list>group[1]
        at_buf = <bytearray>state[0]
        order = <list>state[1]
        prior = state[2]
        at = <Py_ssize_t *>PyByteArray_AS_STRING(at_buf)
        too_long = 2 * cap * len(record)
        for j in range(nf):
            f = fields[j]
            p = places[j]
            place = p
            if place < 0 or place >= n_col:  # `at` is a C array: no place outside it
                raise IndexError(f"field place {place} outside the {n_col} read")
            k = at[place]
            if k >= 0:
                v = pairs[k]
            else:
                got = PyDict_GetItemWithError(mine, p) if prior else NULL
                v = <object>got if got != NULL else (<list>column)[place]
            if v is None:
                v = record
            else:
                if len(<bytes>v) > too_long:
                    v = trim_value(<bytes>v, cap)
                v = joined(<bytes>v, record)
            # Each field once in the slice's pairs, with its last value: a bucket several entries of the
            # batch share is sent once, not once per entry with every record again.
            if k < 0:
                at[place] = len(pairs) + 1
                pairs.append(f)
                pairs.append(v)
                order.append(p)
            else:
                pairs[k] = v
        blob = blobs[i]
        PyDict_SetItem(mine, e, blob)
        pairs.append(b"e" + id_bytes)
        pairs.append(blob)
        written.append((seq, sl, places))
        results.append(seq)
    for sl, state in state_of.items():
        mine = writes[sl]
        pairs = <list>(<list>groups[sl])[1]
        at = <Py_ssize_t *>PyByteArray_AS_STRING(<bytearray>state[0])
        for p in <list>state[1]:
            PyDict_SetItem(mine, p, pairs[at[<Py_ssize_t>p]])
    return results, groups, written, hwm, seq


def restore_round(list ids, times, slices, bounds, keys, list blobs, dict held, double hwm, double window,
                  Py_ssize_t cap, uint64_t seq) -> tuple:
    """`redis_codec.restore_round`, compiled: the fields are told apart by (slice, key) in an open-addressing
    table, each field's new records chained in order, and each new value made in one piece."""
    np = np_()
    cdef const double[::1] ts_of = np.ascontiguousarray(times, dtype=np.float64)
    cdef const int64_t[::1] slice_of = np.ascontiguousarray(slices, dtype=np.int64)
    cdef const int64_t[::1] bound = np.ascontiguousarray(bounds, dtype=np.int64)
    cdef const uint64_t[::1] key_of = np.ascontiguousarray(keys, dtype=np.uint64)
    cdef Py_ssize_t n = len(ids), n_pairs, i, j, f, slot, mask, size, n_fields = 0, r, total, count
    cdef int shift = 64
    cdef double ts, old_ts
    cdef int64_t s
    cdef uint64_t key
    cdef list results = [], order = []
    cdef dict written = {sl: {} for sl in held}, entries = {}, groups = {}, values
    cdef Py_ssize_t n_old, n_pieces, pieces_cap = 0
    cdef nd_piece *pieces = NULL
    cdef const char *op
    cdef object sl, old, group
    cdef bytes id_bytes, efield, v, name
    cdef bint live
    cdef bytearray records = bytearray()
    cdef Py_ssize_t n_id, at
    cdef char *rp
    n_pairs = bound[n] - bound[0] if n else 0
    # Per written entry: its record's place in `records`; per field: slice, key, records (chained), count.
    cdef Py_ssize_t *rec_at = <Py_ssize_t *>PyMem_Malloc((n + 1) * sizeof(Py_ssize_t))
    cdef int64_t *f_slice = <int64_t *>PyMem_Malloc((n_pairs + 1) * sizeof(int64_t))
    cdef uint64_t *f_key = <uint64_t *>PyMem_Malloc((n_pairs + 1) * sizeof(uint64_t))
    cdef Py_ssize_t *f_first = <Py_ssize_t *>PyMem_Malloc((n_pairs + 1) * sizeof(Py_ssize_t))
    cdef Py_ssize_t *f_last = <Py_ssize_t *>PyMem_Malloc((n_pairs + 1) * sizeof(Py_ssize_t))
    cdef Py_ssize_t *f_count = <Py_ssize_t *>PyMem_Malloc((n_pairs + 1) * sizeof(Py_ssize_t))
    cdef Py_ssize_t *f_bytes = <Py_ssize_t *>PyMem_Malloc((n_pairs + 1) * sizeof(Py_ssize_t))
    cdef Py_ssize_t *link_entry = <Py_ssize_t *>PyMem_Malloc((n_pairs + 1) * sizeof(Py_ssize_t))
    cdef Py_ssize_t *link_next = <Py_ssize_t *>PyMem_Malloc((n_pairs + 1) * sizeof(Py_ssize_t))
    cdef Py_ssize_t n_links = 0
    cdef uint64_t *slot_key = NULL
    cdef Py_ssize_t *slot_at = NULL
    cdef int64_t *slot_slice = NULL
    try:
        if (rec_at == NULL or f_slice == NULL or f_key == NULL or f_first == NULL or f_last == NULL
                or f_count == NULL or f_bytes == NULL or link_entry == NULL or link_next == NULL):
            raise MemoryError()
        size = open_table(n_pairs, &slot_key, &slot_at)
        slot_slice = <int64_t *>PyMem_Malloc(size * sizeof(int64_t))
        if slot_slice == NULL:
            raise MemoryError()
        mask = size - 1
        while size > 1:
            size >>= 1
            shift -= 1
        for i in range(n):
            id_bytes = (<str>ids[i]).encode("utf-8", "surrogatepass")
            efield = b"e" + id_bytes
            live = False
            for sl, values in held.items():
                old = (<dict>written[sl]).get(efield)
                if old is None:
                    old = values.get(efield)
                if old:
                    if len(<bytes>old) >= 9:
                        memcpy(&old_ts, <const char *>(<bytes>old) + 1, 8)
                    else:
                        from filters.index.redis_codec import entry_time
                        old_ts = entry_time(old, ids[i])  # raises: too short for an entry
                    if old_ts >= hwm - window:
                        live = True
                        break
            ts = ts_of[i]
            if live or not ts >= (ts if ts > hwm else hwm) - window:
                results.append(0)
                continue
            if ts > hwm:
                hwm = ts
            seq += 1
            n_id = len(id_bytes)
            at = len(records)
            rec_at[i] = at
            records.extend(b"\0" * (20 + n_id))
            rp = PyByteArray_AS_STRING(records) + at
            memcpy(rp, &ts, 8)
            (<uint32_t *>(rp + 8))[0] = <uint32_t>n_id  # little-endian machines only (x86-64, arm64)
            memcpy(rp + 12, <const char *>id_bytes, n_id)
            put_be64(rp + 12 + n_id, seq)
            s = slice_of[i]
            for j in range(bound[i], bound[i + 1]):
                key = key_of[j]
                slot = <Py_ssize_t>(((key ^ <uint64_t>s) * MUL) >> shift)
                while slot_at[slot] >= 0 and (slot_key[slot] != key or slot_slice[slot] != s):
                    slot = (slot + 1) & mask
                f = slot_at[slot]
                if f < 0:
                    f = n_fields
                    n_fields += 1
                    slot_at[slot] = f
                    slot_key[slot] = key
                    slot_slice[slot] = s
                    f_slice[f] = s
                    f_key[f] = key
                    f_first[f] = -1
                    f_count[f] = 0
                    f_bytes[f] = 0
                elif link_entry[f_last[f]] == i:
                    continue  # a key given twice counts once
                link_entry[n_links] = i
                link_next[n_links] = -1
                if f_first[f] < 0:
                    f_first[f] = n_links
                else:
                    link_next[f_last[f]] = n_links
                f_last[f] = n_links
                f_count[f] += 1
                f_bytes[f] += 20 + n_id
                n_links += 1
            sl = s
            (<dict>written[sl])[efield] = blobs[i]
            group = entries.get(sl)
            if group is None:
                group = entries[sl] = [0, []]
            group[0] += 1
            (<list>group[1]).append(efield)
            (<list>group[1]).append(blobs[i])
            results.append(seq)
        for sl in entries:
            groups[sl] = [entries[sl][0], []]
        for f in range(n_fields):
            sl = f_slice[f]
            name = bucket_field(f_key[f])
            values = <dict>held[sl]
            old = values.get(name) if values else None
            n_old = record_count(<const char *>(<bytes>old), len(<bytes>old)) if old is not None else 0
            count = n_old + f_count[f]
            if count > 2 * cap:  # the cap newest of what it held and its new records, at once
                if count > pieces_cap:
                    PyMem_Free(pieces)
                    pieces_cap = 2 * count
                    pieces = <nd_piece *>PyMem_Malloc(pieces_cap * sizeof(nd_piece))
                    if pieces == NULL:
                        raise MemoryError()
                n_pieces = 0
                if old is not None:
                    n_pieces = add_pieces(pieces, 0, <const char *>(<bytes>old), len(<bytes>old))
                r = f_first[f]
                while r >= 0:
                    op = PyByteArray_AS_STRING(records) + rec_at[link_entry[r]]
                    n_pieces = add_pieces(pieces, n_pieces, op, 20 + (<uint32_t *>(op + 8))[0])
                    r = link_next[r]
                v = newest_pieces(pieces, n_pieces, cap)
                count = cap
            else:
                total = f_bytes[f] + (len(<bytes>old) if old is not None else 0)
                v = PyBytes_FromStringAndSize(NULL, total)
                rp = PyBytes_AS_STRING(v)
                if old is not None:
                    memcpy(rp, <const char *>(<bytes>old), len(<bytes>old))
                    rp += len(<bytes>old)
                r = f_first[f]
                while r >= 0:
                    at = rec_at[link_entry[r]]
                    n_id = 20 + (<uint32_t *>(PyByteArray_AS_STRING(records) + at + 8))[0]
                    memcpy(rp, PyByteArray_AS_STRING(records) + at, n_id)
                    rp += n_id
                    r = link_next[r]
            (<list>(<list>groups[sl])[1]).append(name)
            (<list>(<list>groups[sl])[1]).append(v)
        for sl in entries:
            (<list>(<list>groups[sl])[1]).extend(<list>entries[sl][1])
        return results, groups, hwm, seq
    finally:
        PyMem_Free(rec_at); PyMem_Free(f_slice); PyMem_Free(f_key); PyMem_Free(f_first); PyMem_Free(f_last)
        PyMem_Free(f_count); PyMem_Free(f_bytes); PyMem_Free(link_entry); PyMem_Free(link_next)
        PyMem_Free(slot_key); PyMem_Free(slot_at); PyMem_Free(slot_slice); PyMem_Free(pieces)


cdef inline double floor_div(double ts, double length) noexcept:
    return floor(ts / length)


# --- reading stored entries -------------------------------------------------------------------------------



cdef inline int bit_length32(uint64_t v) noexcept nogil:
    cdef int n = 0
    while v:
        v >>= 1
        n += 1
    return n


cdef int packed_width(const uint32_t *values, Py_ssize_t n) noexcept nogil:
    """`redis_codec.packed_width`: the bit length of the largest gap of a strictly increasing sketch (the first
    value is the gap from 0), 0 if it is not packed (empty, not strictly increasing, or no smaller packed)."""
    cdef uint64_t most = 0, gap
    cdef uint32_t before = 0
    cdef Py_ssize_t i
    cdef int width
    if n <= 0:
        return 0
    for i in range(n):
        if i and values[i] <= before:
            return 0
        gap = values[i] - before
        if gap > most:
            most = gap
        before = values[i]
    width = bit_length32(most)
    if width and 1 + (n * width + 7) // 8 < 4 * n:
        return width
    return 0


cdef inline Py_ssize_t read_varint(const char *p, Py_ssize_t at, Py_ssize_t length, uint32_t *out) noexcept nogil:
    """The minimal LEB128 varint of at most 32 bits at `at` into `out`; the position after it, or -1."""
    cdef uint64_t v = 0
    cdef int shift = 0
    cdef Py_ssize_t i
    cdef uint8_t byte
    for i in range(at, min(at + 5, length)):
        byte = <uint8_t>p[i]
        v |= (<uint64_t>(byte & 0x7F)) << shift
        if not (byte & 0x80):
            if (byte == 0 and i > at) or v >= (<uint64_t>1 << 32):
                return -1
            out[0] = <uint32_t>v
            return i + 1
        shift += 7
    return -1


cdef inline char *put_varint(char *p, uint32_t v) noexcept nogil:
    while v >= 0x80:
        p[0] = <char>((v & 0x7F) | 0x80)
        p += 1
        v >>= 7
    p[0] = <char>v
    return p + 1


cdef inline int varint_size(uint32_t v) noexcept nogil:
    cdef int n = 1
    while v >= 0x80:
        v >>= 7
        n += 1
    return n


cdef bint unpack_sketch(const char *p, Py_ssize_t n, int width, uint32_t *out) noexcept nogil:
    """`redis_codec.unpack_sketch`'s values (`p`: the packed bytes after the width byte); False unless they are
    what `pack_sketch` writes: strictly increasing, within 32 bits, `width` the bit length of the largest gap,
    smaller than 4 bytes a value, zero padding bits."""
    cdef Py_ssize_t i, bit = 0, byte, nbytes = (n * width + 7) // 8, j
    cdef uint64_t word, gap, most = 0, total = 0, mask = (<uint64_t>1 << width) - 1
    if n <= 0 or 1 + nbytes >= 4 * n:
        return False
    for i in range(n):
        byte = bit >> 3
        if byte + 8 <= nbytes:
            memcpy(&word, p + byte, 8)  # little-endian, as every stored number (x86-64, arm64)
        else:
            word = 0
            for j in range(nbytes - byte):
                word |= (<uint64_t><uint8_t>p[byte + j]) << (8 * j)
        gap = (word >> (bit & 7)) & mask
        if i and not gap:
            return False
        if gap > most:
            most = gap
        total += gap
        if total >= (<uint64_t>1 << 32):
            return False
        out[i] = <uint32_t>total
        bit += width
    if bit & 7 and (<uint8_t>p[nbytes - 1]) >> (bit & 7):
        return False
    return bit_length32(most) == width


cdef void pack_sketch(const uint32_t *values, Py_ssize_t n, int width, char *out) noexcept nogil:
    """`redis_codec.pack_sketch` after its width byte, into `out` ((n * width + 7) // 8 bytes)."""
    cdef Py_ssize_t i, bit = 0, byte, nbytes = (n * width + 7) // 8
    cdef uint64_t gap, word
    cdef uint32_t before = 0
    memset(out, 0, nbytes)
    for i in range(n):
        gap = (<uint64_t>(values[i] - before)) << (bit & 7)
        before = values[i]
        byte = bit >> 3
        if byte + 8 <= nbytes:
            memcpy(&word, out + byte, 8)
            word |= gap
            memcpy(out + byte, &word, 8)
        else:
            while gap:
                out[byte] = <char>(<uint8_t>out[byte] | <uint8_t>(gap & 0xFF))
                gap >>= 8
                byte += 1
        bit += width


def decode_entries(list ids, list blobs, make, fallback) -> dict:
    """{id: entry} of the stored entries `blobs` (None: gone, left out), decoded as
    `redis_codec.decode_entry` decodes them. The common forms (a uint32 sketch, packed or not, and perhaps a
    short text's characters, nothing else: version 3, or version 2) are read here, into `make(id, ts, exact,
    size, sketch, None, None, frozenset(), chars)`; any other, and anything malformed, goes to
    `fallback(blob, id)`, which decodes it or raises."""
    cdef dict out = {}
    cdef Py_ssize_t i, n, length
    cdef const char *p
    cdef double ts
    cdef uint64_t lo, hi
    cdef uint32_t size, n_sketch, n_minhash, n_sentences
    cdef uint8_t version, flags
    cdef uint32_t[::1] view
    cdef Py_ssize_t at, end
    cdef int width
    if len(ids) != len(blobs):
        raise ValueError("ids and blobs differ in length")
    np = np_()
    for i in range(len(ids)):
        blob = blobs[i]
        if blob is None:
            continue
        id = ids[i]
        length = len(<bytes>blob)
        p = <const char *>(<bytes>blob)
        if length >= 28 and <uint8_t>p[0] == 3 and (<uint8_t>p[25] & ~(8 | 16)) == 4:
            # Version 3, a narrow sketch (packed or not), perhaps characters, nothing else.
            flags = <uint8_t>p[25]
            at = read_varint(p, 26, length, &size)
            if at >= 0:
                at = read_varint(p, at, length, &n_sketch)
            if at >= 0:
                sketch = np.empty(n_sketch, dtype=np.uint32)
                if flags & 16:
                    width = <uint8_t>p[at] if at < length else 0
                    end = at + 1 + (<Py_ssize_t>n_sketch * width + 7) // 8
                    if 1 <= width <= 32 and end <= length:
                        view = sketch
                        if not unpack_sketch(p + at + 1, n_sketch, width, &view[0]):  # False for none
                            end = -1
                    else:
                        end = -1
                else:
                    end = at + 4 * <Py_ssize_t>n_sketch
                    if end <= length and n_sketch:
                        view = sketch
                        memcpy(&view[0], p + at, 4 * <size_t>n_sketch)
                        if packed_width(&view[0], n_sketch):
                            end = -1  # one this neardup packs
                    elif end > length:
                        end = -1
                if end >= 0 and ((not (flags & 8) and length == end) or (flags & 8 and length > end)):
                    chars = ""
                    if flags & 8:
                        try:
                            chars = (<bytes>blob)[end:].decode("utf-8", "surrogatepass")
                        except UnicodeDecodeError:
                            out[id] = fallback(blob, id)  # raises IndexCorrupt
                            continue
                    memcpy(&ts, p + 1, 8)
                    memcpy(&lo, p + 9, 8)
                    memcpy(&hi, p + 17, 8)
                    out[id] = make(id, ts, (<object>hi) << 64 | lo, size, sketch, None, None, NO_SENTENCES, chars)
                    continue
        elif length >= 42:
            version = <uint8_t>p[0]
            memcpy(&ts, p + 1, 8)
            memcpy(&lo, p + 9, 8)
            memcpy(&hi, p + 17, 8)
            memcpy(&size, p + 25, 4)
            flags = <uint8_t>p[29]
            memcpy(&n_sketch, p + 30, 4)
            memcpy(&n_minhash, p + 34, 4)
            memcpy(&n_sentences, p + 38, 4)
            at = 42 + 4 * <Py_ssize_t>n_sketch
            if (version == 2 and n_minhash == 0 and n_sentences == 0
                    and ((flags == 4 and length == at) or (flags == 12 and length > at))):
                chars = ""
                if flags == 12:  # _HAS_CHARS: the rest is the short text (UTF-8, surrogatepass)
                    try:
                        chars = (<bytes>blob)[at:].decode("utf-8", "surrogatepass")
                    except UnicodeDecodeError:
                        out[id] = fallback(blob, id)  # raises IndexCorrupt
                        continue
                sketch = np.empty(n_sketch, dtype=np.uint32)
                if n_sketch:
                    view = sketch
                    memcpy(&view[0], p + 42, 4 * <size_t>n_sketch)
                out[id] = make(id, ts, (<object>hi) << 64 | lo, size, sketch, None, None, NO_SENTENCES, chars)
                continue
        out[id] = fallback(blob, id)
    return out


cdef inline uint64_t _name_hash(object name) except? 0:
    """A field name's hash for `overlay_writes`' table: a bucket's (b"b" and its 8-byte key) by its key mixed,
    any other by Python's. Most names a round reads are new bytes, and Python's siphash of them was most of
    the overlay's work (docs/benchmarks.md, "Rounds of 128 messages")."""
    cdef uint64_t key
    if type(name) is bytes and len(<bytes>name) == 9 and PyBytes_AS_STRING(name)[0] == 98:  # b"b"
        memcpy(&key, PyBytes_AS_STRING(name) + 1, 8)
        return mix64(key)
    return <uint64_t>PyObject_Hash(name)


def overlay_writes(list names, list written_names, list kept, dict written) -> None:
    """`redis_codec.overlay_writes`, compiled: `names` in an open-addressing table of their hashes (a
    bucket field's by its key, `_name_hash`), then each written field looked up by hash and compared only on
    a hash match."""
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
            h = _name_hash(names[i])
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
                h = _name_hash(name)
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


cdef object live_blob(list columns, Py_ssize_t place, double horizon, Py_ssize_t at, object id, object time_of):
    """The value of the field at `place` in the first slice read where it is live: its event time (8 bytes
    at `at`: 1 for an entry, after its version byte; 0 for a memo) at or after `horizon`; else None."""
    cdef object blob
    cdef double ts
    for column in columns:
        blob = (<list>column)[place]
        if blob is None:
            continue
        if len(<bytes>blob) >= at + 8:
            memcpy(&ts, <const char *>(<bytes>blob) + at, 8)
        else:
            ts = time_of(blob, id)  # raises: too short
        if ts >= horizon:
            return blob
    return None


def rank_scratch() -> _RankScratch:
    """Buffers for `rank_lookup` and `rank_all_compact` to keep from lookup to lookup (`scratch=`)."""
    return _RankScratch()


def rank_lookup(list columns, list positions_of, list id_places, list ids, list floors, Py_ssize_t limit,
                list horizons, Py_ssize_t cap, entry_time, memo_time, _RankScratch scratch=None) -> list:
    """`redis_codec.rank_lookup`, compiled: per query of a lookup, (its stored entry's bytes if live, else
    None; if none, its memo's bytes (the field after its entry's) if live, else None; `rank_records` of
    its buckets). `scratch`: buffers kept by the caller (`rank_scratch`), else made for this call."""
    cdef Py_ssize_t i, e, n = len(ids)
    cdef double horizon
    cdef object own, memo
    if scratch is None:
        scratch = _RankScratch()
    if len(id_places) != n:
        raise ValueError("ids and entry places differ in length")
    out = []
    for i in range(n):
        horizon = horizons[i]
        e = id_places[i]
        own = live_blob(columns, e, horizon, 1, ids[i], entry_time)
        memo = None if own is not None else live_blob(columns, e + 1, horizon, 0, ids[i], memo_time)
        out.append((own, memo, _rank_records(columns, positions_of[i], ids[i], floors[i], limit, horizon, cap, -1,
                                             None, scratch)))
    return out


def encode_entries(list entries, fallback) -> list:
    """`redis_codec.encode_entry` of each entry of `entries` ((Entry, keys) pairs): the common form (a
    uint32 sketch, perhaps a short text's characters, no simhash, minhash or sentences) written here, any
    other by `fallback(entry)`."""
    cdef list out = []
    cdef const uint32_t[::1] sketch
    cdef Py_ssize_t n, body
    cdef char *p
    cdef double ts
    cdef uint64_t lo, hi
    cdef uint32_t size, count
    cdef int width
    cdef Py_buffer view
    cdef bint held
    cdef const uint32_t *values
    np = np_()
    u32 = np.uint32
    for item in entries:
        entry = (<tuple>item)[0]
        if entry.simhash is not None or entry.minhash is not None or entry.sentences:
            out.append(fallback(entry))
            continue
        sk = entry.sketch
        exact = entry.exact
        held = native_u32(sk, &view)  # a uint32 sketch, read as it is (else through a typed memoryview)
        try:
            if not ((held or sk.dtype == u32) and 0 <= exact < (1 << 128) and 0 <= entry.size < (1 << 32)):
                out.append(fallback(entry))
                continue
            if held:
                n = view.len // 4
                values = <const uint32_t *>view.buf
            else:
                sketch = sk
                n = sketch.shape[0]
                values = &sketch[0] if n else NULL
            width = packed_width(values, n) if n else 0
            body = 1 + (n * width + 7) // 8 if width else 4 * n
            chars = (<str>entry.chars).encode("utf-8", "surrogatepass") if entry.chars else b""
            size = entry.size
            count = <uint32_t>n
            blob = PyBytes_FromStringAndSize(NULL, 26 + varint_size(size) + varint_size(count) + body
                                             + len(<bytes>chars))
            p = PyBytes_AS_STRING(blob)
            ts = entry.ts
            lo = <uint64_t>(exact & 0xFFFFFFFFFFFFFFFF)
            hi = <uint64_t>(exact >> 64)
            p[0] = 3  # ENCODING_VERSION
            memcpy(p + 1, &ts, 8)
            memcpy(p + 9, &lo, 8)
            memcpy(p + 17, &hi, 8)
            # the sketch is uint32 (4), packed (16), the short text follows (8)
            p[25] = 4 | (16 if width else 0) | (8 if chars else 0)
            p = put_varint(put_varint(p + 26, size), count)
            if width:
                p[0] = <char>width
                pack_sketch(values, n, width, p + 1)
            elif n:
                memcpy(p, values, 4 * n)
            if chars:
                memcpy(p + body, <const char *>(<bytes>chars), len(<bytes>chars))
            out.append(blob)
        finally:
            if held:
                PyBuffer_Release(&view)
    return out



# --- a rebuild's writes, each bucket field once (the twins of `redis_codec.restore_accept`, `newest_records`
# and `bucket_pairs`, which document them) ------------------------------------------------------------------

def restore_accept(list ids, times, dict live, double hwm, double window, uint64_t seq) -> tuple:
    """`redis_codec.restore_accept`, compiled."""
    np = np_()
    cdef const double[::1] ts_of = np.ascontiguousarray(times, dtype=np.float64)
    cdef Py_ssize_t n = len(ids), i
    out = np.zeros(n, np.uint64)
    cdef uint64_t[::1] o = out
    cdef double ts
    cdef object id, old
    for i in range(n):
        id = ids[i]
        ts = ts_of[i]
        old = live.get(id)
        if (old is not None and <double>old >= hwm - window) or not ts >= (ts if ts > hwm else hwm) - window:
            continue
        if ts > hwm:
            hwm = ts
        seq += 1
        o[i] = seq
        live[id] = ts
    return out, hwm, seq


def newest_records(keys, entries, times, seqs, Py_ssize_t cap) -> object:
    """`redis_codec.newest_records`, compiled: each key's records chained in order through an open-addressing
    table (no sort), so a key's records of one entry are next to each other and a repeat is the record
    before."""
    np = np_()
    cdef const uint64_t[::1] k = np.ascontiguousarray(keys, dtype=np.uint64)
    cdef const int64_t[::1] e = np.ascontiguousarray(entries, dtype=np.int64)
    cdef const double[::1] t = np.ascontiguousarray(times, dtype=np.float64)
    cdef const uint64_t[::1] q = np.ascontiguousarray(seqs, dtype=np.uint64)
    cdef Py_ssize_t n = len(k), r, g, j, w = 0, start, m, room = 0, slot, mask, size, n_groups = 0
    cdef int shift = 64
    cdef uint64_t key
    out = np.empty(n, np.int64)
    cdef int64_t[::1] o = out
    cdef nd_piece *pieces = NULL
    cdef nd_piece *grown
    cdef uint64_t *slot_key = NULL
    cdef Py_ssize_t *slot_at = NULL
    # Per group (a key, numbered as first seen): its first and last record; per record the next of its key.
    cdef Py_ssize_t *g_first = <Py_ssize_t *>PyMem_Malloc((n + 1) * sizeof(Py_ssize_t))
    cdef Py_ssize_t *g_last = <Py_ssize_t *>PyMem_Malloc((n + 1) * sizeof(Py_ssize_t))
    cdef Py_ssize_t *following = <Py_ssize_t *>PyMem_Malloc((n + 1) * sizeof(Py_ssize_t))
    try:
        if g_first == NULL or g_last == NULL or following == NULL:
            raise MemoryError()
        size = open_table(n, &slot_key, &slot_at)
        mask = size - 1
        while size > 1:
            size >>= 1
            shift -= 1
        for r in range(n):
            key = k[r]
            slot = <Py_ssize_t>((mix64(key) * MUL) >> shift)
            while slot_at[slot] >= 0 and slot_key[slot] != key:
                slot = (slot + 1) & mask
            following[r] = -1
            if slot_at[slot] < 0:
                slot_key[slot] = key
                slot_at[slot] = n_groups
                g_first[n_groups] = g_last[n_groups] = r
                n_groups += 1
                continue
            g = slot_at[slot]
            if e[g_last[g]] == e[r]:  # the entry gave the key twice: its record once
                following[r] = -2
                continue
            following[g_last[g]] = r
            g_last[g] = r
        for g in range(n_groups):
            start = w
            r = g_first[g]
            while r >= 0:
                o[w] = r
                w += 1
                r = following[r]
            m = w - start
            if m > cap:
                if m > room:
                    grown = <nd_piece *>PyMem_Realloc(pieces, m * sizeof(nd_piece))
                    if grown == NULL:
                        raise MemoryError()
                    pieces, room = grown, m
                for j in range(m):
                    r = o[start + j]
                    pieces[j].ts = t[e[r]]
                    pieces[j].seq = q[e[r]]
                    pieces[j].order = r
                # The cap newest (a group's (event time, seq) are distinct: one record an entry), then in order.
                nd_select_newest_pieces(pieces, pieces + m, cap)
                nd_sort_pieces_by_order(pieces, pieces + cap)
                for j in range(cap):
                    o[start + j] = pieces[j].order
                w = start + cap
    finally:
        PyMem_Free(pieces); PyMem_Free(slot_key); PyMem_Free(slot_at)
        PyMem_Free(g_first); PyMem_Free(g_last); PyMem_Free(following)
    return out[:w]


def bucket_pairs(keys, entries, times, seqs, ids, id_ends, dict olds, Py_ssize_t cap) -> list:
    """`redis_codec.bucket_pairs`, compiled: each value made in one piece."""
    np = np_()
    cdef const uint64_t[::1] k = np.ascontiguousarray(keys, dtype=np.uint64)
    cdef const int64_t[::1] e = np.ascontiguousarray(entries, dtype=np.int64)
    cdef const double[::1] t = np.ascontiguousarray(times, dtype=np.float64)
    cdef const uint64_t[::1] q = np.ascontiguousarray(seqs, dtype=np.uint64)
    cdef const int64_t[::1] ends = np.ascontiguousarray(id_ends, dtype=np.int64)
    cdef const unsigned char[::1] idb = ids
    cdef const char *id_base = ""
    if len(idb):
        id_base = <const char *>&idb[0]
    cdef Py_ssize_t n = len(k), at = 0, stop, j, size, a, b, n_old, count, room = 0
    cdef uint64_t key
    cdef uint32_t idn
    cdef int64_t ent
    cdef list out = []
    cdef object old
    cdef bytes v
    cdef char *p
    cdef nd_piece *pieces = NULL
    cdef nd_piece *grown
    try:
        while at < n:
            key = k[at]
            stop, size = at, 0
            while stop < n and k[stop] == key:
                ent = e[stop]
                size += 20 + ends[ent] - (ends[ent - 1] if ent else 0)
                stop += 1
            old = olds.get(key) if olds else None
            n_old = len(<bytes>old) if old is not None else 0
            v = PyBytes_FromStringAndSize(NULL, n_old + size)
            p = PyBytes_AS_STRING(v)
            if n_old:
                memcpy(p, <const char *>(<bytes>old), n_old)
                p += n_old
            for j in range(at, stop):
                ent = e[j]
                a = ends[ent - 1] if ent else 0
                b = ends[ent]
                idn = <uint32_t>(b - a)
                memcpy(p, &t[ent], 8)
                memcpy(p + 8, &idn, 4)
                memcpy(p + 12, id_base + a, idn)
                put_be64(p + 12 + idn, q[ent])
                p += 20 + idn
            if old is not None:
                count = record_count(PyBytes_AS_STRING(v), len(v))
                if count > cap:
                    if count > room:
                        grown = <nd_piece *>PyMem_Realloc(pieces, count * sizeof(nd_piece))
                        if grown == NULL:
                            raise MemoryError()
                        pieces, room = grown, count
                    add_pieces(pieces, 0, PyBytes_AS_STRING(v), len(v))
                    v = newest_pieces(pieces, count, cap)
            out.append(bucket_field(key))
            out.append(v)
            at = stop
    finally:
        PyMem_Free(pieces)
    return out


def bucket_commands(bytes name, keys, entries, times, seqs, ids, id_ends, dict olds, Py_ssize_t cap,
                    Py_ssize_t per_call) -> tuple:
    """`redis_codec.bucket_commands`, compiled: the sizes first, then the bytes, each value written in place
    (one held before is made apart, by `bucket_pairs`)."""
    np = np_()
    cdef const uint64_t[::1] k = np.ascontiguousarray(keys, dtype=np.uint64)
    cdef const int64_t[::1] e = np.ascontiguousarray(entries, dtype=np.int64)
    cdef const double[::1] t = np.ascontiguousarray(times, dtype=np.float64)
    cdef const uint64_t[::1] q = np.ascontiguousarray(seqs, dtype=np.uint64)
    cdef const int64_t[::1] ends = np.ascontiguousarray(id_ends, dtype=np.int64)
    cdef const unsigned char[::1] idb = ids
    cdef const char *id_base = ""
    if len(idb):
        id_base = <const char *>&idb[0]
    cdef Py_ssize_t n = len(k), at = 0, stop, j, size, a, b, g, c, m, n_groups = 0, total = 0
    cdef Py_ssize_t name_len = len(name)
    cdef uint64_t key
    cdef uint32_t idn
    cdef int64_t ent
    cdef dict made = {}  # group -> its value, when a value held before comes first
    cdef object v
    starts_arr = np.empty(n + 1, np.intp)
    sizes_arr = np.empty(n + 1, np.intp)
    cdef Py_ssize_t[::1] starts = starts_arr
    cdef Py_ssize_t[::1] sizes = sizes_arr
    if per_call < 1:
        raise ValueError("per_call must be >= 1")
    while at < n:
        key = k[at]
        stop, size = at, 0
        while stop < n and k[stop] == key:
            ent = e[stop]
            size += 20 + ends[ent] - (ends[ent - 1] if ent else 0)
            stop += 1
        if olds and key in olds:
            v = bucket_pairs(keys[at:stop], entries[at:stop], times, seqs, ids, id_ends, {key: olds[key]}, cap)[1]
            made[n_groups] = v
            size = len(<bytes>v)
        starts[n_groups] = at
        sizes[n_groups] = size
        n_groups += 1
        at = stop
    starts[n_groups] = n
    for c in range(0, n_groups, per_call):
        m = min(per_call, n_groups - c)
        total += 3 + decimal_size(2 + 2 * m) + 10 + 3 + decimal_size(name_len) + name_len + 2
        for g in range(c, c + m):
            total += 15 + 3 + decimal_size(sizes[g]) + sizes[g] + 2
    out = PyBytes_FromStringAndSize(NULL, total)
    cdef char *p = PyBytes_AS_STRING(out)
    for c in range(0, n_groups, per_call):
        m = min(per_call, n_groups - c)
        p = put_header(p, 42, 2 + 2 * m)
        p = put_header(p, 36, 4)
        memcpy(p, b"HSET\r\n", 6)
        p = put_header(p + 6, 36, name_len)
        memcpy(p, <const char *>name, name_len)
        p[name_len] = 13
        p[name_len + 1] = 10
        p += name_len + 2
        for g in range(c, c + m):
            at = starts[g]
            p = put_header(p, 36, 9)
            p[0] = 98  # b"b"
            put_be64(p + 1, k[at])
            p[9] = 13
            p[10] = 10
            p = put_header(p + 11, 36, sizes[g])
            v = made.get(g) if made else None
            if v is not None:
                memcpy(p, <const char *>(<bytes>v), sizes[g])
                p += sizes[g]
            else:
                for j in range(at, starts[g + 1]):
                    ent = e[j]
                    a = ends[ent - 1] if ent else 0
                    b = ends[ent]
                    idn = <uint32_t>(b - a)
                    memcpy(p, &t[ent], 8)
                    memcpy(p + 8, &idn, 4)
                    memcpy(p + 12, id_base + a, idn)
                    put_be64(p + 12 + idn, q[ent])
                    p += 20 + idn
            p[0] = 13
            p[1] = 10
            p += 2
    return out, (n_groups + per_call - 1) // per_call
