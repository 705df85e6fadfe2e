# Cython's declarations for grpc_h2.py's connection and stream (an augmenting .pxd: grpc_h2.py stays plain Python,
# and runs as such when not compiled). Every frame reads and writes a dozen of their fields and calls a few of the
# connection's own methods: as Python objects each read took the generic attribute lookup (~150 instructions),
# each call a bound method; as C fields and C methods they are a load and a call.
import cython

cdef class _Stream:
    cdef public Py_ssize_t id, send_window, max_message, skip, recv_unacked
    cdef public object handler, request_type, header_block, message, pending
    cdef public bint headers_sent, closed, handled

cdef class ExtProcConnection:
    cdef public object server, partial, transport, buffer, preface_timer, decoder
    cdef public dict streams, decoded_blocks, unsent_trailers
    cdef public list out, after
    cdef public Py_ssize_t backlog, queued, send_window, peer_initial_window, peer_max_frame, recv_unacked
    cdef public Py_ssize_t continuation_of, continuation_flags, last_stream_id, opened, premature_resets
    cdef public Py_ssize_t refused_streams, control_frames
    cdef public double control_window_start
    cdef public bint preface_seen, refused

    @cython.locals(position=cython.Py_ssize_t, size=cython.Py_ssize_t, high=cython.Py_ssize_t, low=cython.Py_ssize_t,
                   kind=cython.Py_ssize_t, flags=cython.Py_ssize_t, stream_id=cython.Py_ssize_t,
                   length=cython.Py_ssize_t, end=cython.Py_ssize_t)
    cpdef data_received(self, data)
    cdef _write(self)
    cdef Py_ssize_t _count_backlog(self) except -1
    @cython.locals(stream=_Stream)
    cdef _on_frame(self, Py_ssize_t kind, Py_ssize_t flags, Py_ssize_t stream_id, payload)
    cdef _count_control_frame(self)
    @cython.locals(stream=_Stream)
    cdef _on_headers(self, Py_ssize_t flags, Py_ssize_t stream_id, payload)
    cdef _on_header_block(self, _Stream stream, Py_ssize_t flags)
    @cython.locals(stream=_Stream, received=cython.Py_ssize_t, offset=cython.Py_ssize_t, size=cython.Py_ssize_t,
                   compressed=cython.Py_ssize_t, length=cython.Py_ssize_t, end=cython.Py_ssize_t,
                   dropped=cython.Py_ssize_t)
    cdef _on_data(self, Py_ssize_t flags, Py_ssize_t stream_id, payload)
    cdef bint _refused_unread(self, _Stream stream, Py_ssize_t length) except -1
    cdef _handle(self, _Stream stream, request)
    cdef _on_settings(self, payload)
    @cython.locals(stream=_Stream)
    cdef _on_window_update(self, Py_ssize_t stream_id, Py_ssize_t increment)
    @cython.locals(size=cython.Py_ssize_t)
    cdef _send_message(self, _Stream stream, message)
    cdef _end_of_requests(self, _Stream stream)
    cdef _close_stream(self, _Stream stream, trailers)
    cdef _drop_message(self, _Stream stream)
    cdef _finish(self, _Stream stream)
    @cython.locals(stream=_Stream)
    cdef _flush_all(self)
    @cython.locals(allowed=cython.Py_ssize_t)
    cdef _flush(self, _Stream stream)
