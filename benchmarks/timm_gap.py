"""imgcls fit against timm's train.py in accuracy at equal steps, one difference at a time: what a gap is made of.

    TIMM_TRAIN_PY=/elsewhere/train.py python -m benchmarks.timm_gap   # writes LOG

An experiment, not a section of `make bench`: its log, LOG, is rendered under the timm section of docs/PERFORMANCE.md
(`note`, benchmarks.pages.EXPERIMENTS), with the command, commit and machine it came from.
The timm section (benchmarks.timm_peer) runs the quickstart's recipe with both programs on the demo digits, where one
validation image is 0.56 points of val/acc. Here the same recipe (train.py's flags from `timm_peer.peer_args`) runs on
MNIST-like digits (`build_digits`, 1,800 validation images) for each of SEEDS: train.py, imgcls fit as it ships, then
imgcls moved toward train.py one difference at a time (VARIANTS), then with all of them at once. The differences are
what the two programs' flags cannot say alike: the network's start (timm zero-inits the last BatchNorm of each
residual block), its head (timm: dropout, then one Linear), the resize (timm: PIL, bicubic) and the learning-rate
schedule (timm: whole warm-up epochs from 1e-5, the cosine over the whole run). What the flags set alike is not
varied: no normalisation (/255 on both sides), label smoothing 0.1 (timm's LabelSmoothingCrossEntropy is torch's
label_smoothing), no weight decay on biases and norm weights (both leave out the 1-D parameters: the same set in a
ResNet); the order the data is drawn in is a seed's, so its effect is the spread over seeds.

Accuracy only: the runs go two at a time, one thread each, and their times are not compared (benchmarks.timm_peer
times the programs).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torchvision.transforms.v2 import functional as F

from benchmarks import provenance
from benchmarks.common import auto_cpu_precision, machine_info, table
from benchmarks.records import RESULTS
from benchmarks.time_to_accuracy import RECIPE, ROOT, clock_records, timed
from benchmarks.timm_peer import PEER_ENV, QUICK_RECIPE, peer_args, peer_version, run_timm
from lightning_modules.network import BackboneWithHead

TITLE = "Accuracy against timm's train.py, one difference at a time"
LOG = RESULTS / "experiments" / "timm_gap.json"
SEEDS = (1, 2, 3)
PARALLEL = 2  # runs at a time, one thread each
TIMM = "timm train.py"
SHIPPED = "imgcls fit, as shipped"
WITHOUT_START = "imgcls fit, without timm's start"
SINGLE = "... with timm's "
ALL_OF_TIMM = "imgcls fit, all four of timm's"
NO_ZERO = ["--model.net.init_args.zero_init_residual", "false"]
HEAD = ["--model.net.class_path", "benchmarks.timm_gap.TimmHead", "--model.net.init_args.head_hidden", "0"]
BICUBIC = [f"--data.{split}_transform.class_path=benchmarks.timm_gap.PILResize" for split in ("train", "eval")]
SCHEDULE = ["--model.lr_scheduler.class_path", "benchmarks.timm_gap.TimmCosine",
            "--model.lr_scheduler.init_args.warmup_epochs", "1"]
# Setting -> imgcls fit's flags on top of configs/quickstart.yaml. Each single difference is taken from where the gap
# was found, imgcls without timm's start (the shipped network has it since): the start alone, then each other one.
VARIANTS = {
    SHIPPED: [],
    WITHOUT_START: NO_ZERO,
    SINGLE + "head": HEAD + NO_ZERO,
    SINGLE + "resize": BICUBIC + NO_ZERO,
    SINGLE + "schedule": SCHEDULE + NO_ZERO,
    "imgcls fit, as shipped but timm's head": HEAD,  # the matched setting of the head: both start as timm's
    ALL_OF_TIMM: HEAD + BICUBIC + SCHEDULE,
}
QUICK_VARIANTS = (SHIPPED, ALL_OF_TIMM)
SIDE = 28  # MNIST's


class TimmHead(BackboneWithHead):
    """timm's ResNet head on the shipped backbone (`head_hidden` 0): dropout (train.py's --drop), then one Linear."""

    def __init__(self, num_classes: int, arch: str = "resnet50", head_hidden: int = 0, dropout: float = 0.2,
                 zero_init_residual: bool = True) -> None:
        if head_hidden:
            raise ValueError("TimmHead is the head without a hidden layer: head_hidden must be 0")
        super().__init__(num_classes, arch=arch, head_hidden=0, dropout=dropout,
                         zero_init_residual=zero_init_residual)
        self.head = nn.Sequential(nn.Dropout(dropout), self.head)


class TimmCosine(LambdaLR):
    """timm's CosineLRScheduler as train.py builds it with --sched-on-updates: step t < warm-up (whole epochs) goes
    linearly from 1e-5 (its --warmup-lr) towards the peak, then the cosine runs over the whole run (no warm-up prefix:
    it starts below the peak) to zero."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_epochs: int = 1, warmup_lr: float = 1e-5,
                 total_steps: int | None = None, steps_per_epoch: int | None = None) -> None:
        self.warmup, self.total, self.warmup_lr = warmup_epochs * steps_per_epoch, total_steps, warmup_lr
        peaks = [group["lr"] for group in optimizer.param_groups]
        super().__init__(optimizer, [lambda t, peak=peak: self.factor(t, peak) for peak in peaks])

    def factor(self, t: int, peak: float) -> float:
        if t < self.warmup:
            return (self.warmup_lr + t * (peak - self.warmup_lr) / self.warmup) / peak
        return 0.0 if t >= self.total else 0.5 * (1 + math.cos(math.pi * t / self.total))


class PILResize:
    """Resize to a square with PIL's bicubic filter, as train.py's transforms do on PIL images: uint8 (3, S, S)."""

    def __init__(self, image_size: int = 32) -> None:
        self.image_size = image_size
        self.mean, self.std = [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]  # /255 only, as the quickstart's preset none

    def __call__(self, image):
        if isinstance(image, torch.Tensor):
            image = F.to_pil_image(image)
        return F.pil_to_tensor(image.resize((self.image_size, self.image_size), Image.BICUBIC))


def _render(drawing: np.ndarray, rng: np.random.Generator) -> Image.Image:
    """A white digit on black, 28 px: the 8x8 drawing scaled to 16-24 px, rotated up to 15 degrees, placed at random,
    light noise."""
    side = int(rng.integers(16, 25))
    mask = Image.fromarray((drawing * (255.0 / 16.0)).astype(np.uint8), mode="L").resize((side, side), Image.BICUBIC)
    mask = np.asarray(mask.rotate(float(rng.uniform(-15, 15)), resample=Image.BILINEAR, expand=True), dtype=np.float32)
    h, w = min(mask.shape[0], SIDE), min(mask.shape[1], SIDE)
    canvas = np.zeros((SIDE, SIDE), np.float32)
    top, left = rng.integers(0, SIDE - h + 1), rng.integers(0, SIDE - w + 1)
    canvas[top:top + h, left:left + w] = mask[:h, :w]
    canvas += rng.normal(0, 8, canvas.shape)
    return Image.fromarray(np.clip(canvas, 0, 255).round().astype(np.uint8), mode="L")


def build_digits(out: Path, train_renders: int = 2, val_renders: int = 5, seed: int = 0) -> Path:
    """MNIST-like digits from the bundled drawings as an image folder: split 80/20 by drawing (stratified), each
    training drawing rendered `train_renders` times, each held-out one `val_renders` times (1,800 images)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    done = out / ".complete"
    if done.is_file():
        return out
    digits = load_digits()
    index = np.arange(len(digits.target))
    train, val = train_test_split(index, train_size=0.8, stratify=digits.target, random_state=seed)
    for split_no, (split, pool, renders) in enumerate((("train", train, train_renders), ("val", val, val_renders))):
        for i in pool:
            folder = out / split / str(digits.target[i])
            folder.mkdir(parents=True, exist_ok=True)
            for k in range(renders):
                rng = np.random.default_rng([seed, split_no, int(i), k])
                _render(digits.images[i], rng).save(folder / f"{i:04d}-{k}.png")
    done.touch()
    return out


def run_imgcls(data: Path, out: Path, recipe: dict, seed: int, flags: list[str], env: dict) -> dict:
    """`imgcls fit --config configs/quickstart.yaml` with `flags`, no checkpoints: val/acc per epoch and the steps."""
    args = [sys.executable, "-m", "imgcls", "fit", "--config", str(ROOT / "configs/quickstart.yaml"),
            "--data.root", str(data), "--trainer.default_root_dir", str(out), "--seed_everything", str(seed),
            "--trainer.callbacks=[]", "--trainer.enable_checkpointing=false",
            "--trainer.callbacks+=benchmarks.time_to_accuracy.EpochClock", *flags,
            "--model.net.init_args.arch", recipe["arch"], "--trainer.max_epochs", str(recipe["epochs"])]
    clock = out / "clock.jsonl"
    timed(args, clock=clock, env=env)
    records = clock_records(clock)
    return {"val_acc": [r["val_acc"] for r in records], "steps": records[-1]["step"]}


def main(quick: bool = False) -> dict:
    peer = os.environ.get(PEER_ENV)
    if not peer:
        return {"skipped": f"no peer script (set {PEER_ENV} to a copy of timm's train.py)", "needs": "peer"}
    peer = Path(peer).resolve()
    if not peer.is_file() or ROOT in peer.parents:
        raise ValueError(f"{PEER_ENV}={peer}: give the path of timm's train.py, kept outside the project")
    recipe = QUICK_RECIPE if quick else RECIPE
    seeds = SEEDS[:1] if quick else SEEDS
    variants = {name: VARIANTS[name] for name in (QUICK_VARIANTS if quick else VARIANTS)}
    data = build_digits(Path(tempfile.gettempdir()) / "imgcls-bench-mnistlike")
    bf16 = auto_cpu_precision() == "bf16-mixed"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(PARALLEL) as pool:
        def one(name: str, seed: int) -> dict:
            out = Path(tmp) / f"{[TIMM, *variants].index(name)}-{seed}"
            found = (run_timm(peer, data, out, recipe, seed, bf16, env) if name == TIMM
                     else run_imgcls(data, out, recipe, seed, variants[name], env))
            return {"seed": seed, "val_acc": found["val_acc"], "steps": found["steps"]}

        jobs = {name: [pool.submit(one, name, seed) for seed in seeds] for name in (TIMM, *variants)}
        runs = {name: [job.result() for job in found] for name, found in jobs.items()}
    images = {split: sum(1 for _ in (data / split).rglob("*.png")) for split in ("train", "val")}
    return {"recipe": recipe, "quick": quick, "peer": peer_version(peer), "bf16_cpu": bf16, "images": images,
            "flags": variants, "runs": runs,
            "peer_args": peer_args(recipe, Path("DATA"), Path("OUT"), seeds[0], bf16)}


def _best(runs: list[dict]) -> list[float]:
    return [max(run["val_acc"]) for run in runs]


def medians(results: dict) -> dict[str, float]:
    """Each setting's median over the seeds of its runs' best val/acc."""
    return {name: statistics.median(_best(runs)) for name, runs in results["runs"].items()}


def _points(difference: float) -> str:
    """A difference of val/acc in points, signed; float32 against exact fractions gives no "-0.00"."""
    return f"{round(100 * difference, 2) + 0.0:+.2f}"


def render(results: dict) -> tuple[str, str]:
    median = medians(results)
    timm = median[TIMM]
    rows = []
    for name, runs in results["runs"].items():
        best = _best(runs)
        flags = " ".join(results["flags"].get(name, [])) if name != TIMM else ""
        rows.append([name, f"`{flags}`" if flags else "", " / ".join(f"{b:.4f}" for b in best),
                     f"{median[name]:.4f} ({min(best):.4f}-{max(best):.4f})",
                     "" if name == TIMM else _points(median[name] - timm)])
    body = table(["setting", "imgcls fit's flags on configs/quickstart.yaml", "best val/acc, seed by seed",
                  "median (min-max)", "median - timm's, points"], rows)
    return body + "\n\n" + _gap(results, median), _settings(results)


def _gap(results: dict, median: dict[str, float]) -> str:
    """What the gap is made of, in points of val/acc between medians: from imgcls without timm's start, each of
    timm's settings on its own; then imgcls as shipped and with all four at once, against train.py."""
    def points(name: str, against: str = TIMM) -> str:
        return _points(median[name] - median[against])

    text = (f"One validation image is {100 / results['images']['val']:.2f} points of val/acc; medians over "
            f"{len(results['runs'][TIMM])} seeds. ")
    if WITHOUT_START in median:
        singles = [f"its {name.removeprefix(SINGLE)} {points(name, WITHOUT_START)}" for name in median
                   if name.startswith(SINGLE)]
        text += (f"Without timm's start imgcls fit is {points(WITHOUT_START)} points against timm's train.py; each "
                 f"of timm's settings on its own moves that by: its start {points(SHIPPED, WITHOUT_START)}, "
                 + ", ".join(singles) + ". ")
    return text + (f"imgcls fit as shipped (with timm's start): {points(SHIPPED)} points against timm's train.py"
                   + (f"; with all four of timm's settings at once: {points(ALL_OF_TIMM)}." if ALL_OF_TIMM in median
                      else "."))


def _settings(results: dict) -> str:
    return (f"timm's {results['peer']}, unmodified, against configs/quickstart.yaml ({results['recipe']['arch']} "
            f"from scratch, {results['recipe']['image_size']} px, batch {results['recipe']['batch']}, AdamW, "
            f"{results['recipe']['epochs']} epochs) on MNIST-like digits (benchmarks.timm_gap.build_digits, "
            f"{results['images']['train']:,} training and {results['images']['val']:,} validation PNGs); "
            f"seeds {', '.join(str(run['seed']) for run in results['runs'][TIMM])}; best val/acc of each run; "
            f"{PARALLEL} runs at a time, one thread each; the flags of timm's train.py: "
            + " ".join(results["peer_args"]) + " (--seed: each run's)"
            + (" (quick: resnet18, 1 epoch)" if results["quick"] else ""))


def figures(results: dict) -> dict[str, str]:
    """Median best val/acc of train.py, of imgcls as shipped and with all of timm's settings; the shipped gap."""
    median = medians(results)
    found = {"timm_acc": f"{100 * median[TIMM]:.2f}%", "shipped_acc": f"{100 * median[SHIPPED]:.2f}%",
             "shipped_minus_timm": f"{_points(median[SHIPPED] - median[TIMM])} points"}
    if ALL_OF_TIMM in median:
        found["all_of_timm_acc"] = f"{100 * median[ALL_OF_TIMM]:.2f}%"
    return found


def note(log: Path = LOG) -> str:
    """The experiment's table and what the gap is made of, from its log, with where the log came from."""
    if not log.is_file():
        shown = log.relative_to(ROOT) if log.is_relative_to(ROOT) else log
        return f"### {TITLE}\n\nNot measured: no {shown} (`python -m benchmarks.timm_gap`)."
    from benchmarks.pages import origin

    record = json.loads(log.read_text())
    body, settings = render(record["results"])
    how = record["provenance"].get("how")
    return (f"### {TITLE}\n\n{body}\n\n_{settings}. Machine: {record['machine']['line']}._\n\n"
            f"_Measured by {origin(record)}{f': {how}' if how else ''}; started {record['started']}._")


if __name__ == "__main__":
    state = provenance.tree_state()  # before the runs
    started = datetime.now(UTC)
    with provenance.captured_log() as tail:
        results = main()
    LOG.parent.mkdir(parents=True, exist_ok=True)
    LOG.write_text(json.dumps({"experiment": "timm_gap", "started": f"{started:%Y-%m-%d %H:%M} UTC",
                               "machine": machine_info(), "results": results,
                               "provenance": provenance.provenance(state, list(tail))}, indent=1) + "\n")
