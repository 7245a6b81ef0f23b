"""`imgcls publish`: a checkpoint to a model folder in the Hugging Face Hub's layout.

    imgcls publish --ckpt_path runs/quickstart/checkpoints/last.ckpt runs/quickstart/published
    -> model.safetensors, config.json, README.md (model card), training_config.yaml [, confusion_matrix.png]

The folder loads back without the checkpoint (`ImageClassifier.from_pretrained(FOLDER)`, `imgcls predict
--model.net.weights FOLDER`), is served by `imgcls serve FOLDER`, and goes online with huggingface_hub's own upload:
`hf upload USER/NAME FOLDER`. Its format is lightning_modules/pretrained.py's.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import tempfile
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from core.command_line import parse_settings
from lightning_modules.pretrained import (
    CONFIG_FILE,
    FORMAT_VERSION,
    LIBRARY,
    WEIGHTS_FILE,
    model_hparams,
    network_spec,
)
from training.records.saved_run import SavedRun, checkpoint_file
from training.records.secrets import redact_secrets, redact_values
from training.resume.checkpoints import run_folder

CARD_FILE = "README.md"
TRAINING_CONFIG = "training_config.yaml"
CONFUSION_PICTURE = "confusion_matrix.png"
# The validation metrics a card reports: (logged name, its name on the card, its Hub metric type).
SINGLE_LABEL_METRICS = (("val/acc", "top-1 accuracy", "accuracy"), ("val/acc_top5", "top-5 accuracy", "accuracy"),
                        ("val/f1_macro", "macro F1", "f1"))
MULTILABEL_METRICS = (("val/map", "mAP (macro)", "mean_average_precision"), ("val/acc", "exact match", "accuracy"),
                      ("val/f1_macro", "macro F1", "f1"))


def read_run(ckpt_path: str | Path) -> tuple[SavedRun, dict[str, torch.Tensor], bool]:
    """(what the checkpoint says of its run, the network's validated weights, whether they are an EMA); one line when
    the file is not a checkpoint of `imgcls fit`."""
    ckpt_path = checkpoint_file(ckpt_path)
    saved = SavedRun.read(ckpt_path)
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True)
    state = ckpt.get("state_dict") if isinstance(ckpt, dict) else None
    if not isinstance(state, dict) or "num_classes" not in saved.model or not any(k.startswith("net.") for k in state):
        raise ValueError(f"--ckpt_path {ckpt_path} is not a checkpoint of imgcls fit (no ImageClassifier "
                         "hyperparameters or net.* weights); pass one from RUN/checkpoints/")
    # Lightning's WeightAveraging saves the averaged weights (those validated) as state_dict, the trained ones beside.
    averaged = "current_model_state" in ckpt
    net = {k.removeprefix("net."): v.contiguous() for k, v in state.items() if k.startswith("net.")}
    return saved, net, averaged


def model_config(saved: SavedRun, threshold: float | None, averaged: bool) -> dict[str, Any]:
    hp = saved.model
    multilabel = bool(hp.get("multilabel"))
    names = saved.class_names or [str(i) for i in range(hp["num_classes"])]
    return {
        "library": LIBRARY,
        "format_version": FORMAT_VERSION,
        "network": network_spec(hp),
        "num_classes": int(hp["num_classes"]),
        "class_names": names,
        "multilabel": multilabel,
        "threshold": threshold if multilabel else None,  # a class is predicted at or above it (multi-label)
        "preprocessing": saved.input_contract,  # the evaluation transform, applied to an 8-bit RGB image
        "weights": {"file": WEIGHTS_FILE, "averaged": averaged,
                    "what": "the EMA of the weights (validated and checkpointed by WeightAveraging)" if averaged
                    else "the trained weights"},
    }


def publish(ckpt_path: str | Path, out_dir: str | Path, *, threshold: float | None = None,
            overwrite: bool = False) -> Path:
    """Writes the model folder; refuses (one line, before writing anything) a checkpoint that is not imgcls's, an
    OUT_DIR holding other files without `overwrite`, and a multi-label run without a threshold."""
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"OUT_DIR {out} is a file; pass a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        held = ", ".join(sorted(p.name for p in out.iterdir())[:4])
        raise FileExistsError(f"OUT_DIR {out} exists and holds files ({held}); pass --overwrite to replace the "
                              "model files in it (other files stay), or a new folder")
    saved, weights, averaged = read_run(ckpt_path)
    if saved.model.get("multilabel"):
        if threshold is None:
            raise ValueError(f"{ckpt_path} is a multi-label model and its threshold is not checkpointed; pass "
                             "--threshold T (e.g. 0.5, the value its validation used unless model.threshold was set)")
        if not 0 < threshold < 1:
            raise ValueError(f"--threshold {threshold} must lie in (0, 1)")
    elif threshold is not None:
        raise ValueError(f"--threshold is for multi-label models; {ckpt_path} is single-label: drop it")
    config = model_config(saved, threshold, averaged)
    model_hparams(config)  # the config rebuilds the model: fails here, not for the user
    run = run_folder(saved.path)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written in full beside OUT_DIR, then moved in: an error half-way leaves OUT_DIR as it was.
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as tmp:
        staging = Path(tmp)
        from safetensors.torch import save_file

        save_file(weights, staging / WEIGHTS_FILE, metadata={"format": "pt"})
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        (staging / TRAINING_CONFIG).write_text(training_config(saved, run))
        figures = run / "figures" / CONFUSION_PICTURE
        if figures.is_file() and not config["multilabel"]:
            shutil.copyfile(figures, staging / CONFUSION_PICTURE)
        (staging / CARD_FILE).write_text(str(model_card(saved, config, run, (staging / CONFUSION_PICTURE).is_file())))
        out.mkdir(exist_ok=True)
        for file in staging.iterdir():
            file.replace(out / file.name)
    return out


def training_config(saved: SavedRun, run: Path) -> str:
    """The run's resolved config (config.yaml of its run directory), or, without it, the checkpoint's
    hyperparameters; secrets masked either way."""
    config = run / "config.yaml"
    if config.is_file():
        return redact_secrets(config.read_text())
    return "# the run directory's config.yaml was not found: the checkpoint's hyperparameters\n" + yaml.safe_dump(
        redact_values({"model": saved.model, "data": saved.data}), sort_keys=False)


# ---- the model card -----------------------------------------------------------------------------------------------

def run_metrics(run: Path, step: int) -> dict[str, float]:
    """The last value of each val/* metric logged at or before `step` (the checkpoint's), from the run's logs."""
    from training.records.report import read_run as read_logs

    try:
        series = read_logs(run)
    except FileNotFoundError:
        return {}
    found = {}
    for name, points in series.items():
        before = [v for s, v in points if s <= step]
        if name.startswith("val/") and before and math.isfinite(before[-1]):
            found[name] = before[-1]
    return found


def training_time(run: Path) -> float | None:
    """Seconds between the first and the last TensorBoard event of the run (None for runs without its logs)."""
    events = sorted(run.glob("events.out.tfevents.*"))
    if not events:
        return None
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    times = []
    for file in events:
        acc = EventAccumulator(str(file), size_guidance={"scalars": 0})
        acc.Reload()
        times += [e.wall_time for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)]
    return max(times) - min(times) if len(times) > 1 else None


def logged_hparams(run: Path) -> dict[str, Any]:
    """What RunConfig logged with the run (images per class, hardware, git), from the logger's hparams.yaml."""
    file = run / "hparams.yaml"
    if not file.is_file():
        return {}
    try:
        return yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError:
        return {}


def per_class(run: Path, names: list[str]) -> dict[str, tuple[float, int]] | None:
    """{class: (validation F1, validation images)} from the run's last figures/per_class.csv, if it wrote one."""
    import numpy as np

    file = run / "figures" / "per_class.csv"
    if not file.is_file():
        return None
    scores = np.atleast_2d(np.loadtxt(file, delimiter=",", comments="#"))
    if len(scores) != len(names):
        return None
    return {name: (float(row[2]), int(row[3])) for name, row in zip(names, scores, strict=True)}


# Arguments of torch's optimizers and losses that say how, not what: left off the card's recipe table.
LIBRARY_DETAILS = frozenset({"eps", "foreach", "fused", "capturable", "differentiable", "maximize", "reduction",
                             "ignore_index", "size_average", "reduce"})


def recipe(saved: SavedRun, run_config: dict) -> list[tuple[str, str]]:
    hp, data = saved.model, saved.data
    trainer = run_config.get("trainer") or {}

    def class_of(value) -> str:
        if isinstance(value, dict) and "class_path" in value:
            args = ", ".join(f"{k}={v}" for k, v in (value.get("init_args") or {}).items()
                             if v not in (None, False) and k not in LIBRARY_DETAILS)
            return f"{value['class_path'].rsplit('.', 1)[-1]}({args})"
        return "the recipe's default" if value is None else str(value)

    spec = network_spec(hp)
    trained_from = ((hp.get("net") or {}).get("init_args") or {}).get("weights")
    recipe = hp.get("recipe") or {}
    rows = [("network", f"{spec['class_path'].rsplit('.', 1)[-1]}("
                        + ", ".join(f"{k}={v}" for k, v in spec["init_args"].items() if k != "weights") + ")"),
            ("initialised from", str(trained_from or "scratch (random weights)")),
            ("optimizer", class_of(hp.get("optimizer"))), ("lr schedule", class_of(hp.get("lr_scheduler"))),
            ("loss", class_of(hp.get("loss"))),
            ("epochs", str(trainer.get("max_epochs", "?"))), ("steps", str(saved.global_step)),
            ("batch", f"{hp.get('batch_size', '?')} per device x {trainer.get('devices', '?')} device(s)"),
            ("precision", str(trainer.get("precision", "?"))),
            ("image size", f"{transform_arg(data, 'train_transform', 'image_size') or data.get('image_size', '?')} "
                           f"train, {saved.input_contract['image_size']} eval"),
            ("augmentation", ", ".join(f"{k}={v}" for k, v in (
                ("preset", data.get("preset")),
                ("auto_augment", transform_arg(data, "train_transform", "auto_augment")),
                ("random_erasing", transform_arg(data, "train_transform", "random_erasing"))) if v is not None)
             + f", mixup={recipe.get('mixup_alpha', 0)}, cutmix={recipe.get('cutmix_alpha', 0)}")]
    return rows


def transform_arg(data: dict, transform: str, key: str):
    """An argument of a data transform's config (`data.train_transform`), None where it has none."""
    config = data.get(transform)
    return ((config.get("init_args") or {}) if isinstance(config, dict) else {}).get(key)


def model_card(saved: SavedRun, config: dict, run: Path, has_confusion: bool):
    """The README.md the Hub shows: YAML metadata (library, tags, dataset, metrics) and the card's text."""
    from huggingface_hub import ModelCard

    names, multilabel = config["class_names"], config["multilabel"]
    metrics = run_metrics(run, saved.global_step)
    shown = [(label, hub, metrics[key]) for key, label, hub in (MULTILABEL_METRICS if multilabel
                                                                  else SINGLE_LABEL_METRICS) if key in metrics]
    root = saved.data.get("root")
    dataset = Path(str(root)).name if root else "unknown"
    arch = config["network"]["init_args"].get("arch", "network")
    logged = logged_hparams(run)
    scores = per_class(run, names)
    run_config = yaml.safe_load(training_config(saved, run)) or {}
    lines = [f"# {arch} on {dataset}", "",
             f"An image classifier ({'multi-label' if multilabel else 'single-label'}, {len(names)} classes) trained "
             f"with imgcls for {saved.global_step} steps on `{dataset}`. Weights: "
             f"{config['weights']['what']}, in `{WEIGHTS_FILE}`.", "",
             "## Validation", ""]
    if shown:
        lines += ["| metric | value |", "|---|---|", *[f"| {label} | {value:.4f} |" for label, _, value in shown]]
        if multilabel:
            lines.append(f"\nThreshold: a class is predicted at or above {config['threshold']}.")
    else:
        lines.append("The run's logs (TensorBoard or CSV in its run directory) were not found: no metrics to show.")
    lines += _class_lines(names, logged, scores)
    lines += ["", "## Recipe", "", "| setting | value |", "|---|---|",
              *[f"| {k} | {v} |" for k, v in recipe(saved, run_config)], "",
              "The full resolved config is `training_config.yaml`.", "", "## Hardware and training time", ""]
    hardware = logged.get("hardware")
    seconds = training_time(run)
    lines.append(f"- hardware: {hardware if hardware else 'not recorded by the run'}")
    lines.append(f"- training time: {seconds / 60:.1f} min (first to last logged point)" if seconds else
                 "- training time: not recorded (no TensorBoard logs)")
    lines += _limits_lines(names, dataset, multilabel, scores)
    contract = config["preprocessing"]
    lines += ["", "## Preprocessing", "",
              f"8-bit RGB; {contract['preset']} preset: " + (f"resize the short side to {contract['resize_size']}, "
                                                             f"center-crop {contract['image_size']}"
                                                             if contract.get("crop") == "center" else
                                                             f"resize to {contract['image_size']}x"
                                                             f"{contract['image_size']}")
              + f"; scale to [0, 1]; normalise with mean {contract['mean']} and std {contract['std']}.", ""]
    if has_confusion:
        lines += ["## Confusion matrix", "", f"![validation confusion matrix]({CONFUSION_PICTURE})", ""]
    lines += ["## Use", "", "```python", "from lightning_modules import ImageClassifier", "",
              'model = ImageClassifier.from_pretrained("THIS_FOLDER_OR_REPO_ID")', "```", "",
              "or `imgcls predict --model.net.weights THIS_FOLDER --data.predict_dir IMAGES`, or `imgcls serve "
              "THIS_FOLDER`.", ""]
    return ModelCard.from_template(_card_data(arch, dataset, multilabel, shown),
                                   template_str="---\n{{ card_data }}\n---\n\n" + "\n".join(lines))


def _card_data(arch: str, dataset: str, multilabel: bool, shown: list[tuple[str, str, float]]):
    """The card's YAML metadata: library, tags, dataset and the validation metrics as the Hub's eval results."""
    from huggingface_hub import EvalResult, ModelCardData

    return ModelCardData(
        library_name=LIBRARY, license="other", pipeline_tag="image-classification",
        tags=["image-classification", "pytorch", "lightning", LIBRARY, str(arch)] + (["multi-label"] if multilabel
                                                                                    else []),
        datasets=[dataset], metrics=sorted({hub for _, hub, _ in shown}) or None,
        model_name=f"{arch} on {dataset}",
        eval_results=[EvalResult(task_type="image-classification", dataset_type=dataset, dataset_name=dataset,
                                 dataset_split="validation", metric_type=hub, metric_name=label, metric_value=value)
                      for label, hub, value in shown] or None,
    )


def _class_lines(names: list[str], logged: dict, scores: dict | None) -> list[str]:
    """The card's table of classes: the images of each in train and val, and its validation F1."""
    counts = (logged.get("data") or {}) if isinstance(logged.get("data"), dict) else {}
    lines = ["", "## Classes", "", "| class | train images | val images | val F1 |", "|---|---|---|---|"]
    for name in names:
        train, val = (counts.get("train") or {}).get(name, "?"), (counts.get("val") or {}).get(name, "?")
        f1, support = scores[name] if scores and name in scores else (None, None)
        f1 = f1 if support else None
        lines.append(f"| {name} | {train} | {support if support is not None else val} | "
                     f"{'-' if f1 is None else f'{f1:.3f}'} |")
    return lines


def _limits_lines(names: list[str], dataset: str, multilabel: bool, scores: dict | None) -> list[str]:
    """The card's intended use and limits, with the weakest classes on validation."""
    seen = {n: f1 for n, (f1, support) in (scores or {}).items() if support}  # classes validated on
    mean_f1 = sum(seen.values()) / len(seen) if seen else None
    weak = [n for n in sorted(seen, key=seen.get)[:3] if seen[n] < mean_f1]
    lines = ["", "## Intended use and limits", "",
             f"Classifies images into the {len(names)} classes above, as found in `{dataset}`; it knows no other "
             "class and gives every image one of them"
             + (" (or none, below the threshold)" if multilabel else "") + ". Images unlike the training data "
             "(other cameras, sizes, domains) may be classified with high but wrong confidence.",
             ""]
    if weak:
        lines.append("Weakest classes on validation (F1): " + ", ".join(f"{n} ({seen[n]:.3f})" for n in weak) + ".")
    else:
        lines.append("Per-class validation figures were not recorded (training.callbacks.ValidationFigures "
                     "writes them).")
    return lines


@dataclass
class PublishSettings:
    """The settings of `imgcls publish`."""

    out_dir: str
    """the model folder to write (new or empty, unless --overwrite)"""
    _: KW_ONLY
    ckpt_path: str
    """checkpoint written by imgcls fit, e.g. RUN/checkpoints/last.ckpt"""
    threshold: float | None = None
    """multi-label models: predict a class at or above this"""
    overwrite: bool = False
    """replace the model files of an existing OUT_DIR"""


def main(argv: list[str] | None = None) -> None:
    args = parse_settings(PublishSettings, argv, prog="imgcls publish", description=__doc__)
    from training.resume.checkpoints import UnsafeCheckpointError

    try:
        out = publish(args.ckpt_path, args.out_dir, threshold=args.threshold, overwrite=args.overwrite)
    except (FileNotFoundError, FileExistsError, ValueError, UnsafeCheckpointError) as err:
        print(f"imgcls publish: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {out}: {WEIGHTS_FILE}, {CONFIG_FILE}, {CARD_FILE} (model card), {TRAINING_CONFIG}; "
          f"upload it with: hf upload USER/NAME {out}")


__all__ = ["publish", "main"]
