"""Training-loop overhead: ResNet-50 steps/s through this project's LightningModule and Trainer vs a plain loop.

    python -m benchmarks.loop_overhead [--quick]

Both loops train the same network with the same optimizer (SGD, Nesterov momentum, a per-step LR schedule),
the precision `auto` picks on this CPU (bf16 autocast with native bf16, else fp32) and channels_last, on the same
synthetic batches from a DataLoader. Lightning adds its hooks, the
training-accuracy metric and `self.log` calls; the ratio of steps/s says what that costs.
"""

from __future__ import annotations

import logging
import time

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.common import (
    auto_cpu_precision,
    cpu_autocast,
    interleaved,
    section,
    standalone,
    table,
    verdict,
)
from lightning_modules import ImageClassifier
from lightning_modules.network import build_network


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
    net = build_network(arch, None, 1024, 0.2, 10).to(memory_format=torch.channels_last)
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


def measure(arch: str, size: int, batch: int, steps: int, reps: int) -> dict[str, float]:
    loader = _loader(size, batch, steps)
    model = ImageClassifier(num_classes=10, arch=arch, optimizer="sgd", lr=0.1, batch_size=batch,
                            warmup_epochs=0, channels_last=True, optimizer_impl="default")  # as the plain loop
    plain = plain_loop(arch, batch)
    plain(loader)  # warm-up of oneDNN primitives for both (they share the process)
    return interleaved({"lightning": lambda: lightning_laps(model, loader), "plain": lambda: plain(loader)}, reps)


def main(quick: bool = False) -> str:
    arch = "resnet18" if quick else "resnet50"
    # (size, batch, steps, turns): each turn one epoch of each loop; a lap is every step after an epoch's first.
    settings = [(32, 4, 3, 1)] if quick else [(64, 32, 9, 6), (224, 8, 7, 5)]
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)  # "GPU available: False" lines per fit
    rows = []
    for size, batch, steps, reps in settings:
        t = measure(arch, size, batch, steps, reps)
        rows.append([f"{size} px, batch {batch}", 1 / t["plain"], 1 / t["lightning"], t["plain"] / t["lightning"]])
    body = table(["input", "plain PyTorch steps/s", "imgcls Lightning steps/s", "ratio (target >= 0.97)"], rows)
    body += "\n\nTarget, a ratio of at least 0.97: " + ", ".join(
        f"{row[0].split(',')[0]} {verdict(row[3] >= 0.97)}" for row in rows) + "."
    return section(
        "Training-loop overhead",
        body,
        f"{arch}, SGD + LambdaLR, {auto_cpu_precision()}, channels_last, synthetic batches, {torch.get_num_threads()} "
        "threads; Trainer without logger, checkpointing or progress bar; medians of interleaved steady-state "
        "steps (each includes fetching its batch). `python -m benchmarks.loop_overhead`",
    )


if __name__ == "__main__":
    standalone(main, __doc__)
