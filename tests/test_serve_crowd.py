"""`imgcls serve` under a crowd (benchmarks/serve_crowd.py): 64 concurrent clients for 60 s on the loopback, valid
images mixed with truncated JPEGs, decompression bombs, wrong and missing content types, empty and oversized bodies
and clients that disconnect mid-request. Every valid request gets the model's label, every bad one its 4xx in one
line; no process of the server dies or is replaced, and its memory stays within the stated margin."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks import serve_crowd
from benchmarks.serve import write_folder


@pytest.mark.slow  # the crowd's minute, the server's start and a warm-up crowd: ~1.5 min on 2 cores
def test_a_crowd_of_good_and_hostile_clients_gets_right_answers_and_leaves_the_server_whole(tmp_path):
    folder = write_folder(tmp_path / "model", "resnet18", 32)
    r = serve_crowd.run(folder, 64, 60, 10, "--max_batch_size", "16", "--batch_timeout", "0.01")
    assert r["errors"] == [], r["errors"][:20]
    assert set(r["counts"]) == {serve_crowd.VALID, *serve_crowd.KINDS} and r["valid"] > 100, r["counts"]
    assert r["seconds"] >= 60 and r["clients"] == 64
    assert len(r["pids_before"]) >= 3 and r["pids_after"] == r["pids_before"], "a server process died or was replaced"
    assert serve_crowd.within_margin(r), (r["rss_before_mib"], r["rss_after_mib"])
    assert r["tracebacks"] == []


def test_the_crowd_counts_every_wrong_answer(monkeypatch):
    """The checks themselves: against a server that answers everything 200 with another label, every request whose
    answer is read is an error (a crowd run that could not fail would prove nothing)."""

    async def wrong(port, data, read=True):
        return (200, b'{"predictions": [{"label": "dog"}]}') if read else None

    monkeypatch.setattr(serve_crowd, "exchange", wrong)
    out = asyncio.run(serve_crowd.crowd(0, 2, 0.05, [(b"jpeg bytes", "image/jpeg", "cat")], b"bomb", seed=3))
    answered = sum(n for kind, n in out["counts"].items() if not kind.startswith("disconnects"))
    assert answered > 0 and len(out["errors"]) == answered, (out["counts"], out["errors"][:5])
    assert any("expected 200 'cat'" in e for e in out["errors"]) == (serve_crowd.VALID in out["counts"])
