"""The rollout guard: a batch whose rollout log-probs disagree with the trainer's is not
trained on; it is regenerated, and the run stops if the gap persists.

These run the torch trainer on the embedded tiny policy with hand-made batches (~1 s
each); tests/test_weight_sync.py fires the guard through a real corrupted vLLM reload.
"""

import math
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from dapo import checkpoint
from dapo.algorithm.batch import SCORED_SCHEMA, collate_table, response_log_probs
from dapo.config import ConfigError, DAPOConfig
from dapo.algorithm.sampling import SamplingState
from dapo.execution.stages.guard import RolloutMismatch, check_rollout_guard
from dapo.execution.stages.training import policy_step

from policy_steps import make_config, scored_table, shared_tiny_policy


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory) -> str:
    return shared_tiny_policy(tmp_path_factory)


def with_true_log_probs(policy_dir: str, table: pa.Table, noise: float = 0.0) -> pa.Table:
    """The table with rollout_log_probs the policy's own (what a correct engine returns), plus noise."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
    batch = collate_table(table, model.config.pad_token_id or 0)
    with torch.no_grad():
        log_probs, _ = response_log_probs(model, batch)
    values = [
        [v + noise for v in log_probs[i, : len(ids)].tolist()] for i, ids in enumerate(table.column("response_token_ids").to_pylist())
    ]
    index = table.schema.get_field_index("rollout_log_probs")
    return table.set_column(index, SCORED_SCHEMA.field("rollout_log_probs"), pa.array(values, pa.list_(pa.float32())))


def test_threshold_defaults_follow_the_dtype_and_can_be_set():
    assert DAPOConfig(dtype="float32").rollout_gap_threshold == 1e-3
    assert DAPOConfig(dtype="bfloat16").rollout_gap_threshold == 0.1
    assert DAPOConfig().rollout_gap_threshold == 0.1  # paper_32b trains in bf16
    assert DAPOConfig(dtype="float32", max_rollout_logprob_gap=0.5).rollout_gap_threshold == 0.5
    assert DAPOConfig.from_dict(DAPOConfig(max_rollout_logprob_gap=math.inf).to_dict()).rollout_gap_threshold == math.inf
    with pytest.raises(ConfigError, match="max_rollout_logprob_gap=0.0: must be > 0"):
        DAPOConfig(max_rollout_logprob_gap=0.0)


def test_guard_error_names_the_gap_the_checkpoint_and_the_cause():
    config = DAPOConfig(dtype="float32")
    check_rollout_guard(config, {"guard/stopped": 0.0, "guard/rollout_logprob_gap": 5.0}, step=3)  # not stopped: no error
    with pytest.raises(RolloutMismatch) as error:
        check_rollout_guard(config, {"guard/stopped": 1.0, "guard/regenerated": 1.0, "guard/rollout_logprob_gap": 0.337}, 3, "/ckpt/policy-3")
    message = str(error.value)
    assert "0.337 nats" in message and "/ckpt/policy-3" in message and "0.001 for float32" in message
    assert "restarted on the checkpoint and the batch regenerated" in message and "tied embeddings" in message


def run_step(policy_dir, tmp_path, batch, regenerate, **overrides):
    config = make_config(**overrides)
    out = tmp_path / "next"
    metrics = policy_step(config, policy_dir, batch, SamplingState(rounds=1, generated_groups=4, kept_groups=4), 0, out, regenerate=regenerate)
    return config, metrics, out


def test_matching_batch_trains_and_logs_the_gap(policy_dir, tmp_path):
    batch = with_true_log_probs(policy_dir, scored_table())
    calls = []
    _, metrics, out = run_step(policy_dir, tmp_path, batch, regenerate=calls.append)
    assert calls == [] and metrics["guard/regenerated"] == 0.0 and metrics["guard/stopped"] == 0.0
    assert metrics["guard/rollout_logprob_gap"] == metrics["actor/rollout_logprob_diff"] < 1e-5
    assert metrics["guard/threshold"] == 1e-3 and metrics["actor/num_updates"] >= 1
    assert checkpoint.is_complete(out)


def test_mismatched_batch_is_regenerated_then_trained_on(policy_dir, tmp_path):
    bad = with_true_log_probs(policy_dir, scored_table(), noise=-0.3)
    good = with_true_log_probs(policy_dir, scored_table(seed=1))
    calls = []

    def regenerate(batch):
        calls.append(batch.num_rows)
        return good

    _, metrics, _ = run_step(policy_dir, tmp_path, bad, regenerate)
    assert calls == [bad.num_rows]
    assert metrics["guard/rollout_logprob_gap"] == pytest.approx(0.3, abs=1e-4)
    assert metrics["guard/regenerated"] == 1.0 and metrics["guard/stopped"] == 0.0 and metrics["step/skipped"] == 0.0
    assert metrics["actor/rollout_logprob_diff"] < 1e-5 and metrics["actor/num_updates"] >= 1


@pytest.mark.parametrize("can_regenerate", [True, False])
def test_persistent_gap_keeps_the_policy_and_stops_the_run(policy_dir, tmp_path, can_regenerate):
    bad = with_true_log_probs(policy_dir, scored_table(), noise=-0.3)
    config, metrics, out = run_step(policy_dir, tmp_path, bad, (lambda batch: bad) if can_regenerate else None)
    assert metrics["guard/stopped"] == 1.0 and metrics["step/skipped"] == 1.0
    assert metrics["guard/regenerated"] == float(can_regenerate)
    assert "actor/num_updates" not in metrics  # nothing was trained on
    assert checkpoint.is_complete(out)
    assert (out / "model.safetensors").read_bytes() == (Path(policy_dir) / "model.safetensors").read_bytes()
    with pytest.raises(RolloutMismatch, match="0.3 nats"):
        check_rollout_guard(config, metrics, step=0)


def test_guard_off_trains_on_anything(policy_dir, tmp_path):
    bad = with_true_log_probs(policy_dir, scored_table(), noise=-0.3)
    _, metrics, _ = run_step(policy_dir, tmp_path, bad, regenerate=None, max_rollout_logprob_gap=math.inf)
    assert metrics["guard/stopped"] == 0.0 and metrics["actor/num_updates"] >= 1
