"""Smoke test of the benchmark suite in quick mode: every benchmark runs, stores its record and renders its table
(no timings checked), and the committed results stay untouched."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import sys

import pytest

from benchmarks import gpu_check, gpu_end_to_end, pages, run, worker_memory
from benchmarks import records as on_disk
from benchmarks import serve as serve_bench
from benchmarks import startup as startup_bench
from benchmarks.common import interleaved, quartiles, table
from tests import postgres
from tests.helpers import cli_env, concurrent_python
from tests.postgres import server_bin


def _tables(markdown: str) -> dict[str, list[list[str]]]:
    """Section title -> rows (header first) of the first Markdown table under it."""
    found = {}
    for block in markdown.split("\n## ")[1:]:
        title, _, rest = block.partition("\n")
        rows = [[c.strip() for c in line.strip("|").split("|")] for line in rest.splitlines()
                if line.startswith("|") and not line.startswith("|---")]
        found[title.strip()] = rows
    return found


def _num(cell: str) -> float:
    return float(cell.replace(",", ""))  # table() writes 1,234


def _committed() -> dict:
    return {p: p.read_bytes() for p in [*on_disk.RESULTS.rglob("*.json"), pages.PERFORMANCE]}


@pytest.mark.slow  # every benchmark but the GPU check's (the next test), shrunk: ~1.5 min on 2 cores
def test_quick_run_writes_every_section_with_its_table(tmp_path, monkeypatch):
    # The sections' `python -m imgcls` processes (fits, servers, sweep workers and their trials) are forked by
    # the preloaded server (tests/preloaded.py): its launcher is their interpreter; anything else runs the real one.
    monkeypatch.setattr(sys, "executable", concurrent_python())
    with contextlib.suppress(pytest.skip.Exception):  # under CI=true a server that cannot be had fails the test
        postgres.ensure_installed()  # before the sweep-retry section, whichever test file installed it first
    committed = _committed()
    sections = tuple(name for name in pages.SECTIONS if name not in gpu_check.SECTIONS)
    # raises if a section failed, or, under CI=true, was skipped for want of what CI has
    out = run.main(quick=True, out=tmp_path / "PERFORMANCE.md", only=sections)
    assert _committed() == committed, "a quick run rewrote the committed results"
    records = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "results" / "machines").glob("*/*.json")}
    assert set(records) == set(sections)
    assert all(r["mode"] == "quick" and r["seconds"] >= 0 and r["machine"]["cpu"] for r in records.values())
    skipped = {name: r["results"]["needs"] for name, r in records.items() if "skipped" in r["results"]}
    assert set(skipped.values()) <= ({"peer"} if os.environ.get("CI") == "true" else {"peer", "postgresql"}), skipped
    origins = [r["provenance"] for r in records.values()]
    assert all(re.fullmatch(r"[0-9a-f]{40}", o["commit"]) and isinstance(o["clean"], bool) for o in origins)
    assert all(o["command"] and {"torch", "lightning"} <= set(o["versions"]) for o in origins)  # xdist: its worker
    assert records["recipe"]["provenance"]["log_tail"], "the section's own output, kept in its record"
    text = out.read_text()
    assert re.search(r"Rendered from .* quick mode .* Measured on .* cores", text)
    tables = _tables(text)

    startup = tables["Process start-up"]
    assert [r[0] for r in startup[1:]] == [startup_bench.BASELINE, startup_bench.STARTED]
    assert _num(startup[1][2]) == 1.0 and all(_num(r[1]) > 0 for r in startup[1:])

    pipeline = tables["Input pipeline"]
    assert pipeline[0][:3] == ["loader", "img/s, 1 core", "vs baseline (target >= 2x)"]
    names = [r[0] for r in pipeline[1:]]
    assert names[0].endswith("(baseline)") and len(names) == 8
    assert any("augment_on_device" in n for n in names) and any("fast_decode" in n for n in names)
    assert re.search(r"Target, at least 2x the baseline per core: [\d.]+x with the defaults", text)
    assert _num(pipeline[1][2]) == 1.0 and all(_num(r[1]) > 0 for r in pipeline[1:])
    assert "loader worker" in text

    scan = tables["Start scan"]
    assert [r[0] for r in scan[1:4]] == ["no cache (before it; data.scan_cache false)",
                                         "cold: first start (decodes all, writes the cache)",
                                         "warm: cache present, nothing changed"]
    assert _num(scan[3][1]) < _num(scan[2][1])
    assert re.search(r"Target, a warm scan at least 20x faster than a cold one: \d+x", text)
    memory = tables["Loader-worker memory"]
    assert [r[0] for r in memory[1:5]] == [worker_memory.ARRAYS, worker_memory.ARRAYS + worker_memory.FROZEN,
                                          worker_memory.LIST, worker_memory.LIST + worker_memory.FROZEN]

    overhead = tables["Training-loop overhead"]
    assert overhead[0][3].startswith("Lightning / plain step time") and len(overhead) == 2
    assert _num(overhead[1][3]) > 0 and overhead[1][4].startswith("IQR")

    levers = tables["Compute levers"]
    assert [r[0] for r in levers[1:]] == ["baseline: fp32, NCHW, eager, for-loop SGD", "channels_last",
                                          "bf16 autocast", "foreach SGD", "fused SGD"]
    assert levers[0][1:] == ["16 px img/s (batch 2)", "16 px speed-up", "32 px img/s (batch 2)", "32 px speed-up"]
    assert _num(levers[1][2]) == 1.0

    tta = tables["Time to accuracy"]  # imgcls against the plain loop, then the defaults turned back on one by one
    variants = ["imgcls fit with 1 loader process", "imgcls fit drawing figures at every validation",
                "imgcls fit without checkpoints, figures, progress bar"]
    assert [r[0] for r in tta[1:]] == ["plain PyTorch loop, tensors in memory (1 seed)",
                                       "imgcls fit (PNG files, loader, Lightning) (1 seed)",
                                       *(f"{v} (1 seed)" for v in variants),
                                       "imgcls / plain within each seed's pair, median (min-max) (targets: 97% <= "
                                       "1.2, whole <= 1.1)",
                                       "run", *variants]
    assert tta[0][1:3] == ["time to 97% val/acc (median)", "time to 99% val/acc (median)"]
    assert tta[0][4] == "whole process, launch to exit (median)" and all(_num(r[4][:-2]) > 0 for r in tta[1:6])
    assert all(_num(r[2][:-1]) > 0 for r in tta[8:])  # each variant's whole process over imgcls fit's
    assert "Target, imgcls within 1.2x of the plain loop's time to 97%" in text
    assert re.search(r"Target, the whole imgcls fit process within 1.1x of the plain loop's: [\d.]+x", text)
    assert re.search(r"The closing validation of the best checkpoint ran in [01] of 1 default runs", text)

    recipe = tables["Recipe ablation"]
    assert recipe[0] == ["variant", "val/acc (median)", "vs baseline, points", "per seed", "best val/acc (median)",
                         "train accuracy, last epoch (median)", "s / epoch (median)"]
    assert [r[0] for r in recipe[1:]] == ["all of the above"] and 0 <= float(recipe[1][1].rstrip(" %")) <= 100
    ema = records["recipe"]["results"]["runs"]["all of the above"][0]["ema"]
    assert ema["start_step"] == 1 and ema["total_steps"] == 2  # after the warm-up's one step, of the 2 run
    assert "the network's last feature map is 1x1 at 32 px and 2x2 at 40 px" in text  # why FixRes has no row

    distributed = tables["Distributed: gradient compression (CPU, gloo)"]
    assert [r[0] for r in distributed[1:5]] == ["none", "fp16", "bf16", "powersgd"]
    ratios = {r[0]: _num(r[4]) for r in distributed[1:5]}  # bytes all-reduced vs none, counted on ResNet50
    assert ratios["fp16"] == ratios["bf16"] == 0.5 and ratios["powersgd"] <= 0.05

    serving = tables["Serving"]
    assert serving[0] == ["server", "requests/s", "vs plain", "p50 ms", "p99 ms", "launch to first answer, s"]
    assert [r[0] for r in serving[1:]] == ["imgcls serve, max_batch_size 16", "imgcls serve, max_batch_size 1",
                                           serve_bench.BASELINE]
    assert all(_num(r[1]) > 0 and _num(r[5]) > 0 for r in serving[1:])

    crowd = records["serve_crowd"]["results"]  # the quick crowd: a few clients for seconds, every kind sent
    assert crowd["errors"] == [] and crowd["pids_after"] == crowd["pids_before"] and crowd["valid"] > 0
    assert tables["Serving under a crowd"][0] == ["request", "sent"]

    reading = tables["Reading cost"]  # this tree against the one before the layout work, by the same code
    assert reading[0][0] == "what a reader opens" and reading[0][1].startswith("before (`")
    assert [r[0] for r in reading[1:4]] == ["one training step: files run (lines)",
                                            "a whole fit, config to last checkpoint: files run (lines)",
                                            "modules the model and the default data source import (lines)"]
    cost = records["reading_cost"]["results"]
    assert "lightning_modules/classifier.py" in cost["now"]["step"]["files"] and cost["now"]["step"]["lines"] > 0
    assert set(cost["now"]["step"]["files"]) <= set(cost["now"]["fit"]["files"])

    retry = text.split("## Sweep retry after a worker's death", 1)[1]
    # Without a PostgreSQL server it is skipped, saying why (tests/test_sweep_postgres.py installs one).
    assert ("Not measured: PostgreSQL's server is not installed" in retry) == (server_bin() is None)
    if server_bin() is not None:  # quick: --heartbeat 1 --grace 5: failed 4 to 5 s after the kill, and a look (1 s)
        assert tables["Sweep retry after a worker's death"][0][:4] == ["death", "kind", "kill -> trial failed, s",
                                                                       "kill -> retry started, s"]
        failed, started = (_num(c) for c in tables["Sweep retry after a worker's death"][1][2:4])
        assert 1.5 <= failed <= started < 10


def test_the_loop_benchmark_quiets_lightning_only_while_it_measures(monkeypatch):
    """benchmarks.run (and the quick run above) call it in a process that goes on: left at ERROR, Lightning's logger
    dropped every later announcement there, and the caplog checks of the tests after it on that worker failed."""
    from benchmarks import loop_overhead

    lightning_log = logging.getLogger("lightning.pytorch")
    levels = []
    monkeypatch.setattr(loop_overhead, "measure", lambda *setting: levels.append(lightning_log.level) or {})
    before = lightning_log.level
    loop_overhead.main(quick=True)
    assert levels == [logging.ERROR]
    assert lightning_log.level == before


@pytest.mark.slow  # the cuda tests collected, the synthetic step and two tiny imgcls fits: ~30 s on 2 cores
def test_make_gpu_check_dry_run_runs_every_gpu_section_on_the_cpu(tmp_path):
    """`make gpu-check --dry-run` (make's -n, which the recipe's + runs anyway) is the GPU check a lent machine runs,
    at tiny sizes on this CPU: it is known to start before a GPU's few minutes are spent on it."""
    committed = _committed()
    # The check and its imgcls fits forked by the preloaded server (its launcher as their interpreter), as a DDP
    # rank is; its pytest, a fresh interpreter.
    proc = subprocess.run(["make", "--dry-run", "gpu-check", f"GPU_PYTHON={concurrent_python()}"], cwd=pages.ROOT,
                          env=cli_env(GPU_CHECK_OUT=str(tmp_path)), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _committed() == committed, "a dry run rewrote the committed results"
    records = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in gpu_check.SECTIONS}
    assert all(r["mode"] == "quick" and "skipped" not in r["results"] for r in records.values())
    tests = records["cuda_tests"]["results"]["tests"]
    ids = {t["test"] for t in tests}  # named as a full run's JUnit report names them
    assert {"test_cuda::test_a_16_mixed_fit_killed_after_an_fp16_overflow_resumes_its_scaler_and_ends_bitwise_equal",
            "test_cuda::test_compression_hooks_are_registered_on_nccl_and_train[powersgd]"} <= ids
    assert all(t["outcome"] == "collected" for t in tests)
    text = (tmp_path / "PERFORMANCE.md").read_text()
    tables = _tables(text)
    assert [r[0] for r in tables["GPU throughput"][1:]] == ["fp32, NCHW, eager", "channels_last + 16-mixed + fused SGD"]
    end_to_end = tables["GPU end to end"]  # both data paths through imgcls fit
    assert [r[0] for r in end_to_end[1:]] == [label for name, label in gpu_end_to_end.PATHS.items()
                                              if name not in gpu_end_to_end.FULL_ONLY]
    assert end_to_end[0][3] == "ms a step"  # the steps timed without a synchronisation each
    # the default path's last steps under torch's profiler: the host's operators here, a GPU's kernels there
    assert re.search(r"CPU decode in the loader workers, the host's time in 3 steps after the timed ones \(torch's "
                     r"profiler\), a step: [\d.]+ ms in all; the longest operators: `aten::", text)
    assert all(_num(r[1]) > 0 and _num(r[3]) > 0 for r in end_to_end[1:])


# The project's dependencies (and extras) that a lent GPU machine's image lacks and the GPU check does not carry.
NOT_ON_THE_GPU_MACHINE = ("litdata", "optuna", "wandb", "litserve", "datasets")


def test_the_gpu_check_renders_its_page_without_the_packages_a_gpu_machine_lacks():
    """The GPU check renders docs/PERFORMANCE.md after each section, importing every section's module for its title:
    none may need, at import, a package that the GPU machine lacks (it once failed there for want of LitData)."""
    probe = f"""
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {NOT_ON_THE_GPU_MACHINE!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Absent())
from benchmarks import pages
page = pages.rendered(docs=False)[pages.PERFORMANCE]
print(sum(f"## {{pages._module(name).TITLE}}" in page for name in pages.SECTIONS), len(pages.SECTIONS))
"""
    proc = subprocess.run([sys.executable, "-c", probe], cwd=pages.ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(pages.ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    found, sections = map(int, proc.stdout.split())
    assert found == sections


def test_interleaved_takes_medians_round_robin():
    calls = []
    result = interleaved({"a": lambda: calls.append("a") or [1.0, 9.0, 2.0], "b": lambda: calls.append("b") or [4.0]},
                         reps=2)
    assert calls == ["a", "b", "a", "b"]
    assert result == {"a": 2.0, "b": 4.0}
    assert table(["x", "y"], [["r", 1234.5]]) == "| x | y |\n|---|---|\n| r | 1,234 |"
    assert quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == {"median": 3.0, "q1": 2.0, "q3": 4.0, "min": 1.0, "max": 5.0, "n": 5}


def test_sections_from_different_machines_are_named_in_the_head():
    def record(cpu: str, seconds: float) -> dict:
        return {"mode": "full", "started": "2026-11-23 10:00 UTC", "seconds": seconds,
                "machine": {"cpu": cpu, "torch": "2.14.1"}}

    one, other = "AMD EPYC (avx2, no avx512_bf16/amx), 2 cores", "Xeon (avx2, avx512f, avx512_bf16), 16 cores"
    same = pages.header({"input_pipeline": [record(one, 60)], "compute_levers": [record(one, 90)]})
    assert f"Measured on {one}; torch 2.14.1." in same and "2 min 30 s in all" in same
    mixed = pages.header({"input_pipeline": [record(one, 60)], "compute_levers": [record(other, 90)]})
    assert "**Measured on more than one machine**" in mixed
    assert f"{one}; torch 2.14.1: Input pipeline;" in mixed and f"{other}; torch 2.14.1: Compute levers)" in mixed


def test_the_timm_section_runs_only_a_peer_script_kept_outside_the_project(monkeypatch, tmp_path):
    """No script: "not measured", in the record and on the page; one inside the project: refused; train.py's flags
    carry the quickstart's recipe (its per-256 lr scaled to the batch, as imgcls does)."""
    from benchmarks import timm_peer

    monkeypatch.delenv(timm_peer.PEER_ENV, raising=False)
    results = timm_peer.main(quick=True)
    assert results == {"skipped": f"no peer script (set {timm_peer.PEER_ENV} to a copy of timm's train.py)",
                       "needs": "peer"}  # what CI can never have: a program from outside the project
    origin = {"commit": "c" * 40, "clean": True, "on_main": True, "command": "python -m benchmarks.timm_peer"}
    record = {"section": "timm_peer", "mode": "quick", "started": "2026-11-26 10:00 UTC", "seconds": 0.1,
              "machine": {"cpu": "x", "line": "x"}, "results": results, "provenance": origin}
    assert "Not measured: no peer script" in pages.section("timm_peer", record)
    monkeypatch.setenv(timm_peer.PEER_ENV, str(pages.ROOT / "benchmarks" / "timm_peer.py"))
    with pytest.raises(ValueError, match="inside the project"):
        timm_peer.main(quick=True)
    args = timm_peer.peer_args(timm_peer.RECIPE, tmp_path, tmp_path, 42, bf16=False)
    value = {flag: args[args.index(flag) + 1] for flag in ("--lr", "-b", "--epochs", "--model", "--smoothing")}
    recipe = timm_peer.RECIPE
    assert value == {"--lr": str(recipe["lr"] * recipe["batch"] / 256), "-b": str(recipe["batch"]),
                     "--epochs": str(recipe["epochs"]), "--model": recipe["arch"],
                     "--smoothing": str(recipe["label_smoothing"])}
    assert float(value["--lr"]) == 0.004 and "--amp" not in args and "--channels-last" in args


def test_a_timm_run_of_one_kind_keeps_the_other_kinds_stored_rows(monkeypatch, tmp_path):
    """--kinds avx2_estimate keeps this machine's native rows of the same recipe (not another recipe's), and a bf16
    CPU's page without AVX2-estimate rows says they are not measured yet."""
    from benchmarks import timm_peer
    from benchmarks.common import machine_info

    run_ = {"seconds": 50.0, "cpu_seconds": 90.0, "val_acc": [0.9, 0.98], "steps": 176}
    native = {timm_peer.TIMM: [run_, run_], timm_peer.IMGCLS: [run_, dict(run_, seconds=45.0)]}
    results = {"recipe": timm_peer.RECIPE, "quick": False, "peer": "train.py (1 bytes) with timm 1", "bf16_cpu": True,
               "runs": {timm_peer.NATIVE: native}, "peer_args": ["--epochs", "8"],
               "measured": {timm_peer.NATIVE: "2026-11-26 19:13 UTC"}}
    record = {"section": "timm_peer", "mode": "full", "started": "2026-11-26 19:00 UTC", "seconds": 1.0,
              "machine": machine_info(), "results": json.loads(json.dumps(results))}
    monkeypatch.setattr(on_disk, "RESULTS", tmp_path)
    on_disk.store(record, tmp_path)
    kept, when = timm_peer.kept_runs(timm_peer.RECIPE, {timm_peer.AVX2_ESTIMATE})
    assert kept == {timm_peer.NATIVE: json.loads(json.dumps(native))}
    assert when == {timm_peer.NATIVE: "2026-11-26 19:13 UTC"}
    assert timm_peer.kept_runs(timm_peer.RECIPE, {timm_peer.NATIVE}) == ({}, {})
    assert timm_peer.kept_runs(dict(timm_peer.RECIPE, epochs=2), {timm_peer.AVX2_ESTIMATE}) == ({}, {})
    page, _ = timm_peer.render(results)
    assert "median 0.95x (from 0.90x to 1.00x, 2 pairs)" in page
    assert "(measured 2026-11-26 19:13 UTC)" in page and "fp32: not measured yet" in page
    # The flags shown are the native kind's; the AVX2 estimate's, which drop bf16 autocast, are said to differ.
    amp = dict(results, peer_args=["--amp", "--amp-dtype", "bfloat16"])
    assert "without --amp" not in timm_peer.render(amp)[1]
    both = dict(amp, runs={timm_peer.NATIVE: native, timm_peer.AVX2_ESTIMATE: native})
    assert "the AVX2 estimate's without --amp --amp-dtype bfloat16" in timm_peer.render(both)[1]


def test_the_timm_table_gives_each_seeds_accuracy_and_the_median_with_its_spread(monkeypatch):
    """Accuracy over 3 or more seeds per kind, seed by seed and as median (min-max); the AVX2 estimate holds torch's
    kernels and oneDNN's alike (benchmarks.common.KERNEL_LIMITS)."""
    from benchmarks import timm_peer
    from benchmarks.common import KERNEL_LIMITS, NOT_MODELLED

    assert min(timm_peer.REPS.values()) >= 3
    monkeypatch.setattr(timm_peer, "auto_cpu_precision", lambda: "bf16-mixed")
    assert set(timm_peer.kinds()[timm_peer.AVX2_ESTIMATE]["env"]) == set(KERNEL_LIMITS)
    run_ = {"seconds": 50.0, "cpu_seconds": 90.0, "steps": 176}
    sides = {timm_peer.TIMM: [dict(run_, val_acc=[0.5, a]) for a in (0.97, 0.98, 0.975)],
             timm_peer.IMGCLS: [dict(run_, val_acc=[0.99, a]) for a in (0.96, 0.97, 0.98)]}
    results = {"recipe": timm_peer.RECIPE, "quick": False, "peer": "train.py (1 bytes) with timm 1", "bf16_cpu": False,
               "runs": {timm_peer.NATIVE: sides}, "peer_args": ["--epochs", "8"]}
    page, _ = timm_peer.render(results)
    assert "| timm train.py | 3 |" in page and "| 0.9750 (0.9700-0.9800) | 0.9700 / 0.9800 / 0.9750 |" in page
    assert "| 0.9900 (0.9900-0.9900) | 0.9900 / 0.9900 / 0.9900 |" in page  # each run's best, not its last
    assert "at least equal (medians): met" in page
    # An estimate says what it cannot model; rows of an estimate that held torch's kernels alone stay off the page.
    aten_only = "AVX2 estimate: ATEN_CPU_CAPABILITY=avx2, fp32"
    both = dict(results, runs={timm_peer.NATIVE: sides, timm_peer.AVX2_ESTIMATE: sides, aten_only: sides})
    page, _ = timm_peer.render(both)
    assert page.count("| timm train.py | 3 |") == 2 and aten_only not in page
    assert page.count(NOT_MODELLED) == 1
    assert page.index(timm_peer.AVX2_ESTIMATE) < page.index(NOT_MODELLED)


def test_hardware_benchmark_times_the_quickstarts_step():
    import yaml

    from benchmarks.hardware import ROOT, quickstart_recipe

    config = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())
    recipe = quickstart_recipe()
    optimizer = config["model"]["optimizer"]["class_path"]  # torch.optim.AdamW: benchmarks name it adamw
    assert (recipe["arch"], recipe["optimizer"], recipe["image_size"], recipe["batch_size"]) == (
        config["model"]["net"]["init_args"]["arch"], optimizer.rsplit(".", 1)[-1].lower(),
        config["data"]["train_transform"]["init_args"]["image_size"],
        config["data"]["batch_size"])


def _clock(steps: list[tuple[float, float, float, float]], window_s: float) -> dict:
    """What StepClock writes for steps of (host time before the step, host time in it, GPU time in it, device
    transforms' time), one after the other from 0 s."""
    now, written = 0.0, []
    for before, inside, device, augment in steps:
        written.append({"host_start_s": now + before, "host_end_s": now + before + inside, "device_s": device,
                        "augment_s": augment})
        now += before + inside
    return {"steps": written, "batch": 256, "window_s": window_s, "cuda": True}


def test_the_end_to_end_figures_come_from_the_timed_window():
    """benchmarks/gpu_end_to_end.py: img/s and the wall time a step over the window between the two synchronisations
    (after the warm-up, at the end), the GPU's busy fraction from its time inside the steps, and per step the device
    transforms' time and the host's time between steps."""
    clock = _clock([(0.0, 9.0, 9.0, 0.5),  # warm-up (compilation): left out
                    (0.3, 0.2, 0.9, 0.1), (0.5, 0.2, 0.9, 0.1)], window_s=2.8)
    r = gpu_end_to_end.summarise(clock, warmup=1)
    assert r["steps"] == 2 and r["img_s"] == pytest.approx(512 / 2.8) and r["step_ms"] == pytest.approx(1400)
    assert r["gpu_busy"] == pytest.approx(1.8 / 2.8)
    assert (r["augment_ms"], r["wait_ms"]) == pytest.approx((100, 400))
    assert (r["median_step_ms"], r["slowest_step_ms"]) == pytest.approx((700, 700))
    for warmup in (0, 3):  # the window starts after a warm-up step, and must hold a step
        with pytest.raises(ValueError, match="no timed steps"):
            gpu_end_to_end.summarise(clock, warmup=warmup)


def test_the_end_to_end_page_names_a_timed_step_far_slower_than_the_others():
    """A recompilation inside the timed steps (as the H200's first run had, at the end of a frozen epoch) makes the
    mean no steady state: the page says which path had it, with the slowest step against the median."""
    def record(slow_s: float) -> dict:
        clock = _clock([(0.0, 5.0, 5.0, 0.0)] + [(0.002, 0.038, 0.038, 0.001)] * 10 + [(0.002, slow_s, 0.04, 0.001)],
                       window_s=0.4 + slow_s)
        return {"device": "GPU", "dry_run": False, "images": 6000, "steps": 12, "warmup": 1, "workers": 16,
                "paths": {"cpu_decode": gpu_end_to_end.summarise(clock, warmup=1)}, "each_step_synchronised": False}

    steady, _ = gpu_end_to_end.render(record(0.05))
    stalled, _ = gpu_end_to_end.render(record(33.0))
    assert "took" not in steady
    assert "CPU decode in the loader workers: a timed step took 33,002 ms against a median of 40.0 ms" in stalled
    profiled = record(0.05)
    profiled["paths"]["cpu_decode"]["kernels"] = {"steps": 3, "ms": 52.0, "top": [
        {"name": "sm90_xmma_dgrad_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc_tilesize128x128x64_warpgroupsize1x1x1",
         "ms": 9.5, "calls": 12.0}]}
    assert ("CPU decode in the loader workers, the device's time in 3 steps after the timed ones (torch's profiler), "
            "a step: 52 ms in all; the longest kernels: `sm90_xmma_dgrad_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhw` "
            "9.5 ms (12 calls).") in gpu_end_to_end.render(profiled)[0]


def test_figures_measured_with_the_kernels_held_are_filed_as_an_estimate(monkeypatch, tmp_path):
    """Under `.ci/as-avx2` (torch's and oneDNN's kernels held to AVX2, the CPU's avx512/amx flags hidden) a record
    says it is an estimate, and is filed apart from a real machine's: it never replaces a real AVX2 CPU's figures."""
    from benchmarks.common import KERNEL_LIMITS, NOT_MODELLED, machine_info

    for name in KERNEL_LIMITS:
        monkeypatch.delenv(name, raising=False)
    real = machine_info()
    for name, value in KERNEL_LIMITS.items():
        monkeypatch.setenv(name, value)
    held = machine_info()
    assert held["cpu_kind"] == f"{real['cpu_kind']} estimate"
    assert held["cpu"] == (f"{real['cpu']} (an estimate: ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2; "
                           f"{NOT_MODELLED})") and held["cpu"] in held["line"]
    assert "clock, caches or interpreter speed" in NOT_MODELLED
    script = (pages.ROOT / ".ci" / "as-avx2").read_text()  # the suite's estimate holds the same kernels
    assert all(f"{name}={value}" in script for name, value in KERNEL_LIMITS.items())

    def record(machine: dict) -> dict:
        return {"section": "startup", "mode": "full", "started": "2026-11-27 14:00 UTC", "seconds": 1.0,
                "machine": machine, "results": {"rows": {}}}

    stored = [on_disk.store(record(machine), tmp_path) for machine in (real, held)]
    assert stored[0] != stored[1] and all(path.is_file() for path in stored)
    assert on_disk.kind_slug(held) == f"{on_disk.kind_slug(real)}-estimate"  # the docs' figure keys name it too
    # Measured natively on the kind it stands in for, the section drops the estimate from the page.
    estimate = {**held, "cpu_kind": "AVX2 CPU estimate", "cpu_model": "estimating host"}
    native = {**real, "cpu_kind": "AVX2 CPU", "cpu_model": "an AVX2 host"}
    on_disk.store(record(estimate), tmp_path)
    assert "AVX2 CPU estimate" in [r["machine"]["cpu_kind"] for r in pages.load_all(tmp_path)["startup"]]
    on_disk.store(record(native), tmp_path)
    kinds = [r["machine"]["cpu_kind"] for r in pages.load_all(tmp_path)["startup"]]
    assert "AVX2 CPU" in kinds and "AVX2 CPU estimate" not in kinds


def test_a_stalled_sweep_retry_shows_what_its_workers_and_trials_said_last(tmp_path):
    from benchmarks.sweep_retry import last_lines

    (tmp_path / "worker_a.log").write_text("".join(f"a {i}\n" for i in range(40)))
    (tmp_path / "worker_b.log").write_text("sweep retry: every point is taken; waiting for 1 trial(s)\n")
    (tmp_path / "b" / "trial_0001").mkdir(parents=True)
    (tmp_path / "b" / "trial_0001" / "fit.log").write_text("imgcls fit ...\nerror: the last thing it said\n")
    said = last_lines(tmp_path).splitlines()
    assert said[:16] == ["--- worker_a.log:", *(f"a {i}" for i in range(25, 40))]
    assert said[16:] == ["--- worker_b.log:", "sweep retry: every point is taken; waiting for 1 trial(s)",
                         "--- b/trial_0001/fit.log:", "imgcls fit ...", "error: the last thing it said"]


def test_time_to_accuracy_judges_imgcls_within_each_seeds_pair():
    """A slow spell of the machine falls on both runs of a pair: the target is judged on the median of the pairs'
    ratios (here 1.2x, missed at a 1.1x target), not on the ratio of the two sides' medians (22 s / 20 s = 1.1x)."""
    from benchmarks import time_to_accuracy as tta

    def runs(seconds_to_97: list[float]) -> list[list[dict]]:
        return [[{"epoch": 1, "step": 10, "val_acc": 0.5, "seconds": s / 2},
                 {"epoch": 2, "step": 20, "val_acc": 0.975, "seconds": s}] for s in seconds_to_97]

    plain, imgcls = [10.0, 20.0, 30.0], [12.0, 22.0, 40.0]
    results = {"recipe": tta.RECIPE, "precision": "32-true", "seeds": [1, 2, 3], "quick": False,
               "runs": {tta.PLAIN: runs(plain), tta.IMGCLS: runs(imgcls)},
               "processes": {tta.PLAIN: [{"seconds": s + 5, "cpu_seconds": s} for s in plain],
                             tta.IMGCLS: [{"seconds": s + 5, "cpu_seconds": s} for s in imgcls]}}
    for variant in (tta.ONE_WORKER, tta.EVERY_FIGURE, tta.LEAN):  # imgcls's defaults turned back on: first seed only
        results["runs"][variant], results["processes"][variant] = runs([12.0]), [{"seconds": 17.0, "cpu_seconds": 12.0}]
    assert tta._pair_ratios(results)["to_97"] == [1.2, 1.1, 40 / 30]
    body, _ = tta.render(results)
    assert "| 1.20 (1.10-1.33) |" in body and "time to 97% (the median of the seeds' pairs): 1.20x (met)" in body
    row = next(line for line in body.splitlines() if line.startswith("| imgcls / plain within each seed's pair"))
    assert row.endswith("| 1.20 (1.10-1.33) | - |  | 1.13 (1.08-1.29) | 1.20 (1.10-1.33) |"), row  # CPU time too
    assert tta.figures(results)["ratio_to_97"] == "1.20x" and tta.figures(results)["cpu_ratio"] == "1.20x"
