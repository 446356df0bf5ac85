"""Run the papers' experiments on the emulator (``make experiments [ONLY=name ...]``).

    python experiments/run_all.py [--out runs/experiments] [--quick | --estimate R] [NAME ...]

Runs every ``experiments/<name>.toml`` (or the named ones) with every sweep combination
and seed, then copies each sweep's ``summary.md``, ``results.json``, ``analysis.json`` and
``accuracy.png`` to ``benchmarks/results/experiments/<name>.*`` (docs/experiments.md quotes them).

The ``fmnist-*`` configs are the experiments (Fashion-MNIST, >= 5 seeds, hours); the others
are their digits versions (minutes). The compute model (seconds per training sample of
each variant, per model) is measured once and pinned for every run, so the simulated
times of all experiments share one clock (``clock.json``); a run of named experiments
reuses it unless ``--calibrate``.

``--resume``: go on with experiments a killed process left in ``--out``: the runs that
finished there (same config and seed) are kept, the others made (see
``coordinator.emulation.experiment``); without it each experiment's folder is cleared first.

``--quick``: each config's quick form (:func:`quick_config`: digits, 2 rounds, one seed,
the sweep cut to its baseline and one other value per dimension) on a nominal clock, into
``--out``, nothing copied or measured: what ``make test`` runs to prove every config runs
end to end.

``--estimate R``: one seed of a covering set of combinations (the first, and each other
value of each dimension) for ``R`` rounds (R >= 2), timed: the per-round wall time (the
rounds after the first) and the fixed cost of a run give a run's full time (fixed +
rounds x per-round), and a cost factor per dimension value gives every combination's
(:func:`estimate`); times seeds (and a ``[sweep.tune]`` table's tuning runs): each
experiment's full time on this machine as loaded now, one run at a time, and in CPU
seconds (the process's and its workers', scaled the same way: what idle cores would
take, to divide by the cores a run uses); for a
config that stops at a plateau, with every run at its maximum rounds (an upper bound);
printed and written to ``estimates.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "benchmarks" / "results" / "experiments"
VARIANTS = ["float32", "int16", "int8", "int6"]
#: the quick form's model for each bundled model of another input size
QUICK_MODELS = {"mnist_cnn": "digits_cnn", "mnist_mlp": "mlp", "fedshift_cnn": "digits_cnn",
                "vgg7_small": "digits_cnn"}
QUICK_STEPS = 5
QUICK_DEVICES = 2  # per profile


def quick_config(cfg: Any, every_method: bool = True, keep_data: bool = False) -> Any:
    """The quick form of an experiment (``make test``): digits (its validation split kept),
    the model's digits counterpart, 2 rounds, the first seed, at most ``QUICK_STEPS``
    local steps and ``QUICK_DEVICES`` devices per profile, and per sweep dimension its
    first value, except the first baseline's dimension (every value, each method runs;
    the baseline and one other without ``every_method``), the other baselines' (the
    baseline and one other value; the baseline alone without ``every_method``) and the
    tuned one (two). ``keep_data``: keep the config's data set and model (a CIFAR-10
    folder given with --set data.path=DIR)."""
    from coordinator.emulation.analysis import ANALYSIS_KEYS, baselines, find_baseline
    from coordinator.emulation.config import from_dict

    raw = cfg.as_dict()
    raw["paper"] = ""  # the config already holds the paper's settings
    raw["rounds"] = 2
    raw["seeds"] = raw["seeds"][:1]
    if not keep_data:
        raw["model"] = QUICK_MODELS.get(raw["model"], raw["model"])
        raw["data"] = raw["data"] | {"dataset": "digits", "path": ""}
    raw["devices"] = {k: min(n, QUICK_DEVICES) for k, n in raw["devices"].items()}
    raw["train"] = dict(raw["train"])
    raw["train"]["steps"] = min(int(raw["train"].get("steps") or QUICK_STEPS), QUICK_STEPS)
    sweep = raw["sweep"]
    keep: dict[str, list[str]] = {}
    first = every = ""
    for b in baselines(sweep):
        dim, value = find_baseline(sweep, b)
        first = first or dim
        every = every or (dim if every_method else "")
        keep.setdefault(dim, []).append(value)
    tune = sweep.get("tune", "")
    out = {k: v for k, v in sweep.items() if k in ANALYSIS_KEYS}
    if isinstance(tune, dict):  # a bracket per method: one tuning seed, each bracket's first point
        out["tune"] = {k: (v[:1] if k == "seeds" else {kk: vv[:1] for kk, vv in v.items()} if isinstance(v, dict)
                           else v) for k, v in tune.items()}
        tune = ""
    tune = str(tune).lstrip("@")
    for key, values in sweep.items():
        if key in ANALYSIS_KEYS:
            continue
        dim = key.lstrip("@")
        labels = [str(v["label"]) if key.startswith("@") else str(v) for v in values]
        if dim == every:
            picked = list(values)
        elif dim == tune:
            picked = values[:2]
        elif dim in keep:
            base = [values[labels.index(x)] for x in keep[dim]]
            other = [v for v, lab in zip(values, labels, strict=True) if lab not in keep[dim]][:1]
            picked = base + other if every_method or dim == first else base[:1]
        else:
            picked = values[:1]
        out[key] = [_cap_devices(v) for v in picked]
    if isinstance(out.get("tune"), dict) and out["tune"].get("by"):  # brackets of the values kept
        by = "@" + str(out["tune"]["by"]).lstrip("@")
        kept = {str(v["label"]) if isinstance(v, dict) else str(v) for v in out.get(by, out.get(by[1:], []))}
        out["tune"] = {k: v for k, v in out["tune"].items() if k in ("seeds", "by", "default") or k in kept}
    raw["sweep"] = out
    return from_dict(raw, f"{cfg.source} (quick)")


def _cap_devices(value: Any) -> Any:
    """An @-group's table with its device counts capped at ``QUICK_DEVICES``."""
    if not isinstance(value, dict):
        return value
    return {k: (min(v, QUICK_DEVICES) if k.startswith("devices.") and isinstance(v, int) else v)
            for k, v in value.items()}


def _clock(models: list[str], calibrate_anew: bool, named: bool) -> dict[str, dict[str, float]]:
    """``{model: {variant: seconds per sample}}``: pinned in clock.json (measured once per
    model; again with ``--calibrate`` or on a run of every experiment)."""
    from coordinator.emulation.emulated_fleet import calibrate
    from edge_client.data import load_source
    from firmware_models import resolve_model

    path = RESULTS / "clock.json"
    saved = json.loads(path.read_text()) if path.is_file() else {}
    clocks = saved.get("models", {})
    if "seconds_per_sample" in saved:  # the older layout: one clock, measured on digits_cnn
        clocks.setdefault("digits_cnn", saved["seconds_per_sample"])
    for model in models:
        if model in clocks and named and not calibrate_anew:
            continue
        spec = resolve_model(model)
        src = "fashion-mnist:1/100" if tuple(spec.input_shape) == (1, 28, 28) else "digits:1/10"
        sample = load_source(src).subset(list(range(64)))
        clocks[model] = calibrate(model, VARIANTS, sample)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"models": clocks}, indent=1))
    return clocks


def _cpu() -> float:
    """CPU seconds of this process and of its finished children (the worker processes a
    run starts and ends)."""
    import os

    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _time_run(c: Any, rounds: int, run_dir: Path) -> dict[str, float]:
    """One seed of config ``c`` for ``rounds`` rounds: its per-round wall time (the rounds
    after the first), fixed wall time and the CPU/wall ratio of the process and its worker
    processes."""
    from coordinator.emulation.emulator import Emulator

    short = copy.deepcopy(c)
    short.rounds = rounds
    if run_dir.exists():
        shutil.rmtree(run_dir)
    t0, c0 = time.monotonic(), _cpu()
    Emulator(short, c.seeds[0], run_dir).run()
    wall, cpu = time.monotonic() - t0, _cpu() - c0
    recs = [json.loads(x) for x in (run_dir / "out" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    per_round = statistics.median(r["round_seconds"] for r in recs[1:]) if len(recs) > 1 else recs[0]["round_seconds"]
    fixed = max(0.0, wall - sum(r["round_seconds"] for r in recs))
    run_s = fixed + c.rounds * per_round
    return {"per_round_s": per_round, "fixed_s": fixed, "run_s": run_s, "run_cpu_s": run_s * cpu / wall}


def estimate(cfg: Any, rounds: int, out: Path) -> dict[str, Any]:
    """Estimate the full time of ``cfg`` (see the module docstring) from a covering set of
    its combinations: the first combination (the base) and, per sweep dimension, each
    other value with the rest at the base. A run's cost is taken as the base's times one
    factor per dimension (the timed run's cost over the base's), so the experiment's cost
    per seed is ``base x prod over dimensions of (sum of that dimension's factors)``."""
    from coordinator.emulation.analysis import ANALYSIS_KEYS
    from coordinator.emulation.config import expand_sweep

    dims = [k for k in cfg.sweep if k not in ANALYSIS_KEYS]
    combos = expand_sweep(cfg)
    first = {k: cfg.sweep[k][0] for k in dims}
    plan: list[tuple[str | None, int]] = [(None, 0)] + [(k, i) for k in dims for i in range(1, len(cfg.sweep[k]))]
    timed: dict[tuple[str | None, int], dict[str, float]] = {}
    for n, (dim, i) in enumerate(plan):
        one = copy.deepcopy(cfg)
        one.sweep = {k: [cfg.sweep[k][i] if k == dim else first[k]] for k in dims}
        (combo, c), = expand_sweep(one)
        timed[(dim, i)] = t = _time_run(c, rounds, out / f"timed-{n}")
        print(f"  {n + 1}/{len(plan)} {combo}: {t['per_round_s']:.1f} s/round, {t['fixed_s']:.1f} s fixed -> "
              f"{t['run_s'] / 60:.1f} min per seed ({t['run_cpu_s'] / 60:.1f} CPU min)", flush=True)
    out_est = {}
    tune = cfg.sweep.get("tune")
    tuning_runs = 0
    if isinstance(tune, dict):  # every setting of a combination's bracket on every tuning seed
        from coordinator.emulation.tuning import bracket

        tuning_runs = len(bracket(tune, combos[0][0])) * len(tune["seeds"])
    for key in ("run_s", "run_cpu_s"):
        base = timed[(None, 0)][key]
        per_seed = base
        for k in dims:
            per_seed *= 1.0 + sum(timed[(k, i)][key] / base for i in range(1, len(cfg.sweep[k])))
        out_est[key] = per_seed * (len(cfg.seeds) + tuning_runs)
    return {"combinations": len(combos), "seeds": len(cfg.seeds), "tuning_runs_per_combination": tuning_runs,
            "rounds": cfg.rounds, "plateau_stop": bool(cfg.stop.plateau),
            "timed_runs": len(plan), "estimated_h": round(out_est["run_s"] / 3600, 2),
            "estimated_cpu_h": round(out_est["run_cpu_s"] / 3600, 2),
            "timed": [{"dimension": d, "value": (cfg.sweep[d][i].get("label") if isinstance(cfg.sweep[d][i], dict)
                                                 else cfg.sweep[d][i]) if d else "base",
                       **{k: round(v, 2) for k, v in t.items()}} for (d, i), t in timed.items()]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs") / "experiments")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a key in every config (e.g. seeds=[0])")
    ap.add_argument("--calibrate", action="store_true",
                    help="measure the compute model again (default: a run of named experiments "
                         "reuses the one in clock.json, so that all results share one clock)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="each config's quick form (make test)")
    mode.add_argument("--estimate", type=int, metavar="R", help="time R rounds of every combination, "
                      "one seed, and estimate each experiment's full time")
    ap.add_argument("--resume", action="store_true",
                    help="go on with interrupted experiments in --out: finished runs (same config and seed) "
                         "are kept, the rest made (default: each experiment's folder is cleared first)")
    ap.add_argument("names", nargs="*", help="experiment names (default: every experiments/*.toml)")
    args = ap.parse_args()

    import tomllib

    from coordinator.emulation.config import load_config
    from coordinator.emulation.experiment import run_experiment

    overrides = {}
    for item in args.set:
        k, _, v = item.partition("=")
        overrides[k] = tomllib.loads(f"v = {v}")["v"]
    paths = sorted(HERE.glob("*.toml"))
    if args.names:
        unknown = sorted(set(args.names) - {p.stem for p in paths})
        if unknown:
            print(f"run_all: no experiments/{unknown[0]}.toml (known: {', '.join(p.stem for p in paths)})",
                  file=sys.stderr)
            return 2
        paths = [p for p in paths if p.stem in args.names]
    configs = {p: load_config(p, overrides) for p in paths}
    if args.quick:
        configs = {p: quick_config(c) for p, c in configs.items()}
    models = sorted({c.model for c in configs.values()})
    if args.quick:  # a nominal clock: the quick runs measure nothing and write no clock.json
        clocks = {m: dict.fromkeys(VARIANTS, 1e-4) for m in models}
    else:
        clocks = _clock(models, args.calibrate, bool(args.names) or args.estimate is not None)
    estimates = {}
    for path, cfg in configs.items():
        cfg.clock = replace(cfg.clock, seconds_per_sample=dict(clocks[cfg.model]))
        t0 = time.monotonic()
        out = args.out / path.stem
        if out.exists() and not (args.resume and args.estimate is None):
            shutil.rmtree(out)
        if args.estimate is not None:
            print(f"== {path.name}: estimating from {args.estimate} rounds of a covering set of combinations",
                  flush=True)
            estimates[path.stem] = estimate(cfg, max(2, args.estimate), out)
            e = estimates[path.stem]
            tuning = f" + {e['tuning_runs_per_combination']} tuning runs" if e["tuning_runs_per_combination"] else ""
            bound = (f"at most (every run to its maximum of {e['rounds']} rounds; the plateau stops most "
                     "earlier), " if e["plateau_stop"] else "")
            print(f"   {e['combinations']} combinations x ({e['seeds']} seeds{tuning}): about {e['estimated_h']:.1f} h "
                  f"{bound}one run at a time as loaded now, {e['estimated_cpu_h']:.1f} h of CPU "
                  f"({time.monotonic() - t0:.0f} s to estimate)", flush=True)
            continue
        print(f"== {path.name} -> {out}", flush=True)
        summary = run_experiment(cfg, out, echo=lambda m: print("  " + m, flush=True), resume=args.resume)
        print(f"   {time.monotonic() - t0:.0f} s; {summary}", flush=True)
        if args.quick:
            continue
        shutil.copyfile(summary, RESULTS / f"{path.stem}.md")
        for name, suffix in (("results.json", ".json"), ("analysis.json", ".analysis.json"),
                             ("tuning.json", ".tuning.json"), ("accuracy.png", ".png")):
            if (out / name).is_file():
                shutil.copyfile(out / name, RESULTS / f"{path.stem}{suffix}")
    if estimates:  # merged into the file: the experiments not estimated now keep theirs
        path = RESULTS / "estimates.json"
        old = json.loads(path.read_text()) if path.is_file() else {}
        for e in old.get("experiments", {}).values():  # (the older layout: one load for the file)
            e.setdefault("machine_load", old.get("machine_load"))
        for e in estimates.values():
            e["machine_load"] = _load()
        path.write_text(json.dumps(
            {"note": "one seed of a covering set of combinations, the first rounds timed on this machine "
                     "as loaded then (machine_load: its load average), one run at a time; estimated_cpu_h: "
                     "the same in CPU time; plateau_stop: an upper bound, every run at its maximum rounds",
             "experiments": old.get("experiments", {}) | estimates}, indent=1))
    return 0


def _load() -> list[float]:
    import os

    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


if __name__ == "__main__":
    sys.exit(main())
