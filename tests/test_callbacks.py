"""Callbacks live in one place: every callback class of the packages is in training/callbacks/, and the class_paths
they had before still resolve, for users' configs."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
from lightning.pytorch import Callback

import training.callbacks

OLD_CLASS_PATHS = {
    "training.checkpointing.ModelCheckpoint": "ModelCheckpoint",
    "training.faults.ExactResume": "ExactResume",
    "training.faults.Preemption": "Preemption",
    "training.faults.NonFiniteLossGuard": "NonFiniteLossGuard",
    "training.run_dir.RunConfig": "RunConfig",
    "training.figures.ValidationFigures": "ValidationFigures",
}


def test_every_callback_class_of_the_packages_is_in_training_callbacks():
    outside = []
    for package in ("core", "datamodules", "lightning_modules", "training"):
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, f"{package}."):
            module = importlib.import_module(info.name)
            outside += [f"{info.name}.{name}" for name, cls in inspect.getmembers(module, inspect.isclass)
                        if issubclass(cls, Callback) and cls.__module__ == info.name
                        and not info.name.startswith("training.callbacks.")]
    assert not outside, f"callback classes outside training/callbacks/: {outside}"
    assert set(training.callbacks.__all__) == {name for name, cls in vars(training.callbacks).items()
                                               if inspect.isclass(cls) and issubclass(cls, Callback)}


@pytest.mark.parametrize("old", sorted(OLD_CLASS_PATHS))
def test_old_class_paths_still_resolve(old):
    module, _, name = old.rpartition(".")
    assert getattr(importlib.import_module(module), name) is getattr(training.callbacks, OLD_CLASS_PATHS[old])


def test_a_misspelt_name_of_an_old_module_is_still_an_attribute_error():
    import training.faults

    with pytest.raises(AttributeError, match="'training.faults' has no attribute 'ExactResum'"):
        training.faults.ExactResum  # noqa: B018
