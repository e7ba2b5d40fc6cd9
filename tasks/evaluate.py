"""Validation: avg@k accuracy of a checkpoint on the held-out split."""

from __future__ import annotations

import typing

from flytekit import Deck, task
from flytekit.types.directory import FlyteDirectory

from dapo import pipeline, report
from images.specs import ROLLOUT_IMAGE
from tasks.common import DECKS, Checkpoint, LoopState, cache, download_weights, load_config, ROLLOUT_POD

EvalOutput = typing.NamedTuple("EvalOutput", [("metrics", dict[str, float]), ("samples", list[dict])])


@task(
    cache=cache("evaluate"),
    container_image=ROLLOUT_IMAGE,
    **ROLLOUT_POD,
    **DECKS,
)
def evaluate(config_json: str, policy: Checkpoint, data: FlyteDirectory, step: int, loop_state: str) -> EvalOutput:
    """avg@k accuracy at the validation sampling settings, with sample completions."""
    metrics, samples = pipeline.evaluate(load_config(config_json), download_weights(policy), data.download(), step)
    history = LoopState.from_json(loop_state).history + [{"step": step, **metrics}]
    Deck("Learning curves", report.png_html(report.learning_curves_png(history), "learning curves"))
    Deck("Sample completions", report.html_table(samples))
    return EvalOutput(metrics, samples)
