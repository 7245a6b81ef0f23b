"""The `imgcls` command: LightningCLI for ImageClassifier + a data source, plus a few helper commands.

    imgcls fit --config configs/quickstart.yaml
    imgcls validate --config runs/quickstart/config.yaml --ckpt_path runs/quickstart/checkpoints/last.ckpt

What the CLI adds that no config file shows (`--print_config` does not list these):
- the fault guards on every run, after the configured callbacks: `training.resume.ExactResume`, `Preemption` and
  `NonFiniteLossGuard` (docs/FAULT_TOLERANCE.md);
- `training.resume.checkpoints.AtomicCheckpointIO` as the checkpoint writer, unless `trainer.plugins` names a
  CheckpointIO;
- `training.callbacks.PredictionWriter` for `predict`, unless a BasePredictionWriter is configured;
- `training.callbacks.RunConfig`, which saves the resolved config into the run directory;
- Lightning's TensorBoard, CSV and W&B loggers built as their resumable classes in training/records/loggers.py, with
  `CurvesAcrossResumes` among the fault guards (one curve across resumes and kills);
- the links data -> model (`num_classes`, `class_names`, `multilabel`, `input_contract`, `batch_size`) and the top-level
  `auto_resume`.
The data source is any `datamodules.ClassificationData` subclass, chosen by `data.class_path` (default
`datamodules.ImageFolderDataModule`; docs/EXTENDING.md, "Data source").
The run directory and the closing summary are in training/records/run_dir.py, one-line errors in training/cli/errors.py
(parse errors: parse_errors.py).
"""

from __future__ import annotations

import importlib
import sys
import warnings
from argparse import RawDescriptionHelpFormatter
from pathlib import Path

import yaml
from jsonargparse import (
    ArgumentError,
    DefaultHelpFormatter,
    Namespace,
    set_dumper,
    set_parsing_settings,
)
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.callbacks import BasePredictionWriter, ModelCheckpoint, WeightAveraging
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, _InstantiatorFn
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_info

from datamodules import ClassificationData, ImageFolderDataModule
from deploy.publish import published_run
from lightning_modules import ImageClassifier
from lightning_modules.network import net_weights, without_pretrained_weights
from lightning_modules.pretrained import is_model_folder, load_network_weights, network_kwargs_of
from training.callbacks import ModelCheckpoint as ImgclsCheckpoint
from training.callbacks import PredictionWriter, RunConfig
from training.cli.errors import exit_code
from training.cli.parse_errors import OneLineErrorParser
from training.cli.preflight import check_monitored
from training.distributed.strategy import destroy_process_groups
from training.records.loggers import LoggerInstantiator, wandb_online
from training.records.run_dir import checkpoint_callbacks, checkpoint_folders, closing_summary, metrics_table, run_dir
from training.records.saved_run import (
    ClassMismatchError,
    NoCheckpointError,
    SavedRun,
    best_checkpoint_of,
    check_classes,
    check_resume_overrides,
    check_same_data,
    check_unfinished,
    evaluation_data,
    explicit_class,
    explicit_keys,
    set_by_user,
)
from training.resume.checkpoints import AtomicCheckpointIO, ResumePlan, resolve_resume
from training.resume.faults import fault_callbacks
from training.trainer import Trainer

# Commands that are not Trainer entry points; each is a `main(argv)` in its own module (imported lazily).
EXTRA_COMMANDS = {
    "demo-data": ("datamodules.demo", "write the scikit-learn digits as an image-folder tree"),
    "prepare-data": ("datamodules.shards", "convert an image folder into LitData shards (ShardsDataModule)"),
    "sweep": ("training.sweeps.command", "run a config-file hyperparameter sweep (W&B sweep schema) with Optuna"),
    "report": ("training.records.report", "write PNG curves and a Markdown summary of a run from its logs"),
    "export": ("deploy.export", "export a checkpoint to ONNX or TorchScript for deployment"),
    "publish": ("deploy.publish", "write a checkpoint as a model folder in the Hugging Face Hub's layout"),
    "serve": ("deploy.serve", "serve a model folder or checkpoint over HTTP with LitServe (dynamic batching)"),
}

DEFAULT_DATA = f"{ImageFolderDataModule.__module__}.{ImageFolderDataModule.__name__}"

# Deprecations raised inside the pinned libraries on every fit, which no config can act on: Lightning 2.6's pytree
# helper under torch 2.14, and torchdata's StatefulDataLoader calling torch's deprecated set_vital.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
# Lightning's WeightAveraging (EMA) warns about any model with configure_model, for sharded layers; ours only picks the
# speed levers (channels_last, compile), so the averaged copy is the whole model.
warnings.filterwarnings("ignore", message="You're using the WeightAveraging callback with a model that overrides")


class _ConfigDumper(yaml.SafeDumper):
    """jsonargparse's YAML dumper (the one `set_dumper` replaces: same keyword arguments), which also writes the
    restricted numbers (PositiveInt, ImageSide: int and float subclasses) as plain numbers. jsonargparse keeps a
    value's object when `data.class_path` changes, so the quickstart's image_size, parsed as the image folder's
    ImageSide, reaches a user's `image_size: int` still an ImageSide, which SafeDumper cannot represent."""


_ConfigDumper.add_multi_representer(int, lambda dumper, value: dumper.represent_int(int(value)))
_ConfigDumper.add_multi_representer(float, lambda dumper, value: dumper.represent_float(float(value)))
# `--help` shows each settings field's one-line docstring (model.recipe, model.levers: litgpt-style dataclasses).
set_parsing_settings(docstring_parse_attribute_docstrings=True)
set_dumper("yaml", lambda data: yaml.dump(data, Dumper=_ConfigDumper, default_flow_style=False, allow_unicode=True,
                                          sort_keys=False))


class _HelpFormatter(DefaultHelpFormatter, RawDescriptionHelpFormatter):
    """Keeps the line breaks of the epilog that lists the extra commands."""


class ImgclsCLI(LightningCLI):
    """Registers the model and data, links what they share, and derives paths from the run directory.

    `trainer.default_root_dir` is the run directory. Checkpoints go to `<run>/checkpoints` (unless a ModelCheckpoint
    names a dirpath), loggers whose `save_dir` is "" write into `<run>`, and the resolved config is `<run>/config.yaml`.
    """

    resume_plan: ResumePlan | None = None  # fit: the checkpoint this process found for --ckpt_path last/auto_resume
    saved_run: SavedRun | None = None  # what the checkpoint of --ckpt_path (or the one found for it) says of its run
    resume_how = ""  # fit: "auto_resume" or "--ckpt_path X", as the user asked for the checkpoint
    explicit = None  # the values a config file or the command line set, without the defaults

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.set_defaults({"data": {"class_path": DEFAULT_DATA}})  # a config's `data:` keys are its init_args
        # The data knows its classes once it has listed the folders: nobody types the number of classes.
        parser.link_arguments("data.num_classes", "model.num_classes", apply_on="instantiate")
        parser.link_arguments("data.class_names", "model.class_names", apply_on="instantiate")
        parser.link_arguments("data.multilabel", "model.multilabel", apply_on="instantiate")  # train/labels.csv
        parser.link_arguments("data.input_contract", "model.input_contract", apply_on="instantiate")  # eval transform
        parser.link_arguments("data.batch_size", "model.batch_size", apply_on="instantiate")  # lr scaling
        parser.add_argument("--auto_resume", type=bool, default=False,
                            help="fit: resume from the newest intact checkpoint of the run directory, if any")

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        super().parse_arguments(parser, args)
        self.explicit = explicit_values(parser, args)

    def _parse_ckpt_path(self) -> None:
        # LightningCLI reads the model hyperparameters of --ckpt_path here, before any other hook: so this is where
        # `last`, auto_resume and a broken checkpoint are resolved to an intact file, where an evaluation without a
        # checkpoint finds its run's best one, and where a resume is checked against the run it would continue.
        subcommand = self.config.get("subcommand")
        if not subcommand:
            return
        config = self.config[subcommand]
        asked = config.ckpt_path
        if subcommand == "fit":
            # Every folder a checkpoint of this run can be in: each callback's, and the run's own (a callback with no
            # dirpath, and the preemption save, write there).
            self.resume_plan = resolve_resume(config.ckpt_path, [run_dir(config) / "checkpoints",
                                                                 *checkpoint_folders(config)], config.auto_resume)
            config.ckpt_path = self.resume_plan.path
        elif config.ckpt_path is None:
            config.ckpt_path = self._checkpoint_to_evaluate(subcommand, config)
        path = config.ckpt_path
        if not path and is_model_folder(net_weights(config.model.get("net"))):  # a folder of `imgcls publish`
            self._from_model_folder(subcommand, net_weights(config.model.get("net")))
            return
        if not path or not Path(path).exists():  # none, or Lightning's "best" / "hpc" / "registry"
            return
        self.saved_run = saved = SavedRun.read(path)
        if subcommand == "fit":
            self.resume_how = how = "auto_resume" if asked is None else f"--ckpt_path {asked}"
            check_resume_overrides(saved, config.model, explicit_keys(self.explicit_of(subcommand), "model"), how)
        hparams = {k: v for k, v in saved.model.items() if k != "_instantiator"}
        if "_class_path" in hparams:  # a model configured by class_path, as LightningCLI stores it
            hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
        if hparams:  # the checkpoint's hyperparameters over the config's, as LightningCLI merges them
            self.config = self.parser.parse_object({subcommand: {"model": hparams}}, self.config)
        if subcommand != "fit":
            self._evaluate_as_saved(subcommand, saved)

    def _evaluate_as_saved(self, subcommand: str, saved: SavedRun) -> None:
        """validate, test and predict of a saved model: the run's data class and evaluation transform, unless the
        user set them."""
        explicit = self.explicit_of(subcommand)
        data = self.config[subcommand].data
        # The parse without defaults still names the default class: only another one counts as the user's.
        named = explicit_class(explicit, "data")
        update = evaluation_data(data_args(self.config[subcommand]), explicit_keys(explicit, "data"), saved,
                                 subcommand, data.class_path, None if _is_default_data(named) else named)
        if update:
            self.config = self.parser.parse_object({subcommand: {"data": update}}, self.config)

    def _from_model_folder(self, subcommand: str, folder: str) -> None:
        """--model.net.weights FOLDER (`imgcls publish`): its network always; for validate, test and predict also its
        classes and input contract, as a checkpoint's (the weights are loaded by _ModelInstantiator)."""
        saved = published_run(folder)
        model = saved.model if subcommand != "fit" else {k: saved.model[k] for k in network_kwargs_of(saved.model)}
        # The folder's network, still pointing at the folder: _ModelInstantiator loads its weights from there.
        if "weights" in model["net"]["init_args"]:
            model = {**model, "net": {**model["net"], "init_args": {**model["net"]["init_args"], "weights": folder}}}
        if subcommand != "fit":
            self.saved_run = saved
        rank_zero_info(f"{subcommand}: the network of the model folder model.net.weights={folder}"
                       + ("" if subcommand == "fit" else ", with its classes and preprocessing"))
        self.config = self.parser.parse_object({subcommand: {"model": model}}, self.config)
        if subcommand != "fit":
            self._evaluate_as_saved(subcommand, saved)

    def _checkpoint_to_evaluate(self, subcommand: str, config) -> str | None:
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

    def explicit_of(self, subcommand: str):
        return self.explicit.get(subcommand) if self.explicit is not None else None

    def before_instantiate_classes(self) -> None:
        # The model and data instantiators replace the two Lightning has added (the same keys); the loggers' is ours.
        self.parser.add_instantiator(_ModelInstantiator(cli=self, key="model"), ImageClassifier,
                                    subclasses=self.subclass_mode_model)
        self.parser.add_instantiator(_DataInstantiator(cli=self, key="data"), ClassificationData,
                                    subclasses=self.subclass_mode_data)
        self.parser.add_instantiator(LoggerInstantiator(self), Logger)
        config = self.config[self.subcommand]
        folder = run_dir(config)
        config.trainer.default_root_dir = str(folder)
        loggers = config.trainer.logger
        for logger in loggers if isinstance(loggers, list) else [loggers]:
            init = getattr(logger, "init_args", None)
            if init is not None and "save_dir" in init and init.save_dir in ("", None):
                init.save_dir = str(folder)
            if init is not None and self.subcommand != "fit" and init.get("version") == "":
                # validate/test/predict of a run log into a series of their own (<run>/validate/...), never into
                # the training curves at step 0.
                init.version = self.subcommand
            if init is not None and logger.class_path.endswith("WandbLogger") and wandb_online():
                init.offline = False
        for callback in checkpoint_callbacks(config):
            if callback.init_args.dirpath is None:
                callback.init_args.dirpath = str(folder / "checkpoints")
        if config.trainer.get("enable_progress_bar") is False and config.trainer.callbacks:
            # The shipped configs list a RichProgressBar, which Lightning refuses next to enable_progress_bar=false.
            config.trainer.callbacks = [c for c in config.trainer.callbacks if not c.class_path.endswith("ProgressBar")]
        if self.saved_run is not None and self.subcommand == "predict":
            explicit = explicit_keys(self.explicit_of(self.subcommand), "data")
            data = data_args(config)
            if "root" in data and not set_by_user("root", explicit):
                data.root = None  # the classes come from the checkpoint: no data folder needed

    def before_fit(self) -> None:
        check_monitored(self.trainer, self.model, self.datamodule)

    def instantiate_trainer(self, **kwargs):
        # Every checkpoint is written atomically and loaded with weights_only=True, unless a config names its own
        # CheckpointIO (e.g. training.resume.checkpoints.AsyncAtomicCheckpointIO: the same, written in the background).
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        plugins = (config.get("trainer") or {}).get("plugins") or []
        plugins = plugins if isinstance(plugins, list) else [plugins]
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            kwargs["plugins"] = [*plugins, AtomicCheckpointIO()]
        trainer = super().instantiate_trainer(**kwargs)
        trainer.resume_plan = self.resume_plan  # followed once the ranks agree (Trainer._run)
        if self.subcommand == "predict" and not any(isinstance(c, BasePredictionWriter) for c in trainer.callbacks):
            trainer.callbacks.append(PredictionWriter())  # predictions.csv in the run directory
        return trainer

    def after_fit(self) -> None:
        """Print the best checkpoint's validation metrics, then say where everything is. The best checkpoint is
        validated again from its file unless the fit's newest validation was of its weights (ours, not a plain
        Lightning ModelCheckpoint, knows)."""
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
            if isinstance(ckpt, ImgclsCheckpoint) and trainer.strategy.broadcast(ckpt.best_is_last_validated(trainer)):
                # The newest validation was of the best checkpoint's weights: its metrics are the best's already.
                # On stdout, where Lightning prints the table of a validation.
                if trainer.is_global_zero:
                    print(metrics_table(trainer.callback_metrics, f"the best checkpoint (validated at step "
                                        f"{ckpt.validated_step}, the end of the fit)"), flush=True)
            else:
                trainer.validate(self.model, datamodule=self.datamodule, ckpt_path=best, verbose=True)
        rank_zero_info(closing_summary(trainer, best, score, monitor, lasts))


class _ModelInstantiator(_InstantiatorFn):
    """With a ckpt_path (validate, test, predict, a resumed fit) the checkpoint overwrites every weight, so the
    network is built without its `weights` argument (model.net.weights): no download, which offline machines cannot
    make. The hyperparameters come from the config, so config.yaml and new checkpoints keep the configured weights for
    a fresh fit."""

    def __call__(self, class_type, *args, applied_instantiation_links: dict, **kwargs):
        net = kwargs.get("net")
        weights = net_weights(net)
        folder = weights if is_model_folder(weights) else None
        if folder is not None:  # loaded below, with the head when it fits (the same classes)
            kwargs["net"] = without_pretrained_weights(net)
        elif self.cli.config[self.cli.subcommand].get("ckpt_path") and without_pretrained_weights(net) is not net:
            rank_zero_info(f"model.net.weights={weights} not loaded: the checkpoint supplies every weight")
            kwargs["net"] = without_pretrained_weights(net)
        model = super().__call__(class_type, *args, applied_instantiation_links=applied_instantiation_links, **kwargs)
        if folder is not None:
            head = load_network_weights(model.net, folder, head=True)
            rank_zero_info(f"model.net.weights={folder}: loaded the network" + ("" if head else
                           "'s backbone (other classes: a new head)"))
        return model


class _DataInstantiator(_InstantiatorFn):
    """The classes of a command run from a checkpoint are the checkpoint's: `predict` takes them whatever the data
    folder holds (with `data.root: null` there is none), `validate` and `test` check the folder's against them, and a
    resumed fit checks that the data is its run's (training.records.saved_run)."""

    def __call__(self, class_type, *args, applied_instantiation_links: dict, **kwargs):
        datamodule = super().__call__(class_type, *args, applied_instantiation_links=applied_instantiation_links,
                                      **kwargs)
        cli, saved = self.cli, self.cli.saved_run
        config = cli.config[cli.subcommand]
        if saved is None or saved.class_names is None:
            return datamodule
        root = data_args(config).get("root")
        if cli.subcommand == "fit":  # the same run (its classes and data), and not finished
            check_same_data(saved, root, datamodule.class_names, cli.resume_how)
            check_unfinished(saved, config.trainer.max_epochs, config.trainer.max_steps, cli.resume_how)
            return datamodule
        multilabel = bool(saved.model.get("multilabel"))
        if cli.subcommand != "predict":
            datamodule.class_names = check_classes(datamodule.class_names, saved, root, cli.subcommand)
            if datamodule.multilabel != multilabel:
                kinds = {True: "multi-label", False: "single-label"}
                raise ClassMismatchError(f"the checkpoint {saved.path} is {kinds[multilabel]} and data.root="
                                         f"{root} is {kinds[datamodule.multilabel]}")
        datamodule.class_names, datamodule.multilabel = saved.class_names, multilabel
        return datamodule


def _is_default_data(class_path: str | None) -> bool:
    """Whether `class_path` names the default data class (by any of its import paths), or none."""
    if not class_path:
        return True
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name) is ImageFolderDataModule
    except (ImportError, AttributeError):
        return False


def data_args(config) -> Namespace:
    """The data source's arguments in a command's config: `data.init_args` (the config names its class by
    `data.class_path`)."""
    return config.data.init_args


def explicit_values(parser: LightningArgumentParser, args):
    """What a config file or the command line set, without the defaults (None if that parse fails): the values the
    user chose, which a checkpoint's own must not replace in silence."""
    exit_on_error, parser.exit_on_error = parser.exit_on_error, False
    try:
        if isinstance(args, dict | Namespace):
            return parser.parse_object(args, defaults=False)
        return parser.parse_args(args, defaults=False)
    except ArgumentError as err:
        argv = sys.argv[1:] if args is None else list(args)
        if "arguments are required" in str(err) and ".data" in str(err) and "--data" not in argv:
            # No data named at all (a checkpoint alone): the default class, which counts as nothing named.
            return explicit_values(parser, [*argv, "--data", DEFAULT_DATA])
        return None
    except (ValueError, TypeError):
        return None
    finally:
        parser.exit_on_error = exit_on_error


def cli_main(args: list[str] | None = None, trainer_defaults: dict | None = None) -> ImgclsCLI:
    """Build and run the LightningCLI; `args` None reads sys.argv. Returns the CLI (trainer, model, datamodule)."""
    epilog = "other commands:\n" + "".join(f"  {name:<12} {text}\n" for name, (_, text) in EXTRA_COMMANDS.items())
    try:
        cli = ImgclsCLI(
            ImageClassifier,
            ClassificationData,  # any subclass, by data.class_path; DEFAULT_DATA when a config names none
            subclass_mode_data=True,
            args=args,
            trainer_class=Trainer,  # lightning.Trainer with `precision: auto`, chosen from the hardware
            save_config_callback=RunConfig,
            save_config_kwargs={"overwrite": True},
            # Appended to the configured callbacks, and kept out of config.yaml: the fault guards on every run, and
            # the sweep's reporting callback on a trial.
            trainer_defaults={"callbacks": [*fault_callbacks(), *(trainer_defaults or {}).get("callbacks", [])]},
            auto_configure_optimizers=False,  # the model owns its optimizer and schedule (typed, in its signature)
            parser_kwargs={"epilog": epilog, "formatter_class": _HelpFormatter},
            parser_class=OneLineErrorParser,
        )
    except SystemExit:  # Preemption's exit after its checkpoint, which every rank agreed on (or --help: no group yet)
        destroy_process_groups()
        raise
    # The run is over on every rank: its process groups go now, not at interpreter shutdown, where a gloo worker
    # thread still releasing the last collective aborts the process (destroy_process_groups). Not after any other
    # exception: a collective still waiting for a lost peer would hold that up until the timeout.
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
