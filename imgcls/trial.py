"""`python -m imgcls.trial fit ARGS`: one trial of `imgcls sweep`, an `imgcls fit` whose callback reports to the study
(training/sweeps/trial.py), started as every imgcls process is (startup.py). The sweep is handed this command
(commands.TRIAL_LAUNCHER) and starts it with the trial's arguments and $IMGCLS_SWEEP_TRIAL."""

from imgcls.startup import start


def _command():
    import training.cli.app  # noqa: F401  (the CLI that main imports when it runs: here, its imports frozen)
    from training.sweeps.trial import main

    return main


if __name__ == "__main__":
    start(_command)
