"""Callbacks live where their room is: the ones a config names in training/callbacks/, the fault guards the CLI adds
to every run in training/resume/, and nowhere else."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

from lightning.pytorch import Callback

import training.callbacks
import training.resume

ROOMS = {"training.callbacks": training.callbacks, "training.resume": training.resume}


def test_every_callback_class_of_the_packages_is_in_its_room_and_exported_there():
    found = {}
    for package in ("core", "datamodules", "lightning_modules", "training", "deploy"):
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, f"{package}."):
            if info.name.endswith("__main__"):
                continue
            module = importlib.import_module(info.name)
            found |= {f"{info.name}.{name}": cls for name, cls in inspect.getmembers(module, inspect.isclass)
                      if issubclass(cls, Callback) and cls.__module__ == info.name}
    outside = [path for path in found if not path.startswith(tuple(f"{room}." for room in ROOMS))]
    assert not outside, f"callback classes outside training/callbacks/ and training/resume/: {outside}"
    for room, module in ROOMS.items():
        classes = {path.rsplit(".", 1)[1] for path in found if path.startswith(f"{room}.")}
        assert set(module.__all__) == classes, room  # each by its one class path: <room>.<Name>
