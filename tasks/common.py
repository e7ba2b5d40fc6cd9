"""What every DAPO task shares: cache versions, the checkpoint type, the loop state."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from typing import Annotated

from flytekit import Cache, FlyteContextManager, Resources, current_context
from flytekit.core.hash import HashMethod
from flytekit.deck import DeckField
from flytekit.extras.accelerators import GPUAccelerator
from flytekit.types.directory import FlyteDirectory

from dapo import checkpoint
from dapo.config import DAPOConfig

# Bump a version when the task's code changes what it computes: cached results of the
# old code are then not reused. One place, so a reviewer sees them all.
CACHE_VERSIONS = {
    "resolve_config": "1",
    "prepare_data": "1",
    "bootstrap_policy": "1",
    "rollout": "3",  # 3: tied-embedding reload fix
    "verify_rewards": "2",
    "filter_groups": "2",
    "policy_step": "3",  # 3: rollout guard
    "evaluate": "2",  # 2: tied-embedding reload fix
    "track": "1",
}

GPU_POD_TEMPLATE_NAME = "dapo-gpu"
"""k8s/20-flyte-podtemplates.yaml: GPU-node selector, nvidia.com/gpu toleration and a
memory-backed /dev/shm (so GPU tasks do not also set shared_memory=True: a second
/dev/shm volume would be rejected)."""

SHARED_GPU_POD_TEMPLATE_NAME = "dapo-gpu-shared"
"""k8s/21-trainer-shared-volume.yaml: dapo-gpu plus the ReadWriteMany volume at
/mnt/dapo-shared (paper_32b's trainer_shared_dir) that a multi-node policy step needs."""

GPU_ACCELERATOR = GPUAccelerator(os.environ["DAPO_GPU_ACCELERATOR"]) if os.environ.get("DAPO_GPU_ACCELERATOR") else None
"""Flyte turns an accelerator into a node selector on the label its propagator is
configured with; set DAPO_GPU_ACCELERATOR (e.g. nvidia-h100) at registration time
where nodes carry that label. Unset, GPU tasks land on any GPU node (pod template)."""



DECKS = {"enable_deck": True, "deck_fields": (DeckField.TIMELINE,)}
"""Our own decks and the timeline. flytekit's default deck fields also render the pip
dependency list and every input (a whole rollout batch) as HTML: ~1 s a task, a
third of a tiny local step (benchmarks/overhead.py)."""


ROLLOUT_GPUS = int(os.environ.get("DAPO_ROLLOUT_GPUS", "1"))
"""GPUs of each rollout and validation pod: the vLLM tensor_parallel_size the workflow is
registered for (paper_32b: 4). Set DAPO_ROLLOUT_GPUS at registration time; a run whose
tensor_parallel_size needs more GPUs than its pod has fails in the rollout with that message."""


def rollout_pod() -> dict:
    """Task settings of a rollout or validation pod: 8 CPUs and 64 GiB per GPU."""
    return on_gpu(cpu=str(8 * ROLLOUT_GPUS), mem=f"{64 * ROLLOUT_GPUS}Gi", gpus=ROLLOUT_GPUS)


def on_gpu(cpu: str, mem: str, gpus: int = 1, pod_template_name: str = GPU_POD_TEMPLATE_NAME) -> dict:
    """Task settings of a pod with `gpus` GPUs on a GPU pod template (k8s/)."""
    return {
        "requests": Resources(cpu=cpu, mem=mem, gpu=str(gpus)),
        "accelerator": GPU_ACCELERATOR,
        "pod_template_name": pod_template_name,
    }


logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def cache(task_name: str) -> Cache:
    return Cache(version=CACHE_VERSIONS[task_name])


def _directory_hash(directory: FlyteDirectory) -> str:
    # The COMPLETE marker already holds the content hash: no need to re-read the weights.
    return checkpoint.recorded_hash(directory.path) or checkpoint.content_hash(directory.path)


Checkpoint = Annotated[FlyteDirectory, HashMethod(_directory_hash)]
"""A checkpoint directory whose cache key is its content, not its (fresh) URI."""


def download_weights(policy: FlyteDirectory) -> str:
    """The checkpoint's top-level files (weights, config, tokenizer) without trainer_state/.

    What rollout and validation need: from a remote store this moves the weights alone,
    not the optimizer state and DeepSpeed's copy of the weights, which are 7x the bf16
    weights' bytes (benchmarks/weights_handoff.py). A local checkpoint is used in place.
    """
    source = policy.remote_source or policy.path
    if not FlyteContextManager.current_context().file_access.is_remote(source):
        return policy.download()
    target = scratch_dir("weights")
    for entry in FlyteDirectory.listdir(policy):
        if not isinstance(entry, FlyteDirectory):
            shutil.move(entry.download(), os.path.join(target, entry.remote_source.rstrip("/").rsplit("/", 1)[-1]))
    return target


def load_config(config_json: str) -> DAPOConfig:
    return DAPOConfig.from_dict(json.loads(config_json))


def scratch_dir(name: str, root: str = "") -> str:
    """A fresh directory for outputs under root (default: the task's sandbox)."""
    import tempfile

    if root:
        os.makedirs(root, exist_ok=True)
    return tempfile.mkdtemp(prefix=f"{name}-", dir=root or current_context().working_directory)


@dataclass
class LoopState:
    """What the training loop carries from step to step besides the checkpoint.

    history: per-step metrics (for the learning-curve Decks); pending: tracking
    records MLflow has not accepted yet; bad_steps: consecutive non-finite updates.
    """

    history: list[dict] = field(default_factory=list)
    pending: list[dict] = field(default_factory=list)
    bad_steps: int = 0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "LoopState":
        return cls(**json.loads(text)) if text else cls()
