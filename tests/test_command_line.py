"""Every `imgcls` command besides the Trainer's four is parsed by jsonargparse from a settings dataclass of its own
(core/command_line.py), as fit is by LightningCLI: `--help` with each option's type, `--config` and `--print_config`,
and a parse error in one line naming the key (exit 2). The round trips of a whole command through a printed config:
tests/test_publish_serve.py (serve) and tests/test_sweep.py (sweep)."""

from __future__ import annotations

import re
from dataclasses import KW_ONLY, dataclass

import pytest
import yaml

from core.command_line import parse_settings
from core.config_types import PositiveInt
from imgcls.commands import EXTRA_COMMANDS, main
from tests.helpers import CONFIGS, run_cli

# Positional arguments that let each command's parse reach its options.
POSITIONAL = {"demo-data": ["d"], "prepare-data": ["s", "d"], "sweep": ["f.yaml"], "report": ["r"], "export": [],
              "publish": ["d"], "serve": ["m"]}


def test_every_command_is_in_the_table_above():
    assert POSITIONAL.keys() == EXTRA_COMMANDS.keys()


def entries(help_text: str) -> dict[str, str]:
    """Each argument's entry in a --help text (`--port`, `model`) -> its words, wrapped lines joined."""
    found: dict[str, str] = {}
    name = None
    start = min(i for head in ("positional arguments:", "options:") if (i := help_text.find(head)) >= 0)
    for line in help_text[start:].splitlines():
        if re.match(r"  \S", line):
            name, _, rest = line.strip().partition(" ")
            found[name.rstrip(",")] = rest
        elif name is not None and line.startswith("   "):
            found[name] += " " + line.strip()
    return {name: " ".join(words.split()) for name, words in found.items()}


@pytest.mark.parametrize("command", sorted(EXTRA_COMMANDS))
def test_help_lists_each_option_with_its_type(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    listed = entries(capsys.readouterr().out)
    assert {"--config", "--print_config"} <= listed.keys()
    settings = {name: words for name, words in listed.items() if name not in ("-h", "--config", "--print_config")}
    assert len(settings) > len(POSITIONAL[command]), listed  # positionals and at least one option
    untyped = [name for name, words in settings.items() if not re.search(r"\((required, )?type: \S", words)]
    assert not untyped, f"imgcls {command} --help: no type for {untyped}"


def test_help_shows_the_type_range_and_default_of_serve_and_sweep_settings(capsys):
    for command in ("serve", "sweep"):
        main_exits([command, "--help"], 0)
    out = capsys.readouterr().out
    serve, sweep = (entries(part) for part in out.split("usage: imgcls sweep"))
    assert serve["model"].endswith("(required, type: str)")
    assert serve["--port"].endswith("(type: NonNegativeInt, default: 8000)")
    assert serve["--max_batch_size"].endswith("(type: PositiveInt, default: 32)")
    assert serve["--accelerator"].endswith("(type: Literal['auto', 'cpu', 'cuda'], default: auto)")
    assert sweep["sweep_file"].startswith("sweep file in the W&B sweep schema")
    assert sweep["--workers"].endswith("(type: PositiveInt, default: 1)")


def main_exits(argv: list[str], code: int) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == code


@pytest.mark.parametrize("command", sorted(EXTRA_COMMANDS))
def test_an_unknown_option_is_one_line_naming_the_closest(command, capsys):
    main_exits([command, *POSITIONAL[command], "--outt", "x"], 2)
    err = capsys.readouterr().err
    assert err.startswith("imgcls: error: --outt is not an option") and err.count("\n") == 1, err
    assert err.endswith(f"(`imgcls {command} --help` lists every option)\n")
    if command in ("sweep", "report", "export"):  # the commands with an --out
        assert "did you mean --out?" in err


@pytest.mark.parametrize(("argv", "expected"), [
    (["serve", "m", "--port", "x"], "port='x' is not an int"),
    (["serve", "m", "--port", "-1"], "port=-1 must be >= 0"),
    (["serve", "m", "--max_batch_size", "0"], "max_batch_size=0 must be at least 1"),
    (["serve", "m", "--batch_timeout", "soon"], "batch_timeout='soon' is not a number"),
    (["serve", "m", "--devices", "x"], "devices='x' is not an int or auto"),
    (["serve", "m", "--accelerator", "gpu"], "accelerator='gpu' is unknown; did you mean cpu?"),
    (["serve", "m", "--threshold", "high"], "threshold='high' is not a number or null"),
    (["sweep", "f.yaml", "--workers", "two"], "workers='two' is not an int"),
    (["sweep", "f.yaml", "--workers", "0"], "workers=0 must be at least 1"),
    (["sweep", "f.yaml", "--trials", "0"], "trials=0 must be at least 1, or null"),
    (["sweep", "f.yaml", "--heartbeat", "1.5"], "heartbeat='1.5' is not an int"),
    (["export", "--ckpt_path", "c", "--format", "tflite"], "format='tflite' is unknown; choose one of onnx, pt2"),
    (["publish", "d", "--ckpt_path", "c", "--overwrite", "maybe"], "overwrite='maybe' is not true or false"),
    (["demo-data", "d", "--size", "0"], "size=0 must be at least 1"),
    (["prepare-data", "s", "d", "--val_split", "a"], "val_split='a' is not a number"),
    (["serve"], "the following arguments are required: model"),
    (["export"], "the following arguments are required: ckpt_path"),
])
def test_a_bad_value_is_one_line_naming_the_key(argv, expected, capsys):
    main_exits(argv, 2)
    err = capsys.readouterr().err
    assert err == f"imgcls: error: {expected} (`imgcls {argv[0]} --help` lists every option)\n"


def test_a_bad_value_through_the_real_command_is_one_line_without_a_traceback():
    cases = ((["serve", "m", "--port", "x"], "port='x' is not an int"),
             (["sweep", "f.yaml", "--workerz", "2"], "--workerz is not an option; did you mean --workers?"))
    for argv, expected in cases:
        proc = run_cli(*argv, check=False)
        assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-3000:]
        assert proc.stderr.startswith(f"imgcls: error: {expected}") and proc.stderr.count("\n") == 1, proc.stderr


def test_an_unknown_key_in_a_settings_file_is_one_line_naming_the_closest(tmp_path, capsys):
    settings = tmp_path / "sweep.yaml"
    settings.write_text("sweep_file: f.yaml\nwokers: 2\n")
    main_exits(["sweep", "--config", str(settings)], 2)
    assert capsys.readouterr().err == ("imgcls: error: --wokers is not an option; did you mean --workers? (in a "
                                       "--config file) (`imgcls sweep --help` lists every option)\n")


@pytest.mark.parametrize("flag", [["--config"], ["--config="]])
def test_a_sweep_file_given_as_the_settings_file_names_the_fix(flag, capsys):
    """The W&B sweep file is the sweep's first argument; --config takes the sweep command's own settings."""
    sweep_file = str(CONFIGS / "sweeps" / "quickstart_lr.yaml")
    argv = [flag[0], sweep_file] if flag[0] == "--config" else [flag[0] + sweep_file]
    main_exits(["sweep", *argv, "--workers", "2"], 2)
    err = capsys.readouterr().err
    assert err == (f"imgcls sweep: error: {sweep_file} is a sweep file: run `imgcls sweep {sweep_file}`; --config "
                   "takes the settings of imgcls sweep itself (`imgcls sweep --print_config` shows them)\n")


# ---- the parser itself, on settings of a user's own command ------------------------------------------------------

@dataclass
class Settings:
    """A command's settings."""

    src: str
    """what to read"""
    _: KW_ONLY
    ckpt_path: str
    """a required option"""
    size: PositiveInt = 64
    """a restricted number"""
    overwrite: bool = False
    """a switch"""


def parse(argv: list[str]) -> Settings:
    return parse_settings(Settings, argv, prog="imgcls mine", description="Mine.\n\nMore.")


def test_positional_required_option_and_defaults():
    assert parse(["a", "--ckpt_path", "c"]) == Settings("a", ckpt_path="c", size=64, overwrite=False)
    assert parse(["--size", "3", "--ckpt_path", "c", "a"]) == Settings("a", ckpt_path="c", size=3, overwrite=False)


@pytest.mark.parametrize(("flags", "value"), [([], False), (["--overwrite"], True), (["--overwrite", "true"], True),
                                              (["--overwrite", "false"], False), (["--overwrite=false"], False)])
def test_a_bool_option_is_a_switch_and_takes_a_value_too(flags, value):
    assert parse(["a", "--ckpt_path", "c", *flags]).overwrite is value
    assert parse([*flags, "--ckpt_path", "c", "a"] if flags != ["--overwrite"] else
                 ["--overwrite", "--ckpt_path", "c", "a"]).overwrite is value


def test_print_config_writes_what_config_reads_back(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(["a", "--ckpt_path", "c", "--size", "7", "--overwrite", "--print_config"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert yaml.safe_load(printed) == {"src": "a", "ckpt_path": "c", "size": 7, "overwrite": True}
    (tmp_path / "mine.yaml").write_text(printed)
    assert parse(["--config", str(tmp_path / "mine.yaml")]) == Settings("a", ckpt_path="c", size=7, overwrite=True)
    # options after the file win, as in fit
    assert parse(["--config", str(tmp_path / "mine.yaml"), "--size", "9"]).size == 9


def test_help_heads_with_the_first_paragraph_and_shows_each_fields_docstring(capsys):
    with pytest.raises(SystemExit):
        parse(["--help"])
    out = capsys.readouterr().out
    assert "\nMine.\n" in out and "More." not in out
    listed = entries(out)
    assert listed["src"] == "what to read (required, type: str)"
    assert listed["--size"] == "SIZE a restricted number (type: PositiveInt, default: 64)"
