"""Benchmarks of imgcls against plain baselines, run by `make bench`; results go to docs/PERFORMANCE.md."""
