"""Reading cost: what a reader opens to follow the code, measured on this tree and on the tree before the current
layout work (BEFORE), by the same code.

    python -m benchmarks.run --only reading_cost

- the lines of each package (every .py file, blank lines and comments included: what a reader scrolls through);
- the project modules that the model (`lightning_modules.classifier`) and the default data source
  (`datamodules.image_folder`) import, following module-level imports transitively, and their lines;
- the project files whose code runs, and their lines: during one training step (the second, from the end of
  the first to its own end: its batch's fetch, transfer and step, which every later step repeats) and during a
  whole `imgcls fit` of two steps, from the config's parse to the last checkpoint. Each is a fit of
  configs/quickstart.yaml in a fresh interpreter of that tree, under a profile hook that records every Python
  function called (sys.setprofile, in every thread); a file counts once a function of it runs.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from benchmarks.common import table

TITLE = "Reading cost"
ROOT = Path(__file__).resolve().parents[1]
BEFORE = "fca0ca67b0f585e2f236c307de23a327c5e6e0f6"  # main before issue 48's layout work
PACKAGES = ("imgcls", "core", "datamodules", "lightning_modules", "training", "deploy", "benchmarks")
ENTRIES = ("lightning_modules.classifier", "datamodules.image_folder")
PROBE = textwrap.dedent('''
    """Run `imgcls fit` (argv) with a profile hook; write the project files whose functions ran to $OUT."""
    import json, os, runpy, sys, threading
    import lightning as L

    root = os.environ["TREE"] + os.sep
    PACKAGES = os.environ["PACKAGES"].split(",")
    seen = {"fit": set(), "step": set()}
    window = {"step": False}

    def hook(frame, event, arg):
        if event == "call" and frame.f_code.co_name != "<module>":  # functions, not imports
            name = frame.f_code.co_filename
            if name.startswith(root) and name[len(root):].split(os.sep)[0] in PACKAGES:
                seen["fit"].add(name)
                if window["step"]:
                    seen["step"].add(name)

    class StepWindow(L.Callback):
        """The second step, its batch's fetch and transfer included: from the end of the first to its own end."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            window["step"] = batch_idx == 0

        def on_fit_end(self, trainer, pl_module):
            with open(os.environ["OUT"], "w") as out:
                json.dump({k: sorted(v) for k, v in seen.items()}, out)

    sys.modules["reading_probe"] = sys.modules[__name__]
    threading.setprofile(hook)
    sys.setprofile(hook)
    runpy.run_module(os.environ["ENTRY"], run_name="__main__", alter_sys=True)
''')


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def package_lines(tree: Path) -> dict[str, int]:
    return {name: sum(lines(p) for p in (tree / name).rglob("*.py")) for name in PACKAGES if (tree / name).is_dir()}


def path_of(tree: Path, module: str) -> Path | None:
    """The file of a project module in `tree`, or None for a module not of the project."""
    base = tree.joinpath(*module.split("."))
    return next((c for c in (base.with_suffix(".py"), base / "__init__.py") if c.is_file()), None)


def module_imports(tree: Path, entries: tuple[str, ...] = ENTRIES) -> list[str]:
    """The project modules `entries` import at module level, transitively (the entries included)."""
    found, todo = set(), list(entries)
    while todo:
        module = todo.pop()
        path = path_of(tree, module)
        if module in found or path is None:
            continue
        found.add(module)
        parents = module.split(".")
        todo += [".".join(parents[:i]) for i in range(1, len(parents))]  # a package's __init__ runs first
        for node in ast.parse(path.read_text()).body:  # module level only: what importing it costs
            if isinstance(node, ast.Import):
                todo += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                todo += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return sorted(found)


def traced_files(tree: Path, data: Path, run: Path, quick: bool) -> dict[str, list[str]]:
    """{"fit": files, "step": files}: the project files whose functions ran in a 2-step fit of `tree`."""
    with tempfile.TemporaryDirectory() as probe_dir:
        (Path(probe_dir) / "reading_probe.py").write_text(PROBE)
        out = Path(probe_dir) / "seen.json"
        entry = "imgcls" if (tree / "imgcls" / "__main__.py").is_file() else "training.cli"
        args = ["fit", "--config", str(tree / "configs/quickstart.yaml"), "--data.root", str(data),
                "--trainer.default_root_dir", str(run), "--trainer.max_steps", "2", "--trainer.max_epochs", "1",
                "--trainer.limit_val_batches", "1", "--trainer.callbacks+=reading_probe.StepWindow",
                "--trainer.enable_progress_bar", "false", "--data.batch_size", "8"]
        if quick:
            args += ["--model.net.arch", "resnet18"]
        env = {"PYTHONPATH": f"{tree}:{probe_dir}", "TREE": str(tree), "OUT": str(out), "ENTRY": entry,
               "PACKAGES": ",".join(p for p in PACKAGES if p != "benchmarks"),
               "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "2"}
        proc = subprocess.run([sys.executable, str(Path(probe_dir) / "reading_probe.py"), *args], cwd=tree, env=env,
                              capture_output=True, text=True, timeout=900)
        if not out.is_file():
            raise RuntimeError(f"the traced fit of {tree} wrote nothing (exit {proc.returncode}):\n"
                               + proc.stderr[-3000:])
        seen = json.loads(out.read_text())
    return {key: sorted(str(Path(f).relative_to(tree)) for f in files) for key, files in seen.items()}


def measure(tree: Path, data: Path, run: Path, quick: bool, trace: bool = True) -> dict:
    """What a reader opens in `tree`; without `trace`, only what reading its files tells (a quick run's older tree)."""
    print(f"reading cost: {'a traced 2-step fit of ' if trace else 'the files of '}{tree}", flush=True)
    traced = traced_files(tree, data, run, quick) if trace else {}
    imported = module_imports(tree)
    return {"packages": package_lines(tree),
            "imports": {"modules": imported, "lines": sum(lines(path_of(tree, m)) for m in imported)},
            **{key: {"files": files, "lines": sum(lines(tree / f) for f in files)} for key, files in traced.items()}}


def main(quick: bool = False) -> dict:
    from datamodules.demo import build_demo_data

    with tempfile.TemporaryDirectory() as tmp:
        data = build_demo_data(Path(tmp) / "digits", size=32)
        before = Path(tmp) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(before), BEFORE], cwd=ROOT, check=True)
        try:
            # quick: the older tree's files only; its fit is traced by a full run
            trees = {"before": measure(before, data, Path(tmp) / "run-before", quick, trace=not quick),
                     "now": measure(ROOT, data, Path(tmp) / "run-now", quick)}
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=ROOT, check=False)
    return {"before_commit": BEFORE, **trees}


def _files(part: dict | None) -> str:
    return f"{len(part['files'])} ({part['lines']:,})" if part else "not traced (quick)"


def render(r: dict) -> tuple[str, str]:
    old, now = r["before"], r["now"]
    rows = [["one training step: files run (lines)", _files(old.get("step")), _files(now.get("step"))],
            ["a whole fit, config to last checkpoint: files run (lines)", _files(old.get("fit")),
             _files(now.get("fit"))],
            ["modules the model and the default data source import (lines)",
             f"{len(old['imports']['modules'])} ({old['imports']['lines']:,})",
             f"{len(now['imports']['modules'])} ({now['imports']['lines']:,})"]]
    rows += [[f"lines of `{name}/`", f"{old['packages'].get(name, 0):,}", f"{now['packages'].get(name, 0):,}"]
             for name in PACKAGES]
    body = table(["what a reader opens", f"before (`{r['before_commit'][:10]}`)", "this tree"], rows)
    settings = ("files of the project (tests left out) whose functions ran under sys.setprofile in a 2-step "
                "`imgcls fit` of configs/quickstart.yaml on the demo digits, batch 8; imports followed at module "
                "level from lightning_modules.classifier and datamodules.image_folder")
    return body, settings
