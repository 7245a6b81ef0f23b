"""Start-up of an `imgcls` process: its imports run with Python's cyclic garbage collector off, and what they built
is then frozen (`gc.freeze`), so that no collection walks it again.

The imports (torch, Lightning, torchmetrics, torchvision, jsonargparse) build ~450,000 long-lived objects. With the
collector on, Python walks them in full collections while importing, and again when the interpreter exits; frozen,
neither happens, and every command, DDP rank and sweep trial starts sooner (docs/PERFORMANCE.md, "Process
start-up", by `python -m benchmarks.run --only startup`). The cost is the cyclic garbage the imports leave behind
(~13,000 objects, a few MB), which is kept instead of collected. Objects made after the start (the
Trainer, the model, the loaders) are collected as usual, and a forked loader worker shares the frozen ones' pages
with its parent, since the collector no longer writes to them.

After the imports, `done` also fixes where the run's announcements go: Lightning's `rank_zero_info` lines (the
precision, the resume, the run directory and the others imgcls prints) are printed on stderr, once each, as bare lines.
Lightning decides that on import: where the root logger has no handler then (a fresh `imgcls` process), it gives
its loggers a console handler of their own and stops them propagating; where it has one (a sitecustomize or a
library imported first that configured logging), it leaves the lines to the root logger's handlers, in their format,
and its `lightning` logger prints each a second time as "INFO: ...". `console` makes the first case the only one.

At the end, `run` ends the process without tearing its heap down: the interpreter frees every object one by one
before it exits (the imports' ones too, frozen or not), which a process that is about to end has no use for, and in
a forked process each freed object's page is copied first. Once the command has returned or exited, the interpreter
joins the non-daemon threads and runs the exit functions (W&B's, multiprocessing's, the loggers'), as always; the
last of them, registered here before any other, flushes the files still open for writing (as freeing them would),
stdout and stderr, and ends the process with the command's exit status (`os._exit`). What it costs: any other
`__del__` that has not run by then does not run. An exception other than SystemExit leaves the command, and the
process ends the usual way.

`imgcls` (the console script) and `python -m imgcls` (__main__.py), and a sweep's trial (`python -m imgcls.trial`,
trial.py) go through `start` here: `begin` and `done` around the imports, then the command through `run`. Code that
imports `imgcls.commands` or `training.cli.app` as a library (tests, notebooks) is left alone.
"""

from __future__ import annotations

import atexit
import gc
import io
import os
import sys
from collections.abc import Callable

_status: int | None = None  # the exit status of the command `run` ran, once it has ended


def _end_without_teardown() -> None:
    """The process's last exit function: after `run`, once the interpreter has joined the non-daemon threads and run
    the other exit functions, the streams are flushed and the process ends, its heap left to the operating system."""
    if _status is None:  # no command ended through `run` (an import as a library, an uncaught exception): as usual
        return
    logging.shutdown()  # imported after this was registered: its own exit function would run after this one
    # What the teardown would have flushed as it freed them: the files still open for writing (a callback's own log
    # that it never closed), made during the command (not frozen: gc.get_objects lists them), then stdout and stderr.
    opened = [o for o in gc.get_objects() if type(o) in (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)]
    for stream in (*opened, sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, read-only, or a reader gone
            pass
    os._exit(_status)


atexit.register(_end_without_teardown)  # before any other (this module's imports included): it runs last
import logging  # noqa: E402

# The loggers of the announcements: `rank_zero_info` logs to lightning.pytorch's, Lightning's Fabric to its own.
ANNOUNCERS = ("lightning.pytorch", "lightning.fabric")


def begin() -> None:
    """Before the imports: the collector off."""
    gc.disable()


def done() -> None:
    """After the imports: what they built frozen, the collector back on for what the run builds, the announcements
    on the console."""
    gc.freeze()
    gc.enable()
    console()


def console() -> None:
    """The announcements on stderr, as Lightning prints them where the root logger had no handler on its import."""
    for name in ANNOUNCERS:
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        if logger.propagate:  # Lightning found the root logger configured: its lines were left to it
            logger.addHandler(logging.StreamHandler())
            logger.propagate = False


def start(load: Callable[[], Callable[[], object]]) -> None:
    """Start an imgcls process: `load` imports what its command needs and returns the command, between `begin` and
    `done`; the command then runs through `run`."""
    begin()
    try:
        command = load()
    finally:
        done()
    run(command)


def run(command: Callable[[], object]) -> None:
    """Run the process's command; once it has returned or exited, the process ends as the interpreter ends it
    (non-daemon threads joined, exit functions run, streams flushed) with the same status, without the teardown of
    its heap (`python -m benchmarks.startup` measures what that saves). Any other exception: the usual end."""
    global _status
    try:
        command()
    except SystemExit as stop:
        code = stop.code
        _status = 0 if code is None else code if isinstance(code, int) else 1  # a message: printed, status 1
        raise
    _status = 0
