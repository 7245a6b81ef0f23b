"""GPU end to end: ResNet-50 training through the real `imgcls fit`, from JPEG files on disk to the optimizer step.

    python -m benchmarks.gpu_end_to_end              # on a CUDA machine; skipped without one
    python -m benchmarks.gpu_end_to_end --dry-run    # tiny sizes on whatever device there is (what CI checks)

Unlike the GPU throughput section (a synthetic batch already on the GPU), every step here goes through the whole
path: an image folder of photo-sized JPEGs on local disk, the DataModule's loader workers, the host-to-device copy,
and either the workers' CPU decode and augmentation (`num_workers` = the host's cores) or `data.augment_on_device`
(nvJPEG decode and the preset's augmentation on the GPU); then the production recipe of configs/imagenet_ddp8.yaml:
`16-mixed`, channels_last, torch.compile and the fused optimizer, batch 256 at 224 px, with the whole network
training (`freeze.epochs 0`: the config's frozen first epoch would end inside the timed steps, and torch.compile
recompiles the network when its parameters start to need gradients). Each path is one `imgcls fit` process of its own
(`python -m training.cli`), whose `StepClock` callback times every step:

- img/s over the timed steps, after the warm-up steps (cuDNN autotuning, compilation);
- the GPU's busy fraction: the time CUDA events bracket around each training step, over the wall time;
- where the time goes per step: the training step itself, the device decode and augmentation (timed inside the
  DataModule's `on_after_batch_transfer`), and the wait for the loader (the rest of the gap between two steps).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback

from benchmarks.common import cores, photo_folder, standalone, table

TITLE = "GPU end to end"
ROOT = Path(__file__).resolve().parents[1]
PATHS = {"cpu_decode": "CPU decode in the loader workers", "augment_on_device": "augment_on_device (nvJPEG)"}


class StepClock(Callback):
    """Times each training step, the device-side decode and augmentation inside it, and the wait in between; writes
    them as JSON to `out` at the end of the fit (rank 0). On CUDA each step is also bracketed by CUDA events (the
    GPU's span of the step). The clock synchronises after each step and around the device-side transforms, so that the
    split is exact; that costs the overlap of a step's launch with the previous step's GPU work."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.steps: list[dict] = []
        self._mark = self._start = None
        self._events: list[tuple] = []
        self._augment = 0.0

    def setup(self, trainer, pl_module, stage: str) -> None:
        datamodule = trainer.datamodule
        inner = datamodule.on_after_batch_transfer

        def timed(batch, dataloader_idx):
            self._sync()
            start = time.perf_counter()
            out = inner(batch, dataloader_idx)
            self._sync()
            if trainer.training:
                self._augment += time.perf_counter() - start
            return out

        datamodule.on_after_batch_transfer = timed

    @staticmethod
    def _sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        now = time.perf_counter()
        self._start = now
        if torch.cuda.is_available():
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
            self._events.append((begin,))
        self.steps.append({"gap_s": (now - self._mark) if self._mark is not None else None,
                           "augment_s": self._augment})
        self._augment = 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if torch.cuda.is_available():
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events[-1] = (self._events[-1][0], end)
        self._sync()
        self._mark = time.perf_counter()
        self.steps[-1]["step_s"] = self._mark - self._start

    def on_train_end(self, trainer, pl_module) -> None:
        self._sync()
        for step, events in zip(self.steps, self._events, strict=False):
            if len(events) == 2:
                step["gpu_s"] = events[0].elapsed_time(events[1]) / 1e3
        if trainer.is_global_zero:
            Path(self.out).write_text(json.dumps({"steps": self.steps, "batch": trainer.datamodule.batch_size}))


def summarise(steps: list[dict], batch: int, warmup: int) -> dict:
    """img/s, GPU busy fraction and the per-step split of the timed steps (those after `warmup`)."""
    timed = steps[warmup:]
    if not timed:
        raise ValueError(f"no timed steps: {len(steps)} steps ran, {warmup} of them warm-up")
    wall = sum(s["step_s"] + (s["gap_s"] or 0.0) for s in timed)
    step = sum(s["step_s"] for s in timed)
    augment = sum(s["augment_s"] for s in timed)
    gpu = sum(s.get("gpu_s", 0.0) for s in timed)
    each = sorted(s["step_s"] for s in timed)
    return {"steps": len(timed), "img_s": batch * len(timed) / wall,
            "gpu_busy": gpu / wall if gpu else None,
            "step_ms": 1e3 * step / len(timed), "augment_ms": 1e3 * augment / len(timed),
            "wait_ms": 1e3 * max(0.0, wall - step - augment) / len(timed),
            "median_step_ms": 1e3 * each[len(each) // 2], "slowest_step_ms": 1e3 * each[-1]}


# A timed step this many times the median is no steady state (a recompilation, a stall): the page says so.
OUTLIER = 5.0


def fit(root: Path, out: Path, *, augment_on_device: bool, dry_run: bool, steps: int) -> list[dict]:
    """One `imgcls fit` process of the production config on `root`, timed by StepClock; its steps."""
    clock = out / "steps.json"
    args = ["fit", "--config", str(ROOT / "configs" / "imagenet_ddp8.yaml"), "--trainer.devices", "1",
            "--trainer.strategy", "auto", "--data.root", str(root), "--model.net.weights", "null",
            "--trainer.max_steps", str(steps),
            "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
            "--trainer.enable_progress_bar", "false", "--trainer.logger", "false",
            "--trainer.enable_checkpointing", "false", "--trainer.callbacks", "[]",
            "--trainer.default_root_dir", str(out), "--auto_resume", "false", "--freeze.epochs", "0",
            "--data.augment_on_device", str(augment_on_device).lower(),
            "--data.num_workers", str(cores()),
            "--trainer.callbacks+=benchmarks.gpu_end_to_end.StepClock", f"--trainer.callbacks.out={clock}"]
    if dry_run:  # tiny: whatever device there is, no compile
        args += ["--model.net.arch", "resnet18", "--model.net.head_hidden", "32", "--data.image_size", "64",
                 "--data.batch_size", "4", "--model.levers.compile", "false", "--trainer.accelerator", "auto",
                 "--data.num_workers", "1", "--data.fast_decode", "false"]
    else:
        args += ["--data.batch_size", "256", "--data.image_size", "224", "--trainer.accelerator", "gpu"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "training.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"imgcls fit exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(clock.read_text())["steps"]


def main(quick: bool = False, dry_run: bool | None = None) -> dict:
    """Both data paths, one fit each. Quick or dry-run: tiny sizes on any device (a check, not a figure); a full run
    needs CUDA and is skipped without it."""
    dry_run = quick if dry_run is None else dry_run
    if not dry_run and not torch.cuda.is_available():
        return {"skipped": "no CUDA device on this machine"}
    count, steps, warmup = (16, 4, 1) if dry_run else (6000, 60, 20)
    root = photo_folder(count)
    paths = {}
    with tempfile.TemporaryDirectory(prefix="imgcls-e2e-") as tmp:
        for name in PATHS:
            out = Path(tmp) / name
            out.mkdir()
            timed = fit(root, out, augment_on_device=name == "augment_on_device", dry_run=dry_run, steps=steps)
            batch = 4 if dry_run else 256
            paths[name] = summarise(timed, batch, warmup)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {"device": device, "dry_run": dry_run, "images": count, "steps": steps, "warmup": warmup,
            "workers": 1 if dry_run else cores(), "paths": paths}


def render(r: dict) -> tuple[str, str]:
    rows = [[PATHS[name], p["img_s"], f"{p['gpu_busy']:.0%}" if p["gpu_busy"] is not None else "no CUDA",
             p["step_ms"], p["augment_ms"], p["wait_ms"]] for name, p in r["paths"].items()]
    body = table(["data path", "img/s", "GPU busy", "step ms", "on-device decode, augment, normalize ms",
                  "loader wait ms"], rows)
    for name, p in r["paths"].items():
        if p.get("slowest_step_ms", 0.0) > OUTLIER * p.get("median_step_ms", float("inf")):
            body += (f"\n\n{PATHS[name]}: a timed step took {p['slowest_step_ms']:,.0f} ms against a median of "
                     f"{p['median_step_ms']:,.1f} ms (a recompilation or a stall inside the timed steps).")
    best = max(p["img_s"] for p in r["paths"].values())
    body += (f"\n\nTarget on one H100 or H200: at least 5,000 img/s end to end (moonshot 7,000): {best:,.0f} img/s."
             if not r["dry_run"] else "\n\nDry run: tiny sizes, a check that the path runs, not a figure.")
    return body, (f"{r['device']}, configs/imagenet_ddp8.yaml on one device through `imgcls fit`, "
                  f"{r['images']} photo-like 500x375 JPEGs, {r['workers']} loader workers, {r['steps']} steps of "
                  f"which {r['warmup']} warm-up")


def figures(r: dict) -> dict[str, str]:
    return {name: f"{p['img_s']:,.0f} img/s" for name, p in r["paths"].items()}


if __name__ == "__main__":
    if "--dry-run" in sys.argv[1:]:
        sys.argv.remove("--dry-run")
        sys.argv.append("--quick")  # stored under runs/bench-quick/, never over the committed results
    standalone("gpu_end_to_end", __doc__ + "\n--dry-run: tiny sizes on any device (the same as --quick).")
