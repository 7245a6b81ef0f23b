"""The speed levers follow the hardware: each rule under both CPU kinds and CUDA (the capability mocked), the
Trainer's `precision: auto`, explicit values obeyed, and the model and loaders resolving `auto` on a real fit."""

from __future__ import annotations

import logging
import typing
import warnings
from functools import partial

import lightning as L
import pytest
import torch
from lightning.pytorch.accelerators import CUDAAccelerator, MPSAccelerator

from core import hardware
from datamodules import ImageFolderDataModule
from lightning_modules import BackboneWithHead, ImageClassifier, Levers
from lightning_modules.settings import resolve_levers
from training.trainer import Trainer, device_type

AVX2_CPU = hardware.Hardware("AMD EPYC 7B12", frozenset({"avx2"}), cores=2)
BF16_CPU = hardware.Hardware("AMD EPYC 9B14", frozenset({"avx2", "avx512f", "avx512_bf16"}), cores=2)
AMX_CPU = hardware.Hardware("Intel Xeon 8481C", frozenset({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}),
                            cores=4)
ARM_CPU = hardware.Hardware("Neoverse-V1", frozenset(), cores=2, machine="aarch64")
H100 = hardware.Hardware("AMD EPYC 9454", frozenset({"avx2", "avx512f", "avx512_bf16"}), cores=16,
                         cuda="NVIDIA H100 80GB HBM3", triton=True)


@pytest.fixture
def machine(monkeypatch):
    """Pretend to run on `hw`: every lever rule reads hardware.detect()."""
    def use(hw: hardware.Hardware) -> hardware.Hardware:
        monkeypatch.setattr(hardware, "detect", lambda: hw)
        return hw
    return use


def test_cpuinfo_flags_are_read_and_described(monkeypatch, tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9B14\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n"
                       "processor\t: 1\nmodel name\t: AMD EPYC 9B14\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n")
    real_path = hardware.Path
    monkeypatch.setattr(hardware, "Path", lambda p: real_path(cpuinfo) if p == "/proc/cpuinfo" else real_path(p))
    model, flags = hardware._cpuinfo()
    assert (model, flags) == ("AMD EPYC 9B14", frozenset({"avx2", "avx512f", "avx512_bf16"}))
    assert BF16_CPU.native_bf16 and AMX_CPU.native_bf16 and not AVX2_CPU.native_bf16 and not ARM_CPU.native_bf16
    assert AVX2_CPU.describe() == "AMD EPYC 7B12 (avx2, no avx512_bf16/amx), 2 cores, no CUDA"
    assert BF16_CPU.describe() == "AMD EPYC 9B14 (avx2, avx512f, avx512_bf16), 2 cores, no CUDA"
    assert (AVX2_CPU.cpu_kind(), BF16_CPU.cpu_kind(), ARM_CPU.cpu_kind()) == ("AVX2 CPU", "bf16 CPU", "aarch64 CPU")


def test_this_machine_is_detected_once_and_consistently():
    hw = hardware.detect()
    assert hw is hardware.detect()  # cached: /proc/cpuinfo is read once per process
    assert hw.cores >= 1 and hw.cpu_model
    assert (hw.cuda is not None) == torch.cuda.is_available()
    if "avx512_bf16" in hw.cpu_flags:  # torch's own probe must agree with ours where it is public enough to ask
        assert torch.backends.cpu.get_cpu_capability().startswith("AVX512")


@pytest.mark.parametrize(("hw", "device", "expected"), [
    (AVX2_CPU, "cpu", "32-true"),
    (ARM_CPU, "cpu", "32-true"),
    (BF16_CPU, "cpu", "bf16-mixed"),
    (AMX_CPU, "cpu", "bf16-mixed"),
    (H100, "cuda", "16-mixed"),
    (AVX2_CPU, "mps", "32-true"),
])
def test_precision_follows_the_capability(hw, device, expected):
    precision, why = hardware.choose_precision(hw, device)
    assert precision == expected
    assert precision in _all_precisions()
    assert ("no native bf16" in why) == (device == "cpu" and not hw.native_bf16)


def _all_precisions() -> set[str]:
    """The values lightning.Trainer's `precision` takes, read from its signature."""
    values = set()
    for arg in typing.get_args(typing.get_type_hints(L.Trainer.__init__)["precision"]):
        values.update(str(a) for a in typing.get_args(arg))
    return values


def test_lightnings_precision_values_include_the_ones_chosen():
    assert {"32-true", "16-mixed", "bf16-mixed"} <= _all_precisions()


@pytest.mark.parametrize(("hw", "expected"), [(AVX2_CPU, "32-true"), (BF16_CPU, "bf16-mixed")])
def test_trainer_auto_precision_is_resolved_and_announced(machine, caplog, hw, expected):
    machine(hw)
    with caplog.at_level(logging.INFO):
        trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
    assert trainer.precision == expected
    announced = [r.getMessage() for r in caplog.records if r.getMessage().startswith("precision: ")]
    assert announced == [f"precision: {expected} ({hardware.choose_precision(hw, 'cpu')[1]})"]


@pytest.mark.parametrize(("hw", "precision", "warns"), [
    (AVX2_CPU, "bf16-mixed", True),   # forced bf16 on emulated bf16: obeyed, with the cost
    (AVX2_CPU, "16-mixed", True),     # Lightning runs this as bf16-mixed on a CPU: the same cost
    (BF16_CPU, "bf16-mixed", False),
    (BF16_CPU, "32-true", False),     # an explicit fp32 on a bf16 CPU is obeyed, silently
    (AVX2_CPU, "32-true", False),
])
def test_explicit_precision_is_obeyed_and_emulated_bf16_warned(machine, hw, precision, warns):
    machine(hw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(accelerator="cpu", precision=precision, logger=False, enable_checkpointing=False)
    assert trainer.precision == ("bf16-mixed" if precision == "16-mixed" else precision)
    ours = [str(w.message) for w in caught if "without native bf16" in str(w.message)]
    assert ours == ([hardware.bf16_cost_warning(hw, "cpu", "bf16-mixed")] if warns else [])


def test_device_type_resolves_auto_and_gpu(monkeypatch):
    monkeypatch.setattr(MPSAccelerator, "is_available", staticmethod(lambda: False))
    monkeypatch.setattr(CUDAAccelerator, "is_available", staticmethod(lambda: True))
    assert (device_type("auto"), device_type("gpu"), device_type("cpu")) == ("cuda", "cuda", "cpu")
    monkeypatch.setattr(CUDAAccelerator, "is_available", staticmethod(lambda: False))
    assert (device_type("auto"), device_type("cuda")) == ("cpu", "cuda")
    from lightning.pytorch.accelerators import CPUAccelerator
    assert device_type(CPUAccelerator()) == "cpu"


@pytest.mark.parametrize(("hw", "device", "expected"), [
    (AVX2_CPU, "cpu", {"channels_last": True, "compile": False, "optimizer_impl": "fused"}),
    (BF16_CPU, "cpu", {"channels_last": True, "compile": False, "optimizer_impl": "fused"}),
    (ARM_CPU, "cpu", {"channels_last": False, "compile": False, "optimizer_impl": "default"}),
    (H100, "cuda", {"channels_last": True, "compile": True, "optimizer_impl": "fused"}),
    (hardware.Hardware("x", cuda="Tesla T4"), "cuda", {"channels_last": True, "compile": False,
                                                       "optimizer_impl": "fused"}),  # no Triton: no compile
])
def test_model_levers_follow_the_capability(machine, hw, device, expected):
    machine(hw)
    hparams = {"channels_last": "auto", "compile": "auto", "optimizer_impl": "auto"}
    levers, reasons = resolve_levers(hparams, device)
    assert levers == expected
    assert len(reasons) == 3 and not any("set in the config" in r for r in reasons)
    explicit = {"channels_last": False, "compile": False, "optimizer_impl": "foreach"}
    assert resolve_levers(explicit, device)[0] == explicit  # an explicit value always wins


@pytest.mark.parametrize(("hw", "device", "devices", "expected"), [
    (AVX2_CPU, "cpu", 1, 0), (AMX_CPU, "cpu", 2, 0), (H100, "cuda", 1, 8), (H100, "cuda", 8, 2),
    (hardware.Hardware("x", cores=4, cuda="A100"), "cuda", 8, 1),
])
def test_loader_workers_follow_the_device_and_cores(hw, device, devices, expected):
    assert hardware.choose_num_workers(hw, device, devices)[0] == expected


@pytest.mark.parametrize(("hw", "expected"), [
    (AVX2_CPU, ("32-true", True, "fused", 0)),
    (ARM_CPU, ("32-true", False, "default", 0)),
])
def test_a_fit_resolves_every_auto_lever_from_the_machine(machine, digits_root, caplog, hw, expected):
    """The model, the loaders and the Trainer of a real (one-batch) fit, on a machine the test pretends to be."""
    machine(hw)
    model = ImageClassifier(num_classes=10, net=partial(BackboneWithHead, arch="resnet18", head_hidden=16),
                            optimizer=partial(torch.optim.AdamW, lr=0.01))
    data = ImageFolderDataModule(root=str(digits_root), batch_size=8, image_size=32)
    trainer = Trainer(accelerator="cpu", fast_dev_run=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False)
    with caplog.at_level(logging.INFO):
        trainer.fit(model, datamodule=data)
    fused = trainer.optimizers[0].defaults.get("fused")
    loader = trainer.train_dataloader
    got = (trainer.precision, model.net.backbone.conv1.weight.is_contiguous(memory_format=torch.channels_last),
           "fused" if fused else "default", loader.num_workers)
    assert got == expected
    lines = [r.getMessage() for r in caplog.records]
    assert sum(m.startswith("model levers on cpu: ") for m in lines) == 1
    assert sum(m.startswith("data.num_workers: 0 per device") for m in lines) == 1


def test_explicit_channels_last_applies_without_a_trainer():
    """Plain torch use (export, notebooks): an explicit true is applied at once, auto waits for the device."""
    explicit = ImageClassifier(num_classes=3, net=partial(BackboneWithHead, arch="resnet18", head_hidden=0),
                               levers=Levers(channels_last=True))
    auto = ImageClassifier(num_classes=3, net=partial(BackboneWithHead, arch="resnet18", head_hidden=0))
    assert explicit.net.backbone.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    assert not auto.net.backbone.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="model.levers.compile='yes' is unknown; choose true, false or auto"):
        ImageClassifier(num_classes=3, net=partial(BackboneWithHead, arch="resnet18"), levers=Levers(compile="yes"))


@pytest.mark.cuda
def test_cuda_auto_levers_on_a_real_gpu():
    trainer = Trainer(accelerator="gpu", devices=1, logger=False, enable_checkpointing=False)
    assert trainer.precision == "16-mixed"
    levers, _ = resolve_levers({"channels_last": "auto", "compile": "auto", "optimizer_impl": "auto"}, "cuda")
    assert levers["channels_last"] and levers["optimizer_impl"] == "fused"


def test_announced_reasons_quote_the_measured_figure_of_the_cpu_kind_at_hand():
    """Each reason `auto` prints quotes core/measured.json (rendered from the stored results: test_figures) for the
    CPU kind at hand, or says that kind was not measured; a CPU without native bf16 would run bf16 slower."""
    from benchmarks import hardware as bench

    entries = [e for e in bench.stored() if not e["cpu_flags"]["avx512_bf16"] and not e["cpu_flags"]["amx_bf16"]]
    assert entries, "benchmarks/results/machines/ holds no hardware record of a CPU without native bf16"
    for entry in entries:
        assert bench.bf16_speedup(entry) < 1 and bench.picks(entry).startswith("32-true"), entry["machine"]
    for kind, flags in (("AVX2 CPU", {"avx2"}), ("bf16 CPU", {"avx2", "avx512_bf16"})):
        hw = hardware.Hardware("X", frozenset(flags), 2)
        figures = hardware.measured(kind)
        reasons = [hardware.choose_precision(hw, "cpu")[1], hardware.choose_channels_last(hw, "cpu")[1],
                   hardware.choose_optimizer_impl(hw, "cpu")[1], hardware.choose_num_workers(hw, "cpu")[1]]
        keys = ("bf16_vs_fp32", "channels_last_vs_nchw", "fused_sgd_vs_loop", "one_loader_process_vs_none")
        article = "an" if kind[0] in "AEIOU" else "a"
        for reason, key in zip(reasons, keys, strict=True):
            want = f"{figures.get(key, 'not measured')} on {article} {kind}"
            assert want in reason, (kind, reason)
