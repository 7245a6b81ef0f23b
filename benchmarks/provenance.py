"""Where a benchmark record came from: the commit and whether the tree matched it, whether that commit was on main,
the exact command, the versions of the libraries, and the last lines of the run's log.

A GPU machine gets a copy of the working tree without its git history: `make gpu-wheels` writes TREE beside the wheels
(the commit, and the blob hash of every tracked file, `git ls-files -s`), and there the tree is compared with it file
by file, as `git status` would compare it with the commit.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import shlex
import subprocess
import sys
from collections import deque
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The libraries a section's figures can depend on, recorded where installed.
LIBRARIES = ("torch", "torchvision", "lightning", "torchmetrics", "jsonargparse", "numpy", "pillow", "simplejpeg",
             "torchdata", "litdata", "scikit-learn", "timm", "optuna", "litserve", "onnxruntime")
# What a benchmark run writes itself (benchmarks.pages): a change there is the run's output, not the measured code.
OUTPUTS = ("benchmarks/results", "docs", "README.md", "core/measured.json")
# Environment variables that change what a command measures: shown in front of it.
SETTINGS_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "CUDA_VISIBLE_DEVICES", "TIMM_TRAIN_PY")
TREE = ".whl/tree.json"
LOG_LINES = 30


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.rstrip("\n") if done.returncode == 0 else None


def _blob_sha(path: Path) -> str:
    """The hash git gives a file's content (`git hash-object`)."""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _is_output(path: str) -> bool:
    return any(path == out or path.startswith(out + "/") for out in OUTPUTS)


def tree_snapshot() -> dict:
    """The commit, whether it is on main, and each tracked file's blob hash: what TREE holds for a machine without
    the history."""
    files = {}
    for line in (_git("ls-files", "-s") or "").splitlines():
        meta, _, path = line.partition("\t")
        files[path] = meta.split()[1]
    return {"commit": _git("rev-parse", "HEAD"), "on_main": _on_main(), "files": files}


def _on_main() -> bool:
    return _git("merge-base", "--is-ancestor", "HEAD", "main") is not None


def _changed_against(snapshot: dict) -> list[str]:
    """The tracked files of `snapshot` whose content here differs (or that are gone), outputs left out."""
    return [path for path, sha in snapshot["files"].items()
            if not _is_output(path) and (not (ROOT / path).is_file() or _blob_sha(ROOT / path) != sha)]


def tree_state() -> dict:
    """{commit, clean, on_main, changed}: from git where this checkout has its history, else from TREE."""
    if _git("rev-parse", "HEAD") is not None:
        status = _git("status", "--porcelain", "--untracked-files=normal") or ""
        changed = [line[3:] for line in status.splitlines() if not _is_output(line[3:].strip('"'))]
        return {"commit": _git("rev-parse", "HEAD"), "clean": not changed, "on_main": _on_main(),
                "changed": changed[:20]}
    snapshot_file = ROOT / TREE
    if not snapshot_file.is_file():
        return {"commit": None, "clean": False, "on_main": False,
                "changed": [f"no git history and no {TREE} (make gpu-wheels writes it)"]}
    snapshot = json.loads(snapshot_file.read_text())
    changed = _changed_against(snapshot)
    return {"commit": snapshot["commit"], "clean": not changed, "on_main": snapshot["on_main"],
            "changed": changed[:20]}


def command() -> str:
    """The command line that started this process, as typed (`python -m benchmarks.run --only NAME`), with the
    environment variables that change what it measures in front."""
    argv = list(getattr(sys, "orig_argv", sys.argv))
    argv[0] = Path(argv[0]).name
    env = [f"{name}={os.environ[name]}" for name in SETTINGS_ENV if os.environ.get(name)]
    return shlex.join([*env, *argv]) if not env else " ".join(env) + " " + shlex.join(argv)


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


class LogTail(io.TextIOBase):
    """Writes through to `stream` and keeps the last LOG_LINES lines written."""

    def __init__(self, stream, lines: deque) -> None:
        self.stream, self.lines, self.partial = stream, lines, ""

    def write(self, text: str) -> int:
        self.stream.write(text)
        *done, self.partial = (self.partial + text).split("\n")
        self.lines.extend(line for line in done if line.strip())
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()


class captured_log:
    """`with captured_log() as tail:` stdout and stderr go on as before; `list(tail)` is their last lines."""

    def __enter__(self) -> deque:
        self.lines: deque = deque(maxlen=LOG_LINES)
        self.saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = LogTail(sys.stdout, self.lines), LogTail(sys.stderr, self.lines)
        return self.lines

    def __exit__(self, *exc) -> None:
        for stream in (sys.stdout, sys.stderr):
            if stream.partial.strip():
                self.lines.append(stream.partial)
        sys.stdout, sys.stderr = self.saved


def provenance(state: dict, log: list[str]) -> dict:
    """A record's `provenance`: `state` (tree_state(), taken before the section ran) and the log's last lines."""
    return {**state, "command": command(), "versions": versions(), "log_tail": log}


FIELDS = ("commit", "clean", "on_main", "command", "versions", "log_tail")
