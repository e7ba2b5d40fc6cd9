"""What `pyflyte run --remote` would register, inspected without a cluster."""

import datetime
import inspect
import os
from collections import OrderedDict

import pytest
from flytekit import LaunchPlan
from flytekit.configuration import Image, ImageConfig, SerializationSettings
from flytekit.tools.translator import get_serializable
from flytekit.types.directory import FlyteDirectory

import workflows.dapo as dapo_workflow
from dapo.config import DAPOConfig
from dapo.execution.schedule import chunk_ranges, is_validation_step
from images.specs import CPU_IMAGE, GPU_IMAGE, ROLLOUT_IMAGE, TRAINER_IMAGE
from dapo.code_version import source_version
from dapo.tracking import LoopState, RunTarget
from tasks import data, evaluate, rollout, tracking, train
from tasks.config import resolve_config

TARGET = RunTarget("sqlite:///mlflow.db", "dapo", "run-key", "run-name")

SETTINGS = SerializationSettings(
    image_config=ImageConfig(default_image=Image(name="default", fqn="registry.example/default", tag="v1")),
    project="dapo", domain="development", version="test",
)
GPU_TASKS = {"rollout": rollout.rollout, "policy_step": train.policy_step, "evaluate": evaluate.evaluate,
             "colocated_chunk": train.colocated_chunk}
CPU_TASKS = {
    "resolve_config": resolve_config, "prepare_data": data.prepare_data, "verify_rewards": rollout.verify_rewards,
    "filter_groups": rollout.filter_groups, "log_step": tracking.log_step, "register_model": tracking.register_model,
}


def serialize(entity):
    return get_serializable(OrderedDict(), SETTINGS, entity)


def requests_of(template) -> dict[str, str]:
    names = {1: "cpu", 2: "gpu", 3: "memory", 4: "storage", 5: "ephemeral_storage"}
    return {names.get(r.name, str(r.name)): r.value for r in template.container.resources.requests}


@pytest.mark.parametrize("name", sorted(GPU_TASKS))
def test_gpu_tasks_request_a_gpu_on_the_gpu_pod_template(name):
    template = serialize(GPU_TASKS[name]).template
    assert requests_of(template)["gpu"] == "1"
    # /dev/shm comes from the pod template (k8s/20-flyte-podtemplates.yaml), never twice
    assert template.metadata.pod_template_name == "dapo-gpu"
    assert not template.extended_resources or not template.extended_resources.HasField("shared_memory")
    expected_image = {"policy_step": TRAINER_IMAGE, "colocated_chunk": GPU_IMAGE}.get(name, ROLLOUT_IMAGE)
    assert template.container.image.startswith(expected_image.image_name().split(":")[0])


@pytest.mark.parametrize("name", sorted(CPU_TASKS))
def test_cpu_tasks_use_the_light_image_and_no_gpu(name):
    template = serialize(CPU_TASKS[name]).template
    assert "gpu" not in requests_of(template) and not template.metadata.pod_template_name
    assert template.container.image.startswith(CPU_IMAGE.image_name().split(":")[0])


@pytest.mark.parametrize("name", ["prepare_data", "bootstrap_policy", "rollout", "verify_rewards", "filter_groups", "policy_step",
                                  "colocated_chunk", "evaluate", "track"])
def test_every_cached_task_has_the_version_of_the_source_it_runs(name):
    tasks = {**GPU_TASKS, **CPU_TASKS, "bootstrap_policy": data.bootstrap_policy, "track": tracking.start_tracking,
             "rollout": rollout.rollout}
    template = serialize(tasks[name]).template
    assert template.metadata.discoverable is True
    assert template.metadata.discovery_version == source_version(tasks[name].task_function.__module__)


def test_rollout_batches_are_structured_datasets_and_checkpoints_directories():
    interface = serialize(rollout.rollout).template.interface
    assert interface.outputs["o0"].type.structured_dataset_type is not None  # one output: map tasks take no more
    assert interface.inputs["policy"].type.blob is not None  # FlyteDirectory -> multipart blob
    step = serialize(train.policy_step).template.interface
    assert step.inputs["batch"].type.structured_dataset_type is not None


def test_dapo_loop_registers_with_defaults_for_the_embedded_run():
    spec = serialize(dapo_workflow.dapo_loop)
    node_tasks = [n.task_node.reference_id.name for n in spec.template.nodes if n.task_node is not None]
    assert node_tasks == ["tasks.config.resolve_config", "tasks.data.prepare_data", "tasks.tracking.start_tracking",
                          "workflows.dapo.train", "tasks.tracking.finish_tracking"]  # train: the dynamic step loop
    assert set(spec.template.interface.inputs) >= {"preset", "overrides_json", "total_steps", "mlflow_tracking_uri", "train_data"}
    launch_plan = serialize(LaunchPlan.get_or_create(dapo_workflow.dapo_loop))
    defaults = launch_plan.spec.default_inputs.parameters
    assert defaults["preset"].default.scalar.primitive.string_value == "tiny_cpu"
    assert defaults["train_data"].default.scalar.primitive.string_value == ""  # "" = the embedded task


@pytest.mark.parametrize("dynamic", ["train", "train_chunk"])
def test_dynamic_workflows_run_in_the_cpu_image(dynamic):
    """Not flytekit's default image: theirs must import every task module (torch, pyarrow, kfpytorch)."""
    template = serialize(getattr(dapo_workflow, dynamic)).template
    assert template.container.image == CPU_IMAGE.image_name()
    assert requests_of(template) == {"cpu": "1", "memory": "2Gi"}


def compile_dynamic(dynamic, tmp_path, **inputs):
    """What the dynamic's pod emits: its DynamicJobSpec, compiled as in a task execution."""
    from flytekit.core.context_manager import ExecutionState, FlyteContextManager

    checkpoint_dir = tmp_path / "policy"
    checkpoint_dir.mkdir(parents=True)
    (checkpoint_dir / "config.json").write_text("{}")
    directories = {k: FlyteDirectory(str(checkpoint_dir)) for k in ("data", "policy") if k in dynamic.python_interface.inputs}
    # A pod gets every input, a default one as its value (compiled without it, it would be a promise).
    defaults = {k: v.default for k, v in inspect.signature(dynamic.task_function).parameters.items() if v.default is not v.empty}
    inputs = {**defaults, **inputs}
    ctx = FlyteContextManager.current_context()
    state = ctx.execution_state.with_params(mode=ExecutionState.Mode.TASK_EXECUTION)
    dynamic._wf = None  # flytekit keeps a dynamic's first compilation in its process (a pod compiles once)
    with FlyteContextManager.with_context(ctx.with_serialization_settings(SETTINGS).with_execution_state(state)) as ctx:
        return dynamic.compile_into_workflow(ctx, dynamic._task_function, **directories, **inputs)


def node_requests(overrides) -> dict[str, str]:
    return {requests_names.get(r.name, str(r.name)): r.value for r in overrides.resources.requests}


requests_names = {1: "cpu", 2: "gpu", 3: "memory", 4: "storage", 5: "ephemeral_storage"}


def test_train_chunk_shapes_every_pod_from_the_config(tmp_path):
    """paper_32b's step as train_chunk's pod emits it: every image a registered one, GPUs
    and GPU type from the config (not the registering shell), the elastic step keeps its
    resolver, the full batch passes through an echo task (no pod), retries and timeouts."""
    config = DAPOConfig.paper_32b().replace(execution="per_stage", gpu_accelerator="nvidia-h100", max_num_gen_batches=3, val_every=1)
    spec = compile_dynamic(dapo_workflow.train_chunk, tmp_path, config=config, step_config=config.step_config(),
                           target=TARGET, loop_state=LoopState(), first_step=0, last_step=1, model_name="m")
    registered = {image.image_name() for image in (CPU_IMAGE, ROLLOUT_IMAGE, TRAINER_IMAGE)}
    tasks = {t.id.name: t for t in spec.tasks}
    assert {t.container.image for t in tasks.values() if t.container} <= registered
    elastic = next(t for name, t in tasks.items() if name.endswith("policy_step_elastic"))
    args = elastic.container.args
    assert args[args.index("--resolver") + 1:] == [
        "tasks.train.elastic_resolver", "--", "policy_step", "nnodes", "16", "nproc-per-node", "8",
    ]
    # the full batch passes later rounds through echo tasks of one input each (the plugin echoes one)
    echoes = [t for t in spec.tasks if t.type == "echo"]
    assert sorted(t.id.name for t in echoes) == ["keep_batch", "keep_done", "keep_sampling_state"]
    assert all(t.container is None and len(t.interface.inputs) == 1 for t in echoes)

    sample_round = next(w for w in spec.subworkflows if w.id.name.endswith("sample_round"))
    rollout_node = next(n for n in sample_round.nodes if "map_rollout" in n.metadata.name).array_node.node
    rollout_requests = node_requests(rollout_node.task_node.overrides)
    assert rollout_requests["gpu"] == "4" and rollout_requests["cpu"] == "32"  # tensor_parallel_size
    assert rollout_node.task_node.overrides.extended_resources.gpu_accelerator.device == "nvidia-h100"
    step_node = next(n for n in spec.nodes if n.metadata.name == "policy_step_elastic")
    assert node_requests(step_node.task_node.overrides)["gpu"] == "8"
    assert step_node.metadata.retries.retries == config.task_retries == 2
    assert step_node.metadata.timeout == datetime.timedelta(minutes=config.stage_timeout_minutes)
    branches = [n for n in spec.nodes if n.branch_node is not None]
    assert len(branches) == config.max_num_gen_batches - 1


def test_a_colocated_chunk_is_one_gpu_pod_of_the_gpu_image(tmp_path):
    """execution="colocated" (a 1.5B policy on one H100): train_chunk emits one colocated_chunk
    pod for the chunk's 10 steps (vLLM and DeepSpeed in the gpu image, GPU and disk from the
    config), then log_chunk and one validation; no per-stage node."""
    config = DAPOConfig.paper_32b().replace(
        execution="colocated", model_size_billions=1.5, trainer_nnodes=1, trainer_nproc_per_node=1, tensor_parallel_size=1,
        rollout_shards=1, gpu_accelerator="nvidia-h100", val_every=10, steps_per_chunk=10, measured_step_minutes=3.0,
        chunk_timeout_minutes=15 * 60, trainer_shared_dir="",
    )
    spec = compile_dynamic(dapo_workflow.train_chunk, tmp_path, config=config, step_config=config.step_config(),
                           target=TARGET, loop_state=LoopState(), first_step=0, last_step=10, model_name="m")
    names = [n.task_node.reference_id.name.split(".")[-1] for n in spec.nodes if n.task_node is not None]
    assert names == ["colocated_chunk", "log_chunk", "evaluate", "register_model"]
    chunk = next(n for n in spec.nodes if n.metadata.name.endswith("colocated_chunk"))
    requests = node_requests(chunk.task_node.overrides)
    assert requests["gpu"] == "1"
    assert float(requests["ephemeral_storage"].removesuffix("Gi")) * 2**30 >= 3 * config.checkpoint_bytes  # input + 2 records
    assert chunk.task_node.overrides.extended_resources.gpu_accelerator.device == "nvidia-h100"
    assert chunk.metadata.retries.retries == config.task_retries
    assert chunk.metadata.timeout == datetime.timedelta(hours=15)  # chunk_timeout_minutes; one step's pods get stage_timeout_minutes
    evaluate_node = next(n for n in spec.nodes if n.metadata.name.endswith("evaluate"))
    assert evaluate_node.metadata.timeout == datetime.timedelta(minutes=config.stage_timeout_minutes)
    template = next(t for t in spec.tasks if t.id.name.endswith("colocated_chunk"))
    assert template.container.image == GPU_IMAGE.image_name() and template.metadata.pod_template_name == "dapo-gpu"
    assert template.metadata.discovery_version == source_version("tasks.train")


def bound_policy(node) -> tuple[str, str]:
    """Where a node's policy input comes from: (node id, output name), or ("", "input") for the chunk's input (a value)."""
    binding = next(b.binding for b in node.inputs if b.var == "policy")
    return (binding.promise.node_id, binding.promise.var) if binding.promise else ("", "input")


def test_one_step_off_the_rollout_of_step_t_plus_1_reads_the_checkpoint_step_t_trains(tmp_path):
    """off_policy_steps=1 per_stage: step 1's first round binds the chunk's input checkpoint,
    as step 0's policy step does (Flyte runs them side by side), and the round of step 2
    (the batch after the chunk, its output) binds step 0's output checkpoint."""
    config = DAPOConfig.paper_32b().replace(execution="per_stage", off_policy_steps=1, rollout_correction="token_tis")
    spec = compile_dynamic(dapo_workflow.train_chunk, tmp_path, config=config, step_config=config.step_config(),
                           target=TARGET, loop_state=LoopState(), first_step=0, last_step=2, model_name="m")
    first_rounds = {int(next(b.binding.scalar.primitive.integer for b in n.inputs if b.var == "step")): n
                    for n in spec.nodes if n.workflow_node is not None and any(b.var == "round_index" and
                                                                                b.binding.scalar.primitive.integer == 0
                                                                                for b in n.inputs)}
    steps = [n for n in spec.nodes if n.task_node is not None and "policy_step" in n.task_node.reference_id.name]
    assert sorted(first_rounds) == [0, 1, 2] and len(steps) == 2
    assert bound_policy(first_rounds[0]) == bound_policy(first_rounds[1]) == bound_policy(steps[0]) == ("", "input")
    assert bound_policy(first_rounds[2]) == bound_policy(steps[1]) == (steps[0].id, "policy")
    assert [o.var for o in spec.outputs] == ["policy", "loop_state", "next_batch", "next_batch_state"]


def test_a_paper_32b_colocated_chunk_is_a_pytorch_job_over_the_trainer_gpus(tmp_path):
    """execution="colocated" at the paper's scale: train_chunk emits the chunk's 10 steps as
    one PyTorchJob of 16 pods x 8 GPUs, each GPU one rank (a DeepSpeed ZeRO-3 rank and one
    of the 4 ranks of a vLLM engine: 32 engines, one rollout shard each), in the gpu image,
    on the pod template with the shared volume where its records live."""
    config = DAPOConfig.paper_32b().replace(execution="colocated", gpu_accelerator="nvidia-h100", val_every=10)
    assert config.rollout_groups == config.rollout_shards == 32
    spec = compile_dynamic(dapo_workflow.train_chunk, tmp_path, config=config, step_config=config.step_config(),
                           target=TARGET, loop_state=LoopState(), first_step=0, last_step=10, model_name="m")
    names = [n.task_node.reference_id.name.split(".")[-1] for n in spec.nodes if n.task_node is not None]
    assert names == ["colocated_chunk_elastic", "log_chunk", "evaluate", "register_model"]
    template = next(t for t in spec.tasks if t.id.name.endswith("colocated_chunk_elastic"))
    assert template.type == "pytorch" and template.custom["workerReplicas"]["replicas"] == 16
    assert template.custom["elasticConfig"] == {"rdzvBackend": "c10d", "minReplicas": 16, "maxReplicas": 16, "nprocPerNode": 8, "maxRestarts": 1}
    assert template.container.image == GPU_IMAGE.image_name() and template.metadata.pod_template_name == "dapo-gpu-shared"
    assert template.metadata.discovery_version == source_version("tasks.train")
    args = template.container.args
    loader = args[args.index("--resolver") + 1:]
    assert loader == ["tasks.train.elastic_resolver", "--", "colocated_chunk", "nnodes", "16", "nproc-per-node", "8"]
    rebuilt = train.elastic_resolver.load_task(loader[2:])
    assert rebuilt.task_function is train.colocated_chunk_elastic and rebuilt.task_config.nproc_per_node == 8
    chunk = next(n for n in spec.nodes if n.metadata.name.endswith("colocated_chunk_elastic"))
    requests = node_requests(chunk.task_node.overrides)
    assert requests["gpu"] == "8" and requests["cpu"] == "128" and requests["memory"] == "1024Gi"
    # the input checkpoint only: the records are on trainer_shared_dir
    assert float(requests["ephemeral_storage"].removesuffix("Gi")) * 2**30 >= config.checkpoint_bytes
    assert chunk.task_node.overrides.extended_resources.gpu_accelerator.device == "nvidia-h100"
    assert chunk.metadata.retries.retries == config.task_retries == 2
    assert train.records_dir(config, FlyteDirectory("s3://b/policy-0"), 0).startswith("/mnt/dapo-shared/colocated/run-")


def test_generation_round_maps_rollout_and_rewards_over_shards_on_their_images():
    """rollout and verify_rewards are ArrayNodes over the shard list (of any length,
    rollout_shards at run time), their sub-tasks keep image, GPU, pod template and cache."""
    entities = OrderedDict()
    spec = get_serializable(entities, SETTINGS, dapo_workflow.sample_round_workflow(DAPOConfig.tiny_cpu()))
    mapped = [n.array_node.node.task_node.reference_id.name for n in spec.template.nodes if n.array_node is not None]
    assert [name.split(".")[-1].split("_")[1] for name in mapped] == ["rollout", "verify"]
    assert spec.template.nodes[-1].task_node.reference_id.name == "tasks.rollout.filter_groups"
    templates = {k.name: v.template for k, v in entities.items() if hasattr(k, "name") and k.name in mapped}
    rollout_map, rewards_map = (templates[name] for name in mapped)
    assert rollout_map.interface.inputs["shard"].type.collection_type is not None  # mapped over
    assert rollout_map.interface.inputs["step"].type.simple is not None  # bound (functools.partial)
    assert requests_of(rollout_map)["gpu"] == "1" and rollout_map.metadata.pod_template_name == "dapo-gpu"
    assert rollout_map.container.image.startswith(ROLLOUT_IMAGE.image_name().split(":")[0])
    assert rollout_map.metadata.discovery_version == source_version("tasks.rollout")
    assert "gpu" not in requests_of(rewards_map)
    assert rewards_map.container.image.startswith(CPU_IMAGE.image_name().split(":")[0])


def test_policy_step_is_one_pod_for_one_process():
    assert train.policy_step_for(DAPOConfig.tiny_cpu()) is train.policy_step
    assert serialize(train.policy_step).template.custom is None


@pytest.mark.parametrize("nnodes, nproc", [(16, 8), (2, 1)])
def test_multi_node_policy_step_is_a_pytorch_job(nnodes, nproc):
    config = DAPOConfig.paper_32b().replace(execution="per_stage", trainer_nnodes=nnodes, trainer_nproc_per_node=nproc,
                                            stage_timeout_minutes=0)  # 32B on 2 GPUs has no budget: its shape is tested
    template = serialize(train.policy_step_for(config)).template
    assert template.type == "pytorch"  # the PyTorchJob plugin (training-operator)
    assert template.custom["workerReplicas"]["replicas"] == nnodes
    assert template.custom["elasticConfig"] == {
        "rdzvBackend": "c10d", "minReplicas": nnodes, "maxReplicas": nnodes, "nprocPerNode": nproc, "maxRestarts": 1,  # an NCCL abort: one in-pod restart
    }
    # the template that mounts the ReadWriteMany volume at the preset's trainer_shared_dir
    assert requests_of(template)["gpu"] == str(nproc) and template.metadata.pod_template_name == "dapo-gpu-shared"
    assert config.trainer_shared_dir == "/mnt/dapo-shared"
    assert template.container.image.startswith(TRAINER_IMAGE.image_name().split(":")[0])
    assert template.metadata.discovery_version == source_version("tasks.train")
    assert template.k8s_pod is None  # no second /dev/shm: the pod template has one
    # the pod finds the task again from its shape (the tasks are made at run time)
    args = template.container.args
    loader = args[args.index("--resolver") + 1 :]
    assert loader == ["tasks.train.elastic_resolver", "--", "policy_step", "nnodes", str(nnodes), "nproc-per-node", str(nproc)]
    rebuilt = train.elastic_resolver.load_task(loader[2:])
    assert (rebuilt.task_config.nnodes, rebuilt.task_config.nproc_per_node) == (nnodes, nproc)
    assert rebuilt.task_function is train.policy_step_elastic


def test_one_node_elastic_policy_step_is_a_plain_pod_running_torchrun():
    config = DAPOConfig.tiny_cpu().replace(trainer_nproc_per_node=4)
    template = serialize(train.policy_step_for(config)).template
    assert template.type == "python-task" and not template.custom  # torch elastic launch inside the pod
    assert requests_of(template)["gpu"] == "4" and template.metadata.pod_template_name == "dapo-gpu"


def test_validation_schedule():
    steps = [s for s in range(1, 13) if is_validation_step(s, 5, 12)]
    assert steps == [5, 10, 12]


def test_a_colocated_chunk_ends_at_every_validation_step_so_val_every_is_honoured():
    """A colocated chunk validates (and registers) the checkpoint it passes on, so its chunks
    also end at each validation step; per stage validates inside a chunk."""
    config = DAPOConfig.tiny_cpu().replace(total_steps=13, val_every=4)
    colocated = config.replace(execution="colocated")
    assert chunk_ranges(config.replace(steps_per_chunk=10)) == [(0, 10), (10, 13)]
    assert chunk_ranges(colocated.replace(steps_per_chunk=10)) == [(0, 4), (4, 8), (8, 10), (10, 12), (12, 13)]
    assert chunk_ranges(colocated.replace(val_every=0, steps_per_chunk=10)) == [(0, 10), (10, 13)]
    assert chunk_ranges(colocated.replace(val_every=10, steps_per_chunk=5)) == [(0, 5), (5, 10), (10, 13)]
    validated = [last for _, last in chunk_ranges(colocated.replace(steps_per_chunk=10)) if is_validation_step(last, 4, 13)]
    assert validated == [step for step in range(1, 14) if is_validation_step(step, 4, 13)] == [4, 8, 12, 13]


def bindings(spec) -> list:
    """Every input binding of the spec's nodes and sub-workflows' nodes (literals inline)."""
    nodes = list(spec.nodes) + [n for w in spec.subworkflows for n in w.nodes]
    return [b for n in nodes for b in n.inputs]


def paper_dag(tmp_path, **overrides):
    """What a 1,000-step paper_32b run's dynamic pods emit: the step loop (train) and its
    last chunk (train_chunk), as DynamicJobSpecs (their futures.pb)."""
    return preset_dag(tmp_path, DAPOConfig.paper_32b().replace(total_steps=1000, **overrides))


def preset_dag(tmp_path, config: DAPOConfig):
    """What a run of `config`'s dynamic pods emit: the step loop (train) and its last chunk
    (train_chunk), as DynamicJobSpecs (their futures.pb)."""
    config = config.replace(train_data_path="s3://b/train.parquet", val_data_path="s3://b/val.parquet")
    common = {"config": config, "step_config": config.step_config(), "target": TARGET, "loop_state": LoopState(), "model_name": "m"}
    train_spec = compile_dynamic(dapo_workflow.train, tmp_path / "train", model_config=config.section("model"), **common)
    first, last = chunk_ranges(config)[-1]
    chunk_spec = compile_dynamic(dapo_workflow.train_chunk, tmp_path / "chunk", first_step=first, last_step=last, **common)
    return train_spec, chunk_spec


def test_a_1000_step_paper_32b_dag_stays_small(tmp_path):
    """docs/architecture.md's figures: a 1,000-step paper_32b run's biggest dynamic workflow spec (the
    step loop, or one chunk of 10 steps with 10 generation rounds each) under 1 MiB, and the
    biggest value bound into a node under 64 KB (outputs passed on: test_workflow_local)."""
    train_spec, chunk_spec = paper_dag(tmp_path, execution="per_stage", steps_per_chunk=10)
    assert len([n for n in train_spec.nodes if "train_chunk" in n.metadata.name]) == 100
    spec_bytes = {"train": train_spec.to_flyte_idl().ByteSize(), "train_chunk": chunk_spec.to_flyte_idl().ByteSize()}
    assert max(spec_bytes.values()) < 2**20, spec_bytes
    largest_binding = max(b.binding.to_flyte_idl().ByteSize() for spec in (train_spec, chunk_spec) for b in bindings(spec))
    assert largest_binding < 64 * 1024, largest_binding
    print(f"paper_32b, 1,000 steps: dynamic specs {spec_bytes} bytes; largest bound input {largest_binding} bytes")


@pytest.mark.parametrize("execution", ["colocated", "per_stage"])
def test_the_shipped_paper_dags_dynamic_specs_fit_propellers_download_limit(tmp_path, execution):
    """paper_32b as shipped (50-step chunks): the futures.pb a dynamic pod writes is read by
    propeller only up to 2 MiB (podsim fails a node past it)."""
    import podsim

    sizes = {name: spec.to_flyte_idl().ByteSize()
             for name, spec in zip(("train", "train_chunk"), paper_dag(tmp_path, execution=execution))}
    assert max(sizes.values()) < podsim.MAX_DOWNLOAD_BYTES, sizes
    print(f"paper_32b {execution}: futures.pb {sizes} bytes (limit {podsim.MAX_DOWNLOAD_BYTES})")


@pytest.mark.parametrize("preset", ["one_gpu_1p5b", "node_7b", "paper_32b"])
def test_each_hardware_preset_compiles_with_its_chunks_shaped_for_its_gpus(tmp_path, preset):
    """The presets for one GPU, one node of 8 and 16 nodes: the step loop and its last chunk
    compile as their dynamic pods emit them, each chunk one colocated task on the trainer's
    nodes and GPUs (an elastic one over several ranks), under the chunk timeout that passed
    the run budget, and the specs fit propeller's download limit."""
    import podsim

    config = DAPOConfig.preset(preset)
    train_spec, chunk_spec = preset_dag(tmp_path, config)
    chunks = [n for n in train_spec.nodes if "train_chunk" in n.metadata.name]
    assert len(chunks) == len(chunk_ranges(config))
    (node,) = [n for n in chunk_spec.nodes if "colocated_chunk" in n.metadata.name]
    assert node_requests(node.task_node.overrides)["gpu"] == str(config.trainer_nproc_per_node)
    assert node.metadata.timeout == datetime.timedelta(minutes=config.chunk_timeout_minutes)
    assert node.metadata.retries.retries == config.task_retries
    task = next(t for t in chunk_spec.tasks if t.id.name == node.task_node.reference_id.name)
    assert task.id.name.endswith("colocated_chunk_elastic" if config.trainer_world_size > 1 else "colocated_chunk")
    # a chunk whose records are on trainer_shared_dir runs where that volume is mounted
    assert task.metadata.pod_template_name == ("dapo-gpu-shared" if config.trainer_shared_dir else "dapo-gpu")
    assert max(spec.to_flyte_idl().ByteSize() for spec in (train_spec, chunk_spec)) < podsim.MAX_DOWNLOAD_BYTES


STATE_VALUES = """
from dapo.algorithm.sampling import SamplingState
from dapo.config import DAPOConfig
from dapo.tracking import LoopState, RunTarget
VALUES = {
    SamplingState: SamplingState(rounds=2, kept_groups=3, done=True, rollout_seconds=1.5, unverified_notes=["a", "b"]),
    LoopState: LoopState(bad_steps=1, outbox="s3://b/outbox.jsonl", best_val_acc=0.25, best_val_step=4),
    RunTarget: RunTarget("http://mlflow:5000", "dapo", "f39e859bd35b3266", "dapo-x"),
    type(DAPOConfig.tiny_cpu().step_config()): DAPOConfig.tiny_cpu().replace(extra={"b": "2", "a": "1"}).step_config(),
}
"""


def test_the_states_between_tasks_are_dataclasses_whose_literals_are_the_same_bytes_under_any_hash_seed():
    """The loop, sampling and tracking states pass between tasks as typed dataclasses (the
    console shows their fields), and a value is the same literal, so the same cache key,
    in every process: PYTHONHASHSEED changes the order of sets and of nothing they hold."""
    import subprocess
    import sys

    from flytekit.models.types import SimpleType

    script = STATE_VALUES + """
import hashlib
import tasks
from flytekit.core.context_manager import FlyteContextManager
from flytekit.core.type_engine import TypeEngine
ctx = FlyteContextManager.current_context()
for kind, value in VALUES.items():
    literal = TypeEngine.to_literal(ctx, value, kind, TypeEngine.to_literal_type(kind))
    assert TypeEngine.to_python_value(ctx, literal, kind) == value
    print(kind.__name__, hashlib.sha256(literal.to_flyte_idl().SerializeToString(deterministic=True)).hexdigest())
"""
    digests = {
        seed: subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONHASHSEED": seed},
                             capture_output=True, text=True, check=True).stdout
        for seed in ("0", "1", "12345")
    }
    assert len(set(digests.values())) == 1, digests
    assert digests["0"].split()[::2] == ["SamplingState", "LoopState", "RunTarget", "StepConfig"]
    for task, state in ((rollout.filter_groups, "sampling_state"), (tracking.log_step, "loop_state"),
                        (tracking.log_step, "target")):
        typed = serialize(task).template.interface.inputs[state].type
        assert typed.simple == SimpleType.STRUCT and typed.metadata["properties"], state  # fields, not a JSON string


TASK_MODULES = ("tasks.config", "tasks.data", "tasks.rollout", "tasks.train", "tasks.tracking", "tasks.evaluate", "workflows.dapo")


def test_no_task_or_workflow_passes_a_state_as_a_json_string():
    """Only the user's own inputs are JSON text (overrides_json: dapo_loop's, its failure
    handler's); every state between tasks is a typed value."""
    import importlib

    from flytekit.core.base_task import PythonTask
    from flytekit.core.workflow import WorkflowBase

    strings = set()
    for module_name in TASK_MODULES:
        for name, entity in vars(importlib.import_module(module_name)).items():
            if isinstance(entity, (PythonTask, WorkflowBase)):
                interface = entity.python_interface
                for var, kind in {**interface.inputs, **interface.outputs}.items():
                    if kind is str and (var.endswith("_json") or var.endswith("_state") or var.startswith("target")):
                        strings.add(f"{entity.name}.{var}")
    assert strings == {"workflows.dapo.dapo_loop.overrides_json", "tasks.tracking.end_failed_run.overrides_json",
                       "tasks.config.resolve_config.overrides_json"}, strings
