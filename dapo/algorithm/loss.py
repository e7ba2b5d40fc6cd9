"""DAPO's policy-gradient objective: decoupled clip and token-level aggregation.

For response i, token t, with importance ratio r_{i,t} = pi_theta / pi_theta_old and
group-normalised advantage A_i (paper, eq. 8):

    L_{i,t} = -min(r_{i,t} * A_i, clip(r_{i,t}, 1 - eps_low, 1 + eps_high) * A_i)

No KL term and no entropy bonus. All tensors are (batch, response_len) unless said.

A loss is two choices, each by name from a registry: the per-token loss L_{i,t}
(POLICY_LOSSES, DAPOConfig.loss_fn) and how token losses become a scalar
(LOSS_AGGREGATIONS, DAPOConfig.loss_agg_mode). A new loss is one function under
@register_policy_loss, or "path/to/file.py:function" in loss_fn.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

LOG_RATIO_CLAMP = 20.0
"""log r is clamped to [-20, 20] before exp so one wild token cannot overflow the loss."""


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of values over positions where mask is 1 (0 when the mask is empty)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


# --- aggregation: token losses -> one scalar ------------------------------------------
@dataclass(frozen=True)
class LossAggregation:
    """A reduction of per-token losses (B, R) under a mask to a scalar.

    unit: what the reduction averages over ("token": valid tokens, "sequence": responses
    with a valid token), so that micro-batch losses can be weighted into exactly the
    mini-batch's loss (dapo.engines.update.minibatch_backward). fixed_length: the loss divides by
    the width of loss_mat, which must then be L_max, not the padded width.
    """

    reduce: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    unit: Literal["token", "sequence"]
    fixed_length: bool = False


LOSS_AGGREGATIONS: dict[str, LossAggregation] = {}


def register_loss_agg(name: str, unit: Literal["token", "sequence"], fixed_length: bool = False):
    """Add a reduction (loss_mat, mask) -> scalar to LOSS_AGGREGATIONS under `name`."""

    def add(reduce: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        LOSS_AGGREGATIONS[name] = LossAggregation(reduce, unit, fixed_length)
        return reduce

    return add


def _sequence_mean(seq_losses: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of per-sequence losses over the sequences with a valid token."""
    has_tokens = (mask.sum(dim=-1) > 0).to(seq_losses.dtype)
    return (seq_losses * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)


@register_loss_agg("token-mean", unit="token")
def token_mean(loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum_{i,t} L_{i,t} / sum_i |o_i|   (DAPO, eq. 12: every token weighs the same)."""
    return masked_mean(loss_mat, mask)


@register_loss_agg("seq-mean-token-mean", unit="sequence")
def seq_mean_token_mean(loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1/G sum_i 1/|o_i| sum_t L_{i,t}   (GRPO: every response weighs the same)."""
    mask = mask.to(loss_mat.dtype)
    return _sequence_mean((loss_mat * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0), mask)


@register_loss_agg("seq-mean-token-sum-norm", unit="sequence", fixed_length=True)
def seq_mean_token_sum_norm(loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1/G sum_i 1/L_max sum_t L_{i,t}   (Dr. GRPO; L_max = loss_mat.shape[-1])."""
    mask = mask.to(loss_mat.dtype)
    return _sequence_mean((loss_mat * mask).sum(dim=-1) / loss_mat.shape[-1], mask)


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, agg: str) -> torch.Tensor:
    """Reduce per-token losses to a scalar by the LOSS_AGGREGATIONS entry `agg`.
    Sequences with no valid token do not count in the sequence modes."""
    if agg not in LOSS_AGGREGATIONS:
        raise ValueError(f"agg={agg!r}: must be one of {sorted(LOSS_AGGREGATIONS)}")
    return LOSS_AGGREGATIONS[agg].reduce(loss_mat, loss_mask.to(loss_mat.dtype))


# --- per-token policy losses ----------------------------------------------------------
PolicyLoss = Callable[..., "tuple[torch.Tensor, dict[str, float]]"]
"""loss_fn(log_prob, old_log_prob, advantages, response_mask, config) -> (L (B, R), metrics):
log pi_theta and log pi_theta_old of the response tokens, A_i as (B, 1), the mask of
tokens that count, and the run's algorithm section (dapo.config.AlgorithmConfig: clip_low,
clip_high, clip_ratio_c, ..., the objective's settings); metrics are floats averaged over
the mini-batch's tokens (actor/<name> in MLflow)."""

POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Add a per-token policy loss to POLICY_LOSSES under `name`."""

    def add(loss_fn: PolicyLoss) -> PolicyLoss:
        POLICY_LOSSES[name] = loss_fn
        return loss_fn

    return add


def clipped_token_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled-clip PPO surrogate L_{i,t} (DAPO), optionally with the dual-clip bound.

    Args:
        log_prob: log pi_theta(o_t | q, o_<t) under the policy being updated.
        old_log_prob: the same under pi_theta_old (the policy that sampled the batch).
        advantages: A_{i,t}; (batch,) is broadcast over tokens.
        response_mask: 1 for tokens that count in the loss, 0 for padding.
        clip_low, clip_high: eps_low, eps_high.
        clip_ratio_c: dual-clip c > 1: for A < 0 the loss is also bounded by -c * A
            (Ye et al. 2020), so a huge ratio on a bad token cannot dominate.

    Returns:
        (token losses, metrics) with metrics clipfrac (tokens where the clipped term was
        taken), clipfrac_high (ratio above 1+eps_high with A>0), clipfrac_low (ratio
        below 1-eps_low with A<0), clipfrac_dual (tokens bounded by c), approx_kl (mean
        of log pi_old - log pi_theta), ratio_mean.
    """
    if log_prob.shape != old_log_prob.shape or log_prob.shape != response_mask.shape:
        raise ValueError(
            f"shape mismatch: log_prob {tuple(log_prob.shape)}, old_log_prob "
            f"{tuple(old_log_prob.shape)}, response_mask {tuple(response_mask.shape)}"
        )
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.expand_as(log_prob)
    mask = response_mask.to(log_prob.dtype)

    log_ratio = torch.clamp(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)

    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    # -min(rA, clip(r)A) == max(-rA, -clip(r)A)
    token_loss = torch.maximum(unclipped, clipped)
    clip_taken = clipped > unclipped

    dual_taken = torch.zeros_like(clip_taken)
    if clip_ratio_c is not None:
        dual_bound = -advantages * clip_ratio_c
        negative = advantages < 0
        dual_taken = negative & (token_loss > dual_bound)
        token_loss = torch.where(negative, torch.minimum(token_loss, dual_bound), token_loss)

    with torch.no_grad():
        metrics = {
            "clipfrac": masked_mean(clip_taken.to(mask.dtype), mask).item(),
            "clipfrac_high": masked_mean(((ratio > 1.0 + clip_high) & (advantages > 0)).to(mask.dtype), mask).item(),
            "clipfrac_low": masked_mean(((ratio < 1.0 - clip_low) & (advantages < 0)).to(mask.dtype), mask).item(),
            "clipfrac_dual": masked_mean(dual_taken.to(mask.dtype), mask).item(),
            "approx_kl": masked_mean(-log_ratio, mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
        }
    return token_loss, metrics


@register_policy_loss("dapo")
def dapo(log_prob, old_log_prob, advantages, response_mask, config) -> tuple[torch.Tensor, dict[str, float]]:
    """DAPO's decoupled clip, L_{i,t} = -min(r_{i,t} A_i, clip(r_{i,t}, 1 - eps_low, 1 + eps_high) A_i)
    with eps_low = config.clip_low, eps_high = config.clip_high, and the dual clip at
    config.clip_ratio_c (clipped_token_loss); config is the algorithm section."""
    return clipped_token_loss(
        log_prob,
        old_log_prob,
        advantages,
        response_mask,
        clip_low=config.clip_low,
        clip_high=config.clip_high,
        clip_ratio_c=config.clip_ratio_c,
    )


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy H = logsumexp(z) - sum softmax(z) * z, in nats."""
    log_z = torch.logsumexp(logits, dim=-1)
    probs = torch.softmax(logits, dim=-1)
    return log_z - (probs * logits).sum(dim=-1)
