"""The coordinator's evaluation as a share of a Fashion-MNIST round (target <= 15 %).

One seed of an experiment's combination, run for its full length on the emulator (its
config, the clock pinned from ``benchmarks/results/experiments/clock.json``):
``eval_share`` = the evaluation's seconds over the rounds' seconds, summed over the run
(``eval_seconds`` and ``round_seconds`` of ``metrics.jsonl``). The evaluator reads the
test split only in the reported rounds and a validation subsample every round
(``coordinator/evaluate.py``); ``first_rounds_share`` is the share in the rounds before
the reported ones, ``reported_rounds_share`` in those. Anchor: the same run with the test split scored every
round (the run without a validation split, as every run was evaluated before), measured
in the same process, one after the other.

Cases: ``fmnist-mixed-fleet`` (FedAvg, float forward, IID: four groups in four forwards,
the most evaluation per round of any experiment) and ``fmnist-fedshift-table1`` (FedAvg,
ASYM-8: one float32 group, 20 local steps: little training per round).

``--quick`` (the test suite): digits, 3 rounds, 2 devices: that the script runs.

Run: ``.venv/bin/python benchmarks/eval_share.py [--quick] [--only EXPERIMENT]``; prints
JSON lines (``--only``: the case of that experiment alone).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = 0.15

CASES = [  # (experiment, the sweep's value per dimension, case label)
    ("fmnist-mixed-fleet", {"@method": "FedAvg float forward", "@split": "IID"}, "FedAvg float forward, IID"),
    ("fmnist-fedshift-table1", {"strategy": "fedavg", "@uplink": "asym-8"}, "FedAvg, asym-8, parity"),
]


def one_combination(name: str, pick: dict[str, str], quick: bool):
    """The experiment's config cut to one combination and seed 0 (quick: its digits form)."""
    sys.path.insert(0, str(ROOT / "experiments"))
    from dataclasses import replace

    from run_all import quick_config

    from coordinator.emulation.config import expand_sweep, load_config

    cfg = load_config(ROOT / "experiments" / f"{name}.toml")
    cfg.sweep = {k: [v for v in vals if (v.get("label") if isinstance(v, dict) else v) == pick[k]]
                 for k, vals in cfg.sweep.items() if k in pick}
    cfg.seeds = [0]
    if quick:
        cfg = quick_config(cfg)
        cfg.rounds = 3
    (_, c), = expand_sweep(cfg)
    clocks = json.loads((ROOT / "benchmarks" / "results" / "experiments" / "clock.json").read_text())["models"]
    c.clock = replace(c.clock, seconds_per_sample=dict(clocks[c.model]))
    return c


def share(cfg, run_dir: Path) -> tuple[float, float, int, float, float]:
    """(evaluation seconds / round seconds, seconds per round, rounds, the share before the
    reported rounds, the share in them) of one run."""
    from coordinator.emulation.analysis import LAST_ROUNDS
    from coordinator.emulation.emulator import Emulator

    hist = Emulator(cfg, 0, run_dir).run().history

    def part(hs) -> float:
        total = sum(float(h["round_seconds"]) for h in hs)
        return sum(float(h["eval_seconds"]) for h in hs) / total if total else 0.0

    total = sum(float(h["round_seconds"]) for h in hist)
    return (part(hist), total / len(hist), len(hist), part(hist[:-LAST_ROUNDS]), part(hist[-LAST_ROUNDS:]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=[name for name, _, _ in CASES], help="this experiment's case alone")
    args = ap.parse_args()
    from dataclasses import replace

    cases = [c for c in CASES if c[0] == args.only] if args.only else CASES[:1] if args.quick else CASES
    with tempfile.TemporaryDirectory(prefix="fedbit-evalshare-") as tmp:
        for name, pick, label in cases:
            cfg = one_combination(name, pick, args.quick)
            old = replace(cfg, data=replace(cfg.data, validation=0.0))
            a_share, a_round, *_ = share(old, Path(tmp) / f"{name}-old")
            n_share, n_round, rounds, first, last = share(cfg, Path(tmp) / f"{name}-new")
            case = f"{name} {label}, {rounds} rounds, seed 0" + (" (quick: digits)" if args.quick else "")
            print(json.dumps({"bench": "eval_share", "case": case, "metric": "eval_share", "value": round(n_share, 4),
                              "unit": "fraction of round time", "anchor": "the test split every round",
                              "anchor_value": round(a_share, 4), "ratio": round(n_share / a_share, 4),
                              "round_seconds": round(n_round, 3), "anchor_round_seconds": round(a_round, 3),
                              "first_rounds_share": round(first, 4), "reported_rounds_share": round(last, 4)}))
            print(json.dumps({"bench": "eval_share", "case": case, "metric": "eval_share", "value": round(n_share, 4),
                              "unit": "fraction of round time", "anchor": "target", "anchor_value": TARGET,
                              "ratio": round(n_share / TARGET, 4)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
