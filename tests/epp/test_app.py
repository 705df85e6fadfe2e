"""The application object (epp/app.py): the EndpointPickerConfig is read once and each part gets its sections,
every part's collector reaches the metrics page, and its servers' ports are not held until it starts."""

import asyncio
import socket

import pytest
from prometheus_client import generate_latest

from epp.app import EndpointPicker
from epp.cli import build_parser
from epp.config import ConfigError, loader
from epp.transport.h2 import GOAWAY, PREFACE, SETTINGS, frame


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def test_the_config_is_read_once_and_every_part_registers_its_metrics(tmp_path, monkeypatch):
    pool = tmp_path / "pool.yaml"
    pool.write_text("endpoints:\n- {name: a, address: 127.0.0.1, port: 8000}\n")
    config = loader.DEFAULT_CONFIG + "saturationDetector: {queueDepthThreshold: 3}\nflowControl: {maxRequests: 7}\n"
    parsed, safe_load = [], loader.yaml.safe_load
    monkeypatch.setattr(loader.yaml, "safe_load", lambda text: parsed.append(text) or safe_load(text))
    flags = ["--pool-file", str(pool), "--bind-address", "127.0.0.1", "--kv-events-port", str(free_port())]
    flags += ["--replica-peers", f"127.0.0.1:{free_port()}"]
    ports = {"--grpc-port": free_port(), "--grpc-health-port": free_port(), "--metrics-port": free_port()}
    for flag, port in ports.items():
        flags += [flag, str(port)]
    picker = EndpointPicker(build_parser().parse_args([*flags, "--config-text", config]))
    try:
        for port in ports.values():  # building the application leaves its three servers' ports free: start binds them
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", port))
        assert parsed.count(config) == 1
        assert picker.scheduler.detector.queue_depth_threshold == 3  # the scheduler's section
        assert picker.flow_control.config.max_requests == 7  # flow control's
        assert picker.subscriber is not None  # the default profile reads KV events
        assert picker.director.load_changed == picker.replicas.load_changed  # the replicas hear of every change
        assert picker.director.forward_record == picker.replicas.forward_record  # and of others' access-log records
        assert picker.replicas.match_record == picker.director.match_record
        assert picker.replicas.prefix_index is picker.scheduler.shared_prefix_index is not None
        page = generate_latest(picker.metrics.registry).decode()
        for name in (
            "inference_objective_request_total",  # the director's series
            "inference_pool_ready_pods",  # the datastore's
            "inference_extension_prefix_indexer_size",  # the scheduler's
            "inference_extension_latency_predictor_observations_total",  # its latency predictor's
            "inference_extension_flow_control_pool_saturation",  # flow control's
            "inference_extension_kv_events_index_entries",  # the KV-event subscriber's
            "inference_extension_ext_proc_buffered_body_bytes",  # the handlers' body budget's
            "inference_extension_ext_proc_connections",  # the h2 transport's
            "inference_extension_replica_peers",  # the replica channel's
        ):
            assert f"# TYPE {name} " in page
    finally:
        await picker.datastore.close()


async def test_a_replica_secret_file_that_cannot_be_read_or_is_empty_is_refused(tmp_path):
    pool = tmp_path / "pool.yaml"
    pool.write_text("endpoints:\n- {name: a, address: 127.0.0.1, port: 8000}\n")
    (tmp_path / "empty").write_text("\n")
    for secret, says in ((tmp_path / "missing", "cannot read --replica-secret-file"), (tmp_path / "empty", "is empty")):
        flags = ["--pool-file", str(pool), "--replica-peers", "127.0.0.1:9005", "--replica-secret-file", str(secret)]
        with pytest.raises(ConfigError, match=says):
            EndpointPicker(build_parser().parse_args(flags))


@pytest.mark.parametrize("transport", ["h2", "grpcio"])
async def test_the_ext_proc_port_takes_at_most_max_ext_proc_connections_over_either_transport(tmp_path, transport):
    """A connection beyond --max-ext-proc-connections is refused (h2: SETTINGS then GOAWAY; grpcio: closed at once);
    those within get the server's SETTINGS."""
    pool = tmp_path / "pool.yaml"
    pool.write_text("endpoints:\n- {name: a, address: 127.0.0.1, port: 8000}\n")
    grpc_port = free_port()
    flags = ["--pool-file", str(pool), "--bind-address", "127.0.0.1", "--kv-events-port", "0"]
    flags += ["--grpc-port", str(grpc_port), "--grpc-health-port", str(free_port()), "--metrics-port", str(free_port())]
    flags += ["--ext-proc-transport", transport, "--max-ext-proc-connections", "4"]
    picker = EndpointPicker(build_parser().parse_args(flags))
    await picker.start()
    connections = []
    try:
        for _ in range(7):
            reader, writer = await asyncio.open_connection("127.0.0.1", grpc_port)
            writer.write(PREFACE + frame(SETTINGS, 0, 0, b""))
            connections.append((reader, writer))
        heads = []  # each connection's first frame header (9 bytes), b"": closed without one
        for reader, _ in connections:
            try:
                heads.append(await asyncio.wait_for(reader.readexactly(9), 2))
            except (ConnectionError, asyncio.IncompleteReadError):
                heads.append(b"")
        kinds = [head[3] if head else None for head in heads]
        assert kinds == [SETTINGS] * 4 + ([SETTINGS] * 3 if transport == "h2" else [None] * 3)
        if transport == "h2":  # the refusal says why: a GOAWAY after the SETTINGS
            reader = connections[4][0]
            await reader.readexactly(int.from_bytes(heads[4][:3], "big"))
            assert (await asyncio.wait_for(reader.readexactly(9), 2))[3] == GOAWAY
    finally:
        for _, writer in connections:
            writer.close()
        await picker.stop()
