"""`python -m dapo config`: every field of the config, by section, with its value and help.

    python -m dapo config                          # tiny_cpu's values
    python -m dapo config --preset paper_32b --set algorithm.clip_high=0.2
    python -m dapo config --presets                # the presets and what each is for
    python -m dapo config --section reward --yaml  # one section, as a YAML config file

The help is each field's docstring in dapo/config/schema.py, read from its source.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import sys
import textwrap
import types
import typing

from dapo.cluster.run_budget import check_run_budget
from dapo.config import SECTIONS, ConfigError, DAPOConfig, flat_overrides, parse_assignments, read_config_file


@functools.cache
def field_help(section: type) -> dict[str, str]:
    """The docstring under each field of a section class (what `help()` cannot show)."""
    (definition,) = ast.parse(textwrap.dedent(inspect.getsource(section))).body
    assert isinstance(definition, ast.ClassDef)
    body = definition.body
    docs = {}
    for node, following in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(following.value.value)
    return docs


def type_name(annotation: object) -> str:
    """A field's type as a reader writes it: int, float | None, one of "vllm" | "hf"."""
    if typing.get_origin(annotation) is typing.Literal:
        return " | ".join(repr(v) for v in typing.get_args(annotation))
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(annotation))
    return "None" if annotation is type(None) else getattr(annotation, "__name__", str(annotation))


def describe(config: DAPOConfig, sections: list[str]) -> str:
    """The sections' fields: `section.field: type = value`, then the help, indented."""
    hints = typing.get_type_hints(DAPOConfig)
    lines = []
    for name in sections:
        section = SECTIONS[name]
        lines += [f"[{name}] {inspect.cleandoc(section.__doc__ or '')}", ""]
        helps = field_help(section)
        for f in dataclasses.fields(section):
            lines.append(f"  {name}.{f.name}: {type_name(hints[f.name])} = {getattr(config, f.name)!r}")
            lines += [
                textwrap.indent(textwrap.fill(para, 88), "      ")
                for para in helps.get(f.name, "").split("\n\n")
                if para
            ]
        lines.append("")
    return "\n".join(lines)


def as_yaml(config: DAPOConfig, sections: list[str]) -> str:
    """The sections' values as a YAML config file (dapo_loop --config_file)."""
    import yaml

    values = {name: {f.name: getattr(config, f.name) for f in dataclasses.fields(SECTIONS[name])} for name in sections}
    return yaml.safe_dump(values, sort_keys=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dapo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser("config", help="list the config's fields, by section, with their values and help")
    show.add_argument("--preset", default="tiny_cpu", help="the preset whose values are shown (default: tiny_cpu)")
    show.add_argument("--config_file", default="", help="a YAML config file applied over the preset")
    show.add_argument(
        "--set", default="", help="dotted assignments applied last: 'algorithm.clip_high=0.2 trainer.lr=1e-6'"
    )
    show.add_argument("--section", action="append", choices=list(SECTIONS), help="only these sections (repeatable)")
    show.add_argument("--yaml", action="store_true", help="print the values as a YAML config file, without help")
    show.add_argument("--presets", action="store_true", help="list the presets and what each is for")
    args = parser.parse_args(argv)
    if args.presets:
        for name, factory in DAPOConfig.preset_factories().items():
            print(f"{name}\n{textwrap.indent(inspect.cleandoc(factory.__doc__ or ''), '    ')}\n")
        return 0
    try:
        overrides = {
            **flat_overrides(read_config_file(args.config_file) if args.config_file else {}),
            **flat_overrides(parse_assignments(args.set)),
        }
        config = DAPOConfig.preset(args.preset, overrides)
        check_run_budget(config)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    sections = args.section or list(SECTIONS)
    print(as_yaml(config, sections) if args.yaml else describe(config, sections), end="")
    return 0
