"""GPU end to end: ResNet-50 training through the real `imgcls fit`, from JPEG files on disk to the optimizer step.

    python -m benchmarks.run --only gpu_end_to_end                   # on a CUDA machine; skipped without one
    python -m benchmarks.gpu_check --dry-run --only gpu_end_to_end   # tiny sizes on any device (what CI checks)

Unlike the GPU throughput section (a synthetic batch already on the GPU), every step here goes through the whole
path: an image folder of photo-sized JPEGs on local disk, the DataModule's loader workers, the host-to-device copy,
and either the workers' CPU decode and augmentation (`data.num_workers` as the config leaves it: the host's CPUs per
GPU, at most 8; the other CPUs run the training process) or `data.augment_on_device` (nvJPEG decode and the preset's
augmentation on the GPU); then the production recipe of configs/imagenet_ddp8.yaml, its `auto` levers as they
resolve on CUDA (`16-mixed`, channels_last, torch.compile), batch 256 at 224 px, with the whole network training
(`freeze.epochs 0`: the config's frozen first epoch would end inside the timed steps, and torch.compile recompiles
the network when its parameters start to need gradients), on enough images that every step lies in the first epoch
(an epoch's first batch waits for one worker to make all of it, which an ImageNet epoch of 5,000 steps pays once; the
6,000 images of the records before 2026-11-27 22:00 UTC put two epoch starts inside the timed steps). Each path is
one `imgcls fit` process of its own (`python -m imgcls`), whose `StepClock` callback times every step:

- img/s over the timed steps, after the warm-up steps (cuDNN autotuning, compilation), and the wall time a step;
- the GPU's busy fraction: the GPU's time inside the training steps (CUDA events around each), over the wall time;
- the device's time decoding and augmenting a batch (`data.augment_on_device`; events around the DataModule's
  `on_after_batch_transfer`), and the host's time between two steps: fetching the next batch from the loader
  workers, its copy and the device transforms' launch (free while the GPU still runs queued work);
- where the default path's step spends the device's time: its kernels over a few steps after the timed ones, under
  torch's profiler (the page names the longest), for a step that falls short of the synthetic one (GPU throughput).
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

from benchmarks.common import photo_folder, table
from core.hardware import choose_num_workers, detect
from datamodules import ImageFolderDataModule

TITLE = "GPU end to end"
ROOT = Path(__file__).resolve().parents[1]
BATCH = 256
PATHS = {"cpu_decode": "CPU decode in the loader workers", "augment_on_device": "augment_on_device (nvJPEG)",
         "cpu_decode_more": "CPU decode, a loader worker per CPU but one",
         "cpu_decode_side_stream": "CPU decode, the batch copied to the GPU on a stream of its own"}
FULL_ONLY = ("cpu_decode_more",)  # a lever of the default path: the dry run checks that path once
# The experiment of a path: its DataModule, where it is not the config's (`data.class_path`).
DATA_CLASS = {"cpu_decode_side_stream": "benchmarks.gpu_end_to_end.SideStreamCopy"}


class SideStreamCopy(ImageFolderDataModule):
    """The default data path with the batch's host-to-device copy on a CUDA stream of its own: issued while the
    training stream still runs the step before, it need not wait for that step's kernels, and the next step waits
    only for its copy (an experiment of the benchmark; the product's copy runs on the current stream)."""

    def transfer_batch_to_device(self, batch, device: torch.device, dataloader_idx: int):
        if device.type != "cuda":
            return super().transfer_batch_to_device(batch, device, dataloader_idx)
        if getattr(self, "copy_stream", None) is None:
            self.copy_stream = torch.cuda.Stream(device)
        with torch.cuda.stream(self.copy_stream):
            moved = super().transfer_batch_to_device(batch, device, dataloader_idx)
        current = torch.cuda.current_stream(device)
        current.wait_stream(self.copy_stream)
        for item in moved:  # the copy's memory is the training stream's to free, once its kernels are done
            if isinstance(item, torch.Tensor) and item.is_cuda:
                item.record_stream(current)
        return moved


class StepClock(Callback):
    """Times the training steps of a fit without synchronising them one by one (a synchronisation per step would keep
    the host from queueing a step while the GPU runs the one before): the host's clock at each step's start and end,
    and on CUDA events around each step and around the device-side decode and augmentation, read after the fit. The
    timed window is bracketed by the only two synchronisations: after the last warm-up step and after the last
    timed one. The last `profile` steps of the fit, after the window, run under torch's profiler: the device's time
    by kernel (the host's by operator without CUDA). Writes JSON to `out` at the end of the fit (rank 0)."""

    def __init__(self, out: str, warmup: int = 0, profile: int = 0) -> None:
        self.out, self.warmup, self.profile = out, warmup, profile
        self._profiler = None
        self.steps: list[dict] = []
        self._events: list[list] = []  # per step: [its begin, its end, its batch's device transforms' (begin, end)]
        self._augment: list = []  # what the device transforms of the next step's batch took: events, or host seconds
        self._window: list[float] = []
        self._cuda = False

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._cuda = trainer.strategy.root_device.type == "cuda"  # the module is moved there after this hook
        datamodule = trainer.datamodule
        inner = datamodule.on_after_batch_transfer

        def timed(batch, dataloader_idx):
            if not trainer.training:
                return inner(batch, dataloader_idx)
            begin = self._mark()
            out = inner(batch, dataloader_idx)
            self._augment.append((begin, self._mark()))
            return out

        datamodule.on_after_batch_transfer = timed

    def _mark(self):
        """A CUDA event recorded now on the current stream, or the host's clock without CUDA."""
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self.steps.append({"host_start_s": time.perf_counter()})
        self._events.append([self._mark(), None, self._augment])
        self._augment = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self._events[-1][1] = self._mark()
        self.steps[-1]["host_end_s"] = time.perf_counter()
        if len(self.steps) == self.warmup:
            self._window = [self._synchronized()]
        if len(self.steps) == trainer.max_steps - self.profile:
            self._window.append(self._synchronized())
            if self.profile:
                from torch.profiler import ProfilerActivity, profile

                self._profiler = profile(activities=[ProfilerActivity.CUDA if self._cuda else ProfilerActivity.CPU])
                self._profiler.start()

    def _synchronized(self) -> float:
        if self._cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_end(self, trainer, pl_module) -> None:
        kernels = self._kernels() if self._profiler is not None else None
        if len(self._window) < 2:  # the fit ended before max_steps: the window ends with it
            self._window.append(self._synchronized())
        timed = self.steps[:len(self.steps) - self.profile] if kernels else self.steps
        for step, (begin, end, augment) in zip(timed, self._events, strict=False):
            step["device_s"] = _elapsed(begin, end)
            step["augment_s"] = sum(_elapsed(a, b) for a, b in augment)
        if trainer.is_global_zero:
            Path(self.out).write_text(json.dumps({"steps": timed, "batch": trainer.datamodule.batch_size,
                                                  "window_s": self._window[-1] - self._window[0],
                                                  "cuda": self._cuda, "kernels": kernels}))

    def _kernels(self) -> dict:
        """The profiled steps' time by kernel (operator on a CPU), per step, the longest first."""
        self._synchronized()
        self._profiler.stop()
        own = [(e.key, (e.self_device_time_total if self._cuda else e.self_cpu_time_total) / 1e3 / self.profile,
                e.count / self.profile) for e in self._profiler.key_averages()]
        own = sorted((row for row in own if row[1] > 0), key=lambda row: -row[1])
        return {"steps": self.profile, "ms": sum(row[1] for row in own),
                "top": [{"name": name, "ms": ms, "calls": calls} for name, ms, calls in own[:KERNELS]]}


def _elapsed(begin, end) -> float:
    return begin.elapsed_time(end) / 1e3 if isinstance(begin, torch.cuda.Event) else end - begin


def summarise(clock: dict, warmup: int) -> dict:
    """img/s, GPU busy fraction and per-step figures of the timed steps (those after `warmup`): `clock` as StepClock
    writes it."""
    steps, batch = clock["steps"], clock["batch"]
    timed = steps[warmup:]
    if not timed or warmup < 1:
        raise ValueError(f"no timed steps: {len(steps)} steps ran, {warmup} of them warm-up (at least 1)")
    window = clock["window_s"]
    pairs = list(zip(steps[warmup - 1:-1], timed, strict=True))  # each timed step after the step before it
    # The host's time per step (its own step and the fetch before it): a recompilation or a stall shows here.
    host = sorted(s["host_end_s"] - before["host_end_s"] for before, s in pairs)
    return {"steps": len(timed), "img_s": batch * len(timed) / window, "step_ms": 1e3 * window / len(timed),
            "gpu_busy": sum(s["device_s"] for s in timed) / window if clock["cuda"] else None,
            "augment_ms": 1e3 * sum(s["augment_s"] for s in timed) / len(timed),
            "wait_ms": 1e3 * sum(s["host_start_s"] - before["host_end_s"] for before, s in pairs) / len(timed),
            "median_step_ms": 1e3 * host[len(host) // 2], "slowest_step_ms": 1e3 * host[-1],
            **({"kernels": clock["kernels"]} if clock.get("kernels") else {})}


# A timed step this many times the median is no steady state (a recompilation, a stall): the page says so.
OUTLIER = 5.0
# The default path's last steps run under torch's profiler, and the page names its longest kernels.
PROFILED, KERNELS = 3, 8


def fit(root: Path, out: Path, *, augment_on_device: bool, dry_run: bool, steps: int, warmup: int,
        workers: int | None = None, profile: int = 0, data_class: str | None = None) -> dict:
    """One `imgcls fit` process of the production config on `root`, timed by StepClock; what the clock wrote."""
    clock = out / "steps.json"
    args = ["fit", "--config", str(ROOT / "configs" / "imagenet_ddp8.yaml"), "--trainer.devices", "1",
            "--trainer.strategy", "auto", "--data.root", str(root), "--model.net.weights", "null",
            "--trainer.max_steps", str(steps + profile),
            "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
            "--trainer.enable_progress_bar", "false", "--trainer.logger", "false",
            "--trainer.enable_checkpointing", "false", "--trainer.callbacks", "[]",
            "--trainer.default_root_dir", str(out), "--auto_resume", "false", "--freeze.epochs", "0",
            "--data.augment_on_device", str(augment_on_device).lower(),
            "--trainer.callbacks+=benchmarks.gpu_end_to_end.StepClock", f"--trainer.callbacks.out={clock}",
            f"--trainer.callbacks.warmup={warmup}", f"--trainer.callbacks.profile={profile}",
            *(["--data.class_path", data_class] if data_class else [])]
    if dry_run:  # tiny: whatever device there is, no compile
        args += ["--model.net.arch", "resnet18", "--model.net.head_hidden", "32", "--data.image_size", "64",
                 "--data.batch_size", "4", "--model.levers.compile", "false", "--trainer.accelerator", "auto",
                 "--data.num_workers", "1", "--data.fast_decode", "false"]
    else:
        args += ["--data.batch_size", str(BATCH), "--data.image_size", "224", "--trainer.accelerator", "gpu"]
        args += ["--data.num_workers", str(workers)] if workers else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "imgcls", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"imgcls fit exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(clock.read_text())


def main(quick: bool = False, dry_run: bool | None = None) -> dict:
    """Both data paths, one fit each. Quick or dry-run: tiny sizes on any device (a check, not a figure); a full run
    needs CUDA and is skipped without it."""
    dry_run = quick if dry_run is None else dry_run
    if not dry_run and not torch.cuda.is_available():
        return {"skipped": "no CUDA device on this machine", "needs": "cuda"}
    count, steps, warmup = (16, 4, 1) if dry_run else (16_500, 60, 20)
    if not dry_run and (steps + PROFILED) * BATCH > count:
        raise ValueError(f"{steps + PROFILED} steps of {BATCH} images take more than an epoch of {count}")
    root = photo_folder(count)
    more = max(1, detect().cores - 1)
    paths = {}
    with tempfile.TemporaryDirectory(prefix="imgcls-e2e-") as tmp:
        for name in PATHS:
            if dry_run and name in FULL_ONLY:
                continue
            out = Path(tmp) / name
            out.mkdir()
            clock = fit(root, out, augment_on_device=name == "augment_on_device", dry_run=dry_run, steps=steps,
                        warmup=warmup, workers=more if name == "cpu_decode_more" else None,
                        profile=PROFILED if name == "cpu_decode" else 0, data_class=DATA_CLASS.get(name))
            paths[name] = summarise(clock, warmup)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {"device": device, "dry_run": dry_run, "images": count, "steps": steps, "warmup": warmup,
            "workers": 1 if dry_run else choose_num_workers(detect(), "cuda")[0], "more_workers": more, "paths": paths,
            "each_step_synchronised": False}


def render(r: dict) -> tuple[str, str]:
    rows = [[PATHS[name], p["img_s"], f"{p['gpu_busy']:.0%}" if p["gpu_busy"] is not None else "no CUDA",
             p["step_ms"], p["augment_ms"], p["wait_ms"]] for name, p in r["paths"].items()]
    synchronised = r.get("each_step_synchronised", True)  # the records stored before 2026-11-27 14:00 UTC
    body = table(["data path", "img/s", "GPU busy", "step ms" if synchronised else "ms a step",
                  "on-device decode, augment, normalize ms", "loader wait ms" if synchronised else
                  "host between steps ms"], rows)
    if synchronised:
        body += ("\n\nTimed with a synchronisation after each step (the host could not queue a step ahead): "
                 "step ms is the step alone, the loader wait the rest of the gap between two steps.")
    for name, p in r["paths"].items():
        if p.get("slowest_step_ms", 0.0) > OUTLIER * p.get("median_step_ms", float("inf")):
            body += (f"\n\n{PATHS[name]}: a timed step took {p['slowest_step_ms']:,.0f} ms against a median of "
                     f"{p['median_step_ms']:,.1f} ms (a recompilation or a stall inside the timed steps).")
    for name, p in r["paths"].items():
        if "kernels" in p:
            k = p["kernels"]
            longest = "; ".join(f"`{row['name'][:60]}` {row['ms']:.3g} ms ({row['calls']:.3g} calls)"
                                for row in k["top"])
            body += (f"\n\n{PATHS[name]}, the {'device' if r['device'] != 'cpu' else 'host'}'s time in {k['steps']} "
                     f"steps after the timed ones (torch's profiler), a step: {k['ms']:.3g} ms in all; the longest "
                     f"{'kernels' if r['device'] != 'cpu' else 'operators'}: {longest}.")
    best = max(r["paths"], key=lambda name: r["paths"][name]["img_s"])
    body += (f"\n\nTarget on one H100 or H200: at least 5,000 img/s end to end (moonshot 7,000): "
             f"{r['paths'][best]['img_s']:,.0f} img/s ({PATHS[best]})."
             if not r["dry_run"] else "\n\nDry run: tiny sizes, a check that the path runs, not a figure.")
    return body, (f"{r['device']}, configs/imagenet_ddp8.yaml on one device through `imgcls fit`, "
                  f"{r['images']} photo-like 500x375 JPEGs, {r['workers']} loader workers"
                  + (f" ({r['more_workers']} in the row that says so)" if "cpu_decode_more" in r["paths"] else "")
                  + f", {r['steps']} steps of "
                  f"which {r['warmup']} warm-up")


def figures(r: dict) -> dict[str, str]:
    return {name: f"{p['img_s']:,.0f} img/s" for name, p in r["paths"].items()}

