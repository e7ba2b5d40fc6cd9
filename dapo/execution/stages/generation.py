"""Generation rounds: each round's prompts (from the seed, step and round only), G responses
each from the rollout engine, sharded over rollout pods, and a step's rounds until its
batch is full (sample_batch, what colocated execution runs in one process)."""

from __future__ import annotations

import json
import logging
import os
import random
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from dapo.algorithm.batch import ROLLOUT_SCHEMA
from dapo.algorithm.sampling import SamplingState
from dapo.config import StepConfig
from dapo.data.prompts import PromptRecord, load_prompts, render_prompt
from dapo.execution.stages import scoring
from dapo.execution.stages.setup import TRAIN_FILE
from dapo.faults import crash_point

logger = logging.getLogger(__name__)


def derived_seed(config: StepConfig, *parts: int | str) -> int:
    """A stable 31-bit seed for one (step, round, purpose)."""
    return random.Random(json.dumps([config.seed, *parts])).randrange(2**31)


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


def training_sampling(config: StepConfig, seed: int):
    """The sampling of a training round (and of its regeneration): G responses of at most
    L_max tokens at the rollout temperature and top_p."""
    from dapo.engines.rollout import SamplingSettings

    return SamplingSettings(
        n=config.n_samples_per_prompt,
        max_tokens=config.max_response_length,
        temperature=config.temperature,
        top_p=config.top_p,
        seed=seed,
    )


def round_prompts(config: StepConfig, records: list[PromptRecord], step: int, round_index: int) -> list[PromptRecord]:
    """The prompts of one generation round: derived from (seed, step, round) only, so the
    same for any number of rollout shards."""
    return choose_prompts(records, config.prompts_per_round, derived_seed(config, "prompts", step, round_index))


def rollout(
    config: StepConfig,
    policy_dir: str,
    data_dir: str,
    step: int,
    round_index: int,
    shard: int = 0,
    progress=None,
    engine=None,
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
    texts = [render_prompt(chosen[i], tokenizer, config.system_prompt) for i in indices]
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    keep = [k for k, n in enumerate(lengths) if n <= config.max_prompt_length]
    if len(keep) < len(indices):
        logger.warning(
            "step %d round %d shard %d: %d prompt(s) longer than max_prompt_length=%d skipped",
            step,
            round_index,
            shard,
            len(indices) - len(keep),
            config.max_prompt_length,
        )
    indices, texts = [indices[k] for k in keep], [texts[k] for k in keep]

    sampling = training_sampling(config, derived_seed(config, "sampling", step, round_index, shard))
    started = time.perf_counter()
    completions = engine.generate(texts, sampling, progress=progress)
    seconds = time.perf_counter() - started
    crash_point("rollout", step)
    table = completion_table(
        completions, [chosen[i] for i in indices], texts, group_prefix=f"s{step}-r{round_index}", prompt_indices=indices
    )
    tokens = sum(len(c.token_ids) for c in completions)
    return table, {
        "rollout/seconds": seconds,
        "rollout/tokens": float(tokens),
        "rollout/tokens_per_s": tokens / max(seconds, 1e-9),
    }


ROLLOUT_METRICS_KEY = b"dapo.rollout_metrics"
"""Schema-metadata key under which a rollout shard's table carries its metrics (JSON)."""


def with_rollout_metrics(table: pa.Table, metrics: dict[str, float]) -> pa.Table:
    """The table carrying its rollout metrics in its schema metadata (a map task has one output)."""
    return table.replace_schema_metadata(
        {**(table.schema.metadata or {}), ROLLOUT_METRICS_KEY: json.dumps(metrics).encode()}
    )


def rollout_metrics_of(table: pa.Table) -> dict[str, float]:
    """The metrics with_rollout_metrics stored ({} when there are none)."""
    return json.loads((table.schema.metadata or {}).get(ROLLOUT_METRICS_KEY, b"{}"))


def merge_shards(tables: list[pa.Table]) -> tuple[pa.Table, dict[str, float]]:
    """One round's shard tables as one table, and the round's rollout metrics: tokens
    summed, seconds the slowest shard's (shards run in parallel on a cluster)."""
    metrics = [rollout_metrics_of(t) for t in tables]
    tokens = sum(m.get("rollout/tokens", 0.0) for m in metrics)
    seconds, reward_seconds = (
        max((m.get(key, 0.0) for m in metrics), default=0.0) for key in ("rollout/seconds", "reward/seconds")
    )
    merged = pa.concat_tables([t.replace_schema_metadata(None) for t in tables])
    return merged, {
        "rollout/seconds": seconds,
        "rollout/tokens": tokens,
        "rollout/tokens_per_s": tokens / max(seconds, 1e-9),
        "reward/seconds": reward_seconds,
    }


def timed_rewards(config: StepConfig, responses: pa.Table, step: int, metrics: dict[str, float]) -> pa.Table:
    """scoring.verify_rewards on a shard's responses, carrying `metrics` and its own wall time
    (reward/seconds) in the table's metadata (with_rollout_metrics)."""
    started = time.perf_counter()
    scored = scoring.verify_rewards(config, responses, step)
    return with_rollout_metrics(scored, {**metrics, "reward/seconds": time.perf_counter() - started})


def sample_batch(
    config: StepConfig, policy_dir: str, data_dir: str, step: int, engine=None, groups=None
) -> tuple[pa.Table, SamplingState]:
    """One step's generation rounds in this process, as dapo_loop's sample_round nodes run
    them (every shard's rollout, rewards, dynamic sampling) until the batch is done.
    engine: as for rollout. groups: a colocated run's rollout engines over several ranks
    (dapo.execution.colocated.RolloutGroups): this rank's engine samples and scores its block of
    each round's shards, and every rank gets the whole round."""
    batch, state = None, SamplingState()
    shards = range(config.rollout_shards) if groups is None else groups.shards(config.rollout_shards)
    while not state.done:
        tables = [
            with_rollout_metrics(*rollout(config, policy_dir, data_dir, step, state.rounds, shard, engine=engine))
            for shard in shards
        ]
        responses, metrics = merge_shards(tables)
        if groups is None:
            scored, metrics = merge_shards([timed_rewards(config, responses, step, metrics)])
        else:  # one rank of each engine scores its shards; the rounds' order is the shards'
            mine = timed_rewards(config, responses, step, metrics) if groups.leader else None
            scored, metrics = merge_shards(groups.gather(mine))
        batch, state = scoring.filter_groups(config, scored, batch, state, metrics)
    return batch, state


def vllm_on_cpu() -> bool:
    """Whether vLLM here is its CPU build (as in CI), whose tensor parallelism needs no GPU."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return current_platform.is_cpu()


def round_sequences_per_engine(config: StepConfig) -> int:
    """The sequences one engine generates at once in a round: prompts_per_round x G, split
    over the colocated run's rollout_groups engines (validation's prompts queue behind them)."""
    return max(1, -(-config.prompts_per_round * config.n_samples_per_prompt // max(1, config.rollout_groups)))


def policy_engine(config: StepConfig, policy_dir: str, colocated: bool = False):
    """The process's rollout engine, holding policy_dir's weights.

    colocated (dapo.execution.colocated: the trainer in this process), vLLM shares the GPU with the
    trainer (colocated_rollout_gpu_memory), and under a launcher of several ranks each
    tensor_parallel_size consecutive ranks form one engine (vLLM's torchrun-compatible
    "external_launcher" executor: no worker processes, the ranks' own process group),
    config.rollout_groups engines in all."""
    import torch

    from dapo.engines.rollout import EngineSettings, cached_rollout_engine

    gpus = torch.cuda.device_count()
    if config.tensor_parallel_size > 1 and gpus < config.tensor_parallel_size and not vllm_on_cpu():
        raise RuntimeError(
            f"tensor_parallel_size={config.tensor_parallel_size} but this process sees {gpus} GPU(s): "
            "dapo_loop's rollout pods request tensor_parallel_size GPUs: "
            "was this task started outside its workflow, or on a node with fewer GPUs than it asked for?"
        )
    options: dict[str, Any] = {}
    if config.rollout_backend == "vllm" and vllm_on_cpu():
        # its KV cache is host memory: sized to the round this engine generates, not vLLM's 256 sequences
        options["max_num_seqs"] = round_sequences_per_engine(config)
    if colocated and config.rollout_backend == "vllm":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1:
            options.update(
                distributed_executor_backend="external_launcher",
                data_parallel_size=world // config.tensor_parallel_size,
            )
        if gpus:
            options["gpu_memory_utilization"] = config.colocated_rollout_gpu_memory
            if config.colocated_release_rollout_memory:
                options["enable_sleep_mode"] = True
    return cached_rollout_engine(config.rollout_backend, policy_dir, EngineSettings.from_config(config), **options)


def completion_table(
    completions,
    records: list[PromptRecord],
    texts: list[str],
    group_prefix: str,
    prompt_indices: list[int] | None = None,
) -> pa.Table:
    """Completions as ROLLOUT_SCHEMA rows; a group is one prompt of one round.

    prompt_indices: each prompt's index in the whole round (default: its index here).
    """
    indices = prompt_indices or list(range(len(records)))
    prompts = [
        {
            "group_id": f"{group_prefix}-p{indices[i]}-{r.uid}",
            "prompt_uid": r.uid,
            "prompt": text,
            "ground_truth": r.ground_truth,
            "data_source": r.data_source,
            "extra_info": r.extra_info,
        }
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
