"""Overrides as users write them: a YAML config file (read_config_file) and the command
line's dotted assignments (parse_assignments), both as field values for
DAPOConfig.from_dict / replace (dapo.config.schema.flat_overrides)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dapo.config.schema import ConfigError


def parse_assignments(text: str) -> dict[str, Any]:
    """Dotted assignments as given on the command line, "algorithm.clip_high=0.2
    rollout.temperature=0.9", separated by spaces (quote a value with spaces), as overrides. Values
    are read as YAML scalars or flow collections: 0.2, true, null, "a b", {k: v}; a float field
    also takes the text YAML 1.1 leaves unread (1e-6, inf), see dapo.config.schema._typed."""
    import shlex

    import yaml

    overrides: dict[str, Any] = {}
    for item in shlex.split(text):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"--set {item!r}: expected section.field=value, e.g. algorithm.clip_high=0.2")
        try:
            parsed = yaml.safe_load(value) if value else ""
        except yaml.YAMLError as error:
            raise ConfigError(f"--set {item!r}: the value is not a YAML scalar or flow collection ({error})") from error
        overrides[key] = parsed
    return overrides


def read_config_file(path: str) -> dict[str, Any]:
    """A YAML config file: fields by section ({algorithm: {clip_high: 0.2}}), dotted or flat."""
    import yaml

    try:
        with open(path) as f:
            values = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as error:
        raise ConfigError(f"config file {path}: {error}") from error
    if values is None:
        return {}
    if not isinstance(values, Mapping):
        raise ConfigError(f"config file {path}: expected a mapping of sections to fields, got {type(values).__name__}")
    return dict(values)
