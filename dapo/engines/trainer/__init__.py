"""The policy step's trainer backends (``base``) and launcher helpers (``launch``).

The update itself (the DAPO algorithm) is ``dapo.engines.update.policy_update``.
"""

from __future__ import annotations

from pathlib import Path

from dapo.config import StepConfig

from .base import META_FILE, STATE_DIR, PolicyTrainer, TrainerState
from .launch import launcher_rank, local_rank0_first, prune_step_dirs, rank0_value

__all__ = [
    "META_FILE",
    "STATE_DIR",
    "PolicyTrainer",
    "TrainerState",
    "launcher_rank",
    "local_rank0_first",
    "make_trainer",
    "prune_step_dirs",
    "rank0_value",
]


def make_trainer(config: StepConfig, model_dir: str | Path) -> PolicyTrainer:
    """The trainer of config.trainer_backend on model_dir (resuming model_dir/trainer_state if present)."""
    if config.trainer_backend == "deepspeed":
        from dapo.engines.trainer.deepspeed_backend import DeepSpeedTrainer

        return DeepSpeedTrainer(config, model_dir)
    if config.trainer_backend == "torch":
        from dapo.engines.trainer.torch_backend import TorchTrainer

        return TorchTrainer(config, model_dir)
    raise ValueError(f"unknown trainer_backend {config.trainer_backend!r}")
