"""RunConfig: the resolved config saved into the run directory and logged (secrets masked)."""

from __future__ import annotations

from pathlib import Path

import yaml
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import WandbLogger

from training.records.loggers import ResumableTensorBoardLogger, hyperparameters
from training.records.run_dir import WANDB_RUN_ID_FILE, data_summary, git_state, hardware_summary
from training.records.secrets import redact_secrets, redact_values


class RunConfig(SaveConfigCallback):
    """Writes the resolved config to `<run dir>/config.yaml` (rank 0), so the run can be re-run from its folder; a
    later command never overwrites it, and writes its own as `<command>_config.yaml` (`fit_config.yaml` for a resumed
    fit whose config differs),
    and logs it to every logger as hyperparameters, with the git commit (and dirty flag) and the images per class;
    secrets (URL passwords, API keys) are masked in both. A fit also records its W&B run id in the run directory, and
    at its end gives TensorBoard the run's result (val/hp_metric) with its settings, for the HPARAMS tab."""

    def __init__(self, parser, config, **kwargs) -> None:
        kwargs["save_to_log_dir"] = False  # the run directory, not the first logger's folder
        super().__init__(parser, config, **kwargs)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Lightning logs the model's and the DataModule's hyperparameters to every logger and stores them in each
        # checkpoint: a password in any string value would leak there too, so those copies are masked as well.
        for obj in (o for o in (pl_module, trainer.datamodule) if o is not None):
            obj.hparams.update(redact_values(dict(obj.hparams)))  # in place: what checkpoints store
            initial = getattr(obj, "_hparams_initial", None)  # what loggers get; `hparams_initial` hands out a copy
            if isinstance(initial, dict):
                initial.update(redact_values(dict(initial)))
        super().setup(trainer, pl_module, stage)

    def save_config(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        folder = Path(trainer.default_root_dir)
        folder.mkdir(parents=True, exist_ok=True)
        text = self._text()
        # The run's record is the config that first trained it: a later command (validate, test, predict, a resumed
        # or repeated fit) writes its own beside it, <stage>_config.yaml.
        stage = getattr(stage, "value", stage)  # a TrainerFn: "fit", "validate", "test", "predict"
        first = folder / self.config_filename
        if stage != "fit" or first.exists():
            if stage != "fit" or first.read_text() != text:
                (folder / f"{stage}_{self.config_filename}").write_text(text)
        else:
            first.write_text(text)
        params = {"config": text, "git": git_state(), "data": data_summary(trainer.datamodule),
                  "hardware": hardware_summary(trainer)}
        for logger in trainer.loggers:
            logger.log_hyperparams(params)
            if isinstance(logger, WandbLogger) and stage == "fit":
                # log_hyperparams has started the W&B run; `imgcls fit --ckpt_path ...` passes this id back to it.
                (folder / WANDB_RUN_ID_FILE).write_text(f"{logger.version}\n")

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # The best value of the metric that ranks the checkpoints, in place of Lightning's placeholder (-1): runs and
        # sweep trials then compare by their result in the HPARAMS tab, their settings as columns.
        ranking = next((c for c in trainer.checkpoint_callbacks if c.monitor and c.best_model_score is not None), None)
        if ranking is None:
            return
        git = git_state()
        params = {**hyperparameters(yaml.safe_load(self._text())), "git.commit": git["commit"],
                  "git.dirty": git["dirty"]}
        for logger in trainer.loggers:
            if isinstance(logger, ResumableTensorBoardLogger):
                logger.log_result(params, float(ranking.best_model_score), trainer.global_step)

    def _text(self) -> str:
        """The resolved config as YAML, secrets masked."""
        return redact_secrets(self.parser.dump(self.config, skip_none=False))
