"""Task helpers that move checkpoints."""

import json
from pathlib import Path

import fsspec
from flytekit.types.directory import FlyteDirectory

from tasks.common import download_weights


def remote_checkpoint(root: str) -> FlyteDirectory:
    fs = fsspec.filesystem("memory")
    files = {"model.safetensors": b"weights", "config.json": b"{}", "trainer_state/optim.pt": b"optimizer" * 100}
    for name, data in files.items():
        fs.pipe(f"{root}/{name}", data)
    return FlyteDirectory.from_source(root)  # as a task receives it: a URI, not yet downloaded


def test_download_weights_leaves_the_optimizer_state_in_the_store():
    local = Path(download_weights(remote_checkpoint("memory://bucket/run/policy-3")))
    assert sorted(p.name for p in local.iterdir()) == ["config.json", "model.safetensors"]
    assert (local / "model.safetensors").read_bytes() == b"weights"


def test_download_weights_uses_a_local_checkpoint_in_place(tmp_path):
    (tmp_path / "trainer_state").mkdir()
    (tmp_path / "model.safetensors").write_bytes(b"w")
    assert Path(download_weights(FlyteDirectory(str(tmp_path)))) == tmp_path


def test_a_checkpoint_passed_on_while_remote_is_keyed_by_its_store_marker_or_uri():
    """Two different remote checkpoints never share a cache key (the empty local path did)."""
    import json

    from tasks.common import _directory_hash

    marked = remote_checkpoint("memory://bucket/run/policy-4")
    fsspec.filesystem("memory").pipe("memory://bucket/run/policy-4/COMPLETE", json.dumps({"content_hash": "abc", "files": {}}).encode())
    assert _directory_hash(marked) == "abc"
    unmarked = [_directory_hash(remote_checkpoint(f"memory://bucket/run/policy-{n}")) for n in (5, 6)]
    assert unmarked[0] != unmarked[1] and all(h.startswith("uri:") for h in unmarked)


def test_a_local_checkpoint_is_keyed_by_its_content(tmp_path):
    from dapo import checkpoint
    from tasks.common import _directory_hash

    (tmp_path / "model.safetensors").write_bytes(b"w")
    assert _directory_hash(FlyteDirectory(str(tmp_path))) == checkpoint.content_hash(tmp_path)
    checkpoint.write_marker(tmp_path, step=1)
    assert _directory_hash(FlyteDirectory(str(tmp_path))) == checkpoint.recorded_hash(tmp_path)


def test_prepare_data_reads_data_given_as_uris():
    """--train_data s3://... as on a cluster: fetched through flytekit's data layer (an
    fsspec memory store here), validated and written like a local file."""
    import io
    import json

    import pyarrow.parquet as pq

    from dapo.data.prompts import make_arithmetic_table
    from tasks.data import prepare_data

    fs = fsspec.filesystem("memory")
    for name, rows in (("train", 12), ("val", 6)):
        buffer = io.BytesIO()
        pq.write_table(make_arithmetic_table(rows, seed=1), buffer)
        fs.pipe(f"memory://bucket/data/{name}.parquet", buffer.getvalue())
    from dapo.config import DAPOConfig

    data_config = DAPOConfig(train_data_path="memory://bucket/data/train.parquet", val_data_path="memory://bucket/data/val.parquet")
    data, stats = prepare_data(config=data_config)
    assert stats["data/train_rows"] == 12 and stats["data/val_rows"] == 6
    assert pq.read_table(Path(data.path) / "train.parquet").num_rows == stats["data/train_kept"]


def test_an_unreadable_data_uri_is_named():
    import pytest

    from dapo.config import DAPOConfig
    from tasks.data import prepare_data

    with pytest.raises(Exception, match="memory://bucket/missing.parquet"):
        prepare_data(config=DAPOConfig(train_data_path="memory://bucket/missing.parquet", val_data_path="memory://bucket/v.parquet"))


def test_the_paper_preset_asks_for_its_data_before_any_work(monkeypatch):
    import pytest

    from dapo import resolve
    from dapo.config import ConfigError
    from tasks.config import resolve_config

    monkeypatch.setattr(resolve, "hub_commit", lambda name, revision: "c" * 40)  # no hub here (test_model_source reads a cache)
    with pytest.raises(ConfigError, match="--train_data"):
        resolve_config(preset="paper_32b", overrides_json="{}", total_steps=0, train_data="", val_data="", steps_per_chunk=0)
    config, step_config, data_config, _ = resolve_config(preset="paper_32b", overrides_json="{}", total_steps=0,
                                                         train_data="s3://b/dapo.parquet", val_data="s3://b/aime.parquet",
                                                         steps_per_chunk=0)
    assert config.train_data_path == data_config.train_data_path == step_config.train_data_path == "s3://b/dapo.parquet"
    assert config.model_revision == "c" * 40 and config.model_size_billions == 32.8  # pinned; the preset's size kept


def test_the_step_config_ignores_the_run_length_validation_and_tags_but_not_the_algorithm():
    """What the step tasks are cached on: the same for a longer run, other validation or
    tags or pod settings; different for anything a step computes with."""
    from tasks.config import resolve_config

    def step_config(total_steps: int, steps_per_chunk: int = 0, **overrides):
        return resolve_config(preset="tiny_cpu", overrides_json=json.dumps(overrides), total_steps=total_steps, train_data="",
                              val_data="", steps_per_chunk=steps_per_chunk)[1]

    base = step_config(30)
    assert step_config(35, val_every=1, extra={"team": "a"}, task_retries=3, gpu_accelerator="nvidia-h100") == base
    assert step_config(30, steps_per_chunk=3, chunk_timeout_minutes=60, measured_step_minutes=2.0) == base
    assert step_config(30, clip_high=0.3) != base and step_config(30, seed=1) != base
    assert base.clip_high == 0.28 and base.n_samples_per_prompt == 8  # the tiny_cpu values, typed


def test_each_presets_mlflow_run_key_is_the_one_0_2_0_gave_it_so_an_upgraded_run_logs_into_the_same_run():
    """tests/fixtures/run_keys_0.2.0.json: every preset's key, and one with overrides, as 0.2.0
    computed them. A field added since (tasks.common.RUN_KEY_FIELDS_ADDED) at the value runs
    had before it keeps the key; set to anything else, it is another run."""
    from dapo.config import DAPOConfig
    from tasks.common import RUN_KEY_FIELDS_ADDED, run_key

    recorded = json.loads((Path(__file__).parent / "fixtures" / "run_keys_0.2.0.json").read_text())
    assert {name: run_key(make()) for name, make in DAPOConfig.preset_factories().items()} == recorded["run_keys"]
    overridden = recorded["with_overrides"]
    config = DAPOConfig.preset(overridden["preset"], overridden["overrides"])
    assert run_key(config) == overridden["run_key"]
    assert set(RUN_KEY_FIELDS_ADDED) <= set(vars(config))  # each a field of the config
    assert run_key(config.replace(adv_estimator="rloo")) != run_key(config)


def test_multi_node_steps_write_under_their_run_on_the_shared_volume_and_prune_it(tmp_path):
    """Each run has its own directory on trainer_shared_dir (runs sharing the volume never
    prune each other), holding its newest shared_checkpoints_kept step checkpoints, and never
    pruning the checkpoint a step reads (in a local execution its input is on the volume)."""
    from dapo.config import DAPOConfig
    from tasks.train import step_output_dir

    config = DAPOConfig.tiny_cpu().replace(trainer_shared_dir=str(tmp_path), shared_checkpoints_kept=2)
    other = config.replace(seed=7)
    dirs = [step_output_dir(config, 0, "")]
    for step in range(1, 4):
        dirs.append(step_output_dir(config, step, dirs[-1]))
    other_dir = step_output_dir(other, 0, "")
    run_dir = Path(dirs[0]).parent
    assert Path(other_dir).parent != run_dir and Path(other_dir).exists()
    assert sorted(p.name.split("-")[1] for p in run_dir.iterdir()) == ["3", "4"]
    assert Path(dirs[-1]).exists()
    kept_one = config.replace(shared_checkpoints_kept=1)
    chain = [step_output_dir(kept_one, 0, "")]
    for step in range(1, 4):
        chain.append(step_output_dir(kept_one, step, chain[-1]))
    assert sorted(p.name.split("-")[1] for p in Path(chain[0]).parent.iterdir()) == ["3", "4"]  # step 3's input spared


def test_a_colocated_chunk_keeps_its_records_under_its_run_by_first_step_and_prunes_earlier_chunks(tmp_path):
    """Over several nodes a chunk's records are on trainer_shared_dir, under its run, named by
    the chunk's first step and input (not its last step: an extended run's longer chunk finds
    them); as a chunk starts, the records of the run's chunks that started before it go
    (their checkpoints are their tasks' outputs); a later chunk's, and other runs', stay."""
    from dapo.config import DAPOConfig
    from tasks.common import run_key
    from tasks.train import prune_earlier_chunks, records_dir

    config = DAPOConfig.tiny_cpu().replace(execution="colocated", trainer_nnodes=2, trainer_shared_dir=str(tmp_path),
                                           rollout_shards=2)
    policy = FlyteDirectory("s3://bucket/policy-10")
    current = records_dir(config, policy, 10)
    assert current.startswith(str(tmp_path / "colocated" / "run-"))
    assert records_dir(config.replace(total_steps=99), policy, 10) == current  # the run extended: the same records
    assert records_dir(config, FlyteDirectory("s3://bucket/other-policy-10"), 10) != current
    one_node = config.replace(trainer_nnodes=1, rollout_shards=1)
    assert Path(records_dir(one_node, policy, 10)).parent == Path(current).parent.parent / f"run-{run_key(one_node)}"  # a shared dir: there too
    assert records_dir(one_node.replace(trainer_shared_dir=""), policy, 10).startswith(
        str(Path.home() / ".flyte" / "dapo-colocated"))  # no shared dir: the pod's (or this machine's) disk
    run_dir = Path(current).parent
    for name in ("chunk-0-aaaa", "chunk-5-bbbb", "chunk-20-cccc", Path(current).name):
        (run_dir / name / "steps").mkdir(parents=True)
    other_run = records_dir(config.replace(seed=7), policy, 0)
    Path(other_run).mkdir(parents=True)
    assert sorted(prune_earlier_chunks(current, 10)) == ["chunk-0-aaaa", "chunk-5-bbbb"]
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(["chunk-20-cccc", Path(current).name])
    assert Path(other_run).exists()


def test_a_local_echo_passes_its_input_literal_on_so_a_cached_consumer_hits_on_the_rerun(tmp_path, monkeypatch):
    """As FlytePropeller's echo plugin on a cluster: the round's batch that keep_batch echoes
    reaches the policy step as the very literal filter_groups returned (its URI), so a local
    re-run or extension replays a step whose batch filled before its last round."""
    import pyarrow as pa
    from diskcache import Cache as DiskCache
    from flytekit import Cache, task, workflow
    from flytekit.core.local_cache import LocalTaskCache

    from tasks.rollout import keep_batch

    monkeypatch.setattr(LocalTaskCache, "_cache", DiskCache(str(tmp_path / "local-cache")))
    monkeypatch.setattr(LocalTaskCache, "_initialized", True)
    consumed = []

    @task(cache=Cache(version="1"))
    def make_batch(n: int) -> pa.Table:
        return pa.table({"x": list(range(n))})

    @task(cache=Cache(version="1"))
    def consume(batch: pa.Table) -> int:
        consumed.append(batch.num_rows)
        return batch.num_rows

    @workflow
    def echoed(n: int) -> int:
        return consume(batch=keep_batch(batch=make_batch(n=n)))

    assert echoed(n=3) == 3 and echoed(n=3) == 3
    assert consumed == [3]  # the second run's consume came from the cache


# --- transient faults are retried, deterministic ones are not -----------------------------
def transient_and_deterministic_errors():
    import errno

    from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, TEMPORARILY_UNAVAILABLE
    from requests.exceptions import ConnectionError as RequestsConnectionError

    from dapo.config import ConfigError
    from dapo.data.prompts import DataError
    from dapo.rewards import ScorerError
    from dapo.execution.stages.guard import RolloutMismatch

    def chained(outer: Exception, cause: Exception) -> Exception:
        try:
            raise outer from cause
        except Exception as error:
            return error

    def s3_error(code: str) -> ClientError:
        return ClientError({"Error": {"Code": code, "Message": code}}, "PutObject")

    transient = [
        ConnectionResetError(errno.ECONNRESET, "reset"), TimeoutError("read timed out"), OSError(errno.ETIMEDOUT, "timed out"),
        EndpointConnectionError(endpoint_url="http://minio:9000"), ReadTimeoutError(endpoint_url="http://minio:9000"),
        s3_error("SlowDown"), s3_error("ServiceUnavailable"), MlflowException("down", error_code=TEMPORARILY_UNAVAILABLE),
        chained(MlflowException("API request to /api/2.0/mlflow/runs/log-batch failed"), RequestsConnectionError("refused")),
        chained(RuntimeError("uploading the checkpoint failed"), ConnectionResetError("reset")),
    ]
    deterministic = [
        ConfigError("algorithm.clip_high=-1"), DataError("row 3"), ScorerError("scorer 'x' failed"), RolloutMismatch("gap"),
        KeyError("prompt"), ValueError("bad"), FileNotFoundError(errno.ENOENT, "no such checkpoint"), s3_error("NoSuchKey"),
        s3_error("AccessDenied"), MlflowException("bad", error_code=INVALID_PARAMETER_VALUE), MlflowException("no code"),
        chained(RuntimeError("scoring failed"), ScorerError("x")),
    ]
    return transient, deterministic


def test_network_and_object_store_faults_are_transient_and_mistakes_are_not():
    from dapo.faults import is_transient

    transient, deterministic = transient_and_deterministic_errors()
    assert [type(e).__name__ for e in transient if not is_transient(e)] == []
    assert [type(e).__name__ for e in deterministic if is_transient(e)] == []


def test_a_task_raises_a_transient_fault_as_recoverable_and_anything_else_as_it_was():
    import pytest
    from flytekit.exceptions.user import FlyteRecoverableException

    from tasks.common import task_entry

    transient, deterministic = transient_and_deterministic_errors()
    for error in transient + deterministic:
        @task_entry
        def body():
            raise error

        with pytest.raises(Exception) as raised:
            body()
        if error in transient:
            assert isinstance(raised.value, FlyteRecoverableException) and raised.value.__cause__ is error
            assert "error=transient, a retry may succeed: " in str(raised.value)
        else:
            assert raised.value is error
