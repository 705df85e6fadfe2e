# Cython's declarations for features.py's Features (an augmenting .pxd: features.py stays plain Python, and runs as
# such when not compiled): a Cython dataclass, its __init__ and __post_init__ compiled (one per candidate of every
# request the predictor predicts for), its fields read-only as the frozen dataclass's.
cdef class Features:
    cdef readonly object waiting, running, kv_usage, in_flight_tokens, prompt_tokens, cached_tokens, adapter_loaded
    cdef readonly object backlog_tokens, endpoint
