"""Validation: avg@k accuracy of a checkpoint on the held-out split."""

from __future__ import annotations

import typing

import pyarrow as pa
from flytekit import Deck, task
from flytekit.types.directory import FlyteDirectory

from dapo import report
from dapo.config import StepConfig
from dapo.execution.stages import validation
from images.specs import ROLLOUT_IMAGE
from tasks.common import DECKS, ROLLOUT_POD, Checkpoint, cache, download_weights, task_entry


class EvalOutput(typing.NamedTuple):
    metrics: dict[str, float]
    samples: pa.Table


"""The samples are a table (stored as a file, passed by reference): 20k-token responses
would make an inline list larger than Flyte keeps in a node's outputs."""


@task(
    cache=cache(__name__),
    container_image=ROLLOUT_IMAGE,
    **ROLLOUT_POD,
    **DECKS,
)
@task_entry
def evaluate(config: StepConfig, policy: Checkpoint, data: FlyteDirectory, step: int) -> EvalOutput:
    """avg@k accuracy at the validation sampling settings, with sample completions."""
    metrics, samples = validation.evaluate(config, download_weights(policy), data.download(), step)
    Deck("Sample completions", report.html_table(samples))
    return EvalOutput(metrics, pa.Table.from_pylist(samples))
