"""The floor of what an ext_proc picker can cost: a processor on the EPP's own HTTP/2 transport that reads nothing.

It answers every request's headers at once with a destination (round robin over a fixed list, header and envoy.lb
metadata prebuilt once), streams body chunks back unchanged as they arrive when the body is streamed, and lets the
response headers through. No JSON, no scheduling, no metrics: set beside plain Envoy and the full EPP in
`epp-bench overhead`, the differences are Envoy's ext_proc mechanism plus our transport, the body round trip, and
our request handling and scheduling.

    python -m harness.bench.floor --port 9102 --endpoints 127.0.0.1:8000,127.0.0.1:8001
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import signal

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from epp.handlers import Reply
from epp.handlers.extproc import streamed_chunk
from epp.transport.h2 import ExtProcServer
from harness.local import python_module
from protocol import extproc


def routing_response(endpoint: str) -> pb.ProcessingResponse:
    header = base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=extproc.DESTINATION_ENDPOINT_HEADER, raw_value=endpoint.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )
    metadata = struct_pb2.Struct()
    metadata.fields[extproc.DESTINATION_ENDPOINT_NAMESPACE].struct_value.fields[
        extproc.DESTINATION_ENDPOINT_KEY
    ].string_value = endpoint
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(
            response=pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=[header]), clear_route_cache=True)
        ),
        dynamic_metadata=metadata,
    )


# The answers that never change (the native floor, harness/bench/floor_native.py, sends the same bytes)
CONTINUE_RESPONSE_HEADERS = pb.ProcessingResponse(response_headers=pb.HeadersResponse()).SerializeToString()
REQUEST_TRAILERS = pb.ProcessingResponse(request_trailers=pb.TrailersResponse()).SerializeToString()
RESPONSE_TRAILERS = pb.ProcessingResponse(response_trailers=pb.TrailersResponse()).SerializeToString()


class FloorHandler:
    """One ext_proc stream; shares the prebuilt answers of its server."""

    __slots__ = ("answers",)
    awaiting_reply = False  # it answers every message at once

    def __init__(self, answers: itertools.cycle, reply: Reply):
        self.answers = answers

    def handle(self, message: pb.ProcessingRequest) -> list[bytes]:
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            return [next(self.answers)]
        if kind == "request_body":
            body = message.request_body
            return [streamed_chunk("request", body.body, body.end_of_stream)]
        if kind == "response_headers":
            return [CONTINUE_RESPONSE_HEADERS]
        if kind == "request_trailers":
            return [REQUEST_TRAILERS]
        if kind == "response_trailers":
            return [RESPONSE_TRAILERS]
        return []

    def oversized(self, size: int) -> None:
        return None

    def after_reply(self) -> None:
        pass

    def finish(self) -> None:
        pass


async def serve(host: str, port: int, endpoints: list[str]) -> None:
    answers = itertools.cycle([routing_response(e).SerializeToString() for e in endpoints])
    new_handler = functools.partial(FloorHandler, answers)
    server = ExtProcServer(new_handler)
    await server.start(host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("ready", flush=True)
    await stop.wait()
    await server.stop(0.5)


def command(port: int, endpoints: list[str]) -> list[str]:
    """The command line that runs this floor on `port`, routing to `endpoints` ("host:port") in turn."""
    return [*python_module("harness.bench.floor"), "--port", str(port), "--endpoints", ",".join(endpoints)]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m harness.bench.floor", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--endpoints", required=True, help="comma list of host:port to route to in turn")
    args = parser.parse_args()
    import uvloop

    uvloop.run(serve(args.host, args.port, [e for e in args.endpoints.split(",") if e]))


if __name__ == "__main__":
    main()
