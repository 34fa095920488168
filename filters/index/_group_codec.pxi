# The group layout's compiled per-batch work (included by filters/_native.pyx, after index/_compact_codec.pxi):
# the twins of filters/index/group_codec.py, held to it by tests/test_group_codec.py.

from cpython cimport array as c_array
from libcpp.string cimport string

import array as py_array

cdef extern from "Python.h":
    Py_ssize_t PyBytes_GET_SIZE(object o)
    PyObject *PyList_GET_ITEM(object o, Py_ssize_t i)
    Py_ssize_t PyList_GET_SIZE(object o)
    bint PyDict_Next(object p, Py_ssize_t *ppos, PyObject **pkey, PyObject **pvalue)

cdef enum:
    AHEAD = 16  # names on whose group `group_slice_column` fetches ahead
    GROUP_RECORD = 20
    GROUP_K_MAX = 30


cdef extern from * nogil:
    """
    static inline unsigned long long nd_load_be64(const unsigned char *p) {
        unsigned long long v; memcpy(&v, p, 8); return __builtin_bswap64(v);
    }
    static inline void nd_store_be64(unsigned char *p, unsigned long long v) {
        v = __builtin_bswap64(v); memcpy(p, &v, 8);
    }
    """
    unsigned long long nd_load_be64(const unsigned char *p)
    void nd_store_be64(unsigned char *p, unsigned long long v)


cdef extern from * nogil:
    """
    static inline void nd_prefetch(const void *p) { __builtin_prefetch(p); }
    static inline PyObject **nd_list_items(PyObject *l) { return ((PyListObject *)l)->ob_item; }
    static inline Py_ssize_t nd_refcnt(PyObject *o) { return Py_REFCNT(o); }
    /* Empties list `l` as list_clear does (detached first, then each item's reference dropped), each item fetched
       64 ahead of its turn: the items of a batch's lists lie all over the heap, cold by then. */
    static void nd_release_list(PyObject *l, int depth) {
        PyListObject *o = (PyListObject *)l;
        Py_ssize_t n = Py_SIZE(o), i;
        PyObject **items = o->ob_item;
        if (items == NULL) return;
        o->ob_item = NULL;
        Py_SET_SIZE(o, 0);
        o->allocated = 0;
        for (i = 0; i < n && i < 64; i++) if (items[i] != NULL) __builtin_prefetch(items[i]);
        for (i = 0; i < n; i++) {
            if (i + 64 < n && items[i + 64] != NULL) __builtin_prefetch(items[i + 64]);
            /* (a list of lists: an inner list only this one holds emptied the same way, once) */
            if (depth && items[i] != NULL && PyList_CheckExact(items[i]) && Py_REFCNT(items[i]) == 1)
                nd_release_list(items[i], depth - 1);
            Py_XDECREF(items[i]);
        }
        PyMem_Free(items);
    }
    """
    void nd_prefetch(const void *p)
    PyObject **nd_list_items(PyObject *l)
    Py_ssize_t nd_refcnt(PyObject *o)
    void nd_release_list(PyObject *l, int depth)


cdef inline uint64_t _load_be64(const unsigned char *p) noexcept nogil:
    return nd_load_be64(p)


cdef inline void _store_be32(unsigned char *p, uint32_t v) noexcept nogil:
    p[0] = <unsigned char>(v >> 24)
    p[1] = <unsigned char>(v >> 16)
    p[2] = <unsigned char>(v >> 8)
    p[3] = <unsigned char>v


cdef inline void _store_be64(unsigned char *p, uint64_t v) noexcept nogil:
    nd_store_be64(p, v)


cdef inline int _group_kind(bytes name) noexcept:
    """`_group_place`'s kind of `name` alone."""
    cdef Py_ssize_t n = PyBytes_GET_SIZE(name)
    cdef const unsigned char *p = <const unsigned char *>PyBytes_AS_STRING(name)
    if n == 9 and p[0] == 98:
        return 1
    return 2 if n >= 1 and p[0] == 105 else 0


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
    """The records of a group (bytes), IndexCorrupt when its length is not a whole number of them."""
    cdef Py_ssize_t n
    if type(group) is not bytes:
        return _group_len_slow(group)
    n = PyBytes_GET_SIZE(group)
    if n % GROUP_RECORD:
        return _group_len_slow(group)
    return n // GROUP_RECORD


cdef Py_ssize_t _group_len_slow(object group) except -1:
    cdef Py_ssize_t n = len(<bytes?>group)
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
    cdef unsigned char buf[64 * 16]  # (a group's records of one bucket gathered here at once, up to 64)
    cdef bytes out
    for r in range(n):
        if _rec_is(g + r * GROUP_RECORD, key, False):
            if found == 64:
                break
            memcpy(buf + found * 16, g + r * GROUP_RECORD + 4, 16)
            found += 1
    else:
        return PyBytes_FromStringAndSize(<const char *>buf, found * 16) if found else None
    found = 0  # more than 64: counted, then copied
    for r in range(n):
        if _rec_is(g + r * GROUP_RECORD, key, False):
            found += 1
    out = PyBytes_FromStringAndSize(NULL, found * 16)
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
    """`group_codec.trim_bucket` (`_trim_in_place` on a copy)."""
    _group_len(group)
    cdef string g = string(PyBytes_AS_STRING(group), len(group))
    cdef Py_ssize_t size = g.size()
    _trim_in_place(g, key, cap)
    if <Py_ssize_t>g.size() == size:
        return group
    return PyBytes_FromStringAndSize(g.data(), g.size())


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
    """`group_codec.group_field`: b"g<j>" (j in decimal), made without Python's formatting."""
    cdef char buf[24]
    buf[0] = 103  # b"g"
    return PyBytes_FromStringAndSize(buf, 1 + _digits(buf + 1, j))


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
    """`filters.index.group_codec.apply_round`, compiled: each group touched made once (`_round_into`)."""
    cdef list fields, values
    fields, values, _ = _round_into(groups, None, names, bits, entries, False, 0, 1, cap)
    cdef Py_ssize_t k
    for k in range(len(fields)):
        groups[fields[k]] = values[k]
    return fields


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



# --- a slice's read and a round's writes at once (the twins of `group_codec.pack_reads`, `slice_column`,
# `slice_writes`): what a batch reads and writes went through Python and dicts of names (~7,000 names a batch) -

cdef struct _GroupSlot:
    uint64_t key  # j + 1; 0: empty
    Py_ssize_t value


cdef class _GroupSlots:
    """Group j -> a number given when j is first met, open addressing: a batch touches thousands of groups of a
    slice of up to 2^30, so neither a dict of their names nor an array of all groups."""
    cdef vector[_GroupSlot] slots
    cdef uint64_t mask
    cdef int shift

    def __cinit__(self, Py_ssize_t most):
        cdef int b = 4
        cdef _GroupSlot empty
        empty.key, empty.value = 0, 0
        while (<Py_ssize_t>1 << b) < 2 * most:
            b += 1
        self.slots.assign(<size_t>1 << b, empty)
        self.mask = (<uint64_t>1 << b) - 1
        self.shift = 64 - b

    cdef inline Py_ssize_t get(self, uint64_t j, Py_ssize_t fresh) noexcept:
        """The number of group j; `fresh` (given it now) when j is new. At most `most` groups."""
        cdef uint64_t at = ((j + 1) * 0x9E3779B97F4A7C15ULL) >> self.shift
        cdef _GroupSlot *slot
        while True:
            slot = &self.slots[at]
            if slot.key == j + 1:
                return slot.value
            if slot.key == 0:
                slot.key = j + 1
                slot.value = fresh
                return fresh
            at = (at + 1) & self.mask


cdef list _GROUP_PLACES = None  # the ints 0 .. 2^16 - 1, made when first needed: a batch's places, not allocated


cdef list _group_places():
    global _GROUP_PLACES
    if _GROUP_PLACES is None:
        _GROUP_PLACES = list(range(1 << 16))
    return _GROUP_PLACES


cdef inline object _place_in(list ints, Py_ssize_t k):
    """The int `k`, from `ints` (`_group_places()`) where it is there."""
    return <object>PyList_GET_ITEM(ints, k) if 0 <= k < (1 << 16) else k


cdef inline void _list_put(list out, Py_ssize_t i, object value) noexcept:
    """Item `i` of a list made by PyList_New (its items NULL) set to `value`."""
    Py_INCREF(value)
    PyList_SET_ITEM(out, i, value)


cdef tuple _pack_fields(str slice_key, Py_ssize_t per_command, list fields, list places):
    """`pack_reads`' result from the fields and places of `read_fields`."""
    cdef Py_ssize_t n = len(fields), a, stop, k, key_len, size = 0
    cdef const char *key = PyUnicode_AsUTF8AndSize(slice_key, &key_len)
    cdef bytes field
    cdef _Out o
    for k in range(n):
        size += 5 + decimal_size(len(<bytes>fields[k])) + len(<bytes>fields[k])
    o.p = NULL
    o.size = o.commands = 0
    for _ in range(2):  # counted, then written
        a = 0
        while a < n:
            stop = min(n, a + per_command)
            _o_header(&o, 42, 2 + stop - a)
            _o_bulk(&o, "HMGET", 5)
            _o_bulk(&o, key, key_len)
            if o.p != NULL:
                for k in range(a, stop):
                    field = <bytes>fields[k]
                    _o_bulk(&o, field, len(field))
            o.commands += 1
            a = stop
        _o_header(&o, 42, 3)
        _o_bulk(&o, "HGET", 4)
        _o_bulk(&o, key, key_len)
        _o_bulk(&o, "n", 1)
        if o.p == NULL:
            out = PyBytes_FromStringAndSize(NULL, o.size + size)
            o.p = PyBytes_AS_STRING(out)
            o.size = o.commands = 0
    if o.size != len(out):  # the two passes disagree: never send what was not written
        raise SystemError(f"group_pack_reads wrote {o.size} bytes of {len(out)}")
    return out, o.commands, fields, places


cdef inline object _group_name_in(list cache, uint64_t j):
    """`_group_name(j)`, kept in `cache` (a list indexed by j; None: none) where j is inside it."""
    cdef object name
    if cache is None or j >= <uint64_t>PyList_GET_SIZE(cache):
        return _group_name(j)
    name = <object>PyList_GET_ITEM(cache, j)
    if name is None:
        name = _group_name(j)
        cache[j] = name
    return name


def group_pack_reads(str slice_key, list names, object bits, Py_ssize_t per_command, list cache=None) -> tuple:
    """`filters.index.group_codec.pack_reads`, compiled: the groups told apart by number (`_GroupSlots`), each
    one's field made once (or taken from `cache`), the lists made at their size, the RESP written at once."""
    cdef Py_ssize_t n = len(names), i, k, m = 0
    cdef bint unknown = bits is None
    # (A slice of unknown bits reads only the names of its hash itself: its fields appended, few.)
    cdef list fields = [] if unknown else PyList_New(n), places = PyList_New(n)
    cdef dict at = {}
    cdef bytes name
    cdef object known
    cdef uint64_t j
    cdef uint32_t key
    cdef int kind, b = 0 if bits is None else bits
    if not 0 <= b <= GROUP_K_MAX:
        raise ValueError(f"bits must be 0 to {GROUP_K_MAX}, got {bits!r}")
    if per_command < 1:
        raise ValueError(f"per_command must be >= 1, got {per_command}")
    # (The lists' items are set once each, in order: a list left behind by an error has NULL items past them,
    # which its deallocation skips.)
    cdef _GroupSlots slots = None if unknown else _GroupSlots(n)
    cdef list ints = _group_places()
    cdef object minus = _place_in(ints, -1)
    cdef vector[uint64_t] js
    cdef vector[int] kinds
    cdef PyObject **items = NULL
    cdef uint64_t kept = 0
    if not unknown:
        # Each name's group first, and its kept field fetched ahead (a slot of a list of 2^17 here, then the field
        # itself `AHEAD` names before its turn: both cold, a batch's ~6,000 groups drawn from all of them), so that
        # the loop below, which counts a reference to each, does not wait for memory one field after the other.
        js.resize(n)
        kinds.resize(n)
        if cache is not None:
            items = nd_list_items(<PyObject *>cache)
            kept = <uint64_t>PyList_GET_SIZE(cache)
        for i in range(n):
            kinds[i] = _group_place(<bytes?>names[i], b, &js[i], &key)
            if kinds[i] and js[i] < kept:
                nd_prefetch(&items[js[i]])
        for i in range(min(n, AHEAD)):
            if kinds[i] and js[i] < kept:
                nd_prefetch(items[js[i]])
                nd_prefetch(<const char *>items[js[i]] + 40)
    for i in range(n):
        if kept and i + AHEAD < n and kinds[i + AHEAD] and js[i + AHEAD] < kept:
            nd_prefetch(items[js[i + AHEAD]])
            nd_prefetch(<const char *>items[js[i + AHEAD]] + 40)
        name = <bytes?>names[i]
        if unknown:  # its groups are not read: only which names are a group's (no hashing)
            kind = _group_kind(name)
        else:
            kind = kinds[i]
            j = js[i]
        if kind:
            if unknown:
                _list_put(places, i, minus)
                continue
            k = slots.get(j, m)
            if k == m:
                _list_put(fields, m, _group_name_in(cache, j))
                m += 1
        else:
            if len(name) > 1 and PyBytes_AS_STRING(name)[0] == 103:
                # b"g...", which may spell a group's field: the reference's one dict of fields
                fields, places = group_read_fields(names, bits)
                return _pack_fields(slice_key, per_command, fields, places)
            known = at.get(name)
            if known is None:
                k = m
                at[name] = _place_in(ints, k)
                if unknown:
                    fields.append(name)
                else:
                    _list_put(fields, m, name)
                m += 1
            else:
                k = known
        _list_put(places, i, _place_in(ints, k))
    if not unknown:
        del fields[m:]
    return _pack_fields(slice_key, per_command, fields, places)


cdef inline bint _group_number(object field, uint64_t *j) noexcept:
    """Is `field` a group's field as `group_field` spells it (b"g" and j in decimal, no leading zero)? Then its j."""
    cdef Py_ssize_t n, i
    cdef const unsigned char *p
    cdef uint64_t v = 0
    if type(field) is not bytes:
        return False
    n = PyBytes_GET_SIZE(field)
    p = <const unsigned char *>PyBytes_AS_STRING(field)
    if n < 2 or n > 20 or p[0] != 103 or (p[1] == 48 and n > 2):
        return False
    for i in range(1, n):
        if not 48 <= p[i] <= 57:
            return False
        v = v * 10 + (p[i] - 48)
    j[0] = v
    return True


def group_slice_column(list replies, list places, list names, object bits, list fields, dict written=None) -> tuple:
    """`filters.index.group_codec.slice_column`, compiled (`fields` and `places` as `pack_reads` made them). The
    groups written since (`written`) are put in their place by number: a name's group, which its column needs
    anyway, looked up in an open-addressing table of theirs (no dict lookup of each field read, ~6,000 a batch,
    whose objects lie all over the heap); the other fields written (memos) by name."""
    cdef Py_ssize_t n = len(names), m = len(fields), p, k, total = 0, t, size
    cdef vector[PyObject *] values
    cdef vector[uint64_t] table_j  # j + 1; 0: empty
    cdef vector[PyObject *] table_v  # (borrowed: `written` holds them through the call)
    cdef uint64_t mask = 0, at
    cdef int shift = 64
    cdef object reply, value, out, field
    cdef PyObject *mine
    cdef PyObject *f
    cdef PyObject *v
    cdef list column, flat
    cdef uint64_t j
    cdef uint32_t key
    cdef int kind, b = 0 if bits is None else bits
    cdef bint by_name = False, others = False
    cdef vector[PyObject *] wrote_f, wrote_v
    cdef Py_ssize_t many
    if len(places) != n:
        raise ValueError("one place a name expected")
    values.reserve(m)
    for reply in replies:
        for value in <list?>reply:
            values.push_back(<PyObject *>value)
    if <Py_ssize_t>values.size() != m:
        raise ValueError(f"{values.size()} values for {m} fields")
    if written:
        if bits is None:
            by_name = True
        else:
            for p in range(n):  # a field of the slice hash spelt b"g...": each field looked up by name
                field = <object>PyList_GET_ITEM(names, p)
                if _group_kind(<bytes?>field) == 0 and PyBytes_GET_SIZE(field) > 1 \
                        and PyBytes_AS_STRING(field)[0] == 103:
                    by_name = True
                    break
        if by_name:
            for k in range(m):
                mine = PyDict_GetItemWithError(written, <object>PyList_GET_ITEM(fields, k))
                if mine != NULL:
                    values[k] = mine
        else:
            size = 16
            while size < 2 * len(written):
                size *= 2
                shift -= 1
            shift -= 4
            mask = <uint64_t>size - 1
            table_j.assign(size, 0)
            table_v.assign(size, NULL)
            # (The fields written, the batch before's, are cold: each fetched `AHEAD` fields before it is read, its
            # name's bytes too, which may lie on the next line.)
            t = 0
            while PyDict_Next(written, &t, &f, &v):
                wrote_f.push_back(f)
                wrote_v.push_back(v)
            many = wrote_f.size()
            for t in range(min(many, AHEAD)):
                nd_prefetch(wrote_f[t])
                nd_prefetch(<const char *>wrote_f[t] + 40)
            for t in range(many):
                if t + AHEAD < many:
                    nd_prefetch(wrote_f[t + AHEAD])
                    nd_prefetch(<const char *>wrote_f[t + AHEAD] + 40)
                f, v = wrote_f[t], wrote_v[t]
                if _group_number(<object>f, &j):
                    at = ((j + 1) * 0x9E3779B97F4A7C15ULL) >> shift
                    while table_j[at] != 0 and table_j[at] != j + 1:
                        at = (at + 1) & mask
                    table_j[at] = j + 1
                    table_v[at] = v
                else:
                    others = True
    cdef bint overlay = written and not by_name
    # First each name's field put in its place (its group by number, once its group is known; a memo by name);
    # then its column made from it, the group of the name `AHEAD` places on fetched meanwhile (the groups lie
    # all over the heap: read by the drain, or written by the batch before).
    cdef vector[Py_ssize_t] at_k
    cdef vector[uint32_t] keys
    cdef vector[char] kinds
    cdef const char *g
    at_k.resize(n)
    keys.resize(n)
    kinds.resize(n)
    for p in range(n):
        k = <object>PyList_GET_ITEM(places, p)
        if k >= m:
            raise IndexError("a place past the fields")
        at_k[p] = k
        if k < 0:
            continue
        kind = 0 if bits is None else _group_place(<bytes?><object>PyList_GET_ITEM(names, p), b, &j, &key)
        kinds[p], keys[p] = kind, key
        if overlay:
            if kind:
                at = ((j + 1) * 0x9E3779B97F4A7C15ULL) >> shift
                while table_j[at] != 0:
                    if table_j[at] == j + 1:
                        values[k] = table_v[at]
                        break
                    at = (at + 1) & mask
            elif others:
                mine = PyDict_GetItemWithError(written, <object>PyList_GET_ITEM(names, p))
                if mine != NULL:
                    values[k] = mine
    column = PyList_New(n)
    for p in range(n):
        if p + AHEAD < n and at_k[p + AHEAD] >= 0 and kinds[p + AHEAD]:
            g = <const char *>values[at_k[p + AHEAD]]
            nd_prefetch(g)
            nd_prefetch(g + 64)
            nd_prefetch(g + 128)
            nd_prefetch(g + 192)
            nd_prefetch(g + 256)
        k = at_k[p]
        if k < 0:
            out = None
        else:
            kind, key = kinds[p], keys[p]
            value = <object>values[k]
            if kind == 0:
                out = value
            elif value is None or (type(value) is bytes and PyBytes_GET_SIZE(value) == 0):
                out = None
            elif kind == 2:
                out = _id_record(value, key)
            else:
                out = _bucket_records(value, key)
        Py_INCREF(out)
        PyList_SET_ITEM(column, p, out)
    flat = PyList_New(m)
    for k in range(m):
        _list_put(flat, k, <object>values[k])
    return column, flat


cdef Py_ssize_t _trim_records(unsigned char *p, Py_ssize_t n, uint32_t key, Py_ssize_t cap):
    """`group_codec.trim_bucket` in place on the `n` records at `p`: the bucket's `cap` newest (event time, then
    seq; of equals, the first) kept, every other record and the order kept. Returns the records left."""
    cdef Py_ssize_t r, m, w = 0
    cdef vector[pair[pair[double, uint64_t], Py_ssize_t]] mine
    cdef double ts
    for r in range(n):
        if _rec_is(p + r * GROUP_RECORD, key, False):
            memcpy(&ts, p + r * GROUP_RECORD + 4, 8)
            # -r: of equal records the later sort first, so go first (the reference's stable sort keeps the first)
            mine.push_back(pair[pair[double, uint64_t], Py_ssize_t](
                pair[double, uint64_t](ts, _load_be64(p + r * GROUP_RECORD + 12)), -r))
    m = mine.size()
    if m <= cap:
        return n
    cpp_sort(mine.begin(), mine.end())  # oldest first: the first m - cap go
    cdef vector[char] drop = vector[char](n, 0)
    for r in range(m - cap):
        drop[-mine[r].second] = 1
    for r in range(n):
        if not drop[r]:
            if w != r:
                memmove(p + w * GROUP_RECORD, p + r * GROUP_RECORD, GROUP_RECORD)
            w += 1
    return w


cdef void _trim_in_place(string &g, uint32_t key, Py_ssize_t cap):
    """`_trim_records` of a group held in a string."""
    cdef Py_ssize_t n = <Py_ssize_t>g.size() // GROUP_RECORD
    if n:
        g.resize(_trim_records(<unsigned char *>&g[0], n, key, cap) * GROUP_RECORD)


cdef struct _GroupAppend:
    Py_ssize_t slot  # the group's number in the round (its field's place)
    uint32_t key
    bint is_id
    double ts
    uint64_t seq


cdef c_array.array _TAKEN_TEMPLATE = py_array.array("q")  # (`array("q")` is int64 on the platforms built for)


cdef class _SliceBuild:
    """One slice's groups as a round writes them (`_round_into`, `group_alone_groups`), as `apply_round` writes
    them: the records appended (`add`) are listed, then each group touched is made once (`finish`): its records
    counted first, its bytes allocated at their size, the group before copied in and the records written in place
    (a bucket trimmed in place). A group is found by its name's place in the slice's read (no dict and no name
    made, where nothing was written since: `groups`), else made. The read's values and `groups` are left as they
    are, and must stay so (and alive) until `finish`: their values are held borrowed."""
    cdef dict groups
    cdef bint written
    cdef list names, fields, read_fields, read_places, read_values
    cdef vector[int64_t] taken  # per group changed, the place of its field in the read (-1: none, or in `groups`)
    cdef Py_ssize_t n_names, n_read
    cdef int bits
    cdef _GroupSlots slots
    cdef vector[_GroupAppend] appends
    cdef vector[Py_ssize_t] counts, sizes
    cdef vector[PyObject *] olds  # (borrowed: the read's values and `groups` hold them)
    cdef list entries  # a round's entries for the slice hash: e<seq>, value, ...
    cdef Py_ssize_t count  # ... and their number

    def __cinit__(self, dict groups, object read, list names, int bits, Py_ssize_t most):
        if not 0 <= bits <= GROUP_K_MAX:
            raise ValueError(f"bits must be 0 to {GROUP_K_MAX}, got {bits!r}")
        self.groups, self.written, self.names, self.bits = groups, len(groups) > 0, names, bits
        self.n_names = len(names)
        self.fields, self.entries, self.count = [], [], 0
        self.taken.reserve(most)
        self.slots = _GroupSlots(most)  # a group for each record at most
        self.olds.reserve(most)
        self.sizes.reserve(most)
        self.counts.reserve(most)
        self.appends.reserve(most)
        self.n_read = 0
        if read is not None:
            self.read_fields, self.read_places, self.read_values = read
            self.n_read = len(self.read_fields)
            if len(self.read_places) != self.n_names or len(self.read_values) != self.n_read:
                raise ValueError("a read of other names")

    cdef int add(self, Py_ssize_t at, bint is_id, double ts, uint64_t seq) except -1:
        """The record of the name at place `at` (a bucket's, or an id's) appended to its group."""
        cdef uint64_t j
        cdef uint32_t key
        cdef int kind
        cdef Py_ssize_t k, kk
        cdef object old
        cdef PyObject *got
        cdef _GroupAppend op
        if not 0 <= at < self.n_names:
            raise IndexError(f"place {at} of {self.n_names} names")
        kind = _group_place(<bytes>PyList_GET_ITEM(self.names, at), self.bits, &j, &key)
        if kind != (2 if is_id else 1):
            raise ValueError(f"not {'an id' if is_id else 'a bucket'} field: {self.names[at]!r}")
        k = self.slots.get(j, PyList_GET_SIZE(self.fields))
        if k == PyList_GET_SIZE(self.fields):
            kk = <Py_ssize_t>(<object>PyList_GET_ITEM(self.read_places, at)) if self.read_places is not None else -1
            if not kk < self.n_read:
                raise IndexError(f"place {kk} of {self.n_read} fields read")
            old = None
            if kk >= 0:  # the read's field (its hash known) and value
                self.fields.append(<object>PyList_GET_ITEM(self.read_fields, kk))
                old = <object>PyList_GET_ITEM(self.read_values, kk)
            else:
                self.fields.append(_group_name(j))
            if self.written:
                got = PyDict_GetItemWithError(self.groups, <object>PyList_GET_ITEM(self.fields, k))
                if got != NULL:  # written since: kept where it was (in `groups`, before the read's value)
                    old = <object>got
                    kk = -1
            self.taken.push_back(kk)
            if old is not None:
                _group_len(old)  # a whole number of records, else IndexCorrupt
                self.sizes.push_back(PyBytes_GET_SIZE(old))
            else:
                self.sizes.push_back(0)
            self.olds.push_back(<PyObject *>old)
            self.counts.push_back(0)
        self.counts[k] += 1
        op.slot, op.key, op.is_id, op.ts, op.seq = k, key, is_id, ts, seq
        self.appends.push_back(op)
        return 0

    cdef list finish(self, Py_ssize_t cap):
        """The groups changed, in the order first changed, their values made (each once)."""
        cdef Py_ssize_t m = PyList_GET_SIZE(self.fields), k, size, n, r
        cdef list values = PyList_New(m)
        cdef object value
        cdef _GroupAppend op
        cdef unsigned char *g
        for k in range(m):  # each group's bytes at most as long as it can get, the group before first
            value = PyBytes_FromStringAndSize(NULL, self.sizes[k] + self.counts[k] * GROUP_RECORD)
            if self.sizes[k]:
                memcpy(PyBytes_AS_STRING(value), PyBytes_AS_STRING(<object>self.olds[k]), self.sizes[k])
            _list_put(values, k, value)
        for op in self.appends:  # (sizes: each group's bytes written so far)
            g = <unsigned char *>PyBytes_AS_STRING(<object>PyList_GET_ITEM(values, op.slot))
            size = self.sizes[op.slot]
            if not op.is_id and size > 2 * cap * GROUP_RECORD:
                n = 0
                for r in range(size // GROUP_RECORD):
                    if _rec_is(g + r * GROUP_RECORD, op.key, False):
                        n += 1
                if n > 2 * cap:
                    size = _trim_records(g, size // GROUP_RECORD, op.key, cap) * GROUP_RECORD
            _store_be32(g + size, op.key)
            memcpy(g + size + 4, &op.ts, 8)
            _store_be64(g + size + 12, op.seq | (0x8000000000000000ULL if op.is_id else 0))
            self.sizes[op.slot] = size + GROUP_RECORD
        for k in range(m):  # shorter where a bucket was trimmed
            if self.sizes[k] != PyBytes_GET_SIZE(<object>PyList_GET_ITEM(values, k)):
                values[k] = PyBytes_FromStringAndSize(PyBytes_AS_STRING(<object>PyList_GET_ITEM(values, k)),
                                                      self.sizes[k])
        return values

    cdef object taken_array(self):
        """`taken` as `array("q")` (`slice_writes`' places)."""
        cdef c_array.array out = c_array.clone(_TAKEN_TEMPLATE, <Py_ssize_t>self.taken.size(), False)
        if self.taken.size():
            memcpy(out.data.as_voidptr, &self.taken[0], self.taken.size() * sizeof(int64_t))
        return out

    cdef list flat(self, Py_ssize_t cap):
        """`finish`, as the slice's `HSET` arguments: each group changed with its value, then `entries`."""
        cdef list values = self.finish(cap)
        cdef Py_ssize_t m = PyList_GET_SIZE(values), k, e = PyList_GET_SIZE(self.entries)
        cdef list out = PyList_New(2 * m + e)
        for k in range(m):
            _list_put(out, 2 * k, <object>PyList_GET_ITEM(self.fields, k))
            _list_put(out, 2 * k + 1, <object>PyList_GET_ITEM(values, k))
        for k in range(e):
            _list_put(out, 2 * m + k, <object>PyList_GET_ITEM(self.entries, k))
        return out


cdef tuple _round_into(dict groups, object read, list names, int bits, list rows, bint one_slice, double s,
                       double slice_length, Py_ssize_t cap):
    """A round's rows applied, as `apply_round` applies them, to the groups of a slice's read of `names` (`read`:
    its fields, each name's place among them, their values; or None) and `groups` (written since; in their place);
    both left as they are (`_SliceBuild`). With `one_slice`, only the rows whose event time is in slice `s`.
    Returns (the fields changed, in the order first changed; their values; the place of each one's field in the
    read, -1 for none)."""
    cdef object row
    cdef list places
    cdef uint64_t seq
    cdef double ts
    cdef Py_ssize_t a, n
    cdef Py_ssize_t most = 0
    for row in rows:
        most += len(row[2]) + 1
    cdef _SliceBuild build = _SliceBuild(groups, read, names, bits, most)
    for row in rows:  # what goes where, in order
        ts = row[1]
        if one_slice and floor(ts / slice_length) != s:
            continue
        seq = row[0]
        places = row[2] if type(row[2]) is list else list(row[2])
        n = len(places)
        for a in range(n):
            build.add(places[a], False, ts, seq)
        build.add(row[3], True, ts, seq)
    values = build.finish(cap)
    return build.fields, values, build.taken_array()


def group_slice_writes(dict groups, object read, list names, int bits, list rows, long long s, double slice_length,
                       Py_ssize_t cap, list pairs) -> tuple:
    """`filters.index.group_codec.slice_writes`, compiled: each group touched made once (`_round_into`)."""
    cdef list fields, values, flat
    cdef object taken
    fields, values, taken = _round_into(groups, read, names, bits, rows, True, <double>s, slice_length, cap)
    cdef Py_ssize_t k, a, n = len(pairs), m = len(fields), e = 0
    cdef object name
    if n % 2:
        raise ValueError("pairs of name and value expected")
    for a in range(0, n, 2):
        name = pairs[a]
        if type(name) is not bytes:
            raise TypeError("field names must be bytes")
        if PyBytes_GET_SIZE(name) > 0 and PyBytes_AS_STRING(name)[0] == 101:  # b"e": an entry
            e += 1
    flat = PyList_New(2 * (m + e))
    for k in range(m):
        _list_put(flat, 2 * k, <object>PyList_GET_ITEM(fields, k))
        _list_put(flat, 2 * k + 1, <object>PyList_GET_ITEM(values, k))
    k = 2 * m
    for a in range(0, n, 2):
        name = pairs[a]
        if PyBytes_GET_SIZE(name) > 0 and PyBytes_AS_STRING(name)[0] == 101:
            _list_put(flat, k, name)
            _list_put(flat, k + 1, pairs[a + 1])
            k += 2
    return flat, taken


def group_alone_groups(list ids, list tss, list blobs, list places_of, list id_places, tuple slices,
                       dict columns, dict writes, double hwm, double window, double slice_length, Py_ssize_t cap,
                       uint64_t seq, list names, dict sides, bint also=False) -> tuple:
    """`filters.index.group_codec.alone_groups` (which documents it), compiled: the compact layout's round
    (`alone_compact`) without its field-value pairs of buckets and ids, each entry's records put straight into
    its slice's groups (`_SliceBuild`), each group made once. A slice's writes (`writes[s]`) are sized for the
    round at once (the same items); its bucket values, made only where it keeps them whole, are kept by place
    until the round's end; with `also`, the dict of the groups changed made as they are made (their objects at
    hand), not after the round trip."""
    cdef Py_ssize_t count = len(ids), i, j, nf, n_id, most = 0, place, n_col
    cdef double ts, old_ts
    cdef bint live, prior, whole
    cdef object e, old, column, mine, p, v, side
    cdef PyObject *got
    cdef list places, latest, order, results = [], written = []
    cdef dict builds = {}, out = {}, state_of = {}
    cdef tuple state
    cdef _SliceBuild build
    cdef bytes id_bytes, rec, blob, value, name
    cdef char *rp
    cdef Py_ssize_t too_long = 2 * cap * 16
    cdef long long s, sl
    for i in range(count):
        most += len(<list>places_of[i]) + 1
    # Each slice's writes and column at hand, by its number in `slices` (not looked up an entry at a time).
    cdef Py_ssize_t n_sl = len(slices), k_sl, ei
    cdef list sl_writes = [writes[s] for s in slices], sl_columns = [columns.get(s) for s in slices]
    for i in range(count):
        e = id_places[i]
        ei = e
        live = False
        for k_sl in range(n_sl):
            got = PyDict_GetItemWithError(<dict>PyList_GET_ITEM(sl_writes, k_sl), e)
            if got != NULL:
                old = <object>got
            else:
                column = <object>PyList_GET_ITEM(sl_columns, k_sl)
                if column is None:
                    old = None
                elif 0 <= ei < PyList_GET_SIZE(<list>column):
                    old = <object>PyList_GET_ITEM(<list>column, ei)
                else:
                    old = (<list>column)[e]
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
        column = columns[sl]
        n_col = len(<list>column)
        places = places_of[i]
        nf = len(places)
        build = <_SliceBuild>builds.get(sl)
        if build is None:
            side = sides[sl]
            build = _SliceBuild(<dict>side[1], side[2], names, side[0], most)
            builds[sl] = build
            whole = side[3]
            # The slice's writes sized for the round at once (a dict grown an item at a time rehashes itself a
            # dozen times over a batch): the same items. Where they keep its bucket values whole, those of this
            # round are kept by place (`latest`) and written into it once each, at the end, in the order first
            # written (`order`); else only the ids go in.
            mine = _PyDict_NewPresized(len(<dict>writes[sl]) + (count - i) * (nf + 1 if whole else 1))
            PyDict_Update(mine, writes[sl])
            writes[sl] = mine
            for k_sl in range(n_sl):
                if slices[k_sl] == sl:
                    sl_writes[k_sl] = mine
            state = state_of[sl] = ([None] * n_col if whole else None, [], len(<dict>mine) > 0)
        else:
            mine = writes[sl]
            state = <tuple>state_of[sl]
        build.count += 1
        if state[0] is None:  # (bucket values not kept: its groups only)
            for j in range(nf):
                p = places[j]
                place = p
                if place < 0 or place >= n_col:
                    raise IndexError(f"field place {place} outside the {n_col} read")
                build.add(place, False, ts, seq)
        else:
            latest, order, prior = <list>state[0], <list>state[1], state[2]
            for j in range(nf):
                p = places[j]
                place = p
                if place < 0 or place >= n_col:
                    raise IndexError(f"field place {place} outside the {n_col} read")
                v = <object>PyList_GET_ITEM(latest, place)
                if v is None:
                    order.append(p)
                    got = PyDict_GetItemWithError(mine, p) if prior else NULL
                    v = <object>got if got != NULL else <object>PyList_GET_ITEM(column, place)
                if v is None:
                    v = rec
                else:
                    if len(<bytes>v) > too_long:
                        v = _trim16(<bytes>v, cap)
                    v = joined(<bytes>v, rec)
                latest[place] = v
                build.add(place, False, ts, seq)
        PyDict_SetItem(mine, e, rec)
        build.add(e, True, ts, seq)
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
        build.entries.append(name)
        build.entries.append(value)
        written.append((seq, sl, places))
        results.append(seq)
    for sl, side in state_of.items():
        if (<tuple>side)[0] is None:
            continue
        mine = writes[sl]
        latest = <list>(<tuple>side)[0]
        for p in <list>(<tuple>side)[1]:
            PyDict_SetItem(mine, p, <object>PyList_GET_ITEM(latest, <Py_ssize_t>p))
    cdef list flat
    cdef object changed
    cdef Py_ssize_t k, m
    for sl, side in builds.items():
        build = <_SliceBuild>side
        flat = build.flat(cap)
        changed = None
        if also:
            m = PyList_GET_SIZE(build.fields)
            changed = _PyDict_NewPresized(m)
            for k in range(m):
                PyDict_SetItem(changed, <object>PyList_GET_ITEM(flat, 2 * k), <object>PyList_GET_ITEM(flat, 2 * k + 1))
        out[sl] = (build.count, flat, build.taken_array(), changed)
    return results, out, written, hwm, seq


def group_keep_written(dict groups, object values, list flat, c_array.array taken, object also) -> None:
    """`filters.index.group_codec.keep_written`, compiled."""
    if (<object>taken).typecode != "q":
        raise TypeError("the places taken are an array('q')")
    cdef Py_ssize_t i, k, m = len(taken)
    cdef const long long *at = taken.data.as_longlongs
    cdef object field, value
    if len(flat) < 2 * m:
        raise ValueError("a field and value for each group taken")
    for i in range(m):
        field = <object>PyList_GET_ITEM(flat, 2 * i)
        value = <object>PyList_GET_ITEM(flat, 2 * i + 1)
        k = <Py_ssize_t>at[i]
        if k >= 0:
            (<list?>values)[k] = value
        else:
            PyDict_SetItem(groups, field, value)
        if also is not None:
            (<dict?>also)[field] = value


def group_pack_writes(str slice_key, list flat, Py_ssize_t per_command, long long entries,
                      unsigned long long ttl_ms) -> tuple:
    """`filters.index.group_codec.pack_writes`, compiled."""
    cdef Py_ssize_t n = len(flat), a, stop, k, key_len, size = 0
    cdef const char *key = PyUnicode_AsUTF8AndSize(slice_key, &key_len)
    cdef char buf[24]
    cdef Py_ssize_t d
    cdef object arg
    cdef _Out o
    if per_command < 2 or per_command % 2 or n % 2:
        raise ValueError("pairs of arguments, an even per_command >= 2 expected")
    for k in range(n):
        arg = <object>PyList_GET_ITEM(flat, k)
        if type(arg) is not bytes:
            raise TypeError("field names and values must be bytes")
        size += 5 + decimal_size(PyBytes_GET_SIZE(arg)) + PyBytes_GET_SIZE(arg)
    if entries < 0:
        d = _digits(buf + 1, <unsigned long long>(-entries)) + 1
        buf[0] = 45  # b"-"
    else:
        d = _digits(buf, <unsigned long long>entries)
    o.p = NULL
    o.size = o.commands = 0
    for _ in range(2):  # counted, then written
        a = 0
        while a < n:
            stop = min(n, a + per_command)
            _o_header(&o, 42, 2 + stop - a)
            _o_bulk(&o, "HSET", 4)
            _o_bulk(&o, key, key_len)
            if o.p != NULL:
                for k in range(a, stop):
                    arg = <object>PyList_GET_ITEM(flat, k)
                    _o_bulk(&o, PyBytes_AS_STRING(arg), PyBytes_GET_SIZE(arg))
            o.commands += 1
            a = stop
        _o_header(&o, 42, 4)
        _o_bulk(&o, "HINCRBY", 7)
        _o_bulk(&o, key, key_len)
        _o_bulk(&o, "n", 1)
        _o_bulk(&o, buf, d)
        _o_header(&o, 42, 3)
        _o_bulk(&o, "PEXPIRE", 7)
        _o_bulk(&o, key, key_len)
        _o_int(&o, ttl_ms)
        o.commands += 2
        if o.p == NULL:
            out = PyBytes_FromStringAndSize(NULL, o.size + size)
            o.p = PyBytes_AS_STRING(out)
            o.size = o.commands = 0
    if o.size != len(out):  # the two passes disagree: never send what was not written
        raise SystemError(f"group_pack_writes wrote {o.size} bytes of {len(out)}")
    return out, o.commands

# --- a rebuild's groups, each field made once (filters/index/redis_group.py, `GroupIndex._held_shares`) --------

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


def group_release(list lists) -> None:
    """`filters.index.group_codec.release`, compiled: each of `lists` that only `lists` holds emptied with its
    items fetched ahead (`nd_release_list`: a batch's ~20,000 values and names, whose references dropped one by
    one waited on memory each), and so each list in it that only it holds; then `lists` itself. A list held
    elsewhere too is left as it is."""
    cdef Py_ssize_t i, n = len(lists)
    cdef object items
    for i in range(n):
        items = <object>PyList_GET_ITEM(lists, i)
        if type(items) is list and nd_refcnt(<PyObject *>items) == 2:  # (`lists`' reference and this one)
            nd_release_list(<PyObject *>items, 1)
    del lists[:]
