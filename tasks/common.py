"""What every DAPO task shares: caching, the checkpoint type, pod settings."""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import math
import os
from typing import Annotated

from flytekit import Cache, FlyteContextManager, Resources, current_context
from flytekit.core.hash import HashMethod
from flytekit.deck import DeckField
from flytekit.exceptions.user import FlyteRecoverableException
from flytekit.extras.accelerators import GPUAccelerator
from flytekit.types.directory import FlyteDirectory

from dapo import checkpoint
from dapo.code_version import source_version
from dapo.config import DAPOConfig, StepConfig, section_values
from dapo.faults import is_transient
from dapo.logs import configure_logging

GPU_POD_TEMPLATE_NAME = "dapo-gpu"
"""k8s/20-flyte-podtemplates.yaml: GPU-node selector, nvidia.com/gpu toleration and a
memory-backed /dev/shm (so GPU tasks do not also set shared_memory=True: a second
/dev/shm volume would be rejected)."""

SHARED_GPU_POD_TEMPLATE_NAME = "dapo-gpu-shared"
"""k8s/21-trainer-shared-volume.yaml: dapo-gpu plus the ReadWriteMany volume at
/mnt/dapo-shared (paper_32b's trainer_shared_dir) that a multi-node policy step needs."""

DECKS = {"enable_deck": True, "deck_fields": (DeckField.TIMELINE,)}
"""Our own decks and the timeline. flytekit's default deck fields also render the pip
dependency list and every input (a whole rollout batch) as HTML: ~1 s a task, a
third of a tiny local step (benchmarks/overhead.py)."""

DISK_MARGIN_GIB = 20
"""Local disk beyond the weights and checkpoints a pod holds: logs, vLLM's compile
and CUDA-graph caches, DeepSpeed's JIT builds, the fast-registration code."""


ROLLOUT_PER_GPU = {"cpu": 8, "mem_gib": 64}
"""CPUs and memory a rollout or validation pod gets per GPU."""
TRAINER_PER_GPU = {"cpu": 16, "mem_gib": 128}
"""CPUs and memory a policy-step pod gets per GPU (one training process per GPU)."""


def gpu_pod(gpus: int, per_gpu: dict, pod_template_name: str = GPU_POD_TEMPLATE_NAME) -> dict:
    """Decorator settings of a GPU task: its pod template and the requests it is registered
    with; the dynamic workflows override the requests from the run's config (node_settings)."""
    return {
        "requests": Resources(cpu=str(per_gpu["cpu"] * gpus), mem=f"{per_gpu['mem_gib'] * gpus}Gi", gpu=str(gpus)),
        "pod_template_name": pod_template_name,
    }


ROLLOUT_POD = gpu_pod(1, ROLLOUT_PER_GPU)


def _gib(n_bytes: float) -> str:
    return f"{DISK_MARGIN_GIB + math.ceil(n_bytes / 2**30)}Gi"


def node_settings(
    config: DAPOConfig,
    *,
    cpu: int,
    mem_gib: int,
    disk_bytes: float = 0,
    gpus: int = 0,
    timeout_minutes: int | None = None,
) -> dict:
    """`with_overrides` arguments that shape one pod from the run's config.

    The dynamic workflows apply them to every node they emit, so GPU counts, the GPU
    type, disk, retries and timeouts come from the config the run was started with,
    never from the environment of the machine that registered the workflow (which
    the pods never see). Limits equal requests: what a pod asks for is what it may use,
    so a node's disk and memory are never overcommitted (an overcommitted pod is the
    first evicted). timeout_minutes: one attempt's limit (None = stage_timeout_minutes, 0 = none).
    """
    resources = Resources(
        cpu=str(cpu), mem=f"{mem_gib}Gi", gpu=str(gpus) if gpus else None, ephemeral_storage=_gib(disk_bytes)
    )
    settings: dict = {
        "requests": resources,
        "limits": resources,
        "retries": config.task_retries,
        "interruptible": config.interruptible,
    }
    if gpus and config.gpu_accelerator:
        settings["accelerator"] = GPUAccelerator(config.gpu_accelerator)
    timeout_minutes = config.stage_timeout_minutes if timeout_minutes is None else timeout_minutes
    if timeout_minutes:
        settings["timeout"] = datetime.timedelta(minutes=timeout_minutes)
    return settings


def rollout_settings(config: DAPOConfig) -> dict:
    """A rollout or validation pod: tensor_parallel_size GPUs, 8 CPUs and 64 GiB each,
    disk for the weights (never the trainer state: download_weights)."""
    gpus = config.tensor_parallel_size
    return node_settings(
        config,
        cpu=ROLLOUT_PER_GPU["cpu"] * gpus,
        mem_gib=ROLLOUT_PER_GPU["mem_gib"] * gpus,
        gpus=gpus,
        disk_bytes=config.weights_bytes,
    )


def trainer_settings(config: DAPOConfig) -> dict:
    """A policy-step pod (one per node): trainer_nproc_per_node GPUs, 16 CPUs and 128 GiB
    each; disk for the input checkpoint, and the output unless it goes to trainer_shared_dir."""
    gpus = config.trainer_nproc_per_node
    copies = 1 if config.trainer_shared_dir else 2
    return node_settings(
        config,
        cpu=TRAINER_PER_GPU["cpu"] * gpus,
        mem_gib=TRAINER_PER_GPU["mem_gib"] * gpus,
        gpus=gpus,
        disk_bytes=copies * config.checkpoint_bytes,
    )


def colocated_settings(config: DAPOConfig) -> dict:
    """A colocated chunk's pod (one per node), under chunk_timeout_minutes: the trainer's
    GPUs (one step off policy, the rollout process's too), CPUs and memory; disk for the
    input checkpoint, and its records (the newest checkpoint and the one being written)
    unless they go to trainer_shared_dir (tasks.train.records_dir)."""
    engine_gpus = config.tensor_parallel_size if config.off_policy_steps else 0  # dapo.execution.overlap's engine
    gpus = config.trainer_nproc_per_node + engine_gpus
    copies = 1 if config.trainer_shared_dir else 3
    return node_settings(
        config,
        cpu=TRAINER_PER_GPU["cpu"] * gpus,
        mem_gib=TRAINER_PER_GPU["mem_gib"] * gpus,
        gpus=gpus,
        disk_bytes=copies * config.checkpoint_bytes,
        timeout_minutes=config.chunk_timeout_minutes or config.stage_timeout_minutes,
    )


def bootstrap_settings(config: DAPOConfig) -> dict:
    """bootstrap_policy: the model as downloaded, then as written (two copies of the weights)."""
    return node_settings(config, cpu=4, mem_gib=16, disk_bytes=2 * config.weights_bytes)


def registry_settings(config: DAPOConfig) -> dict:
    """register_model: the weights of one checkpoint on their way to MLflow."""
    return node_settings(config, cpu=1, mem_gib=4, disk_bytes=config.weights_bytes)


def cpu_settings(config: DAPOConfig, cpu: int = 1, mem_gib: int = 4) -> dict:
    """A CPU pod that holds batches and metrics only."""
    return node_settings(config, cpu=cpu, mem_gib=mem_gib)


def task_entry(function):
    """A task's body as the start of the process that runs it (its pod; locally the pyflyte
    process, at its first task): logging is configured there (dapo.logs), before the task's
    code and the libraries it imports log anything. A transient fault (dapo.faults.is_transient)
    leaves it as FlyteRecoverableException, which Flyte retries (task_retries); flytekit
    writes any other exception of task code as non-recoverable, which fails the node at once."""

    @functools.wraps(function)
    def run(*args, **kwargs):
        configure_logging()
        try:
            return function(*args, **kwargs)
        except Exception as error:
            if is_transient(error):
                raise FlyteRecoverableException(
                    f"transient, a retry may succeed: {type(error).__name__}: {error}"
                ) from error
            raise

    return run


def cache(module: str) -> Cache:
    """Caching for the tasks of `module` (their __name__): the version follows the project
    source they run (dapo.code_version), so code changed since never serves old results."""
    return Cache(version=source_version(module))


def _directory_hash(directory: FlyteDirectory) -> str:
    """The checkpoint's content hash, from its COMPLETE marker where it has one (no need to
    re-read the weights). A checkpoint passed on while still remote (never downloaded)
    is keyed by the marker in the store, else by its URI: never by the empty local path."""
    if os.path.isdir(directory.path) and os.listdir(directory.path):
        return checkpoint.recorded_hash(directory.path) or checkpoint.content_hash(directory.path)
    remote = directory.remote_source
    if not remote:
        raise ValueError(f"checkpoint {directory.path} is neither a local directory with files nor a remote one")
    fs = FlyteContextManager.current_context().file_access.get_filesystem_for_path(remote)
    try:
        marker = json.loads(fs.cat_file(f"{remote.rstrip('/')}/{checkpoint.COMPLETE_FILE}"))
        return marker["content_hash"]
    except (OSError, ValueError, KeyError):
        return "uri:" + remote


def directory_output(path: str) -> FlyteDirectory:
    """A task's output directory, uploaded to the raw-output store whenever that is remote.

    On a cluster flytekit uploads every output directory; in a local run against an
    object store (`pyflyte run --raw-output-data-prefix s3://...`) it would keep them on
    the local disk while tables go to the store, so a resumed run on another machine
    would find half its data."""
    file_access = FlyteContextManager.current_context().file_access
    if file_access.is_remote(file_access.raw_output_prefix):
        return FlyteDirectory(path, remote_directory=file_access.get_random_remote_directory())
    return FlyteDirectory(path)


Checkpoint = Annotated[FlyteDirectory, HashMethod(_directory_hash)]
"""A checkpoint directory whose cache key is its content, not its (fresh) URI."""


def download_weights(policy: FlyteDirectory) -> str:
    """The checkpoint's top-level files (weights, config, tokenizer) without trainer_state/.

    What rollout and validation need: from a remote store this moves the weights alone,
    not the optimizer state and DeepSpeed's copy of the weights, which are 7x the bf16
    weights' bytes (benchmarks/weights_handoff.py). A local checkpoint is used in place.
    """
    source = policy.remote_source or policy.path
    file_access = FlyteContextManager.current_context().file_access
    if not file_access.is_remote(source):
        return policy.download()
    fs = file_access.get_filesystem_for_path(source)
    files = [entry["name"] for entry in fs.ls(source, detail=True) if entry["type"] == "file"]
    target = scratch_dir("weights")
    # One call for all files: fsspec's object-store filesystems fetch a list concurrently.
    fs.get(files, [os.path.join(target, name.rstrip("/").rsplit("/", 1)[-1]) for name in files])
    return target


RUN_KEY_FIELDS_ADDED: dict[str, object] = {"adv_estimator": "group_norm"}
"""Step-config fields added since 0.2.0, which first gave out run keys, with the value every
run had before them: a field holding that value is left out of the key, so a run started on
an earlier release goes on in the same MLflow run (tests/fixtures/run_keys_0.2.0.json)."""


def run_key(config: StepConfig) -> str:
    """One run's key, from its step config (a DAPOConfig's, or one): the same step config is
    the same run (its MLflow run, its directory on trainer_shared_dir), so a resumed or
    extended execution, or one validating more often, finds them again."""
    values = section_values(config, StepConfig).to_dict()
    for name, earlier in RUN_KEY_FIELDS_ADDED.items():
        if name in values and values[name] == earlier:
            del values[name]
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]


def scratch_dir(name: str, root: str = "") -> str:
    """A fresh directory for outputs under root (default: the task's sandbox)."""
    import tempfile

    if root:
        os.makedirs(root, exist_ok=True)
    return tempfile.mkdtemp(prefix=f"{name}-", dir=root or current_context().working_directory)
