"""Test-only probe: a callback that records what torch.compile did in this process (graphs dynamo compiled), so a
test can tell a compiled step from a printed lever."""

from __future__ import annotations

import json
from pathlib import Path

from lightning.pytorch import Callback


class CompiledGraphs(Callback):
    """At the end of training, write to `out` the graphs dynamo compiled and the frames it converted."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module) -> None:
        from torch._dynamo.utils import counters

        Path(self.out).write_text(json.dumps({"graphs": counters["stats"]["unique_graphs"],
                                              "frames": counters["frames"]["ok"]}))
