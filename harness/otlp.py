"""A small OpenTelemetry trace collector: the collector's TraceService/Export over gRPC (opentelemetry-proto), keeping
what it receives in memory. For tests and local runs: point the EPP's, the model servers' and Envoy's
--otlp-traces-endpoint (`harness.envoy.render_bootstrap(otlp_traces_endpoint=...)`) at it and read whole traces back.
`python -m harness.otlp` runs one that only counts.
"""

from __future__ import annotations

import asyncio
import signal
from collections import defaultdict
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from protocol.cli import command_parser


@dataclass
class Span:
    """One received span, flattened: its service (the resource's service.name), ids in hex, times in ns."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root span
    start: int
    end: int
    attributes: dict = field(default_factory=dict)


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


class TraceCollector(trace_service_pb2_grpc.TraceServiceServicer):
    """Serves Export on `address` ("host:port") once started; `spans` holds every span received (with `keep`;
    without, it only counts them in `received`: a sink that costs what parsing the requests costs)."""

    def __init__(self, address: str, keep: bool = True):
        self.address = address
        self.keep = keep
        self.received = 0
        self.spans: list[Span] = []
        self.arrived = asyncio.Event()
        self.server = grpc.aio.server()
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.server.add_insecure_port(address)

    async def Export(self, request, context):  # the collector's method name
        for resource_spans in request.resource_spans:
            self.received += sum(len(scope.spans) for scope in resource_spans.scope_spans)
            if not self.keep:
                continue
            attributes = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            service = attributes.get("service.name", "")
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    self.spans.append(
                        Span(
                            service,
                            s.name,
                            s.trace_id.hex(),
                            s.span_id.hex(),
                            s.parent_span_id.hex(),
                            s.start_time_unix_nano,
                            s.end_time_unix_nano,
                            {a.key: _value(a.value) for a in s.attributes},
                        )
                    )
        self.arrived.set()
        return trace_service_pb2.ExportTraceServiceResponse()

    def traces(self) -> dict[str, list[Span]]:
        """The spans received so far, by trace id."""
        by_trace: dict[str, list[Span]] = defaultdict(list)
        for span in self.spans:
            by_trace[span.trace_id].append(span)
        return dict(by_trace)

    async def start(self) -> None:
        await self.server.start()

    async def stop(self) -> None:
        await self.server.stop(grace=None)


def main(argv: list[str] | None = None) -> None:
    """A collector that counts the spans it receives, printing the count when stopped (SIGINT or SIGTERM): a sink
    for measuring what tracing costs its senders, e.g. `epp-bench overhead --epp-flags "--otlp-traces-endpoint
    127.0.0.1:4317"`."""
    parser = command_parser("python -m harness.otlp", main.__doc__)
    parser.add_argument("--listen", default="127.0.0.1:4317", help="the address to serve TraceService/Export on")
    args = parser.parse_args(argv)

    async def serve() -> None:
        collector = TraceCollector(args.listen, keep=False)
        await collector.start()
        print(f"collecting on {args.listen}", flush=True)
        stopped = asyncio.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(signum, stopped.set)
        await stopped.wait()
        await collector.stop()
        print(f"received {collector.received} spans", flush=True)

    asyncio.run(serve())


if __name__ == "__main__":
    main()
