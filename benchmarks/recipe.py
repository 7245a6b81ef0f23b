"""Recipe ablation: each torchvision V2 recipe ingredient on and off, on the cluttered digits, medians over seeds.

    python -m benchmarks.run --only recipe [--quick]

Every variant is `imgcls fit --config configs/quickstart.yaml` (resnet18 for time, the quickstart's head, optimizer
at a lower rate, and schedule) on benchmarks/cluttered_digits.py's images, the same epochs and seeds, with one
ingredient added; the last variant adds them all. The runs are long enough for the baseline to overfit, so that
regularising can pay: each run records its validation curve and its train accuracy (on the batches it trained on),
and the table's notes are computed from them. The EMA averages from the end of the LR warm-up with the decay fitted
to the run (training.callbacks.EMA). FixRes is left out, and the record says why: it needs a last feature map that
grows with the evaluation side, which a 32 px ResNet does not have.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import lightning as L
import torch
import torchvision
import yaml
from torch import nn

from benchmarks import cluttered_digits
from benchmarks.common import table
from benchmarks.time_to_accuracy import ROOT, _seconds_per_epoch, clock_records, timed
from training.callbacks import EMA

TITLE = "Recipe ablation"
METHOD = 2  # the cluttered digits, EMA from the warm-up's end, no FixRes row (was: the demo digits for 4 epochs)
# One seed and 20 epochs fit the run into a session on a shared 2-core CPU; a lent GPU can afford more seeds.
EPOCHS, SEEDS = 20, (0,)
ARCH, SIDE = "resnet18", 32
# Per 256 images: at the quickstart's rate the TrivialAugment runs stayed at chance through every epoch on this data.
LR = 0.004
DATA = {"train_renders": 2, "val_renders": 5}  # cluttered_digits.build's
BASELINE = "baseline: quickstart recipe (label smoothing 0.1) at a lower lr"
EMA_ROW = "+ EMA of the weights (from the warm-up's end, decay fitted to the run)"
EMA_ARGS = ["--trainer.callbacks+=training.callbacks.EMA", "--trainer.callbacks.decay=null"]
REPEATS = 3
RA_ROW = f"+ repeated augmentation x{REPEATS}"
INGREDIENTS: dict[str, list[str]] = {
    BASELINE: [],
    "+ TrivialAugmentWide": ["--data.train_transform.auto_augment", "trivialaugment"],
    "+ random erasing 0.1": ["--data.train_transform.random_erasing", "0.1"],
    "+ mixup 0.2 / CutMix 1.0": ["--model.recipe.mixup_alpha", "0.2", "--model.recipe.cutmix_alpha", "1.0"],
    EMA_ROW: EMA_ARGS,
    RA_ROW: ["--data.repeated_augmentation", str(REPEATS)],
    "all of the above": ["--data.train_transform.auto_augment", "trivialaugment",
                         "--data.train_transform.random_erasing", "0.1",
                         "--model.recipe.mixup_alpha", "0.2", "--model.recipe.cutmix_alpha", "1.0", *EMA_ARGS,
                         "--data.repeated_augmentation", str(REPEATS)],
}
QUICK = ["all of the above"]  # checks that every ingredient runs together
FIXRES_SIDES = (SIDE, 40)  # the evaluation side a FixRes row would add here


class RunFacts(L.Callback):
    """Appends to $BENCH_CLOCK.facts: the EMA's resolved decay, interval and steps at the fit's start, and the train
    accuracy at each epoch's end. Listed after the EMA, whose own start resolves them first."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for ema in (c for c in trainer.callbacks if isinstance(c, EMA)):
            self._write({"ema": {"decay": ema.run_decay, "every": ema.update_every_n_steps,
                                 "start_step": ema.start_step, "total_steps": int(trainer.estimated_stepping_batches)}})

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write({"epoch": trainer.current_epoch + 1, "train_acc": float(trainer.callback_metrics["train/acc"])})

    @staticmethod
    def _write(fact: dict) -> None:
        with open(os.environ["BENCH_CLOCK"] + ".facts", "a") as f:
            f.write(json.dumps(fact) + "\n")


def fit(data: Path, run_dir: Path, extra: list[str], seed: int, epochs: int, quick: bool) -> dict:
    """One `imgcls fit`: {val_acc, train_acc (last epoch), best_val_acc, s_per_epoch, curve (val/acc per epoch)}, and
    the EMA's settings where it has one."""
    args = [sys.executable, "-m", "imgcls", "fit", "--config", str(ROOT / "configs/quickstart.yaml"),
            "--data.root", str(data), "--trainer.default_root_dir", str(run_dir), "--seed_everything", str(seed),
            "--model.net.arch", ARCH, "--model.optimizer.init_args.lr", str(LR), "--data.image_size", str(SIDE),
            "--trainer.max_epochs", str(epochs),
            "--trainer.enable_progress_bar", "false",
            "--trainer.enable_checkpointing", "false", "--trainer.callbacks=[]",
            "--trainer.callbacks+=benchmarks.time_to_accuracy.EpochClock", *extra,
            "--trainer.callbacks+=benchmarks.recipe.RunFacts"]
    if quick:
        args += ["--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "2", "--data.num_workers", "0",
                 "--data.batch_size", "16"]
    clock = run_dir / "clock.jsonl"
    proc, _ = timed(args, clock=clock)
    records = clock_records(clock)
    facts = [json.loads(line) for line in Path(f"{clock}.facts").read_text().splitlines()]
    ema = next((f["ema"] for f in facts if "ema" in f), None)
    if ema is not None and "fitted to the run" not in proc.stdout + proc.stderr:
        raise RuntimeError(f"{run_dir}: the EMA did not announce its fitted decay")
    curve = [r["val_acc"] for r in records]
    return {"val_acc": curve[-1], "best_val_acc": max(curve), "curve": curve,
            "train_acc": [f["train_acc"] for f in facts if "train_acc" in f][-1],
            "s_per_epoch": _seconds_per_epoch(records), **({"ema": ema} if ema else {})}


def last_feature_side(arch: str, side: int) -> int:
    """The side of `arch`'s last feature map (before the global pool) for `side` px input."""
    net = getattr(torchvision.models, arch)()
    features = nn.Sequential(*list(net.children())[:-2]).eval()
    with torch.no_grad():
        return int(features(torch.zeros(1, 3, side, side)).shape[-1])


def fixres_sizes() -> dict[str, dict[str, int]]:
    """The FixRes row's sides here and the V2 recipe's (configs/recipes/torchvision_v2.yaml), each with the side of
    the last feature map of the network it would run: FixRes pays where that map grows with the evaluation side."""
    v2 = yaml.safe_load((ROOT / "configs/recipes/torchvision_v2.yaml").read_text())["data"]
    recipe = (v2["train_transform"]["init_args"]["image_size"], v2["eval_transform"]["init_args"]["image_size"])
    return {"here": {str(s): last_feature_side(ARCH, s) for s in FIXRES_SIDES},
            "torchvision_v2": {str(s): last_feature_side("resnet50", s) for s in recipe}}


def measure(quick: bool) -> dict:
    names = QUICK if quick else list(INGREDIENTS)
    seeds, epochs = ((0,), 1) if quick else (SEEDS, EPOCHS)
    data_settings = {"train_renders": 1, "val_renders": 1} if quick else DATA
    runs: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        data = cluttered_digits.build(Path(tmp) / "cluttered", **data_settings)
        counts = json.loads((data / cluttered_digits.MANIFEST).read_text())["counts"]
        for seed in seeds:  # seed-major: a slow spell of the machine falls on every variant alike
            for k, name in enumerate(names):
                print(f"recipe: seed {seed}, {name}", flush=True)
                runs[name].append(fit(data, Path(tmp) / f"s{seed}-v{k}", INGREDIENTS[name], seed, epochs, quick))
    quickstart = yaml.safe_load((ROOT / "configs/quickstart.yaml").read_text())["model"]["optimizer"]["init_args"]
    return {"epochs": epochs, "seeds": list(seeds), "arch": ARCH, "image_size": SIDE, "repeats": REPEATS,
            "lr": LR, "quickstart_lr": quickstart["lr"],
            "data": {**data_settings, "side": cluttered_digits.SIDE, **counts}, "fixres": fixres_sizes(),
            "runs": runs}


def _median(per_seed: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in per_seed)


def _why(name: str, per_seed: list[dict], base: list[dict], result: dict) -> str:
    """Why a row below the baseline loses, in figures of the record: the EMA's horizon against the steps it averaged
    over; the distinct images of a repeated-augmentation epoch; for the others, their train accuracy against the
    baseline's."""
    if name == EMA_ROW:
        ema = per_seed[0]["ema"]
        averaged = ema["total_steps"] - ema["start_step"]
        return (f"its average forgets over about {ema['every'] / (1 - ema['decay']):.0f} optimizer steps (decay "
                f"{ema['decay']:g}), of the {averaged} it averaged over from step {ema['start_step']}")
    if name == RA_ROW:
        return (f"each of its epochs holds {result['data']['train'] // result['repeats']} distinct training images, "
                f"each drawn {result['repeats']} times, all on this one process (under DDP the copies go to different "
                "processes)")
    return (f"it trains to {100 * _median(per_seed, 'train_acc'):.1f} % train accuracy against the baseline's "
            f"{100 * _median(base, 'train_acc'):.1f} %, in the same epochs")


def render(result: dict) -> tuple[str, str]:
    runs = result["runs"]
    base_runs = next(iter(runs.values()))
    base = _median(base_runs, "val_acc")
    rows, lost = [], []
    for name, per_seed in runs.items():
        acc = _median(per_seed, "val_acc")
        rows.append([name, f"{100 * acc:.2f} %", f"{100 * (acc - base):+.2f}",
                     " / ".join(f"{100 * r['val_acc']:.1f}" for r in per_seed),
                     f"{100 * _median(per_seed, 'best_val_acc'):.2f} %",
                     f"{100 * _median(per_seed, 'train_acc'):.1f} %",
                     _median(per_seed, "s_per_epoch")])
        if per_seed is not base_runs and acc < base:
            lost.append(f"\"{name}\" loses {100 * (base - acc):.2f} points: {_why(name, per_seed, base_runs, result)}")
    body = table(["variant", "val/acc (median)", "vs baseline, points", "per seed", "best val/acc (median)",
                  "train accuracy, last epoch (median)", "s / epoch (median)"], rows)
    helped = [name for name, _, delta, *_ in rows[1:] if float(delta) > 0]
    gap = _median(base_runs, "train_acc") - base
    body += "\n\n"
    if BASELINE in runs:
        body += (f"The baseline ends at {100 * _median(base_runs, 'train_acc'):.1f} % train accuracy against "
                 f"{100 * base:.2f} % val/acc, a gap of {100 * gap:.1f} points for the recipe's regularisation to "
                 f"close; its best val/acc over the epochs is {100 * _median(base_runs, 'best_val_acc'):.2f} %. The "
                 "ingredients that raised the median val/acc: " + ("; ".join(helped) if helped else "none") + ". ")
    body += ("".join(f"{line}. " for line in lost) + _fixres(result["fixres"])
             + " Seconds per epoch are wall times on a machine that other jobs shared during the run (see the load "
             "average below): compare them with care.")
    data = result["data"]
    settings = (f"imgcls fit of configs/quickstart.yaml with model.net.arch {result['arch']} and "
                f"model.optimizer.init_args.lr {result['lr']:g} per 256 images (the quickstart's "
                f"{result['quickstart_lr']:g} left the augmented runs at chance on this data), "
                f"{result['image_size']} px, {result['epochs']} epochs, seeds {', '.join(map(str, result['seeds']))}, "
                f"on the cluttered digits (benchmarks/cluttered_digits.py: {data['train']} training and {data['val']} "
                f"validation images of {data['side']} px, the validation set's writers unseen in training); val/acc "
                "after the last epoch, medians over the seeds; train accuracy on the batches trained on (augmented, "
                "mixed); s / epoch is the median wall time between validations")
    return body, settings


def _fixres(fixres: dict) -> str:
    """Why there is no FixRes row, from the feature-map sides the record holds."""
    (train, small), (test, large) = fixres["here"].items()
    (v2_train, v2_small), (v2_test, v2_large) = fixres["torchvision_v2"].items()
    return (f"FixRes has no row: it evaluates at a larger side than it trains at, to see objects at the size random "
            f"crops showed them in training, and here the crops are whole images (the quickstart's preset) and the "
            f"network's last feature map is {small}x{small} at {train} px and {large}x{large} at {test} px, a map it "
            f"never trained on; it applies at sizes like the V2 recipe's, where resnet50's map is "
            f"{v2_small}x{v2_small} at {v2_train} px and {v2_large}x{v2_large} at {v2_test} px.")


def main(quick: bool = False) -> dict:
    return measure(quick)

