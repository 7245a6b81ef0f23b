"""What a fit does after its last epoch: the best checkpoint's metrics, those of the fit's validation of its weights
(validated again only where no such validation is known), and the figures of its validations drawn within their
time budget (the first and the last always)."""

from __future__ import annotations

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import CONFIGS, NO_RUN_CHECKPOINTS, TINY
from training.cli.app import cli_main

EPOCHS = 3


def _images(run) -> dict[str, list[int]]:
    """TensorBoard image tag -> the steps it was logged at, in the order they were written."""
    found: dict[str, list[int]] = {}
    for events in sorted(run.glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"images": 0})
        acc.Reload()
        for tag in acc.Tags()["images"]:
            found.setdefault(tag, []).extend(e.step for e in acc.Images(tag))
    return found


def _val_loss(run) -> dict[int, str]:
    """val/loss of each validation of the fit, as a metrics table shows it: the global step it validated (Lightning
    logs it at the step of the batch before) -> the value to 4 decimals."""
    found: dict[int, str] = {}
    for events in sorted(run.glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        found |= {e.step + 1: f"{e.value:.4f}" for e in acc.Scalars("val/loss")}
    return found


def _fit(tmp_path, digits_root, epochs: int, *, best: str = "oldest", budget: float | None = None,
         plain_lightning: bool = False):
    """A tiny quickstart fit of one-step epochs in tmp_path/run whose checkpoints rank by step (mode max: the newest
    is the best; min: the oldest): the run's own (the `checkpoint` key), or with `plain_lightning` none of its own and
    Lightning's ModelCheckpoint, listed."""
    ranked = {"monitor": "step", "mode": "max" if best == "newest" else "min", "save_top_k": 1}
    checkpoint, callbacks = {**ranked, "every_n_train_steps": 0}, []
    if plain_lightning:
        checkpoint = NO_RUN_CHECKPOINTS
        callbacks = [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                      "init_args": {**ranked, "save_last": True, "filename": "epoch{epoch:03d}-step{step:.4f}",
                                    "auto_insert_metric_name": False, "dirpath": None}}]
    overlay = tmp_path / "callbacks.yaml"
    overlay.write_text(yaml.safe_dump({"checkpoint": checkpoint, "trainer": {"callbacks": [
        *callbacks, {"class_path": "training.callbacks.ValidationFigures", "init_args": {"time_budget": budget}}]}}))
    return cli_main(["fit", "--config", str(CONFIGS / "quickstart.yaml"), "--config", str(overlay), *TINY,
                     "--data.root", str(digits_root), "--trainer.default_root_dir", str(tmp_path / "run"),
                     "--trainer.max_epochs", str(epochs), "--trainer.limit_train_batches", "1",
                     "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false"])


TITLE = "val metrics of the best checkpoint"


def _row(table: str, metric: str) -> str:
    """The first line of `table` that shows `metric`."""
    return next(line for line in table.splitlines() if f" {metric} " in line)


@pytest.mark.parametrize(("best", "budget", "drawn_at"), [
    ("newest", 1e-9, [1, 3]),  # a budget nothing fits in: the first and the last validation only
    ("oldest", None, [1, 2, 3]),  # every validation, and no closing one: step 1's validation was of the best weights
])
def test_the_best_checkpoints_metrics_are_those_of_the_validation_of_its_weights(
        tmp_path, digits_root, capsys, best, budget, drawn_at):
    from training.cli.app import ImgclsCLI

    capsys.readouterr()
    cli = _fit(tmp_path, digits_root, EPOCHS, best=best, budget=budget)
    assert isinstance(cli, ImgclsCLI)
    step = EPOCHS if best == "newest" else 1
    assert cli.trainer.checkpoint_callback.best_model_path.endswith(f"-step{step}.0000.ckpt")  # the run's own file
    assert cli.trainer.state.fn == "fit"  # a closing validation would leave the trainer in `validate`
    printed = capsys.readouterr().out  # on stdout, as Lightning prints a validation's table
    table = printed[printed.index(TITLE):]
    assert printed.count(TITLE) == 1 and f"validated at step {step})" in table and "val/acc " in table
    run = tmp_path / "run"
    losses = _val_loss(run)
    assert len(set(losses.values())) == EPOCHS  # each validation's loss tells it from the others
    assert losses[step] in _row(table, "val/loss")
    images = _images(run)
    assert images["val/confusion_matrix"] == drawn_at and images["val/misclassified"] == drawn_at
    assert (run / "figures" / "confusion_matrix.png").is_file()


def test_the_validation_of_the_best_weights_is_remembered_across_a_resume(tmp_path, digits_root, capsys):
    """The best file is step 1's, saved by the first process; the resumed fit to 3 epochs shows its validation's
    metrics, kept in the checkpoint, and validates nothing again."""
    _fit(tmp_path, digits_root, 2)
    capsys.readouterr()
    cli = _fit(tmp_path, digits_root, EPOCHS)
    assert cli.trainer.global_step == EPOCHS and cli.trainer.state.fn == "fit"
    printed = capsys.readouterr().out
    assert printed.count(TITLE) == 1 and "validated at step 1)" in printed
    losses = _val_loss(tmp_path / "run")
    assert len(set(losses.values())) == EPOCHS and losses[1] in _row(printed[printed.index(TITLE):], "val/loss")


def test_the_best_file_of_a_plain_lightning_checkpoint_is_validated_again(tmp_path, digits_root, capsys):
    """Lightning's own ModelCheckpoint keeps no record of the validations of its files: the best is validated again
    from its file, and that validation's figures are drawn."""
    capsys.readouterr()
    cli = _fit(tmp_path, digits_root, EPOCHS, plain_lightning=True)
    assert type(cli.trainer.checkpoint_callback).__module__.startswith("lightning.")
    assert cli.trainer.state.fn == "validate"
    assert TITLE not in capsys.readouterr().out
    assert _images(tmp_path / "run")["val/confusion_matrix"] == [1, 2, 3, 3]


def test_a_time_budget_outside_zero_to_one_is_refused():
    from training.callbacks import ValidationFigures

    for budget in (0, -0.1, 1.5):
        with pytest.raises(ValueError, match="time_budget must be in"):
            ValidationFigures(time_budget=budget)
