"""Runs the benchmarks, stores each section's results as JSON, and renders the figures from them.

    python -m benchmarks.run                    # full sizes (`make bench`); docs/PERFORMANCE.md says how long it took
    python -m benchmarks.run --only NAME ...    # re-measure these sections, keeping the others' stored results
    python -m benchmarks.run --quick            # tiny sizes, only to check that everything runs

A full run writes benchmarks/results/machines/<machine>/<section>.json (the record below: the section's results, the
machine, the date and the seconds it took; other machines' records stay, and a skipped run never replaces a measured
one), then `benchmarks.pages` renders docs/PERFORMANCE.md and the figures quoted in README.md
and docs/ from those files. A quick run writes its records and its page under runs/bench-quick/ (or beside --out),
never over the committed ones.
"""

from __future__ import annotations

import argparse
import importlib
import os
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path

from benchmarks import pages, provenance, records
from benchmarks.common import machine_info

ROOT = Path(__file__).resolve().parents[1]
QUICK_DIR = ROOT / "runs" / "bench-quick"
# What a skipped section's record names as its `needs`, of which CI can never have these: under CI=true a section
# skipped for anything else (PostgreSQL, Linux) fails the run.
NEVER_IN_CI = {"cuda": "a CUDA device", "peer": "a peer program from outside the project"}


def measure(name: str, quick: bool = False) -> dict:
    """Run benchmarks/<name>.py and wrap its results in the record a result file holds: the section, its method,
    when and how long, the machine, and where it came from (`benchmarks.provenance`: commit, tree, command,
    library versions, the last lines of its log)."""
    module = importlib.import_module(f"benchmarks.{name}")
    state = provenance.tree_state()  # before the section writes anything
    started, start = datetime.now(UTC), time.perf_counter()
    with provenance.captured_log() as log:
        print(f"running benchmarks.{name}{' --quick' if quick else ''} ...", flush=True)
        results = module.main(quick=quick)
    return {"section": name, "method": pages.method(name), "mode": "quick" if quick else "full",
            "started": f"{started:%Y-%m-%d %H:%M} UTC", "seconds": round(time.perf_counter() - start, 1),
            "machine": machine_info(), "results": results, "provenance": provenance.provenance(state, list(log))}


def main(quick: bool = False, out: Path | None = None, only: tuple[str, ...] = (), results: Path | None = None) -> Path:
    """Measure `only` (default: every section), store each record in `results`, render `out` from all records there.

    The committed figures (benchmarks/results/, docs/PERFORMANCE.md and the documents' markers) change only in full
    mode with the default folders; a section that fails keeps its previous record, and the run then fails.
    """
    if results is None:
        results = records.RESULTS if not quick else (out.parent if out else QUICK_DIR) / "results"
    out = out or (QUICK_DIR / "PERFORMANCE.md" if quick else pages.PERFORMANCE)
    failed = []
    for name in only or pages.SECTIONS:
        try:
            record = measure(name, quick)
        except Exception:  # one broken benchmark must not lose the others' figures
            failed.append(f"benchmarks.{name} failed:\n{traceback.format_exc(limit=5)}")
            print(failed[-1], flush=True)
            continue
        if not records.measured(record) and os.environ.get("CI") == "true" and (
                record["results"].get("needs") not in NEVER_IN_CI):
            failed.append(f"benchmarks.{name} skipped under CI=true, which can run it: {record['results']['skipped']}")
        if records.store(record, results) is None:
            print(f"benchmarks.{name}: {record['results']['skipped']}; the measured records are kept", flush=True)
        print(pages.section(name, record), flush=True)
    pages.main(results, out, docs=results == records.RESULTS)
    if failed:
        raise RuntimeError("\n".join(failed))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, to check that everything runs")
    parser.add_argument("--out", type=Path, default=None,
                        help="the page to render (default docs/PERFORMANCE.md; quick: runs/bench-quick/PERFORMANCE.md)")
    parser.add_argument("--only", nargs="+", choices=pages.SECTIONS, default=(),
                        help="measure these sections only; the others' stored results stay")
    args = parser.parse_args()
    main(args.quick, args.out, tuple(args.only))
