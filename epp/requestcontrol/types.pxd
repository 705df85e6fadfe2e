# Cython's declarations for types.py's classes (an augmenting .pxd: types.py stays plain Python, and runs as such when
# not compiled). RequestContext: the director reads and writes some thirty of its fields per request, as C fields
# where the director's methods take it typed (director.pxd).
cdef class RequestContext:
    cdef public object headers, subset, model, target_model, labels, request, result, endpoint, served, status
    cdef public object response_tail
    cdef public Py_ssize_t in_flight_tokens
    cdef public double routed_at, first_chunk_at, scheduling_seconds, metrics_age
    cdef public bint dispatched, streamed

# A Cython dataclass (see epp/scheduling/types.pxd): its __init__ compiled.
cdef class RoutingDecision:
    cdef public object request_id, endpoints, body, body_changed
