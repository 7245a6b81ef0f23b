"""Every parse error of `imgcls` in one line that names the key and the fix, not a page of usage: of LightningCLI's
parser (fit, validate, test, predict: training/cli/app.py) and of every other command's (core/command_line.py).

jsonargparse hands its errors over as text only (its structured `error_handler` is deprecated since 4.20 in favour of
argparse's `exit_on_error`), so the hook is argparse's documented one: the parser's `error` method, on the parser class
of every command (LightningCLI takes it as `parser_class`). The rewriting reads the message jsonargparse writes, one
pattern per kind: a value out of its range or choices (worded as `core.config_types.check_arguments` words it:
`data.image_size=16 is below 32`), a value of the wrong type, a key nobody takes (with the closest ones), a misspelt
class, and a value given to a class chosen by class_path (with its key in full)."""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
import sys

from jsonargparse import ArgumentParser

from core.config_types import RULES

_RULE_BY_NAME = {kind.__name__: rule for kind, rule in RULES.items()}
# A value of the wrong type: what it should have been, by the name jsonargparse gives its type.
_KINDS = {"int": "an int", "float": "a number", "bool": "true or false", "str": "a string", "NoneType": "null"}
_KINDS |= {kind.__name__: _KINDS["int" if issubclass(kind, int) else "float"] for kind in RULES}  # PositiveInt: an int


class OneLineErrorParser(ArgumentParser):
    """jsonargparse's parser, whose errors are one line on stderr (exit 2) ending with where `--help` is."""

    def error(self, message: str, ex: Exception | None = None):
        parser = getattr(ex, "subcommand_parser", None) or self
        message = one_line_error(message, parser)
        if not self.exit_on_error:  # jsonargparse trying an alternative: it catches this
            super().error(message, ex)
        command = " ".join(["imgcls", *parser.prog.replace(" [options]", "").split()[1:]])
        print(f"imgcls: error: {message} (`{command} --help` lists every option)", file=sys.stderr)
        sys.exit(2)


def one_line_error(message: str, parser: ArgumentParser) -> str:
    """Any of jsonargparse's parse errors as one line: an unknown key its closest ones, a misspelt class its closest
    ones, a value given to a class chosen by class_path its full key, a value out of range its rule."""
    if message.startswith("unrecognized arguments:"):  # on the command line
        keys = [t.split("=")[0].lstrip("-") for t in message.split(":", 1)[1].split() if t.startswith("--")]
        return "; ".join(unknown_key_message(key, parser_keys(parser)) for key in keys) or message
    in_file = re.match(r"(Group|Subcommand) '([\w.]+)' does not accept option '([\w.]+)'", message)  # a config's
    if in_file:
        return unknown_key_message(in_file[3] if in_file[1] == "Subcommand" else f"{in_file[2]}.{in_file[3]}",
                                   parser_keys(parser))
    # A config's, of a command without groups; the same words from a class's parser tried inside another are left
    # for class_path_error to read.
    in_file = re.fullmatch(r"Option '([\w.]+)' is not accepted", message)
    if in_file and parser.exit_on_error:
        return f"{unknown_key_message(in_file[1], parser_keys(parser))} (in a --config file)"
    if "has no attribute" in message and (misspelt := class_path_error(message)):
        return misspelt
    worded = callable_error_message(plain_parser_error(message))
    for_class = subclass_error_message(worded)
    if for_class != worded:
        return for_class
    return class_path_error(message) or worded


def unknown_key_message(key: str, known: list[str], prefix: str = "") -> str:
    """`--model.lrr is not an option; did you mean --model.lr?` (`prefix`: the section the keys in `known` are in)."""
    close = difflib.get_close_matches(key.removeprefix(prefix), known, n=3, cutoff=0.6)
    return f"--{key} is not an option" + (f"; did you mean {', '.join(f'--{prefix}{c}' for c in close)}?"
                                           if close else "")


def parser_keys(parser: ArgumentParser) -> list[str]:
    """The keys `parser` takes (for a class, those of its parents' too); none when they cannot be listed."""
    try:
        return [k for k in parser.get_defaults().keys() if not k.startswith("__")]
    except Exception:  # noqa: BLE001 - only a hint: the message stands without it
        return []


def class_keys(class_path: str) -> list[str]:
    """The arguments `class_path` takes, as the parser reads them."""
    module, _, name = class_path.rpartition(".")
    try:
        parser = ArgumentParser(exit_on_error=False)
        parser.add_class_arguments(getattr(importlib.import_module(module), name))
    except Exception:  # noqa: BLE001 - only a hint: the message stands without it
        return []
    return parser_keys(parser)


def plain_parser_error(message: str) -> str:
    """A value out of its type's range or choices ('Parser key "model.lr": ... Not of type PositiveFloat: -0.1 does
    not conform to restriction v>0') as `check_arguments` words it ('model.lr=-0.1 must be positive'), a choice
    not in a long Literal (model.net.arch) with the closest names instead of all of them, and a value of the wrong
    type ("port='x' is not an int")."""
    key = re.match(r'Parser key "([^"]+)":', message)
    # A restricted number given a word (data.batch_size x): jsonargparse says only what int() or float() said.
    not_number = re.search(r"Not of type \w+: (?:invalid literal for (int)\(\) with base 10|could not convert string "
                           r"to (float)): (.*)$", message, re.MULTILINE)
    value = re.search(r"Not of type \w+: (\S+) does not conform|(?:Given|Got) value: (.*)$", message, re.MULTILINE)
    if key is not None and not_number is not None and value is None:
        return f"{key.group(1)}={not_number.group(3)} is not {_KINDS[not_number.group(1) or not_number.group(2)]}"
    if key is None or value is None:
        return message
    key, value = key.group(1), value.group(1) or value.group(2)
    shown = value if re.fullmatch(r"[-+.\deE]+", value) else repr(value)
    kinds = expected_kinds(message)
    if not_number is not None and kinds is not None:  # one of a union's types (serve's devices: an int or auto)
        return f"{key}={shown} is not {' or '.join(kinds)}"
    rules = [rule for name, rule in _RULE_BY_NAME.items() if f"Not of type {name}:" in message]
    if rules:
        return f"{key}={shown} {rules[0]}" + (", or null" if "NoneType" in message else "")
    literal = re.search(r"typing\.Literal\[([^\]]*)\]", message)
    # A Literal (or a Literal or null) keeps the hint of its closest names; one with a plain type beside it is worded
    # by its kinds (`devices='x' is not an int or auto`).
    if kinds is not None and (literal is None or any(k in _KINDS.values() and k != "null" for k in kinds)):
        return f"{key}={shown} is not {' or '.join(kinds)}"
    if literal is None:
        return message
    names = re.findall(r"'([^']*)'", literal.group(1))
    close = difflib.get_close_matches(value, names, n=4, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}?" if close else f"choose one of {', '.join(names)}"
    if not close and len(names) > 12:
        hint = f"choose one of the {len(names)} names that `--help` lists"
    return f"{key}={shown} is unknown; {hint}"


def expected_kinds(message: str) -> list[str] | None:
    """What a value of the wrong type should have been, in words (`an int`, `null`, a Literal's names), from
    jsonargparse's 'Expected a <class 'int'>' or its list of a Union's subtypes; None when one of them is a class
    other than the plain ones of _KINDS (a data source's union, whose error subclass_error_message words)."""
    listed = re.search(r"Subtypes: \[(.*)\]", message)
    expected = re.findall(r"Expected an? (<class '[\w.]+'>|typing\.Literal\[[^\]]*\])", message)
    text = listed.group(1) if listed else " ".join(expected)
    kind = r"<class '([\w.]+)'>|typing\.Literal\[([^\]]*)\]"
    if re.sub(kind, "", text).strip(", "):  # a type of no such word (a Callable)
        return None
    kinds = []
    for plain, literal in re.findall(kind, text):
        plain = plain.removeprefix("jsonargparse.typing.")
        if plain and plain not in _KINDS:
            return None
        kinds.append(_KINDS[plain] if plain else " or ".join(re.findall(r"'([^']*)'", literal)))
    return kinds or None


def class_path_error(message: str) -> str | None:
    """A `class_path` value that failed, as one line naming the key and the closest valid choice: a misspelt class
    (`torch.nn.CrossEntropyLos`), a value that is no class path, or an init_args key the class does not take. None
    when `message` is none of these."""
    key = re.match(r'Parser key "([^"]+)":', message)
    if key is None:
        return None
    key = key.group(1)
    given = re.search(r"Problem with given class_path '([^']+)':\s*(.*)", message)
    # A callable's class (model.optimizer): "expects a function or a callable class: Option 'x' is not accepted. Got
    # value: Namespace(class_path='torch.optim.AdamW', ...", or "...: module 'torch.optim' has no attribute 'AdamWW'".
    wrapped = re.search(r"callable class: (Option '\w+' is not accepted|module '[\w.]+' has no attribute '\w+')"
                        r"(?:\. Got value: Namespace\(.*?class_path='([^']+)')?", message)
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


def callable_error_message(message: str) -> str:
    """A value given to a class that arrives as a callable (model.net, built with num_classes), out of its range or
    choices, with the key in full: `model.net.arch='resnt50' is ...`."""
    found = re.match(r'Parser key "([\w.]+)":\s*Type .*? expects a function or a callable class: ([\w.]+=.*?)\. '
                     r"Got value: ", message, re.DOTALL)
    return f"{found[1]}.{' '.join(found[2].split())}" if found else message


def subclass_error_message(message: str) -> str:
    """A value given to a class chosen by class_path (`data`), which jsonargparse reports as a page listing the
    union's members: the key in full (`data.image_size=16 is below 32`), or a key the class does not take with the
    closest ones it does."""
    found = re.match(r'Parser key "([\w.]+)":.*?Problem with given class_path \'([\w.]+)\':\s*\n(.*?)\n\s*- ', message,
                     re.DOTALL)
    if found is None:
        return message
    section, class_path, inner = found[1], found[2], " ".join(found[3].split())
    unknown = re.match(r"Option '([\w.]+)' is not accepted", inner)
    if unknown:
        hint = unknown_key_message(f"{section}.{unknown[1]}", class_keys(class_path), prefix=f"{section}.")
        return f"{hint} ({section}.class_path: {class_path})"
    if re.match(r"--[\w.]+ is not an option", inner):  # a nested class's key (data.train_transform), worded
        return re.sub(r"\((?=[\w.]+\.class_path:)", f"({section}.", re.sub(r"--(?=\w)", f"--{section}.", inner))
    if re.match(r"[\w.]+=", inner):  # a value out of range, already worded by plain_parser_error
        return f"{section}.{inner}"
    nested = re.match(r'Parser key "([\w.]+)": (.*)', inner)
    if nested:
        return f"{section}.{nested[1]}: {nested[2]}"
    return f"{section}.class_path={class_path}: {inner}"
