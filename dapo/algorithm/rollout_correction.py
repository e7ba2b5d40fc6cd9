"""Rollout correction: importance weights for the gap between the engine that sampled and the trainer.

The rollout engine samples o_i from pi_rollout (vLLM: its own kernels, bf16 sampler); the
loss's pi_theta_old is the trainer's recomputation. They differ most on low-probability
tokens (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
training"), and a stale policy (one step off) differs more. Each token's loss L_{i,t}
(dapo.algorithm.loss) is weighted by w_{i,t}, detached, from the ratio

    rho_{i,t} = pi_theta_old(o_{i,t}) / pi_rollout(o_{i,t})          (token level)
    rho_i     = prod_t rho_{i,t} = exp(sum_t log rho_{i,t})          (sequence level, every token of o_i)

truncated at C (TIS: w = min(rho, C)) or masked above C (w = rho if rho <= C else 0),
chosen by name from ROLLOUT_CORRECTIONS (AlgorithmConfig.rollout_correction,
rollout_correction_threshold = C). The names are verl's rollout_is="token"/"sequence" with
a float threshold (TIS) and TRL's vllm_importance_sampling_mode
"token_truncate"/"sequence_truncate"/"token_mask"/"sequence_mask".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from dapo.algorithm.loss import masked_mean

LOG_RATIO_CLAMP = 20.0
"""log rho is clamped to [-20, 20] before exp (verl's SAFETY_BOUND): one wild token cannot overflow."""


@dataclass(frozen=True)
class RolloutCorrection:
    """One correction: the level its ratio is taken at, and what happens above C."""

    level: Literal["token", "sequence"]
    above_threshold: Literal["truncate", "mask"]


ROLLOUT_CORRECTIONS: dict[str, RolloutCorrection | None] = {
    "none": None,
    "token_tis": RolloutCorrection("token", "truncate"),
    "sequence_tis": RolloutCorrection("sequence", "truncate"),
    "token_mask": RolloutCorrection("token", "mask"),
    "sequence_mask": RolloutCorrection("sequence", "mask"),
}


def log_ratios(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor, level: str
) -> torch.Tensor:
    """log rho per token (B, R): log pi_old - log pi_rollout, or its sum over the response's
    valid tokens on every token of it (sequence level); 0 where mask is 0."""
    mask = mask.to(old_log_probs.dtype)
    log_rho = (old_log_probs - rollout_log_probs) * mask
    if level == "sequence":
        log_rho = log_rho.sum(dim=-1, keepdim=True).expand_as(log_rho) * mask
    return log_rho


def correction_weights(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor, name: str, threshold: float
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """(w (B, R), detached, 0 where mask is 0; None for "none") and the rollout_corr/ metrics:
    weight_mean and weight_max over valid tokens, truncated_fraction or masked_fraction (the
    tokens whose rho exceeds C), and the mismatch: kl = E[log pi_rollout - log pi_old] (k1)
    and k3_kl = E[rho - log rho - 1] over the sampled tokens (verl's estimators)."""
    token_log_rho = (old_log_probs - rollout_log_probs).detach()
    valid = mask.to(torch.bool)
    metrics = {
        "rollout_corr/kl": masked_mean(-token_log_rho, mask).item(),
        "rollout_corr/k3_kl": masked_mean(torch.expm1(token_log_rho) - token_log_rho, mask).item(),
    }
    correction = ROLLOUT_CORRECTIONS[name]
    if correction is None:
        return None, metrics
    rho = torch.exp(
        log_ratios(old_log_probs.detach(), rollout_log_probs, mask, correction.level).clamp(
            -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP
        )
    )
    above = (rho > threshold) & valid
    if correction.above_threshold == "truncate":
        weights = rho.clamp(max=threshold)
    else:
        weights = torch.where(above, torch.zeros_like(rho), rho)
    weights = weights * mask.to(weights.dtype)
    kind = "truncated" if correction.above_threshold == "truncate" else "masked"
    metrics.update(
        {
            "rollout_corr/weight_mean": masked_mean(weights, mask).item(),
            "rollout_corr/weight_max": weights.masked_fill(~valid, float("-inf")).max().item() if valid.any() else 0.0,
            f"rollout_corr/{kind}_fraction": masked_mean(above.to(weights.dtype), mask).item(),
        }
    )
    return weights, metrics
