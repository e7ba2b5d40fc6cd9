"""What `pyflyte run --remote` would register, inspected without a cluster."""

from collections import OrderedDict

import pytest
from flytekit import LaunchPlan
from flytekit.configuration import Image, ImageConfig, SerializationSettings
from flytekit.tools.translator import get_serializable

import workflows.dapo as dapo_workflow
from dapo.config import DAPOConfig
from images.specs import CPU_IMAGE, ROLLOUT_IMAGE, TRAINER_IMAGE
from tasks import common, data, evaluate, rollout, tracking, train

SETTINGS = SerializationSettings(
    image_config=ImageConfig(default_image=Image(name="default", fqn="registry.example/default", tag="v1")),
    project="dapo", domain="development", version="test",
)
GPU_TASKS = {"rollout": rollout.rollout, "policy_step": train.policy_step, "evaluate": evaluate.evaluate}
CPU_TASKS = {
    "resolve_config": data.resolve_config, "prepare_data": data.prepare_data, "verify_rewards": rollout.verify_rewards,
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
    expected_image = TRAINER_IMAGE if name == "policy_step" else ROLLOUT_IMAGE
    assert template.container.image.startswith(expected_image.image_name().split(":")[0])


@pytest.mark.parametrize("name", sorted(CPU_TASKS))
def test_cpu_tasks_use_the_light_image_and_no_gpu(name):
    template = serialize(CPU_TASKS[name]).template
    assert "gpu" not in requests_of(template) and not template.metadata.pod_template_name
    assert template.container.image.startswith(CPU_IMAGE.image_name().split(":")[0])


@pytest.mark.parametrize("name", sorted(common.CACHE_VERSIONS))
def test_every_cached_task_has_its_explicit_version(name):
    tasks = {**GPU_TASKS, **CPU_TASKS, "bootstrap_policy": data.bootstrap_policy, "track": tracking.start_tracking,
             "rollout": rollout.rollout}
    template = serialize(tasks[name]).template
    assert template.metadata.discoverable is True
    assert template.metadata.discovery_version == common.CACHE_VERSIONS[name]


def test_rollout_batches_are_structured_datasets_and_checkpoints_directories():
    interface = serialize(rollout.rollout).template.interface
    assert interface.outputs["o0"].type.structured_dataset_type is not None  # one output: map tasks take no more
    assert interface.inputs["policy"].type.blob is not None  # FlyteDirectory -> multipart blob
    step = serialize(train.policy_step).template.interface
    assert step.inputs["batch"].type.structured_dataset_type is not None


def test_dapo_loop_registers_with_defaults_for_the_embedded_run():
    spec = serialize(dapo_workflow.dapo_loop)
    node_tasks = [n.task_node.reference_id.name for n in spec.template.nodes if n.task_node is not None]
    assert node_tasks[:4] == ["tasks.data.resolve_config", "tasks.data.prepare_data", "tasks.data.bootstrap_policy", "tasks.tracking.start_tracking"]
    assert "workflows.dapo.train" in node_tasks  # the dynamic step loop
    assert set(spec.template.interface.inputs) >= {"preset", "overrides_json", "total_steps", "mlflow_tracking_uri", "train_data"}
    launch_plan = serialize(LaunchPlan.get_or_create(dapo_workflow.dapo_loop))
    defaults = launch_plan.spec.default_inputs.parameters
    assert defaults["preset"].default.scalar.primitive.string_value == "tiny_cpu"
    assert defaults["train_data"].default.scalar.primitive.string_value == ""  # "" = the embedded task


def test_generation_round_maps_rollout_and_rewards_over_shards_on_their_images():
    """rollout and verify_rewards are ArrayNodes over the shard list (of any length,
    rollout_shards at run time), their sub-tasks keep image, GPU, pod template and cache."""
    entities = OrderedDict()
    spec = get_serializable(entities, SETTINGS, dapo_workflow.sample_round)
    mapped = [n.array_node.node.task_node.reference_id.name for n in spec.template.nodes if n.array_node is not None]
    assert [name.split(".")[-1].split("_")[1] for name in mapped] == ["rollout", "verify"]
    assert spec.template.nodes[-1].task_node.reference_id.name == "tasks.rollout.filter_groups"
    templates = {k.name: v.template for k, v in entities.items() if hasattr(k, "name") and k.name in mapped}
    rollout_map, rewards_map = (templates[name] for name in mapped)
    assert rollout_map.interface.inputs["shard"].type.collection_type is not None  # mapped over
    assert rollout_map.interface.inputs["step"].type.simple is not None  # bound (functools.partial)
    assert requests_of(rollout_map)["gpu"] == "1" and rollout_map.metadata.pod_template_name == "dapo-gpu"
    assert rollout_map.container.image.startswith(ROLLOUT_IMAGE.image_name().split(":")[0])
    assert rollout_map.metadata.discovery_version == common.CACHE_VERSIONS["rollout"]
    assert "gpu" not in requests_of(rewards_map)
    assert rewards_map.container.image.startswith(CPU_IMAGE.image_name().split(":")[0])


def test_policy_step_is_one_pod_for_one_process():
    assert train.policy_step_for(DAPOConfig.tiny_cpu()) is train.policy_step
    assert serialize(train.policy_step).template.custom is None


@pytest.mark.parametrize("nnodes, nproc", [(16, 8), (2, 1)])
def test_multi_node_policy_step_is_a_pytorch_job(nnodes, nproc):
    config = DAPOConfig.paper_32b().replace(trainer_nnodes=nnodes, trainer_nproc_per_node=nproc)
    template = serialize(train.policy_step_for(config)).template
    assert template.type == "pytorch"  # the PyTorchJob plugin (training-operator)
    assert template.custom["workerReplicas"]["replicas"] == nnodes
    assert template.custom["elasticConfig"] == {
        "rdzvBackend": "c10d", "minReplicas": nnodes, "maxReplicas": nnodes, "nprocPerNode": nproc,
    }
    # the template that mounts the ReadWriteMany volume at the preset's trainer_shared_dir
    assert requests_of(template)["gpu"] == str(nproc) and template.metadata.pod_template_name == "dapo-gpu-shared"
    assert config.trainer_shared_dir == "/mnt/dapo-shared"
    assert template.container.image.startswith(TRAINER_IMAGE.image_name().split(":")[0])
    assert template.metadata.discovery_version == common.CACHE_VERSIONS["policy_step"]
    assert template.k8s_pod is None  # no second /dev/shm: the pod template has one
    # the pod finds the task again from its shape (the tasks are made at run time)
    args = template.container.args
    loader = args[args.index("--resolver") + 1 :]
    assert loader == ["tasks.train.elastic_resolver", "--", "nnodes", str(nnodes), "nproc-per-node", str(nproc)]
    rebuilt = train.elastic_resolver.load_task(loader[2:])
    assert (rebuilt.task_config.nnodes, rebuilt.task_config.nproc_per_node) == (nnodes, nproc)


def test_one_node_elastic_policy_step_is_a_plain_pod_running_torchrun():
    config = DAPOConfig.tiny_cpu().replace(trainer_nproc_per_node=4)
    template = serialize(train.policy_step_for(config)).template
    assert template.type == "python-task" and not template.custom  # torch elastic launch inside the pod
    assert requests_of(template)["gpu"] == "4" and template.metadata.pod_template_name == "dapo-gpu"


def test_validation_schedule():
    steps = [s for s in range(1, 13) if dapo_workflow.is_validation_step(s, 5, 12)]
    assert steps == [5, 10, 12]


def test_rollout_pods_request_the_gpus_of_the_registration_tensor_parallel_size():
    """DAPO_ROLLOUT_GPUS is read at import (registration) time: checked in a fresh interpreter."""
    import json
    import os
    import subprocess
    import sys

    probe = (
        "import json\n"
        "from tests.test_flyte_serialization import requests_of, serialize\n"
        "from tasks import evaluate, rollout\n"
        "print(json.dumps([requests_of(serialize(t).template) for t in (rollout.rollout, evaluate.evaluate)]))\n"
    )
    env = {**os.environ, "DAPO_ROLLOUT_GPUS": "4"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True).stdout
    requests = json.loads(out.strip().splitlines()[-1])
    assert [(r["gpu"], r["cpu"], r["memory"]) for r in requests] == [("4", "32", "256Gi")] * 2
