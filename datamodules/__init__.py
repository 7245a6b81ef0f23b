"""Data: the data-source contract (`ClassificationData`), the sources that ship with it, transform presets and the
demo-data builder. A source of your own subclasses `ClassificationData` (docs/EXTENDING.md, "Data source")."""

from datamodules.base import ClassificationData
from datamodules.csv_manifest import CsvDataModule
from datamodules.hugging_face import HFDataModule
from datamodules.image_data import ImageData
from datamodules.image_folder import ImageFolderDataModule
from datamodules.presets import ClassificationPresetEval, ClassificationPresetTrain

__all__ = ["ClassificationData", "ClassificationPresetEval", "ClassificationPresetTrain", "CsvDataModule",
           "HFDataModule", "ImageData", "ImageFolderDataModule", "ShardsDataModule"]


def __getattr__(name: str):
    if name == "ShardsDataModule":  # imports LitData, which the other sources do without
        from datamodules.shards import ShardsDataModule

        return ShardsDataModule
    raise AttributeError(f"module 'datamodules' has no attribute {name!r}")
