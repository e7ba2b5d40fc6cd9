"""Prompt data: verl-format parquet (DAPO-Math-17k) and the embedded arithmetic task.

verl / DAPO-Math-17k columns: data_source, prompt (chat list of {role, content}),
ability, reward_model {ground_truth, style}, extra_info {index}. The published
file repeats its 17,917 prompts about 100 times: loading de-duplicates on the
prompt and logs how many rows were dropped.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dapo.config import DAPO_PROMPT_TEMPLATE, EMBEDDED_TASKS

logger = logging.getLogger(__name__)

REQUIRED_COLUMNS = ("prompt", "reward_model")
EMBEDDED_SOURCE = "dapo-flyte/arithmetic"

VERL_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
        ("extra_info", pa.struct([("index", pa.int64())])),
    ]
)
NORMALIZED_SCHEMA = VERL_SCHEMA.append(pa.field("extra_info_json", pa.string()))
"""What prepare_data writes: verl's columns, and the source row's whole extra_info as JSON
(a user's data may carry any fields there; their scorer receives them)."""


class DataError(ValueError):
    """A data file or row that cannot be used; the message names file, row and column."""


@dataclass(frozen=True)
class PromptRecord:
    uid: str
    messages: tuple[tuple[str, str], ...]  # ((role, content), ...)
    ground_truth: str
    data_source: str = ""
    extra_info: str = "{}"
    """The row's extra_info as JSON (what a scorer receives, with the data_source)."""

    @property
    def chat(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.messages]


@dataclass
class LoadReport:
    path: str
    rows_read: int
    duplicates_dropped: int
    bad_rows_skipped: int
    kept: int


# --- the embedded arithmetic task --------------------------------------------------
# Difficulty levels: (operator, digits of a, digits of b). The warm-started tiny policy
# solves most level-0 problems, some level-1 ones and few of the rest: mixed groups,
# so RL has signal, and room to improve on every level.
DIFFICULTY_LEVELS = (
    ("+", 1, 1),
    ("+", 2, 1),
    ("+", 2, 2),
    ("-", 2, 2),
)


def _operand_range(digits: int) -> range:
    return range(10 ** (digits - 1) if digits > 1 else 0, 10**digits)


def arithmetic_problem(rng: random.Random, level: int) -> tuple[str, str]:
    """One random problem and its integer answer at a difficulty level."""
    op, digits_a, digits_b = DIFFICULTY_LEVELS[level]
    return _problem(op, rng.choice(_operand_range(digits_a)), rng.choice(_operand_range(digits_b)))


def _problem(op: str, a: int, b: int) -> tuple[str, str]:
    return f"What is {a} {op} {b}?", str(a + b if op == "+" else a - b)


def level_problems(level: int, seed: int) -> list[tuple[str, str]]:
    """Every distinct problem of a level (100 to 8,100 of them), in a seeded order."""
    op, digits_a, digits_b = DIFFICULTY_LEVELS[level]
    problems = [_problem(op, a, b) for a in _operand_range(digits_a) for b in _operand_range(digits_b)]
    random.Random(f"{seed}-{level}").shuffle(problems)
    return problems


# --- the long embedded task -------------------------------------------------------
# Sums of 3 to 7 one-digit numbers, solved by rewriting the sum one addition at a time
# (dapo.model.policy.chain_response_text): the worked solution grows with the square of the
# operands, so that with a short max_response_length the longest problems reach the limit
# (the regime where overlong shaping binds), and accuracy falls with the number of
# operands (each line is another chance of a slip).
CHAIN_LEVELS = (3, 4, 5, 6, 7)
"""Operands per problem, by difficulty level."""


def chain_problem(rng: random.Random, level: int) -> tuple[str, str]:
    """One sum of CHAIN_LEVELS[level] one-digit numbers, and its answer."""
    operands = [rng.randrange(1, 10) for _ in range(CHAIN_LEVELS[level])]
    return "What is " + " + ".join(map(str, operands)) + "?", str(sum(operands))


def chain_level_problems(level: int, seed: int, count: int) -> list[tuple[str, str]]:
    """count distinct problems of a level, in a seeded order."""
    rng = random.Random(f"chain-{seed}-{level}")
    problems: dict[str, str] = {}
    while len(problems) < count:
        problem, answer = chain_problem(rng, level)
        problems.setdefault(problem, answer)
    return list(problems.items())


def task_problem(task: str, rng: random.Random) -> tuple[str, str]:
    """A random problem of the embedded task at a random level (for the warm start)."""
    if task == "long_arithmetic":
        return chain_problem(rng, rng.randrange(len(CHAIN_LEVELS)))
    return arithmetic_problem(rng, rng.randrange(len(DIFFICULTY_LEVELS)))


def _task_pools(task: str, seed: int, per_level: int) -> list[list[tuple[str, str]]]:
    if task == "long_arithmetic":
        return [chain_level_problems(level, seed, per_level) for level in range(len(CHAIN_LEVELS))]
    if task != "arithmetic":
        raise DataError(f"unknown embedded task {task!r}; choose one of {EMBEDDED_TASKS}")
    return [level_problems(level, seed) for level in range(len(DIFFICULTY_LEVELS))]


def _verl_rows(problems: list[tuple[str, str]]) -> pa.Table:
    rows = [
        {
            "data_source": EMBEDDED_SOURCE,
            "prompt": [{"role": "user", "content": DAPO_PROMPT_TEMPLATE.format(problem=problem)}],
            "ability": "MATH",
            "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": index},
        }
        for index, (problem, answer) in enumerate(problems)
    ]
    return pa.Table.from_pylist(rows, schema=VERL_SCHEMA)


def make_arithmetic_table(n_rows: int, seed: int) -> pa.Table:
    """n_rows distinct problems in verl / DAPO-Math-17k format, taking the levels in turn."""
    pools = [level_problems(level, seed) for level in range(len(DIFFICULTY_LEVELS))]
    if n_rows > sum(map(len, pools)):
        raise DataError(f"the embedded task has only {sum(map(len, pools))} distinct problems, {n_rows} asked")
    chosen: list[tuple[str, str]] = []
    depth = 0
    while len(chosen) < n_rows:
        chosen.extend(pool[depth] for pool in pools if depth < len(pool))
        depth += 1
    return _verl_rows(chosen[:n_rows])


def write_embedded_splits(
    directory: str | Path, seed: int, train_per_level: int = 80, val_per_level: int = 20, task: str = "arithmetic"
) -> tuple[Path, Path]:
    """Train and validation parquet files of an embedded task (EMBEDDED_TASKS) with
    disjoint problems and every level in both.

    Validation holds val_per_level problems of each level and training the next
    train_per_level of each: both balanced over the levels, so validation measures what
    training optimises (arithmetic's level 0 has 100 problems: the defaults use all of them).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    train, val = [], []
    for pool in _task_pools(task, seed, train_per_level + val_per_level):
        val.extend(pool[:val_per_level])
        train.extend(pool[val_per_level : val_per_level + train_per_level])
    random.Random(seed).shuffle(train)
    train_path, val_path = directory / "train.parquet", directory / "val.parquet"
    pq.write_table(_verl_rows(train), train_path)
    pq.write_table(_verl_rows(val), val_path)
    return train_path, val_path


# --- loading verl-format files -----------------------------------------------------
def _bad_row(path: str, row: int, column: str, problem: str) -> DataError:
    return DataError(f"{path}: row {row}, column {column!r}: {problem}")


def _parse_row(path: str, row_index: int, row: dict) -> PromptRecord:
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise _bad_row(path, row_index, "prompt", f"expected a non-empty chat list, got {type(prompt).__name__}")
    messages = []
    for turn in prompt:
        if (
            not isinstance(turn, dict)
            or not isinstance(turn.get("content"), str)
            or not isinstance(turn.get("role"), str)
        ):
            raise _bad_row(path, row_index, "prompt", "every turn needs string 'role' and 'content'")
        messages.append((turn["role"], turn["content"]))
    if not any(content.strip() for _, content in messages):
        raise _bad_row(path, row_index, "prompt", "empty prompt text")
    reward_model = row.get("reward_model")
    truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    if isinstance(truth, (int, float)) and not isinstance(truth, bool):
        truth = str(truth)  # integers by construction in DAPO-Math-17k; keep their text form
    if not isinstance(truth, str) or not truth.strip():
        raise _bad_row(path, row_index, "reward_model.ground_truth", f"expected a non-empty string, got {truth!r}")
    extra = json.loads(row["extra_info_json"]) if row.get("extra_info_json") else row.get("extra_info")
    extra = extra if isinstance(extra, dict) else {}
    index = extra.get("index")
    uid = str(index) if index is not None else str(row_index)
    return PromptRecord(
        uid=uid,
        messages=tuple(messages),
        ground_truth=truth.strip(),
        data_source=str(row.get("data_source") or ""),
        extra_info=json.dumps(extra, sort_keys=True, default=str),
    )


def load_prompts(path: str | Path, on_bad_row: str = "error") -> tuple[list[PromptRecord], LoadReport]:
    """Read a verl-format parquet file into de-duplicated prompt records.

    on_bad_row="error" raises DataError naming the file, row and column of the first
    malformed row; "skip" drops malformed rows and counts them in the report.
    """
    path = str(path)
    if not Path(path).exists():
        raise DataError(f"{path}: no such data file")
    try:
        table = pq.read_table(path)
    except Exception as error:  # pyarrow raises several types for unreadable files
        raise DataError(f"{path}: not a readable parquet file ({error})") from error
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise DataError(
            f"{path}: missing column(s) {missing}; found {table.column_names} (expected verl / DAPO-Math-17k format)"
        )
    if table.num_rows == 0:
        raise DataError(f"{path}: the file has no rows")

    records: list[PromptRecord] = []
    seen: set[tuple] = set()
    duplicates = skipped = 0
    for row_index, row in enumerate(table.select([c for c in table.column_names]).to_pylist()):
        try:
            record = _parse_row(path, row_index, row)
        except DataError:
            if on_bad_row == "error":
                raise
            skipped += 1
            logger.warning("skipping malformed row %d of %s", row_index, path, exc_info=True)
            continue
        if record.messages in seen:
            duplicates += 1
            continue
        seen.add(record.messages)
        records.append(record)
    uids = [r.uid for r in records]
    if len(set(uids)) != len(uids):  # group ids are built from uids: they must be unique
        logger.warning("%s: extra_info.index is not unique; using row positions as prompt ids", path)
        records = [dataclasses.replace(r, uid=str(i)) for i, r in enumerate(records)]
    if not records:
        raise DataError(f"{path}: no usable rows ({skipped} malformed, {duplicates} duplicates)")
    report = LoadReport(path, table.num_rows, duplicates, skipped, len(records))
    if duplicates or skipped:
        logger.info(
            "%s: %d rows, dropped %d duplicate prompts, skipped %d malformed rows, kept %d",
            path,
            table.num_rows,
            duplicates,
            skipped,
            len(records),
        )
    return records, report


def render_prompt(record: PromptRecord, tokenizer, system_prompt: str | None = None) -> str:
    """The prompt text the policy sees: the tokenizer's chat template applied to the chat.

    system_prompt (RolloutConfig.system_prompt), for a chat without a system turn: None keeps
    what the template does (some add a default system turn), text becomes the system turn,
    "" drops the template's default: the chat is rendered behind a placeholder system turn,
    which is then cut off, a BOS token before it kept (DataError if the template does not
    render the placeholder as a prefix of its own).
    """
    chat = record.chat
    if system_prompt is None or any(role == "system" for role, _ in record.messages):
        return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    if system_prompt:
        return tokenizer.apply_chat_template(
            [{"role": "system", "content": system_prompt}, *chat], tokenize=False, add_generation_prompt=True
        )
    marker = "dapo-system-placeholder"
    placeholder = [{"role": "system", "content": marker}]
    system_turn = tokenizer.apply_chat_template(placeholder, tokenize=False)
    text = tokenizer.apply_chat_template(placeholder + chat, tokenize=False, add_generation_prompt=True)
    if marker not in system_turn or not text.startswith(system_turn):
        raise DataError(
            "rollout.system_prompt='': this chat template does not render a system turn as a prefix of the "
            "chat, so its default cannot be cut off; set rollout.system_prompt to a text of your own"
        )
    dropped = text[len(system_turn) :]
    bos = tokenizer.bos_token
    if bos and system_turn.startswith(bos) and not dropped.startswith(bos):
        dropped = bos + dropped  # a BOS the template writes before any turn (Llama 3's <|begin_of_text|>) stays
    return dropped


def system_prompt_tokens(tokenizer, system_prompt: str | None) -> int:
    """Tokens the system turn adds to a prompt (the template's default with None, none with ""):
    the rendered length of a one-turn chat minus that of the same chat without a system turn."""
    record = PromptRecord(uid="0", messages=(("user", "q"),), ground_truth="")
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    return count(render_prompt(record, tokenizer, system_prompt)) - count(render_prompt(record, tokenizer, ""))
