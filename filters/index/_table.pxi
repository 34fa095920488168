# The memory index's compiled table (included by filters/_native.pyx): `PyTable` of filters/index/memory.py,
# with the engine's look up → verify → insert loop over a whole batch (`decide`, `decide_shared`).

# --- the table of the memory index ----------------------------------------------------------------------

cdef extern from "Python.h":
    int PyObject_IS_GC(object o)
    void PyObject_GC_UnTrack(void *o)


cdef extern from * nogil:
    """
    #if defined(__linux__)
    #include <sys/mman.h>
    #endif
    #define ND_HUGE ((size_t)2 << 20)
    /* Asks for 2 MiB pages under [p, p + n) (Linux, where transparent huge pages are on "madvise"); a hint. */
    static inline void nd_huge_pages(void *p, size_t n) {
    #if defined(__linux__) && defined(MADV_HUGEPAGE)
        madvise(p, n, MADV_HUGEPAGE);
    #else
        (void)p; (void)n;
    #endif
    }
    """
    size_t ND_HUGE
    void nd_huge_pages(void *p, size_t n)


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
    uint32_t nch  # code points of a short text's normalized form (the edit check), 0 for a longer text
    bint narrow  # the sketch's values fit 32 bits (a fingerprint's): stored as uint32, else uint64
    uint64_t *keys  # inside this allocation
    void *sketch  # inside this allocation, after the keys
    uint32_t *chars  # inside this allocation, after the sketch


cdef union BucketData:
    uint64_t one  # the seq of a bucket's only entry (most buckets: m-gram keys of unique texts rarely repeat)
    uint64_t *many  # seqs sorted by (event time, seq)


cdef struct Bucket:
    uint64_t key
    uint32_t n  # 0: an empty slot
    uint32_t alloc
    BucketData d


cdef struct IdSlot:  # a live entry's id by its hash: the entry's seq (0: an empty slot)
    Py_hash_t hash
    uint64_t seq


cdef struct Due:
    double ts
    uint64_t seq


cdef struct Hit:  # one candidate while counting: how many of the query's buckets hold it, and the first
    uint64_t seq
    uint32_t shared
    uint32_t first
    uint32_t stamp


cdef Bucket *new_slots(Py_ssize_t n, void **held) except NULL:
    """An array of `n` empty buckets; `held[0]` is what to free. One of 2 MiB or more lies on huge pages, where
    the system gives them: a full table is as large as the cache, its look-ups land anywhere in it, and with
    4 KiB pages each one also missed the TLB (and each page was a fault of its own as the table grew)."""
    cdef size_t size = n * sizeof(Bucket)
    cdef char *raw
    cdef Bucket *slots
    if size < 2 * ND_HUGE:
        raw = <char *>PyMem_Malloc(size)
        slots = <Bucket *>raw
    else:
        raw = <char *>PyMem_Malloc(size + ND_HUGE)
        slots = <Bucket *>((<size_t>raw + ND_HUGE - 1) & ~(ND_HUGE - 1))
        if raw:
            nd_huge_pages(slots, size)
    if not raw:
        raise MemoryError()
    memset(slots, 0, size)
    held[0] = raw
    return slots


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


cdef struct Heap:  # a binary min-heap of `Due`s: the expiry of entries, and of memos
    Due *items
    Py_ssize_t n
    Py_ssize_t cap


cdef int heap_push(Heap *h, double ts, uint64_t seq) except -1:
    cdef Due *grown
    cdef Due item, parent
    cdef Py_ssize_t pos, up
    if h.n == h.cap:
        grown = <Due *>PyMem_Realloc(h.items, h.cap * 2 * sizeof(Due))
        if not grown:
            raise MemoryError()
        h.items = grown
        h.cap *= 2
    item.ts = ts
    item.seq = seq
    pos = h.n
    h.n += 1
    while pos > 0:
        up = (pos - 1) // 2
        parent = h.items[up]
        if not due_before(item, parent):
            break
        h.items[pos] = parent
        pos = up
    h.items[pos] = item
    return 0


cdef Due heap_pop(Heap *h) noexcept:
    cdef Due top = h.items[0], last
    cdef Py_ssize_t pos = 0, child
    h.n -= 1
    if h.n == 0:
        return top
    last = h.items[h.n]
    while True:
        child = 2 * pos + 1
        if child >= h.n:
            break
        if child + 1 < h.n and due_before(h.items[child + 1], h.items[child]):
            child += 1
        if not due_before(h.items[child], last):
            break
        h.items[pos] = h.items[child]
        pos = child
    h.items[pos] = last
    return top


cdef struct Merged:  # one candidate of decide_shared: from the batch's own table (seq) or the shared index
    uint32_t shared
    double ts
    bint local
    uint64_t seq  # local: the entry's seq
    Py_ssize_t at  # shared: its place in the message's candidate list
    uint64_t first_key


from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_FORMAT, PyBuffer_Release, PyObject_GetBuffer


cdef bint native_u32(object arr, Py_buffer *view) except -1:
    """Acquires the buffer of `arr` when it is a C-contiguous, one-dimensional array of native uint32 (numpy's
    `uint32`, as every fingerprint's sketch): True, and the caller releases it. Else nothing is held (False):
    the caller takes its general path. A typed memoryview costs a few thousand instructions to set up, a
    buffer a few hundred (bench/client_cost.py)."""
    try:
        PyObject_GetBuffer(arr, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT)
    except (TypeError, ValueError, BufferError):
        return False
    if (view.ndim == 1 and view.itemsize == 4 and view.format != NULL and view.format[0] == c'I'
            and view.format[1] == 0):
        return True
    PyBuffer_Release(view)
    return False


cdef Py_ssize_t widen_sketch(object sketch, uint64_t **buf, Py_ssize_t *cap) except -1:
    """A stored entry's sketch (a uint32 or uint64 array) as uint64 values in `buf`; returns how many."""
    cdef const uint32_t[::1] narrow
    cdef const uint64_t[::1] wide
    cdef Py_buffer view
    cdef const uint32_t *values
    cdef Py_ssize_t n, j
    if native_u32(sketch, &view):
        try:
            n = view.len // 4
            if n >= cap[0]:
                regrow(<void **>buf, cap, n + 1, sizeof(uint64_t))
            values = <const uint32_t *>view.buf
            for j in range(n):
                buf[0][j] = values[j]
        finally:
            PyBuffer_Release(&view)
        return n
    n = len(sketch)
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
    an expiry heap on (event time, seq), and ids → seq. The same behaviour as `filters.index.memory.PyTable`.

    `lookup`, `insert` and `get` serve `MemoryIndex`'s Python API; `decide` runs the embedded engine's
    whole per-message loop (look up, verify by sketch, insert the unique) without a Python object per
    message but its verdict.
    """

    cdef readonly double window
    cdef readonly int bucket_cap
    cdef object make_entry
    cdef Bucket *slots
    cdef void *slots_held  # the allocation `slots` lies in (see `new_slots`)
    cdef uint64_t mask
    cdef Py_ssize_t used
    cdef CEntry **ents
    cdef uint64_t ebase
    cdef Py_ssize_t ecap
    cdef uint64_t seq
    cdef Py_ssize_t live
    cdef Heap due  # (event time, seq) of the entries
    # ids -> seq of the live entries: an open-addressing table of (hash, seq) whose key is the entry's own id. A
    # dict of them missed the cache three times a look-up (its index, its entry, the key's hash in the str); here
    # a look-up of an absent id (nearly every message's) reads one slot, and an id is compared only on equal hashes.
    cdef IdSlot *id_slots
    cdef uint64_t id_mask
    cdef Py_ssize_t id_used
    # Memos: id -> the verdict of a duplicate (a new reference in `memo_due`, whose seq is its address).
    cdef dict memos
    cdef Heap memo_due
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
    cdef uint32_t *pchars  # a message's short text (decide_shared, insert), and a stored entry's (decide_shared)
    cdef uint32_t *ochars
    cdef Py_ssize_t pchars_cap, ochars_cap

    def __cinit__(self, double window, int bucket_cap, make_entry):
        self.window = window
        self.bucket_cap = bucket_cap
        self.make_entry = make_entry
        self.mask = 1023
        self.slots = new_slots(self.mask + 1, &self.slots_held)
        self.ecap = 1024
        self.ents = <CEntry **>PyMem_Malloc(self.ecap * sizeof(CEntry *))
        self.ebase = 1
        self.due.cap = 1024
        self.due.items = <Due *>PyMem_Malloc(self.due.cap * sizeof(Due))
        self.memo_due.cap = 64
        self.memo_due.items = <Due *>PyMem_Malloc(self.memo_due.cap * sizeof(Due))
        self.hmask = 255
        self.hits = <Hit *>PyMem_Malloc((self.hmask + 1) * sizeof(Hit))
        self.ranked_cap = 256
        self.ranked = <Hit **>PyMem_Malloc(self.ranked_cap * sizeof(Hit *))
        self.found_cap = 64
        self.found = <Bucket **>PyMem_Malloc(self.found_cap * sizeof(Bucket *))
        self.probe_cap = self.other_cap = 256
        self.probe = <uint64_t *>PyMem_Malloc(self.probe_cap * sizeof(uint64_t))
        self.other = <uint64_t *>PyMem_Malloc(self.other_cap * sizeof(uint64_t))
        if (not self.slots or not self.ents or not self.due.items or not self.memo_due.items or not self.hits or not self.ranked
                or not self.found or not self.probe or not self.other):
            raise MemoryError()
        memset(self.ents, 0, self.ecap * sizeof(CEntry *))
        memset(self.hits, 0, (self.hmask + 1) * sizeof(Hit))
        self.id_mask = 1023
        self.id_slots = <IdSlot *>PyMem_Malloc((self.id_mask + 1) * sizeof(IdSlot))
        if not self.id_slots:
            raise MemoryError()
        memset(self.id_slots, 0, (self.id_mask + 1) * sizeof(IdSlot))
        self.memos = {}
        self.watermark = -float("inf")
        self.newest = -float("inf")

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self.slots:
            for i in range(<Py_ssize_t>self.mask + 1):
                if self.slots[i].n > 1:
                    PyMem_Free(self.slots[i].d.many)
            PyMem_Free(self.slots_held)
        if self.ents:
            for i in range(self.ecap):
                if self.ents[i]:
                    self._free_entry(self.ents[i])
            PyMem_Free(self.ents)
        if self.memo_due.items:
            for i in range(self.memo_due.n):
                Py_DECREF(<object><PyObject *><size_t>self.memo_due.items[i].seq)
        PyMem_Free(self.due.items); PyMem_Free(self.memo_due.items)
        PyMem_Free(self.hits); PyMem_Free(self.ranked); PyMem_Free(self.found)
        PyMem_Free(self.probe); PyMem_Free(self.other); PyMem_Free(self.qkeys); PyMem_Free(self.merged)
        PyMem_Free(self.pchars); PyMem_Free(self.ochars); PyMem_Free(self.id_slots)

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
        cdef void *old_held = self.slots_held
        cdef uint64_t mask = old_mask * 2 + 1
        cdef void *held
        cdef Bucket *slots = new_slots(mask + 1, &held)
        for i in range(old_mask + 1):
            if old[i].n:
                j = mix64(old[i].key) & mask
                while slots[j].n:
                    j = (j + 1) & mask
                slots[j] = old[i]
        self.slots = slots
        self.slots_held = held
        self.mask = mask
        PyMem_Free(old_held)
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

    # -- ids of the live entries ---------------------------------------------------------------------
    cdef uint64_t _id_seq(self, object id, Py_hash_t h) except? 0:
        """The seq of the live entry whose id equals `id` (of hash `h`), or 0 (as `by_id.get(id)` of a dict)."""
        cdef uint64_t i = <uint64_t>h & self.id_mask
        cdef IdSlot *slot
        cdef CEntry *e
        while True:
            slot = &self.id_slots[i]
            if slot.seq == 0:
                return 0
            if slot.hash == h:
                e = self._entry(slot.seq)
                if <PyObject *>id == e.id or id == <object>e.id:
                    return slot.seq
            i = (i + 1) & self.id_mask

    cdef int _id_add(self, Py_hash_t h, uint64_t seq) except -1:
        """Records a new live entry's id (absent before) by its hash."""
        cdef uint64_t i, j, mask
        cdef IdSlot *grown
        if (self.id_used + 1) * 2 > <Py_ssize_t>(self.id_mask + 1):
            mask = self.id_mask * 2 + 1
            grown = <IdSlot *>PyMem_Malloc((mask + 1) * sizeof(IdSlot))
            if not grown:
                raise MemoryError()
            memset(grown, 0, (mask + 1) * sizeof(IdSlot))
            for i in range(self.id_mask + 1):
                if self.id_slots[i].seq:
                    j = <uint64_t>self.id_slots[i].hash & mask
                    while grown[j].seq:
                        j = (j + 1) & mask
                    grown[j] = self.id_slots[i]
            PyMem_Free(self.id_slots)
            self.id_slots = grown
            self.id_mask = mask
        i = <uint64_t>h & self.id_mask
        while self.id_slots[i].seq:
            i = (i + 1) & self.id_mask
        self.id_slots[i].hash = h
        self.id_slots[i].seq = seq
        self.id_used += 1
        return 0

    cdef void _id_drop(self, Py_hash_t h, uint64_t seq) noexcept:
        """Forgets the id of the entry `seq` (of hash `h`), if recorded; later slots of its run move up (as
        `_drop_slot`)."""
        cdef uint64_t i = <uint64_t>h & self.id_mask, j, home
        while self.id_slots[i].seq != seq:
            if self.id_slots[i].seq == 0:
                return
            i = (i + 1) & self.id_mask
        self.id_used -= 1
        j = i
        while True:
            j = (j + 1) & self.id_mask
            if self.id_slots[j].seq == 0:
                break
            home = <uint64_t>self.id_slots[j].hash & self.id_mask
            if (j > i and (home <= i or home > j)) or (j < i and (home <= i and home > j)):
                self.id_slots[i] = self.id_slots[j]
                i = j
        self.id_slots[i].seq = 0

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
            if ((self.due.n and self.due.items[0].ts < ts - self.window)
                    or (self.memo_due.n and self.memo_due.items[0].ts < ts - self.window)):
                self._expire(ts)
        return 0

    cdef Py_ssize_t _expire(self, double now) except -1:
        cdef double horizon = now - self.window
        cdef Py_ssize_t gone = 0, j, at
        cdef uint32_t k
        cdef Due due
        cdef CEntry *e
        cdef Bucket *b
        cdef uint64_t *seqs
        cdef object memo
        while self.memo_due.n and self.memo_due.items[0].ts < horizon:
            memo = <object><PyObject *><size_t>heap_pop(&self.memo_due).seq
            Py_DECREF(memo)  # the heap's reference (`memo` holds its own)
            if self.memos.get(memo.id) is memo:  # else another replaced it
                del self.memos[memo.id]
        while self.due.n and self.due.items[0].ts < horizon:
            due = heap_pop(&self.due)
            e = self._entry(due.seq)
            if e == NULL:
                continue
            self.ents[due.seq - self.ebase] = NULL
            self.live -= 1
            gone += 1
            self._id_drop(PyObject_Hash(<object>e.id), e.seq)
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

    # -- memos -------------------------------------------------------------------------------------
    cdef int _remember(self, object id, object verdict, double ts) except -1:
        """`PyTable.remember` of `verdict` (whose id is `id`): 1 when remembered, 0 when outside the window
        or an equal one is held."""
        self._advance(ts)
        if ts < self.watermark - self.window:
            return 0
        held = self.memos.get(id)
        if held is not None and held == verdict:
            return 0
        heap_push(&self.memo_due, ts, <uint64_t><size_t><PyObject *>verdict)
        Py_INCREF(verdict)
        self.memos[id] = verdict
        if PyObject_IS_GC(verdict):
            # A verdict holds strings and numbers only, so it can be in no reference cycle: the collector
            # need not walk the window's memos (held for as long as the window, they would reach its
            # oldest generation, and every full collection would walk them all).
            PyObject_GC_UnTrack(<PyObject *>verdict)
        return 1

    def remember(self, verdict, double ts) -> bool:
        """Remembers a duplicate's verdict by its id, at its message's event time (`PyTable.remember`)."""
        return bool(self._remember(verdict.id, verdict, ts))

    def recall(self, id):
        """The verdict remembered for `id`, if still inside the window (`PyTable.recall`)."""
        return self.memos.get(id)

    # -- insert ------------------------------------------------------------------------------------
    cdef int _insert(self, object id, double ts, uint64_t exact_lo, uint64_t exact_hi, int64_t size,
                     const uint64_t *sketch, Py_ssize_t nsk, const uint64_t *keys, Py_ssize_t nkeys,
                     const uint32_t *chars, Py_ssize_t nch, object payload, bint absent=False) except -1:
        """`MemoryIndex.insert_one`: nothing when the id is live or the event time already left the window.
        `absent`: the caller found the id not live (`decide`): it is not looked up twice."""
        cdef Py_hash_t h = PyObject_Hash(id)
        if not absent and self._id_seq(id, h):
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
                                                + nsk * (sizeof(uint32_t) if narrow else sizeof(uint64_t))
                                                + nch * sizeof(uint32_t))
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
        e.nch = <uint32_t>nch
        e.narrow = narrow
        e.keys = <uint64_t *>(<char *>e + sizeof(CEntry))
        e.sketch = <void *>(e.keys + nkeys)
        e.chars = <uint32_t *>(<char *>e.sketch + nsk * (sizeof(uint32_t) if narrow else sizeof(uint64_t)))
        if nch:
            memcpy(e.chars, chars, nch * sizeof(uint32_t))
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
        self._id_add(h, e.seq)
        heap_push(&self.due, ts, e.seq)
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
        np = np_()
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
        cdef Py_ssize_t nch = code_points_of(entry.chars, &self.pchars, &self.pchars_cap)
        return bool(self._insert(entry.id, entry.ts, exact & 0xFFFFFFFFFFFFFFFF, exact >> 64, entry.size,
                                 self.other, nsk, self.probe, nkeys, self.pchars, nch, entry))

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
        # (the loop's state in locals: stores through `hit` would make the compiler reload the table's fields)
        cdef Hit *hits = self.hits
        cdef Hit **ranked = self.ranked
        cdef uint64_t hmask = self.hmask
        cdef uint32_t stamp = self.stamp
        for k in range(nkeys):
            b = self.found[k]
            if b == NULL:
                continue
            seqs = self._members(b)
            for j in range(b.n):
                s = seqs[j]
                # Seqs are handed out in order: their low bits spread them over the map as they are (no mixing).
                h = s & hmask
                while True:
                    hit = &hits[h]
                    if hit.stamp != stamp:
                        hit.stamp = stamp
                        hit.seq = s
                        hit.shared = 1
                        hit.first = <uint32_t>k
                        distinct += 1
                        if s != own:
                            ranked[n_ranked] = hit
                            n_ranked += 1
                        break
                    if hit.seq == s:
                        hit.shared += 1
                        break
                    h = (h + 1) & hmask
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
        cdef uint64_t own_seq = self._id_seq(id, PyObject_Hash(id))
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
        np = np_()
        sketch = np.empty(e.nsk, dtype=np.uint32)
        cdef uint32_t[::1] view = sketch
        cdef uint32_t i
        for i in range(e.nsk):
            view[i] = (<uint32_t *>e.sketch)[i] if e.narrow else <uint32_t>(<uint64_t *>e.sketch)[i]
        chars = PyUnicode_FromKindAndData(PyUnicode_4BYTE_KIND, e.chars, e.nch) if e.nch else ""
        return self.make_entry(<object>e.id, e.ts, (<object>e.exact_hi) << 64 | e.exact_lo, e.size, sketch, chars)

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
                "evicted_by_cap": self.evicted_by_cap, "memos": len(self.memos)}

    # -- the embedded engine's loop -----------------------------------------------------------------
    def decide(self, list ids, list tss, Shingled batch, cfg, tuple method_names, verdict) -> list:
        """`NearDupFilter._decide_local` for every message of a hashed batch, in order: the verdicts,
        made by calling `verdict(id, duplicate, duplicate_of, similarity, method)`. Verification is by
        sketch (`verify="sketch"`) and the edit rule, exactly as `NearDupFilter._sketch_match` with the
        parameters of `cfg` (a `FilterConfig`)."""
        cdef Py_ssize_t i, nkeys, floor, n, c, j, nsk, nch
        cdef double ts, sim
        cdef const uint64_t *keys
        cdef const uint32_t *chars
        cdef CEntry *e
        cdef int64_t size_a
        cdef bint matched
        cdef Estimates est
        cdef Rules rules = rules_of(cfg)
        cdef double min_shared = rules.min_shared
        cdef Py_ssize_t limit = rules.limit
        if len(ids) != batch.n or len(tss) != batch.n:
            raise ValueError("ids, event times and the hashed batch differ in length")
        out = []
        for i in range(batch.n):
            id = ids[i]
            ts = tss[i]
            self._advance(ts)
            if self._id_seq(id, PyObject_Hash(id)):
                out.append(verdict(id, False, None, 0.0, "replay"))
                continue
            memo = self.memos.get(id)
            if memo is not None:
                out.append(memo)
                continue
            keys = batch.keys + batch.key_start[i]
            nkeys = batch.key_start[i + 1] - batch.key_start[i]
            floor = <Py_ssize_t>ceil(min_shared * nkeys)
            if floor < 1:
                floor = 1
            n = self._gather(keys, nkeys, floor, ts, limit, 0)
            nsk = batch.sk_start[i + 1] - batch.sk_start[i]
            size_a = batch.size[i]
            chars = batch.chars + batch.ch_start[i]
            nch = batch.ch_start[i + 1] - batch.ch_start[i]
            matched = False
            if nsk > self.probe_cap:
                self._grow_scratch(&self.probe, &self.probe_cap, nsk)
            for j in range(nsk):
                self.probe[j] = batch.sketch[batch.sk_start[i] + j]
            for c in range(n):
                e = self._entry(self.ranked[c].seq)
                if e.exact_lo == batch.exact_lo[i] and e.exact_hi == batch.exact_hi[i]:
                    memo = verdict(id, True, <object>e.id, 1.0, "exact")
                    matched = True
                    break
                if e.narrow:  # (as a fingerprint's: compared as stored, 32 bits each)
                    est = estimates(batch.sketch + batch.sk_start[i], nsk, size_a, <uint32_t *>e.sketch, e.nsk, e.size)
                else:
                    est = estimates(<const uint64_t *>self.probe, nsk, size_a, self._wide(e), e.nsk, e.size)
                sim = similarity(est, size_a, e.size, &rules, chars, nch, e.chars, e.nch)
                if sim >= 0.0:
                    memo = verdict(id, True, <object>e.id, py_round(sim, 4),
                                   method_names[keys[self.ranked[c].first] >> 60])
                    matched = True
                    break
            if matched:
                self._remember(id, memo, ts)
                out.append(memo)
            else:
                self._insert(id, ts, batch.exact_lo[i], batch.exact_hi[i], size_a, self.probe, nsk, keys, nkeys,
                             chars, nch, None, True)
                out.append(made_of(verdict, 5, id, False, None, 0.0, None))
        return out

    def decide_shared(self, list ids, list tss, list fps, list looked, cfg, tuple method_names, verdict) -> tuple:
        """`filters.index.shared.against`'s loop on this (fresh, batch-local) table, for a batch whose
        shared-index lookup gave `looked` (per message: its stored entry, its memo (a `Verdict`) or None,
        and its ranked `Candidate`s): replays, memos (the shared index's, or of the batch's earlier
        duplicates, remembered here), the batch's own earlier messages merged with the shared candidates
        (most shared keys first, then newest; the batch's first on ties), verification by sketch exactly
        as `NearDupFilter._first_match` with the parameters of `cfg` (a `FilterConfig`), and the unique ones
        inserted here. Returns (the verdicts, made by `verdict(id, duplicate, duplicate_of, similarity,
        method)`, the places of the unique, and the places of the duplicates decided here)."""
        cdef Py_ssize_t count = len(ids), i, j, c, nkeys, floor, n_local, n_remote, n, nsk, nsk_b, pos, nch, nch_b
        cdef double ts, sim
        cdef int64_t size_a, size_b
        cdef uint64_t lo, hi
        cdef const uint32_t[::1] sk
        cdef Py_buffer view
        cdef const uint32_t *values
        cdef Estimates est
        cdef CEntry *e
        cdef Merged item
        cdef bint matched
        cdef const uint64_t *other
        cdef const uint32_t *chars_b
        cdef list cands
        cdef object memo_type = verdict.cls if type(verdict) is Frozen else verdict  # what a memo is
        cdef Rules rules = rules_of(cfg)
        cdef double min_shared = rules.min_shared
        cdef Py_ssize_t limit = rules.limit
        if len(tss) != count or len(fps) != count or len(looked) != count:
            raise ValueError("ids, event times, fingerprints and lookups differ in length")
        out = []
        unique = []
        remembered = []
        for i in range(count):
            id = ids[i]
            ts = tss[i]
            self._advance(ts)
            own, cands = looked[i]
            if (own is not None and type(own) is not memo_type) or self._id_seq(id, PyObject_Hash(id)):
                out.append(verdict(id, False, None, 0.0, "replay"))
                continue
            memo = own if own is not None else self.memos.get(id)
            if memo is not None:
                out.append(memo)
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
            sketch = fp.sketch
            if native_u32(sketch, &view):
                try:
                    nsk = view.len // 4
                    if nsk > self.probe_cap:
                        self._grow_scratch(&self.probe, &self.probe_cap, nsk)
                    values = <const uint32_t *>view.buf
                    for j in range(nsk):
                        self.probe[j] = values[j]
                finally:
                    PyBuffer_Release(&view)
            else:
                sk = sketch
                nsk = sk.shape[0]
                if nsk > self.probe_cap:
                    self._grow_scratch(&self.probe, &self.probe_cap, nsk)
                for j in range(nsk):
                    self.probe[j] = sk[j]
            nch = code_points_of(fp.chars, &self.pchars, &self.pchars_cap)
            matched = False
            for c in range(n):
                item = self.merged[c]
                if item.local:
                    e = self._entry(item.seq)
                    if e.exact_lo == lo and e.exact_hi == hi:
                        memo = verdict(id, True, <object>e.id, 1.0, "exact")
                        matched = True
                        break
                    other = self._wide(e)
                    nsk_b = e.nsk
                    size_b = e.size
                    chars_b = e.chars
                    nch_b = e.nch
                    match_id = <object>e.id
                else:
                    entry = (<object>cands[item.at]).entry
                    if entry.exact == exact:
                        memo = verdict(id, True, entry.id, 1.0, "exact")
                        matched = True
                        break
                    if <Py_ssize_t>item.shared < floor:
                        continue
                    nsk_b = widen_sketch(entry.sketch, &self.other, &self.other_cap)
                    other = self.other
                    size_b = entry.size
                    nch_b = code_points_of(entry.chars, &self.ochars, &self.ochars_cap) if nch else 0
                    chars_b = self.ochars
                    match_id = entry.id
                sim = similarity(estimates(<const uint64_t *>self.probe, nsk, size_a, other, nsk_b, size_b), size_a, size_b,
                                 &rules, self.pchars, nch, chars_b, nch_b)
                if sim >= 0.0:
                    memo = verdict(id, True, match_id, py_round(sim, 4), method_names[item.first_key >> 60])
                    matched = True
                    break
            if matched:
                self._remember(id, memo, ts)
                out.append(memo)
                remembered.append(i)
            else:
                self._insert(id, ts, lo, hi, size_a, self.probe, nsk, self.qkeys, nkeys, self.pchars, nch, None)
                out.append(made_of(verdict, 5, id, False, None, 0.0, None))
                unique.append(i)
        return out, unique, remembered

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

