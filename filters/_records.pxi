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
        cdef PyObject *obj
        cdef object value
        if len(values) != self.n:
            raise TypeError(f"{self.cls.__name__} takes {self.n} values, got {len(values)}")
        obj = (<PyTypeObject *>self.cls).tp_alloc(<PyTypeObject *>self.cls, 0)  # what object.__new__ calls
        if obj == NULL:
            raise MemoryError()
        for i in range(self.n):  # fresh slots hold NULL: nothing to release
            value = values[i]
            Py_INCREF(value)
            (<PyObject **>(<char *>obj + self.offsets[i]))[0] = <PyObject *>value
        made = <object>obj  # a second reference: the one tp_alloc gave is released
        Py_DECREF(made)
        return made
