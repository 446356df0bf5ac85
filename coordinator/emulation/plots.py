"""The report's plots (PNG, matplotlib's Agg backend).

Every plot keeps its legend outside the axes (never over the data; :func:`_save` returns
whether that holds, tests check it), draws accuracy in percent and rounds on integer
ticks, and gives each bitwidth group and each uplink codec a fixed colour of a
colour-blind-safe palette (Okabe and Ito's, then Tol's) and its own line style and marker,
the same in every report and on the dashboard, so groups stay apart in grey too. Sweep
curves are the mean over seeds with a band of ± one sample SD, one colour and line style
per combination; the labels say how many rounds a figure averages.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

#: Okabe & Ito's colour-blind-safe palette (blue, vermillion, bluish green, orange,
#: reddish purple, sky blue, yellow, black), then Paul Tol's muted one
PALETTE = ["#0072B2", "#D55E00", "#009E73", "#E69F00", "#CC79A7", "#56B4E9", "#F0E442", "#000000",
           "#332288", "#882255", "#44AA99", "#999933", "#AA4499", "#117733", "#88CCEE", "#DDCC77"]
#: a fixed colour, line style and marker per bitwidth group (model variant): neighbours in
#: bitwidth (int6 / int8) differ in hue, style and marker
GROUP_STYLES = {"float32": ("#0072B2", "-", "o"), "int16": ("#009E73", "--", "s"), "int12": ("#56B4E9", "--", "P"),
                "int8": ("#E69F00", "-.", "^"), "int6": ("#CC79A7", ":", "D"), "int4": ("#D55E00", (0, (5, 1)), "v"),
                "int2": ("#000000", (0, (1, 1)), "x")}
GROUP_COLOURS = {g: c for g, (c, _, _) in GROUP_STYLES.items()}
#: a fixed colour and hatch per uplink codec family (``kmeans-4`` -> ``kmeans``)
CODEC_STYLES = {"float32": ("#0072B2", ""), "float16": ("#56B4E9", "//"), "int": ("#E69F00", ""),
                "asym": ("#009E73", "\\\\"), "kmeans": ("#D55E00", "xx"), "lloydmax": ("#CC79A7", ".."),
                "danuq": ("#000000", ""), "ternary": ("#F0E442", "++"), "lut": ("#999933", "--"),
                "affine": ("#882255", "||"), "fused": ("#44AA99", "oo"), "mixed": ("#999999", "")}
CODEC_COLOURS = {c: col for c, (col, _) in CODEC_STYLES.items()}
#: colours and line styles of the combinations of a sweep (in the order of the sweep)
SERIES_COLOURS = PALETTE
_LINESTYLES = ["-", "--", "-.", ":"]
_MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]
_SPARE = PALETTE[8:]


def _spare(name: str) -> str:
    return _SPARE[sum(map(ord, name)) % len(_SPARE)]


def group_colour(group: str) -> str:
    """The fixed colour of a bitwidth group (a spare one, stable by name, for others)."""
    return GROUP_COLOURS.get(group) or _spare(group)


def group_style(group: str) -> tuple[str, Any, str]:
    """``(colour, line style, marker)`` of a bitwidth group."""
    return GROUP_STYLES.get(group) or (_spare(group), _LINESTYLES[sum(map(ord, group)) % 4], "*")


def codec_colour(codec: str) -> str:
    """The fixed colour of an uplink codec (``"kmeans-4"``: the ``kmeans`` family's)."""
    family = codec.split("-")[0]
    return CODEC_COLOURS.get(family) or _spare(family)


def series_style(i: int) -> tuple[str, str, str]:
    """``(colour, line style, marker)`` of a sweep's ``i``-th combination: colour and style
    both change from one to the next, so neighbours differ twice."""
    return SERIES_COLOURS[i % len(SERIES_COLOURS)], _LINESTYLES[i % len(_LINESTYLES)], _MARKERS[i % len(_MARKERS)]


def _round_axis(ax: Any) -> None:
    """Rounds are whole numbers: integer ticks only."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")


def _percent(values: Sequence[float]) -> np.ndarray:
    return 100.0 * np.asarray(values, dtype=float)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run_accuracy(path: Path, records: Sequence[Mapping[str, Any]], curves: Mapping[str, list[float]],
                      title: str, last: int, averaged: str, ylabel: str = "test accuracy") -> bool:
    """Accuracy (%) of each group's model against the round and, for an emulated run, the
    simulated time, in its group's colour and style; the legend to the right, with each
    group's mean over its ``last`` rounds (described by ``averaged``). A run without a
    simulated clock (``fedbit serve``) gets the round panel only. ``ylabel``: what the
    curves are (test or validation accuracy)."""
    plt = _pyplot()
    sim = [r.get("sim_time") for r in records]
    simulated = bool(sim) and all(isinstance(t, int | float) and math.isfinite(t) for t in sim)
    fig, axes = plt.subplots(1, 2 if simulated else 1, figsize=(12 if simulated else 9, 4), squeeze=False,
                             layout="constrained")
    ax_r = axes[0][0]
    rounds = [r["round"] for r in records]
    for g, acc in curves.items():
        tail = [a for a in acc[-last:] if not math.isnan(a)]
        label = f"{g}: {100 * float(np.mean(tail)):.1f}%" if tail else g
        colour, style, marker = group_style(g)
        ax_r.plot(rounds, _percent(acc), marker=marker, linestyle=style, color=colour, label=label)
        if simulated:
            axes[0][1].plot(sim, _percent(acc), marker=marker, linestyle=style, color=colour)
    _round_axis(ax_r)
    if simulated:
        axes[0][1].set_xlabel("simulated time (s)")
    for ax in axes[0]:
        ax.set_ylabel(f"{ylabel} (%)")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    if curves:
        fig.legend(loc="outside right upper", fontsize=8, title=f"mean of {averaged}", title_fontsize=8)
    fig.suptitle(f"{title}: accuracy of each bitwidth group's model")
    return _save(fig, path, 110)


def plot_bytes(path: Path, records: Sequence[Mapping[str, Any]]) -> bool:
    """Uplink bytes per round stacked by codec, each codec in its colour and hatch."""
    plt = _pyplot()
    codecs = sorted({c for r in records for c in r.get("uplink_bytes", {})})
    rounds = np.array([r["round"] for r in records])
    fig, ax = plt.subplots(figsize=(8, 4), layout="constrained")
    bottom = np.zeros(len(records))
    for c in codecs:
        vals = np.array([r.get("uplink_bytes", {}).get(c, 0) for r in records], dtype=float) / 1e3
        ax.bar(rounds, vals, bottom=bottom, label=c, color=codec_colour(c),
               hatch=CODEC_STYLES.get(c.split("-")[0], ("", ""))[1], edgecolor="white", linewidth=0.5)
        bottom += vals
    _round_axis(ax)
    ax.set_ylabel("uplink kB (accepted updates)")
    if codecs:
        fig.legend(loc="outside right upper", fontsize=8, title="codec", title_fontsize=8)
    ax.set_title("uplink bytes per round by codec")
    return _save(fig, path, 110)


def plot_sweep(path: Path, curves: Mapping[str, list[Mapping[str, list[float]]]], groups: Sequence[str],
               figures: Mapping[str, str], averaged: str, ylabel: str = "test accuracy") -> bool:
    """One panel per group (titled neutrally: the colours are the combinations'): per
    combination, the mean accuracy (%) over seeds per round with a band of ± one sample
    SD (two seeds or more), runs that stopped earlier ending earlier; legend to the right,
    each entry with its figures (``figures[label]``: each group's mean ± SD of
    ``averaged``)."""
    plt = _pyplot()
    n = max(1, len(groups))
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n + 3.5, 4), squeeze=False, layout="constrained")
    for ax, g in zip(axes[0], groups, strict=False):
        for i, (label, runs) in enumerate(curves.items()):
            accs = [c[g] for c in runs if c.get(g)]
            if not accs:
                continue
            m = max(len(a) for a in accs)  # runs that stopped earlier end earlier
            arr = _percent([list(a) + [math.nan] * (m - len(a)) for a in accs])
            x = np.arange(1, m + 1)
            with np.errstate(all="ignore"):
                mean = np.nanmean(arr, axis=0)
            colour, style, marker = series_style(i)
            fig_text = figures.get(label, "")
            ax.plot(x, mean, color=colour, linestyle=style, marker=marker, markersize=4,
                    label=(f"{label}: {fig_text}" if fig_text else label) if ax is axes[0][0] else None)
            if len(accs) >= 2:
                with np.errstate(all="ignore"):
                    sd = np.nanstd(arr, axis=0, ddof=1)
                ax.fill_between(x, mean - sd, mean + sd, color=colour, alpha=0.15, linewidth=0)
        ax.set_title(f"{g} model")
        _round_axis(ax)
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"{ylabel} (%), mean over seeds ± SD")
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
