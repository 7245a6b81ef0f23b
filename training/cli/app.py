"""The Trainer commands of `imgcls` (fit, validate, test, predict): LightningCLI for ImageClassifier + a data source, a
library that the command on top (imgcls/commands.py), a sweep's trial and the tests call.

    imgcls fit --config configs/quickstart.yaml
    imgcls validate --config runs/quickstart/config.yaml --ckpt_path runs/quickstart/checkpoints/last.ckpt

What the CLI adds that no config file shows (`--print_config` does not list these):
- the fault guards on every run, after the configured callbacks: `training.resume.ExactResume`,
  `LrPlanAcrossResumes`, `Preemption`, `NonFiniteLossGuard` and `DiskSpace` (docs/FAULT_TOLERANCE.md);
- `training.resume.checkpoints.AtomicCheckpointIO` as the checkpoint writer, unless `trainer.plugins` names a
  CheckpointIO;
- `training.callbacks.PredictionWriter` for `predict`, unless a BasePredictionWriter is configured;
- `training.callbacks.RunConfig`, which saves the resolved config into the run directory;
- Lightning's TensorBoard, CSV and W&B loggers built as their resumable classes in training/records/loggers.py, with
  `CurvesAcrossResumes` among the fault guards (one curve across resumes and kills);
- the links data -> model (`num_classes`, `class_names`, `multilabel`, `input_contract`, `batch_size`) and the top-level
  `auto_resume`.
What it adds that `--print_config` shows, each by a key of its own: `checkpoint`, the run's checkpoints in
<run>/checkpoints (`Checkpointing`, training/callbacks/model_checkpoint.py: a `ModelCheckpoint` and a `StepCheckpoint`,
before the configured callbacks, so that `trainer.checkpoint_callback` is the run's), and `freeze`, the
`training.callbacks.FreezeBackbone` of every run (off unless a config sets `freeze.epochs`). A ModelCheckpoint listed
in `trainer.callbacks` is the user's own, kept beside the run's.
The data source is any `datamodules.ClassificationData` subclass, chosen by `data.class_path` (default
`datamodules.ImageFolderDataModule`; docs/EXTENDING.md, "Data source").
Beside it in training/cli/: what a command takes from a checkpoint (from_checkpoint.py), how the model, data and
loggers are built (instantiators.py), one-line errors (errors.py; a parse error's in core/parse_errors.py, which every
command's parser shares). The run directory and the closing summary are in training/records/run_dir.py.
"""

from __future__ import annotations

import importlib
import itertools
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
from lightning.pytorch.callbacks import (
    BasePredictionWriter,
    Checkpoint,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelSummary,
    ProgressBar,
    WeightAveraging,
)
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_info

from core.parse_errors import OneLineErrorParser
from datamodules import ClassificationData, CsvDataModule, HFDataModule, ImageFolderDataModule
from lightning_modules import ImageClassifier
from training.callbacks import FreezeBackbone, PredictionWriter, RunConfig
from training.callbacks.model_checkpoint import Checkpointing
from training.cli.from_checkpoint import resolve_checkpoint
from training.cli.instantiators import DataInstantiator, LoggerInstantiator, ModelInstantiator
from training.cli.preflight import check_batch_norm, check_input_side, check_monitored
from training.distributed.strategy import destroy_process_groups
from training.records.loggers import wandb_online
from training.records.run_dir import closing_summary, config_loggers, metrics_table, place_in_run_dir
from training.records.saved_run import SavedRun, explicit_keys, set_by_user
from training.resume import fault_callbacks
from training.resume.checkpoints import AtomicCheckpointIO, ResumePlan
from training.trainer import Trainer

DEFAULT_DATA = f"{ImageFolderDataModule.__module__}.{ImageFolderDataModule.__name__}"
# The shipped data sources that a config may name by their class name alone (`data.class_path: CsvDataModule`): the
# parser resolves such a name among the subclasses of ClassificationData imported, and `datamodules` imports each
# name when first used. ShardsDataModule (LitData) by its full path only.
SHORT_NAMED_DATA = (ImageFolderDataModule, CsvDataModule, HFDataModule)
# Lightning refuses a checkpoint or progress bar callback next to its Trainer switch turned off, and a learning rate
# monitor without a logger, and keeps a model summary callback whatever its switch says; the shipped callbacks list
# (configs/callbacks/default.yaml) has each kind but checkpoints (the `checkpoint` key's, which the switch leaves out
# too), and a user's list may have one: `--trainer.SWITCH false` alone leaves them out.
SWITCHED = {"enable_checkpointing": Checkpoint, "enable_progress_bar": ProgressBar,
            "enable_model_summary": ModelSummary, "logger": LearningRateMonitor}

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
set_dumper("yaml", lambda data: yaml.dump(data, Dumper=_ConfigDumper, default_flow_style=False, allow_unicode=True,
                                          sort_keys=False))


class _Parser(OneLineErrorParser, LightningArgumentParser):
    """LightningCLI's parser, whose errors are one line."""


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

    def __init__(self, *args, **kwargs) -> None:
        argv = kwargs.get("args")
        argv = sys.argv[1:] if argv is None else argv
        argv = argv if isinstance(argv, list) else []  # a dict or Namespace of values: no command line
        self.command = argv[0] if argv else None
        # Help shows each settings field's one-line docstring (model.recipe, model.levers: litgpt-style dataclasses),
        # which jsonargparse finds by parsing the source of every class the parser is built from: 2 of the 5 s that
        # a small fit takes after its imports. Only a command that prints help pays for it.
        set_parsing_settings(docstring_parse_attribute_docstrings=asks_for_help(argv))
        super().__init__(*args, **kwargs)

    def subcommands(self) -> dict[str, set[str]]:  # LightningCLI's staticmethod: the subcommands it builds parsers of
        """The parser of the subcommand that runs, alone (each takes a tenth of a small fit's seconds to build); all
        four where none comes first (`imgcls --help`, a mistyped one)."""
        every = LightningCLI.subcommands()
        return {self.command: every[self.command]} if self.command in every else every

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.set_defaults({"data": {"class_path": DEFAULT_DATA}})  # a config's `data:` keys are its init_args
        # The data knows its classes once it has listed the folders: nobody types the number of classes.
        parser.link_arguments("data.num_classes", "model.num_classes", apply_on="instantiate")
        parser.link_arguments("data.class_names", "model.class_names", apply_on="instantiate")
        parser.link_arguments("data.multilabel", "model.multilabel", apply_on="instantiate")  # train/labels.csv
        parser.link_arguments("data.input_contract", "model.input_contract", apply_on="instantiate")  # eval transform
        parser.link_arguments("data.batch_size", "model.batch_size", apply_on="instantiate")  # lr scaling
        # Callbacks of every run, each with a key of its own (checkpoint.monitor; freeze.epochs, 0 by default: off):
        # a config or recipe sets them without listing trainer.callbacks, to which a later config can append but whose
        # items it cannot change (jsonargparse's list append).
        parser.add_class_arguments(Checkpointing, "checkpoint")
        parser.add_lightning_class_args(FreezeBackbone, "freeze")
        parser.add_argument("--auto_resume", type=bool, default=False,
                            help="fit: resume from the newest intact checkpoint of the run directory, if any")

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        super().parse_arguments(parser, args)
        self.explicit = explicit_values(parser, args)
        # Before LightningCLI reads the hyperparameters of --ckpt_path: `last`, auto_resume and a broken checkpoint
        # resolved to an intact file, and a resume checked against the run it would continue.
        resolve_checkpoint(self)

    def explicit_of(self, subcommand: str):
        return self.explicit.get(subcommand) if self.explicit is not None else None

    def before_instantiate_classes(self) -> None:
        # The model and data instantiators replace the two Lightning has added (the same keys); the loggers' is ours.
        self.parser.add_instantiator(ModelInstantiator(cli=self, key="model"), ImageClassifier,
                                    subclasses=self.subclass_mode_model)
        self.parser.add_instantiator(DataInstantiator(cli=self, key="data"), ClassificationData,
                                    subclasses=self.subclass_mode_data)
        self.parser.add_instantiator(LoggerInstantiator(self), Logger)
        config = self.config[self.subcommand]
        place_in_run_dir(config, self.subcommand)
        for switch, kind in SWITCHED.items():
            callbacks = config.trainer.callbacks
            if config.trainer.get(switch) in (False, []) and isinstance(callbacks, list):  # logger: [] is none too
                config.trainer.callbacks = [c for c in callbacks if not names_subclass(c.class_path, kind)]
        for logger in config_loggers(config):
            if getattr(logger, "class_path", "").endswith("WandbLogger") and wandb_online():
                logger.init_args.offline = False
        if self.saved_run is not None and self.subcommand == "predict":
            explicit = explicit_keys(self.explicit_of(self.subcommand), "data")
            data = config.data.init_args
            if "root" in data and not set_by_user("root", explicit):
                data.root = None  # the classes come from the checkpoint: no data folder needed

    def before_fit(self) -> None:
        check_monitored(self.trainer, self.model, self.datamodule)
        check_batch_norm(self.model, self.datamodule)
        check_input_side(self.model, self.datamodule, fit=True)

    def before_validate(self) -> None:
        check_input_side(self.model, self.datamodule)

    before_test = before_predict = before_validate

    def instantiate_trainer(self, **kwargs):
        # Every checkpoint is written atomically and loaded with weights_only=True, unless a config names its own
        # CheckpointIO (e.g. training.resume.checkpoints.AsyncAtomicCheckpointIO: the same, written in the background).
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        trainer_config = config.get("trainer") or {}
        plugins = as_list(trainer_config.get("plugins"))
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            kwargs["plugins"] = [*plugins, AtomicCheckpointIO()]
        checkpointing = config.get("checkpoint")
        if checkpointing is not None and trainer_config.get("enable_checkpointing") is not False:
            folder = Path(trainer_config["default_root_dir"]) / "checkpoints"  # the run directory's, set by now
            kwargs["callbacks"] = run_checkpoints(checkpointing, folder, as_list(trainer_config.get("callbacks")))
        trainer = super().instantiate_trainer(**kwargs)
        trainer.resume_plan = self.resume_plan  # followed once the ranks agree (AgreedResume._run)
        if self.subcommand == "predict" and not any(isinstance(c, BasePredictionWriter) for c in trainer.callbacks):
            trainer.callbacks.append(PredictionWriter())  # predictions.csv in the run directory
        return trainer

    def after_fit(self) -> None:
        """Print the best checkpoint's validation metrics, then say where everything is. The best checkpoint is
        validated again from its file only where no validation of the fit was of its weights (ours, not a plain
        Lightning ModelCheckpoint, keeps each saved file's)."""
        trainer = self.trainer
        ckpt = trainer.checkpoint_callback  # the run's (the `checkpoint` key's, listed first), or the user's first
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
            # training.callbacks.ModelCheckpoint's record; not a plain Lightning one's
            seen = ckpt.best_validation() if hasattr(ckpt, "best_validation") else None
            if trainer.strategy.broadcast(seen is not None):
                # A validation of the fit was of the best checkpoint's weights: its metrics are the best's already.
                # On stdout, where Lightning prints the table of a validation.
                if trainer.is_global_zero:
                    print(metrics_table(seen["metrics"], f"the best checkpoint (validated at step {seen['step']})"),
                          flush=True)
            else:
                trainer.validate(self.model, datamodule=self.datamodule, ckpt_path=best, verbose=True)
        rank_zero_info(closing_summary(trainer, best, score, monitor, lasts))


def run_checkpoints(checkpointing: Checkpointing, folder: Path, configured: list) -> list:
    """The run's checkpoint callbacks (`checkpointing`'s, in `folder`), then the configured callbacks. A configured
    ModelCheckpoint that would write last.ckpt into the same folder is refused in one line: two writers of one file."""
    ours = checkpointing.callbacks(folder)
    for callback in configured:
        if (checkpointing.save_last and isinstance(callback, ModelCheckpoint) and callback.save_last
                and callback.dirpath and Path(callback.dirpath).resolve() == folder.resolve()):
            raise ValueError(f"trainer.callbacks lists a {type(callback).__name__} (monitor {callback.monitor}) that "
                             f"writes last.ckpt into {folder}, as the run's own checkpoints do (the checkpoint key): "
                             "give it another dirpath or save_last: false (to rank the run's checkpoints by another "
                             "metric, set checkpoint.monitor and checkpoint.mode instead)")
    return [*ours, *configured]


def as_list(value) -> list:
    """A Trainer argument that takes one item or a list (callbacks, plugins), as a list."""
    return [] if value is None else value if isinstance(value, list) else [value]


def names_subclass(class_path: str, kind: type) -> bool:
    """Whether `class_path` (a config's) names a subclass of `kind`; False where it names nothing importable."""
    module, _, name = class_path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return False
    return isinstance(found, type) and issubclass(found, kind)


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


def asks_for_help(args: list[str]) -> bool:
    """Whether a command line prints help text: `--help`, `-h`, `--KEY.help CLASS` or `--print_config=comments`."""
    return any(arg in ("-h", "--help") or arg.endswith(".help") or
               (arg.startswith("--print_config") and "comments" in (arg.partition("=")[2] or follows).split(","))
               for arg, follows in itertools.pairwise([*args, ""]))


def cli_main(args: list[str] | None = None, trainer_defaults: dict | None = None, epilog: str = "") -> ImgclsCLI:
    """Build and run the LightningCLI; `args` None reads sys.argv; `epilog` ends its --help (the other commands).
    Returns the CLI (trainer, model, datamodule)."""
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
            parser_class=_Parser,
        )
    except SystemExit:  # Preemption's exit after its checkpoint, which every rank agreed on (or --help: no group yet)
        destroy_process_groups()
        raise
    # The run is over on every rank: its process groups go now, not at interpreter shutdown, where a gloo worker
    # thread still releasing the last collective aborts the process (destroy_process_groups). Not after any other
    # exception: a collective still waiting for a lost peer would hold that up until the timeout.
    destroy_process_groups()
    return cli

