"""PNG charts beside epp-bench's tables (`compare`, `flood`): TTFT distributions (CDF) per target, throughput per
target, and a series over time per target or server. matplotlib comes with the `harness` extra; `pyplot()` is
None without it, and the callers say so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path


def pyplot():
    """matplotlib's pyplot on the file-only backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def cdf(series: Mapping[str, Sequence[float]], path: Path, title: str, xlabel: str = "TTFT (ms)") -> Path:
    """One cumulative distribution line per label (e.g. TTFT per target): the share of requests at or below x."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, values in series.items():
        if not values:
            continue
        ordered = sorted(values)
        shares = [(i + 1) / len(ordered) for i in range(len(ordered))]
        ax.step(ordered, shares, where="post", label=f"{label} ({len(ordered)})")
    ax.set(xlabel=xlabel, ylabel="share of requests", title=title, ylim=(0, 1.01))
    ax.set_xscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(plt, fig, path)


def bars(groups: Mapping[str, Mapping[str, float]], path: Path, title: str, ylabel: str) -> Path:
    """Grouped bars: per group (e.g. a load), one bar per label (e.g. a target)."""
    plt = pyplot()
    labels = list(dict.fromkeys(label for values in groups.values() for label in values))
    width = 0.8 / max(1, len(labels))
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, label in enumerate(labels):
        xs = [g + i * width for g in range(len(groups))]
        ax.bar(xs, [values.get(label, 0.0) for values in groups.values()], width, label=label)
    ax.set_xticks([g + width * (len(labels) - 1) / 2 for g in range(len(groups))], list(groups), fontsize=8)
    ax.set(ylabel=ylabel, title=title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    return _save(plt, fig, path)


def over_time(
    series: Mapping[str, Sequence[float]], step: float, path: Path, title: str, ylabel: str, height: float = 3.0
) -> Path:
    """One line per label of values sampled every `step` seconds (load per server, completions per second)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, height))
    for label, values in series.items():
        ax.plot([step * i for i in range(len(values))], values, label=label)
    ax.set(xlabel="seconds", ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(plt, fig, path)


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
