"""How the CLI builds the model, the data source and the loggers from the parsed config (jsonargparse instantiators,
registered in `ImgclsCLI.before_instantiate_classes`): what a checkpoint or a model folder changes of each."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.cli import _InstantiatorFn
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_info

from lightning_modules.network import net_weights, without_pretrained_weights
from lightning_modules.pretrained import is_model_folder, load_network_weights
from training.records.loggers import RESUMABLE
from training.records.run_dir import WANDB_RUN_ID_FILE, run_dir
from training.records.saved_run import ClassMismatchError, check_classes
from training.resume.same_run import check_same_data, check_unfinished


class ModelInstantiator(_InstantiatorFn):
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


class DataInstantiator(_InstantiatorFn):
    """The classes of a command run from a checkpoint are the checkpoint's: `predict` takes them whatever the data
    folder holds (with `data.root: null` there is none), `validate` and `test` check the folder's against them, and a
    resumed fit checks that the data is its run's (training.resume.same_run)."""

    def __call__(self, class_type, *args, applied_instantiation_links: dict, **kwargs):
        datamodule = super().__call__(class_type, *args, applied_instantiation_links=applied_instantiation_links,
                                      **kwargs)
        cli, saved = self.cli, self.cli.saved_run
        config = cli.config[cli.subcommand]
        if saved is None or saved.class_names is None:
            return datamodule
        root = config.data.init_args.get("root")
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


class LoggerInstantiator:
    """Builds each of Lightning's TensorBoard, CSV and W&B loggers as its resumable class (RESUMABLE); a fit resumed
    from a checkpoint continues the W&B run of its run directory instead of starting a second one.
    The W&B id is read here rather than put in the config, so that config.yaml, rerun elsewhere (a sweep's best.yaml,
    say), starts a W&B run of its own."""

    def __init__(self, cli) -> None:
        self.cli = cli

    def __call__(self, class_type, *args, **kwargs):
        if class_type is WandbLogger:
            config = self.cli.config[self.cli.subcommand]
            saved = Path(run_dir(config)) / WANDB_RUN_ID_FILE
            if self.cli.subcommand == "fit" and config.ckpt_path and kwargs.get("id") is None \
                    and kwargs.get("version") is None and saved.is_file():
                # resume explicitly: jsonargparse passes every wandb.init argument, None included, over Lightning's
                # "allow"
                kwargs.update(id=saved.read_text().strip(), resume="allow")
        return RESUMABLE.get(class_type, class_type)(*args, **kwargs)
