"""What `pyflyte run --remote` would register, inspected without a cluster."""

from collections import OrderedDict

import pytest
from flytekit import LaunchPlan
from flytekit.configuration import Image, ImageConfig, SerializationSettings
from flytekit.tools.translator import get_serializable

import workflows.dapo as dapo_workflow
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
    assert interface.outputs["responses"].type.structured_dataset_type is not None
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


def test_validation_schedule():
    steps = [s for s in range(1, 13) if dapo_workflow.is_validation_step(s, 5, 12)]
    assert steps == [5, 10, 12]
