"""Time to accuracy: wall time and epochs for the quickstart to reach 97% and 99% val/acc on the demo digits.

    python -m benchmarks.time_to_accuracy [--quick]

`imgcls fit --config configs/quickstart.yaml` runs as a user runs it (PNG files, DataLoader, Lightning), against a
plain PyTorch loop on in-memory tensors with the same model and recipe, in the same benchmark run. Each is a process
of its own, timed from its launch: both pay for starting Python and importing torch, imgcls also for Lightning.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import yaml

from benchmarks.common import section, standalone, table, verdict
from datamodules.demo import build_demo_data

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
    return _timed(args, clock)


def _timed(args: list[str], clock: Path, **env: str) -> list[dict]:
    """Run `args` with the clock started just before the launch: interpreter start and imports count."""
    clock.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, **env, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               BENCH_CLOCK=str(clock), BENCH_T0=repr(time.time()))
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:4])} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in clock.read_text().splitlines()]


def run_plain(data: Path, run_dir: Path, quick: bool) -> list[dict]:
    """benchmarks/plain_loop.py in a process of its own, timed from its launch like `imgcls fit`."""
    recipe = QUICK if quick else RECIPE
    return _timed([sys.executable, "-m", "benchmarks.plain_loop"], run_dir / "clock.jsonl", BENCH_DATA=str(data),
                  BENCH_RECIPE=json.dumps(recipe), BENCH_MAX_BATCHES="2" if quick else "")


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
        plain = run_plain(data, Path(run_dir) / "plain", quick)
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
    a, b = first_reaching(lit, TARGETS[0]), first_reaching(plain, TARGETS[0])
    body += ("\n\nTarget, imgcls within 1.2x of the plain loop's time to 97%: "
             + (f"{a['seconds'] / b['seconds']:.2f}x ({verdict(a['seconds'] <= 1.2 * b['seconds'])})." if a and b
                else "not measured: a run did not reach 97%."))
    return section(
        "Time to accuracy",
        body,
        f"configs/quickstart.yaml ({recipe['arch']} from scratch, {recipe['image_size']} px, AdamW, bf16, "
        f"channels_last, {recipe['epochs']} epochs) on the demo digits; each run is a process of its own, timed "
        "from its launch (interpreter start, imports and reading the data included); run one after the other. "
        "`python -m benchmarks.time_to_accuracy`" + (" (quick: 2 batches of one epoch)" if quick else ""),
    )


if __name__ == "__main__":
    standalone(main, __doc__)
