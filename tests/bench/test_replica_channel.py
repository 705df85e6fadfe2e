"""`epp-bench replica-channel` (two replica processes sharing over loopback, a second of requests) and the share of
a py-spy profile that `epp-bench compare --profile` reports."""

from harness.bench import compare, replica_channel


def test_two_replicas_share_and_the_run_counts_what_they_sent():
    shared = replica_channel.run(2, True, 40.0, 1.0, 4, 16)
    assert all(r.requests > 0 and r.cpu > 0 for r in shared)
    # each pick goes out at once, to the one peer, which accepts what it is sent
    for r, peer in zip(shared, reversed(shared), strict=True):
        assert r.sent >= r.requests and r.sent_bytes > 40 * r.sent and peer.accepted >= r.requests


def test_profile_shares_count_a_sample_once_per_file_and_per_channel_function(tmp_path):
    stacks = tmp_path / "epp.pyspy.txt"
    stacks.write_text(
        "run (asyncio/runners.py:118);datagram_received (epp/replicas.py:530);learn (epp/predictor/predictor.py:9) 3\n"
        "run (asyncio/runners.py:118);_send (epp/replicas.py:508);_send (epp/replicas.py:509) 1\n"
        "run (asyncio/runners.py:118);route (epp/requestcontrol/director.py:263) 4\n"
    )
    samples, shares = compare.profile_shares(stacks)
    assert samples == 8
    assert shares == {
        "epp/replicas.py": 0.5,
        "epp/replicas.py:datagram_received": 0.375,
        "epp/predictor/": 0.375,
        "epp/replicas.py:_send": 0.125,
    }
    assert compare.profile_shares(tmp_path / "missing.txt") == (0, {})
