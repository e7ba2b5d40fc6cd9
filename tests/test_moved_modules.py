"""Modules that moved into packages stay importable under their old names for one release."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from dapo.moved import MOVED_MODULES, new_name

ROOT = Path(__file__).resolve().parents[1]


def test_every_old_name_points_at_a_module_that_exists_and_no_file_is_left_under_it():
    for old, new in MOVED_MODULES.items():
        assert importlib.util.find_spec(new) is not None, new
        path = ROOT / old.replace(".", "/")
        left = [path.with_suffix(".py"), *path.glob("**/*.py")]  # (git leaves an ignored __pycache__ behind)
        assert not any(p.exists() for p in left), f"{old} is both moved and still there"


def test_an_old_name_gives_the_same_module_with_a_deprecation_warning_naming_the_new_one():
    with pytest.warns(DeprecationWarning, match=r"dapo\.loss moved to dapo\.algorithm\.loss"):
        old = importlib.import_module("dapo.loss")
    from dapo.algorithm import loss

    assert old is loss
    assert old.__name__ == "dapo.algorithm.loss" and old.__spec__.name == "dapo.algorithm.loss"


def test_a_module_under_an_old_package_moves_with_it_and_is_not_loaded_twice():
    code = (
        "import sys, warnings\n"
        "warnings.simplefilter('error', DeprecationWarning)\n"
        "import dapo.engines.rollout.hf_engine as new\n"  # the new names give no warning
        "warnings.simplefilter('ignore', DeprecationWarning)\n"
        "from dapo.rollout import hf_engine\n"
        "import dapo.stages.setup\n"
        "assert hf_engine is new, (hf_engine, new)\n"
        "assert dapo.stages.setup is sys.modules['dapo.execution.stages.setup']\n"
        "copies = [m for m in sys.modules.values() if getattr(m, '__file__', None) == new.__file__]\n"
        "assert len(set(map(id, copies))) == 1, copies\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_python_m_with_an_old_name_runs_the_new_module():
    """0.1.0's `make setup` ran `python -m dapo.trainer.comm_op` (it builds or loads DeepSpeed's comm op)."""
    done = subprocess.run([sys.executable, "-W", "always::DeprecationWarning", "-m", "dapo.trainer.comm_op"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "dapo.trainer.comm_op moved to dapo.engines.trainer.comm_op" in done.stderr
    assert "DeepSpeed's shm comm op" in done.stdout + done.stderr
    missing = subprocess.run([sys.executable, "-W", "always::DeprecationWarning", "-m", "dapo.rollout.no_such_module"], cwd=ROOT, capture_output=True, text=True,
                             timeout=120)
    assert missing.returncode != 0 and "No module named dapo.rollout.no_such_module" in missing.stderr
    assert "no_such_module moved" not in missing.stderr  # its old package warns; a module that does not exist does not


def test_names_that_did_not_move_are_left_alone():
    assert new_name("dapo.updates") is None  # "dapo.update" is a prefix of the name, not its package
    assert new_name("dapo.config") is None and new_name("dapo.rewards") is None
    assert new_name("dapo.rollout.vllm_engine") == "dapo.engines.rollout.vllm_engine"


def test_a_name_that_left_a_module_is_found_where_it_is_now_with_a_deprecation_warning():
    from dapo import data, resolve
    from dapo.data import prompts
    from dapo.execution.stages import setup

    with pytest.warns(DeprecationWarning, match=r"setup\.resolve_sources moved to dapo\.resolve\.resolve_sources"):
        assert setup.resolve_sources is resolve.resolve_sources
    with pytest.warns(DeprecationWarning, match=r"dapo\.data\.task_problem moved to dapo\.data\.prompts"):
        assert data.task_problem is prompts.task_problem
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        data.no_such_name  # noqa: B018


def test_every_moved_name_exists_where_the_table_says():
    from dapo.moved import MOVED_NAMES

    for module, names in MOVED_NAMES.items():
        for name, new in names.items():
            assert hasattr(importlib.import_module(new), name), f"{module}.{name} -> {new}"
