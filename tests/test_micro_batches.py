"""Token-budget micro-batches (dapo.algorithm.micro_batches) and packed sequences (dapo.algorithm.batch.pack):
the plan covers every row once within the budget, the ranks get equal work, and the
gradients, log-probs and updated weights equal those of the padded fixed-size path."""

from __future__ import annotations

import functools
import random

import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo.execution.stages import validation
from dapo.algorithm.batch import SCORED_SCHEMA, collate, collate_table, pack, packed_response_log_probs, response_log_probs
from dapo.config import ConfigError
from dapo.algorithm.micro_batches import by_token_budget, deal_to_ranks, micro_batch_cost, plan_micro_batches
from dapo.engines.trainer import make_trainer
from dapo.engines.update import policy_update
from policy_steps import G, accumulate, make_config, max_diff, weights_of

MAX_PROMPT, MAX_RESPONSE = 16, 48
BUDGET = 160
"""Tokens per micro-batch in these tests: a few of mixed_table's rows each."""


def mixed_table(groups: int = 4, seed: int = 0, long_row: int | None = None) -> pa.Table:
    """Scored rows whose response lengths spread ~15x (2-30 tokens, a lognormal as long
    reasoning's are), mixed rewards and some truncated rows; long_row: that row's response
    is MAX_RESPONSE tokens."""
    rng = random.Random(seed)
    rows = []
    for g in range(groups):
        prompt = [rng.randrange(1, 300) for _ in range(rng.randrange(4, MAX_PROMPT + 1))]
        for i in range(G):
            length = min(30, max(2, int(rng.lognormvariate(2.0, 0.8))))
            if long_row == len(rows):
                length = MAX_RESPONSE
            response = [rng.randrange(1, 300) for _ in range(length)]
            reward = 1.0 if (i + g) % 2 else -1.0
            rows.append(dict(
                group_id=f"g{g}", prompt_uid=f"p{g}", sample_index=i, prompt="", ground_truth="",
                prompt_token_ids=prompt, response_token_ids=response, response_text="",
                rollout_log_probs=[-5.0] * length, truncated=i == 3, reward=reward, acc=float(reward > 0),
                score=reward, overlong_penalty=0.0, format_score=0.0, unverified=0.0,
            ))
    return pa.Table.from_pylist(rows, schema=SCORED_SCHEMA)


def budget_config(**overrides):
    return make_config(max_prompt_length=MAX_PROMPT, max_response_length=MAX_RESPONSE, **overrides)


# --- the plan ---------------------------------------------------------------------------
lengths = st.lists(st.tuples(st.integers(1, 40), st.integers(0, 200)), min_size=1, max_size=60)


@settings(max_examples=200, deadline=None)
@given(lengths=lengths, budget=st.integers(240, 2000), packed=st.booleans())
def test_a_token_budget_plan_holds_every_row_once_and_no_micro_batch_exceeds_the_budget(lengths, budget, packed):
    prompt = torch.tensor([p for p, _ in lengths])
    response = torch.tensor([r for _, r in lengths])
    rows = torch.arange(len(lengths)).flip(0)  # any order of rows
    micro = by_token_budget(rows, prompt, response, budget, packed)
    assert sorted(torch.cat(micro).tolist()) == list(range(len(lengths)))
    costs = [micro_batch_cost(prompt[m].tolist(), response[m].tolist(), packed) for m in micro]
    assert max(costs) <= budget
    # filled greedily: no two micro-batches could have been one
    assert all(micro_batch_cost(prompt[torch.cat([a, b])].tolist(), response[torch.cat([a, b])].tolist(), packed) > budget
               for a, b in zip(micro, micro[1:]))


def test_rows_of_similar_length_share_a_micro_batch():
    prompt = torch.full((8,), 10)
    response = torch.tensor([100, 2, 90, 3, 95, 1, 4, 98])
    micro = by_token_budget(torch.arange(8), prompt, response, budget=3 * 110, packed=False)
    assert [sorted(m.tolist()) for m in micro] == [[0, 4, 7], [2, 3, 6], [1, 5]]  # 100, 98, 95 | 90, 4, 3 | 2, 1


@settings(max_examples=200, deadline=None)
@given(costs=st.lists(st.integers(1, 10_000), min_size=1, max_size=40), world_size=st.integers(1, 8))
def test_micro_batches_are_dealt_to_ranks_so_that_no_rank_carries_more_than_its_share_plus_one(costs, world_size):
    dealt = deal_to_ranks(costs, world_size, balanced=True)
    assert sorted(i for indices in dealt for i in indices) == list(range(len(costs)))
    loads = [sum(costs[i] for i in indices) for indices in dealt]
    assert max(loads) <= sum(costs) / world_size + max(costs)  # greedy longest-first bound
    assert deal_to_ranks(costs, world_size, balanced=False) == [list(range(r, len(costs), world_size)) for r in range(world_size)]


def test_every_rank_plans_the_same_split_and_runs_as_many_micro_batches_as_the_busiest():
    batch = collate_table(mixed_table(groups=4), pad_token_id=0)
    rows = torch.arange(len(batch))
    plans = [plan_micro_batches(batch, rows, micro_batch_size=0, max_tokens=BUDGET, packed=True, rank=r, world_size=3)
             for r in range(3)]
    assert sorted(torch.cat([m for mine, _ in plans for m in mine]).tolist()) == rows.tolist()
    assert {most for _, most in plans} == {max(len(mine) for mine, _ in plans)}


def test_a_token_budget_too_small_for_the_longest_row_or_beside_a_micro_batch_size_is_refused():
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch.*>= max_prompt_length"):
        budget_config(max_tokens_per_micro_batch=MAX_PROMPT + MAX_RESPONSE - 1)
    with pytest.raises(ConfigError, match="replaces micro_batch_size"):
        budget_config(max_tokens_per_micro_batch=BUDGET, micro_batch_size=4)


# --- packed sequences ---------------------------------------------------------------------
def test_packed_log_probs_and_entropy_equal_the_padded_ones(policy_dir):
    table = mixed_table(groups=3)
    batch = collate_table(table, pad_token_id=0)
    trainer = make_trainer(budget_config(), policy_dir)
    try:
        with torch.no_grad():
            padded, padded_entropy = response_log_probs(trainer.model, batch, temperature=0.7, with_entropy=True)
            packed, packed_entropy = packed_response_log_probs(trainer.model, pack(batch), temperature=0.7, with_entropy=True)
    finally:
        trainer.close()
    mask = batch.response_mask.bool()
    assert packed.shape == padded.shape and (packed[~mask] == 0).all()
    assert (packed[mask] - padded[mask]).abs().max().item() < 1e-5
    assert (packed_entropy[mask] - padded_entropy[mask]).abs().max().item() < 1e-5
    assert pack(batch).input_ids.shape[1] == int(batch.attention_mask.sum())  # not a padding token computed


def test_logits_at_the_response_positions_only_give_the_same_log_probs_as_every_positions(policy_dir, monkeypatch):
    """The LM head over the response positions only (the model's logits_to_keep), padded and
    packed, against the logits of every position sliced afterwards, which is also what a
    model whose forward does not take logits_to_keep gets."""
    import dapo.algorithm.batch

    batch = collate_table(mixed_table(groups=3), pad_token_id=0)
    trainer = make_trainer(budget_config(), policy_dir)
    seen = []
    forward = trainer.model.forward

    @functools.wraps(forward)  # keeps the forward's signature, which logits_only_at reads
    def spy(*args, **kwargs):
        seen.append(kwargs.get("logits_to_keep"))
        return forward(*args, **kwargs)

    trainer.model.forward = spy
    try:
        with torch.no_grad():
            kept = [response_log_probs(trainer.model, batch, 0.7, True), packed_response_log_probs(trainer.model, pack(batch), 0.7, True)]
            assert seen[0] == batch.responses.shape[1] + 1 and seen[1].shape == (int(batch.response_mask.sum()),)
            monkeypatch.setattr(dapo.algorithm.batch, "logits_only_at", lambda model, keep: {})  # a forward without logits_to_keep
            every = [response_log_probs(trainer.model, batch, 0.7, True), packed_response_log_probs(trainer.model, pack(batch), 0.7, True)]
    finally:
        trainer.close()
    for (log_probs, entropy), (want_log_probs, want_entropy) in zip(kept, every):
        assert (log_probs - want_log_probs).abs().max().item() < 1e-6 and (entropy - want_entropy).abs().max().item() < 1e-6
    assert dapo.algorithm.batch._parameters(lambda input_ids, attention_mask=None: None) == {"input_ids", "attention_mask"}


def test_varlen_attention_gives_the_padded_log_probs_at_each_rows_own_cost(policy_dir):
    table = mixed_table(groups=3)
    batch = collate_table(table, pad_token_id=0)
    padded_trainer = make_trainer(budget_config(), policy_dir)
    varlen_trainer = make_trainer(budget_config(remove_padding=True, attn_implementation="sdpa_varlen"), policy_dir)
    try:
        with torch.no_grad():
            padded, _ = response_log_probs(padded_trainer.model, batch, temperature=0.7)
            varlen, _ = varlen_trainer.forward(batch, temperature=0.7)
        with pytest.raises(ValueError, match="sdpa_varlen attends packed sequences only"):
            response_log_probs(varlen_trainer.model, batch)  # a padded batch would be read unmasked
    finally:
        padded_trainer.close()
        varlen_trainer.close()
    mask = batch.response_mask.bool()
    assert (varlen[mask] - padded[mask]).abs().max().item() < 1e-5
    with pytest.raises(ConfigError, match="set remove_padding=True"):
        budget_config(attn_implementation="sdpa_varlen")


def test_a_row_without_prompt_tokens_cannot_be_packed():
    batch = collate([[]], [[5, 6]], pad_token_id=0)
    with pytest.raises(ValueError, match="row 0 has an empty prompt"):
        pack(batch)


# --- the update -------------------------------------------------------------------------
SPLITS = {
    "rows": dict(micro_batch_size=3),  # 16 responses -> 6 uneven micro-batches
    "budget": dict(max_tokens_per_micro_batch=BUDGET),
    "packed": dict(max_tokens_per_micro_batch=BUDGET, remove_padding=True),
    "packed-varlen": dict(max_tokens_per_micro_batch=BUDGET, remove_padding=True, attn_implementation="sdpa_varlen"),
}


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_accumulate_to_the_whole_mini_batch_gradient(policy_dir, agg, split):
    # Truncated rows masked out make some micro-batches token-poor: the weighting must still be exact.
    table = mixed_table(groups=4)
    whole = budget_config(loss_agg_mode=agg, overlong_filtering=True)
    split_config = whole.replace(**SPLITS[split])
    results = []
    for config in (whole, split_config):  # each its own trainer: the attention kernel is chosen at load
        trainer = make_trainer(config, policy_dir)
        try:
            results.append(accumulate(trainer, table, config))
        finally:
            trainer.close()
    (result_whole, grads_whole), (result_split, grads_split) = results
    assert max(g.abs().max().item() for g in grads_whole.values()) > 1e-4  # a real gradient
    assert max_diff(grads_whole, grads_split) < 1e-5
    for key in ("pg_loss", "clipfrac", "approx_kl", "ratio_mean"):
        assert result_split[key] == pytest.approx(result_whole[key], abs=1e-6), key


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_policy_step_by_token_budget_updates_the_weights_as_the_fixed_size_one(policy_dir, packed):
    table = mixed_table(groups=4, seed=1)
    fixed = budget_config(micro_batch_size=3, ppo_mini_batch_size=2)
    budgeted = fixed.replace(micro_batch_size=0, max_tokens_per_micro_batch=BUDGET, remove_padding=packed)
    results = []
    for config in (fixed, budgeted):
        trainer = make_trainer(config, policy_dir)
        try:
            metrics = policy_update(trainer, table, config, step=0, temperature=1.0)
            results.append((metrics, weights_of(trainer)))
        finally:
            trainer.close()
    (fixed_metrics, fixed_weights), (budget_metrics, budget_weights) = results
    assert budget_metrics["num_updates"] == fixed_metrics["num_updates"] == 2
    assert budget_metrics["entropy"] == pytest.approx(fixed_metrics["entropy"], abs=1e-6)  # the log-prob pass
    assert budget_metrics["grad_norm"] == pytest.approx(fixed_metrics["grad_norm"], rel=1e-5)
    assert budget_metrics["pg_loss"] == pytest.approx(fixed_metrics["pg_loss"], abs=1e-6)
    # Adam divides by the gradient's own scale: a 1e-6 relative difference in a small
    # gradient component moves its weight by up to ~1e-2 lr (a wrong weighting: ~lr)
    assert max_diff(fixed_weights, budget_weights) < 0.1 * fixed.lr


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_one_very_long_row_costs_no_forward_pass_more_than_the_budget(policy_dir, packed):
    """Activation memory follows the tokens of a forward pass: with 8 rows a micro-batch, the
    longest row makes its micro-batch 8 x its length wide; under the budget, no pass is."""
    table = mixed_table(groups=4, long_row=5)
    fixed = budget_config(micro_batch_size=8, ppo_mini_batch_size=4)
    budgeted = fixed.replace(micro_batch_size=0, max_tokens_per_micro_batch=2 * (MAX_PROMPT + MAX_RESPONSE), remove_padding=packed)
    widest = {}
    for name, config in (("fixed", fixed), ("budget", budgeted)):
        trainer = make_trainer(config, policy_dir)
        sizes = []
        hook = trainer.model.register_forward_pre_hook(lambda _, args, kwargs: sizes.append(kwargs["input_ids"].numel()),
                                                       with_kwargs=True)
        try:
            policy_update(trainer, table, config, step=0, temperature=1.0)
        finally:
            hook.remove()
            trainer.close()
        widest[name] = max(sizes)
    assert widest["budget"] <= budgeted.max_tokens_per_micro_batch < widest["fixed"]
    assert widest["fixed"] >= 8 * MAX_RESPONSE


def test_the_validation_entropy_by_token_budget_equals_the_one_by_row_count(policy_dir):
    table = mixed_table(groups=3, seed=2)
    by_rows = validation.policy_entropy(policy_dir, table, temperature=1.0, rows_per_forward=5)
    by_tokens = validation.policy_entropy(policy_dir, table, temperature=1.0, max_tokens=BUDGET)
    assert by_tokens == pytest.approx(by_rows, rel=1e-6) and by_rows > 0
