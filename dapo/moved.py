"""Old module names, and names that left a module, importable for one release after the
modules moved into packages (0.2.0).

`import dapo.algorithm.loss` (or `from dapo.engines.rollout import vllm_engine`, or anything under an old
package) gives the module at its new name, `dapo.algorithm.loss`, with a
DeprecationWarning naming it; both names are then the same module object, so a patch
through either applies to both. The old names go in the release after 0.2.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

MOVED_MODULES: dict[str, str] = {
    **{
        f"dapo.{name}": f"dapo.algorithm.{name}"
        for name in ("advantages", "batch", "loss", "micro_batches", "rollout_correction", "sampling")
    },
    **{
        f"dapo.{name}": f"dapo.model.{name}" for name in ("model_source", "policy", "policy_matrix", "varlen_attention")
    },
    "dapo.gym_tasks": "dapo.data.gym_tasks",
    "dapo.rollout": "dapo.engines.rollout",
    "dapo.trainer": "dapo.engines.trainer",
    "dapo.update": "dapo.engines.update",
    "dapo.stages": "dapo.execution.stages",
    **{f"dapo.{name}": f"dapo.execution.{name}" for name in ("colocated", "overlap", "schedule")},
    **{f"dapo.{name}": f"dapo.cluster.{name}" for name in ("cluster_cost", "run_budget")},
}
"""Old dotted name -> new dotted name; a module under an old package moves with it."""


MOVED_NAMES: dict[str, dict[str, str]] = {
    "dapo.data": {
        **{
            name: "dapo.data.prompts"
            for name in (
                "REQUIRED_COLUMNS",
                "EMBEDDED_SOURCE",
                "VERL_SCHEMA",
                "DIFFICULTY_LEVELS",
                "arithmetic_problem",
                "level_problems",
                "chain_problem",
                "chain_level_problems",
                "task_problem",
            )
        },
        "DAPO_PROMPT_TEMPLATE": "dapo.config",
        "EMBEDDED_TASKS": "dapo.config",
    },
    "dapo.execution.stages.setup": {"resolve_sources": "dapo.resolve", "check_named_functions": "dapo.resolve"},
}
"""Names that left a module that stayed: {module: {name: the module that has it now}}. The
module's __getattr__ (moved_names) gives them with a DeprecationWarning."""


def moved_names(module: str) -> Callable[[str], Any]:
    """A module-level __getattr__ for `module` that finds the names that left it (MOVED_NAMES)
    where they are now. The new module is imported by name when the old name is used, not
    before: it may sit in a layer above `module`."""

    def __getattr__(name: str) -> Any:
        new = MOVED_NAMES[module].get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(
            f"{module}.{name} moved to {new}.{name}: import it from there (the old name goes in the release after 0.2)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(new), name)

    return __getattr__


def new_name(name: str) -> str | None:
    """Where the module an old `name` stood for lives now, or None if `name` did not move."""
    for old, new in MOVED_MODULES.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old) :]
    return None


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """First on sys.meta_path: an old name must not be found by the path finder through its
    moved parent package (that would load a second copy of the module)."""

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if new_name(fullname) else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        new = new_name(module.__name__)
        warnings.warn(
            f"{module.__name__} moved to {new}: import it from there (the old name goes in the release after 0.2)",
            DeprecationWarning,
            stacklevel=2,
        )
        sys.modules[module.__name__] = importlib.import_module(str(new))  # the import system returns this entry


def install() -> None:
    """Put the finder of old names first on sys.meta_path (once)."""
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedModuleFinder())
