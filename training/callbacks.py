"""Callbacks of the run layer: saving the resolved config into the run directory, writing predictions."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import WandbLogger

WANDB_RUN_ID_FILE = "wandb_run_id"  # in the run directory: the W&B run that a resumed fit continues


class RunConfig(SaveConfigCallback):
    """Writes the resolved config to `<run dir>/config.yaml` (rank 0; `validate_config.yaml` etc. for the other
    commands), so the run can be re-run from its folder,
    and logs it to every logger as hyperparameters, with the git commit (and dirty flag) and the images per class;
    secrets (URL passwords, API keys) are masked in both. A fit also records its W&B run id in the run directory."""

    def __init__(self, parser, config, **kwargs) -> None:
        kwargs["save_to_log_dir"] = False  # the run directory, not the first logger's folder
        super().__init__(parser, config, **kwargs)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Lightning logs the model's and the DataModule's hyperparameters to every logger and stores them in each
        # checkpoint: a password in any string value would leak there too, so those copies are masked as well.
        for obj in (pl_module, trainer.datamodule):
            for name in ("_hparams", "_hparams_initial"):
                if isinstance(getattr(obj, name, None), dict):
                    setattr(obj, name, type(getattr(obj, name))(_redact_values(getattr(obj, name))))
        super().setup(trainer, pl_module, stage)

    def save_config(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        run_dir = Path(trainer.default_root_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        text = redact_secrets(self.parser.dump(self.config, skip_none=False))
        # validate/test/predict, run from <run>/config.yaml, must not overwrite the config that trained the run.
        stage = getattr(stage, "value", stage)  # a TrainerFn: "fit", "validate", "test", "predict"
        name = self.config_filename if stage == "fit" else f"{stage}_{self.config_filename}"
        (run_dir / name).write_text(text)
        params = {"config": text, "git": git_state(), "data": data_summary(trainer.datamodule)}
        for logger in trainer.loggers:
            logger.log_hyperparams(params)
            if isinstance(logger, WandbLogger) and stage == "fit":
                # log_hyperparams has started the W&B run; `imgcls fit --ckpt_path ...` passes this id back to it.
                (run_dir / WANDB_RUN_ID_FILE).write_text(f"{logger.version}\n")


def git_state() -> dict[str, str | bool]:
    """The commit of the code that runs, and whether tracked files differ from it ("unknown" outside a checkout)."""
    repo = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": "unknown", "dirty": False}


def data_summary(datamodule) -> dict[str, dict[str, int]]:
    """Images per class for each split the DataModule has set up: {"train": {"cat": 120, ...}, "val": {...}} (for
    multi-label data, the images that carry each label)."""
    summary = {}
    names = getattr(datamodule, "class_names", None) or []
    for split in ("train", "val", "test"):
        targets = getattr(getattr(datamodule, f"{split}_set", None), "targets", None)
        if targets is None or not len(targets):
            continue
        targets = np.asarray(targets)
        counts = targets.sum(axis=0) if targets.ndim == 2 else np.bincount(targets)
        summary[split] = {names[c] if c < len(names) else str(c): int(n) for c, n in enumerate(counts) if n}
    return summary


# A password in a URL (postgresql://user:PASSWORD@host/db) and values of secret-looking environment variables.
_URL_PASSWORD = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s:@]+):(?P<password>[^@\s/]+)@")
_SECRET_ENV = re.compile(r"(API_KEY|TOKEN|PASSWORD|SECRET|ACCESS_KEY)$", re.IGNORECASE)


def _redact_values(value):
    if isinstance(value, str):
        return redact_secrets(value)
    if isinstance(value, dict):
        return {k: _redact_values(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_redact_values(v) for v in value)
    return value


def redact_secrets(text: str) -> str:
    """`text` with URL passwords and the values of secret environment variables (WANDB_API_KEY...) masked."""
    text = _URL_PASSWORD.sub(lambda m: f"{m['scheme']}:***@", text)
    for name, value in os.environ.items():
        if _SECRET_ENV.search(name) and len(value) >= 6:
            text = text.replace(value, f"<{name}>")
    return text


class SecretSafeWandbLogger(WandbLogger):
    """WandbLogger whose run records the command line with secrets masked.

    wandb stores sys.argv in the run's metadata (and `wandb sync` uploads it), out of reach of the masking of
    config.yaml and of the logged config; a password typed as a command-line value would land there. sys.argv is
    masked only while the run starts: Lightning's launcher still needs the real one to start the other ranks.
    """

    @property
    def experiment(self):
        if self._experiment is not None:
            return super().experiment
        saved = sys.argv[:]
        sys.argv[1:] = [redact_secrets(arg) for arg in saved[1:]]
        try:
            return super().experiment
        finally:
            sys.argv[:] = saved


class PredictionWriter(BasePredictionWriter):
    """Writes `predictions.csv` (path, label, class name, confidence, top-5) at the end of `imgcls predict`; for a
    multi-label model (path, labels at or above `model.threshold`, top-5).

    Under DDP the ranks' parts travel to rank 0 through the process group (no shared disk needed: each node may have
    its own run directory), and rank 0 writes them in dataset order, without the duplicates that the distributed
    sampler pads with.
    """

    def __init__(self, output_dir: str | None = None, filename: str = "predictions.csv") -> None:
        super().__init__(write_interval="epoch")
        self.output_dir = output_dir
        self.filename = filename

    def _out_dir(self, trainer: Trainer) -> Path:
        return Path(self.output_dir or trainer.default_root_dir)

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices) -> None:
        part = _prediction_rows(predictions)
        parts = gather_to_rank_zero(part) if trainer.world_size > 1 else [part]
        if not trainer.is_global_zero:
            return
        merged = {row[0]: row for rows in parts for row in rows}  # a padded duplicate overwrites its identical twin
        paths = trainer.datamodule.predict_set.paths
        names = pl_module.class_names
        out = self._out_dir(trainer)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / self.filename, "w", newline="") as f:
            writer = csv.writer(f)
            if pl_module.hparams.get("multilabel"):
                # labels: every class at or above the threshold, `|`-separated as labels.csv reads them (empty for
                # none); scores: the probabilities of the 5 likeliest classes, for a look below the threshold.
                threshold = pl_module.threshold
                writer.writerow(["path", "labels", "top5"])
                for index in sorted(merged):
                    probs = merged[index][1]
                    order = sorted(range(len(probs)), key=lambda c: -probs[c])
                    labels = "|".join(names[c] for c in sorted(order) if probs[c] >= threshold)
                    top5 = " ".join(f"{names[c]}:{probs[c]:.4f}" for c in order[:5])
                    writer.writerow([paths[index], labels, top5])
            else:
                writer.writerow(["path", "label", "class_name", "confidence", "top5"])
                for index in sorted(merged):
                    _, label, name, conf, top_labels, top_probs = merged[index]
                    top5 = " ".join(f"{names[c]}:{p:.4f}" for c, p in zip(top_labels, top_probs, strict=True))
                    writer.writerow([paths[index], label, name, f"{conf:.6f}", top5])
        print(f"wrote {len(merged)} predictions to {out / self.filename}")


def _prediction_rows(predictions: list[dict]) -> list[tuple]:
    """predict_step outputs -> (index, label, class name, confidence, top-5 labels, top-5 probabilities) rows, or
    (index, every class's probability) rows for a multi-label model."""
    rows = []
    for batch in predictions:
        if "probs" in batch:
            rows += [(int(i), p.tolist()) for i, p in zip(batch["index"], batch["probs"], strict=True)]
            continue
        for i in range(len(batch["index"])):
            rows.append((int(batch["index"][i]), int(batch["label"][i]), batch["class_name"][i],
                         float(batch["confidence"][i]), batch["top5_labels"][i].tolist(),
                         batch["top5_probs"][i].tolist()))
    return rows


def gather_to_rank_zero(obj):
    """Every rank's `obj`, in rank order, on rank 0 (None elsewhere): through the process group, not the disk.

    gloo takes the objects as pickled CPU bytes; NCCL stages them on the current device, which Lightning has set.
    """
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, parts, dst=0)
    return parts
