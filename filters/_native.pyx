# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# distutils: language = c++
"""The compiled hot path: n-gram sketches, m-gram samples, the exact hash, the memory index's table with its
look up → verify → insert loop, and the Redis index client's per-message work.

One extension module; its source is split by concern into the files it includes, each beside the
numpy/Python reference it computes bit for bit: `filters/_shingles.pxi` (`filters/shingles.py`),
`filters/_edits.pxi` (`filters/edits.py`), `filters/_sketch.pxi` (`filters/sketch.py`, the engine's sketch
verification), `filters/index/_table.pxi` (`PyTable` in `filters/index/memory.py`),
`filters/index/_redis_codec.pxi` (`filters/index/redis_codec.py`), `filters/index/_compact_codec.pxi`
(`filters/index/compact_codec.py`), `filters/index/_group_codec.pxi` (`filters/index/group_codec.py`), `filters/_records.pxi` (`filters/records.py`)
and `filters/_normalize.pxi` (`filters/normalize.py`, the stages of
`Normalizer.normalize_batch`). `tests/test_native.py` proves it on the development
stream and with hypothesis. The reference stays the specification and the fallback where no compiler
was available at install time.

Why compiled: per short message the reference spends ≈ 30 µs in Python bookkeeping (a `Fingerprint`, a
`Counter`, `Candidate` and `Entry` records, dict probes); the work itself is ≈ 2 µs of hashing and a
few hundred memory reads. Memory comes from `PyMem_Malloc`, so tracemalloc (bench/filter_bench.py) sees it.
"""

from cpython.bytearray cimport PyByteArray_AS_STRING
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.object cimport PyObject_Hash
from cpython.ref cimport Py_DECREF, Py_INCREF, PyObject
from libc.math cimport ceil, floor, rint
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memmove, memset
from libcpp.algorithm cimport sort as cpp_sort
from libcpp.pair cimport pair
from libcpp.vector cimport vector

import builtins
import inspect
from sys import intern as sys_intern

py_round = builtins.round  # verdicts carry Python's round(similarity, 4), digit for digit
cdef frozenset NO_SENTENCES = frozenset()

# numpy is imported when first used (arrays of sketches, the Redis codec): `neardup filter` on the memory index
# never uses it, and importing it is a third of that command's start-up.
cdef object _numpy = None


cdef object np_():
    global _numpy
    if _numpy is None:
        import numpy
        _numpy = numpy
    return _numpy

cdef extern from "Python.h":
    const char *PyUnicode_AsUTF8AndSize(object unicode, Py_ssize_t *size) except NULL
    object PyTuple_New(Py_ssize_t n)
    void PyTuple_SET_ITEM(object p, Py_ssize_t pos, object o)
    object PyLong_FromUnsignedLongLong(unsigned long long v)

    object PyBytes_FromStringAndSize(const char *v, Py_ssize_t len)
    char *PyBytes_AS_STRING(object o)
    object PyList_New(Py_ssize_t n)
    void PyList_SET_ITEM(object p, Py_ssize_t pos, object o)
    object PyUnicode_FromKindAndData(int kind, const void *buffer, Py_ssize_t size)
    int PyUnicode_1BYTE_KIND
    int PyUnicode_2BYTE_KIND
    int PyUnicode_4BYTE_KIND
    int PyUnicode_KIND(object o)
    void *PyUnicode_DATA(object o)
    bint PyUnicode_IS_ASCII(object o)
    bint PyExceptionInstance_Check(object o)


# One extension module, its source split by concern, each part beside the Python reference it is held to.
# `_records.pxi` first: the loops of the others make their records with it.
include "_records.pxi"
include "_shingles.pxi"
include "_edits.pxi"
include "_sketch.pxi"
include "index/_table.pxi"
include "index/_redis_codec.pxi"
include "index/_compact_codec.pxi"
include "index/_group_codec.pxi"
include "_normalize.pxi"
