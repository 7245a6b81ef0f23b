"""`imgcls report RUN_DIR`: PNG curves and a Markdown summary of a run, from its TensorBoard or CSV logs.

    imgcls report runs/quickstart
    -> runs/quickstart/report/{loss,accuracy,learning_rate}.png and report.md
"""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from dataclasses import KW_ONLY, dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import yaml

from core.command_line import parse_settings

Series = dict[str, list[tuple[int, float]]]  # metric -> [(step, value)], sorted by step

def is_lr(name: str) -> bool:
    """Whether a metric is a learning rate: LearningRateMonitor's tags, named by the model (train/lr/pg1, ...)."""
    return name.startswith("train/lr/")


# (file, title, y label, which metrics) for each plot; a metric goes where its name matches.
PLOTS = (
    ("loss.png", "Loss", "cross-entropy", lambda name: name.endswith("/loss")),
    ("accuracy.png", "Accuracy", "accuracy",
     lambda name: name.split("/")[-1] in ("acc", "acc_top5", "acc_best", "f1_macro")),
    ("learning_rate.png", "Learning rate", "lr", is_lr),
)


def read_tensorboard(run_dir: Path) -> Series:
    """The run's scalars as TensorBoard shows them: its event files read in order as one, a resumed fit's session
    start hiding what an earlier process logged at its steps and later (training/records/loggers.py)."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={SCALARS: 0})  # 0 = keep every point
    acc.Reload()
    return {tag: sorted({e.step: e.value for e in acc.Scalars(tag)}.items()) for tag in acc.Tags()["scalars"]}


def read_csv(run_dir: Path) -> Series:
    series: dict[str, dict[int, float]] = defaultdict(dict)
    with open(run_dir / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            step = int(row["step"])
            for key, value in row.items():
                if key not in ("step", "epoch") and value not in ("", None):
                    series[key][step] = float(value)
    return {tag: sorted(points.items()) for tag, points in series.items()}


def read_run(run_dir: Path) -> Series:
    """Scalars of a run folder: TensorBoard events if there are any, else the CSVLogger's metrics.csv."""
    if list(run_dir.glob("events.out.tfevents.*")):
        return read_tensorboard(run_dir)
    if (run_dir / "metrics.csv").is_file():
        return read_csv(run_dir)
    raise FileNotFoundError(f"{run_dir} holds no TensorBoard events and no metrics.csv; pass a run directory "
                            "(trainer.default_root_dir) of a run logged with the tensorboard or csv logger")


def plot(series: Series, out: Path) -> list[Path]:
    written = []
    for filename, title, ylabel, wanted in PLOTS:
        names = sorted(n for n in series if wanted(n) and series[n])
        if not names:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for name in names:
            steps, values = zip(*series[name], strict=True)
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=name)
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        if filename == "learning_rate.png" and all(v > 0 for n in names for _, v in series[n]):
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / filename, dpi=100)
        plt.close(fig)
        written.append(out / filename)
    return written


def summary(run_dir: Path, series: Series, pngs: list[Path]) -> str:
    lines = [f"# Run report: `{run_dir}`", ""]
    config_path = run_dir / "config.yaml"
    if config_path.is_file():
        config = yaml.safe_load(config_path.read_text())
        model, data, trainer = config.get("model", {}), config.get("data", {}), config.get("trainer", {})
        optimizer = model.get("optimizer") or {}  # class_path and init_args; null: the recipe's SGD
        data = data.get("init_args", data)  # the data source's arguments, under its class_path
        lines += ["| setting | value |", "|---|---|"]
        net = model.get("net") or {}  # class_path and init_args
        net_args = net.get("init_args") or {}
        for key, value in (("model.net", net.get("class_path")), ("model.net.arch", net_args.get("arch")),
                           ("model.net.weights", net_args.get("weights")),
                           ("model.optimizer", optimizer.get("class_path", "torch.optim.SGD")),
                           ("model.optimizer.lr", (optimizer.get("init_args") or {}).get("lr", 0.1)),
                           ("data.root", data.get("root")), ("data.image_size", data.get("image_size")),
                           ("data.batch_size", data.get("batch_size")), ("trainer.devices", trainer.get("devices")),
                           ("trainer.max_epochs", trainer.get("max_epochs"))):
            lines.append(f"| {key} | {value} |")
        lines += ["", f"Rerun: `imgcls fit --config {config_path}`", ""]
    lines += ["## Metrics", "", "| metric | last | best | at step |", "|---|---|---|---|"]
    for name in sorted(series):
        if is_lr(name) or not series[name] or name in ("epoch", "hp_metric"):
            continue
        steps, values = zip(*series[name], strict=True)
        pick = min if "loss" in name else max
        best = pick(range(len(values)), key=lambda i: values[i])
        if not all(math.isfinite(v) for v in values):
            best = len(values) - 1
        lines.append(f"| {name} | {values[-1]:.4f} | {values[best]:.4f} | {steps[best]} |")
    per_class = run_dir / "figures" / "per_class.csv"
    if per_class.is_file():  # written by ValidationFigures at each validation: the last one's
        names = per_class.read_text().splitlines()[0].removeprefix("# rows: ").split(",")
        scores = np.loadtxt(per_class, delimiter=",", ndmin=2)
        lines += ["", "## Per class (last validation)", "", "| class | precision | recall | F1 | support |",
                  "|---|---|---|---|---|"]
        lines += [f"| {name} | {p:.4f} | {r:.4f} | {f:.4f} | {int(n)} |"
                  for name, (p, r, f, n) in zip(names, scores, strict=True)]
    lines += ["", "## Curves", ""] + [f"![{p.stem}]({p.name})" for p in pngs]
    figures = sorted((run_dir / "figures").glob("*.png"))
    if figures:
        lines += ["", "## Last validation", ""] + [f"![{p.stem}](../figures/{p.name})" for p in figures]
    return "\n".join(lines) + "\n"


def report(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    series = read_run(run_dir)
    out = Path(out_dir) if out_dir else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    pngs = plot(series, out)
    path = out / "report.md"
    path.write_text(summary(run_dir, series, pngs))
    return path


@dataclass
class ReportSettings:
    """The settings of `imgcls report`."""

    run_dir: str
    """a run directory (trainer.default_root_dir), e.g. runs/quickstart"""
    _: KW_ONLY
    out: str | None = None
    """output folder (default <run_dir>/report)"""


def main(argv: list[str] | None = None) -> None:
    args = parse_settings(ReportSettings, argv, prog="imgcls report", description=__doc__)
    try:
        path = report(args.run_dir, args.out)
    except FileNotFoundError as err:
        raise SystemExit(f"error: {err}") from None
    print(f"wrote {path} and {len(list(path.parent.glob('*.png')))} PNG curves")


if __name__ == "__main__":
    main()
