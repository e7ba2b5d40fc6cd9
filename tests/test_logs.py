"""Logging: importing our modules configures nothing; a task's start does, quiet by default."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LEVEL_VARIABLES = ("DAPO_LOG_LEVEL", "VLLM_LOGGING_LEVEL", "MLFLOW_LOGGING_LEVEL", "TORCH_CPP_LOG_LEVEL",
                   "TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS")


def run_python(code: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """code in a fresh interpreter (pytest has configured this one's root logger), with none of
    the level variables set but those given, and its own HOME (the Flyte local cache)."""
    clean = {k: v for k, v in os.environ.items() if k not in LEVEL_VARIABLES}
    clean.update(HOME=str(tmp_path), PYTHONPATH=str(REPO), **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=clean, capture_output=True, text=True,
                          timeout=300)


def test_imports_leave_logging_alone_and_a_task_configures_it_quiet_by_default(tmp_path):
    result = run_python(
        """
        import logging, os
        import dapo.engines.rollout.vllm_engine, dapo.tracking, workflows.ablation, workflows.dapo
        from tasks.tracking import end_failed_run

        root = logging.getLogger()
        assert not root.handlers and root.level == logging.WARNING, (root.handlers, root.level)
        assert not [k for k in os.environ if k.endswith("LOGGING_LEVEL")]
        end_failed_run(preset="no-such-preset", overrides_json="", total_steps=1, train_data="", val_data="",
                       mlflow_tracking_uri="", mlflow_experiment="e", model_name="m", steps_per_chunk=1)
        logging.getLogger("dapo.anything").info("an info line")
        print("vllm", os.environ["VLLM_LOGGING_LEVEL"], "mlflow", os.environ["MLFLOW_LOGGING_LEVEL"])
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    # The failure handler's warning, in the format of our log lines; no INFO lines.
    assert " WARNING tasks.tracking: dapo_loop failed before its MLflow run started" in result.stderr
    assert "an info line" not in result.stderr
    assert "vllm ERROR mlflow ERROR" in result.stdout


QUIET_PROBE = """
import logging, os, sys, warnings
import workflows.dapo  # the job's entry: pyflyte imports it first
from dapo.logs import configure_logging

print("torch C++ level", os.environ.get("TORCH_CPP_LOG_LEVEL"), "torch imported", "torch" in sys.modules)
configure_logging()
logging.getLogger("some_library.module").warning("a library warning")
logging.getLogger("dapo.execution.stages.training").warning("our warning")
exec(compile("import warnings; warnings.warn('a library deprecation', FutureWarning)", "lib.py", "exec"), {"__name__": "some_library"})
exec(compile("import warnings; warnings.warn('our deprecation', FutureWarning)", "ours.py", "exec"), {"__name__": "dapo.config"})
import torch, vllm._C  # vLLM's CPU worker calls this at every engine start; its C++ warning goes to stderr
torch.ops._C.init_cpu_memory_env([0])
"""


def test_library_warnings_are_quiet_by_default_and_ours_are_not(tmp_path):
    quiet = run_python(QUIET_PROBE, tmp_path)
    assert quiet.returncode == 0, quiet.stderr
    assert "torch C++ level ERROR torch imported True" in quiet.stdout  # set before the workflow imported torch
    assert "our warning" in quiet.stderr and "our deprecation" in quiet.stderr
    for library_line in ("a library warning", "a library deprecation", "NUMA binding"):
        assert library_line not in quiet.stderr
    loud = run_python(QUIET_PROBE, tmp_path, DAPO_LOG_LEVEL="warning")
    assert loud.returncode == 0, loud.stderr
    for line in ("our warning", "our deprecation", "a library warning", "a library deprecation", "NUMA binding"):
        assert line in loud.stderr


def test_dapo_log_level_brings_the_info_lines_back_and_the_users_library_levels_win(tmp_path):
    result = run_python(
        """
        import logging, os
        from dapo.logs import configure_logging

        configure_logging()
        logging.getLogger("dapo.anything").info("an info line")
        print("vllm", os.environ["VLLM_LOGGING_LEVEL"], "mlflow", os.environ["MLFLOW_LOGGING_LEVEL"])
        """,
        tmp_path,
        DAPO_LOG_LEVEL="info",
        VLLM_LOGGING_LEVEL="DEBUG",
    )
    assert result.returncode == 0, result.stderr
    assert " INFO dapo.anything: an info line" in result.stderr
    assert "vllm DEBUG mlflow INFO" in result.stdout
