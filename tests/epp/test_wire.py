"""The ext_proc answers composed from bytes (epp/handlers/wire.py) are the messages built field by field: each one
parses to what the protobuf classes build, and the body chunks are byte for byte what they serialize."""

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.handlers import wire
from epp.handlers.extproc import CONTINUE_AND_REPLACE, OVERWRITE, RequestStream, streamed_chunk
from epp.requestcontrol.types import RoutingDecision
from protocol import extproc
from tests.epp.helpers import endpoint

# lengths on both sides of each varint width, a body chunk's limit and a large body
SIZES = (0, 1, 127, 128, 16_383, 16_384, extproc.MAX_BODY_CHUNK_BYTES, 300_000)


def test_varints():
    vectors = {0: "00", 1: "01", 127: "7f", 128: "8001", 300: "ac02", 16_383: "ff7f", 16_384: "808001"}
    for value, encoded in vectors.items():
        assert wire.varint(value) == bytes.fromhex(encoded)
    assert wire.varint(2**32 + 5) == bytes.fromhex("8580808010")


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
    fallbacks = hostports[1:]
    if fallbacks:
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
