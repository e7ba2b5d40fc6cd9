"""Dynamic sampling (DAPO, paper eq. 11: 0 < |{o_i | is_equivalent(a, o_i)}| < G).

A group whose G rewards are all equal has zero advantage everywhere and so no
gradient. Such groups are dropped, and generation rounds are repeated until the
batch holds enough informative groups.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from dapo.advantages import group_index


def informative_groups(
    rewards: torch.Tensor | Sequence[float],
    group_ids: Sequence[Hashable] | torch.Tensor,
) -> list[Hashable]:
    """Ids of groups whose rewards are not all equal (std > 0), in order of first appearance."""
    rewards = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    ids = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    if len(ids) != rewards.numel():
        raise ValueError(f"{rewards.numel()} rewards but {len(ids)} group ids")
    if not ids:
        return []
    index = group_index(ids)
    n_groups = int(index.max()) + 1
    lows = torch.full((n_groups,), float("inf"), dtype=torch.float64).scatter_reduce(0, index, rewards, "amin")
    highs = torch.full((n_groups,), float("-inf"), dtype=torch.float64).scatter_reduce(0, index, rewards, "amax")
    ordered_ids = list(dict.fromkeys(ids))
    return [gid for gid, lo, hi in zip(ordered_ids, lows.tolist(), highs.tolist()) if hi > lo]


@dataclass
class GroupBatchAccumulator:
    """Collects informative groups over generation rounds for one policy step.

    Args:
        target_groups: train_prompt_bsz, the groups one step trains on.
        max_rounds: max_num_gen_batches; 0 = no limit.
    Group ids must be unique across rounds (e.g. "<round>-<prompt uid>").
    """

    target_groups: int
    max_rounds: int
    kept: list[Hashable] = field(default_factory=list)
    rounds: int = 0
    generated_groups: int = 0

    def add_round(self, rewards: torch.Tensor | Sequence[float], group_ids: Sequence[Hashable]) -> list[Hashable]:
        """Filter one round's groups; returns (and keeps) the informative ones."""
        kept_now = informative_groups(rewards, group_ids)
        self.rounds += 1
        self.generated_groups += len(dict.fromkeys(group_ids))
        self.kept.extend(kept_now)
        return kept_now

    @property
    def is_full(self) -> bool:
        return len(self.kept) >= self.target_groups

    @property
    def out_of_rounds(self) -> bool:
        return self.max_rounds > 0 and self.rounds >= self.max_rounds

    @property
    def done(self) -> bool:
        """Stop generating: the batch is full or the round budget is spent."""
        return self.is_full or self.out_of_rounds

    def selected(self) -> list[Hashable]:
        """The groups to train on: the first target_groups kept (fewer if short)."""
        return self.kept[: self.target_groups]

    @property
    def kept_ratio(self) -> float:
        """Informative groups / generated groups over all rounds so far."""
        return len(self.kept) / self.generated_groups if self.generated_groups else 0.0
