"""`pyflyte run workflows/dapo.py dapo_loop` for real, locally: a run, the run extended by a
step (the rest replayed from the cache), and runs killed (SIGKILL) mid-update and
mid-checkpoint that resume (mid-rollout, with the data in S3: test_s3_run)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PYFLYTE = Path(sys.executable).parent / "pyflyte"
# Small enough for a 2-core CI machine: a short warm start, few prompts, 2 steps.
SMALL = {
    "embedded_warm_start_steps": 120, "train_prompt_bsz": 4, "gen_prompt_bsz": 8, "ppo_mini_batch_size": 2,
    "max_num_gen_batches": 2, "val_every": 1, "val_n_samples": 2, "val_max_prompts": 16,
}

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.deepspeed]


def pyflyte_run(
    home: Path, *args: str, crash_at: str = "", seed: int = 0, timeout: int = 900, run_options: tuple[str, ...] = (), env: dict | None = None
) -> subprocess.CompletedProcess:
    """pyflyte run [run_options] workflows/dapo.py dapo_loop [args], its Flyte cache and MLflow under home."""
    env = {
        **os.environ,
        **(env or {}),
        "HOME": str(home),  # flytekit's local cache lives under ~/.flyte: one per test
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions")),
        "MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow.db'}",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("DAPO_CRASH_AT", None)
    if crash_at:
        env["DAPO_CRASH_AT"] = crash_at
    overrides = json.dumps({**SMALL, "seed": seed})
    command = [str(PYFLYTE), "run", *run_options, "workflows/dapo.py", "dapo_loop", "--overrides_json", overrides, *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, start_new_session=True)


def step_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("step ")]


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """One local Flyte cache for the module: data and the starting policy are built once."""
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def first_run(home):
    result = pyflyte_run(home, "--total_steps", "2", "--model_name", "e2e-policy")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def test_local_run_completes_logs_steps_and_registers(first_run, home):
    result = first_run
    lines = step_lines(result.stdout)
    assert any(line.startswith("step    0 |") for line in lines)  # validation of the starting policy
    assert any(line.startswith("step    2 |") for line in lines)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}", registry_uri=f"sqlite:///{home / 'mlflow.db'}")
    versions = client.search_model_versions("name = 'e2e-policy'")
    assert sorted(int(v.tags["step"]) for v in versions) == [0, 1, 2]
    assert client.get_model_version_by_alias("e2e-policy", "newest").tags["step"] == "2"
    champion = client.get_model_version_by_alias("e2e-policy", "champion")
    assert float(champion.tags["val_acc"]) == max(float(v.tags["val_acc"]) for v in versions)
    run = client.search_runs([client.get_experiment_by_name("dapo").experiment_id])[0]
    assert run.data.params["clip_high"] == "0.28"
    assert {"actor/entropy", "sampling/kept_ratio", "val/acc", "rollout/tokens_per_s"} <= set(run.data.metrics)


def mlflow_client(home: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(f"sqlite:///{home / 'mlflow.db'}", registry_uri=f"sqlite:///{home / 'mlflow.db'}")


def test_extending_a_run_computes_only_the_new_steps_in_the_same_mlflow_run(first_run, home):
    """2 steps, then 3: the one new step runs (its step and validation lines), steps 1-2 come
    from the cache, and the one MLflow run of the config goes on and ends FINISHED."""
    longer = pyflyte_run(home, "--total_steps", "3", "--model_name", "e2e-policy")
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert {line.split("|")[0] for line in step_lines(longer.stdout)} == {"step    3 "}, step_lines(longer.stdout)
    client = mlflow_client(home)
    runs = client.search_runs([client.get_experiment_by_name("dapo").experiment_id], filter_string="params.seed = '0'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    run = runs[0]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "sampling/kept_ratio")] == [1, 2, 3]
    assert run.data.tags["dapo.total_steps"] == "3"
    versions = client.search_model_versions("name = 'e2e-policy'")
    assert sorted(int(v.tags["step"]) for v in versions) == [0, 1, 2, 3]  # none registered twice
    assert all("trainer_state" not in str(path) for path in Path(client.download_artifacts(run.info.run_id, "checkpoints")).rglob("*"))
    assert "final_step=3" in longer.stdout.replace(" ", ""), longer.stdout[-2000:]


def test_node_outputs_do_not_grow_with_the_run(first_run, home):
    """Every output a cached task passed on (the local cache holds them all) is under 64 KB:
    batches, samples and checkpoints go by reference, the loop state has a fixed size."""
    from diskcache import Cache
    from flyteidl.core import literals_pb2

    sizes = []
    with Cache(str(home / ".flyte" / "local-cache")) as cache:
        for key in cache.iterkeys():
            outputs = literals_pb2.LiteralMap()
            outputs.ParseFromString(cache[key])
            sizes += [(len(literal.SerializeToString()), name) for name, literal in outputs.literals.items()]
    assert len(sizes) > 20 and max(sizes)[0] < 64 * 1024, sorted(sizes)[-5:]


@pytest.mark.parametrize("seed, point", [(2, "policy_step"), (3, "checkpoint_commit")])  # rollout: test_s3_run
def test_killed_run_resumes_after_the_last_completed_step(first_run, home, seed, point):
    """Another seed per case: the shared data and starting policy come from the cache, the steps do not."""
    killed = pyflyte_run(home, "--total_steps", "2", crash_at=f"{point}@1", seed=seed)
    assert killed.returncode == -signal.SIGKILL
    done_before_kill = step_lines(killed.stdout)
    assert any(line.startswith("step    1 |") for line in done_before_kill)  # step index 0 finished
    assert not any(line.startswith("step    2 |") for line in done_before_kill)

    resumed = pyflyte_run(home, "--total_steps", "2", seed=seed)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    lines = step_lines(resumed.stdout)
    assert not any(line.startswith("step    1 |") for line in lines), "step 1 must come from the cache"
    assert any(line.startswith("step    2 |") for line in lines)
