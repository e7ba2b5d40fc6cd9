"""MLflow tracking: runs, metrics, registry aliases, and a server that goes away."""

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from dapo import tracking
from servers import BUCKET, free_port, s3_client, serve, start_mlflow, stop
from dapo.tracking import RunTarget, artifact_record, deliver, metrics_record, params_record, register_record, table_record


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A random-init tiny HF model (no warm start needed to test the registry)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("tiny-hf")
    config = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


def sqlite_target(tmp_path, key="run-a") -> RunTarget:
    return RunTarget(f"sqlite:///{tmp_path / 'mlflow.db'}", "dapo-test", key, f"exec-{key}")


def client_for(target):
    from mlflow.tracking import MlflowClient

    return MlflowClient(target.tracking_uri, registry_uri=target.tracking_uri)


def test_run_params_metrics_table_and_champion(tmp_path, tiny_checkpoint, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the sqlite store's artifacts go under ./mlruns
    target = sqlite_target(tmp_path)
    records = [params_record({"clip_high": 0.28, "extra": {"a": 1}}), metrics_record(1, {"acc": 0.25}),
               table_record("samples/step_000001.json", [{"response": "Answer: 3", "acc": 1.0}])]
    (tmp_path / "curves.png").write_bytes(b"png")
    records.append(artifact_record(tmp_path / "curves.png", "plots"))
    records += [register_record("tiny-policy", tiny_checkpoint, step, acc) for step, acc in [(0, 0.2), (5, 0.5), (10, 0.4)]]
    assert deliver(target, records, materialize=str) == []

    client = client_for(target)
    run = client.search_runs([client.get_experiment_by_name("dapo-test").experiment_id])[0]
    assert run.info.run_name == "exec-run-a"
    assert run.data.params["clip_high"] == "0.28"
    assert [m.value for m in client.get_metric_history(run.info.run_id, "acc")] == [0.25]
    assert [a.path for a in client.list_artifacts(run.info.run_id, "plots")] == ["plots/curves.png"]
    assert client.get_model_version_by_alias("tiny-policy", "champion").tags["step"] == "5"
    assert client.get_model_version_by_alias("tiny-policy", "newest").tags["step"] == "10"

    # the same run key finds the same run (a resumed execution), and re-delivering a
    # registration that already landed does not make a second version
    assert deliver(target, [register_record("tiny-policy", tiny_checkpoint, 10, 0.4)], materialize=str) == []
    assert len(client.search_model_versions("name = 'tiny-policy'")) == 3
    assert len(client.search_runs([run.info.experiment_id])) == 1

    import mlflow
    from transformers import AutoModelForCausalLM

    mlflow.set_tracking_uri(target.tracking_uri)
    local = mlflow.artifacts.download_artifacts("models:/tiny-policy@champion")
    model = AutoModelForCausalLM.from_pretrained(local)
    assert model.config.hidden_size == 16


def test_a_step_delivered_again_is_logged_once_whatever_brings_it_back(tmp_path):
    """An extension, a retried task or a resumed chunk delivers a step MLflow already has:
    the run keeps one point per step and metric; a validation at the same step (other metric
    names) and a new step are still logged."""
    target = sqlite_target(tmp_path)
    step_1, step_2 = metrics_record(1, {"train/acc": 0.5, "actor/pg_loss": 0.1}), metrics_record(2, {"train/acc": 0.75})
    assert deliver(target, [step_1]) == []
    assert deliver(target, [step_1, metrics_record(1, {"val/acc": 0.25}), step_1, step_2]) == []
    assert deliver(target, [step_2, step_1]) == []
    client = client_for(target)
    run_id = client.search_runs([client.get_experiment_by_name("dapo-test").experiment_id])[0].info.run_id
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "train/acc")] == [(1, 0.5), (2, 0.75)]
    assert [m.step for m in client.get_metric_history(run_id, "actor/pg_loss")] == [1]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "val/acc")] == [(1, 0.25)]


def test_unreachable_server_keeps_every_record_and_fails_fast(tmp_path, monkeypatch):
    for key in tracking.FAST_FAIL_ENV:
        monkeypatch.delenv(key, raising=False)
    target = RunTarget(f"http://127.0.0.1:{free_port()}", "dapo-test", "k", "exec")
    records = [metrics_record(step, {"acc": step / 10}) for step in range(3)]
    started = time.perf_counter()
    assert deliver(target, records) == records
    assert time.perf_counter() - started < 15
    assert not [key for key in tracking.FAST_FAIL_ENV if key in os.environ]  # set for the delivery only


def test_fast_fail_settings_never_override_the_users(monkeypatch):
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "300")
    with tracking.fast_fail():
        assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "0"
        assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "300"
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "300"


def test_registry_name_clash_is_refused_not_retried(tmp_path, tiny_checkpoint, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    target = sqlite_target(tmp_path)
    client_for(target).create_registered_model("someone-elses-model")
    left = deliver(target, [register_record("someone-elses-model", tiny_checkpoint, 1, 0.5), metrics_record(1, {"acc": 0.5})],
                   materialize=str)
    assert left == []  # the clash does not block the metrics behind it
    refusals = [r for r in caplog.records if r.levelname == "ERROR" and "MLflow refused a register record" in r.getMessage()]
    assert len(refusals) == 1 and "someone-elses-model" in refusals[0].getMessage()
    assert client_for(target).search_model_versions("name = 'someone-elses-model'") == []


def test_registrations_wait_for_a_task_that_can_hold_weights_and_never_hold_up_metrics(tmp_path, tiny_checkpoint, monkeypatch):
    """log_step's pod has no disk for a model version: its delivery sends the metrics
    around the registrations waiting in the outbox, and register_model's sends them."""
    monkeypatch.chdir(tmp_path)
    target = sqlite_target(tmp_path)
    waiting = [register_record("tiny-policy", tiny_checkpoint, 0, 0.2), register_record("tiny-policy", tiny_checkpoint, 5, 0.5)]
    left = deliver(target, [waiting[0], metrics_record(1, {"acc": 0.1}), waiting[1], metrics_record(2, {"acc": 0.2})])
    assert left == waiting
    client = client_for(target)
    run_id = tracking.Tracker(target).run_id
    assert [m.step for m in client.get_metric_history(run_id, "acc")] == [1, 2]
    assert client.search_registered_models() == []
    assert deliver(target, left, materialize=str) == []
    assert sorted(v.tags["step"] for v in client.search_model_versions("name = 'tiny-policy'")) == ["0", "5"]


def test_a_registration_that_fails_is_kept_in_order_and_the_metrics_behind_it_go_on(tmp_path, tiny_checkpoint, monkeypatch):
    monkeypatch.chdir(tmp_path)
    target = sqlite_target(tmp_path)
    calls = []

    def flaky(uri: str) -> str:  # the checkpoint's download fails once
        calls.append(uri)
        if len(calls) == 1:
            raise OSError("connection reset while downloading the checkpoint")
        return uri

    first, second = register_record("tiny-policy", tiny_checkpoint, 5, 0.5), register_record("tiny-policy", tiny_checkpoint, 10, 0.4)
    left = deliver(target, [first, metrics_record(6, {"acc": 0.6}), second, metrics_record(7, {"acc": 0.7})], materialize=flaky)
    assert left == [first, second] and len(calls) == 1  # the second waits behind the first: versions keep their order
    client = client_for(target)
    assert [m.step for m in client.get_metric_history(tracking.Tracker(target).run_id, "acc")] == [6, 7]
    assert deliver(target, left, materialize=flaky) == []
    assert sorted(int(v.version) for v in client.search_model_versions("name = 'tiny-policy'")) == [1, 2]
    assert client.get_model_version_by_alias("tiny-policy", "newest").tags["step"] == "10"


def test_large_upload_settings_override_fast_fail_inside_and_never_the_users(monkeypatch):
    for key in {**tracking.FAST_FAIL_ENV, **tracking.LARGE_UPLOAD_ENV}:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MLFLOW_MULTIPART_UPLOAD_CHUNK_SIZE", str(8 * 2**20))  # the user's
    with tracking.fast_fail():
        with tracking.large_uploads():
            assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "600"
            assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "3"
            assert os.environ["MLFLOW_ENABLE_PROXY_MULTIPART_UPLOAD"] == "true"
            assert os.environ["MLFLOW_MULTIPART_UPLOAD_CHUNK_SIZE"] == str(8 * 2**20)
        assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "10" and os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "0"
        assert "MLFLOW_ENABLE_PROXY_MULTIPART_UPLOAD" not in os.environ
    assert not [key for key in {**tracking.FAST_FAIL_ENV, **tracking.LARGE_UPLOAD_ENV} if key in os.environ and
                key != "MLFLOW_MULTIPART_UPLOAD_CHUNK_SIZE"]


WEIGHT_FILE_BYTES = 2 * 2**30 + 96 * 2**20
"""A weight shard past 2 GiB (a 32B model's are ~4 GB), sparse on the test's disk: what is
tested is the route its bytes take, which is the same for zeros."""
SERVER_FILE_LIMIT = 256 * 2**20
UPLOADER_FILE_LIMIT = 64 * 2**20
REGISTER = """
import json, resource, sys
from dapo import tracking
limit = int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # the uploader may stage no copy of the weights
target = tracking.RunTarget(sys.argv[1], "dapo-test", "large", "exec")
left = tracking.deliver(target, [tracking.register_record("large-policy", sys.argv[2], 0, 0.1), tracking.metrics_record(1, {"acc": 0.5})],
                        materialize=str)
print(json.dumps([record["kind"] for record in left]))
"""


def register_in_a_pod(tracking_uri: str, checkpoint: Path, **env: str) -> list[str]:
    """Deliver a registration and a metric from a process of its own (a register_model pod):
    the kinds of the records left undelivered."""
    environment = {**{k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}, **env}
    result = subprocess.run([sys.executable, "-c", REGISTER, tracking_uri, str(checkpoint), str(UPLOADER_FILE_LIMIT)],
                            capture_output=True, text=True, env=environment, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.slow
def test_a_model_version_larger_than_the_servers_temp_space_registers_straight_into_the_store(tmp_path, s3, tiny_checkpoint):
    """A real `mlflow server --serve-artifacts` with its artifacts in S3, which may write no
    file over 256 MiB (a pod's small /tmp), and a checkpoint with a 2.1 GiB weight file
    registered from a process that may write no file over 64 MiB: the weights go to S3 by
    multipart upload and the version holds them whole. The same upload through the server
    (multipart turned off by the user) fails there and is kept, and the metric behind it
    is logged all the same."""
    import shutil

    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(tiny_checkpoint, checkpoint)
    with (checkpoint / "model-00002-of-00002.safetensors").open("wb") as shard:
        shard.truncate(WEIGHT_FILE_BYTES)
    server, uri = start_mlflow(tmp_path, artifacts=f"s3://{BUCKET}/mlflow", s3_endpoint=s3, file_limit_bytes=SERVER_FILE_LIMIT)
    try:
        through_server = register_in_a_pod(uri, checkpoint, MLFLOW_ENABLE_PROXY_MULTIPART_UPLOAD="false",
                                           MLFLOW_HTTP_REQUEST_MAX_RETRIES="0")
        assert through_server == ["register"]  # the server could not hold the file: kept for a later delivery
        assert register_in_a_pod(uri, checkpoint) == []
        from mlflow.tracking import MlflowClient

        client = MlflowClient(uri, registry_uri=uri)
        version = client.get_model_version_by_alias("large-policy", "newest")
        assert version.source.endswith(f"/{version.run_id}/artifacts/checkpoints/step_000000")  # mlflow-artifacts:/...
        objects = s3_client(s3).list_objects_v2(Bucket=BUCKET, Prefix="mlflow/")["Contents"]
        sizes = {item["Key"].rsplit("/", 1)[1]: item["Size"] for item in objects if "/checkpoints/step_000000/" in item["Key"]}
        assert sizes["model-00002-of-00002.safetensors"] == WEIGHT_FILE_BYTES
        assert sizes["model.safetensors"] == (checkpoint / "model.safetensors").stat().st_size
        assert [m.step for m in client.get_metric_history(version.run_id, "acc")] == [1]
    finally:
        stop(server)


def mlflow_server_script() -> str:
    """The MLflow server's start script from k8s/12-mlflow-server.yaml."""
    import yaml

    deployment = next(doc for doc in yaml.safe_load_all((Path(__file__).parent.parent / "k8s/12-mlflow-server.yaml").read_text())
                      if doc and doc["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["/bin/sh", "-c"]
    return container["args"][0]


@pytest.mark.slow
def test_the_clusters_mlflow_server_takes_the_pipelines_user_and_shows_people_only_what_they_were_granted(tmp_path, monkeypatch):
    """The manifest's own start script (basic-auth app, admin from the Secret's variables,
    the user store beside the tracking store) run here: the pipeline's user, created as
    k8s/README.md says, delivers with MLFLOW_TRACKING_USERNAME/PASSWORD (what the pod
    templates take from Secret dapo-mlflow-auth); without them every record is kept. A
    person reads the pipeline's experiment and model after k8s/README.md's grant, not before."""
    port = free_port()
    env = {**os.environ, "HOME": str(tmp_path), "MLFLOW_PORT": str(port), "MLFLOW_BACKEND_STORE_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
           "MLFLOW_ARTIFACTS_DESTINATION": str(tmp_path / "artifacts"), "MLFLOW_AUTH_ADMIN_USERNAME": "admin",
           "MLFLOW_AUTH_ADMIN_PASSWORD": "admin-password-0", "MLFLOW_FLASK_SERVER_SECRET_KEY": "0123456789abcdef"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    server = serve(["/bin/sh", "-c", mlflow_server_script()], port, tmp_path / "server.log", env)
    try:
        uri = f"http://127.0.0.1:{port}"
        for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
            monkeypatch.delenv(key, raising=False)
        target = RunTarget(uri, "dapo-test", "auth", "exec")
        records = [params_record({"lr": 1e-6}), metrics_record(1, {"acc": 0.5})]
        assert deliver(target, records) == records  # anonymous: refused, kept for later
        # k8s/README.md's command, in a process of its own (mlflow.server imports a Flask app, whose
        # context-bound proxies left in this process's sys.modules trip vLLM's kernel registry)
        create_user = f"from mlflow.server import get_app_client; get_app_client('basic-auth', tracking_uri={uri!r})" \
                      ".create_user('dapo-pipeline', 'pipeline-password-0')"
        admin = {**os.environ, "MLFLOW_TRACKING_USERNAME": "admin", "MLFLOW_TRACKING_PASSWORD": "admin-password-0"}
        subprocess.run([sys.executable, "-c", create_user], env=admin, check=True, capture_output=True, timeout=120)
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "dapo-pipeline")
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "pipeline-password-0")
        # delivered, at a later delivery at worst: each call waits 10 s (FAST_FAIL_ENV), which a
        # server checking a password hash on a loaded 2-core machine has been seen to miss once
        kept = records
        for _ in range(3):
            kept = deliver(target, kept)
            if not kept:
                break
        assert kept == []
        run = tracking.Tracker(target).find_run()
        assert run.data.params["lr"] == "1e-06" and run.data.metrics["acc"] == 0.5
        client_for(target).create_registered_model("auth-policy", tags={tracking.MANAGED_TAG: "true"})  # as register() does

        # default_permission NO_PERMISSIONS: a person sees the pipeline's experiment and model only once granted READ
        def reader_gets(path: str, **params) -> int:
            return requests.get(f"{uri}/api/2.0/mlflow/{path}", params=params, auth=("alice", "alice-password-0"), timeout=30).status_code

        names = '"alice", "<her password>", "dapo", "dapo-policy"'
        assert names in readme_grant_script()
        script = readme_grant_script().replace(names, '"alice", "alice-password-0", "dapo-test", "auth-policy"').splitlines()
        as_admin = {**admin, "MLFLOW_TRACKING_URI": uri}
        experiment_id = run.info.experiment_id

        def as_admin_run(code: str) -> None:
            done = subprocess.run([sys.executable, "-c", code], env=as_admin, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr[-3000:]

        as_admin_run("\n".join(line for line in script if "grant_user_permission(" not in line))  # the user alone
        assert reader_gets("experiments/get", experiment_id=experiment_id) == 403
        assert reader_gets("registered-models/get", name="auth-policy") == 403
        as_admin_run("\n".join(line for line in script if "create_user(" not in line))
        assert reader_gets("experiments/get", experiment_id=experiment_id) == 200
        assert reader_gets("registered-models/get", name="auth-policy") == 200
        assert reader_gets("experiments/get", experiment_id="0") == 403  # nothing else
    finally:
        stop(server)


def readme_grant_script() -> str:
    """The Python that k8s/README.md's READ grant runs (its heredoc)."""
    text = (Path(__file__).parent.parent / "k8s/README.md").read_text()
    block = next(b for b in text.split("```bash")[1:] if "grant_user_permission" in b)
    return block.split("<<'EOF'\n", 1)[1].split("\nEOF", 1)[0]


@pytest.mark.slow
def test_server_down_at_start_and_mid_run_loses_nothing(tmp_path):
    port = free_port()
    target = RunTarget(f"http://127.0.0.1:{port}", "dapo-test", "k", "exec")
    pending = deliver(target, [params_record({"lr": 1e-6}), metrics_record(0, {"acc": 0.0})])  # down at start
    assert len(pending) == 2
    server, _ = start_mlflow(tmp_path, port)
    try:
        pending = deliver(target, pending + [metrics_record(1, {"acc": 0.1})])
        assert pending == []
        stop(server)  # goes down mid-run
        for step in (2, 3):
            pending = deliver(target, pending + [metrics_record(step, {"acc": step / 10})])
        assert [r["step"] for r in pending] == [2, 3]
        server, _ = start_mlflow(tmp_path, port)
        assert deliver(target, pending + [metrics_record(4, {"acc": 0.4})]) == []
        client = client_for(target)
        run = client.search_runs([client.get_experiment_by_name("dapo-test").experiment_id])[0]
        history = client.get_metric_history(run.info.run_id, "acc")
        assert sorted((m.step, m.value) for m in history) == [(s, s / 10) for s in range(5)]
        assert run.data.params["lr"] == "1e-06"
    finally:
        stop(server)


def test_default_tracking_uri(monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    assert tracking.default_tracking_uri() == f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    assert tracking.default_tracking_uri() == "http://mlflow:5000"
    assert tracking.default_tracking_uri("file:///x") == "file:///x"


def test_credentials_in_the_uri_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="MLFLOW_TRACKING_PASSWORD"):
        tracking.default_tracking_uri("https://alice:s3cret@mlflow.example.com")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://bob:hunter2@mlflow:5000")
    with pytest.raises(ValueError, match="carries a password"):
        tracking.default_tracking_uri()


@pytest.mark.parametrize("message, status", [
    ("[1/1] currentAttempt done. Last Error: USER::Pod failed. [primary] terminated with exit code (137). Reason [OOMKilled].", "KILLED"),
    ("[1/1] currentAttempt done. Last Error: SYSTEM::Interrupted: the node was preempted", "KILLED"),
    ("task active timeout [2h0m0s] expired", "KILLED"),
    ("USER::ValueError: train_data row 17 has no 'answer' field", "FAILED"),
    ("RuntimeError: 3 consecutive bad steps (NaN loss)", "FAILED"),
])
def test_an_execution_stopped_from_outside_ends_killed_one_that_failed_ends_failed(message, status):
    assert tracking.ended_status(message) == status


def test_a_failed_execution_ends_its_run_failed_and_a_resumed_one_reopens_it(tmp_path, monkeypatch):
    """dapo_loop's failure handler finds the run by its step config's key and ends it KILLED
    (the pod was OOM-killed) with the error; the next delivery (a resumed execution) sets
    it RUNNING again."""
    from flytekit.types.error import FlyteError

    from tasks.common import run_key
    from tasks.config import resolve
    from tasks.tracking import end_failed_run

    monkeypatch.chdir(tmp_path)
    inputs = dict(preset="tiny_cpu", overrides_json='{"seed": 3}', total_steps=4, train_data="", val_data="",
                  mlflow_tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", mlflow_experiment="dapo-test", model_name="m", steps_per_chunk=2)
    target = RunTarget(inputs["mlflow_tracking_uri"], "dapo-test", run_key(resolve("tiny_cpu", '{"seed": 3}', 9, "", "")), "x")
    assert deliver(target, [metrics_record(1, {"acc": 0.5})]) == []
    end_failed_run(**inputs, err=FlyteError(message="pod OOMKilled", failed_node_id="n3"))
    client = client_for(target)
    run = client.search_runs([client.get_experiment_by_name("dapo-test").experiment_id])[0]
    assert run.info.status == "KILLED" and run.data.tags["flyte.error"] == "pod OOMKilled"
    end_failed_run(**inputs, err=FlyteError(message="ValueError: bad row", failed_node_id="n1"))
    assert client.get_run(run.info.run_id).info.status == "FAILED"
    assert deliver(target, [metrics_record(2, {"acc": 0.6})]) == []
    assert client.get_run(run.info.run_id).info.status == "RUNNING"


def test_undelivered_records_wait_in_an_outbox_file_not_in_the_loop_state(tmp_path):
    """MLflow down: the loop state keeps a URI, not the records, however many pile up;
    MLflow back: the outbox is delivered in order and emptied."""
    from dapo.tracking import LoopState
    from tasks.tracking import deliver as deliver_through_outbox, read_outbox

    down = RunTarget("http://127.0.0.1:9", "dapo-test", "outbox", "x")  # nothing listens on port 9
    state, sizes = LoopState(), []
    for step in range(1, 6):
        deliver_through_outbox(state, down, [metrics_record(step, {"acc": step / 10, "loss": 1.0})])
        sizes.append(len(json.dumps(dataclasses.asdict(state))))
    assert [r["step"] for r in read_outbox(state)] == [1, 2, 3, 4, 5]
    assert len(set(sizes)) == 1  # the state does not grow with the records waiting
    up = sqlite_target(tmp_path, key="outbox")
    deliver_through_outbox(state, up, [metrics_record(6, {"acc": 0.6})])
    assert state.outbox == ""
    run_id = tracking.Tracker(up).run_id
    assert [m.step for m in client_for(up).get_metric_history(run_id, "acc")] == [1, 2, 3, 4, 5, 6]
