"""Pretrained weights are downloaded once per node however many ranks ask (lightning_modules/network.py:
cached_download): a real HTTP server on a loopback port serves a weights file to 8 processes that ask at once."""

from __future__ import annotations

import hashlib
import http.server
import multiprocessing
import threading
import time
from pathlib import Path

import pytest
import torch
import torchvision

from tests.helpers import FORKSERVER_PRELOAD, ROOT


class _Served(http.server.SimpleHTTPRequestHandler):
    requests: list[str] = []

    def do_GET(self):  # noqa: N802 - http.server's name
        _Served.requests.append(self.path)
        time.sleep(0.5)  # a slow mirror: every other process asks while this download is under way
        super().do_GET()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server(tmp_path):
    folder = tmp_path / "mirror"
    folder.mkdir()
    handler = lambda *args, **kwargs: _Served(*args, directory=str(folder), **kwargs)  # noqa: E731
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    _Served.requests = []
    yield folder, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def _weights_file(folder: Path) -> Path:
    """A resnet18 state dict, named as torchvision names its files: the first hex digits of its SHA-256."""
    torch.manual_seed(0)
    raw = folder / "raw.pth"
    torch.save(torchvision.models.resnet18().state_dict(), raw)
    digest = hashlib.sha256(raw.read_bytes()).hexdigest()
    return raw.rename(folder / f"resnet18-{digest[:8]}.pth")


def _rank(job: tuple[str, str, float]) -> str:
    """One rank: wait for the common start, then fetch the weights and digest what it loaded."""
    import os

    url, torch_home, start = job
    os.environ["TORCH_HOME"] = torch_home
    from lightning_modules.network import _state_dict_from_file, cached_download

    time.sleep(max(0.0, start - time.time()))
    state = _state_dict_from_file(cached_download(url))
    return hashlib.sha256(b"".join(t.numpy().tobytes() for t in state.values())).hexdigest()


@pytest.mark.slow  # 8 processes forked from one that imported torch
def test_eight_ranks_of_a_node_make_one_request_and_load_identical_weights(server, tmp_path):
    folder, base = server
    served = _weights_file(folder)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(FORKSERVER_PRELOAD)
    with context.Pool(8) as pool:
        jobs = [(f"{base}/{served.name}", str(tmp_path / "torch"), time.time() + 3.0)] * 8
        digests = pool.map(_rank, jobs)
    assert _Served.requests == [f"/{served.name}"]  # one download for the node
    state = torch.load(served, weights_only=True)
    assert set(digests) == {hashlib.sha256(b"".join(t.numpy().tobytes() for t in state.values())).hexdigest()}
    assert (tmp_path / "torch" / "hub" / "checkpoints" / served.name).read_bytes() == served.read_bytes()


def test_a_download_that_fails_its_hash_is_refused_and_leaves_nothing_in_the_cache(server, tmp_path, monkeypatch):
    from lightning_modules.network import cached_download

    folder, base = server
    served = _weights_file(folder)
    wrong = served.rename(folder / "resnet18-00000000.pth")  # the name promises another file
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    with pytest.raises(RuntimeError, match="invalid hash value"):
        cached_download(f"{base}/{wrong.name}")
    assert not (tmp_path / "torch" / "hub" / "checkpoints" / wrong.name).exists()


def test_the_readme_names_the_offline_file_and_its_command(monkeypatch):
    """For a node without internet: the exact file of configs/imagenet_ddp8.yaml's weights, and the one command, as
    the download error prints it (TORCH_HOME unset)."""
    import yaml

    from lightning_modules.network import offline_command

    for var in ("TORCH_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    weights = yaml.safe_load((ROOT / "configs" / "imagenet_ddp8.yaml").read_text())["model"]["net"]["init_args"]
    assert weights["arch"] == "resnet50"
    url = torchvision.models.get_weight(f"ResNet50_Weights.{weights['weights']}").url
    readme = (ROOT / "README.md").read_text()
    assert url in readme
    assert offline_command(url).replace(str(Path.home()), "~") in readme
