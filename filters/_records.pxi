# Records made without their generated __init__ (included by filters/_native.pyx): `Frozen`, which
# filters/records.py `maker` picks when the compiled core was built.

# --- records made without their generated __init__ ---------------------------------------------------

cdef extern from "Python.h":
    ctypedef struct PyMemberDef:
        int type
        Py_ssize_t offset
    ctypedef struct PyMemberDescrObject:
        PyMemberDef *d_member
    ctypedef struct PyTypeObject:
        PyObject *(*tp_alloc)(PyTypeObject *, Py_ssize_t)
    int T_OBJECT_EX

cdef enum:
    FROZEN_MAX_FIELDS = 16


cdef class Frozen:
    """Makes instances of a frozen, slotted dataclass from all its field values, in field order: what
    `cls(*values)` makes. The generated `__init__` of a frozen dataclass sets each field through a
    Python-level `object.__setattr__` call (≈ 0.15 µs a field); here the instance is allocated as
    `object.__new__` allocates it and each value stored in its slot, where the slot's own descriptor
    (`cls.__dict__[name]`, a member of type T_OBJECT_EX) says, as its `__set__` would store it (past the
    class's refusing `__setattr__`, as `object.__setattr__`). Only for classes where that is all
    `__init__` does: no `__post_init__`, no `__new__` of their own, every field an init slot."""

    cdef readonly object cls
    cdef tuple names
    cdef Py_ssize_t n
    cdef Py_ssize_t offsets[FROZEN_MAX_FIELDS]

    def __init__(self, cls):
        import dataclasses
        import types

        params = getattr(cls, "__dataclass_params__", None)
        names = tuple(f.name for f in dataclasses.fields(cls)) if params is not None else ()
        if (params is None or not params.frozen or cls.__dict__.get("__slots__") != names
                or hasattr(cls, "__post_init__") or cls.__new__ is not object.__new__
                or tuple(inspect.signature(cls.__init__).parameters)[1:] != names):
            raise TypeError(f"{cls!r} is not a frozen, slotted dataclass whose __init__ only sets its fields")
        if len(names) > FROZEN_MAX_FIELDS:
            raise TypeError(f"{cls!r} has more than {FROZEN_MAX_FIELDS} fields")
        cdef Py_ssize_t i
        for i, name in enumerate(names):
            slot = cls.__dict__[name]
            if type(slot) is not types.MemberDescriptorType or \
                    (<PyMemberDescrObject *>slot).d_member.type != T_OBJECT_EX:
                raise TypeError(f"{cls!r}.{name} is not a slot")
            self.offsets[i] = (<PyMemberDescrObject *>slot).d_member.offset
        self.cls = cls
        self.n = len(names)
        self.names = tuple(sys_intern(name) for name in names)

    def __call__(self, *values):
        cdef Py_ssize_t i
        if len(values) != self.n:
            raise TypeError(f"{self.cls.__name__} takes {self.n} values, got {len(values)}")
        cdef PyObject *held[FROZEN_MAX_FIELDS]
        for i in range(self.n):
            held[i] = <PyObject *>values[i]
        return self._made(held)

    cdef object _made(self, PyObject **values):
        """The instance of `n` values (borrowed: each gets a reference of its own)."""
        cdef Py_ssize_t i
        cdef PyObject *obj = (<PyTypeObject *>self.cls).tp_alloc(<PyTypeObject *>self.cls, 0)  # as object.__new__
        if obj == NULL:
            raise MemoryError()
        for i in range(self.n):  # fresh slots hold NULL: nothing to release
            Py_INCREF(<object>values[i])
            (<PyObject **>(<char *>obj + self.offsets[i]))[0] = values[i]
        made = <object>obj  # a second reference: the one tp_alloc gave is released
        Py_DECREF(made)
        return made


cdef inline object made_of(maker, int n, object a, object b, object c, object d, object e):
    """`maker(a, b, ...)` of the first `n` values (those after them are not used): straight into the instance when `maker` is a `Frozen` of that
    many fields (the compiled loops' records: no call through Python, no tuple of arguments), else called."""
    cdef PyObject *held[5]
    if type(maker) is Frozen and (<Frozen>maker).n == n:
        held[0] = <PyObject *>a; held[1] = <PyObject *>b; held[2] = <PyObject *>c
        held[3] = <PyObject *>d; held[4] = <PyObject *>e
        return (<Frozen>maker)._made(held)
    return maker(*(a, b, c, d, e)[:n])


# --- the common JSON line, decoded without a Python step per field ------------------------------------

cdef extern from "Python.h":
    bint Py_UNICODE_ISSPACE(uint32_t ch) nogil
    uint32_t PyUnicode_READ(int kind, void *data, Py_ssize_t index) nogil
    PyObject *PyDict_GetItemWithError(object d, object key) except? NULL
    long long PyLong_AsLongLongAndOverflow(object o, int *overflow) except? -1
    double PyFloat_AS_DOUBLE(object o)


cdef inline bint blank(str text) noexcept:
    """`not text or text.isspace()`: empty, or white space only (as str.isspace judges each character)."""
    cdef Py_ssize_t i, n = len(text)
    cdef int kind = PyUnicode_KIND(text)
    cdef void *data = PyUnicode_DATA(text)
    for i in range(n):
        if not Py_UNICODE_ISSPACE(PyUnicode_READ(kind, data, i)):
            return False
    return True


def decode_common(list raws, loads, error, str text_field, str id_field, str ts_field, Py_ssize_t limit,
                  double max_ts, new_message, new_decoded) -> tuple:
    """`filters.records.decode_common`, the Python reference, computed here: per raw record (`.value`,
    `.fallback_id`, `.fallback_ts`) the `Decoded` of a common JSON line (`loads` of it a dict with a non-blank
    string text, a non-empty string id or none, a number of seconds from 0 to `max_ts` or none; `error`:
    what `loads` raises on invalid JSON), else None; and the places of the Nones, in order."""
    cdef Py_ssize_t i, n = len(raws)
    cdef PyObject *got
    cdef int overflow
    cdef long long whole
    cdef double seconds
    cdef bint valid
    cdef list out = PyList_New(n)
    cdef list left = []
    cdef object value, record, text, id, ts, made, message
    for i in range(n):
        raw = raws[i]
        made = None
        value = raw.value
        if len(value) <= limit:
            try:
                record = loads(value)
            except error:
                record = None
            if type(record) is dict:
                got = PyDict_GetItemWithError(record, text_field)
                text = <object>got if got != NULL else None
                got = PyDict_GetItemWithError(record, id_field)
                id = <object>got if got != NULL else None
                got = PyDict_GetItemWithError(record, ts_field)
                ts = <object>got if got != NULL else None
                if type(text) is str and not blank(<str>text) and (
                        id is None or (type(id) is str and len(<str>id) > 0)):
                    valid = True
                    if ts is None:
                        ts = raw.fallback_ts
                    elif type(ts) is float:
                        seconds = PyFloat_AS_DOUBLE(ts)
                        valid = 0.0 <= seconds <= max_ts  # NaN fails both
                    elif type(ts) is int:
                        whole = PyLong_AsLongLongAndOverflow(ts, &overflow)
                        # (the bound is below 2**53: its comparison with `whole`, and float(whole), are exact)
                        valid = overflow == 0 and 0 <= whole and <double>whole <= max_ts
                        if valid:
                            ts = float(whole)
                    else:
                        valid = False
                    if valid:
                        message = made_of(new_message, 3, raw.fallback_id if id is None else id, text, ts, None, None)
                        made = made_of(new_decoded, 2, message, record, None, None, None)
        if made is None:
            left.append(i)
        Py_INCREF(made)
        PyList_SET_ITEM(out, i, made)
    return out, left
