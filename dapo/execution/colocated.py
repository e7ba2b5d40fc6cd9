"""Colocated execution: consecutive DAPO steps in one process, the trainer (model
and optimizer state) and the rollout engine resident across them.

Every step runs the per-stage path's functions (dapo.execution.stages): `sample_batch` (rollout,
verify_rewards and filter_groups rounds), `skips_update`, `train_on_batch` (the update
behind the rollout guard). What differs is the hand-over between steps: instead of a
checkpoint written by one task and read by the next (trainer start, optimizer state load,
engine reload), the trainer's new parameters go into the rollout engine in memory
(`RolloutEngine.load_weights_from_tensors`). Checkpoints in the per-stage layout (weights
and trainer state, `PolicyTrainer.save`) are written as records to resume from, not read
back while the run goes on.

Over several ranks (a torch-elastic task: trainer_nnodes x trainer_nproc_per_node) every
rank runs `run_colocated`: each is a DeepSpeed rank of one trainer, and each
tensor_parallel_size consecutive ranks form one vLLM engine (`RolloutGroups`). The
engines sample their blocks of a round's rollout shards side by side, everyone gets the
whole round, and the update, the sync (each rank loads the gathered parameters into its
engine's shard) and the checkpoints are collectives of all ranks. Rank 0 writes the
step records and reports the steps.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc

from dapo import checkpoint
from dapo.algorithm.sampling import SamplingState
from dapo.config import StepConfig
from dapo.engines.trainer.launch import prune_step_dirs
from dapo.execution.stages.generation import policy_engine, sample_batch
from dapo.execution.stages.guard import regenerate_batch
from dapo.execution.stages.training import is_bad_step, skips_update, step_metrics, stops_on_unverified, train_on_batch
from dapo.faults import crash_point
from dapo.memory import breakdown_line, memory_breakdown

logger = logging.getLogger(__name__)


@dataclass
class SampledBatch:
    """A step's batch sampled one step off policy (dapo.execution.overlap), with its sampling state."""

    batch: pa.Table
    state: SamplingState
    policy_version: int
    """The updates behind the weights that sampled it: step - policy_version is its staleness."""


@dataclass
class ColocatedResult:
    checkpoint_dir: str
    """The checkpoint after the last step run (out_root/policy-<step + 1>)."""
    step_metrics: list[dict[str, float]] = field(default_factory=list)
    """Per step: the per-stage path's metrics, plus policy_step/seconds (update and sync) and
    sync/seconds (the in-memory weight sync; absent when the engine needed none: no update,
    its memory kept)."""
    next_batch: SampledBatch | None = None
    """One step off policy (dapo.execution.overlap): the batch of the step after the last one run."""


@dataclass(frozen=True)
class RolloutGroups:
    """The rollout engines of a colocated run over several ranks. Ranks [k * tp, (k + 1) * tp)
    form engine k (tp = tensor_parallel_size; vLLM's external launcher numbers its
    data-parallel ranks so), which samples a contiguous block of each round's shards: in
    shard order, the engines' blocks are the round as one process would sample it. The
    engine's first rank (its leader) scores the block and hands it to all ranks."""

    rank: int
    world_size: int
    tensor_parallel_size: int

    @property
    def count(self) -> int:
        return self.world_size // self.tensor_parallel_size

    @property
    def index(self) -> int:
        return self.rank // self.tensor_parallel_size

    @property
    def leader(self) -> bool:
        return self.rank % self.tensor_parallel_size == 0

    def shards(self, n_shards: int) -> range:
        """This engine's block of a round's shards (config validation: n_shards % count == 0)."""
        per_engine = n_shards // self.count
        return range(self.index * per_engine, (self.index + 1) * per_engine)

    def gather(self, table: pa.Table | None) -> list[pa.Table]:
        """Every leader's table (schema metadata kept), in engine order, on every rank: a
        collective that all ranks call, the leaders with their table, the others with None."""
        import torch.distributed as dist

        payload = None
        if table is not None:
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, table.schema) as writer:
                writer.write_table(table)
            payload = sink.getvalue().to_pybytes()
        everyone: list[bytes | None] = [None] * self.world_size
        dist.all_gather_object(everyone, payload)
        return [pa.ipc.open_stream(p).read_all() for p in everyone if p is not None]


STEP_RECORDS = "steps"
"""out_root/steps/<step>.json: the metrics of each completed step."""


def run_colocated(
    config: StepConfig,
    policy_dir: str,
    data_dir: str,
    first_step: int,
    n_steps: int,
    out_root: str | Path,
    checkpoint_every: int = 1,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> ColocatedResult:
    """Steps [first_step, first_step + n_steps) in this process, from policy_dir's checkpoint
    (its trainer state resumed when present).

    Each step leaves a record in out_root as it completes: its metrics (steps/<step>.json),
    then, every checkpoint_every steps and after the last, its checkpoint (policy-<step + 1>:
    weights and trainer state, the per-stage layout; only the newest is kept). Called again
    on the same out_root (the process was killed, the task run again, or the run extended
    so that the chunk has more steps), it goes on after the newest checkpoint there: the
    steps up to it are not run again and their metrics are read back.
    checkpoint_every=1 loses no finished step; a larger one writes less and reruns up to
    that many steps.

    on_step(step, metrics) is called on rank 0 as each step completes, after its record
    (e.g. to log it to MLflow while the run goes on). Over several ranks out_root is one
    directory for all of them (one node's disk, or a volume all nodes mount).

    The run ends early, its checkpoint written, after a step the rollout guard stops
    (guard/stopped), or after config.max_bad_steps consecutive bad steps (no update
    applied, some refused as non-finite): the caller then raises as per stage
    (check_rollout_guard, count_bad_steps), and a long chunk does not go on sampling
    from a policy that no longer trains.
    """
    from dapo.engines.trainer import make_trainer

    out_root = Path(out_root)
    result = completed_steps(out_root, first_step, n_steps)
    done = len(result.step_metrics)
    if done == n_steps or stops_the_run(config, result.step_metrics):
        return result
    if done:
        policy_dir = result.checkpoint_dir
        logger.info(
            "resuming after step %d from %s (%d of %d steps were done)",
            first_step + done - 1,
            policy_dir,
            done,
            n_steps,
        )
    trainer = make_trainer(config, policy_dir)  # first: under a launcher it sets up the ranks' process group
    groups = (
        RolloutGroups(trainer.rank, trainer.world_size, config.tensor_parallel_size) if trainer.world_size > 1 else None
    )
    engine = policy_engine(config, policy_dir, colocated=True)
    try:
        for step in range(first_step + done, first_step + n_steps):
            batch, state = sample_batch(config, policy_dir, data_dir, step, engine=engine, groups=groups)
            # the trainer may use the engine's GPU memory until the sync (where the engine can free it)
            engine.release_memory()
            started = time.perf_counter()
            metrics, trained = update_on_batch(config, trainer, batch, state, step, out_root)
            if metrics["guard/regenerated"]:
                # the regeneration's fresh engine
                engine = policy_engine(config, str(out_root / f"regenerate-{step}"), colocated=True)
            if trained or engine.released:  # a released engine gets the weights back even if the update was skipped
                synced = time.perf_counter()
                engine.load_weights_from_tensors(trainer.named_weights())
                metrics["sync/seconds"] = time.perf_counter() - synced
            metrics["policy_step/seconds"] = time.perf_counter() - started
            if (
                step == first_step + done and trainer.is_main and trainer.device.type == "cpu"
            ):  # host memory: a CPU run's
                print(breakdown_line(memory_breakdown(config, trainer, engine), config, engine), flush=True)
            if finish_step(
                config, trainer, out_root, result, first_step, n_steps, step, metrics, checkpoint_every, on_step
            ).stop:
                break
    finally:
        trainer.close()
    return result


def update_on_batch(
    config: StepConfig, trainer, batch: pa.Table, state, step: int, out_root: Path
) -> tuple[dict[str, float], bool]:
    """A resident trainer's update on the step's batch, behind the rollout guard (a refused
    batch is regenerated by a fresh engine on the trainer's weights, read from
    out_root/regenerate-<step>). Returns the step's metrics (step/skipped set) and whether
    the policy was updated."""
    metrics = step_metrics(config, batch, state)
    scratch = out_root / f"regenerate-{step}"
    regenerate = functools.partial(regenerate_on_trainer_weights, config, trainer, step=step, scratch_dir=scratch)
    trained = (
        not stops_on_unverified(config, state, step, metrics)
        and not skips_update(config, batch, state, step)
        and train_on_batch(trainer, config, batch, step, metrics, regenerate, str(scratch))
    )
    crash_point("policy_step", step)
    if not trained:
        metrics["step/skipped"] = 1.0
    return metrics, trained


@dataclass(frozen=True)
class FinishedStep:
    stop: bool
    """The run ends after this step (stops_the_run)."""
    checkpointed: bool
    """Its checkpoint (policy-<step + 1>) was written."""


def finish_step(
    config: StepConfig,
    trainer,
    out_root: Path,
    result: ColocatedResult,
    first_step: int,
    n_steps: int,
    step: int,
    metrics: dict[str, float],
    checkpoint_every: int,
    on_step: Callable[[int, dict[str, float]], None] | None,
) -> FinishedStep:
    """A resident trainer's step after its update: its record, its checkpoint when due (every
    checkpoint_every steps, after the chunk's last and after a step that stops the run;
    only the newest is kept), then on_step on rank 0."""
    if trainer.is_main:
        write_step_record(out_root, step, metrics)
    result.step_metrics.append(metrics)
    done = step + 1 - first_step
    stop = stops_the_run(config, result.step_metrics)
    checkpointed = done == n_steps or stop or done % max(1, checkpoint_every) == 0
    if checkpointed:
        result.checkpoint_dir = str(out_root / f"policy-{step + 1}")
        trainer.save(result.checkpoint_dir, step=step)
        if trainer.is_main:  # a resume needs the newest checkpoint only (the trainer holds its serving files)
            prune_step_dirs(out_root, keep=1)
            prune_step_dirs(out_root, keep=0, prefix="regenerate-")  # read by a fresh engine, in memory now
    if on_step and trainer.is_main:
        on_step(step, metrics)
    if stop:
        logger.error(
            "step %d: the run stops after %d of %d steps of its chunk (%s)",
            step,
            done,
            n_steps,
            "the rollout guard"
            if metrics["guard/stopped"]
            else "unverified verdicts"
            if metrics["reward/stopped"]
            else f"{config.max_bad_steps} bad steps in a row",
        )
    return FinishedStep(stop, checkpointed)


def stops_the_run(config: StepConfig, step_metrics: list[dict[str, float]]) -> bool:
    """Whether the last of these steps ends the run: the rollout guard or the unverified
    verdicts stopped it, or it is the config.max_bad_steps-th bad step in a row."""
    if not step_metrics:
        return False
    trailing_bad = 0
    for metrics in reversed(step_metrics):
        if not is_bad_step(metrics):
            break
        trailing_bad += 1
    return (
        bool(step_metrics[-1]["guard/stopped"] or step_metrics[-1]["reward/stopped"])
        or trailing_bad >= config.max_bad_steps
    )


def write_step_record(out_root: Path, step: int, metrics: dict[str, float]) -> None:
    """steps/<step>.json, written whole or not at all."""
    records = out_root / STEP_RECORDS
    records.mkdir(parents=True, exist_ok=True)
    scratch = records / f".{step}.json.tmp"
    scratch.write_text(json.dumps(metrics, sort_keys=True))
    os.replace(scratch, records / f"{step}.json")


def completed_steps(out_root: Path, first_step: int, n_steps: int) -> ColocatedResult:
    """What an earlier run on out_root finished: its newest complete checkpoint among these
    steps and the metrics of every step up to it (an empty result when there is none)."""
    for step in reversed(range(first_step, first_step + n_steps)):
        checkpoint_dir = out_root / f"policy-{step + 1}"
        if checkpoint.is_complete(checkpoint_dir):
            metrics = [
                json.loads((out_root / STEP_RECORDS / f"{s}.json").read_text()) for s in range(first_step, step + 1)
            ]
            return ColocatedResult(str(checkpoint_dir), metrics)
    return ColocatedResult(checkpoint_dir="")


def regenerate_on_trainer_weights(
    config: StepConfig, trainer, batch: pa.Table, step: int, scratch_dir: Path
) -> pa.Table:
    """The colocated rollout guard's second try: the refused batch regenerated by a rollout
    engine started fresh on the trainer's weights, which it reads from files (scratch_dir)."""
    trainer.save(str(scratch_dir))
    return regenerate_batch(config, str(scratch_dir), batch, step, colocated=True)
