"""Colocated execution: n steps in one process with the trainer and the rollout engine
resident, the new weights synced into the engine in memory, give the per-stage path's steps.

The comparisons are bit for bit: in fp32 the in-memory sync hands the engine the very values the
per-stage checkpoint holds, and a trainer resumed from a checkpoint (weights and optimizer
state) continues exactly as the resident one.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dapo.execution.stages import generation, setup, training
from dapo.execution.colocated import run_colocated
from dapo.config import DAPOConfig
from dapo.engines.rollout import close_cached_rollout_engine

from engines import one_torch_thread
from policy_steps import shared_tiny_policy

COMPARED = ("rollout/tokens", "sampling/kept_groups", "sampling/rounds", "train/reward_mean", "train/acc", "actor/pg_loss",
            "actor/grad_norm", "actor/num_updates", "step/skipped")


@pytest.fixture(autouse=True)
def _close_engine():
    yield
    close_cached_rollout_engine()


def per_stage(config: DAPOConfig, policy_dir: str, data_dir: str, steps: int, out_root: Path) -> tuple[list[dict], str]:
    """`steps` steps the per-stage way in this process: each step's rounds on the checkpoint the
    last one wrote, then policy_step (a trainer started on it, the next checkpoint saved).
    Returns the metrics and the last checkpoint."""
    metrics = []
    for step in range(steps):
        batch, state = generation.sample_batch(config, policy_dir, data_dir, step)
        next_dir = str(out_root / f"policy-{step + 1}")
        metrics.append(training.policy_step(config, policy_dir, batch, state, step, next_dir))
        policy_dir = next_dir
    return metrics, policy_dir


def assert_same_steps(stage_metrics: list[dict], colocated_metrics: list[dict], stage_dir: str, colocated_dir: str) -> None:
    for step, (a, b) in enumerate(zip(stage_metrics, colocated_metrics, strict=True)):
        assert {key: a.get(key) for key in COMPARED} == {key: b.get(key) for key in COMPARED}, f"step {step}"
        assert set(a) <= set(b), f"step {step}: colocated lacks {set(a) - set(b)}"
    weights_a, weights_b = load_file(f"{stage_dir}/model.safetensors"), load_file(f"{colocated_dir}/model.safetensors")
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[name], weights_b[name]) for name in weights_a)


def hf_torch_run(tmp_path_factory, tmp_path) -> tuple[DAPOConfig, str, str]:
    """A small run on hf rollout and the torch trainer (no vLLM, no DeepSpeed): (config, policy, data)."""
    policy_dir = shared_tiny_policy(tmp_path_factory)
    config = DAPOConfig.tiny_cpu().replace(
        model_path=policy_dir, rollout_backend="hf", trainer_backend="torch", dynamic_sampling=False, n_samples_per_prompt=4,
        train_prompt_bsz=2, gen_prompt_bsz=2, ppo_mini_batch_size=1, max_response_length=12, overlong_buffer_len=4, lr=1e-3,
    )
    setup.prepare_data(config, tmp_path / "data")
    return config, policy_dir, str(tmp_path / "data")


def test_colocated_steps_are_the_per_stage_steps_hf_and_torch(tmp_path_factory, tmp_path):
    """The fast check of the step logic."""
    config, policy_dir, data = hf_torch_run(tmp_path_factory, tmp_path)
    with one_torch_thread():
        stage_metrics, stage_dir = per_stage(config, policy_dir, data, 2, tmp_path / "stage")
        result = run_colocated(config, policy_dir, data, 0, 2, tmp_path / "colocated", checkpoint_every=2)
    assert result.checkpoint_dir == str(tmp_path / "colocated" / "policy-2")
    assert [m["step/skipped"] for m in result.step_metrics] == [0.0, 0.0]
    assert_same_steps(stage_metrics, result.step_metrics, stage_dir, result.checkpoint_dir)
    assert not (tmp_path / "colocated" / "policy-1").exists()  # step 1 sampled from weights synced in memory


KILLED_RUN = """
import json, sys
import torch
torch.set_num_threads(1)
from dapo.execution.colocated import run_colocated
from dapo.config import DAPOConfig
run_colocated(DAPOConfig.from_dict(json.loads(sys.argv[1])), sys.argv[2], sys.argv[3], 0, 3, sys.argv[4])
"""


def test_a_killed_colocated_run_resumes_after_its_last_recorded_step(tmp_path_factory, tmp_path):
    """3 steps, SIGKILLed in step 2's rollout, then again while writing step 2's checkpoint
    (its metrics recorded, the checkpoint not in place): each run on the same out_root goes
    on after the newest checkpoint there, and the last ends with the uninterrupted run's
    steps and weights, bit for bit."""
    config, policy_dir, data = hf_torch_run(tmp_path_factory, tmp_path)
    with one_torch_thread():
        whole = run_colocated(config, policy_dir, data, 0, 3, tmp_path / "whole")
    assert sorted(p.name for p in (tmp_path / "whole").glob("policy-*")) == ["policy-3"]  # the older records pruned
    out = tmp_path / "killed"
    for crash_at, recorded in (("rollout@2", ["0.json", "1.json"]), ("checkpoint_commit@2", ["0.json", "1.json", "2.json"])):
        env = {**os.environ, "DAPO_CRASH_AT": crash_at, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        killed = subprocess.run([sys.executable, "-c", KILLED_RUN, config.to_json(), policy_dir, data, str(out)],
                                env=env, capture_output=True, text=True, timeout=600)
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
        assert sorted(p.name for p in (out / "steps").glob("*.json")) == recorded
        assert not (out / "policy-3").exists()
    ran = []
    with one_torch_thread():
        resumed = run_colocated(config, policy_dir, data, 0, 3, out, on_step=lambda step, metrics: ran.append(step))
    assert ran == [2]  # steps 0 and 1 come from their records, step 2's metrics were written again
    assert_same_steps(whole.step_metrics, resumed.step_metrics, whole.checkpoint_dir, resumed.checkpoint_dir)
    assert run_colocated(config, policy_dir, data, 0, 3, out).step_metrics == resumed.step_metrics  # done: nothing runs


TRACKED_RUN = """
import json, sys
import torch
torch.set_num_threads(1)
from dapo import tracking
from dapo.execution.colocated import run_colocated
from dapo.config import DAPOConfig
config, policy, data, out, n_steps, every, target = sys.argv[1:]
target = tracking.RunTarget(**json.loads(target))
log = lambda step, metrics: tracking.deliver(target, [tracking.metrics_record(step + 1, metrics)])
result = run_colocated(DAPOConfig.from_dict(json.loads(config)), policy, data, 0, int(n_steps), out,
                       checkpoint_every=int(every), on_step=log)
# what log_chunk does after the chunk: every step once more, MLflow takes the ones it lacks
tracking.deliver(target, [tracking.metrics_record(i + 1, m) for i, m in enumerate(result.step_metrics)])
"""


def test_a_colocated_run_killed_at_random_moments_resumes_each_time_to_the_uninterrupted_weights(tmp_path_factory, tmp_path):
    """5 steps, a record every step: killed first in step 2's rollout (the resume then has 3
    records to write: each save after a resume once needed the record it resumed from,
    which the first save prunes), then SIGKILLed at random instants (rollout, update,
    sync, record, prune, MLflow delivery: drawn within the first run's length) and run
    again until a run finishes by itself.
    The finished run has the uninterrupted run's steps and weights, bit for bit, and MLflow
    holds each step once; a record checkpoint every 2 steps resumes the same way."""
    import json
    import random
    import time

    from dapo.tracking import RunTarget

    config, policy_dir, data = hf_torch_run(tmp_path_factory, tmp_path)
    n_steps = 5
    with one_torch_thread():
        whole = run_colocated(config, policy_dir, data, 0, n_steps, tmp_path / "whole")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    rng = random.Random(29)
    for every, random_kills in ((1, 2), (2, 1)):
        # A scenario whose resumed run ends before its drawn kill instant (the first run's
        # length is measured under whatever else loads the machine) is run again afresh.
        for scenario in range(3):
            out = tmp_path / f"killed-every-{every}-{scenario}"
            target = RunTarget(f"sqlite:///{tmp_path / f'mlflow-{every}-{scenario}.db'}", "kills", "run", "run")
            command = [sys.executable, "-c", TRACKED_RUN, config.to_json(), policy_dir, data, str(out), str(n_steps), str(every),
                       json.dumps(target.__dict__)]
            started = time.monotonic()
            first = subprocess.run(command, env={**env, "DAPO_CRASH_AT": "rollout@2"}, capture_output=True, text=True, timeout=600)
            assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
            # The killed run started and ran 2 steps; each later one starts and runs up to 3: kill
            # instants drawn below its length land anywhere from the imports to the last step.
            first_seconds = time.monotonic() - started
            kills, started = 0, time.monotonic()
            while True:
                run = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                       start_new_session=True)
                try:
                    _, stderr = run.communicate(timeout=rng.uniform(0.3, 0.95) * first_seconds if kills < random_kills else 600)
                    assert run.returncode == 0, stderr[-3000:]
                    break
                except subprocess.TimeoutExpired:
                    os.killpg(run.pid, signal.SIGKILL)
                    run.communicate()
                    kills += 1
            if kills >= 1:
                break
        assert kills >= 1 and time.monotonic() - started < 900
        with one_torch_thread():
            resumed = run_colocated(config, policy_dir, data, 0, n_steps, out)  # done: reads the records back
        assert_same_steps(whole.step_metrics, resumed.step_metrics, whole.checkpoint_dir, resumed.checkpoint_dir)
        client = mlflow_client(target.tracking_uri)
        run_id = client.search_runs([client.get_experiment_by_name("kills").experiment_id])[0].info.run_id
        for key in ("train/acc", "actor/pg_loss", "rollout/tokens"):
            assert sorted(m.step for m in client.get_metric_history(run_id, key)) == list(range(1, n_steps + 1)), (every, key)


def mlflow_client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri)


def test_a_lost_sync_fires_the_guard_and_a_fresh_engine_on_the_trainers_weights_fixes_the_batch(tmp_path_factory, tmp_path, monkeypatch):
    """Step 1 samples from step 0's starting weights (the sync dropped): the guard refuses the
    batch, the trainer's weights are written and a fresh engine regenerates the batch; those
    weights (a whole checkpoint: ~0.5 TB at 32B) go with the step's record."""
    from dapo.engines.rollout.hf_engine import HFRolloutEngine

    config, policy_dir, data = hf_torch_run(tmp_path_factory, tmp_path)
    monkeypatch.setattr(HFRolloutEngine, "_load_tensors", lambda engine, named_tensors: None)
    with one_torch_thread():
        result = run_colocated(config, policy_dir, data, 0, 2, tmp_path / "colocated")
    last = result.step_metrics[1]
    assert last["guard/rollout_logprob_gap"] > config.rollout_gap_threshold
    assert (last["guard/regenerated"], last["guard/stopped"], last["step/skipped"]) == (1.0, 0.0, 0.0)
    assert last["actor/rollout_logprob_diff"] < config.rollout_gap_threshold
    assert not (tmp_path / "colocated" / "regenerate-1").exists()  # the fresh engine's weights, pruned with the older records


def test_a_colocated_run_stops_after_max_bad_steps_in_a_row(tmp_path_factory, tmp_path, monkeypatch):
    """A chunk whose updates are all refused as non-finite (the trainer's own refusal is
    tested in test_trainer) stops at max_bad_steps in a row, its checkpoint written, instead
    of sampling on for the rest of a long chunk; run again it runs nothing; log_chunk's count
    then fails the run as per stage."""
    import dapo.execution.colocated

    config, policy_dir, data = hf_torch_run(tmp_path_factory, tmp_path)
    config = config.replace(max_bad_steps=2)
    real_update = dapo.execution.colocated.train_on_batch

    def refused_from_step_1(trainer, config, batch, step, metrics, regenerate, label=""):
        if step < 1:
            return real_update(trainer, config, batch, step, metrics, regenerate, label)
        metrics.update({"actor/num_updates": 0.0, "actor/nonfinite_updates": 1.0})  # as a step whose every update was refused
        return True

    monkeypatch.setattr(dapo.execution.colocated, "train_on_batch", refused_from_step_1)
    ran = []
    with one_torch_thread():
        result = run_colocated(config, policy_dir, data, 0, 5, tmp_path / "out", checkpoint_every=5,
                               on_step=lambda step, metrics: ran.append(step))
        assert ran == [0, 1, 2] and len(result.step_metrics) == 3
        assert result.checkpoint_dir == str(tmp_path / "out" / "policy-3")
        assert run_colocated(config, policy_dir, data, 0, 5, tmp_path / "out", on_step=lambda *_: ran.append(-1)).step_metrics \
            == result.step_metrics and ran == [0, 1, 2]
    bad = 0
    with pytest.raises(training.TooManyBadSteps, match="step 3: 2 consecutive steps"):
        for offset, metrics in enumerate(result.step_metrics):
            bad = training.count_bad_steps(bad, metrics, config.max_bad_steps, offset + 1)


def test_an_engine_that_releases_its_weights_during_the_update_gets_them_back(tmp_path_factory, tmp_path, monkeypatch):
    """release_memory as vLLM's sleep level 2 does it (a CUDA feature, so here the hf engine's
    weights are discarded, made NaN): released, the engine refuses to generate; each step's
    sync gives it the trainer's weights again, also after a step that skips its update
    (step 0 here), and the steps are those of a run that never released anything, bit for bit."""
    import dapo.execution.colocated
    from dapo.engines.rollout import close_cached_rollout_engine, hf_engine

    config, policy_dir, data = hf_torch_run(tmp_path_factory, tmp_path)
    monkeypatch.setattr(dapo.execution.colocated, "skips_update", lambda config, batch, state, step: step == 0)
    with one_torch_thread():
        kept = run_colocated(config, policy_dir, data, 0, 2, tmp_path / "kept")
    close_cached_rollout_engine()

    def discard_weights(engine) -> bool:
        with torch.no_grad():
            for param in engine.model.parameters():
                param.fill_(float("nan"))
        return True

    monkeypatch.setattr(hf_engine.HFRolloutEngine, "_release_memory", discard_weights)
    with one_torch_thread():
        released = run_colocated(config, policy_dir, data, 0, 2, tmp_path / "released")
        engine = generation.policy_engine(config, policy_dir)
        assert engine.release_memory() and engine.released
        with pytest.raises(RuntimeError, match="released its memory"):
            engine.generate(["1+1="], engine_sampling())
    assert [m["step/skipped"] for m in released.step_metrics] == [1.0, 0.0]
    assert_same_steps(kept.step_metrics, released.step_metrics, kept.checkpoint_dir, released.checkpoint_dir)


def engine_sampling():
    from dapo.engines.rollout import SamplingSettings

    return SamplingSettings(n=1, max_tokens=4, temperature=1.0, top_p=1.0, seed=0)
