"""Weights & Biases: the logger that masks secrets in the command line it records, and the instantiator that
continues a resumed fit's W&B run."""

from __future__ import annotations

import os
import sys

from lightning.pytorch.loggers import WandbLogger

from training.run_dir import WANDB_RUN_ID_FILE, run_dir
from training.secrets import redact_secrets


class SecretSafeWandbLogger(WandbLogger):
    """WandbLogger whose run records the command line with secrets masked.

    wandb stores sys.argv in the run's metadata (and `wandb sync` uploads it), out of reach of the masking of
    config.yaml and of the logged config; a password typed as a command-line value would land there. sys.argv is
    masked only while the logger's run is reached (started on the first access): Lightning's launcher still needs the
    real one to start the other ranks.
    """

    @property
    def experiment(self):
        saved = sys.argv[:]
        sys.argv[1:] = [redact_secrets(arg) for arg in saved[1:]]
        try:
            return super().experiment
        finally:
            sys.argv[:] = saved


def wandb_online() -> bool:
    """Whether WandbLogger goes online although its config says offline: with WANDB_API_KEY set, or under `wandb
    agent` (WANDB_SWEEP_ID), whose login sits in ~/.netrc rather than in the environment. WANDB_MODE, when set, wins."""
    return "WANDB_MODE" not in os.environ and bool(os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_SWEEP_ID"))


class WandbInstantiator:
    """Builds every WandbLogger as a SecretSafeWandbLogger; a fit resumed from a checkpoint continues the W&B run of
    its run directory instead of starting a second one.
    The id is read here rather than put in the config, so that config.yaml, rerun elsewhere (a sweep's best.yaml,
    say), starts a W&B run of its own."""

    def __init__(self, cli) -> None:
        self.cli = cli

    def __call__(self, class_type, *args, **kwargs):
        if class_type is WandbLogger:  # the same logger, with the command line it records masked
            class_type = SecretSafeWandbLogger
        config = self.cli.config[self.cli.subcommand]
        saved = run_dir(config) / WANDB_RUN_ID_FILE
        if self.cli.subcommand == "fit" and config.ckpt_path and kwargs.get("id") is None \
                and kwargs.get("version") is None and saved.is_file():
            # resume explicitly: jsonargparse passes every wandb.init argument, None included, over Lightning's "allow"
            kwargs.update(id=saved.read_text().strip(), resume="allow")
        return class_type(*args, **kwargs)
