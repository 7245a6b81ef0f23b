"""Chromium from Debian's packages, for the tests that open the dashboards in a real browser (benchmarks/pictures.py
drives it through Playwright's client; Playwright's own browser download is not used), installed the way
tests/postgres.py installs PostgreSQL."""

from __future__ import annotations

from pathlib import Path

from benchmarks.pictures import CHROMIUM, missing
from tests.helpers import apt_install, service_unavailable

PACKAGES = ("chromium",)  # Debian's: the browser, at /usr/bin/chromium


def ensure_installed() -> None:
    """Install Debian's Chromium where none is, before a test that uses it; where that cannot be, or the Python
    package playwright is missing, the test is skipped naming why (under CI=true it fails)."""
    if not Path(CHROMIUM).is_file():
        apt_install(PACKAGES, "Chromium is not installed")
    if (problem := missing()) is not None:
        service_unavailable(problem)
