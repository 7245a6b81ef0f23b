"""FSDP2 (training.distributed.fsdp.FSDP2Strategy, configs/fsdp.yaml): refusals and sharded-checkpoint handling in
one process; then 2 gloo CPU processes: sharding, equality with DDP, a sharded checkpoint and an exact resume."""

from __future__ import annotations

import os
import time
from functools import partial

import lightning as L
import pytest
import torch

from datamodules import ImageFolderDataModule
from deploy.export import load_for_export
from lightning_modules import BackboneWithHead, ImageClassifier, Levers
from lightning_modules.schedules import WarmupCosine
from tests.helpers import free_port, join_ranks, make_image_folder, start_ranks
from training.callbacks import FreezeBackbone, ModelCheckpoint
from training.distributed.fsdp import FSDP2Strategy, consolidate
from training.distributed.strategy import CompressedDDPStrategy
from training.resume import fault_callbacks
from training.resume.checkpoints import (
    NonFiniteWeightsError,
    checkpoint_problem,
    resolve_resume,
    tidy_checkpoint_folders,
)

BLOCK = "torchvision.models.resnet.Bottleneck"
ARCH = "resnet50"  # 25.6M parameters with the 1024 head: the kind of backbone FSDP is for, here at 32 px
STEPS, SAVE_AT = 4, 3  # 2 steps per epoch: epoch 0 trains the head alone (frozen backbone), epoch 1 everything


def _sharded_folder(path):
    """The files of a sharded checkpoint as FSDP2Strategy writes them, with stand-in contents."""
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"index")
    (path / "__0_0.distcp").write_bytes(b"shard")
    torch.save({"global_step": 3}, path / "meta.pt")
    return path


def test_sharded_checkpoint_folders_are_resumable_checked_and_tidied(tmp_path):
    folder = tmp_path / "checkpoints"
    good = _sharded_folder(folder / "step3.ckpt")
    assert checkpoint_problem(good) is None
    assert resolve_resume("last", folder, auto_resume=False).path == str(good)
    assert resolve_resume(str(good), folder, auto_resume=False).path == str(good)  # a folder is a --ckpt_path too
    (good / "meta.pt").write_bytes(b"truncated")
    assert "meta.pt: truncated" in checkpoint_problem(good)
    (tmp_path / "bare.ckpt").mkdir()
    assert "no .metadata" in checkpoint_problem(tmp_path / "bare.ckpt")
    # What a kill leaves of FSDP2Strategy.save_checkpoint: the folder being written, or the one being replaced.
    for leftover in (".last.ckpt.tmp123", ".last.ckpt.old123"):
        _sharded_folder(folder / leftover)
    tidy_checkpoint_folders([folder])
    assert sorted(p.name for p in folder.iterdir()) == ["step3.ckpt"]


def test_bad_settings_are_refused_naming_the_key(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"trainer.strategy.units: 'torchvision.models.resnet.Bottle' is not an "):
        FSDP2Strategy(units=["torchvision.models.resnet.Bottle"])
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    root = make_image_folder(tmp_path / "images", {"a": 2, "b": 2}, size=32)
    for strategy, impl, error in [
        (FSDP2Strategy(units=[BLOCK]), "foreach", r"trainer.strategy.units: no module of Bottleneck in this model; "
                                                  r"its block classes include BasicBlock"),
        (FSDP2Strategy(units=["torchvision.models.resnet.BasicBlock"]), "fused",
         "model.levers.optimizer_impl: fused SGD does not run on sharded"),
    ]:
        model = ImageClassifier(num_classes=2, net=partial(BackboneWithHead, arch="resnet18", head_hidden=0),
                                batch_size=2, levers=Levers(channels_last=False, optimizer_impl=impl))
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, limit_val_batches=0,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        with pytest.raises(ValueError, match=error):
            trainer.fit(model, datamodule=ImageFolderDataModule(str(root), batch_size=2, num_workers=0,
                                                                image_size=32))
    torch.distributed.destroy_process_group()


def test_a_sharded_checkpoint_is_renamed_into_place_and_never_holds_nan(tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    root = make_image_folder(tmp_path / "images", {"a": 2, "b": 2}, size=32)
    model = ImageClassifier(num_classes=2, net=partial(BackboneWithHead, arch="resnet18", head_hidden=0),
                            batch_size=2, levers=Levers(channels_last=False, optimizer_impl="foreach"))
    strategy = FSDP2Strategy(units=["torchvision.models.resnet.BasicBlock"])
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, limit_val_batches=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, datamodule=ImageFolderDataModule(str(root), batch_size=2, num_workers=0, image_size=32))
    path = tmp_path / "checkpoints" / "last.ckpt"
    for _ in range(2):  # a new folder, then one replacing it
        trainer.save_checkpoint(path)
        assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]  # no temporary or old folder left
        assert checkpoint_problem(path) is None and (path / "__0_0.distcp").is_file()
    # One file of it, for predict and export (which refuses the folder, naming this command): the same weights.
    with pytest.raises(ValueError, match=f"is a sharded checkpoint .*: python -m training.distributed.fsdp {path} "):
        load_for_export(path)
    single, _ = load_for_export(consolidate(path, tmp_path / "last-full.ckpt"))
    whole = _full_state(model)
    assert all(torch.equal(t, whole[name]) for name, t in _full_state(single).items())
    before = (path / ".metadata").stat().st_mtime_ns
    with torch.no_grad():
        model.net.head.weight.fill_(float("nan"))
    with pytest.raises(NonFiniteWeightsError, match=r"not writing .*last.ckpt: weight tensor\(s\) hold NaN \(first "
                                                    r"on this rank: net.head.weight\)"):
        trainer.save_checkpoint(path)
    assert (path / ".metadata").stat().st_mtime_ns == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]
    torch.distributed.destroy_process_group()


def _fit(root: str, run: str, strategy, ckpt_path: str | None = None, record: dict | None = None):
    """The CLI's fit (its fault callbacks, its ModelCheckpoint) shrunk: STEPS steps of 2 images per rank at 32 px,
    the production config's frozen first epoch, a checkpoint at step SAVE_AT. Returns the whole weights."""
    L.seed_everything(42)
    data = ImageFolderDataModule(root, batch_size=2, num_workers=0, image_size=32, preset="imagenet")
    model = ImageClassifier(num_classes=2, net=partial(BackboneWithHead, arch=ARCH, head_hidden=1024, dropout=0.2),
                            batch_size=2, lr_scheduler=partial(WarmupCosine, warmup_epochs=0.0),
                            levers=Levers(channels_last=False, compile=False, optimizer_impl="foreach"))  # fsdp.yaml's
    initial = _full_state(model)
    checkpoints = ModelCheckpoint(dirpath=f"{run}/checkpoints", filename="step{step}", every_n_train_steps=SAVE_AT,
                                  auto_insert_metric_name=False, save_top_k=-1)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision="32-true", max_steps=STEPS,
                        limit_train_batches=2, limit_val_batches=0, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=run,
                        callbacks=[checkpoints, FreezeBackbone(epochs=1), *fault_callbacks()])
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    if record is not None:
        params = list(model.parameters())
        record.update(initial=initial, all_dtensors=all(hasattr(p, "to_local") for p in params),
                      local_numel=sum(p.to_local().numel() for p in params), numel=sum(p.numel() for p in params),
                      placements={str(p.placements) for p in params})
    return _full_state(model)


def _full_state(model) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, whole (sharded ones gathered from all ranks)."""
    return {name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
            for name, t in [*model.named_parameters(), *model.named_buffers()]}


def _rank(local_rank: int, port: int, root: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(local_rank), NODE_RANK="0")
    torch.set_num_threads(1)
    record: dict = {"seconds": {}}
    states = {}
    for name, strategy, resume in [
        ("fsdp", FSDP2Strategy(units=[BLOCK], activation_checkpointing=[BLOCK], timeout_s=120), None),
        ("resumed", FSDP2Strategy(units=[BLOCK], activation_checkpointing=[BLOCK], timeout_s=120),
         f"{out}/fsdp/checkpoints/step{SAVE_AT}.ckpt"),
        ("ddp", CompressedDDPStrategy(timeout_s=120), None),
    ]:
        start = time.perf_counter()
        states[name] = _fit(root, f"{out}/{name}", strategy, resume, record if name == "fsdp" else None)
        record["seconds"][name] = round(time.perf_counter() - start, 1)
    fsdp, initial = states["fsdp"], record.pop("initial")
    record["trained"] = {n: not torch.equal(fsdp[n], initial[n])
                         for n in ("net.backbone.layer4.2.conv3.weight", "net.head.0.weight")}
    record["unlike_ddp"] = [n for n, v in fsdp.items() if not torch.allclose(v, states["ddp"][n], rtol=1e-5, atol=1e-6)]
    record["ddp_max_diff"] = max((v.double() - states["ddp"][n].double()).abs().max().item() for n, v in fsdp.items())
    record["unlike_resumed"] = [n for n, v in fsdp.items() if not torch.equal(v, states["resumed"][n])]
    torch.save(record, f"{out}/rank{local_rank}.pt")


@pytest.mark.slow
def test_fsdp2_on_two_cpu_processes_shards_equals_ddp_and_resumes_exactly(tmp_path):
    root = make_image_folder(tmp_path / "images", {"a": 8, "b": 8}, splits=("train",), size=32)
    out = tmp_path / "out"
    ranks = start_ranks(_rank, (free_port(), str(root), str(out)), 2)
    join_ranks(ranks, 300, "the 2 FSDP ranks")  # a rank's exception is raised here
    r0, r1 = (torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2))
    print("seconds per fit (rank 0):", r0["seconds"], "largest difference from DDP:", r0["ddp_max_diff"])

    # Sharded: every parameter is a DTensor split along dim 0, and each rank holds half of the 25.6M numbers.
    assert r0["all_dtensors"] and r0["placements"] == {"(Shard(dim=0),)"}
    assert r0["local_numel"] + r1["local_numel"] == r0["numel"] > 25e6
    assert abs(r0["local_numel"] - r0["numel"] / 2) < 0.001 * r0["numel"]

    for r in (r0, r1):
        # The frozen epoch left the backbone alone, the thawed one trained it; the head trained in both.
        assert r["trained"] == {"net.backbone.layer4.2.conv3.weight": True, "net.head.0.weight": True}
        # DDP's reference run: the same weights and BatchNorm statistics (FSDP2 reduce-scatters what DDP
        # all-reduces; measured bitwise equal).
        assert r["unlike_ddp"] == [], r["ddp_max_diff"]
        # Resumed from the sharded checkpoint of step SAVE_AT (after the thaw, mid-epoch): bitwise the uninterrupted
        # run's weights, statistics and batch counters.
        assert r["unlike_resumed"] == []

    # The checkpoint is a folder of each rank's shards (about half the bytes each), swapped into place whole.
    folder = out / "fsdp" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == [f"step{SAVE_AT}.ckpt"]
    shards = sorted((folder / f"step{SAVE_AT}.ckpt").glob("*.distcp"))
    assert [p.name for p in shards] == ["__0_0.distcp", "__1_0.distcp"]
    sizes = [p.stat().st_size for p in shards]
    assert min(sizes) > 0.45 * sum(sizes)
    assert checkpoint_problem(folder / f"step{SAVE_AT}.ckpt") is None
