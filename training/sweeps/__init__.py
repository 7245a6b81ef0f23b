"""`imgcls sweep`: a sweep file in W&B's schema (space.py), run by Optuna (command.py), one `imgcls fit` process per
trial that reports to the study (trial.py); docs/EXPERIMENTS.md."""
