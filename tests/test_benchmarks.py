"""The benchmarks' own logic (the runs themselves: benchmarks/*.py, see RESULTS.md)."""

import json
from types import SimpleNamespace

import pytest

from benchmarks import overhead
from benchmarks.overhead import ExclusiveTimer, short_name
from benchmarks.vs_trl import DapoReward, trl_arguments
from dapo.config import DAPOConfig
from dapo.rewards import score_response


def test_exclusive_timer_counts_every_second_once(monkeypatch):
    """Each second goes to the innermost span only (a fake clock: exact, whatever the load)."""
    clock = [0.0]
    monkeypatch.setattr(overhead.time, "perf_counter", lambda: clock[0])

    def advance(seconds: float) -> None:
        clock[0] += seconds

    timer = ExclusiveTimer()
    with timer.span("Flyte", "outer"):
        advance(0.02)
        with timer.span("compute", "inner"):
            advance(0.05)
        with timer.span("MLflow", "setup-only", phase="setup"):
            advance(0.03)
    outer, inner = timer.totals[("steps", "Flyte", "outer")], timer.totals[("steps", "compute", "inner")]
    assert inner == pytest.approx(0.05) and outer == pytest.approx(0.02)
    assert timer.phase_total("setup") == pytest.approx(0.03) and timer.phase == "steps"
    assert set(timer.by_category("steps")) == {("Flyte", "outer"), ("compute", "inner")}


def test_exclusive_timer_wraps_and_restores_phase_on_error():
    timer = ExclusiveTimer()
    owner = SimpleNamespace(fail=lambda: 1 / 0)
    timer.wrap(owner, "fail", "compute", "fails", phase_of=lambda: "validation")
    try:
        owner.fail()
    except ZeroDivisionError:
        pass
    assert ("validation", "compute", "fails") in timer.totals and timer.phase == "steps"


def test_trl_reward_is_our_reward_with_the_decay_counted_in_policy_steps():
    config = DAPOConfig.tiny_cpu()
    reward = DapoReward(config, updates_per_step=4)
    completions = [[{"role": "assistant", "content": "5 + 7 = 12\nAnswer: 12"}], [{"role": "assistant", "content": "The answer is 12."}]]
    ids = [[1] * 8, [1] * config.max_response_length]
    late = SimpleNamespace(global_step=4 * config.format_reward_decay_steps)
    got = reward(prompts=["q", "q"], completions=completions, completion_ids=ids, ground_truth=["12", "12"], trainer_state=late)
    want = [score_response(c[0]["content"], "12", len(i), max_len=config.max_response_length, buffer_len=config.overlong_buffer_len,
                           overlong_factor=config.overlong_penalty_factor, format_weight=0.0)["reward"] for c, i in zip(completions, ids)]
    assert got == want and got[0] > got[1]
    early = reward(prompts=["q"], completions=completions[:1], completion_ids=ids[:1], ground_truth=["12"],
                   trainer_state=SimpleNamespace(global_step=0))
    assert early[0] > got[0]  # the format bonus at full weight in the first step
    assert reward.generated_tokens == 8 + config.max_response_length + 8


def test_trl_arguments_mirror_the_dapo_config():
    config = DAPOConfig.tiny_cpu().replace(total_steps=30)
    args = trl_arguments(config, "/tmp/out")
    updates = config.train_prompt_bsz // config.ppo_mini_batch_size
    assert args["max_steps"] == 30 * updates
    assert args["per_device_train_batch_size"] * args["steps_per_generation"] == config.train_prompt_bsz * config.n_samples_per_prompt
    assert (args["loss_type"], args["epsilon"], args["epsilon_high"], args["beta"]) == ("dapo", 0.2, 0.28, 0.0)
    assert args["mask_truncated_completions"] and args["max_completion_length"] == config.max_response_length


def test_task_names_in_the_breakdown():
    assert short_name(SimpleNamespace(name="tasks.rollout.verify_rewards")) == "verify_rewards"
    mapped = SimpleNamespace(name="map_verify_rewards_e670a7700d4c838d941453f16b9fe818-arraynode")
    assert short_name(mapped) == "map verify_rewards"


def test_the_micro_batch_benchmark_draws_the_papers_length_spread_scaled_down():
    from benchmarks import micro_batches

    lengths = micro_batches.lengths("paper", 2000, model_dir="")
    responses = sorted(r for _, r in lengths)
    top = micro_batches.MAX_RESPONSE["paper"]
    assert 0.07 < responses.count(top) / len(responses) < 0.13  # ~10% truncated at the maximum
    assert responses[0] >= top / 200 - 1 and responses[len(responses) // 10] < top / 20  # a tail of short ones
    assert all(16 <= p <= micro_batches.MAX_PROMPT["paper"] for p, _ in lengths)


def test_a_benchmark_worker_hands_its_figures_to_its_parent_or_its_failure_names_it(tmp_path):
    import sys

    from benchmarks.common import run_worker

    figures = run_worker([sys.executable, "-c", "from benchmarks.common import print_result; print('noise'); "
                          "print_result({'step_s': 1.5}); print_result({'step_s': 2.5})"], "the worker", log=tmp_path / "w.log")
    assert figures == {"step_s": 2.5}  # the last figures printed
    assert "noise" in (tmp_path / "w.log").read_text()
    with pytest.raises(SystemExit, match="the broken worker failed \\(exit 3\\)"):
        run_worker([sys.executable, "-c", "import sys; sys.exit(3)"], "the broken worker")
    with pytest.raises(SystemExit, match="the silent worker failed \\(exit 0\\)"):
        run_worker([sys.executable, "-c", "print('no figures')"], "the silent worker")


def test_the_real_model_curve_holds_each_seed_to_its_start_plus_a_tenth_within_30_training_minutes(capsys):
    from benchmarks.real_curve import table

    def record(seed, points):
        return {"seed": seed, "wall_seconds": 600.0, "kept_ratio": 0.4, "date": "2026-12-06",
                "step_seconds": {"generation": 20.0, "scoring": 0.1, "update": 30.0},
                "validations": [{"step": s, "train_minutes": m, "acc": a, "format": 0.5, "last_number": 0.1} for s, m, a in points]}

    table([record(1, [(0, 0.0, 0.02), (4, 4.0, 0.19)]),
           record(2, [(0, 0.0, 0.05), (4, 4.0, 0.10), (24, 31.0, 0.40)]),  # its gain came after 30 minutes
           record(1, [(0, 0.0, 0.02), (4, 4.0, 0.20)])])  # a seed's newest record counts
    out = capsys.readouterr().out
    assert "seed 1: 0.020 -> best 0.200 at step 4 (4.0 training min): meets" in out
    assert "seed 2: 0.050 -> best 0.100 at step 4 (4.0 training min): MISSES" in out
    assert "   4       4.0   0.200   0.100  0.150" in out


def test_trl_reward_scores_a_reasoning_gym_row_by_the_tasks_own_verifier():
    """TRL hands the data set's data_source and extra_info to the reward: each row is scored by
    its source's scorer, as our verify_rewards scores it."""
    from benchmarks.vs_trl import setup_scorers
    from dapo.data.gym_tasks import generate_rows, parse_spec

    config = DAPOConfig.smollm2_cpu()
    config = config.replace(reward_fn_by_source=setup_scorers(config))
    (row,) = generate_rows(parse_spec("reasoning_gym:chain_sum?min_terms=2&max_terms=2&size=1&seed=3"))
    reward = DapoReward(config, updates_per_step=1)
    extra = json.dumps(row.source)
    got = reward(prompts=["q", "q"], completions=[f"Answer: {row.answer}", f"Answer: {int(row.answer) + 1}"], completion_ids=[[1] * 4, [1] * 4],
                 ground_truth=[row.answer] * 2, data_source=["reasoning_gym"] * 2, extra_info=[extra] * 2)
    assert got == [1.0, -1.0] and reward.seconds > 0


def test_the_side_by_side_table_times_each_run_to_trls_final_accuracy_from_the_recorded_seeds(tmp_path, capsys):
    from benchmarks.vs_trl import SETTINGS, recorded, report

    def record(run, seed, seconds_per_step, curve):
        return {"run": run, "seed": seed, "train_seconds": 12 * seconds_per_step, "generated_tokens": 600.0, "peak_rss_mib": 5000.0,
                "step_parts": {"generation": 10.0, "update": 20.0}, "curve": [{"step": s, "train_seconds": t, "val/acc": a} for s, t, a in curve]}

    path = tmp_path / "records.jsonl"
    rows = [record("trl", 0, 60.0, [(0, 0, 0.03), (4, 240, 0.15), (8, 480, 0.22), (12, 720, 0.24)]),
            record("trl", 1, 60.0, [(0, 0, 0.03), (4, 240, 0.16), (8, 480, 0.20), (12, 720, 0.22)]),
            record("ours-colocated", 0, 30.0, [(0, 0, 0.03), (4, 120, 0.20), (8, 240, 0.25), (12, 360, 0.26)]),
            record("ours-colocated", 1, 30.0, [(0, 0, 0.03), (4, 120, 0.24), (8, 240, 0.25), (12, 360, 0.27)]),
            record("ours-colocated", 1, 99.0, [(0, 0, 0.03), (12, 1188, 0.0)])]  # an older record of seed 1: the newest counts
    path.write_text("\n".join(json.dumps(r) for r in [rows[4], *rows[:4]]) + "\n")
    table = report(SETTINGS["smollm2_cpu"], recorded(path), 12)
    out = capsys.readouterr().out
    # TRL's target: the mean of its finals, 0.23; TRL's seeds reach it at 720 s (seed 0) and never (seed 1)
    assert table["trl"]["seconds_to_trl_accuracy"] == 720 and table["trl"]["seeds_reaching_trl_accuracy"] == 1
    assert table["ours-colocated"]["seconds_to_trl_accuracy"] == 180 and table["ours-colocated"]["comparison_valid"]
    assert "TRL's time / this one's = 4.00" in out and "the comparison is valid" in out
    rows[1]["curve"][-1]["val/acc"] = 0.10  # TRL's gain (+0.14) no longer exceeds twice its spread (2 x 0.14)
    path.write_text("\n".join(json.dumps(r) for r in rows[:4]) + "\n")
    assert not report(SETTINGS["smollm2_cpu"], recorded(path), 12)["trl"]["comparison_valid"]
    assert "NOT valid" in capsys.readouterr().out
