"""Group-relative outcome advantages (GRPO / DAPO, paper eq. 9).

    A_i = (R_i - mean({R_j}_{j=1..G})) / (std({R_j}_{j=1..G}) + eps)

broadcast to every token of response i. No critic, no KL, no discount.

An advantage estimator is one function by name from ADVANTAGE_ESTIMATORS
(DAPOConfig.adv_estimator): "group_norm" (the formula above, DAPO's and GRPO's), "rloo"
(REINFORCE leave-one-out) or "dr_grpo" (Dr. GRPO's unscaled group mean). A new one is one
function under @register_advantage_estimator, or "path/to/file.py:function" in adv_estimator.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

import torch

ADVANTAGE_EPS = 1e-6
"""eps of the std in group_norm's denominator (verl's epsilon default); the estimators receive it."""

AdvantageEstimator = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
"""estimator(rewards, group_ids, eps) -> A, float32 of shape (n_responses,), A_i broadcast to
every token of response i. The update passes rewards as a float64 tensor (n_responses,) of
outcome rewards R_i (one scalar a response, not verl's token_level_rewards), group_ids as an
int64 tensor (n_responses,) of dense group indices 0..n_groups-1 in order of first appearance
(group_index: rows of one prompt share one), and eps = ADVANTAGE_EPS. Runs in the trainer
without grad; the built-ins also take lists and any hashable group ids."""

ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


E = TypeVar("E", bound=AdvantageEstimator)


def register_advantage_estimator(name: str) -> Callable[[E], E]:
    """Add an advantage estimator to ADVANTAGE_ESTIMATORS under `name`."""

    def add(estimator: E) -> E:
        ADVANTAGE_ESTIMATORS[name] = estimator
        return estimator

    return add


def group_index(group_ids: Sequence[Hashable] | torch.Tensor) -> torch.Tensor:
    """Dense int64 index (0..n_groups-1) for arbitrary group ids, in order of first appearance."""
    if isinstance(group_ids, torch.Tensor):
        group_ids = group_ids.tolist()
    positions: dict[Hashable, int] = {}
    return torch.tensor([positions.setdefault(g, len(positions)) for g in group_ids], dtype=torch.long)


@register_advantage_estimator("group_norm")
def group_advantages(
    rewards: torch.Tensor | Sequence[float],
    group_ids: Sequence[Hashable] | torch.Tensor,
    eps: float = ADVANTAGE_EPS,
) -> torch.Tensor:
    """Per-response advantage (R - mean) / (std + eps) within each group (GRPO, DAPO eq. 9).

    std is the unbiased sample std (torch.std's default). A group of one response has
    no baseline and gets advantage 0. Returns float32 of shape (n_responses,).
    """
    centred, index, counts = _centred(rewards, group_ids)
    sq_sums = torch.zeros(counts.numel(), dtype=torch.float64).index_add_(0, index, centred**2)
    stds = torch.sqrt(sq_sums / (counts - 1).clamp(min=1.0))
    advantages = centred / (stds[index] + eps)
    advantages[counts[index] < 2] = 0.0
    return advantages.to(torch.float32)


def _centred(
    rewards: torch.Tensor | Sequence[float], group_ids: Sequence[Hashable] | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(R_i - mean of R_i's group, the dense group index, G of each group): float64, the
    first two of shape (n_responses,), the last (n_groups,)."""
    rewards = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    index = group_index(group_ids)
    if index.numel() != rewards.numel():
        raise ValueError(f"{rewards.numel()} rewards but {index.numel()} group ids")
    n_groups = int(index.max()) + 1 if index.numel() else 0
    counts = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, index, torch.ones_like(rewards))
    means = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, index, rewards) / counts
    return rewards - means[index], index, counts


@register_advantage_estimator("rloo")
def rloo_advantages(
    rewards: torch.Tensor | Sequence[float],
    group_ids: Sequence[Hashable] | torch.Tensor,
    eps: float = ADVANTAGE_EPS,
) -> torch.Tensor:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024, arXiv 2402.14740):
    each response's baseline is the mean of the other G - 1 rewards of its group,

        A_i = R_i - 1/(G-1) sum_{j != i} R_j = G/(G-1) * (R_i - mean({R_j}_{j=1..G})).

    A group of one response has no other reward to compare with and gets advantage 0
    (verl's compute_rloo_outcome_advantage leaves it R_i). eps is not used. float32 (n_responses,).
    """
    centred, index, counts = _centred(rewards, group_ids)
    sizes = counts[index]
    return (centred * sizes / (sizes - 1).clamp(min=1.0)).to(torch.float32)  # G = 1: centred is 0


@register_advantage_estimator("dr_grpo")
def dr_grpo_advantages(
    rewards: torch.Tensor | Sequence[float],
    group_ids: Sequence[Hashable] | torch.Tensor,
    eps: float = ADVANTAGE_EPS,
) -> torch.Tensor:
    """Dr. GRPO's advantage (Liu et al. 2025, "Understanding R1-Zero-Like Training",
    arXiv 2503.20783): GRPO's without the division by the group's std,

        A_i = R_i - mean({R_j}_{j=1..G}),

    so that groups of nearly equal rewards are not scaled up (verl: grpo with
    norm_adv_by_std_in_grpo=False). A group of one response gets 0 (R_i minus its own mean;
    verl's special case leaves it R_i). eps is not used. float32 (n_responses,).
    """
    centred, _, _ = _centred(rewards, group_ids)
    return centred.to(torch.float32)
