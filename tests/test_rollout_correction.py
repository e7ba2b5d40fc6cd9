"""Rollout correction (dapo/algorithm/rollout_correction.py) against a float64 reference written from
its formulas, and against verl 0.9.1's implementation on the same random inputs."""

from __future__ import annotations

import math

import pytest
import torch

from dapo.algorithm.rollout_correction import ROLLOUT_CORRECTIONS, correction_weights
from verl_reference import verl_functions, verl_module


def random_batch(seed: int, rows: int = 8, width: int = 9, spread: float = 1.0):
    """log pi_old, log pi_rollout (float64) and a left-aligned response mask, some rows short."""
    generator = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(rows, width, generator=generator, dtype=torch.float64) * 3
    old = rollout + torch.randn(rows, width, generator=generator, dtype=torch.float64) * spread
    lengths = torch.randint(1, width + 1, (rows,), generator=generator)
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.float64)
    return old, rollout, mask


def reference_weights(old, rollout, mask, name: str, threshold: float) -> list[list[float]]:
    """w_{i,t} element by element in float64, from the module docstring's formulas."""
    correction = ROLLOUT_CORRECTIONS[name]
    weights = []
    for i in range(old.shape[0]):
        valid = [t for t in range(old.shape[1]) if mask[i, t] == 1]
        sequence_log_rho = sum(float(old[i, t] - rollout[i, t]) for t in valid)
        row = []
        for t in range(old.shape[1]):
            if t not in valid:
                row.append(0.0)
                continue
            log_rho = sequence_log_rho if correction.level == "sequence" else float(old[i, t] - rollout[i, t])
            rho = math.exp(max(-20.0, min(20.0, log_rho)))
            if correction.above_threshold == "truncate":
                row.append(min(rho, threshold))
            else:
                row.append(rho if rho <= threshold else 0.0)
        weights.append(row)
    return weights


@pytest.mark.parametrize("name", [n for n in ROLLOUT_CORRECTIONS if n != "none"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_weights_match_a_float64_reference_of_the_formulas(name, seed):
    old, rollout, mask = random_batch(seed)
    weights, metrics = correction_weights(old, rollout, mask, name, threshold=2.0)
    expected = torch.tensor(reference_weights(old, rollout, mask, name, 2.0), dtype=torch.float64)
    assert torch.allclose(weights, expected, rtol=1e-12, atol=0.0)
    valid = mask.bool()
    assert metrics["rollout_corr/weight_mean"] == pytest.approx(expected[valid].mean().item(), rel=1e-12)
    assert metrics["rollout_corr/weight_max"] == pytest.approx(expected[valid].max().item(), rel=1e-12)
    kind = "truncated" if ROLLOUT_CORRECTIONS[name].above_threshold == "truncate" else "masked"
    assert 0.0 < metrics[f"rollout_corr/{kind}_fraction"] < 1.0  # spread 1: some ratios above 2, not all
    log_rho = (old - rollout)[valid]
    assert metrics["rollout_corr/kl"] == pytest.approx((-log_rho).mean().item(), rel=1e-12)
    assert metrics["rollout_corr/k3_kl"] == pytest.approx((log_rho.exp() - log_rho - 1).mean().item(), rel=1e-10)


def test_no_mismatch_gives_weight_one_everywhere_and_none_gives_no_weights():
    old, _, mask = random_batch(3)
    for name in ("token_tis", "sequence_tis", "token_mask", "sequence_mask"):
        weights, metrics = correction_weights(old, old.clone(), mask, name, threshold=1.0)
        assert torch.equal(weights, mask) and metrics["rollout_corr/kl"] == 0.0
    weights, metrics = correction_weights(old, old + 0.1, mask, "none", threshold=2.0)
    assert weights is None and metrics["rollout_corr/kl"] == pytest.approx(0.1)


def test_weights_carry_no_gradient():
    old, rollout, mask = random_batch(4)
    old.requires_grad_(True)
    weights, _ = correction_weights(old, rollout, mask, "token_tis", threshold=2.0)
    assert not weights.requires_grad


# --- verl 0.9.1 -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def verl_helper():
    """verl 0.9.1's verl/trainer/ppo/rollout_corr_helper.py, run from its wheel's own source.
    Its imports are given: masked_sum and masked_mean are verl's source
    (verl/utils/torch_functional.py, whose other imports need tensordict); the three config
    and protocol classes it names only in annotations are placeholders."""
    functional = verl_functions("verl/utils/torch_functional.py", ("masked_sum", "masked_mean"), torch=torch)
    return verl_module("verl/trainer/ppo/rollout_corr_helper.py", {
        "verl.utils.torch_functional": functional,
        "verl.protocol": {"DataProto": object},
        "verl.trainer.config.algorithm": {"RolloutCorrectionConfig": object},
        "verl.workers.config.actor": {"PolicyLossConfig": object},
    })


VERL_MODES = {  # ours -> verl's rollout_is and threshold spec (IcePop "lower_upper" with a lower bound below any weight)
    "token_tis": ("token", 2.0),
    "sequence_tis": ("sequence", 2.0),
    "token_mask": ("token", "1e-30_2.0"),
    "sequence_mask": ("sequence", "1e-30_2.0"),
}


@pytest.mark.parametrize("name", sorted(VERL_MODES))
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_weights_and_mismatch_metrics_match_verl_0_9_1(verl_helper, name, seed):
    old, rollout, mask = random_batch(seed, rows=16, width=24, spread=0.3)
    ours, metrics = correction_weights(old, rollout, mask, name, threshold=2.0)
    level, threshold = VERL_MODES[name]
    theirs, verl_metrics = verl_helper.compute_rollout_correction_weights(old - rollout, mask, rollout_is=level,
                                                                          rollout_is_threshold=threshold)
    assert torch.allclose(ours, theirs, rtol=1e-12, atol=0.0)
    assert metrics["rollout_corr/weight_mean"] == pytest.approx(verl_metrics["rollout_is_mean"], rel=1e-6)
    offpolicy = verl_helper.compute_offpolicy_metrics(old, rollout, mask)
    assert metrics["rollout_corr/kl"] == pytest.approx(offpolicy["kl"], rel=1e-6)
    assert metrics["rollout_corr/k3_kl"] == pytest.approx(offpolicy["k3_kl"], rel=1e-6)


# --- in the update --------------------------------------------------------------------------
def with_rollout_log_probs(table, log_probs):
    import pyarrow as pa

    index = table.schema.get_field_index("rollout_log_probs")
    return table.set_column(index, table.schema.field(index), pa.array(log_probs, type=table.schema.field(index).type))


@pytest.mark.parametrize("name, ratio, weight", [
    ("token_tis", 1.5, 1.5),  # below C: the ratio itself
    ("token_tis", math.e, 2.0),  # above C: truncated to C
    ("token_mask", math.e, 0.0),  # above C: masked
    ("none", math.e, 1.0),
])
def test_the_update_weighs_every_tokens_loss_by_its_correction(policy_dir, name, ratio, weight):
    """Rollout log-probs set to log pi_old - log ratio on every token: the gradient of the
    token-mean loss is the uncorrected one times the weight the correction gives ratio."""
    from dapo.engines.trainer import make_trainer
    from dapo.engines.update import minibatch_backward, prepare_step
    from policy_steps import grads_of, make_config, max_diff, scored_table

    table = scored_table()
    grads = {}
    for label, config in (("plain", make_config()),
                          ("corrected", make_config(rollout_correction=name, rollout_correction_threshold=2.0))):
        trainer = make_trainer(config, policy_dir)
        data = prepare_step(trainer, table, config, temperature=1.0)
        rows = [data.old_log_probs[i, : int(data.batch.response_mask[i].sum())] - math.log(ratio) for i in range(table.num_rows)]
        data = prepare_step(trainer, with_rollout_log_probs(table, [r.tolist() for r in rows]), config, temperature=1.0)
        minibatch_backward(trainer, data, torch.arange(table.num_rows), config, temperature=1.0)
        grads[label] = grads_of(trainer)
    assert data.metrics["rollout_corr/kl"] == pytest.approx(-math.log(ratio), rel=1e-5)  # E[log pi_rollout - log pi_old]
    assert data.metrics["rollout_logprob_diff"] == pytest.approx(math.log(ratio), rel=1e-5)
    expected = {k: v * weight for k, v in grads["plain"].items()}
    assert max_diff(grads["corrected"], expected) < 1e-6 * max(1.0, weight)
    assert max(v.abs().max().item() for v in grads["plain"].values()) > 1e-3  # not a vacuous comparison
