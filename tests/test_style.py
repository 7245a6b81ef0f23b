"""The house style the issue tracker asked for, checked where CI runs: ruff (line length 120 included) over the code,
tests and notebooks, the same line length in the shipped YAML configs, and the size of the packages' modules and
functions."""

from __future__ import annotations

import ast
import subprocess
import sys

from tests.helpers import CONFIGS, ROOT

MAX_COLUMNS = 120
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
SIZED_PACKAGES = ("core", "datamodules", "lightning_modules", "training", "deploy", "imgcls", "benchmarks")


def test_ruff_finds_nothing():
    found = subprocess.run([sys.executable, "-m", "ruff", "check", "--quiet", "."], cwd=ROOT, capture_output=True,
                           text=True)
    assert found.returncode == 0, found.stdout + found.stderr


def test_shipped_configs_keep_lines_within_120_columns():
    long = [f"{path.relative_to(ROOT)}:{number}: {len(line)} columns"
            for path in sorted(CONFIGS.rglob("*.yaml"))
            for number, line in enumerate(path.read_text().splitlines(), start=1) if len(line) > MAX_COLUMNS]
    assert not long, "\n".join(long)



def oversized(root=ROOT, packages=SIZED_PACKAGES) -> list[str]:
    """Each module of `packages` over MAX_MODULE_LINES lines and each function (or method) over MAX_FUNCTION_LINES,
    from its `def` to its last line."""
    found = []
    for path in sorted(p for package in packages for p in (root / package).rglob("*.py")):
        text, where = path.read_text(), path.relative_to(root)
        if (lines := len(text.splitlines())) > MAX_MODULE_LINES:
            found.append(f"{where}: {lines} lines")
        found += [f"{where}:{node.lineno}: {node.name} is {node.end_lineno - node.lineno + 1} lines"
                  for node in ast.walk(ast.parse(text))
                  if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                  and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    return found


def test_no_module_over_400_lines_and_no_function_over_60():
    found = oversized()
    assert not found, "split these by their seams:\n" + "\n".join(found)


def test_the_size_check_finds_a_long_module_and_a_long_function(tmp_path):
    (tmp_path / "pkg").mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(60))
    (tmp_path / "pkg" / "long.py").write_text(f"def long():\n{body}\n\ndef short():\n    return 1\n"
                                              + "\n" * 400)
    assert oversized(tmp_path, ("pkg",)) == ["pkg/long.py: 465 lines", "pkg/long.py:1: long is 61 lines"]
