"""The run layer: the Trainer (trainer.py), and a folder per subsystem: the Trainer commands (cli/), the callbacks a
config names (callbacks/), resume and fault tolerance (resume/), what a run leaves behind (records/), many processes
(distributed/) and sweeps (sweeps/)."""
