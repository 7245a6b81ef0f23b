"""The folder tree is the architecture: docs/DESIGN.md's table "Rooms and arrows" says what each room may import,
and the code holds to it (every import, at module level or inside a function, and every module started by name:
`importlib.import_module`, `__import__`, `runpy.run_module`, a `python -m` command line), with no import cycle between
modules; every console script starts the room on top."""

from __future__ import annotations

import ast
import itertools
import re
import tomllib
from collections import defaultdict
from pathlib import Path

from tests.helpers import ROOT

PACKAGES = ("core", "datamodules", "lightning_modules", "training", "deploy", "imgcls", "benchmarks")
TOOLS = ("benchmarks",)  # rooms that measure the product: held to the same rules, not installed with it
# Calls that import the module a string names.
BY_NAME = {"import_module", "__import__", "run_module"}


def allowed_arrows() -> dict[str, set[str]]:
    """Room -> the rooms it may import, from DESIGN.md's table ("every room above": those listed before it)."""
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    table = text[text.index("| room | holds | may import |"):].split("\n\n")[0]
    arrows: dict[str, set[str]] = {}
    for line in table.splitlines()[2:]:
        room, _, allowed = (cell.strip() for cell in line.strip("|").split("|"))
        room = room.strip("`")
        arrows[room] = set(arrows) if allowed == "every room above" else set(re.findall(r"`([\w.]+)`", allowed))
    return arrows


def room_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "training" and len(parts) > 1 and (ROOT / "training" / parts[1]).is_dir():
        return f"training.{parts[1]}"
    return parts[0]


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            found[name] = path
    return found


def imports(known: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (`from a import b` counts a.b where b is a module, else a), or starts
    by name (started_by_name)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in known.items():
        tree = ast.parse(path.read_text())
        targets = started_by_name(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                            for a in node.names}
        graph[name] |= {t for t in targets if t in known and t != name}
    return graph


def started_by_name(tree: ast.Module) -> set[str]:
    """The names a module imports or starts through a string: the literal argument of import_module, __import__ or
    run_module, or every string of the module-level table a non-literal argument reads (`TABLE[key][0]`); the item
    after "-m" in a list or tuple (an argument list: `[sys.executable, "-m", "x.y"]`). A package run (`-m`,
    run_module) runs its __main__ too. A command line inside one string is a message to the user (`run python -m
    x.y FILE`), not a start."""
    tables = {target.id: node.value for node in tree.body if isinstance(node, ast.Assign | ast.AnnAssign)
              for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
              if isinstance(target, ast.Name) and node.value is not None}
    names, run = set(), set()  # imported; run as `python -m`
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and _callee(node.func) in BY_NAME:
            argument = node.args[0]
            read = [argument] if _text(argument) is not None else \
                [tables[n.id] for n in ast.walk(argument) if isinstance(n, ast.Name) and n.id in tables]
            found = {_text(c) for table in read for c in ast.walk(table) if _text(c) is not None}
            names |= found | ({f"{n}.__main__" for n in found} if _callee(node.func) == "run_module" else set())
        elif isinstance(node, ast.List | ast.Tuple):
            run |= {_text(b) for a, b in itertools.pairwise(node.elts) if _text(a) == "-m" and _text(b)}
    return names | run | {f"{n}.__main__" for n in run}


def _callee(func: ast.expr) -> str | None:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def _text(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of `graph`, each as the path that closes it."""
    seen, found = {}, []

    def visit(module: str, path: list[str]) -> None:
        seen[module] = "open"
        for target in sorted(graph.get(module, ())):
            if seen.get(target) == "open":
                found.append(path[path.index(target):] + [target])
            elif target not in seen:
                visit(target, [*path, target])
        seen[module] = "done"

    for module in sorted(graph):
        if module not in seen:
            visit(module, [module])
    return found


def top_room(arrows: dict[str, set[str]]) -> str:
    """The room of the product that may import every other: the command on top (the benchmarks, which measure the
    product and are not installed with it, sit above it)."""
    product = set(arrows) - set(TOOLS)
    (top,) = [room for room in product if arrows[room] >= product - {room}]
    return top


def misplaced_scripts(pyproject: str, known: dict[str, Path], top: str) -> list[str]:
    """The console scripts of [project.scripts] whose module is not ours or not in the top room: a process that
    enters below it would skip the start-up, and start a lower room by name."""
    scripts = tomllib.loads(pyproject).get("project", {}).get("scripts", {})
    return sorted(f"{script} = {target!r}" for script, target in scripts.items()
                  if (module := target.partition(":")[0]) not in known or room_of(module) != top)


def test_every_import_points_where_design_md_allows():
    arrows, known = allowed_arrows(), modules()
    assert set(arrows) == {room_of(m) for m in known}, "DESIGN.md's table and the folder tree name other rooms"
    wrong = sorted(f"{module} imports {target}" for module, targets in imports(known).items() for target in targets
                   if room_of(target) != room_of(module) and room_of(target) not in arrows[room_of(module)])
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle_between_modules():
    found = cycles(imports(modules()))
    assert not found, "\n".join(" -> ".join(c) for c in found)


def test_every_console_script_starts_the_room_on_top():
    top = top_room(allowed_arrows())
    assert top == "imgcls"
    assert misplaced_scripts((ROOT / "pyproject.toml").read_text(), modules(), top) == []
    assert not misplaced_scripts('[project.scripts]\nimgcls = "imgcls.startup:main"\n', modules(), top)
    planted = '[project.scripts]\nimgcls = "training.cli.app:main"\nother = "nowhere:main"\n'
    assert misplaced_scripts(planted, modules(), top) == ["imgcls = 'training.cli.app:main'", "other = 'nowhere:main'"]


def test_the_check_sees_an_import_the_table_forbids(tmp_path):
    """The scan itself: `datamodules` importing `training` is found (a test that can fail)."""
    bad = {"datamodules.x": tmp_path / "x.py", "training.records.run_dir": tmp_path / "y.py"}
    bad["datamodules.x"].write_text("def f():\n    from training.records.run_dir import run_dir\n")
    bad["training.records.run_dir"].write_text("")
    assert imports(bad)["datamodules.x"] == {"training.records.run_dir"}
    assert "training.records" not in allowed_arrows()["datamodules"]


def _planted(tmp_path: Path, sources: dict[str, str]) -> dict[str, Path]:
    known = {}
    for name, source in sources.items():
        known[name] = tmp_path / f"{name}.py"
        known[name].write_text(source)
    return known


def test_the_check_sees_a_room_above_started_by_name(tmp_path):
    """A lower room that starts an upper one by its name, through importlib, a table of names or a `python -m`
    argument list, is found as if it imported it; a docstring or a message that names a command line starts
    nothing."""
    known = _planted(tmp_path, {
        "training.records.by_importlib": 'import importlib\nimportlib.import_module("imgcls.commands").main()\n',
        "training.records.by_table": 'from importlib import import_module\nTABLE = {"x": ("imgcls.commands", "help")}'
                                     '\ndef run(key):\n    import_module(TABLE[key][0])\n',
        "training.records.by_dunder": '__import__("imgcls.commands")\n',
        "deploy.by_argv": 'import subprocess, sys\nsubprocess.call([sys.executable, "-m", "imgcls.trial", "fit"])\n',
        "deploy.by_package": 'import runpy\nrunpy.run_module("imgcls", run_name="__main__")\n',
        "deploy.said": '"""Started as `python -m imgcls.trial fit`."""\nHINT = "run: python -m imgcls fit"\n',
        "imgcls": "", "imgcls.__main__": "", "imgcls.commands": "", "imgcls.trial": ""})
    graph = imports(known)
    assert graph["training.records.by_importlib"] == graph["training.records.by_table"] == \
        graph["training.records.by_dunder"] == {"imgcls.commands"}
    assert graph["deploy.by_argv"] == {"imgcls.trial"}
    assert graph["deploy.by_package"] == {"imgcls", "imgcls.__main__"}
    assert graph["deploy.said"] == set()
    arrows = allowed_arrows()
    assert all("imgcls" not in arrows[room] for room in ("training.records", "deploy"))


def test_the_check_sees_a_cycle_through_a_module_started_by_name(tmp_path):
    """An import one way and a start by name the other way is a cycle, as two imports are."""
    known = _planted(tmp_path, {
        "training.cli.app": 'import importlib\nTABLE = {"sweep": "training.sweeps.command"}\n'
                            'def main(name):\n    importlib.import_module(TABLE[name]).main()\n',
        "training.sweeps.command": "from training.cli.app import main\n"})
    assert cycles(imports(known)) == [["training.cli.app", "training.sweeps.command", "training.cli.app"]]
    known["training.cli.app"].write_text("TABLE = {}\n")
    assert cycles(imports(known)) == []
