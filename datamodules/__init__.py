"""Data: the data-source contract (`ClassificationData`), the sources that ship with it, transform presets and the
demo-data builder. A source of your own subclasses `ClassificationData` (docs/EXTENDING.md, "Data source").

Each name is imported when first used (PEP 562): the transforms and image decoding import no Lightning (an inference
worker of `imgcls serve` uses them alone), and ShardsDataModule alone imports LitData."""

import importlib

_MODULES = {"ClassificationData": "base", "CsvDataModule": "csv_manifest", "HFDataModule": "hugging_face",
            "ImageData": "image_data", "ImageFolderDataModule": "image_folder", "ShardsDataModule": "shards",
            "ClassificationPresetEval": "presets", "ClassificationPresetTrain": "presets"}
__all__ = sorted(_MODULES)


def __getattr__(name: str):
    if name in _MODULES:
        return getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
