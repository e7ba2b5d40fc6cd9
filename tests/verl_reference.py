"""verl 0.9.1's own source, run from its wheel without installing verl (its package imports ray
and more): the reference that tests compare our rollout correction and advantages against."""

from __future__ import annotations

import ast
import sys
import types
import zipfile
from pathlib import Path

import pytest

VERL_WHEEL = Path(sys.prefix) / "reference" / "verl-0.9.1-py3-none-any.whl"
"""Downloaded by `make setup`, not installed."""


def verl_source(path: str) -> bytes:
    """The file `path` (e.g. "verl/trainer/ppo/core_algos.py") of verl's wheel."""
    if not VERL_WHEEL.exists():
        pytest.fail(f"{VERL_WHEEL} is missing: `make setup` downloads it")
    with zipfile.ZipFile(VERL_WHEEL) as wheel:
        return wheel.read(path)


def verl_functions(path: str, names: tuple[str, ...], **given: object) -> types.ModuleType:
    """A module of the top-level functions `names` of verl's file `path`, verl's source, with
    `given` as their globals (the names they use; the file's other imports are not run)."""
    wanted = [node for node in ast.parse(verl_source(path)).body if isinstance(node, ast.FunctionDef) and node.name in names]
    module = types.ModuleType(path.removesuffix(".py").replace("/", "."))
    module.__dict__.update(given)
    exec(compile(ast.Module(body=wanted, type_ignores=[]), path, "exec"), module.__dict__)
    return module


def verl_module(path: str, imports: dict[str, types.ModuleType | dict[str, object]]) -> types.ModuleType:
    """verl's whole file `path` run as a module, its imports given: each module name in `imports`
    is the module given or one holding the names given (placeholders for what is only named
    in annotations), its parent packages empty modules, in sys.modules only while it runs."""
    modules: dict[str, types.ModuleType] = {}
    for name, content in imports.items():
        parts = name.split(".")
        for depth in range(1, len(parts)):
            modules.setdefault(".".join(parts[:depth]), types.ModuleType(".".join(parts[:depth])))
        if isinstance(content, types.ModuleType):
            modules[name] = content
        else:
            modules[name] = modules.get(name) or types.ModuleType(name)
            modules[name].__dict__.update(content)
    for name, module in modules.items():  # `import a.b.c as x` and `from a.b import c` find c on a.b
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    saved = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    try:
        module = types.ModuleType("verl_" + Path(path).stem)
        exec(compile(verl_source(path), path, "exec"), module.__dict__)
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    return module
