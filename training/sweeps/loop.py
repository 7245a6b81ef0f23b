"""One sweep worker's trials: the grid's points queued once in the study, and the loop that takes trials one at a time.

    study, created = open_study(sweep, storage, seed)       # a grid's points queued by the worker that created it
    run_trials(study, storage, sweep, objective, ...)       # until no trial is left for this worker

A worker's threads take the study's queued trials (a grid's points, retries) with the storage's compare-and-set of
WAITING to RUNNING, which only one of two workers wins; a random or bayes worker otherwise asks its sampler for a new
trial while the study's finished and running trials are fewer than its budget. Each trial runs with heartbeats and
is told to the study. Optuna's `study.optimize` is not used: asked with its queue empty, it creates a trial of its
own (a grid's sampler then hands out a point that another worker runs), and on SQLite its take of a queued trial is
no compare-and-set (no SELECT ... FOR UPDATE): one queued trial was taken by 3 of 4 processes that asked at once. A
storage file is therefore taken from under an exclusive lock (`.<file>.claim`); a database server's row lock makes the
take atomic there.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from training.sweeps.space import Sweep, make_pruner, make_sampler
from training.sweeps.trial import TrialFailed, storage_file

GRID_KEY = "imgcls:grid"  # a study system attribute: the grid whose points are all queued, set by its creator


def grid_points(sweep: Sweep) -> list[dict]:
    """Every point of the grid, each a {key: value} of its swept parameters."""
    return [dict(zip(sweep.grid, values, strict=True)) for values in itertools.product(*sweep.grid.values())]


def open_study(sweep: Sweep, storage, seed: int | None, wait: float):
    """(the sweep's study, whether this worker created it). The creator of a grid's study queues every point (a
    WAITING trial each) and then marks the queue complete; another worker waits for that mark, `wait` seconds at
    most, and refuses a study whose grid is not its sweep file's."""
    import optuna

    options = {"study_name": sweep.name, "storage": storage, "sampler": make_sampler(sweep, seed),
               "pruner": make_pruner(sweep.hyperband)}
    try:
        study, created = optuna.create_study(direction=sweep.goal, load_if_exists=False, **options), True
    except optuna.exceptions.DuplicatedStudyError:
        study, created = optuna.load_study(**options), False
    if sweep.method != "grid":
        return study, created
    study_id = storage.get_study_id_from_name(sweep.name)
    if created:
        for params in grid_points(sweep):
            study.enqueue_trial(params)
        storage.set_study_system_attr(study_id, GRID_KEY, sweep.grid)
    deadline = time.monotonic() + wait
    while (queued := storage.get_study_system_attrs(study_id).get(GRID_KEY)) is None:
        if time.monotonic() > deadline:
            raise SystemExit(f"error: the grid of study {sweep.name} was never queued in full (the worker that created "
                             f"it stopped within {wait:.0f} s of it); delete the study, e.g. optuna delete-study "
                             f"--study-name {sweep.name} --storage URL, or give the sweep another `name`")
        time.sleep(0.2)
    if queued != sweep.grid:
        raise SystemExit(f"error: study {sweep.name} runs the grid {queued}, not {sweep.path}'s {sweep.grid}; give "
                         "the sweep another `name` for another grid")
    return study, created


@contextlib.contextmanager
def claim_lock(url: str) -> Iterator[None]:
    """Held while a worker takes a trial from a storage file (SQLite's take is no compare-and-set); nothing for a
    database server."""
    file = storage_file(url)
    if file is None:
        yield
        return
    with open(file.with_name(f".{file.name}.claim"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def heartbeat_interval(storage) -> int | None:
    from optuna.storages import RDBStorage

    return storage.get_heartbeat_interval() if isinstance(storage, RDBStorage) else None


def take(study, storage, url: str, *, fresh: Callable[[], bool]):
    """(the next trial for this worker, now RUNNING, its storage id), or None: a queued one (a grid's point, a retry)
    taken by compare-and-set, else a new one from the sampler where `fresh()` allows it. Stale trials (heartbeat
    older than the grace period) are failed first, which queues their retries."""
    import optuna
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.trial import TrialState

    with claim_lock(url):
        if heartbeat_interval(storage):
            optuna.storages.fail_stale_trials(study)
        study_id = storage.get_study_id_from_name(study.study_name)
        for queued in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, queued.number)
            with contextlib.suppress(UpdateFinishedTrialError):  # finished meanwhile by another worker
                if storage.set_trial_state_values(trial_id, state=TrialState.RUNNING):
                    return optuna.Trial(study, trial_id), trial_id
        if not fresh():
            return None
        trial = study.ask()
        return trial, storage.get_trial_id_from_study_id_trial_number(study_id, trial.number)


@contextlib.contextmanager
def heartbeats(storage, trial_id: int) -> Iterator[None]:
    """A database storage's heartbeat of the trial while it runs (what `study.optimize` records), every interval."""
    interval = heartbeat_interval(storage)
    if not interval:
        yield
        return
    stop = threading.Event()

    def beat() -> None:
        while True:
            storage.record_heartbeat(trial_id)
            if stop.wait(interval):
                return

    thread = threading.Thread(target=beat, name=f"heartbeat-{trial_id}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def run_one(study, storage, trial, trial_id: int, objective) -> str | None:
    """Run the trial and tell the study its outcome; what went wrong (a failed trial's message), else None."""
    from optuna import TrialPruned
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.trial import TrialState

    value, state, failure = None, TrialState.COMPLETE, None
    with heartbeats(storage, trial_id):
        try:
            value = objective(trial)
        except TrialPruned:
            state = TrialState.PRUNED
        except TrialFailed as err:
            state, failure = TrialState.FAIL, str(err)
        except BaseException:
            study.tell(trial, state=TrialState.FAIL)
            raise
    try:
        study.tell(trial, value, state=state)
    except UpdateFinishedTrialError:  # its heartbeats came late: another worker failed it, and queued its retry
        failure = (f"trial {trial.number} was failed by another worker while it ran (no heartbeat seen for the grace "
                   "period); its retry counts instead")
    return failure


def new_trials(study, budget: int | None, asks: int) -> Callable[[], bool]:
    """`fresh` for `take`: whether a new trial may be asked, at most `asks` times, each while the study's complete,
    pruned and running trials (every worker's) are fewer than `budget`; never for a grid (None)."""
    from optuna.trial import TrialState

    lock, left = threading.Lock(), [asks]

    def fresh() -> bool:
        with lock:
            counted = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED,
                                                               TrialState.RUNNING))
            if budget is None or left[0] <= 0 or len(counted) >= budget:
                return False
            left[0] -= 1
            return True

    return fresh


def run_trials(study, storage, url: str, objective, *, workers: int, fresh: Callable[[], bool],
               finished: Callable[[int, str | None], None]) -> None:
    """Take and run trials on `workers` threads until none is left to take; `finished(trial number, failure)` after
    each."""

    def work() -> None:
        while (taken := take(study, storage, url, fresh=fresh)) is not None:
            trial, trial_id = taken
            finished(trial.number, run_one(study, storage, trial, trial_id, objective))

    if workers == 1:
        work()  # in this thread, where Ctrl-C arrives
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="sweep-worker") as pool:
        for done in [pool.submit(work) for _ in range(workers)]:
            done.result()
