"""The `imgcls` command: LightningCLI for ImageClassifier + ImageFolderDataModule, plus a few helper commands.

    imgcls fit --config configs/quickstart.yaml
    imgcls validate --config runs/quickstart/config.yaml --ckpt_path runs/quickstart/checkpoints/last.ckpt

What the CLI adds that no config file shows (`--print_config` does not list these):
- the fault guards on every run, after the configured callbacks: `training.faults.ExactResume`, `Preemption` and
  `NonFiniteLossGuard` (docs/FAULT_TOLERANCE.md);
- `training.checkpointing.AtomicCheckpointIO` as the checkpoint writer, unless `trainer.plugins` names a CheckpointIO;
- `training.callbacks.PredictionWriter` for `predict`, unless a BasePredictionWriter is configured;
- `training.run_dir.RunConfig`, which saves the resolved config into the run directory;
- every WandbLogger built as `training.wandb_runs.SecretSafeWandbLogger`;
- the links data -> model (`num_classes`, `class_names`, `multilabel`, `batch_size`) and the top-level `auto_resume`.
The run directory and the closing summary are in training/run_dir.py, error reporting in training/errors.py.
"""

from __future__ import annotations

if __name__ == "__main__":  # `python -m training.cli`: its imports without the cyclic collector (training/startup.py)
    from training.startup import begin, done

    begin()

import importlib
import pickle
import sys
import warnings
from argparse import RawDescriptionHelpFormatter
from pathlib import Path

import torch
from jsonargparse import DefaultHelpFormatter
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.callbacks import BasePredictionWriter, ModelCheckpoint, WeightAveraging
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, _InstantiatorFn
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_info

from datamodules import ImageFolderDataModule
from datamodules.arguments import plain_parser_error
from lightning_modules import ImageClassifier
from training.callbacks import PredictionWriter
from training.checkpointing import (
    AtomicCheckpointIO,
    ResumePlan,
    UnsafeCheckpointError,
    resolve_resume,
    unsafe_message,
)
from training.errors import exit_code
from training.faults import fault_callbacks
from training.run_dir import RunConfig, checkpoint_callbacks, closing_summary, run_dir
from training.strategy import destroy_process_groups
from training.trainer import Trainer
from training.wandb_runs import WandbInstantiator, wandb_online

# Commands that are not Trainer entry points; each is a `main(argv)` in its own module (imported lazily).
EXTRA_COMMANDS = {
    "demo-data": ("datamodules.demo", "write the scikit-learn digits as an image-folder tree"),
    "prepare-data": ("datamodules.shards", "convert an image folder into LitData shards (data.format: litdata)"),
    "sweep": ("training.sweep", "run a config-file hyperparameter sweep (W&B sweep schema) with Optuna"),
    "report": ("training.report", "write PNG curves and a Markdown summary of a run from its logs"),
    "export": ("training.export", "export a checkpoint to ONNX or TorchScript for deployment"),
}

# Deprecations raised inside the pinned libraries on every fit, which no config can act on: Lightning 2.6's pytree
# helper under torch 2.14, and torchdata's StatefulDataLoader calling torch's deprecated set_vital.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
# Lightning's WeightAveraging (EMA) warns about any model with configure_model, for sharded layers; ours only picks the
# speed levers (channels_last, compile), so the averaged copy is the whole model.
warnings.filterwarnings("ignore", message="You're using the WeightAveraging callback with a model that overrides")


class _HelpFormatter(DefaultHelpFormatter, RawDescriptionHelpFormatter):
    """Keeps the line breaks of the epilog that lists the extra commands."""


class _ArgumentParser(LightningArgumentParser):
    """Words a value out of its range or choices as the model and data do: `model.lr=-0.1 must be positive`."""

    def error(self, message: str, ex: Exception | None = None):
        super().error(plain_parser_error(message), ex)


class ImgclsCLI(LightningCLI):
    """Registers the model and data, links what they share, and derives paths from the run directory.

    `trainer.default_root_dir` is the run directory. Checkpoints go to `<run>/checkpoints` (unless a ModelCheckpoint
    names a dirpath), loggers whose `save_dir` is "" write into `<run>`, and the resolved config is `<run>/config.yaml`.
    """

    resume_plan: ResumePlan | None = None  # fit: the checkpoint this process found for --ckpt_path last/auto_resume

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # The data knows its classes once it has listed the folders: nobody types the number of classes.
        parser.link_arguments("data.num_classes", "model.num_classes", apply_on="instantiate")
        parser.link_arguments("data.class_names", "model.class_names", apply_on="instantiate")
        parser.link_arguments("data.multilabel", "model.multilabel", apply_on="instantiate")  # train/labels.csv
        parser.link_arguments("data.batch_size", "model.batch_size")  # for lr scaling by the global batch
        parser.add_argument("--auto_resume", type=bool, default=False,
                            help="fit: resume from the newest intact checkpoint of the run directory, if any")

    def _parse_ckpt_path(self) -> None:
        # LightningCLI reads the model hyperparameters of --ckpt_path here, before any other hook: so this is where
        # `last`, auto_resume and a broken checkpoint are resolved to an intact file.
        subcommand = self.config.get("subcommand")
        config = self.config.get(subcommand) if subcommand else None
        if subcommand == "fit":
            # Every folder a checkpoint of this run can be in: each callback's, and the run's own (a callback with no
            # dirpath, and the preemption save, write there).
            run_checkpoints = run_dir(config) / "checkpoints"
            folders = [Path(c.init_args.dirpath) for c in checkpoint_callbacks(config) if c.init_args.dirpath]
            self.resume_plan = resolve_resume(config.ckpt_path, [run_checkpoints, *folders], config.auto_resume)
            config.ckpt_path = self.resume_plan.path
        try:
            super()._parse_ckpt_path()
        except pickle.UnpicklingError as err:  # LightningCLI loads it with weights_only=True
            raise UnsafeCheckpointError(unsafe_message(config.ckpt_path, err)) from None

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand]
        folder = run_dir(config)
        config.trainer.default_root_dir = str(folder)
        loggers = config.trainer.logger
        for logger in loggers if isinstance(loggers, list) else [loggers]:
            init = getattr(logger, "init_args", None)
            if init is not None and "save_dir" in init and init.save_dir in ("", None):
                init.save_dir = str(folder)
            if init is not None and logger.class_path.endswith("WandbLogger") and wandb_online():
                init.offline = False
        for callback in checkpoint_callbacks(config):
            if callback.init_args.dirpath is None:
                callback.init_args.dirpath = str(folder / "checkpoints")
        if config.trainer.get("enable_progress_bar") is False and config.trainer.callbacks:
            # The shipped configs list a RichProgressBar, which Lightning refuses next to enable_progress_bar=false.
            config.trainer.callbacks = [c for c in config.trainer.callbacks if not c.class_path.endswith("ProgressBar")]
        if config.data.root is None and config.get("ckpt_path"):
            # Predicting from a checkpoint alone: the eval transform must match training's, so take it from there.
            saved = torch.load(config.ckpt_path, map_location="cpu", weights_only=True)
            for key in ("preset", "image_size", "eval_image_size", "eval_resize_size"):
                if key in saved.get("datamodule_hyper_parameters", {}):
                    config.data[key] = saved["datamodule_hyper_parameters"][key]

    def _add_instantiators(self) -> None:
        super()._add_instantiators()  # the model and data instantiators below replace the two Lightning adds
        self.parser.add_instantiator(_ModelInstantiator(cli=self, key="model"), ImageClassifier,
                                    subclasses=self.subclass_mode_model)
        self.parser.add_instantiator(_DataInstantiator(cli=self, key="data"), ImageFolderDataModule,
                                    subclasses=self.subclass_mode_data)
        self.parser.add_instantiator(WandbInstantiator(self), WandbLogger)

    def instantiate_trainer(self, **kwargs):
        # Every checkpoint is written atomically and loaded with weights_only=True, unless a config names its own
        # CheckpointIO (e.g. training.checkpointing.AsyncAtomicCheckpointIO: the same, written in the background).
        plugins = self._get(self.config_init, "trainer", default={}).get("plugins") or []
        plugins = plugins if isinstance(plugins, list) else [plugins]
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            kwargs["plugins"] = [*plugins, AtomicCheckpointIO()]
        trainer = super().instantiate_trainer(**kwargs)
        trainer.resume_plan = self.resume_plan  # followed once the ranks agree (Trainer._run)
        if self.subcommand == "predict" and not any(isinstance(c, BasePredictionWriter) for c in trainer.callbacks):
            trainer.callbacks.append(PredictionWriter())  # predictions.csv in the run directory
        return trainer

    def after_fit(self) -> None:
        """Validate the best checkpoint (prints the metric table), then say where everything is."""
        trainer = self.trainer
        ckpt = trainer.checkpoint_callback
        if trainer.interrupted or not isinstance(ckpt, ModelCheckpoint):
            return
        # Rank 0 wrote the file (maybe on a background thread, maybe on a disk other nodes do not see): its answer
        # decides for every rank, or the ranks would split between validating and exiting.
        # Read before validating: validate(ckpt_path=best) restores the callbacks' state as it was in that file.
        best, score, monitor = ckpt.best_model_path, ckpt.best_model_score, ckpt.monitor
        lasts = [c.last_model_path for c in trainer.checkpoint_callbacks
                 if isinstance(c, ModelCheckpoint) and c.last_model_path and Path(c.last_model_path).exists()]
        averaging = next((c for c in trainer.callbacks if isinstance(c, WeightAveraging)), None)
        if averaging is not None:
            rank_zero_info(f"{type(averaging).__name__}: validation ran with the averaged weights, and checkpoints "
                           "hold "
                           "them as their state_dict (the trained weights as current_model_state)")
        if trainer.strategy.broadcast(bool(best) and Path(best).exists()):  # a file, or a sharded folder
            trainer.validate(self.model, datamodule=self.datamodule, ckpt_path=best, verbose=True)
        rank_zero_info(closing_summary(trainer, best, score, monitor, lasts))


class _ModelInstantiator(_InstantiatorFn):
    """With a ckpt_path (validate, test, predict, a resumed fit) the checkpoint overwrites every weight, so the
    network is built without `model.weights`: no download, which offline machines cannot make. The hyperparameters
    come from the config, so config.yaml and new checkpoints keep the configured weights for a fresh fit."""

    def __call__(self, class_type, *args, applied_instantiation_links: dict, **kwargs):
        if kwargs.get("weights") and self.cli.config[self.cli.subcommand].get("ckpt_path"):
            rank_zero_info(f"model.weights={kwargs['weights']} not loaded: the checkpoint supplies every weight")
            kwargs["weights"] = None
        return super().__call__(class_type, *args, applied_instantiation_links=applied_instantiation_links, **kwargs)


class _DataInstantiator(_InstantiatorFn):
    """With `data.root: null` there are no folders to list: the classes come from the checkpoint's hyperparameters,
    which LightningCLI has merged into `model`, so the data -> model links do not overwrite them with None."""

    def __call__(self, class_type, *args, applied_instantiation_links: dict, **kwargs):
        datamodule = super().__call__(class_type, *args, applied_instantiation_links=applied_instantiation_links,
                                      **kwargs)
        model = self.cli.config[self.cli.subcommand].model
        if datamodule.class_names is None and model.get("class_names"):
            datamodule.class_names = list(model.class_names)
            datamodule.multilabel = bool(model.get("multilabel"))
        return datamodule


def cli_main(args: list[str] | None = None, trainer_defaults: dict | None = None) -> ImgclsCLI:
    """Build and run the LightningCLI; `args` None reads sys.argv. Returns the CLI (trainer, model, datamodule)."""
    epilog = "other commands:\n" + "".join(f"  {name:<12} {text}\n" for name, (_, text) in EXTRA_COMMANDS.items())
    try:
        cli = ImgclsCLI(
            ImageClassifier,
            ImageFolderDataModule,
            args=args,
            trainer_class=Trainer,  # lightning.Trainer with `precision: auto`, chosen from the hardware
            save_config_callback=RunConfig,
            save_config_kwargs={"overwrite": True},
            # Appended to the configured callbacks, and kept out of config.yaml: the fault guards on every run, and
            # the sweep's reporting callback on a trial.
            trainer_defaults={"callbacks": [*fault_callbacks(), *(trainer_defaults or {}).get("callbacks", [])]},
            auto_configure_optimizers=False,  # the model owns its optimizer and schedule (typed, in its signature)
            parser_kwargs={"epilog": epilog, "formatter_class": _HelpFormatter},
            parser_class=_ArgumentParser,
        )
    except SystemExit:  # Preemption's exit after its checkpoint, which every rank agreed on (or --help: no group yet)
        destroy_process_groups()
        raise
    # The run is over on every rank: its process groups go now, not at interpreter shutdown, where a gloo worker
    # thread still releasing the last collective aborts the process (training.strategy.destroy_process_groups). Not
    # after any other exception: a collective still waiting for a lost peer would hold that up until the timeout.
    destroy_process_groups()
    return cli


def main(argv: list[str] | None = None) -> None:
    """The `imgcls` console script."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] in EXTRA_COMMANDS:
        importlib.import_module(EXTRA_COMMANDS[args[0]][0]).main(args[1:])
        return
    try:
        cli_main(argv)  # None: LightningCLI reads sys.argv itself
    except Exception as err:
        code = exit_code(err)  # a one-line message printed for the user's mistakes and lost peers; None: re-raise
        if code is None:
            raise
        sys.exit(code)

if __name__ == "__main__":
    done()
    main()
