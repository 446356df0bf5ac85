"""What a sweep's runs show: per combination and group, the estimate over seeds; a swept
setting chosen on the validation split; each method's paired difference to a baseline.

A config's ``[sweep]`` may name, beside its dimensions::

    [sweep]
    baseline = "FedAvg"         # a value (or @-label) of one dimension, or "key=value";
                                # a list: one comparison per baseline
    tune = "train.lr"           # a dimension chosen per combination of the others
    "@method" = [{label = "FedAvg", ...}, {label = "FedFOR", ...}]
    "train.lr" = [0.1, 0.3, 1.0]

**The figure of a run** is each group's accuracy (its model as that group runs it)
averaged over the last ``min(LAST_ROUNDS, rounds)`` rounds, on the test split and, when
the run held one out (``data.validation``), on the validation split.

**Tuning** (``tune``): for every combination of the other dimensions, the value of the
tuned dimension whose runs score best on the validation split (mean over seeds of the
mean over groups) is chosen, and only its test figures are reported. The test split
never chooses: tuning needs a validation split (``data.validation``; a config without
one is refused), and runs without validation figures are reported untuned.

**Baseline** (``baseline``): every combination is compared with the combination that
differs from it only in the baseline's dimension, seed by seed (same data split, same
initial model): the mean paired difference, its 95 % CI and the seeds won
(:func:`coordinator.emulation.stats.paired`). With tuning, each side uses its own choice.
Several baselines (``baseline = ["FedAvg", "uplink=32+32"]``) give one table each.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from coordinator.emulation.stats import Estimate, Paired, estimate, paired
from edge_client.errors import ConfigError

#: ``[sweep]`` keys that say how to read the results, not what to run
ANALYSIS_KEYS = ("baseline", "tune")
LAST_ROUNDS = 5


def dimensions(sweep: Mapping[str, Any]) -> dict[str, list[str]]:
    """``{dimension: [value labels]}`` of a ``[sweep]`` table: a dotted key's values as
    text, an ``@name`` group's labels under ``name`` (the names combinations use)."""
    out = {}
    for key, values in sweep.items():
        if key in ANALYSIS_KEYS or not isinstance(values, list):
            continue
        if key.startswith("@"):
            out[key[1:]] = [str(v.get("label")) if isinstance(v, dict) else str(v) for v in values]
        else:
            out[key] = [str(v) for v in values]
    return out


def find_baseline(sweep: Mapping[str, Any], baseline: str,
                  dims: Mapping[str, list[str]] | None = None) -> tuple[str, str]:
    """``(dimension, value)`` that ``baseline`` names (``"FedAvg"`` or ``"method=FedAvg"``)
    among the sweep's dimensions (or ``dims``); ConfigError when it names none or several."""
    dims = dimensions(sweep) if dims is None else dims
    name, eq, value = baseline.partition("=")
    if eq:
        name = name.lstrip("@")
        if name not in dims or value not in dims[name]:
            raise ConfigError(f"sweep.baseline: {baseline!r}: no dimension {name!r} with value {value!r}")
        return name, value
    hits = [(d, baseline) for d, labels in dims.items() if baseline in labels]
    if len(hits) != 1:
        where = "no" if not hits else f"{len(hits)} ({', '.join(d for d, _ in hits)})"
        raise ConfigError(f"sweep.baseline: {baseline!r} is a value of {where} dimensions "
                          f"(write \"dimension=value\")")
    return hits[0]


def baselines(sweep: Mapping[str, Any]) -> list[str]:
    """The sweep's baselines as a list (``baseline`` is a string or a list of strings)."""
    b = sweep.get("baseline")
    if b is None:
        return []
    if isinstance(b, str):
        return [b]
    if isinstance(b, list) and b and all(isinstance(x, str) for x in b):
        return list(b)
    raise ConfigError(f"sweep.baseline: expected a string or a list of strings, got {b!r}")


def check_analysis(sweep: Mapping[str, Any]) -> None:
    """ConfigError naming ``sweep.baseline`` / ``sweep.tune`` when they do not fit the
    sweep's dimensions (a combination's own config, which has none left, passes)."""
    dims = dimensions(sweep)
    if not dims:
        return
    tune = sweep.get("tune")
    bdims = [find_baseline(sweep, b)[0] for b in baselines(sweep)]
    if isinstance(tune, dict):  # a bracket per method (coordinator.emulation.tuning; checked with the seeds)
        return
    if tune is not None:
        if not isinstance(tune, str) or tune.lstrip("@") not in dims:
            raise ConfigError(f"sweep.tune: {tune!r} is not one of the sweep's dimensions {sorted(dims)}")
        if len(dims[tune.lstrip("@")]) < 2:
            raise ConfigError(f"sweep.tune: {tune!r} has a single value: nothing to choose")
        if tune.lstrip("@") in bdims:
            raise ConfigError("sweep.tune: the tuned dimension cannot hold the baseline")


# --------------------------------------------------------------------------- run figures


def rounds_averaged(rounds: int, last: int = LAST_ROUNDS) -> int:
    """How many final rounds a run's figure averages."""
    return max(1, min(last, rounds))


def averaging_text(pairs: set[tuple[int, int]]) -> str:
    """What the figures average, from the runs' ``(averaged, rounds)``: ``"the last 5 of
    30 rounds"``, ``"all 2 rounds"``, ``"the final round"``."""
    parts = []
    for k, r in sorted(pairs):
        parts.append("the final round" if r == 1 else f"all {r} rounds" if k == r else f"the last {k} of {r} rounds")
    return " / ".join(parts) or "no rounds"


@dataclass
class Row:
    """One combination's runs: ``test[group][seed]`` and ``val[group][seed]`` figures."""

    combination: dict[str, Any]
    seeds: list[int] = field(default_factory=list)
    test: dict[str, dict[int, float]] = field(default_factory=dict)
    val: dict[str, dict[int, float]] = field(default_factory=dict)
    #: per seed, the run's stopping figures (coordinator.emulation.stopping.stop_summary)
    stops: dict[int, dict[str, Any]] = field(default_factory=dict)

    def climbing_text(self) -> str:
        """``"2 of 5 seeds"`` still climbing at the end (``"n/a"``: runs too short to say)."""
        flags = [st.get("climbing") for st in self.stops.values()]
        known = [f for f in flags if f is not None]
        if not known:
            return "n/a"
        return f"{sum(known)} of {len(known)} seeds" + ("" if len(known) == len(flags) else " (others: too short)")

    def estimate(self, group: str, split: str = "test") -> Estimate:
        return estimate(list(getattr(self, split).get(group, {}).values()))

    def score(self, groups: Sequence[str]) -> tuple[float, str]:
        """(selection score, ``"val"``): the mean over seeds of the mean over ``groups`` of
        the validation figure; -inf without one (the test split never chooses)."""
        split = "val"
        per_seed = []
        for s in self.seeds:
            vals = [self.val.get(g, {}).get(s, math.nan) for g in groups]
            vals = [v for v in vals if not math.isnan(v)]
            if vals:
                per_seed.append(sum(vals) / len(vals))
        return (sum(per_seed) / len(per_seed) if per_seed else -math.inf), split


def key_of(combination: Mapping[str, Any], drop: str | None = None) -> tuple[tuple[str, str], ...]:
    return tuple((k, str(v)) for k, v in combination.items() if k != drop)


def label_of(combination: Mapping[str, Any], drop: str | None = None) -> str:
    return ", ".join(f"{k}={v}" for k, v in combination.items() if k != drop) or "default"


@dataclass
class Analysis:
    """The rows of a sweep, the tuning choices and the paired differences."""

    rows: dict[str, Row]
    groups: list[str]
    tune: str | None = None
    #: per combination of the other dimensions: (chosen value, {value: score}, split)
    chosen: dict[str, tuple[str, dict[str, float], str]] = field(default_factory=dict)
    #: the rows reported (the chosen ones under tuning; every row otherwise)
    reported: dict[str, Row] = field(default_factory=dict)
    comparisons: list[Comparison] = field(default_factory=list)


@dataclass
class Comparison:
    """The paired differences of every reported combination to its partner at the
    baseline ``(dimension, value)``."""

    baseline: tuple[str, str]
    #: reported label -> group -> paired difference to its baseline partner
    diffs: dict[str, dict[str, Paired]] = field(default_factory=dict)
    partner: dict[str, str] = field(default_factory=dict)


def analyse(runs: Sequence[tuple[Mapping[str, Any], int, Mapping[str, Any]]],
            sweep: Mapping[str, Any] | None = None) -> Analysis:
    """``runs`` = ``[(combination, seed, run summary)]`` (a summary's ``groups[g]`` has
    ``mean_last`` and, with a validation split, ``val_mean_last``); ``sweep``: the
    config's ``[sweep]`` (its ``baseline`` and ``tune``)."""
    sweep = sweep or {}
    rows: dict[str, Row] = {}
    for combo, seed, summary in runs:
        row = rows.setdefault(label_of(combo), Row(dict(combo)))
        row.seeds.append(int(seed))
        if summary.get("stop"):
            row.stops[int(seed)] = dict(summary["stop"])
        for g, v in summary.get("groups", {}).items():
            row.test.setdefault(g, {})[int(seed)] = _num(v.get("mean_last"))
            if v.get("val_mean_last") is not None:
                row.val.setdefault(g, {})[int(seed)] = _num(v.get("val_mean_last"))
    groups = sorted({g for r in rows.values() for g in r.test})
    out = Analysis(rows, groups)
    tune = sweep.get("tune")
    tdim = tune.lstrip("@") if isinstance(tune, str) else None
    if tdim and not any(tdim in r.combination for r in rows.values()):
        tdim = None
    if tdim and not any(r.val for r in rows.values()):
        tdim = None  # no validation figures: nothing may choose (every row is reported)
    out.tune = tdim
    if tdim:
        by_rest: dict[tuple, list[Row]] = {}
        for r in rows.values():
            by_rest.setdefault(key_of(r.combination, tdim), []).append(r)
        for cands in by_rest.values():
            scored = {str(r.combination[tdim]): r.score(groups) for r in cands}
            best = max(cands, key=lambda r: scored[str(r.combination[tdim])][0])
            rest = label_of(best.combination, tdim)
            split = scored[str(best.combination[tdim])][1]
            out.chosen[rest] = (str(best.combination[tdim]), {k: s for k, (s, _) in scored.items()}, split)
            out.reported[rest] = best
    else:
        out.reported = dict(rows)
    seen: dict[str, list[str]] = {}
    for r in rows.values():
        for k, v in r.combination.items():
            if str(v) not in seen.setdefault(k, []):
                seen[k].append(str(v))
    try:
        names = baselines(sweep)
    except ConfigError:
        names = []
    for name in names:
        try:
            bdim, bval = find_baseline(sweep, name, seen)
        except ConfigError:
            continue
        if bdim == tdim:
            continue
        comp = Comparison((bdim, bval))
        index = {key_of(r.combination, tdim): label for label, r in out.reported.items()}
        for label, r in out.reported.items():
            if str(r.combination.get(bdim)) == bval:
                continue
            partner_combo = {k: (bval if k == bdim else v) for k, v in r.combination.items()}
            plabel = index.get(key_of(partner_combo, tdim))
            if plabel is None:
                continue
            comp.partner[label] = plabel
            base = out.reported[plabel]
            comp.diffs[label] = {g: paired(r.test.get(g, {}), base.test.get(g, {})) for g in groups}
        out.comparisons.append(comp)
    return out


def analysis_json(a: Analysis) -> dict[str, Any]:
    """The analysis as plain JSON (percent points are left to the reader: fractions)."""
    def est(e: Estimate) -> dict[str, Any]:
        return {"n": e.n, "mean": _fin(e.mean), "sd": _fin(e.sd), "ci95": [_fin(e.lo), _fin(e.hi)]}

    return {
        "groups": a.groups,
        "rows": {label: {"combination": r.combination, "seeds": sorted(r.seeds),
                         "test": {g: est(r.estimate(g)) for g in a.groups},
                         "validation": {g: est(r.estimate(g, "val")) for g in a.groups if r.val.get(g)},
                         "stop": {"rounds": sorted({st["rounds"] for st in r.stops.values()}),
                                  "plateau_rounds": sorted({st["plateau_round"] for st in r.stops.values()
                                                            if st.get("plateau_round")}),
                                  "climbing": sum(bool(st.get("climbing")) for st in r.stops.values()),
                                  "climbing_known": sum(st.get("climbing") is not None for st in r.stops.values())}
                         if r.stops else None}
                 for label, r in a.rows.items()},
        "tune": a.tune,
        "chosen": {k: {"value": v, "scores": {kk: _fin(s) for kk, s in sc.items()}, "split": sp}
                   for k, (v, sc, sp) in a.chosen.items()},
        "paired": [{"baseline": list(c.baseline),
                    "rows": {label: {"against": c.partner[label],
                                     **{g: {**est(p.diff), "wins": p.wins, "ties": p.ties, "losses": p.losses,
                                            "seeds": list(p.seeds)} for g, p in d.items()}}
                             for label, d in c.diffs.items()}} for c in a.comparisons],
    }


def _num(v: object) -> float:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else math.nan


def _fin(v: float) -> float | None:
    return v if isinstance(v, float) and math.isfinite(v) else None
