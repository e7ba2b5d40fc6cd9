"""Progress as pictures and lines: learning-curve plots, HTML tables, the per-step line."""

from __future__ import annotations

import base64
import html
import io

CURVES = (
    ("val/acc", "validation accuracy (avg@k)"),
    ("train/acc", "training accuracy"),
    ("train/reward_mean", "training reward"),
    ("actor/entropy", "policy entropy"),
    ("train/response_length_mean", "mean response length"),
    ("sampling/kept_ratio", "kept-group ratio"),
)


def learning_curves_png(history: list[dict]) -> bytes:
    """A grid of the main curves over steps, as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(12, 6), constrained_layout=True)
    for ax, (key, title) in zip(axes.flat, CURVES):
        points = [(h["step"], h[key]) for h in history if key in h]
        if points:
            ax.plot(*zip(*points), marker="o", markersize=3)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80)
    plt.close(fig)
    return buffer.getvalue()


def png_html(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}"/>'


def html_table(rows: list[dict], max_cell: int = 300) -> str:
    """Rows as an escaped HTML table (model output is data: always escaped)."""
    if not rows:
        return "<p>(no rows)</p>"
    keys = list(dict.fromkeys(k for row in rows for k in row))
    head = "".join(f"<th>{html.escape(str(k))}</th>" for k in keys)
    body = "".join(
        "<tr>" + "".join(f"<td><pre>{html.escape(str(row.get(k, ''))[:max_cell])}</pre></td>" for k in keys) + "</tr>"
        for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


STEP_PARTS = (("rollout/seconds", "gen"), ("reward/seconds", "score"), ("policy_step/seconds", "update"))
"""A step's timed parts (metric, name on the step line): generation, scoring, the update."""


def step_line(metrics: dict) -> str:
    """One compact line per step for the local console."""

    def get(key: str, fmt: str) -> str:
        return format(metrics[key], fmt) if key in metrics else "-"

    # Shown only when it happens: verdicts math-verify did not give, counted as wrong.
    unverified_count = metrics.get("train/unverified", 0.0) + metrics.get("val/unverified", 0.0)
    unverified = f" | unverified {unverified_count:.0f}" if unverified_count else ""

    # The step's parts, where it has them (a validation line has none).
    timing = ", ".join(f"{name} {metrics[key]:.1f}" for key, name in STEP_PARTS if key in metrics)
    timing = f" ({timing})" if timing else ""

    return (
        f"step {metrics.get('step', '?'):>4} | val_acc {get('val/acc', '.3f')} | train_acc {get('train/acc', '.3f')} "
        f"| reward {get('train/reward_mean', '+.3f')} | entropy {get('actor/entropy', '.3f')} "
        f"| kept {get('sampling/kept_ratio', '.2f')} in {get('sampling/rounds', '.0f')} round(s) "
        f"| truncated {get('train/truncated_frac', '.2f')} "
        f"| took {get('step/seconds', '.1f')} s{timing}" + unverified
    )
