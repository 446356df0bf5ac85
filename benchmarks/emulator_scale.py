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

Start-up is measured alike on both sides: process start to the end of the first round,
minus one steady round. Peak RSS sums the whole process tree (psutil, sampled every 0.2 s).

The anchor users would pick instead is Flower's simulation engine (Ray): issue 10 quotes
Flower 1.40 on this kind of machine, 10 clients per round of a tiny softmax regression on
digits: 0.24 s/round at N = 1,000, 0.68 s/round at N = 10,000 (2.8x), peak RSS 1.06-1.09 GB,
5-6 s start-up. ``--flower PYTHON`` (or ``FEDBIT_FLOWER_PYTHON``) names an interpreter with
``flwr[simulation]`` installed (never a fedbit dependency); the same job then runs on
Flower in this run (``benchmarks/_flower_side.py``) and each fedbit figure gets a
``flower`` line with Flower's as its anchor.

Run: ``.venv/bin/python benchmarks/emulator_scale.py [--quick]``; prints JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

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
    from coordinator.emulation.config import from_dict
    from coordinator.emulation.run import Emulator

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
    round_s = statistics.median(h["round_seconds"] for h in steady)
    print(json.dumps({
        "n": n, "startup_s": starts[1] + hist[0]["round_seconds"] - t0 - round_s,
        "round_s": round_s,
        "coordinator_s": statistics.median(h["coordinator_seconds"] for h in steady),
        "device_train_s": statistics.median(h["device_train_seconds"] for h in steady),
        "selected": [h["selected"] for h in hist],
    }), flush=True)


def run_tree(cmd: list[str], timeout: float = 3600) -> tuple[dict, float]:
    """Run ``cmd``; (its last JSON line, peak RSS in MB of it and all its descendants)."""
    import psutil

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [0.0]
    done = threading.Event()

    def sample() -> None:
        root = psutil.Process(proc.pid)
        while not done.wait(0.2):
            try:
                procs = [root, *root.children(recursive=True)]
                total = 0
                for p in procs:
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
                peak[0] = max(peak[0], total / 2**20)
            except psutil.Error:
                return

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        done.set()
        th.join()
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[1:]} failed:\n{err[-4000:]}")
    line = next(ln for ln in reversed(out.splitlines()) if ln.startswith("{"))
    return json.loads(line), peak[0]


def flower_python(arg: str | None) -> str | None:
    """An interpreter that has flwr: ``--flower``, ``FEDBIT_FLOWER_PYTHON``, or this one."""
    for cand in (arg, os.environ.get("FEDBIT_FLOWER_PYTHON")):
        if cand:
            return cand
    try:
        import importlib.util

        return sys.executable if importlib.util.find_spec("flwr") else None
    except (ImportError, ValueError):
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N = 1,000 and 10,000 only, fewer rounds")
    ap.add_argument("--flower", metavar="PYTHON", help="an interpreter with flwr[simulation] (the anchor)")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=ROUNDS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.rounds)
        return
    sizes = [1_000, 10_000] if args.quick else [1_000, 10_000, 100_000]
    rounds = 6 if args.quick else ROUNDS + 4
    flwr_py = flower_python(args.flower)
    results, flower = {}, {}
    for n in sizes:
        results[n], results[n]["rss_mb"] = run_tree([sys.executable, __file__, "--worker", str(n),
                                                     "--rounds", str(rounds)])
        assert all(s == SELECTED for s in results[n]["selected"]), results[n]["selected"]
        if flwr_py and n <= 10_000 or flwr_py and not args.quick:
            flower[n], flower[n]["rss_mb"] = run_tree([flwr_py, str(HERE / "_flower_side.py"), str(n),
                                                       str(rounds), str(SELECTED)])
    base = results[1_000]
    for n in sizes:
        r = results[n]
        case = f"N={n:,} registered, {SELECTED} selected"
        emit(case, "round_seconds", r["round_s"], "s", "same at N=1,000", base["round_s"], rounds=rounds)
        emit(case, "rss", r["rss_mb"], "MB", "budget", RSS_BUDGET_MB)
        emit(case, "startup_seconds", r["startup_s"], "s", "same at N=1,000", base["startup_s"])
        emit(case, "coordinator_seconds", r["coordinator_s"], "s/round", "devices' training s/round",
             r["device_train_s"])
        if n in flower:
            f = flower[n]
            for metric, key, unit in (("round_seconds", "round_s", "s"), ("rss", "rss_mb", "MB"),
                                      ("startup_seconds", "startup_s", "s")):
                emit(f"{case} vs Flower", metric, r[key], unit, "Flower run_simulation (Ray), same run", f[key])


if __name__ == "__main__":
    main()
