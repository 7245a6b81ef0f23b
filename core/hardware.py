"""What this machine can do, read once, and the speed levers chosen from it: precision, channels_last, torch.compile,
the optimizer implementation and the loader workers.

A lever's gain depends on the hardware: bf16 autocast is meant to beat fp32 on a CPU with native bf16 and is far
slower than fp32 on one without (benchmarks/hardware.py measures it; docs/PERFORMANCE.md, "Hardware"), so nothing
here is chosen by habit. Every rule returns ``(value, reason)`` and the reason is printed. It sits at the bottom of
the import graph (data -> model -> training) because the loaders, the model and the Trainer all ask it. Tests
stand in other machines with ``monkeypatch.setattr(hardware, "detect", lambda: ...)``.
"""

from __future__ import annotations

import functools
import json
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

import torch

# /proc/cpuinfo flags that decide a lever; the hardware benchmark records the same ones.
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# What the benchmarks measured per CPU kind (bf16 autocast and channels_last against fp32 NCHW, fused SGD against
# torch's loop): written by `python -m benchmarks.pages` from benchmarks/results/, never typed; the reasons quote it.
MEASURED = Path(__file__).with_name("measured.json")


@functools.cache
def measured(kind: str) -> dict[str, str]:
    """The figures stored for a CPU kind (`Hardware.cpu_kind()`), {} where none was measured."""
    try:
        return json.loads(MEASURED.read_text()).get(kind, {})
    except (OSError, ValueError):
        return {}


def quoted(kind: str, key: str, what: str) -> str:
    """`what` with its measured figure on this kind of CPU, or the plain fact that it was not measured there."""
    figure = measured(kind).get(key) or "not measured"
    return f"{what} {figure} on {'an' if kind[0] in 'AEIOU' else 'a'} {kind}"


@dataclass(frozen=True)
class Hardware:
    """The capabilities the levers depend on."""

    cpu_model: str
    cpu_flags: frozenset[str] = field(default_factory=frozenset)  # the subset of CPU_FLAGS this CPU has
    cores: int = 1  # CPUs this process may run on
    machine: str = "x86_64"  # platform.machine()
    cuda: str | None = None  # name of CUDA device 0, None without one
    triton: bool = False  # torch.compile's GPU code generator is importable

    @property
    def native_bf16(self) -> bool:
        return any(f in self.cpu_flags for f in NATIVE_BF16_FLAGS)

    def cpu_kind(self) -> str:
        """`bf16 CPU`, `AVX2 CPU` or the architecture: the class of CPU that benchmark figures hold for."""
        if self.native_bf16:
            return "bf16 CPU"
        return "AVX2 CPU" if "avx2" in self.cpu_flags else f"{self.machine} CPU"

    def describe(self) -> str:
        """E.g. `AMD EPYC (avx2, no avx512_bf16/amx), 2 cores, no CUDA`: names the machine in logs and figures."""
        flags = [f for f in CPU_FLAGS if f in self.cpu_flags] or ["no avx2"]
        if not self.native_bf16:
            flags.append("no avx512_bf16/amx")
        gpu = f"CUDA {self.cuda}" if self.cuda else "no CUDA"
        return f"{self.cpu_model} ({', '.join(flags)}), {self.cores} cores, {gpu}"


def _cpuinfo() -> tuple[str, frozenset[str]]:
    """The first CPU's model name and its flags of CPU_FLAGS, from /proc/cpuinfo (Linux); elsewhere no flags, so no
    lever that needs one is switched on."""
    model, flags = None, None
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        key, _, value = (part.strip() for part in line.partition(":"))
        if key == "model name" and model is None:
            model = value
        elif key == "flags" and flags is None:
            flags = frozenset(value.split()) & frozenset(CPU_FLAGS)
    return model or platform.processor() or platform.machine(), flags or frozenset()


@functools.cache
def detect() -> Hardware:
    """This machine, read once per process."""
    model, flags = _cpuinfo()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    try:
        import triton  # noqa: F401
        has_triton = True
    except ImportError:
        has_triton = False
    return Hardware(model, flags, cores, platform.machine(), cuda, has_triton)


# ---- the levers: each (value, reason) ------------------------------------------------------------------------


def choose_precision(hw: Hardware, device: str) -> tuple[str, str]:
    """Trainer precision for `device` (`cuda`, `cpu`, `mps`, ...)."""
    if device == "cuda":
        return "16-mixed", f"{hw.cuda or 'CUDA'}: fp16 autocast on tensor cores"
    if device == "cpu" and hw.native_bf16:
        flag = next(f for f in NATIVE_BF16_FLAGS if f in hw.cpu_flags)
        return "bf16-mixed", f"this CPU has native bf16 ({flag}): " + quoted(hw.cpu_kind(), "bf16_vs_fp32",
                                                                             "bf16 autocast's speed over fp32:")
    if device == "cpu":
        return "32-true", ("this CPU has no native bf16, no avx512_bf16 or amx: "
                           + quoted(hw.cpu_kind(), "bf16_vs_fp32", "bf16 autocast's speed over fp32:"))
    return "32-true", f"no mixed precision measured on {device}"


def bf16_cost_warning(hw: Hardware, device: str, precision: str) -> str | None:
    """A one-line warning when bf16 runs on a CPU that emulates it, else None."""
    if device != "cpu" or hw.native_bf16 or not str(precision).startswith("bf16"):
        return None
    return (f"precision {precision} on a CPU without native bf16 ({hw.cpu_model}; no avx512_bf16/amx): "
            + quoted(hw.cpu_kind(), "bf16_vs_fp32", "bf16 autocast's speed over fp32:")
            + "; precision auto picks 32-true here")


def choose_channels_last(hw: Hardware, device: str) -> tuple[bool, str]:
    """NHWC activations: what tensor cores and oneDNN's x86 convolutions prefer."""
    if device == "cuda":
        return True, "NHWC convolutions on tensor cores"
    if device == "cpu" and "avx2" in hw.cpu_flags:
        return True, "oneDNN's NHWC convolutions: " + quoted(hw.cpu_kind(), "channels_last_vs_nchw",
                                                              "channels_last's speed over NCHW (fp32):")
    return False, f"not measured on a {hw.cpu_kind() if device == 'cpu' else device}"


def choose_compile(hw: Hardware, device: str) -> tuple[bool, str]:
    """torch.compile pays a compilation at the start of a run for a faster step: worth it on a GPU with Triton, not on
    a CPU (its compilation cost and step time there: benchmarks/compute_levers.py, docs/PERFORMANCE.md, "Compute
    levers")."""
    if device == "cuda" and hw.triton:
        return True, "Triton kernels on CUDA"
    if device == "cuda":
        return False, "Triton is not installed"
    return False, f"on {device} compilation takes minutes for a small gain"


def choose_optimizer_impl(hw: Hardware, device: str) -> tuple[str, str]:
    """`fused`, one vectorised kernel for every parameter, where measured faster; torch's default loop elsewhere."""
    if device == "cuda":
        return "fused", "one optimizer kernel for all parameters on CUDA"
    if device == "cpu" and "avx2" in hw.cpu_flags:
        # AdamW's fused kernel against its loop is in no stored benchmark result: only SGD's is quoted.
        return "fused", "one vectorised kernel for all parameters: " + quoted(
            hw.cpu_kind(), "fused_sgd_vs_loop", "fused SGD's speed over torch's loop:")
    return "default", f"not measured on a {hw.cpu_kind() if device == 'cpu' else device}"


def choose_num_workers(hw: Hardware, device: str, devices_per_node: int = 1) -> tuple[int, str]:
    """Loader processes per device."""
    if device == "cuda":
        workers = min(8, max(1, hw.cores // max(1, devices_per_node)))
        return workers, f"{hw.cores} CPUs shared by {devices_per_node} GPU(s), at most 8 each"
    # On a CPU the compute threads use every core, so a loader process cannot overlap with them: it preempts one of
    # them (and an intra-op parallel region waits for its slowest thread), and its batches cross processes. Measured,
    # it moves imgcls fit's time by a few percent, one way or the other from run to run (benchmarks/time_to_accuracy.py,
    # docs/PERFORMANCE.md): none spares a process and its memory.
    return 0, ("images are decoded between steps in the training process; a loader process would share the cores "
               "its compute threads use ("
               + quoted(hw.cpu_kind(), "one_loader_process_vs_none", "imgcls fit's time with one loader process over "
                        "none:") + ")")
