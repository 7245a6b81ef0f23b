"""Whether a fit may continue a checkpoint: only the same run (its classes, its data, its model values), and only one
not finished. Each refusal is one line that names the run and the way out (docs/FAULT_TOLERANCE.md, "Resuming a run").

The CLI checks the model values right after parsing, before LightningCLI merges the checkpoint's hyperparameters over
the command line, and the data and the length once the DataModule has listed its classes."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from lightning.pytorch.utilities import rank_zero_info

from training.resume.checkpoints import run_folder

# Model keys a resume may change: the speed levers (how the same run computes) and what the data links in.
RESUME_MAY_CHANGE = frozenset({"levers", "threshold",
                               "num_classes", "class_names", "multilabel", "batch_size", "input_contract"})


class NotTheSameRunError(ValueError):
    """A fit would continue a checkpoint of another run (other classes, model or data), or change it in silence."""


class FinishedRunError(ValueError):
    """A fit would resume a checkpoint that has already reached max_epochs or max_steps: nothing left to train."""


class CheckpointedRun(Protocol):
    """What a checkpoint says of its run, read without its weights (training.records.saved_run.SavedRun is one)."""

    path: Path
    model: dict[str, Any]  # the model's hyperparameters
    data: dict[str, Any]  # the DataModule's
    global_step: int
    epochs_done: int | None  # epochs whose training part finished (Lightning's count for max_epochs)

    @property
    def class_names(self) -> list[str] | None: ...


def check_resume_overrides(saved: CheckpointedRun, model, explicit_model: set[str] | None, how: str) -> None:
    """Refuses a resumed fit whose config sets a model value other than the checkpoint's, which would otherwise win in
    silence (LightningCLI merges the checkpoint's hyperparameters over the command line). The speed levers and what
    the data links in may change. `how`: auto_resume or --ckpt_path ..., named in the message."""
    changed = []
    for key in sorted(explicit_model or ()):
        if key in RESUME_MAY_CHANGE or key not in saved.model:
            continue
        new, old = _flat(model.get(key), f"model.{key}"), _flat(saved.model[key], f"model.{key}")
        changed += [f"{k}={new.get(k)} (the checkpoint's: {old.get(k)})" for k in sorted(new.keys() | old.keys())
                    if not _equal(new.get(k), old.get(k))]
    if changed:
        raise NotTheSameRunError(
            f"{how}: {'; '.join(changed)}: a resumed fit continues {run_folder(saved.path)} as it was trained, so the "
            f"checkpoint's value would be used; drop the override to resume, or {_new_run_hint(saved, how)}")


def check_same_data(saved: CheckpointedRun, root, data_names: list[str] | None, how: str) -> None:
    """Refuses a resumed fit on other classes than its checkpoint's, and an auto_resume on another data root (an
    explicit --ckpt_path may continue on data that moved: said in one line)."""
    names = saved.class_names
    if names is not None and data_names is not None and list(data_names) != names:
        raise NotTheSameRunError(
            f"{how}: {run_folder(saved.path)} holds a run on other classes ({short_names(names)}) than "
            f"data.root={root} ({short_names(data_names)}); {_new_run_hint(saved, how)}")
    trained_on = saved.data.get("root")
    if trained_on and root and not same_path(trained_on, root):
        if how == "auto_resume":
            raise NotTheSameRunError(
                f"auto_resume: {run_folder(saved.path)} holds a run on data.root={trained_on}, not {root}; "
                f"{_new_run_hint(saved, how)}, or --ckpt_path {saved.path} to continue it on this data")
        rank_zero_info(f"{how}: continuing on data.root={root}; the checkpoint trained on {trained_on} (same classes)")


def check_unfinished(saved: CheckpointedRun, max_epochs: int | None, max_steps: int, how: str) -> None:
    """Refuses to "resume" a finished run: Lightning would train nothing, validate, and exit 0."""
    why = finished(saved, max_epochs, max_steps)
    if why:
        raise FinishedRunError(
            f"{how}: {saved.path} has finished its run ({why}), so there is nothing to train; raise "
            "--trainer.max_epochs or --trainer.max_steps to train on, pass a new --trainer.default_root_dir for a "
            f"new run, or evaluate it: imgcls validate --config {run_folder(saved.path) / 'config.yaml'}")


def finished(saved: CheckpointedRun, max_epochs: int | None, max_steps: int) -> str | None:
    """Why a fit resumed from `saved` would train nothing (Lightning's own stopping rule), or None."""
    if max_steps is not None and max_steps != -1 and saved.global_step >= max_steps:
        return f"max_steps={max_steps} reached (global step {saved.global_step})"
    if max_epochs is None:
        max_epochs = 1000 if max_steps in (None, -1) else -1  # Lightning's default
    if max_epochs != -1 and saved.epochs_done is not None and saved.epochs_done >= max_epochs:
        return f"max_epochs={max_epochs} reached"
    return None


def _new_run_hint(saved: CheckpointedRun, how: str) -> str:
    if how == "auto_resume":
        return "pass a new --trainer.default_root_dir for a new run"
    return (f"start a new run from these weights with --model.net.weights {saved.path} and a new "
            "--trainer.default_root_dir")


def same_path(a, b) -> bool:
    """Whether two data roots (folders, or URLs such as s3://) are the same."""
    a, b = str(a), str(b)
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def short_names(names: list[str], most: int = 8) -> str:
    """`names` for a one-line message: the first `most`, then how many more."""
    if not names:
        return "none"
    return ", ".join(map(str, names[:most])) + (f" and {len(names) - most} more" if len(names) > most else "")


def _flat(value, key: str) -> dict[str, Any]:
    """{dotted key: leaf} of a value that may be a nested config (a Namespace or dict: an injected part's
    class_path and init_args), so that a difference is named by its leaf."""
    value = value.as_dict() if hasattr(value, "as_dict") else value
    if isinstance(value, Mapping) and value:
        return {k: v for sub, item in value.items() for k, v in _flat(item, f"{key}.{sub}").items()}
    return {key: value}


def _equal(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-12)
        except (TypeError, ValueError):
            return False
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return dict(a) == dict(b)
    return a == b
