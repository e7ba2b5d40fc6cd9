"""`pyflyte run workflows/dapo.py dapo_loop` for real, locally, with Flyte's raw outputs and
MLflow's artifacts on an S3 server on loopback (moto, in its own process), as on a
cluster: a run; the run extended by a step (the rest replayed from the cache); and one
run killed (SIGKILL) mid-rollout, then mid-checkpoint, each resume
going on from the store after the last completed step, ending with the weights of the
run that was not killed."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from machine_caches import machine_caches
from servers import BUCKET, s3_client

REPO = Path(__file__).resolve().parent.parent
PYFLYTE = Path(sys.executable).parent / "pyflyte"
# Small enough for a 2-core CI machine: a short warm start, few prompts, 2 steps.
SMALL = {
    "embedded_layout_noise": 0.6, "embedded_warm_start_steps": 120, "train_prompt_bsz": 4, "gen_prompt_bsz": 8, "ppo_mini_batch_size": 2,
    "max_num_gen_batches": 2, "val_every": 1, "val_n_samples": 2, "val_max_prompts": 16,
}
LOCAL_CACHE = ".flyte/local-cache"  # flytekit's local cache, under HOME
SETUP_TASKS = ("tasks.data.prepare_data-", "tasks.data.bootstrap_policy-")  # the cached tasks before step 0

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.deepspeed]


def pyflyte_run(home: Path, s3: str, *args: str, crash_at: str = "", seed: int = 0, timeout: int = 900,
                **overrides) -> subprocess.CompletedProcess:
    """pyflyte run --raw-output-data-prefix s3://dapo/raw workflows/dapo.py dapo_loop [args]:
    its Flyte cache and MLflow's database under home, its data in the S3 server at s3."""
    env = {
        **os.environ,
        "HOME": str(home),  # flytekit's local cache lives under ~/.flyte: one per module
        **machine_caches(),
        "MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow.db'}",
        "PYTHONUNBUFFERED": "1",
        "FLYTE_AWS_ENDPOINT": s3, "FLYTE_AWS_ACCESS_KEY_ID": "test", "FLYTE_AWS_SECRET_ACCESS_KEY": "test",
        "MLFLOW_S3_ENDPOINT_URL": s3, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
        "FLYTE_SDK_RICH_TRACEBACKS": "0",  # a failing run's traceback as plain text in its output
    }
    env.pop("DAPO_CRASH_AT", None)
    if crash_at:
        env["DAPO_CRASH_AT"] = crash_at
    overrides = json.dumps({**SMALL, "seed": seed, **overrides})
    command = [str(PYFLYTE), "run", "--raw-output-data-prefix", f"s3://{BUCKET}/raw", "workflows/dapo.py", "dapo_loop",
               "--overrides_json", overrides, *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, start_new_session=True)


def keys(endpoint: str, prefix: str) -> list[str]:
    pages = s3_client(endpoint).get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return [item["Key"] for page in pages for item in page.get("Contents", [])]


def step_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("step ")]


def new_home(tmp_path_factory, setup_from: Path | None = None) -> Path:
    """A local Flyte cache and MLflow database; MLflow's artifacts go to S3, as with a
    server whose artifact root is a bucket. setup_from: a home whose cached config, data
    and starting policy (the tasks before step 0) the new cache starts with."""
    home = tmp_path_factory.mktemp("home")
    mlflow_client(home).create_experiment("dapo", artifact_location=f"s3://{BUCKET}/mlflow")
    if setup_from:
        from diskcache import Cache

        with Cache(str(setup_from / LOCAL_CACHE)) as source, Cache(str(home / LOCAL_CACHE)) as target:
            copied = set()
            for key in source.iterkeys():
                task = next((t for t in SETUP_TASKS if key.startswith(t)), None)
                if task:
                    target[key] = source[key]
                    copied.add(task)
        assert copied == set(SETUP_TASKS), copied
    return home


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """The cache shared by the first run and its extension (data and the starting policy are built once)."""
    return new_home(tmp_path_factory)


@pytest.fixture(scope="module")
def first_run(home, s3):
    result = pyflyte_run(home, s3, "--total_steps", "2", "--model_name", "e2e-policy")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def test_local_run_completes_logs_steps_and_registers_servable_versions_in_s3(first_run, home, s3):
    result = first_run
    lines = step_lines(result.stdout)
    assert any(line.startswith("step    0 |") for line in lines)  # validation of the starting policy
    assert any(line.startswith("step    2 |") for line in lines)
    assert re.search(r"val_acc_curve='0: [01]\.\d{3}, 1: [01]\.\d{3}, 2: [01]\.\d{3}'", result.stdout)  # the summary ends it
    client = mlflow_client(home)
    versions = client.search_model_versions("name = 'e2e-policy'")
    assert sorted(int(v.tags["step"]) for v in versions) == [0, 1, 2]
    assert client.get_model_version_by_alias("e2e-policy", "newest").tags["step"] == "2"
    champion = client.get_model_version_by_alias("e2e-policy", "champion")
    assert float(champion.tags["val_acc"]) == max(float(v.tags["val_acc"]) for v in versions)
    run = client.search_runs([client.get_experiment_by_name("dapo").experiment_id])[0]
    assert run.data.params["clip_high"] == "0.28"
    assert {"actor/entropy", "sampling/kept_ratio", "val/acc", "rollout/tokens_per_s"} <= set(run.data.metrics)
    raw = keys(s3, "raw/")
    checkpoints = {key.rsplit("/", 1)[0] for key in raw if key.endswith("/model.safetensors")}
    assert len(checkpoints) >= 3 and any("/trainer_state/" in key for key in raw)  # steps 0-2, with their trainer state
    registered = keys(s3, "mlflow/")
    assert {key.split("/checkpoints/")[1].split("/")[0] for key in registered if "/checkpoints/" in key} == {
        "step_000000", "step_000001", "step_000002"
    }
    assert any(key.endswith("/model.safetensors") for key in registered)
    assert not any("trainer_state" in key for key in registered)  # a version holds the servable files only
    assert all(v.source.startswith(f"s3://{BUCKET}/mlflow/") for v in versions)


def mlflow_client(home: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(f"sqlite:///{home / 'mlflow.db'}", registry_uri=f"sqlite:///{home / 'mlflow.db'}")


def test_extending_a_run_computes_only_the_new_steps_in_the_same_mlflow_run(first_run, home, s3):
    """2 steps, then 3: the one new step runs (its step and validation lines), steps 1-2 come
    from the cache, and the one MLflow run of the config goes on and ends FINISHED."""
    longer = pyflyte_run(home, s3, "--total_steps", "3", "--model_name", "e2e-policy")
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
    assert "final_step=3" in longer.stdout.replace(" ", ""), longer.stdout[-2000:]


def test_node_outputs_do_not_grow_with_the_run(first_run, home):
    """Every output a cached task passed on (the local cache holds them all) is under 64 KB:
    batches, samples and checkpoints go by reference, the loop state has a fixed size."""
    from diskcache import Cache
    from flyteidl.core import literals_pb2

    sizes = []
    with Cache(str(home / LOCAL_CACHE)) as cache:
        for key in cache.iterkeys():
            outputs = literals_pb2.LiteralMap()
            outputs.ParseFromString(cache[key])
            sizes += [(len(literal.SerializeToString()), name) for name, literal in outputs.literals.items()]
    assert len(sizes) > 20 and max(sizes)[0] < 64 * 1024, sorted(sizes)[-5:]


def test_a_run_killed_twice_resumes_each_time_and_ends_with_the_uninterrupted_weights(first_run, home, s3, tmp_path_factory):
    """first_run again in a cache of its own (that holds only first_run's data and starting
    policy), killed in the rollout of its second step, then in that step's update with its
    checkpoint written but not yet in place: each re-run replays what finished from the
    cache (its outputs read back from S3) and runs only the rest, and the last one ends with
    first_run's final weights, bit for bit."""
    killed_home = new_home(tmp_path_factory, setup_from=home)
    # (DAPO_CRASH_AT, the step lines the run prints: "step 0" validates the starting policy,
    # "step N" ends step index N-1)
    runs = [("rollout@1", {0, 1}), ("checkpoint_commit@1", set()), ("", {2})]
    for crash_at, printed in runs:
        run = pyflyte_run(killed_home, s3, "--total_steps", "2", "--model_name", "kill-policy", crash_at=crash_at)
        if run.returncode != (-signal.SIGKILL if crash_at else 0):
            pytest.fail(f"DAPO_CRASH_AT={crash_at!r}: exit {run.returncode}\n{run.stdout[-12000:]}\n{run.stderr[-6000:]}")
        assert {int(line.split("|")[0].split()[1]) for line in step_lines(run.stdout)} == printed, (crash_at, step_lines(run.stdout))
    killed = {int(v.tags["step"]): v for v in mlflow_client(killed_home).search_model_versions("name = 'kill-policy'")}
    assert sorted(killed) == [0, 1, 2]  # each registered once
    uninterrupted = {int(v.tags["step"]): v for v in mlflow_client(home).search_model_versions("name = 'e2e-policy'")}
    assert weights_digest(s3, killed[2].source) == weights_digest(s3, uninterrupted[2].source)


def weights_digest(s3: str, source: str) -> str:
    """sha256 of the model.safetensors of a registered version (its source: s3://bucket/key)."""
    import hashlib

    bucket, key = source.removeprefix("s3://").split("/", 1)
    body = s3_client(s3).get_object(Bucket=bucket, Key=f"{key}/model.safetensors")["Body"].read()
    return hashlib.sha256(body).hexdigest()


def test_a_colocated_run_killed_mid_chunk_resumes_after_its_last_step_and_ends_with_the_per_stage_weights(
    first_run, home, s3, tmp_path_factory
):
    """first_run's 2 steps as one colocated chunk (trainer and vLLM resident, weights synced in
    memory), killed in the rollout of its second step, then run again: the chunk goes on
    from its step-1 record (step 1 is not run or logged again) and ends with first_run's
    per-stage weights, bit for bit."""
    colocated_home = new_home(tmp_path_factory, setup_from=home)
    for crash_at, printed in (("rollout@1", {0, 1}), ("", {2})):
        run = pyflyte_run(colocated_home, s3, "--total_steps", "2", "--steps_per_chunk", "2", "--model_name", "colocated-policy",
                          crash_at=crash_at, execution="colocated", val_every=0)  # validating at step 1 would end a chunk there
        if run.returncode != (-signal.SIGKILL if crash_at else 0):
            pytest.fail(f"DAPO_CRASH_AT={crash_at!r}: exit {run.returncode}\n{run.stdout[-12000:]}\n{run.stderr[-6000:]}")
        assert {int(line.split("|")[0].split()[1]) for line in step_lines(run.stdout)} == printed, (crash_at, step_lines(run.stdout))
    client = mlflow_client(colocated_home)
    colocated = {int(v.tags["step"]): v for v in client.search_model_versions("name = 'colocated-policy'")}
    assert sorted(colocated) == [0, 2]  # validated at the start and at the chunk's end
    run_id = client.search_runs([client.get_experiment_by_name("dapo").experiment_id])[0].info.run_id
    assert [m.step for m in client.get_metric_history(run_id, "sampling/kept_ratio")] == [1, 2]  # each step logged once
    # step 2 sampled from the weights synced in memory what per-stage sampled from the reloaded checkpoint
    per_stage_client = mlflow_client(home)
    per_stage_run = per_stage_client.search_runs([per_stage_client.get_experiment_by_name("dapo").experiment_id])[0].info.run_id
    for key in ("rollout/tokens", "sampling/rounds", "sampling/informative_groups", "sampling/kept_groups"):
        colocated_history = [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
        assert [step for step, _ in colocated_history] == [1, 2], key
        assert colocated_history == [(m.step, m.value) for m in per_stage_client.get_metric_history(per_stage_run, key) if m.step <= 2], key
    per_stage = {int(v.tags["step"]): v for v in mlflow_client(home).search_model_versions("name = 'e2e-policy'")}
    assert weights_digest(s3, colocated[2].source) == weights_digest(s3, per_stage[2].source)

