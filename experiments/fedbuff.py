"""Buffered against synchronous aggregation on a fleet that comes and goes (experiments/fedbuff.toml).

    python experiments/fedbuff.py [--config experiments/fedbuff.toml] [--out runs/experiments/NAME]
                                  [--resume] [--seeds 0 1] [--tuning-seeds 100 101] [--until S]
                                  [--results DIR | --no-results] [--tuning DIR]
    python experiments/fedbuff.py --analyse RUNS_DIR        # read finished runs again

``NAME`` is the config's ``name`` (``fedbuff``, ``fedbuff-dirichlet``); the results are
``RESULTS/NAME-speedup.*``.

Tuning: every arm of the config's ``@arm`` dimension runs with the tuning seeds (the first
two of the config's seeds, or ``--tuning-seeds``: seeds apart from the reported ones; the
usual sweep, into ``OUT``; its report kept as ``OUT/tuning-summary.md``); per mode
(``sync`` / ``buffered``: 4 settings x 2 seeds each) the arm chosen is the one whose mean
over those seeds of the validation accuracy (the mean over the bitwidth groups, each
group's model as that group runs it) averaged over the last 10 % of the simulated time
budget is highest: the test split is never read for it (``--tuning DIR``: the choice is
made on an earlier invocation's tuning runs in ``DIR``, none run again). Then the two
chosen arms run with every seed (tuning runs with a reported seed kept), and are read
on the simulated clock, per seed:

- **final accuracy**: the test accuracy (mean over groups) averaged over the evaluations
  in the last 10 % of the budget (a round that ends past the budget left out);
- **time to target**: the target is the synchronous run's final accuracy; a run reaches it
  at its first evaluation at or above it (the synchronous run does, within the budget);
- **speed-up**: synchronous time to target / buffered time to target;
- **uplink bytes to target**: accepted update bytes up to that evaluation.

Mean ± sample SD [95 % CI, t distribution] over seeds, and paired differences, go to
``RESULTS/NAME-speedup.md``, ``.json`` and ``.png`` (the chosen arms' mean curves
against the simulated time, ± SD, and the fleet's availability), ``RESULTS`` being
``benchmarks/results/experiments``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = ROOT / "benchmarks" / "results" / "experiments"
CONFIG = HERE / "fedbuff.toml"
#: the share of the time budget the final figures average over
FINAL = 0.1


def curve(run_dir: Path) -> dict[str, list[float]]:
    """One run's evaluations (the rounds or buffers it scored: ``[clock] eval_every_s``):
    simulated time, test and validation accuracy (means over the groups), the accepted
    uplink bytes of every round up to it."""
    recs = [json.loads(line) for line in (run_dir / "out" / "metrics.jsonl").read_text().splitlines() if line]
    out: dict[str, list[float]] = {"time": [], "test": [], "val": [], "bytes": []}
    total = 0
    for r in recs:
        total += sum(int(v) for v in (r.get("uplink_bytes") or {}).values())
        groups = r.get("groups") or {}
        test = [v["accuracy"] for v in groups.values() if isinstance(v.get("accuracy"), int | float)]
        if not test:
            continue
        val = [v["val_accuracy"] for v in groups.values() if isinstance(v.get("val_accuracy"), int | float)]
        out["time"].append(float(r["sim_time"]))
        out["test"].append(sum(test) / len(test))
        out["val"].append(sum(val) / len(val) if val else math.nan)
        out["bytes"].append(float(total))
    return out


def final(c: dict[str, list[float]], key: str, budget: float) -> float:
    """The mean of ``key`` over the evaluations in the last ``FINAL`` of the budget (one
    past it, the end of a round that started before it, left out)."""
    vals = [v for t, v in zip(c["time"], c[key], strict=True)
            if (1 - FINAL) * budget <= t <= budget and not math.isnan(v)]
    return sum(vals) / len(vals) if vals else math.nan


def reach(c: dict[str, list[float]], target: float) -> tuple[float | None, float | None]:
    """(simulated time, uplink bytes) at the first evaluation at or above ``target``;
    (None, None) if never."""
    for t, acc, n in zip(c["time"], c["test"], c["bytes"], strict=True):
        if acc >= target:
            return t, n
    return None, None


def choose(runs: dict[str, dict[int, Path]], modes: dict[str, str], budget: float) -> tuple[dict[str, str],
                                                                                            dict[str, float]]:
    """Per mode, the arm of ``runs`` (arm label -> seed -> run folder) with the best mean
    final validation accuracy; and every arm's score."""
    from coordinator.emulation.stats import estimate

    scores = {arm: estimate([final(curve(d), "val", budget) for d in by_seed.values()]).mean
              for arm, by_seed in runs.items()}
    return {m: max((a for a in runs if modes[a] == m), key=lambda a: scores[a]) for m in ("sync", "buffered")}, scores


def analyse(runs: dict[str, dict[int, Path]], chosen: dict[str, str], scores: dict[str, float],
            budget: float) -> dict[str, Any]:
    """The figures of the module docstring for the ``chosen`` arms' ``runs``."""
    from coordinator.emulation.stats import estimate, paired
    from coordinator.emulation.stopping import STOP_DEFAULTS, climbing

    curves = {arm: {s: curve(d) for s, d in runs[arm].items()} for arm in chosen.values()}
    sync, buf = curves[chosen["sync"]], curves[chosen["buffered"]]
    seeds = sorted(set(sync) & set(buf))
    per_seed = {}
    for s in seeds:
        target = final(sync[s], "test", budget)
        t_s, b_s = reach(sync[s], target)
        t_b, b_b = reach(buf[s], target)
        per_seed[s] = {"target": target, "sync_final": target, "buffered_final": final(buf[s], "test", budget),
                       "sync_time": t_s, "buffered_time": t_b, "sync_bytes": b_s, "buffered_bytes": b_b,
                       "speedup": (t_s / t_b) if t_s and t_b else None,
                       "bytes_ratio": (b_b / b_s) if b_s and b_b else None}
    figs = {k: estimate([v[k] for v in per_seed.values() if v[k] is not None])
            for k in ("sync_final", "buffered_final", "sync_time", "buffered_time", "speedup",
                      "sync_bytes", "buffered_bytes", "bytes_ratio")}
    acc_diff = paired({s: v["buffered_final"] for s, v in per_seed.items()},
                      {s: v["sync_final"] for s, v in per_seed.items()})

    def est(e: Any) -> dict[str, Any]:
        return {"n": e.n, "mean": e.mean, "sd": e.sd, "ci95": [e.lo, e.hi]}

    # runs of a fixed time budget, not to a plateau: flagged when still climbing at the end
    # a run whose bound on rounds (versions) ended it before the budget has no final figures
    ended_early = {mode: [s for s in seeds if not curves[arm][s]["time"]
                          or curves[arm][s]["time"][-1] < (1 - FINAL) * budget] for mode, arm in chosen.items()}
    w, delta = int(STOP_DEFAULTS["window"]), float(STOP_DEFAULTS["min_delta"])
    flags = {mode: [climbing(curves[arm][s]["val"], w, delta) for s in seeds] for mode, arm in chosen.items()}
    still = {mode: sum(f is True for f in fs) for mode, fs in flags.items()}
    still["unknown"] = sum(f is None for fs in flags.values() for f in fs)  # too few scorings to say
    return {"budget_s": budget, "final_share": FINAL, "validation_scores": scores,
            "still_climbing": {**still, "window": w, "min_delta": delta}, "ended_early": ended_early,
            "chosen": chosen, "per_seed": per_seed, "figures": {k: est(e) for k, e in figs.items()},
            "accuracy_difference": {**est(acc_diff.diff), "wins": acc_diff.wins, "losses": acc_diff.losses},
            "reached": {"sync": sum(v["sync_time"] is not None for v in per_seed.values()),
                        "buffered": sum(v["buffered_time"] is not None for v in per_seed.values()),
                        "seeds": len(per_seed)},
            "curves": {arm: curves[arm] for arm in chosen.values()}}


def report(a: dict[str, Any], runs_dir: Path) -> str:
    """The Markdown of :func:`analyse`'s figures."""
    f = a["figures"]

    def pm(key: str, scale: float = 1.0, unit: str = "", digits: int = 1) -> str:
        e = f[key]
        if not e["n"]:
            return "n/a"
        sd = f" ± {scale * e['sd']:.{digits}f}" if e["n"] > 1 else ""
        ci = f" [{scale * e['ci95'][0]:.{digits}f}, {scale * e['ci95'][1]:.{digits}f}]" if e["n"] > 1 else ""
        return f"{scale * e['mean']:.{digits}f}{sd}{ci}{unit} (n = {e['n']})"

    d = a["accuracy_difference"]
    scores = ", ".join(f"{arm}: {100 * s:.2f}%" for arm, s in a["validation_scores"].items())
    lines = [
        "# Buffered (FedBuff) against synchronous FedAvg on a fleet that comes and goes", "",
        f"{a.get('config', 'experiments/fedbuff.toml')}, runs in `{_shown(runs_dir)}` "
        f"(tuning: `{a.get('tuning_runs', _shown(runs_dir))}`, seeds {_seeds(a)}); "
        f"every run {a['budget_s']:g} simulated seconds. "
        + (f"Chosen on the validation split (mean over groups, last {100 * a['final_share']:.0f}% of the time): "
         f"**{a['chosen']['sync']}** and **{a['chosen']['buffered']}** (scores: {scores})."
         if len(a["validation_scores"]) > 2 else
         f"One setting per mode, not tuned at this budget (the config says where it comes from): "
         f"**{a['chosen']['sync']}** and **{a['chosen']['buffered']}** (validation: {scores})."), "",
        "Mean ± sample SD [95% CI of the mean, t distribution] over seeds:", "",
        "| figure | synchronous | buffered |", "|---|---|---|",
        f"| final test accuracy (%), mean over groups, last {100 * a['final_share']:.0f}% of the time | "
        f"{pm('sync_final', 100)} | {pm('buffered_final', 100)} |",
        f"| simulated s to the synchronous run's final accuracy | {pm('sync_time', digits=2)} | "
        f"{pm('buffered_time', digits=2)} |",
        f"| uplink MB (accepted updates) to it | {pm('sync_bytes', 1e-6, digits=2)} | "
        f"{pm('buffered_bytes', 1e-6, digits=2)} |", "",
        f"Speed-up (synchronous time / buffered time, per seed): {pm('speedup', digits=2)}; the target "
        f"reached by {a['reached']['sync']}/{a['reached']['seeds']} synchronous and "
        f"{a['reached']['buffered']}/{a['reached']['seeds']} buffered runs.",
        f"Buffered minus synchronous final accuracy (paired by seed): {100 * d['mean']:+.2f} points "
        f"± {100 * d['sd']:.2f} [{100 * d['ci95'][0]:+.2f}, {100 * d['ci95'][1]:+.2f}], buffered ahead in "
        f"{d['wins']} of {d['n']} seeds.",
        f"Uplink bytes to the target, buffered / synchronous: {pm('bytes_ratio', digits=2)}.",
        f"Still climbing at the end of the budget (validation accuracy: the mean of the last "
        f"{a['still_climbing']['window']} scorings more than {100 * a['still_climbing']['min_delta']:g} points "
        f"above the {a['still_climbing']['window']} before): {a['still_climbing']['sync']}/{a['reached']['seeds']} "
        f"synchronous and {a['still_climbing']['buffered']}/{a['reached']['seeds']} buffered runs "
        + _plateau(a["still_climbing"]), *_early(a), "",
        "| seed | target | sync s | buffered s | speed-up | sync MB | buffered MB | buffered final |",
        "|---|---|---|---|---|---|---|---|"]
    for s, v in a["per_seed"].items():
        def n(x: Any, scale: float = 1.0, digits: int = 2) -> str:
            return "never" if x is None else f"{scale * x:.{digits}f}"
        lines.append(f"| {s} | {100 * v['target']:.2f}% | {n(v['sync_time'])} | {n(v['buffered_time'])} | "
                     f"{n(v['speedup'])} | {n(v['sync_bytes'], 1e-6)} | {n(v['buffered_bytes'], 1e-6)} | "
                     f"{100 * v['buffered_final']:.2f}% |")
    return "\n".join(lines) + "\n"


def plot(a: dict[str, Any], path: Path, availability: dict[str, Any] | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    warnings.filterwarnings("ignore", category=RuntimeWarning)  # (a time before a run's first scoring: NaN)
    fig, axes = plt.subplots(1, 2 if availability else 1, figsize=(13 if availability else 7, 4),
                             squeeze=False, layout="constrained")
    ax = axes[0][0]
    grid = np.linspace(0, a["budget_s"], 121)
    for (mode, arm), colour in zip(a["chosen"].items(), ("#1f77b4", "#d62728"), strict=True):
        runs = a["curves"][arm].values()
        ys = np.array([np.interp(grid, c["time"], c["test"], left=np.nan) for c in runs], dtype=float)
        with np.errstate(all="ignore"):
            m, sd = np.nanmean(ys, axis=0), np.nanstd(ys, axis=0, ddof=1)
        ax.plot(grid, 100 * m, color=colour, label=f"{mode}: {arm} (mean ± SD over seeds)")
        ax.fill_between(grid, 100 * (m - sd), 100 * (m + sd), color=colour, alpha=0.15, linewidth=0)
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("test accuracy (%), mean over groups")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    if availability:
        bx = axes[0][1]
        times = availability["times"]
        for prof, online in sorted(availability["online"].items()):
            bx.plot(times, [x / max(1, availability["devices"][prof]) for x in online], label=prof)
        bx.set_xlabel("simulated time (s)")
        bx.set_ylabel("fraction online (seed 0)")
        bx.set_ylim(-0.03, 1.03)
        bx.grid(alpha=0.3)
        bx.legend(fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plateau(still: dict[str, Any]) -> str:
    """What the climbing counts say about the budget: a cut while climbing, a plateau by
    the rule, or too few scorings to say."""
    if still["sync"] or still["buffered"]:
        return "(a fixed time budget, not a plateau)."
    if still.get("unknown"):
        return f"(too few scorings to say in {still['unknown']} runs)."
    return "(every run at a plateau by that rule at the end of the budget)."


def _early(a: dict[str, Any]) -> list[str]:
    """The report's warning line when a run ended before the last share of the budget (its
    ``rounds`` bound reached first): its final figures are missing."""
    early = {m: v for m, v in (a.get("ended_early") or {}).items() if v}
    if not early:
        return []
    runs = "; ".join(f"{m}: seeds {', '.join(str(s) for s in v)}" for m, v in early.items())
    return [f"**Ended before the budget** (the config's bound on rounds reached first; no final figures): {runs}."]


def _seeds(a: dict[str, Any]) -> str:
    """The tuning seeds as the report names them (a result file written before they were
    recorded: the first two reported seeds, as the script then chose)."""
    seeds = a.get("tuning_seeds") or list(a["per_seed"])[:2]
    reported = {str(s) for s in a["per_seed"]}
    apart = "apart from the reported ones" if not reported & {str(s) for s in seeds} else "among the reported ones"
    return f"{', '.join(str(s) for s in seeds)}: {apart}"


def _shown(path: Path) -> str:
    """``path`` as the report names it: relative to the repository when inside it."""
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(path)


def _clean(o: Any) -> Any:
    """JSON-ready: NaN and infinities -> None, paths -> text."""
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_clean(v) for v in o]
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return str(o) if isinstance(o, Path) else o


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="where the runs go (default runs/experiments/NAME)")
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("--resume", action="store_true", help="keep the runs a killed process finished in --out")
    ap.add_argument("--seeds", type=int, nargs="+", help="(a check) these seeds instead of the config's")
    ap.add_argument("--tuning-seeds", type=int, nargs="+",
                    help="tune on these seeds (default: the first two of the reported seeds)")
    ap.add_argument("--until", type=float, help="(a check) this simulated time budget instead of the config's")
    ap.add_argument("--analyse", type=Path, metavar="RUNS_DIR", help="only read the runs of an earlier invocation")
    ap.add_argument("--results", type=Path, default=RESULTS, help="where NAME-speedup.md/.json/.png go")
    ap.add_argument("--no-results", action="store_true", help="write them next to the runs only")
    ap.add_argument("--tuning", type=Path, metavar="DIR",
                    help="choose on the tuning runs an earlier invocation left in DIR (none run again)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import copy

    from coordinator.emulation.config import expand_sweep, from_dict, load_config, run_slug
    from coordinator.emulation.experiment import run_experiment

    over: dict[str, Any] = {}
    if args.until:
        over["clock.until_s"] = args.until
    cfg = load_config(args.config, over)
    if args.seeds:
        cfg.seeds = list(args.seeds)
    clock = json.loads((RESULTS / "clock.json").read_text())["models"].get(cfg.model) \
        if (RESULTS / "clock.json").is_file() else None
    if clock:  # the experiments' shared compute model (experiments/run_all.py)
        cfg.clock.seconds_per_sample = dict(clock)
    out = args.analyse or args.out or ROOT / "runs" / "experiments" / cfg.name
    stem = f"{cfg.name}-speedup"
    budget = float(cfg.clock.until_s)

    def variant(seeds: list[int], arms: list[str] | None = None) -> Any:
        raw = cfg.as_dict()
        raw["seeds"] = seeds
        if arms is not None:  # (the first of them the baseline of the sweep's own report)
            raw["sweep"]["@arm"] = [v for v in raw["sweep"]["@arm"] if v["label"] in arms]
            raw["sweep"]["baseline"] = arms[0]
        return from_dict(copy.deepcopy(raw), cfg.source)

    def folders(c: Any, base: Path = out) -> tuple[dict[str, dict[int, Path]], dict[str, str]]:
        runs, modes = {}, {}
        for combo, cc in expand_sweep(c):
            arm = str(combo.get("arm"))
            modes[arm] = cc.round.mode
            runs[arm] = {s: base / "runs" / run_slug(combo) / f"seed-{s}" for s in cc.seeds}
        return runs, modes

    tuning_seeds = list(args.tuning_seeds or cfg.seeds[:2])
    tuning = variant(tuning_seeds)
    if not args.analyse and not args.tuning:
        run_experiment(tuning, out, resume=args.resume)
        (out / "tuning-summary.md").write_text((out / "summary.md").read_text())
    chosen, scores = choose(*folders(tuning, args.tuning or out), budget)
    best = variant(cfg.seeds, [chosen["sync"], chosen["buffered"]])
    if not args.analyse:
        run_experiment(best, out, resume=True)  # (the tuning runs of the chosen arms are kept)
    runs = folders(best)[0]
    a = analyse(runs, chosen, scores, budget)
    a["tuning_runs"] = _shown(args.tuning or out)
    a["tuning_seeds"] = tuning_seeds
    a["config"] = _shown(Path(cfg.source))
    av_path = next(iter(runs[chosen["sync"]].values())) / "emulation.json"
    availability = json.loads(av_path.read_text()).get("availability")
    dest = out if args.no_results else args.results
    dest.mkdir(parents=True, exist_ok=True)
    (dest / f"{stem}.md").write_text(report(a, out))
    (dest / f"{stem}.json").write_text(json.dumps(_clean(a), indent=1))
    plot(a, dest / f"{stem}.png", availability)
    print((dest / f"{stem}.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
