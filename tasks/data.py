"""Config, data and the starting policy."""

from __future__ import annotations

import json
import os
import typing

from flytekit import FlyteContextManager, Resources, task
from flytekit.types.directory import FlyteDirectory

from dapo import pipeline
from dapo.config import ConfigError, DAPOConfig
from dapo.data import DataError
from images.specs import CPU_IMAGE, TRAINER_IMAGE
from tasks.common import Checkpoint, cache, directory_output, scratch_dir, task_entry


DATA_FIELDS = ("train_data_path", "val_data_path", "on_bad_row", "embedded_task")
PRESETS_WITHOUT_DEFAULT_DATA = ("paper_32b",)
"""Presets whose model is not meant for the embedded arithmetic task."""
POLICY_FIELDS = ("model_path", "embedded_warm_start_steps", "embedded_layout_noise", "embedded_task")

ResolvedConfig = typing.NamedTuple(
    "ResolvedConfig", [("config", DAPOConfig), ("step_config", DAPOConfig), ("data_config", DAPOConfig), ("policy_config", DAPOConfig)]
)


def resolve(preset: str, overrides_json: str, total_steps: int, train_data: str, val_data: str, steps_per_chunk: int = 0) -> DAPOConfig:
    """The run's validated config: a preset, then overrides, then the explicit inputs (0 or
    "" keeps the preset's)."""
    overrides = json.loads(overrides_json) if overrides_json else {}
    if not isinstance(overrides, dict):
        raise ValueError(f"overrides_json must be a JSON object, got {overrides_json!r}")
    if total_steps:
        overrides["total_steps"] = total_steps
    if train_data:
        overrides["train_data_path"] = train_data
    if val_data:
        overrides["val_data_path"] = val_data
    if steps_per_chunk:
        overrides["steps_per_chunk"] = steps_per_chunk
    config = DAPOConfig.preset(preset, overrides)
    if preset in PRESETS_WITHOUT_DEFAULT_DATA and not config.train_data_path:
        raise ConfigError(
            f"preset {preset!r} trains on DAPO-Math-17k: pass --train_data and --val_data "
            "(verl-format parquet files, as URIs the cluster can read, e.g. s3://bucket/dapo-math-17k.parquet)"
        )
    return config


@task(cache=cache("resolve_config"), container_image=CPU_IMAGE, requests=Resources(cpu="1", mem="1Gi"))
@task_entry
def resolve_config(
    preset: str, overrides_json: str, total_steps: int, train_data: str, val_data: str, steps_per_chunk: int
) -> ResolvedConfig:
    """The run's validated config (resolve), and the configs tasks are cached on, each with
    only the fields its outputs depend on (DAPOConfig.only): the step config for the step
    tasks, the data and policy fields for prepare_data and bootstrap_policy (shared by
    runs that differ elsewhere). Invalid values, and timeouts that cannot cover their
    tasks' work (dapo.run_budget), fail here, before any other work."""
    config = resolve(preset, overrides_json, total_steps, train_data, val_data, steps_per_chunk)
    return ResolvedConfig(config, config.step_config(), config.only(DATA_FIELDS), config.only(POLICY_FIELDS))


@task(cache=cache("prepare_data"), container_image=CPU_IMAGE, requests=Resources(cpu="2", mem="8Gi", ephemeral_storage="20Gi"))
@task_entry
def prepare_data(config: DAPOConfig) -> typing.NamedTuple("PreparedData", [("data", FlyteDirectory), ("stats", dict[str, float])]):
    """Validated, de-duplicated train and validation parquet files.

    Cached on the data fields of the config only, so runs that differ in anything
    else (an ablation, another clip range) share one copy of the data.
    """
    out_dir = scratch_dir("data")
    config = config.replace(train_data_path=local_copy(config.train_data_path), val_data_path=local_copy(config.val_data_path))
    stats = pipeline.prepare_data(config, out_dir)
    return directory_output(out_dir), stats


def local_copy(path: str, directory: bool = False) -> str:
    """A local file (or directory) for a path or URI: s3://, gs://, abfs://... are fetched
    with flytekit's data layer (the object-store settings and credentials of the cluster);
    local paths, hub names and "" (the embedded default) are returned as they are."""
    file_access = FlyteContextManager.current_context().file_access
    if not path or not file_access.is_remote(path):
        return path
    target = os.path.join(scratch_dir("download"), os.path.basename(path.rstrip("/")) or "data.parquet")
    try:
        file_access.get_data(path, target, is_multipart=directory)
    except Exception as error:
        raise DataError(f"cannot read {path}: {error}") from error
    return target


@task(cache=cache("bootstrap_policy"), container_image=TRAINER_IMAGE, requests=Resources(cpu="4", mem="16Gi"))
@task_entry
def bootstrap_policy(config: DAPOConfig) -> Checkpoint:
    """The step-0 checkpoint: the embedded tiny policy (warm-started) or the configured model.

    Cached on the policy fields of the config only (shared across ablation variants).
    """
    from tqdm import tqdm

    out_dir = scratch_dir("policy-0")
    with tqdm(desc="warm start", unit="step", leave=False) as bar:
        def progress(step: int, total: int, loss: float) -> None:
            bar.total = total
            bar.update(step - bar.n)
            bar.set_postfix(loss=f"{loss:.3f}")

        pipeline.bootstrap_policy(config.replace(model_path=local_copy(config.model_path, directory=True)), out_dir, progress=progress)
    return directory_output(out_dir)
