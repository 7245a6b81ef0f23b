"""`imgcls export`: a checkpoint to a deployable ONNX model or `torch.export` program, with its preprocessing written
beside it.

    imgcls export --ckpt_path runs/quickstart/checkpoints/last.ckpt --format onnx
    -> runs/quickstart/export/model.onnx and model.json (classes, input size, preprocessing steps)
    imgcls export --ckpt_path runs/quickstart/checkpoints/last.ckpt --format pt2
    -> runs/quickstart/export/model.pt2 (torch.export.load(path).module() runs it; ExecuTorch and AOTInductor take it)

The exported graph maps a float batch (B, 3, H, W), already preprocessed, to logits (B, num_classes); the batch size
is dynamic. Preprocessing stays outside the graph (decoders and resizers differ between serving stacks), and
model.json lists it step by step: the torchvision eval transform of the training run.
"""

from __future__ import annotations

import json
import sys
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Literal

import torch

from core.command_line import parse_settings
from core.extras import require_extra
from datamodules.transforms import CONTRACT_VALUES, eval_pipeline, name_of
from lightning_modules import ImageClassifier
from lightning_modules.network import without_pretrained_weights
from training.records.saved_run import SavedRun, checkpoint_file
from training.resume.checkpoints import UnsafeCheckpointError

Format = Literal["onnx", "pt2"]
FORMATS = Format.__args__


def load_for_export(ckpt_path: str | Path) -> tuple[ImageClassifier, dict]:
    """The model in eval mode on the CPU, fp32, and its input contract (`SavedRun.input_contract`: the evaluation
    preprocessing it was trained with)."""
    ckpt_path = checkpoint_file(ckpt_path)
    # The network without its `weights`: the checkpoint holds every weight, so the pretrained ones it was fine-tuned
    # from (model.net.weights) are neither needed nor downloaded.
    # Both reads are weights_only: a checkpoint that needs arbitrary unpickling is refused, naming the file.
    saved = SavedRun.read(ckpt_path)
    contract = saved.input_contract
    net = saved.model.get("net")
    overrides = {"net": without_pretrained_weights(net)} if isinstance(net, dict) else {}
    model = ImageClassifier.load_from_checkpoint(ckpt_path, map_location="cpu", weights_only=True, **overrides)
    return model.float().eval(), contract


def preprocessing_section(contract: dict) -> dict:
    """What a server must do to an RGB image before the model: the model's input contract, step by step. A user's
    evaluation transform that states no image_size, mean or std is refused in one line: a server cannot guess them."""
    missing = [key for key in CONTRACT_VALUES if contract.get(key) is None]
    if missing:
        raise ValueError(f"the model's evaluation transform, {name_of(contract.get('transform'))}, states no "
                         f"{', '.join(missing)}: export writes them for the server; give the transform those "
                         "attributes (docs/EXTENDING.md, Transforms)")
    steps = eval_pipeline(contract).transforms
    return {
        "input": "RGB image (decode grayscale/RGBA/16-bit to 8-bit RGB first)",
        **contract,
        "steps": [repr(step) for step in steps],  # torchvision transforms v2, applied in order
        "layout": "float32 (B, 3, H, W), channels RGB",
    }


def export(ckpt_path: str | Path, fmt: str, out_dir: str | Path | None = None) -> Path:
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r} is unknown; choose one of {', '.join(FORMATS)}")
    if fmt == "onnx":
        require_extra("export", "imgcls export --format onnx")
    model, contract = load_for_export(ckpt_path)
    pre = preprocessing_section(contract)
    out = Path(out_dir) if out_dir else Path(ckpt_path).resolve().parent.parent / "export"
    out.mkdir(parents=True, exist_ok=True)
    example = torch.randn(2, 3, pre["image_size"], pre["image_size"])  # (B, 3, H, W)
    net = model.net  # plain nn.Module: no Lightning in the deployed graph
    batch = torch.export.Dim("batch", min=1, max=4096)
    if fmt == "onnx":
        path = out / "model.onnx"
        program = torch.onnx.export(net, (example,), input_names=["image"], output_names=["logits"],
                                    dynamic_shapes=({0: batch},), verbose=False)
        program.save(str(path))
    else:
        path = out / "model.pt2"
        with torch.no_grad():
            torch.export.save(torch.export.export(net, (example,), dynamic_shapes=({0: batch},)), path)
    meta = {
        "format": fmt,
        "model_file": path.name,
        "checkpoint": str(Path(ckpt_path).resolve()),
        "net": model.hparams.get("net") or type(model.net).__qualname__,  # class_path and init_args
        "class_names": model.class_names,
        "inputs": {"image": f"float32 (batch, 3, {pre['image_size']}, {pre['image_size']})"},
        "outputs": {"logits": f"float32 (batch, {model.hparams.num_classes}); softmax gives probabilities"},
        "preprocessing": pre,
    }
    (out / "model.json").write_text(json.dumps(meta, indent=2))
    return path


@dataclass
class ExportSettings:
    """The settings of `imgcls export`."""

    _: KW_ONLY
    ckpt_path: str
    """checkpoint written by imgcls fit"""
    format: Format = "onnx"
    """onnx, or pt2 (a torch.export program)"""
    out: str | None = None
    """output folder (default: <run>/export next to checkpoints/)"""


def main(argv: list[str] | None = None) -> None:
    args = parse_settings(ExportSettings, argv, prog="imgcls export", description=__doc__)
    try:
        path = export(args.ckpt_path, args.format, args.out)
    except (FileNotFoundError, ValueError, UnsafeCheckpointError) as err:
        print(f"imgcls export: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {path} and {path.with_name('model.json')} (preprocessing, class names)")


if __name__ == "__main__":
    main()
