"""The notebooks run top to bottom on the demo data, and are stored without outputs."""

from __future__ import annotations

import json
import os
import sys

import nbformat
import pytest
from nbclient import NotebookClient

from tests.helpers import ROOT, concurrent_python

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
    # The kernel is a fresh interpreter whose sys.executable is the preloaded server's launcher (tests/preloaded.py),
    # so that the `imgcls` processes a notebook starts with it (02's sweep, and the sweep's trials) are forked as the
    # other tests' are; the kernelspec is ipykernel's own otherwise.
    kernels = tmp_path / "jupyter" / "kernels" / "imgcls-test"
    kernels.mkdir(parents=True)
    launch = f"import sys; sys.executable = {concurrent_python()!r}; from ipykernel import kernelapp; " \
             "kernelapp.launch_new_instance()"
    (kernels / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-c", launch, "-f", "{connection_file}"], "display_name": "imgcls tests",
        "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="imgcls-test",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 3  # every section drew its figure
    assert any(tmp_path.iterdir())  # its demo data went to IMGCLS_WORK, not to a temporary folder left behind
