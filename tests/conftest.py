"""Fixtures: the demo digits, built once per session into a temporary folder."""

from __future__ import annotations

import json
import logging
import math
import os
from collections import Counter
from pathlib import Path

import pytest
import torch

from datamodules.demo import build_demo_data


@pytest.fixture(scope="session")
def digits_root(tmp_path_factory):
    """The real demo dataset (1,797 digits as PNGs), at 32 px to keep CPU tests quick."""
    return build_demo_data(tmp_path_factory.mktemp("digits") / "digits", size=32)


@pytest.fixture(autouse=True)
def _restore_environ():
    """Each test starts from the same environment: an in-process DDP fit leaves Lightning's launcher variables
    (LOCAL_RANK, NODE_RANK, OMP_NUM_THREADS) in os.environ, and a later `imgcls` subprocess that inherits LOCAL_RANK
    takes itself for a process started by torchrun and waits for ranks that nobody launches."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


# The loggers imgcls announces through: `rank_zero_info` (precision, resume, run directory, scan cache) logs to
# lightning.pytorch's; Lightning's own lines go to lightning.fabric's too.
ANNOUNCERS = ("lightning.pytorch", "lightning.fabric")


def _announcements_to_root() -> None:
    """imgcls's announcements reach the root logger, where pytest's handlers (caplog's among them) are, at INFO.

    Left alone they reach caplog only by chance: Lightning's import, here in this file's imports, makes its loggers
    non-propagating with a console handler of their own (the root logger has none yet), and what a test then sees
    depended on the pytest version (9.2 attaches its handlers to non-propagating loggers, earlier ones never) and
    on what ran before in the same worker (the loop-overhead benchmark's quick run set lightning.pytorch to ERROR,
    and every caplog check after it on that worker failed). Propagating, as Lightning sets them up itself when the
    root logger has a handler on import, they reach caplog once and the same way in every order."""
    for name in ANNOUNCERS:
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        logger.propagate = True


@pytest.fixture(autouse=True)
def _announcements_reach_caplog():
    """Each test starts with the announcements routed as _announcements_to_root says, whatever a test or an in-process
    benchmark before it did to those loggers."""
    _announcements_to_root()


def pytest_configure(config):
    # Before pytest's first capture: one that began while a logger did not propagate keeps its handler on it too.
    _announcements_to_root()
    _threads_per_worker()


def _threads_per_worker() -> None:
    """A worker of `-n N` computes with its share of the cores. Torch's default, a thread per core in every worker,
    makes each in-process op wait on threads whose cores the other workers hold: the quick benchmarks took 10x longer
    beside one busy core. Subprocesses get one thread from cli_env; those started with os.environ (the benchmarks'
    runs) from OMP_NUM_THREADS here."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        threads = max(1, _cores() // workers)
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core, at most 4 (several tests start 2 to 8 processes of their own)."""
    return max(1, min(4, _cores()))


# Seconds each test file took (setup, call and teardown of its tests), written by `pytest --store-durations`:
# the order in which --dist loadfile hands files to the workers.
DURATIONS = Path(__file__).with_name("durations.json")


def pytest_addoption(parser):
    parser.addoption("--store-durations", action="store_true",
                     help=f"write each test file's seconds to {DURATIONS.name}, the order of the next runs")


def pytest_collection_modifyitems(config, items):
    # The longest files first, by their stored seconds (a file not yet stored counts as the longest): with --dist
    # loadfile a worker runs a whole file, and a long one handed out last keeps one worker busy while the others
    # have finished. (xdist's own order, the files with the most tests first, put the single-test multi-minute files
    # at the end.)
    stored = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    items.sort(key=lambda item: -stored.get(_file(item.nodeid), math.inf))  # stable: ties as collected
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if _marked_cuda(item):
            item.add_marker(skip)


def _marked_cuda(item) -> bool:
    # The mark, not `"cuda" in item.keywords`: keywords hold every folder's name too, a checkout in a folder `cuda`.
    return item.get_closest_marker("cuda") is not None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI=true with a CUDA device visible, a `cuda` test that skips fails instead: a GPU claim whose test skipped
    there (no NCCL, a missing package) would pass unchecked."""
    report = yield
    if report.skipped and not hasattr(report, "wasxfail") and _marked_cuda(item) and os.environ.get("CI") == "true" \
            and torch.cuda.is_available():
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"CI=true with a CUDA device: the cuda test {item.nodeid} may not skip ({reason})"
    return report


def _file(nodeid: str) -> str:
    return nodeid.partition("::")[0]


_seconds: Counter = Counter()


def pytest_runtest_logreport(report):
    _seconds[_file(report.nodeid)] += report.duration  # on the controller too: xdist sends it every report


def pytest_sessionfinish(session):
    if session.config.getoption("--store-durations") and not hasattr(session.config, "workerinput"):
        rounded = {name: round(seconds, 1) for name, seconds in sorted(_seconds.items())}
        DURATIONS.write_text(json.dumps(rounded, indent=1) + "\n")
