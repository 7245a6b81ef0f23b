"""Where a benchmark record came from (benchmarks/provenance.py): the commit and whether the tree matched it, from
git's history or, on a machine that has only a copy of the tree, from the blob hashes `make gpu-wheels` carries; the
command as typed; the log's last lines. And the CI policy on skipped sections (benchmarks/run.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks import pages, provenance, records, run


def _git(root, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A repository with one commit on main: code, a doc and a result, as the project's tree has them."""
    root = tmp_path / "repo"
    (root / "benchmarks" / "results").mkdir(parents=True)
    (root / "docs").mkdir()
    (root / "core").mkdir()
    (root / "core" / "code.py").write_text("x = 1\n")
    (root / "docs" / "PAGE.md").write_text("page\n")
    (root / "benchmarks" / "results" / "r.json").write_text("{}\n")
    _git(root, "init", "-q", "-b", "main")
    _git(root, "add", ".")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    monkeypatch.setattr(provenance, "ROOT", root)
    return root


def test_a_clean_tree_on_main_and_what_makes_it_dirty(repo):
    state = provenance.tree_state()
    assert state == {"commit": _git(repo, "rev-parse", "HEAD"), "clean": True, "on_main": True, "changed": []}
    (repo / "docs" / "PAGE.md").write_text("rendered anew\n")  # what a benchmark run writes itself
    (repo / "benchmarks" / "results" / "r.json").write_text('{"a": 1}\n')
    assert provenance.tree_state()["clean"] is True
    (repo / "core" / "code.py").write_text("x = 2\n")
    (repo / "core" / "new.py").write_text("")
    state = provenance.tree_state()
    assert state["clean"] is False and sorted(state["changed"]) == ["core/code.py", "core/new.py"]


def test_a_commit_off_main_is_said_to_be(repo):
    _git(repo, "checkout", "-qb", "side")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "two")
    assert provenance.tree_state()["on_main"] is False
    _git(repo, "checkout", "-q", "main")
    _git(repo, "merge", "-q", "--ff-only", "side")
    assert provenance.tree_state()["on_main"] is True


def test_without_history_the_tree_is_compared_with_the_carried_snapshot(repo, monkeypatch):
    snapshot = provenance.tree_snapshot()
    (repo / ".whl").mkdir()
    (repo / provenance.TREE).write_text(json.dumps(snapshot))
    monkeypatch.setattr(provenance, "_git", lambda *args: None)  # a GPU machine's copy: no .git
    assert provenance.tree_state() == {"commit": snapshot["commit"], "clean": True, "on_main": True, "changed": []}
    (repo / "docs" / "PAGE.md").write_text("rendered anew\n")
    assert provenance.tree_state()["clean"] is True
    (repo / "core" / "code.py").write_text("x = 3\n")
    assert provenance.tree_state()["changed"] == ["core/code.py"]
    (repo / provenance.TREE).unlink()
    state = provenance.tree_state()
    assert state["commit"] is None and state["clean"] is False and "make gpu-wheels" in state["changed"][0]


def test_the_command_is_the_one_typed_with_the_kernel_limits_in_front(monkeypatch):
    monkeypatch.setattr(sys, "orig_argv", ["/x/.venv/bin/python", "-m", "benchmarks.run", "--only", "recipe"])
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert provenance.command() == "python -m benchmarks.run --only recipe"
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert provenance.command() == ("ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 "
                                    "python -m benchmarks.run --only recipe")


def test_the_log_tail_keeps_the_last_lines_of_stdout_and_stderr(capsys):
    with provenance.captured_log() as tail:
        for i in range(provenance.LOG_LINES + 5):
            print(f"line {i}")
        print("on stderr", file=sys.stderr)
        sys.stdout.write("unfinished")
    assert len(tail) == provenance.LOG_LINES and tail[0] == "line 7" and list(tail)[-2:] == ["on stderr",
                                                                                             "unfinished"]
    assert "line 0" in capsys.readouterr().out  # written through as well


def _skipping(needs: str):
    def measure(name: str, quick: bool = False) -> dict:
        return {"section": name, "method": 1, "mode": "quick", "started": "2026-01-01 00:00 UTC", "seconds": 0.0,
                "machine": {}, "results": {"skipped": f"needs {needs}", "needs": needs}, "provenance": {}}
    return measure


@pytest.mark.parametrize(("needs", "fails"), [("postgresql", True), ("linux", True), ("cuda", False),
                                              ("peer", False)])
def test_under_ci_a_section_skipped_for_what_ci_can_have_fails_the_run(tmp_path, monkeypatch, needs, fails):
    monkeypatch.setattr(run, "measure", _skipping(needs))
    monkeypatch.setattr(records, "store", lambda record, results: None)
    monkeypatch.setattr(pages, "section", lambda name, record: "")
    monkeypatch.setattr(pages, "main", lambda *args, **kwargs: [])
    monkeypatch.setenv("CI", "true")
    if fails:
        with pytest.raises(RuntimeError, match="skipped under CI=true"):
            run.main(quick=True, out=tmp_path / "P.md", only=("sweep_retry",))
    else:
        run.main(quick=True, out=tmp_path / "P.md", only=("sweep_retry",))
    monkeypatch.setenv("CI", "false")  # outside CI a skip is reported, never a failure
    run.main(quick=True, out=tmp_path / "P.md", only=("sweep_retry",))
