"""The policy update: DeepSpeed in one process per pod, or torch elastic over several
processes and nodes (flytekitplugins-kfpytorch Elastic; a PyTorchJob when > 1 node)."""

from __future__ import annotations

import hashlib
import os
import time
import typing

import pyarrow as pa
from flytekit import Deck, task
from flytekit.types.directory import FlyteDirectory
from flytekit.core.base_task import PythonTask, TaskResolverMixin
from flytekit.core.tracker import TrackedInstance
from flytekitplugins.kfpytorch import Elastic

from dapo import pipeline, report
from dapo.config import DAPOConfig
from dapo.trainer import local_rank0_first, prune_step_dirs, rank0_value
from images.specs import GPU_IMAGE, TRAINER_IMAGE
from tasks.common import (
    DECKS, GPU_POD_TEMPLATE_NAME, SHARED_GPU_POD_TEMPLATE_NAME, TRAINER_PER_GPU, Checkpoint, cache, directory_output, gpu_pod,
    run_key, scratch_dir, task_entry,
)

StepOutput = typing.NamedTuple("StepOutput", [("policy", Checkpoint), ("metrics", dict[str, float])])


def trainer_pod(gpus: int, pod_template_name: str = GPU_POD_TEMPLATE_NAME) -> dict:
    """Task settings of a trainer pod (one training process per GPU)."""
    return {"cache": cache("policy_step"), "container_image": TRAINER_IMAGE, **gpu_pod(gpus, TRAINER_PER_GPU, pod_template_name), **DECKS}


def step_output_dir(config: DAPOConfig, step: int) -> str:
    """Where the step writes its checkpoint: the task's sandbox, or with several nodes a
    directory of this run under trainer_shared_dir (all ranks write their shards there).

    Flyte uploads the directory as the task's output, so on the shared volume only the
    newest config.shared_checkpoints_kept copies of this run are kept (registered
    checkpoints live on in the object store as the outputs of their steps)."""
    if not config.trainer_shared_dir:
        return scratch_dir(f"policy-{step + 1}")
    run_dir = os.path.join(config.trainer_shared_dir, "run-" + run_key(config))
    out_dir = scratch_dir(f"policy-{step + 1}", root=run_dir)
    prune_step_dirs(run_dir, keep=config.shared_checkpoints_kept)
    return out_dir


@task(**trainer_pod(gpus=1))
@task_entry
def policy_step(config: DAPOConfig, policy: Checkpoint, batch: pa.Table, sampling_state: str, step: int) -> StepOutput:
    """Decoupled-clip, token-level DAPO update over mini-batches; writes the next checkpoint.

    Under torch elastic every rank runs this body: the checkpoint directory is made by
    rank 0 (under config.trainer_shared_dir when set) and shared with all ranks, which
    all take part in the update and in saving; flytekit returns rank 0's outputs.
    """
    started = time.perf_counter()
    out_dir = rank0_value(lambda: step_output_dir(config, step))
    local_rank0_first(policy.download)  # one download per node, into the path every rank reads
    state = pipeline.SamplingState.from_json(sampling_state)
    metrics = pipeline.policy_step(config, policy.path, batch, state, step, out_dir)
    metrics["policy_step/seconds"] = time.perf_counter() - started
    Deck("This step", report.html_table([{"metric": k, "value": f"{v:.5g}"} for k, v in sorted(metrics.items())]))
    return StepOutput(directory_output(out_dir), metrics)


def policy_step_elastic(config: DAPOConfig, policy: Checkpoint, batch: pa.Table, sampling_state: str, step: int) -> StepOutput:
    """policy_step's body, as the function of the Elastic tasks that elastic_policy_step makes."""
    return policy_step.task_function(config, policy, batch, sampling_state, step)


class ElasticPolicyStepResolver(TrackedInstance, TaskResolverMixin):
    """Finds an elastic policy step again in its pod, from its shape.

    The elastic tasks are made at run time from the run's config (in train_chunk), so
    flytekit's default resolver, which imports a task by its module attribute, cannot
    load them; this one rebuilds the task from (nnodes, nproc_per_node).
    """

    def name(self) -> str:
        return "ElasticPolicyStepResolver"

    def load_task(self, loader_args: list[str]) -> PythonTask:
        _, nnodes, _, nproc_per_node = loader_args
        return elastic_policy_step(int(nnodes), int(nproc_per_node))

    def loader_args(self, settings, task: PythonTask) -> list[str]:
        return ["nnodes", str(task.task_config.nnodes), "nproc-per-node", str(task.task_config.nproc_per_node)]

    def get_all_tasks(self) -> list[PythonTask]:
        raise NotImplementedError


elastic_resolver = ElasticPolicyStepResolver()


def elastic_policy_step(nnodes: int, nproc_per_node: int) -> PythonTask:
    """The policy step as a torch-elastic task: nproc_per_node processes (GPUs) on each of
    nnodes pods; a plain pod for one node, a PyTorchJob (training-operator) for more.

    increase_shared_mem=False: the GPU pod templates already mount /dev/shm. More than one
    node runs on dapo-gpu-shared, which mounts the volume of trainer_shared_dir.
    """
    template = SHARED_GPU_POD_TEMPLATE_NAME if nnodes > 1 else GPU_POD_TEMPLATE_NAME
    elastic = task(
        policy_step_elastic,
        task_config=Elastic(nnodes=nnodes, nproc_per_node=nproc_per_node, increase_shared_mem=False),
        **trainer_pod(gpus=nproc_per_node, pod_template_name=template),
    )
    # Set after construction: a task made inside a dynamic workflow (train_chunk) takes the
    # dynamic's resolver from the compilation state instead of the one passed to task(),
    # and that one cannot load a task made at run time.
    elastic.set_resolver(elastic_resolver)
    return elastic


def policy_step_for(config: DAPOConfig) -> PythonTask:
    """policy_step for one training process, else the elastic step of the config's shape."""
    if config.trainer_world_size == 1:
        return policy_step
    return elastic_policy_step(config.trainer_nnodes, config.trainer_nproc_per_node)


ColocatedOutput = typing.NamedTuple(
    "ColocatedOutput", [("policy", Checkpoint), ("metrics", list[dict[str, float]]), ("outbox", str)]
)


def records_dir(config: DAPOConfig, policy: FlyteDirectory, first_step: int, last_step: int) -> str:
    """Where a colocated chunk keeps its per-step records (dapo.colocated.run_colocated):
    ~/.flyte/dapo-colocated/run-<run key>/chunk-<steps>-<input checkpoint's hash>, so that
    the chunk run again finds them. That outlives a killed local run, not a pod: on a
    cluster a retried chunk starts again from its input checkpoint."""
    source = policy.remote_source or policy.path
    key = hashlib.sha256(f"{source}|{first_step}|{last_step}".encode()).hexdigest()[:16]
    root = os.path.join(os.path.expanduser("~"), ".flyte", "dapo-colocated", "run-" + run_key(config))
    return os.path.join(root, f"chunk-{first_step}-{last_step}-{key}")


@task(cache=cache("colocated_chunk"), container_image=GPU_IMAGE, **gpu_pod(1, TRAINER_PER_GPU), **DECKS)
@task_entry
def colocated_chunk(
    config: DAPOConfig, target_json: str, policy: Checkpoint, data: FlyteDirectory, first_step: int, last_step: int,
    checkpoint_every: int,
) -> ColocatedOutput:
    """Steps [first_step, last_step) in this one pod, the trainer and vLLM resident
    (dapo.colocated): each step's new weights go into vLLM in memory, no checkpoint is read
    between steps. Each step prints its line and goes to MLflow as it ends (what MLflow
    does not take goes to the returned outbox); its record lets a killed chunk go on after
    its last checkpointed step (one every checkpoint_every steps: the run's
    colocated_checkpoint_every, an input of its own as the step config leaves it out)."""
    from dapo.colocated import run_colocated
    from tasks.tracking import LoopState, report_step

    delivery = LoopState()
    result = run_colocated(
        config, policy.download(), data.download(), first_step, last_step - first_step,
        records_dir(config, policy, first_step, last_step), checkpoint_every=checkpoint_every,
        on_step=lambda step, metrics: report_step(delivery, target_json, step + 1, metrics),
    )
    rows = [{"step": first_step + i + 1, **{k: f"{v:.4g}" for k, v in sorted(m.items())}} for i, m in enumerate(result.step_metrics)]
    Deck("This chunk", report.html_table(rows))
    return ColocatedOutput(directory_output(result.checkpoint_dir), result.step_metrics, delivery.outbox)

