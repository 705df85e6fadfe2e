# cython: annotation_typing=True
"""Protobuf's wire format, by hand: composed for the answers the ext_proc handler sends on every request, and read
for the messages it takes (ext_proc requests, the access log's records).

Why: building a ProcessingResponse through the message classes allocates a Python object per nested message and
field, copies the cached routing part in (MergeFrom) and serializes it all; composed from bytes, the routing answer
and its body chunk take 4.6 instead of 6.7 µs (in process, one request's answers), and the handler path 982 instead
of 1,000 thousand instructions per request (`epp-bench handler-cpu` under callgrind: exact, where timings on a shared
host spread by several µs). Two properties of the format make it simple: a message is its fields' bytes one after
another, and bytes of the same message type concatenated parse as the merge of the parts (singular submessages
merge, repeated fields append). So an answer is the cached bytes of what every answer to the same endpoints shares,
then the bytes of the request's own fields, each nested in the fields that lead to it.

Field numbers come from the message descriptors (`key`), so the code names fields, not numbers.

The readers walk the bytes once (`_next_field`) and build only what the handler keeps: the strings of the headers
and records, a body's bytes. Through the message classes every message, header, record and field read was a Python
object of its own: the handler path took 874 thousand instructions a request, 808 from the bytes. They compare field
keys as literal numbers, constants to the interpreter (tests/epp/test_wire.py checks the numbers against the
descriptors, and everything read against what the message classes read).
"""

from __future__ import annotations

import cython
from google.protobuf.message import DecodeError, Message

from epp.wireformat import CACHED, VARINTS, varint

LENGTH_DELIMITED, VARINT = 2, 0


def key(message_type: type[Message], name: str) -> bytes:
    """The key (field number and wire type) that starts field `name` of `message_type` on the wire."""
    field = message_type.DESCRIPTOR.fields_by_name[name]
    wire_type = LENGTH_DELIMITED if field.type in (field.TYPE_MESSAGE, field.TYPE_STRING, field.TYPE_BYTES) else VARINT
    return varint(field.number << 3 | wire_type)


@cython.locals(length=cython.Py_ssize_t)
def nesting(keys: tuple[bytes, ...], size: cython.Py_ssize_t) -> bytes:
    """What goes before `size` bytes of content to nest them in the length-delimited fields `keys`, outermost first:
    each key and the length of what it holds. The content follows it unchanged (a large body is copied once)."""
    prefix = b""
    for field_key in reversed(keys):
        length = size + len(prefix)
        prefix = field_key + (VARINTS[length] if length < CACHED else varint(length)) + prefix
    return prefix


@cython.locals(size=cython.Py_ssize_t)
def field(field_key: bytes, payload: bytes) -> bytes:
    """One length-delimited field: a string, bytes or a submessage's bytes."""
    size = len(payload)
    return field_key + (VARINTS[size] if size < CACHED else varint(size)) + payload


class WireError(DecodeError):
    """Bytes that are not a well-formed protobuf message."""


@cython.cfunc
@cython.locals(value=cython.Py_ssize_t, shift=cython.Py_ssize_t, byte=cython.Py_ssize_t)
def _varint(
    data: bytes, position: cython.Py_ssize_t, end: cython.Py_ssize_t
) -> tuple[cython.Py_ssize_t, cython.Py_ssize_t]:
    """The varint at `position` and the position after it; position -1 when it is cut off by `end` or longer than
    what this reads (63 bits: a C integer)."""
    value = shift = 0
    while position < end and shift <= 56:
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7
    return 0, -1


@cython.cfunc
@cython.locals(
    key=cython.Py_ssize_t,
    byte=cython.Py_ssize_t,
    wire_type=cython.Py_ssize_t,
    start=cython.Py_ssize_t,
    length=cython.Py_ssize_t,
    size=cython.Py_ssize_t,
)
def _next_field(
    data: bytes, position: cython.Py_ssize_t, end: cython.Py_ssize_t
) -> tuple[cython.Py_ssize_t, cython.Py_ssize_t, cython.Py_ssize_t]:
    """The field at `position`: its key (field number << 3 | wire type), where its value starts and where it ends
    (a length-delimited field's value is its payload). Key -1: the bytes up to `end` are not a well-formed field."""
    key, position = _varint(data, position, end)
    if position < 0:
        return -1, end, end
    wire_type = key & 7
    if wire_type == 0:  # VARINT: its value is not read; up to 10 bytes (a negative int64) are skipped
        start = position
        while position < end and position - start < 10:
            byte = data[position]
            position += 1
            if byte < 0x80:
                return key, start, position
        return -1, end, end
    if wire_type == 2:  # LENGTH_DELIMITED
        length, position = _varint(data, position, end)
        if position < 0 or length > end - position:
            return -1, end, end
        return key, position, position + length
    size = 8 if wire_type == 1 else 4 if wire_type == 5 else end  # 64-bit, 32-bit; groups are not read here
    if size > end - position:
        return -1, end, end
    return key, position, position + size


@cython.cfunc
@cython.locals(position=cython.Py_ssize_t, key=cython.Py_ssize_t, value_at=cython.Py_ssize_t)
def _fields(
    data: bytes, start: cython.Py_ssize_t, end: cython.Py_ssize_t, wanted: cython.Py_ssize_t
) -> list[tuple[int, int]]:
    """Where the values of the fields with key `wanted` lie in the message between `start` and `end`, in order."""
    found = []
    position = start
    while position < end:
        key, value_at, position = _next_field(data, position, end)
        if key == wanted:
            found.append((value_at, position))
        elif key < 0:
            raise WireError("a malformed field")
    return found


@cython.cfunc
@cython.locals(position=cython.Py_ssize_t, key=cython.Py_ssize_t, value_at=cython.Py_ssize_t)
def _string_value(data: bytes, start: cython.Py_ssize_t, end: cython.Py_ssize_t) -> str:
    """An OTLP AnyValue's string_value, "" when it holds another kind of value (the message classes' reading)."""
    value = ""
    position = start
    while position < end:
        key, value_at, position = _next_field(data, position, end)
        if key == 0x0A:  # string_value
            value = data[value_at:position].decode("utf-8", "replace")
        elif key < 0:
            raise WireError("a malformed field")
    return value


@cython.cfunc
@cython.locals(
    position=cython.Py_ssize_t,
    key=cython.Py_ssize_t,
    header_at=cython.Py_ssize_t,
    inner=cython.Py_ssize_t,
    field_at=cython.Py_ssize_t,
    name_at=cython.Py_ssize_t,
    name_end=cython.Py_ssize_t,
    value_at=cython.Py_ssize_t,
    value_end=cython.Py_ssize_t,
    raw_at=cython.Py_ssize_t,
    raw_end=cython.Py_ssize_t,
)
def _add_headers(headers: dict[str, str], data: bytes, start: cython.Py_ssize_t, end: cython.Py_ssize_t) -> None:
    """The headers of the HeaderMap (envoy.config.core.v3) between `start` and `end`, added to `headers` as the
    ext_proc handler keeps them: each name lowercased, each value its raw_value decoded as UTF-8 (invalid bytes
    replaced), or its value when raw_value is empty; a name that comes twice keeps its last value."""
    position = start
    while position < end:
        key, header_at, position = _next_field(data, position, end)
        if key != 0x0A:  # not a header (field 1)
            if key < 0:
                raise WireError("a malformed field")
            continue
        name_at = name_end = value_at = value_end = raw_at = raw_end = inner = header_at
        while inner < position:
            key, field_at, inner = _next_field(data, inner, position)
            if key == 0x0A:
                name_at, name_end = field_at, inner
            elif key == 0x12:
                value_at, value_end = field_at, inner
            elif key == 0x1A:
                raw_at, raw_end = field_at, inner
            elif key < 0:
                raise WireError("a malformed header")
        if raw_end > raw_at:
            value_at, value_end = raw_at, raw_end
        # (names come lowercase over HTTP/2: lower() in C costs less than looking for a capital byte by byte)
        name = data[name_at:name_end].decode("utf-8", "replace").lower()
        headers[name] = data[value_at:value_end].decode("utf-8", "replace")


@cython.locals(
    resource_at=cython.Py_ssize_t,
    resource_end=cython.Py_ssize_t,
    scope_at=cython.Py_ssize_t,
    scope_end=cython.Py_ssize_t,
    record_at=cython.Py_ssize_t,
    record_end=cython.Py_ssize_t,
    position=cython.Py_ssize_t,
    key=cython.Py_ssize_t,
    value_at=cython.Py_ssize_t,
    inner=cython.Py_ssize_t,
    field_at=cython.Py_ssize_t,
)
def log_records(data: bytes) -> list[tuple[str, dict[str, str]]]:
    """The records of a serialized OTLP ExportLogsServiceRequest, in order: each one's body and attributes, as strings
    (AnyValue string_value; "" for a value of another kind, as the message classes read it; invalid UTF-8 replaced,
    where the message classes refuse the whole call). A key that comes twice keeps its last value."""
    records = []
    for resource_at, resource_end in _fields(data, 0, len(data), 0x0A):  # resource_logs
        for scope_at, scope_end in _fields(data, resource_at, resource_end, 0x12):  # scope_logs
            for record_at, record_end in _fields(data, scope_at, scope_end, 0x12):  # log_records
                body = ""
                attributes = {}
                position = record_at
                while position < record_end:
                    key, value_at, position = _next_field(data, position, record_end)
                    if key == 0x2A:  # body
                        body = _string_value(data, value_at, position)
                    elif key == 0x32:  # attributes: a KeyValue
                        name = value = ""
                        inner = value_at
                        while inner < position:
                            key, field_at, inner = _next_field(data, inner, position)
                            if key == 0x0A:
                                name = data[field_at:inner].decode("utf-8", "replace")
                            elif key == 0x12:
                                value = _string_value(data, field_at, inner)
                            elif key < 0:
                                raise WireError("a malformed attribute")
                        attributes[name] = value
                    elif key < 0:
                        raise WireError("a malformed log record")
                records.append((body, attributes))
    return records


# The ProcessingRequest (envoy.service.ext_proc.v3) fields `processing_request` reads, by number: its `request` oneof
# (2-7), then HttpHeaders' and HttpBody's fields. tests/epp/test_wire.py checks them against the descriptors.
REQUEST_KINDS = (
    "",
    "",
    "request_headers",
    "response_headers",
    "request_body",
    "response_body",
    "request_trailers",
    "response_trailers",
)


class ExtProcRequest:
    """A ProcessingRequest as the ext_proc handler reads it (`processing_request`): which of the `request` oneof it
    holds (`kind`, "" when none), a headers message's headers (as `_add_headers` reads them) or a body message's
    bytes, its end_of_stream, the protocol_config's body modes (None without one), and `metadata`: the rare parts,
    its metadata_context and attributes fields as they came (b"" when there are none, or only the empty
    metadata_context Envoy sends with every message once namespaces are forwarded), which the handler parses with
    the message classes when it reads them."""

    __slots__ = ("body", "body_modes", "end_of_stream", "headers", "kind", "metadata")

    def __init__(self) -> None:
        self.kind = ""
        self.headers: dict[str, str] = {}
        self.body = b""
        self.end_of_stream = False
        self.body_modes: tuple[int, int] | None = None
        self.metadata = b""

    @staticmethod
    def FromString(data: bytes | memoryview) -> ExtProcRequest:  # (named as a message type's: the transports call it)
        return processing_request(data if isinstance(data, bytes) else bytes(data))


ExtProcRequest.__name__ = "ProcessingRequest"  # the transports' refusals name the message the proxy sent


@cython.locals(
    position=cython.Py_ssize_t,
    end=cython.Py_ssize_t,
    kind=cython.Py_ssize_t,
    key=cython.Py_ssize_t,
    number=cython.Py_ssize_t,
    value_at=cython.Py_ssize_t,
    inner=cython.Py_ssize_t,
    field_at=cython.Py_ssize_t,
    request_mode=cython.Py_ssize_t,
    response_mode=cython.Py_ssize_t,
    start=cython.Py_ssize_t,
)
def processing_request(data: bytes) -> ExtProcRequest:
    """The fields of a serialized ProcessingRequest the ext_proc handler reads (`ExtProcRequest`), read as the
    message classes read them: of the oneof the last member wins, and a member that comes twice merges (headers
    add up; a body or end_of_stream that comes again replaces the earlier one). Malformed bytes raise WireError."""
    request = ExtProcRequest()
    position, end = 0, len(data)
    kind = 0
    while position < end:
        start = position
        key, value_at, position = _next_field(data, position, end)
        number = key >> 3
        if 2 <= number <= 7 and key & 7 == 2:  # a member of the request oneof
            if number != kind:
                if kind:  # another member clears what an earlier one set
                    request.headers, request.body, request.end_of_stream = {}, b"", False
                kind = number
            inner = value_at if number <= 5 else position  # (the handler reads nothing of the trailers)
            while inner < position:
                key, field_at, inner = _next_field(data, inner, position)
                if key == 0x0A:  # HttpHeaders.headers, HttpBody.body
                    if number <= 3:
                        _add_headers(request.headers, data, field_at, inner)
                    else:
                        request.body = data[field_at:inner]
                elif (key == 0x18 and number <= 3) or (key == 0x10 and 4 <= number <= 5):  # end_of_stream
                    request.end_of_stream = _varint(data, field_at, inner)[0] != 0
                elif key < 0:
                    raise WireError("a malformed field")
        elif number == 9 or (number == 8 and position > value_at):  # attributes, a metadata_context with content
            request.metadata += data[start:position]  # (kept whole, key and all: they parse as a ProcessingRequest)
        elif key == 0x5A:  # protocol_config
            request_mode = response_mode = 0
            inner = value_at
            while inner < position:
                key, field_at, inner = _next_field(data, inner, position)
                if key == 0x08:
                    request_mode = _varint(data, field_at, inner)[0]
                elif key == 0x10:
                    response_mode = _varint(data, field_at, inner)[0]
                elif key < 0:
                    raise WireError("a malformed field")
            request.body_modes = (request_mode, response_mode)
        elif key < 0:
            raise WireError("a malformed field")
    request.kind = REQUEST_KINDS[kind]
    return request
