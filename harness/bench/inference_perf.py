"""inference-perf (the Kubernetes serving working group's benchmark client) as the load generator of a comparison
run, so a standard client's numbers stand beside our own generator's.

inference-perf needs Python >= 3.12, so it lives in its own virtual environment: `make bench-inference-perf` builds
`.venv-ip` with pyenv's 3.12. It is found through $INFERENCE_PERF, then `.venv-ip/bin/inference-perf`, then PATH.
Only the shared-prefix workloads map onto an inference-perf data generator (`shared_prefix`, multi-turn included);
its prompts are its own (same shape: groups, prompts per group, system prompt, question and output lengths), and
tokens are counted with our built-in tokenizer, written out as a Hugging Face tokenizer directory.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import yaml

from protocol.tokenizer import save_tokenizer

REPO = Path(__file__).resolve().parents[2]


def command() -> str | None:
    for candidate in (os.environ.get("INFERENCE_PERF"), str(REPO / ".venv-ip" / "bin" / "inference-perf")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("inference-perf")


def config(
    spec: dict,
    base_url: str,
    model: str,
    rate: float,
    concurrency: int,
    duration: float,
    scale: float,
    tokenizer: Path,
    reports: Path,
    seed: int = 0,
) -> dict:
    """inference-perf's config for one run of the workload `spec` against `base_url`."""
    if spec["name"] != "shared-prefix":
        raise SystemExit(f"--load-generator inference-perf runs the shared-prefix workloads only, not {spec['name']!r}")
    if concurrency:
        requests = max(1, int(concurrency * duration))  # about one request per client per second of the run
        load = {"type": "concurrent", "stages": [{"num_requests": requests, "concurrency_level": concurrency}]}
    else:
        load = {"type": "poisson", "stages": [{"rate": rate, "duration": max(1, round(duration))}]}
    load["num_workers"] = 1  # one client process: the 2-core machine is shared with the pool and the router
    return {
        "api": {"type": "completion", "streaming": True},
        "data": {
            "type": "shared_prefix",
            "shared_prefix": {
                "num_groups": spec["groups"],
                "num_prompts_per_group": spec["prompts_per_group"],
                "system_prompt_len": max(1, int(spec["system_prompt_tokens"] * scale)),
                "question_len": spec["question_tokens"],
                "output_len": spec["output_tokens"],
                "seed": seed,
                "enable_multi_turn_chat": bool(spec.get("multi_turn")),
            },
        },
        "load": load,
        "server": {"type": "vllm", "model_name": model, "base_url": base_url, "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": str(tokenizer)},
        "storage": {"local_storage": {"path": str(reports)}},
    }


async def run(
    spec: dict,
    base_url: str,
    model: str,
    rate: float,
    concurrency: int,
    duration: float,
    scale: float,
    workdir: Path,
    seed: int = 0,
) -> dict:
    """Runs inference-perf once; returns its summary_lifecycle_metrics.json."""
    executable = command()
    if executable is None:
        raise SystemExit("inference-perf is not installed: run `make bench-inference-perf` (or set $INFERENCE_PERF)")
    tokenizer, reports = workdir / "tokenizer", workdir / "inference-perf"
    save_tokenizer(tokenizer)
    path = workdir / "inference-perf.yaml"
    path.write_text(
        yaml.safe_dump(config(spec, base_url, model, rate, concurrency, duration, scale, tokenizer, reports, seed))
    )
    with (workdir / "inference-perf.log").open("wb") as log:
        process = await asyncio.create_subprocess_exec(executable, "-c", str(path), stdout=log, stderr=log, cwd=workdir)
        code = await process.wait()
    summary = reports / "summary_lifecycle_metrics.json"
    if code != 0 or not summary.is_file():
        raise SystemExit(f"inference-perf failed (exit {code}); see {workdir / 'inference-perf.log'}")
    return json.loads(summary.read_text())


def ms(distribution: dict | None) -> dict[str, float]:
    """inference-perf's seconds distribution as our summary in milliseconds."""
    if not distribution:
        return {}
    return {
        "p50": distribution["median"] * 1e3,
        "p90": distribution["p90"] * 1e3,
        "p99": distribution["p99"] * 1e3,
        "mean": distribution["mean"] * 1e3,
    }
