"""Logging of a process that runs DAPO: quiet by default, DAPO_LOG_LEVEL for more.

Configured where a process starts to run our code (a task's body: tasks.common.task_entry),
never when a module is imported, so importing dapo leaves the importer's logging alone. The
one exception is torch's C++ log level, which torch reads once, when it is imported: the
job's entry packages (tasks, workflows) default it before anything imports torch.

Quiet (DAPO_LOG_LEVEL unset): our loggers at WARNING; the libraries (vLLM, MLflow,
DeepSpeed, transformers, torch's C++ side, Python warnings raised in library code) at
ERROR: what they report at engine start and import (vLLM's CPU-build advice, deprecations,
NUMA binding) is nothing a user acts on. DAPO_LOG_LEVEL=WARNING (or INFO, DEBUG) puts
everything at that level.
"""

from __future__ import annotations

import logging
import os
import warnings

LOG_LEVEL_ENV = "DAPO_LOG_LEVEL"
DEFAULT_LEVEL = "WARNING"
"""Our loggers' level: the step lines are printed and progress bars drawn whatever the
level; at WARNING the log shows only what may need action."""
QUIET_LIBRARY_LEVEL = "ERROR"
"""The libraries' level unless DAPO_LOG_LEVEL is set."""
OUR_PACKAGES = ("dapo", "tasks", "workflows")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LIBRARY_LEVEL_ENV = ("VLLM_LOGGING_LEVEL", "MLFLOW_LOGGING_LEVEL")
"""vLLM and MLflow set up their own loggers (which do not propagate) from these, once, at
import; vLLM's worker processes inherit them."""
TORCH_CPP_LEVEL_ENV = "TORCH_CPP_LOG_LEVEL"
QUIET_LIBRARY_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    # transformers' "Loading weights" and "Writing model shards" bars, at every load and save
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}
"""Read by the libraries at import, which happens after a task starts."""


def requested_level() -> str:
    """DAPO_LOG_LEVEL, upper-cased; "" when unset (quiet)."""
    return os.environ.get(LOG_LEVEL_ENV, "").strip().upper()


def quiet_native_logs() -> None:
    """torch's C++ warnings (vLLM's NUMA-binding note at each CPU engine start) at ERROR
    unless DAPO_LOG_LEVEL or TORCH_CPP_LOG_LEVEL is set. Effective only before torch is
    imported: called first thing by the tasks and workflows packages."""
    if not requested_level():
        os.environ.setdefault(TORCH_CPP_LEVEL_ENV, QUIET_LIBRARY_LEVEL)


def configure_logging() -> None:
    """Our loggers at DAPO_LOG_LEVEL (default WARNING), the libraries at ERROR unless
    DAPO_LOG_LEVEL is set (then at that level), unless the root logger was configured already
    (pytest, an embedding program); vLLM and MLflow the same unless their own variables are
    set. Idempotent."""
    requested = requested_level()
    library_level = requested or QUIET_LIBRARY_LEVEL
    for name in LIBRARY_LEVEL_ENV:
        os.environ.setdefault(name, library_level)
    if logging.getLogger().handlers:
        return
    logging.basicConfig(level=library_level, format=FORMAT)
    for package in OUR_PACKAGES:
        logging.getLogger(package).setLevel(requested or DEFAULT_LEVEL)
    if not requested:
        # Library code's Python warnings (FutureWarning from vLLM's Triton dispatcher, ...);
        # ours still show. `module` is matched against the warning's module name.
        warnings.filterwarnings("ignore", module=rf"(?!({'|'.join(OUR_PACKAGES)})(\.|$))")
        for name, value in QUIET_LIBRARY_ENV.items():
            os.environ.setdefault(name, value)
