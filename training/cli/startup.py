"""Start-up of an `imgcls` process: its imports run with Python's cyclic garbage collector off, and what they built
is then frozen (`gc.freeze`), so that no collection walks it again.

The imports (torch, Lightning, torchmetrics, torchvision, jsonargparse) build ~450,000 long-lived objects. With the
collector on, Python walks them in full collections while importing, and again when the interpreter exits; frozen,
neither happens, and every command, DDP rank and sweep trial starts and exits sooner (`python -m
benchmarks.startup` measures by how much; docs/DESIGN.md quotes it). The cost is the cyclic garbage the imports
leave behind (~13,000 objects, a few MB), which is kept instead of collected. Objects made after the start (the
Trainer, the model, the loaders) are collected as usual, and a forked loader worker shares the frozen ones' pages
with its parent, since the collector no longer writes to them.

After the imports, `done` also fixes where the run's announcements go: Lightning's `rank_zero_info` lines (the
precision, the resume, the run directory and the others imgcls prints) are printed on stderr, once each, as bare lines.
Lightning decides that on import: where the root logger has no handler then (a fresh `imgcls` process), it gives
its loggers a console handler of their own and stops them propagating; where it has one (a sitecustomize or a
library imported first that configured logging), it leaves the lines to the root logger's handlers, in their format,
and its `lightning` logger prints each a second time as "INFO: ...". `console` makes the first case the only one.

`imgcls` (the console script) and `python -m training.cli` (__main__.py) run `main` here, `begin` and `done` around the
imports. Code that imports `training.cli.app` as a library (tests, notebooks) is left alone.
"""

from __future__ import annotations

import gc
import logging

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


def main() -> None:
    """The `imgcls` console script."""
    begin()
    try:
        from training.cli.app import main as cli
    finally:
        done()
    cli()
