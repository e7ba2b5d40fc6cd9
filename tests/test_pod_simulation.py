"""The cluster path, executed offline: register the workflow as the README's
remote command does, then run the pods that command would start, each as a fresh process
in a directory standing for its image's /root, with its image's package set, under
propeller's retries, timeouts, disk limits and cache (tests/podsim.py).

The whole workflow runs from dapo_loop down, one step: resolve_config -> prepare_data (the
data read from S3 on loopback) -> start_tracking (a real MLflow server, its artifacts in
that S3) -> train -> bootstrap_policy -> evaluate + register_model (step 0) -> train_chunk ->
sample_round (rollout and verify_rewards ArrayNodes, filter_groups) -> the conditional round
-> policy_step -> log_step -> evaluate -> register_model -> finish_tracking. Then: the
multi-node Elastic policy step that train_chunk emits for trainer_nnodes=2 runs as a
2-worker PyTorchJob on the same inputs, and train_chunk with execution="colocated" runs its
colocated_chunk_elastic (gpu image, a PyTorchJob of 2 workers: the steps of one process
sampling both shards) and log_chunk. The same command executed again runs no step pod
(catalog hits); extended by a step it runs that step alone, a killed pod succeeding on its
retry; a node killed on every attempt fails the execution and runs the failure handler;
timeouts, the active deadline and eviction are shown on single nodes.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
import yaml
from flyteidl.core import literals_pb2

import podsim

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.deepspeed]

# README / k8s/README.md: `export DAPO_IMAGE_REGISTRY=...; pyflyte run --remote --copy all workflows/dapo.py dapo_loop`
REGISTER_ARGS = os.environ.get("PODSIM_REGISTER_ARGS", "--copy all workflows/dapo.py dapo_loop").split()
REGISTRATION_ENV = {"DAPO_IMAGE_REGISTRY": "registry.podsim.test/dapo"}
DEFAULT_IMAGE_PACKAGES = ["flytekit"]
"""flytekit's default image (cr.flyte.org/flyteorg/flytekit): flytekit, none of the project's
dependencies. PODSIM_DEFAULT_IMAGE_ROLE=cpu runs it as the cpu image instead, to look past
that failure at what fails next."""
# One small step: few prompts, G=4, short answers, two generation rounds at most (the first
# usually fills the batch of 2, so the conditional round is keep_batch: one cheap pod).
SMALL = {
    "embedded_layout_noise": 0.6, "embedded_warm_start_steps": 4, "train_prompt_bsz": 2, "gen_prompt_bsz": 8, "n_samples_per_prompt": 4,
    "ppo_mini_batch_size": 2, "max_num_gen_batches": 2, "filter_metric": "reward", "max_response_length": 16,
    "overlong_buffer_len": 4, "val_every": 1, "val_n_samples": 2, "val_max_prompts": 8,
}
STEP_TASKS = ["bootstrap_policy", "rollout", "verify_rewards", "filter_groups", "policy_step", "log_step", "evaluate", "register_model"]


def requirement_names(role: str) -> set[str]:
    from images import pins

    return {re.split(r"[\[=<>]", line)[0] for line in pins.requirements(role)}


def image_role(image: str, registration: podsim.Registration) -> str:
    """The role of an image: its ImageSpec's name (dapo-<role>), else the repository name, so
    an image that was not registered under this tag still runs with its role's packages."""
    name = registration.image_specs.get(image) or image.rsplit("/", 1)[-1].split(":")[0]
    return name.removeprefix("dapo-") if name.startswith("dapo-") else os.environ.get("PODSIM_DEFAULT_IMAGE_ROLE", "")


WORKFLOW = "workflows.dapo.dapo_loop"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, s3):
    """What the pods run against: the registration, an object store (S3 on loopback) holding
    the training data, a real MLflow server (--serve-artifacts, its artifacts in that S3),
    and the catalog every execution shares."""
    from dapo.execution.stages import setup
    from dapo.config import DAPOConfig
    from servers import BUCKET, S3_ENV, s3_client, start_mlflow, stop

    root = tmp_path_factory.mktemp("podsim")
    store = root / "store"
    registration = podsim.register(root / "registration", store, REGISTER_ARGS, env=REGISTRATION_ENV)
    envs = podsim.ImageEnvs(podsim.image_envs_root())
    everything = requirement_names("gpu")

    def python_for(template):
        role = image_role(template.container.image, registration)
        have = requirement_names(role) if role else set(DEFAULT_IMAGE_PACKAGES)
        return envs.python(frozenset(everything - have))

    setup.prepare_data(DAPOConfig.preset("tiny_cpu", SMALL), root / "data")  # the embedded task's files, put in the store
    for name in (setup.TRAIN_FILE, setup.VAL_FILE):
        s3_client(s3).upload_file(str(root / "data" / name), BUCKET, f"data/{name}")
    mlflow, tracking_uri = start_mlflow(root, artifacts=f"s3://{BUCKET}/mlflow", s3_endpoint=s3)
    limit_range = yaml.safe_load((REPO / "k8s" / "04-limitrange.yaml").read_text())["spec"]["limits"]
    default_disk = next(limit["default"]["ephemeral-storage"] for limit in limit_range if limit["type"] == "Container")
    env = {"OMP_NUM_THREADS": "1", **S3_ENV, "FLYTE_AWS_ENDPOINT": s3, "FLYTE_AWS_ACCESS_KEY_ID": "test",
           "FLYTE_AWS_SECRET_ACCESS_KEY": "test"}
    try:
        yield {"registration": registration, "root": root, "store": store, "python_for": python_for, "env": env,
               "catalog": podsim.Catalog(store / "catalog"), "tracking_uri": tracking_uri,
               "default_disk_limit": podsim.quantity_bytes(default_disk),
               "data": {"train_data": f"s3://{BUCKET}/data/{setup.TRAIN_FILE}", "val_data": f"s3://{BUCKET}/data/{setup.VAL_FILE}"}}
    finally:
        stop(mlflow)


def execute(cluster, name: str, faults: dict | None = None, **inputs) -> dict:
    """One execution of `pyflyte run --remote ... dapo_loop` with these inputs (the rest the
    README's), every pod in the simulator; failures are kept, not raised."""
    registration = cluster["registration"]
    propeller = podsim.Propeller(cluster["store"], cluster["python_for"], env=dict(cluster["env"]), timeout=420,
                                 image_env=registration.image_env, catalog=cluster["catalog"], execution=name, faults=faults or {},
                                 default_disk_limit=cluster["default_disk_limit"])
    values = {"preset": "tiny_cpu", "overrides_json": json.dumps(SMALL), "total_steps": 1, **cluster["data"],
              "mlflow_tracking_uri": cluster["tracking_uri"], "mlflow_experiment": "podsim", "model_name": "podsim-policy",
              "steps_per_chunk": 1, "config_file": "", "set": "", **inputs}
    hits_before = len(cluster["catalog"].hits)
    state = {"propeller": propeller, "registration": registration, "root": cluster["root"], "error": None, "outputs": None,
             "config": resolved_config(values)}
    try:
        state["outputs"] = propeller.run_workflow(registration.workflows[WORKFLOW], registration.tasks, workflow_inputs(values))
    except podsim.PodFailed as error:
        state["error"] = error
    state["cache_hits"] = cluster["catalog"].hits[hits_before:]
    return state


def resolved_config(values: dict):
    from tasks.config import resolve

    return resolve(values["preset"], values["overrides_json"], values["total_steps"], values["train_data"], values["val_data"],
                   values["steps_per_chunk"], values["config_file"], values["set"])


@pytest.fixture(scope="module")
def sim(cluster):
    """The first execution: one step, the whole workflow from dapo_loop down."""
    return execute(cluster, "podsim-first")


def workflow_inputs(values: dict) -> literals_pb2.LiteralMap:
    """dapo_loop's inputs as the launch plan gives them, written by flytekit's type engine."""
    from flytekit import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine

    from workflows.dapo import dapo_loop

    ctx = FlyteContextManager.current_context()
    return TypeEngine.dict_to_literal_map(ctx, values, dapo_loop.python_interface.inputs).to_flyte_idl()


def summary_of(state):
    from tasks.tracking import RunSummary

    return from_literal(state["outputs"].literals["summary"], RunSummary)


def config_literal(config) -> literals_pb2.Literal:
    """A config (a DAPOConfig, a StepConfig) as the literal a task input holds (flytekit's dataclass encoding)."""
    from flytekit import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine

    ctx = FlyteContextManager.current_context()
    return TypeEngine.to_literal(ctx, config, type(config), TypeEngine.to_literal_type(type(config))).to_flyte_idl()


def from_literal(literal: literals_pb2.Literal, python_type):
    from flytekit import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine
    from flytekit.models.literals import Literal

    return TypeEngine.to_python_value(FlyteContextManager.current_context(), Literal.from_flyte_idl(literal), python_type)


def pods_of(sim, name: str) -> list[podsim.Pod]:
    return [p for p in sim["propeller"].pods if podsim.task_name(p.template) == name]


def failure(sim) -> str:
    return "" if sim["error"] is None else f"the execution stopped: {sim['error']}"


def emitted(sim):
    """(dynamic node, task template) for every task a dynamic emitted in its futures.pb."""
    return [(node, t) for node, spec in sim["propeller"].dynamic_specs.items() for t in spec.tasks]


# --------------------------------------------------------------------------- checks


def test_dynamic_workflows_run_in_a_registered_project_image(sim):
    """train and train_chunk import workflows.dapo (torch, pyarrow, the PyTorch plugin):
    flytekit's default image has none of them."""
    registration = sim["registration"]
    dynamics = [registration.tasks["workflows.dapo.train"]] + [t for _, t in emitted(sim) if podsim.task_name(t) == "train_chunk"]
    assert len(dynamics) == 2, "train_chunk was never emitted: " + failure(sim)
    images = {podsim.task_name(t): t.container.image for t in dynamics}
    assert all(image in registration.image_specs for image in images.values()), (images, sorted(registration.image_specs))


def test_every_image_a_dynamic_emits_was_registered(sim):
    """Inside a pod the ImageSpecs are recomputed: their tags and registry must come out as
    registered, or every emitted task names an image nobody built."""
    pairs = emitted(sim)
    assert pairs, "no dynamic ran: " + failure(sim)
    unknown = {(node, podsim.task_name(t), t.container.image) for node, t in pairs
               if t.HasField("container") and t.container.image not in sim["registration"].images}  # echo tasks have none
    assert not unknown, f"emitted but never registered: {sorted(unknown)}; registered: {sorted(sim['registration'].images)}"


@pytest.mark.parametrize("name", STEP_TASKS)
def test_each_step_task_loads_runs_and_writes_its_outputs(sim, name):
    pods = pods_of(sim, name)
    assert pods, f"no {name} pod ran: " + failure(sim)
    for pod in pods:
        assert not pod.failed, pod.tail()
        assert (pod.prefix / "outputs.pb").exists(), pod.tail()


def test_one_step_through_the_store_gives_a_new_checkpoint_and_finite_metrics(sim):
    assert sim["outputs"] is not None, failure(sim)
    store = sim["root"] / "store"
    policy = sim["outputs"].literals["policy"].scalar.blob.uri
    assert policy.startswith(str(store)) and (Path(policy) / "model.safetensors").exists()
    step_inputs = podsim._read(literals_pb2.LiteralMap, pods_of(sim, "policy_step")[0].prefix / "inputs.pb")
    assert policy != step_inputs.literals["policy"].scalar.blob.uri  # a new checkpoint
    step = pods_of(sim, "policy_step")[0]
    metrics = from_literal(podsim._read(literals_pb2.LiteralMap, step.prefix / "outputs.pb").literals["metrics"], dict[str, float])
    assert metrics and all(math.isfinite(v) for v in metrics.values()), metrics
    # the conditional takes the branch the first round's filter_groups decided: another
    # sample_round while the batch is short, else echo tasks without a pod (keep_batch ...)
    first_filter = pods_of(sim, "filter_groups")[0]
    done = from_literal(podsim._read(literals_pb2.LiteralMap, first_filter.prefix / "outputs.pb").literals["o2"], bool)
    rounds, echoed = len(pods_of(sim, "rollout")), sorted(sim["propeller"].echoed)
    expected = (1, ["keep_batch", "keep_done", "keep_sampling_state"]) if done else (2, [])
    assert (rounds, echoed) == expected, (done, rounds, echoed)
    assert len(pods_of(sim, "filter_groups")) == rounds


def test_the_whole_workflow_runs_as_pods_from_the_s3_data_to_a_finished_mlflow_run(sim, cluster):
    """dapo_loop from its first node: resolve_config, prepare_data reading the data from S3,
    start_tracking, train, finish_tracking, each a pod; the MLflow server has the run
    FINISHED, its validations and a model version per validation, in S3."""
    from mlflow.tracking import MlflowClient

    from servers import BUCKET, s3_client

    assert sim["outputs"] is not None, failure(sim)
    for name in ("resolve_config", "prepare_data", "start_tracking", "train", "finish_tracking"):
        assert len(pods_of(sim, name)) == 1, name
    prepare = pods_of(sim, "prepare_data")[0]
    assert f"s3://{BUCKET}/data/" in str(podsim._read(literals_pb2.LiteralMap, prepare.prefix / "inputs.pb").literals["config"])
    summary = summary_of(sim)
    assert (summary.final_step, summary.undelivered_records, summary.mlflow_tracking_uri) == (1, 0, cluster["tracking_uri"])
    assert [int(pair.split(":")[0]) for pair in summary.val_acc_curve.split(", ")] == [0, 1]
    client = MlflowClient(cluster["tracking_uri"], registry_uri=cluster["tracking_uri"])
    assert client.get_run(summary.mlflow_run_id).info.status == "FINISHED"
    versions = client.search_model_versions("name = 'podsim-policy'")
    assert sorted(int(v.tags["step"]) for v in versions) == [0, 1]
    objects = s3_client(cluster["env"]["FLYTE_AWS_ENDPOINT"]).list_objects_v2(Bucket=BUCKET, Prefix="mlflow/")["Contents"]
    assert sum(key["Key"].endswith("/model.safetensors") for key in objects) == 2


def test_every_pod_stays_within_its_ephemeral_storage(sim, cluster):
    """Each pod's files (the unpacked code, flytekit's sandbox, our scratch space) against
    its ephemeral-storage limit: its node's, else the namespace LimitRange's default
    (k8s/04-limitrange.yaml); every step pod states its own."""
    assert sim["outputs"] is not None, failure(sim)
    pods = sim["propeller"].pods
    stated = {podsim.task_name(pod.template) for pod in pods if pod.disk_limit != cluster["default_disk_limit"]}
    assert set(STEP_TASKS) <= stated, set(STEP_TASKS) - stated
    over = [(pod.node, pod.disk_peak, pod.disk_limit) for pod in pods if pod.disk_peak > pod.disk_limit]
    assert not over and all(pod.disk_peak > 0 for pod in pods), over


def test_multi_node_elastic_step_emitted_by_train_chunk_loads_and_runs(sim):
    """train_chunk for trainer_nnodes=2 emits a PyTorchJob task: its resolver must load it in
    the pod, and its two workers train the same batch as the step above."""
    chunks = [(node, t) for node, t in emitted(sim) if podsim.task_name(t) == "train_chunk"]
    steps = pods_of(sim, "policy_step")
    assert chunks and steps, "the step did not reach policy_step: " + failure(sim)
    propeller, root = sim["propeller"], sim["root"]
    config = sim["config"].replace(trainer_nnodes=2, trainer_nproc_per_node=1, trainer_shared_dir=str(root / "shared"))
    chunk_inputs = podsim._read(literals_pb2.LiteralMap, pods_of(sim, "train_chunk")[0].prefix / "inputs.pb")
    chunk_inputs.literals["config"].CopyFrom(config_literal(config))
    chunk_inputs.literals["step_config"].CopyFrom(config_literal(config.step_config()))
    prefix = root / "store" / "elastic-chunk"
    pod = propeller.run_pod("elastic-chunk", chunks[0][1], chunk_inputs, prefix)
    assert not pod.failed, pod.tail()
    spec = podsim._read(podsim.dynamic_job_pb2.DynamicJobSpec, prefix / "futures.pb")
    elastic = [t for t in spec.tasks if t.type == "pytorch"]
    assert len(elastic) == 1 and elastic[0].custom["workerReplicas"]["replicas"] == 2
    args = list(elastic[0].container.args)
    assert args[args.index("--resolver") + 1] == "tasks.train.elastic_resolver", args[args.index("--resolver"):]
    step_inputs = podsim._read(literals_pb2.LiteralMap, steps[0].prefix / "inputs.pb")
    step_inputs.literals["config"].CopyFrom(config_literal(config.step_config()))
    outputs = propeller.run_task_node("elastic-step", elastic[0], step_inputs, root / "store" / "elastic-step")
    assert (Path(outputs.literals["policy"].scalar.blob.uri) / "model.safetensors").exists()
    metrics = from_literal(outputs.literals["metrics"], dict[str, float])
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert elastic[0].container.image in sim["registration"].images


def test_colocated_chunk_emitted_by_train_chunk_runs_as_a_pytorch_job_in_the_gpu_image(sim, tmp_path):
    """train_chunk for execution="colocated" over 2 nodes of one GPU, from the inputs of the
    per-stage chunk above (2 steps of 4, no validation in them: evaluate and register_model
    on a colocated chunk's checkpoint run in test_workflow_local): it emits one
    colocated_chunk_elastic (a PyTorchJob in the gpu image) and no per-stage node; its
    resolver loads it in both worker pods, each a DeepSpeed rank and a vLLM engine (external
    launcher) sampling one rollout shard of each round; they keep their records on the
    shared volume, the steps reach MLflow, then log_chunk runs. The first attempt is
    SIGKILLed in step 1's rollout (both workers); the node's retry goes on after the step-0
    record on the shared volume (step 0 is not run or logged again). The steps are those of one
    process sampling both shards (run here): the same tokens, groups, rewards and update
    counts, losses and weights within 1e-4, and step 1, sampled by both engines after the
    in-memory sync, as close to the trainer as one engine's."""
    import torch
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file

    from dapo.execution.colocated import run_colocated
    from dapo.engines.rollout import close_cached_rollout_engine
    from engines import one_torch_thread

    chunks = [(node, t) for node, t in emitted(sim) if podsim.task_name(t) == "train_chunk"]
    assert chunks, "train_chunk was never emitted: " + failure(sim)
    propeller, root = sim["propeller"], sim["root"]
    config = sim["config"].replace(execution="colocated", trainer_nnodes=2, trainer_nproc_per_node=1, rollout_shards=2,
                                   trainer_shared_dir=str(root / "shared-colocated"), total_steps=4, val_every=0,
                                   zero_stage=3)  # paper_32b's: each parameter gathered from both ranks for the sync
    chunk_inputs = podsim._read(literals_pb2.LiteralMap, pods_of(sim, "train_chunk")[0].prefix / "inputs.pb")
    chunk_inputs.literals["config"].CopyFrom(config_literal(config))
    chunk_inputs.literals["step_config"].CopyFrom(config_literal(config.step_config()))
    chunk_inputs.literals["last_step"].scalar.primitive.integer = 2
    propeller.env["DAPO_CRASH_AT"] = "rollout@1"
    with pytest.raises(podsim.PodFailed):
        propeller.run_task_node("colocated-chunk-killed", chunks[0][1], chunk_inputs, root / "store" / "colocated-chunk-killed")
    del propeller.env["DAPO_CRASH_AT"]
    killed_records = sorted(p.name for p in (root / "shared-colocated" / "colocated").glob("run-*/chunk-0-*/steps/*.json"))
    assert killed_records == ["0.json"], killed_records
    outputs = propeller.run_task_node("colocated-chunk", chunks[0][1], chunk_inputs, root / "store" / "colocated-chunk")
    spec = propeller.dynamic_specs["colocated-chunk"]
    assert sorted(podsim.task_name(t) for t in spec.tasks) == ["colocated_chunk_elastic", "log_chunk"]
    colocated = next(t for t in spec.tasks if podsim.task_name(t) == "colocated_chunk_elastic")
    assert colocated.type == "pytorch" and colocated.custom["workerReplicas"]["replicas"] == 2
    assert image_role(colocated.container.image, sim["registration"]) == "gpu"
    args = list(colocated.container.args)
    assert args[args.index("--resolver") + 1:] == ["tasks.train.elastic_resolver", "--", "colocated_chunk", "nnodes", "2",
                                                   "nproc-per-node", "1"]
    pod = pods_of(sim, "colocated_chunk_elastic")[-1]  # the retry's
    chunk_outputs = podsim._read(literals_pb2.LiteralMap, pod.prefix / "outputs.pb")
    metrics = from_literal(chunk_outputs.literals["metrics"], list[dict[str, float]])
    assert len(metrics) == 2 and all(math.isfinite(v) for m in metrics for v in m.values()), metrics
    checkpoint_dir = Path(chunk_outputs.literals["policy"].scalar.blob.uri)
    assert (Path(outputs.literals["policy"].scalar.blob.uri) / "model.safetensors").exists()  # the chunk dynamic's output
    records = sorted(p.name for p in (root / "shared-colocated" / "colocated").glob("run-*/chunk-0-*/steps/*.json"))
    assert records == ["0.json", "1.json"], "the chunk's step records are not on the shared volume"
    summary = summary_of(sim)
    logged = MlflowClient(summary.mlflow_tracking_uri).get_metric_history(summary.mlflow_run_id, "sampling/kept_groups")
    # the per-stage step 1, then the colocated step 2: its step 1 is the same step of the same run (run key), logged once
    assert sorted(m.step for m in logged) == [1, 2]

    policy_dir, data_dir = (chunk_inputs.literals[name].scalar.blob.uri for name in ("policy", "data"))
    try:
        with one_torch_thread():
            alone = run_colocated(config.replace(trainer_nnodes=1, trainer_shared_dir=""), policy_dir, data_dir, 0, 2, tmp_path)
    finally:
        close_cached_rollout_engine()
    exact = ("rollout/tokens", "sampling/kept_groups", "sampling/rounds", "train/reward_mean", "train/acc", "actor/num_updates",
             "step/skipped", "guard/regenerated")
    for step, (ranks, single) in enumerate(zip(metrics, alone.step_metrics, strict=True)):
        assert {k: ranks[k] for k in exact} == {k: single[k] for k in exact}, f"step {step}"
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
            assert math.isclose(ranks[key], single[key], rel_tol=1e-4, abs_tol=1e-7), (step, key)
    assert metrics[1]["guard/rollout_logprob_gap"] < 1e-5 and metrics[1]["sync/seconds"] > 0
    both, single = load_file(checkpoint_dir / "model.safetensors"), load_file(Path(alone.checkpoint_dir) / "model.safetensors")
    assert both.keys() == single.keys()
    for name in both:
        torch.testing.assert_close(both[name], single[name], rtol=1e-4, atol=1e-6, msg=name)


# --------------------------------------------------------------------- propeller's semantics

STEP_POD_TASKS = {"prepare_data", "start_tracking", *STEP_TASKS}
"""Every cached task of an execution: what a second execution of the same command takes from the catalog."""


@pytest.fixture(scope="module")
def again(cluster, sim):
    """The same command executed a second time."""
    return execute(cluster, "podsim-again")


def test_a_second_execution_of_the_same_command_runs_no_step_pod(sim, again):
    """Every cached task is a catalog hit (keyed by its cache version, interface and input
    hashes); only resolve_config (not cached: a config file or a user's function it reads
    may have changed), the dynamic workflows' pods (which emit the nodes) and finish_tracking
    (not cached: every execution ends its run) run, and the result is the same checkpoint."""
    assert again["outputs"] is not None, failure(again)
    ran = {podsim.task_name(pod.template) for pod in again["propeller"].pods}
    assert ran == {"resolve_config", "train", "train_chunk", "finish_tracking"}, ran
    hit = {task for _, task in again["cache_hits"]}
    assert hit == STEP_POD_TASKS, hit ^ STEP_POD_TASKS
    assert again["outputs"].literals["policy"] == sim["outputs"].literals["policy"]
    assert summary_of(again).mlflow_run_id == summary_of(sim).mlflow_run_id


@pytest.fixture(scope="module")
def extended(cluster, again):
    """The run extended by a step, with a retry allowed, and step 2's policy-step pod killed
    as it starts (a lost node)."""
    return execute(cluster, "podsim-extended", total_steps=2, overrides_json=json.dumps({**SMALL, "task_retries": 1}),
                   faults={"policy_step": ["kill"]})


def test_an_extension_runs_only_the_new_step_and_a_killed_pod_succeeds_on_its_retry(sim, extended):
    from mlflow.tracking import MlflowClient

    assert extended["outputs"] is not None, failure(extended)
    pods = extended["propeller"].pods
    ran = sorted(podsim.task_name(pod.template) for pod in pods if podsim.task_name(pod.template) in STEP_TASKS)
    rounds = len(pods_of(extended, "rollout"))
    assert ran == sorted(["rollout", "verify_rewards", "filter_groups"] * rounds + ["policy_step"] * 2
                         + ["log_step", "evaluate", "register_model"]), ran  # step 2 only; no bootstrap, no step-1 pod
    killed, retried = pods_of(extended, "policy_step")
    assert (killed.attempt, killed.ended_by, killed.failed) == (0, "kill", True)
    assert (retried.attempt, retried.failed) == (1, False) and retried.prefix == killed.prefix / "attempt-1"
    summary = summary_of(extended)
    assert summary.final_step == 2 and summary.mlflow_run_id == summary_of(sim).mlflow_run_id
    client = MlflowClient(summary.mlflow_tracking_uri, registry_uri=summary.mlflow_tracking_uri)
    assert client.get_run(summary.mlflow_run_id).info.status == "FINISHED"
    assert sorted(int(v.tags["step"]) for v in client.search_model_versions("name = 'podsim-policy'")) == [0, 1, 2]


@pytest.fixture(scope="module")
def failed(cluster, extended):
    """Extended once more, with step 3's rollout pod killed on both its attempts."""
    return execute(cluster, "podsim-failed", total_steps=3, overrides_json=json.dumps({**SMALL, "task_retries": 1}),
                   faults={"rollout": ["kill", "kill"]})


def test_a_node_failing_every_attempt_fails_the_execution_and_runs_the_failure_handler(sim, failed):
    """Propeller's message for a node out of retries reaches end_failed_run as `err`, which
    ends the MLflow run KILLED (killed from outside: a resume may succeed), with the error."""
    from mlflow.tracking import MlflowClient

    error = failed["error"]
    assert error is not None and error.reason.startswith("[2/2] currentAttempt done. Last Error: USER::Pod failed."), failure(failed)
    assert "exit code (137)" in error.reason and [p.attempt for p in pods_of(failed, "rollout")] == [0, 1]
    handler = pods_of(failed, "end_failed_run")
    assert len(handler) == 1 and not handler[0].failed, handler[0].tail() if handler else "no failure handler ran"
    summary = summary_of(sim)
    run = MlflowClient(summary.mlflow_tracking_uri).get_run(summary.mlflow_run_id)
    assert run.info.status == "KILLED", run.info.status
    assert "exit code (137)" in run.data.tags["flyte.error"] and run.data.tags["flyte.failed_node"] == error.pod.node


def one_task_node(sim, name: str, **metadata):
    """The template and recorded inputs of sim's `name` pod, and a compiled node for it
    with the given retries and timeout (seconds) and an optional ephemeral-storage limit."""
    from flyteidl.core import tasks_pb2, workflow_pb2
    from google.protobuf.duration_pb2 import Duration

    pod = pods_of(sim, name)[0]
    node = workflow_pb2.Node(id="n0")
    node.metadata.retries.retries = metadata.get("retries", 0)
    if metadata.get("timeout_s"):
        node.metadata.timeout.CopyFrom(Duration(seconds=metadata["timeout_s"]))
    if metadata.get("disk"):
        entry = tasks_pb2.Resources.ResourceEntry(name=tasks_pb2.Resources.EPHEMERAL_STORAGE, value=metadata["disk"])
        node.task_node.overrides.resources.limits.append(entry)
    return pod.template, podsim._read(literals_pb2.LiteralMap, pod.prefix / "inputs.pb"), node


def bare_propeller(cluster, **settings) -> podsim.Propeller:
    return podsim.Propeller(cluster["store"], cluster["python_for"], env=dict(cluster["env"]), timeout=420,
                            image_env=cluster["registration"].image_env, execution="podsim-limits", **settings)


def test_a_hung_pod_is_ended_at_its_timeout_and_the_retry_succeeds(sim, cluster, tmp_path):
    """A 1-minute timeout (20 s here: seconds_per_minute=20) bounds each attempt; a timeout
    is a retryable failure."""
    template, inputs, node = one_task_node(sim, "resolve_config", retries=2, timeout_s=60)
    propeller = bare_propeller(cluster, seconds_per_minute=20, faults={"resolve_config": ["freeze"]})
    outputs = propeller.run_task_node("hung", template, inputs, tmp_path / "hung", compiled_node=node)
    assert [(p.attempt, p.ended_by) for p in propeller.pods] == [(0, "timeout"), (1, "")]
    assert outputs.literals.keys() == podsim._read(literals_pb2.LiteralMap, pods_of(sim, "resolve_config")[0].prefix / "outputs.pb").literals.keys()


def test_all_attempts_together_end_at_twice_the_timeout(sim, cluster, tmp_path):
    """Propeller's active deadline: twice the timeout from when the node started, whatever
    retries are left (the third attempt never starts)."""
    template, inputs, node = one_task_node(sim, "resolve_config", retries=2, timeout_s=60)
    propeller = bare_propeller(cluster, seconds_per_minute=3, faults={"resolve_config": ["freeze"] * 3})
    with pytest.raises(podsim.PodFailed, match=r"task active timeout \[120s\] expired"):
        propeller.run_task_node("hung-always", template, inputs, tmp_path / "hung-always", compiled_node=node)
    assert [(p.attempt, p.ended_by) for p in propeller.pods] == [(0, "timeout"), (1, "timeout")]


def test_a_pod_that_outgrows_its_ephemeral_storage_is_evicted_and_retried_as_a_system_failure(sim, cluster, tmp_path):
    """An eviction is the platform's failure: retried under propeller's system-failure budget
    (1 here), although the node has no retries of its own."""
    template, inputs, node = one_task_node(sim, "resolve_config", disk="64Ki")
    propeller = bare_propeller(cluster, max_system_failures=1)
    with pytest.raises(podsim.PodFailed, match=r"\[2/2\] system failures\. Last Error: SYSTEM::Pod was evicted: ephemeral local storage usage"):
        propeller.run_task_node("too-big", template, inputs, tmp_path / "too-big", compiled_node=node)
    assert [(pod.attempt, pod.ended_by) for pod in propeller.pods] == [(0, "evicted"), (1, "evicted")]
    assert all(pod.disk_limit == 64 * 1024 < pod.disk_peak for pod in propeller.pods)


def checkpoint_hash(outputs: literals_pb2.LiteralMap) -> str:
    """The content hash a step's output checkpoint carries (its cache key downstream)."""
    (policy,) = [literal for literal in outputs.literals.values() if literal.hash]
    return policy.hash


def test_a_transient_fault_in_a_policy_step_is_retried_and_the_retry_writes_the_same_checkpoint(sim, cluster, tmp_path):
    """The first attempt's code meets a connection reset by the object store (dapo.faults'
    DAPO_TRANSIENT_AT): task_entry raises it as recoverable, the node's one retry runs it again."""
    template, inputs, node = one_task_node(sim, "policy_step", retries=1)
    propeller = bare_propeller(cluster)
    outputs = propeller.run_task_node("transient", template, inputs, tmp_path / "transient", compiled_node=node,
                                      extra_env={"DAPO_TRANSIENT_AT": "policy_step@0"})
    first, retry = propeller.pods
    assert first.failed and first.retryable and first.error.startswith("USER::")
    assert "error=transient, a retry may succeed: ConnectionResetError: [Errno 104] the object store reset the connection" in first.error
    assert (retry.attempt, retry.failed) == (1, False)
    original = podsim._read(literals_pb2.LiteralMap, pods_of(sim, "policy_step")[0].prefix / "outputs.pb")
    assert checkpoint_hash(outputs) == checkpoint_hash(original)  # the same weights as the run without the fault


def test_a_bad_data_row_fails_at_once_whatever_the_retries(sim, cluster, tmp_path, s3):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dapo.config import DAPOConfig
    from dapo.execution.stages import setup
    from servers import BUCKET, s3_client

    table = pq.read_table(cluster["root"] / "data" / setup.TRAIN_FILE)
    prompts = table.column("prompt")
    bad = table.set_column(table.schema.get_field_index("prompt"), "prompt",
                           pa.array([[]] + prompts.to_pylist()[1:], type=prompts.type))  # row 0: an empty chat
    pq.write_table(bad, tmp_path / "bad.parquet")
    s3_client(s3).upload_file(str(tmp_path / "bad.parquet"), BUCKET, "data/bad.parquet")
    config = DAPOConfig.preset("tiny_cpu", {**SMALL, "train_data_path": f"s3://{BUCKET}/data/bad.parquet",
                                             "val_data_path": cluster["data"]["val_data"]}).section("data")
    template, _, node = one_task_node(sim, "prepare_data", retries=2)
    propeller = bare_propeller(cluster)
    with pytest.raises(podsim.PodFailed, match="DataError") as failed:
        propeller.run_task_node("bad-row", template, literals_pb2.LiteralMap(literals={"config": config_literal(config)}),
                                tmp_path / "bad-row", compiled_node=node)
    assert [pod.attempt for pod in propeller.pods] == [0]  # non-recoverable: its 2 retries are not used
    assert "row 0" in str(failed.value) and not failed.value.pod.retryable
