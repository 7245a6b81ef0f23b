"""Config value types shared by the DataModule and the model, and one check of a constructor's arguments against them.

The types are jsonargparse's restricted numbers, so the CLI rejects a bad value while parsing and `--help` shows each
key's range; `check_arguments` applies the same annotations to Python callers (tests, notebooks), with one message.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
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
_RULE_BY_NAME = {kind.__name__: rule for kind, rule in RULES.items()}
__all__ = ["ClosedUnitInterval", "ImageSide", "NonNegativeFloat", "NonNegativeInt", "OpenUnitInterval", "PositiveFloat",
           "PositiveInt", "UnitIntervalRightOpen", "check_arguments", "instantiate", "plain_parser_error"]


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


def class_path_error(message: str) -> str | None:
    """jsonargparse's page for a `class_path` value that failed, as one line naming the key and the closest valid
    choice: a misspelt class (`torch.nn.CrossEntropyLos`), a value that is no class path, or an init_args key the
    class does not take. None when `message` is none of these."""
    key = re.match(r'Parser key "([^"]+)":', message)
    if key is None:
        return None
    key = key.group(1)
    given = re.search(r"Problem with given class_path '([^']+)':\s*(.*)", message)
    # A callable's class (model.optimizer): "expects a function or a callable class: Option 'x' is not accepted. Got
    # value: Namespace(class_path='torch.optim.AdamW', ...", or "...: module 'torch.optim' has no attribute 'AdamWW'".
    wrapped = re.search(r"callable class: (Option '\w+' is not accepted|module '[\w.]+' has no attribute '\w+')"
                        r"(?:\. Got value: Namespace\(class_path='([^']+)')?", message)
    wrapped_path = wrapped and (wrapped.group(2) or (re.search(r"Given value: (\S+)\s*$", message) or [None, None])[1])
    if given or wrapped_path:
        path, problem = (given.group(1), given.group(2).strip()) if given else (wrapped_path, wrapped.group(1))
        missing = re.match(r"module '([\w.]+)' has no attribute '(\w+)'", problem)
        if missing:
            module, name = missing.groups()
            names = [n for n in dir(importlib.import_module(module)) if not n.startswith("_")]
            close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(f'{module}.{c}' for c in close)}?" if close else ""
            return f"{key}={path}: {module} has no {name}{hint}"
        option = re.match(r"Option '(\w+)' is not accepted", problem)
        if option:
            module, _, name = path.rpartition(".")
            try:
                accepted = list(inspect.signature(getattr(importlib.import_module(module), name)).parameters)
            except (ImportError, AttributeError, TypeError, ValueError):
                accepted = []
            close = difflib.get_close_matches(option.group(1), accepted, n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(f'{key}.{c}' for c in close)}?" if close else ""
            return f"{key}.{option.group(1)}: {path} takes no argument {option.group(1)}{hint}"
        first = problem.splitlines()[0]
        if re.match(r"\w+=", first):  # an init_args value out of range, already worded: `label_smoothing=1.0 must ...`
            return f"{key}.{first}"
        return f"{key}={path}: {first}"
    plain = re.search(r"Expected a dot import path string: (\S+)", message)
    if plain:
        return f"{key}={plain.group(1)} is not a class: give a class_path (a dotted import path, e.g. torch.nn.X)"
    return None


def plain_parser_error(message: str) -> str:
    """jsonargparse's error for a value out of its type's range or choices ('Parser key "model.lr": ... Not of type
    PositiveFloat: -0.1 does not conform to restriction v>0') in the words of `check_arguments` ('model.lr=-0.1 must
    be positive'), and a choice not in a long Literal (model.net.arch) with the closest names instead of all of them."""
    key = re.match(r'Parser key "([^"]+)":', message)
    value = re.search(r"Not of type \w+: (\S+) does not conform|(?:Given|Got) value: (.*)$", message, re.MULTILINE)
    if key is None or value is None:
        return message
    key, value = key.group(1), value.group(1) or value.group(2)
    shown = value if re.fullmatch(r"[-+.\deE]+", value) else repr(value)
    rules = [rule for name, rule in _RULE_BY_NAME.items() if f"Not of type {name}:" in message]
    if rules:
        return f"{key}={shown} {rules[0]}" + (", or null" if "NoneType" in message else "")
    literal = re.search(r"typing\.Literal\[([^\]]*)\]", message)
    if literal is None:
        return message
    names = re.findall(r"'([^']*)'", literal.group(1))
    close = difflib.get_close_matches(value, names, n=4, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}?" if close else f"choose one of {', '.join(names)}"
    if not close and len(names) > 12:
        hint = f"choose one of the {len(names)} names that `--help` lists"
    return f"{key}={shown} is unknown; {hint}"


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
