"""The grpcio transport for ext_proc (`epp --ext-proc-transport grpcio`: TLS, reflection). The lean transport
(`epp.transport.h2`) is the default; both drive handlers through the interface in `epp.handlers`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.handlers import NewHandler, accesslog
from epp.transport import oversized_messages

log = logging.getLogger("epp.transport.grpcio")


def ext_proc_service(
    new_handler: NewHandler, request_type: type = pb.ProcessingRequest, trace_context: bool = False
) -> grpc.GenericRpcHandler:
    """ExternalProcessor/Process on this server; the handlers' answers are serialized already (sent as they are).
    `request_type` is what the messages are parsed into, and `trace_context` whether each handler gets the stream's
    traceparent, as on the h2 transport (`epp.transport.h2.ExtProcServer`)."""
    return grpc.method_handlers_generic_handler(
        "envoy.service.ext_proc.v3.ExternalProcessor",
        {
            "Process": grpc.stream_stream_rpc_method_handler(
                ExternalProcessor(new_handler, trace_context).Process, request_deserializer=request_type.FromString
            )
        },
    )


class ExternalProcessor:
    def __init__(self, new_handler: NewHandler, trace_context: bool = False):
        self.new_handler = new_handler
        self.trace_context = trace_context

    async def Process(self, request_iterator, context: grpc.aio.ServicerContext):
        replies: asyncio.Queue = asyncio.Queue()
        if self.trace_context:
            metadata = context.invocation_metadata() or ()
            traceparent = next((value for key, value in metadata if key == "traceparent"), None)
            handler = self.new_handler(replies.put_nowait, traceparent)
        else:
            handler = self.new_handler(replies.put_nowait)
        messages = aiter(request_iterator)
        try:
            while True:
                message = await anext(messages, None)
                if message is None:
                    return
                try:
                    responses = handler.handle(message)
                except Exception as exc:  # a bug must cost this request only, with the lean transport's status
                    log.exception("ext_proc handler failed")
                    await context.abort(grpc.StatusCode.INTERNAL, f"EPP internal error: {type(exc).__name__}")
                for response in responses:
                    yield response
                if responses:
                    handler.after_reply()
                # an answer the handler owes (a queued request) comes through reply before the proxy says more:
                # Envoy waits for it, so waiting here for the next message would never end
                while handler.awaiting_reply or not replies.empty():
                    for response in await replies.get():
                        yield response
                    handler.after_reply()
        finally:
            handler.finish()


def access_log_service(export: Callable) -> grpc.GenericRpcHandler:
    """OpenTelemetry's LogsService/Export (the gateway's access log, `epp.handlers.accesslog`) on this server; an
    Export over accesslog.MAX_EXPORT_BYTES is refused unparsed (RESOURCE_EXHAUSTED), as on the h2 transport."""

    oversized = oversized_messages()

    def deserialize(data: bytes) -> list[tuple[str, dict[str, str]]] | None:
        if len(data) > accesslog.MAX_EXPORT_BYTES:
            oversized.note(len(data), accesslog.ExportRequest.__name__, accesslog.MAX_EXPORT_BYTES)
            return None
        return accesslog.ExportRecords.FromString(data)

    async def answer(request: list[tuple[str, dict[str, str]]] | None, context: grpc.aio.ServicerContext):
        if request is None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"message over {accesslog.MAX_EXPORT_BYTES} bytes")
        return export(request)

    return grpc.method_handlers_generic_handler(
        accesslog.SERVICE,
        {
            accesslog.METHOD: grpc.unary_unary_rpc_method_handler(
                answer,
                request_deserializer=deserialize,
                response_serializer=lambda response: response.SerializeToString(),
            )
        },
    )
