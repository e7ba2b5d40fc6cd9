"""Group-relative outcome advantages (GRPO / DAPO, paper eq. 9).

    A_i = (R_i - mean({R_j}_{j=1..G})) / (std({R_j}_{j=1..G}) + eps)

broadcast to every token of response i. No critic, no KL, no discount.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch


def group_index(group_ids: Sequence[Hashable] | torch.Tensor) -> torch.Tensor:
    """Dense int64 index (0..n_groups-1) for arbitrary group ids, in order of first appearance."""
    if isinstance(group_ids, torch.Tensor):
        group_ids = group_ids.tolist()
    positions: dict[Hashable, int] = {}
    return torch.tensor([positions.setdefault(g, len(positions)) for g in group_ids], dtype=torch.long)


def group_advantages(
    rewards: torch.Tensor | Sequence[float],
    group_ids: Sequence[Hashable] | torch.Tensor,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-response advantage (R - mean) / (std + eps) within each group.

    std is the unbiased sample std (torch.std's default). A group of one response has
    no baseline and gets advantage 0. Returns float32 of shape (n_responses,).
    """
    rewards = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    index = group_index(group_ids)
    if index.numel() != rewards.numel():
        raise ValueError(f"{rewards.numel()} rewards but {index.numel()} group ids")
    if rewards.numel() == 0:
        return torch.zeros(0)
    n_groups = int(index.max()) + 1
    counts = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, index, torch.ones_like(rewards))
    means = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, index, rewards) / counts
    centred = rewards - means[index]
    sq_sums = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, index, centred**2)
    stds = torch.sqrt(sq_sums / (counts - 1).clamp(min=1.0))
    advantages = centred / (stds[index] + eps)
    advantages[counts[index] < 2] = 0.0
    return advantages.to(torch.float32)
