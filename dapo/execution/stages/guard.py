"""The rollout guard: a batch whose rollout log-probs are too far from the trainer's is not
trained on; it is sampled again by an engine started afresh, and the run stops if the gap
persists."""

from __future__ import annotations

import pyarrow as pa

from dapo.config import StepConfig
from dapo.execution.stages.generation import PROMPT_COLUMNS, derived_seed, policy_engine, rows_table, training_sampling
from dapo.execution.stages.scoring import kept_groups, verify_rewards

GUARD_CAUSES = (
    "an in-place weight reload that left part of the engine on old weights (tied embeddings in vLLM "
    "before dapo-flyte's fix; any parameter the engine's loader skips), a checkpoint whose weights do not "
    "load the same way in vLLM and transformers (renamed, missing or shared tensors), a rollout dtype or "
    "kernel far less precise than the trainer's, or rollout log-probs from other sampling settings"
)


class RolloutMismatch(RuntimeError):
    """The rollout engine's log-probs disagree with the trainer's, even after a restart."""


def rollout_guard_message(
    config: StepConfig, gap: float, step: int, checkpoint_dir: str = "", regenerated: bool = True
) -> str:
    """The error that stops a run: the gap, the checkpoint, what was tried and the likely cause."""
    where = checkpoint_dir or f"the checkpoint step {step} started from (after {step} updates: MLflow step {step})"
    tried = (
        "also after the rollout engine was restarted on the checkpoint and the batch regenerated"
        if regenerated
        else "from a rollout engine that had started fresh on the checkpoint (each rollout pod starts its own)"
    )
    return (
        f"step {step + 1}: the rollout's sampled-token log-probs differ from the trainer's by {gap:.4g} nats per token "
        f"on average (max_rollout_logprob_gap {config.rollout_gap_threshold:.3g} for {config.dtype}), {tried}; "
        f"training would use importance ratios against other weights than the policy's, so the run stops. "
        f"Policy: {where}. Likely causes: {GUARD_CAUSES}."
    )


def check_rollout_guard(
    config: StepConfig, step_metrics: dict[str, float], step: int, checkpoint_dir: str = ""
) -> None:
    """Raise RolloutMismatch when policy_step stopped on the rollout guard (after the
    metrics are delivered: the caller logs them first)."""
    if step_metrics.get("guard/stopped", 0.0) > 0:
        raise RolloutMismatch(
            rollout_guard_message(
                config,
                step_metrics.get("guard/rollout_logprob_gap", float("nan")),
                step,
                checkpoint_dir,
                regenerated=step_metrics.get("guard/regenerated", 0.0) > 0,
            )
        )


def default_regenerator(config: StepConfig, policy_dir: str, step: int):
    """How policy_step regenerates a refused batch in this process: with a fresh rollout engine
    on the checkpoint when the rollout backend is importable here (a local run, where the
    rollout engine lives in this process and reloads weights in place), else None (a
    cluster trainer pod: each rollout pod already started its own engine on the checkpoint,
    so a regeneration would reproduce the same batch)."""
    import importlib.util

    if config.rollout_backend == "vllm" and importlib.util.find_spec("vllm") is None:
        return None
    return lambda batch: regenerate_batch(config, policy_dir, batch, step)


def regenerate_batch(
    config: StepConfig, policy_dir: str, batch: pa.Table, step: int, colocated: bool = False
) -> pa.Table:
    """The batch's prompts sampled again by a rollout engine started fresh on policy_dir,
    scored, and (with dynamic sampling) filtered to informative groups; group ids kept."""
    from dapo.engines.rollout import close_cached_rollout_engine

    close_cached_rollout_engine()  # no state of the old engine survives
    engine = policy_engine(config, policy_dir, colocated)
    firsts: dict[object, dict] = {}
    for row in batch.select(PROMPT_COLUMNS).to_pylist():
        firsts.setdefault(row["group_id"], row)
    groups = list(firsts.values())
    completions = engine.generate(
        [g["prompt"] for g in groups], training_sampling(config, derived_seed(config, "regenerate", step))
    )
    table = rows_table(completions, groups)
    return kept_groups(config, verify_rewards(config, table, step))
