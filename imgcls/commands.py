"""The `imgcls` command: fit, validate, test and predict (LightningCLI: training/cli/app.py), and the other commands
of EXTRA_COMMANDS, each a `main(argv)` in the room that owns it.

    imgcls fit --config configs/quickstart.yaml
    imgcls sweep configs/sweeps/quickstart_lr.yaml

This room names every other and none names it: what a command needs from up here is handed to it (HANDED).
"""

from __future__ import annotations

import importlib
import sys

from training.cli.app import cli_main
from training.cli.errors import exit_code

# Commands that are not Trainer entry points; each is a `main(argv)` in its own module (imported when it runs).
EXTRA_COMMANDS = {
    "demo-data": ("datamodules.demo", "write the scikit-learn digits as an image-folder tree"),
    "prepare-data": ("datamodules.shards", "convert an image folder into LitData shards (ShardsDataModule)"),
    "sweep": ("training.sweeps.command", "run a config-file hyperparameter sweep (W&B sweep schema) with Optuna"),
    "report": ("training.records.report", "write PNG curves and a Markdown summary of a run from its logs"),
    "export": ("deploy.export", "export a checkpoint to ONNX or a torch.export program"),
    "publish": ("deploy.publish", "write a checkpoint as a model folder in the Hugging Face Hub's layout"),
    "serve": ("deploy.serve", "serve a model folder or checkpoint over HTTP with LitServe (dynamic batching)"),
}
# A sweep trial's process after `sys.executable`: `imgcls fit` with the sweep's callback, through the start-up.
TRIAL_LAUNCHER = ("-m", "imgcls.trial")
# What a command's `main` is handed from up here, by keyword: the sweep, how to start its trials.
HANDED = {"sweep": {"launcher": TRIAL_LAUNCHER}}
EPILOG = "other commands:\n" + "".join(f"  {name:<12} {text}\n" for name, (_, text) in EXTRA_COMMANDS.items())


def main(argv: list[str] | None = None) -> None:
    """The `imgcls` console script (started through startup.py)."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        if args and args[0] in EXTRA_COMMANDS:
            # a command whose extra is missing says so on import or at its start (core.extras.require_extra)
            importlib.import_module(EXTRA_COMMANDS[args[0]][0]).main(args[1:], **HANDED.get(args[0], {}))
        else:
            cli_main(argv, epilog=EPILOG)  # None: LightningCLI reads sys.argv itself
    except Exception as err:
        code = exit_code(err)  # a one-line message printed for the user's mistakes and lost peers; None: re-raise
        if code is None:
            raise
        sys.exit(code)
