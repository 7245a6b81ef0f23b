"""The `imgcls` command, the room above every other: the table of commands and the dispatcher (commands.py), the
start-up of every imgcls process (startup.py), `python -m imgcls` (__main__.py) and a sweep trial's process (trial.py).
Nothing is imported here, so that startup.py's `begin` comes before the heavy imports."""
