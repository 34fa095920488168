# Records made without their generated __init__ (included by filters/_native.pyx): `Frozen`, which
# filters/records.py `maker` picks when the compiled core was built.

# --- records made without their generated __init__ ---------------------------------------------------

cdef extern from "Python.h":
    int PyObject_GenericSetAttr(object o, object name, object value) except -1

cdef object object_new = object.__new__


cdef class Frozen:
    """Makes instances of a frozen, slotted dataclass from all its field values, in field order: what
    `cls(*values)` makes. The generated `__init__` of a frozen dataclass sets each field through a
    Python-level `object.__setattr__` call (≈ 0.15 µs a field); here each is one generic set, which
    like `object.__setattr__` goes past the class's refusing `__setattr__`. Only for classes where that
    is all `__init__` does: no `__post_init__`, no `__new__` of their own, every field an init slot."""

    cdef readonly object cls
    cdef tuple names

    def __init__(self, cls):
        import dataclasses

        params = getattr(cls, "__dataclass_params__", None)
        names = tuple(f.name for f in dataclasses.fields(cls)) if params is not None else ()
        if (params is None or not params.frozen or cls.__dict__.get("__slots__") != names
                or hasattr(cls, "__post_init__") or cls.__new__ is not object.__new__
                or tuple(inspect.signature(cls.__init__).parameters)[1:] != names):
            raise TypeError(f"{cls!r} is not a frozen, slotted dataclass whose __init__ only sets its fields")
        self.cls = cls
        self.names = tuple(sys_intern(name) for name in names)

    def __call__(self, *values):
        cdef Py_ssize_t i, n = len(self.names)
        cdef object obj
        if len(values) != n:
            raise TypeError(f"{self.cls.__name__} takes {n} values, got {len(values)}")
        obj = object_new(self.cls)
        for i in range(n):
            PyObject_GenericSetAttr(obj, self.names[i], values[i])
        return obj

