# Cython's declarations for types.py's per-request dataclasses (an augmenting .pxd: types.py stays plain Python, and
# runs as such when not compiled). Declared, they are Cython's dataclasses: their __init__, __repr__ and __eq__ are
# compiled, where the dataclasses module would generate them as Python source and run it (an interpreted frame for
# every request and response). Fields stay Python objects: no C types, the same values as in plain Python.
cdef class ResponseInfo:
    cdef public object status, output_tokens, prompt_tokens, cached_tokens

cdef class SchedulingRequest:
    cdef public object request_id, model, prompt, prompt_tokens_estimate, priority, objective, fairness_id, headers
    cdef public object subset, max_tokens, streamed, payload

cdef class SchedulingResult:
    cdef public object endpoints, profile, candidates, raw_scores, timings, cycle_state

# Read about ten times a request: its dict typed, a read is a C call into the dict, not a method looked up by name.
cdef class CycleState:
    cdef dict _data

    cpdef object read(self, object key)
    cpdef object write(self, object key, object value)
