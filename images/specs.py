"""flytekit ImageSpec definitions for the DAPO tasks.

Four images, one module:

* ``ROLLOUT_IMAGE``  vLLM (CUDA) for the rollout task.
* ``TRAINER_IMAGE``  DeepSpeed + CUDA torch (+ flytekitplugins-kfpytorch) for policy_step.
* ``GPU_IMAGE``      vLLM and DeepSpeed together, for a colocated chunk (both engines in one process).
* ``CPU_IMAGE``      light image for prepare_data, verify_rewards, filter_groups,
                     evaluate bookkeeping and MLflow registration.

Use them from tasks as ``@task(container_image=image_for("rollout"))``. Importing
this module never talks to docker or a registry: an ImageSpec is only built
(``docker build`` + push) when ``pyflyte run --remote`` / ``pyflyte register``
serializes a task that uses it, on a machine with a docker engine.

Images carry dependencies only. The project's code reaches the pods by fast
registration (``pyflyte run --remote --copy all ...``), so an image's tag hashes its
packages, base, env and registry, never the source tree: editing the code rebuilds
nothing, and the tag is the same on every checkout and inside the pods. That matters
beyond rebuild time: a dynamic workflow (``train``, ``train_chunk``) serializes the
tasks it emits inside its pod, and flytekit finds their images by each ImageSpec's id
among the images registered with it; any difference between the registering
machine's spec and the pod's (a source path, a registry) names an image never built.

* ``DAPO_IMAGE_REGISTRY`` registry/namespace to push to and pull from
  (default ``ghcr.io/dapo-flyte``), read when this module is imported. Each image
  also carries it in its own environment, so the pods (where the dynamic workflows
  rebuild these specs) compute the same specs, ids and names as the registration.

Non-root: flytekit's default builder always finishes the image with
``USER flytekit`` (created with ``useradd``; uid 1001 on these Ubuntu 24.04 bases,
see ``images/pins.py``). ImageSpec has no field to choose the user or uid, and the
user is named, not numeric, so Kubernetes cannot verify ``runAsNonRoot`` from the
image alone: the pod templates in ``k8s/`` set ``runAsUser: 1001`` explicitly.

Versions, base images and the reasons for them live in ``images/pins.py``.
"""

from __future__ import annotations

import os

from flytekit import ImageSpec

from images import pins

DEFAULT_REGISTRY = "ghcr.io/dapo-flyte"
REGISTRY_ENV = "DAPO_IMAGE_REGISTRY"

ROLES = pins.ROLES

_COMMON_ENV = {
    "PYTHONUNBUFFERED": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

_GPU_ENV = {
    **_COMMON_ENV,
    # DeepSpeed / torch.utils.cpp_extension look for nvcc here.
    "CUDA_HOME": "/usr/local/cuda",
}

_CPU_ENV = {
    **_COMMON_ENV,
    # torch==2.13.0+cpu lives on the PyTorch CPU index, everything else on PyPI:
    # let uv pick the best match across both indexes (its default "first-index"
    # strategy would look for every package on the PyTorch index first).
    "UV_INDEX_STRATEGY": "unsafe-best-match",
}


# Build-time smoke checks, run by the image builder after the install step: the
# user has the uid the pod templates run as, the resolved environment is
# consistent, and torch is the intended build.
_CHECK_UID = f'test "$(id -u {pins.RUNTIME_USER})" = {pins.RUNTIME_UID}'
_CHECK_DEPS = "uv pip check"
_GPU_CHECKS = [
    _CHECK_UID,
    _CHECK_DEPS,
    "python -c \"import torch; assert (torch.version.cuda or '').startswith('13.'), torch.version.cuda\"",
]
_CPU_CHECKS = [
    _CHECK_UID,
    _CHECK_DEPS,
    "python -c \"import torch; assert torch.version.cuda is None, torch.version.cuda\"",
]


def _registry() -> str:
    return os.environ.get(REGISTRY_ENV, "").strip() or DEFAULT_REGISTRY


def make_spec(role: str, registry: str | None = None) -> ImageSpec:
    """Build a fresh ImageSpec for ``role`` (``rollout``, ``trainer`` or ``cpu``)."""
    if role not in ROLES:
        raise ValueError(f"unknown image role {role!r}; expected one of: {', '.join(ROLES)}")
    gpu = role != "cpu"
    registry = registry or _registry()
    return ImageSpec(
        name=f"dapo-{role}",
        registry=registry,
        base_image=pins.GPU_BASE_IMAGE if gpu else pins.CPU_BASE_IMAGE,
        python_version=pins.PYTHON_VERSION,
        packages=pins.requirements(role),
        apt_packages=list(pins.APT_PACKAGES[role]) or None,
        pip_extra_index_url=None if gpu else [pins.TORCH_CPU_INDEX],
        env={**(_GPU_ENV if gpu else _CPU_ENV), REGISTRY_ENV: registry},
        commands=list(_GPU_CHECKS if gpu else _CPU_CHECKS),
        platform="linux/amd64",
        builder_config={"uv_image": pins.UV_IMAGE},
    )


ROLLOUT_IMAGE: ImageSpec = make_spec("rollout")
TRAINER_IMAGE: ImageSpec = make_spec("trainer")
CPU_IMAGE: ImageSpec = make_spec("cpu")
GPU_IMAGE: ImageSpec = make_spec("gpu")

_BY_ROLE: dict[str, ImageSpec] = {
    "rollout": ROLLOUT_IMAGE,
    "trainer": TRAINER_IMAGE,
    "cpu": CPU_IMAGE,
    "gpu": GPU_IMAGE,
}


def image_for(role: str) -> ImageSpec:
    """Return the ImageSpec for a task role: ``"rollout"``, ``"trainer"`` or ``"cpu"``.

    Raises ``ValueError`` (naming the valid roles) for anything else.
    """
    if not isinstance(role, str):
        raise ValueError(f"image role must be a string, got {type(role).__name__}; expected one of: {', '.join(ROLES)}")
    try:
        return _BY_ROLE[role]
    except KeyError:
        raise ValueError(f"unknown image role {role!r}; expected one of: {', '.join(ROLES)}") from None


__all__ = [
    "CPU_IMAGE",
    "DEFAULT_REGISTRY",
    "GPU_IMAGE",
    "ROLES",
    "ROLLOUT_IMAGE",
    "TRAINER_IMAGE",
    "image_for",
    "make_spec",
]
