# Cython's declarations for the children of metrics.py's series (an augmenting .pxd: metrics.py stays plain Python,
# and runs as such when not compiled). A request updates about twenty of them; as Python objects each update read
# and wrote its attributes through the generic lookup, and a histogram's bisect compared boxed floats.
import cython

cdef class _Value:
    cdef public double value

cdef class _Buckets:
    cdef public tuple bounds
    cdef public list counts
    cdef public double sum

    @cython.locals(low=cython.Py_ssize_t, high=cython.Py_ssize_t, middle=cython.Py_ssize_t, bound=cython.double)
    cpdef observe(self, double value)

# A request looks up about ten children by their labels: the children's dict typed, each lookup is a C call into it.
cdef class _Series:
    cdef public object kind, name, documentation, labelnames, buckets
    cdef public dict children
