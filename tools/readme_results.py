"""The README's "What the experiments show", rendered from the result files.

    python tools/readme_results.py           # print the section
    python tools/readme_results.py --write   # put it into README.md (between its markers)

Every figure of the section is read or computed here from
``benchmarks/results/experiments/<name>.analysis.json`` and ``<name>.json`` (the per-run
figures: the device-weighted means); ``tests/project/test_readme_results.py`` renders it again
and compares it with the README, figure for figure. Each comparison says whether its runs
reached a plateau (their ``stop`` records: coordinator.emulation.stopping), were still
climbing, or ran a fixed number of rounds before the stopping rule existed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "experiments"
README = ROOT / "README.md"
BEGIN = "<!-- results: tools/readme_results.py renders this section from benchmarks/results/experiments/ -->"
END = "<!-- /results -->"


class Results:
    """One experiment's files: ``analysis`` (analysis.json) and ``runs`` (results.json)."""

    def __init__(self, name: str, folder: Path = RESULTS) -> None:
        self.name = name
        self.analysis = json.loads((folder / f"{name}.analysis.json").read_text())
        self.runs = json.loads((folder / f"{name}.json").read_text())

    def paired(self, label: str, baseline: str | None = None) -> dict[str, Any]:
        """The paired row of combination ``label`` (against the first baseline, or the
        baseline value ``baseline``): {group: {mean, ci95, wins, n, ...}, against}."""
        for comp in self.analysis["paired"]:
            if baseline is None or comp["baseline"][1] == baseline:
                if label in comp["rows"]:
                    return comp["rows"][label]
        raise KeyError(f"{self.name}: no paired row {label!r}")

    def rounds(self, labels: Sequence[str]) -> tuple[int, str]:
        """(rounds run at most, how the runs of ``labels`` stopped: a phrase)."""
        runs = [r for r in self.runs if _label(r["combination"]) in labels or _label_untuned(r, self) in labels]
        stops = [r.get("stop") for r in runs]
        n = max(int((r.get("stop") or r)["rounds"]) for r in runs)
        if not runs or any(s is None for s in stops):
            return n, f"after {n} rounds, not run to a plateau"
        climbing = sum(bool(s.get("climbing")) for s in stops)
        if climbing:
            return n, f"after {n} rounds, still climbing in {climbing} of {len(stops)} runs"
        return n, "plateaued"

    def per_seed(self, label: str, group: str) -> dict[int, float]:
        return {int(r["seed"]): float(r["groups"][group]["mean_last"]) for r in self.runs
                if _label(r["combination"]) == label}


def _label(combo: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in combo.items())


def _label_untuned(run: Mapping[str, Any], res: Results) -> str:
    tune = res.analysis.get("tune")
    return ", ".join(f"{k}={v}" for k, v in run["combination"].items() if k != tune)


def pts(x: float) -> str:
    """A fraction as signed percent points: ``+5.1``, ``−0.8`` (a minus sign), ``0.0``."""
    v = round(100 * x, 1)
    if v == 0:
        return "0.0"
    return f"+{v:.1f}" if v > 0 else f"−{-v:.1f}"


def one(p: Mapping[str, Any]) -> str:
    """``+5.1 [+2.2, +8.0] 5/5``: mean paired difference [95 % CI] seeds ahead."""
    lo, hi = p["ci95"]
    return f"{pts(p['mean'])} [{pts(lo)}, {pts(hi)}] {p['wins']}/{p['n']}"


def span(ps: Sequence[Mapping[str, Any]]) -> str:
    """Several paired differences as one range: ``+1.5 to +1.8 [CIs +1.0 to +2.2] 5/5``."""
    if len(ps) == 1:
        return one(ps[0])
    means = sorted(p["mean"] for p in ps)
    los, his = min(p["ci95"][0] for p in ps), max(p["ci95"][1] for p in ps)
    wins = sorted(p["wins"] for p in ps)
    n = max(p["n"] for p in ps)
    w = f"{wins[0]}/{n}" if wins[0] == wins[-1] else f"{wins[0]}-{wins[-1]}/{n}"
    m = pts(means[0]) if pts(means[0]) == pts(means[-1]) else f"{pts(means[0])} to {pts(means[-1])}"
    return f"{m} [CIs {pts(los)} to {pts(his)}] {w}"


def weighted(res: Results, label: str, base: str, mix: str) -> dict[str, Any]:
    """The paired difference of the device-weighted mean accuracy (Int8 and float32 groups
    weighted by their devices: ``mix`` = "<Int8 %>/<float32 %>")."""
    from coordinator.emulation.stats import paired

    a = int(mix.split("/")[0]) / 100

    def w(lab: str) -> dict[int, float]:
        i8, f = res.per_seed(lab, "int8"), res.per_seed(lab, "float32")
        return {s: a * i8[s] + (1 - a) * f[s] for s in i8 if s in f}

    p = paired(w(label), w(base))
    return {"mean": p.diff.mean, "ci95": [p.diff.lo, p.diff.hi], "wins": p.wins, "n": p.diff.n}


def render(folder: Path = RESULTS) -> str:
    """The section's text (between the markers)."""
    lines = ["Fashion-MNIST, 5 seeds, method − baseline paired by seed in accuracy points over the last 5 "
             "rounds: mean [95 % CI] seeds ahead/5 ([more](docs/experiments.md#the-papers-on-fashion-mnist))."]
    mf = Results("fmnist-mixed-fleet", folder)
    splits = ("IID", "Dirichlet(0.5)", "Dirichlet(0.1)")

    def mixed(base: str) -> str:
        return "; ".join(f"{sp} {span([row[g] for g in mf.analysis['groups']])}" for sp in splits
                         for row in [mf.paired(f"method=FedAvg Int8 forward, split={sp}", base)])

    _, how = mf.rounds([f"method={m}, split={sp}" for m in ("FedAvg Int8 forward", "FedAvg float forward",
                                                             "FedGroupedAvg") for sp in splits])
    lines.append(f"- **Mixed fleet** (`fmnist-mixed-fleet`, {how}): float devices in the Int8 forward − "
                 f"the float forward, all 4 groups: {mixed('FedAvg float forward')}. "
                 f"Int8 forward − a model per group: {mixed('FedGroupedAvg')}.")
    t2, tau = Results("fmnist-prowd-table2", folder), Results("fmnist-prowd-ablation-tau", folder)
    prowd = []
    for res, label, reading in ((t2, "ProWD", "kept"), (tau, "ProWD (tau dropped)", "dropped")):
        parts = []
        for mix in ("50/50", "80/20"):
            row = res.paired(f"method={label}, mix={mix}")
            wm = weighted(res, f"method={label}, mix={mix}", f"method=FedAvg, mix={mix}", mix)
            parts.append(f"{mix} Int8 {one(row['int8'])}, device-weighted {one(wm)}")
        _, how = res.rounds([f"method={m}, mix={x}" for m in (label, "FedAvg") for x in ("50/50", "80/20")])
        prowd.append(f"τ read as {reading} (`{res.name}`, {how}): " + "; ".join(parts))
    lines.append("- **ProWD − FedAvg**, " + ". ".join(prowd) + ".")
    ff = []
    for name, split in (("fmnist-fedfor", "shards"), ("fmnist-fedfor-dirichlet", "Dirichlet(0.1)")):
        res = Results(name, folder)
        fedfor = res.paired(f"method=FedFOR, split={split}")["float32"]
        avgm = res.paired(f"method=FedAvgM, split={split}")["float32"]
        ff.append(f"{split} FedFOR {one(fedfor)}, FedAvgM {one(avgm)}")
    _, how = res.rounds([f"method={m}, split=Dirichlet(0.1)" for m in ("FedFOR", "FedAvg", "FedAvgM")])
    lines.append(f"- **FedFOR, FedAvgM − FedAvg** (`fmnist-fedfor`, `-dirichlet`, lr tuned on the reported "
                 f"seeds, {how}): " + "; ".join(ff) + ".")
    fs = []
    for name, split in (("fmnist-fedshift-table1", "parity"), ("fmnist-fedshift-table1-shards", "shards")):
        res = Results(name, folder)
        ups = ("asym-16", "asym-8", "kmeans-8", "asym-4", "kmeans-4")
        shift = [res.paired(f"strategy=fedshift, uplink={u}, split={split}", "fedavg")["float32"] for u in ups]
        four = [res.paired(f"strategy=fedavg, uplink={u}, split={split}", "32+32")["float32"]
                for u in ("asym-4", "kmeans-4")]
        fs.append(f"{split} FedShift − FedAvg {span(shift)}, FedAvg 4-bit − 32-bit uplinks {span(four)}")
    _, how = res.rounds([f"strategy={s}, uplink=asym-4, split=shards" for s in ("fedavg", "fedshift")])
    lines.append(f"- **FedShift Table 1** (`fmnist-fedshift-table1`, `-shards`, 5 quantized uplinks, {how}): "
                 + "; ".join(fs) + ".")
    lines.append(fedbuff(folder))
    return "\n".join(_wrap(line) for line in lines)


#: the buffered-aggregation experiments (``experiments/fedbuff.py``) and their regimes
FEDBUFF = (("fedbuff", "IID 40 s"), ("fedbuff-dirichlet", "Dirichlet(0.3) 40 s"), ("fedbuff-day", "IID 120 s"),
           ("fedbuff-concurrency", "IID 40 s, parallelism tuned"),
           ("fedbuff-dirichlet-concurrency", "Dirichlet(0.3) 40 s, parallelism tuned"))


def fedbuff(folder: Path = RESULTS) -> str:
    """The FedBuff item: per regime whether its runs were still climbing at the end of the
    budget, the speed-up to the synchronous run's final accuracy (mean [95 % CI] over
    seeds) and the paired final-accuracy difference (``<name>-speedup.json``)."""
    parts = []
    for name, regime in FEDBUFF:
        a = json.loads((folder / f"{name}-speedup.json").read_text())
        sp, reached, still = a["figures"]["speedup"], a["reached"], a["still_climbing"]
        lo, hi = sp["ci95"]
        climbing = int(still["sync"]) + int(still["buffered"])
        how = f"still climbing {climbing}/{2 * int(reached['seeds'])}" if climbing else "plateaued"
        got = "" if reached["buffered"] == reached["seeds"] else f" (reached {reached['buffered']}/{reached['seeds']})"
        parts.append(f"{regime} ({how}) {sp['mean']:.2f}× [{lo:.2f}, {hi:.2f}]{got}, "
                     f"{one(a['accuracy_difference'])}")
    return ("- **FedBuff − synchronous FedAvg** (`fedbuff`, `-dirichlet`, `-day`, `[-dirichlet]-concurrency`; tuned, "
            "the 120 s runs at 40 s): "
            "how much sooner buffered rounds reach the synchronous final accuracy, final accuracy: "
            + "; ".join(parts) + ".")


def _wrap(line: str, width: int = 100) -> str:
    """A paragraph or list item wrapped at ``width`` (list items' lines indented by 2)."""
    import textwrap

    if not line:
        return line
    indent = "  " if line.startswith("- ") else ""
    return "\n".join(textwrap.wrap(line, width, subsequent_indent=indent, break_long_words=False,
                                   break_on_hyphens=False))


def section(text: str) -> str:
    """The generated part of a README text (between the markers)."""
    m = re.search(re.escape(BEGIN) + r"\n(.*?)\n" + re.escape(END), text, re.S)
    if not m:
        raise ValueError(f"README.md: no generated results section ({BEGIN!r} ... {END!r})")
    return m.group(1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="put the section into README.md")
    args = ap.parse_args()
    text = render()
    if not args.write:
        print(text)
        return 0
    readme = README.read_text()
    old = section(readme)
    README.write_text(readme.replace(f"{BEGIN}\n{old}\n{END}", f"{BEGIN}\n{text}\n{END}"))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
