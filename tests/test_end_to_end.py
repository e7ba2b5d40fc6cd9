"""One full DAPO step for real: vLLM rollout, rewards, dynamic sampling, DeepSpeed update,
checkpoint, and the new checkpoint back in vLLM."""

from pathlib import Path

import pytest

from dapo import checkpoint
from dapo.config import DAPOConfig
from dapo.algorithm.sampling import SamplingState
from dapo.execution.stages.generation import rollout
from dapo.execution.stages.scoring import filter_groups, verify_rewards
from dapo.execution.stages.setup import prepare_data
from dapo.execution.stages.training import policy_step
from dapo.execution.stages.validation import evaluate
from dapo.model.policy import TinyPolicySpec, build_tiny_policy
from dapo.rewards import verify_answer
from dapo.engines.rollout import close_cached_rollout_engine

pytestmark = [pytest.mark.vllm, pytest.mark.deepspeed, pytest.mark.slow]


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    config = DAPOConfig.tiny_cpu().replace(
        train_prompt_bsz=4, gen_prompt_bsz=8, ppo_mini_batch_size=2, max_num_gen_batches=3,
        val_max_prompts=16, val_n_samples=2, lr=1e-3,
    )
    prepare_data(config, root / "data")
    build_tiny_policy(root / "policy-0", TinyPolicySpec(warm_start_steps=150))
    yield config, root
    close_cached_rollout_engine()


def test_one_step_end_to_end(run_dirs):
    config, root = run_dirs
    policy0, data = str(root / "policy-0"), str(root / "data")

    state, kept, round0 = SamplingState(), None, None
    while not state.done:
        responses, rollout_metrics = rollout(config, policy0, data, step=0, round_index=state.rounds)
        round0 = responses if round0 is None else round0
        assert responses.num_rows == config.gen_prompt_bsz * config.n_samples_per_prompt
        assert rollout_metrics["rollout/tokens"] > 0
        scored = verify_rewards(config, responses, step=0)
        kept, state = filter_groups(config, scored, kept, state, rollout_metrics)
    assert state.kept_groups > 0, "the warm-started policy should give some mixed groups"
    groups = set(kept.column("group_id").to_pylist())
    assert len(groups) <= config.train_prompt_bsz

    metrics = policy_step(config, policy0, kept, state, step=0, out_dir=root / "policy-1")
    assert metrics["step/skipped"] == 0.0
    assert metrics["actor/num_updates"] >= 1
    assert metrics["sampling/informative_groups"] == metrics["sampling/kept_groups"] == len(groups)  # all mixed: filtered
    assert abs(metrics["actor/rollout_logprob_diff"]) < 1e-3  # vLLM's log-probs == DeepSpeed's recomputation
    assert checkpoint.is_complete(root / "policy-1")

    # the new checkpoint goes into the live engine in place: same seed, other samples; and
    # reloading the old one reproduces round 0 token for token
    tokens = lambda table: table.column("response_token_ids").to_pylist()  # noqa: E731
    again, _ = rollout(config, str(root / "policy-1"), data, step=0, round_index=0)
    first, _ = rollout(config, policy0, data, step=0, round_index=0)
    assert tokens(first) != tokens(again)
    assert tokens(first) == tokens(round0)


def test_evaluate_reports_avg_at_k(run_dirs):
    """val/acc is the share of correct responses among val_max_prompts x val_n_samples, each
    sample's acc is the verifier's verdict, and validation is seeded: run twice, same figures."""
    config, root = run_dirs
    metrics, samples = evaluate(config, str(root / "policy-0"), str(root / "data"), step=0)
    responses = config.val_max_prompts * config.val_n_samples
    assert abs(metrics["val/acc"] * responses - round(metrics["val/acc"] * responses)) < 1e-6
    assert len(samples) == min(8, config.val_max_prompts)
    assert [s["acc"] for s in samples] == [float(verify_answer(s["response"], s["ground_truth"])) for s in samples]
    again, _ = evaluate(config, str(root / "policy-0"), str(root / "data"), step=0)
    assert again == metrics


def test_validation_measures_the_policy_entropy_on_its_own_samples(run_dirs):
    """val/entropy (val_entropy=True) is the mean next-token entropy over the validation
    responses' tokens, as computed row by row without padding; nothing else changes."""
    import torch
    from transformers import AutoModelForCausalLM

    from dapo.execution.stages.validation import policy_entropy, validation_samples

    config, root = run_dirs
    policy0, data = str(root / "policy-0"), str(root / "data")
    plain, _ = evaluate(config, policy0, data, step=0)
    metrics, _ = evaluate(config.replace(val_entropy=True), policy0, data, step=0)
    assert {k: v for k, v in metrics.items() if k != "val/entropy"} == plain

    model = AutoModelForCausalLM.from_pretrained(policy0, dtype=torch.float32).eval()
    table = validation_samples(config, policy0, data)
    total = tokens = 0.0
    with torch.no_grad():
        for prompt, response in zip(table.column("prompt_token_ids").to_pylist(), table.column("response_token_ids").to_pylist()):
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
            log_p = torch.log_softmax(logits.float(), dim=-1)
            total += float(-(log_p.exp() * log_p).sum())
            tokens += len(response)
    assert metrics["val/entropy"] == pytest.approx(total / tokens, rel=1e-4)
    assert metrics["val/entropy"] > 0
    assert policy_entropy(policy0, table, temperature=0.5) < metrics["val/entropy"]  # sharper at a lower temperature


def test_rollout_shards_split_the_round_without_overlap(run_dirs):
    """Two shards generate for the same prompts as one shard, each for its own half."""
    config, root = run_dirs
    policy0, data = str(root / "policy-0"), str(root / "data")
    whole, _ = rollout(config, policy0, data, step=1, round_index=0)
    two = config.replace(rollout_shards=2)
    halves = [rollout(two, policy0, data, step=1, round_index=0, shard=k)[0] for k in range(2)]

    def groups(table):
        return set(table.column("group_id").to_pylist())

    assert groups(halves[0]).isdisjoint(groups(halves[1]))
    assert groups(halves[0]) | groups(halves[1]) == groups(whole)
    assert [t.num_rows for t in halves] == [whole.num_rows // 2] * 2
