"""Logging: importing our modules configures nothing; a task's start does, quiet by default."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LEVEL_VARIABLES = ("DAPO_LOG_LEVEL", "VLLM_LOGGING_LEVEL", "MLFLOW_LOGGING_LEVEL")


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
        import dapo.rollout.vllm_engine, dapo.tracking, workflows.ablation, workflows.dapo
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
    assert "vllm WARNING mlflow WARNING" in result.stdout


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
