"""The dashboards as a user sees them: headless Chromium (tests/browser.py) opens TensorBoard and optuna-dashboard on
a finished sweep of two tiny trials, and sees the curves of train/loss and val/acc first, the confusion matrix, each
trial's result in the HPARAMS table, and the trials with their values. Shown an empty folder and an empty study, the
same looks fail. benchmarks/pictures.py's looks are the ones `make pictures` photographs."""

from __future__ import annotations

import math

import optuna
import pytest
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from benchmarks import pictures
from tests.browser import ensure_installed
from tests.helpers import run_cli
from tests.test_sweep import LR, sweep_command, write_sweep
from training.records.loggers import HP_METRIC, RESULT_RUN

pytestmark = pytest.mark.slow  # a sweep of two fits, then two servers and a browser


@pytest.fixture(scope="module")
def page():
    ensure_installed()
    with pictures.chromium() as page:
        yield page


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, digits_root):
    """A finished grid sweep of two 1-epoch trials of the shrunk quickstart (TensorBoard only)."""
    folder = tmp_path_factory.mktemp("sweep")
    command = [*sweep_command(digits_root)[:-1], "--trainer.log_every_n_steps", "1", "${args}"]  # 3 steps: 3 points
    spec = write_sweep(folder / "sweep.yaml", digits_root, name="two", command=command,
                       parameters={LR: {"values": [0.02, 0.2]}, "trainer.max_epochs": {"value": 1}})
    run_cli("sweep", str(spec), "--out", str(folder / "out"))
    return folder / "out"


def scalars(run, tag: str) -> list[float]:
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.value for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


def close(shown: str, value: float) -> bool:
    """Whether a number as a dashboard prints it (4 to 5 digits) is `value`."""
    return math.isclose(float(shown), value, rel_tol=1e-3, abs_tol=1e-4)


def test_tensorboard_shows_the_curves_first_the_confusion_matrix_and_each_trials_result(sweep, page, tmp_path):
    trials = sorted(t for t in sweep.glob("trial_*") if t.is_dir())
    study = optuna.load_study(study_name="two", storage=f"sqlite:///{sweep / 'sweep.db'}")
    assert len(trials) == len(study.trials) == 2
    with pictures.tensorboard(sweep, tmp_path / "tensorboard.log") as url:
        curves = pictures.look_at_curves(page, url)  # their groups open first, each card draws a line
        images = pictures.look_at_images(page, url)
        results = pictures.look_at_hparams(page, url, [f"{t.name}/{RESULT_RUN}" for t in trials])
    for trial in trials:
        for tag in pictures.CURVES:
            assert close(curves[tag][trial.name], scalars(trial, tag)[-1]), (tag, trial.name)
    with Image.open(trials[-1] / "figures" / "confusion_matrix.png") as matrix:  # the last one logged
        assert images["val/confusion_matrix"] == matrix.size
    for trial, optuna_trial in zip(trials, study.trials, strict=True):
        best = max(scalars(trial, "val/acc"))
        assert scalars(trial / RESULT_RUN, HP_METRIC) == [pytest.approx(best)]
        assert close(results[f"{trial.name}/{RESULT_RUN}"], best) and close(results[f"{trial.name}/{RESULT_RUN}"],
                                                                              optuna_trial.value)


def test_the_sweep_dashboard_shows_each_trial_and_its_value(sweep, page, tmp_path):
    storage = f"sqlite:///{sweep / 'sweep.db'}"
    study = optuna.load_study(study_name="two", storage=storage)
    with pictures.sweep_dashboard(storage, tmp_path / "dashboard.log") as url:
        shown = pictures.look_at_sweep(page, url, "two")
    assert sorted(shown) == [t.number for t in study.trials]
    assert all(close(shown[t.number], t.value) for t in study.trials), shown


def test_each_look_fails_on_a_dashboard_that_shows_nothing(page, tmp_path):
    """The looks above are checks: TensorBoard on a folder without runs, optuna-dashboard on a study without
    trials, each look raises."""
    (tmp_path / "runs").mkdir()
    with pictures.tensorboard(tmp_path / "runs", tmp_path / "tensorboard.log", read_s=0) as url:
        for look in (pictures.look_at_curves, pictures.look_at_images):
            with pytest.raises(pictures.NothingShown, match="shows no"):
                look(page, url, timeout_s=3)
        with pytest.raises(pictures.NothingShown, match=f"no column {HP_METRIC}"):
            pictures.look_at_hparams(page, url, ["a_run"], timeout_s=3)
    storage = f"sqlite:///{tmp_path / 'empty.db'}"
    optuna.create_study(study_name="empty", storage=storage)
    with pictures.sweep_dashboard(storage, tmp_path / "dashboard.log") as url:
        with pytest.raises(pictures.NothingShown, match="shows no best trial"):
            pictures.look_at_sweep(page, url, "empty", timeout_s=3)

