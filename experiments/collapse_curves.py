"""Before/after curves of issue 27's reproduction (docs/training-health.md).

    python experiments/collapse_curves.py --run before=RUN_DIR --run after=RUN_DIR \
        [--out benchmarks/results/experiments/fashion-collapse-curves] [--title TEXT]

Each ``RUN_DIR`` is an emulated run folder (``fedbit emulate ... --out RUN_DIR``, one
seed) whose metrics carry the coordinator's health record. Writes ``OUT.png`` (top: every
group's accuracy per round; bottom: the live filters of ``conv1`` in the Int8 forward,
and the live units of every other layer as a fraction) and ``OUT.json`` (the same figures
per round, the collapses and rollbacks).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "experiments"


def curves(run_dir: Path) -> dict:
    """Per round: each group's accuracy, the live units of each layer (int8 forward), and
    the rounds that collapsed or were rolled back."""
    recs = [json.loads(line) for line in (run_dir / "out" / "metrics.jsonl").read_text().splitlines() if line]
    groups = sorted({g for r in recs for g in r["groups"]})
    layers = list(recs[0]["health"]["groups"]["int8"])
    return {
        "run": str(run_dir), "rounds": [r["round"] for r in recs],
        "accuracy": {g: [r["groups"].get(g, {}).get("accuracy") for r in recs] for g in groups},
        "live": {name: [r["health"]["groups"]["int8"][name]["live"] for r in recs] for name in layers},
        "units": {name: recs[0]["health"]["groups"]["int8"][name]["units"] for name in layers},
        "collapse": {r["round"]: r["health"]["collapse"] for r in recs if r["health"]["collapse"]},
        "rolled_back": [r["round"] for r in recs if r["health"]["rolled_back"]],
        "rolled_back_accuracy": {r["round"]: r["health"].get("rolled_back_accuracy") for r in recs
                                 if r["health"]["rolled_back"]},
    }


def plot(runs: dict[str, dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=(3, 2))
    styles = ["--", "-", ":", "-."]
    colors = {"float32": "tab:blue", "int8": "tab:orange", "int6": "tab:green"}
    for k, (label, c) in enumerate(runs.items()):
        ls = styles[k % len(styles)]
        for g, acc in c["accuracy"].items():
            ax.plot(c["rounds"], [100 * a if a is not None else float("nan") for a in acc], ls,
                    color=colors.get(g), label=f"{label}: {g}")
        for r in c["rolled_back"]:
            ax.axvline(r, color="tab:red", alpha=0.3, lw=1)
        bx.plot(c["rounds"], c["live"]["conv1"], ls, color="black", label=f"{label}: conv1 live filters")
    ax.axhline(78, color="grey", lw=0.8)
    ax.set_ylabel("test accuracy (%)")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    ax.set_title(title, fontsize=10)
    bx.set_ylabel("conv1 filters that can fire")
    bx.set_xlabel("round")
    bx.set_ylim(0, 17)
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="append", required=True, metavar="LABEL=RUN_DIR")
    ap.add_argument("--out", type=Path, default=RESULTS / "fashion-collapse-curves")
    ap.add_argument("--title", default="Issue 27's reproduction: Fashion-MNIST, 3 Int6 + 3 Int8 + 3 float32 "
                                        "(Int8 forward), seed 31")
    args = ap.parse_args()
    runs = {}
    for item in args.run:
        label, _, d = item.partition("=")
        runs[label] = curves(Path(d))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(runs, indent=1))
    plot(runs, args.out.with_suffix(".png"), args.title)
    print(f"wrote {args.out.with_suffix('.png')} and {args.out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
