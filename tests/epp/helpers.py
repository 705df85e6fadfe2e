"""Endpoints with given metrics, for scheduler and server tests."""

from epp.datalayer.endpoint import Endpoint, EndpointSpec
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
