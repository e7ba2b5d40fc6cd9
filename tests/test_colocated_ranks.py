"""Colocated execution over several ranks, run for real: flytekit's Elastic launches the
colocated chunk's 2 processes (gloo on this CPU) as it would in one pod of 2 GPUs. Each
rank is a DeepSpeed ZeRO-3 rank and a vLLM engine of its own (external launcher, data
parallel 2): the engines sample one rollout shard each and gather the scored round, the
update is one over both ranks, and each rank syncs the gathered parameters into its engine.
The steps are those of one process sampling both shards."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from flytekit.types.directory import FlyteDirectory
from safetensors.torch import load_file

from dapo import checkpoint, pipeline, tracking
from dapo.colocated import run_colocated
from dapo.config import DAPOConfig
from dapo.rollout import close_cached_rollout_engine
from tasks import train

try:
    from test_rollout import one_torch_thread
    from test_trainer import shared_tiny_policy
except ImportError:  # run from the repo root as a package
    from tests.test_rollout import one_torch_thread
    from tests.test_trainer import shared_tiny_policy

pytestmark = [pytest.mark.slow, pytest.mark.deepspeed, pytest.mark.vllm]

EXACT = ("rollout/tokens", "sampling/kept_groups", "sampling/rounds", "train/reward_mean", "train/acc", "actor/num_updates",
         "step/skipped", "guard/regenerated")


def test_two_rank_colocated_chunk_runs_the_one_process_steps(tmp_path_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("FLYTE_LOCAL_CACHE_ENABLED", "false")  # run the chunk, never serve it from ~/.flyte
    policy_dir = shared_tiny_policy(tmp_path_factory)
    one = DAPOConfig.tiny_cpu().replace(
        model_path=policy_dir, execution="colocated", zero_stage=3, rollout_shards=2, dynamic_sampling=False, n_samples_per_prompt=4,
        train_prompt_bsz=4, gen_prompt_bsz=8, ppo_mini_batch_size=2, max_response_length=16, overlong_buffer_len=4, lr=1e-3,
    )
    two = one.replace(trainer_nproc_per_node=2)
    assert two.rollout_groups == 2
    data_dir = tmp_path / "data"
    pipeline.prepare_data(one, data_dir)
    target = tracking.RunTarget(f"sqlite:///{tmp_path}/mlflow.db", "ranks", "run-key", "ranks")

    chunk = train.colocated_chunk_for(two)
    assert chunk.task_config.nproc_per_node == 2 and chunk.task_function is train.colocated_chunk_elastic
    records = train.records_dir(two, FlyteDirectory(policy_dir), 0, 2)
    shutil.rmtree(records, ignore_errors=True)
    try:
        out = chunk(config=two, target_json=json.dumps(target.__dict__), policy=FlyteDirectory(policy_dir),
                    data=FlyteDirectory(str(data_dir)), first_step=0, last_step=2, checkpoint_every=1)
        assert checkpoint.is_complete(out.policy.path, verify=True)
        shards = sorted(p.name for p in (Path(out.policy.path) / "trainer_state" / "deepspeed" / "state").iterdir())
        both = load_file(f"{out.policy.path}/model.safetensors")
    finally:
        shutil.rmtree(records, ignore_errors=True)
    assert [s for s in shards if s.endswith("optim_states.pt")] == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]  # both ranks saved their optimizer partition

    with one_torch_thread():
        alone = run_colocated(one, policy_dir, str(data_dir), 0, 2, tmp_path / "one")
    close_cached_rollout_engine()
    assert len(out.metrics) == len(alone.step_metrics) == 2
    for step, (ranks, single) in enumerate(zip(out.metrics, alone.step_metrics)):
        assert {k: ranks[k] for k in EXACT} == {k: single[k] for k in EXACT}, f"step {step}"
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
            assert math.isclose(ranks[key], single[key], rel_tol=1e-4, abs_tol=1e-7), (step, key)
        # step 1 was sampled by both engines after the in-memory sync: they held the trained weights
        assert ranks["guard/rollout_logprob_gap"] < 1e-5, step
    assert out.metrics[1]["sync/seconds"] > 0
    single = load_file(f"{alone.checkpoint_dir}/model.safetensors")
    assert both.keys() == single.keys()
    start = load_file(f"{policy_dir}/model.safetensors")
    assert max((both[n] - start[n]).abs().max().item() for n in both) > 1e-4  # it did update
    for name in both:
        torch.testing.assert_close(both[name], single[name], rtol=1e-4, atol=1e-6, msg=name)

    # rank 0 alone reported the steps, each once, while the chunk ran
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=target.tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("ranks").experiment_id])
    history = client.get_metric_history(run.info.run_id, "rollout/tokens")
    assert sorted((p.step, p.value) for p in history) == [(1, out.metrics[0]["rollout/tokens"]), (2, out.metrics[1]["rollout/tokens"])]
