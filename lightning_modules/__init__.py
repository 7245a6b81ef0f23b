"""The model: the LightningModule, the network contract and its default network, and the model's settings.

Each name is imported on first use (core.lazy): code that needs the network alone, such as an inference worker of
`imgcls serve` building it from a model folder, imports neither Lightning nor torchmetrics."""

from core.lazy import lazy_names

_MODULES = {"ImageClassifier": "classifier", "BackboneWithHead": "network", "DeclaresHead": "network",
            "Levers": "settings", "Recipe": "settings"}
__all__ = sorted(_MODULES)
__getattr__ = lazy_names(__name__, _MODULES)
