"""Data loading: verl / DAPO-Math-17k format, de-duplication, bad rows, the embedded task."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dapo.data.prompts import (
    DAPO_PROMPT_TEMPLATE,
    DIFFICULTY_LEVELS,
    VERL_SCHEMA,
    DataError,
    load_prompts,
    make_arithmetic_table,
    write_embedded_splits,
)


def verl_row(problem: str, answer, index: int) -> dict:
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": DAPO_PROMPT_TEMPLATE.format(problem=problem)}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": index},
    }


def write_rows(path, rows, schema=None):
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def test_embedded_task_is_verl_format_and_correct(tmp_path):
    table = make_arithmetic_table(200, seed=3)
    assert table.schema == VERL_SCHEMA
    for row in table.to_pylist()[:50]:
        content = row["prompt"][0]["content"]
        assert content.startswith("Solve the following math problem step by step.")
        expression = content.split("What is ")[1].split("?")[0]
        a, op, b = expression.split()
        assert int(row["reward_model"]["ground_truth"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))
    train, val = write_embedded_splits(tmp_path, seed=1, train_per_level=90, val_per_level=20)
    train_problems = {r.messages for r in load_prompts(train)[0]}
    val_problems = {r.messages for r in load_prompts(val)[0]}
    assert len(train_problems) == 80 + 3 * 90  # level 0 has 100 problems: 20 in validation, 80 left
    assert len(val_problems) == 4 * 20
    assert not train_problems & val_problems  # held-out really held out


def test_all_difficulty_levels_appear():
    table = make_arithmetic_table(400, seed=0)
    ops = {row["prompt"][0]["content"].split("What is ")[1].split()[1] for row in table.to_pylist()}
    assert ops == {op for op, _, _ in DIFFICULTY_LEVELS}


def test_duplicates_are_dropped_and_counted(tmp_path):
    rows = [verl_row("1+1", "2", i % 3) for i in range(3)] * 4 + [verl_row("2+2", "4", 7)]
    records, report = load_prompts(write_rows(tmp_path / "d.parquet", rows))
    assert report.rows_read == 13 and report.duplicates_dropped == 11 and report.kept == 2
    assert [r.ground_truth for r in records] == ["2", "4"]


def test_integer_ground_truth_is_accepted(tmp_path):
    rows = [verl_row("6*7", 42, 0)]
    schema = pa.schema([f if f.name != "reward_model" else pa.field("reward_model", pa.struct([("ground_truth", pa.int64()), ("style", pa.string())])) for f in VERL_SCHEMA])
    records, _ = load_prompts(write_rows(tmp_path / "i.parquet", rows, schema))
    assert records[0].ground_truth == "42"


def test_wrong_columns_are_named(tmp_path):
    path = write_rows(tmp_path / "w.parquet", [{"question": "1+1", "answer": "2"}])
    with pytest.raises(DataError, match=r"w.parquet: missing column\(s\) \['prompt', 'reward_model'\]"):
        load_prompts(path)


def test_empty_and_unreadable_files(tmp_path):
    empty = tmp_path / "empty.parquet"
    pq.write_table(VERL_SCHEMA.empty_table(), empty)
    with pytest.raises(DataError, match="empty.parquet: the file has no rows"):
        load_prompts(empty)
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="junk.parquet: not a readable parquet file"):
        load_prompts(junk)
    with pytest.raises(DataError, match="no such data file"):
        load_prompts(tmp_path / "missing.parquet")


@pytest.mark.parametrize(
    "bad, column",
    [
        ({"prompt": [], "reward_model": {"ground_truth": "1", "style": "r"}}, "'prompt'"),
        ({"prompt": [{"role": "user", "content": "   "}], "reward_model": {"ground_truth": "1", "style": "r"}}, "'prompt'"),
        ({"prompt": [{"role": "user", "content": "x"}], "reward_model": {"ground_truth": "", "style": "r"}}, "'reward_model.ground_truth'"),
        ({"prompt": [{"role": "user", "content": "x"}], "reward_model": None}, "'reward_model.ground_truth'"),
    ],
)
def test_bad_rows_error_or_skip(tmp_path, bad, column):
    good = verl_row("1+1", "2", 0)
    row = {**good, **bad}
    path = write_rows(tmp_path / "b.parquet", [good, row], VERL_SCHEMA)
    with pytest.raises(DataError, match=f"b.parquet: row 1, column {column}"):
        load_prompts(path)
    records, report = load_prompts(path, on_bad_row="skip")
    assert len(records) == 1 and report.bad_rows_skipped == 1


def test_plain_string_prompt_is_accepted(tmp_path):
    path = write_rows(tmp_path / "s.parquet", [{"prompt": "What is 2+3?", "reward_model": {"ground_truth": "5", "style": "r"}}])
    records, _ = load_prompts(path)
    assert records[0].chat == [{"role": "user", "content": "What is 2+3?"}]


def test_long_task_splits_hold_every_level_disjointly_with_correct_sums(tmp_path):
    from dapo.data.prompts import CHAIN_LEVELS

    train, val = write_embedded_splits(tmp_path, seed=0, train_per_level=30, val_per_level=10, task="long_arithmetic")
    train_records, val_records = load_prompts(train)[0], load_prompts(val)[0]
    assert (len(train_records), len(val_records)) == (30 * len(CHAIN_LEVELS), 10 * len(CHAIN_LEVELS))
    assert not {r.messages for r in train_records} & {r.messages for r in val_records}
    operand_counts = set()
    for record in train_records + val_records:
        terms = record.messages[0][1].split("What is ")[1].split("?")[0].split(" + ")
        operand_counts.add(len(terms))
        assert all(1 <= int(t) <= 9 for t in terms) and int(record.ground_truth) == sum(map(int, terms))
    assert operand_counts == set(CHAIN_LEVELS)
    # the same seed gives the same files: runs and their cache share one task
    again = write_embedded_splits(tmp_path / "again", seed=0, train_per_level=30, val_per_level=10, task="long_arithmetic")
    assert [r.messages for r in load_prompts(again[1])[0]] == [r.messages for r in val_records]


def test_an_unknown_embedded_task_is_named(tmp_path):
    with pytest.raises(DataError, match="unknown embedded task 'geometry'"):
        write_embedded_splits(tmp_path, seed=0, task="geometry")
