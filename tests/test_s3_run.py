"""The local DAG with its data in S3, as on a cluster: an S3 server on loopback (moto) holds
Flyte's raw outputs (checkpoints, batches, the weights-only download for rollout) and
MLflow's artifacts; a run killed mid-rollout resumes from what is in S3, nothing lost."""

import signal
import socket
import subprocess
import sys
import time

import pytest

from test_workflow_local import mlflow_client, pyflyte_run, step_lines

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.deepspeed]
BUCKET = "dapo"


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory):
    """moto's S3 server in a process of its own: in this one its Flask app would leave
    context-bound proxies in sys.modules, which vLLM's kernel registry trips over."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = (tmp_path_factory.mktemp("moto") / "server.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=log)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                s3_client(endpoint).create_bucket(Bucket=BUCKET)
                break
            except Exception:  # not listening yet
                time.sleep(0.2)
        else:
            raise RuntimeError(f"moto's S3 server did not start on {endpoint}")
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def s3_client(endpoint: str):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="test", aws_secret_access_key="test", region_name="us-east-1")


def keys(endpoint: str, prefix: str) -> list[str]:
    pages = s3_client(endpoint).get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return [item["Key"] for page in pages for item in page.get("Contents", [])]


def test_a_run_in_s3_killed_mid_rollout_resumes_from_s3(s3_endpoint, tmp_path):
    env = {
        "FLYTE_AWS_ENDPOINT": s3_endpoint, "FLYTE_AWS_ACCESS_KEY_ID": "test", "FLYTE_AWS_SECRET_ACCESS_KEY": "test",
        "MLFLOW_S3_ENDPOINT_URL": s3_endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
    }
    client = mlflow_client(tmp_path)
    client.create_experiment("dapo", artifact_location=f"s3://{BUCKET}/mlflow")  # as an MLflow server with an S3 artifact root
    options = ("--raw-output-data-prefix", f"s3://{BUCKET}/raw")
    run = dict(run_options=options, env=env, seed=1)

    killed = pyflyte_run(tmp_path, "--total_steps", "2", "--model_name", "s3-policy", crash_at="rollout@1", **run)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert any(line.startswith("step    1 |") for line in step_lines(killed.stdout))
    resumed = pyflyte_run(tmp_path, "--total_steps", "2", "--model_name", "s3-policy", **run)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    lines = step_lines(resumed.stdout)
    assert not any(line.startswith("step    1 |") for line in lines) and any(line.startswith("step    2 |") for line in lines)

    raw = keys(s3_endpoint, "raw/")
    checkpoints = {key.rsplit("/", 1)[0] for key in raw if key.endswith("/model.safetensors")}
    assert len(checkpoints) >= 3 and any("/trainer_state/" in key for key in raw)  # steps 0, 1, 2, with their trainer state
    registered = keys(s3_endpoint, "mlflow/")
    assert {key.split("/checkpoints/")[1].split("/")[0] for key in registered if "/checkpoints/" in key} == {
        "step_000000", "step_000001", "step_000002"
    }
    assert any(key.endswith("/model.safetensors") for key in registered)
    assert not any("trainer_state" in key for key in registered)  # a version holds the servable files only
    versions = client.search_model_versions("name = 's3-policy'")
    assert sorted(int(v.tags["step"]) for v in versions) == [0, 1, 2]
    assert all(v.source.startswith(f"s3://{BUCKET}/mlflow/") for v in versions)
