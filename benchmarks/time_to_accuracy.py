"""Time to accuracy: wall time and epochs for the quickstart to reach 97% and 99% val/acc on the demo digits.

    python -m benchmarks.run --only time_to_accuracy [--quick]

`imgcls fit --config configs/quickstart.yaml` runs as a user runs it (PNG files, DataLoader, Lightning), against a
plain PyTorch loop on in-memory tensors with the same model and recipe, in the same benchmark run. Each is a process
of its own, timed from its launch to its exit: both pay for starting Python and importing torch, imgcls also for
Lightning, its checkpoints, figures and closing summary.

What imgcls does by default beyond the plain loop is measured by turning it back on, one thing at a time, over the
same seeds: a loader process on the CPU (`data.num_workers: 1`, the default before 0), the figures drawn at every
validation (`ValidationFigures.time_budget: null`), and, without checkpoints, figures and progress bar, the floor.
The closing validation of the best checkpoint runs only where no validation of the fit was of the best weights; its
time is recorded where it ran. The targets are judged on imgcls's time over the plain loop's within each seed's pair
(run back to back), the median of the pairs, given with their spread: a shared machine's speed drifts over minutes
by more than the difference measured, and a ratio of two sides' medians mixes runs far apart.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import yaml

from benchmarks.common import auto_cpu_precision, table, verdict
from datamodules.demo import build_demo_data

ROOT = Path(__file__).resolve().parents[1]
TITLE = "Time to accuracy"
TARGETS = (0.97, 0.99)
RATIO_TARGET = 1.2  # imgcls' time to 97% at most this many times the plain loop's
SEEDS = 5
PROCESS_TARGET = 1.1  # the whole `imgcls fit` process at most this many times the plain loop's
PLAIN = "plain PyTorch loop, tensors in memory"
IMGCLS = "imgcls fit (PNG files, loader, Lightning)"
LEAN = "imgcls fit without checkpoints, figures, progress bar"
ONE_WORKER = "imgcls fit with 1 loader process"
EVERY_FIGURE = "imgcls fit drawing figures at every validation"


def _quickstart_recipe() -> dict:
    """The recipe of configs/quickstart.yaml, read from the file, so that the plain loop copies what imgcls runs."""
    config = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())
    model, data = config["model"], config["data"]
    optimizer, schedule = model["optimizer"], model["lr_scheduler"]
    assert optimizer["class_path"] == "torch.optim.AdamW", optimizer  # the plain loop's optimizer
    assert schedule["class_path"] == "lightning_modules.schedules.WarmupCosine", schedule  # and its schedule
    net = model["net"]["init_args"]  # BackboneWithHead's
    return dict(arch=net["arch"], head_hidden=net["head_hidden"], dropout=net["dropout"],
                zero_init_residual=net["zero_init_residual"],
                lr=optimizer["init_args"]["lr"], betas=tuple(optimizer["init_args"]["betas"]),
                weight_decay=optimizer["init_args"]["weight_decay"],
                warmup_epochs=schedule["init_args"]["warmup_epochs"],
                label_smoothing=model["loss"]["init_args"]["label_smoothing"],
                batch=data["batch_size"], image_size=data["train_transform"]["init_args"]["image_size"],
                epochs=config["trainer"]["max_epochs"],
                seed=config["seed_everything"])


RECIPE = _quickstart_recipe()
QUICK = dict(RECIPE, arch="resnet18", head_hidden=32, image_size=32, batch=16, epochs=1)


class EpochClock(L.Callback):
    """Appends {epoch, step, val_acc, seconds since $BENCH_T0} to $BENCH_CLOCK after each validation of `fit`, and the
    seconds of the closing validation of the best checkpoint (`validate` after `fit`) to $BENCH_CLOCK.closing."""

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.started = time.time()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "validate":
            with open(os.environ["BENCH_CLOCK"] + ".closing", "a") as f:
                f.write(f"{time.time() - self.started}\n")
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        record = {"epoch": trainer.current_epoch + 1, "step": trainer.global_step,
                  "val_acc": float(trainer.callback_metrics["val/acc"]),
                  "seconds": time.time() - float(os.environ["BENCH_T0"])}
        with open(os.environ["BENCH_CLOCK"], "a") as f:
            f.write(json.dumps(record) + "\n")


def every_figure_callbacks(folder: Path) -> Path:
    """configs/callbacks/default.yaml with ValidationFigures drawing at every validation (time_budget: null)."""
    callbacks = yaml.safe_load((ROOT / "configs" / "callbacks" / "default.yaml").read_text())
    for callback in callbacks:
        if callback["class_path"].endswith("ValidationFigures"):
            callback.setdefault("init_args", {})["time_budget"] = None
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "callbacks.yaml").write_text(yaml.safe_dump(callbacks, sort_keys=False))
    return folder / "callbacks.yaml"


def variant_args(name: str, run_dir: Path) -> list[str]:
    """The command-line arguments that turn one of imgcls's defaults back on (or, LEAN, every extra off)."""
    if name == LEAN:
        return ["--trainer.callbacks=[]", "--trainer.enable_checkpointing=false"]
    if name == ONE_WORKER:
        return ["--data.num_workers", "1"]
    if name == EVERY_FIGURE:
        return ["--trainer.callbacks", str(every_figure_callbacks(run_dir.parent / "every-figure"))]
    return []


def run_imgcls(data: Path, run_dir: Path, quick: bool, seed: int, variant: str = IMGCLS) -> tuple[list[dict], dict]:
    """`imgcls fit` of the quickstart with `variant`'s arguments: its epochs' records, and {process seconds,
    closing validation seconds (None where it did not run)}."""
    clock = run_dir / "clock.jsonl"
    args = [sys.executable, "-m", "imgcls", "fit", "--config", str(ROOT / "configs/quickstart.yaml"),
            "--data.root", str(data), "--trainer.default_root_dir", str(run_dir), "--seed_everything", str(seed),
            *variant_args(variant, run_dir)]
    args += ["--trainer.callbacks+=benchmarks.time_to_accuracy.EpochClock"]
    if quick:
        args += ["--model.net.arch", QUICK["arch"], "--model.net.head_hidden", str(QUICK["head_hidden"]),
                 "--data.image_size", str(QUICK["image_size"]), "--data.batch_size", str(QUICK["batch"]),
                 "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2",
                 "--trainer.limit_val_batches", "2"]
    _, process = timed(args, clock=clock)
    records = clock_records(clock)
    closing = Path(f"{clock}.closing")
    return records, {**process, "closing_validation": float(closing.read_text()) if closing.exists() else None}


def timed(args: list[str], *, clock: Path | None = None, cwd: Path = ROOT,
          env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    """Run `args` (in `cwd`, with `env`, default this process's) with the clock started just before the launch
    (interpreter start and imports count), $BENCH_CLOCK naming `clock`: the finished process, and {the seconds from
    launch to exit, the CPU seconds of the process and its children}."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.time()
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if clock is not None:
        clock.parent.mkdir(parents=True, exist_ok=True)
        env |= {"BENCH_CLOCK": str(clock), "BENCH_T0": repr(start)}
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=3600)
    seconds = time.time() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:4])} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return proc, {"seconds": seconds, "cpu_seconds": cpu}


def clock_records(clock: Path) -> list[dict]:
    """The records EpochClock (or the plain loop) appended to `clock`, one per validation."""
    return [json.loads(line) for line in clock.read_text().splitlines()]


def run_plain(data: Path, run_dir: Path, quick: bool, seed: int) -> tuple[list[dict], dict]:
    """benchmarks/plain_loop.py in a process of its own, timed from its launch like `imgcls fit`."""
    recipe = dict(QUICK if quick else RECIPE, seed=seed)
    clock = run_dir / "clock.jsonl"
    _, process = timed([sys.executable, "-m", "benchmarks.plain_loop"], clock=clock,
                       env=dict(os.environ, BENCH_DATA=str(data), BENCH_RECIPE=json.dumps(recipe),
                                BENCH_MAX_BATCHES="2" if quick else ""))
    return clock_records(clock), process


def _seconds_per_epoch(records: list[dict]) -> float:
    """Median wall time between consecutive validations (start-up and the first epoch excluded)."""
    laps = [b["seconds"] - a["seconds"] for a, b in zip(records, records[1:], strict=False)]
    return statistics.median(laps) if laps else float("nan")


def first_reaching(records: list[dict], target: float) -> dict | None:
    return next((r for r in records if r["val_acc"] >= target), None)


def _cell(runs: list[list[dict]], target: float) -> tuple[str, float | None]:
    """"median s (epochs e1, e2, ...)" over the runs that reached `target`, and that median."""
    hits = [first_reaching(records, target) for records in runs]
    if not all(hits):
        return f"not reached in {sum(h is None for h in hits)} of {len(hits)} runs", None
    median = statistics.median(h["seconds"] for h in hits)
    return f"{median:.0f} s (epochs {', '.join(str(h['epoch']) for h in hits)})", median


def main(quick: bool = False) -> dict:
    recipe = QUICK if quick else RECIPE
    # Which epoch first crosses 97% depends on the seed (initial weights, data order, dropout): both sides draw the
    # same for a seed (benchmarks/plain_loop.py), and the medians over SEEDS seeds are compared. imgcls's defaults
    # turned back on, one at a time, run on the first seed and are compared with imgcls's run of that seed.
    seeds = (recipe["seed"],) if quick else tuple(recipe["seed"] + k for k in range(SEEDS))
    data = build_demo_data(Path(tempfile.gettempdir()) / f"imgcls-bench-digits-{recipe['image_size']}",
                           size=recipe["image_size"])
    runs: dict[str, list[list[dict]]] = {PLAIN: [], IMGCLS: [], ONE_WORKER: [], EVERY_FIGURE: [], LEAN: []}
    processes: dict[str, list[dict]] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory() as tmp:
        # Untimed: the first process after a while reads torch's libraries from disk, and the first fit writes the
        # data's scan cache; neither should fall on whichever side happens to run first (quick: nothing is compared).
        if not quick:
            run_plain(data, Path(tmp) / "warm-plain", True, seeds[0])
            run_imgcls(data, Path(tmp) / "warm-imgcls", True, seeds[0])
        for i, seed in enumerate(seeds):  # interleaved, so that a slow spell of the machine hits every side
            names = [PLAIN, IMGCLS] if i % 2 == 0 else [IMGCLS, PLAIN]  # neither side always goes first
            for k, name in enumerate(names + ([ONE_WORKER, EVERY_FIGURE, LEAN] if i == 0 else [])):
                run_dir = Path(tmp) / f"{k}-{seed}"
                records, process = (run_plain(data, run_dir, quick, seed) if name == PLAIN else
                                    run_imgcls(data, run_dir, quick, seed, name))
                runs[name].append(records)
                processes[name].append(process)
    return {"recipe": recipe, "precision": auto_cpu_precision(), "seeds": list(seeds), "quick": quick, "runs": runs,
            "processes": processes}


def _process_seconds(results: dict, name: str) -> list[float]:
    """Each run's seconds from launch to exit; records made before those were kept hold the last validation's."""
    processes = results.get("processes", {}).get(name)
    return [p["seconds"] for p in processes] if processes else [r[-1]["seconds"] for r in results["runs"][name]]


def _cpu_seconds(results: dict, name: str) -> float | None:
    """The median CPU seconds of a run kind's processes (with their children); None for records without them."""
    cpu = [p["cpu_seconds"] for p in results.get("processes", {}).get(name, []) if "cpu_seconds" in p]
    return statistics.median(cpu) if cpu else None


def _versus(results: dict, name: str, base: str, cpu: bool = False) -> float:
    """`name`'s median whole-process (or CPU) seconds over `base`'s on the same seeds: the first ones, as many as
    `name` ran."""
    def seconds(kind: str) -> list[float]:
        if cpu:
            return [p["cpu_seconds"] for p in results["processes"][kind]]
        return _process_seconds(results, kind)

    n = len(results["runs"][name])
    return statistics.median(seconds(name)) / statistics.median(seconds(base)[:n])


def _medians(results: dict) -> dict[str, list[float | None]]:
    """Per run kind: median seconds to each target (None unless every run reached it), then median total seconds."""
    return {name: [_cell(group, target)[1] for target in TARGETS] + [statistics.median(_process_seconds(results, name))]
            for name, group in results["runs"].items() if group}


def _pair_ratios(results: dict) -> dict[str, list[float] | None]:
    """imgcls's seconds over the plain loop's within each seed's pair (the two ran back to back, so a slow spell of
    the machine falls on both): to 97% val/acc (None unless every run reached it), whole process, and its CPU time
    (None for records without it)."""
    imgcls, plain = results["runs"][IMGCLS], results["runs"][PLAIN]
    hits = [(first_reaching(a, TARGETS[0]), first_reaching(b, TARGETS[0])) for a, b in zip(imgcls, plain, strict=True)]
    processes = results.get("processes", {})
    cpu = [(a.get("cpu_seconds"), b.get("cpu_seconds"))
           for a, b in zip(processes.get(IMGCLS, []), processes.get(PLAIN, []), strict=True)]
    return {"to_97": [a["seconds"] / b["seconds"] for a, b in hits] if all(a and b for a, b in hits) else None,
            "whole": [a / b for a, b in zip(_process_seconds(results, IMGCLS), _process_seconds(results, PLAIN),
                                            strict=True)],
            "cpu": [a / b for a, b in cpu] if cpu and all(a and b for a, b in cpu) else None}


def _spread(ratios: list[float]) -> str:
    """"median (min-max)" of within-pair ratios."""
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def _closing(results: dict) -> tuple[int, list[float]]:
    """imgcls's default runs: how many, and the seconds of each closing validation of the best checkpoint that ran."""
    processes = results.get("processes", {}).get(IMGCLS, [])
    return len(processes), [p["closing_validation"] for p in processes if p.get("closing_validation") is not None]


def render(results: dict) -> tuple[str, str]:
    runs, seeds, recipe = results["runs"], results["seeds"], results["recipe"]
    medians = _medians(results)
    whole = "processes" in results  # launch to exit; older records end at the last validation
    cpu = {name: _cpu_seconds(results, name) for name in medians}
    timed_cpu = cpu[IMGCLS] is not None
    rows = []
    for name, group in runs.items():
        if not group:
            continue
        best = statistics.median(max(r["val_acc"] for r in records) for records in group)
        rows.append([f"{name} ({len(group)} seed{'s' if len(group) > 1 else ''})",
                     *(_cell(group, target)[0] for target in TARGETS), f"{best:.3f}", f"{medians[name][-1]:.1f} s",
                     *([f"{cpu[name]:.1f} s"] if timed_cpu else [])])
    pairs = _pair_ratios(results)
    rows.append([f"imgcls / plain within each seed's pair, median (min-max) (targets: 97% <= {RATIO_TARGET}, "
                 f"whole <= {PROCESS_TARGET})", _spread(pairs["to_97"]) if pairs["to_97"] else "-", "-", "",
                 _spread(pairs["whole"]), *([_spread(pairs["cpu"])] if timed_cpu else [])])
    body = table(["run", "time to 97% val/acc (median)", "time to 99% val/acc (median)", "best val/acc (median)",
                  "whole process, launch to exit (median)" if whole else "to the last validation (median)",
                  *(["CPU time of the process and its children (median)"] if timed_cpu else [])], rows)
    if whole:
        cuts = [[name, f"{medians[name][-1]:.1f} s", f"{_versus(results, name, IMGCLS):.2f}x",
                 *([f"{_versus(results, name, IMGCLS, cpu=True):.2f}x"] if timed_cpu else [])]
                for name in (ONE_WORKER, EVERY_FIGURE, LEAN) if name in medians]
        body += ("\n\nimgcls's defaults, one turned back on at a time (whole process, median over the same seeds), "
                 "against imgcls fit as shipped on those seeds:\n\n"
                 + table(["run", "whole process", "over imgcls fit", *(["CPU time over imgcls fit's"] if timed_cpu
                                                                      else [])], cuts))
        count, closing = _closing(results)
        body += (f"\n\nThe closing validation of the best checkpoint ran in {len(closing)} of {count} default runs"
                 + (f" ({statistics.median(closing):.1f} s median where it ran)" if closing else "")
                 + "; in the others the metrics of the fit's validation of the best weights were shown.")
    per_epoch = {name: statistics.median(_seconds_per_epoch(r) for r in group) for name, group in runs.items() if group}
    body += (f"\n\nSeconds per epoch after the first (training and validation, median): plain "
             f"{per_epoch[PLAIN]:.1f}, imgcls {per_epoch[IMGCLS]:.1f} ({per_epoch[IMGCLS] / per_epoch[PLAIN]:.2f}x), "
             f"imgcls without checkpoints and figures {per_epoch[LEAN]:.1f} "
             f"({per_epoch[LEAN] / per_epoch[PLAIN]:.2f}x). First validation after launch (start-up and one epoch, "
             f"median): plain {statistics.median(r[0]['seconds'] for r in runs[PLAIN]):.0f} s, imgcls "
             f"{statistics.median(r[0]['seconds'] for r in runs[IMGCLS]):.0f} s.")
    short = {PLAIN: "plain", IMGCLS: "imgcls", LEAN: "imgcls without checkpoints and figures",
             ONE_WORKER: "imgcls, 1 loader process", EVERY_FIGURE: "imgcls, every figure"}
    body += "\n\nPer epoch (val/acc@seconds): " + "; ".join(
        f"{short[name]}, seed {seed}: " + ", ".join(f"{r['val_acc']:.3f}@{r['seconds']:.0f}" for r in records)
        for name, group in runs.items() for seed, records in zip(seeds, group, strict=False)) + "."
    to_97, whole_ratio = (statistics.median(r) if r else None for r in (pairs["to_97"], pairs["whole"]))
    body += (f"\n\nTarget, imgcls within {RATIO_TARGET}x of the plain loop's time to 97% (the median of the seeds' "
             "pairs): " + (f"{to_97:.2f}x ({verdict(to_97 <= RATIO_TARGET)})." if to_97 else "not measured: a run "
                           "did not reach 97%."))
    if whole:
        body += (f" Target, the whole imgcls fit process within {PROCESS_TARGET}x of the plain loop's: "
                 f"{whole_ratio:.2f}x ({verdict(whole_ratio <= PROCESS_TARGET)}).")
    return body, (f"configs/quickstart.yaml ({recipe['arch']} from scratch, {recipe['image_size']} px, AdamW, "
                  f"{results['precision']} (auto), channels_last, {recipe['epochs']} epochs) on the demo digits, "
                  f"seeds {', '.join(map(str, seeds))} for both sides; each run is a process of its own, timed from "
                  "its launch (interpreter start, imports and reading the data included); runs one after the other"
                  + (" (quick: 2 batches of one epoch)" if results["quick"] else ""))


def figures(results: dict) -> dict[str, str]:
    """imgcls fit against the plain loop: seconds to 97% and their ratio, whole runs, best val/acc (medians), and
    what each default turned back on costs."""
    medians, pairs = _medians(results), _pair_ratios(results)
    imgcls, plain = medians[IMGCLS], medians[PLAIN]
    best = statistics.median(max(r["val_acc"] for r in records) for records in results["runs"][IMGCLS])
    found = {"imgcls_total": f"{imgcls[-1]:.0f} s", "plain_total": f"{plain[-1]:.0f} s",
             "imgcls_best_acc": f"{100 * best:.1f}%", "seeds": ", ".join(map(str, results["seeds"])),
             "target": f"{RATIO_TARGET}x", "total_ratio": f"{statistics.median(pairs['whole']):.2f}x"}
    if pairs["to_97"]:
        found |= {"imgcls_to_97": f"{imgcls[0]:.0f} s", "plain_to_97": f"{plain[0]:.0f} s",
                  "ratio_to_97": f"{statistics.median(pairs['to_97']):.2f}x"}
    if pairs["cpu"]:
        found["cpu_ratio"] = f"{statistics.median(pairs['cpu']):.2f}x"
    if "processes" in results:
        found |= {"process_target": f"{PROCESS_TARGET}x",
                  "one_worker_vs_none": f"{_versus(results, ONE_WORKER, IMGCLS):.2f}x",
                  "every_figure_vs_budget": f"{_versus(results, EVERY_FIGURE, IMGCLS):.2f}x",
                  "lean_vs_plain": f"{_versus(results, LEAN, PLAIN):.2f}x"}
    return found

