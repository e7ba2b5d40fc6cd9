"""Bring your own task: a reward and a policy loss of your own, each one file plus one config
value (examples/my_reward.py, examples/my_loss.py), chosen by name like the built-ins."""

import json
import os
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from dapo.algorithm import loss

from dapo import rewards
from dapo.execution.stages import scoring
from dapo.algorithm.batch import ROLLOUT_SCHEMA
from dapo.config import ConfigError, DAPOConfig
from dapo.plugins import load_user_function
from policy_steps import accumulate, make_config, max_diff, scored_table

REPO = Path(__file__).resolve().parent.parent
MY_REWARD = "examples/my_reward.py:score"
MY_LOSS = "examples/my_loss.py:cispo"
SETTINGS = {"max_len": 100, "buffer_len": 10, "overlong_factor": 1.0, "format_weight": 0.0}


@pytest.fixture(autouse=True)
def in_the_repository(monkeypatch):
    """The examples' paths are relative to the working directory, as in `pyflyte run`."""
    monkeypatch.chdir(REPO)


def scorer_file(tmp_path: Path, body: str) -> str:
    path = tmp_path / "scorer.py"
    path.write_text("import os, time\n\n\ndef score(response, ground_truth, extra_info):\n" + body)
    return f"{path}:score"


# --- rewards ------------------------------------------------------------------------
def test_a_users_scorer_runs_in_a_verifier_worker_and_its_metrics_come_back(tmp_path):
    spec = scorer_file(tmp_path, "    return {'score': 0.5, 'pid': os.getpid(), 'words': len(response.split())}\n")
    result = rewards.task_score(spec, "two words", "x", {"data_source": "mine"})
    assert (result.score, result.acc, result.unverified) == (0.5, 1.0, 0.0)  # acc: score > 0 unless given
    metrics = dict(result.metrics)
    assert metrics["words"] == 2.0 and metrics["pid"] != os.getpid()  # not in this process

    example = rewards.score_response("Answer: 12", "15", 5, scorer=MY_REWARD, **SETTINGS)
    assert (example["score"], example["acc"], example["score_metrics"]) == (-1.0, 0.0, {"parsed": 1.0, "distance": 3.0})


@pytest.mark.parametrize("body, message", [
    ("    raise ValueError('no such answer key')\n", "ValueError: no such answer key"),
    ("    return {'acc': 1.0}\n", "returned a dict without 'score'"),
    ("    return float('nan')\n", "score=nan: every value must be a finite number"),
    ("    return 'right'\n", "score='right': every value must be a finite number"),
])
def test_a_scorer_that_fails_stops_the_step_naming_itself_rather_than_making_up_a_reward(tmp_path, body, message):
    spec = scorer_file(tmp_path, body)
    with pytest.raises(rewards.ScorerError, match=message) as raised:
        rewards.score_responses(["Answer: 1"], ["1"], [3], scorers=[spec], **SETTINGS)
    assert spec in str(raised.value)


def test_a_scorer_past_its_time_limit_counts_as_wrong_and_unverified(tmp_path):
    spec = scorer_file(tmp_path, "    time.sleep(60)\n    return 1.0\n")
    scores = rewards.score_responses(["a", "Answer: 1"], ["1", "1"], [3, 3], scorers=[spec, "dapo_math"], timeout_s=0.5, **SETTINGS)
    assert [(s["score"], s["acc"], s["unverified"]) for s in scores] == [(-1.0, 0.0, 1.0), (1.0, 1.0, 0.0)]
    assert scores[0]["verdict_note"] == f"scorer {spec!r} gave no verdict within 0.5 s"


def test_a_scorer_that_kills_its_worker_is_named_and_retried_once_and_a_second_death_stops_the_step(tmp_path, caplog):
    marker = tmp_path / "died-once"
    once = scorer_file(tmp_path, f"    if not os.path.exists({str(marker)!r}):\n        open({str(marker)!r}, 'w').close()\n"
                                 "        os._exit(9)  # as a crash in C or the OOM killer would\n    return 1.0\n")
    scores = rewards.score_responses(["Answer: 1"], ["1"], [3], scorers=[once], **SETTINGS)
    assert [(s["score"], s["unverified"]) for s in scores] == [(1.0, 0.0)]  # scored in a new worker, not unverified
    deaths = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "killed its verifier worker" in r.getMessage()]
    assert len(deaths) == 1 and once in deaths[0] and "'Answer: 1'" in deaths[0]

    (tmp_path / "always").mkdir()
    always = scorer_file(tmp_path / "always", "    os._exit(9)\n")
    with pytest.raises(rewards.ScorerError, match="killed a verifier worker 2 times") as raised:
        rewards.score_responses(["Answer: 2"], ["2"], [3], scorers=[always], **SETTINGS)
    assert always in str(raised.value) and "'Answer: 2'" in str(raised.value)
    assert rewards.score_responses(["Answer: 3"], ["3"], [3], **SETTINGS)[0]["acc"] == 1.0  # the pool goes on working


def rollout_rows(sources: list[str]) -> pa.Table:
    rows = [dict(group_id="g", prompt_uid="p", sample_index=i, prompt="", ground_truth="12", data_source=source,
                 extra_info=json.dumps({"index": i}), prompt_token_ids=[1], response_token_ids=[2, 3], response_text=text,
                 rollout_log_probs=[-1.0, -1.0], truncated=False)
            for i, (source, text) in enumerate(zip(sources, ["Answer: 12", "Answer: 13", "Answer: 12", "Answer: x"]))]
    return pa.Table.from_pylist(rows, schema=ROLLOUT_SCHEMA)


def test_rows_are_scored_by_their_data_sources_scorer_and_its_metrics_reach_the_step_line():
    config = DAPOConfig.tiny_cpu().replace(reward_fn_by_source={"closeness": MY_REWARD}, format_reward_weight=0.0)
    scored = scoring.verify_rewards(config, rollout_rows(["math", "math", "closeness", "closeness"]), step=0)
    assert scored.column("score").to_pylist() == [1.0, -1.0, 1.0, -1.0]
    assert [dict(m) for m in scored.column("score_metrics").to_pylist()] == [
        {}, {}, {"parsed": 1.0, "distance": 0.0}, {"parsed": 0.0}]
    metrics = scoring.batch_metrics(scored, prefix="train/")
    assert metrics["train/score/parsed"] == 0.5 and metrics["train/score/distance"] == 0.0  # over the rows that have it
    assert metrics["train/score_mean"] == 0.0


def test_a_scorer_receives_the_data_rows_extra_info_and_source(tmp_path):
    spec = scorer_file(tmp_path, "    return {'score': 1.0, 'index': extra_info['index'], "
                                 "'from_math': float(extra_info['data_source'] == 'math')}\n")
    scored = scoring.verify_rewards(DAPOConfig.tiny_cpu().replace(reward_fn=spec), rollout_rows(["math", "other"]), step=0)
    assert [dict(m) for m in scored.column("score_metrics").to_pylist()] == [
        {"index": 0.0, "from_math": 1.0}, {"index": 1.0, "from_math": 0.0}]


# --- losses -------------------------------------------------------------------------
def test_a_new_loss_is_one_registered_function_chosen_by_name(policy_dir, monkeypatch):
    from dapo.engines.trainer import make_trainer

    calls = []
    monkeypatch.delitem(loss.POLICY_LOSSES, "reinforce", raising=False)  # registered below, gone after the test

    @loss.register_policy_loss("reinforce")
    def reinforce(log_prob, old_log_prob, advantages, response_mask, config):
        """L_{i,t} = -A_i * log pi_theta(o_{i,t}): plain REINFORCE, no ratio, no clip."""
        calls.append(log_prob.shape)
        return -advantages * log_prob, {"calls": float(len(calls))}

    config = make_config(loss_fn="reinforce", micro_batch_size=4)
    result, _ = accumulate(make_trainer(config, policy_dir), scored_table(), config)
    assert calls and "calls" in result and "clipfrac" not in result


def test_a_users_loss_from_a_file_accumulates_exactly_over_micro_batches_and_reports_its_metrics(policy_dir):
    from dapo.engines.trainer import make_trainer

    table = scored_table()
    whole_config, micro_config = make_config(loss_fn=MY_LOSS), make_config(loss_fn=MY_LOSS, micro_batch_size=4)
    trainer = make_trainer(whole_config, policy_dir)
    whole, whole_grads = accumulate(trainer, table, whole_config)
    micro, micro_grads = accumulate(trainer, table, micro_config)
    assert max_diff(whole_grads, micro_grads) < 1e-6
    assert whole["cispo_weight_mean"] == pytest.approx(1.0) and micro["cispo_weight_mean"] == pytest.approx(1.0)  # on-policy


def test_off_policy_the_example_loss_keeps_the_gradient_of_tokens_dapos_clip_drops(policy_dir):
    """With pi_theta / pi_old = e^-0.5 < 1 - eps_low on every token, DAPO's clip zeroes the
    gradient of negative-advantage tokens; CISPO weighs them by 1 - eps_low instead."""
    from dapo.engines.trainer import make_trainer
    from dapo.engines.update import minibatch_backward, prepare_step
    from policy_steps import grads_of

    table = scored_table()
    grads = {}
    for name in ("dapo", MY_LOSS):
        config = make_config(loss_fn=name)
        trainer = make_trainer(config, policy_dir)
        data = prepare_step(trainer, table, config, temperature=1.0)
        data.old_log_probs += 0.5
        result = minibatch_backward(trainer, data, torch.arange(table.num_rows), config, temperature=1.0)
        grads[name] = grads_of(trainer)
    assert result["cispo_weight_mean"] == pytest.approx(1 - config.clip_low)
    assert max_diff(grads["dapo"], grads[MY_LOSS]) > 1e-4


def test_the_example_loss_is_cispos_formula():
    log_prob = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -1.0]])
    config = DAPOConfig.tiny_cpu().section("algorithm")  # what a loss gets
    cispo = load_user_function(MY_LOSS)
    token_loss, metrics = cispo(log_prob, old, torch.tensor([[2.0]]), torch.ones(1, 2), config)
    weight = torch.clamp(torch.exp(log_prob - old), 1 - config.clip_low, 1 + config.clip_high).detach()
    assert torch.allclose(token_loss, -weight * 2.0 * log_prob)
    token_loss.sum().backward()
    assert torch.allclose(log_prob.grad, -weight * 2.0)  # the clipped weight carries no gradient: every token has one


# --- at the start of a run ------------------------------------------------------------
@pytest.mark.parametrize("assignment, message", [
    ("reward.reward_fn=dapo_maths", "DAPOConfig.reward_fn: unknown scorer 'dapo_maths': choose one of \\['dapo_math', 'reasoning_gym'\\]"),
    ("algorithm.loss_fn=examples/no_such.py:loss", "DAPOConfig.loss_fn: policy loss 'examples/no_such.py:loss': no file"),
    ("algorithm.loss_fn=examples/my_loss.py:grpo", "has no function 'grpo'"),
    ("'reward.reward_fn_by_source={gsm8k: no_such_module:score}'", "reward_fn_by_source\\['gsm8k'\\]: scorer .* cannot import 'no_such_module'"),
])
def test_a_misspelt_function_fails_when_the_run_starts_naming_its_field(assignment, message):
    from tasks.config import resolve

    with pytest.raises(ConfigError, match=message):
        resolve("tiny_cpu", set=assignment)


def test_the_step_config_carries_a_digest_of_the_users_functions_so_cached_steps_follow_their_code(tmp_path):
    from tasks.config import resolve

    assert resolve("tiny_cpu").user_code_digest == ""
    spec = scorer_file(tmp_path, "    return 1.0\n")
    first = resolve("tiny_cpu", set=f"reward.reward_fn={spec}").user_code_digest
    assert first and resolve("tiny_cpu", set=f"reward.reward_fn={spec}").user_code_digest == first
    Path(spec.rpartition(":")[0]).write_text(Path(spec.rpartition(":")[0]).read_text().replace("1.0", "2.0"))
    assert resolve("tiny_cpu", set=f"reward.reward_fn={spec}").user_code_digest != first


def test_the_digest_follows_a_helper_beside_the_scorer_and_the_data_files_it_declares_not_caches_or_venvs(tmp_path):
    from tasks.config import resolve

    (tmp_path / "helpers").mkdir()
    (tmp_path / "helpers" / "parse.py").write_text("def answer(text):\n    return text.strip()\n")
    (tmp_path / "answers.json").write_text('{"1": 1}')
    path = tmp_path / "scorer.py"
    path.write_text("import json, os\nDAPO_DATA_FILES = ['answers.json']\n\n\ndef score(response, ground_truth, extra_info):\n    return 1.0\n")
    digest = lambda: resolve("tiny_cpu", set=f"reward.reward_fn={path}:score").user_code_digest  # noqa: E731
    first = digest()
    for ignored in (tmp_path / "__pycache__" / "parse.cpython-311.py", tmp_path / ".venv" / "lib" / "x.py"):
        ignored.parent.mkdir(parents=True)
        ignored.write_text("changed = True\n")
    assert digest() == first  # caches and environments are not the scorer's code
    (tmp_path / "helpers" / "parse.py").write_text("def answer(text):\n    return text\n")
    second = digest()
    assert second != first
    (tmp_path / "answers.json").write_text('{"1": 2}')
    assert digest() not in (first, second)


# --- end to end -------------------------------------------------------------------------
@pytest.mark.slow
def test_a_users_reward_and_loss_run_through_dapo_loop_from_one_file_each_plus_config(tmp_path_factory):
    """What the README shows: `--set 'reward.reward_fn=examples/my_reward.py:score
    algorithm.loss_fn=examples/my_loss.py:cispo'`, 2 steps (local_runs: hf rollout, torch
    trainer); the scorer's and the loss's own metrics reach MLflow at every step."""
    from local_runs import dapo_loop, logged_steps, new_home, trained_steps

    home = new_home(tmp_path_factory)
    run = dapo_loop(home, 2, args=("--set", f"reward.reward_fn={MY_REWARD} algorithm.loss_fn={MY_LOSS}"), seed=0)
    assert trained_steps(run) == [1, 2]
    assert logged_steps(home, "train/score/parsed") == [1, 2]
    assert logged_steps(home, "actor/cispo_weight_mean") == [1, 2]
    assert logged_steps(home, "val/score/parsed") == [0, 2]
