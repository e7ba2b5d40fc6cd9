"""The data and the starting policy: cached on the data and model sections alone."""

from __future__ import annotations

import dataclasses
import os
import typing

from flytekit import FlyteContextManager, Resources, task
from flytekit.types.directory import FlyteDirectory

from dapo.config import DataConfig, ModelConfig
from dapo.data.prompts import DataError
from dapo.execution.stages import setup
from dapo.model.model_source import is_gguf_source
from images.specs import CPU_IMAGE, TRAINER_IMAGE
from tasks.common import Checkpoint, cache, directory_output, scratch_dir, task_entry


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
