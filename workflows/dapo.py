"""dapo_loop: DAPO as a cached, resumable Flyte DAG.

    resolve_config -> prepare_data -> start_tracking -> train -> finish_tracking
    train (dynamic)       = bootstrap_policy, evaluate(0) + register_model, then a chain
                            of train_chunk nodes, steps_per_chunk steps each
    train_chunk (dynamic) = per step: sample_round, then up to max_num_gen_batches-1
                            conditional sample_rounds (taken only while the batch is
                            short; once it is full, keep_round echoes it through without
                            a pod), policy_step, log_step, and every val_every steps
                            evaluate + register_model; one step off policy, step t+1's
                            rounds read step t's input checkpoint (they run beside it)
    sample_round          = rollout and verify_rewards as map tasks (ArrayNodes) over
                            rollout_shards shards, then filter_groups over all shards

Every pod is shaped by the run's config: the dynamic workflows build the nodes they
emit with `with_overrides` from it (GPUs = tensor_parallel_size per rollout pod, the
trainer's nodes and GPUs, disk from model_size_billions, the GPU type, retries,
timeouts; tasks.common.node_settings). Nothing is read from the registering machine's
environment, which the pods never see. The dynamic workflows themselves run in the CPU
image, which can import every task module.

Why this shape: the step loop has a fixed length, so it is unrolled, in chunks, so
that no dynamic workflow holds more than a few hundred nodes (the workflow CRD lives
in etcd); the dynamic-sampling rounds are data-dependent, so they are conditional
branches on the filter's `done` output rather than recursion, which keeps the
nesting depth at 4 whatever the number of rounds or steps. A 1,000-step run with
the paper's 10 rounds is 100 chunk nodes of ~150 nodes each.

Run locally: pyflyte run workflows/dapo.py dapo_loop
On a cluster: pyflyte run --remote --copy all workflows/dapo.py dapo_loop --preset paper_32b ...
"""

from __future__ import annotations

import functools
import json
import typing

import pyarrow as pa
from flytekit import Resources, conditional, dynamic, map_task, workflow
from flytekit.core.workflow import PythonFunctionWorkflow
from flytekit.types.directory import FlyteDirectory
from flytekit.types.structured import StructuredDataset

from dapo.algorithm.sampling import SamplingState
from dapo.config import DAPOConfig, ModelConfig, StepConfig
from dapo.execution.schedule import chunk_ranges, is_validation_step
from dapo.tracking import RunTarget
from images.specs import CPU_IMAGE
from tasks.common import (
    Checkpoint,
    bootstrap_settings,
    colocated_settings,
    cpu_settings,
    registry_settings,
    rollout_settings,
    trainer_settings,
)
from tasks.config import resolve_config
from tasks.data import bootstrap_policy, prepare_data
from tasks.evaluate import evaluate
from tasks.rollout import (
    RoundResult,
    filter_groups,
    keep_batch,
    keep_done,
    keep_sampling_state,
    rollout,
    verify_rewards,
)
from tasks.tracking import (
    LoopState,
    RunSummary,
    end_failed_run,
    finish_tracking,
    log_chunk,
    log_step,
    register_model,
    start_tracking,
)
from tasks.train import colocated_chunk_for, policy_step_for

DYNAMIC_POD = {"container_image": CPU_IMAGE, "requests": Resources(cpu="1", mem="2Gi")}
"""Where the dynamic workflows run: they only build the DAG of their nodes."""


def sample_round_workflow(config: DAPOConfig) -> PythonFunctionWorkflow:
    """One generation round as a sub-workflow whose pods are shaped by the run's config:
    rollout and verify_rewards mapped over the shards (ArrayNodes: one rollout pod and
    one reward pod per shard), then filter_groups on all shards."""
    return _sample_round_workflow(config.to_json())


@functools.lru_cache(maxsize=8)
def _sample_round_workflow(config_json: str) -> PythonFunctionWorkflow:
    config = DAPOConfig.from_dict(json.loads(config_json))
    rollout_pod, reward_pod, filter_pod = (
        rollout_settings(config),
        cpu_settings(config, cpu=4, mem_gib=8),
        cpu_settings(config),
    )

    def sample_round(
        step_config: StepConfig,
        policy: Checkpoint,
        data: FlyteDirectory,
        step: int,
        round_index: int,
        shards: list[int],
        kept: pa.Table | None,
        sampling_state: SamplingState,
    ) -> RoundResult:
        responses = map_task(
            functools.partial(rollout, config=step_config, policy=policy, data=data, step=step, round_index=round_index)
        )(shard=shards).with_overrides(**rollout_pod)
        scored = map_task(functools.partial(verify_rewards, config=step_config, step=step))(
            responses=responses
        ).with_overrides(**reward_pod)
        return filter_groups(
            config=step_config, scored=scored, kept=kept, sampling_state=sampling_state
        ).with_overrides(**filter_pod)

    # One name whatever the config: the function is made here, not at module level.
    sample_round.__qualname__ = sample_round.__name__
    return workflow(sample_round)


@workflow
def keep_round(batch: pa.Table, sampling_state: SamplingState, done: bool) -> RoundResult:
    """The branch of a round once the batch is full: the round's result passes on unchanged,
    through echo tasks (no pod, no data moved)."""
    return keep_batch(batch=batch), keep_sampling_state(sampling_state=sampling_state), keep_done(done=done)


def evaluate_and_register(
    config: DAPOConfig,
    step_config: StepConfig,
    target: RunTarget,
    loop_state,
    policy,
    data,
    step: int,
    model_name: str,
):
    """evaluate (a rollout-shaped pod) then register_model; returns the new loop state."""
    eval_metrics, samples = evaluate(config=step_config, policy=policy, data=data, step=step).with_overrides(
        **rollout_settings(config)
    )
    return register_model(
        target=target,
        loop_state=loop_state,
        policy=policy,
        step=step,
        eval_metrics=eval_metrics,
        samples=samples,
        model_name=model_name,
    ).with_overrides(**registry_settings(config))


def sample_step(config: DAPOConfig, step_config: StepConfig, policy, data, step: int):
    """A step's generation rounds on `policy`: a sample_round, then up to max_num_gen_batches-1
    conditional ones (taken only while the batch is short; once it is full, keep_round echoes
    it through without a pod). Returns the batch and its sampling state."""
    shards = list(range(config.rollout_shards))
    sample_round = sample_round_workflow(config)
    batch, sampling_state, done = sample_round(
        step_config=step_config,
        policy=policy,
        data=data,
        step=step,
        round_index=0,
        shards=shards,
        kept=None,
        sampling_state=SamplingState(),
    )
    for round_index in range(1, config.max_num_gen_batches if config.dynamic_sampling else 1):
        batch, sampling_state, done = (
            conditional(f"step_{step}_round_{round_index}")
            .if_(done.is_false())
            .then(
                sample_round(
                    step_config=step_config,
                    policy=policy,
                    data=data,
                    step=step,
                    round_index=round_index,
                    shards=shards,
                    kept=batch,
                    sampling_state=sampling_state,
                )
            )
            .else_()
            .then(keep_round(batch=batch, sampling_state=sampling_state, done=done))
        )
    return batch, sampling_state


class ChunkOutput(typing.NamedTuple):
    policy: Checkpoint
    loop_state: LoopState
    next_batch: StructuredDataset | None
    next_batch_state: SamplingState | None


class TrainOutput(typing.NamedTuple):
    policy: Checkpoint
    loop_state: LoopState


class DapoResult(typing.NamedTuple):
    policy: Checkpoint
    summary: RunSummary


@dynamic(**DYNAMIC_POD)
def train_chunk(
    config: DAPOConfig,
    step_config: StepConfig,
    target: RunTarget,
    data: FlyteDirectory,
    policy: Checkpoint,
    loop_state: LoopState,
    first_step: int,
    last_step: int,
    model_name: str,
    next_batch: StructuredDataset | None = None,
    next_batch_state: SamplingState | None = None,
) -> ChunkOutput:
    """Steps [first_step, last_step) unrolled; the policy step task is chosen from the
    config's trainer shape (tasks.train.policy_step_for). The pods are shaped from the
    whole config; the tasks get the step config (their cache key). With
    execution="colocated" the steps run in one colocated_chunk task instead.

    One step off policy (off_policy_steps=1) the rollout of step t+1 reads checkpoint t,
    the input of step t's policy step, so Flyte runs them side by side; next_batch (with
    its sampling state) is the chunk's first batch, sampled by the chunk before, and the
    output next_batch the one after the chunk (a StructuredDataset: the dynamic workflow
    passes it on without reading it). On policy they are None."""
    if config.execution == "colocated":
        return colocated_steps(
            config,
            step_config,
            target,
            data,
            policy,
            loop_state,
            first_step,
            last_step,
            model_name,
            next_batch,
            next_batch_state,
        )
    policy_step = policy_step_for(config)
    upcoming = (next_batch, next_batch_state) if next_batch is not None and next_batch_state is not None else None
    for step in range(first_step, last_step):
        batch, sampling_state = upcoming or sample_step(config, step_config, policy, data, step)
        upcoming = sample_step(config, step_config, policy, data, step + 1) if config.off_policy_steps else None
        policy, metrics = policy_step(
            config=step_config, policy=policy, batch=batch, sampling_state=sampling_state, step=step
        ).with_overrides(**trainer_settings(config))
        loop_state = log_step(
            config=step_config, target=target, loop_state=loop_state, step=step + 1, step_metrics=metrics
        ).with_overrides(**cpu_settings(config))
        if is_validation_step(step + 1, config.val_every, config.total_steps):
            loop_state = evaluate_and_register(
                config, step_config, target, loop_state, policy, data, step + 1, model_name
            )
    return ChunkOutput(policy, loop_state, *(upcoming or (None, None)))


def colocated_steps(
    config: DAPOConfig,
    step_config: StepConfig,
    target: RunTarget,
    data,
    policy,
    loop_state,
    first_step: int,
    last_step: int,
    model_name: str,
    first_batch,
    first_batch_state: SamplingState | None,
):
    """The chunk's steps in one colocated_chunk task (one pod, or the trainer's elastic ranks:
    tasks.train.colocated_chunk_for), then log_chunk; validated on the chunk's last
    checkpoint when that is a validation step (chunk_ranges ends a colocated chunk at each)."""
    chunk = colocated_chunk_for(config)
    policy, metrics, outbox, next_batch, next_batch_state = chunk(
        config=step_config,
        target=target,
        policy=policy,
        data=data,
        first_step=first_step,
        last_step=last_step,
        checkpoint_every=config.colocated_checkpoint_every,
        first_batch=first_batch,
        first_batch_state=first_batch_state,
    ).with_overrides(**colocated_settings(config))
    loop_state = log_chunk(
        config=step_config,
        target=target,
        loop_state=loop_state,
        first_step=first_step,
        step_metrics=metrics,
        outbox=outbox,
    ).with_overrides(**cpu_settings(config))
    if is_validation_step(last_step, config.val_every, config.total_steps):
        loop_state = evaluate_and_register(config, step_config, target, loop_state, policy, data, last_step, model_name)
    return policy, loop_state, next_batch, next_batch_state


@dynamic(**DYNAMIC_POD)
def train(
    config: DAPOConfig,
    step_config: StepConfig,
    model_config: ModelConfig,
    target: RunTarget,
    data: FlyteDirectory,
    loop_state: LoopState,
    model_name: str,
) -> TrainOutput:
    """The starting policy, its validation, then the step loop as a chain of chunks.

    config shapes the DAG and its pods; the tasks get step_config and model_config
    (resolve_config), the sections their outputs depend on."""
    policy = bootstrap_policy(config=model_config, embedded_task=config.embedded_task).with_overrides(
        **bootstrap_settings(config)
    )
    loop_state = evaluate_and_register(config, step_config, target, loop_state, policy, data, 0, model_name)
    next_batch, next_batch_state = None, None
    for first, last in chunk_ranges(config):
        policy, loop_state, next_batch, next_batch_state = train_chunk(
            config=config,
            step_config=step_config,
            target=target,
            data=data,
            policy=policy,
            loop_state=loop_state,
            first_step=first,
            last_step=last,
            model_name=model_name,
            next_batch=next_batch,
            next_batch_state=next_batch_state,
        )
    return TrainOutput(policy, loop_state)


@workflow(on_failure=end_failed_run)
def dapo_loop(
    preset: str = "tiny_cpu",
    overrides_json: str = "{}",
    total_steps: int = 0,
    train_data: str = "",
    val_data: str = "",
    mlflow_tracking_uri: str = "",
    mlflow_experiment: str = "dapo",
    model_name: str = "dapo-policy",
    steps_per_chunk: int = 0,
    config_file: str = "",
    set: str = "",
) -> DapoResult:
    """DAPO training. Defaults: the embedded tiny policy and arithmetic task, local MLflow.

    `python -m dapo config --preset NAME` lists every field of the config by section
    (model, data, reward, algorithm, rollout, validation, trainer, run, cluster) with its
    value and help.

    Run again with more total_steps (or another val_every, model_name, tags) to extend a
    run: the steps already computed come from the cache and the same MLflow run goes on.
    Returns the final checkpoint and the run's summary (accuracies, champion version,
    MLflow run id); the run ends FINISHED, or FAILED if the execution fails.

    :param preset: tiny_cpu | smollm2_cpu | one_gpu_1p5b | node_7b | paper_32b (python -m dapo config --presets)
    :param overrides_json: config fields as JSON, by section or flat: '{"algorithm": {"clip_high": 0.2}}'
    :param total_steps: 0 keeps the preset's
    :param train_data: verl-format parquet path or URI (s3://..., gs://...), or a reasoning-gym spec:
        reasoning_gym:chain_sum?min_terms=2&max_terms=2
    :param val_data: verl-format parquet path or URI, or a reasoning_gym: spec ("" with one: another seed of train_data)
    :param mlflow_tracking_uri: "" = $MLFLOW_TRACKING_URI or ./mlflow.db
    :param mlflow_experiment: the MLflow experiment
    :param model_name: the MLflow registered model
    :param steps_per_chunk: steps a train_chunk node holds, 0 keeps the preset's
    :param config_file: a YAML file of config fields by section (applied before overrides_json)
    :param set: dotted assignments, last: 'algorithm.clip_high=0.2 reward.reward_fn=my_reward.py:score'
    """
    config, step_config, data_config, model_config = resolve_config(
        preset=preset,
        overrides_json=overrides_json,
        total_steps=total_steps,
        train_data=train_data,
        val_data=val_data,
        steps_per_chunk=steps_per_chunk,
        config_file=config_file,
        set=set,
    )
    data, data_stats = prepare_data(config=data_config)
    target, loop_state = start_tracking(
        config=step_config, tracking_uri=mlflow_tracking_uri, experiment=mlflow_experiment, data_stats=data_stats
    )
    final_policy, final_state = train(
        config=config,
        step_config=step_config,
        model_config=model_config,
        target=target,
        data=data,
        loop_state=loop_state,
        model_name=model_name,
    )
    summary = finish_tracking(config=config, target=target, loop_state=final_state, model_name=model_name)
    return DapoResult(final_policy, summary)
