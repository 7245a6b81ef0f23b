"""The network contract (`model.net`: any nn.Module built with `num_classes`, which may declare its head), and the
default network: any torchvision classification model (or timm model, `timm/<name>`) with the classic Keras fine-tuning
head (the backbone's pooled features -> 1024 -> classes)."""

from __future__ import annotations

import difflib
import functools
import os
import pickle
import sys
from pathlib import Path
from typing import Literal, Protocol, get_args

import torch
import torchvision
from jsonargparse.typing import restricted_string_type
from torch import nn

from core.config_types import NonNegativeInt, UnitIntervalRightOpen, check_arguments

TIMM_PREFIX = "timm/"  # model.net.arch of a timm model: timm/<name>[.<pretrained tag>], e.g. timm/resnet50.a1_in1k


# model.net.arch: a torchvision classification model (resnet50, convnext_tiny, efficientnet_b0, vit_b_16, ...), or a
# timm one as timm/<name>. Literal, so `imgcls fit --help` lists the choices and the CLI refuses a typo.
TorchvisionArch = Literal[tuple(torchvision.models.list_models(module=torchvision.models))]
TimmArch = restricted_string_type("TimmArch", rf"^{TIMM_PREFIX}\S+$", docstring="timm/<name>[.<pretrained tag>]")
Arch = TorchvisionArch | TimmArch


def archs() -> tuple[str, ...]:
    """Every torchvision classification model name."""
    return get_args(TorchvisionArch)


class DeclaresHead(Protocol):
    """What a network declares so that the training can tell its backbone from its head (docs/EXTENDING.md, Network).

    `head_modules()` returns the modules of the head: the layers trained from scratch for the new classes. Every
    parameter outside them is the backbone. Freezing (training.callbacks.FreezeBackbone), `model.recipe.
    backbone_lr_ratio`, the (backbone | head) parameter groups and the frozen BatchNorm statistics all read it. A
    network without it is all head: the options that need a backbone refuse it, naming this method.
    """

    def head_modules(self) -> list[nn.Module]: ...


def declares_head(net: nn.Module) -> bool:
    return callable(getattr(net, "head_modules", None))


def require_backbone(net: nn.Module, what: str) -> None:
    """One line refusing `what` (an option that needs a backbone) for a network that declares no head."""
    if not declares_head(net):
        raise ValueError(f"{what} needs the network's backbone, and {type(net).__qualname__} declares none: add a "
                         "method head_modules(self) -> list[nn.Module] returning its head (docs/EXTENDING.md, Network)")


def head_parameter_names(net: nn.Module) -> set[str]:
    """The qualified names of the head's parameters in `net`: every parameter when the network declares no head."""
    if not declares_head(net):
        return {name for name, _ in net.named_parameters()}
    ids = {id(p) for module in net.head_modules() for p in module.parameters()}
    return {name for name, p in net.named_parameters() if id(p) in ids}


def backbone_modules(net: nn.Module) -> list[nn.Module]:
    """The modules of `net` outside its declared head (none when it declares no head)."""
    if not declares_head(net):
        return []
    head = {id(m) for module in net.head_modules() for m in module.modules()}
    return [m for m in net.modules() if id(m) not in head and m is not net]


class BackboneWithHead(nn.Module):
    """The default `model.net`: a torchvision classification model (or a timm one, `timm/<name>`) as the backbone, its
    last Linear layer dropped, and the classic Keras fine-tuning head on the features that Linear took.

    The backbone ends with the model's own global pool (a ResNet's avgpool, a ConvNeXt's pool + LayerNorm, a ViT's
    class token), (B, 3, H, W) -> (B, features); layers of the classifier before its last Linear (MobileNetV3's
    1280-wide layer, VGG's fc6/fc7) stay in it. The head: Linear(features -> head_hidden) -> ReLU -> Dropout ->
    Linear(-> num_classes). The width is read from the dropped Linear, so any model works without a table of widths.
    A torchvision ResNet trained from scratch starts each residual block as the identity (`zero_init_residual`), as
    timm's ResNets do.

    Args:
        num_classes: outputs of the head; the model passes the data's.
        arch: any torchvision classification model: resnet18 ... resnet152, wide_resnet50_2, convnext_tiny,
            efficientnet_b0, mobilenet_v3_large, regnet_y_8gf, vit_b_16, swin_t, ...; or timm/<name>[.<tag>].
        weights: initialises the backbone: a torchvision weights name (IMAGENET1K_V2, DEFAULT; timm: DEFAULT), a
            state-dict, safetensors or checkpoint file of this project, or null (from scratch). See
            `load_backbone_weights`. Not read when a checkpoint supplies every weight (validate, resume, export).
        head_hidden: width of the hidden head layer (1024 in the Keras/Horovod recipe this template reproduces);
            0 gives a single linear layer.
        dropout: dropout before the last layer of the head.
        zero_init_residual: the last BatchNorm weight of each residual block starts at zero (Goyal et al. 2017;
            torchvision's own option, off there, and timm's default): each block starts as the identity. It is the
            initialisation before any `weights`, for torchvision's ResNets (resnet*, resnext*, wide_resnet*); other
            torchvision models have no such blocks, and a timm model keeps timm's own initialisation.
    """

    def __init__(self, num_classes: int, arch: Arch = "resnet50", weights: str | None = None,
                 head_hidden: NonNegativeInt = 1024, dropout: UnitIntervalRightOpen = 0.2,
                 zero_init_residual: bool = True) -> None:
        super().__init__()
        check_arguments("model.net", BackboneWithHead.__init__, {"head_hidden": head_hidden, "dropout": dropout})
        # The CLI's values are jsonargparse's int and float subclasses: torch.compile (dynamo of torch 2.11) breaks the
        # graph at a Dropout whose p is one. The modules get plain numbers.
        head_hidden, dropout = int(head_hidden), float(dropout)
        backbone, name = _classification_model(arch, zero_init_residual=zero_init_residual)
        if weights is not None:
            load_backbone_weights(backbone, arch, weights, head_prefix=f"{name}.")
        features = backbone.get_submodule(name).in_features  # 512 for resnet18, 2048 for resnet50, 768 for convnext_t
        backbone.set_submodule(name, nn.Identity())
        self.backbone = backbone
        if head_hidden:
            self.head = nn.Sequential(nn.Linear(features, head_hidden), nn.ReLU(inplace=True), nn.Dropout(dropout),
                                      nn.Linear(head_hidden, num_classes))
        else:
            self.head = nn.Linear(features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))  # (B, 3, H, W) -> (B, features) -> (B, num_classes)

    def head_modules(self) -> list[nn.Module]:
        return [self.head]


def _classification_model(arch: str, *, zero_init_residual: bool) -> tuple[nn.Module, str]:
    """A fresh (untrained) torchvision or timm model of `arch`, and the name of its last Linear layer; a torchvision
    ResNet with `zero_init_residual` passed on."""
    if arch.startswith(TIMM_PREFIX):
        net = _timm().create_model(_timm_name(arch), pretrained=False)
        name = net.pretrained_cfg.get("classifier")  # timm names its classifier, e.g. "head.fc"
        if not isinstance(net.get_submodule(name) if name else None, nn.Linear):
            name = classifier_name(net, arch)
        return net, name
    if arch not in archs():
        close = difflib.get_close_matches(arch, archs(), n=4, cutoff=0.5)
        raise ValueError(f"model.net.arch={arch!r} is not a torchvision classification model"
                         + (f"; did you mean {', '.join(close)}?" if close else "")
                         + f" ({len(archs())} names: torchvision.models.list_models(module=torchvision.models); "
                         "timm models are timm/<name>)")
    resnet = torchvision.models.get_model_builder(arch).__module__ == torchvision.models.resnet.__name__
    net = torchvision.models.get_model(arch, weights=None, **({"zero_init_residual": True}
                                                             if resnet and zero_init_residual else {}))
    if getattr(net, "aux_logits", False):  # Inception v3, GoogLeNet: auxiliary classifiers would be a 2nd output
        net = torchvision.models.get_model(arch, weights=None, aux_logits=False, init_weights=False)
    return net, classifier_name(net, arch)


def classifier_name(net: nn.Module, arch: str) -> str:
    """The qualified name of `net`'s last Linear layer: its classifier (`fc`, `classifier.1`, `heads.head`)."""
    linears = [name for name, module in net.named_modules() if isinstance(module, nn.Linear)]
    if not linears:  # SqueezeNet classifies with a convolution
        raise ValueError(f"model.net.arch={arch} has no Linear classifier to put the head in place of; choose another")
    return linears[-1]


def load_backbone_weights(net: nn.Module, arch: str, weights: str, head_prefix: str) -> None:
    """Load backbone weights into a fresh torchvision model (whose classifier is still its 1000-class layer).

    `weights` is a torchvision weights name (`IMAGENET1K_V2`, `DEFAULT`), a torchvision state-dict file, or a
    checkpoint of this project (its `net.` parameters: `net.backbone.*` of a BackboneWithHead, or the older layout
    without the `backbone.` level). The source's classifier (`head_prefix`) is never loaded: the head is trained for
    the new classes.
    """
    if os.path.sep in weights or weights.endswith(WEIGHT_FILES) or Path(weights).exists():
        state = _state_dict_from_file(Path(weights).expanduser())
    elif arch.startswith(TIMM_PREFIX):
        state = _state_dict_from_timm(arch, weights)
    else:
        state = _state_dict_from_torchvision(arch, weights)
    if any(k.startswith("backbone.") for k in state) and not any(k.startswith("backbone.") for k in net.state_dict()):
        state = {k.removeprefix("backbone."): v for k, v in state.items() if k.startswith("backbone.")}  # no head.*
    backbone = {k: v for k, v in state.items() if not k.startswith(head_prefix)}
    own = net.state_dict()
    missing = [k for k in own if k not in backbone and not k.startswith(head_prefix)]
    unexpected = [k for k in backbone if k not in own]
    wrong_shape = [k for k in backbone if k in own and backbone[k].shape != own[k].shape]
    if missing or unexpected or wrong_shape:
        raise ValueError(
            f"model.net.weights={weights} does not fit {arch}: {len(missing)} missing, {len(unexpected)} unexpected "
            f"and {len(wrong_shape)} wrongly shaped tensors (e.g. {(missing + unexpected + wrong_shape)[:3]}); "
            f"is it a {arch} state dict?"
        )
    net.load_state_dict(backbone, strict=False)  # strict=False: only the classifier is left as initialised


WEIGHT_FILES = (".pth", ".pt", ".ckpt", ".bin", ".safetensors")


def _state_dict_from_file(path: Path, key: str = "model.net.weights") -> dict[str, torch.Tensor]:
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


class WeightsDownloadError(RuntimeError):
    """Pretrained weights could not be fetched (no network, a proxy, a download that fails its hash): the machine's
    state, not a bug; its message names the file to put in the cache instead."""


def _state_dict_from_torchvision(arch: str, name: str) -> dict[str, torch.Tensor]:
    enum_name = torchvision.models.get_model_weights(arch).__name__  # e.g. ResNet50_Weights
    try:
        w = torchvision.models.get_weight(f"{enum_name}.{name}")
    except (ValueError, KeyError, AttributeError):
        choices = [w.name for w in torchvision.models.get_model_weights(arch)] + ["DEFAULT"]
        raise ValueError(f"model.net.weights={name!r} is not a {arch} weights name; choose one of {choices}, "
                         "a file path, or null") from None
    try:
        path = cached_download(w.url)
    except Exception as err:  # no network, proxy, truncated download, a file that fails its hash...
        raise WeightsDownloadError(
            f"could not download {arch} weights {name} ({type(err).__name__}: {err}). Without network access, "
            f"put the file in {cache_dir()} first: {offline_command(w.url)}; or pass model.net.weights=/path/to/file"
        ) from None
    # Read here rather than by torchvision's get_state_dict, whose torch.hub load unpickles anything: a file dropped
    # into the cache must not run code.
    return _state_dict_from_file(path, key=f"model.net.weights={name}: the cached file")


def cache_dir() -> Path:
    """torch.hub's folder of downloaded weights: $TORCH_HOME/hub/checkpoints (~/.cache/torch/hub/checkpoints)."""
    return Path(torch.hub.get_dir()) / "checkpoints"


def offline_command(url: str) -> str:
    """The command that puts the weights file of `url`, fetched on a machine with internet, where the cache reads it."""
    return f"mkdir -p {cache_dir()} && cp {os.path.basename(url)} {cache_dir()}/"


def cached_download(url: str) -> Path:
    """The file of `url` in torch.hub's cache, downloaded by one process at a time: the ranks of a node (and nodes that
    share the cache folder) wait on a lock beside the file while the first downloads it once, then read it. A
    download is checked against the SHA-256 prefix in its name (torchvision's files carry one) before it lands in
    the cache under its name; a file already there is read as it is."""
    from filelock import FileLock

    path = cache_dir() / os.path.basename(url)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{path}.lock"):
        if not path.is_file():
            found = torch.hub.HASH_REGEX.search(path.name)
            torch.hub.download_url_to_file(url, str(path), hash_prefix=found.group(1) if found else None,
                                           progress=sys.stderr.isatty())
    return path


def _timm():
    try:
        import timm
    except ImportError:
        raise ImportError("model.net.arch=timm/...: timm is not installed; pip install 'imgcls[timm]'") from None
    return timm


def _timm_name(arch: str) -> str:
    """`timm/<name>[.tag]` -> `<name>[.tag]`, checked against timm's model list."""
    name = arch.removeprefix(TIMM_PREFIX)
    timm = _timm()
    if not timm.is_model(name.split(".")[0]):
        close = difflib.get_close_matches(name, timm.list_models(), n=4, cutoff=0.6)
        raise ValueError(f"model.net.arch={arch!r}: {name!r} is not a timm model"
                         + (f"; did you mean {', '.join(TIMM_PREFIX + c for c in close)}?" if close else ""))
    return name


def _state_dict_from_timm(arch: str, weights: str) -> dict[str, torch.Tensor]:
    """timm's pretrained weights of `arch` (weights=DEFAULT), from timm's cache or the Hugging Face Hub."""
    name = _timm_name(arch)
    if weights != "DEFAULT":
        raise ValueError(f"model.net.weights={weights!r} for {arch}: use DEFAULT (timm's pretrained weights; the tag "
                         "goes in the name, e.g. timm/resnet50.a1_in1k), a weights file, or null")
    timm = _timm()
    try:
        return timm.create_model(name, pretrained=True).state_dict()
    except Exception as err:  # no network, no cached file, a gated repository...
        hub_id = timm.get_pretrained_cfg(name).hf_hub_id if timm.get_pretrained_cfg(name) else None
        where = (f"download https://huggingface.co/{hub_id}/resolve/main/model.safetensors and pass "
                 "model.net.weights=/path/to/model.safetensors" if hub_id
                 else "pass model.net.weights=/path/to/weights file")
        raise RuntimeError(f"could not load timm's pretrained weights for {arch} ({type(err).__name__}: "
                           f"{str(err).splitlines()[0][:200]}); without network access, {where}") from None


def net_weights(net) -> str | None:
    """The `weights` argument of `net` (a callable num_classes -> nn.Module, or its class_path config), None where it
    has none."""
    if isinstance(net, functools.partial):
        return net.keywords.get("weights")
    init_args = net.get("init_args") if hasattr(net, "get") else None
    return init_args.get("weights") if hasattr(init_args, "get") else None


def without_pretrained_weights(net):
    """`net` (a callable num_classes -> nn.Module, or its class_path config as a dict) with its `weights` argument
    None, where it has one: a checkpoint supplies every weight, so none is downloaded or read."""
    if isinstance(net, functools.partial) and net.keywords.get("weights") is not None:
        return functools.partial(net.func, *net.args, **{**net.keywords, "weights": None})
    if isinstance(net, dict) and (net.get("init_args") or {}).get("weights") is not None:
        return {**net, "init_args": {**net["init_args"], "weights": None}}
    return net


def network_config(net) -> dict | None:
    """A network class, or a functools.partial of one with plain arguments, as the class_path and init_args a
    weights_only checkpoint can hold; None for any other callable."""
    args = getattr(net, "keywords", {}) or {}
    cls = net.func if isinstance(net, functools.partial) and not net.args else net
    if not (isinstance(cls, type) and issubclass(cls, nn.Module) and _plain(args)):
        return None
    return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": dict(args)}


def network_from_config(config: dict):
    """The callable num_classes -> nn.Module of a `network_config` (a checkpoint's hyperparameters), its class from a
    module already imported: a checkpoint may not make this process import code."""
    module, _, name = config["class_path"].rpartition(".")
    cls = getattr(sys.modules.get(module), name, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"model.net: {config['class_path']} is not an nn.Module class of an imported module; import "
                         f"{module or 'its module'} first, or give model.net")
    return functools.partial(cls, **(config.get("init_args") or {}))


def _plain(value) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, str | int | float | bool)
