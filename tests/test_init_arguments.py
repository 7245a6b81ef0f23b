"""No constructor in the packages takes more than 12 arguments: what does not fit goes into the injected objects.

A data source is a layered dataclass (datamodules/base.py): each layer declares its own fields, each with its
docstring, and inherits the layers below; the rule holds per layer, for the fields it declares (before the layers
were dataclasses, the inherited arguments passed through **kwargs and counted as one)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil

import pytest

MOST = 12


def _constructors(package: str) -> dict[str, int]:
    """Each class defined in `package`'s modules with an `__init__` of its own, and its parameters besides self."""
    found = {}
    for info in pkgutil.walk_packages(importlib.import_module(package).__path__, prefix=f"{package}."):
        if info.name.endswith(".__main__"):  # a command, run on import
            continue
        module = importlib.import_module(info.name)  # subpackages too (training.callbacks)
        for name, obj in vars(module).items():
            if not (inspect.isclass(obj) and obj.__module__ == module.__name__ and "__init__" in vars(obj)):
                continue
            if dataclasses.is_dataclass(obj):  # the fields this layer declares
                declared = vars(obj).get("__annotations__", {})
                found[f"{module.__name__}.{name}"] = len([f for f in dataclasses.fields(obj) if f.name in declared])
            else:
                found[f"{module.__name__}.{name}"] = len(inspect.signature(obj.__init__).parameters) - 1
    return found


@pytest.mark.parametrize("package", ["datamodules", "lightning_modules", "core", "training", "deploy"])
def test_no_constructor_takes_more_than_twelve_arguments(package):
    over = {name: count for name, count in _constructors(package).items() if count > MOST}
    assert not over, f"constructors over {MOST} arguments: {over}"


def test_the_count_takes_every_argument_but_self():
    counts = _constructors("lightning_modules")
    assert counts["lightning_modules.classifier.ImageClassifier"] == 12  # counted, and at the limit


def test_a_data_source_layer_counts_the_fields_it_declares():
    from datamodules.image_data import ImageData

    counts = _constructors("datamodules")
    assert counts["datamodules.image_data.ImageData"] == 11 and len(dataclasses.fields(ImageData)) == 19
    assert counts["datamodules.image_folder.ImageFolderDataModule"] == 3  # root, val_split, split_seed
