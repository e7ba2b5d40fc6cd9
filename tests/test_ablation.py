"""The ablation studies' variants and report (the runs themselves: workflows/ablation.py)."""

import math
import re

import pytest

from dapo import ablation
from dapo.config import DAPOConfig

TABLE1, FIDELITY = ablation.study("table1"), ablation.study("fidelity")


def test_table1_variants_are_cumulative_from_naive_grpo_to_dapo():
    first = DAPOConfig.tiny_cpu().replace(**TABLE1.variant_overrides(0))
    assert (first.clip_high, first.loss_agg_mode, first.dynamic_sampling, first.enable_overlong_penalty) == (
        0.2, "seq-mean-token-mean", False, False)
    assert TABLE1.variant_overrides(1)["overlong_filtering"] is True
    assert TABLE1.variant_overrides(2)["clip_high"] == 0.28 and TABLE1.variant_overrides(2)["overlong_filtering"]
    soft = TABLE1.variant_overrides(3)
    assert soft["enable_overlong_penalty"] and not soft["overlong_filtering"]
    last = DAPOConfig.tiny_cpu().replace(**TABLE1.variant_overrides(len(TABLE1.variants) - 1))
    dapo = DAPOConfig.tiny_cpu().replace(format_reward_weight=0.0)
    for field in ("clip_low", "clip_high", "loss_agg_mode", "dynamic_sampling", "enable_overlong_penalty", "overlong_filtering"):
        assert getattr(last, field) == getattr(dapo, field), field


def test_fidelity_rows_share_the_regime_and_end_at_dapo():
    configs = [DAPOConfig.tiny_cpu().replace(**FIDELITY.variant_overrides(i)) for i in range(len(FIDELITY.variants))]
    for config in configs:
        assert config.embedded_task == "long_arithmetic" and config.val_entropy and config.execution == "colocated"
        assert config.updates_per_step >= 4, "clipping binds only over several updates per rollout batch"
    assert [c.overlong_filtering for c in configs] == [False, True, True, False]
    assert [c.clip_high for c in configs] == [0.2, 0.2, 0.28, 0.28]
    assert not any(c.dynamic_sampling or c.enable_overlong_penalty for c in configs[:-1])
    dapo = DAPOConfig.tiny_cpu().replace(**FIDELITY.regime, format_reward_weight=0.0)
    for field in ("clip_low", "clip_high", "loss_agg_mode", "dynamic_sampling", "enable_overlong_penalty", "overlong_filtering"):
        assert getattr(configs[-1], field) == getattr(dapo, field), field


def test_an_unknown_study_is_named():
    with pytest.raises(ValueError, match="unknown ablation study 'nope'"):
        ablation.study("nope")


def test_summary_means_and_spreads_over_seeds(tmp_path):
    seeds = [0, 1]
    histories = []
    for variant, seed in TABLE1.grid(seeds):
        final = 0.1 * variant + 0.02 * seed
        histories.append([
            {"step": 0, "val/acc": 0.05, "val/entropy": 0.4, "val/truncated_frac": 0.3},
            {"step": 1, "actor/entropy": 0.3, "sampling/informative_groups": 4.0, "actor/clipfrac": 0.01, "actor/clipfrac_high": 0.004},
            {"step": 2, "val/acc": final, "actor/entropy": 0.2, "actor/clipfrac": 0.03, "actor/clipfrac_high": 0.0,
             "val/entropy": 0.1 + 0.1 * seed, "val/truncated_frac": 0.1},
        ])
    rows = ablation.summarize(TABLE1, histories, seeds)
    assert [r["variant"] for r in rows] == [name for name, _ in TABLE1.variants]
    assert math.isclose(rows[2]["val_acc_mean"], 0.21) and math.isclose(rows[2]["val_acc_std"], 0.0141421356, rel_tol=1e-6)
    assert rows[0]["val_acc_start"] == 0.05 and rows[0]["final_entropy"] == 0.2 and rows[0]["informative_groups_per_step"] == 4.0
    assert math.isclose(rows[0]["val_entropy_start"], 0.4) and math.isclose(rows[0]["val_entropy_final"], 0.15)
    assert math.isclose(rows[0]["clipfrac"], 0.02) and math.isclose(rows[0]["clipfrac_high"], 0.002)
    assert math.isnan(rows[0]["clipfrac_low"])  # no run measured it
    assert (rows[0]["val_truncated_start"], rows[0]["val_truncated_final"]) == (0.3, 0.1)
    table = ablation.markdown_table(rows)
    assert "| + dynamic sampling (DAPO) |" in table and "| 0.400 → 0.150 |" in table and "30.0% → 10.0%" in table
    assert "/ 0.20% / — |" in table  # clipfrac_low: not measured, not "nan%"
    # MLflow metric names: alphanumerics, _ - . space : / only
    assert [r["key"] for r in rows][-1] == "5_dynamic_sampling_dapo"
    assert all(re.fullmatch(r"[\w\-. :/]+", r["key"]) for r in rows)
    ablation.plot_curves(TABLE1, histories, seeds, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 1000
