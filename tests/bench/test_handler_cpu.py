"""`epp-bench handler-cpu`: Envoy's frames for each request drive the whole request path in process."""

from epp.bench import handler_cpu


def test_every_request_is_routed_answered_and_closed():
    result = handler_cpu.measure(requests=64, batch=1, rounds=2)
    assert result.requests == 64
    assert result.routed == 2 * 64  # every request of both rounds reached an endpoint
    assert result.open_streams == 0  # each stream ended at its RST_STREAM (the director heard the end)
    # one at a time, two answers Envoy waits for, each its own write: the routing and the response headers'
    assert result.writes_per_request == 2
    assert all(us > 0 for us in result.rounds)
    assert "2.00 writes per request" in result.markdown()


def test_a_read_of_many_requests_is_answered_in_one_write():
    result = handler_cpu.measure(requests=64, batch=16, rounds=1)
    assert result.routed == 64 and result.open_streams == 0
    assert result.writes_per_request == 2 / 16  # a write per read: the 16 routings, then the 16 response headers'
