# Cython's declarations for load.py (an augmenting .pxd: load.py stays plain Python, and runs as such when not
# compiled). The estimates read five fields of every candidate each cycle: typed, the endpoint's are C fields.
import cython
from epp.datalayer.endpoint cimport Endpoint

@cython.locals(in_flight=cython.Py_ssize_t, finished=cython.Py_ssize_t)
cpdef queue_depth(Endpoint endpoint)

@cython.locals(e=Endpoint, in_flight=cython.Py_ssize_t, finished=cython.Py_ssize_t)
cpdef list queue_depths(cycle_state, endpoints)

cpdef running_requests(Endpoint endpoint)
