"""The model: the LightningModule, the network contract and its default network, and the model's settings."""

from lightning_modules.classifier import ImageClassifier
from lightning_modules.network import BackboneWithHead, DeclaresHead
from lightning_modules.settings import Levers, Recipe

__all__ = ["BackboneWithHead", "DeclaresHead", "ImageClassifier", "Levers", "Recipe"]
