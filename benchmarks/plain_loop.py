"""The baseline of the time-to-accuracy benchmark: the quickstart recipe as a plain PyTorch loop on in-memory tensors.

    BENCH_DATA=data/digits BENCH_RECIPE='{...}' BENCH_CLOCK=clock.jsonl BENCH_T0=$(date +%s.%N) \
        python -m benchmarks.plain_loop

It imports only torch and torchvision (not Lightning; of this project only the seed functions and the CPU's levers),
so that its start-up is what a hand-written script pays. It draws what imgcls draws: the same initial weights, batches
and dropout masks for the same seed (`train`). It appends {epoch, val_acc, seconds since $BENCH_T0} to $BENCH_CLOCK
after each epoch.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torchvision.io import ImageReadMode, decode_image, read_file

from benchmarks.common import cpu_autocast
from core import hardware
from core.seeding import batch_seed


def load_split(split_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Every image of an image-folder split as one uint8 (N, 3, H, W) tensor, and the class indices."""
    classes = sorted(d.name for d in split_dir.iterdir() if d.is_dir())
    files = [(f, c) for c, name in enumerate(classes) for f in sorted((split_dir / name).iterdir())]
    x = torch.stack([decode_image(read_file(str(f)), mode=ImageReadMode.RGB) for f, _ in files])
    return x, torch.tensor([c for _, c in files])


def network(arch: str, head_hidden: int, dropout: float, zero_init_residual: bool, num_classes: int) -> nn.Module:
    net = getattr(torchvision.models, arch)(weights=None, zero_init_residual=zero_init_residual)
    features = net.fc.in_features
    net.fc = nn.Sequential(nn.Linear(features, head_hidden), nn.ReLU(inplace=True), nn.Dropout(dropout),
                           nn.Linear(head_hidden, num_classes))
    return net.to(memory_format=torch.channels_last)


def train(data: Path, recipe: dict, *, start: float, max_batches: int | None = None):
    """Yields {epoch, val_acc, seconds since `start`} after each epoch."""
    torch.manual_seed(recipe["seed"])
    x_train, y_train = load_split(data / "train")
    x_val, y_val = load_split(data / "val")
    size = recipe["image_size"]
    if x_train.shape[-1] != size:
        x_train = F.interpolate(x_train.float(), size=(size, size), mode="bilinear", antialias=True).round().byte()
        x_val = F.interpolate(x_val.float(), size=(size, size), mode="bilinear", antialias=True).round().byte()
    net = network(recipe["arch"], recipe["head_hidden"], recipe["dropout"], recipe["zero_init_residual"],
                  int(y_train.max()) + 1)
    batch = recipe["batch"]
    lr = recipe["lr"] * batch / 256  # linear scaling of the per-256 rate, as the LightningModule does
    decay = [p for p in net.parameters() if p.ndim > 1]
    no_decay = [p for p in net.parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": recipe["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=recipe["betas"],
                            fused=hardware.choose_optimizer_impl(hardware.detect(), "cpu")[0] == "fused")  # as auto
    steps_per_epoch = len(x_train) // batch
    total, warmup = steps_per_epoch * recipe["epochs"], int(recipe["warmup_epochs"] * steps_per_epoch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / warmup if s < warmup else
                                              0.5 * (1 + math.cos(math.pi * min(1.0, (s - warmup) / (total - warmup)))))

    def prepare(x: torch.Tensor) -> torch.Tensor:  # uint8 (B, 3, H, W) -> float in [0, 1], NHWC
        return (x.float() / 255).contiguous(memory_format=torch.channels_last)

    batches = 0
    for epoch in range(recipe["epochs"]):
        net.train()
        # imgcls's draws: its training sampler's order, a function of (seed, epoch), and dropout seeded per batch.
        # With the same initial weights (the same seed and construction), both sides then train on the same batches
        # with the same masks, and the epoch at which each reaches a target is no longer a matter of luck.
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(recipe["seed"] + epoch))
        for i in range(steps_per_epoch if max_batches is None else min(max_batches, steps_per_epoch)):
            idx = order[i * batch:(i + 1) * batch]
            torch.manual_seed(batch_seed(batches, 0, base=recipe["seed"]))
            batches += 1
            with cpu_autocast():
                loss = F.cross_entropy(net(prepare(x_train[idx])), y_train[idx],
                                       label_smoothing=recipe["label_smoothing"])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
        net.eval()
        with torch.no_grad(), cpu_autocast():
            pred = torch.cat([net(prepare(x_val[i:i + 256])).argmax(1) for i in range(0, len(x_val), 256)])
        yield {"epoch": epoch + 1, "val_acc": (pred == y_val).float().mean().item(), "seconds": time.time() - start}


def main() -> None:
    recipe = json.loads(os.environ["BENCH_RECIPE"])
    max_batches = int(os.environ["BENCH_MAX_BATCHES"]) if os.environ.get("BENCH_MAX_BATCHES") else None
    for record in train(Path(os.environ["BENCH_DATA"]), recipe, start=float(os.environ["BENCH_T0"]),
                        max_batches=max_batches):
        with open(os.environ["BENCH_CLOCK"], "a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
