"""The folder tree is the architecture: docs/DESIGN.md's table "Rooms and arrows" says what each room may import,
and the code holds to it (every import, at module level or inside a function), with no import cycle between
modules."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

from tests.helpers import ROOT

PACKAGES = ("core", "datamodules", "lightning_modules", "training", "deploy", "imgcls")


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
    """Module -> the modules of ours it imports (`from a import b` counts a.b where b is a module, else a)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                           for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in known and t != name}
    return graph


def test_every_import_points_where_design_md_allows():
    arrows, known = allowed_arrows(), modules()
    assert set(arrows) == {room_of(m) for m in known}, "DESIGN.md's table and the folder tree name other rooms"
    wrong = sorted(f"{module} imports {target}" for module, targets in imports(known).items() for target in targets
                   if room_of(target) != room_of(module) and room_of(target) not in arrows[room_of(module)])
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle_between_modules():
    graph, seen, cycles = imports(modules()), {}, []

    def visit(module: str, path: list[str]) -> None:
        seen[module] = "open"
        for target in sorted(graph[module]):
            if seen.get(target) == "open":
                cycles.append(path[path.index(target):] + [target])
            elif target not in seen:
                visit(target, [*path, target])
        seen[module] = "done"

    for module in sorted(graph):
        if module not in seen:
            visit(module, [module])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_check_sees_an_import_the_table_forbids(tmp_path):
    """The scan itself: `datamodules` importing `training` is found (a test that can fail)."""
    bad = {"datamodules.x": tmp_path / "x.py", "training.records.run_dir": tmp_path / "y.py"}
    bad["datamodules.x"].write_text("def f():\n    from training.records.run_dir import run_dir\n")
    bad["training.records.run_dir"].write_text("")
    assert imports(bad)["datamodules.x"] == {"training.records.run_dir"}
    assert "training.records" not in allowed_arrows()["datamodules"]
