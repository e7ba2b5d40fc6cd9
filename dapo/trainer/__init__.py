"""The policy step's trainer backends (``base``) and launcher helpers (``launch``).

The update itself (the DAPO algorithm) is ``dapo.update.policy_update``.
"""

from .base import META_FILE, STATE_DIR, PolicyTrainer, TrainerState, make_trainer
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
