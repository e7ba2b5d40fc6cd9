"""The cluster path, executed offline (issue 11): register the workflow as the README's
remote command does, then run the pods that command would start, each as a fresh process
in a directory standing for its image's /root, with its image's package set (tests/podsim.py).

One training step runs through the harness from the `train` dynamic down: train ->
bootstrap_policy -> evaluate + register_model (step 0) -> train_chunk -> sample_round (rollout and verify_rewards ArrayNodes, filter_groups) ->
the conditional round -> policy_step -> log_step -> evaluate -> register_model; then the
multi-node Elastic policy step that train_chunk emits for trainer_nnodes=2 runs as a
2-worker PyTorchJob on the same inputs, and train_chunk with execution="colocated" runs
its colocated_chunk_elastic (gpu image, a PyTorchJob of 2 workers: the steps of one process
sampling both shards) and log_chunk.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
from flyteidl.core import literals_pb2

import podsim

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.deepspeed]

# README / k8s/README.md: `export DAPO_IMAGE_REGISTRY=...; pyflyte run --remote --copy all workflows/dapo.py dapo_loop`
REGISTER_ARGS = os.environ.get("PODSIM_REGISTER_ARGS", "--copy all workflows/dapo.py dapo_loop").split()
REGISTRATION_ENV = {"DAPO_IMAGE_REGISTRY": "registry.podsim.test/dapo"}
DEFAULT_IMAGE_PACKAGES = ["flytekit"]
"""flytekit's default image (cr.flyte.org/flyteorg/flytekit): flytekit, none of the project's
dependencies. PODSIM_DEFAULT_IMAGE_ROLE=cpu runs it as the cpu image instead, to look past
issue 11's item 2 at what fails next."""
# One small step: few prompts, G=4, short answers, two generation rounds at most (the first
# usually fills the batch of 2, so the conditional round is keep_batch: one cheap pod).
SMALL = {
    "embedded_layout_noise": 0.6, "embedded_warm_start_steps": 4, "train_prompt_bsz": 2, "gen_prompt_bsz": 8, "n_samples_per_prompt": 4,
    "ppo_mini_batch_size": 2, "max_num_gen_batches": 2, "filter_metric": "reward", "max_response_length": 16,
    "overlong_buffer_len": 4, "val_every": 1, "val_n_samples": 2, "val_max_prompts": 8, "total_steps": 1,
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


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    """Register, build the step's inputs into the store, run one step; failures are kept, not raised."""
    from dapo import pipeline, tracking
    from dapo.config import DAPOConfig
    from tasks.data import POLICY_FIELDS

    root = tmp_path_factory.mktemp("podsim")
    store = root / "store"
    registration = podsim.register(root / "registration", store, REGISTER_ARGS, env=REGISTRATION_ENV)
    envs = podsim.ImageEnvs(podsim.image_envs_root())
    everything = requirement_names("gpu")

    def python_for(template):
        role = image_role(template.container.image, registration)
        have = requirement_names(role) if role else set(DEFAULT_IMAGE_PACKAGES)
        return envs.python(frozenset(everything - have))

    config = DAPOConfig.preset("tiny_cpu", {**SMALL, "steps_per_chunk": 1})
    pipeline.prepare_data(config, root / "data")
    target = tracking.RunTarget(f"sqlite:///{root / 'mlflow.db'}", "podsim", "podsim", "podsim")  # the "MLflow server"
    inputs = {
        "config": config, "step_config": config.step_config(), "policy_config": config.only(POLICY_FIELDS),
        "target_json": json.dumps(target.__dict__),
        "data": str(root / "data"), "loop_state": "", "model_name": "podsim-policy",
    }
    propeller = podsim.Propeller(store, python_for, env={"OMP_NUM_THREADS": "1"}, timeout=420, image_env=registration.image_env)
    state = {"registration": registration, "propeller": propeller, "config": config, "root": root, "error": None, "target": target,
             "inputs": to_literal_map(inputs, store), "outputs": None}
    try:
        state["outputs"] = propeller.run_task_node("train", registration.tasks["workflows.dapo.train"], state["inputs"], store / "train")
    except podsim.PodFailed as error:
        state["error"] = error
    return state


def to_literal_map(values: dict, store: Path) -> literals_pb2.LiteralMap:
    """Inputs of workflows.dapo.train, written by flytekit's type engine (directories uploaded to the store)."""
    from flytekit import FlyteContextManager
    from flytekit.core.data_persistence import FileAccessProvider
    from flytekit.core.type_engine import TypeEngine
    from flytekit.types.directory import FlyteDirectory

    from workflows.dapo import train

    hints = train.python_interface.inputs
    values = {k: FlyteDirectory(v) if k == "data" else v for k, v in values.items()}
    access = FileAccessProvider(local_sandbox_dir=str(store / "sandbox"), raw_output_prefix=str(store / "inputs"))
    with FlyteContextManager.with_context(FlyteContextManager.current_context().with_file_access(access)) as ctx:
        return TypeEngine.dict_to_literal_map(ctx, values, hints).to_flyte_idl()


def config_literal(config) -> literals_pb2.Literal:
    """A DAPOConfig as the literal a task input holds (flytekit's dataclass encoding)."""
    from flytekit import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine

    from dapo.config import DAPOConfig

    ctx = FlyteContextManager.current_context()
    return TypeEngine.to_literal(ctx, config, DAPOConfig, TypeEngine.to_literal_type(DAPOConfig)).to_flyte_idl()


def from_literal(literal: literals_pb2.Literal, python_type):
    from flytekit import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine
    from flytekit.models.literals import Literal

    return TypeEngine.to_python_value(FlyteContextManager.current_context(), Literal.from_flyte_idl(literal), python_type)


def task_name(template) -> str:
    """tasks.rollout.rollout -> rollout; a map task's name carries its function's name."""
    last = template.id.name.rsplit(".", 1)[-1]
    mapped = re.fullmatch(r"map_(\w+?)_[0-9a-f]+(?:-arraynode)?", last)
    return mapped.group(1) if mapped else last


def pods_of(sim, name: str) -> list[podsim.Pod]:
    return [p for p in sim["propeller"].pods if task_name(p.template) == name]


def failure(sim) -> str:
    error = sim["error"]
    return "" if error is None else f"the step stopped at {error.pod.node}:\n{error.pod.tail(3000)}"


def emitted(sim):
    """(dynamic node, task template) for every task a dynamic emitted in its futures.pb."""
    return [(node, t) for node, spec in sim["propeller"].dynamic_specs.items() for t in spec.tasks]


# --------------------------------------------------------------------------- checks


def test_dynamic_workflows_run_in_a_registered_project_image(sim):
    """train and train_chunk import workflows.dapo (torch, pyarrow, the PyTorch plugin):
    flytekit's default image has none of them (issue 11, item 2)."""
    registration = sim["registration"]
    dynamics = [registration.tasks["workflows.dapo.train"]] + [t for _, t in emitted(sim) if task_name(t) == "train_chunk"]
    assert len(dynamics) == 2, "train_chunk was never emitted: " + failure(sim)
    images = {task_name(t): t.container.image for t in dynamics}
    assert all(image in registration.image_specs for image in images.values()), (images, sorted(registration.image_specs))


def test_every_image_a_dynamic_emits_was_registered(sim):
    """Inside a pod the ImageSpecs are recomputed: their tags and registry must come out as
    registered, or every emitted task names an image nobody built (issue 11, item 1)."""
    pairs = emitted(sim)
    assert pairs, "no dynamic ran: " + failure(sim)
    unknown = {(node, task_name(t), t.container.image) for node, t in pairs
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
    from flytekit.types.directory import FlyteDirectory

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
    state = json.loads(from_literal(sim["outputs"].literals["loop_state"], str))
    assert state["last_val_step"] == 1 and state["outbox"] == "", state  # validated after the step; MLflow took every record
    from dapo import tracking

    history = tracking.run_history(sim["target"].tracking_uri, tracking.Tracker(sim["target"]).run_id)
    assert [h["step"] for h in history if "val/acc" in h] == [0, 1]
    assert FlyteDirectory  # (imported for the type engine's FlyteDirectory transformer)


def test_multi_node_elastic_step_emitted_by_train_chunk_loads_and_runs(sim):
    """train_chunk for trainer_nnodes=2 emits a PyTorchJob task: its resolver must load it in
    the pod (issue 11, item 3), and its two workers train the same batch as the step above."""
    chunks = [(node, t) for node, t in emitted(sim) if task_name(t) == "train_chunk"]
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

    from dapo import tracking
    from dapo.colocated import run_colocated
    from dapo.rollout import close_cached_rollout_engine
    from test_rollout import one_torch_thread

    chunks = [(node, t) for node, t in emitted(sim) if task_name(t) == "train_chunk"]
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
    assert sorted(task_name(t) for t in spec.tasks) == ["colocated_chunk_elastic", "log_chunk"]
    colocated = next(t for t in spec.tasks if task_name(t) == "colocated_chunk_elastic")
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
    logged = MlflowClient(sim["target"].tracking_uri).get_metric_history(tracking.Tracker(sim["target"]).run_id, "sampling/kept_groups")
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
