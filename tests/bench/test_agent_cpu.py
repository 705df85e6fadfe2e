from harness.bench import agent_cpu


def test_every_agent_request_is_routed_and_a_context_stays_where_its_blocks_are(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    result = agent_cpu.measure(rate=1.0, duration=3.0, profile=5)
    assert result.requests > 10 and result.routed == result.requests
    assert result.body_bytes > 10_000  # the shared tools prompt in every body
    # the precise prefix scorer follows each context's blocks, as in a live pool (load ties aside)
    assert result.stayed > 0.6
    assert "ms of CPU per request (under cProfile)" in result.markdown() and "tottime" in result.profile
