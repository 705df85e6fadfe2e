"""Scheduling outcomes that become ImmediateResponses: 503 nothing can serve, 429 shed or no capacity."""


class SchedulingError(Exception):
    status = 503


class NoEndpointError(SchedulingError):
    """No ready endpoint (empty pool, nothing in the subset hint, every candidate filtered out)."""

    status = 503


class NoCapacityError(SchedulingError):
    """Endpoints exist but none can take the request now."""

    status = 429


class ShedError(NoCapacityError):
    """A sheddable request (negative priority) arrived while the pool is saturated."""
