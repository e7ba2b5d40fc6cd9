"""The policy update (DeepSpeed on GPUs; one process here)."""

from __future__ import annotations

import time
import typing

import pyarrow as pa
from flytekit import Deck, task
from flytekit.types.directory import FlyteDirectory

from dapo import pipeline, report
from images.specs import TRAINER_IMAGE
from tasks.common import DECKS, Checkpoint, cache, load_config, on_gpu, scratch_dir

StepOutput = typing.NamedTuple("StepOutput", [("policy", Checkpoint), ("metrics", dict[str, float])])


@task(
    cache=cache("policy_step"),
    container_image=TRAINER_IMAGE,
    **on_gpu(cpu="16", mem="128Gi"),
    **DECKS,
)
def policy_step(config_json: str, policy: Checkpoint, batch: pa.Table, sampling_state: str, step: int) -> StepOutput:
    """Decoupled-clip, token-level DAPO update over mini-batches; writes the next checkpoint."""
    started = time.perf_counter()
    out_dir = scratch_dir(f"policy-{step + 1}")
    state = pipeline.SamplingState.from_json(sampling_state)
    metrics = pipeline.policy_step(load_config(config_json), policy.download(), batch, state, step, out_dir)
    metrics["policy_step/seconds"] = time.perf_counter() - started
    Deck("This step", report.html_table([{"metric": k, "value": f"{v:.5g}"} for k, v in sorted(metrics.items())]))
    return StepOutput(FlyteDirectory(out_dir), metrics)
