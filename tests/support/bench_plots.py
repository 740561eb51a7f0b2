"""PNG plots of the benchmarks' figures, written beside what they print (matplotlib, headless).

Plots go to `$DYNAMO_BENCH_PLOTS` (the command in docs/operations/benchmarks.md sets it to
docs/img to regenerate the committed ones), else to `dynamo-bench-plots` in the system's temp
folder; each call prints the path it wrote. One function per kind of figure, so every
benchmark's plots look alike.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: files only

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

OURS, BASELINE = "#2e7d32", "#9e9e9e"


def plot_dir() -> Path:
    folder = Path(
        os.environ.get("DYNAMO_BENCH_PLOTS") or Path(tempfile.gettempdir()) / "dynamo-bench-plots"
    )
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _save(figure: Figure, name: str) -> Path:
    path = plot_dir() / f"{name}.png"
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    print(f"  plot: {path}")
    return path


def convergence(points: Sequence[tuple[int, float, float]], name: str) -> Path:
    """Seconds until N DynamoWorkers are Ready, against the floor of N Deployments created
    directly; `points` are (N, operator seconds, floor seconds)."""
    points = sorted(points)
    counts = [n for n, _, _ in points]
    figure, axes = plt.subplots(figsize=(6.4, 4))
    axes.plot(
        counts, [s for _, s, _ in points], "o-", color=OURS, label="operator: DynamoWorkers Ready"
    )
    axes.plot(
        counts,
        [f for _, _, f in points],
        "s--",
        color=BASELINE,
        label="floor: Deployments created directly",
    )
    axes.set_xlabel("DynamoWorkers created at once (1 pod each)")
    axes.set_ylabel("seconds until all are Ready")
    axes.set_title("Operator convergence")
    axes.set_ylim(bottom=0)
    axes.set_xticks(counts)
    axes.grid(alpha=0.3)
    axes.legend()
    return _save(figure, name)


def distribution(seconds: Sequence[float], marks: dict[str, float], title: str, name: str) -> Path:
    """How many of the objects were Ready after each number of seconds (one step per
    object), with `marks` (label: seconds, e.g. baselines measured in the same run) as
    vertical lines."""
    times = sorted(seconds)
    figure, axes = plt.subplots(figsize=(6.4, 4))
    axes.step([0.0, *times], range(len(times) + 1), where="post", color=OURS, linewidth=2,
              label=f"{len(times)} applied at once: Ready so far")  # fmt: skip
    styles = iter(["--", ":", "-.", (0, (5, 1, 1, 1))])
    for label, value in marks.items():
        axes.axvline(
            value, color=BASELINE, linestyle=next(styles, "--"), label=f"{label} ({value:.2f} s)"
        )
    axes.yaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlim(left=0)
    axes.set_ylim(0, len(times) + 0.5)
    axes.set_xlabel("seconds from apply to Ready")
    axes.set_ylabel("Ready")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small", loc="center")
    return _save(figure, name)


def throughput(
    baseline: tuple[str, float], rows: Sequence[tuple[str, float]], title: str, name: str
) -> Path:
    """Tokens/s of each row beside the baseline measured in the same run, with the ratio."""
    labels = [baseline[0], *(label for label, _ in rows)]
    values = [baseline[1], *(value for _, value in rows)]
    figure, axes = plt.subplots(figsize=(6.4, 1.2 + 0.6 * len(labels)))
    bars = axes.barh(labels, values, color=[BASELINE] + [OURS] * len(rows))
    for bar, value in zip(bars[1:], values[1:], strict=True):
        axes.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                  f" {value / baseline[1]:.2f}x", va="center")  # fmt: skip
    axes.invert_yaxis()
    axes.set_xlabel("completion tokens/s")
    axes.set_title(title)
    axes.set_xlim(right=max(values) * 1.18)
    if max(values) >= 10_000:
        axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value / 1000:.0f}k"))
    return _save(figure, name)
