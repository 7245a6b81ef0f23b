"""What a command takes from a checkpoint or a model folder, decided right after parsing (`ImgclsCLI.parse_arguments`):
`--ckpt_path last` and auto_resume resolved to an intact file, an evaluation without --ckpt_path given its run's best
checkpoint, a resume checked against the run it would continue, and the saved model (and, to evaluate it, its data
class and evaluation transform) merged into the config. LightningCLI reads the hyperparameters of the resolved
--ckpt_path itself next, and merges the same values again."""

from __future__ import annotations

import importlib
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_info

from datamodules import ImageFolderDataModule
from lightning_modules.network import net_weights
from lightning_modules.pretrained import is_model_folder, model_hparams, network_kwargs_of, read_config
from training.records.run_dir import checkpoint_folders, run_dir
from training.records.saved_run import (
    NoCheckpointError,
    SavedRun,
    best_checkpoint_of,
    evaluation_data,
    explicit_class,
    explicit_keys,
)
from training.resume.checkpoints import newest_intact_checkpoint, resolve_resume
from training.resume.same_run import check_resume_overrides


def resolve_checkpoint(cli) -> None:
    """Resolve the checkpoint (or model folder) `cli`'s command runs from, and merge what it saved into `cli.config`;
    sets `cli.resume_plan`, `cli.saved_run` and `cli.resume_how`."""
    subcommand = cli.config.get("subcommand")
    if not subcommand:
        return
    config = cli.config[subcommand]
    asked = config.ckpt_path
    if subcommand == "fit":
        # Every folder a checkpoint of this run can be in: each callback's, and the run's own (a callback with no
        # dirpath, and the preemption save, write there).
        cli.resume_plan = resolve_resume(config.ckpt_path, [run_dir(config) / "checkpoints",
                                                            *checkpoint_folders(config)], config.auto_resume)
        config.ckpt_path = cli.resume_plan.path
    elif config.ckpt_path is None:
        config.ckpt_path = checkpoint_to_evaluate(subcommand, config)
    elif config.ckpt_path in ("last", "best"):
        config.ckpt_path = named_checkpoint(subcommand, config, config.ckpt_path)
    path = config.ckpt_path
    if not path and is_model_folder(net_weights(config.model.get("net"))):  # a folder of `imgcls publish`
        _from_model_folder(cli, subcommand, net_weights(config.model.get("net")))
        return
    if not path or not Path(path).exists():  # none, or Lightning's "best" / "hpc" / "registry"
        return
    cli.saved_run = saved = SavedRun.read(path)
    if subcommand == "fit":
        cli.resume_how = how = "auto_resume" if asked is None else f"--ckpt_path {asked}"
        check_resume_overrides(saved, config.model, explicit_keys(cli.explicit_of(subcommand), "model"), how)
    hparams = {k: v for k, v in saved.model.items() if k != "_instantiator"}
    if "_class_path" in hparams:  # a model configured by class_path, as LightningCLI stores it
        hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
    # The checkpoint's hyperparameters over the config's, as LightningCLI merges them (here for a sharded checkpoint
    # too, a folder, which LightningCLI skips; and before the checks of the instantiators read them).
    if hparams:
        cli.config = cli.parser.parse_object({subcommand: {"model": hparams}}, cli.config)
    if subcommand != "fit":
        _evaluate_as_saved(cli, subcommand, saved)


def checkpoint_to_evaluate(subcommand: str, config) -> str | None:
    """validate, test or predict without --ckpt_path: the run directory's best checkpoint, else the pretrained
    weights (said in one line), else a refusal: an untrained network is never evaluated in silence."""
    if is_model_folder(net_weights(config.model.get("net"))):
        return None  # the model folder's own weights (_from_model_folder)
    folder = run_dir(config)
    found = best_checkpoint_of(folder, checkpoint_folders(config))
    if found is not None:
        path, score = found
        rank_zero_info(f"{subcommand}: no --ckpt_path, so the best checkpoint of {folder}: {path}"
                       + (f" ({score})" if score else ""))
        return path
    weights = net_weights(config.model.get("net"))
    if weights:
        rank_zero_info(f"{subcommand}: no --ckpt_path and no checkpoint in {folder / 'checkpoints'}: evaluating "
                       f"the pretrained weights model.net.weights={weights} with an untrained head")
        return None
    raise NoCheckpointError(
        f"{subcommand}: no --ckpt_path and no checkpoint in {folder / 'checkpoints'}: the network is untrained; "
        f"pass --ckpt_path RUN/checkpoints/last.ckpt (or --config RUN/config.yaml of a trained run)")


def named_checkpoint(subcommand: str, config, name: str) -> str:
    """validate, test or predict with --ckpt_path last or best: that checkpoint of the run directory, as fit's
    `last` finds it. Lightning takes `last` from the files named last* in its callbacks' folders (none: a warning,
    then an untrained network evaluated) and `best` from what its callbacks saved in this process (none in an
    evaluation: a traceback)."""
    folder = run_dir(config)
    if name == "best":
        found = best_checkpoint_of(folder, checkpoint_folders(config))
        path = found[0] if found else None
    else:
        path = newest_intact_checkpoint([folder / "checkpoints", *checkpoint_folders(config)])[0]
    if path is None:
        raise NoCheckpointError(f"{subcommand}: --ckpt_path {name}: no checkpoint in {folder / 'checkpoints'}; pass "
                                "--config RUN/config.yaml of a trained run (or --ckpt_path RUN/checkpoints/last.ckpt)")
    rank_zero_info(f"{subcommand}: --ckpt_path {name} of {folder}: {path}")
    return str(path)


def _evaluate_as_saved(cli, subcommand: str, saved: SavedRun) -> None:
    """validate, test and predict of a saved model: the run's data class and evaluation transform, unless the user
    set them."""
    explicit = cli.explicit_of(subcommand)
    data = cli.config[subcommand].data
    # The parse without defaults still names the default class: only another one counts as the user's.
    named = explicit_class(explicit, "data")
    update = evaluation_data(data.init_args, explicit_keys(explicit, "data"), saved, subcommand, data.class_path,
                             None if _is_default_data(named) else named)
    if update:
        cli.config = cli.parser.parse_object({subcommand: {"data": update}}, cli.config)


def published_run(folder: str | Path) -> SavedRun:
    """A model folder (`imgcls publish`) read as a checkpoint's run: its model hyperparameters (network, classes,
    contract)."""
    return SavedRun(Path(folder), model_hparams(read_config(folder)), {}, 0, None, {})


def _from_model_folder(cli, subcommand: str, folder: str) -> None:
    """--model.net.weights FOLDER (`imgcls publish`): its network always; for validate, test and predict also its
    classes and input contract, as a checkpoint's (the weights are loaded by ModelInstantiator)."""
    saved = published_run(folder)
    model = saved.model if subcommand != "fit" else {k: saved.model[k] for k in network_kwargs_of(saved.model)}
    # The folder's network, still pointing at the folder: ModelInstantiator loads its weights from there.
    if "weights" in model["net"]["init_args"]:
        model = {**model, "net": {**model["net"], "init_args": {**model["net"]["init_args"], "weights": folder}}}
    if subcommand != "fit":
        cli.saved_run = saved
    rank_zero_info(f"{subcommand}: the network of the model folder model.net.weights={folder}"
                   + ("" if subcommand == "fit" else ", with its classes and preprocessing"))
    cli.config = cli.parser.parse_object({subcommand: {"model": model}}, cli.config)
    if subcommand != "fit":
        _evaluate_as_saved(cli, subcommand, saved)


def _is_default_data(class_path: str | None) -> bool:
    """Whether `class_path` names the default data class (by any of its import paths), or none."""
    if not class_path:
        return True
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name) is ImageFolderDataModule
    except (ImportError, AttributeError):
        return False
