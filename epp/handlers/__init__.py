"""Handlers speak the proxy's protocol and nothing else: they turn its messages into calls of the director
(`epp.requestcontrol.director`) and the director's answers into its messages.

The ext_proc handler interface, which both gRPC transports (`epp.transport.h2`, the lean one; `epp.transport.grpcio`)
drive the same way:
* per ext_proc stream (one HTTP request) the transport makes one handler: `new_handler(reply)`, or, when the EPP
  traces requests, `new_handler(reply, traceparent)` with the W3C traceparent of the stream's gRPC metadata (None
  without one: the proxy's own trace of the request, which the request's span continues);
* `handle(message)` takes one ProcessingRequest and returns the answers to send now, in order (possibly none), each
  a serialized ProcessingResponse (the handler composes them from cached bytes: `epp.handlers.wire`);
* an answer the handler cannot give at once (a request waiting in flow control) it gives later by calling
  `reply(answers)`, at most once per message it left unanswered; the transport sends them as they come;
* `awaiting_reply` is true while the handler owes such an answer (a transport that reads and writes one stream in
  turns waits for it before reading the next message: the proxy sends nothing more before it has the answer);
* `oversized(size)` is asked by a transport that reassembles messages from frames (`epp.transport.h2`) before it buffers
  one of `size` bytes: None to receive it, or the answers that refuse the request without it (the transport sends
  them and drops the message as it arrives); grpcio hands over whole messages only, so it never asks;
* `after_reply()` runs after each batch of answers (returned or replied) has been handed to the connection: work
  the proxy need not wait for;
* `finish()` runs exactly once when the stream ends, however it ends (end of messages, reset, disconnect, error);
  it cancels an answer still pending, and `reply` is not called after it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

Reply = Callable[[list[bytes]], None]  # serialized ProcessingResponses


class ExtProcHandler(Protocol):
    awaiting_reply: bool

    def handle(self, message: pb.ProcessingRequest) -> list[bytes]: ...

    def oversized(self, size: int) -> list[bytes] | None: ...

    def after_reply(self) -> None: ...

    def finish(self) -> None: ...


NewHandler = Callable[..., ExtProcHandler]  # (reply) or (reply, traceparent)
