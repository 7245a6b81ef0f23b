"""Config value types shared by the DataModule and the model, and one check of a constructor's arguments against them.

The types are jsonargparse's restricted numbers, so the CLI rejects a bad value while parsing and `--help` shows each
key's range; `check_arguments` applies the same annotations to Python callers (tests, notebooks), with one message.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal

from jsonargparse.typing import (
    ClosedUnitInterval,
    NonNegativeFloat,
    NonNegativeInt,
    OpenUnitInterval,
    PositiveFloat,
    PositiveInt,
    restricted_number_type,
)

UnitIntervalRightOpen = restricted_number_type("UnitIntervalRightOpen", float, [(">=", 0), ("<", 1)],
                                               docstring="float in [0, 1)")
ImageSide = restricted_number_type("ImageSide", int, (">=", 32), docstring="int >= 32")

# What each type's error says after `key=value`.
RULES: dict[type, str] = {
    PositiveInt: "must be at least 1",
    PositiveFloat: "must be positive",
    NonNegativeInt: "must be >= 0",
    NonNegativeFloat: "must be >= 0",
    ClosedUnitInterval: "must be in [0, 1]",
    OpenUnitInterval: "must be between 0 and 1",
    UnitIntervalRightOpen: "must be in [0, 1)",
    ImageSide: "is below 32, too small for a ResNet (5 stride-2 stages)",
}
__all__ = ["ClosedUnitInterval", "ImageSide", "NonNegativeFloat", "NonNegativeInt", "OpenUnitInterval", "PositiveFloat",
           "PositiveInt", "UnitIntervalRightOpen", "RULES", "check_arguments", "instantiate"]


def check_arguments(prefix: str, function: Callable, values: dict[str, Any]) -> None:
    """Raise ValueError naming `prefix.key` for the first value in `values` that its annotation in `function`
    refuses: a restricted number out of range, or a value outside a Literal. Other annotations are not checked."""
    hints = typing.get_type_hints(function)
    for key, value in values.items():
        members = _members(hints.get(key, Any))
        if any(_accepts(member, value) for member in members):
            continue
        rules = [RULES[m] for m in members if m in RULES]
        if rules:
            null = ", or null" if type(None) in members else ""
            raise ValueError(f"{prefix}.{key}={value!r} {rules[0]}{null}")
        raise ValueError(f"{prefix}.{key}={value!r} is unknown; choose {_choices(members)}")


def instantiate(kind: Any, config: Mapping) -> Any:
    """The object of a class_path and init_args config (nested ones too) of type `kind`, as LightningCLI's parser
    builds it from a config file: the same rules, the same defaults."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--value", type=kind)
    return parser.instantiate(parser.parse_object({"value": dict(config)})).value


def _members(annotation: Any) -> tuple:
    """The alternatives of a union annotation (`NonNegativeInt | None` -> (NonNegativeInt, NoneType))."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return tuple(m for arg in typing.get_args(annotation) for m in _members(arg))
    return (annotation,)


def _accepts(member: Any, value: Any) -> bool:
    if typing.get_origin(member) is Literal:
        return value in typing.get_args(member)
    if member in RULES:
        try:
            member(value)
        except (TypeError, ValueError):
            return False
        return True
    if member is type(None):
        return value is None
    if member is bool:
        return isinstance(value, bool)
    return True  # not a type this check knows: jsonargparse checks it on the command line


def _choices(members: tuple) -> str:
    names: list[str] = []
    for member in members:
        if member is bool:
            names += ["true", "false"]
        elif member is type(None):
            names.append("null")
        elif typing.get_origin(member) is Literal:
            names += [str(arg) for arg in typing.get_args(member)]
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else "".join(names)
