"""A task's cache version: a digest of the project source its module runs.

Flyte reuses a cached output while the task's name, interface, inputs and cache version
are the same; a version bumped by hand is one forgotten bump away from serving results of
old code (a stale preset once was). Here the version is computed: the task module and
every project module it imports (at the top or inside a function, transitively), each
parsed and written out canonically, so that comments, docstrings and formatting do not
change it and any change of what the code does does. Registration and the pods (which
import the fast-registered copy of the same files) compute the same version.

What it does not cover: the installed libraries (an image's new vLLM is a new image, not
a new version) and a user's own functions (their digest is an input of the cached tasks,
dapo.plugins.user_code_digest).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
from pathlib import Path

from dapo.moved import new_name

PROJECT_PACKAGES = ("dapo", "tasks")
"""Top-level packages whose modules make up a task's version."""


def canonical_source(source: str) -> str:
    """The module's syntax tree without docstrings, written out with every non-empty field:
    comments and layout are gone after parsing, and fields that are empty (None, []) are
    left out so that Python versions adding fields (3.12's type_params) agree."""
    return _canonical(ast.parse(source))


def _canonical(tree: ast.Module) -> str:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return _written(tree)


def _written(node) -> str:
    if isinstance(node, ast.AST):
        fields = [
            f"{name}={_written(value)}" for name, value in ast.iter_fields(node) if value is not None and value != []
        ]
        return f"{type(node).__name__}({','.join(fields)})"
    if isinstance(node, list):
        return f"[{','.join(map(_written, node))}]"
    return repr(node)


@functools.cache
def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)  # a top-level package: found, not imported
    return Path(spec.origin).parent if spec and spec.origin else None


def _source_file(module: str) -> Path | None:
    """The file of a project module, found beside its package without importing anything;
    None for anything else (another library, a name imported from a module)."""
    package, *rest = module.split(".")
    directory = _package_dir(package) if package in PROJECT_PACKAGES else None
    if directory is None:
        return None
    path = directory.joinpath(*rest)
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _imports(module: str, tree: ast.AST, is_package: bool) -> set[str]:
    """The project modules a module's import statements name, with their parent packages
    (importing a.b.c runs a/__init__.py and a/b/__init__.py)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            package = module if is_package else module.rpartition(".")[0]
            base = (
                importlib.util.resolve_name("." * node.level + (node.module or ""), package)
                if node.level
                else node.module or ""
            )
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
    names = {new_name(name) or name for name in names}  # an old module name (dapo.moved) is its new module
    with_parents = {".".join(name.split(".")[: n + 1]) for name in names for n in range(name.count(".") + 1)}
    return {name for name in with_parents if _source_file(name)}


@functools.cache
def _module_text(module: str) -> tuple[str, frozenset[str]]:
    path = _source_file(module)
    if path is None:
        raise ModuleNotFoundError(f"{module!r} is no module of {PROJECT_PACKAGES}")
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imports = frozenset(_imports(module, tree, path.name == "__init__.py"))  # before _canonical drops docstrings
    return _canonical(tree), imports


def module_closure(module: str) -> list[str]:
    """The module and every project module it imports, directly or not, sorted."""
    seen, pending = set(), [module]
    while pending:
        name = pending.pop()
        if name not in seen:
            seen.add(name)
            pending.extend(_module_text(name)[1] - seen)
    return sorted(seen)


@functools.cache
def source_version(module: str) -> str:
    """The cache version of the tasks defined in `module` (a dotted name): 16 hex digits of
    the sha256 over the canonical source of module_closure(module)."""
    digest = hashlib.sha256()
    for name in module_closure(module):
        digest.update(f"{name}\n{_module_text(name)[0]}\n".encode())
    return digest.hexdigest()[:16]
