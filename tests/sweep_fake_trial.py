"""A stand-in for a sweep trial's `imgcls fit` process, with no training and no Lightning import: it leaves in the
study what training.sweeps.trial's callback leaves there (test_trial_callback_leaves_what_the_sweep_reads checks that
the callback does), so that tests of the sweep process run in seconds.

    python -m tests.sweep_fake_trial fit ... --model.optimizer.lr=0.01 ... --trainer.default_root_dir=<run dir>

Two epochs of half a second each, val/acc = lr * epoch; a trial whose number is in $FAKE_TRIAL_PRUNE (comma-separated)
is pruned after its first epoch. With $FAKE_TRIAL_MEET=N, trials 0 to N-1 start their epochs only once N trials are
running (or after 60 s), so that a test of concurrent workers does not depend on how fast processes start.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import optuna
import yaml

from training.sweeps.trial import EPOCH_KEY, INTERMEDIATE_KEY, PRUNED_KEY, TRIAL_ENV_VAR, open_trial


def main(argv: list[str]) -> None:
    options = dict(arg.removeprefix("--").split("=", 1) for arg in argv if arg.startswith("--") and "=" in arg)
    run_dir, lr = Path(options["trainer.default_root_dir"]), float(options["model.optimizer.lr"])
    spec = json.loads(os.environ[TRIAL_ENV_VAR])
    trial, trial_id = open_trial(spec)
    study = trial.study
    prune = str(trial.number) in os.environ.get("FAKE_TRIAL_PRUNE", "").split(",")
    meet = int(os.environ.get("FAKE_TRIAL_MEET", 0))  # trials numbered below it wait (60 s at most) until that many run
    deadline = time.monotonic() + 60
    while trial.number < meet and time.monotonic() < deadline and sum(
            t.state == optuna.trial.TrialState.RUNNING for t in study.get_trials(deepcopy=False)) < meet:
        time.sleep(0.1)
    for key, value in ((INTERMEDIATE_KEY, {}), (PRUNED_KEY, False)):
        trial.storage.set_trial_system_attr(trial_id, key, value)
    for epoch in range(2):
        time.sleep(0.5)
        trial.report(lr * (epoch + 1), step=epoch)
        if prune:
            trial.storage.set_trial_system_attr(trial_id, PRUNED_KEY, True)
            trial.storage.set_trial_system_attr(trial_id, EPOCH_KEY, epoch)
            break
    trial.set_user_attr("final_metrics", {spec["metric"]: lr * (epoch + 1), "val/loss": 1.0})
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"model": {"optimizer": {"init_args": {"lr": lr}}},
                                                         "trainer": {"default_root_dir": str(run_dir)}}))


if __name__ == "__main__":
    main(sys.argv[1:])
