"""Ablations of DAPO's ingredients: rows that add one switch each to the row above.

Two studies:

- "table1": the paper's Table 1 in miniature on the embedded default. Rows (paper, AIME
  2024 avg@32 with Qwen2.5-32B): naive GRPO 30, + overlong filtering 36, + clip-higher
  38, + soft overlong punishment 41, + token-level loss 42, + dynamic sampling (full
  DAPO) 50. The soft overlong punishment row turns overlong filtering off again (DAPO
  keeps the soft punishment, not the mask; verl's recipe does the same).
- "fidelity": the regime where each claim can show (FIDELITY_REGIME): the long
  arithmetic task, whose longest solutions overrun max_response_length, and 4 optimiser
  updates per rollout batch (the paper's 512 prompts in mini-batches of 32 make 16), so
  that the clip bounds bind and the entropy moves; the policy's entropy is measured on
  the validation samples (val/entropy), which dynamic sampling's selection cannot bias.

No format reward anywhere: the paper has none.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

NAIVE_GRPO = {
    "clip_high": 0.2,
    "loss_agg_mode": "seq-mean-token-mean",
    "dynamic_sampling": False,
    "enable_overlong_penalty": False,
    "overlong_filtering": False,
    "format_reward_weight": 0.0,
}

FIDELITY_REGIME = {
    "embedded_task": "long_arithmetic",
    "embedded_warm_start_steps": 1200,
    "max_response_length": 64,
    "overlong_buffer_len": 16,
    "n_samples_per_prompt": 8,
    "train_prompt_bsz": 8,
    "gen_prompt_bsz": 16,
    "ppo_mini_batch_size": 2,
    "lr": 5e-5,
    "warmup_steps": 5,
    "val_n_samples": 2,
    "val_every": 25,
    "val_entropy": True,
    "execution": "colocated",
    "colocated_checkpoint_every": 25,
}
"""The fidelity study's overrides of the tiny_cpu preset, shared by every row."""


@dataclass(frozen=True)
class Study:
    variants: tuple[tuple[str, dict], ...]
    """(row name, the switches it adds to the row above); row 0 adds to NAIVE_GRPO."""
    regime: dict = field(default_factory=dict)
    """Overrides of the tiny_cpu preset shared by every row."""

    def variant_overrides(self, index: int) -> dict:
        """DAPOConfig overrides of row `index`: the regime, naive GRPO, then rows 0..index."""
        overrides = {**self.regime, **NAIVE_GRPO}
        for _, change in self.variants[: index + 1]:
            overrides.update(change)
        return overrides

    def variant_key(self, index: int) -> str:
        """Row `index` as an MLflow-safe metric prefix, e.g. "5_dynamic_sampling_dapo"."""
        return f"{index}_" + re.sub(r"[^a-z0-9]+", "_", self.variants[index][0].lower()).strip("_")

    def grid(self, seeds: list[int]) -> list[tuple[int, int]]:
        """(variant index, seed) of every run, in the order runs are launched and reported."""
        return [(v, seed) for v in range(len(self.variants)) for seed in seeds]

    def by_variant(self, histories: list[list[dict]], seeds: list[int]) -> dict[int, list[list[dict]]]:
        runs: dict[int, list[list[dict]]] = {}
        for (variant, _), history in zip(self.grid(seeds), histories):
            runs.setdefault(variant, []).append(history)
        return runs


STUDIES = {
    "table1": Study(
        (
            ("naive GRPO", {}),
            ("+ overlong filtering", {"overlong_filtering": True}),
            ("+ clip-higher", {"clip_high": 0.28}),
            ("+ soft overlong punishment", {"enable_overlong_penalty": True, "overlong_filtering": False}),
            ("+ token-level loss", {"loss_agg_mode": "token-mean"}),
            ("+ dynamic sampling (DAPO)", {"dynamic_sampling": True}),
        )
    ),
    "fidelity": Study(
        (
            ("naive GRPO", {}),
            ("+ overlong filtering", {"overlong_filtering": True}),
            ("+ clip-higher", {"clip_high": 0.28}),
            (
                "DAPO (+ soft overlong punishment for filtering, token-level loss, dynamic sampling)",
                {
                    "overlong_filtering": False,
                    "enable_overlong_penalty": True,
                    "loss_agg_mode": "token-mean",
                    "dynamic_sampling": True,
                },
            ),
        ),
        FIDELITY_REGIME,
    ),
}


def study(name: str) -> Study:
    if name not in STUDIES:
        raise ValueError(f"unknown ablation study {name!r}; choose one of {sorted(STUDIES)}")
    return STUDIES[name]


def values(history: list[dict], key: str) -> list[float]:
    return [h[key] for h in history if key in h]


def _seed_mean(runs: list[list[dict]], pick) -> float:
    """Mean over seeds of pick(values of a run), skipping runs without the metric."""
    picked = [pick(v) for v in runs if v]
    return statistics.fmean(picked) if picked else float("nan")


def summarize(chosen: Study, histories: list[list[dict]], seeds: list[int]) -> list[dict]:
    """One row per variant: validation accuracy at the end (mean and spread over seeds) and
    at the start; the probe entropy at the start and the end (val/entropy, where measured);
    the clip fractions, truncation share and kept groups averaged over the steps."""
    rows = []
    for variant, runs in sorted(chosen.by_variant(histories, seeds).items()):

        def series(key, runs=runs):
            return [values(h, key) for h in runs]

        finals = [v[-1] for v in series("val/acc") if v]
        rows.append(
            {
                "variant": chosen.variants[variant][0],
                "key": chosen.variant_key(variant),
                "val_acc_mean": statistics.fmean(finals) if finals else float("nan"),
                "val_acc_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
                "val_acc_start": _seed_mean(series("val/acc"), lambda v: v[0]),
                "val_entropy_start": _seed_mean(series("val/entropy"), lambda v: v[0]),
                "val_entropy_final": _seed_mean(series("val/entropy"), lambda v: v[-1]),
                "final_entropy": _seed_mean(series("actor/entropy"), lambda v: v[-1]),
                "clipfrac": _seed_mean(series("actor/clipfrac"), statistics.fmean),
                "clipfrac_high": _seed_mean(series("actor/clipfrac_high"), statistics.fmean),
                "clipfrac_low": _seed_mean(series("actor/clipfrac_low"), statistics.fmean),
                "val_truncated_start": _seed_mean(series("val/truncated_frac"), lambda v: v[0]),
                "val_truncated_final": _seed_mean(series("val/truncated_frac"), lambda v: v[-1]),
                "val_length_final": _seed_mean(series("val/response_length_mean"), lambda v: v[-1]),
                "informative_groups_per_step": _seed_mean(series("sampling/informative_groups"), statistics.fmean),
                "seeds": len(runs),
            }
        )
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| variant | val acc (final, mean ± std) | val acc at step 0 | probe entropy (start → final) "
        "| batch entropy (final) | clipped tokens (all / high / low) | truncated (val, start → final) "
        "| val length (final) | informative groups per step | seeds |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:

        def cell(key: str, spec: str, r=r) -> str:
            return "—" if math.isnan(r[key]) else format(r[key], spec)  # not measured (e.g. val_entropy off)

        lines.append(
            f"| {r['variant']} | {cell('val_acc_mean', '.3f')} ± {cell('val_acc_std', '.3f')} "
            f"| {cell('val_acc_start', '.3f')} "
            f"| {cell('val_entropy_start', '.3f')} → {cell('val_entropy_final', '.3f')} "
            f"| {cell('final_entropy', '.3f')} "
            f"| {cell('clipfrac', '.2%')} / {cell('clipfrac_high', '.2%')} / {cell('clipfrac_low', '.2%')} "
            f"| {cell('val_truncated_start', '.1%')} → {cell('val_truncated_final', '.1%')} "
            f"| {cell('val_length_final', '.1f')} "
            f"| {cell('informative_groups_per_step', '.1f')} | {r['seeds']} |"
        )
    return "\n".join(lines)


PANELS = (
    ("val/acc", "validation accuracy"),
    ("val/entropy", "policy entropy on the validation samples"),
    ("actor/clipfrac", "clipped tokens"),
    ("val/truncated_frac", "truncated validation responses"),
    ("val/response_length_mean", "mean validation response length"),
    ("sampling/informative_groups", "informative groups trained"),
)


def plot_curves(chosen: Study, histories: list[list[dict]], seeds: list[int], path: str | Path) -> None:
    """The PANELS metrics over steps, mean over seeds (steps averaged in windows of 10 for
    per-step metrics), one line per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 8), constrained_layout=True)
    for ax, (key, title) in zip(axes.flat, PANELS):
        window = 1 if key.startswith("val/") else 10
        for variant, runs in sorted(chosen.by_variant(histories, seeds).items()):
            points: dict[int, list[float]] = {}
            for run in runs:
                for h in run:
                    if key in h:
                        points.setdefault(-(-h["step"] // window) * window, []).append(h[key])
            steps = sorted(points)
            ax.plot(
                steps,
                [statistics.fmean(points[s]) for s in steps],
                marker="o",
                markersize=3,
                label=chosen.variants[variant][0],
            )
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.savefig(path, dpi=90)
    plt.close(fig)
