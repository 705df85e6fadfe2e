# Cython's declarations for scheduler.py (an augmenting .pxd: scheduler.py stays plain Python, and runs as such when
# not compiled). The weighted sum of every scorer's scores, a C loop on doubles, where Python floats were unboxed
# and boxed again for each candidate and scorer.
import cython

@cython.locals(size=cython.Py_ssize_t, i=cython.Py_ssize_t, s=cython.double)
cpdef add_weighted(list totals, scores, double weight)
