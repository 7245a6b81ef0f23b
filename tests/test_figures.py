"""Every published figure comes from benchmarks/results/*.json: docs/PERFORMANCE.md is what benchmarks.figures
renders, and each figure quoted in README.md and docs/*.md stands between markers and equals its result."""

from __future__ import annotations

import difflib

import pytest

from benchmarks import figures

RECORD_KEYS = {"section", "mode", "started", "seconds", "machine", "results"}


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    return figures.load()


def _diff(old: str, new: str, name: str) -> str:
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), name, "rendered", n=1))[:4000]


def test_result_files_are_full_runs_that_name_their_machine(runs):
    assert set(runs) == set(figures.SECTIONS), f"no result file for {set(figures.SECTIONS) - set(runs)}"
    for name, run in runs.items():
        assert RECORD_KEYS <= set(run), f"{name}.json lacks {RECORD_KEYS - set(run)}"
        assert run["section"] == name and run["mode"] == "full", f"{name}.json holds a {run['mode']} run"
        assert run["machine"]["cpu"] and run["machine"]["cpu"] in run["machine"]["line"], name


def test_performance_md_is_what_the_results_render(runs):
    expected = figures.performance(runs)
    actual = figures.PERFORMANCE.read_text()
    assert actual == expected, ("docs/PERFORMANCE.md differs from benchmarks/results/ (python -m benchmarks.figures):\n"
                                + _diff(actual, expected, "docs/PERFORMANCE.md"))


@pytest.mark.parametrize("path", figures.documents(), ids=lambda p: p.name)
def test_quoted_figures_equal_their_results(path, runs):
    text = path.read_text()
    expected = figures.quote(text, figures.figures(runs), path.name)  # a key that no result has raises, naming it
    assert text == expected, (f"{path.name} quotes stale figures (python -m benchmarks.figures):\n"
                              + _diff(text, expected, path.name))
    assert not figures.unmarked(text), f"{path.name}: measured figures outside a marker: {figures.unmarked(text)}"


def test_header_agrees_with_the_sections(runs):
    head = figures.header(runs)
    total = sum(run["seconds"] for run in runs.values() if run["seconds"] is not None)
    assert figures.duration(total) + " in all" in head
    assert all(run["machine"]["cpu"] in head for run in runs.values()), head
    assert min(run["started"] for run in runs.values()) in head and max(run["started"] for run in runs.values()) in head


def test_a_stale_figure_is_rewritten_and_an_unknown_key_is_an_error():
    known = {"loop_overhead.ratio_224px": "1.02x", "loop_overhead.cpu": "AMD EPYC"}
    text = "took <!-- figure: loop_overhead.ratio_224px -->0.99x<!-- /figure --> on a CPU"
    assert figures.quote(text, known, "X.md") == text.replace("0.99x", "1.02x")
    with pytest.raises(KeyError, match="'loop_overhead.ratio_64px'.*loop_overhead.ratio_224px"):
        figures.quote("<!-- figure: loop_overhead.ratio_64px -->1x<!-- /figure -->", known, "X.md")
    with pytest.raises(ValueError, match="without its"):
        figures.quote("<!-- figure: loop_overhead.cpu -->AMD EPYC", known, "X.md")
    shown = "write `<!-- figure: SECTION.NAME -->` and `<!-- /figure -->` around it"  # inline code: not a marker
    assert figures.quote(shown, known, "X.md") == shown
    table = "<!-- figure: t -->\n| `a` |\n|---|\n| 1 |\n<!-- /figure -->"
    assert figures.quote(table, {"t": "\n| `a` |\n|---|\n| 2 |\n"}, "X.md").count("| 2 |") == 1


def test_unmarked_finds_typed_figures_but_not_code_or_marked_ones():
    assert figures.unmarked("the loader delivers 2.06x the images/s") == ["the loader delivers 2.06x the images/s"]
    for typed in ("none 193 ms", "took 15 min 8 s", "sends 1.5 % of them", "98.3% (epoch 8)", "about 9 GB",
                  "~10x slower", "at 738 img/s"):
        assert figures.unmarked(typed), typed
    assert not figures.unmarked("```\nbf16 ~10x slower\n```\n`--x 2x` and <!-- figure: a.b -->2.06x<!-- /figure -->")
    assert not figures.unmarked("a (64 + 147) x 4 matrix, 10% of train/, every 30 s, 224 px")
