"""The run budget (dapo.cluster.run_budget): a config whose timeouts cannot cover their tasks' work,
by the cost model and Flyte's deadlines, is refused before any work, naming the numbers."""

from pathlib import Path

import pytest

from dapo.cluster import cluster_cost, run_budget
from dapo.config import ConfigError, DAPOConfig

PAPER = DAPOConfig.paper_32b()


def checked(config: DAPOConfig) -> DAPOConfig:
    """The config as the run's resolver passes it on: after the run budget (a ConfigError if not)."""
    run_budget.check_run_budget(config)
    return config


def test_the_shipped_paper_preset_fits_its_budget_in_both_execution_modes():
    for config in (PAPER, PAPER.replace(execution="per_stage")):
        budgets = run_budget.task_budgets(config)
        assert {b.task for b in budgets} >= {"bootstrap_policy", "evaluate", "register_model"}
        assert all(b.timeout_minutes >= b.needed_minutes for b in budgets), run_budget.budget_lines(config)


def test_a_32b_chunk_that_outlasts_its_timeout_is_refused_naming_the_field_and_the_numbers():
    """The preset as it was: 4 h for every task, 5-step colocated chunks (val_every 5)."""
    with pytest.raises(ConfigError) as refused:
        checked(PAPER.replace(chunk_timeout_minutes=0, stage_timeout_minutes=240, val_every=5))
    message = str(refused.value)
    assert message.startswith("cluster.stage_timeout_minutes=240: a colocated chunk needs ~")
    assert "5 steps of" in message and "set stage_timeout_minutes >= " in message and "31.3 min from the cost model" in message
    needed = int(message.split("set stage_timeout_minutes >= ")[1].split()[0])
    checked(PAPER.replace(chunk_timeout_minutes=0, stage_timeout_minutes=needed, val_every=5))  # the number it names suffices
    with pytest.raises(ConfigError, match="set stage_timeout_minutes >= "):
        checked(PAPER.replace(chunk_timeout_minutes=0, stage_timeout_minutes=needed - 1, val_every=5))


def test_longer_chunks_need_a_longer_chunk_timeout_and_a_measured_step_time_replaces_the_estimate():
    with pytest.raises(ConfigError, match=r"cluster.chunk_timeout_minutes=2160: a colocated chunk .*\(100 steps of"):
        checked(PAPER.replace(steps_per_chunk=100, val_every=100))
    faster = PAPER.replace(measured_step_minutes=10.0, steps_per_chunk=100, val_every=100)  # measured: 10-minute steps
    chunk = next(b for b in run_budget.task_budgets(faster) if b.task == "a colocated chunk")
    assert chunk.timeout_field == "chunk_timeout_minutes"
    assert 100 * 10 * 60 < chunk.attempt_s < 100 * 11 * 60 + 4 * 3600  # 100 steps, their syncs and one set of restarts


def test_retries_of_both_kinds_must_fit_twice_the_timeout_from_where_each_task_restarts():
    """A per-stage policy step restarts from scratch: with its 2 retries and propeller's 3
    after system failures, its six attempts need 3x an attempt's time; a colocated chunk's
    retry resumes from its record, so its retries cost only the steps since the last one."""
    assert run_budget.SYSTEM_RETRIES == 3
    policy_step = next(b for b in run_budget.task_budgets(PAPER.replace(execution="per_stage")) if b.task == "policy_step")
    assert policy_step.retry_s == policy_step.attempt_s and policy_step.retries == 2
    assert policy_step.needed_minutes == pytest.approx(6 * policy_step.attempt_s * run_budget.HEADROOM / 60 / 2, abs=1)
    chunk = next(b for b in run_budget.task_budgets(PAPER) if b.task == "a colocated chunk")
    every_step = PAPER.replace(colocated_checkpoint_every=1, chunk_timeout_minutes=0, stage_timeout_minutes=0)  # priced, not checked
    chunk_every_step = next(b for b in run_budget.task_budgets(every_step) if b.task == "a colocated chunk")
    assert chunk_every_step.retry_s < chunk.retry_s < chunk.attempt_s < chunk_every_step.attempt_s  # a record every step costs time
    no_retries = next(b for b in run_budget.task_budgets(PAPER.replace(task_retries=0)) if b.task == "a colocated chunk")
    assert no_retries.needed_minutes == pytest.approx(chunk.attempt_s * run_budget.HEADROOM / 60, abs=1)


def test_a_chunk_without_a_shared_volume_is_priced_as_starting_again_on_a_retry():
    """A chunk's records outlive its pod only on trainer_shared_dir (tasks.train.records_dir):
    without it a retried pod starts the whole chunk again, and node_7b's 10-hour chunks
    would need a 35-hour timeout; the preset keeps its records on the shared volume."""
    node = DAPOConfig.node_7b()
    assert node.trainer_nnodes == 1 and node.trainer_shared_dir
    resumed = next(b for b in run_budget.task_budgets(node) if b.task == "a colocated chunk")
    assert resumed.retry_s < resumed.attempt_s / 4 and "resumes from its last record, <= 2 steps back" in resumed.work
    with pytest.raises(ConfigError, match=r"a retry starts it again\) and ~3,\d{3} min with its 2 retries and propeller's 3"):
        checked(node.replace(trainer_shared_dir=""))
    unchecked = node.replace(trainer_shared_dir="", chunk_timeout_minutes=0, stage_timeout_minutes=0)
    again = next(b for b in run_budget.task_budgets(unchecked) if b.task == "a colocated chunk")
    assert again.retry_s == again.attempt_s and again.needed_minutes > 2000


def test_the_config_itself_is_plain_data_and_the_run_and_the_cli_check_the_budget(capsys, monkeypatch):
    """Building a config never prices it (no import of the cost model from the schema); the
    run's resolver and `python -m dapo config` refuse what the budget refuses."""
    from dapo import cli, resolve as run_resolver
    from tasks.config import resolve

    monkeypatch.setattr(run_resolver, "hub_commit", lambda name, revision: "0" * 40)  # offline: the hub's answer
    short = PAPER.replace(stage_timeout_minutes=1)  # built: the schema has no opinion on timeouts
    with pytest.raises(ConfigError, match="stage_timeout_minutes=1: "):
        checked(short)
    with pytest.raises(ConfigError, match="stage_timeout_minutes=1: "):
        resolve("paper_32b", train_data="t.parquet", val_data="v.parquet", set="cluster.stage_timeout_minutes=1")
    assert cli.main(["config", "--preset", "paper_32b", "--set", "cluster.stage_timeout_minutes=1"]) == 2
    assert "stage_timeout_minutes=1: " in capsys.readouterr().err


def test_the_system_retries_priced_are_the_ones_the_shipped_flyte_allows():
    import yaml

    values = yaml.safe_load((Path(__file__).resolve().parents[1] / "k8s" / "flyte-binary-values.yaml").read_text())
    node_config = values["configuration"]["inline"]["propeller"]["node-config"]
    assert node_config["max-node-retries-system-failures"] == run_budget.SYSTEM_RETRIES


def test_no_timeout_or_the_embedded_policy_has_no_budget_to_check():
    checked(DAPOConfig.tiny_cpu().replace(stage_timeout_minutes=1))  # model_size_billions 0: nothing to price
    checked(PAPER.replace(stage_timeout_minutes=0, chunk_timeout_minutes=0, val_every=5))  # no limit at all
    assert all(b.problem() == "" for b in run_budget.task_budgets(PAPER.replace(stage_timeout_minutes=0, chunk_timeout_minutes=0)))


def test_the_budget_prices_the_configs_own_cluster():
    model = cluster_cost.Model.of(PAPER)
    assert (model.nodes, model.gpus, model.engines) == (16, 128, 32)
    assert model.weights_bytes == pytest.approx(PAPER.weights_bytes) and model.checkpoint_bytes == pytest.approx(PAPER.checkpoint_bytes)
    assert run_budget.step_seconds(PAPER) == pytest.approx(cluster_cost.VERL_STEP_S, rel=1e-9)  # verl's own 32B cluster
    half = PAPER.replace(trainer_nnodes=8, rollout_shards=16, stage_timeout_minutes=0, chunk_timeout_minutes=0)
    assert run_budget.step_seconds(half) == pytest.approx(2 * cluster_cost.VERL_STEP_S)


@pytest.mark.parametrize("field", ["run.steps_per_chunk", "cluster.chunk_timeout_minutes", "cluster.measured_step_minutes"])
def test_budget_fields_reject_bad_values(field):
    with pytest.raises(ConfigError, match=f"{field}="):
        DAPOConfig.tiny_cpu().replace(**{field: -1})
