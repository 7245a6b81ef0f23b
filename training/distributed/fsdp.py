"""FSDP2 (torch's `fully_shard`) on Lightning's ModelParallelStrategy: parameters, gradients and optimizer state
sharded across the processes, on GPUs (NCCL) and on CPUs (gloo), with atomic sharded checkpoints.

    imgcls fit --config configs/imagenet_ddp8.yaml --config configs/fsdp.yaml --data.root /datasets/my_images
    python -m training.distributed.fsdp runs/x/checkpoints/last.ckpt last-full.ckpt   # one file, for predict and export
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import shutil
import sys
import tempfile
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed._composable import checkpoint as checkpoint_activations
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from training.resume.checkpoints import (
    AtomicCheckpointIO,
    NonFiniteWeightsError,
    _fsync_dir,
    checkpoint_problem,
    safe_load,
)


class FSDP2Strategy(ModelParallelStrategy):
    """Fully sharded data parallel (FSDP2): each process keeps 1/N of every parameter, of its gradient and of the
    optimizer state, and gathers a unit's full parameters just before the unit runs (forward and backward).

    The network is sharded here, when the Trainer sets the strategy up (after the model's `configure_model`): each
    module of a class in `units` becomes one FSDP unit, then each direct child of the LightningModule that still
    holds parameters (ImageClassifier's `net`: the stem, the head) becomes the unit around them. The model does not
    know it is sharded; a state dict has the same keys as under DDP.

    Args:
        units: import paths of the module classes that are each one FSDP unit (gathered just before it runs, freed
            after): the repeated blocks, e.g. ``torchvision.models.resnet.Bottleneck``. Empty: one unit per child.
        reshard_after_forward: free each unit's gathered parameters after its forward (FULL_SHARD: gathered again for
            the backward); false keeps them until the backward (SHARD_GRAD_OP: more memory, one all-gather less).
        activation_checkpointing: import paths of module classes whose activations are recomputed in the backward
            instead of kept (torch's composable `checkpoint`, which keeps the parameter names).
        broadcast_buffers: before each training forward, copy rank 0's buffers (BatchNorm running statistics) to
            every rank, as DDP does; without it each rank's statistics follow its own batches.
        save_distributed_checkpoint: true: each checkpoint is a folder holding every rank's shards (torch
            distributed checkpoint, written in parallel); false: full weights gathered on rank 0, one ``.ckpt`` file.
        process_group_backend: ``nccl`` / ``gloo``; null picks by device.
        timeout_s: collective timeout in seconds.
    """

    def __init__(
        self,
        units: list[str] | None = None,
        reshard_after_forward: bool = True,
        activation_checkpointing: list[str] | None = None,
        broadcast_buffers: bool = True,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout_s: float = 1800.0,
    ) -> None:
        # Every process on the one data-parallel axis; no tensor parallelism (set once the world size is known).
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timedelta(seconds=timeout_s))
        self.units = _classes(units or [], "units")
        self.reshard_after_forward = reshard_after_forward
        self.activation_checkpointing = _classes(activation_checkpointing or [], "activation_checkpointing")
        self.broadcast_buffers = broadcast_buffers
        self.save_distributed_checkpoint = save_distributed_checkpoint

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    def setup(self, trainer) -> None:
        if trainer.accumulate_grad_batches > 1:
            # ExactResume checkpoints the gradients of an unfinished accumulation window by all-reducing them;
            # sharded (DTensor) gradients are not handled there.
            raise ValueError(f"trainer.accumulate_grad_batches={trainer.accumulate_grad_batches} is not supported with "
                             f"{type(self).__name__}; set it to 1 (raise data.batch_size instead)")
        module = self.lightning_module
        if not any(isinstance(m, FSDPModule) for m in module.modules()):  # validate/test after fit: sharded already
            shard(module, self.device_mesh["data_parallel"], self.units, self.reshard_after_forward,
                  self.activation_checkpointing, self.broadcast_buffers)
        super().setup(trainer)

    def setup_optimizers(self, trainer) -> None:
        super().setup_optimizers(trainer)
        for optimizer in self.optimizers:
            if isinstance(optimizer, torch.optim.SGD) and any(g.get("fused") for g in optimizer.param_groups):
                # torch 2.14's DTensor has sharding rules for fused Adam/AdamW, none for aten._fused_sgd_.
                raise ValueError("model.levers.optimizer_impl: fused SGD does not run on sharded (DTensor) parameters "
                                 f"under {type(self).__name__}; set model.levers.optimizer_impl to foreach")

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """A sharded checkpoint is written into a hidden folder beside `filepath`, then renamed into place: a kill
        mid-write leaves the previous checkpoint whole. Weights holding NaN are never written (on any rank)."""
        if not self.save_distributed_checkpoint:
            super().save_checkpoint(checkpoint, filepath, storage_options)  # one file, through the CheckpointIO
            return
        path = Path(self.broadcast(str(filepath)))
        bad = [k for k, v in checkpoint.get("state_dict", {}).items() if _has_nan(v)]
        nans = self.reduce(torch.tensor(float(len(bad)), device=self.root_device), reduce_op="sum")
        if nans > 0:  # every rank raises, none writes
            raise NonFiniteWeightsError(f"not writing {path}: weight tensor(s) hold NaN"
                                        + (f" (first on this rank: {bad[0]})" if bad else "")
                                        + "; the checkpoints saved before are kept")
        # Replicated tensors (buffers: BatchNorm statistics) are written once, from whichever rank the planner picks;
        # each rank's differ by its last batch. Rank 0's are saved, as under DDP, so that a resume is exact.
        state = checkpoint.get("state_dict", {})
        replicated = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and not isinstance(v, DTensor)}
        state.update(self.broadcast(replicated))
        tmp = path.with_name(f".{path.name}.tmp{self.broadcast(os.getpid())}")
        if self.is_global_zero:
            shutil.rmtree(tmp, ignore_errors=True)
        self.barrier()
        super().save_checkpoint(checkpoint, tmp, storage_options)
        self.barrier()  # every rank's shards are on disk
        if self.is_global_zero:
            old = path.with_name(f".{path.name}.old{os.getpid()}")
            if path.exists():
                os.replace(path, old)  # a folder cannot be renamed over a non-empty one
            os.replace(tmp, path)
            _fsync_dir(path.parent)
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)
        self.barrier()

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        module = self.lightning_module
        if module.trainer.state.fn != TrainerFn.FITTING:
            # validate / test / predict need the weights only; Lightning would also load the optimizer state into
            # the optimizers a previous fit left, whose parameters may have other states (a thawed backbone).
            optimizers, self.optimizers = self.optimizers, []
            try:
                return super().load_checkpoint(checkpoint_path, weights_only)
            finally:
                self.optimizers = optimizers
        path = Path(self.broadcast(str(checkpoint_path)))
        if not path.is_dir():
            return super().load_checkpoint(path, weights_only)
        # torch reads the optimizer state of the parameters that need a gradient now: a fit resumed after the
        # backbone's thaw starts with it frozen, and would drop its momentum. While loading, all saved ones need one.
        keys = FileSystemReader(path).read_metadata().state_dict_metadata  # optimizer_0.state.<name>.momentum_buffer
        saved = {m.group(1) for key in keys if (m := re.match(r"optimizer_\d+\.state\.(.+)\.[^.]+$", key))}
        thawed = [p for name, p in module.named_parameters() if name in saved and not p.requires_grad]
        for p in thawed:
            p.requires_grad_(True)
        try:
            return super().load_checkpoint(path, weights_only)
        finally:
            for p in thawed:
                p.requires_grad_(False)


CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def shard(module: nn.Module, mesh, units: tuple[type[nn.Module], ...], reshard_after_forward: bool = True,
          checkpointed: tuple[type[nn.Module], ...] = (), broadcast_buffers: bool = True) -> list[nn.Module]:
    """fully_shard each `units` module of `module`, then each direct child still holding parameters; returns the
    children sharded (the roots)."""
    if units and not any(isinstance(m, units) for m in module.modules()):
        # Repeated blocks that hold parameters (a ResNet's BasicBlock): the classes worth sharding one by one.
        counts = Counter(type(m) for m in module.modules() if 0 < len(list(m.children())) < 8
                         and not isinstance(m, CONTAINERS) and any(True for _ in m.parameters()))
        present = sorted(cls.__name__ for cls, n in counts.items() if n > 1)
        raise ValueError(f"trainer.strategy.units: no module of {', '.join(c.__name__ for c in units)} in this model; "
                         f"its block classes include {', '.join(present[:12])}")
    for m in module.modules():
        if checkpointed and isinstance(m, checkpointed):
            # The recomputation would update BatchNorm's running statistics a second time per step (torch does not
            # tell a recompute from a forward); its buffers are put back as the forward left them.
            checkpoint_activations(m, context_fn=lambda m=m: (contextlib.nullcontext(), _buffers_kept(m)))
    for m in list(module.modules()):
        if units and isinstance(m, units):
            fully_shard(m, mesh=mesh, reshard_after_forward=reshard_after_forward)
    roots = [child for child in module.children() if any(not isinstance(p, DTensor) for p in child.parameters())]
    for child in roots:
        # The root unit's parameters stay gathered after its forward: the backward starts with them at once.
        fully_shard(child, mesh=mesh, reshard_after_forward=False)
        if broadcast_buffers and mesh.size() > 1:
            child.register_forward_pre_hook(_BufferBroadcast(mesh.get_group()))
    return roots


class _BufferBroadcast:
    """Forward pre-hook: rank 0's buffers to every rank before each training forward (DDP's broadcast_buffers)."""

    def __init__(self, group) -> None:
        self.group = group

    def __call__(self, module: nn.Module, args) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for buffer in module.buffers():
            by_dtype.setdefault(buffer.dtype, []).append(buffer)
        src = dist.get_global_rank(self.group, 0)
        for buffers in by_dtype.values():  # one broadcast per dtype: float statistics, int64 batch counters
            flat = torch.cat([b.detach().reshape(-1) for b in buffers])
            dist.broadcast(flat, src=src, group=self.group)
            with torch.no_grad():
                for b, new in zip(buffers, flat.split([b.numel() for b in buffers]), strict=True):
                    b.copy_(new.view_as(b))


@contextlib.contextmanager
def _buffers_kept(module: nn.Module):
    saved = [b.detach().clone() for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in zip(module.buffers(), saved, strict=True):
                b.copy_(value)


def _has_nan(value) -> bool:
    if isinstance(value, DTensor):
        value = value.to_local()
    return isinstance(value, torch.Tensor) and value.is_floating_point() and bool(torch.isnan(value).any())


def _classes(paths: list[str], key: str) -> tuple[type[nn.Module], ...]:
    """The classes named by import paths (``torchvision.models.resnet.Bottleneck``); a bad one is named."""
    found = []
    for path in paths:
        module_name, _, name = path.rpartition(".")
        with contextlib.suppress(ImportError, ValueError):
            cls = getattr(importlib.import_module(module_name), name, None)
            if isinstance(cls, type) and issubclass(cls, nn.Module):
                found.append(cls)
                continue
        raise ValueError(f"trainer.strategy.{key}: {path!r} is not an importable torch.nn.Module class (give its "
                         "import path, e.g. torchvision.models.resnet.Bottleneck)")
    return tuple(found)


def consolidate(folder, out) -> Path:
    """One ordinary checkpoint file from a sharded one (a folder): the whole weights and everything else but the
    optimizer state, which is keyed by parameter name there and fits no unsharded optimizer. For predict, export and
    `load_from_checkpoint`, which read one file."""
    folder, out = Path(folder), Path(out)
    problem = checkpoint_problem(folder) if folder.is_dir() else "not a folder"
    if problem:
        raise ValueError(f"{folder} is not a sharded checkpoint: {problem}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        dcp_to_torch_save(folder, Path(tmp) / "all.pt")  # (torch's converter) every rank's shards, joined
        weights = safe_load(Path(tmp) / "all.pt")["state_dict"]
    checkpoint = safe_load(folder / "meta.pt")
    checkpoint["state_dict"] = weights
    AtomicCheckpointIO().save_checkpoint(checkpoint, out)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m training.distributed.fsdp SHARDED_CHECKPOINT_FOLDER OUT.ckpt")
    print(f"wrote {consolidate(sys.argv[1], sys.argv[2])}")
