"""The run's inputs: the prompt data, validated and de-duplicated, and the starting policy."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dapo import checkpoint, moved
from dapo.config import ConfigError, DataConfig, ModelConfig
from dapo.data.gym_tasks import DATA_SOURCE as GYM_DATA_SOURCE
from dapo.data.gym_tasks import DEFAULT_VAL_SIZE, VAL_SEED_OFFSET, GymRow, generate_rows, is_gym_spec, parse_spec
from dapo.data.prompts import NORMALIZED_SCHEMA, PromptRecord, load_prompts, write_embedded_splits
from dapo.model.model_source import (
    convert_gguf,
    is_gguf_source,
    locate_gguf,
)

logger = logging.getLogger(__name__)

TRAIN_FILE, VAL_FILE = "train.parquet", "val.parquet"
EMBEDDED_SEED = 0
"""The embedded task and starting policy are fixed; config.seed varies the RL run only
(sampling, prompt choice, shuffling), so runs with several seeds share one start."""


def prepare_data(config: DataConfig, out_dir: str | Path) -> dict[str, float]:
    """Write validated, de-duplicated train/val parquet files into out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if is_gym_spec(config.train_data_path):
        return prepare_gym_data(config, out_dir)
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
        counts = {
            "rows": report.rows_read,
            "kept": report.kept,
            "duplicates": report.duplicates_dropped,
            "bad_rows": report.bad_rows_skipped,
        }
        stats.update({f"data/{split}_{name}": float(value) for name, value in counts.items()})
    return stats


def prepare_gym_data(config: DataConfig, out_dir: Path) -> dict[str, float]:
    """reasoning-gym rows (dapo.data.gym_tasks) as train and validation files: each question in
    config.question_template. Validation from val_data_path's spec, else from another seed of
    the training spec; either way without a question that training has."""
    train_spec = parse_spec(config.train_data_path)
    if is_gym_spec(config.val_data_path):
        val_spec = parse_spec(config.val_data_path)
    elif config.val_data_path:
        raise ValueError(
            f"data.val_data_path={config.val_data_path!r}: with reasoning_gym: training data, give a "
            "reasoning_gym: spec (or nothing: another seed of the training spec)"
        )
    else:
        val_spec = train_spec.with_seed(train_spec.seed + VAL_SEED_OFFSET, DEFAULT_VAL_SIZE)
    train_rows, val_rows = _unique(generate_rows(train_spec)), _unique(generate_rows(val_spec))
    train_questions = {row.question for row in train_rows}
    held_out = [row for row in val_rows if row.question not in train_questions]
    overlap = len(train_questions & {row.question for row in held_out})
    print(
        f"reasoning-gym: {len(train_rows)} training and {len(val_rows)} validation questions; "
        f"{len(val_rows) - len(held_out)} validation questions also in training dropped; overlap now {overlap}",
        flush=True,
    )
    if not held_out:
        raise ValueError(f"data.val_data_path: every validation question of {val_spec} is also a training question")
    stats: dict[str, float] = {}
    for name, rows, spec_size in ((TRAIN_FILE, train_rows, train_spec.size), (VAL_FILE, held_out, len(val_rows))):
        records = [
            PromptRecord(
                uid=str(i),
                messages=(("user", config.question_template.format(problem=row.question)),),
                ground_truth=row.answer,
                data_source=GYM_DATA_SOURCE,
                extra_info=json.dumps(row.source, sort_keys=True),
            )
            for i, row in enumerate(rows)
        ]
        write_records(records, out_dir / name)
        split = name.split(".")[0]
        stats.update({f"data/{split}_rows": float(spec_size), f"data/{split}_kept": float(len(records))})
    stats["data/val_dropped_as_in_train"] = float(len(val_rows) - len(held_out))
    return stats


def _unique(rows: list[GymRow]) -> list[GymRow]:
    """The first row of each question (small generators repeat questions)."""
    first: dict[str, GymRow] = {}
    for row in rows:
        first.setdefault(row.question, row)
    return list(first.values())


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
            from dapo.model.policy import TinyPolicySpec, build_tiny_policy

            spec = TinyPolicySpec.for_task(
                embedded_task, config.embedded_warm_start_steps, config.embedded_layout_noise, seed=EMBEDDED_SEED
            )
            stats = build_tiny_policy(scratch, spec, progress=progress)
        elif is_gguf_source(config.model_path):
            stats = convert_gguf(locate_gguf(config.model_path), scratch)
        elif Path(config.model_path).is_dir():
            shutil.copytree(config.model_path, scratch, dirs_exist_ok=True)
        else:  # a hub name, at the commit resolve_config pinned: from the hub, or the Hugging Face cache offline
            from huggingface_hub import snapshot_download

            try:
                snapshot = snapshot_download(config.model_path, revision=config.model_revision or None)
            except Exception as error:
                raise RuntimeError(
                    f"model_path={config.model_path!r} is neither a local directory nor downloadable: {error}"
                ) from error
            shutil.copytree(
                snapshot, scratch, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".*")
            )  # the files, not the cache's links
        if not (Path(scratch) / "config.json").exists():
            raise FileNotFoundError(f"model_path={config.model_path!r}: no config.json in the checkpoint")
        with_chat_template(scratch, config)
    return stats


def with_chat_template(checkpoint_dir: str | Path, config: ModelConfig) -> None:
    """config.chat_template written into the checkpoint's tokenizer, if given; a tokenizer
    left without a template is refused: prompts are rendered with it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)
    if config.chat_template:
        tokenizer.chat_template = config.chat_template
        tokenizer.save_pretrained(checkpoint_dir)
    elif not tokenizer.chat_template:
        raise ConfigError(
            f"model.model_path={config.model_path!r}: its tokenizer has no chat template, and prompts are rendered "
            "with one: set model.chat_template (a Jinja template; e.g. "
            "\"{% for m in messages %}{{ m['content'] }}\\n{% endfor %}\" for plain prompts)"
        )


__getattr__ = moved.moved_names(__name__)  # names that moved from here, for one release
