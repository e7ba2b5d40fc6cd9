"""reasoning-gym's procedural tasks as a data source: rows in our schema, entries regenerated to score.

    --train_data 'reasoning_gym:chain_sum?min_terms=2&max_terms=2'
    --train_data 'reasoning_gym:chain_sum?max_terms=2&weight=3;products?max_digits=1&size=4000&seed=7'

A spec names one or more of reasoning-gym's datasets (`reasoning_gym.factory.DATASETS`),
separated by ";", each with its own options (its config dataclass's fields, values read as
YAML scalars) and a `weight` (default 1): the rows are shared out by weight. `size` (rows in
all, default 2000) and `seed` (default 0) are the spec's, given once on any task.

Each row stores where its entry comes from (task, options, seed, size, index) in extra_info,
and the `reasoning_gym` scorer (dapo.rewards) regenerates the entry and asks the task's own
`score_answer`: generators are deterministic in (seed, index), so nothing but the question
and answer text travels with the row.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

PREFIX = "reasoning_gym:"
DATA_SOURCE = "reasoning_gym"
"""The rows' data_source (resolve maps it to the reasoning_gym scorer)."""
DEFAULT_SIZE = 2000
DEFAULT_VAL_SIZE = 1024
VAL_SEED_OFFSET = 1_000_003
"""A validation split made from the training spec uses seed + this (then de-duplicated against training)."""
SPEC_KEYS = ("size", "seed")
TASK_KEYS = ("weight",)


class GymSpecError(ValueError):
    """A reasoning_gym: spec that names an unknown task or option, or a bad value."""


@dataclass(frozen=True)
class GymTask:
    name: str
    options: tuple[tuple[str, object], ...]
    weight: float = 1.0

    @property
    def options_json(self) -> str:
        return json.dumps(dict(self.options), sort_keys=True)


@dataclass(frozen=True)
class GymSpec:
    tasks: tuple[GymTask, ...]
    size: int = DEFAULT_SIZE
    seed: int = 0

    def task_sizes(self) -> list[int]:
        """Rows of each task: size shared out by weight (largest remainders), each at least 1."""
        total = sum(t.weight for t in self.tasks)
        shares = [self.size * t.weight / total for t in self.tasks]
        sizes = [max(1, int(s)) for s in shares]
        by_remainder = sorted(range(len(shares)), key=lambda i: shares[i] - int(shares[i]), reverse=True)
        for i in by_remainder[: max(0, self.size - sum(sizes))]:
            sizes[i] += 1
        return sizes

    def with_seed(self, seed: int, size: int | None = None) -> GymSpec:
        return dataclasses.replace(self, seed=seed, size=size or self.size)


def is_gym_spec(path: str) -> bool:
    return path.startswith(PREFIX)


def _value(text: str) -> object:
    import yaml

    try:
        return yaml.safe_load(text) if text else ""
    except yaml.YAMLError:
        return text


def _datasets() -> dict:
    from reasoning_gym.factory import DATASETS

    return DATASETS


def parse_spec(spec: str) -> GymSpec:
    """A reasoning_gym: spec, every task and option checked against reasoning-gym's own
    datasets and config classes (GymSpecError names the closest known one), before any work."""
    if not is_gym_spec(spec):
        raise GymSpecError(f"{spec!r} is not a reasoning_gym: spec")
    datasets = _datasets()
    tasks: list[GymTask] = []
    spec_values: dict[str, Any] = {}  # parsed from the user's text: checked below
    for part in filter(None, (p.strip() for p in spec[len(PREFIX) :].split(";"))):
        name, _, query = part.partition("?")
        if name not in datasets:
            close = difflib.get_close_matches(name, list(datasets), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise GymSpecError(
                f"{spec!r}: reasoning-gym has no task {name!r}{hint} "
                f"({len(datasets)} tasks in reasoning_gym.factory.DATASETS)"
            )
        fields = [f.name for f in dataclasses.fields(datasets[name][1]) if f.name not in ("seed", "size")]
        options: dict[str, Any] = {}
        weight: Any = 1.0
        for item in filter(None, query.split("&")):
            key, eq, text = (unquote(part) for part in item.partition("="))  # "+" stays "+" (operators=[+,-])
            if not eq:
                raise GymSpecError(f"{spec!r}: {item!r} is not option=value")
            value = _value(text)
            if key in SPEC_KEYS:
                if key in spec_values and spec_values[key] != value:
                    raise GymSpecError(
                        f"{spec!r}: {key} given twice ({spec_values[key]!r}, {value!r}); it is the spec's, give it once"
                    )
                spec_values[key] = value
            elif key == "weight":
                weight = value
            elif key in fields:
                options[key] = value
            else:
                close = difflib.get_close_matches(key, fields + list(SPEC_KEYS + TASK_KEYS), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise GymSpecError(
                    f"{spec!r}: task {name!r} has no option {key!r}{hint} "
                    f"(its options: {fields + list(SPEC_KEYS + TASK_KEYS)})"
                )
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or weight <= 0:
            raise GymSpecError(f"{spec!r}: task {name!r}: weight must be a number > 0, got {weight!r}")
        tasks.append(GymTask(name, tuple(sorted(options.items())), float(weight)))
    if not tasks:
        raise GymSpecError(f"{spec!r}: name at least one task, e.g. reasoning_gym:chain_sum?min_terms=2&max_terms=2")
    size, seed = spec_values.get("size", DEFAULT_SIZE), spec_values.get("seed", 0)
    for key, value, least in (("size", size, 1), ("seed", seed, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise GymSpecError(f"{spec!r}: {key} must be an integer >= {least}, got {value!r}")
    parsed = GymSpec(tuple(tasks), size, seed)
    if len(tasks) > size:
        raise GymSpecError(f"{spec!r}: size={size} is smaller than the {len(tasks)} tasks")
    for task, task_size in zip(parsed.tasks, parsed.task_sizes()):
        dataset(task.name, task.options_json, seed, task_size)  # the task's own config checks (validate())
    return parsed


@functools.lru_cache(maxsize=64)
def dataset(name: str, options_json: str, seed: int, size: int):
    """reasoning-gym's dataset object (entries are made on access, deterministic in seed and index)."""
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(name, seed=seed, size=size, **json.loads(options_json))
    except (TypeError, ValueError, AssertionError) as error:
        raise GymSpecError(f"reasoning-gym task {name!r} refused options {options_json}: {error}") from error


@dataclass(frozen=True)
class GymRow:
    question: str
    answer: str
    source: dict
    """Where the entry comes from: rg_task, rg_options (JSON), rg_seed, rg_size, rg_index."""


def generate_rows(spec: GymSpec) -> list[GymRow]:
    """Every row of the spec, task by task, with its provenance. A generator that raises is
    reported with its task, options and index."""
    rows = []
    for index, (task, size) in enumerate(zip(spec.tasks, spec.task_sizes())):
        seed = spec.seed + index  # tasks of one spec draw from their own streams
        data = dataset(task.name, task.options_json, seed, size)
        for i in range(size):
            try:
                entry = data[i]
            except Exception as error:
                raise GymSpecError(
                    f"reasoning-gym task {task.name!r} ({task.options_json}) failed to generate entry {i} "
                    f"of seed {seed}: {type(error).__name__}: {error}"
                ) from error
            source = {
                "rg_task": task.name,
                "rg_options": task.options_json,
                "rg_seed": seed,
                "rg_size": size,
                "rg_index": i,
            }
            rows.append(GymRow(str(entry["question"]), str(entry["answer"]), source))
    return rows


def entry_of(extra_info: dict) -> tuple[Any, dict]:
    """The dataset and entry a row came from, regenerated from its extra_info."""
    data = dataset(
        extra_info["rg_task"], extra_info["rg_options"], int(extra_info["rg_seed"]), int(extra_info["rg_size"])
    )
    return data, data[int(extra_info["rg_index"])]
