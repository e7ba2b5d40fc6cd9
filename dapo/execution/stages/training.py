"""The policy step: the update on a kept batch (dapo.engines.update) with the rollout guard, its
metrics, and the count of bad steps that stops a run."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pyarrow as pa

from dapo import checkpoint
from dapo.algorithm.sampling import SamplingState, informative_groups
from dapo.config import StepConfig
from dapo.execution.stages.guard import default_regenerator, rollout_guard_message
from dapo.execution.stages.scoring import batch_metrics
from dapo.faults import crash_point

logger = logging.getLogger(__name__)


def policy_step(
    config: StepConfig,
    policy_dir: str,
    batch: pa.Table,
    state: SamplingState,
    step: int,
    out_dir: str | Path,
    regenerate="default",
) -> dict[str, float]:
    """One DAPO update on the filtered batch by a trainer started on policy_dir for this step
    (the per-stage path); writes the next checkpoint to out_dir.

    A skipped step (`skips_update`, or the rollout guard: see `train_on_batch`) writes the
    unchanged policy (optimizer state included) so the run goes on. Under a launcher with
    several ranks every rank calls this with the same out_dir: all take part in the update
    and in saving (collectives), and the metrics are the same on every rank.

    regenerate: how a batch the rollout guard refuses is regenerated (`regenerate(batch)`);
    default: `default_regenerator`, a fresh rollout engine on policy_dir.
    """
    from dapo.engines.trainer import launcher_rank, make_trainer

    def skip() -> dict[str, float]:
        if launcher_rank() == 0:  # out_dir is shared by all ranks of a distributed step
            copy_checkpoint(policy_dir, out_dir, step)
        metrics["step/skipped"] = 1.0
        return metrics

    metrics = step_metrics(config, batch, state)
    if config.off_policy_steps:  # the schedule of dapo_loop's DAG: step t samples from checkpoint t - 1 (step 0 from 0)
        metrics["off_policy/staleness"] = float(min(step, config.off_policy_steps))
    if stops_on_unverified(config, state, step, metrics) or skips_update(config, batch, state, step):
        crash_point("policy_step", step)  # the kill tests reach this task on either path
        return skip()
    if regenerate == "default":
        regenerate = default_regenerator(config, policy_dir, step)
    trainer = make_trainer(config, policy_dir)
    try:
        if not train_on_batch(trainer, config, batch, step, metrics, regenerate, policy_dir):
            return skip()
        crash_point("policy_step", step)
        trainer.save(str(out_dir))
    finally:
        trainer.close()
    return metrics


def step_metrics(config: StepConfig, batch: pa.Table, state: SamplingState) -> dict[str, float]:
    """A policy step's metrics known before its update: the batch's groups, the sampling
    rounds' counts and rollout throughput, and the guard's starting values."""
    group_ids = batch.column("group_id").to_pylist()
    return {
        "sampling/kept_groups": float(len(set(group_ids))),
        # groups with a non-zero advantage somewhere, whether or not dynamic sampling ran
        "sampling/informative_groups": float(len(informative_groups(batch.column("reward").to_pylist(), group_ids))),
        "sampling/rounds": float(state.rounds),
        "sampling/kept_ratio": state.kept_ratio,
        "rollout/tokens": state.rollout_tokens,
        "rollout/seconds": state.rollout_seconds,
        "rollout/tokens_per_s": state.rollout_tokens / state.rollout_seconds if state.rollout_seconds else 0.0,
        "reward/seconds": state.reward_seconds,
        "step/skipped": 0.0,
        "guard/threshold": config.rollout_gap_threshold,
        "guard/regenerated": 0.0,
        "guard/stopped": 0.0,
        "reward/unverified_share": state.unverified_share,
        "reward/stopped": 0.0,
    }


def stops_on_unverified(config: StepConfig, state: SamplingState, step: int, metrics: dict[str, float]) -> bool:
    """Whether the share of the step's scored responses without a verdict passes
    config.max_unverified_share: then the step trains on nothing, reward/stopped = 1, and
    `check_verdicts` stops the run after the metrics reach MLflow. Logs the first reasons."""
    if state.unverified_share <= config.max_unverified_share:
        return False
    metrics["reward/stopped"] = 1.0
    logger.error(
        "%s; the first reasons: %s", unverified_message(config, metrics, step), "; ".join(state.unverified_notes)
    )
    return True


class TooManyUnverified(RuntimeError):
    """Too many of a step's responses got no verdict from their scorer for its rewards to be trusted."""


def unverified_message(config: StepConfig, metrics: dict[str, float], step: int) -> str:
    return (
        f"step {step + 1}: {metrics['reward/unverified_share']:.1%} of the responses scored got no verdict "
        f"(max_unverified_share {config.max_unverified_share:g}), so their rewards are not trusted and the run stops "
        "with the policy of the step before"
    )


def check_verdicts(config: StepConfig, step_metrics: dict[str, float], step: int) -> None:
    """Raise TooManyUnverified when the step stopped on unverified verdicts (after the
    metrics are delivered: the caller logs them first)."""
    if step_metrics.get("reward/stopped", 0.0) > 0:
        raise TooManyUnverified(
            unverified_message(config, step_metrics, step) + " (the first reasons are in the step's log)"
        )


def skips_update(config: StepConfig, batch: pa.Table, state: SamplingState, step: int) -> bool:
    """Whether the step skips its update for want of groups (an empty batch; a short one
    with on_short_batch="skip"); logs why, and a short batch that is trained on. step: the
    index of the step's input checkpoint; messages name the step as its step line does (step + 1)."""
    groups, target = len(set(batch.column("group_id").to_pylist())), config.train_prompt_bsz
    if groups == 0 or (groups < target and config.on_short_batch == "skip"):
        logger.warning(
            "step %d skipped: %d informative group(s) after %d round(s) (need %d, on_short_batch=%s)",
            step + 1,
            groups,
            state.rounds,
            target,
            config.on_short_batch,
        )
        return True
    if groups < target:
        logger.warning(
            "step %d trains on a short batch: %d of %d groups after %d round(s)", step + 1, groups, target, state.rounds
        )
    return False


def train_on_batch(
    trainer,
    config: StepConfig,
    batch: pa.Table,
    step: int,
    metrics: dict[str, float],
    regenerate,
    policy_label: str = "",
) -> bool:
    """One DAPO update of `trainer` on the batch, behind the rollout guard; adds the update's
    metrics (actor/, train/, guard/) to `metrics`. Returns whether the policy was updated.

    The rollout guard: when the batch's rollout log-probs differ from the trainer's by more
    than config.rollout_gap_threshold (mean per token), nothing is trained on it; the batch
    is regenerated (`regenerate(batch)`) and the update runs on the new batch if its gap is
    within the threshold. Otherwise (or with regenerate None) nothing is trained, and
    guard/stopped = 1: `check_rollout_guard` then stops the run, after the metrics reach
    MLflow. guard/rollout_logprob_gap is the first batch's gap. policy_label names the
    policy in the messages (the per-stage path: its checkpoint).
    """
    from dapo.engines.update import RolloutGapExceeded, policy_update

    threshold = config.rollout_gap_threshold
    try:
        update = policy_update(trainer, batch, config, step, temperature=config.temperature, max_rollout_gap=threshold)
    except RolloutGapExceeded as exceeded:
        metrics["guard/rollout_logprob_gap"] = exceeded.gap
        if regenerate is None:
            metrics["guard/stopped"] = 1.0
            logger.error("%s", rollout_guard_message(config, exceeded.gap, step, policy_label, regenerated=False))
            return False
        logger.warning(
            "step %d: rollout log-prob gap %.4g > %.3g: batch refused; restarting the rollout engine on %s "
            "and regenerating it",
            step + 1,
            exceeded.gap,
            threshold,
            policy_label or "the policy",
        )
        metrics["guard/regenerated"] = 1.0
        batch = regenerate(batch)
        metrics["guard/regenerated_groups"] = float(len(set(batch.column("group_id").to_pylist())))
        if batch.num_rows == 0:
            logger.warning("step %d skipped: the regenerated batch has no informative group", step + 1)
            return False
        try:
            update = policy_update(
                trainer, batch, config, step, temperature=config.temperature, max_rollout_gap=threshold
            )
        except RolloutGapExceeded as again:
            metrics["guard/stopped"] = 1.0
            metrics["guard/regenerated_logprob_gap"] = again.gap
            logger.error("%s", rollout_guard_message(config, again.gap, step, policy_label))
            return False
    else:
        metrics["guard/rollout_logprob_gap"] = update["rollout_logprob_diff"]
    metrics.update(
        {key if "/" in key else f"actor/{key}": value for key, value in update.items()}
    )  # rollout_corr/ keeps its group
    metrics.update(batch_metrics(batch, prefix="train/"))
    return True


class TooManyBadSteps(RuntimeError):
    """Consecutive policy steps whose every update was refused as non-finite."""


def is_bad_step(step_metrics: dict[str, float]) -> bool:
    """A step that refused at least one non-finite update and applied none."""
    return step_metrics.get("actor/nonfinite_updates", 0.0) > 0 and step_metrics.get("actor/num_updates", 0.0) == 0


def count_bad_steps(bad_steps: int, step_metrics: dict[str, float], max_bad_steps: int, step: int) -> int:
    """Consecutive bad steps (is_bad_step) after this one. Raises TooManyBadSteps at max_bad_steps."""
    bad_steps = bad_steps + 1 if is_bad_step(step_metrics) else 0
    if bad_steps >= max_bad_steps:
        raise TooManyBadSteps(
            f"step {step}: {bad_steps} consecutive steps with a non-finite loss or gradient "
            f"(max_bad_steps={max_bad_steps}); the last good checkpoint is the input of this step"
        )
    return bad_steps


def copy_checkpoint(source: str | Path, target: str | Path, step: int) -> None:
    """The unchanged policy (weights and optimizer state) as the checkpoint of a skipped step."""
    with checkpoint.atomic_dir(target, step=step) as scratch:
        shutil.copytree(source, scratch, dirs_exist_ok=True)
