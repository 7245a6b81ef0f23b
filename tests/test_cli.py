"""The imgcls command: every shipped config parses, the quickstart runs, checkpoints validate and resume."""

from __future__ import annotations

import contextlib
import io
import json
import logging
from pathlib import Path

import pytest
import torch
import torchvision
import yaml
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelSummary

from core import hardware
from imgcls.commands import EXTRA_COMMANDS, main
from tests.helpers import CONFIGS, TINY, cli_env, make_image_folder, run_cli
from training.cli.app import cli_main

QUIET = ["--trainer.enable_model_summary", "false"]


def _trainer_configs() -> list[Path]:
    """Shipped LightningCLI configs (sweep files have their own schema and their own tests)."""
    # sweeps/ are sweep files, callbacks/ the list that configs name as their `trainer.callbacks` (parsed with them)
    return sorted(p for p in CONFIGS.rglob("*.yaml") if not {"sweeps", "callbacks"} & set(p.parts))


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch):
    """In-process CLI runs must not see pytest's own command line."""
    monkeypatch.setattr("sys.argv", ["imgcls"])


def _print_config(*args: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        main(["fit", *args, "--print_config"])
    assert exit_.value.code in (0, None), out.getvalue()
    return yaml.safe_load(out.getvalue())


@pytest.mark.parametrize("config", _trainer_configs(), ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_shipped_config_parses(config):
    # Overlays (loggers/, fsdp.yaml) are partial: each file is parsed on top of the quickstart, as users compose them.
    printed = _print_config("--config", str(CONFIGS / "quickstart.yaml"), "--config", str(config))
    assert printed["model"]["net"]["init_args"]["arch"].startswith(("resnet", "wide_resnet"))
    assert printed["trainer"]["default_root_dir"]


def test_production_config_prints_on_its_own():
    printed = _print_config("--config", str(CONFIGS / "imagenet_ddp8.yaml"))
    trainer, model = printed["trainer"], printed["model"]
    # precision auto is 16-mixed on these GPUs (tests/test_hardware.py checks the rule on a mocked CUDA machine)
    assert (trainer["accelerator"], trainer["devices"], trainer["precision"]) == ("gpu", 8, "auto")
    assert trainer["strategy"]["class_path"].endswith("DDPStrategy")
    data = printed["data"]
    assert data["class_path"] == "datamodules.ImageFolderDataModule"  # the default data source
    net = model["net"]["init_args"]
    assert (net["arch"], net["weights"], data["init_args"]["batch_size"]) == ("resnet50", "IMAGENET1K_V2", 64)
    assert printed["checkpoint"] == {"monitor": "val/acc", "mode": "max", "save_top_k": 2, "save_last": True,
                                     "every_n_train_steps": 500}  # the run's checkpoints; every 500 steps here
    assert not [c for c in trainer["callbacks"] if c["class_path"].endswith("Checkpoint")]  # the key's, not listed
    assert printed["freeze"] == {"epochs": 1}  # training.callbacks.FreezeBackbone: the head trains alone first


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in ("fit", "validate", "test", "predict", *EXTRA_COMMANDS):
        assert command in out


def test_fit_help_lists_the_architectures_and_ranges(capsys):
    """model.net.arch (the default network's) is a Literal of torchvision's models (or timm/<name>), shown by the
    network's own help; the numbers carry their ranges."""
    with pytest.raises(SystemExit):
        main(["fit", "--model.net.help", "lightning_modules.network.BackboneWithHead"])
    out = " ".join(capsys.readouterr().out.split())
    start = out.index("--model.net.arch ARCH any torchvision")  # the help entry, not the usage line
    arch_help = out[start:out.index("--model.net.weights WEIGHTS", start)]
    for name in ("'resnet50'", "'convnext_tiny'", "'vit_b_16'", "TimmArch"):
        assert name in arch_help
    assert "NonNegativeInt" in out[out.index("--model.net.head_hidden"):]
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--model.net.help" in out and "NonNegativeFloat" in out[out.index("--model.recipe.backbone_lr_ratio"):]


def test_help_shows_each_settings_fields_docstring_which_only_help_parses(capsys, monkeypatch):
    """jsonargparse finds a dataclass field's docstring by parsing its class's source (2 of the 5 s a small fit spends
    after its imports): `--help` shows those of model.recipe and model.levers; a command that prints no help parses
    none."""
    import docstring_parser

    from lightning_modules.settings import Levers, Recipe
    from training.cli.app import asks_for_help

    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for settings in (Recipe, Levers):
        fields = docstring_parser.parse_from_object(settings).params
        assert {f.arg_name for f in fields} == set(settings.__dataclass_fields__)
        assert all(" ".join(f.description.split()) in out for f in fields)

    parsed = []
    monkeypatch.setattr(docstring_parser, "parse_from_object", lambda *a, **k: parsed.append(a))
    _print_config()
    assert parsed == []
    for args, help_ in ((["--help"], True), (["-h"], True), (["--model.net.help", "X"], True),
                        (["--print_config=skip_null,comments"], True), (["--print_config", "comments"], True),
                        (["--print_config"], False), (["--print_config", "--config", "comments"], False),
                        (["--config", "comments.yaml"], False)):
        assert asks_for_help(["fit", *args]) == help_, args
    assert not asks_for_help([])  # `imgcls` alone: its usage line


def test_quickstart_fast_dev_run(digits_root, tmp_path):
    proc = run_cli("fit", "--config", str(CONFIGS / "quickstart.yaml"), "--data.root", str(digits_root),
                   "--trainer.fast_dev_run", "1", "--trainer.default_root_dir", str(tmp_path / "run"))
    assert "`Trainer.fit` stopped: `max_steps=1` reached" in proc.stdout + proc.stderr


def _tiny_fit_args(root: Path, run: Path, epochs: int) -> list[str]:
    return ["--config", str(CONFIGS / "quickstart.yaml"), *TINY, *QUIET, "--data.root", str(root),
            "--trainer.default_root_dir", str(run), "--trainer.max_epochs", str(epochs),
            "--trainer.limit_train_batches", "4", "--trainer.limit_val_batches", "2", "--trainer.precision", "32-true"]


def test_fit_then_validate_last_checkpoint_reproduces_val_acc(digits_root, tmp_path, monkeypatch, caplog):
    run = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.INFO):  # the run directory relative to the working directory, as configs name it
        fit = cli_main(["fit", *_tiny_fit_args(digits_root, Path("run"), epochs=2)])
    # fit ends by saying where everything went, in paths relative to the working directory.
    best = Path(fit.trainer.checkpoint_callback.best_model_path)
    assert best.resolve().parent == run.resolve() / "checkpoints" and best.is_file()
    for line in ("run directory   run\n", f"best checkpoint run/checkpoints/{best.name} (val/acc 0.",
                 "last checkpoint run/checkpoints/last.ckpt  (resume: add --ckpt_path last)",
                 "resolved config run/config.yaml\n", "dashboard       make dashboard"):
        assert line in caplog.text
    assert caplog.text.count("checkpoints     run/checkpoints: ") == 1  # two callbacks save there: one line
    last = run / "checkpoints" / "last.ckpt"
    ckpt = torch.load(last, weights_only=True, map_location="cpu")
    state = next(v for k, v in ckpt["callbacks"].items() if k.startswith("ModelCheckpoint"))
    logged = float(state["current_score"])  # val/acc logged at the end of the last epoch
    fit_config = (run / "config.yaml").read_text()

    cli = cli_main(["validate", "--config", str(run / "config.yaml"), "--ckpt_path", str(last), *QUIET])
    val = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
    assert val["val/acc"] == pytest.approx(logged, abs=1e-6)
    assert 0.0 <= val["val/f1_macro"] <= 1.0 and val["val/acc"] <= val["val/acc_top5"] <= 1.0  # 10 classes: top-5
    assert ckpt["hyper_parameters"]["class_names"] == [str(i) for i in range(10)]  # travels in the checkpoint

    # The same checkpoint on the held-out test/ split (180 images).
    cli = cli_main(["test", "--config", str(run / "config.yaml"), "--ckpt_path", str(last), *QUIET,
                    "--trainer.limit_test_batches", "3"])
    test = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
    assert set(test) == {"test/acc", "test/acc_top5", "test/f1_macro", "test/loss"}
    assert test["test/acc"] <= test["test/acc_top5"] <= 1.0 and 0.0 <= test["test/f1_macro"] <= 1.0
    assert test["test/loss"] > 0.0
    # Evaluating from the run's config.yaml leaves it as fit wrote it; each command records its own beside it.
    assert (run / "config.yaml").read_text() == fit_config
    assert "ckpt_path" in (run / "validate_config.yaml").read_text() and (run / "test_config.yaml").is_file()


def test_progress_bar_checkpoints_summary_and_loggers_can_be_switched_off_from_the_command_line(digits_root, tmp_path):
    """The quickstart keeps two checkpoint callbacks (its `checkpoint` key) and lists a RichProgressBar and a
    LearningRateMonitor, which Lightning refuses next to their switches turned off (a traceback, before), and a
    RichModelSummary, which it kept whatever its switch said: --trainer.enable_progress_bar,
    --trainer.enable_checkpointing, --trainer.logger (false, or an empty list as here) and
    --trainer.enable_model_summary false (QUIET) leave each out. A user's own callbacks stay."""
    run = tmp_path / "run"
    cli = cli_main(["fit", *_tiny_fit_args(digits_root, run, epochs=1), "--trainer.max_steps", "1",
                    "--trainer.enable_progress_bar", "false", "--trainer.enable_checkpointing", "false",
                    "--trainer.logger", "[]", "--trainer.callbacks+=tests.test_cli.EpochRecorder"])
    assert cli.trainer.global_step == 1 and cli.trainer.progress_bar_callback is None
    assert cli.trainer.checkpoint_callbacks == [] and not list(run.rglob("*.ckpt"))
    assert not any(isinstance(c, ModelSummary | LearningRateMonitor) for c in cli.trainer.callbacks)
    assert cli.trainer.loggers == []
    assert [c.epochs for c in cli.trainer.callbacks if isinstance(c, EpochRecorder)] == [[0]]


@pytest.mark.parametrize(("precision", "dtype"), [("bf16-true", torch.bfloat16)])  # 64-true: the same path
def test_a_true_precision_fit_gets_batches_of_its_dtype(digits_root, tmp_path, precision, dtype):
    """Lightning converts a batch to a true precision's dtype before the DataModule makes its images float on the
    device: the float32 batch met bf16 weights ("Input type (torch.FloatTensor) and weight type (CPUBFloat16Type)
    should be the same"), at the first step. The device stage converts its float batch as Lightning would."""
    cli = cli_main(["fit", *_tiny_fit_args(digits_root, tmp_path / "run", epochs=1), "--trainer.precision", precision])
    assert cli.trainer.global_step == 4 and next(cli.model.parameters()).dtype == dtype
    assert "val/acc" in cli.trainer.callback_metrics


class EpochRecorder(Callback):
    """Records which epochs this process trained."""

    def __init__(self) -> None:
        self.epochs: list[int] = []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.epochs.append(trainer.current_epoch)


def test_ckpt_path_last_resumes_from_the_saved_epoch(digits_root, tmp_path):
    run = tmp_path / "run"
    cli_main(["fit", *_tiny_fit_args(digits_root, run, epochs=1)])
    first = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert first["epoch"] == 0 and first["global_step"] == 4

    cli = cli_main(["fit", *_tiny_fit_args(digits_root, run, epochs=3), "--ckpt_path", "last",
                    "--trainer.callbacks+=tests.test_cli.EpochRecorder"])
    recorder = next(c for c in cli.trainer.callbacks if isinstance(c, EpochRecorder))
    assert recorder.epochs == [1, 2]  # epoch 0 was not trained again
    assert cli.trainer.global_step == 12


@pytest.mark.slow  # torch.compile of ResNet50: ~50 s on 2 cores with a cold inductor cache
def test_production_config_runs_one_batch_on_cpu(tmp_path):
    """configs/imagenet_ddp8.yaml as shipped (ResNet50, IMAGENET1K_V2 from the hub cache, levers auto), one device."""
    make_image_folder(tmp_path / "data", {"cat": 4, "dog": 4}, size=64, ext=".jpg")
    hub = tmp_path / "torch" / "hub" / "checkpoints"
    hub.mkdir(parents=True)
    torch.save(torchvision.models.resnet50(weights=None).state_dict(), hub / "resnet50-11ad3fa6.pth")
    proc = run_cli("fit", "--config", str(CONFIGS / "imagenet_ddp8.yaml"), "--trainer.accelerator", "cpu",
                   "--trainer.devices", "1", "--trainer.fast_dev_run", "1", "--data.root", str(tmp_path / "data"),
                   "--data.num_workers", "0", "--data.batch_size", "4", "--data.image_size", "64",
                   "--trainer.default_root_dir", str(tmp_path / "run"), env=cli_env(TORCH_HOME=str(tmp_path / "torch")))
    # precision and compile: auto resolves from this CPU (precision 32-true without native bf16, bf16-mixed with it;
    # compile off), and says why.
    hw = hardware.detect()
    (expected, why), (_, no_compile) = hardware.choose_precision(hw, "cpu"), hardware.choose_compile(hw, "cpu")
    assert f"precision: {expected} ({why})" in proc.stderr + proc.stdout
    assert f"compile off ({no_compile})" in proc.stderr + proc.stdout


def test_the_compile_lever_runs_a_compiled_step(tmp_path, digits_root):
    """`model.levers.compile: true` compiles the network in place and the step runs compiled (the probe counts the
    graphs dynamo compiled), on a two-layer user network: from a cold inductor cache, as on a fresh CI machine, this
    test takes ~20 s on 2 cores, the production config's ResNet50 compiled took 35-45 s."""
    proc = run_cli("fit", "--config", str(CONFIGS / "quickstart.yaml"), *TINY, "--data.root", str(digits_root),
                   "--model.net", "tests.user_plugins.SmallGeMNet", "--trainer.fast_dev_run", "1",
                   "--model.levers.compile", "true",
                   "--trainer.callbacks+=tests.compile_probe.CompiledGraphs",
                   "--trainer.callbacks.out", str(tmp_path / "compiled.json"),
                   "--trainer.default_root_dir", str(tmp_path / "run"))
    assert "compile on (set in the config)" in proc.stdout + proc.stderr
    compiled = json.loads((tmp_path / "compiled.json").read_text())
    assert compiled["graphs"] >= 1 and compiled["frames"] >= 1, compiled  # a compiled step ran, not only the lever


STARTUP_PROBE = """
import gc, json, os, runpy, sys
import optuna
from imgcls import startup
# A sweep's trial process reads its trial from the study (training/sweeps/trial.py): one, asked of a journal file.
url = "journal:///" + os.path.join(sys.argv[1], "study.journal")
from training.sweeps.trial import open_storage
optuna.create_study(study_name="probe", storage=open_storage(url), direction="maximize").ask()
os.environ["IMGCLS_SWEEP_TRIAL"] = json.dumps({"storage": url, "study": "probe", "trial_number": 0,
                                               "metric": "val/acc", "hyperband": None})
sys.argv = ["imgcls", "fit", "--config", "configs/quickstart.yaml", "--print_config"]
collections = lambda: sum(generation["collections"] for generation in gc.get_stats())
begin, done, started = startup.begin, startup.done, []
def counted_begin():
    begin()
    started.append(collections())
def counted_done():  # the collections run between begin and done: while the imports ran
    print(f"collections while importing: {collections() - started.pop()}", file=sys.stderr)
    done()
startup.begin, startup.done = counted_begin, counted_done
for entry in ("python -m imgcls", "imgcls", "python -m imgcls.trial"):
    gc.unfreeze()
    try:
        if entry == "imgcls":  # the console script
            from imgcls.__main__ import main
            main()
        else:
            runpy.run_module(entry.split()[-1], run_name="__main__")
    except SystemExit as stop:
        assert stop.code in (None, 0), stop.code
    print(f"{entry}: {gc.get_freeze_count()} frozen, collector {'on' if gc.isenabled() else 'off'}", file=sys.stderr)
"""


def test_every_entry_point_freezes_its_imports_and_runs_with_the_collector_on(tmp_path):
    """`imgcls`, `python -m imgcls` and a sweep's trial process import with the cyclic collector off (no
    collection runs), freeze what the imports built, and run the command with the collector back on
    (imgcls/startup.py). The probe runs each entry in one fresh interpreter, so this process's objects stay
    unfrozen."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", STARTUP_PROBE, str(tmp_path)], cwd=CONFIGS.parent, env=cli_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("trainer:") == 3  # each entry ran the command
    found = dict(line.split(": ", 1) for line in proc.stderr.splitlines() if line.startswith(("python -m", "imgcls:")))
    assert set(found) == {"python -m imgcls", "imgcls", "python -m imgcls.trial"}, proc.stderr[-3000:]
    # Each entry's imports ran no collection (a first import of torch and Lightning runs dozens with it on).
    assert [line for line in proc.stderr.splitlines() if line.startswith("collections while importing")] == \
        ["collections while importing: 0"] * 3, proc.stderr[-3000:]
    for entry, state in found.items():
        count, collector = state.split(" frozen, collector ")
        assert int(count) > 100_000 and collector == "on", (entry, state)


EXIT_PROBE = """
import atexit, sys, threading, time
from pathlib import Path
from imgcls import startup

out, how = Path(sys.argv[1]), sys.argv[2]


class Freed:  # a module's object: only the interpreter's teardown frees it
    def __init__(self, path):
        self.path = path

    def __del__(self, open=open):  # bound now: the teardown empties the builtins before it gets here
        open(self.path, "w").close()


kept = Freed(str(out / "freed"))


def command():
    global log
    log = open(out / "log.txt", "w")  # a user's callback's own log, never closed: its line sits in the buffer
    log.write("a line never flushed")
    atexit.register(lambda: (out / "exit_function").touch())
    threading.Thread(target=lambda: time.sleep(0.5) or (out / "thread").touch()).start()  # not a daemon
    sys.stdout.write("the last line, without its newline")  # buffered: a pipe
    if how not in ("return", "plain"):
        sys.exit(int(how) if how.isdigit() else how)


startup.run(command) if how != "plain" else command()
"""


@pytest.mark.parametrize("how, status", [("return", 0), ("3", 3), ("refused: the reason", 1), ("plain", 0)])
def test_an_imgcls_process_ends_with_its_status_after_its_threads_and_exit_functions_without_teardown(
        tmp_path, how, status):
    """startup.run: once the command has returned or exited, the interpreter joins the threads and runs the exit
    functions as always, and the process ends with the command's status, its output and its open files flushed, but
    no object of its heap is freed one by one (a module's `__del__` does not run); "plain", the command without run:
    the teardown frees it, so the probe tells the two apart."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", EXIT_PROBE, str(tmp_path), how], cwd=CONFIGS.parent, env=cli_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == status, proc.stderr[-3000:]
    assert proc.stdout == "the last line, without its newline"
    assert proc.stderr.strip() == (how if status == 1 else "")  # SystemExit's message, printed by the interpreter
    assert (tmp_path / "thread").exists() and (tmp_path / "exit_function").exists()
    assert (tmp_path / "log.txt").read_text() == "a line never flushed"  # flushed, as the teardown flushes a file
    assert (tmp_path / "freed").exists() == (how == "plain")
