"""An in-process model server (sim backend) on a free loopback port."""

from dataclasses import dataclass

import pytest

from modelserver.api.server import ModelServer, ServerSettings
from modelserver.engine.config import EngineConfig
from modelserver.engine.engine import AsyncEngine
from modelserver.engine.sim import SimExecutor, SimTiming
from modelserver.metrics import PrometheusStatLogger
from protocol.tokenizer import load_tokenizer
from tests.conftest import free_ports

MODEL = "sim-model"


@dataclass
class RunningServer:
    url: str
    engine: AsyncEngine
    server: ModelServer

    async def stop(self) -> None:
        await self.server.stop()
        await self.engine.stop()


async def start_server(
    tmp_path,
    timing: SimTiming | None = None,
    max_request_body_bytes: int = 2 * 1024 * 1024,
    max_buffered_body_bytes: int = ServerSettings.max_buffered_body_bytes,
    **config,
) -> RunningServer:
    tokenizer = load_tokenizer(None)
    cfg = EngineConfig(**{"num_gpu_blocks": 2048, "max_model_len": 4096, "enable_lora": True, "max_loras": 1, **config})
    timing = timing or SimTiming(prefill_overhead=0.001, prefill_time_per_token=0.00002, decode_base=0.002)
    executor = SimExecutor(timing, cfg.block_size, cfg.num_gpu_blocks, tokenizer.filler_token_ids())
    (tmp_path / "loras" / "sql").mkdir(parents=True, exist_ok=True)
    engine = AsyncEngine(
        cfg,
        executor,
        model_name=MODEL,
        stat_loggers=[PrometheusStatLogger(cfg, MODEL)],
        lora_modules={"sql": str(tmp_path / "loras" / "sql")},
    )
    await engine.start()
    settings = ServerSettings(
        served_model_name=MODEL,
        model_path=MODEL,
        max_model_len=cfg.max_model_len,
        lora_roots=[str(tmp_path / "loras")],
        allow_runtime_lora_updating=True,
        max_request_body_bytes=max_request_body_bytes,
        max_buffered_body_bytes=max_buffered_body_bytes,
    )
    server = ModelServer(engine, tokenizer, settings)
    (port,) = free_ports(1)
    await server.start("127.0.0.1", port)
    return RunningServer(f"http://127.0.0.1:{port}", engine, server)


@pytest.fixture
async def model_server(tmp_path):
    running = await start_server(tmp_path)
    try:
        yield running
    finally:
        await running.stop()
