"""The pictures of README.md and docs/EXPERIMENTS.md, taken of real runs' dashboards in a real browser, and the looks
that tests/test_dashboards.py takes at the same dashboards.

    make pictures        # python -m benchmarks.pictures

trains the quickstart and a short sweep of configs/sweeps/quickstart_lr.yaml under runs/pictures/, opens TensorBoard
and optuna-dashboard on them in headless Chromium (Debian's `chromium` package, driven by Playwright's client: its
own browser download is not used), checks that each view shows what it should (a curve drawn, an image loaded, a
value in a table) and photographs it into docs/pictures/, with pictures.json naming the machine, the commit and the
command that made them. A view that shows nothing raises NothingShown, and nothing is photographed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from training.records.loggers import HP_METRIC

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"  # Debian's package
# What Chromium needs here: root (no sandbox), no GPU, and no traffic of its own on a closed network.
CHROMIUM_FLAGS = ("--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync")
VIEWPORT = {"width": 1280, "height": 800}
CURVES = ("train/loss", "val/acc")  # what a user opens TensorBoard for: the cards that must come first
IMAGES = ("val/confusion_matrix", "val/misclassified")
LINE_PIXELS = 60  # coloured pixels of a chart's canvas that make a drawn line (a 2-pixel line across it: hundreds)


class NothingShown(AssertionError):
    """A dashboard does not show what it should; the message says what is missing, and where."""


def missing() -> str | None:
    """What is missing to open the dashboards in Chromium, in one line; None when nothing is."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the Python package playwright is not installed: pip install -e '.[dev]'"
    if not Path(CHROMIUM).is_file():
        return f"no Chromium at {CHROMIUM}: apt-get install chromium (Debian's package)"
    return None


@contextlib.contextmanager
def chromium() -> Iterator:
    """A headless Chromium page of VIEWPORT's size; the browser closes on exit."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=list(CHROMIUM_FLAGS), headless=True)
        try:
            yield browser.new_page(viewport=VIEWPORT)
        finally:
            browser.close()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(command: list[str], ready: str, log: Path, timeout: float = 120) -> Iterator[str]:
    """Run a dashboard server, yield its address once `ready` (a path of it) answers, stop it (and its children) on
    exit. Its output goes to `log`."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with open(log, "w") as sink:
        proc = subprocess.Popen([*command, "--port", str(port)], stdout=sink, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url + ready, timeout=5) as response:
                    if response.status == 200:
                        break
            if proc.poll() is not None:
                raise RuntimeError(f"{command[0]} exited ({proc.returncode}): {log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{command[0]} did not answer on {url} in {timeout:.0f} s: "
                                   f"{log.read_text()[-2000:]}")
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


@contextlib.contextmanager
def tensorboard(logdir: Path, log: Path, read_s: float = 30) -> Iterator[str]:
    """TensorBoard, as `make dashboard` starts it, on a folder of runs; yields its address once it lists a run, or
    after `read_s` seconds without one."""
    command = [str(Path(sys.executable).parent / "tensorboard"), "--logdir", str(logdir), "--host", "127.0.0.1"]
    with served(command, "data/runs", log) as url:
        deadline = time.monotonic() + read_s  # the first read of the event files: an empty folder never has runs
        while time.monotonic() < deadline:
            with urllib.request.urlopen(url + "data/runs", timeout=5) as response:
                if json.load(response):
                    break
            time.sleep(0.5)
        yield url


@contextlib.contextmanager
def sweep_dashboard(storage: str, log: Path) -> Iterator[str]:
    """optuna-dashboard on a sweep's storage, as `make sweep-dashboard` starts it."""
    with served([sys.executable, "-m", "training.sweeps.dashboard", "--storage", storage], "api/studies", log) as url:
        yield url


def _first(locator, what: str, timeout_s: float, scroll=None):
    """The first element of `locator` once it is there, scrolled into view (or NothingShown); `scroll` is a page whose
    view is scrolled down until it appears, for cards that are drawn only once they come into view."""
    deadline = time.monotonic() + timeout_s
    while not locator.count():
        if time.monotonic() > deadline:
            raise NothingShown(what)
        if scroll is not None:  # over the cards, whose pane scrolls (not the window)
            scroll.mouse.move(VIEWPORT["width"] * 0.6, VIEWPORT["height"] * 0.6)
            scroll.mouse.wheel(0, 300)
        time.sleep(0.25)
    element = locator.first
    element.scroll_into_view_if_needed()
    return element


def coloured_pixels(png: bytes) -> int:
    """Pixels of a chart's screenshot that a line drew: dark or saturated ones (the background is white, the grid
    light grey)."""
    import numpy as np
    from PIL import Image

    rgb = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)
    return int(((rgb.max(axis=2) - rgb.min(axis=2) > 60) | (rgb.mean(axis=2) < 130)).sum())


def look_at_curves(page, url: str, tags=CURVES, timeout_s: float = 60) -> dict[str, dict[str, str]]:
    """TensorBoard as it opens (TIME SERIES): the groups of the `tags` are the first two, open without a click, and
    each tag's card draws a line and shows its runs' values. Returns {tag: {run: the value its table shows}}."""
    page.goto(url)
    _first(page.locator("scalar-card"), f"TensorBoard at {url} shows no scalar card", timeout_s)
    groups = [g.strip() for g in page.locator("span.group-title").all_inner_texts() if g.strip() != "Pinned"]
    wanted = list(dict.fromkeys(tag.split("/")[0] for tag in tags))
    if groups[:len(wanted)] != wanted:
        raise NothingShown(f"TensorBoard at {url} opens with the groups {groups}, not {wanted} first")
    values = {}
    for tag in tags:
        card = _first(page.locator("scalar-card", has=page.locator(f'tb-truncated-path[title="{tag}"]')),
                      f"TensorBoard at {url} shows no card of {tag}", timeout_s, scroll=page)
        rows = card.locator("tb-data-table-content-row")
        _first(rows.filter(has_text=re.compile(r"\d")), f"TensorBoard's card of {tag} shows no value", timeout_s)
        header = [h.strip() for h in card.locator("tb-data-table-header-cell").all_inner_texts()]
        table = [dict(zip(header, (c.strip() for c in row.locator("tb-data-table-content-cell").all_inner_texts()),
                          strict=False)) for row in rows.all()]
        values[tag] = {row["Run"]: row["Value"] for row in table}
        canvas = _first(card.locator("canvas"), f"TensorBoard's card of {tag} draws no chart", timeout_s)
        deadline = time.monotonic() + timeout_s
        while (drawn := coloured_pixels(canvas.screenshot())) < LINE_PIXELS:
            if time.monotonic() > deadline:
                raise NothingShown(f"TensorBoard's card of {tag} draws no line ({drawn} coloured pixels)")
            time.sleep(0.5)
    return values


def scalar_card(page, tag: str):
    """The card of `tag` on TensorBoard's TIME SERIES page (look_at_curves found it)."""
    return page.locator("scalar-card", has=page.locator(f'tb-truncated-path[title="{tag}"]')).first


def look_at_images(page, url: str, tags=IMAGES, timeout_s: float = 60) -> dict[str, tuple[int, int]]:
    """TensorBoard's IMAGES tab: each tag's newest image of every run is loaded. Returns {tag: (width, height)} of
    the first run's."""
    page.goto(url + "#images")
    sizes = {}
    for tag in tags:
        loader = _first(page.locator("tf-image-loader", has_text=tag), f"TensorBoard at {url} shows no image {tag}",
                        timeout_s)
        image = _first(loader.locator("img"), f"TensorBoard's card of {tag} holds no image", timeout_s)
        try:
            page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=image.element_handle(),
                                   timeout=timeout_s * 1000)
        except Exception as error:  # playwright's TimeoutError
            raise NothingShown(f"TensorBoard's image {tag} does not load") from error
        sizes[tag] = tuple(image.evaluate("img => [img.naturalWidth, img.naturalHeight]"))
    return sizes


def look_at_hparams(page, url: str, runs: list[str], timeout_s: float = 60) -> dict[str, str]:
    """TensorBoard's HPARAMS tab: a row for each run, whose last column is the run's HP_METRIC. Returns {run: the
    value shown}."""
    page.goto(url + "#hparams")
    cells = page.locator("vaadin-grid-cell-content")
    _first(cells.filter(has_text=re.compile(f"^\\s*{re.escape(HP_METRIC)}\\s*$")),
           f"TensorBoard at {url} shows no column {HP_METRIC} in HPARAMS", timeout_s)
    for run in runs:
        _first(cells.filter(has_text=re.compile(f"^\\s*{re.escape(run)}\\s*$")),
               f"TensorBoard's HPARAMS at {url} has no row of {run}", timeout_s)
    texts = [t.strip() for t in cells.all_inner_texts()]
    starts = sorted(texts.index(run) for run in runs)
    shown = {}
    for start, end in zip(starts, [*starts[1:], len(texts)], strict=True):
        row = [t for t in texts[start:end] if t]
        shown[row[0]] = row[-1]
    return shown


def look_at_sweep(page, url: str, study: str, timeout_s: float = 60) -> dict[int, str]:
    """optuna-dashboard: the study is listed, its page names the best trial, and its list of trials shows each
    trial's value. Returns {trial number: the value shown}."""
    page.goto(url + "dashboard")
    _first(page.get_by_text(study, exact=False), f"optuna-dashboard at {url} lists no study {study}", timeout_s).click()
    _first(page.get_by_text(re.compile(r"Best Trial \(number=\d+\)")),
           f"optuna-dashboard's study {study} shows no best trial", timeout_s)
    overview = page.url
    page.goto(overview.rstrip("/") + "/trials")
    items = page.locator("li, [role=button]").filter(has_text=re.compile(r"^\s*Trial \d+"))
    _first(items, f"optuna-dashboard's study {study} lists no trial", timeout_s)
    shown = {}
    for number in sorted({int(m) for m in re.findall(r"Trial (\d+)", " ".join(items.all_inner_texts()))}):
        items.filter(has_text=re.compile(rf"^\s*Trial {number}(?!\d)")).first.click()
        heading = _first(page.get_by_text(re.compile(rf"^Trial {number} \(trial_id=\d+\)")),
                         f"optuna-dashboard shows no trial {number}", timeout_s)
        details = heading.locator("xpath=ancestor::*[.//*[normalize-space(text())='Value']][1]")
        value = re.search(r"Value\s+(\S+)", details.inner_text())
        if value is None:
            raise NothingShown(f"optuna-dashboard's trial {number} shows no value")
        shown[number] = value.group(1)
    page.goto(overview)
    return shown


# What `make pictures` trains, from the repository root: the quickstart as `make train` does, and the shipped sweep
# cut to a few trials (W&B offline).
DATA = "data/digits"
SWEEP_FILE = "configs/sweeps/quickstart_lr.yaml"
TRIALS = 4
CAPTIONS = {  # each picture -> what it shows, for pictures.json
    "quickstart_curves.png": "TensorBoard's TIME SERIES, filtered to the quickstart's train/loss and val/acc",
    "quickstart_confusion_matrix.png": "TensorBoard's IMAGES: the quickstart's last confusion matrix",
    "tensorboard.png": "TensorBoard as it opens on the quickstart (TIME SERIES)",
    "tensorboard_misclassified.png": "TensorBoard's IMAGES: the quickstart's most confident mistakes",
    "tensorboard_hparams.png": "TensorBoard's HPARAMS on the sweep's trials, the swept settings ticked",
    "sweep_dashboard.png": "optuna-dashboard on the sweep's storage (make sweep-dashboard)",
}


def save(png: bytes, path: Path) -> None:
    """A screenshot as a PNG of 256 colours at most: a fraction of the size, the same to the eye."""
    from PIL import Image

    with Image.open(io.BytesIO(png)) as image:
        image.convert("RGB").quantize(colors=256, dither=Image.Dither.NONE).save(path, optimize=True)


def shoot_quickstart(page, url: str, out: Path) -> dict:
    """The quickstart's TensorBoard: as it opens, its two curves, its confusion matrix and its mistakes."""
    seen = {"curves": look_at_curves(page, url)}
    page.goto(url)  # as it opens, not scrolled to the cards looked at
    _first(page.locator("scalar-card"), f"TensorBoard at {url} shows no scalar card", 60)
    page.get_by_role("button", name="Settings").click()  # the side pane TensorBoard opens with
    page.wait_for_timeout(3000)
    page.evaluate("() => document.activeElement && document.activeElement.blur()")
    save(page.screenshot(), out / "tensorboard.png")
    page.locator('input[placeholder="Filter tags (regex)"]').fill("^(" + "|".join(CURVES) + ")$")
    page.keyboard.press("Escape")  # the list of matching tags
    cards = _first(page.locator("metrics-filtered-view"), "TensorBoard shows no tags matching the filter", 30)
    page.wait_for_timeout(2000)
    save(cards.screenshot(), out / "quickstart_curves.png")
    seen["images"] = look_at_images(page, url)
    for tag, name in zip(IMAGES, ("quickstart_confusion_matrix.png", "tensorboard_misclassified.png"), strict=True):
        loader = page.locator("tf-image-loader", has_text=tag).first
        loader.locator("img").click()  # TensorBoard's "Toggle actual size": the picture as it was logged
        page.wait_for_timeout(1000)
        save(loader.screenshot(), out / name)
    return seen


def shoot_hparams(page, url: str, runs: list[str], swept: list[str], out: Path) -> dict:
    """HPARAMS on the sweep's trials, with the swept settings as the only columns beside the result."""
    seen = look_at_hparams(page, url, runs)
    request = urllib.request.Request(url + "data/plugin/hparams/experiment", data=b'{"experimentName": ""}',
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        names = [info["name"] for info in json.load(response)["hparamInfos"]]
    boxes = page.locator("paper-checkbox")
    for name in names:  # a setting's box (below it, boxes of its values filter the rows: left alone)
        box = boxes.filter(has_text=re.compile(f"^\\s*{re.escape(name)}\\s*$")).first
        if (box.get_attribute("aria-checked") == "true") != (name in swept):
            box.click()
    boxes.first.scroll_into_view_if_needed()
    page.wait_for_timeout(1500)
    save(page.screenshot(), out / "tensorboard_hparams.png")
    return seen


def run(*args: str) -> None:
    """An `imgcls` command from the repository root, its output shown; W&B offline."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    print("+ imgcls " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "imgcls", *args], cwd=ROOT, env=env, check=True)


def train(runs: Path, trials: int) -> tuple[Path, Path]:
    """The quickstart and the sweep under `runs` (each kept where it has finished): runs/quickstart/quickstart, so
    that TensorBoard on its folder names the run as `make dashboard` does."""
    quickstart, sweep = runs / "quickstart" / "quickstart", runs / "sweep"
    run("demo-data", DATA)
    if not (quickstart / "hparams").is_dir():
        run("fit", "--config", "configs/quickstart.yaml", "--trainer.default_root_dir", str(quickstart))
    if not (sweep / "best.yaml").is_file():
        run("sweep", SWEEP_FILE, "--out", str(sweep), "--trials", str(trials), "--seed", "0")
    return quickstart, sweep


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pictures", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="runs/pictures", help="where the runs are trained (a finished one is kept)")
    parser.add_argument("--out", default="docs/pictures", help="where the pictures and pictures.json go")
    parser.add_argument("--trials", type=int, default=TRIALS, help="trials of the sweep")
    args = parser.parse_args(argv)
    if (problem := missing()) is not None:
        raise SystemExit(f"error: {problem}")
    import optuna
    import yaml

    from benchmarks import common, provenance

    runs, out = ROOT / args.runs, ROOT / args.out
    quickstart, sweep = train(runs, args.trials)
    out.mkdir(parents=True, exist_ok=True)
    study_name = yaml.safe_load((ROOT / SWEEP_FILE).read_text())["name"]
    storage = f"sqlite:///{sweep / 'sweep.db'}"
    trials = sorted(t.name for t in sweep.glob("trial_*") if (t / "hparams").is_dir())
    swept = list(yaml.safe_load((ROOT / SWEEP_FILE).read_text())["parameters"])
    with chromium() as page:
        with tensorboard(quickstart.parent, runs / "tensorboard.log") as url:
            seen = {"quickstart": shoot_quickstart(page, url, out)}
        with tensorboard(sweep, runs / "tensorboard.log") as url:
            seen["hparams"] = shoot_hparams(page, url, [f"{t}/hparams" for t in trials], swept, out)
        with sweep_dashboard(storage, runs / "sweep_dashboard.log") as url:
            seen["sweep"] = look_at_sweep(page, url, study_name)
            page.wait_for_timeout(3000)  # the study's charts
            save(page.screenshot(), out / "sweep_dashboard.png")
    study = optuna.load_study(study_name=study_name, storage=storage)
    record = {"machine": common.machine(),
              "provenance": {**provenance.tree_state(), "command": provenance.command(),
                             "versions": provenance.versions()},
              "runs": {"quickstart": str(quickstart.relative_to(ROOT)), "sweep": str(sweep.relative_to(ROOT)),
                       "sweep_trials": {t.number: t.state.name.lower() for t in study.trials}},
              "pictures": {name: CAPTIONS[name] for name in sorted(CAPTIONS)}, "seen": seen}
    (out / "pictures.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    sizes = {name: (out / name).stat().st_size // 1024 for name in CAPTIONS}
    print(f"{len(sizes)} pictures in {out.relative_to(ROOT)} ({sum(sizes.values())} KiB): "
          + ", ".join(f"{name} {kib} KiB" for name, kib in sizes.items()))


if __name__ == "__main__":
    main()
