"""The `imgcls` command: app.py registers ImageClassifier and the data sources with LightningCLI and links them;
`python -m training.cli` and the console script start it through startup.py. Nothing is imported here, so that
startup.py's `begin` comes before the heavy imports."""
