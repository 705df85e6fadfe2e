"""The EPP's servers. The ext_proc transports are gRPC servers that drive the handlers of `epp.handlers` through its
interface: `h2` is the EPP's own HTTP/2 server on the event loop (the default); `grpcio` is grpcio aio's (TLS,
reflection). The metrics and status port's listener is `protocol.http_listener`, shared with the model server. Here what
the transports share: the warning of a gRPC message refused over its size limit."""

from __future__ import annotations

from protocol.limits import RepeatedWarning


def oversized_messages() -> RepeatedWarning:
    """gRPC messages a transport refused unread over their method's size limit (RESOURCE_EXHAUSTED); `note(type
    name, length, limit)`. A gateway whose access-log batches are too large loses their records: its operator needs
    to see why."""
    return RepeatedWarning(
        "epp.transport",
        "refused a %d-byte %s over its limit of %d bytes; for the access log's Export, lower the gateway's "
        "buffer_size_bytes (%d so far)",
    )
