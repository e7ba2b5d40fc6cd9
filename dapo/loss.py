"""DAPO's policy-gradient objective: decoupled clip and token-level aggregation.

For response i, token t, with importance ratio r_{i,t} = pi_theta / pi_theta_old and
group-normalised advantage A_i (paper, eq. 8):

    L_{i,t} = -min(r_{i,t} * A_i, clip(r_{i,t}, 1 - eps_low, 1 + eps_high) * A_i)

No KL term and no entropy bonus. All tensors are (batch, response_len) unless said.
"""

from __future__ import annotations

import torch

from dapo.config import LOSS_AGG_MODES

LOG_RATIO_CLAMP = 20.0
"""log r is clamped to [-20, 20] before exp so one wild token cannot overflow the loss."""


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of values over positions where mask is 1 (0 when the mask is empty)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, agg: str) -> torch.Tensor:
    """Reduce per-token losses to a scalar.

    token-mean:               sum_{i,t} L_{i,t} / sum_i |o_i|          (DAPO, eq. 12)
    seq-mean-token-mean:      1/G sum_i 1/|o_i| sum_t L_{i,t}          (GRPO)
    seq-mean-token-sum-norm:  1/G sum_i 1/L_max sum_t L_{i,t}          (Dr. GRPO; L_max = loss_mat.shape[-1])
    Sequences with no valid token do not count in the seq-mean modes.
    """
    mask = loss_mask.to(loss_mat.dtype)
    if agg == "token-mean":
        return masked_mean(loss_mat, mask)
    token_sums = (loss_mat * mask).sum(dim=-1)
    token_counts = mask.sum(dim=-1)
    has_tokens = (token_counts > 0).to(loss_mat.dtype)
    if agg == "seq-mean-token-mean":
        seq_losses = token_sums / token_counts.clamp(min=1.0)
    elif agg == "seq-mean-token-sum-norm":
        seq_losses = token_sums / loss_mat.shape[-1]
    else:
        raise ValueError(f"agg={agg!r}: must be one of {LOSS_AGG_MODES}")
    return (seq_losses * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)


def policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    clip_ratio_c: float | None = None,
    agg: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled-clip PPO surrogate (DAPO), optionally with the dual-clip bound.

    Args:
        log_prob: log pi_theta(o_t | q, o_<t) under the policy being updated.
        old_log_prob: the same under pi_theta_old (the policy that sampled the batch).
        advantages: A_{i,t}; (batch,) is broadcast over tokens.
        response_mask: 1 for tokens that count in the loss, 0 for padding.
        clip_low, clip_high: eps_low, eps_high.
        clip_ratio_c: dual-clip c > 1: for A < 0 the loss is also bounded by -c * A
            (Ye et al. 2020), so a huge ratio on a bad token cannot dominate.
        agg: how token losses become a scalar (see agg_loss).

    Returns:
        (loss, metrics) with metrics clipfrac (tokens where the clipped term was taken),
        clipfrac_high (ratio above 1+eps_high with A>0), clipfrac_low (ratio below
        1-eps_low with A<0), clipfrac_dual (tokens bounded by c), approx_kl
        (mean of log pi_old - log pi_theta), ratio_mean.
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

    loss = agg_loss(token_loss, mask, agg)

    with torch.no_grad():
        metrics = {
            "clipfrac": masked_mean(clip_taken.to(mask.dtype), mask).item(),
            "clipfrac_high": masked_mean(((ratio > 1.0 + clip_high) & (advantages > 0)).to(mask.dtype), mask).item(),
            "clipfrac_low": masked_mean(((ratio < 1.0 - clip_low) & (advantages < 0)).to(mask.dtype), mask).item(),
            "clipfrac_dual": masked_mean(dual_taken.to(mask.dtype), mask).item(),
            "approx_kl": masked_mean(-log_ratio, mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
        }
    return loss, metrics


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy H = logsumexp(z) - sum softmax(z) * z, in nats."""
    log_z = torch.logsumexp(logits, dim=-1)
    probs = torch.softmax(logits, dim=-1)
    return log_z - (probs * logits).sum(dim=-1)
