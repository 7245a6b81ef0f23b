"""A sweep's progress while it runs: one line per trial this worker finishes, and a progress bar on a terminal.

    trial 3 complete: val/acc 0.8125 | best 0.8750 (trial 1) | 5 of 8 done, 3 left | <its time>, <mean time> per trial

The line gives the trial's outcome and value, the best value so far, the study's finished trials (complete or pruned,
every worker's) against the grid's size or the budget, the trial's time and the mean time of the finished trials.
Where stdout is a terminal, rich's progress bar of the same count stands below the lines; elsewhere (CI, a log file)
only the lines are written.
"""

from __future__ import annotations

import sys
import threading

from training.sweeps.space import Sweep


def seconds(value: float) -> str:
    """A duration as a person reads it: 42 s, 3.5 min, 2.1 h."""
    if value < 90:
        return f"{value:.0f} s"
    return f"{value / 60:.1f} min" if value < 90 * 60 else f"{value / 3600:.1f} h"


def _took(trial) -> float | None:
    if trial.datetime_start is None or trial.datetime_complete is None:
        return None
    return (trial.datetime_complete - trial.datetime_start).total_seconds()


def progress_line(trial, trials: list, sweep: Sweep, total: int, failure: str | None = None) -> str:
    """The line for `trial`, finished, among the study's `trials`; `failure`, why it failed."""
    from optuna.trial import TrialState

    done = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    complete = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None]
    if failure is not None or trial.state == TrialState.FAIL:
        outcome = f"trial {trial.number} failed ({failure or 'see its fit.log'})"
    else:
        value = "-" if trial.value is None else f"{trial.value:.4f}"
        last = " (its last report)" if trial.state == TrialState.PRUNED else ""
        outcome = f"trial {trial.number} {trial.state.name.lower()}: {sweep.metric} {value}{last}"
    best = "best -"
    if complete:
        pick = max if sweep.goal == "maximize" else min
        top = pick(complete, key=lambda t: t.value)
        best = f"best {top.value:.4f} (trial {top.number})"
    times = [took for t in done if (took := _took(t)) is not None]
    took = _took(trial)
    timing = f"{seconds(took) if took is not None else '-'}, " + (
        f"{seconds(sum(times) / len(times))} per trial" if times else "- per trial")
    return f"{outcome} | {best} | {len(done)} of {total} done, {max(0, total - len(done))} left | {timing}"


class SweepProgress:
    """`finished(number, failure)` prints the line of a trial this worker finished and moves the bar; a context
    manager that shows the bar while the sweep runs, where stdout is a terminal (or on `console`, a rich Console)."""

    def __init__(self, study, sweep: Sweep, total: int, console=None) -> None:
        from optuna.trial import TrialState

        self.study, self.sweep, self.total, self.lock = study, sweep, total, threading.Lock()
        self.bar = None
        if console is not None or sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn(f"sweep {sweep.name}"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("trials done"), TimeElapsedColumn(), console=console)
            done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
            self.task = self.bar.add_task("trials", total=total, completed=len(done))

    def __enter__(self) -> SweepProgress:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()

    def finished(self, number: int, failure: str | None) -> None:
        from optuna.trial import TrialState

        with self.lock:
            trials = self.study.get_trials(deepcopy=False)
            line = progress_line(trials[number], trials, self.sweep, self.total, failure)
            if self.bar is None:
                print(line, flush=True)
                return
            done = sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
            self.bar.update(self.task, completed=done)
            self.bar.console.print(line, markup=False, highlight=False, soft_wrap=True)  # one line, as without a bar
