"""Renders every published figure from the benchmarks' result files: docs/PERFORMANCE.md whole, and the figures
quoted in README.md and docs/*.md between markers.

    python -m benchmarks.pages            # rewrite docs/PERFORMANCE.md and the marked figures
    python -m benchmarks.pages --check    # rewrite nothing; list what differs from the stored results

`make bench` runs it after measuring. A quoted figure is marked, and only what stands between the markers is
rewritten (a figure may span lines, a table for instance: then the markers stand on lines of their own):

    Lightning's step took <!-- figure: loop_overhead.ratio_224px -->1.02x<!-- /figure --> the plain loop's

Results are kept per machine: benchmarks/results/machines/<machine>/<section>.json, one record per section and
machine (`store`), so a run on one machine never replaces what another measured, and a skipped run (a GPU section on
a CPU) never replaces a measured one. docs/PERFORMANCE.md shows each section's rows for every machine that measured
it, each with its machine line and date.

The key is SECTION.NAME: SECTION one of SECTIONS, NAME one of the figures that benchmarks/SECTION.py's
`figures(results)` returns, or `cpu` (the machine it ran on), `picks` (what `auto` picks there), `date` or `took`,
which every section has. A key quotes the section's primary record: its newest full measured one.
tests/test_figures.py fails when a document differs from what this renders, when a marker names a key no result
provides, when a measured figure (in digits or in words) stands outside a marker, when a figure's machine is not
named under the same heading, and when a render would drop a machine's records.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import re
from pathlib import Path

from benchmarks.common import picks
from benchmarks.records import RESULTS, kind_slug, measured, read_all

ROOT = Path(__file__).resolve().parents[1]
PERFORMANCE = ROOT / "docs" / "PERFORMANCE.md"
LEVERS = ROOT / "core" / "measured.json"  # what core/hardware.py quotes when it announces a lever, per CPU kind
# The sections of docs/PERFORMANCE.md, in order: each a module benchmarks/<name>.py and a file results/<name>.json.
SECTIONS = ("hardware", "startup", "input_pipeline", "input_profile", "shards", "scan_cache", "worker_memory",
            "loop_overhead", "compute_levers", "distributed", "fsdp_memory", "time_to_accuracy", "timm_peer",
            "recipe", "cuda_tests", "gpu_throughput", "gpu_end_to_end", "serve", "serve_crowd", "sweep_retry",
            "reading_cost")
# Experiments shown under a section, after its runs: benchmarks/<name>.py, whose `note()` renders its own log.
EXPERIMENTS = {"timm_peer": ("timm_gap",)}
MARKER = re.compile(r"<!-- figure: ([\w.@-]+) -->(.*?)<!-- /figure -->", re.S)
OPENING = "<!-- figure:"
CODE = re.compile(r"`[^`\n]*`")  # inline code: a marker written there is shown, not filled in
# A code span or a marker, whichever starts first: a marker's own text may hold code spans (a table's options).
TOKEN = re.compile(f"({CODE.pattern})|{MARKER.pattern}", re.S)
# Measured figures, by their units: a ratio (2.06x), a rate, a time in ms or minutes, a size, a decimal percentage.
MEASURED = re.compile(r"(?<![\w.])~?\d[\d,]*(\.\d+)?(x\b| ?(img/s|steps/s|ms\b|min\b|MiB|GiB|MB\b|GB\b))|\d\.\d+ ?%")
# The same figures in words: a ratio ("twelve times the plain server's", "12 times one at 64 px") or a fraction ("a
# quarter of the requests/s", "tenfold").
NUMBER = r"\d+(\.\d+)?|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|twenty|thirty|forty|fifty|hundred"
IN_WORDS = re.compile(rf"\b({NUMBER}) times (the|as|more|less|fewer|faster|slower|larger|smaller|one)\b"
                      rf"|\b(a|one|two|three|four) (quarters?|thirds?|fifths?|tenths?)\b|\b({NUMBER})-?fold\b", re.I)
MACHINE = ("cpu", "machine")  # the names of a section's figures that say which machine the others come from

INTRO = """# Performance

Every figure below is a ratio against a baseline measured in the same run, because the machine that produced them
may be shared: loader, loop and lever candidates are interleaved and their medians taken; the two time-to-accuracy
runs go one after the other, so other load during one of them skews that ratio. Each section's results are stored
per machine in `benchmarks/results/machines/<machine>/<section>.json`, a section shows every machine that measured
it, and this page, like every figure quoted in README.md and docs/, is rendered from those files by
`python -m benchmarks.pages`. Regenerate with `make bench` (`make bench-quick` only checks that the
benchmarks run, under runs/bench-quick/; `python -m benchmarks.run --only NAME` re-measures one section and keeps
the others' results; the three GPU sections come from `make gpu-check` on a CUDA machine, benchmarks/gpu_check.py).
Each record says where it came from, and each section shows it: the command that measured it
and the commit it ran at, marked where the tree held uncommitted changes, where the commit was not on main, or where
the record predates this bookkeeping and its origin was reconstructed from git's history; the record also keeps the
versions of the libraries and the last lines of its log. Each section names the machine it ran on: CPU model, the
flags that decide its levers (avx2, avx512f, avx512_bf16, amx_tile) and cores. A lever's gain depends on that machine
(bf16 autocast is fast only on a CPU with native bf16; see Hardware), so read each figure with its machine line. A
figure measured with the kernels held to AVX2 on a CPU that has more is an estimate of the AVX2 kind, and its
machine line says so.
"""


def method(section: str) -> int:
    """The version of what a section measures (its module's METHOD, 1 where it declares none): raised when a change
    makes the records measured before it measure something else, which then never reach the page."""
    return getattr(_module(section), "METHOD", 1)


def superseded(record: dict) -> bool:
    return record.get("method", 1) < method(record["section"])


def load_all(results: Path = RESULTS) -> dict[str, list[dict]]:
    """Section name -> every machine's record of it, primary first (measured before skipped, full before quick,
    newest first), for the sections that have one. Left out: superseded records, and an estimate of a CPU kind
    (`AVX2 CPU estimate`) where that kind measured the section natively."""
    found = {name: [r for r in records if not superseded(r)] for name, records in read_all(results).items()
             if name in SECTIONS}
    for records in found.values():
        # A section measured natively on the kind an estimate stands in for replaces the estimate.
        native = {r["machine"]["cpu_kind"] for r in records if measured(r) and not r["machine"].get("cuda")}
        records[:] = [r for r in records if r["machine"]["cpu_kind"].removesuffix(" estimate") not in native
                      or not r["machine"]["cpu_kind"].endswith(" estimate")]
        records.sort(key=lambda r: r["started"], reverse=True)
        records.sort(key=lambda r: (not measured(r), r["mode"] != "full"))
    return {name: found[name] for name in SECTIONS if found.get(name)}


def load(results: Path = RESULTS) -> dict[str, dict]:
    """Section name -> its primary record (`load_all`'s first): what a marked figure quotes."""
    return {name: records[0] for name, records in load_all(results).items()}


def _module(name: str):
    return importlib.import_module(f"benchmarks.{name}")


def duration(seconds: float | None) -> str:
    if seconds is None:  # a record stored before the runs timed their sections
        return "an unrecorded time"
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds // 60:.0f} min {seconds % 60:.0f} s"


def origin(run: dict) -> str:
    """Where a record came from, for its section's last line: the command and the commit, and what a reader must
    know before trusting them (a tree that differed from the commit, a commit not on main, a reconstruction)."""
    prov = run["provenance"]
    text = f"`{prov['command']}` at commit `{(prov['commit'] or 'unknown')[:10]}`"
    if rebuilt := prov.get("reconstructed"):  # a record from before provenance: what git's history says of it
        later = ("its section's code was committed only there" if rebuilt["code_committed_later"]
                 else "the tree's state unknown")
        return text + (f" (**provenance reconstructed**: the newest commit on main when it started; stored in "
                       f"`{rebuilt['stored_in'][:10]}`, {later})")
    marks = ([] if prov["clean"] else ["**from a tree with uncommitted changes**"]) + (
        [] if prov["on_main"] else ["**a commit not on main**"])
    return text + (f" ({'; '.join(marks)})" if marks else "")


def section(name: str, runs: dict | list[dict] | None) -> str:
    """The Markdown section of one benchmark: for each machine that measured it (or the one that skipped it), its
    tables and text, the settings, the command and commit that made it, the machine line and the time; then,
    once, the module's `section_note()` if any, and the notes of its EXPERIMENTS."""
    module = _module(name)
    runs = [runs] if isinstance(runs, dict) else [r for r in runs or [] if measured(r)] or (runs or [])[:1]
    if not runs:
        return (f"## {module.TITLE}\n\nNot measured: no record in benchmarks/results/machines/ (`python -m "
                f"benchmarks.run --only {name}`).\n")
    parts = [f"## {module.TITLE}\n"]
    for run in runs:
        if len(runs) > 1:
            parts.append(f"### On {run['machine']['cpu']}\n")
        if measured(run):
            body, settings = module.render(run["results"])
        else:
            body, settings = f"Not measured: {run['results']['skipped']}.", "Skipped"
        parts.append(f"{body}\n\n_{settings}. Machine: {run['machine']['line']}._\n\n"
                     f"_Measured by {origin(run)}; took {duration(run['seconds'])} ({run['mode']} mode)._\n")
    if hasattr(module, "section_note") and (note := module.section_note()):
        parts.append(f"{note}\n")  # said once, under every machine's runs
    parts += [f"{_module(experiment).note()}\n" for experiment in EXPERIMENTS.get(name, ())]
    return "\n".join(parts)


def header(all_runs: dict[str, list[dict]]) -> str:
    """What the page was measured on, when, and how long the measuring took: from the sections' own records."""
    by_machine: dict[str, list[str]] = {}
    for name, records in all_runs.items():
        for run in records:
            by_machine.setdefault(f"{run['machine']['cpu']}; torch {run['machine']['torch']}", []).append(
                _module(name).TITLE)
    runs = {f"{name}/{i}": run for name, records in all_runs.items() for i, run in enumerate(records)}
    modes = sorted({run["mode"] for run in runs.values()})
    started = sorted(run["started"] for run in runs.values())
    lines = [f"Rendered from the sections' result files, {' and '.join(modes)} mode"
             + (" (tiny sizes: checks only, not figures)." if modes == ["quick"] else ".")]
    if len(by_machine) == 1:
        lines.append(f"Measured on {next(iter(by_machine))}.")
    else:
        lines.append("**Measured on more than one machine** ("
                     + "; ".join(f"{m}: {', '.join(titles)}" for m, titles in by_machine.items()) + ").")
    timed = [run["seconds"] for run in runs.values() if run["seconds"] is not None]
    if started:
        untimed = list(dict.fromkeys(_module(key.split("/")[0]).TITLE for key, run in runs.items()
                                     if run["seconds"] is None))
        lines.append(f"The sections ran one at a time between {started[0]} and {started[-1]}, "
                     f"{duration(sum(timed))} in all (the sum of their times"
                     + (f"; not recorded for {', '.join(untimed)}" if untimed else "") + ").")
    missing = [_module(name).TITLE for name in SECTIONS if name not in all_runs]
    if missing:
        lines.append(f"No results yet: {', '.join(missing)}.")
    return " ".join(lines)


def performance(all_runs: dict[str, list[dict]]) -> str:
    """docs/PERFORMANCE.md: the introduction, the header and every section, from every machine's stored records."""
    return INTRO + "\n" + header(all_runs) + "\n\n" + "\n".join(section(name, all_runs.get(name))
                                                                   for name in SECTIONS)


def figures(runs: dict[str, dict | list[dict]]) -> dict[str, str]:
    """Every quotable figure: SECTION.NAME from the section's primary record, and SECTION@KIND.NAME from the newest
    record of a kind of machine (`kind_slug`), for a sentence about that kind whichever machine measured last."""
    def of(run: dict) -> dict[str, str]:
        found = {"cpu": run["machine"]["cpu"], "picks": picks(run["machine"]), "date": run["started"][:10],
                 "took": duration(run["seconds"])}
        if measured(run) and hasattr(_module(run["section"]), "figures"):
            found |= _module(run["section"]).figures(run["results"])
        return found

    found = {}
    for name, records in runs.items():
        records = [records] if isinstance(records, dict) else records
        found |= {f"{name}.{key}": value for key, value in of(records[0]).items()}
        for run in reversed(records):  # oldest first: the newest of a kind wins
            found |= {f"{name}@{kind_slug(run['machine'])}.{key}": value for key, value in of(run).items()}
    return found


def lever_figures(all_runs: dict[str, list[dict]]) -> dict[str, dict[str, str]]:
    """CPU kind -> the measured figures core/hardware.py quotes in the reasons it prints for `auto`'s choices, each
    from that kind's newest full record: bf16 autocast and channels_last against fp32 NCHW (Hardware, the
    quickstart's step), fused SGD against torch's loop (Compute levers, 224 px), `imgcls fit` with a loader process
    against none (Time to accuracy, whole process)."""
    found: dict[str, dict[str, str]] = {}
    for run in reversed(all_runs.get("hardware", [])):  # oldest first: the newest of a kind wins
        if measured(run) and run["mode"] == "full":
            img_s = run["results"]["machines"][0]["img_s"]
            found.setdefault(run["machine"]["cpu_kind"], {}).update({
                "bf16_vs_fp32": f"{img_s['bf16 autocast, channels_last'] / img_s['fp32, channels_last']:.2f}x",
                "channels_last_vs_nchw": f"{img_s['fp32, channels_last'] / img_s['fp32, NCHW']:.2f}x"})
    for run in reversed(all_runs.get("compute_levers", [])):
        if measured(run) and run["mode"] == "full" and not run["machine"].get("cuda"):
            large = max(run["results"]["settings"], key=lambda s: s["size"])
            times = large["step_s"]
            baseline = next(name for name in times if name.startswith("baseline"))
            found.setdefault(run["machine"]["cpu_kind"], {})["fused_sgd_vs_loop"] = (
                f"{times[baseline] / times['fused SGD']:.2f}x at {large['size']} px")
    for run in reversed(all_runs.get("time_to_accuracy", [])):
        if measured(run) and run["mode"] == "full" and not run["machine"].get("cuda") and "processes" in run["results"]:
            ratio = _module("time_to_accuracy").figures(run["results"])["one_worker_vs_none"]
            found.setdefault(run["machine"]["cpu_kind"], {})["one_loader_process_vs_none"] = ratio
    return dict(sorted(found.items()))


def quote(text: str, known: dict[str, str], where: str) -> str:
    """`text` with each marked figure replaced by its value in `known`; a key it lacks is an error naming it."""
    # Left over once code spans and whole markers are taken out, or inside a marker's text: an opening not closed.
    if OPENING in TOKEN.sub("", text) or any(OPENING in (m.group(3) or "") for m in TOKEN.finditer(text)):
        raise ValueError(f"{where}: a '{OPENING} KEY -->' marker without its '<!-- /figure -->'")

    def replace(match: re.Match) -> str:
        if match.group(1) is not None:
            return match.group(1)
        key = match.group(2)
        if key not in known:
            name = key.split(".")[0]
            raise KeyError(f"{where}: the marker names {key!r}, which no file in benchmarks/results/ provides; "
                           f"{name!r} has: {', '.join(k for k in known if k.startswith(name + '.')) or 'nothing'}")
        return f"<!-- figure: {key} -->{known[key]}<!-- /figure -->"

    return TOKEN.sub(replace, text)


def unmarked(text: str) -> list[str]:
    """Measured-looking figures, in digits or in words, outside any marker and outside code blocks: each should be
    quoted from a result."""
    prose = re.sub(r"^```.*?^```", "", MARKER.sub("", text), flags=re.S | re.M)
    prose = re.sub(r"`[^`\n]*`", "", prose)  # inline code: options and commands, not figures
    return [line.strip() for line in prose.splitlines() if MEASURED.search(line) or IN_WORDS.search(line)]


def unnamed_machines(text: str) -> list[str]:
    """The marked figures whose machine the reader is not told: each SECTION[@KIND].NAME needs, in the same `##`
    section, a SECTION[@KIND].cpu or .machine marker, its own record's machine."""
    missing = []
    prose = CODE.sub("", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M))
    for part in re.split(r"^##? .*$", prose, flags=re.M):
        keys = [m.group(1) for m in MARKER.finditer(part)]
        named = {key.rpartition(".")[0] for key in keys if key.rpartition(".")[2] in MACHINE}
        missing += [key for key in keys if key.rpartition(".")[0] not in named]
    return missing


def documents() -> list[Path]:
    """The documents that quote figures: README.md and docs/*.md but PERFORMANCE.md, which is rendered whole."""
    return [ROOT / "README.md", *(p for p in sorted((ROOT / "docs").glob("*.md")) if p != PERFORMANCE)]


def rendered(results: Path = RESULTS, out: Path = PERFORMANCE, docs: bool = True) -> dict[Path, str]:
    """Each file as it should read: `out` rendered from `results`, and (`docs`) the documents with their markers."""
    all_runs = load_all(results)
    files = {out: performance(all_runs)}
    if docs:
        files[LEVERS] = json.dumps(lever_figures(all_runs), indent=1) + "\n"
        known = figures(all_runs)
        files |= {path: quote(path.read_text(), known, str(path.relative_to(ROOT))) for path in documents()}
    return files


def main(results: Path = RESULTS, out: Path = PERFORMANCE, docs: bool = True, check: bool = False) -> list[Path]:
    """Write (or with `check`, only compare) the rendered files; returns those that differed."""
    differ = []
    for path, text in rendered(results, out, docs).items():
        old = path.read_text() if path.is_file() else ""
        if old == text:
            continue
        differ.append(path)
        if check:
            print("".join(difflib.unified_diff(old.splitlines(True), text.splitlines(True), str(path), "rendered")))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    return differ


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a document differs")
    args = parser.parse_args()
    stale = main(check=args.check)
    unquoted = {str(p.relative_to(ROOT)): unmarked(p.read_text()) for p in documents()}
    for path, lines in unquoted.items():
        for line in lines:
            print(f"{path}: a measured figure outside a marker: {line}")
    anonymous = {str(p.relative_to(ROOT)): unnamed_machines(p.read_text()) for p in documents()}
    for path, keys in anonymous.items():
        for key in keys:
            print(f"{path}: {key} is quoted under a heading that names no machine of its record")
    raise SystemExit(1 if args.check and (stale or any(unquoted.values()) or any(anonymous.values())) else 0)
