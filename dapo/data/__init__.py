"""Prompt data: verl-format parquet files and the embedded arithmetic tasks (prompts), and
reasoning-gym's generated tasks (gym_tasks)."""

from dapo import moved
from dapo.data.prompts import (
    CHAIN_LEVELS,
    NORMALIZED_SCHEMA,
    DataError,
    LoadReport,
    PromptRecord,
    load_prompts,
    make_arithmetic_table,
    render_prompt,
    system_prompt_tokens,
    write_embedded_splits,
)

__all__ = [
    "CHAIN_LEVELS",
    "NORMALIZED_SCHEMA",
    "DataError",
    "LoadReport",
    "PromptRecord",
    "load_prompts",
    "make_arithmetic_table",
    "render_prompt",
    "system_prompt_tokens",
    "write_embedded_splits",
]

__getattr__ = moved.moved_names(__name__)  # names that moved from here, for one release
