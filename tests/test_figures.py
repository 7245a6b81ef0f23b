"""Every published figure comes from benchmarks/results/machines/*/*.json, each machine's records kept:
docs/PERFORMANCE.md is what benchmarks.pages renders, and each figure quoted in README.md and docs/*.md stands
between markers and equals its result."""

from __future__ import annotations

import difflib
import json
import re
import subprocess

import pytest

from benchmarks import pages, provenance
from benchmarks import records as on_disk

RECORD_KEYS = {"section", "mode", "started", "seconds", "machine", "results", "provenance"}
SHA = re.compile(r"[0-9a-f]{40}")


@pytest.fixture(scope="module")
def all_runs() -> dict[str, list[dict]]:
    return pages.load_all()


def _diff(old: str, new: str, name: str) -> str:
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), name, "rendered", n=1))[:4000]


def test_result_files_are_full_runs_that_name_their_machine(all_runs):
    assert set(all_runs) == set(pages.SECTIONS), f"no result file for {set(pages.SECTIONS) - set(all_runs)}"
    for name, records in all_runs.items():
        for run in records:
            assert RECORD_KEYS <= set(run), f"{name}.json lacks {RECORD_KEYS - set(run)}"
            assert run["section"] == name and run["mode"] == "full", f"{name}.json holds a {run['mode']} run"
            assert run["machine"]["cpu"] and run["machine"]["cpu"] in run["machine"]["line"], name


def test_every_record_says_where_it_came_from(all_runs):
    """The commit and whether the tree matched it, the command, the libraries, the log's last lines; a record from
    before provenance was kept says that its origin was reconstructed, and from which commit of git's history."""
    for name, records in all_runs.items():
        for run in records:
            prov = run["provenance"]
            assert set(provenance.FIELDS) <= set(prov), f"{name}: provenance lacks {set(provenance.FIELDS) - set(prov)}"
            assert SHA.fullmatch(prov["commit"] or ""), (name, prov["commit"])
            assert prov["command"] and "torch" in prov["versions"], name
            assert "note" not in run, f"{name}: a typed note; what a page says comes from the record's fields"
            if prov.get("reconstructed"):
                assert SHA.fullmatch(prov["reconstructed"]["stored_in"]) and prov["clean"] in (None, False), name
            else:
                assert isinstance(prov["clean"], bool) and isinstance(prov["on_main"], bool), name
                assert {"lightning", "torchvision"} <= set(prov["versions"]) and prov["log_tail"], name


def _history() -> bool:
    """Whether this checkout has the history a record's commit is looked up in (not a shallow clone)."""
    done = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=pages.ROOT, capture_output=True,
                          text=True)
    return done.returncode == 0 and done.stdout.strip() == "false"


def test_every_records_commit_is_in_the_history_and_on_main_where_it_says_so(all_runs):
    if not _history():
        pytest.skip("a checkout without its full history: the commits cannot be looked up")
    for name, records in all_runs.items():
        for run in records:
            prov = run["provenance"]
            for sha in (prov["commit"], (prov.get("reconstructed") or {}).get("stored_in")):
                if sha:
                    assert subprocess.run(["git", "cat-file", "-e", f"{sha}^{{commit}}"],
                                          cwd=pages.ROOT).returncode == 0, f"{name}: no commit {sha}"
            if prov["on_main"]:
                assert subprocess.run(["git", "merge-base", "--is-ancestor", prov["commit"], "HEAD"],
                                      cwd=pages.ROOT).returncode == 0, f"{name}: {prov['commit']} is not on main"


def test_the_page_shows_each_records_command_and_commit_and_marks_what_a_reader_must_know():
    page = pages.PERFORMANCE.read_text()
    for records in pages.load_all().values():
        for run in (r for r in records if on_disk.measured(r)):
            assert f"_Measured by {pages.origin(run)};" in page
    base = {"commit": "a" * 40, "clean": True, "on_main": True, "command": "python -m benchmarks.run --only x",
            "versions": {}, "log_tail": []}
    clean = pages.origin({"provenance": base})
    assert clean == "`python -m benchmarks.run --only x` at commit `aaaaaaaaaa`"
    assert "uncommitted changes" in pages.origin({"provenance": {**base, "clean": False}})
    assert "not on main" in pages.origin({"provenance": {**base, "on_main": False}})
    rebuilt = {**base, "clean": None, "reconstructed": {"stored_in": "b" * 40, "code_committed_later": True}}
    assert re.search(r"reconstructed.*`bbbbbbbbbb`.*committed only there", pages.origin({"provenance": rebuilt}))


def test_a_superseded_record_never_reaches_the_page(tmp_path, monkeypatch, all_runs):
    """A record of an older METHOD than its section's measures something else: it is left out, and none is stored."""
    for path in sorted((on_disk.RESULTS / "machines").glob("*/*.json")):
        assert not pages.superseded(json.loads(path.read_text())), f"{path} is superseded: delete or re-measure it"
    record = json.loads(json.dumps(all_runs["startup"][0]))
    folder = tmp_path / "machines" / "m"
    folder.mkdir(parents=True)
    (folder / "startup.json").write_text(json.dumps(record))
    assert pages.load_all(tmp_path)["startup"] == [record]
    from benchmarks import startup

    monkeypatch.setattr(startup, "METHOD", record.get("method", 1) + 1, raising=False)
    assert "startup" not in pages.load_all(tmp_path)
    assert "Not measured" in pages.section("startup", pages.load_all(tmp_path).get("startup"))


def test_performance_md_is_what_the_results_render(all_runs):
    expected = pages.performance(all_runs)
    actual = pages.PERFORMANCE.read_text()
    assert actual == expected, ("docs/PERFORMANCE.md differs from benchmarks/results/ (python -m benchmarks.pages):\n"
                                + _diff(actual, expected, "docs/PERFORMANCE.md"))


@pytest.mark.parametrize("path", pages.documents(), ids=lambda p: p.name)
def test_quoted_figures_equal_their_results(path, all_runs):
    text = path.read_text()
    # Every machine's records, as benchmarks.pages quotes them: SECTION@KIND keys name a kind that may not have
    # measured last.
    expected = pages.quote(text, pages.figures(all_runs), path.name)  # a key that no result has raises, naming it
    assert text == expected, (f"{path.name} quotes stale figures (python -m benchmarks.pages):\n"
                              + _diff(text, expected, path.name))
    assert not pages.unmarked(text), f"{path.name}: measured figures outside a marker: {pages.unmarked(text)}"
    assert not pages.unnamed_machines(text), f"{path.name}: no machine named for {pages.unnamed_machines(text)}"


def test_header_agrees_with_the_sections(all_runs):
    head = pages.header(all_runs)
    records = [run for runs in all_runs.values() for run in runs]
    total = sum(run["seconds"] for run in records if run["seconds"] is not None)
    assert pages.duration(total) + " in all" in head
    assert all(run["machine"]["cpu"] in head for run in records), head
    assert min(run["started"] for run in records) in head and max(run["started"] for run in records) in head


def test_every_machines_stored_record_is_on_the_page(all_runs):
    """A render that dropped a machine's figures (as a CPU run once replaced the H100's) fails here."""
    page = pages.PERFORMANCE.read_text()
    for name, records in all_runs.items():
        for run in (r for r in records if on_disk.measured(r)):
            body, _ = pages._module(name).render(run["results"])
            assert f"Machine: {run['machine']['line']}._" in page and body in page, (name, run["machine"]["cpu"])
    gpu = [r for r in all_runs["gpu_throughput"] if r["machine"].get("cuda") == "NVIDIA H100 80GB HBM3"]
    assert gpu and on_disk.measured(gpu[0])


def _record(section: str, kind: str, flags: dict, results: dict, started: str, cuda: str | None = None) -> dict:
    machine = {"line": f"AMD EPYC ({kind}); torch 2.14.1", "cpu": f"AMD EPYC ({kind})", "cpu_model": "AMD EPYC",
               "cpu_kind": kind, "cpu_flags": flags, "cores": 2, "cuda": cuda, "torch": "2.14.1", "threads": 2}
    origin = {"commit": "c" * 40, "clean": True, "on_main": True,
              "command": f"python -m benchmarks.run --only {section}",
              "versions": {"torch": "2.14.1"}, "log_tail": ["done"]}
    return {"section": section, "mode": "full", "started": started, "seconds": 1.0, "machine": machine,
            "results": results, "provenance": origin}


def test_a_run_keeps_every_other_machines_record_and_a_skip_never_replaces_a_measured_one(tmp_path):
    avx2 = {"avx2": True, "avx512f": False, "avx512_bf16": False, "amx_tile": False, "amx_bf16": False}
    bf16 = {**avx2, "avx512f": True, "avx512_bf16": True}
    gpu = _record("gpu_throughput", "bf16 CPU", bf16, {"device": "H", "batch": 2, "steps": 1, "img_s": {"a": 9.0},
                  "flop_per_image": 1e9, "peak_flops": None, "augment_img_s": 3.0}, "2026-01-01 00:00 UTC", cuda="H")
    skipped = _record("gpu_throughput", "AVX2 CPU", avx2, {"skipped": "no CUDA device on this machine"},
                      "2026-02-01 00:00 UTC")
    assert on_disk.store(gpu, tmp_path) is not None
    assert on_disk.store(skipped, tmp_path) is None  # newer, but skipped: the measured record stays the only one
    assert pages.load_all(tmp_path)["gpu_throughput"] == [gpu]
    first = _record("startup", "AVX2 CPU", avx2, {}, "2026-01-01 00:00 UTC")
    second = _record("startup", "bf16 CPU", bf16, {}, "2026-02-01 00:00 UTC")
    on_disk.store(first, tmp_path)
    on_disk.store(second, tmp_path)
    assert pages.load_all(tmp_path)["startup"] == [second, first]  # both kept, the newest is primary
    other = _record("gpu_throughput", "AVX2 CPU", avx2, {**gpu["results"], "device": "G", "img_s": {"a": 7.0}},
                    "2026-03-01 00:00 UTC", cuda="G")
    on_disk.store(other, tmp_path)
    page = pages.section("gpu_throughput", pages.load_all(tmp_path)["gpu_throughput"])
    assert "| a | 9 |" in page and "| a | 7 |" in page and "no CUDA device" not in page  # both GPUs' rows
    assert page.count("_Measured by ") == 2
    assert page.index(other["machine"]["line"]) < page.index(gpu["machine"]["line"])


def test_a_stale_figure_is_rewritten_and_an_unknown_key_is_an_error():
    known = {"loop_overhead.ratio_224px": "1.02x", "loop_overhead.cpu": "AMD EPYC"}
    text = "took <!-- figure: loop_overhead.ratio_224px -->0.99x<!-- /figure --> on a CPU"
    assert pages.quote(text, known, "X.md") == text.replace("0.99x", "1.02x")
    with pytest.raises(KeyError, match="'loop_overhead.ratio_64px'.*loop_overhead.ratio_224px"):
        pages.quote("<!-- figure: loop_overhead.ratio_64px -->1x<!-- /figure -->", known, "X.md")
    with pytest.raises(ValueError, match="without its"):
        pages.quote("<!-- figure: loop_overhead.cpu -->AMD EPYC", known, "X.md")
    shown = "write `<!-- figure: SECTION.NAME -->` and `<!-- /figure -->` around it"  # inline code: not a marker
    assert pages.quote(shown, known, "X.md") == shown
    table = "<!-- figure: t -->\n| `a` |\n|---|\n| 1 |\n<!-- /figure -->"
    assert pages.quote(table, {"t": "\n| `a` |\n|---|\n| 2 |\n"}, "X.md").count("| 2 |") == 1


def test_unmarked_finds_typed_figures_but_not_code_or_marked_ones():
    assert pages.unmarked("the loader delivers 2.06x the images/s") == ["the loader delivers 2.06x the images/s"]
    for typed in ("none 193 ms", "took 15 min 8 s", "sends 1.5 % of them", "98.3% (epoch 8)", "about 9 GB",
                  "~10x slower", "at 738 img/s"):
        assert pages.unmarked(typed), typed
    assert not pages.unmarked("```\nbf16 ~10x slower\n```\n`--x 2x` and <!-- figure: a.b -->2.06x<!-- /figure -->")
    assert not pages.unmarked("a (64 + 147) x 4 matrix, 10% of train/, every 30 s, 224 px")


def test_unmarked_finds_figures_typed_in_words():
    for typed in ("its CPU time was about twelve times the plain server's", "costs 12 times one at 64 px",
                  "about a quarter of the requests/s", "three quarters of its CPU", "a tenfold gain"):
        assert pages.unmarked(typed), typed
    for count in ("runs the fit 5 times in a row", "two times out of three", "a manifold", "half the bytes"):
        assert not pages.unmarked(count), count


def test_a_figure_needs_its_machine_named_under_the_same_heading():
    cpu = "<!-- figure: serve.cpu -->AMD EPYC<!-- /figure -->"
    kind_cpu = "<!-- figure: serve@avx2-cpu.cpu -->AMD EPYC<!-- /figure -->"
    fig = "<!-- figure: serve.batching_x -->1.19x<!-- /figure -->"
    assert pages.unnamed_machines(f"## A\nbatching gave {fig}") == ["serve.batching_x"]
    assert pages.unnamed_machines(f"## A\nOn {cpu}:\n\n### detail\nbatching gave {fig}") == []
    assert pages.unnamed_machines(f"## A\nOn {cpu}\n## B\nbatching gave {fig}") == ["serve.batching_x"]
    assert pages.unnamed_machines(f"## A\nOn {kind_cpu}, {fig}") == ["serve.batching_x"]  # another record's machine
    assert pages.unnamed_machines(f"`{fig}` shown as code") == []


def test_the_figures_imgcls_announces_are_the_stored_ones(all_runs):
    """core/measured.json, which core/hardware.py quotes in the reasons it prints, is rendered from the results."""
    import json

    assert pages.LEVERS.read_text() == json.dumps(pages.lever_figures(all_runs), indent=1) + "\n"
    assert pages.lever_figures(all_runs)["AVX2 CPU"]["bf16_vs_fp32"].endswith("x")


def test_a_marker_can_name_the_kind_of_machine_it_speaks_of(all_runs):
    known = pages.figures(all_runs)
    assert known["hardware@avx2-cpu.machine"].startswith("AMD EPYC (avx2, no avx512_bf16/amx)")
    assert known["gpu_throughput@nvidia-h100-80gb-hbm3.cpu"].endswith("CUDA NVIDIA H100 80GB HBM3")
