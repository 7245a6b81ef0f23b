"""`imgcls ARGS` (the console script, `main`) and `python -m imgcls ARGS`: the command's imports made and frozen by
the start-up (startup.py), then the command (commands.py)."""

from imgcls.startup import start


def _command():
    from imgcls.commands import main

    return main


def main() -> None:
    """The `imgcls` console script."""
    start(_command)


if __name__ == "__main__":
    main()
