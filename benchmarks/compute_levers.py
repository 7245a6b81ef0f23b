"""Compute levers: each option's speed-up of a ResNet-50 training step on this machine, at 64 px and 224 px.

    python -m benchmarks.run --only compute_levers [--quick]

The levers are the model and trainer options a config sets: channels_last (model.levers.channels_last), bf16
autocast (trainer.precision bf16-mixed; 16-mixed on CUDA), torch.compile (model.levers.compile) and foreach / fused
optimizers (model.levers.optimizer_impl). Each is timed alone against the fp32, NCHW, eager, for-loop-SGD baseline, in
the same run.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.common import interleaved, lap_times, table
from lightning_modules.network import BackboneWithHead

TITLE = "Compute levers"
BASELINE = "baseline: fp32, NCHW, eager, for-loop SGD"
LEVERS: dict[str, dict] = {
    BASELINE: {},
    "channels_last": {"channels_last": True},
    "bf16 autocast": {"bf16": True},
    "torch.compile": {"compile": True},
    "foreach SGD": {"impl": "foreach"},
    "fused SGD": {"impl": "fused"},
    "all four: channels_last, bf16, compile, fused SGD": {"channels_last": True, "bf16": True, "compile": True,
                                                          "impl": "fused"},
}


def train_step(*, arch: str = "resnet50", size: int = 224, batch: int = 8, channels_last: bool = False,
               bf16: bool = False, compile: bool = False, impl: str = "default", optimizer: str = "sgd",
               head_hidden: int = 1024, device: str = "cpu") -> Callable[[], None]:
    """One SGD (or AdamW) step of the project's network on a fixed synthetic batch (B, 3, size, size)."""
    torch.manual_seed(0)
    net = BackboneWithHead(10, arch=arch, head_hidden=head_hidden).to(device)
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    if channels_last:
        net = net.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    if compile:
        net.compile()
    extra = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[impl]
    if optimizer == "adamw":
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.05, **extra)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-4, **extra)
    dtype = torch.bfloat16 if device == "cpu" else torch.float16

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        ctx = torch.autocast(device, dtype=dtype) if bf16 else contextlib.nullcontext()
        with ctx:
            loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()

    return step


def measure(levers: dict[str, dict], size: int, batch: int, steps: int, reps: int, arch: str,
            warmup: int = 2) -> tuple[dict[str, float], dict[str, float]]:
    """Median seconds per step of every lever, interleaved; and the seconds of each lever's first `warmup` steps."""
    candidates, first = {}, {}
    for name, options in levers.items():
        step = train_step(arch=arch, size=size, batch=batch, **options)
        start = time.perf_counter()
        for _ in range(warmup):  # allocator, oneDNN primitives, compilation for torch.compile
            step()
        first[name] = time.perf_counter() - start
        candidates[name] = lambda step=step: lap_times(steps, step)
    return interleaved(candidates, reps), first


def main(quick: bool = False) -> dict:
    arch = "resnet18" if quick else "resnet50"
    # (size, batch, steps per turn, turns): one step per turn, so load from other processes hits every lever alike.
    settings = [(16, 2, 1, 1), (32, 2, 1, 1)] if quick else [(64, 16, 1, 9), (224, 8, 1, 6)]
    # Compiling a ResNet-50 training step takes a minute or more per graph on 2 CPU cores: the quick mode does not.
    levers = {k: v for k, v in LEVERS.items() if not (quick and v.get("compile"))}
    measured = []
    for size, batch, steps, reps in settings:
        step_s, first_s = measure(levers, size, batch, steps, reps, arch, warmup=1 if quick else 2)
        measured.append({"size": size, "batch": batch, "steps": steps, "turns": reps, "step_s": step_s,
                         "first_steps_s": first_s})
    return {"arch": arch, "threads": torch.get_num_threads(), "levers": list(levers), "settings": measured}


def render(results: dict) -> tuple[str, str]:
    settings = results["settings"]
    rows = []
    for name in results["levers"]:
        row = [name]
        for s in settings:
            times = s["step_s"]
            row += [s["batch"] / times[name], times[BASELINE] / times[name]]
        rows.append(row)
    headers = ["lever"]
    for s in settings:
        headers += [f"{s['size']} px img/s (batch {s['batch']})", f"{s['size']} px speed-up"]
    body = table(headers, rows)
    notes = [f"{s['size']} px: first two steps {s['first_steps_s']['torch.compile']:.0f} s with compile vs "
             f"{s['first_steps_s'][BASELINE]:.1f} s eager" for s in settings if "torch.compile" in s["step_s"]]
    body += ("\n\nCompilation cost, paid once per run: " + "; ".join(notes) + ".") if notes else (
        "\n\nQuick mode: compile levers left out.")
    return body, (f"{results['arch']} (the project's network, 1024-unit head), SGD with Nesterov momentum, synthetic "
                  f"batches on the CPU, {results['threads']} threads; speed-up = baseline step time / lever step "
                  "time, medians of interleaved steps")

