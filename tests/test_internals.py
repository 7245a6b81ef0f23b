"""Every private name of Lightning, torch, torchvision, torchdata, LitData and Optuna that the packages use, by name and
with the reason no public way exists: an upgrade that moves one fails here, loudly, instead of silently changing a
resume, a checkpoint or a comm hook. pyproject pins lightning to the minor version these were read from.

`test_the_packages_use_only_the_fenced_private_names` reads the packages' source (ast) and fails on a private name of
a library that is not in FENCE, or on an entry of FENCE that the code no longer uses; FENCE holds at most 15."""

from __future__ import annotations

import ast
import builtins
import collections
import importlib
import inspect
import re
import typing
from importlib.metadata import version
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "datamodules", "lightning_modules", "training", "deploy", "imgcls", "benchmarks")
MAX_PRIVATE_NAMES = 15

# name -> (where it is used, why no public way exists)
FENCE = {
    "_run": ("training/resume/agreement.py: AgreedResume._run",
             "rank 0 holds the run folder and the ranks agree on the resume checkpoint after the process group exists "
             "and before any rank reads or writes a file of the run; "
             "Lightning has no hook between the two, and the checkpoint path is a local of _run"),
    "_data_fetcher": ("training/resume/exact.py",
                      "a restored loader position needs a fresh iterator from the fetcher Lightning already started; "
                      "_should_check_val_fx takes it too"),
    "_should_check_val_fx": ("training/resume/exact.py",
                             "whether a validation follows this batch (a step save is deferred past it); the rule has "
                             "private inputs of its own (time-based intervals, early stopping)"),
    "_combined_loader_states_to_load": ("training/resume/exact.py",
                                        "the loader positions Lightning restored but never applies once "
                                        "estimated_stepping_batches built the loader; no public way to read or drop "
                                        "them"),
    "_last_global_step_saved": ("training/callbacks/model_checkpoint.py, training/resume/exact.py",
                                "the step a ModelCheckpoint last saved at: ExactResume defers, records and restores "
                                "it (Lightning keeps it in memory only), for any ModelCheckpoint a user configures"),
    "_last_checkpoint_saved": ("training/callbacks/model_checkpoint.py",
                               "the file a ModelCheckpoint saved at this step, which last.ckpt hard-links"),
    "_should_save_on_train_epoch_end": ("training/callbacks/model_checkpoint.py",
                                        "the hook (epoch end or validation end) Lightning saves in, so last.ckpt "
                                        "follows in the same one; it reads a private Trainer setting itself"),
    "_save_last_checkpoint": ("training/callbacks/model_checkpoint.py",
                              "the one place Lightning writes last.ckpt: overridden to link it instead of writing "
                              "the same state twice"),
    "_save_checkpoint": ("training/callbacks/model_checkpoint.py: ModelCheckpoint._save_checkpoint",
                         "each file's entry of the validation of its weights is noted before the write, so that the "
                         "file holds its own (a resumed fit shows the best file's metrics without validating it "
                         "again); the one place a ModelCheckpoint writes a file, with its path"),
    "_check_log_dir_exists": ("training/records/loggers.py: _KeptMetrics",
                              "Lightning's CSVLogger deletes metrics.csv there when a run starts again in its folder; "
                              "the writer has no option to keep it"),
    "_experiment": ("training/records/loggers.py: ResumableCSVLogger.experiment",
                    "the CSVLogger builds its writer in this property and keeps it here (finalize reads it); no "
                    "argument takes another writer class"),
    "_composable": ("training/distributed/fsdp.py: torch.distributed._composable.checkpoint",
                    "the only activation checkpointing that keeps parameter names (checkpoint_wrapper renames them "
                    "and is private too)"),
    "_data_parallel_size": ("training/distributed/fsdp.py: FSDP2Strategy.setup_environment",
                            "every process on the data-parallel axis: the world size is known only once the Trainer "
                            "set the strategy up, and ModelParallelStrategy's `auto` means the number of nodes"),
    "_InstantiatorFn": ("training/cli/instantiators.py: the model and data instantiators",
                        "Lightning's instantiator that stores the config in the hyperparameters "
                        "(load_from_checkpoint); ours wrap it"),
    "_hparams_initial": ("training/callbacks/run_config.py: RunConfig.setup",
                         "secrets masked in the hyperparameters Lightning logs; `hparams_initial` returns a copy"),
}


def test_lightning_is_pinned_to_the_minor_version_read():
    pinned = next(line for line in open(ROOT / "pyproject.toml") if '"lightning' in line)
    assert '"lightning>=2.6.1,<2.7"' in pinned
    assert version("lightning").startswith("2.6.")


def test_the_trainers_precision_values_are_lightnings():
    """training/trainer.py types `precision` with the values lightning.Trainer's signature takes, plus `auto`."""
    from training.trainer import Precision

    def literals(hint) -> set:
        if typing.get_origin(hint) is typing.Literal:
            return set(typing.get_args(hint))
        return set().union(*(literals(arg) for arg in typing.get_args(hint)))

    lightnings = literals(typing.get_type_hints(L.Trainer.__init__)["precision"])
    assert lightnings and set(typing.get_args(Precision)) == lightnings | {"auto"}


# ---- the scan ---------------------------------------------------------------------------------------------------

NAME_ARGUMENT = ("getattr", "setattr", "hasattr", "delattr")


# Names with a leading underscore that their library documents as public: not private, not fenced.
PUBLIC = {"_exit": "os._exit, in the os module's reference (Process Management): ends the process without cleanup; "
                   "imgcls/startup.py ends a finished command's process with it"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name != "_" and name not in PUBLIC


def _dotted(node) -> str | None:
    if isinstance(node, ast.Subscript):  # Generic[T], Dataset[int]: the class itself
        return _dotted(node.value)
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return inner and f"{inner}.{node.attr}"
    return None


def _resolve(path: str):
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(path)


class _Source:
    """One module of the packages: its tree and what each imported name refers to."""

    def __init__(self, path: Path, root: Path, packages: tuple[str, ...]) -> None:
        self.where = path.relative_to(root).as_posix()
        parts = list(path.relative_to(root).with_suffix("").parts)
        self.module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        self.package = ".".join(parts[:-1])
        self.tree = ast.parse(path.read_text(), str(path))
        self.packages = packages
        self.imported: dict[str, str] = {}  # local name -> dotted path
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    self.imported[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname \
                        else alias.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom):
                base = self.absolute(node)
                for alias in node.names:
                    self.imported[alias.asname or alias.name] = f"{base}.{alias.name}"

    def absolute(self, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = self.package.split(".")[: len(self.package.split(".")) - node.level + 1]
        return ".".join(base + ([node.module] if node.module else []))

    def ours(self, module: str) -> bool:
        return module.split(".")[0] in self.packages


def _classes_outside(node):
    """The nodes under `node` (a class or function body), not those of classes nested in it."""
    for child in ast.iter_child_nodes(node):
        yield child
        if not isinstance(child, ast.ClassDef):
            yield from _classes_outside(child)


class _Scan:
    def __init__(self, root: Path, packages: tuple[str, ...]) -> None:
        self.sources = [_Source(p, root, packages) for pkg in packages for p in sorted((root / pkg).rglob("*.py"))]
        self.packages = packages
        self.uses: dict[str, set[str]] = collections.defaultdict(set)  # name -> {"file:line"}, before `own`
        self.library: dict[str, set[str]] = collections.defaultdict(set)  # names known to be a library's
        self.own: set[str] = set()  # private names our own code defines
        self.bases: dict[int, list[type]] = {}  # id(ClassDef) -> the library classes it derives from
        self.defs = {(s.module, n.name): (s, n) for s in self.sources for n in ast.walk(s.tree)
                     if isinstance(n, ast.ClassDef)}
        self.source_of: dict[type, str] = {}
        for source in self.sources:
            self.read(source)

    def library_bases(self, source: _Source, cls: ast.ClassDef) -> list[type]:
        if id(cls) not in self.bases:
            found: list[type] = []
            for base in cls.bases:
                name = _dotted(base)
                if name is None:
                    continue
                head, _, rest = name.partition(".")
                if head not in source.imported and (source.module, name) in self.defs:  # a class of the same module
                    found += self.library_bases(*self.defs[(source.module, name)])
                    continue
                if head in source.imported:
                    path = source.imported[head] + (f".{rest}" if rest else "")
                elif hasattr(builtins, head):
                    path = f"builtins.{name}"
                else:  # a name the module assigns itself
                    path = f"{source.module}.{name}"
                obj = _resolve(path)
                if isinstance(obj, type):
                    found += [k for k in obj.__mro__ if k is not object and not source.ours(k.__module__)]
            self.bases[id(cls)] = found
        return self.bases[id(cls)]

    def sets(self, cls: type, name: str) -> bool:
        """Whether the library class `cls` defines `name`, as a class attribute or as `self.<name>` in its code."""
        if name in vars(cls):
            return True
        if cls not in self.source_of:
            try:
                self.source_of[cls] = inspect.getsource(cls)
            except (OSError, TypeError):
                self.source_of[cls] = ""
        return re.search(rf"\bself\.{name}\b", self.source_of[cls]) is not None

    def read(self, source: _Source) -> None:
        def at(node) -> str:
            return f"{source.where}:{node.lineno}"

        for node in source.tree.body:  # module-level names
            targets = [node.name] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else \
                [n.id for t in getattr(node, "targets", [getattr(node, "target", None)]) if t is not None
                 for n in ast.walk(t) if isinstance(n, ast.Name)] if isinstance(node, (ast.Assign, ast.AnnAssign)) \
                else []
            self.own.update(t for t in targets if _private(t))
        for cls in (n for n in ast.walk(source.tree) if isinstance(n, ast.ClassDef)):
            bases = self.library_bases(source, cls)
            members = [(n.name, n) for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            members += [(t.id, n) for n in cls.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                        for t in getattr(n, "targets", [getattr(n, "target", None)]) if isinstance(t, ast.Name)]
            for node in _classes_outside(cls):
                if isinstance(node, ast.Attribute) and _dotted(node.value) == "self" and _private(node.attr):
                    if any(self.sets(k, node.attr) for k in bases):  # a library's attribute, on our subclass
                        self.library[node.attr].add(at(node))
                    elif isinstance(node.ctx, ast.Store):
                        members.append((node.attr, node))
            for name, node in members:
                if _private(name):
                    if any(self.sets(k, name) for k in bases):  # overrides or sets a library's private
                        self.library[name].add(at(node))
                    else:
                        self.own.add(name)
        for node in ast.walk(source.tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                self.uses[node.attr].add(at(node))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [source.absolute(node)]
                for module in (m for m in modules if not source.ours(m)):
                    for part in (p for p in module.split(".") if _private(p)):
                        self.library[part].add(at(node))
                    if isinstance(node, ast.ImportFrom):
                        for alias in (a for a in node.names if _private(a.name)):
                            self.library[alias.name].add(at(node))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
                self.read_names_in_strings(node, at)

    def read_names_in_strings(self, scope, at) -> None:
        """Attribute names given as strings: a literal passed to getattr & co., and, in a function that passes them a
        computed name, every private-looking string literal of that function."""
        calls = [n for n in ast.walk(scope) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                 and n.func.id in NAME_ARGUMENT and len(n.args) > 1]
        computed = any(not isinstance(c.args[1], ast.Constant) for c in calls)
        for call in calls:
            if isinstance(call.args[1], ast.Constant) and isinstance(call.args[1].value, str) \
                    and _private(call.args[1].value):
                self.uses[call.args[1].value].add(at(call))
        if computed and not isinstance(scope, ast.Module):
            pieces = {id(v) for n in ast.walk(scope) if isinstance(n, ast.JoinedStr) for v in n.values}  # f"{x}_set"
            for node in ast.walk(scope):
                if isinstance(node, ast.Constant) and id(node) not in pieces and isinstance(node.value, str) \
                        and re.fullmatch(r"_\w+", node.value) and _private(node.value):
                    self.uses[node.value].add(at(node))

    def private_names(self) -> dict[str, list[str]]:
        """Each private name of a library the packages use -> where (sorted)."""
        found = {name: set(where) for name, where in self.library.items() if where}
        for name, where in self.uses.items():
            if name not in self.own:
                found.setdefault(name, set()).update(where)
        return {name: sorted(where) for name, where in sorted(found.items())}


def library_private_names(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, list[str]]:
    """The private names of libraries used in `packages` under `root`, each with its `file:line`s.

    A private name (one leading underscore) counts unless our own code defines it: a module-level name, or a method,
    class attribute or `self.` attribute of one of our classes that none of its library base classes defines. An
    override of a library's private method, an assignment to a library's private attribute, a private module in an
    import path, and a name given to getattr/setattr/hasattr/delattr as a string all count. An attribute read on an
    object that is not `self` is judged by its name alone, so a library attribute named like one of ours would pass.
    """
    return _Scan(root, packages).private_names()


def test_the_packages_use_only_the_fenced_private_names():
    used = library_private_names()
    unfenced = {name: where for name, where in used.items() if name not in FENCE}
    stale = sorted(set(FENCE) - set(used))
    assert not unfenced, ("private names of libraries outside tests/test_internals.py's FENCE (use a public API, or "
                          f"add each with the reason none exists): {unfenced}")
    assert not stale, f"FENCE names private names the packages no longer use; remove them: {stale}"
    assert len(FENCE) <= MAX_PRIVATE_NAMES


def test_the_scan_finds_each_kind_of_private_use(tmp_path):
    """The scan on a package written here: a library's private names are found however they are reached, and our own
    private names are not."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text('''
import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed._composable import checkpoint
from lightning.pytorch.cli import _InstantiatorFn

_OWN_CONSTANT = 1


def _own_helper(x):
    return getattr(x, "_via_getattr")


def computed(obj):
    for name in ("_hparams", "public"):
        setattr(obj, name, getattr(obj, name))


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self._mine = 1

    def forward(self, x):
        return self._trainer, self._mine


class Checkpoint(ModelCheckpoint):
    def _save_last_checkpoint(self, trainer, candidates):
        return trainer.fit_loop._data_fetcher, _own_helper(self)

    def own_method(self):
        self._last_global_step_saved = 0
''')
    found = library_private_names(tmp_path, ("pkg",))
    assert set(found) == {"_composable", "_InstantiatorFn", "_via_getattr", "_hparams", "_trainer",
                          "_save_last_checkpoint", "_data_fetcher", "_last_global_step_saved"}
    assert found["_trainer"] == ["pkg/mod.py:25"]


# ---- the fenced names exist in the pinned versions ---------------------------------------------------------------


def test_the_fenced_lightning_methods_exist():
    assert list(inspect.signature(L.Trainer._run).parameters) == ["self", "model", "ckpt_path", "weights_only"]
    assert callable(ModelCheckpoint._should_save_on_train_epoch_end)
    assert list(inspect.signature(ModelCheckpoint._save_last_checkpoint).parameters) == [
        "self", "trainer", "monitor_candidates"]
    assert list(inspect.signature(ModelCheckpoint._save_checkpoint).parameters) == ["self", "trainer", "filepath"]
    from lightning.pytorch.cli import _InstantiatorFn  # noqa: F401
    from torch.distributed._composable import checkpoint  # noqa: F401


def test_the_fenced_lightning_state_exists_on_instances():
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    checkpoint = ModelCheckpoint()
    for name in ("_last_global_step_saved", "_last_checkpoint_saved"):
        assert hasattr(checkpoint, name), name
    for name in ("_combined_loader_states_to_load", "_data_fetcher"):
        assert hasattr(trainer.fit_loop, name), name
    assert "data_fetcher" in inspect.signature(trainer.fit_loop.epoch_loop._should_check_val_fx).parameters
    assert ModelParallelStrategy(data_parallel_size="auto")._data_parallel_size == "auto"
    module = L.LightningModule()
    module.save_hyperparameters({"a": 1})
    assert module._hparams_initial == {"a": 1} and module.hparams_initial is not module._hparams_initial
    assert module._trainer is None


def test_optuna_integration_keys_used_by_the_sweep():
    """training/sweeps/trial.py writes, in a trial process, the system attributes of optuna-integration's protocol
    for a trainer in another process; the sweep reads the pruning decision from the same keys."""
    from optuna_integration.pytorch_lightning import pytorch_lightning as integration

    from training.sweeps.trial import EPOCH_KEY, INTERMEDIATE_KEY, PRUNED_KEY

    assert (INTERMEDIATE_KEY, PRUNED_KEY, EPOCH_KEY) == (integration._INTERMEDIATE_VALUE, integration._PRUNED_KEY,
                                                         integration._EPOCH_KEY)


def test_torchs_fused_sgd_still_leaves_its_momentum_to_a_first_step_the_grad_scaler_skips():
    """Why lightning_modules/optim.py primes a fused SGD's momentum with zeros (`prime_fused_sgd_momentum`): after an
    overflowing first step, which a GradScaler must skip whole, torch's fused SGD holds a momentum buffer it never
    wrote (`torch.empty_like`; torch's loop holds none); on an H100 the production config's fit was nan at step 3.
    Once torch leaves none or zeros, the priming can go."""
    import torch

    states = {}
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # torch.empty* fills its memory with nan: never zeros by chance
    try:
        for fused in (False, True):
            param = torch.nn.Parameter(torch.ones(4))
            optimizer = torch.optim.SGD([param], lr=0.1, momentum=0.9, fused=fused or None)
            scaler = torch.amp.GradScaler("cpu")
            scaler.scale((param * float("inf")).sum()).backward()
            scaler.step(optimizer)
            scaler.update()
            assert torch.equal(param.detach(), torch.ones(4))  # skipped: the weights are untouched either way
            states[fused] = dict(optimizer.state[param])
    finally:
        torch.use_deterministic_algorithms(deterministic)
    assert states[False] == {}
    assert "momentum_buffer" in states[True] and torch.isnan(states[True]["momentum_buffer"]).all(), (
        "torch's fused SGD now leaves no momentum, or zeros, after a skipped first step: remove "
        "prime_fused_sgd_momentum from lightning_modules/optim.py")


def test_wandb_still_takes_the_run_file_flush_interval():
    """training/records/loggers.py sets W&B's experimental `x_transaction_log_flush_interval` (15 s by default), so
    that the rows a checkpoint covers are in the offline run file soon after it; an upgrade that drops the setting
    fails here."""
    import wandb

    from training.records.loggers import WANDB_FLUSH_S

    assert wandb.Settings(x_transaction_log_flush_interval=WANDB_FLUSH_S).x_transaction_log_flush_interval == 1.0
