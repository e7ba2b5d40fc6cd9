"""DAPO's clipped token loss and its aggregations, pinned against hand-computed cases and an independent reference."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo.algorithm.loss import agg_loss, clipped_token_loss, entropy_from_logits


def policy_loss(log_prob, old_log_prob, advantages, response_mask, agg="token-mean", **clips):
    """DAPO's objective as one scalar: the token losses reduced by `agg`, and their metrics."""
    token_loss, metrics = clipped_token_loss(log_prob, old_log_prob, advantages, response_mask, **clips)
    return agg_loss(token_loss, response_mask, agg), metrics


def one_token(log_ratio: float, advantage: float, **kwargs):
    lp = torch.tensor([[log_ratio]])
    return policy_loss(lp, torch.zeros(1, 1), torch.tensor([advantage]), torch.ones(1, 1), **kwargs)


@pytest.mark.parametrize(
    "ratio, advantage, expected, clipped",
    [
        (1.1, 1.0, -1.1, False),  # inside both bounds: -r*A
        (1.5, 1.0, -1.28, True),  # above 1+eps_high with A>0: clipped at 1.28
        (1.25, 1.0, -1.25, False),  # between 1.2 and 1.28: clip-higher lets it through
        (0.5, 1.0, -0.5, False),  # below 1-eps_low with A>0: min takes the unclipped r*A
        (0.5, -1.0, 0.8, True),  # below 1-eps_low with A<0: clipped at 0.8
        (1.5, -1.0, 1.5, False),  # above the upper bound with A<0: unclipped, pessimistic
        (0.9, -2.0, 1.8, False),
    ],
)
def test_decoupled_clip_hand_computed(ratio, advantage, expected, clipped):
    loss, metrics = one_token(math.log(ratio), advantage)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["clipfrac"] == (1.0 if clipped else 0.0)


def test_clipfrac_high_and_low_are_separate():
    _, high = one_token(math.log(1.5), 1.0)
    _, low = one_token(math.log(0.5), -1.0)
    assert (high["clipfrac_high"], high["clipfrac_low"]) == (1.0, 0.0)
    assert (low["clipfrac_high"], low["clipfrac_low"]) == (0.0, 1.0)


def test_symmetric_clip_differs_from_clip_higher():
    sym, _ = one_token(math.log(1.25), 1.0, clip_high=0.2)
    higher, _ = one_token(math.log(1.25), 1.0, clip_high=0.28)
    assert sym.item() == pytest.approx(-1.2)
    assert higher.item() == pytest.approx(-1.25)


def test_dual_clip_bounds_negative_advantages():
    loss, metrics = one_token(math.log(10.0), -1.0, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx(3.0)
    assert metrics["clipfrac_dual"] == 1.0
    unbounded, _ = one_token(math.log(10.0), -1.0)
    assert unbounded.item() == pytest.approx(10.0)
    positive, _ = one_token(math.log(10.0), 1.0, clip_ratio_c=3.0)
    assert positive.item() == pytest.approx(-1.28)  # c only acts where A < 0


def test_sign_of_advantage_sets_gradient_direction():
    for advantage, sign in ((1.0, -1.0), (-1.0, 1.0)):
        lp = torch.zeros(1, 3, requires_grad=True)
        loss, _ = policy_loss(lp, torch.zeros(1, 3), torch.tensor([advantage]), torch.ones(1, 3))
        loss.backward()
        # descending the loss raises log-probs of positive-advantage tokens
        assert torch.all(torch.sign(lp.grad) == sign)


def test_masked_tokens_are_ignored():
    lp = torch.tensor([[0.1, 5.0, -7.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0]])
    loss, metrics = policy_loss(lp, torch.zeros(1, 3), torch.tensor([1.0]), mask)
    assert loss.item() == pytest.approx(-math.exp(0.1), abs=1e-6)
    assert metrics["clipfrac"] == 0.0


def test_token_mean_differs_from_seq_mean_when_lengths_differ():
    losses = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    assert agg_loss(losses, mask, "token-mean").item() == pytest.approx(8.0 / 5.0)
    assert agg_loss(losses, mask, "seq-mean-token-mean").item() == pytest.approx((1.0 + 4.0) / 2)
    assert agg_loss(losses, mask, "seq-mean-token-sum-norm").item() == pytest.approx((4.0 / 4 + 4.0 / 4) / 2)


def test_empty_sequences_do_not_count_in_seq_mean():
    losses = torch.tensor([[2.0, 2.0], [9.0, 9.0]])
    mask = torch.tensor([[1, 1], [0, 0]])
    assert agg_loss(losses, mask, "seq-mean-token-mean").item() == pytest.approx(2.0)
    assert agg_loss(losses, mask, "token-mean").item() == pytest.approx(2.0)


def test_extreme_log_ratio_is_clamped_and_finite():
    loss, metrics = one_token(1e4, -1.0)
    assert math.isfinite(loss.item())
    assert loss.item() == pytest.approx(math.exp(20.0), rel=1e-5)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="shape mismatch"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="agg='sum'"):
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), agg="sum")


def reference_loss(lp, old, adv, mask, eps_low, eps_high, c, agg):
    """Straight-from-the-paper loop, float64."""
    per_seq, total, count = [], 0.0, 0
    horizon = len(lp[0])
    for i in range(len(lp)):
        seq_total, seq_count = 0.0, 0
        for t in range(horizon):
            if not mask[i][t]:
                continue
            r = math.exp(max(-20.0, min(20.0, lp[i][t] - old[i][t])))
            a = adv[i]
            value = -min(r * a, max(1 - eps_low, min(1 + eps_high, r)) * a)
            if c is not None and a < 0:
                value = min(value, -c * a)
            seq_total += value
            seq_count += 1
        total += seq_total
        count += seq_count
        if seq_count:
            per_seq.append(seq_total / (seq_count if agg == "seq-mean-token-mean" else horizon))
    if agg == "token-mean":
        return total / max(count, 1)
    return sum(per_seq) / max(len(per_seq), 1)


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 5),
    length=st.integers(1, 7),
    seed=st.integers(0, 10_000),
    agg=st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]),
    c=st.sampled_from([None, 3.0]),
)
def test_matches_reference_on_random_inputs(batch, length, seed, agg, c):
    g = torch.Generator().manual_seed(seed)
    lp = torch.randn(batch, length, generator=g, dtype=torch.float64)
    old = lp + 0.5 * torch.randn(batch, length, generator=g, dtype=torch.float64)
    adv = torch.randn(batch, generator=g, dtype=torch.float64)
    mask = (torch.rand(batch, length, generator=g) > 0.3).to(torch.float64)
    loss, metrics = policy_loss(lp, old, adv, mask, clip_ratio_c=c, agg=agg)
    expected = reference_loss(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.28, c, agg)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    for key in ("clipfrac", "clipfrac_high", "clipfrac_low"):
        assert 0.0 <= metrics[key] <= 1.0


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_loss_at_ratio_one_is_minus_mean_advantage(seed):
    """At theta = theta_old every ratio is 1: token-mean loss = -(sum_i |o_i| A_i) / sum_i |o_i|."""
    g = torch.Generator().manual_seed(seed)
    lp = torch.randn(4, 6, generator=g)
    adv = torch.randn(4, generator=g)
    mask = (torch.rand(4, 6, generator=g) > 0.2).float()
    loss, metrics = policy_loss(lp, lp.clone(), adv, mask)
    lengths = mask.sum(-1)
    assert loss.item() == pytest.approx(-(lengths * adv).sum().item() / max(lengths.sum().item(), 1), abs=1e-5)
    assert metrics["clipfrac"] == 0.0 and metrics["approx_kl"] == 0.0


def test_entropy_of_uniform_and_peaked():
    uniform = entropy_from_logits(torch.zeros(1, 8))
    assert uniform.item() == pytest.approx(math.log(8), abs=1e-6)
    peaked = entropy_from_logits(torch.tensor([[100.0, 0.0, 0.0]]))
    assert peaked.item() == pytest.approx(0.0, abs=1e-6)


def test_every_registered_loss_and_aggregation_states_its_formula():
    from dapo.algorithm.loss import LOSS_AGGREGATIONS, POLICY_LOSSES

    assert set(POLICY_LOSSES) >= {"dapo"}
    assert set(LOSS_AGGREGATIONS) == {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"}
    formulas = [fn.__doc__ for fn in POLICY_LOSSES.values()] + [agg.reduce.__doc__ for agg in LOSS_AGGREGATIONS.values()]
    assert all(doc and ("L_{i,t}" in doc or "sum" in doc) for doc in formulas), formulas
    assert {name for name, agg in LOSS_AGGREGATIONS.items() if agg.unit == "sequence"} == {"seq-mean-token-mean", "seq-mean-token-sum-norm"}
