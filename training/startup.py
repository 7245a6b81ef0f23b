"""Start-up of an `imgcls` process: its imports run with Python's cyclic garbage collector off, and what they built
is then frozen (`gc.freeze`), so that no collection walks it again.

The imports (torch, Lightning, torchmetrics, torchvision, jsonargparse) build ~450,000 long-lived objects. With the
collector on, Python walks them in full collections while importing, and again when the interpreter exits; frozen,
neither happens, and every command, DDP rank and sweep trial starts and exits sooner (`python -m
benchmarks.startup` measures by how much; docs/DESIGN.md quotes it). The cost is the cyclic garbage the imports
leave behind (~13,000 objects, a few MB), which is kept instead of collected. Objects made after the start (the
Trainer, the model, the loaders) are collected as usual, and a forked loader worker shares the frozen ones' pages
with its parent, since the collector no longer writes to them.

`imgcls` (the console script) runs `main` here; `python -m training.cli` calls `begin` and `done` around its own
imports. Code that imports `training.cli` as a library (tests, notebooks) is left alone.
"""

from __future__ import annotations

import gc


def begin() -> None:
    """Before the imports: the collector off."""
    gc.disable()


def done() -> None:
    """After the imports: what they built frozen, the collector back on for what the run builds."""
    gc.freeze()
    gc.enable()


def main() -> None:
    """The `imgcls` console script."""
    begin()
    try:
        from training.cli import main as cli
    finally:
        done()
    cli()
