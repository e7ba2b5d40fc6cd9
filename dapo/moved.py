"""Old module names, and names that left a module, importable for one release after the
modules moved into packages (0.2.0).

`import dapo.loss` (or `from dapo.rollout import vllm_engine`, or anything under an old
package) gives the module at its new name, `dapo.algorithm.loss`, with a DeprecationWarning
naming it; both names are then the same module object, so a patch through either applies to
both. `python -m` with an old name runs the new module. A name that left a module
(MOVED_NAMES) is looked up where it is now: patch it there, since a patch of the old name
sets an attribute nothing reads. The old names go in the release after 0.2.
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
        new = new_name(fullname)
        if new is None or importlib.util.find_spec(new) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        new = _warned_new_name(module.__name__)
        sys.modules[module.__name__] = importlib.import_module(new)  # the import system returns this entry

    def get_code(self, fullname: str) -> types.CodeType | None:
        """The new module's code, for `python -m` with an old name (runpy asks for it)."""
        new = _warned_new_name(fullname)
        spec = importlib.util.find_spec(new)
        loader = spec.loader if spec else None
        return loader.get_code(new) if isinstance(loader, importlib.abc.InspectLoader) else None


def _warned_new_name(name: str) -> str:
    new = str(new_name(name))
    warnings.warn(
        f"{name} moved to {new}: import it from there (the old name goes in the release after 0.2)",
        DeprecationWarning,
        stacklevel=3,
    )
    return new


def install() -> None:
    """Put the finder of old names first on sys.meta_path (once)."""
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedModuleFinder())
