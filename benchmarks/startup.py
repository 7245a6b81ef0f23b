"""Process start-up: the wall time of a whole `imgcls fit --print_config` process (interpreter start, imports,
config parsing, exit), with imgcls/startup.py's collector settings against the same command imported as a library.

    python -m benchmarks.run --only startup [--quick]

Every `imgcls` command, DDP rank and sweep trial pays this once; a short run pays it more than once (a DDP rank
that Lightning starts runs the command again). The candidates run round-robin, each in a fresh interpreter:
- baseline: `python -c "from imgcls.commands import main; main()" fit ...`, the imports with the collector on;
- `python -m imgcls fit ...` and the `imgcls` console script: the collector off during the imports, and what
  they built frozen after them; at the end, the process ends without tearing its heap down (`startup.run`);
- the same start with the interpreter's teardown at the end: what `startup.run` saves.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import quartiles, table

TITLE = "Process start-up"
ROOT = Path(__file__).resolve().parents[1]
ARGS = ["fit", "--config", "configs/quickstart.yaml", "--print_config"]
BASELINE = "imports as a library, collector on (baseline)"
TEARDOWN = "imports frozen, the interpreter's teardown at exit"
STARTED = "python -m imgcls"
CANDIDATES = {
    BASELINE: [sys.executable, "-c", "from imgcls.commands import main; main()"],
    STARTED: [sys.executable, "-m", "imgcls"],
    "imgcls (console script)": [str(Path(sys.executable).with_name("imgcls"))],
    TEARDOWN: [sys.executable, "-c", "from imgcls.startup import begin, done; begin(); "
               "from imgcls.commands import main; done(); main()"],
}
# Records made before the command moved to imgcls/ name STARTED by the module it was then.
STARTED_BEFORE = "python -m training.cli"


def seconds(cmd: list[str]) -> float:
    """Wall seconds of one process, launch to exit; its output is checked to be the full config."""
    start = time.perf_counter()
    proc = subprocess.run([*cmd, *ARGS], cwd=ROOT, capture_output=True, text=True, timeout=300)
    took = time.perf_counter() - start
    assert proc.returncode == 0 and "trainer:" in proc.stdout, proc.stderr[-2000:]
    return took


def main(quick: bool = False) -> dict:
    reps = 1 if quick else 8
    names = [BASELINE, STARTED] if quick else list(CANDIDATES)
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(reps):
        for name in names:
            times[name].append(seconds(CANDIDATES[name]))
    return {"command": " ".join(ARGS), "reps": reps, "times": times}


def _ratios(r: dict, name: str) -> list[float]:
    """This candidate's time over the baseline's, turn by turn (the two ran one after the other)."""
    return [t / b for t, b in zip(r["times"][name], r["times"][BASELINE], strict=True)]


def render(r: dict) -> tuple[str, str]:
    rows = []
    for name, times in r["times"].items():
        ratio = quartiles(_ratios(r, name))
        rows.append([name, statistics.median(times), f"{ratio['median']:.2f}",
                     f"{ratio['min']:.2f}-{ratio['max']:.2f}"])
    body = table(["process", "wall s (median)", "vs baseline (median of turns)", "min-max"], rows)
    return body, f"`imgcls {r['command']}`, {r['reps']} interleaved turns, each process started afresh"


def figures(r: dict) -> dict[str, str]:
    started = STARTED if STARTED in r["times"] else STARTED_BEFORE
    ratio = quartiles(_ratios(r, started))
    saved = statistics.median(r["times"][BASELINE]) - statistics.median(r["times"][started])
    found = {"ratio": f"{ratio['median']:.2f}x", "saved_s": f"{saved:.1f} s",
             "spread": f"min-max {ratio['min']:.2f}-{ratio['max']:.2f} over {ratio['n']} turns"}
    if TEARDOWN in r["times"]:  # records made before the teardown was left out have no such row
        exits = [t - f for t, f in zip(r["times"][TEARDOWN], r["times"][started], strict=True)]
        found["exit_saved_s"] = f"{statistics.median(exits):.2f} s"
    return found

