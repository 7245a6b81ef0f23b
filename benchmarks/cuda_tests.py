"""CUDA tests: the suite's `cuda`-marked tests (`16-mixed` kill and resume bitwise, the fp16 and PowerSGD hooks on
NCCL, the device's auto levers, nvJPEG against the CPU pipeline), run on a CUDA device and recorded per test.

    python -m benchmarks.cuda_tests            # on a CUDA machine; skipped without one
    python -m benchmarks.cuda_tests --quick    # anywhere: collects the same tests without running them

CI has no GPU, so these tests are skipped there; this section is how their outcome on a real device is kept.
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

from benchmarks.common import standalone, table

TITLE = "CUDA tests"
ROOT = Path(__file__).resolve().parents[1]
MARKED = re.compile(r"pytest\.mark\.cuda\b")


def test_files() -> list[str]:
    """The test files that hold a `cuda`-marked test: collecting only these keeps the other files' imports (Optuna,
    LitServe, Hugging Face datasets) off a GPU machine that lacks them."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py") if MARKED.search(p.read_text()))


def pytest_args(collect_only: bool, junit: Path) -> list[str]:
    return [sys.executable, "-m", "pytest", "-m", "cuda", "-p", "no:cacheprovider", f"--junitxml={junit}",
            *(["--collect-only", "-q"] if collect_only else []), *test_files()]


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
    if not quick and not torch.cuda.is_available():
        return {"skipped": "no CUDA device on this machine", "needs": "cuda"}
    with tempfile.TemporaryDirectory(prefix="imgcls-cuda-tests-") as tmp:
        junit = Path(tmp) / "junit.xml"
        start = time.perf_counter()
        proc = subprocess.run(pytest_args(quick, junit), cwd=ROOT, capture_output=True, text=True, timeout=420)
        seconds = time.perf_counter() - start
        print(proc.stdout[-3000:], proc.stderr[-2000:], sep="\n", flush=True)
        if quick:
            if proc.returncode != 0:
                raise RuntimeError(f"pytest could not collect the cuda tests (exit {proc.returncode})")
            collected = [line for line in proc.stdout.splitlines() if "::" in line]
            return {"device": "cpu", "dry_run": True, "files": test_files(), "seconds": seconds,
                    "tests": [{"test": t.split("/")[-1], "outcome": "collected", "seconds": 0.0, "message": ""}
                              for t in collected]}
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


def figures(r: dict) -> dict[str, str]:
    c = counts(r)
    return {"passed": f"{c.get('passed', 0)} of {len(r['tests'])}"}


if __name__ == "__main__":
    standalone("cuda_tests", __doc__)
