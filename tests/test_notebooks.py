"""The notebooks run top to bottom on the demo data, and are stored without outputs."""

from __future__ import annotations

import os

import nbformat
import pytest
from nbclient import NotebookClient

from tests.helpers import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert {p.name for p in NOTEBOOKS} >= {"01_data_exploration.ipynb", "02_results.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: clear outputs before commit"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_top_to_bottom(path, monkeypatch, tmp_path):
    # The kernel inherits this environment: one thread each, this checkout first, the notebook's own demo data and
    # sweep, built in this test's folder (pytest removes it), not under runs/notebooks/.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("IMGCLS_WORK", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for var in ("IMGCLS_DATA", "IMGCLS_SWEEP"):
        monkeypatch.delenv(var, raising=False)
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 3  # every section drew its figure
    assert any(tmp_path.iterdir())  # its demo data went to IMGCLS_WORK, not to a temporary folder left behind
