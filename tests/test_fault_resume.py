"""Crash and preemption recovery of the real `imgcls fit`: SIGKILL / SIGTERM at chosen points, resume, same weights."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import (
    ROOT,
    TINY_ARCH,
    cli_env,
    concurrent_python,
    free_port,
    kill_args,
    make_image_folder,
    max_diff,
    resume_config,
    run_cli,
)
from tests.helpers import (
    fit_run as _fit,
)
from tests.helpers import (
    last_weights as _weights,
)
from training.resume.checkpoints import checkpoint_problem
from training.resume.preemption import Preemption

STEPS_PER_EPOCH = 4  # 32 train images / batch 8
# (global step, where, the checkpoint a resume must start from); checkpoints every 2 steps, only the newest step one
# is kept, last.ckpt and the best one are written at the end of each validation.
KILL_POINTS = [
    (3, "train", "step0000002.ckpt"),  # mid-epoch 0
    # during epoch 0's validation: step 4's checkpoint is only written once that validation has ended (a resume
    # from a checkpoint taken before it would skip the validation)
    (4, "val", "step0000002.ckpt"),
    (5, "train", "last.ckpt"),  # first step of epoch 1: last.ckpt of epoch 0's validation
]
# The lost-peer test's process-group timeout, and the seconds past it a hung peer's rank 0 may take to print its
# error and to exit (docs/FAULT_TOLERANCE.md quotes all three: checked below).
PEER_TIMEOUT_S, LINE_MARGIN_S, EXIT_MARGIN_S = 12, 3, 15


def _config(tmp_path: Path, data: Path, devices: int = 1, background_writes: bool = False,
            recipe: bool = False) -> Path:
    """The shipped quickstart config, shrunk: TINY_ARCH at 32 px, 2 epochs of 4 steps, checkpoints every 2 steps.

    `background_writes` uses the production config's writer (AsyncAtomicCheckpointIO) instead of the quickstart's
    synchronous one; with it, a kill right after a step may come before that step's checkpoint is on disk. `recipe`
    turns on mixup and CutMix (torchvision V2's alphas), whose draws a resume must repeat, an EMA of the weights
    (training.callbacks.EMA, copying the weights for 4 steps and averaging after them, so that a resume starts on
    either side), whose average a resume must carry on, a backbone frozen for epoch 0, which the kills before and
    after its thaw must not disturb, the loader's random augmentation (imagenet preset,
    TrivialAugment, random erasing), which a resume must draw again alike, and one of the recipe's samplers, whose
    position a resume must restore: class-balanced sampling on one process, repeated augmentation on several.
    """
    cfg = resume_config(devices)
    assert "plugins" not in cfg["trainer"]  # shipped: checkpoints written on the training thread
    if background_writes:
        cfg["trainer"]["plugins"] = [{"class_path": "training.resume.checkpoints.AsyncAtomicCheckpointIO"}]
    callbacks = cfg["trainer"]["callbacks"]
    if recipe:
        cfg["model"]["recipe"].update(mixup_alpha=0.2, cutmix_alpha=1.0)
        cfg["freeze"] = {"epochs": 1}  # training.callbacks.FreezeBackbone: thaws at epoch 1
        callbacks.append({"class_path": "training.callbacks.EMA",
                          "init_args": {"decay": 0.9, "update_starting_at_step": 4}})
    cfg["data"].update(root=str(data), batch_size=8 // devices, num_workers=0, image_size=32)
    if recipe:  # the loader's random augmentation too: crops and flips, TrivialAugment, erasing
        cfg["data"].update(preset="imagenet", train_transform={
            "class_path": "datamodules.presets.ClassificationPresetTrain",
            "init_args": {"auto_augment": "trivialaugment", "random_erasing": 0.25}},
                           **({"sampler": "balanced"} if devices == 1 else {"repeated_augmentation": 2}))
    assert cfg["auto_resume"] is True  # shipped on
    path = tmp_path / f"config{devices}{'_recipe' if recipe else ''}{'_background' if background_writes else ''}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path




def _kill(config: Path, run: Path, step: int, where: str) -> None:
    """Run `config` until every process SIGKILLs itself at (step, where)."""
    killed = _fit(config, run, *kill_args(step, where), check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]


def _resumed_from(proc: subprocess.CompletedProcess) -> tuple[Path, str]:
    """(the checkpoint a run resumed from, why: auto_resume or --ckpt_path last), from its one-line notice."""
    found = re.search(r"resuming from (\S+) \(([^)]+)\)", proc.stdout + proc.stderr)
    assert found, (proc.stdout + proc.stderr)[-3000:]
    return Path(found[1]), found[2]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("data"), {"a": 16, "b": 16}, size=32)


@pytest.mark.slow
def test_sigkill_at_any_point_resumes_to_identical_weights(tmp_path, data):
    """The kill points follow one another in one run folder, as in the DDP test below, in an order where each resume
    but the first trains steps that the end weights keep: killed during epoch 0's validation; resumed and killed
    after step 3; resumed by --ckpt_path last and killed after step 5; resumed past a truncated last.ckpt to the end,
    with the weights of the run that was never killed. The recipe is on (mixup, CutMix, EMA, a frozen epoch, the
    class-balanced sampler): the EMA weights (state_dict) and the trained ones must both match."""
    config = _config(tmp_path, data, recipe=True)
    _fit(config, tmp_path / "reference")
    reference = _weights(tmp_path / "reference")
    trained = _weights(tmp_path / "reference", "current_model_state")
    run = tmp_path / "killed"
    checkpoints = run / "checkpoints"
    expected = {(step, where): checkpoints / name for step, where, name in KILL_POINTS}
    assert sorted(expected) == [(3, "train"), (4, "val"), (5, "train")]  # the chain below covers each of them
    # During epoch 0's validation: step 4's checkpoint is only written once that validation has ended (a resume
    # from a checkpoint taken before it would skip the validation). The same command again: auto_resume.
    _kill(config, run, 4, "val")
    killed = _fit(config, run, *kill_args(3, "train"), check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert _resumed_from(killed) == (expected[(4, "val")], "auto_resume")
    # Mid-epoch 0: the command, the same one plus --ckpt_path last; auto_resume off, so that the flag does
    # it. This run trains on to step 5: the checkpoints of epoch 0's end that the last resume starts from are its.
    killed = _fit(config, run, "--ckpt_path", "last", "--auto_resume", "false", *kill_args(5, "train"), check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert _resumed_from(killed) == (expected[(3, "train")], "--ckpt_path last")
    # First step of epoch 1, with last.ckpt half-written (a crash of a non-atomic writer): the resume falls back to
    # the newest intact checkpoint. A new, truncated file under the name (last.ckpt shares its data with the best-k
    # file of its step).
    last = expected[(5, "train")]
    truncated = last.read_bytes()[:1000]
    last.unlink()
    last.write_bytes(truncated)
    resumed = _fit(config, run)
    out = resumed.stdout + resumed.stderr
    assert f"skipped {last}, which is unusable (truncated" in out and "UserWarning" not in out
    resumed_from, how = _resumed_from(resumed)
    # epoch 0's best, written with last.ckpt at the end of its validation
    assert resumed_from.parent == checkpoints and resumed_from.name.startswith("epoch000-"), resumed_from
    assert how == "auto_resume"
    report = {"(4, val), (3, train), (5, train) in turn": max_diff(reference, _weights(run)),
              "the same, trained weights": max_diff(trained, _weights(run, "current_model_state"))}
    # The production config's background writer: a kill may come while the newest checkpoint is still being
    # written, and the resume then starts from an older one (or from scratch), never from a partial file, and still
    # ends the same.
    run = tmp_path / "kill_train5_background_writes"
    _kill(_config(tmp_path, data, background_writes=True, recipe=True), run, 5, "train")
    # A write cut short leaves at most its hidden temporary file: every file named *.ckpt is whole.
    assert all(checkpoint_problem(c) is None for c in (run / "checkpoints").glob("*.ckpt"))
    _fit(_config(tmp_path, data, background_writes=True, recipe=True), run)
    report["(5, train), background writes"] = max_diff(reference, _weights(run))
    print("1 process, max |w - w_ref|:", report)
    assert all(diff <= 1e-6 for diff in report.values()), report


@pytest.mark.slow
def test_sigkill_of_a_ddp_job_at_any_point_resumes_to_identical_weights(tmp_path, data):
    """2-process DDP (gloo): every rank is killed at the same point, as when a node is lost; the same command
    resumes on both ranks. The kill points follow one another in one run folder: each resumed run is killed at the
    next point, and the last resume runs to the end, with the weights of the run that was never killed. Mixup,
    CutMix, an EMA of the weights and a backbone frozen for epoch 0 are on: each rank's draws must repeat after a
    resume, the average go on, and the thaw happen at the same step; repeated augmentation deals each image's 2
    copies to the 2 ranks, and the resumed loaders continue that order."""
    config = _config(tmp_path, data, devices=2, recipe=True)
    _fit(config, tmp_path / "reference")
    run = tmp_path / "killed"
    resumed = []
    for i, (step, where, _) in enumerate(KILL_POINTS):
        killed = _fit(config, run, *kill_args(step, where), check=False)
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
        if i:
            resumed.append(_resumed_from(killed))
    resumed.append(_resumed_from(_fit(config, run)))
    assert resumed == [(run / "checkpoints" / expected, "auto_resume") for _, _, expected in KILL_POINTS]
    diff = max_diff(_weights(tmp_path / "reference"), _weights(run))  # the EMA weights: state_dict
    diff = max(diff, max_diff(_weights(tmp_path / "reference", "current_model_state"),
                              _weights(run, "current_model_state")))  # and the trained ones
    print(f"DDP x2, killed at {[(step, where) for step, where, _ in KILL_POINTS]}: max |w - w_ref| = {diff}")
    assert diff <= 1e-6


def _gone(pid: int) -> bool:
    """True when `pid` has exited (a zombie waiting for its reaper counts as exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_run_cli_timeout_kills_the_processes_the_command_started(tmp_path, monkeypatch):
    """A hung DDP run must not outlive its test: on a timeout, run_cli kills the launcher's whole process group."""
    child_pid = tmp_path / "child.pid"
    launcher = tmp_path / "launcher.sh"  # stands in for `python -m imgcls`: starts a "rank", waits on it
    launcher.write_text(f"#!/bin/sh\nsleep 600 &\necho $! > {child_pid}\nwait\n")
    launcher.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(launcher))
    with pytest.raises(pytest.fail.Exception, match="timed out after 3s"):
        run_cli("fit", timeout=3)
    pid = int(child_pid.read_text())
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(pid), f"process {pid} started by the command is still running"


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_preemption_signal_saves_and_exits_nonzero_then_resumes(tmp_path, data, sig):
    # SIGUSR1 (SLURM) with the production config's background writer: the exit must wait for preempted.ckpt.
    config = _config(tmp_path, data, background_writes=sig == signal.SIGUSR1)
    run = tmp_path / "run"
    # The test sends the signal to itself mid-step (as SLURM or Kubernetes would send it from outside), and saves
    # that step. Ctrl-C goes to its process group, as a terminal's does, loader workers included, during the first
    # validation (after its first batch): the validation's next batches and step 5 still load, and step 5 is saved.
    kill, step = (kill_args(4, "val") + ["--trainer.callbacks.group=true", "--data.num_workers=1"], 5) \
        if sig == signal.SIGINT else (kill_args(3, "train_start"), 4)
    proc = _fit(config, run, *kill, f"--trainer.callbacks.sig={int(sig)}", check=False)
    assert proc.returncode == 128 + sig, proc.stderr[-3000:]
    saved = run / "checkpoints" / "preempted.ckpt"
    assert saved.is_file()
    assert torch.load(saved, weights_only=True)["global_step"] == step  # the step running when it came, or the next
    out = proc.stdout + proc.stderr
    assert f"{signal.Signals(sig).name} received: saved {saved} at step {step}" in out
    assert "`weights_only` was not set" not in out  # Lightning's line for a save that does not say what it holds
    if sig == signal.SIGINT:
        assert "Ctrl-C: stopping at the end of this training step, with a checkpoint" in out
    if sig != signal.SIGTERM:
        return  # the same save path as SIGTERM: resuming it once is enough
    resumed = _fit(config, run)
    assert f"resuming from {saved}" in resumed.stdout + resumed.stderr
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2 * STEPS_PER_EPOCH


def test_a_second_ctrl_c_interrupts_at_once_and_an_ignored_one_stays_ignored():
    """The first Ctrl-C of a fit only asks for the save at the step end and puts the previous handler back, so the
    second raises KeyboardInterrupt where it lands (Lightning's shutdown); a fit started with SIGINT ignored (a script's
    background job) keeps ignoring it. After fit, every handler is the one from before, and a next fit of the same
    Trainer starts without the request."""
    trainer = types.SimpleNamespace(world_size=1)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (a test worker may ignore it)
        guard = Preemption()
        guard.on_train_start(trainer, None)
        # Checked before any Ctrl-C is sent: one that no handler took would interrupt the whole pytest session.
        assert signal.getsignal(signal.SIGINT) == guard._handler
        os.kill(os.getpid(), signal.SIGINT)
        assert guard._received == signal.SIGINT
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        guard.teardown(trainer, None, "fit")
        assert signal.getsignal(signal.SIGTERM) == before[signal.SIGTERM]
        guard.on_train_start(trainer, None)  # the same Trainer's next fit (a notebook's) starts without the request
        assert guard._received == 0
        guard.teardown(trainer, None, "fit")

        signal.signal(signal.SIGINT, signal.SIG_IGN)
        guard = Preemption()
        guard.on_train_start(trainer, None)
        os.kill(os.getpid(), signal.SIGINT)
        assert guard._received == 0 and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        guard.teardown(trainer, None, "fit")
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


@pytest.mark.slow
@pytest.mark.parametrize("sig, expected", [
    (signal.SIGKILL, ("connection reset by peer", "connection closed by peer")),  # a dead peer: its socket closes
    (signal.SIGSTOP, ("timeout", "timed out")),  # a hung peer: its socket stays open, only the timeout ends it
], ids=["killed", "hung"])
def test_ddp_rank_lost_mid_step_peer_exits_within_timeout(tmp_path, data, sig, expected):
    """Rank 1 dies or hangs at the start of step 4; rank 0 blocks in the gradient all-reduce and must fail, not hang.

    The two ranks run as two single-process "nodes" (the multi-node layout, NODE_RANK 0 and 1 on one host), so no
    launcher watches over them: rank 0 must notice the lost peer through the process group alone.
    """
    config = _config(tmp_path, data)
    timeout_s = PEER_TIMEOUT_S
    stamp = tmp_path / "rank1_lost_at"
    args = ["fit", "--config", str(config), "--trainer.default_root_dir", str(tmp_path / "run"),
            "--trainer.num_nodes", "2", "--data.batch_size", "4",
            "--trainer.strategy", "training.distributed.strategy.CompressedDDPStrategy",
            "--trainer.strategy.timeout_s", str(timeout_s), *kill_args(3, "train_start", rank=1),
            f"--trainer.callbacks.sig={int(sig)}", "--trainer.callbacks.stamp", str(stamp)]
    port = str(free_port())
    python = concurrent_python()
    procs = [subprocess.Popen([python, "-m", "imgcls", *args], cwd=ROOT,
                              env=cli_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(node)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for node in (0, 1)]
    lines: list[tuple[float, str]] = []  # rank 0's output, each line with the time it arrived
    reader = threading.Thread(target=lambda: lines.extend((time.time(), ln) for ln in procs[0].stdout))
    reader.start()
    try:
        procs[0].wait(timeout=240)
        exited = time.time()
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        reader.join()
    lost = float(stamp.read_text())  # the moment rank 1 was killed or stopped
    out = "".join(ln for _, ln in lines)
    # One line that says what happened and what to do, with gloo's own reason in it.
    line_at, line = next(((t, ln) for t, ln in lines if ln.startswith("imgcls: error: rank 0 lost contact")),
                         (None, None))
    assert line is not None, out[-3000:]
    print(f"rank 1 got {signal.Signals(sig).name}; {line_at - lost:.1f}s after it rank 0 printed its error, "
          f"{exited - lost:.1f}s after it rank 0 exited (code {procs[0].returncode}):\n{line}")
    assert procs[0].returncode != 0
    assert any(text in line.lower() for text in expected) and "timeout_s" in line and "resume" in line, line
    if sig == signal.SIGKILL:
        assert exited - lost <= timeout_s, f"{exited - lost:.1f}s"
    else:
        waiting = float(Path(f"{stamp}.rank0").read_text())  # when rank 0 started step 4, before its collectives
        # Rank 0's first collective of step 4 (DDP's buffer broadcast in the forward) starts after `waiting`: its
        # timeout cannot end before waiting + timeout_s. (Measured from rank 1's stamp instead, that bound failed by
        # 11 ms once: under load rank 1 can reach the start of step 4 after rank 0 has begun to wait.) The error
        # comes within LINE_MARGIN_S of the timeout counted from the stop (what rank 0 runs before it waits, when
        # that is after the stop, and the exception's way out of Lightning: measured 0.0-0.3 s); the exit within
        # EXIT_MARGIN_S (after the line Python finalizes torch's and Lightning's modules: measured 2.4-7.2 s at a
        # load of 5-12 on 2 cores, so twice the worst).
        assert timeout_s <= line_at - waiting and line_at - lost <= timeout_s + LINE_MARGIN_S, \
            f"{line_at - waiting:.3f}s after rank 0 began waiting, {line_at - lost:.3f}s after rank 1 stopped"
        assert timeout_s <= exited - waiting and exited - lost <= timeout_s + EXIT_MARGIN_S, \
            f"{exited - waiting:.3f}s after rank 0 began waiting, {exited - lost:.3f}s after rank 1 stopped"


def test_the_fault_tolerance_notes_quote_the_lost_peer_tests_bounds():
    notes = (ROOT / "docs" / "FAULT_TOLERANCE.md").read_text()
    t, line, end = PEER_TIMEOUT_S, PEER_TIMEOUT_S + LINE_MARGIN_S, PEER_TIMEOUT_S + EXIT_MARGIN_S
    for quoted in (f"with a {t} s\ntimeout",
                   f"print its error between {t} and {line} s and exit between {t} and {end} s",
                   f"(required: {t} to {line} s) | {t} to {end} s (required)", f"Timed out waiting {t * 1000}ms"):
        assert quoted in notes, quoted


class _SeedRecorder:
    """Mixed into the model: the global seed each training batch starts from (set by ExactResume just before)."""

    def on_train_batch_start(self, batch, batch_idx):
        self.seeds.append(torch.initial_seed())


def test_each_micro_batch_of_an_accumulated_step_draws_its_own_random_numbers(tmp_path, data):
    """accumulate_grad_batches=2: the two micro-batches of one optimizer step must not share dropout masks (a seed
    from the optimizer step would give them the same); rerunning gives the same seeds (resumes depend on it)."""
    from functools import partial

    import lightning as L

    from datamodules import ImageFolderDataModule
    from lightning_modules import BackboneWithHead, ImageClassifier
    from training.resume import ExactResume

    class Model(_SeedRecorder, ImageClassifier):
        seeds: list

    def seeds() -> list[int]:
        L.seed_everything(3)
        model = Model(num_classes=2, net=partial(BackboneWithHead, arch=TINY_ARCH, head_hidden=8))
        model.seeds = []
        trainer = L.Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=4, limit_val_batches=0,
                            accumulate_grad_batches=2, callbacks=[ExactResume()], logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, ImageFolderDataModule(str(data), batch_size=4, num_workers=0, image_size=32))
        assert trainer.global_step == 2
        return model.seeds

    first = seeds()
    assert len(first) == 4 and len(set(first)) == 4
    assert seeds() == first


@pytest.mark.slow
def test_preemption_of_one_ddp_rank_saves_and_stops_every_rank(tmp_path, data):
    """SIGTERM to rank 1 only: the flag travels by an asynchronous all-reduce on a CPU group, read one step later,
    so both ranks save preempted.ckpt at the same step and exit with 143."""
    config = _config(tmp_path, data, devices=2)
    run = tmp_path / "run"
    proc = _fit(config, run, *kill_args(3, "train_start", rank=1), f"--trainer.callbacks.sig={int(signal.SIGTERM)}",
                check=False)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
    saved = run / "checkpoints" / "preempted.ckpt"
    # The signal came during step 4; its all-reduce started at that step's end and was read at the next one's.
    assert torch.load(saved, weights_only=True)["global_step"] == 5
    assert "SIGTERM received: saved" in proc.stdout + proc.stderr


def test_non_finite_loss_guard_checks_in_batches_and_always_before_a_save():
    """One host transfer per check_every_n_steps losses (a GPU step never waits on it), the first bad one named;
    a checkpoint save checks at once."""
    from types import SimpleNamespace

    from training.resume import NonFiniteLossGuard
    from training.resume.faults import NonFiniteLossError

    trainer = SimpleNamespace(global_step=0, current_epoch=0, checkpoint_callbacks=[])
    guard = NonFiniteLossGuard(check_every_n_steps=4)
    for step, value in enumerate([1.0, 2.0, float("nan")], start=1):
        trainer.global_step = step
        guard.on_train_batch_end(trainer, None, {"loss": torch.tensor(value)}, None, step - 1)  # not checked yet
    with pytest.raises(NonFiniteLossError, match="training loss is nan at step 3 .epoch 0, batch 2.; last good "
                                                 "checkpoint: none yet"):
        guard.on_save_checkpoint(trainer, None, {})
    for step in range(4):
        guard.on_train_batch_end(trainer, None, {"loss": torch.tensor(1.0)}, None, step)
    assert guard._pending == []  # checked after 4, all finite
    assert NonFiniteLossGuard().check_every_n_steps is None  # by device: every step on a CPU, every 50 on CUDA


@pytest.mark.cuda
def test_fault_guards_never_synchronise_a_cuda_step_between_checks():
    from types import SimpleNamespace

    from training.resume import NonFiniteLossGuard

    trainer = SimpleNamespace(global_step=0, current_epoch=0, checkpoint_callbacks=[])
    guard = NonFiniteLossGuard()
    loss = torch.ones((), device="cuda")
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host wait raises
    try:
        for step in range(49):
            guard.on_train_batch_end(trainer, None, {"loss": loss * step}, None, step)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(guard._pending) == 49
    guard.on_train_batch_end(trainer, None, {"loss": loss}, None, 49)  # the 50th: one check, all finite
    assert guard._pending == []
