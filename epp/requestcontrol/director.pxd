# Cython's declarations for director.py's Director (an augmenting .pxd: director.py stays plain Python, and runs as
# such when not compiled). Its fields as C fields, its own calls as C calls, and the request's context typed
# (types.pxd), so that a request's trip through it reads no attribute through the generic lookup. The methods the
# handler calls stay Python-callable (cpdef); a None context raises AttributeError (setup.py turns nonecheck on).
from epp.requestcontrol.types cimport RequestContext

cdef class Director:
    cdef public object datastore, scheduler, metrics, flow_control, _order
    cdef public dict awaiting_records, early_records
    cdef public list prefilling
    cdef public bint access_log_seen, response_headers_seen
    cdef public Py_ssize_t untimed_responses
    cdef public double untimed_since

    cpdef route(self, RequestContext ctx, payload, raw)
    cdef _failed(self, RequestContext ctx, error)
    cpdef record_error(self, RequestContext ctx, error)
    cdef tuple _resolve_model(self, RequestContext ctx, payload, raw)
    cdef _scheduling_request(self, RequestContext ctx, payload)
    cdef _schedule(self, RequestContext ctx, request, body, body_changed, bint waited=*)
    cdef _decide(self, RequestContext ctx, request, body, body_changed, cycle_state, bint waited)
    cdef _observe_decision(self, RequestContext ctx)
    cpdef after_routed(self, RequestContext ctx)
    cpdef on_response_headers(self, RequestContext ctx, status, served)
    cdef _release_prefilled(self, double now)
    cpdef bint rewrites_response(self, RequestContext ctx) except -1
    cpdef on_complete(self, RequestContext ctx)
    cdef _settle(self, RequestContext ctx, endpoint, double ended, output_tokens, ttft, status, served)
    cpdef on_access_log(self, request_id, ttft, status, served)
    cdef _timed(self, request, result, endpoint, ttft, tpot)
    cdef _untimed(self, double now)
