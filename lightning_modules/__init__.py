"""The model: the LightningModule, the network contract and its default network, and the model's settings.

Each name is imported when first used (PEP 562): code that needs the network alone, such as an inference worker of
`imgcls serve` building it from a model folder, imports neither Lightning nor torchmetrics."""

import importlib

_MODULES = {"ImageClassifier": "classifier", "BackboneWithHead": "network", "DeclaresHead": "network",
            "Levers": "settings", "Recipe": "settings"}
__all__ = sorted(_MODULES)


def __getattr__(name: str):
    if name in _MODULES:
        return getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
