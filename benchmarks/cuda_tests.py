"""CUDA tests: the suite's `cuda`-marked tests (`16-mixed` kill and resume bitwise with its GradScaler after an fp16
overflow, the fp16 and PowerSGD hooks registered on NCCL, the device's auto levers, nvJPEG against the CPU pipeline,
a step that waits for the GPU only for the progress bar's loss), run on a CUDA device and recorded per test.

    python -m benchmarks.run --only cuda_tests            # on a CUDA machine; skipped without one
    python -m benchmarks.run --only cuda_tests --quick    # anywhere: collects the same tests without running them

CI has no GPU, so these tests are skipped there; this section is how their outcome on a real device is kept. The
newest full record names every cuda test of the suite by its id (`test_cuda::test_name[param]`), except those in
NOT_YET_RUN_ON_A_GPU (`coverage_problems`, which tests/test_cuda_checks.py holds to).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

from benchmarks.common import table
from benchmarks.records import RESULTS, measured, read_all

TITLE = "CUDA tests"
ROOT = Path(__file__).resolve().parents[1]
MARKED = re.compile(r"pytest\.mark\.cuda\b")
# The cuda tests added or changed since the newest GPU record, each with why; once the next GPU check has run them,
# they leave (coverage_problems). A changed test takes a new name: no record of its old form may stand for it.
NOT_YET_RUN_ON_A_GPU = {
    "test_cuda::test_a_16_mixed_step_waits_for_the_gpu_only_where_the_progress_bar_loss_is_copied":
        "added with the progress bar's host copy of the loss, after the last GPU check",
    "test_cuda::test_a_16_mixed_fit_killed_after_an_fp16_overflow_resumes_its_scaler_and_ends_bitwise_equal":
        "replaces the resume test whose scaler check held for a fresh GradScaler too: an fp16 overflow is forced "
        "before the kill, and the resumed scaler's scale and growth tracker are compared with the uninterrupted run's",
    "test_cuda::test_compression_hooks_are_registered_on_nccl_and_train[fp16]":
        "replaces the NCCL hook test that did not check the hook's registration: DDP's logging data must name the "
        "hook on an NCCL process group",
    "test_cuda::test_compression_hooks_are_registered_on_nccl_and_train[powersgd]":
        "as its fp16 case",
    "test_cuda::test_a_batch_copied_on_a_side_stream_equals_the_plain_copy":
        "added with the GPU end-to-end section's side-stream copy, after the last GPU check",
}


def test_files() -> list[str]:
    """The test files that hold a `cuda`-marked test: collecting only these keeps the other files' imports (Optuna,
    LitServe, Hugging Face datasets) off a GPU machine that lacks them."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py") if MARKED.search(p.read_text()))


def pytest_args(collect_only: bool, junit: Path) -> list[str]:
    return [sys.executable, "-m", "pytest", "-m", "cuda", "-p", "no:cacheprovider", f"--junitxml={junit}",
            *(["--collect-only", "-q"] if collect_only else []), *test_files()]


def record_id(nodeid: str) -> str:
    """pytest's node id (`tests/test_cuda.py::test_name[param]`) as a record names the test, as JUnit's class name and
    test name give it in a full run: `test_cuda::test_name[param]`."""
    path, _, name = nodeid.partition("::")
    return f"{Path(path).stem}::{name}"


def collected() -> list[str]:
    """The ids of the suite's cuda tests (record_id), collected without running them: what the quick mode records."""
    with tempfile.TemporaryDirectory(prefix="imgcls-cuda-tests-") as tmp:
        proc = subprocess.run(pytest_args(True, Path(tmp) / "junit.xml"), cwd=ROOT, capture_output=True, text=True,
                              timeout=420)
    print(proc.stdout[-3000:], proc.stderr[-2000:], sep="\n", flush=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pytest could not collect the cuda tests (exit {proc.returncode})")
    return [record_id(line) for line in proc.stdout.splitlines() if "::" in line]


def newest_record(results: Path = RESULTS) -> dict | None:
    """The newest full record of this section that ran the tests, on any machine; None where there is none."""
    records = [r for r in read_all(results).get("cuda_tests", []) if measured(r) and r["mode"] == "full"]
    return max(records, key=lambda r: r["started"], default=None)


def ran(record: dict | None) -> set[str]:
    """The ids of the tests a record's GPU run did not skip."""
    return {c["test"] for c in record["results"]["tests"] if c["outcome"] != "skipped"} if record else set()


def coverage_problems(suite: set[str], newest: dict | None, pending: dict[str, str]) -> list[str]:
    """What makes the newest full record (`newest`, None where there is none) and the `pending` list (test id -> why)
    disagree with the `suite`'s cuda tests: a test that neither ran there nor is pending, a pending one that ran
    there (its entry goes), a pending one that the suite lacks."""
    done = ran(newest)
    problems = [f"{t}: a cuda test that the newest GPU record did not run and NOT_YET_RUN_ON_A_GPU does not list"
                for t in sorted(suite - done - pending.keys())]
    problems += [f"{t}: ran in the newest GPU record; remove it from NOT_YET_RUN_ON_A_GPU"
                 for t in sorted(pending.keys() & done)]
    return problems + [f"{t}: listed in NOT_YET_RUN_ON_A_GPU, but the suite has no such cuda test"
                       for t in sorted(pending.keys() - suite)]


def outcomes(junit: Path) -> list[dict]:
    """Each test case of a JUnit XML report: its id, outcome and seconds."""
    cases = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        message = next((child.get("message", "") for child in case if child.tag != "system-out"), "")
        cases.append({"test": f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}",
                      "outcome": outcome, "seconds": float(case.get("time") or 0.0), "message": message[:300]})
    return cases


def main(quick: bool = False) -> dict:
    """Run the `cuda` tests (quick: collect them only); a full run needs CUDA and is skipped without it."""
    start = time.perf_counter()
    if quick:
        tests = [{"test": t, "outcome": "collected", "seconds": 0.0, "message": ""} for t in collected()]
        return {"device": "cpu", "dry_run": True, "files": test_files(), "seconds": time.perf_counter() - start,
                "tests": tests}
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device on this machine", "needs": "cuda"}
    with tempfile.TemporaryDirectory(prefix="imgcls-cuda-tests-") as tmp:
        junit = Path(tmp) / "junit.xml"
        proc = subprocess.run(pytest_args(False, junit), cwd=ROOT, capture_output=True, text=True, timeout=420)
        seconds = time.perf_counter() - start
        print(proc.stdout[-3000:], proc.stderr[-2000:], sep="\n", flush=True)
        cases = outcomes(junit) if junit.is_file() else []
    if not cases:
        raise RuntimeError(f"pytest ran no cuda test (exit {proc.returncode})")
    return {"device": torch.cuda.get_device_name(0), "dry_run": False, "files": test_files(), "seconds": seconds,
            "exit_code": proc.returncode, "tests": cases}


def counts(r: dict) -> dict[str, int]:
    found: dict[str, int] = {}
    for case in r["tests"]:
        found[case["outcome"]] = found.get(case["outcome"], 0) + 1
    return found


def render(r: dict) -> tuple[str, str]:
    rows = [[c["test"], c["outcome"] + (f": {c['message']}" if c["outcome"] in ("failure", "error") else ""),
             f"{c['seconds']:.1f}"] for c in r["tests"]]
    body = table(["test", "outcome", "seconds"], rows)
    tally = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts(r).items()))
    done = f"Dry run: collected, not run ({tally})." if r["dry_run"] else f"{tally}, in {r['seconds']:.0f} s."
    body += "\n\n" + done
    return body, f"{r['device']}, `pytest -m cuda` over {', '.join(r['files'])}"


def section_note() -> str:
    """What the section says once, under every machine's record: the cuda tests that no GPU has run yet."""
    if not NOT_YET_RUN_ON_A_GPU:
        return ""
    return "Never run on a GPU yet (added or changed since the newest record above):\n\n" + "\n".join(
        f"- `{test}`: {why}." for test, why in NOT_YET_RUN_ON_A_GPU.items())


def figures(r: dict) -> dict[str, str]:
    c = counts(r)
    return {"passed": f"{c.get('passed', 0)} of {len(r['tests'])}"}

