"""The DAPO policy update (Yu et al. 2025, arXiv 2503.14476), independent of the training backend.

For a scored batch of G responses o_i per question q with rewards R_i:

1. A_i = (R_i - mean({R_j})) / (std({R_j}) + eps) within each group, or the estimator
   ``adv_estimator`` names (``dapo.algorithm.advantages``);
2. log pi_theta_old(o_{i,t}) (and the token entropy) recomputed by the trainer without grad;
3. loss mask = response mask, minus truncated responses when ``overlong_filtering``;
4. ``ppo_epochs`` passes over mini-batches of ``ppo_mini_batch_size`` whole groups,
   shuffled with a generator seeded by (config.seed, step, epoch);
5. per mini-batch, the decoupled-clip loss L_{i,t} (``dapo.algorithm.loss``) over micro-batches of
   ``micro_batch_size`` responses or of ``max_tokens_per_micro_batch`` tokens
   (``dapo.algorithm.micro_batches``), each micro loss weighted by its share of the
   mini-batch's valid tokens sum_i |o_i| (token-mean) or of its responses with a valid
   token (seq modes), so the accumulated gradient is exactly that of the whole
   mini-batch's loss; clip at ``grad_clip``; AdamW step at
   lr = ``lr * min(1, (step + 1) / warmup_steps)`` (linear warm-up over policy steps,
   then constant);
6. an update whose loss or gradient norm is not finite is not applied (counted in
   ``nonfinite_updates``; the caller decides whether to stop).

Across data-parallel ranks (DeepSpeed with WORLD_SIZE > 1) every rank holds the
whole scored table: the old-log-prob pass and the micro-batches of each mini-batch
are dealt over the ranks (round-robin, or by tokens under a token budget), each micro
loss is scaled by the world size
(DeepSpeed averages gradients over ranks), and ranks short of a micro-batch run a
zero-weight one so that all ranks run the same collectives.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa
import torch
import torch.nn.functional as F

from dapo.algorithm.advantages import ADVANTAGE_EPS, ADVANTAGE_ESTIMATORS, group_index
from dapo.algorithm.batch import PolicyBatch, collate_table
from dapo.algorithm.loss import LOSS_AGGREGATIONS, POLICY_LOSSES, masked_mean
from dapo.algorithm.micro_batches import plan_micro_batches
from dapo.algorithm.rollout_correction import correction_weights
from dapo.config import AlgorithmConfig, StepConfig, section_values
from dapo.plugins import resolve as resolve_plugin

if TYPE_CHECKING:
    from dapo.engines.trainer import PolicyTrainer

logger = logging.getLogger(__name__)


def lr_at(config: StepConfig, step: int) -> float:
    """Linear warm-up over ``warmup_steps`` policy steps (step 0 gets lr / warmup_steps), then constant."""
    if config.warmup_steps <= 0:
        return config.lr
    return config.lr * min(1.0, (step + 1) / config.warmup_steps)


def shuffle_seed(seed: int, step: int, epoch: int) -> int:
    """The seed of the mini-batch order of (seed, step, epoch): a hash, so that neighbouring values give unrelated
    orders."""
    digest = hashlib.sha256(f"dapo-minibatch:{seed}:{step}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass
class StepData:
    """A scored batch in tensor form with everything the updates need."""

    batch: PolicyBatch
    advantages: torch.Tensor  # (B,)
    old_log_probs: torch.Tensor  # (B, R)
    entropy: torch.Tensor  # (B, R)
    loss_mask: torch.Tensor  # (B, R) float
    group_rows: list[torch.Tensor]  # row indices of each group, in order of first appearance
    metrics: dict[str, float]
    rollout_weights: torch.Tensor | None = None  # (B, R) rollout correction w_{i,t}; None: off


def prepare_step(trainer: PolicyTrainer, scored: pa.Table, config: StepConfig, temperature: float) -> StepData:
    """Advantages, collated tensors, old log-probs (no grad) and the loss mask."""
    if scored.num_rows == 0:
        raise ValueError("policy_update needs a non-empty scored batch")
    group_ids = scored.column("group_id").to_pylist()
    index = group_index(group_ids)
    advantages = estimate_advantages(config, scored.column("reward").to_pylist(), index)
    batch = collate_table(scored, trainer.pad_token_id)
    response_mask = batch.response_mask.to(torch.float32)
    loss_mask = response_mask.clone()
    truncated = torch.tensor([bool(t) for t in scored.column("truncated").to_pylist()])
    if config.overlong_filtering:
        loss_mask[truncated] = 0.0

    started = time.perf_counter()
    old_log_probs, entropy = trainer.log_probs(batch, temperature)
    log_prob_seconds = time.perf_counter() - started
    rollout_log_probs, covered = rollout_log_prob_tensor(scored, old_log_probs, batch.response_mask)
    compared = response_mask * covered.unsqueeze(-1)
    rollout_weights, correction_metrics = correction_weights(
        old_log_probs, rollout_log_probs, compared, config.rollout_correction, config.rollout_correction_threshold
    )
    if rollout_weights is not None:
        # rows without rollout log-probs: 1
        rollout_weights = torch.where(covered.unsqueeze(-1), rollout_weights, response_mask)

    group_rows = [(index == g).nonzero().flatten() for g in range(int(index.max()) + 1)]

    lengths = response_mask.sum(dim=-1)
    metrics = {
        "entropy": masked_mean(entropy, response_mask).item(),
        "response_length_mean": lengths.mean().item(),
        "response_length_max": lengths.max().item(),
        "tokens": response_mask.sum().item(),
        "loss_tokens": loss_mask.sum().item(),
        "truncated_frac": truncated.float().mean().item(),
        "advantage_abs_mean": advantages.abs().mean().item(),
        "groups": float(len(group_rows)),
        "old_log_prob_seconds": log_prob_seconds,
        "rollout_logprob_diff": masked_mean((old_log_probs - rollout_log_probs).abs(), compared).item()
        if compared.any()
        else float("nan"),
        **correction_metrics,
    }
    return StepData(batch, advantages, old_log_probs, entropy, loss_mask, group_rows, metrics, rollout_weights)


def estimate_advantages(config: StepConfig, rewards: list[float], index: torch.Tensor) -> torch.Tensor:
    """A_i (float32, one a response) by config.adv_estimator, from the rewards R_i as float64 and
    the dense group index (dapo.algorithm.advantages.AdvantageEstimator); ValueError names an
    estimator that returns another shape. A value that is not finite passes on: the update
    refuses it (nonfinite_updates), as it does a reward that is not finite."""
    estimator = resolve_plugin(config.adv_estimator, ADVANTAGE_ESTIMATORS, "advantage estimator")
    with torch.no_grad():
        advantages = torch.as_tensor(estimator(torch.tensor(rewards, dtype=torch.float64), index, ADVANTAGE_EPS))
    if advantages.shape != (len(rewards),):
        raise ValueError(
            f"advantage estimator {config.adv_estimator!r} returned shape {tuple(advantages.shape)}, "
            f"expected ({len(rewards)},)"
        )
    return advantages.to(torch.float32)


def rollout_log_prob_tensor(
    scored: pa.Table, old_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rollout engine's log-probs (B, R) beside the trainer's, and which rows have them for
    their whole response (covered, (B,)); an uncovered row holds the trainer's own."""
    rollout = old_log_probs.detach().clone()
    covered = torch.zeros(len(rollout), dtype=torch.bool)
    for row, values in enumerate(scored.column("rollout_log_probs").to_pylist()):
        n = int(response_mask[row].sum())
        if values and len(values) >= n > 0:
            rollout[row, :n] = torch.as_tensor(values[:n], dtype=rollout.dtype)
            covered[row] = True
    return rollout, covered


def minibatch_backward(
    trainer: PolicyTrainer,
    data: StepData,
    rows: torch.Tensor,
    config: StepConfig,
    temperature: float,
) -> dict[str, float] | None:
    """Accumulate the gradient of one mini-batch's loss over micro-batches (no optimizer step).

    The loss is config.loss_fn's token losses reduced by config.loss_agg_mode (dapo.algorithm.loss);
    the loss sees the algorithm section.
    Returns the mini-batch's metrics (pg_loss, and the loss's metrics token-weighted over
    micro-batches and ranks) with "nonfinite" = 1.0 when a micro loss was not finite (its
    backward then poisons the gradient with NaN so the step is refused everywhere), or
    None when the mini-batch has no valid token (nothing to learn; no update).
    """
    algorithm = section_values(config, AlgorithmConfig)
    loss_fn = resolve_plugin(algorithm.loss_fn, POLICY_LOSSES, "policy loss")
    aggregation = LOSS_AGGREGATIONS[algorithm.loss_agg_mode]

    def units(mask: torch.Tensor) -> float:
        """What the aggregation averages over: valid tokens, or responses with a valid token."""
        return (mask.sum(dim=-1) > 0).sum().item() if aggregation.unit == "sequence" else mask.sum().item()

    mask = data.loss_mask[rows]
    total_tokens = mask.sum().item()
    total_units = units(mask)
    if total_units == 0:
        return None
    chunks, per_rank = plan_micro_batches(
        data.batch,
        rows,
        micro_batch_size=config.micro_batch_size,
        max_tokens=config.max_tokens_per_micro_batch,
        packed=config.remove_padding,
        rank=trainer.rank,
        world_size=trainer.world_size,
    )
    mine = [(c, True) for c in chunks]
    mine += [(rows[:1], False)] * (per_rank - len(mine))  # zero-weight filler: same collectives on every rank

    width = data.batch.responses.shape[1]
    if aggregation.fixed_length:
        width = max(width, config.max_response_length)  # the loss's constant L_max, not the padded width

    keys: list[str] = []  # pg_loss, then the loss's metrics, in the loss's order (the same on every rank)
    sums = torch.zeros(0, dtype=torch.float64)
    nonfinite = torch.zeros(1, dtype=torch.float64)
    trainer.train_mode(True)
    trainer.zero_grad()
    for i, (chunk, counts) in enumerate(mine):
        micro = data.batch.select(chunk)
        log_probs, _ = trainer.forward(micro, temperature)
        pad = width - log_probs.shape[1]
        device = log_probs.device
        micro_mask = F.pad(data.loss_mask[chunk], (0, pad)).to(device)
        token_loss, loss_metrics = loss_fn(
            log_probs if pad == 0 else F.pad(log_probs, (0, pad)),
            F.pad(data.old_log_probs[chunk], (0, pad)).to(device),
            data.advantages[chunk].to(device).unsqueeze(-1),
            micro_mask,
            algorithm,
        )
        if data.rollout_weights is not None:  # w_{i,t}: dapo.algorithm.rollout_correction
            token_loss = token_loss * F.pad(data.rollout_weights[chunk], (0, pad)).to(device, token_loss.dtype)
        loss = aggregation.reduce(token_loss, micro_mask.to(token_loss.dtype))
        if not keys:
            keys = ["pg_loss", *loss_metrics]
            sums = torch.zeros(len(keys), dtype=torch.float64)
        share = units(micro_mask) / total_units if counts else 0.0
        token_share = micro_mask.sum().item() / total_tokens if counts else 0.0
        if bool(torch.isfinite(loss)):
            scaled = loss * (share * trainer.world_size)
            sums[0] += loss.item() * share
            for k, key in enumerate(keys[1:], start=1):
                sums[k] += float(loss_metrics[key]) * token_share
        else:
            # NaN reaches every parameter's gradient: the backend refuses the step (all ranks agree).
            scaled = log_probs.sum() * float("nan")
            nonfinite[0] = 1.0
        trainer.backward(scaled, last_micro_batch=i == len(mine) - 1)
    sums = torch.cat([sums, nonfinite])
    if trainer.world_size > 1:
        sums = trainer.all_reduce_sum(sums)
    out = {key: sums[k].item() for k, key in enumerate(keys)}
    out["nonfinite"] = 1.0 if sums[-1].item() > 0 else 0.0
    return out


class RolloutGapExceeded(RuntimeError):
    """The batch's rollout log-probs are too far from the trainer's: no update was made."""

    def __init__(self, gap: float, threshold: float):
        super().__init__(f"mean |rollout - trainer| log-prob {gap:.3g} > {threshold:.3g}")
        self.gap = gap
        self.threshold = threshold


def policy_update(
    trainer: PolicyTrainer,
    scored: pa.Table,
    config: StepConfig,
    step: int,
    temperature: float,
    max_rollout_gap: float | None = None,
) -> dict[str, float]:
    """One DAPO policy step on a scored batch (SCORED_SCHEMA rows); returns float metrics.

    Metrics: pg_loss, clipfrac, clipfrac_high, clipfrac_low, clipfrac_dual, approx_kl,
    ratio_mean, grad_norm (pre-clip) averaged over applied updates; lr; entropy (mean
    token entropy under the policy before the step); rollout_logprob_diff (mean |old -
    rollout| log-prob, NaN when the rollout gave none); rollout_corr/kl and k3_kl (the
    mismatch), and with config.rollout_correction its weights' metrics
    (dapo.algorithm.rollout_correction); response_length_mean/max;
    tokens (valid response tokens), loss_tokens (after overlong filtering);
    num_updates (applied), nonfinite_updates (refused), empty_updates (mini-batches
    with no valid token); step_seconds, of which old_log_prob_seconds (the no-grad pass for pi_old).

    max_rollout_gap: raise RolloutGapExceeded before any update when rollout_logprob_diff
    exceeds it (every rank computes the same value from all-reduced log-probs).
    """
    started = time.perf_counter()
    if step != trainer.state.next_step:
        logger.info("policy_update step=%d; the loaded trainer state expected step %d", step, trainer.state.next_step)
    data = prepare_step(trainer, scored, config, temperature)
    gap = data.metrics["rollout_logprob_diff"]
    if max_rollout_gap is not None and gap == gap and gap > max_rollout_gap:  # NaN: no rollout log-probs to compare
        raise RolloutGapExceeded(gap, max_rollout_gap)
    lr = lr_at(config, step)
    trainer.set_lr(lr)

    totals: dict[str, float] = {}
    applied = nonfinite = empty = 0
    n_groups = len(data.group_rows)
    for epoch in range(config.ppo_epochs):
        generator = torch.Generator().manual_seed(shuffle_seed(config.seed, step, epoch))
        order = torch.randperm(n_groups, generator=generator).tolist()
        for start in range(0, n_groups, config.ppo_mini_batch_size):
            rows = torch.cat([data.group_rows[g] for g in order[start : start + config.ppo_mini_batch_size]])
            result = minibatch_backward(trainer, data, rows, config, temperature)
            if result is None:
                empty += 1
                continue
            grad_norm, ok = trainer.step(skip=result["nonfinite"] > 0)
            if not ok:
                nonfinite += 1
                logger.warning(
                    "step %d epoch %d: update refused (loss %s, grad norm %s)",
                    step,
                    epoch,
                    result["pg_loss"],
                    grad_norm,
                )
                continue
            applied += 1
            for key, value in (*result.items(), ("grad_norm", grad_norm)):
                if key != "nonfinite":
                    totals[key] = totals.get(key, 0.0) + value
    trainer.finish_step(step, applied)

    metrics = {key: float("nan") for key in ("pg_loss", "grad_norm")}  # no update applied: still on the step line
    metrics.update({key: value / applied for key, value in totals.items()})
    metrics.update(data.metrics)
    metrics.update(
        lr=lr,
        num_updates=float(applied),
        nonfinite_updates=float(nonfinite),
        empty_updates=float(empty),
        step_seconds=time.perf_counter() - started,
    )
    return {key: float(value) for key, value in metrics.items()}
