"""Memory per rank of FSDP2 (training.distributed.fsdp) against DDP, on 2 CPU processes (gloo): the bytes of parameters,
gradients and optimizer state each rank holds after a training step, and how much its resident memory grew at peak.

    python -m benchmarks.run --only fsdp_memory            # resnet50, resnet152, wide_resnet101_2
    python -m benchmarks.run --only fsdp_memory --quick    # resnet18 only, tiny: checks that it runs

Each (backbone, strategy) runs in its own 2 processes, forked from a server that imported torch once, so that a
peak belongs to that run alone. DDP is configured as configs/imagenet_ddp8.yaml (gradients as bucket views, so no
second gradient copy), FSDP2 as configs/fsdp.yaml (one unit per residual block, through the `shard` function the
strategy calls); both train with SGD + momentum (foreach) in fp32. The bytes are counted from the tensors each rank
holds between steps: for FSDP2 its shards. The peak resident memory (Linux's VmHWM, minus the process's memory
before the network was built; reset after the first step) adds what the bytes leave out: activations, the full
parameters FSDP2 gathers for the unit that runs, communication buffers and the allocator's slack.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torchvision.models.resnet import BasicBlock, Bottleneck

from benchmarks.common import run_forked, table
from lightning_modules.network import BackboneWithHead
from training.distributed.fsdp import shard

TITLE = "FSDP2 against DDP: memory per rank (CPU, gloo, 2 processes)"
STRATEGIES = ("ddp", "fsdp2", "fsdp2_ac")
LABELS = {"ddp": "DDP", "fsdp2": "FSDP2", "fsdp2_ac": "FSDP2 + activation checkpointing"}
WORLD = 2
BLOCKS = (Bottleneck, BasicBlock)  # the FSDP units (resnet50 and larger have Bottlenecks; quick's resnet18 BasicBlocks)


def _status_kib(field: str) -> int:
    """A memory line of /proc/self/status (VmRSS: resident now, VmHWM: resident at peak), in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)


def _return_freed_memory() -> None:
    """Large allocations always mmapped, so that a freed tensor leaves the resident memory (glibc otherwise raises
    its mmap threshold after the first frees and keeps later tensors in its heap, and RSS stops tracking use)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD, fixed


def _local_bytes(tensors) -> int:
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors if t is not None)


def _measure(job: dict) -> dict:
    """Build, wrap and train one network for the job's steps; what this rank holds and its memory peak."""
    baseline = _status_kib("VmRSS")
    torch.manual_seed(0)
    net = BackboneWithHead(job["classes"], arch=job["arch"], head_hidden=1024, dropout=0.0)
    if job["strategy"] == "ddp":
        model = DistributedDataParallel(net, gradient_as_bucket_view=True, bucket_cap_mb=25.0, static_graph=True)
    else:
        model = nn.Module()
        model.net = net  # as a LightningModule holds its network: `shard` wraps the children that hold parameters
        checkpointed = BLOCKS if job["strategy"] == "fsdp2_ac" else ()
        shard(model, init_device_mesh("cpu", (WORLD,)), BLOCKS, checkpointed=checkpointed)
        model = model.net
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=True)
    times, first_peak = [], 0
    for step in range(job["steps"]):
        x = torch.randn(job["batch"], 3, job["size"], job["size"])  # (B, 3, H, W)
        y = torch.randint(0, job["classes"], (job["batch"],))
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
        if step == 0:  # the build, the wrapping and the first step (optimizer state created) peak once; then reset
            first_peak = _status_kib("VmHWM") - baseline
            _reset_peak()
    params = list(model.parameters())
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return {"param_bytes": _local_bytes(params), "grad_bytes": _local_bytes(p.grad for p in params),
            "optim_bytes": _local_bytes(state), "numel": sum(p.numel() for p in params),
            "first_peak_growth_kib": first_peak, "peak_growth_kib": _status_kib("VmHWM") - baseline,
            "step_s": statistics.median(times[1:])}


def _worker(rank: int, port: int, jobs: list[dict], out: str) -> None:
    torch.set_num_threads(1)
    _return_freed_memory()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        results = []
        for job in jobs:
            gathered = [None] * WORLD
            dist.all_gather_object(gathered, _measure(job))
            results.append(gathered)
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def run(jobs: list[dict]) -> list[list[dict]]:
    """The jobs one after the other in WORLD fresh gloo processes; each job's figures, per rank. A peak is the
    job's own only when it ran alone (or after smaller ones) in its processes."""
    return run_forked("benchmarks.fsdp_memory", _worker, WORLD, lambda port, out: (port, jobs, out))


def main(quick: bool = False) -> dict:
    if not Path("/proc/self/status").is_file():
        return {"skipped": "needs Linux (/proc/self/status)", "needs": "linux"}
    if quick:  # every strategy in the same 2 processes, tiny: checks that it runs, the peaks mean nothing
        settings = {"batch": 2, "size": 32, "classes": 10, "steps": 2}
        ranks = run([{"arch": "resnet18", "strategy": s, **settings} for s in STRATEGIES])
        return {"settings": settings, "world": WORLD, "runs": {"resnet18": dict(zip(STRATEGIES, ranks, strict=True))}}
    settings = {"batch": 4, "size": 64, "classes": 10, "steps": 4}  # peaks: over steps 2+
    runs = {arch: {s: run([{"arch": arch, "strategy": s, **settings}])[0] for s in STRATEGIES}
            for arch in ("resnet50", "resnet152", "wide_resnet101_2")}
    return {"settings": settings, "world": WORLD, "runs": runs}


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def memory_table(results: dict) -> str:
    def held(rank: dict) -> int:
        return rank["param_bytes"] + rank["grad_bytes"] + rank["optim_bytes"]

    rows = []
    for arch, runs in results["runs"].items():
        ddp_held = max(held(r) for r in runs["ddp"])
        ddp_peak = max(r["peak_growth_kib"] for r in runs["ddp"])
        for strategy, ranks in runs.items():
            worst = max(ranks, key=held)
            peak = max(r["peak_growth_kib"] for r in ranks)
            rows.append([f"{arch} ({ranks[0]['numel'] / 1e6:.1f}M)", LABELS[strategy], _mib(worst["param_bytes"]),
                         _mib(worst["grad_bytes"]), _mib(worst["optim_bytes"]), _mib(held(worst)),
                         f"{held(worst) / ddp_held:.2f}", f"{peak / 1024:,.0f}", f"{peak / ddp_peak:.2f}",
                         f"{max(r['first_peak_growth_kib'] for r in ranks) / 1024:,.0f}",
                         f"{max(r['step_s'] for r in ranks) * 1000:,.0f}"])
    return table(["backbone (parameters)", "strategy", "parameters MiB", "gradients MiB", "optimizer MiB",
                  "held MiB", "held x DDP", "training peak MiB", "peak x DDP", "first-step peak MiB", "step ms"],
                 rows)


def settings_line(results: dict) -> str:
    s = results["settings"]
    return (f"{results['world']} processes, 1 thread each; + the 1024-wide head, {s['classes']} classes; batch "
            f"{s['batch']} per process at {s['size']} px, fp32, SGD with momentum; {s['steps']} steps; per rank, "
            "the larger of the two ranks' figures")


def render(results: dict) -> tuple[str, str]:
    body = ("Held: the parameters, gradients and momentum each rank keeps between steps (its shards under FSDP2). "
            "Training peak: the largest rise of the rank's resident memory over the steps after the first, from "
            "before the network was built (held + activations + FSDP2's gathered units and communication buffers). "
            "First-step peak: the same over building the full network on every rank, wrapping or sharding it and the "
            f"first step.\n\n{memory_table(results)}")
    return body, settings_line(results)


def figures(results: dict) -> dict[str, str]:
    """The table docs/DISTRIBUTED.md quotes, its settings, and the held-bytes ratio of resnet152 (or the first)."""
    arch = "resnet152" if "resnet152" in results["runs"] else next(iter(results["runs"]))
    runs = results["runs"][arch]

    def held(strategy: str) -> int:
        return max(r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"] for r in runs[strategy])

    return {"memory_table": f"\n{memory_table(results)}\n", "settings": settings_line(results),
            "held_ratio": f"{held('fsdp2') / held('ddp'):.2f}x", "held_arch": arch}

