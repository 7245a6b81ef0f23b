"""Shared benchmark helpers: the machine's description, interleaved timing with medians, Markdown tables, photo-like
JPEGs."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp
from PIL import Image

from core import hardware


def cores() -> int:
    return hardware.detect().cores


# What holds torch's and oneDNN's CPU kernels below what the CPU has (`.ci/as-avx2` sets both, and hides the CPU's
# avx512/amx flags): figures measured so estimate another CPU kind. Their records say so, and are filed apart from
# the records of a real machine of that kind, never over them.
KERNEL_LIMITS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
# What holding the kernels cannot make of one CPU another: said wherever an estimate is shown.
NOT_MODELLED = ("it does not model the other CPU's clock, caches or interpreter speed, nor libraries that probe the "
                "CPU themselves (MKL, numpy, onnxruntime)")


def kernel_limits() -> dict[str, str]:
    return {name: os.environ[name] for name in KERNEL_LIMITS if os.environ.get(name)}


def estimate_label(limits: dict[str, str]) -> str:
    """How an estimate is named wherever it is shown: the limits it ran under and what it cannot model."""
    return f"an estimate: {', '.join(f'{k}={v}' for k, v in limits.items())}; {NOT_MODELLED}"


def _described() -> str:
    limits = kernel_limits()
    return hardware.detect().describe() + (f" ({estimate_label(limits)})" if limits else "")


def machine() -> str:
    """One line naming what the figures were measured on (CPU model and the flags that decide its levers, cores,
    GPU, any limit on the kernels), and how busy it was."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{_described()}; torch {torch.__version__}; "
            f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC; 1-minute load average {load:.1f}")


def machine_info() -> dict:
    """What a result file records of the machine: the line above, and its parts for the figures that quote it."""
    hw = hardware.detect()
    kind = hw.cpu_kind() + (" estimate" if kernel_limits() else "")  # its own folder and figure keys
    return {"line": machine(), "cpu": _described(), "cpu_model": hw.cpu_model, "cpu_kind": kind,
            "cpu_flags": {flag: flag in hw.cpu_flags for flag in hardware.CPU_FLAGS}, "cores": hw.cores,
            "cuda": hw.cuda, "torch": torch.__version__, "threads": torch.get_num_threads()}


def picks(entry: dict) -> str:
    """What `auto` chooses on the recorded machine, from its recorded flags (a hardware entry or a result's machine)."""
    hw = hardware.Hardware(entry["cpu_model"], frozenset(f for f, has in entry["cpu_flags"].items() if has),
                           entry["cores"])
    precision = hardware.choose_precision(hw, "cpu")[0]
    layout = "channels_last" if hardware.choose_channels_last(hw, "cpu")[0] else "NCHW"
    return f"{precision}, {layout}"


def auto_cpu_precision() -> str:
    """The precision `auto` runs on this CPU (bf16-mixed with native bf16, else 32-true): what the benchmarks of
    the project's defaults train in, on both sides of each comparison."""
    return hardware.choose_precision(hardware.detect(), "cpu")[0]


def cpu_autocast() -> contextlib.AbstractContextManager:
    """The autocast context of auto_cpu_precision(): bf16 autocast, or none for fp32."""
    bf16 = auto_cpu_precision() == "bf16-mixed"
    return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def interleaved_turns(candidates: dict[str, Callable[[], list[float]]], reps: int) -> dict[str, list[list[float]]]:
    """The per-item times each candidate returns in each of `reps` turns, running candidates round-robin.

    Round-robin spreads the load of a shared machine over every candidate alike.
    """
    times: dict[str, list[list[float]]] = {name: [] for name in candidates}
    for _ in range(reps):
        for name, run in candidates.items():
            times[name].append(run())
    return times


def interleaved(candidates: dict[str, Callable[[], list[float]]], reps: int) -> dict[str, float]:
    """Median of the per-item times of every turn of interleaved_turns: the median of many short intervals ignores
    the ones where another process held the core."""
    turns = interleaved_turns(candidates, reps)
    return {name: statistics.median(t for turn in laps for t in turn) for name, laps in turns.items()}


def quartiles(values: list[float]) -> dict[str, float]:
    """Median, interquartile range and extremes of `values`: the spread a figure is quoted with."""
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return {"median": median, "q1": q1, "q3": q3, "min": min(values), "max": max(values), "n": len(values)}


def lap_times(steps: int, step: Callable[[], object]) -> list[float]:
    """Seconds of each of `steps` calls of `step`."""
    laps = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        laps.append(time.perf_counter() - start)
    return laps


def table(headers: list[str], rows: list[list]) -> str:
    def cell(v) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def verdict(met: bool) -> str:
    return "met" if met else "**missed**"


def photo(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """A photo-like RGB image: smooth colour fields, mid-scale texture and sensor noise.

    Pure noise compresses badly and flat colour too well; this mix gives JPEGs of ImageNet-like size
    (about 70 KB at 500x375, quality 90), so decode times are realistic.
    """
    def smooth(cells_y: int, cells_x: int) -> np.ndarray:
        cells = Image.fromarray(rng.integers(0, 256, (cells_y, cells_x, 3), dtype=np.uint8))
        return np.asarray(cells.resize((width, height), Image.BICUBIC), dtype=np.float32)

    pixels = 0.6 * smooth(6, 8) + 0.3 * smooth(max(2, height // 8), max(2, width // 8))
    pixels += rng.normal(0.0, 10.0, (height, width, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def _save_photos(job: tuple[Path, int, int, int, int, int, int]) -> None:
    """Write photos `start`..`stop` of one split: each from its own seed, so any split of the work gives the same
    files."""
    root, start, stop, width, height, classes, seed = job
    for i in range(start, stop):
        folder = root / f"class{i % classes:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        photo(np.random.default_rng([seed, i]), width, height).save(folder / f"{i:05d}.jpg", quality=90)


def photo_folder(count: int, *, width: int = 500, height: int = 375, classes: int = 10) -> Path:
    """An image-folder tree (train/ and a small val/) of `count` photo-like JPEGs, cached in the temp folder and
    written by one process per core (6,000 of them take ~90 s on one core)."""
    root = Path(tempfile.gettempdir()) / f"imgcls-bench-photos-{count}-{width}x{height}"
    done = root / ".complete"
    if done.is_file():
        return root
    jobs = []
    for seed, (split, n) in enumerate((("train", count), ("val", max(classes, count // 10)))):
        chunk = max(1, -(-n // (4 * cores())))
        jobs += [(root / split, start, min(n, start + chunk), width, height, classes, seed)
                 for start in range(0, n, chunk)]
    if len(jobs) > 2:
        with multiprocessing.get_context("spawn").Pool(min(cores(), len(jobs))) as pool:
            pool.map(_save_photos, jobs)
    else:
        for job in jobs:
            _save_photos(job)
    done.touch()
    return root


def mean_jpeg_kb(root: Path) -> float:
    sizes = [p.stat().st_size for p in root.glob("train/*/*.jpg")]
    return sum(sizes) / len(sizes) / 1e3


@contextlib.contextmanager
def one_torch_thread():
    """torch on one thread, as in a loader worker (DataLoader sets that): figures per core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_forked(module: str, worker: Callable, nprocs: int, args: Callable[[int, str], tuple]):
    """Run `worker(rank, *args(port, out))` in `nprocs` processes and return what they saved to `out`.

    The processes are forked from a server that imported `module` (torch, Lightning) once: spawned, each would
    import them again, ~6 s of CPU apiece. The server has run nothing, so a fork inherits no threads.
    """
    multiprocessing.set_forkserver_preload([module])
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.pt")
        for attempt in range(3):  # a port found free can be taken by another program before gloo binds it
            try:
                mp.start_processes(worker, args=args(free_port(), out), nprocs=nprocs, join=True,
                                   start_method="forkserver")
                break
            except mp.ProcessExitedException:
                if attempt == 2:
                    raise
        return torch.load(out, weights_only=True)
