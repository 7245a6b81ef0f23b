"""The benchmarks' records on disk: benchmarks/results/machines/<machine>/<section>.json, one record per section and
machine. Writing and reading them, and naming a machine's folder and kind; no section is imported here (what a
record means is its section's, and benchmarks.pages renders it).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine_slug(machine: dict) -> str:
    """The folder of a machine's records: its GPU model or CPU kind, CPU model and cores, e.g.
    `avx2-cpu-amd-epyc-2-cores`, `nvidia-h100-80gb-hbm3-intel-r-xeon-r-processor-16-cores`."""
    name = f"{machine.get('cuda') or machine['cpu_kind']} {machine['cpu_model']} {machine['cores']} cores"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def measured(record: dict) -> bool:
    return "skipped" not in record["results"]


def read_all(results: Path = RESULTS) -> dict[str, list[dict]]:
    """Section name -> every stored record of it, in the order of their files."""
    found: dict[str, list[dict]] = {}
    for path in sorted((results / "machines").glob("*/*.json")):
        record = json.loads(path.read_text())
        found.setdefault(record.get("section", ""), []).append(record)
    return found


def store(record: dict, results: Path = RESULTS) -> Path | None:
    """Write `record` as its machine's record of its section; None (nothing written) for a skipped run where this
    section has a measured record on any machine."""
    section = record["section"]
    if not measured(record) and any(measured(r) for r in read_all(results).get(section, [])):
        return None
    path = results / "machines" / machine_slug(record["machine"]) / f"{section}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def kind_slug(machine: dict) -> str:
    """A machine's kind in a marker key: its GPU model, else its CPU kind (`avx2-cpu`, `bf16-cpu`)."""
    return re.sub(r"[^a-z0-9]+", "-", (machine.get("cuda") or machine["cpu_kind"]).lower()).strip("-")
