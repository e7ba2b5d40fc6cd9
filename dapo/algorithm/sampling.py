"""Dynamic sampling (DAPO, paper eq. 11: 0 < |{o_i | is_equivalent(a, o_i)}| < G).

A group whose G rewards are all equal has zero advantage everywhere and so no
gradient. Such groups are dropped, and generation rounds are repeated until the
batch holds enough informative groups (``SamplingState`` counts them) or the round
budget is spent.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from dapo.algorithm.advantages import group_index


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


MAX_UNVERIFIED_NOTES = 3  # reasons kept for the message of a run stopped on unverified verdicts


@dataclass
class SamplingState:
    """Progress of one step's dynamic sampling, carried from round to round: a typed input
    and output of the filter_groups tasks, and of the policy step that trains the batch."""

    rounds: int = 0
    generated_groups: int = 0
    kept_groups: int = 0
    done: bool = False
    """Stop generating: the batch is full or the round budget is spent."""
    rollout_tokens: float = 0.0
    rollout_seconds: float = 0.0
    reward_seconds: float = 0.0
    """Scoring's wall time over the rounds (the slowest shard's of each round)."""
    scored_responses: int = 0
    unverified_responses: int = 0
    """Responses the scorer gave no verdict over the rounds (rewards.TaskScore.unverified)."""
    unverified_notes: list[str] = dataclasses.field(default_factory=list)
    """Why, for the first MAX_UNVERIFIED_NOTES of them."""

    def after_round(
        self,
        generated_groups: int,
        kept_groups: int,
        *,
        target_groups: int,
        max_rounds: int,
        rollout_tokens: float = 0.0,
        rollout_seconds: float = 0.0,
        reward_seconds: float = 0.0,
        scored_responses: int = 0,
        unverified_notes: Sequence[str] = (),
    ) -> SamplingState:
        """The state after one more round that generated and kept the given numbers of groups
        and scored `scored_responses`, of which len(unverified_notes) got no verdict.

        done when kept_groups >= target_groups (train_prompt_bsz) or when
        rounds >= max_rounds > 0 (max_num_gen_batches; 0 = no limit).
        """
        rounds = self.rounds + 1
        kept = self.kept_groups + kept_groups
        return SamplingState(
            rounds=rounds,
            generated_groups=self.generated_groups + generated_groups,
            kept_groups=kept,
            done=kept >= target_groups or (max_rounds > 0 and rounds >= max_rounds),
            rollout_tokens=self.rollout_tokens + rollout_tokens,
            rollout_seconds=self.rollout_seconds + rollout_seconds,
            reward_seconds=self.reward_seconds + reward_seconds,
            scored_responses=self.scored_responses + scored_responses,
            unverified_responses=self.unverified_responses + len(unverified_notes),
            unverified_notes=(self.unverified_notes + list(unverified_notes))[:MAX_UNVERIFIED_NOTES],
        )

    @property
    def unverified_share(self) -> float:
        """Responses without a verdict / responses scored over the rounds so far (0 before any)."""
        return self.unverified_responses / self.scored_responses if self.scored_responses else 0.0

    @property
    def kept_ratio(self) -> float:
        """Kept groups / generated groups over all rounds so far (0 before any)."""
        return self.kept_groups / self.generated_groups if self.generated_groups else 0.0

    def to_json(self) -> str:
        """The state as JSON: a one-step-off batch's file carries it (dapo.execution.overlap)."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> SamplingState:
        return cls(**json.loads(text))
