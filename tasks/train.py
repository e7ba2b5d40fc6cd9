"""The policy update: DeepSpeed in one process per pod, or torch elastic over several
processes and nodes (flytekitplugins-kfpytorch Elastic; a PyTorchJob when > 1 node)."""

from __future__ import annotations

import hashlib
import os
import shutil
import time
import typing

import pyarrow as pa
from flytekit import Deck, FlyteContextManager, task
from flytekit.core.base_task import PythonTask, TaskResolverMixin
from flytekit.core.tracker import TrackedInstance
from flytekit.types.directory import FlyteDirectory
from flytekitplugins.kfpytorch import Elastic

from dapo import report
from dapo.algorithm.sampling import SamplingState
from dapo.config import DAPOConfig, StepConfig
from dapo.engines.trainer import launcher_rank, local_rank0_first, prune_step_dirs, rank0_value
from dapo.execution.stages import training
from dapo.tracking import LoopState, RunTarget
from images.specs import GPU_IMAGE, TRAINER_IMAGE
from tasks.common import (
    DECKS,
    GPU_POD_TEMPLATE_NAME,
    SHARED_GPU_POD_TEMPLATE_NAME,
    TRAINER_PER_GPU,
    Checkpoint,
    cache,
    directory_output,
    gpu_pod,
    run_key,
    scratch_dir,
    task_entry,
)


class StepOutput(typing.NamedTuple):
    policy: Checkpoint
    metrics: dict[str, float]


def trainer_pod(gpus: int, pod_template_name: str = GPU_POD_TEMPLATE_NAME) -> dict:
    """Task settings of a trainer pod (one training process per GPU)."""
    return {
        "cache": cache(__name__),
        "container_image": TRAINER_IMAGE,
        **gpu_pod(gpus, TRAINER_PER_GPU, pod_template_name),
        **DECKS,
    }


def step_output_dir(config: StepConfig, step: int, input_dir: str) -> str:
    """Where the step writes its checkpoint: the task's sandbox, or with several nodes a
    directory of this run under trainer_shared_dir (all ranks write their shards there).

    Flyte uploads the directory as the task's output, so on the shared volume only the
    newest config.shared_checkpoints_kept copies of this run are kept (registered
    checkpoints live on in the object store as the outputs of their steps), and never
    input_dir, the checkpoint this step reads (in a local execution it is on the volume)."""
    if not config.trainer_shared_dir:
        return scratch_dir(f"policy-{step + 1}")
    run_dir = os.path.join(config.trainer_shared_dir, "run-" + run_key(config))
    out_dir = scratch_dir(f"policy-{step + 1}", root=run_dir)
    prune_step_dirs(run_dir, keep=config.shared_checkpoints_kept, spare=input_dir)
    return out_dir


@task(**trainer_pod(gpus=1))
@task_entry
def policy_step(
    config: StepConfig, policy: Checkpoint, batch: pa.Table, sampling_state: SamplingState, step: int
) -> StepOutput:
    """Decoupled-clip, token-level DAPO update over mini-batches; writes the next checkpoint.

    Under torch elastic every rank runs this body: the checkpoint directory is made by
    rank 0 (under config.trainer_shared_dir when set) and shared with all ranks, which
    all take part in the update and in saving; flytekit returns rank 0's outputs.
    """
    started = time.perf_counter()
    out_dir = rank0_value(lambda: step_output_dir(config, step, policy.path))
    local_rank0_first(policy.download)  # one download per node, into the path every rank reads
    metrics = training.policy_step(config, policy.path, batch, sampling_state, step, out_dir)
    metrics["policy_step/seconds"] = time.perf_counter() - started
    Deck("This step", report.html_table([{"metric": k, "value": f"{v:.5g}"} for k, v in sorted(metrics.items())]))
    return StepOutput(directory_output(out_dir), metrics)


def policy_step_elastic(
    config: StepConfig, policy: Checkpoint, batch: pa.Table, sampling_state: SamplingState, step: int
) -> StepOutput:
    """policy_step's body, as the function of its Elastic tasks (elastic_task)."""
    return policy_step.task_function(config, policy, batch, sampling_state, step)


class ElasticTaskResolver(TrackedInstance, TaskResolverMixin):
    """Finds an elastic task (policy_step or colocated_chunk) again in its pod, from its name
    and shape.

    The elastic tasks are made at run time from the run's config (in train_chunk), so
    flytekit's default resolver, which imports a task by its module attribute, cannot
    load them; this one rebuilds the task from (name, nnodes, nproc_per_node).
    """

    def name(self) -> str:
        return "ElasticTaskResolver"

    def load_task(self, loader_args: list[str]) -> PythonTask:
        name, _, nnodes, _, nproc_per_node = loader_args
        return elastic_task(name, int(nnodes), int(nproc_per_node))

    def loader_args(self, settings, task: PythonTask) -> list[str]:
        name = next(n for n, (function, _) in ELASTIC_TASKS.items() if function is task.task_function)
        return [name, "nnodes", str(task.task_config.nnodes), "nproc-per-node", str(task.task_config.nproc_per_node)]

    def get_all_tasks(self) -> list[PythonTask]:
        raise NotImplementedError


elastic_resolver = ElasticTaskResolver()


ELASTIC_RESTARTS = 1


def elastic_task(name: str, nnodes: int, nproc_per_node: int, shared_volume: bool = False) -> PythonTask:
    """policy_step or colocated_chunk as a torch-elastic task: nproc_per_node processes
    (GPUs) on each of nnodes pods; a plain pod for one node, a PyTorchJob
    (training-operator) for more.

    increase_shared_mem=False: the GPU pod templates already mount /dev/shm. More than one
    node, or one with shared_volume (a config's trainer_shared_dir: a chunk's records there
    outlive its pod), runs on dapo-gpu-shared, which mounts the volume of trainer_shared_dir
    (the pod that loads the task again by its name and shape needs no template).
    max_restarts=ELASTIC_RESTARTS: a worker that NCCL's watchdog aborts (a hung collective,
    a flaky link) dies by a signal that no `except` sees, so task_entry cannot call it
    transient; torchrun restarts the worker group once instead (a step restarts from its
    input checkpoint, a chunk after its last record), a deterministic error then fails again.
    """
    function, settings = ELASTIC_TASKS[name]
    template = SHARED_GPU_POD_TEMPLATE_NAME if nnodes > 1 or shared_volume else GPU_POD_TEMPLATE_NAME
    elastic = task(
        function,
        task_config=Elastic(
            nnodes=nnodes, nproc_per_node=nproc_per_node, increase_shared_mem=False, max_restarts=ELASTIC_RESTARTS
        ),
        **settings(nproc_per_node, template),
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
    return elastic_task(
        "policy_step", config.trainer_nnodes, config.trainer_nproc_per_node, bool(config.trainer_shared_dir)
    )


class ColocatedOutput(typing.NamedTuple):
    policy: Checkpoint
    metrics: list[dict[str, float]]
    outbox: str
    next_batch: pa.Table | None
    next_batch_state: SamplingState | None


def records_dir(config: StepConfig, policy: FlyteDirectory, first_step: int) -> str:
    """Where a colocated chunk keeps its per-step records (dapo.execution.colocated.run_colocated):
    <root>/run-<run key>/chunk-<first step>-<input checkpoint's hash>. Its last step is not
    part of the name: the chunk run again (a retry, a resumed execution) finds its records,
    and so does the longer chunk that replaces a short last chunk when the run is extended,
    which goes on after its newest record. The root is trainer_shared_dir/colocated where the
    config has one (the volume of dapo-gpu-shared, which every node mounts: a retried pod
    resumes there too), else ~/.flyte/dapo-colocated (it outlives a killed local run, not a
    pod: a retry on a cluster starts the chunk again)."""
    source = policy.remote_source or policy.path
    key = hashlib.sha256(f"{source}|{first_step}".encode()).hexdigest()[:16]
    if config.trainer_shared_dir:
        root = os.path.join(config.trainer_shared_dir, "colocated")
    else:
        root = os.path.join(os.path.expanduser("~"), ".flyte", "dapo-colocated")
    return os.path.join(root, "run-" + run_key(config), f"chunk-{first_step}-{key}")


def prune_earlier_chunks(records: str, first_step: int) -> list[str]:
    """Remove the run's records of chunks that started before first_step: at 32B each holds
    ~0.5 TB, and their last checkpoint is their task's output (uploaded to the object store,
    or locally a copy of its own: chunk_output)."""
    parent = os.path.dirname(records)
    removed = []
    for name in os.listdir(parent) if os.path.isdir(parent) else []:
        parts = name.split("-")
        if name.startswith("chunk-") and len(parts) == 3 and parts[1].isdigit() and int(parts[1]) < first_step:
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
            removed.append(name)
    return removed


def chunk_output(checkpoint_dir: str) -> FlyteDirectory:
    """The chunk's last checkpoint as its output. Where outputs stay on the local disk (a
    local execution) the output is a hard-linked copy in the task's sandbox, not the record
    itself: the records directory goes on (a longer chunk after an extension prunes it),
    while Flyte's cache keeps pointing at this output."""
    file_access = FlyteContextManager.current_context().file_access
    if file_access.is_remote(file_access.raw_output_prefix):
        return directory_output(checkpoint_dir)
    snapshot = scratch_dir(os.path.basename(checkpoint_dir))
    shutil.copytree(checkpoint_dir, snapshot, copy_function=link_or_copy, dirs_exist_ok=True)
    return FlyteDirectory(snapshot)


def link_or_copy(source: str, target: str) -> None:
    """A hard link (no bytes copied), a copy where the two paths are on different filesystems."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def chunk_pod(gpus: int, pod_template_name: str = GPU_POD_TEMPLATE_NAME) -> dict:
    """Task settings of a colocated chunk's pod: the GPU image (vLLM and DeepSpeed), the trainer's share per GPU."""
    return {
        "cache": cache(__name__),
        "container_image": GPU_IMAGE,
        **gpu_pod(gpus, TRAINER_PER_GPU, pod_template_name),
        **DECKS,
    }


@task(**chunk_pod(gpus=1))
@task_entry
def colocated_chunk(
    config: StepConfig,
    target: RunTarget,
    policy: Checkpoint,
    data: FlyteDirectory,
    first_step: int,
    last_step: int,
    checkpoint_every: int,
    first_batch: pa.Table | None,
    first_batch_state: SamplingState | None,
) -> ColocatedOutput:
    """Steps [first_step, last_step) in this pod (or these ranks), the trainer and vLLM resident
    (dapo.execution.colocated): each step's new weights go into vLLM in memory, no checkpoint is read
    between steps. Each step prints its line and goes to MLflow as it ends (what MLflow
    does not take goes to the returned outbox); its record lets a killed chunk go on after
    its last checkpointed step (one every checkpoint_every steps: the run's
    colocated_checkpoint_every, an input of its own as the step config leaves it out).

    One step off policy (off_policy_steps=1) a trainer process and a rollout process run the
    steps side by side (dapo.execution.overlap): first_batch (and its sampling state) is the chunk's
    first batch, sampled by the chunk before, and next_batch the one after the chunk. On
    policy they are None.

    Under torch elastic every rank runs this: the inputs are downloaded once per node,
    rank 0 reports the steps, and flytekit returns rank 0's outputs."""
    from dapo.execution.colocated import run_colocated
    from tasks.tracking import report_step

    delivery = LoopState()
    local_rank0_first(policy.download)  # one download per node, into the paths every rank reads
    local_rank0_first(data.download)
    records = records_dir(config, policy, first_step)
    if launcher_rank() == 0:
        prune_earlier_chunks(records, first_step)
    chunk: dict[str, typing.Any] = dict(
        checkpoint_every=checkpoint_every,
        on_step=lambda step, metrics: report_step(delivery, target, step + 1, metrics),
    )
    if config.off_policy_steps:
        from dapo.execution.overlap import SampledBatch, run_overlapped

        first = (
            None
            if first_batch is None or first_batch_state is None
            else SampledBatch(first_batch, first_batch_state, first_step - 1)
        )
        result = run_overlapped(
            config, policy.path, data.path, first_step, last_step - first_step, records, first_batch=first, **chunk
        )
    else:
        result = run_colocated(config, policy.path, data.path, first_step, last_step - first_step, records, **chunk)
    rows = [
        {"step": first_step + i + 1, **{k: f"{v:.4g}" for k, v in sorted(m.items())}}
        for i, m in enumerate(result.step_metrics)
    ]
    Deck("This chunk", report.html_table(rows))
    following = result.next_batch
    return ColocatedOutput(
        chunk_output(result.checkpoint_dir),
        result.step_metrics,
        delivery.outbox,
        None if following is None else following.batch,
        None if following is None else following.state,
    )


def colocated_chunk_elastic(
    config: StepConfig,
    target: RunTarget,
    policy: Checkpoint,
    data: FlyteDirectory,
    first_step: int,
    last_step: int,
    checkpoint_every: int,
    first_batch: pa.Table | None,
    first_batch_state: SamplingState | None,
) -> ColocatedOutput:
    """colocated_chunk's body, as the function of its Elastic tasks (elastic_task)."""
    return colocated_chunk.task_function(
        config, target, policy, data, first_step, last_step, checkpoint_every, first_batch, first_batch_state
    )


ELASTIC_TASKS = {
    "policy_step": (policy_step_elastic, trainer_pod),
    "colocated_chunk": (colocated_chunk_elastic, chunk_pod),
}
"""The bodies that run as elastic tasks, and their task settings from (GPUs per pod, pod template)."""


def colocated_chunk_for(config: DAPOConfig) -> PythonTask:
    """colocated_chunk for one process, else its elastic task of the config's trainer shape."""
    if config.trainer_world_size == 1:
        return colocated_chunk
    return elastic_task(
        "colocated_chunk", config.trainer_nnodes, config.trainer_nproc_per_node, bool(config.trainer_shared_dir)
    )
