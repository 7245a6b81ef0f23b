"""What a command started from a checkpoint takes from it, and what it refuses.

A checkpoint carries its run: the model's hyperparameters (the class names, the input contract: the evaluation
preprocessing the network was trained with), the DataModule's, and how far the fit got. So

- `imgcls validate|test|predict --ckpt_path X` evaluate with the model's own preprocessing and classes, whatever the
  DataModule's defaults are; a value the user set (on the command line or in a config) is obeyed, with one line when
  it differs from training;
- without `--ckpt_path` they evaluate the run directory's best checkpoint, or say that they evaluate pretrained
  weights, or refuse: never an untrained network in silence;
- `imgcls fit` continues a checkpoint only when it is the same run, unfinished (training/resume/same_run.py).
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
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
from training.resume.same_run import same_path, short_names

log = logging.getLogger(__name__)

# The data keys of the held-out validation split.
SPLIT_KEYS = ("val_split", "split_seed")


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

    @cached_property
    def input_contract(self) -> dict[str, Any]:
        """The model's input contract (its evaluation preprocessing), the one place evaluate, export, publish and serve
        read it: the model's own, or for a model whose data source stated none (it handed over ready tensors) the
        default evaluation preset's, said in one line."""
        from datamodules.presets import ClassificationPresetEval
        from datamodules.transforms import contract_of, name_of

        contract = self.model.get("input_contract")
        if contract is not None:
            return dict(contract)
        contract = contract_of(ClassificationPresetEval())
        warn_line(f"{self.path} carries no input contract (its data source stated none): its preprocessing is taken "
                  f"to be the default, {name_of(contract['transform'])}")
        return contract

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
    # The contract only where the evaluated class takes an evaluation transform (a source may preprocess itself).
    takes_transform = "eval_transform" in (saved.data if "class_path" in update else data)
    trained = saved.input_contract.get("transform") if takes_transform else None
    if trained is not None and set_by_user("eval_transform", explicit):
        asked = _eval_transform_as_run(data)
        if asked != trained:
            warn_line(f"data.eval_transform={name_of(asked)} is set, and the model's input contract names "
                      f"{name_of(trained)} ({saved.path}): {command} uses the one set")
    elif trained is not None:
        init["eval_transform"] = _with_short_forms_set(trained, data, explicit, saved, command)
        taken["data.eval_transform"] = name_of(trained)
    root = data.get("root")
    if root and saved.data.get("root") and same_path(root, saved.data["root"]) and not (Path(root) / "val").is_dir():
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
        f"same: only in the data: {short_names(only_data)}; only in the checkpoint: {short_names(only_ckpt)}; "
        f"{command} needs data with the model's classes (to train on these, start a new run with --model.net.weights "
        f"{saved.path})")


def best_checkpoint_of(run_dir: Path, folders: list[Path]) -> tuple[str, str | None] | None:
    """The best checkpoint of a run directory (as its ModelCheckpoint recorded it) and its score; None without one."""
    newest, _ = newest_intact_checkpoint([run_dir / "checkpoints", *folders])
    if newest is None:
        return None
    return SavedRun.read(newest).best()
