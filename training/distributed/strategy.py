"""DDP with gradient compression (fp16, bf16, PowerSGD) and post-local SGD, configured by plain YAML fields.

    trainer:
      strategy:
        class_path: training.distributed.strategy.CompressedDDPStrategy
        init_args: {compression: powersgd, powersgd: {rank: 4}}
"""

from __future__ import annotations

import gc
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
import torch.distributed.optim  # noqa: F401  before any process group exists: see destroy_process_groups
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_local_sgd
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

Compression = Literal["none", "fp16", "bf16", "powersgd"]
COMPRESSIONS: tuple[str, ...] = get_args(Compression)

# Checkpoint key of the PowerSGD state: one entry per rank, because the error-feedback memory is rank-local.
POWERSGD_KEY = "powersgd_state"


def build_comm_hook(compression: Compression, module: torch.nn.Module, process_group=None, *, rank: int = 4,
                    start_iter: int = 10, min_compression_rate: float = 2.0, use_error_feedback: bool = True,
                    warm_start: bool = True):
    """(state, hook) for DDP's register_comm_hook of `module`; (None, None) for `none` (DDP's own C++ all-reduce)."""
    if compression == "none":
        return None, None
    if compression == "fp16":
        return process_group, default_hooks.fp16_compress_hook
    if compression == "bf16":
        return process_group, default_hooks.bf16_compress_hook
    if compression == "powersgd":
        state = powersgd.PowerSGDState(
            process_group=process_group,
            matrix_approximation_rank=rank,
            start_powerSGD_iter=start_iter,
            min_compression_rate=min_compression_rate,
            use_error_feedback=use_error_feedback,
            warm_start=warm_start,
        )
        return state, ResumablePowerSGDHook({id(p): name for name, p in module.named_parameters()})
    raise ValueError(f"trainer.strategy.compression={compression!r} is unknown; choose one of "
                     f"{', '.join(COMPRESSIONS)}")


def destroy_process_groups() -> None:
    """End this process's torch.distributed: destroy every process group and free it, joining its worker threads.

    A gloo process group runs each collective on a C++ worker thread, which drops its reference to the finished
    collective, and with it the tensors' Python objects (which takes the GIL), only after the caller waiting for it
    has been released. A process that exits right after a collective (the end of `imgcls fit`: after_fit's broadcast
    of whether a best checkpoint exists) can reach interpreter shutdown first; the worker, refused the GIL, is made to
    exit inside the collective's destructor, and the C++ runtime aborts the process: "terminate called without an
    active exception", SIGABRT. A group's destructor joins its workers, with the GIL released (torch's
    IntrusivePtrNoGilDestructor), but `shutdown()` alone does not: so every reference to the groups must go here,
    while the interpreter is fully alive. destroy_process_group forgets them all, and a collection frees those held
    only in cycles. Held elsewhere, a group would outlive this: Preemption destroys its own at teardown, and the
    strategy drops post-local SGD's state and averager at its teardown. (torch.distributed.optim is imported with
    this module, before any group exists: ZeroRedundancyOptimizer's `_broadcast_object` takes the default group as
    a default argument, and imported later, as Lightning's post-local SGD setup does, it would hold it for good.)

    For the end of a run that every rank completed: a collective still waiting for a lost peer would hold its worker
    thread, and this with it, until the timeout. And for the end of a command, whose last collectives (a broadcast,
    metric syncs) leave no Python callback holding a group on a worker thread: a worker that let go of a group's
    last reference would run its destructor, and join itself.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.destroy_process_group()  # every group; Lightning's own at exit (NCCL only) then finds none
    gc.collect()


@dataclass(frozen=True)
class PowerSGD:
    """PowerSGD's settings (`trainer.strategy.powersgd`): a rank-r approximation of each weight matrix's gradient."""

    rank: int = 4
    """Rank r of the approximation; an (n, m) gradient sends (n + m) x r numbers."""
    start_iter: int = 10
    """Plain all-reduce for this many steps first (PowerSGD is unstable from the first step)."""
    min_compression_rate: float = 2.0
    """Compress a matrix only if n*m / ((n + m) * r) exceeds this."""
    use_error_feedback: bool = True
    """Add the previous step's approximation error to the gradient (needed to converge)."""
    warm_start: bool = True
    """Reuse last step's Q instead of a fresh random matrix (better approximations)."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"trainer.strategy.powersgd.rank={self.rank} must be >= 1")


@dataclass(frozen=True)
class PostLocalSGD:
    """Post-local SGD (`trainer.strategy.post_local_sgd`): local all-reduces, and the models averaged every `period`."""

    period: int
    """Average the full model every this many steps."""
    start_iter: int = 100
    """Global all-reduce for this many steps first."""
    group_size: int | None = None
    """Processes per local group, which still all-reduce every step; null = the processes of one node."""

    def __post_init__(self) -> None:
        if self.period < 1:
            raise ValueError(f"trainer.strategy.post_local_sgd.period={self.period} must be >= 1")


DEFAULT_POWERSGD = PowerSGD()  # frozen: safe as an argument default


class CompressedDDPStrategy(DDPStrategy):
    """DistributedDataParallel whose gradient all-reduce is compressed, on any device and backend.

    Args:
        compression: ``none`` (fp32 all-reduce), ``fp16`` / ``bf16`` (gradients cast for the wire, 0.5x the bytes),
            ``powersgd`` (rank-r low-rank approximation of each weight matrix, with error feedback).
        powersgd: PowerSGD's settings (`PowerSGD`), read with ``compression: powersgd``.
        post_local_sgd: post-local SGD (`PostLocalSGD`), null is off: after its ``start_iter`` steps, gradients are
            only all-reduced inside groups of ``group_size`` processes and the full model is averaged every
            ``period`` steps. Combines with none/fp16/bf16.
        bucket_cap_mb: DDP bucket size in MiB: larger buckets mean fewer, larger all-reduces, less overlap.
        gradient_as_bucket_view: gradients are views into the buckets (saves one gradient copy of memory).
        static_graph: the set of used parameters never changes between steps; lets DDP skip per-step checks.
        find_unused_parameters: search the autograd graph for unused parameters each step (slow; only if needed).
        process_group_backend: ``nccl`` / ``gloo``; null picks by device.
        timeout_s: collective timeout in seconds: a rank that waits longer fails the job instead of hanging.
        start_method: ``popen`` (re-run the script per process, default) or ``spawn`` / ``fork``.
    """

    def __init__(
        self,
        compression: Compression = "none",
        powersgd: PowerSGD = DEFAULT_POWERSGD,
        post_local_sgd: PostLocalSGD | None = None,
        bucket_cap_mb: float = 25.0,
        gradient_as_bucket_view: bool = True,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        process_group_backend: str | None = None,
        timeout_s: float = 1800.0,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        if compression not in COMPRESSIONS:
            raise ValueError(f"trainer.strategy.compression={compression!r} is unknown; "
                             f"choose one of {', '.join(COMPRESSIONS)}")
        powersgd = PowerSGD(**powersgd) if isinstance(powersgd, dict) else powersgd
        post_local_sgd = PostLocalSGD(**post_local_sgd) if isinstance(post_local_sgd, dict) else post_local_sgd
        if post_local_sgd is not None and compression == "powersgd":
            raise ValueError("trainer.strategy.post_local_sgd cannot be combined with compression=powersgd; "
                             "use compression none, fp16 or bf16 with post-local SGD")
        super().__init__(  # the hooks and post-local SGD are set up here, not by Lightning (on CUDA only)
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=timeout_s),
            start_method=start_method,
            # DistributedDataParallel keyword arguments:
            bucket_cap_mb=bucket_cap_mb,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
            find_unused_parameters=find_unused_parameters,
        )
        self.compression = compression
        self.powersgd_kwargs = asdict(powersgd)  # build_comm_hook's keyword arguments
        self.post_local_sgd_period = post_local_sgd.period if post_local_sgd is not None else None
        self.post_local_sgd_start_iter = post_local_sgd.start_iter if post_local_sgd is not None else 0
        self.post_local_sgd_group_size = post_local_sgd.group_size if post_local_sgd is not None else None
        self.comm_state: Any = None  # the hook's state (process group, PowerSGDState, PostLocalSGDState)
        self.comm_hook = None  # what DDP calls with each gradient bucket; None: its own all-reduce
        self.model_averager: PeriodicModelAverager | None = None  # post-local SGD's, while a fit runs
        self._powersgd_resume: dict | None = None  # this rank's saved PowerSGD state, until the hook exists

    # ---- hook registration ----------------------------------------------------------------------------------

    def configure_ddp(self) -> None:
        # Registered on every device, so CPU runs compress too (docs/DISTRIBUTED.md, "Hooks on every device").
        super().configure_ddp()
        self._build_hook_state()
        if self.comm_hook is None:
            return
        hook = self.comm_hook
        if self.post_local_sgd_period is not None and self.compression != "none":  # compressed inside post-local SGD
            wrapper = {"fp16": default_hooks.fp16_compress_wrapper, "bf16": default_hooks.bf16_compress_wrapper}
            rank_zero_info(f"DDP comm hook: {wrapper[self.compression].__qualname__}({hook.__qualname__})")
            hook = wrapper[self.compression](hook)
        self.model.register_comm_hook(state=self.comm_state, hook=hook)

    def _build_hook_state(self) -> None:
        """Create the hook and its state now that the process group exists (every rank runs this)."""
        if self.post_local_sgd_period is not None:
            # Post-local SGD: the hook all-reduces globally for start_iter steps, then only inside the subgroup; the
            # model averager (setup) averages the whole model every period steps after that.
            group_size = self.post_local_sgd_group_size or self.num_processes
            subgroup, _ = dist.new_subgroups(group_size=group_size)
            self.comm_state = post_local_sgd.PostLocalSGDState(
                process_group=None, subgroup=subgroup, start_localSGD_iter=self.post_local_sgd_start_iter
            )
            self.comm_hook = post_local_sgd.post_localSGD_hook
            return
        self.comm_state, self.comm_hook = build_comm_hook(self.compression, self.model.module, **self.powersgd_kwargs)
        self._restore_powersgd()

    def setup(self, trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and isinstance(self.comm_state, post_local_sgd.PostLocalSGDState):
            from torch.distributed.optim import PostLocalSGDOptimizer, ZeroRedundancyOptimizer

            for optimizer in self.optimizers:
                if isinstance(optimizer, (ZeroRedundancyOptimizer, PostLocalSGDOptimizer)):
                    raise ValueError(f"trainer.strategy.post_local_sgd cannot average the model with a "
                                     f"{type(optimizer).__name__}; use a plain torch.optim optimizer")
            self.model_averager = PeriodicModelAverager(period=self.post_local_sgd_period,
                                                        warmup_steps=self.comm_state.start_localSGD_iter)

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.model_averager is not None:
            self.model_averager.average_parameters(
                iter([p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]))
        return output

    def teardown(self) -> None:
        super().teardown()
        if self.post_local_sgd_period is not None:
            # Post-local SGD's state and model averager hold process groups (its subgroup, the default group): let go
            # of them when the stage ends, so that the end of the run frees the groups (destroy_process_groups). A
            # next fit builds both again (configure_ddp, setup). PowerSGD's state holds none and is kept for
            # checkpoints saved after the fit.
            self.comm_state = None
            self.model_averager = None

    # ---- PowerSGD state in checkpoints (not in any state dict: pytorch issue 75666) -------------------------

    @property
    def powersgd_state(self) -> powersgd.PowerSGDState | None:
        state = self.comm_state
        return state if isinstance(state, powersgd.PowerSGDState) else None

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        # Every rank reaches here (Trainer.save_checkpoint); rank 0 writes. The error memory differs per rank, so
        # rank 0 gathers all of them: the checkpoint grows by one fp32 gradient copy per rank.
        if isinstance(self.comm_hook, ResumablePowerSGDHook) and dist.is_initialized():
            local = self.comm_hook.state_dict(self.powersgd_state)
            gathered = [None] * self.world_size if self.is_global_zero else None
            dist.gather_object(local, gathered, dst=0)
            if self.is_global_zero:
                checkpoint[POWERSGD_KEY] = {"world_size": self.world_size, "ranks": gathered}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        saved = checkpoint.pop(POWERSGD_KEY, None)
        if saved is not None and self.compression == "powersgd":
            if saved["world_size"] == self.world_size:
                self._powersgd_resume = saved["ranks"][self.global_rank]
            else:  # the per-rank error memories do not map onto a new world size; keep the step count only
                rank_zero_warn(f"{checkpoint_path} holds PowerSGD state for {saved['world_size']} processes, not "
                               f"{self.world_size}: its error-feedback memory is dropped, the iteration kept")
                self._powersgd_resume = {"iter": saved["ranks"][0]["iter"]}
            self._restore_powersgd()
        return checkpoint

    def _restore_powersgd(self) -> None:
        if self._powersgd_resume is None or not isinstance(self.comm_hook, ResumablePowerSGDHook):
            return
        self.comm_hook.load_state_dict(self.powersgd_state, self._powersgd_resume)
        self._powersgd_resume = None


class ResumablePowerSGDHook:
    """powerSGD_hook whose error memory is kept per parameter, so it can be saved, resumed and re-bucketed.

    PowerSGDState keys its memories by DDP bucket index, and bucket layouts change: a new DDP instance starts with
    buckets in reverse parameter order and rebuilds them after the first step in gradient-ready order. A resumed
    run at iter >= start_powerSGD_iter would add a saved (n,) error to a bucket of another size. So after each
    step the bucket's (n,) residual is also indexed per parameter (views, no copy), and when a bucket's parameter
    list differs from the one its memory was built for, the memory is reassembled from those pieces. The
    warm-start Q matrices are not carried over: after a resume or a re-bucketing they are drawn afresh from the
    (saved) seeded generator, as on PowerSGD's first step, which costs one step of a coarser approximation.
    """

    def __init__(self, names: dict[int, str]) -> None:
        self.names = names  # id(parameter) -> name in the module
        self.layout: dict[int, tuple[tuple[str, int], ...]] = {}  # bucket index -> ((name, numel), ...)
        self.param_error: dict[str, torch.Tensor] = {}  # name -> (numel,) latest residual of that parameter
        # DDP logs the hook by name (_get_ddp_logging_data()["comm_hook"]), and Lightning prints it.
        self.__name__ = self.__qualname__ = "resumable_powerSGD_hook"

    def __call__(self, state: powersgd.PowerSGDState, bucket):  # unannotated: DDP compares annotations as objects
        index = bucket.index()
        layout = tuple((self.names[id(p)], p.numel()) for p in bucket.parameters())
        if self.layout.get(index) != layout:  # first sight of this bucket, a resume, or DDP re-bucketed
            self.layout[index] = layout
            state.p_memory_dict.pop(index, None)  # sized for the old layout; PowerSGD re-allocates them
            state.q_memory_dict.pop(index, None)
            state.error_dict.pop(index, None)
            if self.param_error and state.use_error_feedback:
                buffer = bucket.buffer()  # (total numel,) flat gradients of this bucket, in layout order
                state.error_dict[index] = torch.cat([
                    self.param_error[name].to(buffer) if name in self.param_error else buffer.new_zeros(numel)
                    for name, numel in layout
                ])
        future = powersgd.powerSGD_hook(state, bucket)
        if dist.is_initialized() and dist.get_backend(state.process_group) == "gloo":
            # PowerSGD issues its P and Q all-reduces from future callbacks, on gloo's worker threads; with several
            # buckets they can interleave with the next bucket's all-reduce in a different order on each rank,
            # and gloo then aborts on mismatched sizes (gloo::EnforceNotMet). Finishing each bucket before the
            # next keeps the order identical on all ranks, at the cost of overlap (gloo is the CPU/test backend).
            future.wait()

        def repair_and_index(done: torch.futures.Future) -> torch.Tensor:
            # A step whose fp16 gradients overflowed is skipped by the gradient scaler (the inf reaches every rank's
            # result through the all-reduces), but PowerSGD has already folded it into its memories: a NaN error
            # memory or warm-start Q would poison every later step. Their non-finite entries are reset here, on the
            # device, without a synchronisation: errors to 0, Q to draws seeded alike on every rank.
            flat = state.error_dict.get(index)  # PowerSGD stores the new residual before its future completes
            if flat is not None:
                torch.nan_to_num_(flat, nan=0.0, posinf=0.0, neginf=0.0)
            q = state.q_memory_dict.get(index)
            if q is not None:
                generator = torch.Generator(q.device).manual_seed(int(state.iter) * 1_009 + index)
                fresh = torch.randn(q.shape, generator=generator, device=q.device, dtype=q.dtype)
                q.copy_(torch.where(torch.isfinite(q), q, fresh))
            if flat is not None and state.use_error_feedback:
                self.param_error.update(zip((n for n, _ in layout), flat.split([n for _, n in layout]), strict=True))
            return done.value()

        return future.then(repair_and_index)

    def state_dict(self, state: powersgd.PowerSGDState) -> dict[str, Any]:
        """This rank's state as ints and CPU tensors (loadable with torch.load(weights_only=True))."""
        _, keys, pos, _, _ = state.rng.get_state()
        return {
            "iter": int(state.iter),
            "rng_keys": torch.from_numpy(keys.astype("int64")),
            "rng_pos": int(pos),
            "error": {name: t.detach().cpu().clone() for name, t in self.param_error.items()},
        }

    def load_state_dict(self, state: powersgd.PowerSGDState, saved: dict[str, Any]) -> None:
        state.iter = saved["iter"]
        if "rng_keys" in saved:  # random Q draws continue where they stopped (same on every rank)
            state.rng.set_state(("MT19937", saved["rng_keys"].numpy().astype("uint32"), saved["rng_pos"], 0, 0.0))
        for memory in (state.error_dict, state.p_memory_dict, state.q_memory_dict):
            memory.clear()
        self.layout.clear()
        self.param_error = dict(saved.get("error", {}))
