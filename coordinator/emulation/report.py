"""Reports of emulated runs: plots (PNG), a summary (Markdown), results (JSON).

A run folder (``coordinator.emulation.emulator.Emulator``) holds ``emulation.json`` (config, fleet,
data split, clock) and ``out/metrics.jsonl`` (one record per round). :func:`write_report`
adds to it:

- ``accuracy.png``: the accuracy of each bitwidth group's model (as that group runs it)
  against the round and against the simulated time;
- ``bytes.png``: uplink bytes per round, by codec;
- ``availability.png`` (a run with ``[availability]``): the fraction of each profile's
  devices online against the simulated time;
- ``summary.md``: the configuration, the data split (samples per class per device), the
  final table and where the plots are.

A sweep folder (``fedbit emulate`` with ``[sweep]`` or several seeds) holds one run folder
per combination and seed under ``runs/``; :func:`write_sweep_report` writes
``results.json`` (every run's figures), ``analysis.json`` and a ``summary.md``: per
combination and group, the mean ± sample SD over seeds and the 95 % CI of the mean
(t distribution) of the accuracy averaged over the last ``min(5, rounds)`` rounds (the
labels say how many), on the test split and the validation split; with ``[sweep] tune``
the value chosen on the validation split; with ``[sweep] baseline`` each method's paired
difference to the baseline, seed by seed (:mod:`coordinator.emulation.analysis`);
``accuracy.png`` the mean curves with ± SD bands (:mod:`coordinator.emulation.plots`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from coordinator.emulation.analysis import (
    LAST_ROUNDS,
    Analysis,
    analyse,
    analysis_json,
    averaging_text,
    rounds_averaged,
)
from coordinator.emulation.plots import plot_availability, plot_bytes, plot_run_accuracy, plot_sweep
from coordinator.emulation.stats import estimate
from coordinator.emulation.stopping import stop_summary
from coordinator.ops.dashboard.runview import served_info
from coordinator.ops.export import onnx_summary_lines
from coordinator.ops.rundir import find_run
from edge_client.errors import ConfigError


def load_run(run_dir: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``(emulation info, metrics records)`` of a run folder, emulated or a ``fedbit serve
    --out`` folder (whose info is its job, from ``live.json``, with ``served`` True);
    ConfigError naming what is missing."""
    run = find_run(run_dir)
    if run.coordinator is None:
        raise ConfigError(f"{run.path}: a sweep folder, not one run")
    info_path, metrics_path = run.path / "emulation.json", run.coordinator / "metrics.jsonl"
    if not metrics_path.is_file():
        raise ConfigError(f"{run.path}: no metrics.jsonl yet (no round completed)")
    info = json.loads(info_path.read_text()) if info_path.is_file() else served_info(metrics_path.parent)
    if run.kind == "serve":
        info["served"] = True
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    return info, records


def curve_key(records: Sequence[dict[str, Any]]) -> str:
    """The figure a run's per-round curves show: ``accuracy`` (the test split) when it was
    scored every round, else ``val_accuracy`` (the validation subsample of every round;
    the test split only in the reported rounds: coordinator.evaluate)."""
    def count(key: str) -> int:
        return sum(any(isinstance(g.get(key), int | float) for g in r.get("groups", {}).values()) for r in records)

    return "val_accuracy" if count("val_accuracy") > count("accuracy") else "accuracy"


def group_curves(records: Sequence[dict[str, Any]], key: str = "accuracy") -> dict[str, list[float]]:
    """``{variant: [accuracy per round]}`` (NaN where a round has none); ``key``
    ``val_accuracy``: on the validation split (groups without it are left out)."""
    groups = sorted({g for r in records for g, v in r.get("groups", {}).items() if key in v})
    return {g: [_num(r.get("groups", {}).get(g, {}).get(key)) for r in records] for g in groups}


def to_target(records: Sequence[dict[str, Any]], group: str, target: float) -> tuple[int | None, float | None]:
    """(first round, simulated time at its end) when ``group``'s accuracy reached
    ``target``; (None, None) if it never did."""
    for r in records:
        acc = r.get("groups", {}).get(group, {}).get("accuracy")
        if isinstance(acc, int | float) and acc >= target:
            return int(r["round"]), r.get("sim_time")
    return None, None


def summarize_run(info: dict[str, Any], records: Sequence[dict[str, Any]], last: int = LAST_ROUNDS) -> dict[str, Any]:
    """The figures of one run: per group the final accuracy, ``mean_last`` (the mean over
    the last ``rounds_averaged`` = min(``last``, rounds) rounds; ``val_mean_last`` on the
    validation split when the run held one out) and (with the config's
    ``target_accuracy``) the rounds and simulated seconds to reach it; uplink bytes by
    codec, wall and simulated seconds; ``stop``: the rounds run, the plateau round and
    whether it was still climbing at its end (coordinator.emulation.stopping)."""
    curves = group_curves(records)
    val = group_curves(records, "val_accuracy")
    k = rounds_averaged(len(records), last)
    target = float(info.get("config", {}).get("target_accuracy") or 0.0)
    uplink: dict[str, int] = {}
    for r in records:
        for codec, n in r.get("uplink_bytes", {}).items():
            uplink[codec] = uplink.get(codec, 0) + int(n)
    groups = {}
    for g, c in curves.items():
        v: dict[str, Any] = {"final": c[-1] if c else math.nan, "mean_last": _nanmean(c[-k:])}
        if g in val:
            v["val_mean_last"] = _nanmean(val[g][-k:])
        if target:
            v["rounds_to_target"], v["sim_seconds_to_target"] = to_target(records, g, target)
        groups[g] = v
    return {
        "rounds": len(records),
        "rounds_averaged": k,
        "groups": groups,
        "target_accuracy": target,
        "uplink_bytes": uplink,
        "wall_seconds": info.get("wall_seconds", sum(v for r in records for v in (r.get("round_seconds"),
                                                                                   r.get("wait_seconds"))
                                                     if isinstance(v, int | float) and math.isfinite(v))),
        "sim_seconds": _num(records[-1].get("sim_time")) if records else math.nan,
        "stragglers": sum(int(r.get("stragglers", 0)) for r in records),
        "health": health_summary(records),
        "stop": stop_summary(records, info.get("config", {}).get("stop") or {},
                             (info.get("stop") or {}).get("plateau_round")),
        **privacy_summary(records),
    }


def privacy_summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The run's privacy: the last round's ``epsilon`` at ``delta`` (DP runs) and the
    devices secure aggregation excluded (``{}`` when neither applies)."""
    dp = [r for r in records if r.get("epsilon") is not None]
    excluded = sorted({d for r in records for d in (r.get("secagg_excluded") or {})})
    out: dict[str, Any] = {"epsilon": dp[-1]["epsilon"], "delta": dp[-1].get("delta")} if dp else {}
    if any("secagg_survivors" in r for r in records):
        out["secagg_excluded"] = excluded
    return out


def _privacy_lines(s: dict[str, Any]) -> list[str]:
    lines = []
    if "epsilon" in s:
        lines.append(f"Differential privacy: ε = {s['epsilon']:.3f} at δ = {s['delta']:g} after the last round "
                     "(every round's ε: `metrics.jsonl`).")
    if "secagg_excluded" in s:
        lines.append("Secure aggregation: the coordinator saw only sums; devices excluded: "
                     + (", ".join(s["secagg_excluded"]) or "none") + ".")
    return [*lines, ""] if lines else []


def health_summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The run's training health (``coordinator.health``): per group and layer the live
    units at the first and the last round (``[first, last, units]``), the collapses
    (their reasons, each naming the round and the layer), the rounds rolled back and the
    warnings (live units lost)."""
    with_health = [r["health"] for r in records if r.get("health")]
    if not with_health:
        return {}
    first: dict[str, dict[str, Any]] = {}  # per group, its first and last record (a round
    last: dict[str, dict[str, Any]] = {}  # that scored no group has the float32 one only)
    for h in with_health:
        for g, layers in h.get("groups", {}).items():
            first.setdefault(g, layers)
            last[g] = layers
    live = {g: {name: [int(v.get("live", 0)), int(last[g].get(name, {}).get("live", 0)),
                       int(last[g].get(name, {}).get("units", 0))] for name, v in layers.items()}
            for g, layers in first.items()}
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
    run = find_run(run_dir).path
    info, records = load_run(run)
    s = summarize_run(info, records)
    averaged = averaging_text({(s["rounds_averaged"], s["rounds"])})
    cfg = info.get("config", {})
    served = bool(info.get("served"))
    title = (info.get("title") or f"{run.name}: a `fedbit serve` run") if served \
        else f"{cfg.get('name', run.name)}: seed {info.get('seed', '?')}"
    key = curve_key(records)
    plot_run_accuracy(run / "accuracy.png", records, group_curves(records, key), title, s["rounds_averaged"], averaged,
                      ylabel=CURVE_LABEL[key])
    plot_bytes(run / "bytes.png", records)
    if info.get("availability"):
        plot_availability(run / "availability.png", info["availability"], records)
    simulated = math.isfinite(s["sim_seconds"])
    lines = [f"# {title}", ""]
    made = ("Made by `fedbit serve`" + (" (its job's settings below)" if cfg else " (no live.json: its settings "
                                         "are not known here)")) if served else f"Config: `{info.get('source', '?')}`"
    lines += [f"Run folder: `{run}`. {made}. Plots: `accuracy.png` (accuracy per bitwidth group vs round"
              f"{' and vs simulated time' if simulated else ''}), `bytes.png` (uplink bytes per round by codec).", ""]
    lines += _config_lines(cfg)
    t = s["target_accuracy"]
    has_val = any("val_mean_last" in v for v in s["groups"].values())
    head = f" rounds / simulated s to {100 * t:.0f}% |" if t else ""
    vhead = f" validation, mean of {averaged} |" if has_val else ""
    lines += ["## Result", "", f"| group | final accuracy | mean of {averaged} |{vhead}{head}",
              "|---|---|---|" + ("---|" if has_val else "") + ("---|" if t else "")]
    for g, v in s["groups"].items():
        reach = ""
        if t:
            r, sim = v["rounds_to_target"], v["sim_seconds_to_target"]
            reach = f" {r} / {sim:.1f} |" if r is not None else " not reached |"
        vcell = f" {_pct(v.get('val_mean_last', math.nan))} |" if has_val else ""
        lines.append(f"| {g} | {_pct(v['final'])} | {_pct(v['mean_last'])} |{vcell}{reach}")
    if not served:
        lines += ["", stop_text(s["stop"]) + f" Curves (`accuracy.png`): {CURVE_LABEL[key]}."]
    sim = f" and {s['sim_seconds']:.1f} s of simulated time" if simulated else ""
    lines += ["", f"{s['rounds']} rounds in {s['wall_seconds']:.1f} s of wall time{sim}; {s['stragglers']} "
              "straggler(s) in all.", "",
              *([_workers_line(info), ""] if "workers" in info else []),
              "Uplink bytes by codec: " + ", ".join(f"{k} {v:,}" for k, v in sorted(s["uplink_bytes"].items())), ""]
    lines += _privacy_lines(s)
    lines += _availability_lines(info.get("availability"), records)
    lines += _health_lines(s["health"])
    lines += onnx_summary_lines(run, info.get("onnx"))
    lines += _split_lines(info)
    path = run / "summary.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def write_sweep_report(root: str | Path, runs: Sequence[tuple[dict[str, Any], int, Path]],
                       sweep: dict[str, Any] | None = None) -> Path:
    """``results.json``, ``analysis.json``, ``summary.md`` and ``accuracy.png`` over
    ``runs`` = ``[(combination, seed, run folder)]``; ``sweep``: the config's ``[sweep]``
    (its ``baseline`` and ``tune``; default: as the runs' configs recorded it). Returns
    the summary's path."""
    root = Path(root)
    results = []
    curves: dict[str, list[dict[str, list[float]]]] = {}
    averaging: set[tuple[int, int]] = set()
    target = 0.0
    reach: dict[str, dict[str, list[tuple[int | None, float | None]]]] = {}
    keys: set[str] = set()
    for combo, seed, run in runs:
        info, records = load_run(run)
        if sweep is None:
            sweep = info.get("config", {}).get("sweep") or {}
        s = summarize_run(info, records)
        results.append({"combination": combo, "seed": seed, "run": str(Path(run).relative_to(root)), **s})
        averaging.add((s["rounds_averaged"], s["rounds"]))
        label = combo_label(combo)
        keys.add(curve_key(records))
        curves.setdefault(label, []).append(group_curves(records, curve_key(records)))
        target = s["target_accuracy"] or target
        for g, v in s["groups"].items():
            if target:
                reach.setdefault(label, {}).setdefault(g, []).append(
                    (v.get("rounds_to_target"), v.get("sim_seconds_to_target")))
    a = analyse([(r["combination"], r["seed"], r) for r in results], sweep)
    (root / "results.json").write_text(json.dumps(_clean(results), indent=1))
    (root / "analysis.json").write_text(json.dumps(_clean(analysis_json(a)), indent=1))
    averaged = averaging_text(averaging)
    lines = sweep_lines(a, averaged, len(runs))
    if (root / "tuning.json").is_file():
        lines += tuning_lines(json.loads((root / "tuning.json").read_text()))
    if target:
        lines += ["", f"Rounds / simulated seconds to reach {100 * target:.0f}% accuracy (mean ± SD over the "
                  "seeds that reached it; `k/n`: k of n seeds reached it):", "",
                  "| combination | " + " | ".join(a.groups) + " |", "|---|" + "---|" * len(a.groups)]
        for label, by_group in reach.items():
            cells = []
            for g in a.groups:
                got = by_group.get(g, [])
                cells.append(f"{_reach([r for r, _ in got], '')} rounds / {_reach([t for _, t in got], ' s')}")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    collapsed = [f"{combo_label(r['combination'])}, seed {r['seed']}: round(s) {r['health']['collapse_rounds']}, "
                 f"rolled back {r['health']['rolled_back'] or 'none'}" for r in results if r["health"].get("collapse")]
    lines += ["", "Collapses (coordinator.health): " + ("; ".join(collapsed) if collapsed else "none in any run") + "."]
    path = root / "summary.md"
    path.write_text("\n".join(lines) + "\n")
    figures = {label: ", ".join(f"{g} {_pct_est(r.estimate(g))}" for g in a.groups) for label, r in a.rows.items()}
    plot_sweep(root / "accuracy.png", curves, a.groups, figures, averaged,
               ylabel=" / ".join(CURVE_LABEL[k] for k in sorted(keys)))
    return path


def sweep_lines(a: Analysis, averaged: str, n_runs: int) -> list[str]:
    """The Markdown of a sweep's analysis: every combination, the tuning choices, the
    paired differences to the baseline."""
    groups = a.groups
    lines = [f"# Sweep: {len(a.rows)} combination(s), {n_runs} run(s)", "",
             f"Each figure: the accuracy of a bitwidth group's model (as that group runs it) averaged over "
             f"{averaged}, then over seeds: mean ± sample SD [95% CI of the mean, t distribution]; on the "
             "test split unless marked. `results.json` has every run, `analysis.json` these figures, "
             "`accuracy.png` the mean curves (± SD bands).", "",
             "| combination | seeds | " + " | ".join(groups) + " |", "|---|---|" + "---|" * len(groups)]
    for label, row in a.rows.items():
        lines.append(f"| {label} | {len(row.seeds)} | " + " | ".join(row.estimate(g).text() for g in groups) + " |")
    if any(r.stops for r in a.rows.values()):
        lines += ["", "Stopping (coordinator.emulation.stopping: still climbing = the mean validation accuracy "
                  "of the last rounds of the window above the window before by more than the margin):", "",
                  "| combination | rounds run | plateau at round | still climbing at the end |", "|---|---|---|---|"]
        for label, row in a.rows.items():
            lines.append(f"| {label} | {_span([st['rounds'] for st in row.stops.values()])} | "
                         f"{_span([st['plateau_round'] for st in row.stops.values()])} | "
                         f"{row.climbing_text()} |")
    if any(r.val for r in a.rows.values()):
        lines += ["", f"Validation split (held out of the training data), mean of {averaged}:", "",
                  "| combination | " + " | ".join(groups) + " |", "|---|" + "---|" * len(groups)]
        for label, row in a.rows.items():
            lines.append(f"| {label} | " + " | ".join(row.estimate(g, "val").text() for g in groups) + " |")
    if a.tune:
        note = "chosen on the validation split"
        lines += ["", f"`{a.tune}` {note}, per combination of the other settings (score: mean over seeds "
                  "of the mean over groups); the test figures of the chosen value:", "",
                  f"| combination | {a.tune} (scores) | " + " | ".join(groups) + " |",
                  "|---|---|" + "---|" * len(groups)]
        for rest, (value, scores, _) in a.chosen.items():
            row = a.reported[rest]
            sc = ", ".join(f"{'**' + k + '**' if k == value else k}: {_pct(v)}" for k, v in scores.items())
            lines.append(f"| {rest} | {sc} | " + " | ".join(row.estimate(g).text() for g in groups) + " |")
    for c in a.comparisons:
        dim, val = c.baseline
        lines += ["", f"Paired differences to the baseline `{dim}={val}` (same seed: same data split and "
                  "initial model), in accuracy points: mean ± SD [95% CI]; wins: seeds where the method is "
                  "ahead." + (f" Each side with its own `{a.tune}` choice." if a.tune else ""), "",
                  "| combination | against | " + " | ".join(groups) + " |", "|---|---|" + "---|" * len(groups)]
        for label, d in c.diffs.items():
            lines.append(f"| {label} | {c.partner[label]} | " + " | ".join(d[g].text() for g in groups) + " |")
    return lines


CURVE_LABEL = {"accuracy": "test accuracy", "val_accuracy": "validation accuracy"}


def tuning_lines(t: dict[str, Any]) -> list[str]:
    """What a ``[sweep.tune]`` table tuned (``tuning.json``): per combination the keys, the
    budget, every point's validation score and the point chosen."""
    lines = ["", f"Tuned on seeds {t['seeds']} (never reported; the figures above are of fresh seeds), "
             "each combination with the same budget of settings, each chosen on the validation split "
             "(mean over the tuning seeds of the mean over groups):", "",
             "| combination | tuned | budget | chosen | validation scores |", "|---|---|---|---|---|"]
    for label, c in t["combinations"].items():
        chosen = ", ".join(f"{k}={v}" for k, v in c["chosen"].items())
        scores = "; ".join(f"{k}: {_pct(v)}" for k, v in c["scores"].items())
        lines.append(f"| {label} | {', '.join(c['keys'])} | {c['budget']} | **{chosen}** | {scores} |")
    return lines


def stop_text(stop: dict[str, Any]) -> str:
    """One sentence on how a run stopped."""
    how = (f"Plateau at round {stop['plateau_round']} (validation accuracy), then the reported rounds"
           if stop.get("plateau_round") else f"Ran its {stop['rounds']} rounds")
    flag = {True: "still climbing at the end", False: "not climbing at the end",
            None: "too short to say whether it was still climbing"}[stop.get("climbing")]
    return f"{how}; {flag} (read on the {stop.get('split', 'validation')} curve)."


def _span(values: Sequence[Any]) -> str:
    got = sorted(v for v in values if v is not None)
    if not got:
        return "none"
    lo, hi = got[0], got[-1]
    text = str(lo) if lo == hi else f"{lo}-{hi}"
    return text if len(got) == len(values) else f"{text} ({len(got)} of {len(values)})"


def combo_label(combo: dict[str, Any]) -> str:
    """``strategy=fedshift, data.partition=parity`` (``default`` for no sweep)."""
    return ", ".join(f"{k}={v}" for k, v in combo.items()) or "default"


def mean_std(values: Sequence[float]) -> str:
    """``"87.1 ± 2.3 [84.0, 90.2]"`` in percent: mean ± sample SD [95% CI] (``n/a`` for none)."""
    return estimate(values).text()


# --------------------------------------------------------------------------- text


def _availability_lines(series: dict[str, Any] | None, records: Sequence[dict[str, Any]]) -> list[str]:
    """The summary's availability section: per profile the mean fraction online over the
    run, and what the clock made of it (updates lost to devices going offline)."""
    if not series:
        return []
    lines = ["## Device availability", "", f"Model `{series.get('model')}`, local hour "
             f"{float(series.get('start_hour', 0)):g}:00 at simulated time 0; `availability.png` shows each profile's "
             "devices online against the simulated time.", "", "| profile | devices | mean online | min | max |",
             "|---|---|---|---|---|"]
    for prof, online in sorted(series.get("online", {}).items()):
        n = max(1, int(series.get("devices", {}).get(prof, 1)))
        frac = np.asarray(online, dtype=float) / n
        lines.append(f"| {prof} | {n} | {_pct(float(frac.mean()))} | {_pct(float(frac.min()))} | "
                     f"{_pct(float(frac.max()))} |")
    lost = sum(int(r.get("sim_offline", 0)) + int(r.get("sim_lost", 0)) for r in records)
    waited = sum(float(r.get("sim_wait_seconds", 0.0)) for r in records)
    return [*lines, "", f"Updates lost (device offline before its update arrived, or its request dropped): {lost}; "
            f"simulated seconds waited for devices between rounds: {waited:.1f}.", ""]


def _workers_line(info: dict[str, Any]) -> str:
    """Where the devices trained: workers, backend, this machine's cores."""
    where = (f"Ray actors ({info.get('cluster_cpus', '?')} CPUs on {info.get('nodes', '?')} node(s), "
             f"address `{info.get('address', '?')}`)" if info.get("backend") == "ray"
             else "worker processes" if info.get("processes") else "the emulator's process")
    if info.get("processes_from_round"):
        where += f" from round {info['processes_from_round']} (before: the emulator's process)"
    if info.get("auto"):
        where += " (`round.workers = 0`: auto)"
    lost = f"; {info['workers_lost']} worker(s) lost and replaced" if info.get("workers_lost") else ""
    return (f"Devices trained in {info['workers']} worker(s): {where}; the emulator's machine has "
            f"{info.get('cores', '?')} cores{lost}.")


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
            f"{info.get('train_samples', '?')} training samples on {info.get('fleet_size', len(devices)):,} devices; "
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


def _reach(values: Sequence[float | None], unit: str) -> str:
    got = [float(v) for v in values if v is not None]
    if not got:
        return f"never (0/{len(values)})"
    tail = "" if len(got) == len(values) else f" ({len(got)}/{len(values)})"
    e = estimate(got)
    sd = f" ± {e.sd:.1f}" if e.n > 1 else ""
    return f"{e.mean:.1f}{sd}{unit}{tail}"


def _pct_est(e: Any) -> str:
    return "n/a" if e.n == 0 else f"{100 * e.mean:.1f}" + (f" ± {100 * e.sd:.1f}" if e.n > 1 else "")


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
