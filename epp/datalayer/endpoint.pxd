# Cython's declarations for endpoint.py's Endpoint (an augmenting .pxd: endpoint.py stays plain Python, and runs as
# such when not compiled). Every scheduling cycle reads a dozen of each candidate's fields: where a function takes an
# endpoint typed (load.pxd), each read is a C field, not a lookup by name.
cdef class Endpoint:
    cdef public object spec, metrics, batch_slots, inter_token_totals, recent_adapters
    cdef public bint stale
    cdef public Py_ssize_t in_flight_requests, in_flight_tokens, routed_total, in_flight_at_scrape
    cdef public double recent_ttft
