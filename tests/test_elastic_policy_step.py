"""The policy step as a torch-elastic task, run for real: flytekit's Elastic launches 2
DeepSpeed processes (gloo on this CPU) in one "node", as it would in one pod."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from flytekit.types.directory import FlyteDirectory
from safetensors.torch import load_file

from dapo import checkpoint
from dapo.algorithm.sampling import SamplingState
from tasks import train
from policy_steps import make_config, scored_table, shared_tiny_policy

pytestmark = [pytest.mark.slow, pytest.mark.deepspeed]


def run_step(task, config, policy_dir: str, table) -> tuple[str, dict[str, float]]:
    """The task executed locally (outside a workflow), as pyflyte run would."""
    out = task(config=config, policy=FlyteDirectory(policy_dir), batch=table, sampling_state=SamplingState(), step=0)
    return out.policy.path, out.metrics


def weights(checkpoint_dir: str) -> dict[str, torch.Tensor]:
    return load_file(f"{checkpoint_dir}/model.safetensors")


def test_two_process_elastic_step_matches_one_process(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("FLYTE_LOCAL_CACHE_ENABLED", "false")  # run the step, never serve it from ~/.flyte
    policy_dir = shared_tiny_policy(tmp_path_factory)
    table = scored_table(groups=4)
    # The synthetic batch's rollout log-probs come from no engine: the rollout guard is off.
    # Packed micro-batches of 48 tokens (2-3 rows): 3-4 a mini-batch, dealt to the two
    # ranks by tokens, one rank running a zero-weight filler where their counts differ.
    config = make_config(trainer_backend="deepspeed", zero_stage=2, max_prompt_length=16, max_response_length=16,
                         max_tokens_per_micro_batch=48, remove_padding=True, max_rollout_logprob_gap=math.inf)
    two = config.replace(trainer_nproc_per_node=2)
    elastic = train.policy_step_for(two)
    assert elastic.task_config.nproc_per_node == 2 and elastic is not train.policy_step

    single_dir, single_metrics = run_step(train.policy_step, config, policy_dir, table)
    double_dir, double_metrics = run_step(elastic, two, policy_dir, table)

    assert checkpoint.is_complete(double_dir, verify=True)
    marker = checkpoint.read_marker(double_dir)
    assert marker["step"] == 0 and marker["extra"]["updates"] == single_metrics["actor/num_updates"] == 2
    shards = sorted(p.name for p in (Path(double_dir) / "trainer_state" / "deepspeed" / "state").iterdir())
    assert [s for s in shards if s.startswith("zero_pp_rank")] == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]  # both ranks saved their optimizer partition into the one directory
    start, one, both = weights(policy_dir), weights(single_dir), weights(double_dir)
    assert one.keys() == both.keys()
    for name in one:
        assert torch.isfinite(both[name]).all()
        torch.testing.assert_close(both[name], one[name], rtol=1e-4, atol=1e-6, msg=name)
    assert max((both[n] - start[n]).abs().max().item() for n in both) > 1e-4  # it did update
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/tokens"):
        assert math.isclose(double_metrics[key], single_metrics[key], rel_tol=1e-4), key
