"""What a command started from a checkpoint takes from it, and what it refuses.

A checkpoint carries its run: the model's hyperparameters (the class names, the input contract: the evaluation
preprocessing the network was trained with), the DataModule's, and how far the fit got. So

- `imgcls validate|test|predict --ckpt_path X` evaluate with the model's own preprocessing and classes, whatever the
  DataModule's defaults are; a value the user set (on the command line or in a config) is obeyed, with one line when
  it differs from training;
- without `--ckpt_path` they evaluate the run directory's best checkpoint, or say that they evaluate pretrained
  weights, or refuse: never an untrained network in silence;
- `imgcls fit` continues a checkpoint only when it is the same run (classes, model, data), not finished, and not
  changed on the command line.
"""

from __future__ import annotations

import logging
import math
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only

from training.resume.checkpoints import (
    UnsafeCheckpointError,
    checkpoint_problem,
    newest_intact_checkpoint,
    unsafe_message,
)

log = logging.getLogger(__name__)

# The data keys of the held-out validation split.
SPLIT_KEYS = ("val_split", "split_seed")
# Model keys a resume may change: the speed levers (how the same run computes) and what the data links in.
RESUME_MAY_CHANGE = frozenset({"levers", "threshold",
                               "num_classes", "class_names", "multilabel", "batch_size", "input_contract"})


class NotTheSameRunError(ValueError):
    """A fit would continue a checkpoint of another run (other classes, model or data), or change it in silence."""


class FinishedRunError(ValueError):
    """A fit would resume a checkpoint that has already reached max_epochs or max_steps: nothing left to train."""


class ClassMismatchError(ValueError):
    """The data's classes are not the checkpoint's."""


class NoCheckpointError(ValueError):
    """An evaluation command has no checkpoint to evaluate and no pretrained weights."""


@dataclass(frozen=True)
class SavedRun:
    """What one checkpoint (a file, or a sharded checkpoint's folder) says about its run, read without its weights."""

    path: Path
    model: dict[str, Any]  # the model's hyperparameters
    data: dict[str, Any]  # the DataModule's
    global_step: int
    epochs_done: int | None  # epochs whose training part finished (Lightning's count for max_epochs)
    callbacks: dict[str, Any]

    @classmethod
    def read(cls, path: str | Path) -> SavedRun:
        path = Path(path)
        # training.distributed.fsdp keeps everything but the shards there
        file = path / "meta.pt" if path.is_dir() else path
        try:
            # mmap: the tensors stay on disk; only the small Python parts are read.
            ckpt = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointError(unsafe_message(file, err)) from None
        except RuntimeError as err:  # not a zip archive: an old or foreign format
            raise ValueError(f"--ckpt_path {path} is not a checkpoint imgcls can read ({checkpoint_problem(file)})"
                             f": {str(err).splitlines()[0]}") from None
        progress = ckpt.get("loops", {}).get("fit_loop", {}).get("epoch_progress", {}).get("current", {})
        return cls(path, dict(ckpt.get("hyper_parameters") or {}), dict(ckpt.get("datamodule_hyper_parameters") or {}),
                   int(ckpt.get("global_step", 0)), progress.get("processed"), dict(ckpt.get("callbacks") or {}))

    @property
    def class_names(self) -> list[str] | None:
        names = self.model.get("class_names")
        return list(names) if names is not None else None

    @property
    def input_contract(self) -> dict[str, Any] | None:
        """The model's evaluation preprocessing (None: its data source stated none)."""
        contract = self.model.get("input_contract")
        return dict(contract) if contract is not None else None

    def finished(self, max_epochs: int | None, max_steps: int) -> str | None:
        """Why a fit resumed from here would train nothing (Lightning's own stopping rule), or None."""
        if max_steps is not None and max_steps != -1 and self.global_step >= max_steps:
            return f"max_steps={max_steps} reached (global step {self.global_step})"
        if max_epochs is None:
            max_epochs = 1000 if max_steps in (None, -1) else -1  # Lightning's default
        if max_epochs != -1 and self.epochs_done is not None and self.epochs_done >= max_epochs:
            return f"max_epochs={max_epochs} reached"
        return None

    def best(self) -> tuple[str, str | None]:
        """(the best checkpoint that a ModelCheckpoint of this run recorded, "monitor score"), or (this one, None)."""
        for key, state in self.callbacks.items():
            best = state.get("best_model_path") if isinstance(state, Mapping) else None
            if key.startswith("ModelCheckpoint") and best and not checkpoint_problem(Path(best)):
                score = state.get("best_model_score")
                monitor = state.get("monitor") or key
                shown = f"{monitor} {float(score):.4f}" if score is not None else None
                return best, shown
        return str(self.path), None


def checkpoint_file(ckpt_path: str | Path) -> Path:
    """`ckpt_path` as one checkpoint file, for the commands that read one (export, publish): a sharded checkpoint (a
    folder, training.distributed.fsdp) is refused with the command that makes one file of it, a missing file too."""
    ckpt_path = Path(ckpt_path)
    if ckpt_path.is_dir():
        raise ValueError(f"--ckpt_path {ckpt_path} is a sharded checkpoint (a folder); make one file of it first: "
                         f"python -m training.distributed.fsdp {ckpt_path} "
                         f"{ckpt_path.with_name(ckpt_path.stem + '-full.ckpt')}")
    if not ckpt_path.is_file():
        raise FileNotFoundError(f"--ckpt_path {ckpt_path} does not exist; pass a checkpoint of imgcls fit, e.g. "
                                "RUN/checkpoints/last.ckpt")
    return ckpt_path


def explicit_keys(explicit, section: str) -> set[str] | None:
    """The keys of `section` ("data", "model") that a config file or the command line set; None when unknown."""
    if explicit is None:
        return None
    part = explicit.get(section) if hasattr(explicit, "get") else None
    if part is None:
        return set()
    init = part.get("init_args") if hasattr(part, "get") and part.get("init_args") is not None else part
    return set(vars(init)) if hasattr(init, "__dict__") else set(init)


def set_by_user(key: str, explicit: set[str] | None) -> bool:
    return explicit is None or key in explicit


def explicit_class(explicit, section: str) -> str | None:
    """The class_path of `section` that a config file or the command line named; None when none did (or unknown)."""
    part = explicit.get(section) if explicit is not None and hasattr(explicit, "get") else None
    return part.get("class_path") if part is not None and hasattr(part, "get") else None


def evaluation_data(data, explicit: set[str] | None, saved: SavedRun, command: str, data_class: str,
                    named_class: str | None) -> dict:
    """What `validate|test|predict` of a checkpoint take from it: the run's data class (unless one is named), its
    evaluation transform (the input contract's), and on the run's own data root without a val/ folder its held-out
    validation split. The keys the user set are obeyed: one warning line each where they
    differ from training, and one line lists what was taken. Returns the data config's update: class_path and
    init_args. `data_class` is the config's data class, `named_class` the one the user named (None: none)."""
    from datamodules.transforms import name_of

    update, init, taken = {}, {}, {}
    trained_class = saved.data.get("_class_path")
    if trained_class and trained_class != data_class and named_class is None and explicit is not None:
        update["class_path"] = taken["data.class_path"] = trained_class
        # With the run's class, its arguments too (its folder or list, its sizes), unless the user set them.
        init |= {k: v for k, v in saved.data.items() if not k.startswith("_") and not set_by_user(k, explicit)}
    contract = saved.input_contract
    trained = (contract or {}).get("transform")
    if trained is not None and set_by_user("eval_transform", explicit):
        asked = _eval_transform_as_run(data)
        if asked != trained:
            warn_line(f"data.eval_transform={name_of(asked)} is set, and the model was trained with "
                      f"{name_of(trained)} ({saved.path}): {command} uses the one set")
    elif trained is not None:
        init["eval_transform"] = _with_short_forms_set(trained, data, explicit, saved, command)
        taken["data.eval_transform"] = name_of(trained)
    root = data.get("root")
    if root and saved.data.get("root") and _same_path(root, saved.data["root"]) and not (Path(root) / "val").is_dir():
        init |= {k: saved.data[k] for k in SPLIT_KEYS if k in saved.data and not set_by_user(k, explicit)}
        taken |= {f"data.{k}": v for k, v in init.items() if k in SPLIT_KEYS}
    if "class_path" not in update:
        init = {k: v for k, v in init.items() if k in data}  # keys this data class takes
        taken = {k: v for k, v in taken.items() if k.split(".")[1] in init}
    if init:
        update["init_args"] = init
    if update:
        shown = ", ".join(f"{k}={v}" for k, v in taken.items())
        rank_zero_info(f"{command}: as the model was trained ({saved.path}): {shown}")
    return update


def _eval_transform_as_run(data) -> dict | None:
    """The config of the evaluation transform that `data` (a data config) runs: its data.eval_transform (the default
    preset when null) under the short forms, as the DataModule places them; comparable with a contract's."""
    from datamodules.presets import ClassificationPresetEval, with_short_forms
    from datamodules.transforms import build_transform, transform_config

    asked = data.get("eval_transform")
    asked = asked.as_dict() if hasattr(asked, "as_dict") else asked
    transform = build_transform(asked) if asked else ClassificationPresetEval()
    transform, _ = with_short_forms(transform, "data.eval_transform", data.get("preset"), data.get("image_size"))
    return transform_config(transform, asked)


def _with_short_forms_set(trained: dict, data, explicit: set[str] | None, saved: SavedRun, command: str) -> dict:
    """The trained evaluation transform, with the short forms the user set (data.preset, data.image_size) over its
    own where it has them: one warning line each that differs. A side set resets resize_size to its usual ratio."""
    values = dict(trained.get("init_args") or {})
    for key in ("preset", "image_size"):
        asked = data.get(key)
        if asked is None or key not in values or asked == values[key] or not set_by_user(key, explicit):
            continue
        warn_line(f"data.{key}={asked} is set, and the model was trained with {values[key]} ({saved.path}): "
                  f"{command} uses {asked}")
        values[key] = asked
        if key == "image_size" and "resize_size" in values:
            values["resize_size"] = None
    return {"class_path": trained["class_path"], "init_args": values}


@rank_zero_only
def warn_line(message: str) -> None:
    """One warning line (rank zero), without the source line that `warnings` adds."""
    log.warning(message)


def check_classes(data_names: list[str] | None, saved: SavedRun, root, command: str) -> list[str] | None:
    """The class names `command` evaluates with: the checkpoint's. The same names in another order are mapped by name
    (said in one line); other names or counts are refused in one line that lists the difference."""
    names = saved.class_names
    if names is None or data_names is None or list(data_names) == names:
        return names
    if sorted(data_names) == sorted(names):
        rank_zero_info(f"{command}: data.root={root} lists the checkpoint's classes in another order; images are "
                       f"labelled by class name, in the checkpoint's order")
        return names
    only_data = [n for n in data_names if n not in names]
    only_ckpt = [n for n in names if n not in data_names]
    raise ClassMismatchError(
        f"data.root={root} has {len(data_names)} classes and the checkpoint {saved.path} has {len(names)}, not the "
        f"same: only in the data: {_short(only_data)}; only in the checkpoint: {_short(only_ckpt)}; {command} needs "
        f"data with the model's classes (to train on these, start a new run with --model.net.weights {saved.path})")


def run_folder(saved: SavedRun) -> Path:
    """The run directory a checkpoint belongs to (<run>/checkpoints/x.ckpt -> <run>)."""
    return saved.path.parent.parent if saved.path.parent.name == "checkpoints" else saved.path.parent


def _new_run_hint(saved: SavedRun, how: str) -> str:
    if how == "auto_resume":
        return "pass a new --trainer.default_root_dir for a new run"
    return (f"start a new run from these weights with --model.net.weights {saved.path} and a new "
            "--trainer.default_root_dir")


def check_resume_overrides(saved: SavedRun, model, explicit_model: set[str] | None, how: str) -> None:
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
            f"{how}: {'; '.join(changed)}: a resumed fit continues {run_folder(saved)} as it was trained, so the "
            f"checkpoint's value would be used; drop the override to resume, or {_new_run_hint(saved, how)}")


def check_same_data(saved: SavedRun, root, data_names: list[str] | None, how: str) -> None:
    """Refuses a resumed fit on other classes than its checkpoint's, and an auto_resume on another data root (an
    explicit --ckpt_path may continue on data that moved: said in one line)."""
    names = saved.class_names
    if names is not None and data_names is not None and list(data_names) != names:
        raise NotTheSameRunError(
            f"{how}: {run_folder(saved)} holds a run on other classes ({_short(names)}) than data.root={root} "
            f"({_short(data_names)}); {_new_run_hint(saved, how)}")
    trained_on = saved.data.get("root")
    if trained_on and root and not _same_path(trained_on, root):
        if how == "auto_resume":
            raise NotTheSameRunError(
                f"auto_resume: {run_folder(saved)} holds a run on data.root={trained_on}, not {root}; "
                f"{_new_run_hint(saved, how)}, or --ckpt_path {saved.path} to continue it on this data")
        rank_zero_info(f"{how}: continuing on data.root={root}; the checkpoint trained on {trained_on} (same classes)")


def check_unfinished(saved: SavedRun, max_epochs: int | None, max_steps: int, how: str) -> None:
    """Refuses to "resume" a finished run: Lightning would train nothing, validate, and exit 0."""
    why = saved.finished(max_epochs, max_steps)
    if why:
        raise FinishedRunError(
            f"{how}: {saved.path} has finished its run ({why}), so there is nothing to train; raise "
            "--trainer.max_epochs or --trainer.max_steps to train on, pass a new --trainer.default_root_dir for a "
            f"new run, or evaluate it: imgcls validate --config {run_folder(saved) / 'config.yaml'}")


def best_checkpoint_of(run_dir: Path, folders: list[Path]) -> tuple[str, str | None] | None:
    """The best checkpoint of a run directory (as its ModelCheckpoint recorded it) and its score; None without one."""
    newest, _ = newest_intact_checkpoint([run_dir / "checkpoints", *folders])
    if newest is None:
        return None
    return SavedRun.read(newest).best()


def _same_path(a, b) -> bool:
    a, b = str(a), str(b)
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


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


def _short(names: list[str], most: int = 8) -> str:
    if not names:
        return "none"
    return ", ".join(map(str, names[:most])) + (f" and {len(names) - most} more" if len(names) > most else "")
