"""Logging of a process that runs DAPO: quiet by default, DAPO_LOG_LEVEL for more.

Configured where a process starts to run our code (a task's body: tasks.common.task_entry),
never when a module is imported, so importing dapo, the tasks or the workflows leaves the
importer's logging alone.
"""

from __future__ import annotations

import logging
import os

LOG_LEVEL_ENV = "DAPO_LOG_LEVEL"
DEFAULT_LEVEL = "WARNING"
"""The step lines are printed and progress bars drawn whatever the level; at WARNING the
log shows only what may need action, not vLLM's hundreds of INFO lines a run."""
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LIBRARY_LEVEL_ENV = ("VLLM_LOGGING_LEVEL", "MLFLOW_LOGGING_LEVEL")
"""vLLM and MLflow set up their own loggers (which do not propagate) from these, once, at
import; vLLM's worker processes inherit them."""


def configure_logging() -> None:
    """Our loggers and every library logger that propagates at DAPO_LOG_LEVEL (default
    WARNING; INFO brings back what the libraries report), unless the root logger was
    configured already (pytest, an embedding program); vLLM and MLflow at the same level
    unless their own variables are set. Idempotent."""
    level = os.environ.get(LOG_LEVEL_ENV, "").strip().upper() or DEFAULT_LEVEL
    logging.basicConfig(level=level, format=FORMAT)
    for name in LIBRARY_LEVEL_ENV:
        os.environ.setdefault(name, level)
