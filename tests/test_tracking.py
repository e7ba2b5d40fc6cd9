"""MLflow tracking: runs, metrics, registry aliases, and a server that goes away."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dapo import tracking
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
    assert deliver(target, records) == []

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
    assert deliver(target, [register_record("tiny-policy", tiny_checkpoint, 10, 0.4)]) == []
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
    left = deliver(target, [register_record("someone-elses-model", tiny_checkpoint, 1, 0.5), metrics_record(1, {"acc": 0.5})])
    assert left == []  # the clash does not block the metrics behind it
    refusals = [r for r in caplog.records if r.levelname == "ERROR" and "MLflow refused a register record" in r.getMessage()]
    assert len(refusals) == 1 and "someone-elses-model" in refusals[0].getMessage()
    assert client_for(target).search_model_versions("name = 'someone-elses-model'") == []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(store: Path, port: int) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{store / 'server.db'}", "--artifacts-destination", str(store / "artifacts"),
         "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    deadline = time.time() + 90
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return process
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError("mlflow server did not start")


def stop_server(process: subprocess.Popen) -> None:
    os.killpg(process.pid, 9)
    process.wait(timeout=30)


@pytest.mark.slow
def test_server_down_at_start_and_mid_run_loses_nothing(tmp_path):
    port = free_port()
    target = RunTarget(f"http://127.0.0.1:{port}", "dapo-test", "k", "exec")
    pending = deliver(target, [params_record({"lr": 1e-6}), metrics_record(0, {"acc": 0.0})])  # down at start
    assert len(pending) == 2
    server = start_server(tmp_path, port)
    try:
        pending = deliver(target, pending + [metrics_record(1, {"acc": 0.1})])
        assert pending == []
        stop_server(server)  # goes down mid-run
        for step in (2, 3):
            pending = deliver(target, pending + [metrics_record(step, {"acc": step / 10})])
        assert [r["step"] for r in pending] == [2, 3]
        server = start_server(tmp_path, port)
        assert deliver(target, pending + [metrics_record(4, {"acc": 0.4})]) == []
        client = client_for(target)
        run = client.search_runs([client.get_experiment_by_name("dapo-test").experiment_id])[0]
        history = client.get_metric_history(run.info.run_id, "acc")
        assert sorted((m.step, m.value) for m in history) == [(s, s / 10) for s in range(5)]
        assert run.data.params["lr"] == "1e-06"
    finally:
        if server.poll() is None:
            stop_server(server)


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
    from tasks.data import resolve
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
    from tasks.tracking import LoopState, deliver as deliver_through_outbox, read_outbox

    down = RunTarget("http://127.0.0.1:9", "dapo-test", "outbox", "x")  # nothing listens on port 9
    state, sizes = LoopState(), []
    for step in range(1, 6):
        deliver_through_outbox(state, json_of(down), [metrics_record(step, {"acc": step / 10, "loss": 1.0})])
        sizes.append(len(state.to_json()))
    assert [r["step"] for r in read_outbox(state)] == [1, 2, 3, 4, 5]
    assert len(set(sizes)) == 1  # the state does not grow with the records waiting
    up = sqlite_target(tmp_path, key="outbox")
    deliver_through_outbox(state, json_of(up), [metrics_record(6, {"acc": 0.6})])
    assert state.outbox == ""
    run_id = tracking.Tracker(up).run_id
    assert [m.step for m in client_for(up).get_metric_history(run_id, "acc")] == [1, 2, 3, 4, 5, 6]


def json_of(target: RunTarget) -> str:
    import json

    return json.dumps(target.__dict__)
