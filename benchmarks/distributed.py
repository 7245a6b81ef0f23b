"""Benchmark of DDP gradient compression on CPU (gloo): bytes all-reduced per step, and step time with 1 and 2
processes.

    python -m benchmarks.run --only distributed            # + 2-process parity on the demo digits
    python -m benchmarks.run --only distributed --quick    # ResNet50 bytes, ResNet18 32 px step times
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from benchmarks.common import free_port, run_forked, table
from lightning_modules.network import BackboneWithHead
from training.distributed.strategy import COMPRESSIONS, build_comm_hook

TITLE = "Distributed: gradient compression (CPU, gloo)"
POWERSGD_RANK = 4
PARITY_EPOCHS = 8  # the quickstart's max_epochs: the recipe as shipped


def expected_allreduce_bytes(module: torch.nn.Module, compression: str, *, rank: int = POWERSGD_RANK,
                             min_compression_rate: float = 2.0) -> int:
    """Bytes each rank hands to all-reduce per step, from the parameter shapes alone.

    none: fp32 gradients, 4 bytes per element; fp16/bf16: 2 bytes. PowerSGD (after its start iteration) views each
    gradient as an (n, m) = (shape[0], rest) matrix and sends fp32 P (n, r) and Q (m, r) when (n + m) r times
    `min_compression_rate` is below n m; other tensors (biases, norm weights, small matrices) go uncompressed.
    """
    total = 0
    for p in module.parameters():
        if not p.requires_grad:
            continue
        if compression == "powersgd":
            n, m = p.shape[0], p.numel() // p.shape[0]
            r = min(n, m, rank)
            total += 4 * ((n + m) * r if (n + m) * r * min_compression_rate < n * m else n * m)
        else:
            total += p.numel() * (4 if compression == "none" else 2)
    return total


@contextlib.contextmanager
def count_allreduce_bytes():
    """Counts the bytes of every tensor passed to torch.distributed.all_reduce inside the block (this process).

    The Python comm hooks call `dist.all_reduce`, so patching it sees exactly what goes on the wire per rank
    (a ring all-reduce then moves 2 (N - 1) / N times that per rank). DDP's built-in C++ all-reduce bypasses
    Python, so `none` is measured with default_hooks.allreduce_hook, its Python twin.
    """
    counted = {"bytes": 0, "calls": 0}
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        counted["bytes"] += tensor.numel() * tensor.element_size()
        counted["calls"] += 1
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        yield counted
    finally:
        dist.all_reduce = original


def wrap_ddp(module: torch.nn.Module, compression: str, *, count: bool = False, powersgd_start_iter: int = 2,
             bucket_cap_mb: float = 25.0) -> tuple[DistributedDataParallel, object]:
    """DDP with the same hook CompressedDDPStrategy registers (`count`: `none` via the Python all-reduce hook)."""
    ddp = DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True)
    state, hook = build_comm_hook(compression, module, rank=POWERSGD_RANK, start_iter=powersgd_start_iter)
    if hook is None and count:
        hook = default_hooks.allreduce_hook
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    return ddp, state


def _train_step(ddp: DistributedDataParallel, optimizer, batch: int, size: int, classes: int) -> None:
    x = torch.randn(batch, 3, size, size)  # (B, 3, H, W)
    y = torch.randint(0, classes, (batch,))
    optimizer.zero_grad(set_to_none=True)
    F.cross_entropy(ddp(x), y).backward()
    optimizer.step()


def _init_group(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _measure(job: dict, compression: str) -> dict:
    """Median step time (and with `count`, bytes all-reduced per step) of one freshly built DDP model."""
    torch.manual_seed(0)
    net = BackboneWithHead(job["classes"], arch=job["arch"], head_hidden=job["head_hidden"], dropout=0.0)
    ddp, _ = wrap_ddp(net, compression, count=job["count"])
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    for _ in range(job["warmup"]):  # bucket rebuild after step 1, PowerSGD from step 3
        _train_step(ddp, optimizer, job["batch"], job["size"], job["classes"])
    times = []
    with count_allreduce_bytes() if job["count"] else contextlib.nullcontext({"bytes": 0}) as counted:
        for _ in range(job["steps"]):
            dist.barrier()
            start = time.perf_counter()
            _train_step(ddp, optimizer, job["batch"], job["size"], job["classes"])
            times.append(time.perf_counter() - start)
    return {"bytes": counted["bytes"] // job["steps"], "step_s": statistics.median(times),
            "expected": expected_allreduce_bytes(net, compression)}


def _worker(rank: int, world: int, port: int, jobs: list[dict], out: str) -> None:
    torch.set_num_threads(1)
    _init_group(rank, world, port)
    try:
        results = [{c: _measure(job, c) for c in job["compressions"]} for job in jobs]
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def run_jobs(world: int, jobs: list[dict]) -> list[dict]:
    """Run each job (one model per compression mode) in `world` gloo processes; rank 0's figures."""
    return run_forked("benchmarks.distributed", _worker, world, lambda port, out: (world, port, jobs, out))


def _fit_two_processes(compression: str, data: str, run: Path, epochs: int) -> Path:
    """`imgcls fit` of the quickstart recipe on 2 gloo processes with one compression mode; its last.ckpt."""
    cmd = [sys.executable, "-m", "imgcls", "fit", "--config", "configs/quickstart.yaml",
           "--data.root", data, "--model.net.arch", "resnet18", "--data.image_size", "32", "--data.batch_size", "32",
           "--data.num_workers", "0", "--trainer.accelerator", "cpu", "--trainer.devices", "2",
           "--trainer.max_epochs", str(epochs), "--trainer.default_root_dir", str(run),
           "--trainer.enable_model_summary", "false",
           "--trainer.strategy=training.distributed.strategy.CompressedDDPStrategy",
           f"--trainer.strategy.compression={compression}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))
    last = run / "checkpoints" / "last.ckpt"
    for attempt in range(2):  # one retry: a rank can die at exit ("terminate called ...") after training
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        if last.is_file() and (proc.returncode == 0 or attempt == 1):
            break
        env["MASTER_PORT"] = str(free_port())
    if proc.returncode != 0:
        print(f"{compression}: imgcls exited {proc.returncode}: {proc.stderr[-2000:]}", file=sys.stderr)
    return last


def held_out_correct(run: Path) -> tuple[int, int]:
    """(images right, images) of `<run>/checkpoints/last.ckpt` on the val/ and test/ splits, one process.

    Both splits are held out: last.ckpt is the final epoch's weights, not a checkpoint picked by val/acc. The data
    and precision settings are the run's own (`<run>/config.yaml`), so the images look as they did in training.
    """
    import yaml

    from datamodules import ImageFolderDataModule
    from lightning_modules import ImageClassifier
    from training.trainer import Trainer  # resolves the config's `precision: auto` as the run did

    config = yaml.safe_load((run / "config.yaml").read_text())
    data = ImageFolderDataModule(**{**config["data"]["init_args"], "num_workers": 0})  # the run's data source
    model = ImageClassifier.load_from_checkpoint(run / "checkpoints" / "last.ckpt", map_location="cpu",
                                                 weights_only=True)
    trainer = Trainer(accelerator="cpu", devices=1, precision=config["trainer"]["precision"], logger=False,
                      enable_progress_bar=False, enable_model_summary=False)
    val_acc = trainer.validate(model, datamodule=data, verbose=False)[0]["val/acc"]
    test_acc = trainer.test(model, datamodule=data, verbose=False)[0]["test/acc"]
    n_val, n_test = len(data.val_set), len(data.test_set)
    return round(val_acc * n_val) + round(test_acc * n_test), n_val + n_test  # val/acc, test/acc: micro accuracy


def parity(epochs: int = PARITY_EPOCHS, root: str | None = None) -> dict[str, tuple[int, int]]:
    """Held-out (right, images) after 2-process DDP (gloo) on the demo digits for each compression mode, with the
    same seed and epochs for every mode."""
    from datamodules.demo import build_demo_data

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = root or str(build_demo_data(Path(tmp) / "digits", size=32))
        for compression in COMPRESSIONS:
            run = Path(tmp) / compression
            _fit_two_processes(compression, data, run, epochs)
            results[compression] = held_out_correct(run)
    return results


def parity_table(results: dict[str, tuple[int, int]]) -> str:
    """Markdown: each mode's held-out accuracy, its difference from `none` in points, and whether that is <= 1."""
    right0, n0 = results["none"]
    rows = []
    for compression, (right, n) in results.items():
        diff = 100 * (right / n - right0 / n0)
        rows.append([compression, f"{right} / {n}", f"{100 * right / n:.2f} %", f"{diff:+.2f}",
                     "yes" if abs(diff) <= 1.0 else "no"])
    return table(["compression", "right (val + test)", "accuracy", "vs none (points)", "within 1 point"], rows)


def main(quick: bool = False) -> dict:
    """Bytes per step on ResNet50 for each compression, step times with 1 and 2 processes, and (full) parity."""
    bytes_job = dict(arch="resnet50", head_hidden=1024, classes=10, batch=2, size=32, warmup=3, steps=1, count=True,
                     compressions=COMPRESSIONS)
    time_job = dict(arch="resnet18", head_hidden=0, classes=10, batch=4 if quick else 16, size=16 if quick else 64,
                    warmup=1 if quick else 3, steps=1 if quick else 10, count=False, compressions=COMPRESSIONS)
    counted, one = run_jobs(1, [bytes_job, time_job])
    (two,) = run_jobs(2, [time_job])
    return {"powersgd_rank": POWERSGD_RANK, "time_job": {k: v for k, v in time_job.items() if k != "compressions"},
            "bytes": {c: {"measured": counted[c]["bytes"], "expected": counted[c]["expected"]} for c in COMPRESSIONS},
            "step_s": {c: {"1": one[c]["step_s"], "2": two[c]["step_s"]} for c in COMPRESSIONS},
            "parity_epochs": None if quick else PARITY_EPOCHS, "parity": None if quick else parity()}


def bytes_table(results: dict) -> str:
    base = results["bytes"]["none"]["measured"]
    return table(["compression", "bytes / step / rank", "MiB", "expected from shapes, MiB", "x none"],
                 [[c, f"{b['measured']:,}", f"{b['measured'] / 2**20:.2f}", f"{b['expected'] / 2**20:.2f}",
                   f"{b['measured'] / base:.4f}"] for c, b in results["bytes"].items()])


def step_table(results: dict) -> str:
    return table(["compression", "step ms, 1 process", "step ms, 2 processes", "2 / 1"],
                 [[c, f"{t['1'] * 1000:.0f}", f"{t['2'] * 1000:.0f}", f"{t['2'] / t['1']:.2f}"]
                  for c, t in results["step_s"].items()])


def step_settings(results: dict) -> str:
    job = results["time_job"]
    return (f"{job['arch']}, batch {job['batch']} per process, {job['size']} px, median of {job['steps']} steps after "
            f"{job['warmup']} warm-up steps, 1 thread per process")


def render(results: dict) -> tuple[str, str]:
    body = (f"Bytes all-reduced per step and rank (ResNet50 + 1024-wide head, PowerSGD rank "
            f"{results['powersgd_rank']}, one step after PowerSGD started), counted and expected from the parameter "
            f"shapes:\n\n{bytes_table(results)}\n\nStep time: {step_settings(results)}.\n\n{step_table(results)}")
    if results["parity"]:
        body += ("\n\n" + parity_table(results["parity"]) + "\n\nParity: demo digits at 32 px (1,437 train; 180 val "
                 "+ 180 test held out), resnet18 + 1024 head, configs/quickstart.yaml, 2 gloo processes x batch 32, "
                 f"{results['parity_epochs']} epochs, PowerSGD rank 4 from step 10, seed 42; last.ckpt evaluated "
                 "on val/ and test/.")
    return body, "Step times and bytes from plain DDP with the hooks the strategy registers" + (
        "" if results["parity"] else "; quick: no parity runs")


def figures(results: dict) -> dict[str, str]:
    """The tables docs/DISTRIBUTED.md quotes, and the bytes of `none` and PowerSGD."""
    sent = {c: b["measured"] for c, b in results["bytes"].items()}
    found = {"bytes_table": f"\n{bytes_table(results)}\n", "step_table": f"\n{step_table(results)}\n",
             "step_settings": step_settings(results), "none_mib": f"{sent['none'] / 2**20:.1f} MiB",
             "powersgd_percent": f"{100 * sent['powersgd'] / sent['none']:.1f}%"}
    if results["parity"]:
        found["parity_table"] = f"\n{parity_table(results['parity'])}\n"
    return found

