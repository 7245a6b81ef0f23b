"""Time to accuracy: wall time and epochs for the quickstart to reach 97% and 99% val/acc on the demo digits.

    python -m benchmarks.time_to_accuracy [--quick]

`imgcls fit --config configs/quickstart.yaml` runs as a user runs it (PNG files, DataLoader, Lightning), timed
from its launch, against a plain PyTorch loop on in-memory tensors with the same model and recipe, timed from the
start of reading the PNGs, in the same benchmark run.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
import yaml

from benchmarks.common import section, standalone, table
from datamodules.demo import build_demo_data
from datamodules.images import find_classes, read_image, scan_split
from lightning_modules.network import build_resnet

ROOT = Path(__file__).resolve().parents[1]
TARGETS = (0.97, 0.99)
LEAN = "imgcls fit without checkpoints, figures, progress bar"


def _quickstart_recipe() -> dict:
    """The recipe of configs/quickstart.yaml, read from the file, so that the plain loop copies what imgcls runs."""
    config = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())
    model, data = config["model"], config["data"]
    return dict(arch=model["arch"], head_hidden=model["head_hidden"], dropout=model["dropout"], lr=model["lr"],
                betas=(model["momentum"], 0.999), weight_decay=model["weight_decay"],
                warmup_epochs=model["warmup_epochs"], label_smoothing=model["label_smoothing"],
                batch=data["batch_size"], image_size=data["image_size"], epochs=config["trainer"]["max_epochs"],
                seed=config["seed_everything"])


RECIPE = _quickstart_recipe()
QUICK = dict(RECIPE, arch="resnet18", head_hidden=32, image_size=32, batch=16, epochs=1)


class EpochClock(L.Callback):
    """Appends {epoch, val_acc, seconds since $BENCH_T0} to $BENCH_CLOCK after each validation of `fit`."""

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        record = {"epoch": trainer.current_epoch + 1, "val_acc": float(trainer.callback_metrics["val/acc"]),
                  "seconds": time.time() - float(os.environ["BENCH_T0"])}
        with open(os.environ["BENCH_CLOCK"], "a") as f:
            f.write(json.dumps(record) + "\n")


def run_imgcls(data: Path, run_dir: Path, quick: bool, lean: bool = False) -> list[dict]:
    """`imgcls fit` of the quickstart; `lean` drops the config's callbacks (checkpoints, figures, progress bar)."""
    clock = run_dir / "clock.jsonl"
    args = [sys.executable, "-m", "training.cli", "fit", "--config", str(ROOT / "configs/quickstart.yaml"),
            "--data.root", str(data), "--trainer.default_root_dir", str(run_dir)]
    if lean:
        args += ["--trainer.callbacks=[]", "--trainer.enable_checkpointing=false"]
    args += ["--trainer.callbacks+=benchmarks.time_to_accuracy.EpochClock"]
    if quick:
        args += ["--model.arch", QUICK["arch"], "--model.head_hidden", str(QUICK["head_hidden"]),
                 "--data.image_size", str(QUICK["image_size"]), "--data.batch_size", str(QUICK["batch"]),
                 "--data.num_workers", "0", "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2",
                 "--trainer.limit_val_batches", "2"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               BENCH_CLOCK=str(clock), BENCH_T0=repr(time.time()))
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"imgcls fit exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in clock.read_text().splitlines()]


def _load(split_dir: Path, classes: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    samples = scan_split(split_dir, classes)
    x = torch.stack([read_image(p) for p, _ in samples])  # (N, 3, 64, 64) uint8
    return x, torch.tensor([t for _, t in samples])


def run_plain(data: Path, recipe: dict, max_batches: int | None = None) -> list[dict]:
    """The quickstart recipe in plain PyTorch on tensors held in memory; val/acc after each epoch."""
    start = time.time()
    torch.manual_seed(recipe["seed"])
    classes = find_classes(data / "train")
    x_train, y_train = _load(data / "train", classes)
    x_val, y_val = _load(data / "val", classes)
    size = recipe["image_size"]
    if x_train.shape[-1] != size:
        x_train = F.interpolate(x_train.float(), size=(size, size), mode="bilinear", antialias=True).round().byte()
        x_val = F.interpolate(x_val.float(), size=(size, size), mode="bilinear", antialias=True).round().byte()
    net = build_resnet(recipe["arch"], None, recipe["head_hidden"], recipe["dropout"], len(classes))
    net = net.to(memory_format=torch.channels_last)
    batch = recipe["batch"]
    lr = recipe["lr"] * batch / 256  # linear scaling of the per-256 rate, as the LightningModule does
    decay = [p for p in net.parameters() if p.ndim > 1]
    no_decay = [p for p in net.parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": recipe["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=recipe["betas"])
    steps_per_epoch = len(x_train) // batch
    total, warmup = steps_per_epoch * recipe["epochs"], int(recipe["warmup_epochs"] * steps_per_epoch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / warmup if s < warmup else
                                              0.5 * (1 + math.cos(math.pi * min(1.0, (s - warmup) / (total - warmup)))))

    def prepare(x: torch.Tensor) -> torch.Tensor:  # uint8 (B, 3, H, W) -> float in [0, 1], NHWC
        return (x.float() / 255).contiguous(memory_format=torch.channels_last)

    records = []
    for epoch in range(recipe["epochs"]):
        net.train()
        order = torch.randperm(len(x_train))
        for i in range(steps_per_epoch if max_batches is None else min(max_batches, steps_per_epoch)):
            idx = order[i * batch:(i + 1) * batch]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(net(prepare(x_train[idx])), y_train[idx], label_smoothing=recipe["label_smoothing"])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
        net.eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            pred = torch.cat([net(prepare(x_val[i:i + 256])).argmax(1) for i in range(0, len(x_val), 256)])
        records.append({"epoch": epoch + 1, "val_acc": (pred == y_val).float().mean().item(),
                        "seconds": time.time() - start})
    return records


def _seconds_per_epoch(records: list[dict]) -> float:
    """Median wall time between consecutive validations (start-up and the first epoch excluded)."""
    laps = [b["seconds"] - a["seconds"] for a, b in zip(records, records[1:], strict=False)]
    return statistics.median(laps) if laps else float("nan")


def first_reaching(records: list[dict], target: float) -> dict | None:
    return next((r for r in records if r["val_acc"] >= target), None)


def main(quick: bool = False) -> str:
    recipe = QUICK if quick else RECIPE
    data = build_demo_data(Path(tempfile.gettempdir()) / f"imgcls-bench-digits-{recipe['image_size']}",
                           size=recipe["image_size"])
    with tempfile.TemporaryDirectory() as run_dir:
        lit = run_imgcls(data, Path(run_dir) / "full", quick)
        lean = run_imgcls(data, Path(run_dir) / "lean", quick, lean=True)
    plain = run_plain(data, recipe, max_batches=2 if quick else None)
    rows = []
    for name, records in (("plain PyTorch loop, tensors in memory", plain),
                          ("imgcls fit (PNG files, loader, Lightning)", lit),
                          (LEAN, lean)):
        row = [name]
        for target in TARGETS:
            hit = first_reaching(records, target)
            row += [f"{hit['seconds']:.0f} s (epoch {hit['epoch']})" if hit else "not reached"]
        best = max(records, key=lambda r: r["val_acc"])
        row += [f"{best['val_acc']:.3f} (epoch {best['epoch']})", f"{records[-1]['seconds']:.0f} s"]
        rows.append(row)
    ratio = ["imgcls / plain (target <= 1.2)"]
    for target in TARGETS:
        a, b = first_reaching(lit, target), first_reaching(plain, target)
        ratio.append(f"{a['seconds'] / b['seconds']:.2f}" if a and b else "-")
    ratio += ["", f"{lit[-1]['seconds'] / plain[-1]['seconds']:.2f}"]
    rows.append(ratio)
    per_epoch = {name: _seconds_per_epoch(records) for name, records in (("plain", plain), ("imgcls", lit),
                                                                          ("lean", lean))}
    body = table(["run", "time to 97% val/acc", "time to 99% val/acc", "best val/acc", "total"], rows)
    body += ("\n\nPer epoch (val/acc, seconds): plain "
             + ", ".join(f"{r['val_acc']:.3f}@{r['seconds']:.0f}" for r in plain)
             + "; imgcls " + ", ".join(f"{r['val_acc']:.3f}@{r['seconds']:.0f}" for r in lit)
             + "; imgcls without checkpoints and figures "
             + ", ".join(f"{r['val_acc']:.3f}@{r['seconds']:.0f}" for r in lean) + ".")
    body += (f"\n\nSeconds per epoch after the first (training and validation): plain {per_epoch['plain']:.1f}, "
             f"imgcls {per_epoch['imgcls']:.1f} ({per_epoch['imgcls'] / per_epoch['plain']:.2f}x), imgcls without "
             f"checkpoints and figures {per_epoch['lean']:.1f} ({per_epoch['lean'] / per_epoch['plain']:.2f}x). "
             "The epoch at which a run first reaches a target also varies from run to run (each run draws its own "
             "initial weights, data order and dropout), so the time ratios move by whole epochs; the per-epoch "
             "ratios are the steadier measure of what the pipeline costs.")
    return section(
        "Time to accuracy",
        body,
        f"configs/quickstart.yaml ({recipe['arch']} from scratch, {recipe['image_size']} px, AdamW, bf16, "
        f"channels_last, {recipe['epochs']} epochs) on the demo digits; imgcls timed from its launch (imports "
        "and start-up included), the plain loop from reading the PNGs; run one after the other. "
        "`python -m benchmarks.time_to_accuracy`" + (" (quick: 2 batches of one epoch)" if quick else ""),
    )


if __name__ == "__main__":
    standalone(main, __doc__)
