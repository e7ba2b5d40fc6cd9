"""Every command README.md shows works: each `make` target exists, `python -m dapo` runs,
and each `pyflyte run` line parses as pyflyte and the workflow would take it (pyflyte's
own options, dapo_loop's inputs, the preset and every `--set` through the config parser,
a reasoning-gym spec through its parser), without starting any work."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def readme_commands() -> list[list[str]]:
    """The commands of README.md's bash blocks: continuations joined, comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(words)
    return commands


COMMANDS = readme_commands()


def test_the_readme_shows_the_two_commands_and_the_real_model():
    assert [words for words in COMMANDS if words[0] == "make"][:3] == [["make", "run"], ["make", "test"], ["make", "run-real"]]
    assert sum(words[:2] == ["pyflyte", "run"] for words in COMMANDS) >= 5


@pytest.mark.parametrize("target", sorted({words[1] for words in COMMANDS if words[0] == "make"}))
def test_each_make_target_the_readme_names_exists(target):
    assert re.search(rf"^{re.escape(target)}:", (ROOT / "Makefile").read_text(), re.M), target


@pytest.mark.parametrize("words", [w for w in COMMANDS if w[:3] == ["python", "-m", "dapo"]], ids=" ".join)
def test_each_dapo_command_runs(words):
    done = subprocess.run([sys.executable, *words[1:]], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def pyflyte_lines() -> list[list[str]]:
    return [words for words in COMMANDS if words[:2] == ["pyflyte", "run"]]


@pytest.mark.parametrize("words", pyflyte_lines(), ids=lambda w: " ".join(w[2:])[:80])
def test_each_pyflyte_run_parses_as_pyflyte_and_dapo_loop_take_it(words):
    from flytekit.clis.sdk_in_container.run import RunLevelParams

    from dapo.data import gym_tasks
    from dapo.config import DAPOConfig, flat_overrides, parse_assignments
    from workflows.dapo import dapo_loop

    run_options = {name: option for option in RunLevelParams.options() for name in option.opts}
    rest = words[2:]
    while rest[0].startswith("-"):  # pyflyte run's own options, before the file
        option = run_options.get(rest[0])
        assert option is not None, f"pyflyte run has no option {rest[0]}"
        rest = rest[1 if option.is_flag else 2 :]
    path, entity, *arguments = rest
    assert (ROOT / path).is_file() and (path, entity) == ("workflows/dapo.py", "dapo_loop")
    inputs = dapo_loop.python_interface.inputs
    given: dict[str, list[str]] = {}
    for name, value in zip(arguments[::2], arguments[1::2]):
        assert name.startswith("--") and name[2:] in inputs, f"dapo_loop has no input {name}"
        given.setdefault(name[2:], []).append(value)
    assert len(arguments) % 2 == 0, arguments
    overrides = {}
    for assignments in given.get("set", []):
        overrides.update(flat_overrides(parse_assignments(assignments)))
    DAPOConfig.preset(given.get("preset", ["tiny_cpu"])[0], overrides)  # a ConfigError names what is wrong
    for name in ("total_steps", "steps_per_chunk"):
        for value in given.get(name, []):
            int(value)
    for value in given.get("train_data", []) + given.get("val_data", []):
        if gym_tasks.is_gym_spec(value):
            gym_tasks.parse_spec(value)
