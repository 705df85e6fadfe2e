"""Built-in scheduler plugins; importing this package registers them by type name."""

from epp.scheduling.plugins import (  # noqa: F401
    header_based_testing_filter,
    in_flight_tokens_scorer,
    kv_cache_utilization_scorer,
    lora_affinity_scorer,
    max_score_picker,
    precise_prefix_cache_scorer,
    predicted_latency_filter,
    predicted_latency_scorer,
    prefix_cache_scorer,
    queue_scorer,
    random_picker,
    running_requests_size_scorer,
    slo_headroom_filter,
    slo_interference_filter,
    weighted_random_picker,
)
