"""What a fit does after its last epoch: the best checkpoint's metrics, validated again only when needed, and the
figures of its validations drawn within their time budget (the first and the last always)."""

from __future__ import annotations

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import CONFIGS, TINY
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


@pytest.mark.parametrize(("best", "budget", "closing", "drawn_at"), [
    # monitor "step", mode max: the newest checkpoint is the best, and the fit's newest validation was of it
    ("newest", 1e-9, False, [1, 3]),  # a budget nothing fits in: the first and the last validation only
    ("oldest", None, True, [1, 2, 3, 3]),  # every validation, then the closing one of the best (epoch 0's) file
])
def test_the_best_checkpoint_is_validated_again_only_when_it_is_not_the_last_validated(
        tmp_path, digits_root, capsys, best, budget, closing, drawn_at):
    from training.cli.app import ImgclsCLI

    run = tmp_path / "run"
    overlay = tmp_path / "callbacks.yaml"
    overlay.write_text(yaml.safe_dump({"trainer": {"callbacks": [
        {"class_path": "training.callbacks.ModelCheckpoint",
         "init_args": {"monitor": "step", "mode": "max" if best == "newest" else "min", "save_top_k": 1,
                       "save_last": True, "filename": "s{step}", "auto_insert_metric_name": False, "dirpath": None,
                       "every_n_train_steps": None}},
        {"class_path": "training.callbacks.ValidationFigures", "init_args": {"time_budget": budget}}]}}))
    capsys.readouterr()
    cli = cli_main(["fit", "--config", str(CONFIGS / "quickstart.yaml"), "--config", str(overlay), *TINY,
                    "--data.root", str(digits_root), "--trainer.default_root_dir", str(run),
                    "--trainer.max_epochs", str(EPOCHS), "--trainer.limit_train_batches", "1",
                    "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false"])
    assert isinstance(cli, ImgclsCLI)
    ckpt = cli.trainer.checkpoint_callback
    assert ckpt.best_model_path.endswith("s3.ckpt" if best == "newest" else "s1.ckpt")
    # A closing validation leaves the trainer in `validate`; without it the fit's state stays.
    assert cli.trainer.state.fn == ("validate" if closing else "fit")
    printed = capsys.readouterr().out  # on stdout, as Lightning prints a validation's table
    title = "val metrics of the best checkpoint"
    if closing:
        assert title not in printed
    else:  # the newest validation's metrics, shown as the best checkpoint's
        table = printed[printed.index(title):]
        assert printed.count(title) == 1 and "validated at step 3" in table and "val/acc " in table
        assert f"{float(cli.trainer.callback_metrics['val/acc']):.4f}" in table
    images = _images(run)
    assert images["val/confusion_matrix"] == drawn_at and images["val/misclassified"] == drawn_at
    assert (run / "figures" / "confusion_matrix.png").is_file()


def test_a_time_budget_outside_zero_to_one_is_refused():
    from training.callbacks import ValidationFigures

    for budget in (0, -0.1, 1.5):
        with pytest.raises(ValueError, match="time_budget must be in"):
            ValidationFigures(time_budget=budget)
