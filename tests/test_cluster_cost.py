"""The cluster cost model (dapo.cluster.cluster_cost) as benchmarks/cluster_cost.py prints it: its claims hold for every input it prints."""

import dataclasses
import math

import pytest

from benchmarks import cluster_cost as cc
from dapo.config import DAPOConfig

LOW, HIGH = cc.scenarios(cc.handoff_figures(cc.RESULTS.read_text()))
CHUNKS = (1, 2, 5, 10, 50, 200)
BIG = next(model for model in cc.MODELS if model.name == "32B")


@pytest.mark.parametrize("scenario", [LOW, HIGH], ids=lambda s: s.name)
@pytest.mark.parametrize("model", cc.MODELS, ids=lambda m: m.name)
def test_colocated_moves_and_restarts_less_than_per_stage_for_any_chunk(model, scenario):
    per_stage = cc.step_cost(model, "per_stage", 1, scenario)
    one_step_chunk = cc.step_cost(model, "colocated", 1, scenario)
    for n in CHUNKS:
        colocated = cc.step_cost(model, "colocated", n, scenario)
        assert colocated.bytes_moved < per_stage.bytes_moved
        assert colocated.bytes_moved == pytest.approx(one_step_chunk.bytes_moved / n)  # one state load and save a chunk
        assert colocated.overhead_s < per_stage.overhead_s
        assert colocated.vllm_starts == pytest.approx(per_stage.vllm_starts / n)  # one start a chunk, per engine
        every = DAPOConfig.paper_32b().colocated_checkpoint_every  # step_cost's default: a record every 5 steps, and after the chunk's last
        assert colocated.checkpoint_writes == pytest.approx(math.ceil(n / every) / n)
        once = cc.step_cost(model, "colocated", n, scenario, checkpoint_every=n)
        assert once.checkpoint_writes == pytest.approx(1 / n) and once.overhead_s <= colocated.overhead_s


@pytest.mark.parametrize("scenario", [LOW, HIGH], ids=lambda s: s.name)
@pytest.mark.parametrize("model", cc.MODELS, ids=lambda m: m.name)
def test_overhead_share_falls_with_the_chunk_length(model, scenario):
    shares = [cc.step_cost(model, "colocated", n, scenario).share for n in CHUNKS]
    assert all(a > b for a, b in zip(shares, shares[1:]))
    assert cc.step_cost(model, "per_stage", 1, scenario).share == cc.step_cost(model, "per_stage", 50, scenario).share


@pytest.mark.parametrize("mode", cc.MODES)
def test_bytes_scale_linearly_with_parameters(mode):
    double = dataclasses.replace(BIG, billions=2 * BIG.billions)
    for n in CHUNKS:
        assert cc.step_cost(double, mode, n, HIGH).bytes_moved == pytest.approx(2 * cc.step_cost(BIG, mode, n, HIGH).bytes_moved)


@pytest.mark.parametrize("scenario", [LOW, HIGH], ids=lambda s: s.name)
def test_recommended_chunk_is_the_smallest_under_five_percent_at_32b(scenario):
    n = cc.chunk_for_share(BIG, scenario)
    assert n > 1
    assert cc.step_cost(BIG, "colocated", n, scenario).share < 0.05 <= cc.step_cost(BIG, "colocated", n - 1, scenario).share


def test_high_end_costs_more_than_low_end():
    for model in cc.MODELS:
        for mode in cc.MODES:
            assert cc.step_cost(model, mode, 10, LOW).overhead_s < cc.step_cost(model, mode, 10, HIGH).overhead_s


def test_32b_is_the_paper_preset_and_bytes_match_the_measured_checkpoint():
    paper = DAPOConfig.paper_32b()
    assert BIG.engines == paper.rollout_shards and BIG.gpus == paper.trainer_nnodes * paper.trainer_nproc_per_node
    assert BIG.weights_bytes == pytest.approx(paper.weights_bytes) and BIG.checkpoint_bytes == pytest.approx(paper.checkpoint_bytes)
    # The 16 B/param of bf16 training rests on the layout measured in fp32 (RESULTS.md section 4).
    fp32 = paper.replace(dtype="float32", chunk_timeout_minutes=0, stage_timeout_minutes=0)  # heavier records: 2,165 min a chunk
    measured = cc.handoff_figures(cc.RESULTS.read_text())
    assert fp32.checkpoint_bytes / fp32.weights_bytes == pytest.approx(measured["ratio"], abs=0.01)
    assert (cc.WEIGHT_BYTES_PER_PARAM, cc.CHECKPOINT_BYTES_PER_PARAM) == (2, 16)


def test_unreachable_share_and_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="no steps_per_chunk"):
        cc.chunk_for_share(BIG, HIGH, target=0.001)  # the per-step sync alone is above 0.1%
    with pytest.raises(ValueError, match="steps_per_chunk"):
        cc.step_cost(BIG, "colocated", 0, HIGH)
    with pytest.raises(ValueError, match="mode"):
        cc.step_cost(BIG, "actors", 1, HIGH)


def test_the_fixed_micro_batch_ratio_it_prints_is_read_from_the_measured_results():
    ratio = float(cc.FIXED_MICRO_BATCH_RATIO.search(cc.RESULTS.read_text()).group(1))
    assert ratio > 1.0  # by fixed row counts the update computes padding: slower


def test_the_run_budgets_measured_figures_are_the_ones_in_results():
    """dapo.cluster.cluster_cost prices the run budget without reading RESULTS.md (the package does
    not ship it): its copy of section 4's figures must be the measured ones."""
    from dapo.cluster import cluster_cost

    measured = cc.handoff_figures(cc.RESULTS.read_text())
    assert cluster_cost.MEASURED_HANDOFF == {key: measured[key] for key in cluster_cost.MEASURED_HANDOFF}
    assert (cluster_cost.LOW, cluster_cost.HIGH) == (LOW, HIGH)


@pytest.mark.parametrize("model", cc.MODELS, ids=lambda m: m.name)
def test_one_step_off_is_bounded_by_the_rollouts_share_and_its_split_keeps_the_update_within_the_rollout(model):
    """The speed-up lies in (1, 1 / rollout share]; the trainer's GPUs are the fewest whose update is
    no longer than the rollout, and the rollout keeps whole vLLM engines."""
    for scenario in (LOW, HIGH):
        cost = cc.one_step_off_cost(model, scenario)
        assert 1.0 < cost.speedup <= 1 / (1 - cc.UPDATE_SHARE)
        assert cost.trainer_gpus + cost.rollout_gpus == model.gpus and cost.rollout_gpus % model.tensor_parallel == 0
        compute = cc.compute_s(model)
        assert cc.UPDATE_SHARE * compute * model.gpus / cost.trainer_gpus <= (1 - cc.UPDATE_SHARE) * compute
        fewer = cost.trainer_gpus - model.tensor_parallel
        assert fewer < 1 or cc.UPDATE_SHARE * compute * model.gpus / fewer > (1 - cc.UPDATE_SHARE) * compute
