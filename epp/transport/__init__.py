"""The EPP's servers. The ext_proc transports are gRPC servers that drive the handlers of `epp.handlers` through its
interface: `h2` is the EPP's own HTTP/2 server on the event loop (the default); `grpcio` is grpcio aio's (TLS,
reflection). `http` is the metrics and status port's listener. Here what they share: the counted warnings of what a
peer can repeat at will (a refused message, connection, ...)."""

from __future__ import annotations

import logging


class RepeatedWarning:
    """An event a peer can repeat at will, worth an operator's attention: counted, and logged at the first and at
    every thousandth (with the count so far, the message's last argument), so that it is seen without flooding the
    log."""

    __slots__ = ("count", "logger", "message")

    def __init__(self, logger: str, message: str) -> None:
        self.count = 0
        self.logger = logging.getLogger(logger)
        self.message = message

    def note(self, *args: object) -> None:
        if self.count % 1000 == 0:
            self.logger.warning(self.message, *args, self.count + 1)
        self.count += 1


def oversized_messages() -> RepeatedWarning:
    """gRPC messages a transport refused unread over their method's size limit (RESOURCE_EXHAUSTED); `note(type
    name, length, limit)`. A gateway whose access-log batches are too large loses their records: its operator needs
    to see why."""
    return RepeatedWarning(
        "epp.transport",
        "refused a %d-byte %s over its limit of %d bytes; for the access log's Export, lower the gateway's "
        "buffer_size_bytes (%d so far)",
    )
