"""The default network and the LightningModule: shapes, head, weights from files, freezing, lr scaling."""

from __future__ import annotations

import logging
import re
from functools import partial
from unittest import mock

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import torchvision
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from core.config_types import instantiate
from datamodules import ImageFolderDataModule
from lightning_modules import BackboneWithHead, ImageClassifier, Levers, Recipe
from lightning_modules.losses import BinaryCrossEntropy
from lightning_modules.mixing import batch_mix
from lightning_modules.optim import build_optimizer
from lightning_modules.schedules import WarmupCosine
from tests.helpers import make_image_folder
from training.callbacks import EMA, FreezeBackbone
from training.resume import LrPlanAcrossResumes


@pytest.mark.parametrize(("arch", "features"), [("resnet18", 512), ("resnet50", 2048)])
def test_head_is_pool_hidden_layer_classes(arch, features):
    net = BackboneWithHead(7, arch=arch, head_hidden=1024)
    linears = [m for m in net.head.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(features, 1024), (1024, 7)]
    assert any(isinstance(m, nn.ReLU) for m in net.head.modules())
    assert any(isinstance(m, nn.Dropout) for m in net.head.modules())
    assert isinstance(net.backbone.avgpool, nn.AdaptiveAvgPool2d)  # global average pool before the head
    assert isinstance(net.backbone.fc, nn.Identity) and net.head_modules() == [net.head]


@pytest.mark.parametrize(("arch", "head", "features"), [
    ("mobilenet_v3_small", "classifier.3", 1024),  # its classifier's 1024-wide layer stays, as backbone
    ("efficientnet_b0", "classifier.1", 1280),
    ("convnext_tiny", "classifier.2", 768),  # after its LayerNorm and Flatten
    ("regnet_x_400mf", "fc", 400),
])
def test_any_torchvision_classifier_gets_the_head_in_place_of_its_last_linear(arch, head, features):
    net = BackboneWithHead(5, arch=arch, head_hidden=32)
    assert isinstance(net.backbone.get_submodule(head), nn.Identity)  # its last Linear, dropped
    linears = [m for m in net.head.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(features, 32), (32, 5)]
    out = net.eval()(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 5) and torch.isfinite(out).all()
    model = ImageClassifier(num_classes=5, net=partial(BackboneWithHead, arch=arch, head_hidden=32),
                            optimizer=partial(torch.optim.SGD, lr=0.256),
                            recipe=Recipe(lr_scaling="none", backbone_lr_ratio=0.1))
    head_params = {id(p) for p in model.net.head.parameters()}
    for group in model.make_optimizer().param_groups:  # the head's lr, and the backbone's at 0.1 of it: nothing else
        assert group["lr"] == pytest.approx(0.256 if id(group["params"][0]) in head_params else 0.0256)
        assert {id(p) in head_params for p in group["params"]} == {id(group["params"][0]) in head_params}


def test_backbone_weights_of_another_model_family_load_and_its_classifier_does_not(tmp_path):
    source = torchvision.models.efficientnet_b0(weights=None)
    path = tmp_path / "efficientnet_b0.pth"
    torch.save(source.state_dict(), path)
    net = BackboneWithHead(3, arch="efficientnet_b0", weights=str(path), head_hidden=0)
    assert torch.equal(net.backbone.features[0][0].weight, source.features[0][0].weight)
    assert net.head.out_features == 3


def test_unknown_arch_suggests_close_names_and_a_model_without_linear_classifier_is_refused():
    with pytest.raises(ValueError, match="did you mean convnext_tiny"):
        BackboneWithHead(1000, arch="convnext_tiniest")
    with pytest.raises(ValueError, match="squeezenet1_0 has no Linear classifier"):
        BackboneWithHead(1000, arch="squeezenet1_0")


@pytest.mark.parametrize(("arch", "last"), [("resnet18", "bn2"), ("resnet50", "bn3"), ("resnext50_32x4d", "bn3")])
def test_a_resnet_from_scratch_starts_each_residual_block_as_the_identity_as_torchvision_and_timm_can(arch, last):
    blocks = (torchvision.models.resnet.BasicBlock, torchvision.models.resnet.Bottleneck)
    torch.manual_seed(0)
    net = BackboneWithHead(3, arch=arch)
    gammas = [getattr(m, last).weight for m in net.backbone.modules() if isinstance(m, blocks)]
    assert gammas and all(not g.any() for g in gammas)
    torch.manual_seed(0)  # the same draws as torchvision's own option: the plain loop's weights are imgcls's
    reference = torchvision.models.get_model(arch, weights=None, zero_init_residual=True)
    for name, tensor in net.backbone.state_dict().items():
        assert torch.equal(tensor, reference.state_dict()[name]), name
    off = BackboneWithHead(3, arch=arch, zero_init_residual=False)
    assert all(getattr(m, last).weight.eq(1).all() for m in off.backbone.modules() if isinstance(m, blocks))


def test_zero_init_residual_is_only_the_start_weights_replace_it_and_other_families_build_as_before(tmp_path):
    source = torchvision.models.resnet18(weights=None)
    path = tmp_path / "resnet18.pth"
    torch.save(source.state_dict(), path)
    net = BackboneWithHead(3, arch="resnet18", weights=str(path))
    assert torch.equal(net.backbone.layer1[0].bn2.weight, source.layer1[0].bn2.weight)  # ones: the file's
    torch.manual_seed(0)
    net = BackboneWithHead(3, arch="mobilenet_v3_small")  # no residual BatchNorm to zero: torchvision's own init
    torch.manual_seed(0)
    reference = torchvision.models.mobilenet_v3_small(weights=None)
    assert all(torch.equal(t, reference.state_dict()[k]) for k, t in net.backbone.state_dict().items())


def test_head_hidden_zero_is_a_single_linear_layer():
    net = BackboneWithHead(3, arch="resnet18", head_hidden=0)
    assert isinstance(net.head, nn.Linear) and (net.head.in_features, net.head.out_features) == (512, 3)


@pytest.mark.parametrize("channels_last", [False, True])
def test_forward_shape_and_finite(channels_last):
    model = ImageClassifier(num_classes=5, net=partial(BackboneWithHead, arch="resnet18"),
                            levers=Levers(channels_last=channels_last)).eval()
    with torch.no_grad():
        out = model(torch.randn(3, 3, 64, 64))
    assert out.shape == (3, 5) and out.dtype == torch.float32
    assert torch.isfinite(out).all()


def test_weights_from_torchvision_state_dict_file(tmp_path):
    source = torchvision.models.resnet18(weights=None)
    path = tmp_path / "resnet18.pth"
    torch.save(source.state_dict(), path)
    net = BackboneWithHead(4, arch="resnet18", weights=str(path))
    assert torch.equal(net.backbone.conv1.weight, source.conv1.weight)
    assert torch.equal(net.backbone.layer4[1].bn2.running_var, source.layer4[1].bn2.running_var)
    assert net.head[-1].out_features == 4  # the 1000-class classifier is not taken


def test_weights_from_a_project_checkpoint(tmp_path):
    trained = ImageClassifier(num_classes=3, net=partial(BackboneWithHead, arch="resnet18"))
    path = tmp_path / "run.ckpt"
    torch.save({"state_dict": trained.state_dict(), "hyper_parameters": dict(trained.hparams)}, path)
    net = BackboneWithHead(6, arch="resnet18", weights=str(path))
    assert torch.equal(net.backbone.layer1[0].conv1.weight, trained.net.backbone.layer1[0].conv1.weight)


def test_weights_from_a_checkpoint_of_the_layout_before_the_net_seam(tmp_path):
    """Checkpoints written before model.net: the torchvision model's own keys under `net.`, its head at `net.fc.`."""
    source = torchvision.models.resnet18(weights=None)
    source.fc = nn.Sequential(nn.Linear(512, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 3))
    path = tmp_path / "old.ckpt"
    torch.save({"state_dict": {f"net.{k}": v for k, v in source.state_dict().items()}}, path)
    net = BackboneWithHead(5, arch="resnet18", weights=str(path))
    assert torch.equal(net.backbone.layer4[1].conv2.weight, source.layer4[1].conv2.weight)
    assert net.head[-1].out_features == 5


def test_weights_for_another_arch_are_refused(tmp_path):
    path = tmp_path / "r18.pth"
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), path)
    with pytest.raises(ValueError, match="does not fit resnet50"):
        BackboneWithHead(1000, arch="resnet50", weights=str(path))


def test_missing_weights_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.pth does not exist"):
        BackboneWithHead(1000, arch="resnet18", weights=str(tmp_path / "nope.pth"))


def test_weights_name_loads_from_the_torch_hub_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    source = torchvision.models.resnet18(weights=None)
    cache = tmp_path / "hub" / "checkpoints"
    cache.mkdir(parents=True)
    torch.save(source.state_dict(), cache / "resnet18-f37072fd.pth")  # IMAGENET1K_V1's file name
    net = BackboneWithHead(1000, arch="resnet18", weights="IMAGENET1K_V1")
    assert torch.equal(net.backbone.conv1.weight, source.conv1.weight)


def test_weights_name_without_network_says_where_to_put_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))

    def offline(*args, **kwargs):
        raise OSError("[Errno 101] Network is unreachable")

    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    hub = tmp_path / "hub" / "checkpoints"
    with pytest.raises(RuntimeError, match="Network is unreachable") as err:
        BackboneWithHead(1000, arch="resnet50", weights="IMAGENET1K_V2")
    assert f"mkdir -p {hub} && cp resnet50-11ad3fa6.pth {hub}/" in str(err.value)
    assert not list(hub.glob("*.pth"))  # nothing half-written left to be read as weights


def test_unknown_weights_name_lists_the_choices():
    with pytest.raises(ValueError, match="IMAGENET1K_V1"):
        BackboneWithHead(1000, arch="resnet18", weights="IMAGENET9K")


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.AdamW, torch.optim.RMSprop])
def test_param_groups_skip_weight_decay_on_biases_and_norms(optimizer):
    model = ImageClassifier(num_classes=3, net=partial(BackboneWithHead, arch="resnet18"),
                            optimizer=partial(optimizer, lr=0.256, weight_decay=0.1),
                            recipe=Recipe(lr_scaling="none", backbone_lr_ratio=0.1))
    groups = model.make_optimizer().param_groups
    assert isinstance(model.make_optimizer(), optimizer) and len(groups) == 4
    assert sum(len(g["params"]) for g in groups) == len(list(model.net.parameters()))
    for g in groups:
        assert all(p.ndim > 1 for p in g["params"]) == (g["weight_decay"] == 0.1)
        assert g["lr"] == pytest.approx(0.256 if g["is_head"] else 0.0256)


def test_weight_decay_on_norms_and_biases_too_when_asked():
    model = ImageClassifier(num_classes=3, net=partial(BackboneWithHead, arch="resnet18"),
                            optimizer=partial(torch.optim.AdamW, lr=0.1, weight_decay=0.1),
                            recipe=Recipe(decay_norms_and_biases=True))
    groups = model.make_optimizer().param_groups
    assert len(groups) == 2 and all(g["weight_decay"] == 0.1 for g in groups)  # head and backbone


def test_the_optimizer_impl_lever_is_passed_where_the_optimizer_takes_it_and_the_config_left_it_unset():
    def built(optimizer, impl):
        model = ImageClassifier(num_classes=3, net=partial(BackboneWithHead, arch="resnet18", head_hidden=0),
                                optimizer=optimizer, levers=Levers(optimizer_impl=impl))
        return model.make_optimizer().defaults
    assert built(partial(torch.optim.SGD, lr=0.1), "fused")["fused"] is True
    assert built(partial(torch.optim.SGD, lr=0.1, fused=False), "fused")["foreach"] is True  # set: kept, foreach
    assert built(partial(torch.optim.RMSprop, lr=0.1), "fused")["foreach"] is True  # no fused kernel: foreach
    assert built(partial(torch.optim.AdamW, lr=0.1), "default")["fused"] is None
    assert built(lambda params: torch.optim.Adam(params, lr=0.1), "foreach")["foreach"] is None  # takes no kwargs


def test_under_a_grad_scaler_fused_sgd_skips_an_overflowing_first_step_and_then_trains_as_the_loop():
    """16-mixed's GradScaler skips the overflowing first steps of a run; torch's fused SGD left its momentum undefined
    on them (tests/test_internals.py) and an H100 fit was nan at step 3, so SGD was built with foreach, whose step
    synchronises the host with the GPU every step. Fused SGD now gets zero momentum where a step would allocate it: a
    fit whose first step overflows ends with the loop's weights, bitwise; fused AdamW skips such steps by itself. A
    CPU has no 16-mixed, so the CUDA plugin's GradScaler is given by hand."""
    import lightning as L
    from lightning.pytorch.plugins import MixedPrecision
    from torch.utils.data import DataLoader, TensorDataset

    def fit(optimizer, impl: str) -> tuple[torch.optim.Optimizer, dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        model = ImageClassifier(num_classes=3, net=partial(BackboneWithHead, arch="resnet18", head_hidden=8),
                                batch_size=4, optimizer=optimizer, levers=Levers(optimizer_impl=impl))
        # The first step overflows (skipped), the next ones do not: the scale falls from 2^100 to 1.
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100, backoff_factor=2.0**-100)
        trainer = L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
        data = TensorDataset(torch.randn(12, 3, 32, 32), torch.randint(0, 3, (12,)))
        trainer.fit(model, DataLoader(data, batch_size=4))
        assert scaler.get_scale() == 1.0  # one step skipped, two taken
        return trainer.optimizers[0], {k: v.detach().clone() for k, v in model.named_parameters()}

    sgd = partial(torch.optim.SGD, lr=0.1, momentum=0.9, nesterov=True)
    fused, fused_weights = fit(sgd, "fused")
    loop, loop_weights = fit(sgd, "foreach")
    assert fused.defaults["fused"] is True and loop.defaults["foreach"] is True
    assert all(torch.isfinite(v).all() for v in fused_weights.values())
    assert all(torch.equal(fused_weights[k], loop_weights[k]) for k in loop_weights)
    adamw, _ = fit(partial(torch.optim.AdamW, lr=0.1), "fused")  # fused AdamW skips those steps as it should
    assert adamw.defaults["fused"] is True


def test_fused_sgd_with_dampening_under_a_grad_scaler_gets_foreach_and_a_config_s_fused_is_kept(caplog):
    """A dampened momentum's first step is not a zero buffer's, so that SGD gets foreach kernels under a GradScaler,
    and says so; `fused: true` in the config is kept (it was given foreach too, and torch refused both)."""
    params = [{"params": [torch.nn.Parameter(torch.zeros(2))]}]
    dampened, note = build_optimizer(partial(torch.optim.SGD, lr=0.1, momentum=0.9, dampening=0.1), params, "fused",
                                     grad_scaler=True)
    assert dampened.defaults["foreach"] is True and not dampened.defaults["fused"]
    assert note.startswith("optimizer_impl foreach, not fused: torch's fused SGD leaves its momentum undefined")
    assert build_optimizer(partial(torch.optim.SGD, lr=0.1, momentum=0.9, dampening=0.1), params, "fused")[0].defaults[
        "fused"] is True  # no GradScaler: no skipped step
    own, note = build_optimizer(partial(torch.optim.SGD, lr=0.1, fused=True), params, "fused")
    assert own.defaults["fused"] is True and not own.defaults["foreach"] and note is None


def test_clipped_gradients_under_mixed_precision_get_foreach_kernels(caplog):
    """Lightning's mixed precision refuses to clip the gradients of a fused optimizer (it unscales them inside its
    step): trainer.gradient_clip_val under bf16-mixed stopped the first step with a traceback, as auto picks fused.
    Under mixed precision with clipping the optimizer gets foreach kernels and says so; without clipping, fused."""
    from torch.utils.data import DataLoader, TensorDataset

    def fit(clip: float | None) -> torch.optim.Optimizer:
        model = ImageClassifier(num_classes=3, net=partial(BackboneWithHead, arch="resnet18", head_hidden=8),
                                batch_size=4, optimizer=partial(torch.optim.AdamW, lr=0.01),
                                levers=Levers(optimizer_impl="fused"))
        trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, precision="bf16-mixed",
                            gradient_clip_val=clip)
        data = TensorDataset(torch.randn(4, 3, 32, 32), torch.randint(0, 3, (4,)))
        trainer.fit(model, DataLoader(data, batch_size=4))
        assert trainer.global_step == 1
        return trainer.optimizers[0]

    with caplog.at_level("INFO"):
        clipped = fit(1.0)
    assert clipped.defaults["foreach"] is True and not clipped.defaults["fused"]
    assert "optimizer_impl foreach, not fused: trainer.gradient_clip_val is set" in caplog.text
    assert fit(None).defaults["fused"] is True


@pytest.mark.parametrize(("scaling", "expected"), [("linear", 0.5), ("sqrt", 0.5**0.5), ("none", 1.0)])
def test_lr_scales_with_the_global_batch(scaling, expected):
    model = ImageClassifier(num_classes=3, net=partial(BackboneWithHead, arch="resnet18"), batch_size=64,
                            recipe=Recipe(lr_scaling=scaling))
    model.trainer = L.Trainer(accelerator="cpu", devices=1, accumulate_grad_batches=2, logger=False)
    assert model.lr_plan.scale(model.trainer) == pytest.approx(expected)  # global batch 1 x 64 x 2 = 128 images


def _fit(root, epochs: int | None = 1, callbacks=(), trainer_kwargs: dict | None = None, ckpt_path=None,
         **model_kwargs) -> tuple[ImageClassifier, dict[str, torch.Tensor]]:
    """Train 3 steps (of 4 images) per epoch."""
    L.seed_everything(0)
    dm = ImageFolderDataModule(root, batch_size=4, num_workers=0, preset="none", image_size=32)
    warmup = model_kwargs.pop("warmup_epochs", 0)
    model = ImageClassifier(num_classes=dm.num_classes, net=partial(BackboneWithHead, arch="resnet18", head_hidden=16),
                            **{"optimizer": partial(torch.optim.SGD, lr=1.0, momentum=0.9, nesterov=True),
                               "lr_scheduler": partial(WarmupCosine, warmup_epochs=warmup), **model_kwargs})
    before = {k: v.clone() for k, v in model.net.state_dict().items()}
    trainer = L.Trainer(accelerator="cpu", max_epochs=epochs, limit_train_batches=3, limit_val_batches=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=list(callbacks), **(trainer_kwargs or {}))
    trainer.fit(model, dm, ckpt_path=ckpt_path)
    return model, before


class _BackwardThrough(Callback):
    """Per epoch: backward passes through the backbone's first block, and the backbone parameters that have an
    optimizer state at the epoch's end."""

    def __init__(self) -> None:
        self.backward, self.with_state = [], []

    def on_fit_start(self, trainer, pl_module) -> None:
        pl_module.net.backbone.layer1.register_full_backward_hook(lambda *args: self.backward.__setitem__(-1,
                                                                                                 self.backward[-1] + 1))

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.backward.append(0)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        state = trainer.optimizers[0].state
        self.with_state.append(sum(1 for n, p in pl_module.net.named_parameters() if not n.startswith("head.")
                                   and state.get(p)))


def test_frozen_backbone_stays_fixed_while_the_head_learns(tmp_path):
    make_image_folder(tmp_path, {"a": 6, "b": 6}, size=32)
    probe = _BackwardThrough()
    model, before = _fit(tmp_path, callbacks=[FreezeBackbone(epochs=1), probe])
    after = model.net.state_dict()
    backbone = [k for k in before if not k.startswith("head.")]
    assert all(torch.equal(before[k], after[k]) for k in backbone)  # weights and BatchNorm statistics
    assert not torch.equal(before["head.0.weight"], after["head.0.weight"])
    # Really frozen: no backward pass through it, no momentum built up for it (only its learning rate at 0 before)
    assert probe.backward == [0] and probe.with_state == [0]

    probe = _BackwardThrough()
    model, before = _fit(tmp_path, epochs=2, callbacks=[FreezeBackbone(epochs=1), probe])
    assert probe.backward[0] == 0 and probe.backward[1] > 0  # thawed at epoch 1
    assert probe.with_state[0] == 0 and probe.with_state[1] > 0
    assert not torch.equal(before["backbone.conv1.weight"], model.net.state_dict()["backbone.conv1.weight"])

    model, before = _fit(tmp_path, callbacks=[FreezeBackbone(epochs=0)])
    assert not torch.equal(before["backbone.conv1.weight"], model.net.state_dict()["backbone.conv1.weight"])


class HeadLrFactors(Callback):
    """The head's learning rate as a fraction of its peak, before each step and after the last one."""

    def __init__(self) -> None:
        self.factors: list[float] = []

    def _record(self, trainer) -> None:
        group = next(g for g in trainer.optimizers[0].param_groups if g["is_head"])
        self.factors.append(group["lr"] / group["initial_lr"])

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._record(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self._record(trainer)


def test_lr_warms_up_linearly_then_decays_to_zero_on_a_cosine(tmp_path):
    make_image_folder(tmp_path, {"a": 6, "b": 6}, size=32)
    lr = HeadLrFactors()
    _fit(tmp_path, epochs=2, callbacks=[lr], warmup_epochs=1)
    # 6 steps, 3 of warm-up: (step + 1) / 3 up to the peak at the end of warm-up, then 0.5 * (1 + cos(pi * t)) with
    # t = (step - 3) / 3, reaching 0 after the last step.
    assert lr.factors == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0, 0.75, 0.25, 0.0])


def test_warm_up_epochs_are_loader_epochs_under_max_steps(tmp_path):
    """max_steps without max_epochs: an epoch is still one pass over the loader, not the whole run."""
    make_image_folder(tmp_path, {"a": 6, "b": 6}, size=32)
    lr = HeadLrFactors()
    _fit(tmp_path, epochs=None, callbacks=[lr], trainer_kwargs={"max_steps": 7}, warmup_epochs=1)
    # 3 steps per epoch (12 images, batch 4 after the val split), so 3 warm-up steps of the 7, then the cosine.
    assert lr.factors[:4] == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0])


def test_resuming_on_another_global_batch_rescales_the_learning_rate(tmp_path, caplog):
    """Accumulating 2 batches after a checkpoint taken with 1 doubles the global batch: the restored optimizer and
    schedule states are rescaled (linear scaling x2) by the callback the CLI adds to every run, and the run says so."""
    make_image_folder(tmp_path, {"a": 6, "b": 6}, size=32)
    first, _ = _fit(tmp_path, epochs=1, callbacks=[LrPlanAcrossResumes()])
    ckpt = tmp_path / "one.ckpt"
    first.trainer.save_checkpoint(ckpt)
    with caplog.at_level(logging.INFO):
        second, _ = _fit(tmp_path, epochs=2, trainer_kwargs={"accumulate_grad_batches": 2}, ckpt_path=ckpt,
                         callbacks=[LrPlanAcrossResumes()])
    base = second.trainer.optimizers[0].param_groups[-1]["initial_lr"]
    assert base == pytest.approx(first.trainer.optimizers[0].param_groups[-1]["initial_lr"] * 2)
    assert second.trainer.lr_scheduler_configs[0].scheduler.state_dict()["base_lrs"][-1] == pytest.approx(base)
    assert "learning rates rescaled x2 (linear scaling" in caplog.text


def test_predict_returns_a_result_for_every_image(tmp_path):
    for i in range(7):
        (tmp_path / "imgs" / f"d{i % 2}").mkdir(parents=True, exist_ok=True)
        image = torchvision.transforms.functional.to_pil_image(torch.rand(3, 40, 40))
        image.save(tmp_path / "imgs" / f"d{i % 2}" / f"{i}.png")
    dm = ImageFolderDataModule(None, batch_size=3, num_workers=0, image_size=32, predict_dir=str(tmp_path / "imgs"))
    model = ImageClassifier(num_classes=3, net=partial(BackboneWithHead, arch="resnet18"),
                            class_names=["cat", "dog", "eel"])
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    batches = trainer.predict(model, dm)
    assert sum(len(b["index"]) for b in batches) == 7
    assert sorted(int(i) for b in batches for i in b["index"]) == list(range(7))
    for b in batches:
        assert all(name in ("cat", "dog", "eel") for name in b["class_name"])
        assert torch.all((b["confidence"] > 0) & (b["confidence"] <= 1))
        assert torch.allclose(b["top5_probs"][:, 0], b["confidence"])
        assert b["top5_labels"].shape[1] == 3  # top-k capped at the number of classes


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"optimizer": partial(torch.optim.SGD, lr=-0.1)}, "model.optimizer (SGD): Invalid learning rate: -0.1"),
        ({"optimizer": "adam"}, "model.optimizer='adam' is not a class_path: give the class, e.g. torch.optim.AdamW"),
        ({"net": partial(BackboneWithHead, arch="resnet51")},
         "model.net.arch='resnet51' is not a torchvision classification model; did you mean"),
        ({"class_names": ["a"]}, "model.class_names has 1 names but model.num_classes=3"),
    ],
)
def test_bad_model_arguments_name_the_key(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ImageClassifier(num_classes=3, **{"net": partial(BackboneWithHead, arch="resnet18"), **kwargs})


def test_the_printed_learning_rate_is_the_scaled_peak_not_the_first_warm_up_step(caplog):
    model = ImageClassifier(num_classes=3, net=partial(BackboneWithHead, arch="resnet18"), batch_size=64,
                            optimizer=partial(torch.optim.AdamW, lr=0.016),
                            lr_scheduler=partial(WarmupCosine, warmup_epochs=1))
    model.trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False)
    # 20 steps over 2 epochs: 10 per epoch, so warmup_epochs=1 is 10 warm-up steps.
    with mock.patch.object(type(model.trainer), "estimated_stepping_batches", 20), caplog.at_level(logging.INFO):
        config = model.configure_optimizers()
    assert config["optimizer"].param_groups[-1]["lr"] == pytest.approx(0.004 / 10)  # step 0 of 10 warm-up steps
    assert "AdamW lr 0.016 per 256 images x 0.25" in caplog.text
    assert "= 0.004 for the head (peak); WarmupCosine over 20 steps, 10 of warm-up" in caplog.text


def _soft(y: torch.Tensor, classes: int) -> torch.Tensor:
    return F.one_hot(y, classes).float()


def test_mixup_mixes_the_images_and_the_labels_with_one_weight():
    torch.manual_seed(0)
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 1])
    mixed, soft = batch_mix(3, mixup_alpha=0.2, cutmix_alpha=0.0)(x, y)
    lam = soft[0, 0]  # sample 0 (class 0) is mixed with the batch rolled by one: sample 3 (class 1)
    assert 0 < lam < 1
    torch.testing.assert_close(mixed, lam * x + (1 - lam) * x.roll(1, 0))
    torch.testing.assert_close(soft, lam * _soft(y, 3) + (1 - lam) * _soft(y.roll(1, 0), 3))


def test_cutmix_pastes_one_box_and_weights_the_labels_by_its_area():
    torch.manual_seed(1)
    x, y = torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 1])
    mixed, soft = batch_mix(3, mixup_alpha=0.0, cutmix_alpha=1.0)(x, y)
    pasted = (mixed == x.roll(1, 0)).all(dim=1)  # (B, H, W): pixels that came from the rolled batch
    assert ((mixed == x).all(dim=1) | pasted).all()  # every pixel is one image's or the other's
    area = pasted[0].float().mean()
    assert 0 < area < 1 and (pasted == pasted[0]).all()  # one box, the same for the whole batch
    torch.testing.assert_close(soft, (1 - area) * _soft(y, 3) + area * _soft(y.roll(1, 0), 3))


def test_with_both_on_each_batch_gets_mixup_or_cutmix():
    mix, x, y = batch_mix(3, mixup_alpha=0.2, cutmix_alpha=1.0), torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 1])
    kinds = set()
    for seed in range(20):
        torch.manual_seed(seed)
        mixed, _ = mix(x, y)
        kinds.add("cutmix" if ((mixed == x).all(dim=1) | (mixed == x.roll(1, 0)).all(dim=1)).all() else "mixup")
    assert kinds == {"mixup", "cutmix"}
    assert batch_mix(3, 0.0, 0.0) is None


def test_a_fit_with_mixup_and_cutmix_trains_on_mixed_batches():
    x, y = torch.randn(8, 3, 16, 16), torch.arange(8) % 2
    model = ImageClassifier(num_classes=2, net=partial(BackboneWithHead, arch="resnet18", head_hidden=8),
                            batch_size=4, recipe=Recipe(mixup_alpha=0.2, cutmix_alpha=1.0),
                            levers=Levers(channels_last=False))
    seen = []
    model.net.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach().clone()))
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=4))
    assert len(seen) == 2 and not any(torch.equal(s, x[:4]) or torch.equal(s, x[4:]) for s in seen)
    assert torch.isfinite(trainer.callback_metrics["train/loss"])


class _ValidationWeights(Callback):
    """Listed after the EMA callback: sees the weights validation runs with, and the ones training left."""

    def __init__(self, ema) -> None:
        self.ema, self.seen = ema, []

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:  # the EMA callback has swapped the averaged weights in
            swapped_out = self.ema._average_model.module.state_dict()  # swapped back at the end of validation
            self.seen.append(({k: v.clone() for k, v in pl_module.state_dict().items()},
                              {k: v.clone() for k, v in swapped_out.items()}))


def test_ema_weights_are_validated_and_saved_the_trained_ones_kept(tmp_path):
    """training.callbacks.EMA (Lightning's WeightAveraging) in the callbacks: validation runs with the averaged
    weights, which differ from the trained ones; a checkpoint holds the averaged weights as its state_dict and the
    trained ones beside."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(0)
    x, y = torch.randn(16, 3, 16, 16), torch.arange(16) % 2
    model = ImageClassifier(num_classes=2, net=partial(BackboneWithHead, arch="resnet18", head_hidden=8),
                            batch_size=4, levers=Levers(channels_last=False))
    ema = EMA(decay=0.5, update_starting_at_step=0)  # averaging from the first step, the warm-up's included
    recorder = _ValidationWeights(ema)
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[ema, recorder, ModelCheckpoint(dirpath=tmp_path, save_last=True)])
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    trainer.fit(model, loader, loader)
    (validated, trained), = recorder.seen
    key = "net.head.3.weight"
    averaged = {k.removeprefix("module."): v for k, v in ema._average_model.state_dict().items()}
    assert torch.equal(validated[key], averaged[key])  # what validation ran with is the average...
    assert not torch.equal(validated[key], trained[key])  # ...not the trained weights
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert torch.equal(saved["state_dict"][key], averaged[key])
    assert torch.equal(saved["current_model_state"][key], trained[key])


@pytest.mark.parametrize(("arch", "head", "features"), [("timm/resnet18", "fc", 512),
                                                          ("timm/convnext_atto", "head.fc", 320)])
def test_timm_models_get_the_same_head_in_place_of_their_named_classifier(arch, head, features):
    net = BackboneWithHead(3, arch=arch, head_hidden=16)
    assert isinstance(net.backbone.get_submodule(head), nn.Identity)
    linears = [m for m in net.head.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(features, 16), (16, 3)]
    assert net.eval()(torch.randn(2, 3, 32, 32)).shape == (2, 3)


def test_timm_weights_from_a_safetensors_file_load_the_backbone_only(tmp_path):
    import timm
    from safetensors.torch import save_file

    source = timm.create_model("resnet18", pretrained=False)
    path = tmp_path / "model.safetensors"
    save_file(source.state_dict(), path)
    net = BackboneWithHead(4, arch="timm/resnet18", weights=str(path), head_hidden=0)
    assert torch.equal(net.backbone.conv1.weight, source.conv1.weight)
    assert net.head.out_features == 4


def test_timm_pretrained_weights_without_network_name_the_file_to_fetch(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import: the variable is too late
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"download https://huggingface.co/timm/resnet18\.a1_in1k/resolve/main/"
                                           r"model\.safetensors and pass model\.net\.weights="):
        BackboneWithHead(1000, arch="timm/resnet18.a1_in1k", weights="DEFAULT")


def test_timm_names_are_checked_and_timm_is_optional(monkeypatch):
    with pytest.raises(ValueError, match="did you mean timm/resnet18"):
        BackboneWithHead(1000, arch="timm/resnet18x")
    monkeypatch.setitem(__import__("sys").modules, "timm", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'imgcls\[timm\]'"):
        BackboneWithHead(1000, arch="timm/resnet18")


def test_bce_loss_scores_each_class_against_the_smoothed_or_mixed_targets():
    model = ImageClassifier(num_classes=4, net=partial(BackboneWithHead, arch="resnet18", head_hidden=0),
                            loss=BinaryCrossEntropy(label_smoothing=0.2))
    logits, y = torch.randn(3, 4), torch.tensor([0, 3, 1])
    expected = F.binary_cross_entropy_with_logits(logits, F.one_hot(y, 4).float() * 0.8 + 0.05)
    torch.testing.assert_close(model.loss(logits, y), expected)
    soft = torch.tensor([[0.7, 0.3, 0.0, 0.0]] * 3)  # a mixed batch's targets
    torch.testing.assert_close(model.loss(logits, soft), F.binary_cross_entropy_with_logits(logits, soft * 0.8 + 0.05))
    ce = ImageClassifier(num_classes=4, net=partial(BackboneWithHead, arch="resnet18", head_hidden=0),
                         loss=torch.nn.CrossEntropyLoss(label_smoothing=0.2))
    torch.testing.assert_close(ce.loss(logits, y), F.cross_entropy(logits, y, label_smoothing=0.2))


def test_bce_target_threshold_binarises_the_mixed_targets_as_rsb_does():
    model = ImageClassifier(num_classes=4, net=partial(BackboneWithHead, arch="resnet18", head_hidden=0),
                            loss=BinaryCrossEntropy(target_threshold=0.2))
    logits = torch.randn(2, 4)
    mixed = torch.tensor([[0.85, 0.15, 0.0, 0.0], [0.0, 0.5, 0.5, 0.0]])  # mixup's weights 0.85/0.15 and 0.5/0.5
    binary = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0]])
    torch.testing.assert_close(model.loss(logits, mixed), F.binary_cross_entropy_with_logits(logits, binary))
    with pytest.raises(ValueError, match=r"model.loss.target_threshold=1.5 must be in \[0, 1\)"):
        BinaryCrossEntropy(target_threshold=1.5)


def test_lamb_is_timms_and_trains_with_the_projects_parameter_groups():
    from timm.optim import Lamb

    x, y = torch.randn(8, 3, 16, 16), torch.arange(8) % 2
    model = ImageClassifier(num_classes=2, net=partial(BackboneWithHead, arch="resnet18", head_hidden=8),
                            optimizer=partial(Lamb, lr=0.008), loss=BinaryCrossEntropy(), batch_size=4,
                            lr_scheduler=partial(WarmupCosine, warmup_epochs=0), recipe=Recipe(lr_scaling="none"),
                            levers=Levers(channels_last=False))
    before = model.net.head[0].weight.detach().clone()
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=4))
    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, Lamb) and len(optimizer.param_groups) == 4
    assert [g["initial_lr"] for g in optimizer.param_groups] == pytest.approx([0.008] * 4)
    assert not torch.equal(model.net.head[0].weight, before) and torch.isfinite(trainer.callback_metrics["train/loss"])


def test_a_network_from_the_cli_holds_plain_numbers():
    """The CLI parses model.net's numbers into jsonargparse's restricted int and float subclasses; the network's
    modules must hold plain ones: with the subclass as Dropout's p, torch.compile of torch 2.11 broke the compiled
    forward in two at the head (seen on an H200)."""
    net = instantiate(nn.Module, {"class_path": "lightning_modules.network.BackboneWithHead",
                                  "init_args": {"num_classes": 3, "arch": "resnet18", "head_hidden": 8,
                                                "dropout": 0.2}})
    numbers = {f"{name}.{key}": type(value) for name, module in net.named_modules()
               for key, value in vars(module).items() if isinstance(value, int | float) and not isinstance(value, bool)}
    assert numbers["head.2.p"] is float and numbers["head.0.out_features"] is int
    assert {kind for kind in numbers.values()} <= {int, float}, numbers


def test_the_progress_bar_shows_a_host_copy_of_the_loss_and_the_loggers_get_every_step():
    """The bar's `loss` is a CPU tensor (Lightning reads a bar's values after every step: on a GPU that read of the
    device's loss would wait for the step; tests/test_cuda.py checks the GPU's side), copied every step on a CPU;
    train/loss stays the device's tensor, for the loggers, out of the bar."""
    model = ImageClassifier(num_classes=2, net=partial(BackboneWithHead, arch="resnet18", head_hidden=8), batch_size=4)
    losses = []

    class Losses(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer = L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Losses()])
    trainer.fit(model, DataLoader(TensorDataset(torch.randn(12, 3, 16, 16), torch.arange(12) % 2), batch_size=4))
    assert set(trainer.progress_bar_metrics) == {"loss"} and model._bar_loss.device.type == "cpu"
    assert trainer.progress_bar_metrics["loss"] == pytest.approx(losses[-1])
    assert float(trainer.callback_metrics["train/loss"]) == pytest.approx(losses[-1])

    class DeviceLoss:  # a GPU's loss, as far as show_loss sees it: each copy to the host counted
        device = torch.device("cuda")

        def __init__(self, value: float) -> None:
            self.value = value

        def detach(self):
            return self

        def to(self, device):
            copies.append(self.value)
            return torch.tensor(self.value)

    copies, shown = [], []
    steps = L.Trainer(log_every_n_steps=5, logger=False)
    with mock.patch.object(type(model), "trainer", new_callable=mock.PropertyMock, return_value=steps), \
            mock.patch.object(model, "log", lambda name, value, **kwargs: shown.append(float(value))):
        model._bar_loss = None
        for step in range(12):  # global_step, as the Trainer counts it
            steps.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total.completed = step
            model.show_loss(DeviceLoss(float(step)))
    assert copies == [0.0, 5.0, 10.0]  # on a GPU the host waits for a step only every log_every_n_steps steps
    assert shown == [0.0] * 5 + [5.0] * 5 + [10.0] * 2
