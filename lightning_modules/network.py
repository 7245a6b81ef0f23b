"""Plain-torch network builder: a torchvision ResNet with the classic Keras fine-tuning head (pool -> 1024 -> classes)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Literal

import torch
import torchvision
from torch import nn

Arch = Literal["resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "wide_resnet50_2", "wide_resnet101_2"]
ARCHS: tuple[str, ...] = Arch.__args__
HEAD_PREFIX = "fc."  # parameters of the head; everything else is the backbone


def build_resnet(
    arch: str = "resnet50",
    weights: str | None = None,
    head_hidden: int = 1024,
    dropout: float = 0.2,
    num_classes: int = 1000,
) -> nn.Module:
    """A torchvision ResNet whose `fc` is the classic Keras fine-tuning head.

    The backbone ends in torchvision's global average pool, so the head sees (B, features):
    Linear(features -> head_hidden) -> ReLU -> Dropout -> Linear(-> num_classes); head_hidden=0 gives one Linear.
    `weights` (a torchvision weights name or a file) initialises the backbone; see `load_backbone_weights`.
    """
    if arch not in ARCHS:
        raise ValueError(f"model.arch={arch!r} is unknown; choose one of {', '.join(ARCHS)}")
    if head_hidden < 0:
        raise ValueError(f"model.head_hidden={head_hidden} must be >= 0 (0 means a single linear layer)")
    net = getattr(torchvision.models, arch)(weights=None)
    if weights is not None:
        load_backbone_weights(net, arch, weights)
    features = net.fc.in_features  # 512 for resnet18/34, 2048 for resnet50 and deeper
    if head_hidden:
        net.fc = nn.Sequential(
            nn.Linear(features, head_hidden), nn.ReLU(inplace=True), nn.Dropout(dropout), nn.Linear(head_hidden, num_classes)
        )
    else:
        net.fc = nn.Linear(features, num_classes)
    return net


def load_backbone_weights(net: nn.Module, arch: str, weights: str) -> None:
    """Load backbone weights into a fresh torchvision ResNet (whose `fc` is still the 1000-class layer).

    `weights` is a torchvision weights name (`IMAGENET1K_V2`, `DEFAULT`), a torchvision state-dict file, or a
    checkpoint of this project (its `net.` parameters). The classifier of the source is never loaded: the head is
    trained for the new classes.
    """
    if os.path.sep in weights or weights.endswith((".pth", ".pt", ".ckpt", ".bin")) or Path(weights).exists():
        state = _state_dict_from_file(Path(weights).expanduser())
    else:
        state = _state_dict_from_torchvision(arch, weights)
    backbone = {k: v for k, v in state.items() if not k.startswith(HEAD_PREFIX)}
    own = net.state_dict()
    missing = [k for k in own if k not in backbone and not k.startswith(HEAD_PREFIX)]
    unexpected = [k for k in backbone if k not in own]
    wrong_shape = [k for k in backbone if k in own and backbone[k].shape != own[k].shape]
    if missing or unexpected or wrong_shape:
        raise ValueError(
            f"model.weights={weights} does not fit {arch}: {len(missing)} missing, {len(unexpected)} unexpected and "
            f"{len(wrong_shape)} wrongly shaped tensors (e.g. {(missing + unexpected + wrong_shape)[:3]}); "
            f"is it a {arch} state dict?"
        )
    net.load_state_dict(backbone, strict=False)  # strict=False: only the head (fc.*) is left as initialised


def _state_dict_from_file(path: Path, key: str = "model.weights") -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise FileNotFoundError(f"{key}={path} does not exist; pass a state-dict file, a checkpoint, "
                                "a torchvision weights name such as IMAGENET1K_V2, or null")
    # weights_only: a weight file must never be able to run code when it is read.
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise ValueError(f"{key}={path} holds pickled objects beyond tensors, which could run code when "
                         "loaded; refusing it. Re-save it as a plain state dict (torch.save(model.state_dict()))") from None
    if isinstance(state, dict) and "state_dict" in state:  # a Lightning checkpoint of this project
        state = {k.removeprefix("net."): v for k, v in state["state_dict"].items() if k.startswith("net.")}
    if not isinstance(state, dict) or not state:
        raise ValueError(f"{key}={path} holds no state dict")
    return state


def _state_dict_from_torchvision(arch: str, name: str) -> dict[str, torch.Tensor]:
    enum_name = torchvision.models.get_model_weights(arch).__name__  # e.g. ResNet50_Weights
    try:
        w = torchvision.models.get_weight(f"{enum_name}.{name}")
    except (ValueError, KeyError, AttributeError):
        choices = [w.name for w in torchvision.models.get_model_weights(arch)] + ["DEFAULT"]
        raise ValueError(f"model.weights={name!r} is not a {arch} weights name; choose one of {choices}, "
                         "a file path, or null") from None
    file_name = os.path.basename(w.url)
    cached = Path(torch.hub.get_dir()) / "checkpoints" / file_name
    if cached.is_file():
        # Read here rather than by torchvision's get_state_dict, whose torch.hub load unpickles anything: a file
        # dropped into the cache must not run code.
        return _state_dict_from_file(cached, key=f"model.weights={name}: the cached file")
    try:
        return torch.hub.load_state_dict_from_url(w.url, progress=True, check_hash=True, weights_only=True)
    except Exception as err:  # no network, proxy, truncated download...
        raise RuntimeError(
            f"could not download {arch} weights {name} ({type(err).__name__}: {err}). Without network access, "
            f"copy {file_name} to {cached} ($TORCH_HOME/hub/checkpoints/) or pass model.weights=/path/to/file.pth"
        ) from None
