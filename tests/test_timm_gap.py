"""The accuracy comparison with timm's train.py, one difference at a time (benchmarks.timm_gap): each of timm's
settings it moves imgcls to is timm's, and its table and figures come from the runs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from benchmarks import pages, timm_gap


def test_the_schedule_is_timms_as_train_py_builds_it():
    """Step by step the lr of train.py's cosine (its defaults: --warmup-lr 1e-5, --min-lr 0, no warm-up prefix, no
    cool-down; --sched-on-updates), over the quickstart's length."""
    scheduler = pytest.importorskip("timm.scheduler")
    per_epoch, epochs, peak = 44, 8, 0.004
    theirs = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=peak)
    timm_plan, _ = scheduler.create_scheduler_v2(theirs, sched="cosine", num_epochs=epochs, warmup_epochs=1,
                                                 warmup_lr=1e-5, min_lr=0.0, step_on_epochs=False,
                                                 updates_per_epoch=per_epoch)
    ours = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=peak)
    plan = timm_gap.TimmCosine(ours, warmup_epochs=1, total_steps=per_epoch * epochs, steps_per_epoch=per_epoch)
    for step in range(per_epoch * epochs):
        timm_plan.step_update(step)
        assert ours.param_groups[0]["lr"] == pytest.approx(theirs.param_groups[0]["lr"], rel=1e-9, abs=1e-12), step
        ours.step()
        plan.step()
    assert ours.param_groups[0]["lr"] == 0.0


def test_the_head_and_the_resize_are_timms():
    """timm's ResNet head: dropout then one Linear from the pooled features; the resize: PIL's bicubic filter, on
    a tensor image as on a PIL one, /255 only (mean 0, std 1)."""
    net = timm_gap.TimmHead(10, arch="resnet18", dropout=0.3)
    assert [type(m) for m in net.head] == [nn.Dropout, nn.Linear] and net.head[0].p == 0.3
    assert (net.head[1].in_features, net.head[1].out_features) == (512, 10)
    assert not net.backbone.layer1[0].bn2.weight.any()  # the shipped start, timm's
    with pytest.raises(ValueError, match="head_hidden must be 0"):
        timm_gap.TimmHead(10, arch="resnet18", head_hidden=1024)
    image = Image.fromarray(torch.randint(0, 256, (28, 28, 3), dtype=torch.uint8).numpy())
    resize = timm_gap.PILResize(32)
    expected = torch.from_numpy(np.array(image.resize((32, 32), Image.BICUBIC))).permute(2, 0, 1)
    assert torch.equal(resize(image), expected)
    assert torch.equal(resize(torch.from_numpy(np.array(image)).permute(2, 0, 1)), expected)
    assert (resize.mean, resize.std) == ([0.0] * 3, [1.0] * 3)


def test_each_variant_changes_one_thing_and_the_table_comes_from_the_runs(monkeypatch, tmp_path):
    """No peer script: skipped for what CI can never have. The table: each run's best val/acc seed by seed, the
    median with its spread, and the median's distance to train.py's in points."""
    monkeypatch.delenv(timm_gap.PEER_ENV, raising=False)
    assert timm_gap.main(quick=True)["needs"] == "peer"
    singles = [flags for name, flags in timm_gap.VARIANTS.items() if name.startswith("...")]
    assert singles and all(flags[-2:] == timm_gap.NO_ZERO for flags in singles)
    assert timm_gap.VARIANTS[timm_gap.ALL_OF_TIMM] == timm_gap.HEAD + timm_gap.BICUBIC + timm_gap.SCHEDULE
    accs = {timm_gap.TIMM: 0.97, timm_gap.SHIPPED: 0.975, timm_gap.WITHOUT_START: 0.965,
            timm_gap.SINGLE + "head": 0.93, timm_gap.ALL_OF_TIMM: 0.96}
    runs = {name: [{"seed": s, "val_acc": [0.5, acc + 0.001 * s], "steps": 352} for s in (1, 2, 3)]
            for name, acc in accs.items()}
    results = {"recipe": timm_gap.RECIPE, "quick": False, "peer": "train.py (1 bytes) with timm 1", "bf16_cpu": True,
               "images": {"train": 2874, "val": 1800}, "flags": timm_gap.VARIANTS, "runs": runs,
               "peer_args": ["--epochs", "8"]}
    body, settings = timm_gap.render(results)
    assert "| timm train.py |  | 0.9710 / 0.9720 / 0.9730 | 0.9720 (0.9710-0.9730) |  |" in body
    assert "| 0.9760 / 0.9770 / 0.9780 | 0.9770 (0.9760-0.9780) | +0.50 |" in body
    assert "| 0.9620 (0.9610-0.9630) | -1.00 |" in body and "`--model.net.class_path" in body
    assert timm_gap._points(0.9805555 - 0.9805556) == "+0.00" and timm_gap._points(-0.0017) == "-0.17"
    assert "medians over 3 seeds" in body and "seeds 1, 2, 3" in settings
    assert ("Without timm's start imgcls fit is -0.50 points against timm's train.py; each of timm's settings on its "
            "own moves that by: its start +1.00, its head -3.50. imgcls fit as shipped (with timm's start): +0.50 "
            "points against timm's train.py; with all four of timm's settings at once: -1.00.") in body
    assert timm_gap.figures(results) == {"timm_acc": "97.20%", "shipped_acc": "97.70%",
                                         "shipped_minus_timm": "+0.50 points", "all_of_timm_acc": "96.20%"}
    # The log is shown under the timm section, with where it came from; without one, "not measured".
    assert f"Not measured: no {tmp_path / 'none.json'}" in timm_gap.note(tmp_path / "none.json")
    assert timm_gap.LOG.relative_to(timm_gap.ROOT).as_posix() == "benchmarks/results/experiments/timm_gap.json"
    origin = {"commit": "c" * 40, "clean": False, "on_main": False, "command": "python -m benchmarks.timm_gap",
              "how": "a harness"}
    log = tmp_path / "timm_gap.json"
    log.write_text(json.dumps({"started": "2026-11-28 05:00 UTC", "machine": {"line": "a CPU"}, "results": results,
                               "provenance": origin}))
    note = timm_gap.note(log)
    assert note.startswith(f"### {timm_gap.TITLE}\n\n{body}\n\n_{settings}. Machine: a CPU._")
    assert "`python -m benchmarks.timm_gap` at commit `cccccccccc`" in note and "not on main**): a harness;" in note
    assert pages.EXPERIMENTS["timm_peer"] == ("timm_gap",) and timm_gap.note() in pages.PERFORMANCE.read_text()
