"""Many processes: DDP with gradient compression hooks on every backend (strategy.py) and FSDP2 (fsdp.py);
docs/DISTRIBUTED.md."""
