"""The run's inputs: the prompt data, validated and de-duplicated, and the starting policy."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dapo import checkpoint
from dapo.config import DataConfig, ModelConfig
from dapo.data import NORMALIZED_SCHEMA, PromptRecord, load_prompts, write_embedded_splits

TRAIN_FILE, VAL_FILE = "train.parquet", "val.parquet"
EMBEDDED_SEED = 0
"""The embedded task and starting policy are fixed; config.seed varies the RL run only
(sampling, prompt choice, shuffling), so runs with several seeds share one start."""


def prepare_data(config: DataConfig, out_dir: str | Path) -> dict[str, float]:
    """Write validated, de-duplicated train/val parquet files into out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not config.train_data_path:
        write_embedded_splits(out_dir, seed=EMBEDDED_SEED, task=config.embedded_task)
        sources = {TRAIN_FILE: out_dir / TRAIN_FILE, VAL_FILE: out_dir / VAL_FILE}
    else:
        if not config.val_data_path:
            raise ValueError("val_data_path is required when train_data_path is set")
        sources = {TRAIN_FILE: Path(config.train_data_path), VAL_FILE: Path(config.val_data_path)}
    stats: dict[str, float] = {}
    for name, source in sources.items():
        records, report = load_prompts(source, on_bad_row=config.on_bad_row)
        write_records(records, out_dir / name)
        split = name.split(".")[0]
        counts = {"rows": report.rows_read, "kept": report.kept, "duplicates": report.duplicates_dropped, "bad_rows": report.bad_rows_skipped}
        stats.update({f"data/{split}_{name}": float(value) for name, value in counts.items()})
    return stats


def write_records(records: list[PromptRecord], path: Path) -> None:
    """Normalised records back to verl format (so later tasks read one clean schema)."""
    rows = [
        {
            "data_source": r.data_source,
            "prompt": r.chat,
            "ability": "MATH",
            "reward_model": {"ground_truth": r.ground_truth, "style": "rule"},
            "extra_info": {"index": int(r.uid) if r.uid.isdigit() else i},
            "extra_info_json": r.extra_info,
        }
        for i, r in enumerate(records)
    ]
    pq.write_table(pa.Table.from_pylist(rows, schema=NORMALIZED_SCHEMA), path)


def bootstrap_policy(config: ModelConfig, embedded_task: str, out_dir: str | Path, progress=None) -> dict[str, float]:
    """The step-0 checkpoint, written atomically: the embedded tiny policy (warm-started on
    embedded_task), or config.model_path."""
    stats: dict[str, float] = {}
    with checkpoint.atomic_dir(out_dir, step=0) as scratch:
        if not config.model_path:
            from dapo.policy import TinyPolicySpec, build_tiny_policy

            spec = TinyPolicySpec.for_task(embedded_task, config.embedded_warm_start_steps,
                                           config.embedded_layout_noise, seed=EMBEDDED_SEED)
            stats = build_tiny_policy(scratch, spec, progress=progress)
        elif Path(config.model_path).is_dir():
            shutil.copytree(config.model_path, scratch, dirs_exist_ok=True)
        else:  # a hub name: the cluster images can reach the hub, this machine cannot
            from huggingface_hub import snapshot_download

            try:
                snapshot_download(config.model_path, local_dir=scratch)
            except Exception as error:
                raise RuntimeError(f"model_path={config.model_path!r} is neither a local directory nor downloadable: {error}") from error
        if not (Path(scratch) / "config.json").exists():
            raise FileNotFoundError(f"model_path={config.model_path!r}: no config.json in the checkpoint")
    return stats
