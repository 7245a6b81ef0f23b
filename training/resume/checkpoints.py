"""Checkpoint integrity: atomic, finite-only writes, safe (weights_only) loads, and picking an intact checkpoint to
resume.

    imgcls fit --config configs/quickstart.yaml --ckpt_path last   # newest intact checkpoint of the run
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import shutil
import threading
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection

from training.resume.faults import WriteError, error_in


class CheckpointWriteError(WriteError):
    """A checkpoint could not be written (a full disk, or any other OSError); the files saved before it are
    untouched, and no temporary file is left."""


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint holds pickled objects beyond tensors and plain containers, so it was not loaded."""


class NonFiniteWeightsError(RuntimeError):
    """The model holds NaN or infinite weights; such a state is never written as a checkpoint."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """TorchCheckpointIO that writes a temporary file in the target folder, fsyncs it and renames it into place.

    Lightning's own `_atomic_save` serialises to memory first but then writes the target in place, so a kill or a
    full disk during the write leaves a truncated `last.ckpt` behind. A rename within one folder is atomic on POSIX
    file systems: readers see the old file or the new one, never half of one. Loads use `weights_only=True`, so a
    checkpoint cannot run code when it is unpickled.

    Once on disk, the file's pages leave the page cache (`posix_fadvise(DONTNEED)`): a fit does not read its own
    checkpoints back, and each one (~300 MB for ResNet-50 with AdamW) would otherwise push the images of the next
    epochs out of the cache; the next write then fills pages just freed rather than fresh ones, which is faster.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options")
        path = Path(path)
        _check_finite(checkpoint.get("state_dict", {}), path)

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
                if hasattr(os, "posix_fadvise"):  # not on macOS or Windows
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)

        self._replace(path, write, tensor_bytes(checkpoint))

    def link_checkpoint(self, source, path) -> None:
        """Make `path` a second name of the checkpoint file `source` (a hard link, or a copy where the file system
        has none), replacing `path` atomically: the same training state, without writing it again."""
        source, path = Path(source), Path(path)

        def link(tmp: Path) -> None:
            try:
                os.link(source, tmp)
            except OSError:
                shutil.copyfile(source, tmp)
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())

        self._replace(path, link, source.stat().st_size)

    @staticmethod
    def _replace(path: Path, make: Callable[[Path], None], needed: int) -> None:
        """`make` a temporary file in `path`'s folder, then rename it over `path`: never half a file at `path`. A write
        that fails for an OSError (torch's zip writer wraps it in a RuntimeError) raises CheckpointWriteError."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            make(tmp)
            os.replace(tmp, path)
            _fsync_dir(path.parent)
        except BaseException as err:
            tmp.unlink(missing_ok=True)
            cause = error_in(err) if isinstance(err, Exception) else None
            if cause is None or isinstance(err, CheckpointWriteError):
                raise
            raise CheckpointWriteError(cause, f"checkpoint {path.name}", path.parent, needed) from err

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None) -> dict:
        return safe_load(path, map_location=map_location)


class AsyncAtomicCheckpointIO(CheckpointIO):
    """AtomicCheckpointIO on a background thread: training does not wait for the disk.

    As Lightning's AsyncCheckpointIO does, the checkpoint's tensors are snapshotted on the training thread before the
    write is queued, so later steps cannot change what is saved. Removals and links are queued behind the writes too,
    so ModelCheckpoint never deletes an older checkpoint before the one that replaces it is on disk. Pending writes
    are finished when the Trainer tears down (the end of fit, an exception, a preemption exit); an error in one is
    raised at the next save or at teardown. Opt in with
    `trainer.plugins: training.resume.checkpoints.AsyncAtomicCheckpointIO`; the CLI's default is the synchronous
    AtomicCheckpointIO (on a 2-core CPU the background writer competed with the compute threads and a run took longer).
    """

    def __init__(self) -> None:
        self.checkpoint_io = AtomicCheckpointIO()
        self.executor: ThreadPoolExecutor | None = None  # made at the first write; teardown ends it
        self.error: BaseException | None = None  # the first failed operation, raised on the training thread

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        snapshot = apply_to_collection(checkpoint, torch.Tensor, lambda t: t.detach().clone())
        self._queue(self.checkpoint_io.save_checkpoint, snapshot, path, storage_options)
        if self.error is not None:
            raise self.error

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None) -> dict:
        return self.checkpoint_io.load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path) -> None:
        self._queue(self.checkpoint_io.remove_checkpoint, path)

    def link_checkpoint(self, source, path) -> None:
        self._queue(self.checkpoint_io.link_checkpoint, source, path)  # behind the write of `source`

    def teardown(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=True)
            self.executor = None
        if self.error is not None:
            raise self.error

    def _queue(self, operation: Callable, *args) -> None:
        if self.executor is None:
            self.executor = ThreadPoolExecutor(max_workers=1, initializer=_lower_thread_priority)

        def run() -> None:
            if self.error is not None:  # a write failed: no later removal may take the checkpoint it was to replace
                return
            try:
                operation(*args)
            except BaseException as err:  # noqa: BLE001 - raised on the training thread, at the next save or teardown
                self.error = err

        self.executor.submit(run)


def _lower_thread_priority() -> None:
    """Runs in the writer thread: it yields the CPU to the training threads and writes in their gaps (where the OS
    allows: Linux schedules each thread on its own and takes a thread id for a process id here)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


def safe_load(path, map_location: Any | None = "cpu") -> Any:
    """torch.load with weights_only=True; a checkpoint that needs arbitrary unpickling is refused with its path."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(unsafe_message(path, err)) from None


def unsafe_message(path, err: Exception) -> str:
    # torch's own message is a page long; its last line names the offending global.
    detail = [line.strip() for line in str(err).splitlines() if "Unsupported global" in line]
    return (f"refusing to load {path}: it holds pickled objects other than tensors and plain containers, which could "
            f"run code when loaded ({detail[0] if detail else type(err).__name__}); only use files from a trusted "
            "source")


def tensor_bytes(obj: Any) -> int:
    """The bytes of the tensors in `obj` (a checkpoint, a state dict, an optimizer's state, nested)."""
    sizes: list[int] = []
    apply_to_collection(obj, torch.Tensor, lambda t: sizes.append(t.numel() * t.element_size()))
    return sum(sizes)


def _check_finite(state_dict: dict[str, Any], path: Path) -> None:
    # NaN, not inf: a diverged run fills its weights with NaN, while metric states legitimately start at -inf
    # (MaxMetric, the best-so-far val/acc).
    bad = [k for k, v in state_dict.items()
           if isinstance(v, torch.Tensor) and v.is_floating_point() and torch.isnan(v).any()]
    if bad:
        raise NonFiniteWeightsError(
            f"not writing {path}: {len(bad)} weight tensor(s) hold NaN (first: {bad[0]}); "
            "the checkpoints saved before are kept"
        )


def _fsync_dir(folder: Path) -> None:
    """Make the rename itself durable (the directory entry), where the OS allows opening a directory."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def checkpoint_problem(path: Path) -> str | None:
    """Why `path` is not a usable checkpoint (empty, truncated, corrupt), or None when it is intact.

    torch.save writes a zip archive; checking every member's CRC finds truncation and bit rot without unpickling. A
    folder is a sharded checkpoint (training.distributed.fsdp): its shard index `.metadata` and its `meta.pt` must
    be intact.
    """
    if path.is_dir():
        if not (path / ".metadata").is_file():
            return "not a sharded checkpoint (no .metadata)"
        problem = checkpoint_problem(path / "meta.pt")
        return f"meta.pt: {problem}" if problem else None
    try:
        if path.stat().st_size == 0:
            return "empty file"
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
        return f"corrupt member {bad}" if bad is not None else None
    except zipfile.BadZipFile as err:
        return f"truncated or not a checkpoint ({err})"
    except OSError as err:
        return f"unreadable ({err.strerror or err})"


def run_folder(checkpoint: Path) -> Path:
    """The run directory a checkpoint belongs to (<run>/checkpoints/x.ckpt -> <run>)."""
    return checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint.parent


@dataclass(frozen=True)
class ResumePlan:
    """The checkpoint a fit loads (None: from scratch), and the unusable ones seen while choosing it."""

    path: str | None
    unusable: tuple[Path, ...] = ()
    auto: bool = False  # found by auto_resume (no --ckpt_path)


def newest_intact_checkpoint(folder: Path | list[Path], first: Path | None = None,
                             report: bool = True) -> tuple[Path | None, list[Path]]:
    """(the newest intact `*.ckpt` of `folder` (or of several), the unusable ones newer than it); `first` is tried
    before the others.

    Read-only: every rank of a job may run it at once. Each unusable file is reported (unless `report` is False);
    `tidy_checkpoint_folders` moves them aside once the ranks have agreed (`agree_on_resume`).
    """
    folders = [folder] if isinstance(folder, Path) else list(dict.fromkeys(folder))
    candidates = []
    for p in (p for f in folders if f.is_dir() for p in f.glob("*.ckpt")):
        with contextlib.suppress(FileNotFoundError):  # removed since the listing (an older job still tidying)
            if not p.name.startswith("."):
                candidates.append(((p.stat().st_mtime_ns, p.name == "last.ckpt"), p))
    candidates = [p for _, p in sorted(candidates, key=lambda c: c[0], reverse=True)]
    if first is not None:
        candidates = [first] + [p for p in candidates if p != first]
    problems: dict[Path, str] = {}
    found = None
    for path in candidates:
        problems[path] = checkpoint_problem(path)
        if problems[path] is None:
            found = problems.pop(path) or path
            break
    then = f"continuing from {found}" if found else "no intact checkpoint is left"
    for path, problem in problems.items() if report else ():  # one plain line each, as every announcement
        rank_zero_info(f"skipped {path}, which is unusable ({problem}) and will be moved to {path.name}.corrupt; "
                       f"{then}")
    return found, list(problems)


def resolve_resume(ckpt_path: str | None, ckpt_dir: Path | list[Path], auto_resume: bool) -> ResumePlan:
    """The checkpoint `fit` should resume from, as this process sees the disk (read-only).

    `last` (or `auto_resume` with no ckpt_path) means the newest intact checkpoint of the run's checkpoint folders
    (`ckpt_dir`: one, or every folder the run's callbacks write to), whichever callback wrote it. An explicit path
    that is broken falls back to the newest intact checkpoint of its own folder. Under several processes, rank 0's
    plan is the one that every rank follows (`agree_on_resume`, once the process group is up).
    """
    if ckpt_path is None and not auto_resume:
        return ResumePlan(None)
    if ckpt_path in (None, "last"):
        found, unusable = newest_intact_checkpoint(ckpt_dir)
        if found is None:
            if ckpt_path == "last":
                shown = ckpt_dir if isinstance(ckpt_dir, Path) else ", ".join(map(str, ckpt_dir))
                rank_zero_warn(f"--ckpt_path last: no intact checkpoint in {shown}; training from scratch")
            return ResumePlan(None, tuple(unusable))
        rank_zero_info(f"resuming from {found} ({'auto_resume' if ckpt_path is None else '--ckpt_path last'})")
        return ResumePlan(str(found), tuple(unusable), auto=ckpt_path is None)
    if ckpt_path in ("best", "hpc", "registry") or ckpt_path.startswith("registry:"):
        return ResumePlan(ckpt_path)
    path = Path(ckpt_path)
    if not path.exists():
        raise FileNotFoundError(f"--ckpt_path {path} does not exist; use --ckpt_path last to resume the newest one")
    found, unusable = newest_intact_checkpoint(path.parent, first=path)
    if found is None:
        raise ValueError(f"--ckpt_path {path} is unusable ({checkpoint_problem(path)}) and {path.parent} holds no "
                         "intact checkpoint to fall back to")
    if found != path:
        rank_zero_info(f"resuming from {found} instead of the unusable {path}")
    return ResumePlan(str(found), tuple(unusable))


def agree_on_resume(path: str | None) -> str | None:
    """Rank 0's resume checkpoint, on every rank; `path` as it is without an initialised process group of 2+.

    Each rank chose from its own view of the disk (a stale network-file-system cache, a node-local copy, a folder
    that rank 0 was tidying): ranks that loaded different checkpoints would train from different steps, and their
    collectives would hang. A rank that cannot read rank 0's choice stops the job, on every rank, naming it.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return path
    choices: list = [None] * dist.get_world_size()
    dist.all_gather_object(choices, path)
    agreed = choices[0]
    readable: list = [None] * dist.get_world_size()
    dist.all_gather_object(readable, agreed is None or Path(agreed).exists())  # a file, or a sharded folder
    blind = [rank for rank, ok in enumerate(readable) if not ok]
    if blind:
        raise FileNotFoundError(
            f"rank 0 resumes from {agreed}, which rank(s) {', '.join(map(str, blind))} cannot read: the checkpoint "
            "folder must be on a disk that every node mounts at the same path")
    differing = [rank for rank, choice in enumerate(choices) if choice != agreed]
    if differing:
        rank_zero_info(f"resuming every rank from {agreed} (rank 0's choice; rank(s) "
                       f"{', '.join(map(str, differing))} saw {choices[differing[0]]} on their disk)")
    return agreed


# A write that a kill interrupted leaves `.<name>.tmp<pid>` (AtomicCheckpointIO._replace; a folder from
# training.distributed.fsdp, or its `.<name>.old<pid>` between two renames): as big as a checkpoint.
_TEMPORARY = re.compile(r"^\..+\.(tmp|old)\d+$")


def tidy_checkpoint_folders(folders, unusable=()) -> None:
    """Rank 0, before a fit: move the unusable checkpoints aside (`<name>.corrupt`, kept for inspection) and remove
    the temporary files of writes that were killed. Nothing writes into the folders at this point of a fit."""
    for path in unusable:
        with contextlib.suppress(FileNotFoundError):
            os.replace(path, path.with_name(path.name + ".corrupt"))
            rank_zero_info(f"moved the unusable checkpoint {path} to {path.name}.corrupt")
    for folder in dict.fromkeys(Path(f) for f in folders if f):
        leftovers = [p for p in folder.glob(".*") if _TEMPORARY.match(p.name)] if folder.is_dir() else []
        size = 0
        for leftover in leftovers:
            with contextlib.suppress(FileNotFoundError):
                if leftover.is_dir():
                    size += sum(f.stat().st_size for f in leftover.rglob("*") if f.is_file())
                    shutil.rmtree(leftover)
                else:
                    size += leftover.stat().st_size
                    leftover.unlink()
        if leftovers:
            rank_zero_info(f"removed {len(leftovers)} temporary file(s) ({size / 2**20:.0f} MiB) left in {folder} by "
                           "checkpoint writes that were interrupted")
