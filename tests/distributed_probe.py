"""A test-only callback that records, per rank, what a distributed run did: data, gradients, weights, writes."""

from __future__ import annotations

import atexit
import hashlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch import Callback


def weights_digest(module: torch.nn.Module) -> str:
    """SHA-1 of every parameter's bytes: equal digests mean bitwise-identical weights."""
    h = hashlib.sha1()
    for p in module.parameters():
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


class Probe(Callback):
    """Writes `<out_dir>/rank<R>.pt` at the end of fit; with `fail_rank`, that rank raises at `fail_step`, once
    (a marker file remembers), to test failure propagation and elastic restarts; with `digest_every_step`, the
    weights' digest after each optimizer step (and any model averaging) goes into `step_digests`; with
    `record_tensors`, the initial state dict and the first step's gradients too (two model copies per rank)."""

    def __init__(self, out_dir: str, perturb_nonzero_ranks: bool = False, fail_rank: int | None = None,
                 fail_step: int = 0, digest_every_step: bool = False, record_tensors: bool = False) -> None:
        self.out = Path(out_dir)
        self.perturb = perturb_nonzero_ranks
        self.record_tensors = record_tensors
        self.fail_rank = fail_rank
        self.fail_step = fail_step
        self.digest_every_step = digest_every_step
        self.record: dict = {"val": [], "step_digests": []}

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        rank = trainer.global_rank
        if self.perturb and rank != 0:  # before DDP wraps the model: only rank 0's broadcast can undo this
            with torch.no_grad():
                for p in pl_module.parameters():
                    p.add_(float(rank))
        io = trainer.strategy.checkpoint_io
        save = io.save_checkpoint
        log = self.out / "checkpoint_writes.jsonl"

        def logged_save(checkpoint, path, storage_options=None):  # records who really writes a file
            with open(log, "a") as f:
                f.write(json.dumps({"rank": rank, "path": str(path)}) + "\n")
            return save(checkpoint, path, storage_options=storage_options)

        io.save_checkpoint = logged_save

    def on_train_start(self, trainer, pl_module) -> None:
        ddp = trainer.strategy.model
        logging = ddp._get_ddp_logging_data() if hasattr(ddp, "_get_ddp_logging_data") else {}
        self.record.update(
            rank=trainer.global_rank, world_size=trainer.world_size, comm_hook=logging.get("comm_hook"),
            backend=logging.get("backend_name"),  # the process group's, which the hook's all-reduce runs on
            lrs=[g["lr"] for g in trainer.optimizers[0].param_groups],
            start_digest=weights_digest(pl_module), start_step=trainer.global_step,
            precision=trainer.precision_plugin.precision,
        )
        if self.record_tensors:
            self.record["initial_state"] = {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()}
        self._forward_hook = pl_module.register_forward_hook(self._record_autocast)

    def _record_autocast(self, module, args, logits: torch.Tensor) -> None:
        # What the first training forward really ran under, whatever the config asked for.
        device = logits.device.type
        enabled = torch.is_autocast_enabled(device)
        self.record["autocast"] = str(torch.get_autocast_dtype(device)) if enabled else None
        self.record["logits_dtype"] = str(logits.dtype)
        self._forward_hook.remove()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if "batch" not in self.record:
            x, y = batch
            self.record["batch"] = (x.detach().cpu().clone(), y.detach().cpu().clone())
            sampler = trainer.train_dataloader.batch_sampler.sampler
            # SeededDraws yields (index, seed); Lightning's own DistributedSampler (a plain DataLoader here) indices
            self.record["sampler_indices"] = [item[0] if isinstance(item, tuple) else item for item in sampler]
        if trainer.global_rank == self.fail_rank and trainer.global_step == self.fail_step:
            marker = self.out / "failed_once"
            if not marker.exists():
                marker.touch()
                raise RuntimeError(f"probe: injected failure on rank {trainer.global_rank}")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self.digest_every_step:
            self.record["step_digests"].append(weights_digest(pl_module))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.record_tensors and "grads" not in self.record:  # after backward, so after DDP's all-reduce
            self.record["grads"] = {n: p.grad.detach().cpu().clone() for n, p in pl_module.named_parameters()
                                    if p.grad is not None}

    def on_validation_start(self, trainer, pl_module) -> None:
        self.record["val_pred"] = []  # this epoch's (prediction, target) pairs only

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int, dataloader_idx=0) -> None:
        if trainer.sanity_checking:
            return
        x, y = batch
        with torch.no_grad():
            pred = pl_module(x).argmax(1)
        self.record["val_pred"].append(torch.stack([pred.cpu(), y.cpu()]))  # (2, B)

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.record["val"].append(float(trainer.callback_metrics["val/acc"]))

    def on_train_end(self, trainer, pl_module) -> None:
        # Before the strategy's teardown (on_fit_end comes after it), which drops post-local SGD's model averager.
        averager = getattr(trainer.strategy, "model_averager", None)
        self.record["model_averaging_period"] = getattr(averager, "period", None)

    def on_fit_end(self, trainer, pl_module) -> None:
        self.record.update(end_digest=weights_digest(pl_module), end_step=trainer.global_step)
        strategy = trainer.strategy
        state = getattr(strategy, "powersgd_state", None)
        if state is not None:
            self.record["powersgd"] = strategy.comm_hook.state_dict(state)
        torch.save(self.record, self.out / f"rank{trainer.global_rank}.pt")



# Native threads of torch.distributed, by the names they give themselves: gloo's workers and transport loop, the store.
DISTRIBUTED_THREADS = ("gloo", "tcpstore")


class GroupsAtExit(Callback):
    """Writes `<out_dir>/exit_rank<R>.json` as the process exits, in the first atexit handler to run (registered after
    every import's): whether torch.distributed is still initialised, and which of its native threads still live."""

    def __init__(self, out_dir: str) -> None:
        self.out = Path(out_dir)
        self.registered = False

    def setup(self, trainer, pl_module, stage: str) -> None:
        if not self.registered:
            self.out.mkdir(parents=True, exist_ok=True)
            atexit.register(_record_exit, self.out / f"exit_rank{trainer.global_rank}.json")
            self.registered = True


def _record_exit(path: Path) -> None:
    tasks = Path("/proc/self/task")
    names = [(tasks / task / "comm").read_text().strip() for task in os.listdir(tasks)]
    threads = sorted(n for n in names if any(part in n.lower() for part in DISTRIBUTED_THREADS))
    path.write_text(json.dumps({"initialized": dist.is_initialized(), "distributed_threads": threads}))
