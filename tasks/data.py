"""Config, data and the starting policy."""

from __future__ import annotations

import dataclasses
import json
import os
import typing

from flytekit import FlyteContextManager, Resources, task
from flytekit.types.directory import FlyteDirectory

from dapo.config import (
    ConfigError,
    DAPOConfig,
    DataConfig,
    ModelConfig,
    StepConfig,
    flat_overrides,
    parse_assignments,
    read_config_file,
)
from dapo.data.prompts import DataError
from dapo.execution.stages import setup
from dapo.model.model_source import is_gguf_source
from dapo.resolve import resolve_run
from images.specs import CPU_IMAGE, TRAINER_IMAGE
from tasks.common import Checkpoint, cache, directory_output, scratch_dir, task_entry

PRESETS_WITHOUT_DEFAULT_DATA = ("paper_32b", "node_7b", "one_gpu_1p5b")
"""Presets whose model is not meant for the embedded arithmetic task."""


class ResolvedConfig(typing.NamedTuple):
    config: DAPOConfig
    step_config: StepConfig
    data_config: DataConfig
    model_config: ModelConfig


def resolve(
    preset: str,
    overrides_json: str = "",
    total_steps: int = 0,
    train_data: str = "",
    val_data: str = "",
    steps_per_chunk: int = 0,
    config_file: str = "",
    set: str = "",
) -> DAPOConfig:
    """The run's validated config: a preset, then a YAML config file, the JSON overrides,
    the dotted assignments of `set`, and the explicit inputs (0 or "" keeps what is there),
    with the digest of the user's functions it names (plugins.user_code_digest)."""
    overrides = read_config_file(local_copy(config_file)) if config_file else {}
    from_json = json.loads(overrides_json) if overrides_json else {}
    if not isinstance(from_json, dict):
        raise ValueError(f"overrides_json must be a JSON object, got {overrides_json!r}")
    overrides = {**flat_overrides(overrides), **flat_overrides(from_json), **flat_overrides(parse_assignments(set))}
    explicit = {
        "total_steps": total_steps,
        "train_data_path": train_data,
        "val_data_path": val_data,
        "steps_per_chunk": steps_per_chunk,
    }
    overrides.update({name: value for name, value in explicit.items() if value})
    config = DAPOConfig.preset(preset, overrides)
    if preset in PRESETS_WITHOUT_DEFAULT_DATA and not config.train_data_path:
        raise ConfigError(
            f"preset {preset!r} trains on DAPO-Math-17k: pass --train_data and --val_data "
            "(verl-format parquet files, as URIs the cluster can read, e.g. s3://bucket/dapo-math-17k.parquet)"
        )
    return resolve_run(config)


# Not cached: what it reads besides its inputs (a config file, the user's functions) may
# have changed since; it is one small pod, and its outputs key every other task's cache.
@task(container_image=CPU_IMAGE, requests=Resources(cpu="1", mem="1Gi"))
@task_entry
def resolve_config(
    preset: str,
    overrides_json: str,
    total_steps: int,
    train_data: str,
    val_data: str,
    steps_per_chunk: int,
    config_file: str = "",
    set: str = "",
) -> ResolvedConfig:
    """The run's validated config (resolve), and the sections tasks are cached on, each
    what its outputs depend on: the step config for the step tasks, the data and model
    sections for prepare_data and bootstrap_policy (shared by runs that differ elsewhere).
    Invalid values, and timeouts that cannot cover their tasks' work (dapo.cluster.run_budget),
    fail here, before any other work."""
    config = resolve(preset, overrides_json, total_steps, train_data, val_data, steps_per_chunk, config_file, set)
    return ResolvedConfig(config, config.step_config(), config.section("data"), config.section("model"))


class PreparedData(typing.NamedTuple):
    data: FlyteDirectory
    stats: dict[str, float]


@task(
    cache=cache(__name__), container_image=CPU_IMAGE, requests=Resources(cpu="2", mem="8Gi", ephemeral_storage="20Gi")
)
@task_entry
def prepare_data(config: DataConfig) -> PreparedData:
    """Validated, de-duplicated train and validation parquet files.

    Cached on the data section only, so runs that differ in anything else (an
    ablation, another clip range) share one copy of the data.
    """
    out_dir = scratch_dir("data")
    config = dataclasses.replace(
        config, train_data_path=local_copy(config.train_data_path), val_data_path=local_copy(config.val_data_path)
    )
    stats = setup.prepare_data(config, out_dir)
    return PreparedData(directory_output(out_dir), stats)


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


@task(cache=cache(__name__), container_image=TRAINER_IMAGE, requests=Resources(cpu="4", mem="16Gi"))
@task_entry
def bootstrap_policy(config: ModelConfig, embedded_task: str) -> Checkpoint:
    """The step-0 checkpoint: the embedded tiny policy (warm-started on embedded_task) or
    the configured model.

    Cached on the model section and the embedded task only (shared across ablation variants).
    """
    from tqdm import tqdm

    out_dir = scratch_dir("policy-0")
    with tqdm(desc="warm start", unit="step", leave=False) as bar:

        def progress(step: int, total: int, loss: float) -> None:
            bar.total = total
            bar.update(step - bar.n)
            bar.set_postfix(loss=f"{loss:.3f}")

        directory = not is_gguf_source(config.model_path)  # a GGUF source is one file
        model = dataclasses.replace(config, model_path=local_copy(config.model_path, directory=directory))
        setup.bootstrap_policy(model, embedded_task, out_dir, progress=progress)
    return directory_output(out_dir)
