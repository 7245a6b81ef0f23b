"""`python -m training.cli ARGS`: `imgcls ARGS`, its imports made as the console script makes them (startup.py)."""

from training.cli.startup import main

main()
