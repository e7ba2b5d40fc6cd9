"""The run's config, resolved before any other work (not cached)."""

from __future__ import annotations

import json
import typing

from flytekit import Resources, task

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
from dapo.resolve import resolve_run
from images.specs import CPU_IMAGE
from tasks.common import task_entry
from tasks.data import local_copy

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
