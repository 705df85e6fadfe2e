"""Protobuf's varint, shared by the EPP's two writers of protobuf bytes by hand: the ext_proc answers
(`epp/handlers/wire.py`) and the OTLP spans (`epp/requestcontrol/tracing.py`). A leaf of the EPP's layers, so that
both may import it (request control may not import the handlers)."""

from __future__ import annotations

# The varints of one and two bytes, made once: every length of a field up to 16 KiB (a span is a few hundred bytes).
# A hot path indexes VARINTS itself below CACHED, saving the call.
CACHED = 1 << 14
VARINTS = [bytes((n,)) if n < 0x80 else bytes(((n & 0x7F) | 0x80, n >> 7)) for n in range(CACHED)]


def varint(value: int) -> bytes:
    """A non-negative integer as a protobuf varint (7 bits a byte, least significant first)."""
    if value < CACHED:
        return VARINTS[value]
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
