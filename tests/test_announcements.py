"""imgcls's announcements (Lightning's `rank_zero_info` lines: precision, resume, run directory, scan cache) reach the
tests' caplog whatever ran before in the same process, and an `imgcls` process prints each once, on stderr, whatever
logging it had when Lightning was imported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Two tests in this order, in one pytest process with this suite's conftest: the first leaves Lightning's logger as
# Lightning's import leaves it without a root handler (not propagating) and as the loop-overhead benchmark's quick
# run left it (at ERROR); the second is a caplog check of an announcement, as tests/test_hardware.py makes.
ORDER = textwrap.dedent('''
    import logging

    from core import hardware
    from training.trainer import Trainer


    def test_something_quiets_lightning():
        logger = logging.getLogger("lightning.pytorch")
        logger.propagate = False
        logger.setLevel(logging.ERROR)


    def test_the_next_one_still_sees_the_announcement(caplog):
        with caplog.at_level(logging.INFO):
            Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
        precision, why = hardware.choose_precision(hardware.detect(), "cpu")
        assert [m for m in caplog.messages if m.startswith("precision: ")] == [f"precision: {precision} ({why})"]
''')


def test_an_announcement_reaches_caplog_whatever_ran_before_it(tmp_path):
    (tmp_path / "test_order.py").write_text(ORDER)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("PYTEST_XDIST_WORKER_COUNT", None)
    # In tmp_path, away from pyproject.toml's options (no xdist): one process runs both, in the file's order.
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider",
                             "--rootdir", str(tmp_path), "-q", "test_order.py"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout


def test_an_imgcls_process_prints_each_announcement_once_even_with_logging_configured_first():
    """Lightning leaves its lines to the root logger's handlers where it finds one on import (here basicConfig's, as a
    sitecustomize may set up), and its `lightning` logger prints each again as "INFO: ...". imgcls/startup.py
    prints them as a fresh process does: bare, once."""
    code = textwrap.dedent('''
        import logging
        logging.basicConfig()
        import lightning.pytorch
        from lightning.pytorch.utilities import rank_zero_info
        from imgcls.startup import console
        console()
        rank_zero_info("precision: 32-true (why)")
    ''')
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert [line for line in result.stderr.splitlines() if "precision" in line] == ["precision: 32-true (why)"]
