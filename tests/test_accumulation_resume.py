"""A checkpoint written inside a gradient-accumulation window resumes that window exactly, on 2 DDP processes.

(The 1-process case is one of tests/test_property.py's examples: VALIDATION_MID_ACCUMULATION.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import (
    CONFIGS,
    NO_RUN_CHECKPOINTS,
    TINY_ARCH,
    cli_env,
    free_port,
    make_image_folder,
    max_diff,
    run_cli,
)


def _config(tmp_path: Path, data: Path) -> Path:
    """TINY_ARCH at 64 px (at 32 px its last stage is 1 x 1 pixel, where a bias before BatchNorm gets no gradient) on 2
    processes, 2 micro-batches per step, 4 batches: a validation after the third (inside the second step's window)
    writes a checkpoint, and every step writes one."""
    cfg = yaml.safe_load((CONFIGS / "quickstart.yaml").read_text())
    validation = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                  "init_args": {"monitor": "val/loss", "mode": "min", "save_top_k": -1}}
    steps = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
             "init_args": {"every_n_train_steps": 1, "save_top_k": -1, "filename": "{step}"}}
    cfg["checkpoint"] = NO_RUN_CHECKPOINTS  # these two alone
    cfg["trainer"].update(callbacks=[validation, steps], precision="32-true", deterministic=True, accelerator="cpu",
                          devices=2,
                          strategy="ddp", max_epochs=1, limit_train_batches=4, accumulate_grad_batches=2,
                          val_check_interval=3, limit_val_batches=1, num_sanity_val_steps=0,
                          enable_progress_bar=False, enable_model_summary=False)
    cfg["model"]["net"]["init_args"].update(arch=TINY_ARCH, head_hidden=32)
    cfg["model"]["levers"]["channels_last"] = False
    cfg["model"]["optimizer"] = {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1, "momentum": 0.9}}
    cfg["data"].update(root=str(data), batch_size=2, num_workers=0, image_size=64)
    cfg["auto_resume"] = False
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _fit(config: Path, run: Path, *extra: str) -> None:
    run_cli("fit", "--config", str(config), "--trainer.default_root_dir", str(run), *extra,
            env=cli_env(MASTER_PORT=str(free_port())), timeout=300)


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=True, map_location="cpu")


@pytest.mark.slow
def test_a_ddp_checkpoint_inside_an_accumulation_window_resumes_it_exactly(tmp_path):
    """Each rank's accumulated gradients are its own until the step's all-reduce averages them; the checkpoint holds
    their average, restored on every rank, so the resumed step averages to the same gradient. Before, the window
    restarted with no gradients and the step summed one micro-batch of two."""
    data = make_image_folder(tmp_path / "images", {"a": 8, "b": 8}, size=64)
    config = _config(tmp_path, data)
    _fit(config, tmp_path / "reference")
    checkpoints = tmp_path / "reference" / "checkpoints"
    inside = [c for c in checkpoints.glob("epoch=*.ckpt") if "accumulated_grads" in _load(c)]
    assert [_load(c)["global_step"] for c in inside] == [1], sorted(checkpoints.iterdir())
    grads = _load(inside[0])["accumulated_grads"]
    assert grads and all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads.values())

    run = tmp_path / "resumed"
    _fit(config, run, "--ckpt_path", str(inside[0]))
    reference, resumed = _load(checkpoints / "step=2.ckpt"), _load(run / "checkpoints" / "step=2.ckpt")
    # The weights after the resumed step. Not bitwise: mean(before) + mean(after) rounds differently from
    # mean(before + after), and the later steps of this tiny net (BatchNorm over 2 images of 2 x 2 pixels in its last
    # stage) amplify a rounding difference, so the step itself is compared.
    assert max_diff(reference["state_dict"], resumed["state_dict"]) <= 1e-6
