"""The GPU path's own guarantees, on a real CUDA device (skipped without one, `cuda` mark): a `16-mixed` fit whose
fp16 gradients overflow once, killed with SIGKILL and resumed to bitwise-identical weights with its GradScaler's
state; and the gradient-compression hooks registered on NCCL. One GPU runs one process, so the hooks are checked on an
NCCL group of one: the hook and its state run as under 8 processes, the all-reduce sums one rank. The checks are
tests/cuda_checks.py's, which tests/test_cuda_checks.py sees fail on the CPU where the promise breaks."""

from __future__ import annotations

import pytest
import torch

from tests.cuda_checks import (
    OVERFLOW,
    assert_hook_registered,
    assert_scaler_restored,
    compression_strategy,
    probe,
    short_config,
)
from tests.helpers import fit_run, killed_and_resumed, last_weights

pytestmark = pytest.mark.cuda


def test_a_16_mixed_fit_killed_after_an_fp16_overflow_resumes_its_scaler_and_ends_bitwise_equal(tmp_path, digits_root):
    # deterministic kernels (resume_config's): two runs of the same steps end bitwise equal
    config = short_config(tmp_path, digits_root, "fp16", precision="16-mixed", callbacks=(OVERFLOW,))
    assert killed_and_resumed(config, tmp_path, kill_after=3, resumes_from=2) == 0.0
    assert_scaler_restored(tmp_path / "reference", tmp_path / "killed")


@pytest.mark.parametrize("compression", ["fp16", "powersgd"])
def test_compression_hooks_are_registered_on_nccl_and_train(tmp_path, digits_root, compression):
    config = short_config(tmp_path, digits_root, compression, precision="16-mixed",
                          strategy=compression_strategy(compression), callbacks=(probe(tmp_path / "probe"),))
    result = fit_run(config, tmp_path / "run")
    assert "val/acc" in result.stdout
    hook = {"fp16": "fp16_compress_hook", "powersgd": "resumable_powerSGD_hook"}[compression]
    assert_hook_registered(tmp_path / "probe", hook, backend="nccl")
    weights = last_weights(tmp_path / "run")
    assert all(torch.isfinite(w).all() for w in weights.values() if w.is_floating_point())
    if compression == "powersgd":  # the hook ran past its plain all-reduce steps, and its state was checkpointed
        saved = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["powersgd_state"]
        assert saved["world_size"] == 1 and saved["ranks"][0]["iter"] > 2


def test_a_16_mixed_step_waits_for_the_gpu_only_where_the_progress_bar_loss_is_copied():
    """The host queues each step while the GPU runs the one before: between the progress bar's loss copies (every
    trainer.log_every_n_steps steps) a step of the production recipe (16-mixed's GradScaler, fused SGD, the
    classifier's metrics and logging, the fault guards) never waits for the device. Lightning read the bar's loss
    with `.item()` after every step, and torch's foreach SGD under a GradScaler read its inf check."""
    import warnings
    from functools import partial

    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_modules import BackboneWithHead, ImageClassifier, Levers
    from training.resume import fault_callbacks

    class Waits(Callback):
        """Per batch, from its start to the next batch's start: the host's waits for the GPU."""

        def __init__(self) -> None:
            self.waits: dict[int, int] = {}
            self._open = None

        def _close(self) -> None:
            if self._open is not None:
                batch, catcher, caught = self._open
                catcher.__exit__(None, None, None)
                torch.cuda.set_sync_debug_mode("default")
                self.waits[batch] = sum("synchroniz" in str(w.message) for w in caught)
                self._open = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
            self._close()
            if batch_idx >= 2:  # after cuDNN's first choices
                catcher = warnings.catch_warnings(record=True)
                caught = catcher.__enter__()
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                self._open = (batch_idx, catcher, caught)

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            self._close()

    torch.manual_seed(0)
    model = ImageClassifier(num_classes=3, net=partial(BackboneWithHead, arch="resnet18", head_hidden=8),
                            batch_size=8, optimizer=partial(torch.optim.SGD, lr=0.01, momentum=0.9),
                            levers=Levers(compile=False))
    waits = Waits()
    trainer = L.Trainer(accelerator="gpu", devices=1, precision="16-mixed", max_epochs=1, log_every_n_steps=5,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[*fault_callbacks(), waits])
    data = TensorDataset(torch.randn(12 * 8, 3, 32, 32), torch.randint(0, 3, (12 * 8,)))
    trainer.fit(model, DataLoader(data, batch_size=8, pin_memory=True))
    assert trainer.optimizers[0].defaults["fused"] is True
    waited = {batch for batch, n in waits.waits.items() if n}
    assert sorted(waits.waits) == list(range(2, 12))
    assert waited <= {5, 10}, f"batches whose step waited for the GPU: {sorted(waited)}"


def test_a_batch_copied_on_a_side_stream_equals_the_plain_copy(digits_root):
    """benchmarks.gpu_end_to_end's experiment: the batch's host-to-device copy on a stream of its own, issued while
    the training stream is busy, arrives whole for the training stream's next kernel (which waits for the copy)."""
    from benchmarks.gpu_end_to_end import SideStreamCopy

    data = SideStreamCopy(root=str(digits_root), batch_size=4, num_workers=0)
    x = torch.randint(0, 256, (64, 3, 224, 224), dtype=torch.uint8).pin_memory()
    y = torch.arange(64).pin_memory()
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # the training stream's queue: a copy on it would wait behind these
        busy = busy @ busy / 64
    moved = data.transfer_batch_to_device((x, y), torch.device("cuda"), 0)
    assert data.copy_stream != torch.cuda.current_stream()
    assert moved[0].sum(dtype=torch.int64).item() == x.sum(dtype=torch.int64).item()  # read on the training stream
    assert torch.equal(moved[1].cpu(), y)
