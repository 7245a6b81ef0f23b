"""The GPU check: everything that needs a CUDA device, in one command that fits a lent machine's few minutes.

    make gpu-wheels          # here, with the internet: the wheels a GPU machine lacks, into .whl/ (git-ignored),
                             # and the tree's commit and file hashes (.whl/tree.json) its records name
    make gpu-check           # on the CUDA machine, .whl/ carried along: the sections below, within 8 min
    GPU_CHECK_OUT=DIR make gpu-check  # also copies each record to DIR as soon as it is stored
    make gpu-check --dry-run # (make's -n) anywhere: the same sections at tiny sizes on whatever device there is
    python3 -m benchmarks.gpu_check --only NAME ...  # only these sections: what a cut-short call left undone

The sections are `pytest -m cuda` (benchmarks/cuda_tests.py), the synthetic step (gpu_throughput) and the end to
end fit of both data paths (gpu_end_to_end). A full run stores each section's record where every benchmark keeps
them, benchmarks/results/machines/<the GPU's machine>/, and renders the figures from them; a dry run writes under
runs/bench-quick/ and leaves the committed results alone. A GPU machine that is lent for a short while has Python,
torch, torchvision, Lightning and torchmetrics but cannot download: `--prepare` fetches the rest as wheels for its
Python, and the check installs them into a folder of its own before it imports anything of the project's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from benchmarks import provenance  # standard library only: importable before install()

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("cuda_tests", "gpu_throughput", "gpu_end_to_end")
# What `imgcls fit` and the cuda tests import that a GPU machine's image lacks; the versions are this venv's.
WHEELS = ("jsonargparse", "docstring-parser", "typeshed-client", "torchdata", "simplejpeg")
# The GPU machine's interpreter, and the manylinux tags pip must match exactly when it downloads for another Python.
TARGET_PYTHON = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")


def prepare(folder: Path) -> list[Path]:
    """Download the wheels of WHEELS, at the versions installed here, for the GPU machine's Python into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    pins = [f"{name}=={metadata.version(name)}" for name in WHEELS]
    platforms = [arg for tag in PLATFORMS for arg in ("--platform", tag)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", TARGET_PYTHON, "--implementation", "cp", *platforms, "-d", str(folder), *pins],
                   check=True)
    wheels = sorted(folder.glob("*.whl"))
    print(f"{len(wheels)} wheels in {folder} ({sum(w.stat().st_size for w in wheels) / 1e6:.1f} MB): "
          + ", ".join(w.name.split("-")[0] for w in wheels))
    # The GPU machine gets the tree without its history: the records it makes compare the tree with this snapshot.
    snapshot = provenance.tree_snapshot()
    (ROOT / provenance.TREE).write_text(json.dumps(snapshot) + "\n")
    state = provenance.tree_state()
    print(f"the tree at {snapshot['commit'][:10]}" + ("" if state["clean"] else
          f", with uncommitted changes in {', '.join(state['changed'])}: commit them first, for records that name "
          "their code") + ("" if snapshot["on_main"] else ", a commit not on main"))
    return wheels


def install(folder: Path) -> None:
    """Put the wheels in `folder` on this process's path and its children's, where a module of WHEELS is missing."""
    missing = [name for name in WHEELS if importlib.util.find_spec(name.replace("-", "_")) is None]
    if not missing:
        return
    wheels = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    if not wheels:
        raise SystemExit(f"gpu-check: {', '.join(missing)} not installed and no wheels in {folder}; "
                         "run `make gpu-wheels` where pip can download, and carry that folder")
    site = Path(tempfile.gettempdir()) / "imgcls-gpu-site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                    "--upgrade", "--target", str(site), *map(str, wheels)], check=True)
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)


def check(dry_run: bool, wheels: Path, out: Path | None = None, only: tuple[str, ...] = SECTIONS) -> list[str]:
    """Run SECTIONS one by one (one that fails does not stop the others); each record, once stored, is copied to
    `out` too, so a call cut short by its time limit still returns what it finished. The sections that failed."""
    install(wheels)
    sys.path.insert(0, str(ROOT))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    from benchmarks import records, run  # after install(): the project imports jsonargparse and torchdata
    from benchmarks.common import machine_info

    page = out / "PERFORMANCE.md" if dry_run and out is not None else None  # a dry run's page and records beside out
    results = (page or run.QUICK_DIR / "PERFORMANCE.md").parent / "results" if dry_run else records.RESULTS
    folder = results / "machines" / records.machine_slug(machine_info())
    failed = []
    for name in only:
        try:
            run.main(quick=dry_run, out=page, only=(name,))
        except Exception as error:  # a section's failure or its page's: the next section runs all the same
            failed.append(name)
            print(error, flush=True)
        if out is not None and (folder / f"{name}.json").is_file():
            out.mkdir(parents=True, exist_ok=True)
            shutil.copy(folder / f"{name}.json", out / f"{name}.json")
    return failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on any device, kept under runs/")
    parser.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="the wheels folder (default .whl/)")
    parser.add_argument("--prepare", action="store_true", help="download the wheels into --wheels and stop")
    parser.add_argument("--out", type=Path, default=os.environ.get("GPU_CHECK_OUT"),
                        help="also copy each record here as soon as it is stored (default $GPU_CHECK_OUT)")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=SECTIONS,
                        help="run these sections only (a rerun of the ones a cut-short call did not finish)")
    args = parser.parse_args()
    if args.prepare:
        prepare(args.wheels)
    elif failed := check(args.dry_run, args.wheels, args.out, tuple(args.only)):
        raise SystemExit(f"gpu-check: {', '.join(failed)} failed")


if __name__ == "__main__":
    main()
