"""Reports of emulated runs: plots (PNG), a summary (Markdown), results (JSON).

A run folder (``coordinator.emulation.run.Emulator``) holds ``emulation.json`` (config, fleet,
data split, clock) and ``out/metrics.jsonl`` (one record per round). :func:`write_report`
adds to it:

- ``accuracy.png``: the accuracy of each bitwidth group's model (as that group runs it)
  against the round and against the simulated time;
- ``bytes.png``: uplink bytes per round, by codec;
- ``summary.md``: the configuration, the data split (samples per class per device), the
  final table and where the plots are.

A sweep folder (``fedbit emulate`` with ``[sweep]`` or several seeds) holds one run folder
per combination and seed under ``runs/``; :func:`write_sweep_report` writes
``results.json`` and a ``summary.md`` with mean ± std over seeds of each group's accuracy
averaged over the last ``LAST_ROUNDS`` rounds, and ``accuracy.png`` with the mean curves.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edge_client.errors import ConfigError

LAST_ROUNDS = 5


def load_run(run_dir: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``(emulation info, metrics records)`` of a run folder (ConfigError naming what is
    missing)."""
    run = Path(run_dir)
    info_path, metrics_path = run / "emulation.json", run / "out" / "metrics.jsonl"
    if not metrics_path.is_file():
        raise ConfigError(f"{run}: not a run folder (no out/metrics.jsonl)")
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    return info, records


def group_curves(records: Sequence[dict[str, Any]]) -> dict[str, list[float]]:
    """``{variant: [accuracy per round]}`` (NaN where a round has none)."""
    groups = sorted({g for r in records for g in r.get("groups", {})})
    return {g: [_num(r.get("groups", {}).get(g, {}).get("accuracy")) for r in records] for g in groups}


def to_target(records: Sequence[dict[str, Any]], group: str, target: float) -> tuple[int | None, float | None]:
    """(first round, simulated time at its end) when ``group``'s accuracy reached
    ``target``; (None, None) if it never did."""
    for r in records:
        acc = r.get("groups", {}).get(group, {}).get("accuracy")
        if isinstance(acc, int | float) and acc >= target:
            return int(r["round"]), r.get("sim_time")
    return None, None


def summarize_run(info: dict[str, Any], records: Sequence[dict[str, Any]], last: int = LAST_ROUNDS) -> dict[str, Any]:
    """The figures of one run: per group the final accuracy, the mean of the last ``last``
    rounds and (with the config's ``target_accuracy``) the rounds and simulated seconds to
    reach it; uplink bytes by codec, wall and simulated seconds."""
    curves = group_curves(records)
    target = float(info.get("config", {}).get("target_accuracy") or 0.0)
    uplink: dict[str, int] = {}
    for r in records:
        for codec, n in r.get("uplink_bytes", {}).items():
            uplink[codec] = uplink.get(codec, 0) + int(n)
    return {
        "rounds": len(records),
        "groups": {g: {"final": c[-1] if c else math.nan, f"last{last}": _nanmean(c[-last:]),
                       **(dict(zip(("rounds_to_target", "sim_seconds_to_target"), to_target(records, g, target),
                                   strict=True)) if target else {})}
                   for g, c in curves.items()},
        "target_accuracy": target,
        "uplink_bytes": uplink,
        "wall_seconds": info.get("wall_seconds", sum(r.get("round_seconds", 0.0) for r in records)),
        "sim_seconds": records[-1].get("sim_time", math.nan) if records else math.nan,
        "stragglers": sum(int(r.get("stragglers", 0)) for r in records),
        "health": health_summary(records),
    }


def health_summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The run's training health (``coordinator.health``): per group and layer the live
    units at the first and the last round (``[first, last, units]``), the collapses
    (their reasons, each naming the round and the layer), the rounds rolled back and the
    warnings (live units lost)."""
    with_health = [r["health"] for r in records if r.get("health")]
    if not with_health:
        return {}
    live: dict[str, dict[str, list[int]]] = {}
    for h in (with_health[0], with_health[-1]):
        for g, layers in h.get("groups", {}).items():
            for name, v in layers.items():
                live.setdefault(g, {}).setdefault(name, []).append(int(v.get("live", 0)))
    for g, layers in live.items():
        for name, v in layers.items():
            v.append(int(with_health[-1]["groups"].get(g, {}).get(name, {}).get("units", 0)))
    return {"live": live, "collapse": [c for h in with_health for c in h.get("collapse", [])],
            "collapse_rounds": [int(r["round"]) for r in records if (r.get("health") or {}).get("collapse")],
            "rolled_back": [int(r["round"]) for r in records if (r.get("health") or {}).get("rolled_back")],
            "warnings": sum(len(h.get("warnings", [])) for h in with_health)}


def _health_lines(h: dict[str, Any]) -> list[str]:
    """The summary's training-health section."""
    if not h:
        return []
    lines = ["## Training health", "", "Live units (can still output a positive value; output layer: any value) "
             "per layer after the first and the last round, of each group's model as that group runs it:", "",
             "| group | " + " | ".join(next(iter(h["live"].values()))) + " |",
             "|---|" + "---|" * len(next(iter(h["live"].values())))]
    for g, layers in sorted(h["live"].items()):
        lines.append(f"| {g} | " + " | ".join(f"{a} -> {b} of {n}" for a, b, n in layers.values()) + " |")
    lines.append("")
    if h["collapse"]:
        lines += [f"**Collapse** in round(s) {h['collapse_rounds']}; rolled back: "
                  f"{h['rolled_back'] or 'none'}:", ""] + [f"- {c}" for c in h["collapse"]] + [""]
    else:
        lines += ["No collapse.", ""]
    lines += [f"{h['warnings']} warning(s) of lost live units (the metrics' `health.warnings`).", ""]
    return lines


def write_report(run_dir: str | Path) -> Path:
    """Plots and ``summary.md`` for one run folder; returns the summary's path."""
    run = Path(run_dir)
    info, records = load_run(run)
    _plot_accuracy(run / "accuracy.png", {"": records}, info.get("config", {}).get("name", run.name))
    _plot_bytes(run / "bytes.png", records)
    s = summarize_run(info, records)
    cfg = info.get("config", {})
    lines = [f"# {cfg.get('name', run.name)}: seed {info.get('seed', '?')}", ""]
    lines += [f"Run folder: `{run}`. Config: `{info.get('source', '?')}`. Plots: `accuracy.png` (accuracy per "
              "bitwidth group vs round and vs simulated time), `bytes.png` (uplink bytes per round by codec).", ""]
    lines += _config_lines(cfg)
    t = s["target_accuracy"]
    head = f" rounds / simulated s to {100 * t:.0f}% |" if t else ""
    lines += ["## Result", "", f"| group | final accuracy | mean of the last {LAST_ROUNDS} rounds |{head}",
              "|---|---|---|" + ("---|" if t else "")]
    for g, v in s["groups"].items():
        reach = ""
        if t:
            r, sim = v["rounds_to_target"], v["sim_seconds_to_target"]
            reach = f" {r} / {sim:.1f} |" if r is not None else " not reached |"
        lines.append(f"| {g} | {_pct(v['final'])} | {_pct(v[f'last{LAST_ROUNDS}'])} |{reach}")
    lines += ["", f"{s['rounds']} rounds in {s['wall_seconds']:.1f} s of wall time and "
              f"{s['sim_seconds']:.1f} s of simulated time; {s['stragglers']} straggler(s) in all.", "",
              "Uplink bytes by codec: " + ", ".join(f"{k} {v:,}" for k, v in sorted(s["uplink_bytes"].items())), ""]
    lines += _health_lines(s["health"])
    lines += _split_lines(info)
    path = run / "summary.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def write_sweep_report(root: str | Path, runs: Sequence[tuple[dict[str, Any], int, Path]]) -> Path:
    """``results.json``, ``summary.md`` and ``accuracy.png`` over ``runs`` =
    ``[(combination, seed, run folder)]``; returns the summary's path."""
    root = Path(root)
    rows: dict[str, dict[str, Any]] = {}
    curves: dict[str, list[list[dict[str, Any]]]] = {}
    results = []
    target = 0.0
    for combo, seed, run in runs:
        info, records = load_run(run)
        label = combo_label(combo)
        s = summarize_run(info, records)
        results.append({"combination": combo, "seed": seed, "run": str(run.relative_to(root)), **s})
        row = rows.setdefault(label, {"combination": combo, "seeds": [], "groups": {}, "rounds": {}, "sim": {}})
        row["seeds"].append(seed)
        target = s["target_accuracy"] or target
        for g, v in s["groups"].items():
            row["groups"].setdefault(g, []).append(v[f"last{LAST_ROUNDS}"])
            if target:
                row["rounds"].setdefault(g, []).append(v["rounds_to_target"])
                row["sim"].setdefault(g, []).append(v["sim_seconds_to_target"])
        curves.setdefault(label, []).append(records)
    (root / "results.json").write_text(json.dumps(_clean(results), indent=1))
    groups = sorted({g for r in rows.values() for g in r["groups"]})
    lines = [f"# Sweep: {len(rows)} combination(s) x seeds", "",
             f"Each cell: mean ± std over seeds of the accuracy averaged over the last {LAST_ROUNDS} rounds "
             "(each group's model as that group runs it). `results.json` has every run; `accuracy.png` the "
             "mean curves.", "",
             "| combination | seeds | " + " | ".join(groups) + " |", "|---|---|" + "---|" * len(groups)]
    for label, row in rows.items():
        cells = [mean_std(row["groups"].get(g, [])) for g in groups]
        lines.append(f"| {label} | {len(row['seeds'])} | " + " | ".join(cells) + " |")
    if target:
        lines += ["", f"Rounds / simulated seconds to reach {100 * target:.0f}% accuracy (mean ± std over the "
                  "seeds that reached it; `k/n`: k of n seeds reached it):", "",
                  "| combination | " + " | ".join(groups) + " |", "|---|" + "---|" * len(groups)]
        for label, row in rows.items():
            cells = [f"{_reach(row['rounds'].get(g, []), 1.0, '')} rounds / {_reach(row['sim'].get(g, []), 1.0, ' s')}"
                     for g in groups]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    collapsed = [f"{combo_label(r['combination'])}, seed {r['seed']}: round(s) {r['health']['collapse_rounds']}, "
                 f"rolled back {r['health']['rolled_back'] or 'none'}" for r in results if r["health"].get("collapse")]
    lines += ["", "Collapses (coordinator.health): " + ("; ".join(collapsed) if collapsed else "none in any run") + "."]
    path = root / "summary.md"
    path.write_text("\n".join(lines) + "\n")
    _plot_sweep(root / "accuracy.png", curves)
    return path


def combo_label(combo: dict[str, Any]) -> str:
    """``strategy=fedshift, data.partition=parity`` (``default`` for no sweep)."""
    return ", ".join(f"{k}={v}" for k, v in combo.items()) or "default"


def mean_std(values: Sequence[float]) -> str:
    """``"87.1 ± 2.3"`` in percent (``n/a`` for none)."""
    v = [x for x in values if not math.isnan(x)]
    if not v:
        return "n/a"
    return f"{100 * float(np.mean(v)):.1f} ± {100 * float(np.std(v)):.1f}"


# --------------------------------------------------------------------------- plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_accuracy(path: Path, runs: dict[str, list[dict[str, Any]]], title: str) -> None:
    plt = _pyplot()
    fig, (ax_r, ax_t) = plt.subplots(1, 2, figsize=(11, 4))
    for label, records in runs.items():
        rounds = [r["round"] for r in records]
        sim = [r.get("sim_time", math.nan) for r in records]
        for g, acc in group_curves(records).items():
            name = f"{label} {g}".strip()
            ax_r.plot(rounds, acc, marker=".", label=name)
            ax_t.plot(sim, acc, marker=".", label=name)
    ax_r.set_xlabel("round")
    ax_t.set_xlabel("simulated time (s)")
    for ax in (ax_r, ax_t):
        ax.set_ylabel("test accuracy")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    ax_r.legend(fontsize=8)
    fig.suptitle(f"{title}: accuracy of each bitwidth group's model")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_bytes(path: Path, records: Sequence[dict[str, Any]]) -> None:
    plt = _pyplot()
    codecs = sorted({c for r in records for c in r.get("uplink_bytes", {})})
    rounds = np.array([r["round"] for r in records])
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = np.zeros(len(records))
    for c in codecs:
        vals = np.array([r.get("uplink_bytes", {}).get(c, 0) for r in records], dtype=float) / 1e3
        ax.bar(rounds, vals, bottom=bottom, label=c)
        bottom += vals
    ax.set_xlabel("round")
    ax.set_ylabel("uplink kB (accepted updates)")
    ax.legend(fontsize=8)
    ax.set_title("uplink bytes per round by codec")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_sweep(path: Path, curves: dict[str, list[list[dict[str, Any]]]]) -> None:
    plt = _pyplot()
    groups = sorted({g for runs in curves.values() for rec in runs for g in group_curves(rec)})
    fig, axes = plt.subplots(1, max(1, len(groups)), figsize=(4.5 * max(1, len(groups)), 4), squeeze=False)
    for ax, g in zip(axes[0], groups, strict=False):
        for label, runs in curves.items():
            accs = [group_curves(rec).get(g) for rec in runs]
            accs = [a for a in accs if a]
            if not accs:
                continue
            n = min(len(a) for a in accs)
            m = np.nanmean(np.array([a[:n] for a in accs]), axis=0)
            ax.plot(np.arange(1, n + 1), m, label=label)
        ax.set_title(g)
        ax.set_xlabel("round")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy (mean over seeds)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --------------------------------------------------------------------------- text


def _config_lines(cfg: dict[str, Any]) -> list[str]:
    if not cfg:
        return []
    out = ["## Configuration", "", "| key | value |", "|---|---|"]
    for k, v in cfg.items():
        if isinstance(v, dict):
            for kk, vv in v.items():
                out.append(f"| {k}.{kk} | `{vv}` |")
        else:
            out.append(f"| {k} | `{v}` |")
    return [*out, ""]


def _split_lines(info: dict[str, Any], limit: int = 40) -> list[str]:
    devices = info.get("devices", [])
    if not devices:
        return []
    profiles = info.get("profiles", {})
    out = ["## Fleet", "", "| profile | devices | compute | trainer | uplink | kbps up | latency ms | loss | speed |",
           "|---|---|---|---|---|---|---|---|---|"]
    for name, p in profiles.items():
        out.append(f"| {name} | {p['count']} | {p['compute_bits']} | {p['trainer']} | {p['codec']}-{p['codec_bits']} | "
                   f"{p['uplink_kbps']:g} | {p['latency_ms']:g} | {p['loss_rate']:g} | {p['relative_speed']:g} |")
    sps = info.get("seconds_per_sample", {})
    out += ["", "Compute model, seconds per training sample on this machine (divided by a profile's speed): "
            + ", ".join(f"{k} {v:.3g}" + (" (measured)" if k in info.get("calibrated", []) else " (pinned)")
                        for k, v in sorted(sps.items())), ""]
    d = info.get("config", {}).get("data", {})
    out += [f"## Data split: {info.get('dataset', '?')}, partition `{d.get('partition', '?')}`", "",
            f"{info.get('train_samples', '?')} training samples on {len(devices)} devices; "
            f"{info.get('test_samples', '?')} held out. Samples per class:", ""]
    k = len(devices[0]["class_counts"])
    out += ["| device | codec | " + " | ".join(str(c) for c in range(k)) + " | total |",
            "|---|---|" + "---|" * (k + 1)]
    for dev in devices[:limit]:
        out.append(f"| {dev['id']} | {dev['codec']} | " + " | ".join(str(c) for c in dev["class_counts"])
                   + f" | {dev['samples']} |")
    if len(devices) > limit:
        out.append(f"| ... {len(devices) - limit} more | | " + " | " * k + " |")
    return [*out, ""]


def _reach(values: Sequence[float | None], scale: float, unit: str) -> str:
    got = [float(v) for v in values if v is not None]
    if not got:
        return f"never (0/{len(values)})"
    tail = "" if len(got) == len(values) else f" ({len(got)}/{len(values)})"
    return f"{scale * np.mean(got):.1f} ± {scale * np.std(got):.1f}{unit}{tail}"


def _num(v: Any) -> float:
    return float(v) if isinstance(v, int | float) and v is not None else math.nan


def _nanmean(v: Sequence[float]) -> float:
    vals = [x for x in v if not math.isnan(x)]
    return float(np.mean(vals)) if vals else math.nan


def _pct(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{100 * v:.1f}%"


def _clean(o: Any) -> Any:
    """JSON-ready: NaN -> None, numpy scalars -> Python numbers."""
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_clean(v) for v in o]
    if isinstance(o, np.generic):
        o = o.item()
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return o
