"""Data: the image-folder LightningDataModule, transform presets and the demo-data builder."""

from datamodules.image_folder import ImageFolderDataModule
from datamodules.presets import ClassificationPresetEval, ClassificationPresetTrain

__all__ = ["ClassificationPresetEval", "ClassificationPresetTrain", "ImageFolderDataModule"]
