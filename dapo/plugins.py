"""A user's own function, named in the config: a registry name, "package.module:function"
or "path/to/file.py:function" (as verl's custom_reward_function.path / .name).

The config holds the name, never the function, so that it travels to every pod and
worker process as text, and each loads the function where it runs.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path


class PluginError(ValueError):
    """A function named in the config that cannot be found; the message says where it looked."""


def is_user_spec(spec: str) -> bool:
    """Whether `spec` names a user's function ("module:function", "file.py:function")
    rather than an entry of a registry."""
    return ":" in spec


def resolve(spec: str, registry: Mapping[str, Callable], kind: str) -> Callable:
    """The function `spec` names: a registry entry, or a user's function (load_user_function)."""
    if not is_user_spec(spec):
        if spec not in registry:
            raise PluginError(
                f"unknown {kind} {spec!r}: choose one of {sorted(registry)}, "
                "or name your own as 'package.module:function' or 'path/to/file.py:function'"
            )
        return registry[spec]
    return load_user_function(spec, kind)


@functools.lru_cache(maxsize=64)
def load_user_function(spec: str, kind: str = "function") -> Callable:
    """Import "module:function" or "file.py:function" (a relative path from the working
    directory) and return the function; PluginError names what is missing."""
    where, _, name = spec.rpartition(":")
    if not where or not name.isidentifier():
        raise PluginError(f"{kind} {spec!r}: expected 'package.module:function' or 'path/to/file.py:function'")
    if where.endswith(".py"):
        path = Path(where).resolve()
        if not path.is_file():
            raise PluginError(f"{kind} {spec!r}: no file {path}")
        module_name = f"dapo_user_{path.stem}_{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        if module_spec is None or module_spec.loader is None:
            raise PluginError(f"{kind} {spec!r}: {path} cannot be loaded as a Python module")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module  # dataclasses and pickling look their module up here
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as error:
            raise PluginError(
                f"{kind} {spec!r}: cannot import {where!r} ({error}); is its directory on PYTHONPATH?"
            ) from error
    function = getattr(module, name, None)
    if not callable(function):
        raise PluginError(f"{kind} {spec!r}: {where} has no function {name!r}")
    return function


def named_functions(config) -> list[tuple[str, str, str]]:
    """(field, spec, kind) of every function the config names: reward_fn, each scorer of
    reward_fn_by_source, loss_fn, adv_estimator."""
    return [
        ("reward_fn", config.reward_fn, "scorer"),
        ("loss_fn", config.loss_fn, "policy loss"),
        ("adv_estimator", config.adv_estimator, "advantage estimator"),
        *((f"reward_fn_by_source[{source!r}]", spec, "scorer") for source, spec in config.reward_fn_by_source.items()),
    ]


def user_code_digest(config) -> str:
    """sha256 of the code of the user's functions the config names ("" when it names none):
    every .py file under each function's directory (helpers it imports beside it) and the
    data files its module lists in DAPO_DATA_FILES (paths relative to that directory).
    resolve_config puts it in the step config, so that cached steps follow the code of a
    reward, loss or advantage estimator edited since, not only its name."""
    specs = sorted({(spec, kind) for _, spec, kind in named_functions(config) if is_user_spec(spec)})
    if not specs:
        return ""
    digest = hashlib.sha256()
    for spec, kind in specs:
        module = sys.modules[load_user_function(spec, kind).__module__]  # as check_named_functions loaded it
        if module.__file__ is None:
            raise PluginError(f"{kind} {spec!r}: its module {module.__name__!r} has no file to hash")
        path = Path(module.__file__).resolve()
        data_files = [path.parent / name for name in getattr(module, "DAPO_DATA_FILES", ())]
        digest.update(spec.encode())
        for file in sorted(set(user_code_files(path)) | set(data_files)):
            digest.update(str(file.relative_to(path.parent) if file.is_relative_to(path.parent) else file).encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


def user_code_files(path: Path) -> list[Path]:
    """The .py files under the directory of a user's file `path`: that file alone when it lies
    directly in site-packages; hidden directories, virtual environments and caches skipped."""
    if path.parent.name in ("site-packages", "dist-packages"):
        return [path]
    files = []
    for folder, subfolders, names in os.walk(path.parent):
        subfolders[:] = sorted(
            d
            for d in subfolders
            if not d.startswith((".", "__pycache__"))
            and not (Path(folder) / d / "pyvenv.cfg").exists()
            and d not in ("site-packages", "node_modules")
        )
        files += [Path(folder) / name for name in names if name.endswith(".py")]
    return files
