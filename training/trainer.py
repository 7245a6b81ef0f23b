"""Lightning's Trainer with `precision: auto`, resolved from what the hardware can do (core/hardware.py), over
training.resume's one resume decision for all ranks."""

from __future__ import annotations

from typing import Literal

from lightning.pytorch.accelerators import Accelerator, CUDAAccelerator, MPSAccelerator
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from core import hardware
from training.resume.agreement import AgreedResume

# The values lightning.Trainer's `precision` takes (tests/test_internals.py checks them against its annotation), and
# `auto`: typed, so that `--help` lists them and the CLI refuses a typo.
Precision = Literal["auto", "transformer-engine", "transformer-engine-float16", "16-true", "16-mixed", "bf16-true",
                    "bf16-mixed", "32-true", "64-true", "64", "32", "16", "bf16", 64, 32, 16]


class Trainer(AgreedResume):
    """`lightning.Trainer`, whose `precision` also takes `auto` (the default): 16-mixed on CUDA, bf16-mixed on a CPU
    with native bf16 (AVX512-BF16 or AMX), 32-true on any other CPU. The choice and its reason are printed. An
    explicit precision is obeyed, with a warning when it asks for bf16 on a CPU that would emulate it.

    A fit resumes every rank from rank 0's checkpoint (`training.resume.agreement.AgreedResume`).
    """

    def __init__(self, *args, precision: Precision | None = "auto", **kwargs) -> None:
        hw = hardware.detect()
        device = device_type(kwargs.get("accelerator", "auto"))
        if precision == "auto":
            precision, why = hardware.choose_precision(hw, device)
            rank_zero_info(f"precision: {precision} ({why})")
        super().__init__(*args, precision=precision, **kwargs)
        # self.precision is what runs: Lightning turns 16-mixed into bf16-mixed on a CPU (with its own warning).
        warning = hardware.bf16_cost_warning(hw, device_type(self.accelerator), self.precision)
        if warning:
            rank_zero_warn(warning)


def device_type(accelerator: str | Accelerator) -> str:
    """`cuda`, `cpu`, `mps`, ... for a Trainer `accelerator` value, `auto` and `gpu` resolved as Lightning does."""
    if isinstance(accelerator, Accelerator):
        return type(accelerator).__name__.removesuffix("Accelerator").lower()
    name = str(accelerator).lower()
    if name in ("auto", "gpu"):
        if CUDAAccelerator.is_available():
            return "cuda"
        if MPSAccelerator.is_available():
            return "mps"
        return "cpu" if name == "auto" else "gpu"
    return name
