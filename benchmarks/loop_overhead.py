"""Training-loop overhead: ResNet-50 steps/s through this project's LightningModule and Trainer vs a plain loop.

    python -m benchmarks.run --only loop_overhead [--quick]

Both loops train the same network with the same optimizer (SGD, Nesterov momentum, a per-step LR schedule),
the precision `auto` picks on this CPU (bf16 autocast with native bf16, else fp32) and channels_last, on the same
synthetic batches from a DataLoader. Lightning adds its hooks, the training-accuracy metric and `self.log` calls;
the ratio of step times says what that costs. Each turn runs one epoch of each loop; the ratio is taken per turn
(median Lightning step / median plain step) and quoted as the median over the turns with their spread.
"""

from __future__ import annotations

import logging
import statistics
import time
from functools import partial

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.common import (
    auto_cpu_precision,
    cpu_autocast,
    interleaved_turns,
    quartiles,
    table,
    verdict,
)
from lightning_modules import ImageClassifier, Levers
from lightning_modules.network import BackboneWithHead
from lightning_modules.schedules import WarmupCosine

TITLE = "Training-loop overhead"
TARGET = 1.03  # Lightning's step time at most this many times the plain loop's


class _Laps(L.Callback):
    """Seconds between consecutive training-batch ends: one full loop iteration each (fetch, hooks, step)."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, *args) -> None:
        self.ends.append(time.perf_counter())

    def laps(self) -> list[float]:
        return [b - a for a, b in zip(self.ends, self.ends[1:], strict=False)]


def _loader(size: int, batch: int, steps: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(batch * steps, 3, size, size, generator=g),
                         torch.randint(0, 10, (batch * steps,), generator=g))
    return DataLoader(data, batch_size=batch, shuffle=True, drop_last=True)


def lightning_laps(model: ImageClassifier, loader: DataLoader) -> list[float]:
    laps = _Laps()
    trainer = L.Trainer(accelerator="cpu", devices=1, precision=auto_cpu_precision(), max_epochs=1, logger=False,
                        callbacks=[laps], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, loader)
    return laps.laps()


def plain_loop(arch: str, batch: int):
    """The same recipe in plain PyTorch; returns a function that runs one epoch over a loader and gives its laps."""
    torch.manual_seed(0)
    net = BackboneWithHead(10, arch=arch).to(memory_format=torch.channels_last)
    decay = [p for p in net.parameters() if p.ndim > 1]
    no_decay = [p for p in net.parameters() if p.ndim <= 1]
    lr = 0.1 * batch / 256
    opt = torch.optim.SGD([{"params": decay, "weight_decay": 1e-4}, {"params": no_decay, "weight_decay": 0.0}],
                          lr=lr, momentum=0.9, nesterov=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)

    def epoch(loader: DataLoader) -> list[float]:
        net.train()
        ends = []
        for x, y in loader:
            x = x.contiguous(memory_format=torch.channels_last)
            with cpu_autocast():
                loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            ends.append(time.perf_counter())
        return [b - a for a, b in zip(ends, ends[1:], strict=False)]

    return epoch


def measure(arch: str, size: int, batch: int, steps: int, reps: int) -> dict:
    """Both loops' laps per turn (one epoch each, interleaved), their medians and the per-turn ratio's spread."""
    loader = _loader(size, batch, steps)
    model = ImageClassifier(num_classes=10, net=partial(BackboneWithHead, arch=arch), batch_size=batch,
                            lr_scheduler=partial(WarmupCosine, warmup_epochs=0),  # the recipe's SGD, as the plain loop
                            levers=Levers(channels_last=True, optimizer_impl="default"))
    plain = plain_loop(arch, batch)
    plain(loader)  # warm-up of oneDNN primitives for both (they share the process)
    turns = interleaved_turns({"lightning": lambda: lightning_laps(model, loader), "plain": lambda: plain(loader)},
                              reps)
    ratios = [statistics.median(lit) / statistics.median(pl)
              for lit, pl in zip(turns["lightning"], turns["plain"], strict=True)]
    return {"size": size, "batch": batch, "steps": steps, "turns": reps, "laps_s": turns,
            "plain_s": statistics.median(t for turn in turns["plain"] for t in turn),
            "lightning_s": statistics.median(t for turn in turns["lightning"] for t in turn),
            "ratio": quartiles(ratios)}


def main(quick: bool = False) -> dict:
    arch = "resnet18" if quick else "resnet50"
    # (size, batch, steps, turns): each turn one epoch of each loop; a lap is every step after an epoch's first.
    settings = [(32, 4, 3, 1)] if quick else [(64, 32, 9, 10), (224, 8, 7, 8)]
    # Without Lightning's "GPU available: False" lines per fit; put back after, since benchmarks.run (and the tests'
    # quick run) calls this in a process that goes on: left at ERROR, every later announcement there was dropped.
    lightning_log = logging.getLogger("lightning.pytorch")
    level = lightning_log.level
    lightning_log.setLevel(logging.ERROR)
    try:
        return {"arch": arch, "precision": auto_cpu_precision(), "threads": torch.get_num_threads(),
                "settings": [measure(arch, *setting) for setting in settings]}
    finally:
        lightning_log.setLevel(level)


def spread(ratio: dict) -> str:
    return (f"IQR {ratio['q1']:.2f}–{ratio['q3']:.2f}, min–max {ratio['min']:.2f}–{ratio['max']:.2f} over "
            f"{ratio['n']} turn{'s' if ratio['n'] > 1 else ''}")


def render(results: dict) -> tuple[str, str]:
    rows = [[f"{s['size']} px, batch {s['batch']}", 1 / s["plain_s"], 1 / s["lightning_s"],
             f"{s['ratio']['median']:.3f}", spread(s["ratio"])] for s in results["settings"]]
    body = table(["input", "plain PyTorch steps/s", "imgcls Lightning steps/s",
                  f"Lightning / plain step time, median of turns (target <= {TARGET})", "spread of that ratio"], rows)
    body += f"\n\nTarget, Lightning's step at most {TARGET}x the plain loop's: " + ", ".join(
        f"{s['size']} px {verdict(s['ratio']['median'] <= TARGET)}" for s in results["settings"]) + "."
    return body, (f"{results['arch']}, SGD + LambdaLR, {results['precision']}, channels_last, synthetic batches, "
                  f"{results['threads']} threads; Trainer without logger, checkpointing or progress bar; each turn "
                  "one epoch of each loop, interleaved; step times are medians of the steady-state steps (each "
                  "includes fetching its batch), the ratio is taken per turn")


def figures(results: dict) -> dict[str, str]:
    """Per input size: `ratio_224px` (Lightning / plain step time, median of turns), `spread_224px`, `input_224px`."""
    found = {}
    for s in results["settings"]:
        found[f"ratio_{s['size']}px"] = f"{s['ratio']['median']:.2f}x"
        found[f"spread_{s['size']}px"] = spread(s["ratio"])
        found[f"input_{s['size']}px"] = f"{s['size']} px, batch {s['batch']}"
    return found

