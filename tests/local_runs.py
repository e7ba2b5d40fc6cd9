"""`pyflyte run workflows/dapo.py dapo_loop` locally, in a home of its own (Flyte cache,
MLflow database), on the hf rollout engine and the torch trainer (the step logic is the
same as on vLLM and DeepSpeed, test_workflow_local runs those) to fit CI's 2 cores."""

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from machine_caches import machine_caches

REPO = Path(__file__).resolve().parent.parent
PYFLYTE = Path(sys.executable).parent / "pyflyte"
LOCAL_CACHE = ".flyte/local-cache"
SETUP_TASKS = ("tasks.data.prepare_data-", "tasks.data.bootstrap_policy-")  # the cached tasks before step 0
SMALL = {
    "embedded_layout_noise": 0.6, "embedded_warm_start_steps": 120, "rollout_backend": "hf", "trainer_backend": "torch", "train_prompt_bsz": 2,
    "gen_prompt_bsz": 8, "ppo_mini_batch_size": 2, "max_num_gen_batches": 3, "val_every": 0, "val_n_samples": 2,
    "val_max_prompts": 8,
}


def dapo_loop(home: Path, total_steps: int, crash_at: str = "", args: tuple[str, ...] = (), **overrides) -> subprocess.CompletedProcess:
    """pyflyte run workflows/dapo.py dapo_loop --total_steps N [args], its Flyte cache, MLflow
    database and colocated records under home; it must end as asked: SIGKILLed at
    crash_at, else exit 0."""
    env = {**os.environ, "HOME": str(home), **machine_caches(), "MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow.db'}",
           "PYTHONUNBUFFERED": "1", "FLYTE_SDK_RICH_TRACEBACKS": "0"}
    env.pop("DAPO_CRASH_AT", None)
    if crash_at:
        env["DAPO_CRASH_AT"] = crash_at
    command = [str(PYFLYTE), "run", "workflows/dapo.py", "dapo_loop", "--total_steps", str(total_steps),
               "--overrides_json", json.dumps({**SMALL, **overrides}), *args]
    run = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900, start_new_session=True)
    if run.returncode != (-signal.SIGKILL if crash_at else 0):
        pytest.fail(f"total_steps={total_steps} {overrides} crash_at={crash_at!r}: exit {run.returncode}\n"
                    f"{run.stdout[-6000:]}\n{run.stderr[-6000:]}")
    return run


def trained_steps(run: subprocess.CompletedProcess) -> list[int]:
    """The steps a run computed: its step lines without a validation accuracy (a validation's line has one)."""
    lines = [line for line in run.stdout.splitlines() if line.startswith("step ") and "val_acc - " in line]
    return [int(line.split("|")[0].split()[1]) for line in lines]


def mlflow_client(home: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(f"sqlite:///{home / 'mlflow.db'}")


def logged_steps(home: Path, key: str = "sampling/rounds") -> list[int]:
    """The steps of the home's one MLflow run that hold `key`, a step as often as it was logged."""
    client = mlflow_client(home)
    (run,) = client.search_runs([client.get_experiment_by_name("dapo").experiment_id])
    return sorted(point.step for point in client.get_metric_history(run.info.run_id, key))


def final_weights(home: Path, step: int) -> str:
    """sha256 of model.safetensors of the version registered at step (the run's last)."""
    (version,) = [v for v in mlflow_client(home).search_model_versions("name = 'dapo-policy'") if v.tags["step"] == str(step)]
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{home / 'mlflow.db'}")
    local = mlflow.artifacts.download_artifacts(version.source)
    return hashlib.sha256(Path(local, "model.safetensors").read_bytes()).hexdigest()


def new_home(tmp_path_factory, setup_from: Path | None = None) -> Path:
    """A fresh Flyte cache and MLflow database; setup_from: a home whose config, data and
    starting policy (the tasks before step 0) the new cache starts with."""
    home = tmp_path_factory.mktemp("home")
    mlflow_client(home).create_experiment("dapo", artifact_location=str(home / "mlruns"))
    if setup_from:
        from diskcache import Cache

        with Cache(str(setup_from / LOCAL_CACHE)) as source, Cache(str(home / LOCAL_CACHE)) as target:
            for key in source.iterkeys():
                if key.startswith(SETUP_TASKS):
                    target[key] = source[key]
    return home


def logged_values(home: Path, key: str) -> list[float]:
    client = mlflow_client(home)
    (run,) = client.search_runs([client.get_experiment_by_name("dapo").experiment_id])
    return [point.value for point in client.get_metric_history(run.info.run_id, key)]
