"""Rewards and dynamic sampling: every response scored (R_task by its row's scorer, the
overlong and format terms), and each round's informative groups kept until the batch is full."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc

from dapo.algorithm.batch import REWARD_FIELDS
from dapo.algorithm.sampling import SamplingState, informative_groups
from dapo.config import RewardConfig, StepConfig, section_values
from dapo.rewards import format_reward_weight, score_responses


def scoring_settings(reward: RewardConfig, max_response_length: int, step: int | None) -> dict[str, float]:
    """score_response's keyword arguments at this step: L_max (the rollout's
    max_response_length), L_cache, the overlong factor (0 when the soft punishment is off),
    the decayed format-reward weight (0 when `step` is None: validation scores without the
    format bonus) and the scorer's time limit."""
    return {
        "max_len": max_response_length,
        "buffer_len": reward.overlong_buffer_len,
        "overlong_factor": reward.overlong_penalty_factor if reward.enable_overlong_penalty else 0.0,
        "format_weight": 0.0
        if step is None
        else format_reward_weight(step, reward.format_reward_decay_steps, reward.format_reward_weight),
        "timeout_s": reward.reward_timeout_seconds,
    }


def row_scorer(reward: RewardConfig, data_source: str) -> str:
    """The scorer of a row: reward_fn_by_source's for its data_source, else reward_fn."""
    return reward.reward_fn_by_source.get(data_source, reward.reward_fn)


def verify_rewards(config: StepConfig, table: pa.Table, step: int | None) -> pa.Table:
    """Score every response: R_task by its row's scorer, the soft overlong penalty and the
    soft format reward (rewards.score_response); step None: validation's scoring. The
    verifier sees config's reward section and L_max, nothing else of the run."""
    reward = section_values(config, RewardConfig)
    columns = table.select(["response_text", "ground_truth", "data_source", "extra_info"]).to_pydict()
    extra_infos = [
        {**json.loads(extra or "{}"), "data_source": source}
        for extra, source in zip(columns["extra_info"], columns["data_source"])
    ]
    scores = score_responses(
        columns["response_text"],
        columns["ground_truth"],
        [len(ids) for ids in table.column("response_token_ids").to_pylist()],
        scorers=[row_scorer(reward, source) for source in columns["data_source"]],
        extra_infos=extra_infos,
        **scoring_settings(reward, config.max_response_length, step),
    )
    for field in REWARD_FIELDS:
        values = [score[field.name] for score in scores]
        table = table.append_column(field, pa.array(values, field.type))
    return table


def filter_groups(
    config: StepConfig,
    scored: pa.Table,
    kept: pa.Table | None,
    state: SamplingState,
    rollout_metrics: dict[str, float] | None = None,
) -> tuple[pa.Table, SamplingState]:
    """Add this round's informative groups to the batch (all groups without dynamic sampling)."""
    rollout_metrics = rollout_metrics or {}
    round_kept = kept_groups(config, scored)
    batch = round_kept if kept is None or kept.num_rows == 0 else pa.concat_tables([kept, round_kept])
    state = state.after_round(
        len(set(scored.column("group_id").to_pylist())),
        len(set(round_kept.column("group_id").to_pylist())),
        target_groups=config.train_prompt_bsz,
        max_rounds=config.max_num_gen_batches
        if config.dynamic_sampling
        else 1,  # without dynamic sampling one round is the batch
        rollout_tokens=rollout_metrics.get("rollout/tokens", 0.0),
        rollout_seconds=rollout_metrics.get("rollout/seconds", 0.0),
        reward_seconds=rollout_metrics.get("reward/seconds", 0.0),
        scored_responses=scored.num_rows,
        unverified_notes=unverified_notes(scored),
    )
    if state.done:
        batch = first_groups(batch, config.train_prompt_bsz)
    return batch, state


def kept_groups(config: StepConfig, scored: pa.Table) -> pa.Table:
    """The rows of the groups dynamic sampling keeps (those whose filter_metric varies:
    sampling.informative_groups); every row without dynamic sampling."""
    if not config.dynamic_sampling:
        return scored
    group_ids = scored.column("group_id").to_pylist()
    keep = set(informative_groups(scored.column(config.filter_metric).to_pylist(), group_ids))
    return scored.filter(pa.array([g in keep for g in group_ids], type=pa.bool_()))


def unverified_notes(scored: pa.Table) -> list[str]:
    """Why each response without a verdict has none, with the response's start."""
    rows = (
        scored.filter(pc.greater(scored.column("unverified"), 0)).select(["verdict_note", "response_text"]).to_pylist()
    )
    return [f"{row['verdict_note'] or 'no verdict'} (response starting {row['response_text'][:60]!r})" for row in rows]


def first_groups(table: pa.Table, n_groups: int) -> pa.Table:
    group_ids = table.column("group_id").to_pylist()
    chosen = set(list(dict.fromkeys(group_ids))[:n_groups])
    return table.filter(pa.array([g in chosen for g in group_ids], type=pa.bool_()))


def batch_metrics(scored: pa.Table, prefix: str = "") -> dict[str, float]:
    """Reward, task score, accuracy and length statistics of a scored table, the scorers' own
    metrics, and how many verdicts the scorer did not give (`unverified`, a count)."""
    if scored.num_rows == 0:
        return {}
    lengths = [len(ids) for ids in scored.column("response_token_ids").to_pylist()]
    column = lambda name: scored.column(name).to_pylist()  # noqa: E731
    return {
        f"{prefix}reward_mean": sum(column("reward")) / len(lengths),
        f"{prefix}acc": sum(column("acc")) / len(lengths),
        f"{prefix}format_score": sum(column("format_score")) / len(lengths),
        f"{prefix}overlong_penalty_mean": sum(column("overlong_penalty")) / len(lengths),
        f"{prefix}truncated_frac": sum(column("truncated")) / len(lengths),
        f"{prefix}response_length_mean": sum(lengths) / len(lengths),
        f"{prefix}response_length_max": float(max(lengths)),
        f"{prefix}unverified": sum(column("unverified")),  # verdicts the scorer did not give: counted as wrong
        f"{prefix}score_mean": sum(column("score")) / len(lengths),
        **scorer_metrics(scored, prefix),
    }


def scorer_metrics(scored: pa.Table, prefix: str = "") -> dict[str, float]:
    """Each of the scorers' own metrics averaged over the rows that have it ({prefix}score/<name>)."""
    values: dict[str, list[float]] = {}
    for row in scored.column("score_metrics").to_pylist():
        for name, value in row or ():
            values.setdefault(name, []).append(value)
    return {f"{prefix}score/{name}": sum(v) / len(v) for name, v in sorted(values.items())}
