"""Every private internal of Lightning (and Optuna) this project relies on, by name: an upgrade that moves one fails
here, loudly, instead of silently changing a resume, a checkpoint or a comm hook. pyproject pins lightning to the
minor version these were read from."""

from __future__ import annotations

import importlib
import inspect
from importlib.metadata import version

import lightning as L
import optuna
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.strategies import DDPStrategy

# (module, name): module-level private functions and types imported by name.
IMPORTED = [
    ("lightning.pytorch.overrides.distributed", "_register_ddp_comm_hook"),  # training/strategy.py: hooks on CPU too
    ("lightning.pytorch.cli", "_InstantiatorFn"),  # training/cli.py: the model and data instantiators
]

# (class, attribute) read or overridden on instances and classes.
ATTRIBUTES = [
    (L.Trainer, "_run"),  # trainer.py: the ranks agree on the resume checkpoint between process group and load
    # cli.py: resolve `last`, auto_resume and a missing --ckpt_path, and check a resume, before hparams are merged
    # (no public hook runs between parsing and that merge)
    (LightningCLI, "_parse_ckpt_path"),
    (LightningCLI, "_add_instantiators"),
    (ModelCheckpoint, "_should_skip_saving_checkpoint"),
    (ModelCheckpoint, "_should_save_on_train_epoch_end"),  # faults.py: where a deferred step save goes
    (ModelCheckpoint, "_should_remove_checkpoint"),  # checkpointing.py: last.ckpt as a hard link
    (ModelCheckpoint, "_remove_checkpoint"),
    (ModelCheckpoint, "_save_last_checkpoint"),
    (ModelCheckpoint, "_monitor_candidates"),
]

INSTANCE_STATE = {
    "ModelCheckpoint": ["_last_global_step_saved", "_last_checkpoint_saved"],
    "DDPStrategy": ["_ddp_comm_state", "_ddp_comm_hook", "_ddp_comm_wrapper", "_model_averaging_period"],
    "FitLoop": ["_combined_loader", "_combined_loader_states_to_load", "_data_fetcher"],  # faults.ExactResume
    "WandbLogger": ["_experiment"],  # wandb_runs.SecretSafeWandbLogger
}


def test_lightning_is_pinned_to_the_minor_version_read():
    pinned = next(line for line in open("pyproject.toml") if '"lightning' in line)
    assert '"lightning>=2.6,<2.7"' in pinned
    assert version("lightning").startswith("2.6.")


def test_the_trainers_precision_values_are_lightnings():
    """training/trainer.py types `precision` with Lightning's values (its annotation is private) plus `auto`."""
    from typing import get_args

    from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT

    from training.trainer import Precision

    lightnings = {v for part in get_args(_PRECISION_INPUT) for v in get_args(part)}
    assert set(get_args(Precision)) == lightnings | {"auto"}


@pytest.mark.parametrize(("module", "name"), IMPORTED, ids=[n for _, n in IMPORTED])
def test_private_imports_exist(module, name):
    assert hasattr(importlib.import_module(module), name)


@pytest.mark.parametrize(("cls", "name"), ATTRIBUTES, ids=[f"{c.__name__}.{n}" for c, n in ATTRIBUTES])
def test_private_methods_exist(cls, name):
    assert callable(getattr(cls, name))


def test_private_state_exists_on_instances():
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    instances = {"ModelCheckpoint": ModelCheckpoint(), "DDPStrategy": DDPStrategy(), "FitLoop": trainer.fit_loop,
                 "WandbLogger": WandbLogger(offline=True)}
    for kind, names in INSTANCE_STATE.items():
        for name in names:
            assert hasattr(instances[kind], name), f"{kind}.{name}"
    # faults.ExactResume calls these on the loop objects themselves
    assert callable(trainer.fit_loop.epoch_loop._should_check_val_fx)
    assert callable(trainer.fit_loop.epoch_loop._should_accumulate)  # a checkpoint inside an accumulation window
    assert "data_fetcher" in inspect.signature(trainer.fit_loop.epoch_loop._should_check_val_fx).parameters
    assert list(inspect.signature(L.Trainer._run).parameters) == ["self", "model", "ckpt_path", "weights_only"]
    from lightning.pytorch.utilities.combined_loader import CombinedLoader
    assert callable(CombinedLoader._load_state_dicts)


def test_optuna_trial_internals_used_by_the_sweep():
    """training/sweep_trial.py hands a running trial to its `imgcls fit` process by id (no public handle reaches it
    from another process), and there writes the system attributes of optuna-integration's protocol for a trainer in
    another process (Optuna has no public setter); the sweep reads the pruning decision from the same keys."""
    from optuna_integration.pytorch_lightning import PyTorchLightningPruningCallback
    from optuna_integration.pytorch_lightning import pytorch_lightning as integration

    from training.sweep_trial import EPOCH_KEY, INTERMEDIATE_KEY, PRUNED_KEY

    study = optuna.create_study()
    trial = study.ask()
    assert isinstance(trial._trial_id, int)
    assert optuna.trial.Trial(study, trial._trial_id).number == trial.number
    trial.storage.set_trial_system_attr(trial._trial_id, PRUNED_KEY, True)
    assert study.trials[0].system_attrs[PRUNED_KEY] is True
    assert (INTERMEDIATE_KEY, PRUNED_KEY, EPOCH_KEY) == (integration._INTERMEDIATE_VALUE, integration._PRUNED_KEY,
                                                         integration._EPOCH_KEY)
    callback = PyTorchLightningPruningCallback(trial, "val/acc")  # SweepTrial sets and reads these
    assert callback.is_ddp_backend is False and callback._trial is trial
