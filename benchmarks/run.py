"""Runs every benchmark and writes docs/PERFORMANCE.md.

    python -m benchmarks.run            # full sizes (`make bench`), about 20 minutes on 2 CPU cores
    python -m benchmarks.run --quick    # tiny sizes, only to check that everything runs
"""

from __future__ import annotations

import argparse
import importlib
import re
import time
import traceback
from pathlib import Path

from benchmarks.common import machine

ROOT = Path(__file__).resolve().parents[1]
# Order of the sections in docs/PERFORMANCE.md.
BENCHMARKS = ("hardware", "input_pipeline", "scan_cache", "worker_memory", "loop_overhead", "compute_levers",
              "distributed", "time_to_accuracy", "recipe", "gpu_throughput")

INTRO = """# Performance

Every figure below is a ratio against a baseline measured in the same run, because the machine that produced them
may be shared: loader, loop and lever candidates are interleaved and their medians taken; the two time-to-accuracy
runs go one after the other, so other load during one of them skews that ratio. Regenerate with `make bench`
(`make bench-quick` only checks that the benchmarks run; `python -m benchmarks.run --only NAME` re-runs one
section in place). Each section names the command that reproduces it alone, and the machine it ran on: CPU model,
the flags that decide its levers (avx2, avx512f, avx512_bf16, amx_tile) and cores. A lever's gain depends on that
machine (bf16 autocast is ~2x fp32 on a CPU with native bf16 and ~10x slower without), so read each figure with its
machine line.
"""


def run(names: tuple[str, ...] = BENCHMARKS, quick: bool = False) -> str:
    sections = []
    for name in names:
        try:
            module = importlib.import_module(f"benchmarks.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"benchmarks.{name}":
                raise
            sections.append(f"## {name}\n\nNot run: benchmarks/{name}.py is not in this checkout.\n")
            continue
        start = time.perf_counter()
        print(f"running benchmarks.{name}{' --quick' if quick else ''} ...", flush=True)
        try:
            text = module.main(quick=quick)
        except Exception:  # one broken benchmark must not lose the others' figures
            text = f"## {name}\n\nFailed:\n\n```\n{traceback.format_exc(limit=5)}```\n"
        print(text, flush=True)
        sections.append(text + f"\n_Took {time.perf_counter() - start:.0f} s._\n")
    mode = "quick mode (tiny sizes: checks only, not figures)" if quick else "full mode"
    return INTRO + f"\nGenerated in {mode} on: {machine()}.\n\n" + "\n".join(sections)


def machines_note(document: str) -> str:
    """`document` with a line listing which sections ran on which machine, when they did not all run on one."""
    by_machine: dict[str, list[str]] = {}
    for block in document.split("\n## ")[1:]:
        title = block.partition("\n")[0]
        found = re.search(r"Machine: (.+?); torch", block)
        if found:  # a skipped section (no CUDA device, say) measured nothing
            by_machine.setdefault(found.group(1), []).append(title)
    document = re.sub(r"\n\*\*Measured on more than one machine\*\*.*\n", "\n", document)
    if len(by_machine) < 2:
        return document
    listed = "; ".join(f"{m}: {', '.join(titles)}" for m, titles in by_machine.items())
    head, sep, rest = document.partition("\n## ")
    return head.rstrip("\n") + f"\n\n**Measured on more than one machine** ({listed}).\n\n" + sep.lstrip("\n") + rest


def replace_sections(document: str, update: str) -> str:
    """`document` with each "## " section of `update` put in place of the section of the same title; sections
    it does not have yet go first."""
    def split(text: str) -> tuple[str, dict[str, str]]:
        head, *parts = text.split("\n## ")
        return head, {p.partition("\n")[0]: "\n## " + p for p in parts}

    head, old = split(document)
    _, new = split(update)
    added = "".join(body for title, body in new.items() if title not in old)  # a benchmark new to the document
    return head + added + "".join(new.get(title, body) for title, body in old.items())


def main(quick: bool = False, out: Path | None = None, only: tuple[str, ...] = ()) -> Path:
    out = out or ROOT / "docs" / "PERFORMANCE.md"
    text = run(only or BENCHMARKS, quick=quick)
    if only and out.is_file():  # re-run some benchmarks: keep the other sections' figures
        text = replace_sections(out.read_text(), text)
    text = machines_note(text)  # sections kept from another machine are named, never mixed silently
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, to check that everything runs")
    parser.add_argument("--out", type=Path, default=None, help="where to write (default docs/PERFORMANCE.md)")
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, default=(),
                        help="run these and replace their sections in --out, keeping the others")
    args = parser.parse_args()
    main(args.quick, args.out, tuple(args.only))
