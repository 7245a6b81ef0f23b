"""The docs say what the code does. Every `--key` flag and config key written in README.md, docs/*.md,
configs/**/*.yaml and notebooks/*.ipynb is one the real parser takes, every class path there imports, every
repository path, test and section they name exists, and no config or notebook types a measured figure (the figures of
README.md and docs/ stand in markers that name their machine: benchmarks/pages.py, tests/test_figures.py). Each
check is a function of the text, shown a planted mistake at the end of this file."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import json
import re
from functools import cache
from pathlib import Path

import pytest

from benchmarks import pages
from benchmarks import records as on_disk
from tests.helpers import ROOT
from tests.test_architecture import allowed_arrows

OURS = ("core", "datamodules", "lightning_modules", "training", "deploy", "imgcls", "benchmarks", "tests")
LIBRARIES = ("torch", "torchvision", "lightning", "timm")  # whose classes the configs name by class_path
FOLDERS = (*OURS, "configs", "notebooks", "docs")
# The user's own module of an example (`my_nets.SmallGeMNet`, `my_nets.py`): its classes are tests/user_plugins.py's.
USER_MODULE = "my_"
PLUGINS = "tests.user_plugins"

DOTTED_FLAG = re.compile(r"(?<![\w-])--([A-Za-z_]\w*(?:\.\w+)+)")
PLAIN_FLAG = re.compile(r"(?<![\w-])--([A-Za-z_][\w-]*)(?![\w.])")
COMMAND = re.compile(r"\bimgcls\s+([a-z][\w-]*)")
ROOTS = "|".join((*OURS, *LIBRARIES, USER_MODULE + r"\w+"))
NAME = re.compile(rf"(?<![\w./-])((?:{ROOTS})(?:\.\w+)+)")
CLASS_PATH = re.compile(r"class_path[:= ]\s*(\w+(?:\.\w+)+)")
FILE_SUFFIX = re.compile(r"\.(py|yaml|ipynb|json|md|csv|ckpt|pth|pt|pt2|onnx|safetensors)$")
KEY = re.compile(r"(?<![\w./-])((?:trainer|model|data|freeze)(?:\.\w+)+)")  # data.sampler, model.recipe.lr_scaling
IN_FOLDER = "|".join(FOLDERS)
PATH = re.compile(rf"(?<![\w./<-])((?:{IN_FOLDER})/[\w./*<>-]*[\w*>])")
FILE_NAME = re.compile(r"(?<![\w./<-])(?<!timm )(?<!timm's )(\w+\.py)\b")  # timm's train.py is timm's, not ours
PLACED = re.compile(rf"(?<![\w./<-])((?:{IN_FOLDER})/[\w./-]*\.py)(?::\s*|::)([A-Za-z_]\w*(?:\.\w+)?)")
TEST_NAME = re.compile(r"(?<![\w./])(test_\w+)(?![\w.])")
SECTION_REF = re.compile(r"((?:docs/)?[A-Z_]+\.md)(?:,\s*|\s*\(|\s+)\"([^\"\n]+)\"")  # PERFORMANCE.md, "Start scan"
LINK = re.compile(r"\]\(([^)#:]+)(?:#[^)]*)?\)")
CODE_SPAN = re.compile(r"`[^`\n]*`")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def sources() -> dict[str, str]:
    """Repository-relative name -> text, for every file whose words this test holds to the code; a notebook is its
    cells' sources, each code cell as a code block."""
    found = {"README.md": (ROOT / "README.md").read_text()}
    found |= {f"docs/{p.name}": p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))}
    found |= {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "configs").rglob("*.yaml"))}
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = [("{}" if c["cell_type"] == "markdown" else "```python\n{}\n```").format("".join(c["source"]))
                 for c in json.loads(path.read_text())["cells"]]
        found[str(path.relative_to(ROOT))] = "\n\n".join(cells)
    return found


def prose(text: str, name: str) -> str:
    """What a text says in words: a document without its code blocks, a config's comments."""
    if name.endswith(".yaml"):
        return "\n".join(line.partition("#")[2] for line in text.splitlines())
    return FENCE.sub("", text)


def lines(text: str) -> list[str]:
    """The text's lines, a shell command continued with a backslash joined into one."""
    return re.sub(r"\\\n\s*", " ", text).splitlines()


def code(text: str) -> list[str]:
    """The commands of a text, one a line: its code spans, the lines of its code blocks, and a config's comment lines
    that show a command (`#   imgcls fit --config ...`)."""
    blocks = [line for block in FENCE.findall(text) for line in lines(block)]
    shown = re.findall(r"^\s*#\s+((?:imgcls|python|torchrun)\b.*)$", text, re.M)
    return [span.strip("`") for span in CODE_SPAN.findall(FENCE.sub("", text))] + blocks + shown


def flags(text: str) -> set[tuple[str | None, str]]:
    """(command, key) of each flag: a dotted key (`--trainer.max_epochs`), anywhere, with command None, since every
    command of LightningCLI takes it; a plain one (`--ckpt_path`) in a command whose `imgcls COMMAND` comes before it
    (in prose a plain flag may be anyone's)."""
    found = {(None, key) for line in lines(text) for key in DOTTED_FLAG.findall(line)}
    for line in code(text):
        commands = [(m.end(), m.group(1)) for m in COMMAND.finditer(line)]
        for match in PLAIN_FLAG.finditer(line):
            before = [name for end, name in commands if end <= match.start()]
            if before:
                found.add((before[-1], match.group(1)))
    return found


def class_paths(text: str, name: str) -> set[str]:
    """Dotted names of our packages anywhere, of the libraries after `class_path` and in code (in a config,
    anywhere): each should import."""
    spans = " ".join(CODE_SPAN.findall(text) + FENCE.findall(text)) if not name.endswith(".yaml") else text
    found = set(CLASS_PATH.findall(text)) | set(NAME.findall(spans))
    found |= {n for n in NAME.findall(text) if n.split(".")[0] in OURS}
    return {n for n in found if not FILE_SUFFIX.search(n)}


def repository_paths(text: str) -> set[str]:
    """Paths of this repository a text names (`training/resume/exact.py`, `configs/loggers/*.yaml`, with `<name>`
    placeholders read as globs), and bare file names (`exact.py`)."""
    return {p.rstrip(".") for p in PATH.findall(text)} | set(FILE_NAME.findall(text))


@cache
def file_names() -> frozenset[str]:
    return frozenset(p.name for folder in FOLDERS for p in (ROOT / folder).rglob("*") if p.is_file())


def missing_paths(text: str, root: Path = ROOT) -> list[str]:
    """The paths a text names that do not exist under `root` (a glob matching nothing counts as missing), and the
    bare module names (`exact.py`) no file of the repository has; the user's own example files excepted."""
    missing = []
    for path in sorted(repository_paths(text)):
        if "/" not in path:
            if path not in file_names() and not path.startswith(USER_MODULE):
                missing.append(path)
        elif not any(root.glob(re.sub(r"<[^>]*>", "*", path).rstrip("/"))):
            missing.append(path)
    return missing


def misplaced_names(text: str, root: Path = ROOT) -> list[str]:
    """`PATH: Name` and `PATH::name` (`training/resume/exact.py: ExactResume`) where the file defines no such class,
    function or module-level name."""
    wrong = []
    for path, name in set(PLACED.findall(text)):
        file = root / path
        top = name.split(".")[0]
        if file.is_file() and not re.search(rf"^\s*(class|def|async def) {top}\b|^{top}\b.*=", file.read_text(), re.M):
            wrong.append(f"{path}: {name}")
    return sorted(wrong)


def missing_sections(text: str, root: Path = ROOT) -> list[str]:
    """References to a page's section by its title (`docs/PERFORMANCE.md, "Start scan"`) where that page has no
    heading that begins so."""
    wrong = []
    for page, title in sorted(set(SECTION_REF.findall(text))):
        path = root / (page if page == "README.md" else f"docs/{page.removeprefix('docs/')}")
        headings = re.findall(r"^#+ (.*)$", path.read_text(), re.M) if path.is_file() else []
        if not any(h.startswith(title) or h.split(": ", 1)[-1].startswith(title) for h in headings):
            wrong.append(f'{page}, "{title}"')
    return wrong


def picture_errors(text: str, arrows: dict[str, set[str]]) -> list[str]:
    """Where the picture under "Rooms and arrows" disagrees with the table (`arrows`: room -> the rooms it may import):
    a room drawn twice, drawn but not in the table or in the table but not drawn, and an arrow of the table that does
    not point to a lower row of the picture. A remark in parentheses (`training (trainer.py)`) is no room."""
    picture = FENCE.search(text[text.index("## Rooms and arrows"):]).group(0).splitlines()[1:-1]
    row: dict[str, int] = {}
    wrong = []
    for number, line in enumerate(picture):
        for room in re.findall(r"[\w.]+", re.sub(r"\([^)]*\)", "", line)):
            wrong += [f"{room} is drawn twice"] if room in row else []
            row[room] = number
    wrong += [f"{room} is drawn but not in the table" for room in row if room not in arrows]
    wrong += [f"{room} is in the table but not drawn" for room in arrows if room not in row]
    wrong += [f"{room} may import {target}, which is not drawn below it" for room, targets in arrows.items()
              for target in sorted(targets) if room in row and target in row and row[target] <= row[room]]
    return wrong


def broken_links(text: str, folder: Path) -> list[str]:
    """Relative Markdown links whose target does not exist (read from the document's own folder)."""
    return [target for target in LINK.findall(text) if not target.startswith("http") and not (folder / target).exists()]


@cache
def defined_tests() -> frozenset[str]:
    return frozenset(name for path in (ROOT / "tests").glob("*.py")
                     for name in re.findall(r"def (test_\w+)", path.read_text()))


@cache
def recorded_tests() -> frozenset[str]:
    """The test functions that the stored GPU check records name: docs/PERFORMANCE.md shows what a GPU ran under the
    names the tests had then (one renamed since waits in benchmarks.cuda_tests.NOT_YET_RUN_ON_A_GPU for the next)."""
    return frozenset(re.sub(r"\[.*", "", case["test"].partition("::")[2])
                     for record in pages.load_all().get("cuda_tests", []) if on_disk.measured(record)
                     for case in record["results"]["tests"])


def unknown_tests(text: str) -> list[str]:
    """Test functions a text names (`test_` and two words or more: `test_set` is a DataModule's attribute) that no
    file of tests/ defines; a test file's own name (`test_cuda::...`) counts as known."""
    known = defined_tests()
    modules = {path.stem for path in (ROOT / "tests").glob("test_*.py")}
    return sorted({name for name in TEST_NAME.findall(text)
                   if name.count("_") >= 2 and name not in known and name not in modules})


def resolve(name: str):
    """The object a dotted name names: the longest importable module, then attributes; the user's own module of an
    example (`my_nets.SmallGeMNet`) is tests/user_plugins.py. Raises ImportError or AttributeError."""
    if name.startswith(USER_MODULE):
        return getattr(importlib.import_module(PLUGINS), name.split(".")[-1])
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as err:
            if err.name is None or not ".".join(parts[:cut]).startswith(err.name):
                raise  # the module exists and an import inside it failed: the environment, not the text
            continue
        for attribute in parts[cut:]:
            found = getattr(found, attribute)
        return found
    raise ImportError(name)


def unimportable(names: set[str]) -> list[str]:
    """Each name that does not resolve, with the reason."""
    wrong = []
    for name in sorted(names):
        try:
            resolve(name)
        except (ImportError, AttributeError) as err:
            wrong.append(f"{name} ({type(err).__name__}: {err})")
    return wrong


# The configs a flag may be written for: the shipped stacks, and the quickstart with each other data source.
CONTEXTS = (
    ("--config", "configs/quickstart.yaml"),
    ("--config", "configs/imagenet_ddp8.yaml"),
    ("--config", "configs/imagenet_ddp8.yaml", "--config", "configs/fsdp.yaml"),
    *(("--config", "configs/quickstart.yaml", "--data.class_path", source) for source in
      ("datamodules.CsvDataModule", "datamodules.HFDataModule", "datamodules.ShardsDataModule",
       f"{PLUGINS}.TensorData")),
)


class _Parsed(Exception):
    """Raised in place of LightningCLI's parse: the parser is built, nothing is parsed or instantiated."""


@cache
def parser():
    """The parser of the `imgcls` command with its four subcommands (a command line without one builds them all),
    built by the real ImgclsCLI, which stops where it would parse."""
    from training.cli import app

    class ParserOnly(app.ImgclsCLI):
        def parse_arguments(self, parser, args) -> None:
            raise _Parsed(parser)

    real, app.ImgclsCLI = app.ImgclsCLI, ParserOnly
    try:
        app.cli_main([])
    except _Parsed as parsed:
        return parsed.args[0]
    finally:
        app.ImgclsCLI = real
    raise AssertionError("ImgclsCLI ran without parsing its arguments")


@cache
def contexts() -> tuple:
    """The full config (defaults included) of each of CONTEXTS, as `imgcls fit` parses it."""
    return tuple(parser().parse_args(["fit", *args]).fit for args in CONTEXTS)


def has_key(config, key: str) -> bool:
    """Whether `key` (`model.net.weights`) names a value of `config`, reading through each `init_args` of a
    class_path as the command line does (`model.net.init_args.weights`)."""
    from jsonargparse import Namespace

    node = config
    for part in key.split("."):
        if not isinstance(node, Namespace):
            return False
        if part in node:
            node = node[part]
        elif "init_args" in node and isinstance(node["init_args"], Namespace) and part in node["init_args"]:
            node = node["init_args"][part]
        else:
            return False
    return True


@cache
def options(command: str) -> frozenset[str]:
    """The option strings `imgcls COMMAND --help` lists (none for a command imgcls does not have)."""
    from imgcls.commands import EXTRA_COMMANDS, main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        if command in EXTRA_COMMANDS:
            main([command, "--help"])
        elif command in ("fit", "validate", "test", "predict"):
            parser().parse_args([command, "--help"])
    return frozenset(re.findall(r"(?<![\w-])--([\w.-]+)", out.getvalue()))


def unknown_flags(found: set[tuple[str | None, str]]) -> list[str]:
    """The flags no command takes: a dotted key that names no value of any parsed context and that `imgcls fit
    --help` does not list; a plain one its command's --help does not list."""
    wrong = []
    for command, key in sorted(found, key=lambda f: (f[0] or "", f[1])):
        if command is None:
            if not any(has_key(config, key) for config in contexts()) and key not in options("fit"):
                wrong.append(f"--{key}")
        elif key not in options(command):
            wrong.append(f"imgcls {command} --{key}")
    return wrong


def keys(text: str, name: str) -> set[str]:
    """The config keys a text's words name (`data.sampler`, `model.recipe.lr_scaling`)."""
    return {key for key in KEY.findall(prose(text, name)) if not FILE_SUFFIX.search(key)}


def unknown_keys(found: set[str]) -> list[str]:
    """The keys that name no value of any parsed context, nor an attribute or argument of the Trainer or the model
    they speak of (`trainer.estimated_stepping_batches`, the linked `model.input_contract`)."""
    from lightning_modules import ImageClassifier
    from training.trainer import Trainer

    owners = {"trainer": Trainer, "model": ImageClassifier}
    wrong = []
    for key in sorted(found):
        root, _, name = key.partition(".")
        owner = owners.get(root)
        if any(has_key(config, key) for config in contexts()):
            continue
        if owner is not None and (hasattr(owner, name) or name in inspect.signature(owner).parameters):
            continue
        wrong.append(key)
    return wrong


TEXTS = sources()
README_MAX_LINES = 250  # the researcher's path: issue 31
DESIGN_MAX_LINES = 250  # the picture and the decisions a newcomer needs: issue 48


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_every_flag_and_key_a_text_writes_is_one_the_parser_takes(name):
    text = TEXTS[name]
    assert not unknown_flags(flags(text)), f"{name}: no command takes {unknown_flags(flags(text))}"
    assert not unknown_keys(keys(text, name)), f"{name}: no config has {unknown_keys(keys(text, name))}"


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_every_class_path_a_text_names_imports(name):
    wrong = unimportable(class_paths(TEXTS[name], name))
    assert not wrong, f"{name} names what does not import:\n" + "\n".join(wrong)


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_every_file_test_and_section_a_text_names_exists(name):
    text, folder = TEXTS[name], (ROOT / name).parent
    assert not missing_paths(text), f"{name}: no such file in the repository: {missing_paths(text)}"
    assert not misplaced_names(text), f"{name}: the file does not define it: {misplaced_names(text)}"
    unknown = [test for test in unknown_tests(text) if name != "docs/PERFORMANCE.md" or test not in recorded_tests()]
    assert not unknown, f"{name}: no such test in tests/: {unknown}"
    assert not broken_links(text, folder), f"{name}: links to nothing: {broken_links(text, folder)}"
    assert not missing_sections(text), f"{name}: no such section: {missing_sections(text)}"


@pytest.mark.parametrize("name", sorted(n for n in TEXTS if not n.endswith(".md")))
def test_configs_and_notebooks_type_no_measured_figure(name):
    """Markers are rendered in README.md and docs/ only (tests/test_figures.py holds those): a config's comments and a
    notebook's prose say where a figure is measured, never the figure."""
    assert not pages.unmarked(TEXTS[name]), f"{name}: {pages.unmarked(TEXTS[name])}"


def test_the_readme_is_one_path_of_at_most_250_lines():
    readme = TEXTS["README.md"]
    assert len(readme.splitlines()) <= README_MAX_LINES
    headings = re.findall(r"^## (\d)\. ", readme, re.M)
    assert headings == [str(i) for i in range(1, 9)], headings


def test_the_design_is_the_picture_and_the_decisions_in_at_most_250_lines():
    design = TEXTS["docs/DESIGN.md"]
    assert len(design.splitlines()) <= DESIGN_MAX_LINES, "docs/DESIGN.md: point to a module's docstring instead"
    assert not picture_errors(design, allowed_arrows()), picture_errors(design, allowed_arrows())


def test_commands_are_written_one_way_for_an_activated_venv():
    """README.md says `source .venv/bin/activate` once; every page then writes `imgcls ...`, `pytest ...`."""
    written = {name: re.findall(r"\.venv/bin/\w+", text) for name, text in TEXTS.items() if name.endswith(".md")}
    assert written.pop("README.md") == [".venv/bin/activate"]
    assert not any(written.values()), {name: found for name, found in written.items() if found}


# Each checker, shown a planted mistake beside its correct twin: the checks above can fail.

def test_the_flag_and_key_checks_refuse_what_no_parser_takes():
    text = ("imgcls fit --trainer.max_epochz 3 --model.net.weightz x --data.images 4 --model.net.weights x\n"
            "`imgcls serve M --portz 1` and `imgcls serve M --port 1`; in prose --anything goes")
    assert unknown_flags(flags(text)) == ["--model.net.weightz", "--trainer.max_epochz", "imgcls serve --portz"]
    named = ("| image folder (data.format folder) | `data.sampler: balanced`, `trainer.estimated_stepping_batches`, "
             "`model.input_contract`, `model.criterion`\n```python\nmodel.criterion = loss  # code, not words\n```")
    assert unknown_keys(keys(named, "X.md")) == ["data.format", "model.criterion"]
    assert unknown_keys(keys("  dropout: 0.2  # float; see model.net.dropoutz", "x.yaml")) == ["model.net.dropoutz"]


def test_the_class_path_check_refuses_a_name_that_does_not_import():
    text = ("class_path: my_nets.NoSuchNet\n`training.resume.faults.ExactResume`, `training.resume.ExactResume`, "
            "class_path: my_nets.SmallGeMNet, `torch.optim.AdamW`")
    assert [w.split(" ")[0] for w in unimportable(class_paths(text, "X.md"))] == [
        "my_nets.NoSuchNet", "training.resume.faults.ExactResume"]


def test_the_path_checks_refuse_what_the_repository_does_not_hold():
    text = ("`training/resume/nope.py`, `training/resume/exact.py`, `benchmarks/results/distributed.json`, "
            "`benchmarks/results/machines/<machine>/*.json`, `checkpointing.py`, `exact.py`, `my_nets.py`, "
            "timm's train.py, train.py")
    assert missing_paths(text) == ["benchmarks/results/distributed.json", "checkpointing.py", "train.py",
                                   "training/resume/nope.py"]
    assert misplaced_names("`training/resume/faults.py: ExactResume`, `training/resume/exact.py: ExactResume`, "
                           "`tests/test_docs.py::test_no_such`") == [
        "tests/test_docs.py: test_no_such", "training/resume/faults.py: ExactResume"]
    named = ("`test_no_such_test_here`, `test_set`, `test_cuda::x`, "
             "`test_the_path_checks_refuse_what_the_repository_does_not_hold`")
    assert unknown_tests(named) == ["test_no_such_test_here"]
    assert broken_links("[a](examples/slurm.sbatch) [b](examples/nope.sh) [c](https://x.org)", ROOT / "docs") == [
        "examples/nope.sh"]
    assert missing_sections('docs/PERFORMANCE.md, "Start scan"; docs/PERFORMANCE.md ("No such section")') == [
        'docs/PERFORMANCE.md, "No such section"']


def test_the_picture_check_refuses_a_picture_the_table_does_not_draw():
    arrows = {"core": set(), "data": {"core"}, "model": {"core"}, "cli": {"data", "model", "core"}}
    drawn = "## Rooms and arrows\n\n```\n   cli (the command)\n data   model\n   core\n```\n"
    assert picture_errors(drawn, arrows) == []
    upside_down = drawn.replace(" data   model\n   core", "   core\n data   model")
    assert picture_errors(upside_down, arrows) == ["data may import core, which is not drawn below it",
                                                   "model may import core, which is not drawn below it"]
    beside = drawn.replace(" data   model", " data   model   cli   serve")
    assert picture_errors(beside, arrows) == ["cli is drawn twice", "serve is drawn but not in the table",
                                              "cli may import data, which is not drawn below it",
                                              "cli may import model, which is not drawn below it"]
    assert picture_errors(drawn.replace("model", "(model)"), arrows) == ["model is in the table but not drawn"]
