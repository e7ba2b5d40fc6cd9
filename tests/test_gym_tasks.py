"""reasoning-gym as a data source and a reward: specs checked before any work, rows that carry
where their entry comes from, held-out questions, and the task's own verdict read strictly."""

import json

import pyarrow.parquet as pq
import pytest

from dapo.data import gym_tasks

from dapo import rewards
from dapo.config import DAPOConfig
from dapo.data.prompts import load_prompts
from dapo.data.gym_tasks import GymSpecError, entry_of, generate_rows, parse_spec
from dapo.execution.stages import setup
from tasks.config import resolve

ONE_DIGIT = "reasoning_gym:chain_sum?min_terms=2&max_terms=2&min_digits=1&max_digits=1"
TWO_DIGIT = "reasoning_gym:chain_sum?min_terms=2&max_terms=2&min_digits=1&max_digits=2"


def test_a_spec_names_tasks_options_weights_size_and_seed():
    spec = parse_spec("reasoning_gym:chain_sum?min_terms=2&max_terms=2&weight=3;products?max_digits=1&size=100&seed=7")
    assert [t.name for t in spec.tasks] == ["chain_sum", "products"]
    assert dict(spec.tasks[0].options) == {"min_terms": 2, "max_terms": 2} and spec.tasks[0].weight == 3.0
    assert (spec.size, spec.seed, spec.task_sizes()) == (100, 7, [75, 25])


@pytest.mark.parametrize("spec, message", [
    ("reasoning_gym:chain_sun", "no task 'chain_sun'; did you mean 'chain_sum'"),
    ("reasoning_gym:chain_sum?min_term=2", "no option 'min_term'; did you mean 'min_terms'"),
    ("reasoning_gym:chain_sum?weight=0", "weight must be a number > 0"),
    ("reasoning_gym:chain_sum?size=10;products?size=20", "size given twice"),
    ("reasoning_gym:chain_sum?seed=-1", "seed must be an integer >= 0"),
    ("reasoning_gym:chain_sum?min_terms=5&max_terms=2", "refused options"),
    ("reasoning_gym:", "name at least one task"),
])
def test_a_misspelt_task_or_option_is_refused_naming_the_closest(spec, message):
    with pytest.raises(GymSpecError, match=message):
        parse_spec(spec)


def test_a_bad_spec_stops_the_run_at_resolve_before_any_work():
    with pytest.raises(GymSpecError, match="did you mean 'chain_sum'"):
        resolve("tiny_cpu", train_data="reasoning_gym:chain_sun?min_terms=2")


def test_resolve_scores_reasoning_gym_rows_with_the_tasks_own_verifier_unless_told_otherwise():
    config = resolve("tiny_cpu", train_data=ONE_DIGIT)
    assert config.reward_fn_by_source == {"reasoning_gym": "reasoning_gym"} and config.reward_fn == "dapo_math"
    mine = resolve("tiny_cpu", train_data=ONE_DIGIT, set="reward.reward_fn_by_source='{reasoning_gym: dapo_math}'")
    assert mine.reward_fn_by_source == {"reasoning_gym": "dapo_math"}


def test_rows_regenerate_their_entry_from_what_they_store():
    rows = generate_rows(parse_spec(TWO_DIGIT + "&size=20&seed=3"))
    assert len(rows) == 20
    for row in rows[:5]:
        _, entry = entry_of(json.loads(json.dumps(row.source)))  # as read back from a data file
        assert (entry["question"], entry["answer"]) == (row.question, row.answer)
    again = generate_rows(parse_spec(TWO_DIGIT + "&size=20&seed=3"))
    assert [r.question for r in again] == [r.question for r in rows]


def test_validation_is_another_seed_of_the_training_spec_with_no_training_question(tmp_path, capsys):
    config = DAPOConfig.tiny_cpu().replace(train_data_path=ONE_DIGIT + "&size=150", question_template="Q: {problem}")
    stats = setup.prepare_data(config.section("data"), tmp_path)
    train, _ = load_prompts(tmp_path / "train.parquet")
    val, _ = load_prompts(tmp_path / "val.parquet")
    questions = lambda records: {r.messages[0][1] for r in records}  # noqa: E731
    assert not questions(train) & questions(val) and val
    assert "overlap now 0" in capsys.readouterr().out
    # one-digit sums have ~200 distinct questions: many validation draws were training questions
    assert stats["data/val_dropped_as_in_train"] > 0
    assert train[0].messages[0][1].startswith("Q: State the final answer")
    assert {r.data_source for r in train} == {"reasoning_gym"}
    assert pq.read_table(tmp_path / "train.parquet").num_rows == len(train)


def test_an_explicit_validation_spec_is_used(tmp_path):
    config = DAPOConfig.tiny_cpu().replace(train_data_path=TWO_DIGIT + "&size=50", val_data_path=TWO_DIGIT + "&size=30&seed=99")
    setup.prepare_data(config.section("data"), tmp_path)
    val, _ = load_prompts(tmp_path / "val.parquet")
    assert {json.loads(r.extra_info)["rg_seed"] for r in val} == {99} and 0 < len(val) <= 30


def test_a_generator_that_raises_is_reported_with_its_task_and_index(monkeypatch):
    spec = parse_spec(TWO_DIGIT + "&size=5")
    data = gym_tasks.dataset("chain_sum", spec.tasks[0].options_json, 0, 5)

    def broken(index):
        raise ZeroDivisionError("in the generator")

    monkeypatch.setattr(type(data), "__getitem__", lambda self, index: broken(index))
    with pytest.raises(GymSpecError, match="'chain_sum'.*failed to generate entry 0.*ZeroDivisionError"):
        generate_rows(spec)


# --- the reasoning_gym scorer --------------------------------------------------------
@pytest.fixture(scope="module")
def entry():
    row = generate_rows(parse_spec(TWO_DIGIT + "&size=1&seed=5"))[0]
    return row, {**row.source, "data_source": "reasoning_gym"}


def test_the_tasks_own_verdict_on_our_answer_line_is_the_reward(entry):
    row, extra = entry
    right = rewards.reasoning_gym(f"Let me add.\nAnswer: {row.answer}", row.answer, extra)
    assert (right["score"], right["acc"], right["rg_score"], right["last_number"]) == (1.0, 1.0, 1.0, 1.0)
    wrong = rewards.reasoning_gym("Answer: 1000", row.answer, extra)
    assert (wrong["score"], wrong["acc"], wrong["last_number"]) == (-1.0, 0.0, 0.0)


def test_partial_credit_for_padding_around_the_truth_is_not_a_correct_answer(entry):
    row, extra = entry
    padded = rewards.reasoning_gym(f"Answer: it is {row.answer} I think", row.answer, extra)
    assert 0 < padded["rg_score"] < 1.0  # the task's own partial credit, logged
    assert (padded["score"], padded["acc"]) == (-1.0, 0.0)


def test_a_known_answer_off_the_answer_line_counts_only_as_a_last_number(entry):
    row, extra = entry
    result = rewards.reasoning_gym(f"The result is {row.answer}", row.answer, extra)
    assert (result["score"], result["acc"], result["last_number"]) == (-1.0, 0.0, 1.0)


@pytest.mark.parametrize("verdict, message", [
    (lambda answer, entry: 1 / 0, "task 'chain_sum': score_answer raised ZeroDivisionError"),
    (lambda answer, entry: "yes", "task 'chain_sum': score_answer returned 'yes', not a finite number"),
    (lambda answer, entry: float("nan"), "returned nan"),
])
def test_a_score_answer_that_fails_stops_the_step_naming_the_task(entry, monkeypatch, verdict, message):
    row, extra = entry
    data, _ = entry_of(extra)
    monkeypatch.setattr(data, "score_answer", verdict)
    with pytest.raises(rewards.ScorerError, match=message):
        rewards.score_responses(["Answer: 1"], [row.answer], [3], scorers=["reasoning_gym"], extra_infos=[extra],
                                max_len=100, buffer_len=10, overlong_factor=1.0, format_weight=0.0)


def test_a_row_not_made_from_a_spec_is_refused_by_the_scorer():
    with pytest.raises(rewards.ScorerError, match="no 'rg_task' in extra_info"):
        rewards.reasoning_gym("Answer: 1", "1", {"data_source": "reasoning_gym"})


def test_option_values_are_yaml_and_a_plus_stays_a_plus():
    spec = parse_spec("reasoning_gym:basic_arithmetic?operators=[+,-]&allow_parentheses=false&min_digits=1&max_digits=1")
    assert dict(spec.tasks[0].options) == {"operators": ["+", "-"], "allow_parentheses": False, "min_digits": 1, "max_digits": 1}
    with pytest.raises(GymSpecError, match="is not option=value"):
        parse_spec("reasoning_gym:chain_sum?min_terms")
