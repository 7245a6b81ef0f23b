"""The command line of every `imgcls` command that is not a Trainer's (sweep, serve, export, publish, report,
prepare-data, demo-data), in the style of fit's LightningCLI: a settings dataclass of the command, one field per option
with a one-line docstring (litgpt's habit), makes its parser. So each command takes `--config FILE` (its settings in
YAML), `--print_config` (the YAML such a file holds) and `--help` (each option with its type and default), and a parse
error is one line (core/parse_errors.py).

    @dataclass
    class ReportSettings:
        run_dir: str
        \"\"\"a run directory\"\"\"
        _: KW_ONLY
        out: str | None = None
        \"\"\"output folder\"\"\"

    settings = parse_settings(ReportSettings, argv, prog="imgcls report", description=__doc__)

A field before `KW_ONLY` without a default is positional (`imgcls report RUN_DIR`), one after it without a default a
required option (`--ckpt_path`); the rest are options with their defaults.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import TypeVar

from jsonargparse import ActionConfigFile, set_parsing_settings

from core.parse_errors import OneLineErrorParser

Settings = TypeVar("Settings")


class CommandParser(OneLineErrorParser):
    """A command's parser. A bool option is a switch: `--overwrite` alone turns it on, as argparse's store_true did,
    and `--overwrite false` (fit's way) is understood too."""

    def add_argument(self, *args, **kwargs):
        if kwargs.get("type") is bool and args and args[0].startswith("--"):
            kwargs.setdefault("nargs", "?")
            kwargs.setdefault("const", True)
        return super().add_argument(*args, **kwargs)


def command_parser(settings: type, *, prog: str, description: str) -> CommandParser:
    """The parser of a command whose options are the fields of the dataclass `settings`, with `--config` and
    `--print_config`; `description`, the command's module docstring, heads its --help with its first paragraph."""
    # --help shows each field's docstring, which jsonargparse reads from the class's source when the parser is built.
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    try:
        parser = CommandParser(prog=prog, description=description.split("\n\n")[0])
        parser.add_argument("--config", action=ActionConfigFile,
                            help="a YAML file of these settings (`--print_config` writes one); options after it win")
        parser.add_class_arguments(settings, as_positional=True, as_group=False)
    finally:
        set_parsing_settings(docstring_parse_attribute_docstrings=False)  # jsonargparse's default, for other parsers
    return parser


def parse_settings(settings: type[Settings], argv: Sequence[str] | None, *, prog: str, description: str) -> Settings:
    """`settings` as the command line `argv` (None: sys.argv) and the `--config` files it names give them; a parse
    error exits 2 with one line, `--help` and `--print_config` exit 0."""
    parser = command_parser(settings, prog=prog, description=description)
    config = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    return settings(**{field.name: config[field.name] for field in dataclasses.fields(settings) if field.init})
