"""Property test of the whole fit path: hypothesis draws Trainer settings and a user's own ModelCheckpoint; each run
keeps the checkpoints its settings ask for, and a SIGKILL at a drawn point, resumed with `--ckpt_path last`, ends
with the weights of the run that was never killed.

The files a configuration asks for are computed here from Lightning 2.6's rules (`timeline`, `writes`), so a
callback of the project that changes which files the user's ModelCheckpoint writes shows up as a difference.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, Phase, assume, example, given, note, settings
from hypothesis import strategies as st
from lightning.pytorch import Callback

from tests.helpers import NO_RUN_CHECKPOINTS, TINY, kill_args, make_image_folder, max_diff, run_cli, shipped_config

BATCHES = 4  # training batches per epoch at most: 8 images, batch 2
MAX_STEPS = 8  # optimizer steps per run at most: a run takes seconds, a checkpoint write ~0.2 s
# Drawn cases beside the explicit ones below, ~17 s each on 2 cores (two fits in this process, one killed `imgcls`
# subprocess); the same ones on every run. Explore further with e.g. IMGCLS_PROPERTY_EXAMPLES=40 (~12 min).
EXAMPLES = int(os.environ.get("IMGCLS_PROPERTY_EXAMPLES", "2"))
Event = tuple[str, int, int]  # ("batch" | "val" | "epoch", global step, epoch): a point where a checkpoint is written
Write = tuple[int, str, int]  # (index of the event it is written in, file name, global step)


@dataclass(frozen=True)
class Case:
    """A drawn configuration: Trainer settings, the user's ModelCheckpoint init_args, and KillAt's (where, step)."""

    trainer: dict
    checkpoint: dict
    kill: tuple[str, int]


def timeline(trainer: dict) -> list[Event]:
    """Lightning's fit loop as the checkpoint hooks see it: each training batch end, validation end, epoch end."""
    batches, accumulate = trainer["limit_train_batches"], trainer["accumulate_grad_batches"]
    interval, every_n_epochs = trainer["val_check_interval"], trainer["check_val_every_n_epoch"]
    check_batch = interval if isinstance(interval, int) else max(1, int(batches * interval))
    max_epochs = trainer["max_epochs"] or math.inf
    events: list[Event] = []
    step = epoch = total = 0
    while epoch < max_epochs and step != trainer["max_steps"]:
        for batch in range(batches):
            if (batch + 1) % accumulate == 0 or batch == batches - 1:  # the optimizer steps on an epoch's last batch
                step += 1
            events.append(("batch", step, epoch))
            # An int interval counts the epoch's batches, or the run's when check_val_every_n_epoch is None.
            counted = total if every_n_epochs is None else batch
            if (every_n_epochs is None or (epoch + 1) % every_n_epochs == 0) and (counted + 1) % check_batch == 0:
                events.append(("val", step, epoch))
            total += 1
            if step == trainer["max_steps"]:
                break
        events.append(("epoch", step, epoch))  # also after a max_steps stop within the epoch
        epoch += 1
    return events


def writes(trainer: dict, checkpoint: dict, events: list[Event]) -> list[Write]:
    """Each file that Lightning's ModelCheckpoint writes with `checkpoint` (default file names), in order.

    A step save at a batch that a validation follows is written once that validation has ended (ExactResume), the
    others where Lightning writes them: a step save at its batch end, an epoch save (and a monitored one) at each
    validation end, or at the epoch end where Lightning saves there; last.ckpt right after any of them.
    """
    monitored = checkpoint.get("monitor") is not None
    every_n_steps = checkpoint.get("every_n_train_steps") or 0
    timed = checkpoint.get("train_time_interval") is not None  # drawn as 0: every check is due
    every_n_epochs = checkpoint.get("every_n_epochs") or (0 if every_n_steps or timed else 1)
    top_k, save_last = checkpoint["save_top_k"], checkpoint["save_last"]
    on_epoch_end = saves_at_epoch_end(trainer, checkpoint)
    out: list[Write] = []
    saved = 0  # ModelCheckpoint._last_global_step_saved: nothing twice at one step, nothing at step 0
    for i, (kind, step, epoch) in enumerate(events):
        if step == saved:
            continue
        if kind == "batch" and (timed or (every_n_steps and step % every_n_steps == 0)):
            at = i
            if i + 1 < len(events) and events[i + 1][0] == "val":
                at = i + 1 + (on_epoch_end and i + 2 < len(events) and events[i + 2][0] == "epoch")
            names = ([f"epoch={epoch}-step={step}.ckpt"] if top_k else []) + (["last.ckpt"] if save_last else [])
        elif kind == ("epoch" if on_epoch_end else "val") and every_n_epochs and (epoch + 1) % every_n_epochs == 0:
            at = i
            # A monitored save at an epoch end (a max_steps stop within an epoch) needs a validation's metric.
            due = top_k and (not monitored or kind == "val" or any(e[0] == "val" for e in events[:i]))
            names = [f"epoch={epoch}-step={step}.ckpt"] + (["last.ckpt"] if save_last else []) if due else []
        else:
            continue
        out += [(at, name, step) for name in names]
        saved = step if names else saved
    if save_last and not out:  # on_train_end: last.ckpt of the final step when nothing was saved
        out.append((len(events), "last.ckpt", events[-1][1]))
    return out


def saves_at_epoch_end(trainer: dict, checkpoint: dict) -> bool:
    """Lightning's ModelCheckpoint._should_save_on_train_epoch_end, where an int interval 1 (every batch) equals 1.0."""
    return checkpoint.get("save_on_train_epoch_end",
                          trainer["check_val_every_n_epoch"] == 1 and trainer["val_check_interval"] == 1.0)


def kill_points(events: list[Event]) -> list[tuple[int, str, int]]:
    """(event index, KillAt's `where`, step): where KillAt kills a run, at the first batch end of each step (before
    the checkpoints of that batch end) or in the first validation at each step."""
    points = {}
    for i, (kind, step, _) in enumerate(events):
        if kind != "epoch" and step >= 1:
            points.setdefault(("train" if kind == "batch" else "val", step), i)
    return [(i, where, step) for (where, step), i in points.items()]


def kept(checkpoint: dict, written: list[Write]) -> tuple[set[str], int]:
    """(the top-k files that may remain of `written`, how many remain); last.ckpt aside. Which of a monitored
    callback's files remain depends on the metric's values; how many does not."""
    names = [name for _, name, _ in written if name != "last.ckpt"]
    if checkpoint["save_top_k"] == -1:
        return set(names), len(names)
    if checkpoint.get("monitor") is None:  # top 1 keeps the newest
        return set(names[-1:]), len(names[-1:])
    return set(names), min(checkpoint["save_top_k"], len(names))


@st.composite
def cases(draw) -> Case:
    batches = draw(st.integers(2, BATCHES))
    accumulate = draw(st.integers(1, 3))
    validation = draw(st.sampled_from(["epoch end", "fraction", "batches", "batches of the run"]))
    if validation == "epoch end":
        interval, every_n_epochs = 1.0, draw(st.sampled_from([1, 2]))
    elif validation == "fraction":
        interval, every_n_epochs = 0.5, 1
    elif validation == "batches":
        interval, every_n_epochs = draw(st.integers(1, batches)), 1
    else:
        interval, every_n_epochs = draw(st.integers(1, 2 * batches)), None
    if draw(st.booleans()):
        epochs = draw(st.integers(1, max(1, MAX_STEPS // math.ceil(batches / accumulate))))
        length = {"max_epochs": epochs, "max_steps": -1}
    else:
        length = {"max_epochs": None, "max_steps": draw(st.integers(2, MAX_STEPS))}
    trainer = {"limit_train_batches": batches, "accumulate_grad_batches": accumulate,
               "val_check_interval": interval, "check_val_every_n_epoch": every_n_epochs, **length}
    trigger = draw(st.sampled_from(["monitor", "every_n_epochs", "every_n_train_steps", "train_time_interval"]))
    if trigger == "monitor":
        metric = draw(st.sampled_from(["val/acc", "val/loss"]))  # logged by ImageClassifier._eval_step
        checkpoint = {"monitor": metric, "mode": "max" if metric == "val/acc" else "min",
                      "save_top_k": draw(st.sampled_from([1, 2, -1]))}
    else:
        value = {"every_n_epochs": st.integers(1, 2), "every_n_train_steps": st.integers(1, 3),
                 "train_time_interval": st.just("0:00:00")}[trigger]
        checkpoint = {trigger: draw(value), "save_top_k": draw(st.sampled_from([-1, 1, 0]))}
    checkpoint["save_last"] = checkpoint["save_top_k"] == 0 or draw(st.booleans())  # top 0 alone asks for nothing
    events = timeline(trainer)
    written = writes(trainer, checkpoint, events)
    points = kill_points(events)
    # Killed once a checkpoint exists: the resume then starts from it, not from scratch.
    resumable = [p for p in points if written and p[0] > written[0][0]]
    assume(resumable)
    _, where, step = draw(st.sampled_from(resumable))
    return Case(trainer, checkpoint, (where, step))


# Cases this test found, each a defect fixed since and kept as an example (run first, on every run).
# A step save was lost where the user's ModelCheckpoint saves at the epoch's end although validations run within the
# epoch (ExactResume held the save past the validation until the next batch end, and gave it that batch's step).
# `val_check_interval: 1` (an int: every batch; Lightning takes 1 for 1.0) lost steps 1 and 4 here;
# `save_on_train_epoch_end: true` with `val_check_interval: 0.5` did the same.
EVERY_BATCH_VALIDATES = Case(
    {"limit_train_batches": 3, "accumulate_grad_batches": 1, "val_check_interval": 1, "check_val_every_n_epoch": 1,
     "max_epochs": 2, "max_steps": -1},
    {"train_time_interval": "0:00:00", "save_top_k": -1, "save_last": False}, ("train", 5))
# A resume from a checkpoint written at an epoch's end, at the validation that ends it (`check_val_every_n_epoch: 2`,
# `val_check_interval: 0.5`) or, with max_steps set, at the train epoch end, replays that epoch's end and made one
# more loader iterator than the run never killed: with a shuffle drawn from a generator (torchdata's RandomSampler on
# one process), the next epoch trained on the batches of the epoch after it (max |w - w_ref| ~ 1 to 10). Every
# training sampler is now a function of (seed, epoch).
RESUMED_AFTER_CLOSING_VALIDATION = Case(
    {"limit_train_batches": 2, "accumulate_grad_batches": 1, "val_check_interval": 1.0, "check_val_every_n_epoch": 2,
     "max_epochs": 3, "max_steps": -1},
    {"monitor": "val/acc", "mode": "max", "save_top_k": 1, "save_last": True}, ("train", 5))
# The same under max_steps from a checkpoint of the train epoch's end: Lightning replays that epoch's end, counts it
# processed twice and set the samplers' epoch one ahead (6.2). ExactResume sets it from `current_epoch`.
RESUMED_UNDER_MAX_STEPS = Case(
    {"limit_train_batches": 2, "accumulate_grad_batches": 2, "val_check_interval": 1.0, "check_val_every_n_epoch": 1,
     "max_epochs": None, "max_steps": 2},
    {"monitor": "val/acc", "mode": "max", "save_top_k": 1, "save_last": False}, ("train", 2))
# A checkpoint inside an accumulation window lacked the gradients accumulated so far: the resumed step took the
# window's remaining micro-batches only (0.41). A validation there writes one (`val_check_interval` in batches, not
# a multiple of `accumulate_grad_batches`). ExactResume now keeps them in the checkpoint...
VALIDATION_MID_ACCUMULATION = Case(
    {"limit_train_batches": 4, "accumulate_grad_batches": 2, "val_check_interval": 3, "check_val_every_n_epoch": 1,
     "max_epochs": 1, "max_steps": -1},
    {"monitor": "val/loss", "mode": "min", "save_top_k": -1, "save_last": True}, ("train", 2))
# ...and a step save after a resume under accumulation saved the resumed step again (Lightning does not checkpoint a
# ModelCheckpoint's last saved step): at the first micro-batch, over the file resumed from or, at an epoch's start,
# beside it (epoch=1-step=1.ckpt here, beside epoch=0-step=1.ckpt). ExactResume now checkpoints and restores it.
SAVED_AGAIN_AFTER_RESUME = Case(
    {"limit_train_batches": 2, "accumulate_grad_batches": 2, "val_check_interval": 8, "check_val_every_n_epoch": None,
     "max_epochs": 2, "max_steps": -1},
    {"every_n_train_steps": 1, "save_top_k": -1, "save_last": False}, ("train", 2))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("data"), {"a": 4, "b": 4}, size=32)


@pytest.fixture(scope="module")
def one_thread():
    """In-process fits compute as the `imgcls` subprocesses do (OMP_NUM_THREADS=1): the same kernels, the same sums.
    Lightning's `deterministic: true` is process-wide; the tests after these get the setting they had."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)


class Outcome(Callback):
    """What an in-process fit resumed from and the weights it ended with (read at the end of training: the closing
    validation of the best checkpoint then loads that checkpoint's weights into the model)."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.resumed_at = trainer.global_step
        self.resumed_from = trainer.ckpt_path

    def on_train_end(self, trainer, pl_module) -> None:
        self.weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


def _config(folder: Path, data: Path, case: Case) -> Path:
    """The quickstart config with the drawn Trainer settings; the user's ModelCheckpoint alone, the run keeping none of
    its own (every part of the `checkpoint` key off). ValidationFigures is left out too (a figure per validation takes
    longer than a step here)."""
    cfg = shipped_config()
    cfg["checkpoint"] = NO_RUN_CHECKPOINTS
    monitor = [c for c in cfg["trainer"]["callbacks"] if c["class_path"].endswith("LearningRateMonitor")]
    mine = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": case.checkpoint}
    cfg["trainer"].update(case.trainer, callbacks=[mine, *monitor], precision="32-true", deterministic=True,
                          limit_val_batches=1, enable_progress_bar=False)
    # SGD: one state tensor per weight, not AdamW's two: checkpoints a third smaller
    cfg["model"]["optimizer"] = {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.016, "momentum": 0.9}}
    cfg["data"]["root"] = str(data)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _args(config: Path, run: Path) -> list[str]:
    return ["fit", "--config", str(config), *TINY, "--data.batch_size", "2", "--trainer.default_root_dir", str(run)]


def _fit(config: Path, run: Path, *extra: str) -> Outcome:
    """`imgcls fit` in this process: no interpreter start and imports (seconds each) for the runs that are not
    killed."""
    from training.cli.app import cli_main

    outcome = Outcome()
    cli_main([*_args(config, run), *extra], trainer_defaults={"callbacks": [outcome]})
    return outcome


def _check_files(folder: Path, case: Case, written: list[Write]) -> set[str]:
    """The files in `folder` are those `written` leaves (the newest top-k, last.ckpt); returns their names."""
    files = {p.name for p in folder.glob("*.ckpt")} if folder.is_dir() else set()
    top, count = kept(case.checkpoint, written)
    assert ("last.ckpt" in files) == any(name == "last.ckpt" for _, name, _ in written), (files, written)
    assert files - {"last.ckpt"} <= top and len(files - {"last.ckpt"}) == count, (files, written)
    return files


def _step(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)["global_step"]


@pytest.mark.slow
# The same cases on every run (no example database, no random seed); no shrinking: a case costs ~17 s, and a failing
# one is printed with its events and expected writes.
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
@example(case=EVERY_BATCH_VALIDATES)
@example(case=RESUMED_AFTER_CLOSING_VALIDATION)
@example(case=RESUMED_UNDER_MAX_STEPS)
@example(case=VALIDATION_MID_ACCUMULATION)
@example(case=SAVED_AGAIN_AFTER_RESUME)
def test_drawn_configurations_keep_their_checkpoints_and_resume_to_the_same_weights(case, data, tmp_path_factory,
                                                                                   one_thread):
    events = timeline(case.trainer)
    written = writes(case.trainer, case.checkpoint, events)
    note(f"events {events}\nwrites {written}")
    folder = tmp_path_factory.mktemp("case")
    config = _config(folder, data, case)

    reference = _fit(config, folder / "reference")
    checkpoints = folder / "reference" / "checkpoints"
    files = _check_files(checkpoints, case, written)
    assert all(_step(checkpoints / name) == int(re.search(r"step=(\d+)", name)[1]) for name in files - {"last.ckpt"})
    if "last.ckpt" in files and case.checkpoint.get("monitor") is None:
        assert _step(checkpoints / "last.ckpt") == written[-1][2]  # the newest save (a monitored one: the best's)

    run = folder / "killed"
    where, step = case.kill
    killed = run_cli(*_args(config, run), *kill_args(step, where), check=False, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    kill_at = next(i for i, w, s in kill_points(events) if (w, s) == case.kill)
    before = [w for w in written if w[0] < kill_at]
    _check_files(run / "checkpoints", case, before)

    resumed = _fit(config, run, "--ckpt_path", "last")
    # From the newest checkpoint on disk: a monitored top-k one's step depends on the metric, the others' do not.
    steps = [s for _, _, s in before] or [0]
    if case.checkpoint.get("monitor") is None or case.checkpoint["save_top_k"] == -1:
        assert resumed.resumed_at == steps[-1]
    else:
        assert resumed.resumed_at in steps
    diff = max_diff(reference.weights, resumed.weights)
    note(f"resumed from {resumed.resumed_from} at step {resumed.resumed_at}: max |w - w_ref| = {diff}")
    assert diff <= 1e-6
    # The same files as the run never killed, plus the one resumed from (Lightning never deletes that one).
    resumed_from = {Path(resumed.resumed_from).name} if resumed.resumed_from else set()
    assert {p.name for p in (run / "checkpoints").glob("*.ckpt")} == files | resumed_from
    shutil.rmtree(folder)  # hundreds of MB per case; a failed case's folder stays to look at
