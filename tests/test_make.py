"""The Makefile's own promises: `make clean` removes what `make train` and the tools made, and never a user's run."""

from __future__ import annotations

import subprocess

import yaml

from tests.helpers import CONFIGS, ROOT


def test_make_clean_removes_what_make_made_and_keeps_the_users_runs(tmp_path):
    made = {"data/digits/train/0/0.png", "runs/quickstart/checkpoints/last.ckpt", "runs/bench-quick/PERFORMANCE.md",
            ".pytest_cache/README.md"}
    yours = {"runs/my_images/checkpoints/last.ckpt", "runs/my_images/config.yaml", "my_images/train/cat/1.jpg"}
    for name in made | yours:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    # `make train` trains the quickstart into its config's run directory: the one `make clean` removes.
    assert yaml.safe_load((CONFIGS / "quickstart.yaml").read_text())["trainer"]["default_root_dir"] == "runs/quickstart"
    proc = subprocess.run(["make", "--no-print-directory", "-f", str(ROOT / "Makefile"), "-C", str(tmp_path), "clean"],
                          capture_output=True, text=True, check=True)
    assert all((tmp_path / name).is_file() for name in yours)
    removed = ["data/digits", "runs/quickstart", "runs/bench-quick", ".pytest_cache"]
    assert not any((tmp_path / folder).exists() for folder in removed)
    assert proc.stdout.splitlines() == [f"removed {folder}" for folder in removed] + ["kept runs/my_images"]
