"""The access-log handler applies an Export's records a slice per turn of the event loop, in order, answering the
Export at once; a request read beside an Export is answered before any of its records is applied."""

import asyncio

from hpack import Encoder

from epp.handlers import accesslog
from epp.transport.h2 import (
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    PREFACE,
    SETTINGS,
    ExtProcConnection,
    ExtProcServer,
    UnaryMethod,
    frame,
    grpc_message,
)
from harness.bench.handler_cpu import EXPORT_HEADERS, GRPC_REQUEST_HEADERS
from tests.epp.test_grpc_h2 import RecordingTransport
from tests.epp.test_transports import EchoHandler, headers


def records(count: int, start: int = 0) -> list[tuple[str, dict[str, str]]]:
    return [(f"r{i}", {accesslog.TTFT_ATTRIBUTE: "1500"}) for i in range(start, start + count)]


def applied_ids(applied: list[tuple]) -> list[str]:
    return [record[0] for record in applied]


async def test_an_exports_records_are_applied_a_slice_per_loop_turn_in_the_order_they_came():
    applied = []
    handler = accesslog.ExportHandler(lambda *record: applied.append(record), per_turn=4)
    handler(records(10))
    handler(records(3, start=10))
    assert applied == []  # answered at once, nothing applied yet
    await asyncio.sleep(0)
    assert applied_ids(applied) == ["r0", "r1", "r2", "r3"]
    await asyncio.sleep(0)
    assert len(applied) == 8
    for _ in range(3):
        await asyncio.sleep(0)
    assert applied_ids(applied) == [f"r{i}" for i in range(13)]
    assert applied[0] == ("r0", 0.0015, "", None)
    assert handler.loop is None and not handler.pending  # nothing scheduled once drained


def test_without_a_running_loop_an_export_is_applied_at_once():
    applied = []
    accesslog.ExportHandler(lambda *record: applied.append(record), per_turn=2)(records(5))
    assert applied_ids(applied) == [f"r{i}" for i in range(5)]


async def test_over_max_pending_the_oldest_records_are_applied_at_once():
    """A loop that cannot keep up holds a bounded backlog: beyond `max_pending` the oldest go through at once."""
    applied = []
    handler = accesslog.ExportHandler(lambda *record: applied.append(record), per_turn=2, max_pending=5)
    handler(records(12))
    assert applied_ids(applied) == [f"r{i}" for i in range(7)] and len(handler.pending) == 5
    for _ in range(3):
        await asyncio.sleep(0)
    assert applied_ids(applied) == [f"r{i}" for i in range(12)]


async def test_a_record_whose_handling_raises_does_not_strand_the_ones_after_it():
    applied, errors = [], []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context["exception"]))

    def on_record(request_id, *rest):
        if request_id == "r1":
            raise RuntimeError("boom")
        applied.append(request_id)

    handler = accesslog.ExportHandler(on_record, per_turn=2)
    handler(records(5))
    for _ in range(4):
        await asyncio.sleep(0)
    assert applied == ["r0", "r2", "r3", "r4"]  # only the failing record is lost
    assert [str(e) for e in errors] == ["boom"]


async def test_a_request_read_beside_an_export_is_answered_before_the_exports_records_are_applied():
    """Envoy sends its access log on the EPP's ext_proc connection: one read can hold an Export and a request's
    message. The request's answer is written in that read's turn; the records follow, a slice a turn."""
    applied = []
    export = UnaryMethod(
        accesslog.ExportRecords,
        accesslog.ExportHandler(lambda *record: applied.append(record)),
        accesslog.MAX_EXPORT_BYTES,
    )
    connection = ExtProcConnection(ExtProcServer(EchoHandler, {accesslog.EXPORT_PATH: export}))
    transport = RecordingTransport()
    connection.connection_made(transport)
    connection.data_received(PREFACE + frame(SETTINGS, 0, 0))
    encoder = Encoder()
    message = accesslog.export_request((f"r{i}", "1500") for i in range(100)).SerializeToString()
    read = (
        frame(HEADERS, END_HEADERS, 1, encoder.encode(EXPORT_HEADERS))
        + frame(DATA, END_STREAM, 1, grpc_message(message))
        + frame(HEADERS, END_HEADERS, 3, encoder.encode(GRPC_REQUEST_HEADERS))
        + frame(DATA, 0, 3, grpc_message(headers().SerializeToString()))
    )
    written_before = len(transport.written)
    connection.data_received(read)
    assert transport.written[written_before:].find(b"x-seen") > 0  # the request's answer went out in this turn
    assert applied == []
    for _ in range(100 // accesslog.RECORDS_PER_TURN + 1):
        await asyncio.sleep(0)
    assert applied_ids(applied) == [f"r{i}" for i in range(100)]
