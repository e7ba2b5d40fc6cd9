"""One step off policy (off_policy_steps=1): the overlapped chunk's trainer and rollout
processes give, bit for bit, the steps of the same schedule run one stage after the other
in one process (step t's batch sampled from checkpoint t-1's weights), and a killed chunk
resumes with nothing lost or replayed."""

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dapo.config import ConfigError, DAPOConfig
from dapo.execution.overlap import read_batch, run_overlapped
from dapo.engines.rollout import close_cached_rollout_engine
from dapo.execution.stages import generation, training

from engines import one_torch_thread
from test_colocated import assert_same_steps, hf_torch_run


@pytest.fixture(autouse=True)
def _close_engine():
    yield
    close_cached_rollout_engine()


def one_step_off(config: DAPOConfig) -> DAPOConfig:
    return config.replace(off_policy_steps=1, rollout_correction="token_tis")


def sequential_one_step_off(config: DAPOConfig, policy_dir: str, data_dir: str, steps: int, out_root: Path) -> tuple[list[dict], str]:
    """The one-step-off schedule without overlap, in this process: step t samples from the
    checkpoint before step t-1's update (step 0 from the first), then a trainer started on
    checkpoint t updates. Returns the steps' metrics and the last checkpoint."""
    checkpoints, metrics = [policy_dir], []
    for step in range(steps):
        batch, state = generation.sample_batch(config, checkpoints[max(step - 1, 0)], data_dir, step)
        checkpoints.append(str(out_root / f"policy-{step + 1}"))
        metrics.append(training.policy_step(config, checkpoints[step], batch, state, step, checkpoints[-1]))
    return metrics, checkpoints[-1]


def test_the_overlapped_chunk_runs_the_one_step_off_schedule_bit_for_bit(tmp_path_factory, tmp_path):
    """3 steps: steps 1 and 2 train on batches one update old (staleness 1), the weights the
    rollout process samples step 2 from come through the broadcast, and the batch of step 3
    (the next chunk's first) is returned, sampled from checkpoint 2's weights."""
    config, policy_dir, data = hf_torch_run(tmp_path_factory, tmp_path)
    config = one_step_off(config)
    with one_torch_thread():
        reference, reference_dir = sequential_one_step_off(config, policy_dir, data, 3, tmp_path / "sequential")
        result = run_overlapped(config, policy_dir, data, 0, 3, tmp_path / "overlapped")
        next_batch, _ = generation.sample_batch(config, str(tmp_path / "sequential" / "policy-2"), data, 3)
    assert [m["off_policy/staleness"] for m in result.step_metrics] == [0.0, 1.0, 1.0]
    assert all(m["step/skipped"] == 0.0 and m["guard/regenerated"] == 0.0 for m in result.step_metrics)
    assert result.step_metrics[2]["rollout_corr/kl"] != 0.0  # the lag is measured and corrected
    assert_same_steps(reference, result.step_metrics, reference_dir, result.checkpoint_dir)
    assert result.next_batch.policy_version == 2
    assert result.next_batch.batch.equals(next_batch)


def test_off_policy_steps_needs_a_rollout_correction_and_one_node_when_colocated():
    with pytest.raises(ConfigError, match="rollout_correction"):
        DAPOConfig.tiny_cpu().replace(off_policy_steps=1)
    with pytest.raises(ConfigError, match="off_policy_steps"):
        DAPOConfig.tiny_cpu().replace(off_policy_steps=2, rollout_correction="token_tis")
    off = {"off_policy_steps": 1, "rollout_correction": "token_tis", "execution": "colocated"}
    with pytest.raises(ConfigError, match="trainer's ranks and one rollout engine on one node"):
        DAPOConfig.paper_32b().replace(**off)
    # 2 trainer ranks beside a TP-4 engine: on policy, each engine's ranks must be trainer ranks
    with pytest.raises(ConfigError, match="must divide trainer_nproc_per_node=2"):
        DAPOConfig.tiny_cpu().replace(trainer_nproc_per_node=2, tensor_parallel_size=4, execution="colocated")
    DAPOConfig.tiny_cpu().replace(trainer_nproc_per_node=2, tensor_parallel_size=4, **off)


KILLED_RUN = """
import json, sys
import torch
torch.set_num_threads(1)
from dapo.execution.overlap import run_overlapped
from dapo.config import DAPOConfig
run_overlapped(DAPOConfig.from_dict(json.loads(sys.argv[1])), sys.argv[2], sys.argv[3], 0, 4, sys.argv[4])
"""


def test_a_killed_overlapped_chunk_resumes_with_nothing_lost_or_replayed(tmp_path_factory, tmp_path):
    """4 steps, SIGKILLed in the trainer's step 2 (its rollout process dies with it), then in
    the rollout process's step 4 (the trainer stops with an error naming it): each run on
    the same out_root goes on after the newest checkpoint there, and the last ends with the
    uninterrupted run's steps and weights, bit for bit, its steps run once each after the
    checkpoint they resumed from."""
    config, policy_dir, data = hf_torch_run(tmp_path_factory, tmp_path)
    config = one_step_off(config)
    with one_torch_thread():
        whole = run_overlapped(config, policy_dir, data, 0, 4, tmp_path / "whole")
    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    for crash_at, recorded, returncode in (("policy_step@2", ["0.json", "1.json"], -signal.SIGKILL),
                                           ("rollout@4", ["0.json", "1.json", "2.json"], 1)):
        killed = subprocess.run([sys.executable, "-c", KILLED_RUN, config.to_json(), policy_dir, data, str(out)],
                                env={**env, "DAPO_CRASH_AT": crash_at}, capture_output=True, text=True, timeout=600)
        assert killed.returncode == returncode, killed.stderr[-3000:]
        assert sorted(p.name for p in (out / "steps").glob("*.json")) == recorded
        if returncode == 1:
            assert "the rollout process exited (signal SIGKILL) before writing step 4's batch" in killed.stderr
    assert sorted(p.name for p in (out / "batches").glob("*.arrow")) == ["3.arrow"]  # kept with checkpoint 3
    ran = []
    with one_torch_thread():
        resumed = run_overlapped(config, policy_dir, data, 0, 4, out, on_step=lambda step, metrics: ran.append(step))
    assert ran == [3]
    assert_same_steps(whole.step_metrics, resumed.step_metrics, whole.checkpoint_dir, resumed.checkpoint_dir)
    assert resumed.next_batch.batch.equals(whole.next_batch.batch)
    done = run_overlapped(config, policy_dir, data, 0, 4, out)  # done: nothing runs, the records are read back
    assert done.step_metrics == resumed.step_metrics and done.next_batch.batch.equals(whole.next_batch.batch)
    assert read_batch(out, 4).policy_version == 3


RANKS_RUN = """
import json, sys
import torch
torch.set_num_threads(1)
from dapo.execution.overlap import run_overlapped
from dapo.config import DAPOConfig
run_overlapped(DAPOConfig.from_dict(json.loads(sys.argv[1])), sys.argv[2], sys.argv[3], 0, 2, sys.argv[4])
"""


@pytest.mark.deepspeed
def test_two_trainer_ranks_beside_the_rollout_process_take_the_steps_of_one(tmp_path_factory, tmp_path):
    """Under torchrun, 2 DeepSpeed ranks (ZeRO-2, gloo) and the rollout process rank 0 starts:
    2 steps (both on batches from the first weights) with one process's metrics and weights
    within 1e-4, and the batch after them sampled from the weights the main rank broadcast."""
    config, policy_dir, data = hf_torch_run(tmp_path_factory, tmp_path)
    config = one_step_off(config).replace(trainer_backend="deepspeed", zero_stage=2)
    with one_torch_thread():
        one = run_overlapped(config, policy_dir, data, 0, 2, tmp_path / "one")
    out = tmp_path / "two"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    script = tmp_path / "ranks.py"
    script.write_text(RANKS_RUN)
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
                          config.replace(trainer_nproc_per_node=2).to_json(), policy_dir, data, str(out)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    records = [json.loads((out / "steps" / f"{step}.json").read_text()) for step in range(2)]
    for step, (a, b) in enumerate(zip(one.step_metrics, records)):
        assert (a["rollout/tokens"], a["train/acc"], a["off_policy/staleness"]) == (b["rollout/tokens"], b["train/acc"],
                                                                                    b["off_policy/staleness"]), step
        assert math.isclose(a["actor/pg_loss"], b["actor/pg_loss"], rel_tol=1e-4, abs_tol=1e-7), step
    ours, theirs = load_file(f"{one.checkpoint_dir}/model.safetensors"), load_file(out / "policy-2" / "model.safetensors")
    for name in ours:
        torch.testing.assert_close(theirs[name], ours[name], rtol=1e-4, atol=1e-6, msg=name)
    assert read_batch(out, 2).policy_version == 1
