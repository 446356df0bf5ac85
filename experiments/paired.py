"""Paired differences between a sweep's combinations, seed by seed.

    python experiments/paired.py RESULTS.json --ref "method=FedGroupedAvg" [--group int8] ...

For every combination and group, the accuracy (mean of the last 5 rounds) minus the
reference combination's on the same seed (same data split, same initial model): mean ±
std over seeds and how many seeds the difference is positive on. ``--ref`` picks the
reference by ``key=value`` pairs (comma-separated) of its combination; ``--ref-group``
compares every group against one group of the reference (default: the same group).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def label(combo: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in combo.items())


def matches(combo: dict, spec: str) -> bool:
    want = dict(kv.split("=", 1) for kv in spec.split(","))
    return all(str(combo.get(k)) == v for k, v in want.items())


def paired_table(runs: list[dict], ref: str, groups: list[str], ref_group: str | None = None) -> str:
    by_combo: dict[str, dict[int, dict]] = {}
    combos: dict[str, dict] = {}
    for r in runs:
        key = label(r["combination"])
        combos[key] = r["combination"]
        by_combo.setdefault(key, {})[r["seed"]] = r["groups"]
    refs = [k for k, c in combos.items() if matches(c, ref)]
    if len(refs) != 1:
        raise SystemExit(f"--ref {ref!r} matches {len(refs)} combinations: {refs}")
    base = by_combo[refs[0]]
    head = "| combination | " + " | ".join(f"{g} − ref ({ref_group or g})" for g in groups) + " |"
    lines = [f"Paired differences, in accuracy points, against `{refs[0]}` on the same seed "
             "(mean ± std over seeds; `k/n`: seeds where it is positive).", "", head,
             "|---|" + "---|" * len(groups)]
    for key, seeds in by_combo.items():
        cells = []
        for g in groups:
            d = [100 * (seeds[s][g]["last5"] - base[s][ref_group or g]["last5"])
                 for s in sorted(seeds) if s in base and g in seeds[s]]
            if not d:
                cells.append("")
                continue
            sd = statistics.stdev(d) if len(d) > 1 else 0.0
            cells.append(f"{statistics.mean(d):+.1f} ± {sd:.1f} ({sum(x > 0 for x in d)}/{len(d)})")
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--ref", required=True, help="the reference combination, key=value[,key=value]")
    ap.add_argument("--group", action="append", help="groups to compare (default: all)")
    ap.add_argument("--ref-group", help="compare against this group of the reference")
    args = ap.parse_args()
    runs = json.loads(args.results.read_text())
    groups = args.group or sorted({g for r in runs for g in r["groups"]})
    print(paired_table(runs, args.ref, groups, args.ref_group), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
