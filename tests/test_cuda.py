"""The GPU path's own guarantees, on a real CUDA device (skipped without one, `cuda` mark): a `16-mixed` fit, whose
GradScaler state travels in the checkpoints, killed with SIGKILL and resumed to bitwise-identical weights; and the
gradient-compression hooks on NCCL. One GPU runs one process, so the hooks are checked on an NCCL group of one: the
hook and its state run as under 8 processes, the all-reduce sums one rank."""

from __future__ import annotations

import pytest
import torch
import yaml

from tests.helpers import fit_run, killed_and_resumed, last_weights, resume_config

pytestmark = pytest.mark.cuda


def _gpu_config(tmp_path, data, name: str, **trainer) -> object:
    cfg = resume_config()
    # 2 epochs of 6 steps: on an H100 the whole digits set made this file take 6 min of the GPU check's 8
    cfg["trainer"].update(accelerator="gpu", devices=1, limit_train_batches=6, limit_val_batches=2, **trainer)
    cfg["data"].update(root=str(data), batch_size=8, num_workers=0, image_size=32)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_a_16_mixed_fit_killed_and_resumed_on_cuda_ends_bitwise_equal(tmp_path, digits_root):
    config = _gpu_config(tmp_path, digits_root, "fp16", precision="16-mixed")  # deterministic kernels: shipped on
    assert killed_and_resumed(config, tmp_path, kill_after=3, resumes_from=2) == 0.0
    scaler = next(v for k, v in torch.load(tmp_path / "killed" / "checkpoints" / "last.ckpt", weights_only=True,
                                           map_location="cpu").items() if "MixedPrecision" in k)
    assert scaler["scale"] > 0  # the GradScaler's state came back with the resume, not a fresh scale


@pytest.mark.parametrize("compression", ["fp16", "powersgd"])
def test_compression_hooks_train_on_nccl(tmp_path, digits_root, compression):
    strategy = {"class_path": "training.distributed.strategy.CompressedDDPStrategy",
                "init_args": {"compression": compression, "powersgd": {"start_iter": 2, "rank": 2}}}
    config = _gpu_config(tmp_path, digits_root, compression, precision="16-mixed", strategy=strategy)
    result = fit_run(config, tmp_path / "run")
    assert "val/acc" in result.stdout
    weights = last_weights(tmp_path / "run")
    assert all(torch.isfinite(w).all() for w in weights.values() if w.is_floating_point())
    if compression == "powersgd":  # the hook ran past its plain all-reduce steps, and its state was checkpointed
        saved = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["powersgd_state"]
        assert saved["world_size"] == 1 and saved["ranks"][0]["iter"] > 2
