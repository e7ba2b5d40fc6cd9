"""Policy-step test material: the tiny policy built once per session, configs for the torch
trainer, hand-made scored batches, and gradients to compare."""

from __future__ import annotations

import random

import pyarrow as pa
import torch

from dapo import checkpoint
from dapo.algorithm.batch import SCORED_SCHEMA
from dapo.config import DAPOConfig
from dapo.model.policy import TinyPolicySpec, build_tiny_policy
from dapo.engines.update import minibatch_backward, prepare_step

G = 4


def shared_tiny_policy(tmp_path_factory) -> str:
    """The tiny policy, built once per pytest session (tests/test_checkpoint.py shares it)."""
    path = tmp_path_factory.getbasetemp() / "dapo-tiny-policy"
    if not checkpoint.is_complete(path):
        with checkpoint.atomic_dir(path) as scratch:
            build_tiny_policy(scratch, TinyPolicySpec(warm_start_steps=10, warm_start_batch=8))
    return str(path)


def make_config(**overrides) -> DAPOConfig:
    values = dict(
        trainer_backend="torch",
        n_samples_per_prompt=G,
        train_prompt_bsz=4,
        gen_prompt_bsz=4,
        ppo_mini_batch_size=2,
        micro_batch_size=0,
        max_tokens_per_micro_batch=0,
        lr=1e-3,
        warmup_steps=2,
        weight_decay=0.01,
        zero_stage=2,
        dtype="float32",
        seed=7,
    )
    values.update(overrides)
    return DAPOConfig.tiny_cpu().replace(**values)


def scored_table(groups: int = 4, seed: int = 0, truncated_every: int = 0, rewards=None, split_vocab=False) -> pa.Table:
    """Hand-made scored rows: G responses of varied length per prompt, mixed rewards in each group.

    split_vocab: rewarded responses draw their tokens from ids 1-149, the others from 150-299.
    """
    rng = random.Random(seed)
    rows = []
    for g in range(groups):
        prompt = [rng.randrange(1, 300) for _ in range(rng.randrange(5, 12))]
        for i in range(G):
            reward = rewards[g * G + i] if rewards is not None else (1.0 if (i + g) % 2 else -1.0)
            low, high = ((1, 150) if reward > 0 else (150, 300)) if split_vocab else (1, 300)
            response = [rng.randrange(low, high) for _ in range(rng.randrange(3, 11))]
            rows.append(
                dict(
                    group_id=f"s{seed}-g{g}", prompt_uid=f"p{g}", sample_index=i, prompt="", ground_truth="",
                    prompt_token_ids=prompt, response_token_ids=response, response_text="",
                    rollout_log_probs=[-5.0] * len(response),
                    truncated=bool(truncated_every) and i % truncated_every == 0,
                    reward=reward, acc=float(reward > 0), score=reward, overlong_penalty=0.0, format_score=0.0, unverified=0.0,
                )
            )
    return pa.Table.from_pylist(rows, schema=SCORED_SCHEMA)


def weights_of(trainer) -> dict[str, torch.Tensor]:
    """fp32 CPU copies of the HF model's parameters (whole on every rank: these tests use ZeRO 0-2, not 3)."""
    model = trainer.engine.module if trainer.backend_name == "deepspeed" else trainer.model
    return {name: p.detach().float().cpu().clone() for name, p in model.named_parameters()}


def grads_of(trainer) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in trainer.model.named_parameters() if p.grad is not None}


def accumulate(trainer, table, config) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Gradient of the whole table as ONE mini-batch, micro-batched per config (no step)."""
    data = prepare_step(trainer, table, config, temperature=1.0)
    result = minibatch_backward(trainer, data, torch.arange(table.num_rows), config, temperature=1.0)
    grads = grads_of(trainer)
    trainer.zero_grad()
    return result, grads


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)
