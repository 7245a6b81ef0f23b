"""imgcls without any extra, as `pip install imgcls` gives it, at requirements.lock's versions, in a fresh virtual
environment: it fine-tunes from a published model folder, writes one, and each command that needs an extra names the
extra in one line. The environment is made with uv (.venv's, from the dev extra): its cache links the files of torch
into a new environment instead of copying them, so that a second run takes seconds."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from uv import find_uv_bin

from tests.helpers import CONFIGS, ROOT, TINY, make_image_folder, run_cli
from tests.test_dependencies import LOCK, environments, pinned_in

pytestmark = pytest.mark.slow

SETTINGS = [*TINY, "--trainer.enable_progress_bar", "false", "--trainer.precision", "32-true", "--auto_resume", "false",
            "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1", "--trainer.max_epochs", "1"]


def pip_sources() -> list[str]:
    """The indexes and find-links pip is configured with (where `make install` took .venv's packages), as uv's
    options: uv reads no pip configuration. Any index may serve a file: the lock's hashes decide which file is
    taken."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                            check=True).stdout
    flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links"}
    options: list[str] = []
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        flag = flags.get(key.rpartition(".")[2])
        for source in value.strip().strip("'\"").split() if flag else []:
            if source not in options:
                options += [flag, source]
    return [*options, "--index-strategy", "unsafe-best-match"]


def base_env_vars() -> dict[str, str]:
    """This environment without what points at this checkout or .venv: the base environment runs its own copy."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """The fresh environment's bin/: imgcls installed from this checkout (not editable), its base dependencies held
    to the lock's versions, each file checked against the lock's hashes."""
    venv = tmp_path_factory.mktemp("base_install") / "venv"
    uv = find_uv_bin()
    subprocess.run([uv, "venv", "--quiet", "--python", sys.executable, str(venv)], check=True, env=base_env_vars())
    proc = subprocess.run([uv, "pip", "install", "--quiet", "--python", str(venv / "bin" / "python"), "-c", str(LOCK),
                           str(ROOT), *pip_sources()], capture_output=True, text=True, env=base_env_vars(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return venv / "bin"


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(images, a checkpoint, its published folder), made with .venv's imgcls."""
    tmp = tmp_path_factory.mktemp("base_published")
    images = make_image_folder(tmp / "images", {"a": 6, "b": 6}, size=32)
    run_cli("fit", "--config", str(CONFIGS / "quickstart.yaml"), *SETTINGS, "--data.root", str(images),
            "--trainer.default_root_dir", str(tmp / "run"))
    ckpt = tmp / "run" / "checkpoints" / "last.ckpt"
    run_cli("publish", "--ckpt_path", str(ckpt), str(tmp / "published"))
    return images, ckpt, tmp / "published"


def imgcls(bin_dir: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(bin_dir / "imgcls"), *args], cwd=cwd, capture_output=True, text=True,
                          env=base_env_vars(), timeout=600)


def requirement_closure(installed: dict[str, metadata.Distribution], root: str) -> set[str]:
    """`root` and everything its installed metadata requires, without any extra of root's (an extra that a
    dependency asks for of another, such as jsonargparse[signatures], followed)."""
    env = default_environment()
    seen: set[tuple[str, str]] = set()
    todo = [(canonicalize_name(root), "")]
    while todo:
        name, extra = todo.pop()
        if (name, extra) in seen or name not in installed:
            continue
        seen.add((name, extra))
        for line in installed[name].requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({**env, "extra": extra}):
                todo += [(canonicalize_name(req.name), e) for e in ("", *req.extras)]
    return {name for name, _ in seen}


def test_the_base_install_holds_the_locked_base_set_and_no_extra(base):
    site = next((base.parent / "lib").glob("python*/site-packages"))
    installed = {canonicalize_name(d.metadata["Name"]): d for d in metadata.distributions(path=[str(site)])}
    here = next(env for env in environments() if env["sys_platform"] == sys.platform and
                env["python_version"] == f"{sys.version_info.major}.{sys.version_info.minor}")
    locked = pinned_in(here)
    assert installed["imgcls"].version == metadata.version("imgcls")
    assert {n: d.version for n, d in installed.items() if n != "imgcls" and str(locked.get(n)) != d.version} == {}
    assert set(installed) - requirement_closure(installed, "imgcls") == set()  # nothing that only an extra needs
    assert not {"optuna", "litserve", "onnx", "wandb", "pytest"} & installed.keys()


def test_the_base_install_fine_tunes_from_a_published_folder_and_publishes(base, published, tmp_path):
    images, _, folder = published
    fit = imgcls(base, "fit", "--config", str(CONFIGS / "quickstart.yaml"), *SETTINGS, "--data.root", str(images),
                 "--model.net.weights", str(folder), "--trainer.default_root_dir", str(tmp_path / "tuned"),
                 cwd=tmp_path)
    assert fit.returncode == 0, fit.stderr[-4000:]
    assert f"model.net.weights={folder}: loaded the network" in fit.stdout + fit.stderr
    again = imgcls(base, "publish", "--ckpt_path", str(tmp_path / "tuned" / "checkpoints" / "last.ckpt"),
                   str(tmp_path / "republished"), cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-4000:]
    assert (tmp_path / "republished" / "model.safetensors").is_file()


@pytest.mark.parametrize(("extra", "command"), [
    ("sweep", ["sweep", "--config", str(CONFIGS / "sweeps" / "quickstart_lr.yaml")]),
    ("serve", ["serve", "FOLDER"]),
    ("export", ["export", "--ckpt_path", "CKPT", "--format", "onnx"]),
])
def test_a_command_that_needs_an_extra_names_it_in_one_line(base, published, tmp_path, extra, command):
    _, ckpt, folder = published
    args = [{"FOLDER": str(folder), "CKPT": str(ckpt)}.get(a, a) for a in command]
    proc = imgcls(base, *args, cwd=tmp_path)
    what = "imgcls export --format onnx" if extra == "export" else f"imgcls {extra}"
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-4000:]
    assert proc.stderr.startswith(f"imgcls: error: {what} needs the `{extra}` extra: pip install 'imgcls[{extra}]' (")
