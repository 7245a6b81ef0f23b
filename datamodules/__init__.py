"""Data: the data-source contract (`ClassificationData`), the sources that ship with it, transform presets and the
demo-data builder. A source of your own subclasses `ClassificationData` (docs/EXTENDING.md, "Data source").

Each name is imported on first use (core.lazy): the transforms and image decoding import no Lightning (an inference
worker of `imgcls serve` uses them alone), and ShardsDataModule alone imports LitData."""

from core.lazy import lazy_names

_MODULES = {"ClassificationData": "base", "CsvDataModule": "csv_manifest", "HFDataModule": "hugging_face",
            "ImageData": "image_data", "ImageFolderDataModule": "image_folder", "ShardsDataModule": "shards",
            "ClassificationPresetEval": "presets", "ClassificationPresetTrain": "presets"}
__all__ = sorted(_MODULES)
__getattr__ = lazy_names(__name__, _MODULES)
