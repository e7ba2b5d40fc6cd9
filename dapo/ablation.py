"""The paper's Table 1 in miniature: cumulative DAPO ingredients on top of naive GRPO.

Rows (paper, AIME 2024 avg@32 with Qwen2.5-32B): naive GRPO 30, + overlong filtering 36,
+ clip-higher 38, + soft overlong punishment 41, + token-level loss 42, + dynamic
sampling (full DAPO) 50. Each row here adds one switch to the row above. The soft
overlong punishment row turns overlong filtering off again (DAPO keeps the soft
punishment, not the mask; verl's recipe does the same). No format reward anywhere:
the paper has none.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

NAIVE_GRPO = {
    "clip_high": 0.2,
    "loss_agg_mode": "seq-mean-token-mean",
    "dynamic_sampling": False,
    "enable_overlong_penalty": False,
    "overlong_filtering": False,
    "format_reward_weight": 0.0,
}
VARIANTS: tuple[tuple[str, dict], ...] = (
    ("naive GRPO", {}),
    ("+ overlong filtering", {"overlong_filtering": True}),
    ("+ clip-higher", {"clip_high": 0.28}),
    ("+ soft overlong punishment", {"enable_overlong_penalty": True, "overlong_filtering": False}),
    ("+ token-level loss", {"loss_agg_mode": "token-mean"}),
    ("+ dynamic sampling (DAPO)", {"dynamic_sampling": True}),
)


def variant_key(index: int) -> str:
    """Row `index` as an MLflow-safe metric prefix, e.g. "5_dynamic_sampling_dapo"."""
    return f"{index}_" + re.sub(r"[^a-z0-9]+", "_", VARIANTS[index][0].lower()).strip("_")


def variant_overrides(index: int) -> dict:
    """DAPOConfig overrides of row `index`: naive GRPO plus rows 1..index."""
    overrides = dict(NAIVE_GRPO)
    for _, change in VARIANTS[: index + 1]:
        overrides.update(change)
    return overrides


def grid(seeds: list[int]) -> list[tuple[int, int]]:
    """(variant index, seed) of every run, in the order runs are launched and reported."""
    return [(v, seed) for v in range(len(VARIANTS)) for seed in seeds]


def final_value(history: list[dict], key: str) -> float | None:
    values = [h[key] for h in history if key in h]
    return values[-1] if values else None


def mean_of(history: list[dict], key: str) -> float | None:
    values = [h[key] for h in history if key in h]
    return sum(values) / len(values) if values else None


def summarize(histories: list[list[dict]], seeds: list[int]) -> list[dict]:
    """One row per variant: final validation accuracy (mean, spread over seeds) and more."""
    by_variant: dict[int, list[list[dict]]] = {}
    for (variant, _), history in zip(grid(seeds), histories):
        by_variant.setdefault(variant, []).append(history)
    rows = []
    for variant, runs in sorted(by_variant.items()):
        finals = [v for v in (final_value(h, "val/acc") for h in runs) if v is not None]
        entropies = [v for v in (final_value(h, "actor/entropy") for h in runs) if v is not None]
        informative = [v for v in (mean_of(h, "sampling/informative_groups") for h in runs) if v is not None]
        rows.append({
            "variant": VARIANTS[variant][0],
            "key": variant_key(variant),
            "val_acc_mean": statistics.fmean(finals) if finals else float("nan"),
            "val_acc_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "val_acc_start": statistics.fmean(v for v in (h[0].get("val/acc") for h in runs) if v is not None) if runs and "val/acc" in runs[0][0] else float("nan"),
            "final_entropy": statistics.fmean(entropies) if entropies else float("nan"),
            "informative_groups_per_step": statistics.fmean(informative) if informative else float("nan"),
            "seeds": len(runs),
        })
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| variant | val acc (final, mean ± std) | val acc at step 0 | final entropy | informative groups per step | seeds |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['val_acc_mean']:.3f} ± {r['val_acc_std']:.3f} | {r['val_acc_start']:.3f} "
            f"| {r['final_entropy']:.3f} | {r['informative_groups_per_step']:.1f} | {r['seeds']} |"
        )
    return "\n".join(lines)


def plot_curves(histories: list[list[dict]], seeds: list[int], path: str | Path) -> None:
    """Accuracy, entropy, response length and kept groups over steps, mean over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("val/acc", "validation accuracy"), ("actor/entropy", "policy entropy"),
              ("train/response_length_mean", "mean response length"), ("sampling/informative_groups", "informative groups trained"))
    fig, axes = plt.subplots(1, 4, figsize=(18, 4), constrained_layout=True)
    runs_by_variant: dict[int, list[list[dict]]] = {}
    for (variant, _), history in zip(grid(seeds), histories):
        runs_by_variant.setdefault(variant, []).append(history)
    for ax, (key, title) in zip(axes, panels):
        for variant, runs in sorted(runs_by_variant.items()):
            steps = sorted({h["step"] for run in runs for h in run if key in h})
            means = [statistics.fmean(h[key] for run in runs for h in run if h["step"] == s and key in h) for s in steps]
            ax.plot(steps, means, marker="o", markersize=3, label=VARIANTS[variant][0])
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.savefig(path, dpi=90)
    plt.close(fig)
