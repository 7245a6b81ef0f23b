"""What a run leaves behind: its directory and closing summary (run_dir.py), the run a checkpoint records
(saved_run.py), the loggers (loggers.py), a validation's plots for the dashboards (plots.py), `imgcls report`
(report.py), and the masking of secrets in all of them (secrets.py)."""
