# Cython's declarations for wire.py's readers and writers (an augmenting .pxd: wire.py stays plain Python, and runs
# as such when not compiled). C integers for the positions and the bytes read make their loops over the wire bytes
# run as C; untyped, they would run slower than protobuf's own accessors. (The writers: a streamed chunk's answer
# in 0.31 against 0.42 µs untyped.)
import cython

# (`byte` as wide as `value`: C shifts it in its own type)
@cython.locals(value=cython.Py_ssize_t, shift=cython.Py_ssize_t, byte=cython.Py_ssize_t)
cdef inline (Py_ssize_t, Py_ssize_t) _varint(bytes data, Py_ssize_t position, Py_ssize_t end) except *

@cython.locals(key=cython.Py_ssize_t, byte=cython.Py_ssize_t, wire_type=cython.Py_ssize_t, start=cython.Py_ssize_t,
               length=cython.Py_ssize_t, size=cython.Py_ssize_t)
cdef (Py_ssize_t, Py_ssize_t, Py_ssize_t) _next_field(bytes data, Py_ssize_t position, Py_ssize_t end) except *

@cython.locals(position=cython.Py_ssize_t, key=cython.Py_ssize_t, value_at=cython.Py_ssize_t)
cdef list _fields(bytes data, Py_ssize_t start, Py_ssize_t end, Py_ssize_t wanted)

@cython.locals(position=cython.Py_ssize_t, key=cython.Py_ssize_t, value_at=cython.Py_ssize_t)
cdef str _string_value(bytes data, Py_ssize_t start, Py_ssize_t end)

@cython.locals(position=cython.Py_ssize_t, key=cython.Py_ssize_t, header_at=cython.Py_ssize_t,
               inner=cython.Py_ssize_t, field_at=cython.Py_ssize_t, name_at=cython.Py_ssize_t,
               name_end=cython.Py_ssize_t, value_at=cython.Py_ssize_t, value_end=cython.Py_ssize_t,
               raw_at=cython.Py_ssize_t, raw_end=cython.Py_ssize_t, byte=cython.uchar)
cdef _add_headers(dict headers, bytes data, Py_ssize_t start, Py_ssize_t end)

@cython.locals(resource_at=cython.Py_ssize_t, resource_end=cython.Py_ssize_t, scope_at=cython.Py_ssize_t,
               scope_end=cython.Py_ssize_t, record_at=cython.Py_ssize_t, record_end=cython.Py_ssize_t,
               position=cython.Py_ssize_t, key=cython.Py_ssize_t, value_at=cython.Py_ssize_t,
               inner=cython.Py_ssize_t, field_at=cython.Py_ssize_t)
cpdef list log_records(bytes data)

@cython.locals(position=cython.Py_ssize_t, end=cython.Py_ssize_t, kind=cython.Py_ssize_t, key=cython.Py_ssize_t,
               number=cython.Py_ssize_t, value_at=cython.Py_ssize_t, inner=cython.Py_ssize_t,
               field_at=cython.Py_ssize_t, request_mode=cython.Py_ssize_t, response_mode=cython.Py_ssize_t,
               start=cython.Py_ssize_t)
cpdef processing_request(bytes data)

@cython.locals(size=cython.Py_ssize_t)
cpdef bytes field(bytes field_key, payload)

@cython.locals(length=cython.Py_ssize_t)
cpdef bytes nesting(tuple keys, Py_ssize_t size)
