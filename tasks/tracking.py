"""MLflow delivery between steps: metrics, sample tables and registered checkpoints."""

from __future__ import annotations

import json
import logging
import os
import typing

from flytekit import FlyteContextManager, Resources, current_context, task
from flytekit.types.directory import FlyteDirectory

from dapo import pipeline, report, tracking
from images.specs import CPU_IMAGE
from tasks.common import Checkpoint, LoopState, cache, download_weights, load_config, run_key

logger = logging.getLogger(__name__)

UNDELIVERED_FILE = "undelivered-tracking.jsonl"


def run_target(target_json: str) -> tracking.RunTarget:
    return tracking.RunTarget(**json.loads(target_json))


def _materialize(uri: str) -> str:
    # A registered version holds what a user serves: the weights, config and tokenizer,
    # not trainer_state/ (7x the bf16 weights' bytes).
    return download_weights(FlyteDirectory(uri))


@task(cache=cache("track"), container_image=CPU_IMAGE, requests=Resources(cpu="1", mem="2Gi"))
def start_tracking(config_json: str, tracking_uri: str, experiment: str, data_stats: dict[str, float]) -> typing.NamedTuple(
    "Tracking", [("target_json", str), ("loop_state", str)]
):
    """Bind this execution to one MLflow run (found again on resume) and log the config."""
    execution = current_context().execution_id.name
    config = load_config(config_json)
    target = tracking.RunTarget(tracking.default_tracking_uri(tracking_uri), experiment, run_key(config_json), run_name=f"dapo-{execution}")
    records = [tracking.params_record(config.to_dict()), tracking.metrics_record(0, data_stats)]
    pending = tracking.deliver(target, records, materialize=_materialize)
    return json.dumps(target.__dict__), LoopState(pending=pending).to_json()


@task(cache=cache("track"), container_image=CPU_IMAGE, requests=Resources(cpu="1", mem="4Gi"))
def log_step(config_json: str, target_json: str, loop_state: str, step: int, step_metrics: dict[str, float]) -> str:
    """Log a step's metrics (and whatever earlier deliveries left pending); print the step line."""
    config = load_config(config_json)
    state = LoopState.from_json(loop_state)
    state.bad_steps = pipeline.count_bad_steps(state.bad_steps, step_metrics, config.max_bad_steps, step)
    seconds = step_metrics.get("rollout/seconds", 0.0) + step_metrics.get("policy_step/seconds", 0.0)
    state.history.append({"step": step, **step_metrics, "step/seconds": seconds})
    print(report.step_line(state.history[-1]), flush=True)
    state.pending = tracking.deliver(run_target(target_json), state.pending + [tracking.metrics_record(step, step_metrics)], materialize=_materialize)
    pipeline.check_rollout_guard(config, step_metrics, step - 1)  # after delivery: MLflow sees why the run stops
    return state.to_json()


@task(cache=cache("track"), container_image=CPU_IMAGE, requests=Resources(cpu="1", mem="4Gi"))
def register_model(
    target_json: str, loop_state: str, policy: Checkpoint, step: int, eval_metrics: dict[str, float], samples: list[dict], model_name: str
) -> str:
    """Log validation metrics and samples, register the checkpoint, move champion/newest."""
    state = LoopState.from_json(loop_state)
    if state.history and state.history[-1]["step"] == step:
        state.history[-1].update(eval_metrics)
    else:
        state.history.append({"step": step, **eval_metrics})
    print(report.step_line(state.history[-1]), flush=True)
    uri = policy.remote_source or policy.path
    records = [
        tracking.metrics_record(step, eval_metrics),
        tracking.table_record(f"samples/step_{step:06d}.json", samples),
        tracking.register_record(model_name, uri, step, eval_metrics.get("val/acc", 0.0)),
    ]
    state.pending = tracking.deliver(run_target(target_json), state.pending + records, materialize=_materialize)
    return state.to_json()


@task(container_image=CPU_IMAGE, requests=Resources(cpu="1", mem="2Gi"))
def finish_tracking(target_json: str, loop_state: str) -> str:
    """A last delivery; what still cannot be delivered is kept in the output and on disk."""
    state = LoopState.from_json(loop_state)
    state.pending = tracking.deliver(run_target(target_json), state.pending, materialize=_materialize)
    if state.pending:
        where = "this task's output (loop_state.pending)"
        if FlyteContextManager.current_context().execution_state.is_local_execution():
            # A local run's sandbox is temporary: also leave them beside the user's command.
            tracking.spill(state.pending, UNDELIVERED_FILE)
            where += f" and {os.path.abspath(UNDELIVERED_FILE)}"
        logger.warning("%d tracking record(s) could not be delivered; kept in %s", len(state.pending), where)
    return state.to_json()
