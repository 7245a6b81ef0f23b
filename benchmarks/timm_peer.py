"""timm's own train.py against `imgcls fit`: the quickstart's recipe run by both, at equal optimizer steps.

    TIMM_TRAIN_PY=/elsewhere/train.py python -m benchmarks.run --only timm_peer

timm's train.py is not in its wheel. It runs unmodified, read from timm's public repository at a release tag whose
imports the installed timm serves (`git show v1.0.28:train.py > /elsewhere/train.py`), and it stays outside this
project: its path comes from $TIMM_TRAIN_PY (`--peer` sets it). Without one the section records "not measured: no
peer script".

Both programs read the same PNG files of the demo digits as an image folder and train the quickstart's recipe
(`peer_args` maps it onto train.py's flags, the one place they are kept), each in a process of its own timed from its
launch to its exit. The pairs are interleaved, the order swapped every repetition, so that a busy spell of a shared
machine falls on both; the ratio is taken within each pair. On a CPU with native bf16 the other kind, AVX2 without
it, is estimated on the same machine: torch's own kernels and oneDNN's (the convolutions) both held to AVX2
(ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2, as benchmarks.common.KERNEL_LIMITS names them) and fp32 on both
sides, as `auto` picks there. An estimate: it cannot model another CPU's clock, caches or memory, nor libraries that
probe the CPU themselves.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import statistics
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.common import KERNEL_LIMITS, NOT_MODELLED, auto_cpu_precision, table, verdict
from benchmarks.time_to_accuracy import RECIPE, ROOT, clock_records, timed
from datamodules.demo import build_demo_data

TITLE = "imgcls fit against timm's train.py"
PEER_ENV = "TIMM_TRAIN_PY"
KINDS_ENV = "TIMM_PEER_KINDS"  # the kinds a run measures, comma-separated (`--kinds` sets it); default both
TARGET = 1.0  # imgcls' wall time at most this many times train.py's, at equal steps and accuracy at least equal
REPS = {"native": 4, "avx2_estimate": 3}  # interleaved pairs per kind, one seed each: accuracy is compared over 3 or
# more seeds (180 validation images make one image 0.56 points of val/acc: the native kind, the faster, runs more)
TIMM = "timm train.py"
IMGCLS = "imgcls fit"
NATIVE = "this CPU, as `auto` picks"
AVX2_ESTIMATE = f"AVX2 estimate: {', '.join(f'{k}={v}' for k, v in KERNEL_LIMITS.items())}, fp32"
QUICK_RECIPE = dict(RECIPE, arch="resnet18", epochs=1)


def peer_args(recipe: dict, data: Path, out: Path, seed: int, bf16: bool) -> list[str]:
    """train.py's flags for the quickstart's recipe. What its flags cannot say alike: the head (timm's one linear
    layer after dropout, imgcls' 1024-unit hidden layer before it), the resize (PIL's bicubic filter in train.py) and
    the warm-up, whole epochs in train.py (0.5 rounded up to 1) from 1e-5; benchmarks.timm_gap measures each on its
    own. Its own defaults stay: a checkpoint at every epoch, top-1 ranked."""
    size = recipe["image_size"]
    return [
        "--data-dir", str(data), "--train-split", "train", "--val-split", "val",  # the same PNG files
        "--model", recipe["arch"], "--num-classes", "10", "--drop", str(recipe["dropout"]),  # from scratch
        "--input-size", "3", str(size), str(size), "--crop-pct", "1.0",  # evaluated at the side trained, uncropped
        "--no-aug", "--mean", "0", "0", "0", "--std", "1", "1", "1",  # the quickstart's preset none: resize, /255
        "-b", str(recipe["batch"]), "--opt", "adamw", "--lr", str(recipe["lr"] * recipe["batch"] / 256),  # linear
        "--weight-decay", str(recipe["weight_decay"]), "--opt-betas", *map(str, recipe["betas"]),
        "--sched", "cosine", "--sched-on-updates", "--epochs", str(recipe["epochs"]),
        "--warmup-epochs", str(math.ceil(recipe["warmup_epochs"])), "--smoothing", str(recipe["label_smoothing"]),
        "--channels-last", *(["--amp", "--amp-dtype", "bfloat16"] if bf16 else []),
        "--device", "cpu", "-j", "1", "--seed", str(seed), "--output", str(out), "--experiment", "run",
    ]


def run_timm(peer: Path, data: Path, out: Path, recipe: dict, seed: int, bf16: bool, env: dict) -> dict:
    """train.py in a process of its own, from a folder outside the project: seconds, CPU seconds, val/acc per epoch
    (its summary.csv) and the optimizer steps it took (epochs x the batches per epoch its log names)."""
    out.mkdir(parents=True)
    args = [sys.executable, str(peer), *peer_args(recipe, data, out, seed, bf16)]
    proc, process = timed(args, cwd=out, env=env)
    per_epoch = {int(n) for n in re.findall(r"Train: \d+ \[\s*\d+/(\d+)", proc.stdout + proc.stderr)}
    with open(out / "run" / "summary.csv", newline="") as f:
        acc = [float(row["eval_top1"]) / 100 for row in csv.DictReader(f)]
    assert len(per_epoch) == 1, per_epoch
    return {**process, "val_acc": acc, "steps": per_epoch.pop() * len(acc)}


def run_imgcls(data: Path, out: Path, recipe: dict, seed: int, precision: str | None, env: dict) -> dict:
    """`imgcls fit --config configs/quickstart.yaml` as a user runs it, plus a clock callback that records each
    validation: seconds, CPU seconds, val/acc per epoch and the optimizer steps."""
    args = [sys.executable, "-m", "imgcls", "fit", "--config", str(ROOT / "configs/quickstart.yaml"),
            "--data.root", str(data), "--trainer.default_root_dir", str(out), "--seed_everything", str(seed),
            "--trainer.callbacks+=benchmarks.time_to_accuracy.EpochClock"]
    if recipe["arch"] != RECIPE["arch"]:  # quick
        args += ["--model.net.arch", recipe["arch"], "--trainer.max_epochs", str(recipe["epochs"])]
    if precision:
        args += ["--trainer.precision", precision]
    clock = out / "clock.jsonl"
    _, process = timed(args, clock=clock, env=env)
    records = clock_records(clock)
    return {**process, "val_acc": [r["val_acc"] for r in records], "steps": records[-1]["step"]}


def kinds() -> dict[str, dict]:
    """The CPU kinds measured here: this one as `auto` picks, and on a bf16 CPU the AVX2 estimate."""
    bf16 = auto_cpu_precision() == "bf16-mixed"
    found = {NATIVE: {"key": "native", "bf16": bf16, "precision": None, "env": {}, "reps": REPS["native"]}}
    if bf16:
        found[AVX2_ESTIMATE] = {"key": "avx2_estimate", "bf16": False, "precision": "32-true",
                                "env": KERNEL_LIMITS, "reps": REPS["avx2_estimate"]}
    return found


def kept_runs(recipe: dict, measured: set[str]) -> tuple[dict, dict]:
    """The other kinds' runs in this machine's stored record of the same recipe (a run of one kind keeps the other's),
    and when each was measured."""
    from benchmarks import records
    from benchmarks.common import machine_info

    path = records.RESULTS / "machines" / records.machine_slug(machine_info()) / "timm_peer.json"
    record = json.loads(path.read_text()) if path.is_file() else {}
    results = record.get("results", {})
    if record.get("mode") != "full" or results.get("recipe") != json.loads(json.dumps(recipe)):  # tuples: lists
        return {}, {}
    runs = {kind: sides for kind, sides in results["runs"].items() if kind not in measured}
    started = {kind: results.get("measured", {}).get(kind, record["started"]) for kind in runs}
    return runs, started


def main(quick: bool = False) -> dict:
    peer = os.environ.get(PEER_ENV)
    if not peer:
        return {"skipped": f"no peer script (set {PEER_ENV} to a copy of timm's train.py)", "needs": "peer"}
    peer = Path(peer).resolve()
    if not peer.is_file():
        raise FileNotFoundError(f"{PEER_ENV}={peer} is not a file: give the path of timm's train.py")
    if ROOT in peer.parents:
        raise ValueError(f"{PEER_ENV}={peer} lies inside the project; keep timm's train.py outside it")
    recipe = QUICK_RECIPE if quick else RECIPE
    wanted = os.environ.get(KINDS_ENV, "native,avx2_estimate").split(",")
    todo = {kind: how for kind, how in kinds().items() if how["key"] in wanted}
    kept, measured = kept_runs(recipe, set(todo)) if not quick else ({}, {})
    data = build_demo_data(Path(tempfile.gettempdir()) / f"imgcls-bench-digits-{recipe['image_size']}",
                           size=recipe["image_size"])
    runs: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        warm = QUICK_RECIPE
        # Untimed: the first process after a while reads torch's libraries from disk, and imgcls's first fit writes
        # the data's scan cache; neither should fall on whichever side happens to run first.
        run_timm(peer, data, tmp / "warm-timm", warm, 0, False, dict(os.environ))
        run_imgcls(data, tmp / "warm-imgcls", warm, 0, "32-true", dict(os.environ))
        for kind, how in todo.items():
            runs[kind] = {TIMM: [], IMGCLS: []}
            env = dict(os.environ, **how["env"])
            for rep in range(1 if quick else how["reps"]):
                seed = RECIPE["seed"] + rep
                sides = (TIMM, IMGCLS) if rep % 2 == 0 else (IMGCLS, TIMM)  # ABBA: neither side always goes first
                for side in sides:
                    out = tmp / f"{len(runs)}-{rep}-{side.split()[0]}"
                    runs[kind][side].append(
                        run_timm(peer, data, out, recipe, seed, how["bf16"], env) if side == TIMM
                        else run_imgcls(data, out, recipe, seed, how["precision"], env))
    now = f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC"
    measured |= dict.fromkeys(runs, now)
    runs = {kind: runs.get(kind) or kept[kind] for kind in kinds() if kind in runs or kind in kept}
    bf16 = kinds()[NATIVE]["bf16"]
    shown = peer_args(recipe, Path("DATA"), Path("OUT"), RECIPE["seed"], bf16)
    return {"recipe": recipe, "quick": quick, "peer": peer_version(peer), "runs": runs, "peer_args": shown,
            "bf16_cpu": bf16, "measured": {kind: measured[kind] for kind in runs}}


def peer_version(peer: Path) -> str:
    """The installed timm's version: what train.py imported."""
    import timm

    return f"train.py ({peer.stat().st_size:,} bytes) with timm {timm.__version__}"


def _ratios(kind: dict[str, list[dict]]) -> list[float]:
    """imgcls' seconds over train.py's, within each interleaved pair."""
    return [b["seconds"] / a["seconds"] for a, b in zip(kind[TIMM], kind[IMGCLS], strict=True)]


def _median(runs: list[dict], key) -> float:
    return statistics.median(key(r) for r in runs)


def _best(runs: list[dict]) -> list[float]:
    """Each run's best val/acc, in seed order (the runs of a side are seeds RECIPE["seed"], +1, ...)."""
    return [max(r["val_acc"]) for r in runs]


def _summary(kind: dict[str, list[dict]]) -> dict[str, float]:
    ratios = _ratios(kind)
    best = {side: statistics.median(_best(kind[side])) for side in (TIMM, IMGCLS)}
    return {"ratio": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "best": best,
            "met": statistics.median(ratios) <= TARGET and best[IMGCLS] >= best[TIMM]}


def _row(side: str, runs: list[dict]) -> list:
    best = _best(runs)
    return [side, len(runs), f"{_median(runs, lambda r: r['seconds']):.1f} s",
            f"{_median(runs, lambda r: r['cpu_seconds']):.1f} s", _median(runs, lambda r: r["steps"]),
            f"{statistics.median(best):.4f} ({min(best):.4f}-{max(best):.4f})",
            " / ".join(f"{b:.4f}" for b in best), f"{_median(runs, lambda r: r['val_acc'][-1]):.4f}",
            ", ".join(f"{r['seconds']:.0f} s" for r in runs)]


def render(results: dict) -> tuple[str, str]:
    """The tables of the kinds this code measures: rows stored under another kind's name (an estimate that held
    torch's kernels alone) do not measure what the section claims, and stay off the page."""
    parts = []
    for kind, sides in results["runs"].items():
        if kind not in (NATIVE, AVX2_ESTIMATE):
            continue
        rows = [_row(side, runs) for side, runs in sides.items()]
        s = _summary(sides)
        when = results.get("measured", {}).get(kind)
        parts.append(f"{kind}{f' (measured {when})' if when else ''}:\n\n"
                     + table(["program", "runs", "wall time, launch to exit (median)", "CPU time (median)",
                              "optimizer steps", "best val/acc, median (min-max)", "best val/acc, seed by seed",
                              "final val/acc (median)", "each run"], rows)
                     + f"\n\nimgcls / timm wall time, within each pair: median {s['ratio']:.2f}x (from {s['min']:.2f}x "
                       f"to {s['max']:.2f}x, {len(_ratios(sides))} pairs). Target, at most {TARGET}x with best "
                       f"val/acc at least equal (medians): {verdict(s['met'])}."
                     + (f" An estimate of the AVX2 kind: {NOT_MODELLED}." if kind == AVX2_ESTIMATE else ""))
    if results.get("bf16_cpu") and AVX2_ESTIMATE not in results["runs"]:
        parts.append(f"{AVX2_ESTIMATE}: not measured yet (`{KINDS_ENV}=avx2_estimate python -m benchmarks.run --only "
                     "timm_peer` measures it and keeps the rows above).")
    elif AVX2_ESTIMATE not in results["runs"]:
        parts.append(f"{AVX2_ESTIMATE}: not measured (this CPU has no native bf16: the row above is the AVX2 kind; "
                     "the bf16 kind is not measured here).")
    recipe = results["recipe"]
    settings = (f"timm's {results['peer']}, unmodified, against configs/quickstart.yaml ({recipe['arch']} from "
                f"scratch, {recipe['image_size']} px, batch {recipe['batch']}, AdamW, {recipe['epochs']} epochs) on "
                "the demo digits' PNG files; timm's train.py with one loader process, imgcls with its `auto` levers; "
                f"seeds {RECIPE['seed']} onwards, one per pair; each run a process of its own, timed from launch to "
                "exit, pairs interleaved with the order swapped each time; the flags of timm's train.py: "
                + " ".join(results["peer_args"]) + (" (quick: resnet18, 1 epoch)" if results["quick"] else "")
                + ("; the AVX2 estimate's without --amp --amp-dtype bfloat16 (fp32 on both sides)"
                   if "--amp" in results["peer_args"] and AVX2_ESTIMATE in results["runs"] else ""))
    return "\n\n".join(parts), settings


def figures(results: dict) -> dict[str, str]:
    """The median ratio of wall times and both best val/acc, per kind (`native`, and `avx2_estimate` where run)."""
    found = {}
    for kind, key in ((NATIVE, "native"), (AVX2_ESTIMATE, "avx2_estimate")):
        if kind in results["runs"]:
            s = _summary(results["runs"][kind])
            found |= {f"{key}_ratio": f"{s['ratio']:.2f}x", f"{key}_spread": f"{s['min']:.2f}x-{s['max']:.2f}x",
                      f"{key}_timm_acc": f"{100 * s['best'][TIMM]:.1f}%",
                      f"{key}_imgcls_acc": f"{100 * s['best'][IMGCLS]:.1f}%"}
    return found


