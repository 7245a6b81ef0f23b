"""A model folder in the Hugging Face Hub's layout, as `imgcls publish` writes it: `model.safetensors` (the network's
state dict, no pickle) and `config.json` (the network's class_path and init_args, the classes, single- or multi-label
and the threshold, the input contract). `from_pretrained` rebuilds the model from it with no checkpoint and no config
file; `--model.net.weights FOLDER` loads it in the CLI (training/cli/app.py).

    model = ImageClassifier.from_pretrained("runs/quickstart/published")   # or a Hub repo id: "user/digits-resnet18"
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_modules.network import declares_head, network_from_config

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
LIBRARY = "imgcls"
FORMAT_VERSION = 1
DEFAULT_NETWORK = "lightning_modules.network.BackboneWithHead"


def network_spec(hparams: dict[str, Any]) -> dict[str, Any]:
    """The network of a model's hyperparameters (a checkpoint's) as {"class_path", "init_args"}, its `weights` None
    (a folder's weights are model.safetensors): the one place that knows where the model keeps it."""
    net = hparams.get("net")
    if not (isinstance(net, dict) and net.get("class_path")):
        raise ValueError("the checkpoint's hyperparameters hold no network (model.net as class_path and init_args): "
                         "it was not written by this imgcls")
    init_args = dict(net.get("init_args") or {})
    if "weights" in init_args or net["class_path"] == DEFAULT_NETWORK:
        init_args["weights"] = None
    return {"class_path": net["class_path"], "init_args": init_args}


def network_factory(spec: dict[str, Any]):
    """The callable num_classes -> nn.Module of a network spec (what `model.net` takes from Python)."""
    return network_from_config(spec)


def network_kwargs_of(hparams: dict[str, Any]) -> list[str]:
    """The keys of a model's hyperparameters that hold its network (those a fine-tune takes from a folder)."""
    return ["net"] if "net" in hparams else []


def is_model_folder(path: str | Path | None) -> bool:
    """True for a folder that `imgcls publish` wrote (its config.json names imgcls)."""
    if not path or not Path(str(path)).expanduser().is_dir():
        return False
    config = Path(str(path)).expanduser() / CONFIG_FILE
    try:
        return json.loads(config.read_text()).get("library") == LIBRARY
    except (OSError, ValueError, AttributeError):
        return False


def read_config(folder: str | Path) -> dict[str, Any]:
    """The folder's config.json, checked: one line naming the file and the fix when it is not an imgcls model."""
    folder = Path(folder).expanduser()
    file = folder / CONFIG_FILE
    if not (folder / WEIGHTS_FILE).is_file() or not file.is_file():
        raise FileNotFoundError(f"{folder} is not a model folder: it needs {CONFIG_FILE} and {WEIGHTS_FILE}; write "
                                "one with imgcls publish --ckpt_path RUN/checkpoints/best.ckpt FOLDER")
    try:
        config = json.loads(file.read_text())
    except ValueError as err:
        raise ValueError(f"{file} is not valid JSON ({err}); publish the model again") from None
    if config.get("library") != LIBRARY:
        raise ValueError(f"{file} was not written by imgcls publish (library: {config.get('library')!r})")
    if config.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(f"{file} has format_version {config['format_version']}, newer than this imgcls reads "
                         f"({FORMAT_VERSION}); upgrade imgcls")
    return config


def model_hparams(config: dict[str, Any]) -> dict[str, Any]:
    """The ImageClassifier arguments a model folder fixes: the network, the classes, the kind and the input contract."""
    return {"net": config["network"], "num_classes": config["num_classes"],
            "class_names": list(config["class_names"]), "multilabel": bool(config["multilabel"]),
            "input_contract": dict(config["preprocessing"])}


def weights_of(folder: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file  # tensors only, by design: nothing to unpickle

    return load_file(Path(folder).expanduser() / WEIGHTS_FILE)


def head_state_keys(net: nn.Module) -> set[str]:
    """The state-dict keys of the head `net` declares (every key when it declares none)."""
    own = net.state_dict()
    if not declares_head(net):
        return set(own)
    heads = {id(m) for m in net.head_modules()}
    prefixes = tuple(f"{name}." for name, m in net.named_modules() if id(m) in heads)
    return {k for k in own if k.startswith(prefixes)}


def load_network_weights(net: nn.Module, folder: str | Path, *, head: bool) -> bool:
    """Loads the folder's weights into `net` (built by the same network spec): every tensor, or, with `head` False or
    a head of another shape (other classes), the backbone's only. Returns whether the head was loaded."""
    state, own, head_keys = weights_of(folder), net.state_dict(), head_state_keys(net)
    head_fits = all(k in state and state[k].shape == own[k].shape for k in head_keys)
    if not (head and head_fits):
        state = {k: v for k, v in state.items() if k not in head_keys}
    wrong = [k for k, v in state.items() if k in own and own[k].shape != v.shape]
    missing = [k for k in own if k not in state and (head and head_fits or k not in head_keys)]
    unexpected = [k for k in state if k not in own]
    if wrong or missing or unexpected:
        raise ValueError(f"{Path(folder) / WEIGHTS_FILE} does not fit the network {network_summary(net)}: "
                         f"{len(missing)} missing, {len(unexpected)} unexpected and {len(wrong)} wrongly shaped "
                         f"tensors (e.g. {(missing + unexpected + wrong)[:3]}); is config.json the folder's own?")
    net.load_state_dict(state, strict=head and head_fits)
    return head and head_fits


def network_summary(net: nn.Module) -> str:
    return f"{type(net).__name__} ({sum(p.numel() for p in net.parameters()):,} parameters)"


def local_folder(name_or_path: str | Path) -> Path:
    """A model folder on disk, or a Hub repo id (`user/name`) downloaded into huggingface_hub's cache."""
    path = Path(str(name_or_path)).expanduser()
    if path.exists() or str(name_or_path).count("/") != 1:
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(name_or_path), allow_patterns=[CONFIG_FILE, WEIGHTS_FILE]))


def from_pretrained(cls, name_or_path: str | Path, *, threshold: float | None = None):
    """`cls` (ImageClassifier) rebuilt from a model folder or Hub repo id, on the CPU in eval mode, fp32. A
    multi-label model's threshold is the folder's unless `threshold` is given."""
    folder = local_folder(name_or_path)
    config = read_config(folder)
    hparams = model_hparams(config)
    hparams["net"] = network_factory(hparams["net"])
    model = cls(**hparams, threshold=folder_threshold(config, threshold), levers={"channels_last": False})
    load_network_weights(model.net, folder, head=True)
    return model.float().eval()


def folder_threshold(config: dict[str, Any], threshold: float | None = None) -> float:
    """The threshold of a folder's model (`config`, its read_config): `threshold` where given, else the folder's; a
    single-label folder has none, and its model keeps 0.5, which it never uses."""
    return threshold if threshold is not None else config.get("threshold") or 0.5


def pretrained_network(folder: str | Path, config: dict[str, Any]) -> nn.Module:
    """The network of a model folder (`config`, its read_config) with its weights, on the CPU in eval mode, fp32: what
    from_pretrained's model runs in its forward, without the LightningModule around it."""
    net = network_factory(config["network"])(config["num_classes"])
    load_network_weights(net, folder, head=True)
    return net.float().eval()
