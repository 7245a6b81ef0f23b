"""Checkpoint integrity and safety: atomic writes, full disks, NaN weights, truncated files, pickle payloads,
secrets."""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import mmap
import os
import re
import shutil
import subprocess
import time
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torchvision
import yaml

import training.resume.checkpoints as checkpointing
from lightning_modules.network import BackboneWithHead
from tests.helpers import (
    CONFIGS,
    ROOT,
    TINY,
    cli_env,
    free_port,
    join_ranks,
    make_image_folder,
    resume_config,
    run_cli,
    start_ranks,
    torchrun,
)
from training.callbacks import ModelCheckpoint
from training.records.secrets import redact_secrets
from training.resume.checkpoints import (
    AsyncAtomicCheckpointIO,
    AtomicCheckpointIO,
    CheckpointWriteError,
    NonFiniteWeightsError,
    UnsafeCheckpointError,
    resolve_resume,
    tidy_checkpoint_folders,
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

    def full_disk_as_torch_reports_it(obj, f):
        try:
            full_disk(obj, f)
        except OSError:  # torch's zip writer fails again while closing the archive, and that is what reaches us
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 2899200 vs 2899092")  # noqa: B904

    for save in (full_disk, full_disk_as_torch_reports_it):
        monkeypatch.setattr(checkpointing.torch, "save", save)
        with pytest.raises(CheckpointWriteError, match=f"cannot write checkpoint last.ckpt in {tmp_path}: No space"):
            io.save_checkpoint(_ckpt(2.0), path)
        monkeypatch.undo()
        assert io.load_checkpoint(path)["global_step"] == 1  # the old one, whole
        assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no temporary left behind


def _cached_bytes(path: Path) -> int:
    """How much of `path` sits in the page cache (mincore(2) over a private mapping of the file)."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mapped:
        pages = (ctypes.c_ubyte * -(-len(mapped) // mmap.PAGESIZE))()
        start = ctypes.c_char.from_buffer(mapped)
        try:
            assert libc.mincore(ctypes.byref(start), ctypes.c_size_t(len(mapped)), pages) == 0, ctypes.get_errno()
        finally:
            del start  # the mapping cannot close while a ctypes object holds its buffer
    return sum(page & 1 for page in pages) * mmap.PAGESIZE


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise on this OS: the pages stay cached")
def test_a_written_checkpoint_leaves_the_page_cache(tmp_path):
    """A fit never reads its checkpoints back: once synced, their pages are dropped, not left to evict the images."""
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(4 << 20)}}, path)  # 16 MiB
    size = path.stat().st_size
    assert _cached_bytes(path) < size / 10
    path.read_bytes()
    assert _cached_bytes(path) > size / 2  # what the probe sees of a file just read: it can tell


def test_background_writer_snapshots_orders_removals_and_reports_errors(tmp_path, monkeypatch):
    """AsyncAtomicCheckpointIO: what is saved is the state at the call, an older checkpoint is removed only after
    its replacement is on disk, and a failed write is raised at the latest at teardown (the end of fit)."""
    io = AsyncAtomicCheckpointIO()
    old, new = tmp_path / "epoch0.ckpt", tmp_path / "epoch1.ckpt"
    io.save_checkpoint(_ckpt(0.0), old)
    io.teardown()  # waits for the pending write
    events, slow_save = [], checkpointing.AtomicCheckpointIO.save_checkpoint

    def save(self, checkpoint, path, storage_options=None):
        time.sleep(0.3)  # a slow disk: the training thread goes on meanwhile
        slow_save(self, checkpoint, path, storage_options)
        events.append(("written", Path(path).name, old.exists()))

    monkeypatch.setattr(checkpointing.AtomicCheckpointIO, "save_checkpoint", save)
    state = _ckpt(1.0)
    io.save_checkpoint(state, new)
    state["state_dict"]["w"].fill_(7.0)  # the next training step changes the weights in place
    io.remove_checkpoint(old)
    assert old.exists() and not new.exists()  # the call returned before the write
    io.teardown()
    assert events == [("written", "epoch1.ckpt", True)] and not old.exists()
    assert io.load_checkpoint(new)["state_dict"]["w"].tolist() == [1.0] * 4

    def full_disk(self, checkpoint, path, storage_options=None):
        time.sleep(0.3)  # the removal below is queued before the write fails
        raise CheckpointWriteError(OSError(errno.ENOSPC, "No space left on device"), f"checkpoint {Path(path).name}",
                                   tmp_path)

    monkeypatch.setattr(checkpointing.AtomicCheckpointIO, "save_checkpoint", full_disk)
    io.save_checkpoint(_ckpt(2.0), tmp_path / "epoch2.ckpt")
    io.remove_checkpoint(new)  # as ModelCheckpoint drops the file the failed one was to replace
    with pytest.raises(CheckpointWriteError, match="epoch2.ckpt"):
        io.teardown()
    assert io.load_checkpoint(new)["global_step"] == 1.0  # the checkpoints written before are intact, none removed


class _ScriptedMetric(L.LightningModule):
    """A tiny module whose val/acc per epoch is given: to steer which epochs improve the best-k."""

    def __init__(self, scores: list[float]) -> None:
        super().__init__()
        self.scores, self.layer = scores, torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def validation_step(self, batch, batch_idx):
        self.log("val/acc", self.scores[self.current_epoch])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("io", [AtomicCheckpointIO, AsyncAtomicCheckpointIO])
def test_last_checkpoint_links_the_best_file_of_its_own_step_only(tmp_path, io):
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(torch.randn(4, 2)), batch_size=2)
    seen = []

    class Inspect(L.Callback):
        def on_train_epoch_start(self, trainer, pl_module):  # the previous epoch's files are all written by now
            if trainer.current_epoch:
                trainer.strategy.checkpoint_io.teardown()  # the background writer: wait for pending writes
                last = tmp_path / "last.ckpt"
                best = {torch.load(f, weights_only=True)["global_step"]: f.stat().st_ino
                        for f in tmp_path.glob("epoch*.ckpt")}
                step = torch.load(last, weights_only=True)["global_step"]
                seen.append((step, last.stat().st_ino == best.get(step)))

    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="epoch{epoch}", monitor="val/acc", mode="max",
                                 save_top_k=1, save_last=True)
    trainer = L.Trainer(max_epochs=4, callbacks=[checkpoint, Inspect()], plugins=[io()], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(_ScriptedMetric([0.5, 0.7, 0.6, 0.8]), loader, loader)
    # Epochs 0 and 1 improve: last.ckpt is the best file of that step (one inode); epoch 2 does not improve, so
    # last.ckpt is written in full, with epoch 2's state, not linked to the older best file.
    assert seen == [(2, True), (4, True), (6, False)]
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 8


def test_a_resumed_fit_replaces_its_runs_last_checkpoint_not_beside_it(tmp_path):
    """last.ckpt is linked to the best-k file of its step after that file was written, so the state inside both names
    no last.ckpt. A fit resumed from it whose next validation does not improve the best-k writes last.ckpt in full:
    Lightning took the existing last.ckpt for another run's and wrote last-v1.ckpt beside it, leaving last.ckpt (the
    path the README resumes and evaluates from) a stale epoch behind."""
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(torch.randn(4, 2)), batch_size=2)
    scores = [0.5, 0.7, 0.6, 0.55]  # epochs 0 and 1 improve; 2 and 3 do not

    def fit(epochs: int, ckpt_path: str | None) -> None:
        checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="epoch{epoch}", monitor="val/acc", mode="max",
                                     save_top_k=1, save_last=True)
        trainer = L.Trainer(max_epochs=epochs, callbacks=[checkpoint], plugins=[AtomicCheckpointIO()], logger=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
        trainer.fit(_ScriptedMetric(scores), loader, loader, ckpt_path=ckpt_path)

    fit(1, None)
    # Resumed from last.ckpt: a link to epoch 0's file, to epoch 1's (saved by a resumed fit), then a file in full.
    for epochs in (2, 3, 4):
        fit(epochs, str(tmp_path / "last.ckpt"))
        assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == ["epochepoch=1.ckpt", "last.ckpt"]
        assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 2 * epochs


def test_nan_weights_are_never_written(tmp_path):
    io, path = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint(_ckpt(1.0), path)
    with pytest.raises(NonFiniteWeightsError, match="hold NaN"):
        io.save_checkpoint(_ckpt(float("nan")), path)
    assert torch.isfinite(io.load_checkpoint(path)["state_dict"]["w"]).all()
    io.save_checkpoint(_ckpt(float("-inf")), path)  # metric states such as MaxMetric's start at -inf: allowed


def test_truncated_last_checkpoint_falls_back_to_newest_intact(tmp_path, caplog):
    io = AtomicCheckpointIO()
    io.save_checkpoint(_ckpt(1.0), tmp_path / "step0000002.ckpt")
    io.save_checkpoint(_ckpt(2.0), tmp_path / "step0000004.ckpt")
    io.save_checkpoint(_ckpt(3.0), tmp_path / "last.ckpt")
    last = tmp_path / "last.ckpt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])  # a crash mid-write without atomic saves
    (tmp_path / "empty.ckpt").touch()
    with caplog.at_level("INFO"), warnings.catch_warnings():
        warnings.simplefilter("error")  # one plain line, not a Python warning with a source path
        plan = resolve_resume("last", tmp_path, auto_resume=False)
    assert plan.path == str(tmp_path / "step0000004.ckpt")
    assert (f"skipped {last}, which is unusable (truncated or not a checkpoint" in caplog.text
            and f"will be moved to last.ckpt.corrupt; continuing from {tmp_path / 'step0000004.ckpt'}" in caplog.text)
    assert set(plan.unusable) == {last, tmp_path / "empty.ckpt"}
    assert last.exists()  # choosing is read-only: every rank chooses at once; rank 0 tidies once they agree
    tidy_checkpoint_folders([tmp_path], plan.unusable)
    assert not last.exists() and (tmp_path / "last.ckpt.corrupt").is_file()  # moved aside, kept for inspection
    # An explicit broken path falls back too; auto_resume with no checkpoint folder starts from scratch.
    broken = tmp_path / "step0000006.ckpt"
    broken.write_bytes(b"PK\x03\x04")
    caplog.clear()
    with caplog.at_level("INFO"):
        assert resolve_resume(str(broken), tmp_path, auto_resume=False).path == str(tmp_path / "step0000004.ckpt")
    assert f"skipped {broken}, which is unusable" in caplog.text
    assert resolve_resume(None, tmp_path / "none", auto_resume=True).path is None


def test_tidying_removes_the_temporary_files_of_killed_writes_and_nothing_else(tmp_path):
    io = AtomicCheckpointIO()
    io.save_checkpoint(_ckpt(1.0), tmp_path / "last.ckpt")
    killed = [tmp_path / ".last.ckpt.tmp4242", tmp_path / ".epoch001-step0000004.ckpt.tmp17"]  # AtomicCheckpointIO's
    for path in killed:
        path.write_bytes(b"\0" * 4096)
    kept = [tmp_path / "last.ckpt", tmp_path / ".notes.tmpfile", tmp_path / "mine.ckpt.tmp12", tmp_path / ".hidden"]
    for path in kept[1:]:
        path.write_text("the user's")
    tidy_checkpoint_folders([tmp_path, tmp_path / "missing"])
    assert [p for p in killed if p.exists()] == []
    assert [p for p in kept if not p.exists()] == []


def _agreeing_rank(rank: int, port: int, folder: str) -> None:
    """Each rank chooses from its own folder (its working directory: the same relative path, another disk)."""
    os.chdir(Path(folder, f"view{rank}"))
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results = []
    for choices in (["step0000004.ckpt", "step0000002.ckpt"], ["step0000006.ckpt", None]):
        try:
            results.append(checkpointing.agree_on_resume(choices[rank]))
        except FileNotFoundError as err:
            results.append(f"error: {err}")
    Path(folder, f"rank{rank}.json").write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


def test_every_rank_follows_rank_zeros_resume_choice(tmp_path):
    """Two ranks that chose differently from their own view of the disk load rank 0's checkpoint; when one cannot
    read it, every rank stops with the same error naming that rank."""
    for rank, names in enumerate((["step0000002.ckpt", "step0000004.ckpt", "step0000006.ckpt"],
                                  ["step0000002.ckpt", "step0000004.ckpt"])):
        (tmp_path / f"view{rank}").mkdir()
        for name in names:
            (tmp_path / f"view{rank}" / name).touch()
    join_ranks(start_ranks(_agreeing_rank, (free_port(), str(tmp_path)), 2), 120, "the 2 ranks")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    blind = ("error: rank 0 resumes from step0000006.ckpt, which rank(s) 1 cannot read: the checkpoint folder must "
             "be on a disk that every node mounts at the same path")
    assert results == [["step0000004.ckpt", blind]] * 2


@pytest.mark.slow
def test_torchrun_ranks_with_different_views_of_the_folder_resume_from_one_checkpoint(tmp_path):
    """2 torchrun processes, each with its own run directory: rank 0's holds the whole run (a truncated last.ckpt,
    the temporary file of a killed write), rank 1's an older checkpoint only (a stale view from another node).
    Both resume from rank 0's newest intact checkpoint; rank 0 alone tidies its folder, after the ranks agreed."""
    data = make_image_folder(tmp_path / "images", {"a": 4, "b": 4}, size=32)
    common = ["--config", str(CONFIGS / "quickstart.yaml"), *TINY, "--data.root", str(data), "--data.batch_size", "2",
              "--trainer.precision", "32-true", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches",
              "1", "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false"]
    run_cli("fit", *common, "--trainer.max_epochs", "2", "--trainer.default_root_dir", str(tmp_path / "rank0"),
            env=cli_env())
    folder = tmp_path / "rank0" / "checkpoints"
    steps = {c: torch.load(c, weights_only=True, map_location="cpu")["global_step"] for c in folder.glob("*.ckpt")}
    assert max(steps.values()) == 4 and min(steps.values()) < 4, steps
    last = folder / "last.ckpt"
    truncated = last.read_bytes()[:1000]
    last.unlink()
    last.write_bytes(truncated)
    leftover = folder / ".last.ckpt.tmp999999"
    leftover.write_bytes(b"\0" * 4096)
    (tmp_path / "rank1" / "checkpoints").mkdir(parents=True)
    oldest = min(steps, key=steps.get)
    shutil.copy2(oldest, tmp_path / "rank1" / "checkpoints" / oldest.name)
    probe = tmp_path / "probe"
    proc = subprocess.run(
        [*torchrun("--nproc-per-node", "2", "--master-port", str(free_port()), module="tests.per_rank_run_dir"),
         str(tmp_path), "fit", *common, "--trainer.max_epochs", "3",
         "--trainer.devices", "2", "--trainer.strategy", "training.distributed.strategy.CompressedDDPStrategy",
         "--trainer.strategy.timeout_s", "60", "--trainer.callbacks+=tests.distributed_probe.Probe",
         f"--trainer.callbacks.out_dir={probe}", "--ckpt_path", "last"],
        cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    records = [torch.load(probe / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [r["start_step"] for r in records] == [4, 4]  # not 4 on rank 0 and rank 1's older step
    assert "rank 0's choice; rank(s) 1 saw" in log
    assert (folder / "last.ckpt.corrupt").read_bytes() == truncated and not leftover.exists()
    assert sorted(p.name for p in (tmp_path / "rank1" / "checkpoints").iterdir()) == [oldest.name]  # untouched


def test_crafted_pickle_is_refused_as_weights_and_as_checkpoint(tmp_path):
    marker = tmp_path / "pwned"
    evil = _evil_checkpoint(tmp_path / "evil.ckpt", marker)
    with pytest.raises(ValueError, match="refusing it"):
        BackboneWithHead(2, arch="resnet18", weights=str(evil), head_hidden=0, dropout=0.0)
    with pytest.raises(UnsafeCheckpointError, match=f"refusing to load {evil}"):
        AtomicCheckpointIO().load_checkpoint(evil)
    assert not marker.exists()


def test_pickle_planted_in_the_torch_hub_cache_is_refused(tmp_path, monkeypatch):
    """model.net.weights=IMAGENET1K_V1 reads $TORCH_HOME/hub/checkpoints/<file> itself, weights_only: torchvision's
    get_state_dict would unpickle whatever was dropped there."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    hub = tmp_path / "torch" / "hub" / "checkpoints"
    cached = hub / Path(torchvision.models.ResNet18_Weights.IMAGENET1K_V1.url).name
    cached.parent.mkdir(parents=True)
    marker = tmp_path / "pwned"
    torch.save({"conv1.weight": _Payload(marker)}, cached)
    with pytest.raises(ValueError, match=f"the cached file={cached} holds pickled objects beyond tensors"):
        BackboneWithHead(2, arch="resnet18", weights="IMAGENET1K_V1", head_hidden=0, dropout=0.0)
    assert not marker.exists()
    clean = torchvision.models.resnet18().state_dict()
    torch.save(clean, cached)  # a real weights file there is what offline machines use: it loads
    net = BackboneWithHead(2, arch="resnet18", weights="IMAGENET1K_V1", head_hidden=0, dropout=0.0)
    assert torch.equal(net.backbone.conv1.weight, clean["conv1.weight"])


def test_export_refuses_a_crafted_pickle_in_one_line(tmp_path, capsys):
    from deploy import export

    marker = tmp_path / "pwned"
    evil = _evil_checkpoint(tmp_path / "evil.ckpt", marker)
    with pytest.raises(SystemExit) as exited:
        export.main(["--ckpt_path", str(evil), "--out", str(tmp_path / "out")])
    assert exited.value.code == 2
    assert capsys.readouterr().err.startswith(f"imgcls export: error: refusing to load {evil}")
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


def test_nan_loss_stops_with_step_and_last_good_checkpoint(tmp_path):
    """A huge lr blows the weights up; the run stops at the first non-finite loss, and nothing NaN is on disk."""
    data = make_image_folder(tmp_path / "data", {"a": 8, "b": 8}, splits=("train", "val"), size=32)
    run = tmp_path / "run"
    proc = run_cli(
        "fit", *TINY, "--data.root", str(data), "--data.batch_size", "4", "--trainer.default_root_dir", str(run),
        "--trainer.max_epochs", "3", "--model.optimizer", "torch.optim.SGD", "--model.optimizer.lr", "1e12",
        "--model.recipe.lr_scaling", "none", "--model.lr_scheduler", "lightning_modules.schedules.WarmupCosine",
        "--model.lr_scheduler.warmup_epochs", "0",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        "--trainer.callbacks.every_n_train_steps", "1", check=False,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("imgcls: error: training loss is nan at step") or "loss is inf" in line, line
    named = Path(re.search(r"last good checkpoint: (\S+?)\. ", line).group(1))
    saved = sorted((run / "checkpoints").glob("*.ckpt"))
    assert named in saved, (named, saved)  # the run saved before the loss turned, and names what it saved
    for ckpt in saved:
        state = torch.load(ckpt, weights_only=True)["state_dict"]
        weights = {k: v for k, v in state.items() if k.startswith("net.") and v.is_floating_point()}
        assert weights and all(torch.isfinite(v).all() for v in weights.values()), ckpt


API_KEY = "wandb-secret-key-0123456789"
DB_URL = "postgresql://alice:hunter2-db-password@db:5432/optuna"
MASKED_URL = "postgresql://alice:***@db:5432/optuna"


def _strings(obj) -> list[str]:
    """Every string (keys included) in a checkpoint loaded with weights_only=True."""
    if isinstance(obj, (str, bytes)):
        return [obj if isinstance(obj, str) else obj.decode("latin-1")]
    if isinstance(obj, dict):
        return [s for k, v in obj.items() for s in _strings(k) + _strings(v)]
    if isinstance(obj, (list, tuple, set)):
        return [s for v in obj for s in _strings(v)]
    return []


@pytest.mark.parametrize("given", [
    "config file",
    "command line",  # wandb records sys.argv in its run (run-*.wandb): masked while the run starts
])
def test_no_secret_reaches_the_run_folder(tmp_path, given):
    """A database URL with a password in a config value and WANDB_API_KEY in the environment, with TensorBoard and
    wandb (offline) logging the run: neither secret may be written into the run folder.

    The URL travels where config values go: config.yaml, the config logged to both loggers, and the DataModule's
    hyperparameters (logged by Lightning and stored in every checkpoint). wandb itself reads the API key.
    """
    data = make_image_folder(tmp_path / "data", {"a": 4, "b": 4}, size=32)
    run = tmp_path / "run"
    if given == "config file":
        secrets = tmp_path / "secrets.yaml"
        secrets.write_text(yaml.safe_dump({"data": {"predict_dir": DB_URL}}))
        url_args = ["--config", str(secrets)]
    else:
        url_args = ["--data.predict_dir", DB_URL]
    run_cli("fit", "--config", str(CONFIGS / "quickstart.yaml"), "--config", str(CONFIGS / "loggers" / "wandb.yaml"),
            *url_args, *TINY, "--data.root", str(data), "--data.batch_size", "4", "--trainer.max_epochs", "1",
            "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(run),
            env=cli_env(WANDB_API_KEY=API_KEY, WANDB_MODE="offline", WANDB_SILENT="true"))
    checkpoints = sorted((run / "checkpoints").glob("*.ckpt"))
    wandb_run = next((run / "wandb").glob("offline-run-*/run-*.wandb"))
    # The URL did reach each place, masked: so the scan below looks where a leak would be.
    for blob in ((run / "config.yaml").read_bytes(), (run / "hparams.yaml").read_bytes(), wandb_run.read_bytes()):
        assert MASKED_URL.encode() in blob
    assert checkpoints and all(
        torch.load(c, weights_only=True)["datamodule_hyper_parameters"]["predict_dir"] == MASKED_URL
        for c in checkpoints)
    for f in (f for f in run.rglob("*") if f.is_file()):
        texts = (_strings(torch.load(f, weights_only=True)) if f.suffix == ".ckpt"
                 else [f.read_bytes().decode("latin-1")])
        leaks = [t[max(0, i - 80): i + 80] for t in texts for secret in ("hunter2", API_KEY)
                 if (i := t.find(secret)) >= 0]
        assert not leaks, f"{f} holds a secret: {leaks}"


# A user's own ModelCheckpoint, in the variants users write: (init_args, expected files after 3 epochs of 4 steps,
# with a validation at each epoch's end). Every file the configuration asks for must exist, and nothing else.
USER_CHECKPOINTS = {
    "every epoch, keep all": ({"every_n_epochs": 1, "save_top_k": -1, "filename": "e{epoch}"},
                              {"e0.ckpt", "e1.ckpt", "e2.ckpt"}),
    "every 2 epochs, last": ({"every_n_epochs": 2, "save_top_k": -1, "save_last": True, "filename": "e{epoch}"},
                             {"e1.ckpt", "last.ckpt"}),
    # steps 4, 8 and 12 end an epoch (a validation follows): saved all the same, once that validation has ended
    "every 2 steps": ({"every_n_train_steps": 2, "save_top_k": -1, "filename": "s{step}"},
                      {f"s{k}.ckpt" for k in (2, 4, 6, 8, 10, 12)}),
    "every 4 steps, last only": ({"every_n_train_steps": 4, "save_top_k": 0, "save_last": True}, {"last.ckpt"}),
    "monitored, best 1 and last": ({"monitor": "val/acc", "mode": "max", "save_top_k": 1, "save_last": True,
                                    "filename": "best"}, {"best.ckpt", "last.ckpt"}),
}


# Every key the variants set, at Lightning's default: each variant states its whole configuration (jsonargparse merges
# a list entry into an earlier config's entry of the same class at the same position).
CHECKPOINT_DEFAULTS = {"monitor": None, "mode": "min", "filename": None, "save_top_k": 1, "save_last": None,
                       "every_n_epochs": None, "every_n_train_steps": None, "train_time_interval": None,
                       "auto_insert_metric_name": False}


def test_users_own_model_checkpoints_save_what_they_ask_for(tmp_path, digits_root, caplog):
    """All the variants in one fit, each in a folder of its own (the combination users end up with)."""
    from training.cli.app import cli_main

    run = tmp_path / "run"
    folders = {variant: run / f"ckpts{i}" for i, variant in enumerate(USER_CHECKPOINTS)}
    overlay = tmp_path / "mine.yaml"
    overlay.write_text(yaml.safe_dump({"trainer": {"callbacks": [
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {**CHECKPOINT_DEFAULTS, "dirpath": str(folders[variant]), **init_args}}
        for variant, (init_args, _) in USER_CHECKPOINTS.items()]}}))
    with caplog.at_level(logging.INFO):
        cli = cli_main(["fit", "--config", str(CONFIGS / "quickstart.yaml"), "--config", str(overlay), *TINY,
                        "--data.root", str(digits_root), "--trainer.default_root_dir", str(run),
                        "--trainer.max_epochs", "3", "--trainer.limit_train_batches", "4",
                        "--trainer.limit_val_batches", "2", "--trainer.enable_progress_bar", "false"])
    assert cli.trainer.global_step == 12
    for variant, (_, expected) in USER_CHECKPOINTS.items():
        folder = folders[variant]
        assert {p.name for p in folder.glob("*.ckpt")} == expected, variant
        steps = {torch.load(p, weights_only=True, map_location="cpu")["global_step"] for p in folder.glob("s*.ckpt")}
        assert steps == {int(name[1:-5]) for name in expected if name.startswith("s")}  # each file is its step
    # The closing summary names only files that exist, and how many each callback's folder holds.
    summary = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("run directory"))
    named = [line.split()[2] for line in summary.splitlines()
             if line.startswith(("best checkpoint", "last checkpoint"))]
    assert named and all(Path(path).is_file() for path in named), summary
    for variant, (_, expected) in USER_CHECKPOINTS.items():
        assert f"{folders[variant]}: {len(expected)} file(s)" in summary


def test_a_users_own_model_checkpoint_is_kept_beside_the_runs(tmp_path, digits_root):
    """The run's checkpoints are its `checkpoint` key's; a training.callbacks.ModelCheckpoint the user lists is a
    second one, kept, not a replacement: both rank and save into <run>/checkpoints, each by its own metric, and the
    run's is trainer.checkpoint_callback (what the closing validation, the sweep and the summary read)."""
    from training.callbacks import StepCheckpoint
    from training.cli.app import cli_main

    mine = {"class_path": "training.callbacks.ModelCheckpoint",
            "init_args": {"monitor": "val/loss", "mode": "min", "save_top_k": 1, "filename": "loss-e{epoch}",
                          "auto_insert_metric_name": False}}
    overlay, run = tmp_path / "mine.yaml", tmp_path / "run"
    overlay.write_text(yaml.safe_dump({"trainer": {"callbacks+": [mine]}}))
    cli = cli_main(["fit", "--config", str(CONFIGS / "quickstart.yaml"), "--config", str(overlay), *TINY,
                    "--data.root", str(digits_root), "--trainer.default_root_dir", str(run),
                    "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "2",
                    "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false"])
    kept = [(type(c).__name__, c.monitor) for c in cli.trainer.checkpoint_callbacks]
    assert kept == [("ModelCheckpoint", "val/acc"), ("StepCheckpoint", None), ("ModelCheckpoint", "val/loss")]
    assert cli.trainer.checkpoint_callback.monitor == "val/acc"
    assert isinstance(cli.trainer.checkpoint_callbacks[1], StepCheckpoint)
    files = {p.name for p in (run / "checkpoints").glob("*.ckpt")}
    ours, theirs = cli.trainer.checkpoint_callbacks[0], cli.trainer.checkpoint_callbacks[2]
    assert {Path(ours.best_model_path).name, Path(theirs.best_model_path).name, "last.ckpt"} <= files
    assert [f for f in files if f.startswith("loss-e")] == [Path(theirs.best_model_path).name]  # its best 1
    states = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")["callbacks"]
    assert sorted(v["monitor"] for k, v in states.items() if k.startswith("ModelCheckpoint")) == ["val/acc", "val/loss"]


def test_a_second_writer_of_the_runs_last_ckpt_is_refused_in_one_line(tmp_path):
    """A listed ModelCheckpoint with save_last into the run's checkpoint folder would write last.ckpt beside the run's
    own: refused, naming the fix. Into another folder, or without save_last, or with the run's save_last off, it is
    kept after the run's."""
    from lightning.pytorch.callbacks import ModelCheckpoint as LightningCheckpoint

    from training.callbacks import StepCheckpoint
    from training.callbacks.model_checkpoint import Checkpointing
    from training.cli.app import run_checkpoints

    folder = tmp_path / "run" / "checkpoints"
    with pytest.raises(ValueError, match=r"^trainer.callbacks lists a ModelCheckpoint \(monitor val/loss\) that "
                                         r"writes last.ckpt into .*checkpoints, as the run's own checkpoints do"):
        run_checkpoints(Checkpointing(), folder, [LightningCheckpoint(dirpath=folder, monitor="val/loss",
                                                                      save_last=True)])
    for mine, keys in ((LightningCheckpoint(dirpath=tmp_path / "mine", save_last=True), Checkpointing()),
                       (LightningCheckpoint(dirpath=folder, save_last=False), Checkpointing()),
                       (LightningCheckpoint(dirpath=folder, save_last=True), Checkpointing(save_last=False))):
        kept = run_checkpoints(keys, folder, [mine])
        assert kept[-1] is mine and isinstance(kept[0], ModelCheckpoint) and isinstance(kept[1], StepCheckpoint)


def test_the_checkpoint_keys_set_what_the_run_keeps():
    """`checkpoint:` builds the run's callbacks: the best k by its monitor (the files named after it) with last.ckpt,
    and a step checkpoint every N steps; a 0 or false leaves its part out, all of them every callback."""
    from training.callbacks import StepCheckpoint
    from training.callbacks.model_checkpoint import Checkpointing

    best, steps = Checkpointing(monitor="val/loss", mode="min", save_top_k=3, every_n_train_steps=7).callbacks(
        Path("ckpts"))
    assert (best.monitor, best.mode, best.save_top_k, best.save_last) == ("val/loss", "min", 3, True)
    assert best.filename == "epoch{epoch:03d}-val_loss{val/loss:.4f}" and Path(best.dirpath).name == "ckpts"
    assert isinstance(steps, StepCheckpoint) and "'every_n_train_steps': 7" in steps.state_key
    assert (steps.save_top_k, steps.save_last, steps.filename) == (1, False, "step{step:07d}")
    assert [type(c).__name__ for c in Checkpointing(every_n_train_steps=0).callbacks(Path("c"))] == ["ModelCheckpoint"]
    assert [type(c).__name__ for c in Checkpointing(save_top_k=0, save_last=False).callbacks(Path("c"))] == [
        "StepCheckpoint"]
    assert Checkpointing(save_top_k=0, save_last=False, every_n_train_steps=0).callbacks(Path("c")) == []
    with pytest.raises(ValueError, match=r"checkpoint.every_n_train_steps=-1 must be >= 0"):
        Checkpointing(every_n_train_steps=-1)
    with pytest.raises(ValueError, match=r"checkpoint.mode='up' is unknown"):
        Checkpointing(mode="up")


def test_the_shipped_step_checkpoint_skips_the_steps_last_ckpt_holds(tmp_path, digits_root, monkeypatch):
    """The shipped callbacks, a step checkpoint every 2 steps of 2 epochs of 4: steps 2 and 6 are mid-epoch, each a
    step file; steps 4 and 8 end an epoch, whose validation writes last.ckpt of them, so no step file repeats it. A
    checkpoint every 2 steps all the same: a kill loses at most 2."""
    from training.cli.app import cli_main

    saved: list[tuple[str, int]] = []
    write = AtomicCheckpointIO.save_checkpoint

    def recording(self, checkpoint, path, storage_options=None):
        saved.append((Path(path).name, checkpoint["global_step"]))
        write(self, checkpoint, path, storage_options)

    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", recording)
    config, run = tmp_path / "config.yaml", tmp_path / "run"
    config.write_text(yaml.safe_dump(resume_config(every_n_train_steps=2)))
    cli = cli_main(["fit", "--config", str(config), "--data.root", str(digits_root), "--data.image_size", "32",
                    "--data.batch_size", "16", "--trainer.default_root_dir", str(run),
                    "--trainer.limit_train_batches", "4", "--trainer.limit_val_batches", "1"])
    assert cli.trainer.global_step == 8
    assert [(name, step) for name, step in saved if name.startswith("step")] == [("step0000002.ckpt", 2),
                                                                                 ("step0000006.ckpt", 6)], saved
    assert {step for _, step in saved} == {2, 4, 6, 8}, saved
    assert {p.name for p in (run / "checkpoints").glob("step*.ckpt")} == {"step0000006.ckpt"}
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")["global_step"] == 8


def test_resume_looks_in_every_checkpoint_folder_of_the_run(tmp_path):
    """A user's ModelCheckpoint writing to its own dirpath beside the run's checkpoints/ (where the shipped callback and
    the preemption save write): `last` takes the newest intact file of either, not only the first folder's."""
    io = AtomicCheckpointIO()
    mine, run = tmp_path / "mine", tmp_path / "checkpoints"
    io.save_checkpoint(_ckpt(1.0), mine / "epoch=0-step=2.ckpt")
    time.sleep(0.01)
    io.save_checkpoint(_ckpt(2.0), run / "preempted.ckpt")
    assert resolve_resume("last", [run, mine], auto_resume=False).path == str(run / "preempted.ckpt")
    assert resolve_resume("last", [mine, run], auto_resume=False).path == str(run / "preempted.ckpt")
    assert resolve_resume(None, [tmp_path / "none", mine], auto_resume=True).path == str(mine / "epoch=0-step=2.ckpt")
