"""What tests/test_cuda.py checks on a GPU, as functions of runs and their files, so that tests/test_cuda_checks.py can
run the same checks on the CPU against a run that keeps the promise and one that breaks it: a check that cannot
fail would pass on a GPU that broke it too."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
import yaml
from lightning.pytorch.plugins.precision import MixedPrecision

from tests.helpers import resume_config

# 16-mixed's GradScaler starts at torch's default scale; an overflow halves it, and 2 epochs of 6 steps never grow it.
INITIAL_SCALE = inspect.signature(torch.amp.GradScaler).parameters["init_scale"].default
# Step 1's fp16 gradients overflow (tests.fault_injection.OverflowAt), before the step-2 checkpoint that resumes load.
OVERFLOW = {"class_path": "tests.fault_injection.OverflowAt", "init_args": {"step": 1}}
# 16-mixed on the CPU: Lightning's precision flag turns it into bf16-mixed there, its plugin given whole keeps fp16
# autocast and a GradScaler (torch's CPU one), the stand-in for the GPU's in tests/test_cuda_checks.py.
CPU_FP16 = {"precision": None, "plugins": {"class_path": "lightning.pytorch.plugins.precision.MixedPrecision",
                                           "init_args": {"precision": "16-mixed", "device": "cpu"}}}


def short_config(folder: Path, data: Path, name: str, *, accelerator: str = "gpu", callbacks: tuple = (),
                 **trainer) -> Path:
    """resume_config on `accelerator`: 2 epochs of 6 steps of 8 images at 32 px, `callbacks` added, `trainer`'s keys
    set; written to `folder/name.yaml`."""
    cfg = resume_config()
    # 2 epochs of 6 steps: on an H100 the whole digits set made tests/test_cuda.py take 6 min of the GPU check's 8
    cfg["trainer"].update(accelerator=accelerator, devices=1, limit_train_batches=6, limit_val_batches=2, **trainer)
    cfg["trainer"]["callbacks"] += list(callbacks)
    cfg["data"].update(root=str(data), batch_size=8, num_workers=0, image_size=32)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def scaler_states(run: Path) -> dict[str, dict]:
    """The GradScaler's scale and growth tracker that each checkpoint of `<run>/checkpoints` holds, by file name."""
    states = {}
    for path in sorted((run / "checkpoints").glob("*.ckpt")):
        saved = torch.load(path, weights_only=True, map_location="cpu")[MixedPrecision.__qualname__]
        states[path.name] = {key: saved[key] for key in ("scale", "_growth_tracker")}
    return states


def assert_scaler_restored(reference: Path, resumed: Path) -> None:
    """The checkpoints a killed run wrote after its resume hold the GradScaler state of the uninterrupted run's files
    of the same name (the same step), and in these an overflow had lowered the scale: a resume that started a fresh
    scaler would hold the initial scale and a growth tracker counted from the resume."""
    expected, found = scaler_states(reference), scaler_states(resumed)
    shared = sorted(expected.keys() & found.keys())
    assert "last.ckpt" in shared, f"no last.ckpt in both runs: {sorted(expected)} and {sorted(found)}"
    unlowered = {name: state["scale"] for name, state in expected.items() if state["scale"] >= INITIAL_SCALE}
    assert not unlowered, f"no overflow lowered the GradScaler's scale below {INITIAL_SCALE}: {unlowered}"
    differ = {name: (expected[name], found[name]) for name in shared if expected[name] != found[name]}
    assert not differ, f"the resumed run's GradScaler differs from the uninterrupted run's (expected, found): {differ}"


def compression_strategy(compression: str) -> dict:
    """trainer.strategy: CompressedDDPStrategy with `compression` (PowerSGD compressing from step 2, at rank 2)."""
    return {"class_path": "training.distributed.strategy.CompressedDDPStrategy",
            "init_args": {"compression": compression, "powersgd": {"start_iter": 2, "rank": 2}}}


def probe(out: Path) -> dict:
    """The callback that records what DDP logged on each rank (tests.distributed_probe.Probe) into `out`."""
    return {"class_path": "tests.distributed_probe.Probe", "init_args": {"out_dir": str(out)}}


def assert_hook_registered(out: Path, hook: str, backend: str) -> None:
    """Rank 0's DDP module, as the probe in `out` recorded from DDP's own logging data, had the communication hook
    `hook` registered and its process group on `backend`."""
    record = torch.load(out / "rank0.pt", weights_only=True)
    found = (record["comm_hook"], record["backend"])
    assert found == (hook, backend), f"DDP logged the hook {found[0]!r} on a {found[1]!r} process group, not " \
                                     f"{hook!r} on {backend!r}"
