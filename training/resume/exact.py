"""ExactResume: a resumed run continues exactly like the uninterrupted one (docs/FAULT_TOLERANCE.md)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import CombinedLoader, rank_zero_info

from core.seeding import batch_seed, run_seed
from training.resume.faults import PREEMPTED, set_sampler_epoch


class ExactResume(Callback):
    """Makes a resumed run continue exactly like the uninterrupted one: same data position, same random numbers.

    Data position: Lightning restores a StatefulDataLoader's position in `FitLoop.setup_data`, but only the first time
    the train loader is built; `trainer.estimated_stepping_batches` (used by the model's LR schedule in
    `configure_optimizers`) builds it earlier, before the checkpoint is restored, and the saved position is then
    silently dropped and the epoch restarts from its first batch. The pending position is loaded here at
    `on_train_start` and the loader's iterator re-created from it.

    Random numbers: torch's global generator is seeded from (seed, training batch index, rank) before every training
    batch (each micro-batch of an accumulated step has its own), so dropout, mixup and CutMix depend only on the
    batch, not on how many random numbers were drawn since the process started. (Lightning does not checkpoint RNG
    states, and restoring a saved state would still be off by whatever the loaders draw at an epoch boundary.) The
    loader's augmentation does not draw from it: each training draw carries a seed of its own
    (datamodules.samplers.SeededDraws).
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed
        self._base = 0
        self._deferred: list[tuple[ModelCheckpoint, int]] = []  # step saves held until the validation has ended
        self._deferred_args: tuple = ()
        self._world_size: int | None = None  # saved in checkpoints: a resume on another one cannot keep the position
        self._saved: dict = {}  # what the checkpoint resumed from holds of this callback's state
        self._grads: dict[str, torch.Tensor] | None = None  # the accumulated gradients it holds, if any
        self._epoch_samples = 0  # samples the epoch in progress has drawn, over all ranks
        self._trainer: Trainer | None = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # seed_everything exports its seed; without one the run is not reproducible anyway.
        self._base = self.seed if self.seed is not None else run_seed()
        self._trainer = trainer

    def state_dict(self) -> dict:
        state = {"world_size": self._world_size, "epoch_samples": self._epoch_samples}
        if self._trainer is not None:
            # The step each ModelCheckpoint last saved at (Lightning keeps it only in memory): a resumed callback must
            # not save the step again that it has saved already. A save held back here counts with its own step.
            held = {id(callback): previous for callback, previous in self._deferred}
            state["last_saved_step"] = {
                callback.state_key: held.get(id(callback), callback._last_global_step_saved)
                for callback in self._trainer.checkpoint_callbacks if isinstance(callback, ModelCheckpoint)}
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        self._saved = state_dict

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
        # A checkpoint inside an accumulation window (a validation or a timed save between two optimizer steps) also
        # holds the gradients accumulated so far; without them the resumed step would sum fewer micro-batches. Under
        # DDP each rank's are its own until the step's all-reduce, which averages: their average, restored on every
        # rank, gives that same average. Every rank calls this hook (the all-reduce is collective); rank 0 writes.
        if trainer.state.fn != TrainerFn.FITTING or not inside_accumulation_window(trainer):
            return
        grads = {name: p.grad.detach().clone() for name, p in pl_module.named_parameters() if p.grad is not None}
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            for grad in grads.values():
                dist.all_reduce(grad)
                grad.div_(trainer.world_size)
        checkpoint["accumulated_grads"] = {name: grad.cpu() for name, grad in grads.items()}

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
        self._grads = checkpoint.get("accumulated_grads")

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._world_size = trainer.world_size
        if trainer.ckpt_path:
            self._restore_checkpoint_steps(trainer)
        fit_loop = trainer.fit_loop
        states = fit_loop._combined_loader_states_to_load
        saved_world_size = self._saved.get("world_size")
        if states and saved_world_size not in (None, trainer.world_size):
            self._restart_epoch_on_new_shards(trainer, saved_world_size)
            return
        self._epoch_samples = self._saved.get("epoch_samples", 0)
        if self._grads:
            params = dict(pl_module.named_parameters())
            for name, grad in self._grads.items():  # the window resumes where it stopped: Lightning zeroes none
                params[name].grad = grad.to(params[name].device, params[name].dtype)
            self._grads = None
        loaders = train_loaders(trainer)
        if not states or loaders is None or fit_loop._data_fetcher is None:
            return
        stateful = [loader for loader in loaders if all(hasattr(loader, m) for m in ("state_dict", "load_state_dict"))]
        if len(stateful) != len(states):
            raise RuntimeError(f"the checkpoint holds the positions of {len(states)} training loader(s), the fit has "
                               f"{len(stateful)}: resume with the data configuration it was saved with")
        for loader, state in zip(stateful, states, strict=True):
            loader.load_state_dict(state)
        fit_loop._combined_loader_states_to_load = []
        for loader in loaders:  # a DistributedSampler's order depends on the epoch
            set_sampler_epoch(loader, trainer.current_epoch)
        if fit_loop.epoch_loop.batch_progress.is_last_batch:
            # Saved after an epoch's last batch: the restored iterator is spent. Running it out uses the restored
            # position up; the fresh iterator below starts the next epoch (the sampler's order is a function of the
            # epoch, so it makes no difference whether Lightning continues with it or makes its own).
            for loader in stateful:
                for _ in loader:
                    pass
        iter(fit_loop._data_fetcher)  # a fresh iterator (and prefetch) from the restored position

    def _restart_epoch_on_new_shards(self, trainer: Trainer, saved_world_size: int) -> None:
        """An elastic restart on another world size: each rank's shard of the epoch differs, so no saved loader
        position maps onto the new ones. A checkpoint taken inside an epoch restarts that epoch from its first batch,
        on the new shards: the samples it had drawn are drawn again (said in one line), none is skipped."""
        fit_loop = trainer.fit_loop
        fit_loop._combined_loader_states_to_load = []
        progress = fit_loop.epoch_loop.batch_progress
        repeated = self._saved.get("epoch_samples", 0)
        if progress.is_last_batch or not repeated:
            where, repeated = "at an epoch boundary: no sample is repeated", 0
        else:
            progress.current.reset()  # Lightning would end the epoch after its old count of batches: run it all
            fit_loop.epoch_loop.reset_restart_stage()  # nor count the checkpoint's batch as done once more
            self._grads = None  # an accumulation window of the old shards: it restarts with the epoch
            where = (f"inside epoch {trainer.current_epoch}, which restarts from its first batch on the new shards: "
                     f"the {repeated} samples it had drawn before the checkpoint are drawn again, none is skipped")
        self._epoch_samples = 0
        rank_zero_info(f"resuming on {trainer.world_size} processes, saved on {saved_world_size} {where}")

    def _restore_checkpoint_steps(self, trainer: Trainer) -> None:
        """Each ModelCheckpoint's last saved step as it was when the checkpoint resumed from was written; the callback
        that wrote it had saved at its step too (it notes that just after the write)."""
        saved = self._saved.get("last_saved_step", {})
        path = Path(trainer.ckpt_path)
        for callback in trainer.checkpoint_callbacks:
            if not isinstance(callback, ModelCheckpoint):
                continue
            step = saved.get(callback.state_key, callback._last_global_step_saved)
            if callback.dirpath and Path(callback.dirpath).resolve() == path.parent.resolve() \
                    and path.name != PREEMPTED:  # Preemption's file: ModelCheckpoint had not saved at that step
                step = trainer.global_step
            callback._last_global_step_saved = step

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning sets each sampler's epoch to its count of processed epochs, which a resume under max_steps from a
        # checkpoint of an epoch's end counts twice (it replays that epoch's end): the next epoch would take the order
        # of the one after it. The epoch that starts is `current_epoch`; the loader's iterator is made after this hook.
        for loader in train_loaders(trainer) or []:
            set_sampler_epoch(loader, trainer.current_epoch)
        self._epoch_samples = 0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        # Per batch, not per optimizer step: under gradient accumulation each micro-batch draws its own dropout masks.
        # Lightning has counted the batch in hand already.
        counted = trainer.fit_loop.epoch_loop.batch_progress.total.ready
        torch.manual_seed(batch_seed(counted - 1, trainer.global_rank, base=self._base))

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx) -> None:
        # A run resumed from a checkpoint taken at the end of a batch that a validation follows skips that validation
        # (Lightning fast-forwards its progress), so its metrics, best-k checkpoint and val/acc_best would differ from
        # the uninterrupted run's. So an unmonitored ModelCheckpoint's step save (every_n_train_steps,
        # train_time_interval) at such a batch is deferred until that validation has ended, when the checkpoint holds
        # its results; epoch saves are untouched. (Callbacks run before every ModelCheckpoint, which skips a step it
        # believes saved; monitored ones already defer to the validation themselves.)
        self._epoch_samples += len(batch[0]) * trainer.world_size  # (x, y[, seeds]); every rank draws a full batch
        self._flush_deferred(trainer, pl_module)
        epoch_loop = trainer.fit_loop.epoch_loop
        if not epoch_loop._should_check_val_fx(trainer.fit_loop._data_fetcher):
            return
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.monitor is None \
                    and callback._last_global_step_saved != trainer.global_step:
                self._deferred.append((callback, callback._last_global_step_saved))
                callback._last_global_step_saved = trainer.global_step  # its on_train_batch_end, next, skips
        self._deferred_args = (outputs, batch, batch_idx)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # The validation that followed the step has ended, at the same global step: every deferred step save is due
        # now, also for a callback that saves its epoch files at the epoch's end (validations may run inside the
        # epoch: a later flush would give the save the step of a later batch, where it is not due).
        self._flush_deferred(trainer, pl_module)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._flush_deferred(trainer, pl_module)  # just before ModelCheckpoint's own epoch-end saves

    def _flush_deferred(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Give each deferred ModelCheckpoint its step save now (it decides itself whether the step is due). The others
        stay listed while one saves: its checkpoint records their true last saved steps (`state_dict`)."""
        while self._deferred:
            callback, previous = self._deferred.pop(0)
            callback._last_global_step_saved = previous
            callback.on_train_batch_end(trainer, pl_module, *self._deferred_args)


def train_loaders(trainer: Trainer) -> list | None:
    """The fit's training loaders, flattened as Lightning combines them; None before they are built."""
    loaders = trainer.train_dataloader
    return None if loaders is None else CombinedLoader(loaders).flattened


def inside_accumulation_window(trainer: Trainer) -> bool:
    """Whether the batch just run leaves its gradients for a later optimizer step (as Lightning's training epoch loop
    decides): its count is not a multiple of accumulate_grad_batches, and it is not the epoch's last batch, on which
    Lightning steps unless the strategy accumulates itself."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    if progress.current.ready % trainer.accumulate_grad_batches == 0:
        return False
    last = progress.current.ready == trainer.num_training_batches or progress.is_last_batch
    return trainer.strategy.handles_gradient_accumulation or not last
