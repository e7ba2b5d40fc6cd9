"""Validation: avg@k of the policy on the held-out prompts, and optionally its entropy there."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from dapo.config import StepConfig
from dapo.data.prompts import load_prompts, render_prompt, system_prompt_tokens
from dapo.execution.stages.generation import completion_table, derived_seed, policy_engine
from dapo.execution.stages.scoring import batch_metrics, verify_rewards
from dapo.execution.stages.setup import VAL_FILE


def evaluate(
    config: StepConfig, policy_dir: str, data_dir: str, step: int, n_samples_table: int = 8
) -> tuple[dict[str, float], list[dict]]:
    """avg@k accuracy on the held-out split at (val_temperature, val_top_p), the policy's
    entropy there (config.val_entropy); and a few samples."""
    from transformers import AutoTokenizer

    scored = validation_samples(config, policy_dir, data_dir)
    metrics = {f"val/{k}": v for k, v in batch_metrics(scored).items()}
    prompt_lengths = [len(ids) for ids in scored.column("prompt_token_ids").to_pylist()]
    metrics["val/prompt_length_mean"] = sum(prompt_lengths) / len(prompt_lengths)
    metrics["val/system_prompt_tokens"] = float(
        system_prompt_tokens(AutoTokenizer.from_pretrained(policy_dir), config.system_prompt)
    )
    if config.val_entropy:
        metrics["val/entropy"] = policy_entropy(
            policy_dir, scored, config.temperature, max_tokens=config.max_tokens_per_micro_batch
        )
    first_samples = scored.filter(pc.equal(scored.column("sample_index"), 0)).slice(0, n_samples_table)
    samples = [
        {
            "step": step,
            "problem": row["prompt"][-120:],
            "ground_truth": row["ground_truth"],
            "response": row["response_text"],
            "acc": row["acc"],
        }
        for row in first_samples.to_pylist()
    ]
    return metrics, samples


def validation_samples(config: StepConfig, policy_dir: str, data_dir: str) -> pa.Table:
    """val_n_samples responses to each validation prompt (seeded: the same on every call),
    scored without the format bonus."""
    from transformers import AutoTokenizer

    from dapo.engines.rollout import SamplingSettings

    records, _ = load_prompts(Path(data_dir) / VAL_FILE)
    if config.val_max_prompts:
        records = records[: config.val_max_prompts]
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    texts = [render_prompt(r, tokenizer, config.system_prompt) for r in records]
    engine = policy_engine(config, policy_dir)
    sampling = SamplingSettings(
        n=config.val_n_samples,
        max_tokens=config.max_response_length,
        temperature=config.val_temperature,
        top_p=config.val_top_p,
        seed=derived_seed(config, "validation"),
    )
    completions = engine.generate(texts, sampling)
    return verify_rewards(config, completion_table(completions, records, texts, group_prefix="val"), step=None)


def policy_entropy(
    policy_dir: str, table: pa.Table, temperature: float, rows_per_forward: int = 64, max_tokens: int = 0
) -> float:
    """Mean entropy per response token (nats) of the policy in policy_dir at `temperature`,
    over the responses of `table` (teacher-forced, transformers on CPU), rows_per_forward
    rows a forward, or by a token budget of max_tokens (dapo.algorithm.micro_batches).

    On the validation samples this is the entropy of the policy on a fixed probe set (the
    validation prompts, its own responses): unlike actor/entropy, measured on the batch a
    step trains on, it does not depend on which groups dynamic sampling kept."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dapo.algorithm.batch import collate_table, response_log_probs, trim_batch
    from dapo.algorithm.micro_batches import plan_micro_batches

    pad_token_id = AutoTokenizer.from_pretrained(policy_dir).pad_token_id or 0
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
    whole = collate_table(table, pad_token_id)
    micro, _ = plan_micro_batches(
        whole, torch.arange(len(whole)), micro_batch_size=rows_per_forward, max_tokens=max_tokens, packed=False
    )
    entropy_sum = tokens = 0.0
    with torch.no_grad():
        for rows in micro:
            batch = trim_batch(whole.select(rows))
            _, entropy = response_log_probs(model, batch, temperature, with_entropy=True)
            assert entropy is not None  # asked for
            entropy_sum += float((entropy * batch.response_mask).sum())
            tokens += float(batch.response_mask.sum())
    return entropy_sum / max(tokens, 1.0)
