"""How `imgcls` reports errors: the user's mistakes (a config value, a file, a folder, an image), a lost peer, a file
of the run that could not be written and a run folder another fit holds, each in one line that names the key or file
and the fix, without a traceback (IMGCLS_TRACEBACK=1 shows it); anything else with its traceback."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_only

from datamodules.datasets import UnreadableImageError
from lightning_modules.network import WeightsDownloadError
from training.resume.checkpoints import CheckpointWriteError, UnsafeCheckpointError
from training.resume.disk import RunWriteError
from training.resume.faults import NonFiniteLossError, error_in, lost_peer_message
from training.resume.hold import RunFolderHeld

# Errors caused by what the user gave us (config values, files, folders, a source whose extra is not installed)
# or by the machine (weights it cannot download), reported in one line without a traceback.
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, ImportError, UnsafeCheckpointError,
               NonFiniteLossError, WeightsDownloadError)
# The exit codes besides 2 (USER_ERRORS) and 1 (a lost peer), from sysexits.h: a file of the run could not be written
# or will not fit (EX_IOERR); another fit holds the run folder, and the same command succeeds once it has ended
# (EX_TEMPFAIL: a wrapper or sweep can tell it from a bad config and retry).
EXIT_CODES = {RunWriteError: 74, CheckpointWriteError: 74, RunFolderHeld: 75}
_PACKAGES = tuple(str(Path(__file__).resolve().parents[2] / pkg) for pkg in ("core", "datamodules", "lightning_modules",
                                                                             "training", "deploy"))


def exit_code(err: BaseException) -> int | None:
    """Print `err` in one line and return the exit code (2: the user's input, 1: a lost peer, EXIT_CODES), or None
    when it is to be raised with its traceback."""
    if os.environ.get("IMGCLS_TRACEBACK"):
        return None
    for kind, code in EXIT_CODES.items():  # in the chain too: a teardown's error raised while the fit's was handled
        found = error_in(err, kind)
        if found is not None:
            if rank_zero_only.rank == 0:  # every rank of a job stops with it; the line once
                print(f"imgcls: error: {found}", file=sys.stderr)
            return code
    err = constructor_error(err)
    if isinstance(err, UnreadableImageError):
        # From a loader worker it arrives re-raised by torch, its message the worker's whole traceback: the last line
        # is ours.
        print(f"imgcls: error: {str(err).strip().splitlines()[-1].split('UnreadableImageError: ')[-1]}",
              file=sys.stderr)
        return 2
    if isinstance(err, USER_ERRORS):
        if not raised_here(err):  # a ValueError from deep inside torch: its traceback says where
            return None
        # Bad config values, data layout, images or checkpoints: our messages name the key or file and the fix.
        print(f"imgcls: error: {err}", file=sys.stderr)
        return 2
    message = lost_peer_message(err) if isinstance(err, RuntimeError) else None
    if message is None:
        return None
    print(f"imgcls: error: {message}", file=sys.stderr)
    return 1


def constructor_error(err: BaseException) -> BaseException:
    """The error a class chosen by class_path (the data source) raised in its constructor, which jsonargparse
    re-raises wrapped in its own listing of the types it tried ("Does not validate against any of the Union
    subtypes"), chained `from` it; any other error as it is."""
    while isinstance(err, ValueError) and isinstance(err.__cause__, Exception) and str(err).startswith(
            "Does not validate against any of the Union subtypes"):
        err = err.__cause__
    return err


def raised_here(err: BaseException) -> bool:
    """True when `err` was raised by this project's own checks (a ValueError from deep in torch keeps its traceback)."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and str(Path(tb.tb_frame.f_code.co_filename).resolve()).startswith(_PACKAGES)
