"""The Trainer commands of `imgcls` (fit, validate, test, predict) as a library: app.py registers ImageClassifier and
the data sources with LightningCLI and links them; the command on top of it is imgcls/ (commands.py, startup.py)."""
