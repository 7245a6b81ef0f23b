"""Plain-torch network builder: any torchvision classification model (or timm model, `timm/<name>`), its classifier
replaced by the classic Keras fine-tuning head (the backbone's pooled features -> 1024 -> classes)."""

from __future__ import annotations

import difflib
import os
import pickle
from pathlib import Path
from typing import Literal, get_args

import torch
import torchvision
from jsonargparse.typing import restricted_string_type
from torch import nn

TIMM_PREFIX = "timm/"  # model.arch of a timm model: timm/<name>[.<pretrained tag>], e.g. timm/resnet50.a1_in1k


# model.arch: a torchvision classification model (resnet50, convnext_tiny, efficientnet_b0, vit_b_16, ...), or a
# timm one as timm/<name>. Literal, so `imgcls fit --help` lists the choices and the CLI refuses a typo.
TorchvisionArch = Literal[tuple(torchvision.models.list_models(module=torchvision.models))]
TimmArch = restricted_string_type("TimmArch", rf"^{TIMM_PREFIX}\S+$", docstring="timm/<name>[.<pretrained tag>]")
Arch = TorchvisionArch | TimmArch


def archs() -> tuple[str, ...]:
    """Every torchvision classification model name."""
    return get_args(TorchvisionArch)


def build_network(
    arch: str = "resnet50",
    weights: str | None = None,
    head_hidden: int = 1024,
    dropout: float = 0.2,
    num_classes: int = 1000,
) -> nn.Module:
    """A torchvision classification model whose last Linear layer is the classic Keras fine-tuning head.

    The head takes the features the model's own classifier took, (B, features), after its global pool (a ResNet's
    avgpool, a ConvNeXt's pool + LayerNorm, a ViT's class token): Linear(features -> head_hidden) -> ReLU ->
    Dropout -> Linear(-> num_classes); head_hidden=0 gives one Linear. Layers of the classifier before its last
    Linear (MobileNetV3's 1280-wide layer, VGG's fc6/fc7) stay, as part of the backbone. The width is read from
    that Linear, so any model works without a table of widths. The head's module name is `net.head_name` (`fc` for
    a ResNet, `classifier.1` for an EfficientNet). `weights` (a torchvision weights name or a file) initialises the
    backbone; see `load_backbone_weights`.
    """
    if head_hidden < 0:
        raise ValueError(f"model.head_hidden={head_hidden} must be >= 0 (0 means a single linear layer)")
    if arch.startswith(TIMM_PREFIX):
        net = _timm().create_model(_timm_name(arch), pretrained=False)
        name = net.pretrained_cfg.get("classifier")  # timm names its classifier, e.g. "head.fc"
        if not isinstance(net.get_submodule(name) if name else None, nn.Linear):
            name = classifier_name(net, arch)
    else:
        if arch not in archs():
            close = difflib.get_close_matches(arch, archs(), n=4, cutoff=0.5)
            raise ValueError(f"model.arch={arch!r} is not a torchvision classification model"
                             + (f"; did you mean {', '.join(close)}?" if close else "")
                             + f" ({len(archs())} names: torchvision.models.list_models(module=torchvision.models); "
                             "timm models are timm/<name>)")
        net = torchvision.models.get_model(arch, weights=None)
        if getattr(net, "aux_logits", False):  # Inception v3, GoogLeNet: auxiliary classifiers would be a 2nd output
            net = torchvision.models.get_model(arch, weights=None, aux_logits=False, init_weights=False)
        name = classifier_name(net, arch)
    if weights is not None:
        load_backbone_weights(net, arch, weights, head_prefix=f"{name}.")
    features = net.get_submodule(name).in_features  # 512 for resnet18, 2048 for resnet50, 768 for convnext_tiny
    if head_hidden:
        head = nn.Sequential(nn.Linear(features, head_hidden), nn.ReLU(inplace=True), nn.Dropout(dropout),
                             nn.Linear(head_hidden, num_classes))
    else:
        head = nn.Linear(features, num_classes)
    net.set_submodule(name, head)
    net.head_name = name
    return net


def classifier_name(net: nn.Module, arch: str) -> str:
    """The qualified name of `net`'s last Linear layer: its classifier (`fc`, `classifier.1`, `heads.head`)."""
    linears = [name for name, module in net.named_modules() if isinstance(module, nn.Linear)]
    if not linears:  # SqueezeNet classifies with a convolution
        raise ValueError(f"model.arch={arch} has no Linear classifier to put the head in place of; choose another")
    return linears[-1]


def head_prefix(net: nn.Module) -> str:
    """The state-dict prefix of the head built by `build_network`: everything else is the backbone."""
    return f"{net.head_name}."


def load_backbone_weights(net: nn.Module, arch: str, weights: str, head_prefix: str) -> None:
    """Load backbone weights into a fresh torchvision model (whose classifier is still its 1000-class layer).

    `weights` is a torchvision weights name (`IMAGENET1K_V2`, `DEFAULT`), a torchvision state-dict file, or a
    checkpoint of this project (its `net.` parameters). The source's classifier (`head_prefix`) is never loaded:
    the head is trained for the new classes.
    """
    if os.path.sep in weights or weights.endswith(WEIGHT_FILES) or Path(weights).exists():
        state = _state_dict_from_file(Path(weights).expanduser())
    elif arch.startswith(TIMM_PREFIX):
        state = _state_dict_from_timm(arch, weights)
    else:
        state = _state_dict_from_torchvision(arch, weights)
    backbone = {k: v for k, v in state.items() if not k.startswith(head_prefix)}
    own = net.state_dict()
    missing = [k for k in own if k not in backbone and not k.startswith(head_prefix)]
    unexpected = [k for k in backbone if k not in own]
    wrong_shape = [k for k in backbone if k in own and backbone[k].shape != own[k].shape]
    if missing or unexpected or wrong_shape:
        raise ValueError(
            f"model.weights={weights} does not fit {arch}: {len(missing)} missing, {len(unexpected)} unexpected and "
            f"{len(wrong_shape)} wrongly shaped tensors (e.g. {(missing + unexpected + wrong_shape)[:3]}); "
            f"is it a {arch} state dict?"
        )
    net.load_state_dict(backbone, strict=False)  # strict=False: only the classifier is left as initialised


WEIGHT_FILES = (".pth", ".pt", ".ckpt", ".bin", ".safetensors")


def _state_dict_from_file(path: Path, key: str = "model.weights") -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise FileNotFoundError(f"{key}={path} does not exist; pass a state-dict file, a checkpoint, "
                                "a torchvision weights name such as IMAGENET1K_V2, or null")
    if path.suffix == ".safetensors":  # tensors only, by design: nothing to unpickle
        from safetensors.torch import load_file

        return load_file(path)
    # weights_only: a weight file must never be able to run code when it is read.
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise ValueError(f"{key}={path} holds pickled objects beyond tensors, which could run code when "
                         "loaded; refusing it. Re-save it as a plain state dict "
                         "(torch.save(model.state_dict()))") from None
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


def _timm():
    try:
        import timm
    except ImportError:
        raise ImportError("model.arch=timm/...: timm is not installed; pip install 'imgcls[timm]'") from None
    return timm


def _timm_name(arch: str) -> str:
    """`timm/<name>[.tag]` -> `<name>[.tag]`, checked against timm's model list."""
    name = arch.removeprefix(TIMM_PREFIX)
    timm = _timm()
    if not timm.is_model(name.split(".")[0]):
        close = difflib.get_close_matches(name, timm.list_models(), n=4, cutoff=0.6)
        raise ValueError(f"model.arch={arch!r}: {name!r} is not a timm model"
                         + (f"; did you mean {', '.join(TIMM_PREFIX + c for c in close)}?" if close else ""))
    return name


def _state_dict_from_timm(arch: str, weights: str) -> dict[str, torch.Tensor]:
    """timm's pretrained weights of `arch` (weights=DEFAULT), from timm's cache or the Hugging Face Hub."""
    name = _timm_name(arch)
    if weights != "DEFAULT":
        raise ValueError(f"model.weights={weights!r} for {arch}: use DEFAULT (timm's pretrained weights; the tag goes "
                         "in the name, e.g. timm/resnet50.a1_in1k), a weights file, or null")
    timm = _timm()
    try:
        return timm.create_model(name, pretrained=True).state_dict()
    except Exception as err:  # no network, no cached file, a gated repository...
        hub_id = timm.get_pretrained_cfg(name).hf_hub_id if timm.get_pretrained_cfg(name) else None
        where = (f"download https://huggingface.co/{hub_id}/resolve/main/model.safetensors and pass "
                 "model.weights=/path/to/model.safetensors" if hub_id else "pass model.weights=/path/to/weights file")
        raise RuntimeError(f"could not load timm's pretrained weights for {arch} ({type(err).__name__}: "
                           f"{str(err).splitlines()[0][:200]}); without network access, {where}") from None
