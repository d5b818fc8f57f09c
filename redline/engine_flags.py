"""Command-line flags generated from EngineConfig's fields (engine_config.py), one argument group per
option group, so every command spells and defaults an option the same way.

A field's flag is its name in kebab case (--max-num-seqs), plus one per alias (--max-batch) and its extra
spellings (--tp); booleans get --x / --no-x. A command may give a field another default for a reason of
its own (`redline generate` completes one prompt: one slot); the help text then says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable, Iterable
from typing import Any

from redline.engine_config import GROUPS, EngineConfig, Option, SpeculativeConfig, options


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def flags_of(o: Option) -> list[str]:
    """--flat, --alias..., extra spellings: max_num_seqs -> ["--max-num-seqs", "--max-batch"]."""
    return [flag(o.flat), *(flag(a) for a in o.aliases), *o.field.metadata["flags"]]


def _parser_type(o: Option) -> Callable[[str], Any]:
    parse = o.field.metadata.get("parse")
    if parse is None:
        kind = typing.get_type_hints(GROUPS[o.group])[o.field.name]
        parse = int if kind in (int, int | None) else float if kind is float else str

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from e

    convert.__name__ = getattr(parse, "__name__", "value")  # argparse names it in its errors
    return convert


QUANTIZING = ("revision", "quantization", "quantization_group_size")  # flags eval and bench skip


def add_engine_args(
    parser: argparse.ArgumentParser,
    groups: Iterable[str] = tuple(GROUPS),
    defaults: dict[str, Any] | None = None,
    skip: Iterable[str] = (),
) -> None:
    """The flags of `groups`' options; `defaults` overrides some (by flat name, with the reason in the
    help), `skip` leaves some out (a command that sets them itself)."""
    defaults, skip = defaults or {}, set(skip)
    added = []
    for group in groups:
        section = parser.add_argument_group(f"engine: {group}")
        for o in options().values():
            if o.group != group or o.flat in skip:
                continue
            default = defaults.get(o.flat, o.default)
            help = o.field.metadata["help"] + (
                "" if default in (None, False, "") else f" (default {default})"
            )
            added.append(o.flat)
            kind = typing.get_type_hints(GROUPS[o.group])[o.field.name]
            if kind in (bool, bool | None):
                action = argparse.BooleanOptionalAction
                section.add_argument(*flags_of(o), dest=o.flat, action=action, default=default, help=help)
                continue
            extra = {k: o.field.metadata[k] for k in ("choices", "metavar") if k in o.field.metadata}
            section.add_argument(
                *flags_of(o), dest=o.flat, type=_parser_type(o), default=default, help=help, **extra
            )
        if group == "speculative":
            help = (
                """vLLM's form of --draft: '{"method": "eagle3", "model": D, "num_speculative_tokens": """
                """3}' or '{"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4, """
                """"num_speculative_tokens": 3}'"""
            )
            section.add_argument("--speculative-config", default=None, metavar="JSON", help=help)
            added.append("speculative_config")
    parser.set_defaults(engine_options=tuple(added))  # what config_from_args reads back


def config_from_args(args: argparse.Namespace, **fixed: Any) -> EngineConfig:
    """The EngineConfig of parsed flags (those add_engine_args added), with `fixed` options on top."""
    given = {name: getattr(args, name) for name in args.engine_options}
    spec = given.pop("speculative_config", None)
    if spec is not None:
        speculative = {o.flat: o.default for o in options().values() if o.group == "speculative"}
        if any(given.get(name, default) != default for name, default in speculative.items()):
            raise ValueError("give the draft once: --draft (--num-draft-tokens) or --speculative-config")
        for name in speculative:
            given.pop(name, None)
        given["speculative_config"] = dataclasses.asdict(SpeculativeConfig.from_json(spec))
    return EngineConfig.create(**(given | fixed))
