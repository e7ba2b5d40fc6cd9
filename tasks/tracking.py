"""MLflow delivery between steps: metrics, sample tables and registered checkpoints.

What the loop carries from task to task (LoopState) has a fixed size however long the
run: the metric history lives in MLflow, and records MLflow has not accepted yet wait in
an outbox file in Flyte's store, passed on by its URI.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import typing
from dataclasses import dataclass

import pyarrow as pa
from flytekit import Deck, FlyteContextManager, Resources, current_context, task
from flytekit.types.directory import FlyteDirectory
from flytekit.types.error import FlyteError

from dapo import report, tracking
from dapo.config import DAPOConfig, StepConfig
from dapo.execution.stages import guard, training
from dapo.tracking import LoopState
from images.specs import CPU_IMAGE
from tasks.common import DECKS, Checkpoint, cache, download_weights, run_key, task_entry
from tasks.config import resolve
from tasks.flytekit_fixes import register_dataclass

for state_type in (LoopState, tracking.RunTarget):
    register_dataclass(state_type)

logger = logging.getLogger(__name__)

UNDELIVERED_FILE = "undelivered-tracking.jsonl"


@dataclass
class RunSummary:
    """What dapo_loop ends with: the run in a few fields (the full record is in MLflow)."""

    final_step: int
    final_val_acc: float
    best_val_acc: float
    best_val_step: int
    champion_version: str
    """The registered version with the `champion` alias ("" if MLflow could not be reached)."""
    model_name: str
    mlflow_run_id: str
    mlflow_tracking_uri: str
    undelivered_records: int
    """Tracking records MLflow has not accepted (kept in the outbox and, locally, in a file)."""
    val_acc_curve: str = ""
    """The validation accuracy by step, as "step: acc" pairs ("" if MLflow could not be reached)."""


def _materialize(uri: str) -> str:
    # A registered version holds what a user serves: the weights, config and tokenizer,
    # not trainer_state/ (7x the bf16 weights' bytes).
    return download_weights(FlyteDirectory(uri))


def read_outbox(state: LoopState) -> list[dict]:
    if not state.outbox:
        return []
    fs = FlyteContextManager.current_context().file_access.get_filesystem_for_path(state.outbox)
    return [json.loads(line) for line in fs.cat_file(state.outbox).decode().splitlines() if line]


def deliver(state: LoopState, target: tracking.RunTarget, records: list[dict], registers: bool = False) -> None:
    """Send the outbox's records and then these; what is left goes into a new outbox file.

    registers: this task's pod has disk for a model version's weights (register_model's),
    so registrations are sent; elsewhere they wait in the outbox, behind nothing and
    holding nothing up, for the next register_model."""
    left = tracking.deliver(target, read_outbox(state) + records, materialize=_materialize if registers else None)
    state.outbox = ""
    if left:
        lines = "".join(json.dumps(record) + "\n" for record in left).encode()
        state.outbox = FlyteContextManager.current_context().file_access.put_raw_data(
            io.BytesIO(lines), file_name="outbox.jsonl"
        )


def execution_name() -> str:
    return current_context().execution_id.name


class Tracking(typing.NamedTuple):
    target: tracking.RunTarget
    loop_state: LoopState


@task(cache=cache(__name__), container_image=CPU_IMAGE, requests=Resources(cpu="1", mem="2Gi"))
@task_entry
def start_tracking(config: StepConfig, tracking_uri: str, experiment: str, data_stats: dict[str, float]) -> Tracking:
    """Bind the run (its step config) to one MLflow run, found again when the run is resumed
    or extended, and log the config."""
    target = tracking.RunTarget(
        tracking.default_tracking_uri(tracking_uri), experiment, run_key(config), f"dapo-{execution_name()}"
    )
    state = LoopState()
    deliver(state, target, [tracking.params_record(config.to_dict()), tracking.metrics_record(0, data_stats)])
    return Tracking(target, state)


def report_step(state: LoopState, target: tracking.RunTarget, step: int, step_metrics: dict[str, float]) -> None:
    """Print the step line and log the step's metrics (after whatever earlier deliveries
    left pending; what MLflow does not take goes into state's outbox)."""
    seconds = sum(step_metrics.get(key, 0.0) for key, _ in report.STEP_PARTS)
    print(report.step_line({"step": step, **step_metrics, "step/seconds": seconds}), flush=True)
    deliver(state, target, [tracking.metrics_record(step, step_metrics)])


@task(cache=cache(__name__), container_image=CPU_IMAGE, requests=Resources(cpu="1", mem="4Gi"))
@task_entry
def log_step(
    config: StepConfig, target: tracking.RunTarget, loop_state: LoopState, step: int, step_metrics: dict[str, float]
) -> LoopState:
    """Log a step's metrics (and whatever earlier deliveries left pending); print the step line."""
    state = dataclasses.replace(loop_state)
    state.bad_steps = training.count_bad_steps(state.bad_steps, step_metrics, config.max_bad_steps, step)
    report_step(state, target, step, step_metrics)
    guard.check_rollout_guard(config, step_metrics, step - 1)  # after delivery: MLflow sees why the run stops
    training.check_verdicts(config, step_metrics, step - 1)
    return state


@task(cache=cache(__name__), container_image=CPU_IMAGE, requests=Resources(cpu="1", mem="4Gi"))
@task_entry
def log_chunk(
    config: StepConfig,
    target: tracking.RunTarget,
    loop_state: LoopState,
    first_step: int,
    step_metrics: list[dict[str, float]],
    outbox: str,
) -> LoopState:
    """After a colocated chunk, which printed and logged each of its steps as it ended: the
    records it could not deliver (its outbox), then every step's metrics once more, which
    MLflow takes only where it lacks them (a chunk killed after a step's record but before
    its delivery resumes after that step: Tracker.is_logged); the bad-step count over its
    steps, and the rollout guard's verdict on its last step."""
    state = dataclasses.replace(loop_state)
    for offset, metrics in enumerate(step_metrics):
        state.bad_steps = training.count_bad_steps(
            state.bad_steps, metrics, config.max_bad_steps, first_step + offset + 1
        )
    steps = [tracking.metrics_record(first_step + offset + 1, metrics) for offset, metrics in enumerate(step_metrics)]
    deliver(state, target, read_outbox(LoopState(outbox=outbox)) + steps)
    if step_metrics:
        guard.check_rollout_guard(config, step_metrics[-1], first_step + len(step_metrics) - 1)
        training.check_verdicts(config, step_metrics[-1], first_step + len(step_metrics) - 1)
    return state


@task(cache=cache(__name__), container_image=CPU_IMAGE, requests=Resources(cpu="1", mem="4Gi"), **DECKS)
@task_entry
def register_model(
    target: tracking.RunTarget,
    loop_state: LoopState,
    policy: Checkpoint,
    step: int,
    eval_metrics: dict[str, float],
    samples: pa.Table,
    model_name: str,
) -> LoopState:
    """Log validation metrics and samples, register the checkpoint, move champion/newest;
    the Deck shows the run's learning curves as MLflow has them."""
    state = dataclasses.replace(loop_state)
    state.record_validation(step, eval_metrics.get("val/acc", 0.0))
    print(report.step_line({"step": step, **eval_metrics}), flush=True)
    uri = policy.remote_source or policy.path
    records = [
        tracking.metrics_record(step, eval_metrics),
        tracking.table_record(f"samples/step_{step:06d}.json", samples.to_pylist()),
        tracking.register_record(model_name, uri, step, eval_metrics.get("val/acc", 0.0), execution=execution_name()),
    ]
    deliver(state, target, records, registers=True)
    try:
        with tracking.fast_fail():
            run_id = tracking.Tracker(target).run_id
            history = tracking.run_history(target.tracking_uri, run_id)
        Deck("Learning curves", report.png_html(report.learning_curves_png(history), "learning curves"))
    except Exception as error:  # the curves are a view; MLflow being down must not fail (or stall) the step
        logger.warning("no learning-curve Deck: MLflow at %s: %s", target.tracking_uri, error)
    return state


def run_tags(config: DAPOConfig) -> dict[str, str]:
    """Tags of an execution (MLflow params cannot change, and these may between
    executions of one run): the run's length, validation period and the config's extra tags."""
    return {
        "dapo.total_steps": str(config.total_steps),
        "dapo.val_every": str(config.val_every),
        "flyte.execution": execution_name(),
        **{str(k): str(v) for k, v in config.extra.items()},
    }


@task(container_image=CPU_IMAGE, requests=Resources(cpu="1", mem="2Gi"))
@task_entry
def finish_tracking(
    config: DAPOConfig, target: tracking.RunTarget, loop_state: LoopState, model_name: str
) -> RunSummary:
    """A last delivery, then the run ends FINISHED with this execution's tags; returns the
    run's summary.

    Not cached: every execution, a resumed or an extended one too, ends its run. What
    still cannot be delivered stays in the outbox and, in a local run, in a file."""
    state = dataclasses.replace(loop_state)
    deliver(state, target, [])
    pending = read_outbox(state)
    if pending:
        where = f"the outbox {state.outbox}"
        if FlyteContextManager.current_context().execution_state.is_local_execution():
            # A local run's sandbox is temporary: also leave them beside the user's command.
            tracking.spill(pending, UNDELIVERED_FILE)
            where += f" and {os.path.abspath(UNDELIVERED_FILE)}"
        logger.warning("%d tracking record(s) could not be delivered; kept in %s", len(pending), where)
    run_id = tracking.end_run(target, "FINISHED", run_tags(config))
    return RunSummary(
        final_step=state.last_val_step,
        final_val_acc=state.last_val_acc,
        best_val_acc=state.best_val_acc,
        best_val_step=state.best_val_step,
        champion_version=tracking.alias_version(target, model_name),
        model_name=model_name,
        mlflow_run_id=run_id,
        mlflow_tracking_uri=target.tracking_uri,
        undelivered_records=len(pending),
        val_acc_curve=val_acc_curve(target, run_id),
    )


def val_acc_curve(target: tracking.RunTarget, run_id: str) -> str:
    """The run's validation accuracy by step from MLflow, "0: 0.203, 5: 0.287, ..."; "" if
    MLflow cannot be reached (the summary is a view: it must not fail the run)."""
    try:
        with tracking.fast_fail():
            history = tracking.run_history(target.tracking_uri, run_id)
    except Exception as error:
        logger.warning("no validation curve in the summary: MLflow at %s: %s", target.tracking_uri, error)
        return ""
    return ", ".join(f"{int(h['step'])}: {h['val/acc']:.3f}" for h in history if "val/acc" in h)


@task(container_image=CPU_IMAGE, requests=Resources(cpu="1", mem="2Gi"))
@task_entry
def end_failed_run(
    preset: str,
    overrides_json: str,
    total_steps: int,
    train_data: str,
    val_data: str,
    mlflow_tracking_uri: str,
    mlflow_experiment: str,
    model_name: str,
    steps_per_chunk: int,
    config_file: str = "",
    set: str = "",
    err: FlyteError | None = None,
) -> None:
    """dapo_loop's failure handler: the run's MLflow run (if it was started) ends KILLED or
    FAILED (tracking.ended_status), with the error as a tag, instead of staying RUNNING.

    Flyte runs no failure handler for an execution aborted by hand (or whose process
    dies): its run stays RUNNING until the next execution of the config goes on with it."""
    try:
        config = resolve(preset, overrides_json, total_steps, train_data, val_data, steps_per_chunk, config_file, set)
    except Exception as error:  # the config itself was the failure: no run was started
        logger.warning("dapo_loop failed before its MLflow run started: %s", error)
        return
    target = tracking.RunTarget(
        tracking.default_tracking_uri(mlflow_tracking_uri), mlflow_experiment, run_key(config), ""
    )
    message = (err.message if err else "unknown error")[:4000]
    tags = {**run_tags(config), "flyte.error": message, "flyte.failed_node": err.failed_node_id if err else ""}
    status = tracking.ended_status(message)
    if tracking.end_run(target, status, tags):
        logger.warning("MLflow run of %s marked %s", mlflow_experiment, status)
