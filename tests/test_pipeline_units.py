"""Pipeline stages that need no engine: rewards on a rollout table, dynamic sampling, skips."""

import pyarrow as pa
import pytest

from dapo import checkpoint
from dapo.algorithm.batch import ROLLOUT_SCHEMA, SCORED_SCHEMA
from dapo.config import DAPOConfig
from dapo.data.prompts import PromptRecord
from dapo.algorithm.sampling import SamplingState
from dapo.execution.stages.generation import merge_shards, policy_engine, rollout_metrics_of, round_prompts, shard_bounds, with_rollout_metrics
from dapo.execution.stages.scoring import batch_metrics, filter_groups, verify_rewards
from dapo.execution.stages.training import TooManyBadSteps, count_bad_steps, policy_step


def rollout_table(groups: dict[str, list[str]], truth: str = "12", lengths: list[int] | None = None) -> pa.Table:
    rows = []
    for gid, texts in groups.items():
        for k, text in enumerate(texts):
            n = lengths[k] if lengths else 5
            rows.append({
                "group_id": gid, "prompt_uid": gid, "sample_index": k, "prompt": "q", "ground_truth": truth,
                "prompt_token_ids": [1, 2, 3], "response_token_ids": list(range(n)), "response_text": text,
                "rollout_log_probs": [-0.5] * n, "truncated": False,
            })
    return pa.Table.from_pylist(rows, schema=ROLLOUT_SCHEMA)


def config(**overrides) -> DAPOConfig:
    base = dict(n_samples_per_prompt=2, train_prompt_bsz=2, gen_prompt_bsz=3, max_num_gen_batches=3,
                ppo_mini_batch_size=1, max_response_length=20, overlong_buffer_len=10, format_reward_weight=0.0)
    return DAPOConfig.tiny_cpu().replace(**{**base, **overrides})


def test_verify_rewards_adds_scores():
    table = rollout_table({"a": ["5 + 7 = 12\nAnswer: 12", "Answer: 13"]})
    scored = verify_rewards(config(), table, step=0)
    assert scored.schema == SCORED_SCHEMA
    assert scored.column("acc").to_pylist() == [1.0, 0.0]
    assert scored.column("reward").to_pylist() == [1.0, -1.0]


def test_overlong_penalty_enters_the_reward():
    table = rollout_table({"a": ["Answer: 12", "Answer: 12"]}, lengths=[10, 15])
    scored = verify_rewards(config(), table, step=0)
    # L_max=20, L_cache=10: 15 tokens is 5 into the buffer -> -0.5
    assert scored.column("overlong_penalty").to_pylist() == pytest.approx([0.0, -0.5])
    assert scored.column("reward").to_pylist() == pytest.approx([1.0, 0.5])
    off = verify_rewards(config(enable_overlong_penalty=False), table, step=0)
    assert off.column("reward").to_pylist() == pytest.approx([1.0, 1.0])


def test_format_reward_decays_with_steps():
    table = rollout_table({"a": ["Answer: 13", "no answer"]})
    cfg = config(format_reward_weight=1.0, format_reward_decay_steps=4)
    early = verify_rewards(cfg, table, step=0).column("reward").to_pylist()
    later = verify_rewards(cfg, table, step=2).column("reward").to_pylist()
    done = verify_rewards(cfg, table, step=4).column("reward").to_pylist()
    assert early == pytest.approx([0.0, -1.0]) and later == pytest.approx([-0.5, -1.0]) and done == pytest.approx([-1.0, -1.0])


def test_filter_groups_accumulates_until_full():
    cfg = config()
    round0 = verify_rewards(cfg, rollout_table({"r0-a": ["Answer: 12", "Answer: 12"], "r0-b": ["Answer: 12", "Answer: 1"]}), 0)
    batch, state = filter_groups(cfg, round0, None, SamplingState(), {"rollout/tokens": 20, "rollout/seconds": 2})
    assert set(batch.column("group_id").to_pylist()) == {"r0-b"} and not state.done
    round1 = verify_rewards(cfg, rollout_table({"r1-a": ["Answer: 2", "Answer: 12"], "r1-b": ["Answer: 3", "Answer: 12"]}), 0)
    batch, state = filter_groups(cfg, round1, batch, state, {"rollout/tokens": 20, "rollout/seconds": 2})
    assert state.done and state.rounds == 2 and state.kept_groups == 3 and state.generated_groups == 4
    assert list(dict.fromkeys(batch.column("group_id").to_pylist())) == ["r0-b", "r1-a"]  # trimmed to train_prompt_bsz
    assert state.rollout_tokens == 40


def test_filter_groups_gives_up_after_max_rounds():
    cfg = config(max_num_gen_batches=2)
    uniform = verify_rewards(cfg, rollout_table({"a": ["Answer: 12", "Answer: 12"]}), 0)
    batch, state = filter_groups(cfg, uniform, None, SamplingState(), {})
    batch, state = filter_groups(cfg, uniform, batch, state, {})
    assert state.done and batch.num_rows == 0 and state.kept_groups == 0


def test_without_dynamic_sampling_every_group_is_kept():
    cfg = config(dynamic_sampling=False, gen_prompt_bsz=2)
    uniform = verify_rewards(cfg, rollout_table({"a": ["Answer: 12", "Answer: 12"], "b": ["x", "y"]}), 0)
    batch, state = filter_groups(cfg, uniform, None, SamplingState(), {})
    assert state.done and batch.num_rows == 4


def test_informative_groups_are_counted_without_dynamic_sampling(tmp_path):
    cfg = config(dynamic_sampling=False, train_prompt_bsz=4, gen_prompt_bsz=4, on_short_batch="skip")
    mixed = verify_rewards(cfg, rollout_table({"a": ["Answer: 12", "Answer: 12"], "b": ["Answer: 12", "y"]}), 0)
    batch, state = filter_groups(cfg, mixed, None, SamplingState(), {})
    source = tmp_path / "policy"
    with checkpoint.atomic_dir(source, step=0) as scratch:
        open(f"{scratch}/model.safetensors", "wb").write(b"weights")
    metrics = policy_step(cfg, str(source), batch, state, 0, tmp_path / "next")
    assert (metrics["sampling/kept_groups"], metrics["sampling/informative_groups"]) == (2.0, 1.0)


def test_empty_batch_skips_the_step_and_keeps_the_policy(tmp_path):
    source = tmp_path / "policy"
    with checkpoint.atomic_dir(source, step=0) as scratch:
        open(f"{scratch}/model.safetensors", "wb").write(b"weights")
    empty = SCORED_SCHEMA.empty_table()
    metrics = policy_step(config(), str(source), empty, SamplingState(rounds=3, generated_groups=9), 0, tmp_path / "next")
    assert metrics["step/skipped"] == 1.0 and metrics["sampling/kept_ratio"] == 0.0
    assert metrics["sampling/informative_groups"] == 0.0
    assert (tmp_path / "next" / "model.safetensors").read_bytes() == b"weights"
    assert checkpoint.is_complete(tmp_path / "next")


def test_batch_metrics():
    scored = verify_rewards(config(), rollout_table({"a": ["Answer: 12", "Answer: 7"]}, lengths=[4, 8]), 0)
    m = batch_metrics(scored, "train/")
    assert m["train/acc"] == 0.5 and m["train/response_length_mean"] == 6 and m["train/response_length_max"] == 8


def test_verdicts_math_verify_did_not_give_are_counted_and_shown_on_the_step_line():
    from dapo.report import step_line

    too_long = "Answer: " + "1+" * 600 + "1"  # beyond MAX_VERIFY_CHARS: no verdict, counted as wrong
    scored = verify_rewards(config(), rollout_table({"a": ["Answer: 12", too_long, too_long]}, lengths=[4, 8, 8]), 0)
    assert scored.column("unverified").to_pylist() == [0.0, 1.0, 1.0]
    assert scored.column("acc").to_pylist() == [1.0, 0.0, 0.0]
    m = {"step": 3, **batch_metrics(scored, "train/")}
    assert m["train/unverified"] == 2.0
    assert step_line(m).endswith("| unverified 2")
    assert "unverified" not in step_line({"step": 3, "train/unverified": 0.0})


def test_a_step_whose_unverified_share_passes_the_bound_trains_on_nothing_and_stops_the_run_after_its_metrics(tmp_path, caplog):
    from dapo.execution.stages.training import TooManyUnverified, check_verdicts

    too_long = "Answer: " + "1+" * 600 + "1"
    cfg = config(max_unverified_share=0.3, dynamic_sampling=False, train_prompt_bsz=2, on_short_batch="train")
    scored = verify_rewards(cfg, rollout_table({"a": ["Answer: 12", too_long], "b": [too_long, "Answer: 7"]}), 0)
    batch, state = filter_groups(cfg, scored, None, SamplingState(), {})
    assert (state.scored_responses, state.unverified_responses, state.unverified_share) == (4, 2, 0.5)
    assert len(state.unverified_notes) == 2 and "over math-verify's 1024" in state.unverified_notes[0]
    source = tmp_path / "policy"
    with checkpoint.atomic_dir(source, step=0) as scratch:
        open(f"{scratch}/model.safetensors", "wb").write(b"weights")
    metrics = policy_step(cfg, str(source), batch, state, 4, tmp_path / "next")  # trains on nothing: no trainer started
    assert (metrics["reward/unverified_share"], metrics["reward/stopped"], metrics["step/skipped"]) == (0.5, 1.0, 1.0)
    assert (tmp_path / "next" / "model.safetensors").read_bytes() == b"weights"  # the policy of the step before
    assert "step 5: 50.0% of the responses scored got no verdict" in caplog.text and "response starting 'Answer: 1+1+" in caplog.text
    with pytest.raises(TooManyUnverified, match=r"step 5: 50\.0% .*max_unverified_share 0\.3"):
        check_verdicts(cfg, metrics, 4)
    check_verdicts(cfg.replace(max_unverified_share=0.5), {**metrics, "reward/stopped": 0.0}, 4)  # at the bound: goes on
    relaxed = policy_step(cfg.replace(max_unverified_share=1.0), str(source), batch.slice(0, 0), state, 4, tmp_path / "other")
    assert relaxed["reward/stopped"] == 0.0


def test_run_stops_after_max_bad_steps_in_a_row():
    bad = {"actor/nonfinite_updates": 4.0, "actor/num_updates": 0.0}
    good = {"actor/nonfinite_updates": 1.0, "actor/num_updates": 3.0}  # one refused, others applied: not bad
    count = count_bad_steps(0, bad, max_bad_steps=3, step=1)
    count = count_bad_steps(count, bad, max_bad_steps=3, step=2)
    assert count == 2
    assert count_bad_steps(count, good, max_bad_steps=3, step=3) == 0  # a good step resets the count
    with pytest.raises(TooManyBadSteps, match="step 6: 3 consecutive steps"):
        count = 0
        for step in (4, 5, 6):
            count = count_bad_steps(count, bad, max_bad_steps=3, step=step)


# --- rollout shards --------------------------------------------------------------------
@pytest.mark.parametrize("n_items, shards", [(32, 1), (32, 2), (32, 5), (7, 7), (8, 3)])
def test_shard_slices_cover_the_round_exactly_once_in_order(n_items, shards):
    bounds = [shard_bounds(n_items, shards, k) for k in range(shards)]
    covered = [i for start, end in bounds for i in range(start, end)]
    assert covered == list(range(n_items))  # disjoint, complete, contiguous
    sizes = [end - start for start, end in bounds]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    with pytest.raises(ValueError, match="shard 3 is not in"):
        shard_bounds(n_items, 3, 3)


def test_two_shards_take_the_same_prompts_as_one_disjointly():
    records = [PromptRecord(uid=str(i), messages=(("user", f"{i} + 1"),), ground_truth=str(i + 1)) for i in range(50)]
    one, two = config(gen_prompt_bsz=9), config(gen_prompt_bsz=9, rollout_shards=2)
    whole = round_prompts(one, records, step=3, round_index=1)
    assert round_prompts(two, records, step=3, round_index=1) == whole
    halves = [set(range(*shard_bounds(len(whole), 2, k))) for k in range(2)]
    assert halves[0].isdisjoint(halves[1]) and halves[0] | halves[1] == set(range(9))
    assert round_prompts(one, records, step=3, round_index=2) != whole  # another round, other prompts


def test_merged_shards_keep_all_rows_and_sum_the_rollout_metrics():
    a = with_rollout_metrics(rollout_table({"s0-r0-p0-x": ["a", "b"]}), {"rollout/tokens": 10.0, "rollout/seconds": 2.0})
    b = with_rollout_metrics(rollout_table({"s0-r0-p1-y": ["c", "d"]}), {"rollout/tokens": 30.0, "rollout/seconds": 4.0})
    scored = [verify_rewards(config(), t, step=0) for t in (a, b)]  # metadata survives scoring
    merged, metrics = merge_shards(scored)
    assert merged.column("group_id").to_pylist() == ["s0-r0-p0-x"] * 2 + ["s0-r0-p1-y"] * 2
    assert merged.schema == SCORED_SCHEMA and not merged.schema.metadata
    assert metrics == {"rollout/tokens": 40.0, "rollout/seconds": 4.0, "rollout/tokens_per_s": 10.0, "reward/seconds": 0.0}
    assert rollout_metrics_of(rollout_table({"g": ["a", "b"]})) == {}


def test_tensor_parallelism_beyond_the_pods_gpus_names_the_setting(tmp_path, monkeypatch):
    import torch

    from dapo.execution.stages import generation

    assert generation.vllm_on_cpu()  # here vLLM's CPU build runs tensor parallelism without GPUs
    monkeypatch.setattr(generation, "vllm_on_cpu", lambda: False)  # a CUDA build, as in the rollout image
    cfg = config(tensor_parallel_size=torch.cuda.device_count() + 2)
    with pytest.raises(RuntimeError, match="tensor_parallel_size"):
        policy_engine(cfg, str(tmp_path))
