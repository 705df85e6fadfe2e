"""Endpoints with given metrics, for scheduler and server tests; the ext_proc handler with parsed answers; waiting
for a condition without assuming how fast a loaded machine gets there."""

import asyncio

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.datalayer.endpoint import Endpoint, EndpointSpec
from epp.handlers.extproc import RequestStream
from protocol.metrics import EndpointMetrics


def endpoint(
    i: int,
    waiting=0,
    running=0,
    kv=0.0,
    running_adapters=(),
    waiting_adapters=(),
    max_lora=None,
    stale=False,
    in_flight=0,
    in_flight_tokens=0,
    block_size=16,
    num_gpu_blocks=1000,
) -> Endpoint:
    metrics = EndpointMetrics(
        waiting=waiting,
        running=running,
        kv_usage=kv,
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        max_lora=max_lora,
        running_adapters=frozenset(running_adapters),
        waiting_adapters=frozenset(waiting_adapters),
    )
    return Endpoint(
        EndpointSpec(f"e{i}", "127.0.0.1", 8000 + i),
        metrics,
        stale=stale,
        in_flight_requests=in_flight,
        in_flight_tokens=in_flight_tokens,
    )


class ParsedStream(RequestStream):
    """The ext_proc handler with its answers parsed, for assertions on their fields (the transports get the bytes)."""

    def __init__(self, director, reply, *args, **kwargs):
        super().__init__(director, lambda answers: reply(parsed(answers)), *args, **kwargs)

    def handle(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        return parsed(super().handle(message))

    def oversized(self, size: int) -> list[pb.ProcessingResponse] | None:
        answers = super().oversized(size)
        return None if answers is None else parsed(answers)


def parsed(answers: list[bytes]) -> list[pb.ProcessingResponse]:
    assert all(type(a) is bytes for a in answers)
    return [pb.ProcessingResponse.FromString(a) for a in answers]


async def until(condition, timeout: float = 5.0) -> None:
    """Returns once `condition()` holds; fails after `timeout` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)
