# Cython's declarations for extproc.py's RequestStream (an augmenting .pxd: extproc.py stays plain Python, and runs
# as such when not compiled). Each of a request's messages reads a dozen of its fields and calls a few of its own
# methods: as C fields and C methods they are a load and a call, where a Python object's took the generic attribute
# lookup and a bound method each.
# The answers' writers call each other and wire's field and nesting (cpdef, cimported) as C functions, not through
# Python: 10 calls a request (handler-cpu --instructions 696.6 -> 695.0 thousand).
from epp.handlers cimport wire

cpdef bytes _set_header(bytes named, bytes value)
cpdef bytes streamed_chunk(str direction, chunk, bint last)

cdef class RequestStream:
    cdef public object director, reply, budget, ctx, pending
    cdef public Py_ssize_t max_body_bytes, body_bytes
    cdef public list body_chunks, held
    cdef public bint body_done, full_duplex, response_full_duplex, rewrite_back, routed, completed

    cdef list _handle(self, message)
    cdef list _on_request_headers(self, message)
    cdef list _on_request_body(self, chunk, bint end_of_stream)
    cdef _release_body(self)
    cdef list _refuse_body(self, error)
    cdef list _route(self, payload, raw, bint headers_phase)
    cpdef list _answers(self, decision, bint headers_phase)
    cdef bytes _reject(self, error)
    cdef list _on_response_headers(self, message)
    cdef list _on_response_body(self, chunk, bint end_of_stream)
    cdef _complete(self)
