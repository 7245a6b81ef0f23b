"""The model: the LightningModule and the plain-torch network builder."""

from lightning_modules.classifier import ImageClassifier
from lightning_modules.network import build_network

__all__ = ["ImageClassifier", "build_network"]
