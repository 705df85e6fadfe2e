"""The ext_proc answers composed from bytes (epp/handlers/wire.py) are the messages built field by field: each one
parses to what the protobuf classes build, and the body chunks are byte for byte what they serialize. The readers
(request headers, access-log records) read what the protobuf classes read, and refuse malformed bytes with
DecodeError, as they do."""

import contextlib

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.common.v1 import common_pb2

from epp.handlers import accesslog, wire
from epp.handlers.extproc import CONTINUE_AND_REPLACE, OVERWRITE, RequestStream, streamed_chunk
from epp.requestcontrol.types import RoutingDecision
from epp.wireformat import varint
from protocol import extproc
from tests.epp.helpers import endpoint

# lengths on both sides of each varint width, a body chunk's limit and a large body
SIZES = (0, 1, 127, 128, 16_383, 16_384, extproc.MAX_BODY_CHUNK_BYTES, 300_000)


def test_varints():
    vectors = {0: "00", 1: "01", 127: "7f", 128: "8001", 300: "ac02", 16_383: "ff7f", 16_384: "808001"}
    for value, encoded in vectors.items():
        assert varint(value) == bytes.fromhex(encoded)
    assert varint(2**32 + 5) == bytes.fromhex("8580808010")


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("last", [False, True])
def test_a_streamed_chunk_is_the_serialized_message(size, last):
    chunk = bytes(range(256)) * (size // 256) + b"z" * (size % 256)
    for direction, field in (("request", "request_body"), ("response", "response_body")):
        mutation = pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(body=chunk, end_of_stream=last))
        built = pb.ProcessingResponse(**{field: pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation))})
        assert streamed_chunk(direction, chunk, last) == built.SerializeToString()


def _expected(decision: RoutingDecision, headers_phase: bool) -> list[pb.ProcessingResponse]:
    """The answers as the handler built them with the message classes before (the protocol's fields)."""
    head = pb.ProcessingResponse()
    common = head.request_headers.response if headers_phase else head.request_body.response
    common.clear_route_cache = True
    hostports = [e.spec.hostport for e in decision.endpoints]
    headers = [(extproc.DESTINATION_ENDPOINT_HEADER, hostports[0])]
    fallbacks = hostports[1:] or hostports  # a lone pick is its own fallback
    headers += [(n, fallbacks[min(i, len(fallbacks) - 1)]) for i, n in enumerate(extproc.FALLBACK_ENDPOINT_HEADERS)]
    headers.append((extproc.REQUEST_ID_HEADER, decision.request_id))
    if decision.body is not None:
        headers.append(("content-length", str(len(decision.body))))
    for key, value in headers:
        common.header_mutation.set_headers.append(
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=key, raw_value=value.encode()), append_action=OVERWRITE
            )
        )
    head.dynamic_metadata.get_or_create_struct(extproc.DESTINATION_ENDPOINT_NAMESPACE)[
        extproc.DESTINATION_ENDPOINT_KEY
    ] = ",".join(hostports)
    if not headers_phase:
        if decision.body_changed:
            common.status = CONTINUE_AND_REPLACE
            common.body_mutation.body = decision.body
        return [head]
    answers = [head]
    body = decision.body
    if body is not None:
        size = extproc.MAX_BODY_CHUNK_BYTES
        for start in range(0, len(body), size) or (0,):
            streamed = pb.StreamedBodyResponse(body=body[start : start + size], end_of_stream=start + size >= len(body))
            mutation = pb.BodyMutation(streamed_response=streamed)
            answers.append(
                pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation)))
            )
    return answers


# (body size or None for a request without a body, whether the EPP changed the body)
BODIES = [(None, False)] + [(size, changed) for size in (0, 10, 200, 150_000) for changed in (False, True)]


@pytest.mark.parametrize("headers_phase", [True, False])
@pytest.mark.parametrize(("body_size", "changed"), BODIES)
@pytest.mark.parametrize("picked", [1, 3])
def test_routing_answers_parse_to_the_messages_built_field_by_field(headers_phase, body_size, changed, picked):
    body = None if body_size is None else b"{" + b"x" * max(body_size - 2, 0) + b"}"
    decision = RoutingDecision("req-" + "7" * 40, [endpoint(i) for i in range(picked)], body, changed)
    stream = RequestStream(director=None, reply=None)
    stream.response_full_duplex = False
    answers = stream._answers(decision, headers_phase)
    assert [pb.ProcessingResponse.FromString(a) for a in answers] == _expected(decision, headers_phase)


_IN_REQUEST_HEADERS = (wire.key(pb.ProcessingRequest, "request_headers"), wire.key(pb.HttpHeaders, "headers"))


def _read_header_map(data: bytes) -> dict[str, str]:
    """The handler's reading of a serialized HeaderMap, nested in a request_headers message as Envoy sends it."""
    return wire.processing_request(wire.nesting(_IN_REQUEST_HEADERS, len(data)) + data).headers


def _header_map_as_the_classes_read_it(data: bytes) -> dict[str, str]:
    """What the handler read through the message classes before the wire readers."""
    headers = {}
    for h in base_pb2.HeaderMap.FromString(data).headers:
        headers[h.key.lower()] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return headers


_NAMES = st.sampled_from([":path", ":method", "Content-Type", "x-request-id", "X-Gateway-Model-Name", "Ä", "a" * 200])
_HEADER = st.tuples(_NAMES | st.text(max_size=20), st.text(max_size=300), st.binary(max_size=300))


@settings(max_examples=300)
@given(st.lists(_HEADER, max_size=12), st.booleans())
def test_the_headers_read_are_what_the_message_classes_read(headers, unknown_field):
    message = base_pb2.HeaderMap()
    for name, value, raw in headers:  # value, raw_value or both, as a proxy may send them
        message.headers.add(key=name, value=value, raw_value=raw)
    data = message.SerializeToString()
    if unknown_field:  # a field this reader does not know (a newer proxy's): skipped, as the classes skip it
        data += varint(7 << 3 | 2) + varint(3) + b"abc" + varint(9 << 3) + varint(2**40)
    assert _read_header_map(data) == _header_map_as_the_classes_read_it(data)


def _records_as_the_classes_read_them(data: bytes) -> list[tuple[str, dict[str, str]]]:
    records = []
    for resource in accesslog.ExportRequest.FromString(data).resource_logs:
        for scope in getattr(resource, accesslog._SCOPES):
            for record in getattr(scope, accesslog._RECORDS):
                attributes = {a.key: a.value.string_value for a in record.attributes}
                records.append((record.body.string_value, attributes))
    return records


_VALUE = st.one_of(
    st.text(max_size=30).map(lambda text: common_pb2.AnyValue(string_value=text)),
    st.integers(-(2**63), 2**63 - 1).map(lambda number: common_pb2.AnyValue(int_value=number)),
    st.floats(allow_nan=False).map(lambda number: common_pb2.AnyValue(double_value=number)),
    st.booleans().map(lambda flag: common_pb2.AnyValue(bool_value=flag)),
    st.binary(max_size=30).map(lambda raw: common_pb2.AnyValue(bytes_value=raw)),
)
_KEYS = st.sampled_from([accesslog.TTFT_ATTRIBUTE, accesslog.STATUS_ATTRIBUTE, accesslog.UPSTREAM_ATTRIBUTE, "other"])
_RECORD = st.tuples(_VALUE, st.lists(st.tuples(_KEYS, _VALUE), max_size=5), st.integers(0, 2**64 - 1))


@settings(max_examples=300)
@given(st.lists(st.lists(st.lists(_RECORD, max_size=4), max_size=3), max_size=3))
def test_log_records_reads_what_the_message_classes_read(resources):
    request = accesslog.ExportRequest()
    for scopes in resources:
        resource = request.resource_logs.add()
        resource.resource.attributes.add(key="service.name", value=common_pb2.AnyValue(string_value="envoy"))
        for records in scopes:
            scope = getattr(resource, accesslog._SCOPES).add()
            scope.schema_url = "https://opentelemetry.io/schemas/1.0"  # a field beside the records: skipped
            for body, attributes, time_unix_nano in records:
                record = getattr(scope, accesslog._RECORDS).add(time_unix_nano=time_unix_nano, severity_text="INFO")
                record.body.CopyFrom(body)
                for key, value in attributes:
                    record.attributes.add(key=key, value=value)
    data = request.SerializeToString()
    assert wire.log_records(data) == _records_as_the_classes_read_them(data)
    assert accesslog.ExportRecords.FromString(memoryview(data)) == wire.log_records(data)  # (a large one's view)


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
@settings(max_examples=2000)
@given(st.binary(max_size=200), st.integers(0, 199))
def test_the_readers_refuse_malformed_bytes_as_the_message_classes_do(noise, cut):
    """Bytes that are not a message raise DecodeError (the transports answer INVALID_ARGUMENT), never another
    error; cut messages and random bytes alike."""
    export = accesslog.export_request([("request-1", "1500", "200", "10.0.0.1:8000")]).SerializeToString()
    headers = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key="a", raw_value=b"b")]).SerializeToString()
    for read, data in ((wire.log_records, export), (_read_header_map, headers)):
        for candidate in (data[: cut % (len(data) + 1)], noise, data + noise):
            with contextlib.suppress(DecodeError):
                read(candidate)


def test_overlong_and_truncated_varints_are_malformed():
    lengths_over_c_int = (b"\x12\xbc\xd7\xcd\x90\x09", b"\x0a" + b"\xff" * 8 + b"\x7f")  # 2^31 and more, 2^63 - 1
    for data in (
        b"\x0a" + b"\xff" * 10 + b"\x01",
        b"\x0a\x80",
        b"\x0a\x05abc",
        b"\x0b",
        b"\x0a\x02\x0a\x05",
        *lengths_over_c_int,
    ):
        with pytest.raises(DecodeError):
            _read_header_map(data)
        with pytest.raises(DecodeError):
            wire.log_records(data)


def test_the_request_kinds_are_the_oneof_members_by_number():
    oneof = pb.ProcessingRequest.DESCRIPTOR.oneofs_by_name["request"]
    assert {f.number: f.name for f in oneof.fields} == {n: k for n, k in enumerate(wire.REQUEST_KINDS) if k}
    numbers = {name: f.number for name, f in pb.ProcessingRequest.DESCRIPTOR.fields_by_name.items()}
    assert (numbers["metadata_context"], numbers["attributes"], numbers["protocol_config"]) == (8, 9, 11)
    assert [pb.HttpHeaders.DESCRIPTOR.fields_by_name[n].number for n in ("headers", "end_of_stream")] == [1, 3]
    assert [pb.HttpBody.DESCRIPTOR.fields_by_name[n].number for n in ("body", "end_of_stream")] == [1, 2]
    modes = pb.ProtocolConfiguration.DESCRIPTOR.fields_by_name
    assert (modes["request_body_mode"].number, modes["response_body_mode"].number) == (1, 2)


def _as_the_classes_read_it(message: pb.ProcessingRequest) -> tuple:
    kind = message.WhichOneof("request") or ""
    headers, body, end = {}, b"", False
    if kind in ("request_headers", "response_headers"):
        http = getattr(message, kind)
        headers = _header_map_as_the_classes_read_it(http.headers.SerializeToString())
        end = http.end_of_stream
    elif kind in ("request_body", "response_body"):
        body, end = getattr(message, kind).body, getattr(message, kind).end_of_stream
    config = message.protocol_config
    modes = (config.request_body_mode, config.response_body_mode) if message.HasField("protocol_config") else None
    metadata = pb.ProcessingRequest(attributes=message.attributes)
    if message.metadata_context.ByteSize():  # (an empty one is no metadata)
        metadata.metadata_context.CopyFrom(message.metadata_context)
    return kind, headers, body, end, modes, metadata


_KIND = st.sampled_from((*wire.REQUEST_KINDS[2:], ""))


@settings(max_examples=300)
@given(
    _KIND,
    st.lists(_HEADER, max_size=6),
    st.binary(max_size=200),
    st.booleans(),
    st.booleans(),
    st.sampled_from(("none", "empty", "filled")),
    st.booleans(),
    st.integers(0, 5),
)
def test_processing_request_reads_what_the_message_classes_read(
    kind, headers, body, end, config, metadata, attributes, modes
):
    message = pb.ProcessingRequest()
    if kind in ("request_headers", "response_headers"):
        http = getattr(message, kind)
        for name, value, raw in headers:
            http.headers.headers.add(key=name, value=value, raw_value=raw)
        http.end_of_stream = end
    elif kind in ("request_body", "response_body"):
        getattr(message, kind).body = body
        getattr(message, kind).end_of_stream = end
    elif kind:
        getattr(message, kind).SetInParent()
    if config:
        message.protocol_config.request_body_mode = modes
        message.protocol_config.response_body_mode = 5 - modes
    if metadata == "empty":  # as Envoy sends it with every message when metadata namespaces are forwarded
        message.metadata_context.SetInParent()
    elif metadata == "filled":
        message.metadata_context.filter_metadata["envoy.lb"].fields["x"].string_value = "10.0.0.1:8000"
    if attributes:  # as Envoy sends response_attributes
        message.attributes["envoy.filters.http.ext_proc"].fields["upstream.address"].string_value = "10.0.0.1:8000"
    data = message.SerializeToString()
    read = wire.processing_request(data)
    # the metadata comes as its own fields' bytes: parsed, they are the message's (and nothing when there is none)
    parsed = pb.ProcessingRequest.FromString(read.metadata)
    assert (read.kind, read.headers, read.body, read.end_of_stream, read.body_modes, parsed) == (
        _as_the_classes_read_it(message)
    )
    assert bool(read.metadata) == (metadata == "filled" or attributes)
    assert wire.ExtProcRequest.FromString(memoryview(data)).body == read.body


def test_a_later_member_of_the_oneof_replaces_an_earlier_one_and_a_repeated_one_merges():
    headers = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key="a", value="1")]))
    ).SerializeToString()
    more = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key="b", value="2")]), end_of_stream=True
        )
    ).SerializeToString()
    body = pb.ProcessingRequest(request_body=pb.HttpBody(body=b"x")).SerializeToString()
    for data in (headers + more, headers + body, body + headers + more, body + body):
        assert _as_the_classes_read_it(pb.ProcessingRequest.FromString(data))[:4] == (
            (read := wire.processing_request(data)).kind,
            read.headers,
            read.body,
            read.end_of_stream,
        )
