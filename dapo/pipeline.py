"""The DAPO step as plain functions: what each Flyte task calls, and what tests call.

    prepare_data -> bootstrap_policy -> [rollout -> verify_rewards -> filter_groups]+
                 -> policy_step -> evaluate

Every function takes the config and plain paths or pyarrow tables, and derives its
randomness from (config.seed, step, round) so that a re-run reproduces it.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dapo import checkpoint
from dapo.batch import REWARD_FIELDS, ROLLOUT_SCHEMA
from dapo.config import DAPOConfig, DataConfig, ModelConfig
from dapo.data import NORMALIZED_SCHEMA, PromptRecord, load_prompts, render_prompt, write_embedded_splits
from dapo.faults import crash_point
from dapo.rewards import format_reward_weight, score_responses
from dapo.sampling import SamplingState, informative_groups

logger = logging.getLogger(__name__)

TRAIN_FILE, VAL_FILE = "train.parquet", "val.parquet"
EMBEDDED_SEED = 0
"""The embedded task and starting policy are fixed; config.seed varies the RL run only
(sampling, prompt choice, shuffling), so runs with several seeds share one start."""


def derived_seed(config: DAPOConfig, *parts: int | str) -> int:
    """A stable 31-bit seed for one (step, round, purpose)."""
    return random.Random(json.dumps([config.seed, *parts])).randrange(2**31)


# --- data and policy ---------------------------------------------------------------
def prepare_data(config: DataConfig, out_dir: str | Path) -> dict[str, float]:
    """Write validated, de-duplicated train/val parquet files into out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not config.train_data_path:
        write_embedded_splits(out_dir, seed=EMBEDDED_SEED, task=config.embedded_task)
        sources = {TRAIN_FILE: out_dir / TRAIN_FILE, VAL_FILE: out_dir / VAL_FILE}
    else:
        if not config.val_data_path:
            raise ValueError("val_data_path is required when train_data_path is set")
        sources = {TRAIN_FILE: Path(config.train_data_path), VAL_FILE: Path(config.val_data_path)}
    stats: dict[str, float] = {}
    for name, source in sources.items():
        records, report = load_prompts(source, on_bad_row=config.on_bad_row)
        write_records(records, out_dir / name)
        split = name.split(".")[0]
        counts = {"rows": report.rows_read, "kept": report.kept, "duplicates": report.duplicates_dropped, "bad_rows": report.bad_rows_skipped}
        stats.update({f"data/{split}_{name}": float(value) for name, value in counts.items()})
    return stats


def write_records(records: list[PromptRecord], path: Path) -> None:
    """Normalised records back to verl format (so later tasks read one clean schema)."""
    rows = [
        {
            "data_source": r.data_source,
            "prompt": r.chat,
            "ability": "MATH",
            "reward_model": {"ground_truth": r.ground_truth, "style": "rule"},
            "extra_info": {"index": int(r.uid) if r.uid.isdigit() else i},
            "extra_info_json": r.extra_info,
        }
        for i, r in enumerate(records)
    ]
    pq.write_table(pa.Table.from_pylist(rows, schema=NORMALIZED_SCHEMA), path)


def bootstrap_policy(config: ModelConfig, embedded_task: str, out_dir: str | Path, progress=None) -> dict[str, float]:
    """The step-0 checkpoint, written atomically: the embedded tiny policy (warm-started on
    embedded_task), or config.model_path."""
    stats: dict[str, float] = {}
    with checkpoint.atomic_dir(out_dir, step=0) as scratch:
        if not config.model_path:
            from dapo.policy import TinyPolicySpec, build_tiny_policy

            spec = TinyPolicySpec.for_task(embedded_task, config.embedded_warm_start_steps,
                                           config.embedded_layout_noise, seed=EMBEDDED_SEED)
            stats = build_tiny_policy(scratch, spec, progress=progress)
        elif Path(config.model_path).is_dir():
            shutil.copytree(config.model_path, scratch, dirs_exist_ok=True)
        else:  # a hub name: the cluster images can reach the hub, this machine cannot
            from huggingface_hub import snapshot_download

            try:
                snapshot_download(config.model_path, local_dir=scratch)
            except Exception as error:
                raise RuntimeError(f"model_path={config.model_path!r} is neither a local directory nor downloadable: {error}") from error
        if not (Path(scratch) / "config.json").exists():
            raise FileNotFoundError(f"model_path={config.model_path!r}: no config.json in the checkpoint")
    return stats


# --- rollout -----------------------------------------------------------------------
def choose_prompts(records: list[PromptRecord], n: int, seed: int) -> list[PromptRecord]:
    """n prompts for one generation round (without replacement while the set allows)."""
    rng = random.Random(seed)
    if n <= len(records):
        return rng.sample(records, n)
    return [rng.choice(records) for _ in range(n)]


def shard_bounds(n_items: int, shards: int, shard: int) -> tuple[int, int]:
    """[start, end) of shard `shard` when n_items are cut into `shards` contiguous slices
    whose sizes differ by at most one (the first n_items % shards slices are the longer)."""
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} is not in [0, {shards})")
    size, extra = divmod(n_items, shards)
    start = shard * size + min(shard, extra)
    return start, start + size + (1 if shard < extra else 0)


def training_sampling(config: DAPOConfig, seed: int):
    """The sampling of a training round (and of its regeneration): G responses of at most
    L_max tokens at the rollout temperature and top_p."""
    from dapo.rollout import SamplingSettings

    return SamplingSettings(n=config.n_samples_per_prompt, max_tokens=config.max_response_length,
                            temperature=config.temperature, top_p=config.top_p, seed=seed)


def round_prompts(config: DAPOConfig, records: list[PromptRecord], step: int, round_index: int) -> list[PromptRecord]:
    """The prompts of one generation round: derived from (seed, step, round) only, so the
    same for any number of rollout shards."""
    return choose_prompts(records, config.prompts_per_round, derived_seed(config, "prompts", step, round_index))


def rollout(
    config: DAPOConfig, policy_dir: str, data_dir: str, step: int, round_index: int, shard: int = 0, progress=None, engine=None
) -> tuple[pa.Table, dict[str, float]]:
    """Sample G responses for each prompt of this round's slice `shard` (of config.rollout_shards).

    The shard's sampling seed is derived from (seed, step, round, shard); group ids hold
    the prompt's index in the whole round, so they are unique across shards. engine: a
    rollout engine that already holds the policy (colocated mode: synced in memory);
    default: the process's engine on policy_dir's weights.
    """
    records, _ = load_prompts(Path(data_dir) / TRAIN_FILE)
    chosen = round_prompts(config, records, step, round_index)
    start, end = shard_bounds(len(chosen), config.rollout_shards, shard)
    indices = list(range(start, end))
    engine = engine if engine is not None else policy_engine(config, policy_dir)
    tokenizer = engine.tokenizer
    texts = [render_prompt(chosen[i], tokenizer) for i in indices]
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    keep = [k for k, n in enumerate(lengths) if n <= config.max_prompt_length]
    if len(keep) < len(indices):
        logger.warning("step %d round %d shard %d: %d prompt(s) longer than max_prompt_length=%d skipped",
                       step, round_index, shard, len(indices) - len(keep), config.max_prompt_length)
    indices, texts = [indices[k] for k in keep], [texts[k] for k in keep]

    sampling = training_sampling(config, derived_seed(config, "sampling", step, round_index, shard))
    started = time.perf_counter()
    completions = engine.generate(texts, sampling, progress=progress)
    seconds = time.perf_counter() - started
    crash_point("rollout", step)
    table = completion_table(completions, [chosen[i] for i in indices], texts, group_prefix=f"s{step}-r{round_index}", prompt_indices=indices)
    tokens = sum(len(c.token_ids) for c in completions)
    return table, {"rollout/seconds": seconds, "rollout/tokens": float(tokens), "rollout/tokens_per_s": tokens / max(seconds, 1e-9)}


ROLLOUT_METRICS_KEY = b"dapo.rollout_metrics"
"""Schema-metadata key under which a rollout shard's table carries its metrics (JSON)."""


def with_rollout_metrics(table: pa.Table, metrics: dict[str, float]) -> pa.Table:
    """The table carrying its rollout metrics in its schema metadata (a map task has one output)."""
    return table.replace_schema_metadata({**(table.schema.metadata or {}), ROLLOUT_METRICS_KEY: json.dumps(metrics).encode()})


def rollout_metrics_of(table: pa.Table) -> dict[str, float]:
    """The metrics with_rollout_metrics stored ({} when there are none)."""
    return json.loads((table.schema.metadata or {}).get(ROLLOUT_METRICS_KEY, b"{}"))


def merge_shards(tables: list[pa.Table]) -> tuple[pa.Table, dict[str, float]]:
    """One round's shard tables as one table, and the round's rollout metrics: tokens
    summed, seconds the slowest shard's (shards run in parallel on a cluster)."""
    metrics = [rollout_metrics_of(t) for t in tables]
    tokens = sum(m.get("rollout/tokens", 0.0) for m in metrics)
    seconds = max((m.get("rollout/seconds", 0.0) for m in metrics), default=0.0)
    merged = pa.concat_tables([t.replace_schema_metadata(None) for t in tables])
    return merged, {"rollout/seconds": seconds, "rollout/tokens": tokens, "rollout/tokens_per_s": tokens / max(seconds, 1e-9)}


def sample_batch(
    config: DAPOConfig, policy_dir: str, data_dir: str, step: int, engine=None, groups=None
) -> tuple[pa.Table, SamplingState]:
    """One step's generation rounds in this process, as dapo_loop's sample_round nodes run
    them (every shard's rollout, rewards, dynamic sampling) until the batch is done.
    engine: as for rollout. groups: a colocated run's rollout engines over several ranks
    (dapo.colocated.RolloutGroups): this rank's engine samples and scores its block of
    each round's shards, and every rank gets the whole round."""
    batch, state = None, SamplingState()
    shards = range(config.rollout_shards) if groups is None else groups.shards(config.rollout_shards)
    while not state.done:
        tables = [with_rollout_metrics(*rollout(config, policy_dir, data_dir, step, state.rounds, shard, engine=engine))
                  for shard in shards]
        responses, metrics = merge_shards(tables)
        if groups is None:
            scored = verify_rewards(config, responses, step)
        else:  # one rank of each engine scores its shards; the rounds' order is the shards'
            mine = with_rollout_metrics(verify_rewards(config, responses, step), metrics) if groups.leader else None
            scored, metrics = merge_shards(groups.gather(mine))
        batch, state = filter_groups(config, scored, batch, state, metrics)
    return batch, state


# --- rewards and dynamic sampling ----------------------------------------------------
def scoring_settings(config: DAPOConfig, step: int | None) -> dict[str, float]:
    """score_response's keyword arguments at this step: L_max, L_cache, the overlong
    factor (0 when the soft punishment is off), the decayed format-reward weight (0 when
    `step` is None: validation scores without the format bonus) and the scorer's time limit."""
    return {
        "max_len": config.max_response_length,
        "buffer_len": config.overlong_buffer_len,
        "overlong_factor": config.overlong_penalty_factor if config.enable_overlong_penalty else 0.0,
        "format_weight": 0.0 if step is None else format_reward_weight(step, config.format_reward_decay_steps, config.format_reward_weight),
        "timeout_s": config.reward_timeout_seconds,
    }


def row_scorer(config: DAPOConfig, data_source: str) -> str:
    """The scorer of a row: reward_fn_by_source's for its data_source, else reward_fn."""
    return config.reward_fn_by_source.get(data_source, config.reward_fn)


def verify_rewards(config: DAPOConfig, table: pa.Table, step: int | None) -> pa.Table:
    """Score every response: R_task by its row's scorer, the soft overlong penalty and the
    soft format reward (rewards.score_response); step None: validation's scoring."""
    columns = table.select(["response_text", "ground_truth", "data_source", "extra_info"]).to_pydict()
    extra_infos = [{**json.loads(extra or "{}"), "data_source": source} for extra, source in zip(columns["extra_info"], columns["data_source"])]
    scores = score_responses(
        columns["response_text"], columns["ground_truth"], [len(ids) for ids in table.column("response_token_ids").to_pylist()],
        scorers=[row_scorer(config, source) for source in columns["data_source"]], extra_infos=extra_infos,
        **scoring_settings(config, step),
    )
    for field in REWARD_FIELDS:
        values = [score[field.name] for score in scores]
        table = table.append_column(field, pa.array(values, field.type))
    return table


def filter_groups(
    config: DAPOConfig, scored: pa.Table, kept: pa.Table | None, state: SamplingState, rollout_metrics: dict[str, float] | None = None
) -> tuple[pa.Table, SamplingState]:
    """Add this round's informative groups to the batch (all groups without dynamic sampling)."""
    rollout_metrics = rollout_metrics or {}
    round_kept = kept_groups(config, scored)
    batch = round_kept if kept is None or kept.num_rows == 0 else pa.concat_tables([kept, round_kept])
    state = state.after_round(
        len(set(scored.column("group_id").to_pylist())), len(set(round_kept.column("group_id").to_pylist())),
        target_groups=config.train_prompt_bsz,
        max_rounds=config.max_num_gen_batches if config.dynamic_sampling else 1,  # without dynamic sampling one round is the batch
        rollout_tokens=rollout_metrics.get("rollout/tokens", 0.0), rollout_seconds=rollout_metrics.get("rollout/seconds", 0.0),
    )
    if state.done:
        batch = first_groups(batch, config.train_prompt_bsz)
    return batch, state


def kept_groups(config: DAPOConfig, scored: pa.Table) -> pa.Table:
    """The rows of the groups dynamic sampling keeps (those whose filter_metric varies:
    sampling.informative_groups); every row without dynamic sampling."""
    if not config.dynamic_sampling:
        return scored
    group_ids = scored.column("group_id").to_pylist()
    keep = set(informative_groups(scored.column(config.filter_metric).to_pylist(), group_ids))
    return scored.filter(pa.array([g in keep for g in group_ids], type=pa.bool_()))


def first_groups(table: pa.Table, n_groups: int) -> pa.Table:
    group_ids = table.column("group_id").to_pylist()
    chosen = set(list(dict.fromkeys(group_ids))[:n_groups])
    return table.filter(pa.array([g in chosen for g in group_ids], type=pa.bool_()))


def batch_metrics(scored: pa.Table, prefix: str = "") -> dict[str, float]:
    """Reward, accuracy and length statistics of a scored table, and how many of its
    verdicts math-verify did not give (`unverified`, a count)."""
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
        **scorer_metrics(scored, prefix),
    }


def scorer_metrics(scored: pa.Table, prefix: str = "") -> dict[str, float]:
    """The mean task score R_task, and each of the scorers' own metrics averaged over the
    rows that have it ({prefix}score/<name>)."""
    sums: dict[str, list[float]] = {}
    for row in scored.column("score_metrics").to_pylist():
        for name, value in row or ():
            sums.setdefault(name, []).append(value)
    scores = scored.column("score").to_pylist()
    return {f"{prefix}score_mean": sum(scores) / len(scores), **{f"{prefix}score/{k}": sum(v) / len(v) for k, v in sorted(sums.items())}}


# --- policy update ---------------------------------------------------------------
GUARD_CAUSES = (
    "an in-place weight reload that left part of the engine on old weights (tied embeddings in vLLM "
    "before dapo-flyte's fix; any parameter the engine's loader skips), a checkpoint whose weights do not "
    "load the same way in vLLM and transformers (renamed, missing or shared tensors), a rollout dtype or "
    "kernel far less precise than the trainer's, or rollout log-probs from other sampling settings"
)


class RolloutMismatch(RuntimeError):
    """The rollout engine's log-probs disagree with the trainer's, even after a restart."""


def rollout_guard_message(config: DAPOConfig, gap: float, step: int, checkpoint_dir: str = "", regenerated: bool = True) -> str:
    """The error that stops a run: the gap, the checkpoint, what was tried and the likely cause."""
    where = checkpoint_dir or f"the checkpoint step {step} started from (after {step} updates: MLflow step {step})"
    tried = (
        "also after the rollout engine was restarted on the checkpoint and the batch regenerated"
        if regenerated
        else "from a rollout engine that had started fresh on the checkpoint (each rollout pod starts its own)"
    )
    return (
        f"step {step}: the rollout's sampled-token log-probs differ from the trainer's by {gap:.4g} nats per token "
        f"on average (max_rollout_logprob_gap {config.rollout_gap_threshold:.3g} for {config.dtype}), {tried}; "
        f"training would use importance ratios against other weights than the policy's, so the run stops. "
        f"Policy: {where}. Likely causes: {GUARD_CAUSES}."
    )


def check_rollout_guard(config: DAPOConfig, step_metrics: dict[str, float], step: int, checkpoint_dir: str = "") -> None:
    """Raise RolloutMismatch when policy_step stopped on the rollout guard (after the
    metrics are delivered: the caller logs them first)."""
    if step_metrics.get("guard/stopped", 0.0) > 0:
        raise RolloutMismatch(rollout_guard_message(
            config, step_metrics.get("guard/rollout_logprob_gap", float("nan")), step, checkpoint_dir,
            regenerated=step_metrics.get("guard/regenerated", 0.0) > 0,
        ))


def default_regenerator(config: DAPOConfig, policy_dir: str, step: int):
    """How policy_step regenerates a refused batch in this process: with a fresh rollout engine
    on the checkpoint when the rollout backend is importable here (a local run, where the
    rollout engine lives in this process and reloads weights in place), else None (a
    cluster trainer pod: each rollout pod already started its own engine on the checkpoint,
    so a regeneration would reproduce the same batch)."""
    import importlib.util

    if config.rollout_backend == "vllm" and importlib.util.find_spec("vllm") is None:
        return None
    return lambda batch: regenerate_batch(config, policy_dir, batch, step)


def regenerate_batch(config: DAPOConfig, policy_dir: str, batch: pa.Table, step: int, colocated: bool = False) -> pa.Table:
    """The batch's prompts sampled again by a rollout engine started fresh on policy_dir,
    scored, and (with dynamic sampling) filtered to informative groups; group ids kept."""
    from dapo.rollout import close_cached_rollout_engine

    close_cached_rollout_engine()  # no state of the old engine survives
    engine = policy_engine(config, policy_dir, colocated)
    firsts = {}
    for row in batch.select(PROMPT_COLUMNS).to_pylist():
        firsts.setdefault(row["group_id"], row)
    groups = list(firsts.values())
    completions = engine.generate([g["prompt"] for g in groups], training_sampling(config, derived_seed(config, "regenerate", step)))
    table = rows_table(completions, groups)
    return kept_groups(config, verify_rewards(config, table, step))


def policy_step(
    config: DAPOConfig, policy_dir: str, batch: pa.Table, state: SamplingState, step: int, out_dir: str | Path,
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
    from dapo.trainer import launcher_rank, make_trainer

    def skip() -> dict[str, float]:
        if launcher_rank() == 0:  # out_dir is shared by all ranks of a distributed step
            copy_checkpoint(policy_dir, out_dir, step)
        metrics["step/skipped"] = 1.0
        return metrics

    metrics = step_metrics(config, batch, state)
    if skips_update(config, batch, state, step):
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


def step_metrics(config: DAPOConfig, batch: pa.Table, state: SamplingState) -> dict[str, float]:
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
        "step/skipped": 0.0,
        "guard/threshold": config.rollout_gap_threshold,
        "guard/regenerated": 0.0,
        "guard/stopped": 0.0,
    }


def skips_update(config: DAPOConfig, batch: pa.Table, state: SamplingState, step: int) -> bool:
    """Whether the step skips its update for want of groups (an empty batch; a short one
    with on_short_batch="skip"); logs why, and a short batch that is trained on."""
    groups, target = len(set(batch.column("group_id").to_pylist())), config.train_prompt_bsz
    if groups == 0 or (groups < target and config.on_short_batch == "skip"):
        logger.warning("step %d skipped: %d informative group(s) after %d round(s) (need %d, on_short_batch=%s)",
                       step, groups, state.rounds, target, config.on_short_batch)
        return True
    if groups < target:
        logger.warning("step %d trains on a short batch: %d of %d groups after %d round(s)", step, groups, target, state.rounds)
    return False


def train_on_batch(
    trainer, config: DAPOConfig, batch: pa.Table, step: int, metrics: dict[str, float], regenerate, policy_label: str = ""
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
    from dapo.update import RolloutGapExceeded, policy_update

    threshold = config.rollout_gap_threshold
    try:
        update = policy_update(trainer, batch, config, step, temperature=config.temperature, max_rollout_gap=threshold)
    except RolloutGapExceeded as exceeded:
        metrics["guard/rollout_logprob_gap"] = exceeded.gap
        if regenerate is None:
            metrics["guard/stopped"] = 1.0
            logger.error("%s", rollout_guard_message(config, exceeded.gap, step, policy_label, regenerated=False))
            return False
        logger.warning("step %d: rollout log-prob gap %.4g > %.3g: batch refused; restarting the rollout engine on %s "
                       "and regenerating it", step, exceeded.gap, threshold, policy_label or "the policy")
        metrics["guard/regenerated"] = 1.0
        batch = regenerate(batch)
        metrics["guard/regenerated_groups"] = float(len(set(batch.column("group_id").to_pylist())))
        if batch.num_rows == 0:
            logger.warning("step %d skipped: the regenerated batch has no informative group", step)
            return False
        try:
            update = policy_update(trainer, batch, config, step, temperature=config.temperature, max_rollout_gap=threshold)
        except RolloutGapExceeded as again:
            metrics["guard/stopped"] = 1.0
            metrics["guard/regenerated_logprob_gap"] = again.gap
            logger.error("%s", rollout_guard_message(config, again.gap, step, policy_label))
            return False
    else:
        metrics["guard/rollout_logprob_gap"] = update["rollout_logprob_diff"]
    metrics.update({f"actor/{key}": value for key, value in update.items()})
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


# --- validation --------------------------------------------------------------------
def evaluate(config: DAPOConfig, policy_dir: str, data_dir: str, step: int, n_samples_table: int = 8) -> tuple[dict[str, float], list[dict]]:
    """avg@k accuracy on the held-out split at (val_temperature, val_top_p), the policy's
    entropy there (config.val_entropy); and a few samples."""
    scored = validation_samples(config, policy_dir, data_dir)
    metrics = {f"val/{k}": v for k, v in batch_metrics(scored).items()}
    if config.val_entropy:
        metrics["val/entropy"] = policy_entropy(policy_dir, scored, config.temperature, max_tokens=config.max_tokens_per_micro_batch)
    first_samples = scored.filter(pc.equal(scored.column("sample_index"), 0)).slice(0, n_samples_table)
    samples = [
        {"step": step, "problem": row["prompt"][-120:], "ground_truth": row["ground_truth"], "response": row["response_text"], "acc": row["acc"]}
        for row in first_samples.to_pylist()
    ]
    return metrics, samples


def validation_samples(config: DAPOConfig, policy_dir: str, data_dir: str) -> pa.Table:
    """val_n_samples responses to each validation prompt (seeded: the same on every call),
    scored without the format bonus."""
    from transformers import AutoTokenizer

    from dapo.rollout import SamplingSettings

    records, _ = load_prompts(Path(data_dir) / VAL_FILE)
    if config.val_max_prompts:
        records = records[: config.val_max_prompts]
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    texts = [render_prompt(r, tokenizer) for r in records]
    engine = policy_engine(config, policy_dir)
    sampling = SamplingSettings(
        n=config.val_n_samples, max_tokens=config.max_response_length,
        temperature=config.val_temperature, top_p=config.val_top_p, seed=derived_seed(config, "validation"),
    )
    completions = engine.generate(texts, sampling)
    return verify_rewards(config, completion_table(completions, records, texts, group_prefix="val"), step=None)


def policy_entropy(
    policy_dir: str, table: pa.Table, temperature: float, rows_per_forward: int = 64, max_tokens: int = 0
) -> float:
    """Mean entropy per response token (nats) of the policy in policy_dir at `temperature`,
    over the responses of `table` (teacher-forced, transformers on CPU), rows_per_forward
    rows a forward, or by a token budget of max_tokens (dapo.micro_batches).

    On the validation samples this is the entropy of the policy on a fixed probe set (the
    validation prompts, its own responses): unlike actor/entropy, measured on the batch a
    step trains on, it does not depend on which groups dynamic sampling kept."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dapo.batch import collate_table, response_log_probs, trim_batch
    from dapo.micro_batches import plan_micro_batches

    pad_token_id = AutoTokenizer.from_pretrained(policy_dir).pad_token_id or 0
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
    whole = collate_table(table, pad_token_id)
    micro, _ = plan_micro_batches(whole, torch.arange(len(whole)), micro_batch_size=rows_per_forward, max_tokens=max_tokens, packed=False)
    entropy_sum = tokens = 0.0
    with torch.no_grad():
        for rows in micro:
            batch = trim_batch(whole.select(rows))
            _, entropy = response_log_probs(model, batch, temperature, with_entropy=True)
            entropy_sum += float((entropy * batch.response_mask).sum())
            tokens += float(batch.response_mask.sum())
    return entropy_sum / max(tokens, 1.0)


def vllm_on_cpu() -> bool:
    """Whether vLLM here is its CPU build (as in CI), whose tensor parallelism needs no GPU."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return current_platform.is_cpu()


def policy_engine(config: DAPOConfig, policy_dir: str, colocated: bool = False):
    """The process's rollout engine, holding policy_dir's weights.

    colocated (dapo.colocated: the trainer in this process), vLLM shares the GPU with the trainer (colocated_rollout_gpu_memory), and
    under a launcher of several ranks each tensor_parallel_size consecutive ranks form one
    engine (vLLM's torchrun-compatible "external_launcher" executor: no worker processes,
    the ranks' own process group), config.rollout_groups engines in all."""
    import torch

    from dapo.rollout import cached_rollout_engine

    gpus = torch.cuda.device_count()
    if config.tensor_parallel_size > 1 and gpus < config.tensor_parallel_size and not vllm_on_cpu():
        raise RuntimeError(
            f"tensor_parallel_size={config.tensor_parallel_size} but this process sees {gpus} GPU(s): "
            "dapo_loop's rollout pods request tensor_parallel_size GPUs: "
            "was this task started outside its workflow, or on a node with fewer GPUs than it asked for?"
        )
    options = {}
    if colocated and config.rollout_backend == "vllm":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1:
            options.update(distributed_executor_backend="external_launcher", data_parallel_size=world // config.tensor_parallel_size)
        if gpus:
            options["gpu_memory_utilization"] = config.colocated_rollout_gpu_memory
            if config.colocated_release_rollout_memory:
                options["enable_sleep_mode"] = True
    return cached_rollout_engine(
        config.rollout_backend, policy_dir, dtype=config.dtype,
        max_model_len=config.max_prompt_length + config.max_response_length,
        tensor_parallel_size=config.tensor_parallel_size, seed=config.seed, **options,
    )


def completion_table(
    completions, records: list[PromptRecord], texts: list[str], group_prefix: str, prompt_indices: list[int] | None = None
) -> pa.Table:
    """Completions as ROLLOUT_SCHEMA rows; a group is one prompt of one round.

    prompt_indices: each prompt's index in the whole round (default: its index here).
    """
    indices = prompt_indices or list(range(len(records)))
    prompts = [
        {"group_id": f"{group_prefix}-p{indices[i]}-{r.uid}", "prompt_uid": r.uid, "prompt": text, "ground_truth": r.ground_truth,
         "data_source": r.data_source, "extra_info": r.extra_info}
        for i, (r, text) in enumerate(zip(records, texts))
    ]
    return rows_table(completions, prompts)


PROMPT_COLUMNS = ["group_id", "prompt_uid", "prompt", "ground_truth", "data_source", "extra_info"]
"""The ROLLOUT_SCHEMA columns that all responses to one prompt share."""


def rows_table(completions, prompts: list[dict]) -> pa.Table:
    """ROLLOUT_SCHEMA rows: completion c answers prompts[c.prompt_index] (PROMPT_COLUMNS)."""
    rows = [
        {
            **prompts[c.prompt_index],
            "sample_index": c.sample_index,
            "prompt_token_ids": c.prompt_token_ids,
            "response_token_ids": c.token_ids,
            "response_text": c.text,
            "rollout_log_probs": c.log_probs,
            "truncated": c.truncated,
        }
        for c in completions
    ]
    return pa.Table.from_pylist(rows, schema=ROLLOUT_SCHEMA)
