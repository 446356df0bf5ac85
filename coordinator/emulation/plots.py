"""The report's plots (PNG, matplotlib's Agg backend).

Every plot keeps its legend outside the axes (never over the data), gives each bitwidth
group and each uplink codec a fixed colour (the same in every report: float32 is always
the same blue), and returns whether its legends stay clear of the axes (tests check it), draws sweep curves as the mean over seeds with a band of ± one sample SD,
and says in its labels how many rounds a figure averages.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

#: a fixed colour per bitwidth group (model variant)
GROUP_COLOURS = {"float32": "#1f77b4", "int16": "#2ca02c", "int8": "#ff7f0e", "int6": "#d62728",
                 "int4": "#9467bd", "int2": "#8c564b"}
#: a fixed colour per uplink codec family (``kmeans-4`` -> ``kmeans``)
CODEC_COLOURS = {"float32": "#1f77b4", "float16": "#17becf", "int": "#ff7f0e", "asym": "#2ca02c",
                 "kmeans": "#d62728", "lloydmax": "#9467bd", "danuq": "#8c564b", "ternary": "#e377c2",
                 "lut": "#7f7f7f", "affine": "#bcbd22", "fused": "#aec7e8"}
#: colours of the combinations of a sweep (in the order of the sweep)
SERIES_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
                  "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39",
                  "#7b4173", "#3182bd", "#e6550d", "#31a354", "#756bb1", "#636363"]
_SPARE = ["#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173"]
_LINESTYLES = ["-", "--", ":", "-."]


def group_colour(group: str) -> str:
    """The fixed colour of a bitwidth group (a spare one, stable by name, for others)."""
    return GROUP_COLOURS.get(group, _SPARE[sum(map(ord, group)) % len(_SPARE)])


def codec_colour(codec: str) -> str:
    """The fixed colour of an uplink codec (``"kmeans-4"``: the ``kmeans`` family's)."""
    family = codec.split("-")[0]
    return CODEC_COLOURS.get(family, _SPARE[sum(map(ord, family)) % len(_SPARE)])


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run_accuracy(path: Path, records: Sequence[Mapping[str, Any]], curves: Mapping[str, list[float]],
                      title: str, last: int, averaged: str) -> bool:
    """Accuracy of each group's model against the round and the simulated time, in its
    group's colour; the legend to the right, with each group's mean over its ``last``
    rounds (described by ``averaged``)."""
    plt = _pyplot()
    fig, (ax_r, ax_t) = plt.subplots(1, 2, figsize=(12, 4), layout="constrained")
    rounds = [r["round"] for r in records]
    sim = [r.get("sim_time", math.nan) for r in records]
    for g, acc in curves.items():
        tail = [a for a in acc[-last:] if not math.isnan(a)]
        label = f"{g}: {100 * float(np.mean(tail)):.1f}%" if tail else g
        ax_r.plot(rounds, acc, marker=".", color=group_colour(g), label=label)
        ax_t.plot(sim, acc, marker=".", color=group_colour(g))
    ax_r.set_xlabel("round")
    ax_t.set_xlabel("simulated time (s)")
    for ax in (ax_r, ax_t):
        ax.set_ylabel("test accuracy")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    if curves:
        fig.legend(loc="outside right upper", fontsize=8, title=f"mean of {averaged}", title_fontsize=8)
    fig.suptitle(f"{title}: accuracy of each bitwidth group's model")
    return _save(fig, path, 110)


def plot_bytes(path: Path, records: Sequence[Mapping[str, Any]]) -> bool:
    """Uplink bytes per round stacked by codec, each codec in its colour."""
    plt = _pyplot()
    codecs = sorted({c for r in records for c in r.get("uplink_bytes", {})})
    rounds = np.array([r["round"] for r in records])
    fig, ax = plt.subplots(figsize=(8, 4), layout="constrained")
    bottom = np.zeros(len(records))
    for c in codecs:
        vals = np.array([r.get("uplink_bytes", {}).get(c, 0) for r in records], dtype=float) / 1e3
        ax.bar(rounds, vals, bottom=bottom, label=c, color=codec_colour(c))
        bottom += vals
    ax.set_xlabel("round")
    ax.set_ylabel("uplink kB (accepted updates)")
    if codecs:
        fig.legend(loc="outside right upper", fontsize=8, title="codec", title_fontsize=8)
    ax.set_title("uplink bytes per round by codec")
    return _save(fig, path, 110)


def plot_sweep(path: Path, curves: Mapping[str, list[Mapping[str, list[float]]]], groups: Sequence[str],
               figures: Mapping[str, str], averaged: str) -> bool:
    """One panel per group: per combination, the mean accuracy over seeds per round with a
    band of ± one sample SD (two seeds or more); legend to the right, each entry with its
    figures (``figures[label]``: each group's mean ± SD of ``averaged``)."""
    plt = _pyplot()
    n = max(1, len(groups))
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n + 3.5, 4), squeeze=False, layout="constrained")
    for ax, g in zip(axes[0], groups, strict=False):
        for i, (label, runs) in enumerate(curves.items()):
            accs = [c[g] for c in runs if c.get(g)]
            if not accs:
                continue
            m = min(len(a) for a in accs)
            arr = np.array([a[:m] for a in accs], dtype=float)
            x = np.arange(1, m + 1)
            with np.errstate(all="ignore"):
                mean = np.nanmean(arr, axis=0)
            colour = SERIES_COLOURS[i % len(SERIES_COLOURS)]
            style = _LINESTYLES[(i // len(SERIES_COLOURS)) % len(_LINESTYLES)]
            fig_text = figures.get(label, "")
            ax.plot(x, mean, color=colour, linestyle=style,
                    label=(f"{label}: {fig_text}" if fig_text else label) if ax is axes[0][0] else None)
            if len(accs) >= 2:
                with np.errstate(all="ignore"):
                    sd = np.nanstd(arr, axis=0, ddof=1)
                ax.fill_between(x, mean - sd, mean + sd, color=colour, alpha=0.15, linewidth=0)
        ax.set_title(g, color=group_colour(g))
        ax.set_xlabel("round")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy (mean over seeds ± SD)")
    if curves:
        fig.legend(loc="outside right upper", fontsize=7,
                   title=f"accuracy (%), mean ± SD over seeds of {averaged}", title_fontsize=7)
    return _save(fig, path, 100)

def plot_availability(path: Path, series: Mapping[str, Any], records: Sequence[Mapping[str, Any]] = ()) -> bool:
    """The fraction of each profile's devices online against the simulated time (and the
    local hour), from ``emulation.json``'s ``availability``; ticks below mark when each
    round (version) ended."""
    plt = _pyplot()
    times = np.asarray(series.get("times", []), dtype=float)
    fig, ax = plt.subplots(figsize=(9, 3.6), layout="constrained")
    for i, (prof, online) in enumerate(sorted(series.get("online", {}).items())):
        n = max(1, int(series.get("devices", {}).get(prof, 1)))
        ax.plot(times, np.asarray(online, dtype=float) / n, color=SERIES_COLOURS[i % len(SERIES_COLOURS)],
                label=f"{prof} ({n})")
    ends = [r.get("sim_time") for r in records if isinstance(r.get("sim_time"), int | float)]
    if ends:
        ax.plot(ends, [0.0] * len(ends), "|", color="#555555", markersize=8, label="round / version end")
    ax.set_xlabel(f"simulated time (s; local hour {float(series.get('start_hour', 0)):g}:00 at 0)")
    ax.set_ylabel("fraction online")
    ax.set_ylim(-0.03, 1.03)
    ax.grid(alpha=0.3)
    fig.legend(loc="outside right upper", fontsize=8, title=f"availability: {series.get('model', '?')}",
               title_fontsize=8)
    return _save(fig, path, 110)


def _save(fig: Any, path: Path, dpi: int) -> bool:
    """Write the figure; returns whether every legend stays clear of every axes (the
    plots' promise: no legend over the data)."""
    fig.savefig(path, dpi=dpi)
    renderer = fig.canvas.get_renderer()
    boxes = [ax.get_window_extent(renderer) for ax in fig.axes]
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    clear = not any(leg.get_window_extent(renderer).overlaps(b) for leg in legends for b in boxes)
    _pyplot().close(fig)
    return clear
