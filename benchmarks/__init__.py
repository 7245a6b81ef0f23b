"""Benchmarks of imgcls against plain baselines, run by `make bench`: results go to
benchmarks/results/machines/<machine>/*.json, and benchmarks/pages.py renders docs/PERFORMANCE.md and the figures
quoted in the docs from them."""
