"""Run the papers' experiments on the emulator (``make experiments``).

    python experiments/run_all.py [--out runs/experiments] [NAME ...]

Runs every ``experiments/<name>.toml`` (or the named ones) with every sweep combination
and seed, then copies each sweep's ``summary.md`` and ``results.json`` to
``benchmarks/results/experiments/<name>.md`` / ``.json`` / ``.png`` (the mean accuracy
curves; docs/experiments.md quotes and shows them). The
compute model (seconds per training sample of each variant) is measured once and pinned
for every run, so the simulated times of all experiments share one clock; the values
are written beside the results (``clock.json``), and a run of named experiments reuses
them unless ``--calibrate``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "benchmarks" / "results" / "experiments"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs") / "experiments")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a key in every config (e.g. seeds=[0])")
    ap.add_argument("--calibrate", action="store_true",
                    help="measure the compute model again (default: a run of named experiments "
                         "reuses the one in clock.json, so that all results share one clock)")
    ap.add_argument("names", nargs="*", help="experiment names (default: every experiments/*.toml)")
    args = ap.parse_args()

    import tomllib

    from coordinator.emulation.clock import calibrate
    from coordinator.emulation.config import load_config
    from coordinator.emulation.sweep import run_experiment
    from edge_client.data import load_digits

    overrides = {}
    for item in args.set:
        k, _, v = item.partition("=")
        overrides[k] = tomllib.loads(f"v = {v}")["v"]
    paths = sorted(HERE.glob("*.toml"))
    if args.names:
        paths = [p for p in paths if p.stem in args.names]
    pinned = RESULTS / "clock.json"
    if pinned.is_file() and args.names and not args.calibrate:
        clock = json.loads(pinned.read_text())["seconds_per_sample"]  # the other results' clock
    else:
        clock = calibrate("digits_cnn", ["float32", "int16", "int8", "int6"],
                          load_digits("train").subset(list(range(64))))
        RESULTS.mkdir(parents=True, exist_ok=True)
        pinned.write_text(json.dumps({"seconds_per_sample": clock}, indent=1))
    for path in paths:
        t0 = time.monotonic()
        cfg = load_config(path, overrides | {"clock.seconds_per_sample": clock})
        out = args.out / path.stem
        if out.exists():
            shutil.rmtree(out)
        print(f"== {path.name} -> {out}", flush=True)
        summary = run_experiment(cfg, out, echo=lambda m: print("  " + m, flush=True))
        shutil.copyfile(summary, RESULTS / f"{path.stem}.md")
        for name, suffix in (("results.json", ".json"), ("accuracy.png", ".png")):
            if (out / name).is_file():
                shutil.copyfile(out / name, RESULTS / f"{path.stem}{suffix}")
        print(f"   {time.monotonic() - t0:.0f} s; {RESULTS / (path.stem + '.md')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
