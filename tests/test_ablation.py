"""The ablation's variants and report (the runs themselves: workflows/ablation.py)."""

import math
import re

from dapo import ablation
from dapo.config import DAPOConfig


def test_variants_are_cumulative_from_naive_grpo_to_dapo():
    first = DAPOConfig.tiny_cpu().replace(**ablation.variant_overrides(0))
    assert (first.clip_high, first.loss_agg_mode, first.dynamic_sampling, first.enable_overlong_penalty) == (
        0.2, "seq-mean-token-mean", False, False)
    assert ablation.variant_overrides(1)["overlong_filtering"] is True
    assert ablation.variant_overrides(2)["clip_high"] == 0.28 and ablation.variant_overrides(2)["overlong_filtering"]
    soft = ablation.variant_overrides(3)
    assert soft["enable_overlong_penalty"] and not soft["overlong_filtering"]
    last = DAPOConfig.tiny_cpu().replace(**ablation.variant_overrides(len(ablation.VARIANTS) - 1))
    dapo = DAPOConfig.tiny_cpu().replace(format_reward_weight=0.0)
    for field in ("clip_low", "clip_high", "loss_agg_mode", "dynamic_sampling", "enable_overlong_penalty", "overlong_filtering"):
        assert getattr(last, field) == getattr(dapo, field), field


def test_summary_means_and_spreads_over_seeds(tmp_path):
    seeds = [0, 1]
    histories = []
    for variant, seed in ablation.grid(seeds):
        final = 0.1 * variant + 0.02 * seed
        histories.append([{"step": 0, "val/acc": 0.05}, {"step": 1, "actor/entropy": 0.3, "sampling/informative_groups": 4.0},
                          {"step": 2, "val/acc": final, "actor/entropy": 0.2}])
    rows = ablation.summarize(histories, seeds)
    assert [r["variant"] for r in rows] == [name for name, _ in ablation.VARIANTS]
    assert math.isclose(rows[2]["val_acc_mean"], 0.21) and math.isclose(rows[2]["val_acc_std"], 0.0141421356, rel_tol=1e-6)
    assert rows[0]["val_acc_start"] == 0.05 and rows[0]["final_entropy"] == 0.2 and rows[0]["informative_groups_per_step"] == 4.0
    assert "| + dynamic sampling (DAPO) |" in ablation.markdown_table(rows)
    # MLflow metric names: alphanumerics, _ - . space : / only
    assert [r["key"] for r in rows][-1] == "5_dynamic_sampling_dapo"
    assert all(re.fullmatch(r"[\w\-. :/]+", r["key"]) for r in rows)
    ablation.plot_curves(histories, seeds, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 1000
