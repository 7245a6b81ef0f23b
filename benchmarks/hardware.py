"""Hardware: what this machine's CPU can do, and the quickstart's training step in each precision and memory format.

    python -m benchmarks.run --only hardware [--quick]

Each full run stores its machine's record like every section (benchmarks/results/machines/<machine>/hardware.json);
the section shows every machine stored there, named by its CPU model and flags, so figures from a bf16 CPU and an
AVX2-only CPU sit side by side and never mix. The last columns say what `auto` picks on that machine
(core/hardware.py).
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.common import interleaved, lap_times, machine_info, picks, table
from benchmarks.compute_levers import train_step
from benchmarks.records import measured, read_all
from benchmarks.time_to_accuracy import RECIPE
from core import hardware

ROOT = Path(__file__).resolve().parents[1]
TITLE = "Hardware"
# (precision, memory format) -> train_step options; fp32 NCHW is the baseline of each machine's ratios.
COMBOS = {
    "fp32, NCHW": {},
    "fp32, channels_last": {"channels_last": True},
    "bf16 autocast, NCHW": {"bf16": True},
    "bf16 autocast, channels_last": {"bf16": True, "channels_last": True},
}
BASELINE = "fp32, NCHW"


def quickstart_recipe() -> dict:
    """The step configs/quickstart.yaml trains, as time_to_accuracy reads it from the file (AdamW, as its plain
    loop)."""
    return {"arch": RECIPE["arch"], "head_hidden": RECIPE["head_hidden"], "optimizer": "adamw",
            "image_size": RECIPE["image_size"], "batch_size": RECIPE["batch"], "epochs": RECIPE["epochs"]}


def measure(recipe: dict, reps: int, hw: hardware.Hardware) -> dict[str, float]:
    """img/s of the quickstart's training step for each combination, interleaved medians."""
    impl = hardware.choose_optimizer_impl(hw, "cpu")[0]  # the optimizer `auto` runs here, in every combination
    candidates = {}
    for name, options in COMBOS.items():
        step = train_step(arch=recipe["arch"], size=recipe["image_size"], batch=recipe["batch_size"],
                          head_hidden=recipe["head_hidden"], optimizer=recipe["optimizer"], impl=impl, **options)
        step()  # warm-up: allocator, oneDNN primitives
        candidates[name] = lambda step=step: lap_times(1, step)
    seconds = interleaved(candidates, reps)
    return {name: recipe["batch_size"] / s for name, s in seconds.items()}


def record(recipe: dict, img_s: dict[str, float]) -> dict:
    """This machine's entry: its CPU (as the result files describe it), the recipe and the step rates."""
    info = machine_info()
    return {"machine": info["cpu"], **{key: info[key] for key in ("cpu_model", "cpu_kind", "cpu_flags", "cores",
                                                                  "torch", "threads")},
            "date": f"{datetime.now(UTC):%Y-%m-%d}", "recipe": recipe, "img_s": img_s}


def slug(entry: dict) -> str:
    """The file name of a machine's entry: its CPU kind, model and cores."""
    name = f"{entry['cpu_kind']} {entry['cpu_model']} {entry['cores']} cores"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def stored() -> list[dict]:
    """Every machine's entry, from the section's stored records."""
    return [entry for record in read_all().get("hardware", []) if measured(record) and record["mode"] == "full"
            for entry in record["results"]["machines"]]


def table_of(entries: list[dict]) -> str:
    headers = ["machine (CPU kind)", "flags: avx2 / avx512f / avx512_bf16 / amx_tile", "torch, threads"]
    headers += [f"{name} img/s" for name in COMBOS] + ["bf16 / fp32 speed (channels_last)", "auto picks"]
    rows = []
    for e in entries:
        flags = " / ".join("yes" if e["cpu_flags"].get(f) else "no" for f in ("avx2", "avx512f", "avx512_bf16",
                                                                             "amx_tile"))
        img_s = e["img_s"]
        rows.append([f"{e['machine']} ({e['cpu_kind']}, {e['date']})", flags, f"{e['torch']}, {e['threads']}",
                     *[img_s[name] for name in COMBOS], f"{bf16_speedup(e):.2f}x", picks(e)])
    return table(headers, rows)


def bf16_speedup(entry: dict) -> float:
    """bf16 autocast's speed over fp32's, both channels_last: ~2 with native bf16, ~0.1 without."""
    return entry["img_s"]["bf16 autocast, channels_last"] / entry["img_s"]["fp32, channels_last"]


def quickstart_projection(entry: dict) -> str:
    """Seconds of training steps in the quickstart (all epochs) at the step rate `auto` picks on that machine."""
    recipe = entry["recipe"]
    precision, layout = picks(entry).split(", ")
    name = f"{'bf16 autocast' if precision == 'bf16-mixed' else 'fp32'}, {layout}"
    images = 1437 * recipe["epochs"]  # the demo digits' training split
    return f"{entry['machine']}: {images / entry['img_s'][name]:.0f} s of training steps at {name}"


def main(quick: bool = False) -> dict:
    """Measure this machine; the results hold every stored machine's figures (a quick run's: its own only)."""
    hw = hardware.detect()
    recipe = quickstart_recipe()
    if quick:
        recipe.update(arch="resnet18", image_size=32, batch_size=2)
    entry = record(recipe, measure(recipe, reps=1 if quick else 5, hw=hw))  # emulated bf16: long steps
    return {"machines": [entry], "measured": slug(entry)}


def render(results: dict) -> tuple[str, str]:
    entries = results["machines"]
    body = table_of(entries)
    body += ("\n\nThe quickstart's training steps (8 epochs of the 1,437 training digits), at what `auto` picks: "
             + "; ".join(quickstart_projection(e) for e in entries) + ". Validation, start-up and checkpoints "
             "come on top: the time to accuracy section times whole runs.")
    recipe = entries[0]["recipe"]
    return body, (f"{recipe['arch']} + {recipe['head_hidden']}-unit head, {recipe['image_size']} px, batch "
                  f"{recipe['batch_size']}, {recipe['optimizer']} (the optimizer implementation `auto` picks), "
                  "synthetic batches, medians of interleaved steps")


def figures(results: dict) -> dict[str, str]:
    """The machine this run measured (or the first stored): bf16 autocast's cost there."""
    entry = next((e for e in results["machines"] if slug(e) == results["measured"]), results["machines"][0])
    speed = bf16_speedup(entry)
    return {"bf16_vs_fp32": f"{speed:.2f}x", "bf16_slowdown": f"{1 / speed:.0f}x",
            "machine": entry["machine"]}

