"""MLflow tracking that never stops training and never loses a record.

Everything the pipeline logs is first a plain JSON record (params, metrics of a
step, a table of sample completions, a checkpoint to register). `deliver` sends
records to MLflow and returns the ones it could not send; the pipeline carries
those forward (as a task output, so they survive pod restarts) and hands them to
the next delivery. An unreachable server therefore delays records, with a
warning, and loses none; only a record the server refuses for good (a registry
name clash, an invalid value) is dropped, with an error in the log.

One MLflow run per dapo_loop execution: the run is found by its `dapo.run_key`
tag (so a resumed execution keeps logging into the same run) or created with the
execution's name. Registered checkpoints get the aliases `newest` (newest step)
and `champion` (best validation accuracy among the model's versions). MLflow 3
reserves the alias name `latest`: `models:/<name>/latest` already gives the newest
version natively, and `models:/<name>@newest` the newest registered by this run.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

RUN_KEY_TAG = "dapo.run_key"
NEWEST_ALIAS = "newest"
CHAMPION_ALIAS = "champion"
# Server-side refusals that a retry cannot fix; anything else counts as "unavailable".
PERMANENT_ERROR_CODES = {"INVALID_PARAMETER_VALUE", "RESOURCE_ALREADY_EXISTS", "BAD_REQUEST", "INVALID_STATE"}
MANAGED_TAG = "dapo.managed"
FAST_FAIL_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
LARGE_UPLOAD_ENV = {
    "MLFLOW_ENABLE_PROXY_MULTIPART_UPLOAD": "true",
    "MLFLOW_MULTIPART_UPLOAD_CHUNK_SIZE": str(64 * 2**20),
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "600",
}
"""A model version's upload. Files from MLflow's minimum multipart size (500 MB) up go by
MLflow's proxied multipart upload: the server only opens and completes the upload (small
JSON calls), the parts go from this process straight to the artifact store by presigned
URLs, so no weight file passes through the server's disk or its request timeout (64 MiB
parts: a 4 GB shard is 60 of them; the uploading threads each hold one part in memory).
The server's calls get retries and a timeout that a large object's completion fits in."""

_ours: dict[str, str] = {}
"""The MLflow variables our scopes have set, with the value they set: anything else in the
environment is the user's and is never overridden."""


@contextmanager
def _mlflow_env(values: dict[str, str]):
    """Set MLflow's client variables for the calls inside (MLflow reads them at each
    request), except those the user set; nested scopes override outer ones and restore them."""
    previous: dict[str, str | None] = {}
    for key, value in values.items():
        if key in os.environ and _ours.get(key) != os.environ[key]:
            continue  # the user's
        previous[key] = os.environ.get(key)
        os.environ[key] = _ours[key] = value
    try:
        yield
    finally:
        for key, earlier in previous.items():
            if earlier is None:
                os.environ.pop(key, None)
                _ours.pop(key, None)
            else:
                os.environ[key] = _ours[key] = earlier


def fast_fail():
    """MLflow calls inside (a with block, a decorated function) fail within seconds when the
    server is down: the default client retries for minutes per call, which would stall the
    training loop that waits on them. Never over the user's own settings."""
    return _mlflow_env(FAST_FAIL_ENV)


def large_uploads():
    """MLflow calls inside upload files of any size without the server holding them
    (LARGE_UPLOAD_ENV); never over the user's own settings."""
    return _mlflow_env(LARGE_UPLOAD_ENV)


class RegistryNameClash(RuntimeError):
    """The registered model name exists and was not created by dapo-flyte."""


def default_tracking_uri(uri: str = "") -> str:
    """The given URI, else $MLFLOW_TRACKING_URI, else a sqlite store in the working directory.

    A URI with a password in it is refused: it would end up in task outputs and logs.
    Credentials belong in MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (or
    MLFLOW_TRACKING_TOKEN), set from a Kubernetes Secret.
    """
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI", "") or f"sqlite:///{Path.cwd() / 'mlflow.db'}"
    if urlsplit(uri).password:
        raise ValueError(
            "the MLflow tracking URI carries a password; pass credentials through "
            "MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD (from a Secret) instead"
        )
    return uri


def params_record(params: dict[str, Any]) -> dict:
    flat = {k: json.dumps(v) if isinstance(v, (dict, list)) else str(v) for k, v in params.items()}
    return {"kind": "params", "values": flat}


def metrics_record(step: int, metrics: dict[str, float]) -> dict:
    return {
        "kind": "metrics",
        "step": int(step),
        "values": {k: float(v) for k, v in metrics.items()},
        "time": time.time(),
    }


def table_record(artifact_file: str, rows: list[dict]) -> dict:
    return {"kind": "table", "artifact_file": artifact_file, "rows": rows}


def artifact_record(local_path: str | Path, artifact_path: str = "") -> dict:
    """A local file (a plot, a report) to store with the run under artifact_path."""
    return {"kind": "artifact", "local_path": str(local_path), "artifact_path": artifact_path}


def register_record(model_name: str, checkpoint_uri: str, step: int, val_acc: float, execution: str = "") -> dict:
    """checkpoint_uri: a local directory, or a remote URI that `materialize` turns into one;
    execution: the Flyte execution that trained it (named in the version's description)."""
    return {
        "kind": "register",
        "model_name": model_name,
        "checkpoint_uri": checkpoint_uri,
        "step": int(step),
        "val_acc": float(val_acc),
        "execution": execution,
    }


def servable_files(checkpoint_dir: str | Path) -> list[Path]:
    """What a registered version holds: the checkpoint's top-level files (weights, config,
    tokenizer, generation config); never trainer_state/ (optimizer state, 7x the bf16
    weights) nor the checkpoint's COMPLETE marker."""
    from dapo.checkpoint import COMPLETE_FILE

    return sorted(p for p in Path(checkpoint_dir).iterdir() if p.is_file() and p.name != COMPLETE_FILE)


@dataclass
class RunTarget:
    """The MLflow run a pipeline logs to: the server, the experiment, the run's key (its
    `dapo.run_key` tag, found again by a resumed or extended execution) and the name a new
    run gets. Passed from task to task as a typed input."""

    tracking_uri: str
    experiment: str
    run_key: str
    run_name: str


@dataclass
class LoopState:
    """What the training loop carries from step to step besides the checkpoint, as a typed
    input and output of the tasks (the console shows its fields): a fixed size, whatever
    the number of steps.

    bad_steps: consecutive non-finite updates; outbox: URI of a JSON-lines file of the
    tracking records MLflow has not accepted yet ("" = none); the best and the last
    validation accuracy so far and their steps (-1 = none yet).
    """

    bad_steps: int = 0
    outbox: str = ""
    best_val_acc: float = 0.0
    best_val_step: int = -1
    last_val_acc: float = 0.0
    last_val_step: int = -1

    def record_validation(self, step: int, val_acc: float) -> None:
        self.last_val_acc, self.last_val_step = val_acc, step
        if self.best_val_step < 0 or val_acc > self.best_val_acc:
            self.best_val_acc, self.best_val_step = val_acc, step


class Tracker:
    """A thin MlflowClient wrapper bound to one run, created lazily on first success."""

    def __init__(self, target: RunTarget, materialize: Callable[[str], str] | None = None):
        from mlflow.tracking import MlflowClient

        self.target = target
        self.materialize = materialize
        self.client = MlflowClient(tracking_uri=target.tracking_uri, registry_uri=target.tracking_uri)
        self._run_id: str | None = None
        self._logged_steps: dict[str, set[int]] = {}

    @property
    def run_id(self) -> str:
        if self._run_id is None:
            self._run_id = self._find_or_create_run()
        return self._run_id

    def find_run(self, experiment_id: str | None = None):
        """The run of this target's key, or None."""
        if experiment_id is None:
            experiment = self.client.get_experiment_by_name(self.target.experiment)
            if experiment is None:
                return None
            experiment_id = experiment.experiment_id
        runs = self.client.search_runs(
            [experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{self.target.run_key}'", max_results=1
        )
        return runs[0] if runs else None

    def _find_or_create_run(self) -> str:
        experiment = self.client.get_experiment_by_name(self.target.experiment)
        experiment_id = (
            experiment.experiment_id if experiment else self.client.create_experiment(self.target.experiment)
        )
        run = self.find_run(experiment_id)
        if run is None:
            run = self.client.create_run(
                experiment_id, run_name=self.target.run_name, tags={RUN_KEY_TAG: self.target.run_key}
            )
        elif run.info.status != "RUNNING":  # an ended run that an execution extends or resumes
            self.client.update_run(run.info.run_id, status="RUNNING")
        return run.info.run_id

    # --- one record ------------------------------------------------------------------
    def send(self, record: dict) -> None:
        kind = record["kind"]
        if kind == "params":
            from mlflow.entities import Param

            existing = self.client.get_run(self.run_id).data.params
            fresh = [Param(k, v[:6000]) for k, v in record["values"].items() if k not in existing]
            for start in range(0, len(fresh), 100):  # MLflow's batch limit
                self.client.log_batch(self.run_id, params=fresh[start : start + 100])
        elif kind == "metrics":
            from mlflow.entities import Metric

            if not record["values"] or self.is_logged(record):
                return
            stamp = int(record.get("time", time.time()) * 1000)
            metrics = [Metric(k, v, stamp, record["step"]) for k, v in record["values"].items()]
            self.client.log_batch(self.run_id, metrics=metrics)
            self._logged_steps[min(record["values"])].add(record["step"])
        elif kind == "table":
            self.client.log_table(self.run_id, data=_columns(record["rows"]), artifact_file=record["artifact_file"])
        elif kind == "artifact":
            self.client.log_artifact(self.run_id, record["local_path"], artifact_path=record["artifact_path"] or None)
        elif kind == "register":
            self.register(record)
        else:
            raise ValueError(f"unknown tracking record kind {kind!r}")

    def is_logged(self, record: dict) -> bool:
        """Whether the run already holds this metrics record's step: its first metric (in name
        order) has a value at that step. A step that comes back (a run extended or resumed, a
        retried task, a chunk's steps delivered again after it ends) has the values it was
        first logged with, so each step is logged once. Records logged at one step by
        different tasks (a step's metrics, its validation's) have different metric names."""
        key = min(record["values"])
        if key not in self._logged_steps:
            self._logged_steps[key] = {point.step for point in self.client.get_metric_history(self.run_id, key)}
        return record["step"] in self._logged_steps[key]

    def register(self, record: dict) -> str:
        """Log the checkpoint's servable files as run artifacts and register them; move the aliases.

        A copy, not a reference to the checkpoint in Flyte's store: Flyte's checkpoints
        hold the trainer state beside the weights, and its raw-output store is scratch
        space that a cluster expires (k8s/README.md), while a registered version must
        outlive the run."""
        from mlflow.exceptions import MlflowException

        if self.materialize is None:
            raise ValueError("a registration needs a task that can hold the weights (materialize)")
        name = record["model_name"]
        try:
            model = self.client.get_registered_model(name)
            if model.tags.get(MANAGED_TAG) != "true":
                raise RegistryNameClash(
                    f"registered model {name!r} exists and was not created by dapo-flyte; "
                    "choose another register_name (checkpoints are kept as run artifacts meanwhile)"
                )
        except MlflowException as error:
            if "RESOURCE_DOES_NOT_EXIST" not in str(error.error_code):
                raise
            self.client.create_registered_model(name, tags={MANAGED_TAG: "true"})
        artifact_path = f"checkpoints/step_{record['step']:06d}"
        for version in self.client.search_model_versions(f"name = '{name}'"):
            if version.run_id == self.run_id and version.tags.get("step") == str(record["step"]):
                return version.version  # already registered by an earlier, interrupted delivery
        with large_uploads():
            for path in servable_files(self.materialize(record["checkpoint_uri"])):
                self.client.log_artifact(self.run_id, str(path), artifact_path=artifact_path)
        source = f"{self.client.get_run(self.run_id).info.artifact_uri}/{artifact_path}"
        execution = record.get("execution", "?")
        description = f"step {record['step']} of Flyte execution {execution}; checkpoint {record['checkpoint_uri']}"
        version = self.client.create_model_version(
            name,
            source=source,
            run_id=self.run_id,
            description=description,
            tags={"step": str(record["step"]), "val_acc": f"{record['val_acc']:.6f}"},
        )
        self.client.set_registered_model_alias(name, NEWEST_ALIAS, version.version)
        self._update_champion(name)
        return version.version

    def _update_champion(self, name: str) -> None:
        versions = self.client.search_model_versions(f"name = '{name}'")
        scored = [v for v in versions if "val_acc" in v.tags]
        if scored:
            # Best accuracy; the later step wins a tie (it trained longer for the same score).
            best = max(scored, key=lambda v: (float(v.tags["val_acc"]), int(v.tags.get("step", 0))))
            self.client.set_registered_model_alias(name, CHAMPION_ALIAS, best.version)


# What Kubernetes and Flyte say when something outside the code stopped a pod: the OOM
# killer, SIGKILL/SIGTERM (exit codes 137/143), a preempted node ("Interrupted"), eviction,
# an expired task timeout, an abort.
KILLED_PATTERN = re.compile(
    r"OOMKilled|exit code \(?(137|143)\)?|SIGKILL|SIGTERM|\bInterrupted\b|preempt|\bevicted\b"
    r"|timeout.*expired|\baborted\b",
    re.IGNORECASE,
)


def ended_status(error_message: str) -> str:
    """MLflow's status for a run whose execution ended with this error: KILLED when the
    execution was stopped from outside (resuming it as it is may succeed), FAILED when
    the code or its input failed (something needs fixing first)."""
    return "KILLED" if KILLED_PATTERN.search(error_message) else "FAILED"


@fast_fail()
def end_run(target: RunTarget, status: str, tags: dict[str, str] | None = None) -> str:
    """Set the run's tags and end it with status (FINISHED, FAILED, KILLED); returns its
    id, or "" when there is no such run or MLflow cannot be reached (logged)."""
    try:
        tracker = Tracker(target)
        run = tracker.find_run()
        if run is None:
            return ""
        for key, value in (tags or {}).items():
            tracker.client.set_tag(run.info.run_id, key, value)
        tracker.client.set_terminated(run.info.run_id, status=status)
        return run.info.run_id
    except Exception as error:
        logger.warning("could not end the MLflow run at %s as %s: %s", target.tracking_uri, status, error)
        return ""


@fast_fail()
def alias_version(target: RunTarget, model_name: str, alias: str = CHAMPION_ALIAS) -> str:
    """The version of model_name that holds alias ("" if none or unreachable)."""
    try:
        return str(Tracker(target).client.get_model_version_by_alias(model_name, alias).version)
    except Exception as error:
        logger.warning("no %s version of %s at %s: %s", alias, model_name, target.tracking_uri, error)
        return ""


def run_history(tracking_uri: str, run_id: str) -> list[dict]:
    """A run's metrics as one dict per step, {"step": s, key: value, ...}, in step order:
    the learning curves, read back from MLflow instead of carried between tasks."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    by_step: dict[int, dict] = {}
    for key in client.get_run(run_id).data.metrics:
        for point in client.get_metric_history(run_id, key):  # the last value logged at a step wins
            by_step.setdefault(point.step, {"step": point.step})[key] = point.value
    return [by_step[step] for step in sorted(by_step)]


def _columns(rows: list[dict]) -> dict[str, list]:
    keys = list(dict.fromkeys(k for row in rows for k in row))
    return {k: [row.get(k) for row in rows] for k in keys}


def is_permanent(error: Exception) -> bool:
    """A refusal that retrying cannot fix (a name clash, an invalid value)."""
    from mlflow.exceptions import MlflowException

    if isinstance(error, (RegistryNameClash, ValueError)):
        return True
    return isinstance(error, MlflowException) and str(error.error_code) in PERMANENT_ERROR_CODES


@fast_fail()
def deliver(
    target: RunTarget,
    records: list[dict],
    materialize: Callable[[str], str] | None = None,
) -> list[dict]:
    """Send records in order; return those not sent, in their order.

    Order is kept so a later step's metrics never overtake an earlier one's. Registrations
    (whose checkpoints must be materialized: each a model version's weights) keep their own
    order but never hold up the rest: with no materialize (a task without disk for the
    weights) they are not attempted and are returned, and one that fails is returned while
    the records after it go on. A record the server refuses for good (a registry name
    clash, an invalid value) is logged as an error and dropped instead of blocking the
    queue forever; any other failure of a non-registration keeps it and everything after it.
    """
    if not records:
        return []
    left: list[dict] = []  # registrations only: any other record not sent ends the delivery
    try:
        tracker = Tracker(target, materialize)
        for index, record in enumerate(records):
            registering = record["kind"] == "register"
            if registering and (materialize is None or left):
                left.append(record)
                continue
            try:
                tracker.send(record)
            except Exception as error:  # any transport or server error: keep it for later
                if is_permanent(error):
                    logger.error("MLflow refused a %s record: %s", record["kind"], error)
                    continue
                logger.warning(
                    "MLflow at %s unavailable for a %s record (%s: %s); kept for a later delivery",
                    target.tracking_uri,
                    record["kind"],
                    type(error).__name__,
                    str(error)[:200],
                )
                if registering:
                    left.append(record)
                    continue
                return left + records[index:]
    except Exception as error:
        logger.warning(
            "MLflow at %s unavailable (%s); %d record(s) kept for a later delivery",
            target.tracking_uri,
            error,
            len(records),
        )
        return list(records)
    return left


def spill(records: list[dict], path: str | Path) -> None:
    """Write undelivered records to a JSON-lines file (the last resort at the end of a run)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
