"""How the emulator scales with the registered fleet (issue 10).

In-process devices (``transport = "inproc"``), 10 selected per round, N registered (1,000
and 10,000; 100,000 without ``--quick``), ``mlp`` on digits (each device 32 samples drawn
for it, ``partition = "sample"``), half Int8 (raspberry-pi-4) and half float32 (desktop)
devices, FedAvg. Each N runs in a fresh subprocess; per N it prints:

- ``round_seconds``: wall seconds per round after the first (median), anchored on the
  same figure at N = 1,000 measured in the same run (target: 10,000 / 1,000 < 1.3: the
  cost follows the selected devices, not the registered ones);
- ``rss``: peak RSS of the process tree (MB), anchored on the 500 MB budget at N = 10,000;
- ``startup_seconds``: process start to the first round's announcement (imports,
  registering N devices with the coordinator, calibration), anchored on N = 1,000;
- ``coordinator_seconds``: the coordinator's own time per round (median), anchored on
  the devices' training time in that round.

Flower 1.40's simulation engine (Ray), measured on this kind of machine with 10 clients
per round of a tiny softmax regression on digits (issue 10): 0.24 s/round at N = 1,000,
0.68 s/round at N = 10,000 (2.8x), peak RSS 1.06-1.09 GB, 5-6 s start-up. When
``flwr[simulation]`` is importable, ``--flower`` measures it in this run too.

Run: ``.venv/bin/python benchmarks/emulator_scale.py [--quick]``; prints JSON lines.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROUNDS = 6
SELECTED = 10
RSS_BUDGET_MB = 500.0


def emit(case: str, metric: str, value: float, unit: str, anchor: str, anchor_value: float, **extra) -> None:
    print(json.dumps({"bench": "emulator_scale", "case": case, "metric": metric, "value": round(value, 4),
                      "unit": unit, "anchor": anchor, "anchor_value": round(anchor_value, 4),
                      "ratio": round(value / anchor_value, 4) if anchor_value else None, **extra}), flush=True)


def worker(n: int, rounds: int) -> None:
    """One emulated run with ``n`` registered devices; prints its figures as one JSON line."""
    t0 = time.monotonic()
    from coordinator.emulator import Emulator
    from coordinator.experiment import from_dict

    starts: dict[int, float] = {}

    def on_event(event: str, f: dict) -> None:
        if event == "round_start":
            starts[f["round"]] = time.monotonic()

    cfg = from_dict({
        "name": "scale", "model": "mlp", "rounds": rounds, "strategy": "fedavg", "transport": "inproc",
        "devices": {"raspberry-pi-4": n // 2, "desktop": n - n // 2},
        "data": {"partition": "sample", "per_device": 32}, "train": {"epochs": 1, "batch": 32},
        "round": {"fraction": SELECTED / n, "deadline_s": 0.0},
        "clock": {"seconds_per_sample": {"int8": 2e-5, "float32": 1e-4}},
    }, f"emulator_scale N={n}")
    with tempfile.TemporaryDirectory(prefix="fedbit-scale-") as tmp:
        hist = Emulator(cfg, 0, Path(tmp) / "run", on_event=on_event).run().history
    steady = hist[1:]
    print(json.dumps({
        "n": n, "startup_s": starts[1] - t0,
        "round_s": statistics.median(h["round_seconds"] for h in steady),
        "coordinator_s": statistics.median(h["coordinator_seconds"] for h in steady),
        "device_train_s": statistics.median(h["device_train_seconds"] for h in steady),
        "selected": [h["selected"] for h in hist],
    }), flush=True)


def run_worker(n: int, rounds: int) -> tuple[dict, float]:
    """(figures, peak RSS in MB) of a fresh worker process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    proc = subprocess.run([sys.executable, __file__, "--worker", str(n), "--rounds", str(rounds)],
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"worker N={n} failed:\n{proc.stderr[-4000:]}")
    rss_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    line = next(ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("{"))
    return json.loads(line), max(rss_kb, before) / 1024.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N = 1,000 and 10,000 only, fewer rounds")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=ROUNDS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.rounds)
        return
    sizes = [1_000, 10_000] if args.quick else [1_000, 10_000, 100_000]
    rounds = 4 if args.quick else ROUNDS
    results = {}
    for n in sizes:
        results[n], rss = run_worker(n, rounds)
        results[n]["rss_mb"] = rss  # ru_maxrss of the children: the largest worker so far
        assert all(s == SELECTED for s in results[n]["selected"]), results[n]["selected"]
    base = results[1_000]
    for n in sizes:
        r = results[n]
        case = f"N={n:,} registered, {SELECTED} selected"
        emit(case, "round_seconds", r["round_s"], "s", "same at N=1,000", base["round_s"], rounds=rounds)
        emit(case, "rss", r["rss_mb"], "MB", "budget", RSS_BUDGET_MB)
        emit(case, "startup_seconds", r["startup_s"], "s", "same at N=1,000", base["startup_s"])
        emit(case, "coordinator_seconds", r["coordinator_s"], "s/round", "devices' training s/round",
             r["device_train_s"])


if __name__ == "__main__":
    main()
