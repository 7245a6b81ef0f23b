"""The transform seam: what ``data.train_transform`` and ``data.eval_transform`` are, and how the evaluation one
becomes part of the model's input contract.

    data:
      train_transform:
        class_path: torchvision.transforms.v2.Compose   # any v2 transform, a shipped preset, or a class of yours
        init_args:
          transforms:
            - {class_path: torchvision.transforms.v2.RandomResizedCrop, init_args: {size: 64}}
            - {class_path: torchvision.transforms.v2.RandomHorizontalFlip}

The shipped presets are `datamodules.presets.ClassificationPresetTrain` and `ClassificationPresetEval`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torchvision.transforms import v2

from core.config_types import instantiate

CONTRACT_VALUES = ("image_size", "mean", "std")  # what export and serving need of an evaluation transform


@runtime_checkable
class ImageTransform(Protocol):
    """A training or evaluation pipeline: one image in, one image out.

    - In: a decoded RGB image, a uint8 (3, H, W) tensor (on the CPU in a loader worker; on the device with
      ``data.augment_on_device``). With ``data.fast_decode`` the training transform gets the JPEG file's bytes (a
      1-D uint8 tensor) instead, which it decodes itself: only a transform whose ``reads_encoded`` is True.
    - Out: a uint8 (3, S, S) tensor, S the same for every image (batches stack). The DataModule's float stage
      follows, on the device or in the workers (``data.normalize_on_device``): pixels scaled to [0, 1], then
      (x - mean) / std with the evaluation transform's ``mean`` and ``std``. A float output is taken as final (no
      float stage): the transform normalised it itself, and states no mean and std.
    - Random draws come from torch's generator (as torchvision's transforms draw): the DataModule seeds it per sample
      from (run seed, epoch, rank, position), so a resumed run draws every augmentation of the run it continues.

    Optional attributes, read where present: ``image_size`` (S), ``mean`` and ``std`` (per channel, after scaling
    to [0, 1]), ``reads_encoded``. The evaluation transform's go into the model's input contract, which export and
    serving read; the shipped presets state them all.
    """

    # Annotated Any: jsonargparse reads a Callable returning a Tensor as a class whose constructor makes one.
    def __call__(self, image: Any, /) -> Any: ...


def stated(transform, key: str):
    """What `transform` states of `key` (an attribute), as plain values (None when it states nothing)."""
    value = getattr(transform, key, None)
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, (tuple, list)):
        return [float(v) for v in value]
    return int(value) if key == "image_size" and value is not None else value


def transform_config(transform, given=None) -> dict | None:
    """class_path and init_args that rebuild `transform`: its own (`config()`, the shipped presets), else `given`
    (the config LightningCLI built it from); None when neither says (an object built in Python)."""
    if hasattr(transform, "config"):
        return transform.config()
    if isinstance(given, Mapping) and given.get("class_path"):
        return {"class_path": given["class_path"], "init_args": dict(given.get("init_args") or {})}
    return None


def contract_of(transform, given=None) -> dict[str, Any]:
    """The model's input contract of an evaluation transform: the values (a shipped preset's `contract_values`, or
    what the transform states, None where it states nothing) and, under ``transform``, its class_path and init_args."""
    if hasattr(transform, "contract_values"):
        values = transform.contract_values()
    else:
        values = {"preset": None, "resize_size": None, "crop": None, "interpolation": None,
                  **{key: stated(transform, key) for key in CONTRACT_VALUES}}
    return {**values, "transform": transform_config(transform, given)}


def build_transform(config: Mapping) -> ImageTransform:
    """The transform of a class_path and init_args (nested ones too: a v2.Compose of v2 transforms), as the CLI
    builds ``data.eval_transform``."""
    return instantiate(ImageTransform, config)


def transform_of(contract: Mapping) -> dict:
    """The class_path and init_args of a model's evaluation transform, as its input contract stores them: what
    evaluation from a checkpoint sets as data.eval_transform, and what `eval_pipeline` builds."""
    config = contract.get("transform")
    if not config:
        raise ValueError("the model's input contract names no evaluation transform (one built in Python, which has "
                         "no class_path); train it from a config, or give the transform a config() method")
    return {"class_path": config["class_path"], "init_args": dict(config.get("init_args") or {})}


def eval_pipeline(contract: Mapping) -> v2.Compose:
    """The model's evaluation preprocessing, rebuilt from its input contract: an RGB image (a uint8 (3, H, W) tensor
    or a PIL image) -> float32 (3, S, S): the contract's transform, then the scaling to [0, 1] and the normalisation
    of its mean and std. The one place it is built: serving runs it and export lists its steps."""
    from datamodules.presets import ClassificationPresetEval, float_stage

    transform = build_transform(transform_of(contract))
    if isinstance(transform, ClassificationPresetEval):  # its uint8 steps; the float stage follows
        steps = list(transform.replace(uint8_output=True).transforms.transforms)
    else:
        steps = list(transform.transforms) if isinstance(transform, v2.Compose) else [transform]
    return v2.Compose([*steps, *float_stage(contract.get("mean"), contract.get("std")).transforms])


def name_of(config: Mapping | None) -> str:
    """`class_path(key=value, ...)` of a transform's config, for one-line messages."""
    if not config:
        return "an unknown transform"
    args = ", ".join(f"{k}={v}" for k, v in (config.get("init_args") or {}).items())
    return f"{config['class_path']}({args})"


class ThenFloat:
    """A transform, then the float stage on its uint8 output (``data.normalize_on_device: false``: in the worker)."""

    def __init__(self, transform, float_stage) -> None:
        self.transform, self.float_stage = transform, float_stage

    def __call__(self, image):
        out = self.transform(image)
        return self.float_stage(out) if out.dtype == torch.uint8 else out
