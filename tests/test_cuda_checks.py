"""The CUDA tests' checks, held on the CPU: each passes a run that keeps its promise and fails one that breaks it
(tests/cuda_checks.py); the GPU check's record names every CUDA test the suite has; under CI=true with a CUDA device,
no CUDA test skips (tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from benchmarks import cuda_tests
from tests.cuda_checks import (
    CPU_FP16,
    INITIAL_SCALE,
    OVERFLOW,
    assert_hook_registered,
    assert_scaler_restored,
    compression_strategy,
    probe,
    short_config,
)
from tests.helpers import ROOT, fit_run, killed_and_resumed

FORGET_SCALER = {"class_path": "tests.fault_injection.ForgetScaler"}


def _checkpoints(run, states: dict[str, tuple[float, int]]) -> None:
    """Files in `<run>/checkpoints` that hold only a GradScaler state, (scale, growth tracker) by file name."""
    (run / "checkpoints").mkdir(parents=True)
    for name, (scale, tracker) in states.items():
        torch.save({"MixedPrecision": {"scale": scale, "growth_factor": 2.0, "backoff_factor": 0.5,
                                       "growth_interval": 2000, "_growth_tracker": tracker}},
                   run / "checkpoints" / name)


def test_the_scaler_check_refuses_an_unlowered_scale_and_another_growth_tracker(tmp_path):
    overflowed = {"step0000010.ckpt": (INITIAL_SCALE / 2, 3), "last.ckpt": (INITIAL_SCALE / 2, 5)}
    _checkpoints(tmp_path / "reference", overflowed)
    _checkpoints(tmp_path / "resumed", {**overflowed, "step0000002.ckpt": (INITIAL_SCALE / 4, 0)})
    assert_scaler_restored(tmp_path / "reference", tmp_path / "resumed")  # files of the killed process are not shared
    _checkpoints(tmp_path / "fresh", {"step0000010.ckpt": (INITIAL_SCALE, 3), "last.ckpt": (INITIAL_SCALE, 5)})
    with pytest.raises(AssertionError, match="no overflow lowered"):
        assert_scaler_restored(tmp_path / "fresh", tmp_path / "fresh")
    _checkpoints(tmp_path / "counted", {**overflowed, "last.ckpt": (INITIAL_SCALE / 2, 4)})
    with pytest.raises(AssertionError, match="differs from the uninterrupted run's"):
        assert_scaler_restored(tmp_path / "reference", tmp_path / "counted")


def test_the_scaler_check_holds_a_16_mixed_resume_on_the_cpu_and_fails_one_that_forgot_its_scaler(tmp_path,
                                                                                                   digits_root):
    """tests/test_cuda.py's fit, on the CPU's fp16 autocast and GradScaler: the forced overflow lowers the scale, the
    resume restores it, and a resume that drops it from the checkpoint (tests.fault_injection.ForgetScaler) fails."""
    config = short_config(tmp_path, digits_root, "fp16", accelerator="cpu", callbacks=(OVERFLOW,), **CPU_FP16)
    assert killed_and_resumed(config, tmp_path, kill_after=3, resumes_from=2) == 0.0
    assert_scaler_restored(tmp_path / "reference", tmp_path / "killed")
    forgetful = short_config(tmp_path, digits_root, "forgetful", accelerator="cpu", callbacks=(OVERFLOW, FORGET_SCALER),
                             **CPU_FP16)
    killed_and_resumed(forgetful, tmp_path / "forgot", kill_after=3, resumes_from=2, reference=tmp_path / "reference")
    with pytest.raises(AssertionError, match="differs from the uninterrupted run's"):
        assert_scaler_restored(tmp_path / "reference", tmp_path / "forgot" / "killed")


def test_the_hook_check_holds_compressed_ddp_on_gloo_and_fails_lightnings_ddp_that_skips_the_hook_on_cpu(
        tmp_path, digits_root):
    """tests/test_cuda.py's NCCL fit on a gloo group of one: the check names the backend, and it fails a run whose
    hook was configured and never registered (Lightning's DDPStrategy registers hooks on CUDA devices only)."""
    config = short_config(tmp_path, digits_root, "fp16", accelerator="cpu", strategy=compression_strategy("fp16"),
                          callbacks=(probe(tmp_path / "probe"),))
    assert "val/acc" in fit_run(config, tmp_path / "run").stdout
    assert_hook_registered(tmp_path / "probe", "fp16_compress_hook", backend="gloo")
    with pytest.raises(AssertionError, match="on a 'gloo' process group, not 'fp16_compress_hook' on 'nccl'"):
        assert_hook_registered(tmp_path / "probe", "fp16_compress_hook", backend="nccl")
    lightning = {"class_path": "lightning.pytorch.strategies.DDPStrategy", "init_args": {
        "ddp_comm_hook": "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook"}}
    config = short_config(tmp_path, digits_root, "lightning", accelerator="cpu", strategy=lightning,
                          callbacks=(probe(tmp_path / "unhooked"),))
    assert "val/acc" in fit_run(config, tmp_path / "lightning").stdout
    with pytest.raises(AssertionError, match="logged the hook None on a 'gloo' process group"):
        assert_hook_registered(tmp_path / "unhooked", "fp16_compress_hook", backend="gloo")


def test_the_newest_gpu_record_ran_every_cuda_test_but_those_not_yet_run_on_a_gpu():
    """The GPU check's newest record names every cuda test it ran; one added or changed since waits in
    benchmarks.cuda_tests.NOT_YET_RUN_ON_A_GPU, with why, until the next check runs it and it leaves the list."""
    suite = set(cuda_tests.collected())
    assert suite, "no cuda test collected"
    problems = cuda_tests.coverage_problems(suite, cuda_tests.newest_record(), cuda_tests.NOT_YET_RUN_ON_A_GPU)
    assert not problems, "\n".join(problems)


def test_the_coverage_check_names_an_unrun_test_a_stale_entry_and_an_entry_for_no_test():
    record = {"results": {"tests": [{"test": "test_x::ran", "outcome": "passed"},
                                    {"test": "test_x::failed", "outcome": "failure"},
                                    {"test": "test_x::skipped", "outcome": "skipped"}]}}
    suite = {"test_x::ran", "test_x::failed", "test_x::skipped", "test_x::new"}
    assert cuda_tests.coverage_problems(suite, record, {"test_x::new": "why", "test_x::skipped": "why"}) == []
    problems = cuda_tests.coverage_problems(suite, record, {"test_x::ran": "why", "test_x::gone": "why"})
    unrun = "a cuda test that the newest GPU record did not run and NOT_YET_RUN_ON_A_GPU does not list"
    assert problems == [f"test_x::new: {unrun}", f"test_x::skipped: {unrun}",
                        "test_x::ran: ran in the newest GPU record; remove it from NOT_YET_RUN_ON_A_GPU",
                        "test_x::gone: listed in NOT_YET_RUN_ON_A_GPU, but the suite has no such cuda test"]
    assert len(cuda_tests.coverage_problems(suite, None, {})) == len(suite)  # no GPU record at all


MARK = "cuda"  # not spelled out in this file: benchmarks.cuda_tests.test_files() would take it for a GPU test file
TESTS = f"""
import pytest

@pytest.mark.{MARK}
def test_cuda_skips_itself():
    pytest.skip("no NCCL here")

@pytest.mark.{MARK}
def test_cuda_passes():
    pass

def test_other_skips():
    pytest.skip("not a GPU test")
"""


@pytest.mark.parametrize("ci, cuda, expected", [
    ("true", True, {"test_cuda_skips_itself": "failure", "test_cuda_passes": "passed", "test_other_skips": "skipped"}),
    ("false", True, {"test_cuda_skips_itself": "skipped", "test_cuda_passes": "passed", "test_other_skips": "skipped"}),
    ("true", False, {"test_cuda_skips_itself": "skipped", "test_cuda_passes": "skipped",  # CI's CPU machines
                     "test_other_skips": "skipped"}),
])
def test_under_ci_with_a_cuda_device_no_cuda_test_skips(tmp_path, ci, cuda, expected):
    """tests/conftest.py's hooks in a pytest run of their own; a visible CUDA device is torch.cuda.is_available
    answering True (a plugin of the run)."""
    (tmp_path / "test_tiny.py").write_text(TESTS)
    (tmp_path / "pytest.ini").write_text(f"[pytest]\nmarkers =\n    {MARK}: needs a CUDA device\n")
    (tmp_path / "visible_cuda.py").write_text("import torch\n\ntorch.cuda.is_available = lambda: True\n")
    plugins = ["-p", "tests.conftest", *(["-p", "visible_cuda"] if cuda else [])]
    env = {**os.environ, "CI": ci, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    subprocess.run([sys.executable, "-m", "pytest", *plugins, "-p", "no:cacheprovider", "--junitxml=junit.xml",
                    "test_tiny.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    found = {case["test"].partition("::")[2]: case for case in cuda_tests.outcomes(tmp_path / "junit.xml")}
    assert {name: case["outcome"] for name, case in found.items()} == expected
    if expected["test_cuda_skips_itself"] == "failure":
        assert "may not skip (Skipped: no NCCL here)" in found["test_cuda_skips_itself"]["message"]
