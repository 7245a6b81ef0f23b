"""Checkpoint integrity and safety: atomic writes, full disks, NaN weights, truncated files, pickle payloads, secrets."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

import training.checkpointing as checkpointing
from lightning_modules.network import build_resnet
from tests.helpers import TINY, make_image_folder, run_cli
from training.callbacks import redact_secrets
from training.checkpointing import (
    AtomicCheckpointIO,
    CheckpointWriteError,
    NonFiniteWeightsError,
    UnsafeCheckpointError,
    resolve_resume,
)


def _ckpt(value: float) -> dict:
    return {"state_dict": {"w": torch.full((4,), value)}, "global_step": value}


class _Payload:
    """Unpickling this creates `marker`: what a malicious checkpoint would do (or worse)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _evil_checkpoint(path: Path, marker: Path) -> Path:
    torch.save({"state_dict": {"net.fc.weight": torch.zeros(2, 2)}, "payload": _Payload(marker)}, path)
    assert not marker.exists()
    return path


def test_save_is_atomic_and_a_full_disk_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    io, path = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint(_ckpt(1.0), path)

    def full_disk(obj, f):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpointing.torch, "save", full_disk)
    with pytest.raises(CheckpointWriteError, match=f"no space left to write checkpoint {path}"):
        io.save_checkpoint(_ckpt(2.0), path)
    monkeypatch.undo()
    assert io.load_checkpoint(path)["global_step"] == 1  # the old one, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no temporary left behind


def test_nan_weights_are_never_written(tmp_path):
    io, path = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint(_ckpt(1.0), path)
    with pytest.raises(NonFiniteWeightsError, match="hold NaN/inf"):
        io.save_checkpoint(_ckpt(float("nan")), path)
    assert torch.isfinite(io.load_checkpoint(path)["state_dict"]["w"]).all()


def test_truncated_last_checkpoint_falls_back_to_newest_intact(tmp_path, capsys):
    io = AtomicCheckpointIO()
    io.save_checkpoint(_ckpt(1.0), tmp_path / "step0000002.ckpt")
    io.save_checkpoint(_ckpt(2.0), tmp_path / "step0000004.ckpt")
    io.save_checkpoint(_ckpt(3.0), tmp_path / "last.ckpt")
    last = tmp_path / "last.ckpt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])  # a crash mid-write without atomic saves
    (tmp_path / "empty.ckpt").touch()
    with pytest.warns(UserWarning, match=f"checkpoint {last} is unusable: truncated"):
        found = resolve_resume("last", tmp_path, auto_resume=False)
    assert found == str(tmp_path / "step0000004.ckpt")
    assert not last.exists() and (tmp_path / "last.ckpt.corrupt").is_file()  # moved aside, kept for inspection
    # An explicit broken path falls back too; auto_resume with no checkpoint folder starts from scratch.
    broken = tmp_path / "step0000006.ckpt"
    broken.write_bytes(b"PK\x03\x04")
    with pytest.warns(UserWarning, match=f"checkpoint {broken} is unusable"):
        assert resolve_resume(str(broken), tmp_path, auto_resume=False) == str(tmp_path / "step0000004.ckpt")
    assert resolve_resume(None, tmp_path / "none", auto_resume=True) is None


def test_crafted_pickle_is_refused_as_weights_and_as_checkpoint(tmp_path):
    marker = tmp_path / "pwned"
    evil = _evil_checkpoint(tmp_path / "evil.ckpt", marker)
    with pytest.raises(ValueError, match="refusing it"):
        build_resnet("resnet18", str(evil), 0, 0.0, 2)
    with pytest.raises(UnsafeCheckpointError, match=f"refusing to load {evil}"):
        AtomicCheckpointIO().load_checkpoint(evil)
    assert not marker.exists()


def test_crafted_pickle_is_refused_by_fit_ckpt_path(tmp_path):
    data = make_image_folder(tmp_path / "data", {"a": 4, "b": 4}, size=32)
    marker = tmp_path / "pwned"
    evil = _evil_checkpoint(tmp_path / "evil.ckpt", marker)
    proc = run_cli("fit", *TINY, "--data.root", str(data), "--trainer.default_root_dir", str(tmp_path / "run"),
                   "--trainer.max_epochs", "1", "--ckpt_path", str(evil), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"imgcls: error: refusing to load {evil}" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not marker.exists()


def test_redact_secrets_masks_url_passwords_and_secret_env_values(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef")
    text = "storage: postgresql://alice:hunter2@db:5432/optuna\nnote: key 0123456789abcdef\nplain: https://x.org/a"
    out = redact_secrets(text)
    assert "hunter2" not in out and "0123456789abcdef" not in out
    assert "postgresql://alice:***@db:5432/optuna" in out and "<WANDB_API_KEY>" in out
    assert "https://x.org/a" in out


def test_nan_loss_stops_with_step_and_last_good_checkpoint_and_no_secret_is_saved(tmp_path):
    """A huge lr blows the weights up; the run stops at the first non-finite loss, and nothing NaN is on disk.

    The same run carries a password in a URL and WANDB_API_KEY in its environment: neither may reach the run folder.
    """
    data = make_image_folder(tmp_path / "data", {"a": 8, "b": 8}, splits=("train", "val"), size=32)
    run = tmp_path / "run"
    key = "wandb-secret-key-0123456789"
    env = dict(os.environ, WANDB_API_KEY=key, PYTHONPATH=str(Path(__file__).resolve().parents[1]),
               OMP_NUM_THREADS="1")
    proc = run_cli(
        "fit", *TINY, "--data.root", str(data), "--data.batch_size", "4", "--trainer.default_root_dir", str(run),
        "--trainer.max_epochs", "3", "--model.lr", "1e12", "--model.lr_scaling", "none", "--model.warmup_epochs", "0",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        "--trainer.callbacks.every_n_train_steps", "1", "--trainer.callbacks.save_last", "true",
        "--data.predict_dir", "postgresql://alice:hunter2@db:5432/optuna",
        check=False, env=env,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("imgcls: error: training loss is nan at step") or "loss is inf" in line, line
    assert "last good checkpoint: " + str(run / "checkpoints") in line
    for ckpt in (run / "checkpoints").glob("*.ckpt"):
        state = torch.load(ckpt, weights_only=True)["state_dict"]
        assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point()), ckpt
    config = (run / "config.yaml").read_text()
    assert "postgresql://alice:***@db:5432/optuna" in config
    for f in run.rglob("*"):
        if f.is_file() and f.suffix != ".ckpt":
            blob = f.read_bytes()
            assert b"hunter2" not in blob and key.encode() not in blob, f
