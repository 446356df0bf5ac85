"""How the emulator scales: with the cores (workers), with the registered fleet, and
against Flower's simulation engine (issue 20).

Every run is a fresh subprocess (in-process devices, ``transport = "inproc"``); figures
are ratios against an anchor measured in the same run.

1. **Workers.** 16 Int8 ``digits_cnn`` devices (raspberry-pi-4), each 200 local steps of
   batch 32 per round, all selected, FedAvg: ``round_seconds`` with ``workers = 2`` (and
   ``workers = <cores>`` on a larger machine) against one core: ``workers = 1`` with
   ``round.parallel = 1`` (one device training at a time in the emulator's process, the
   emulator before issue 20), and the ``speedup`` against its target (1.7x for 2
   workers, 10x for 16) and against what the machine allows at that moment
   (``speedup_vs_machine``: the same Int8 training in ``workers`` independent processes
   against one; on a machine shared with other work that is well under ``workers``).
   For information, ``workers = 1`` with the default ``round.parallel = 2``: two devices
   training at once on threads of one process (the kernels release the GIL), against
   the same one-core anchor.
2. **Registered fleet.** N = 1,000 / 10,000 / 100,000 / 1,000,000 registered devices, 10
   selected per round, ``mlp`` on digits (each device 32 samples drawn for it,
   ``partition = "sample"``), half Int8 (raspberry-pi-4), half float32 (desktop), the
   default ``round.workers = 0`` (auto: rounds this light stay in the emulator's process):
   ``round_seconds`` (anchor: N = 1,000; target <= 1.3),
   ``startup_seconds`` (process start to the end of round 1 minus one steady round:
   imports, the fleet, registering it, the workers' start; anchor: the 30 s budget),
   ``rss`` and ``pss`` (peak of the process tree, MB, sampled every 0.2 s; RSS counts the
   libraries every process maps once per process, PSS shares them out; anchor: the
   1,000 MB budget), ``coordinator_seconds`` (the coordinator's own time per round,
   anchored on the devices' training time).
3. **Flower** (``--flower PYTHON``, or ``FEDBIT_FLOWER_PYTHON``: an interpreter with
   ``flwr[simulation]`` and torch; ``make bench-flower`` makes ``.venv-flower``): the
   registered-fleet job on Flower 1.40's simulation (Ray; a softmax regression per client,
   ``benchmarks/_flower_side.py``) at N = 1,000 / 10,000 / 100,000, each fedbit figure
   anchored on Flower's (targets: >= 5x faster per round at 10,000 and 100,000, <= 0.4x
   its memory); and the float32 ``mlp`` job, 1,000 registered, 100 selected per round,
   every core busy on both sides (fedbit: one worker per core; Flower: one client per
   CPU): ``rounds_per_s`` anchored on Flower's (target >= 2x).

``--quick`` (the test suite): 4 devices x 20 steps for the workers (workers=2 only); N =
1,000 and 1,000,000, 3 rounds; no Flower.

Run: ``.venv/bin/python benchmarks/emulator_scale.py [--quick] [--flower PYTHON]``;
prints JSON lines.
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

SELECTED = 10
#: rounds of the registered-fleet runs (the median of all but the first is quoted)
ROUNDS = 16
BUDGET_MB = 1000.0
STARTUP_BUDGET_S = 30.0


def emit(case: str, metric: str, value: float, unit: str, anchor: str, anchor_value: float, **extra) -> None:
    print(json.dumps({"bench": "emulator_scale", "case": case, "metric": metric, "value": round(value, 4),
                      "unit": unit, "anchor": anchor, "anchor_value": round(anchor_value, 4),
                      "ratio": round(value / anchor_value, 4) if anchor_value else None, **extra}), flush=True)


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# --------------------------------------------------------------------------- one run


def run_once(kind: str, n: int, rounds: int, workers: int, steps: int) -> None:
    """One emulated run in this process; prints its figures as one JSON line."""
    t0 = time.monotonic()
    from coordinator.emulation.config import from_dict
    from coordinator.emulation.emulator import Emulator

    starts: dict[int, float] = {}

    def on_event(event: str, f: dict) -> None:
        if event == "round_start":
            starts[f["round"]] = time.monotonic()

    clock = {"seconds_per_sample": {"int8": 2e-5, "float32": 1e-4}}
    if kind.startswith("workers"):  # n Int8 digits_cnn devices, all selected, `steps` steps each
        raw = {"model": "digits_cnn", "devices": {"raspberry-pi-4": n}, "data": {"partition": "iid"},
               "train": {"steps": steps, "batch": 32}, "round": {"fraction": 1.0}}
        if kind == "workers-serial":  # one device training at a time: one core
            raw["round"]["parallel"] = 1
    elif kind == "mlp":  # n float32 mlp devices, 100 selected
        raw = {"model": "mlp", "devices": {"desktop": n}, "data": {"partition": "sample", "per_device": 32},
               "train": {"epochs": 1, "batch": 32}, "round": {"fraction": 100 / n}}
    else:  # the registered fleet: half Int8, half float32, 10 selected
        raw = {"model": "mlp", "devices": {"raspberry-pi-4": n // 2, "desktop": n - n // 2},
               "data": {"partition": "sample", "per_device": 32}, "train": {"epochs": 1, "batch": 32},
               "round": {"fraction": SELECTED / n}}
    raw |= {"name": kind, "rounds": rounds, "strategy": "fedavg", "transport": "inproc", "clock": clock}
    raw["round"] |= {"deadline_s": 0.0, "workers": workers}
    cfg = from_dict(raw, f"emulator_scale {kind} N={n}")
    with tempfile.TemporaryDirectory(prefix="fedbit-scale-") as tmp:
        res = Emulator(cfg, 0, Path(tmp) / "run", on_event=on_event).run()
    hist = res.history
    steady = hist[1:]
    round_s = statistics.median(h["round_seconds"] for h in steady)
    print(json.dumps({
        "n": n, "workers": res.info["workers"], "startup_s": starts[1] + hist[0]["round_seconds"] - t0 - round_s,
        "round_s": round_s,
        "coordinator_s": statistics.median(h["coordinator_seconds"] for h in steady),
        "device_train_s": statistics.median(h["device_train_seconds"] for h in steady),
        "selected": [h["selected"] for h in hist], "accepted": [h["accepted"] for h in hist],
    }), flush=True)


def run_tree(cmd: list[str], timeout: float = 3600, env: dict | None = None) -> tuple[dict, float, float]:
    """Run ``cmd``; (its last JSON line, peak RSS and peak PSS in MB of it and all its
    descendants)."""
    import psutil

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    peak = [0.0, 0.0]
    done = threading.Event()

    def sample() -> None:
        root = psutil.Process(proc.pid)
        while not done.wait(0.2):
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                return
            rss = pss = 0
            for p in procs:
                try:
                    m = p.memory_full_info()
                    rss, pss = rss + m.rss, pss + m.pss
                except psutil.Error:
                    pass
            peak[0], peak[1] = max(peak[0], rss / 2**20), max(peak[1], pss / 2**20)

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
    return json.loads(line), peak[0], peak[1]


def fedbit(kind: str, n: int, rounds: int, workers: int, steps: int = 0) -> dict:
    res, rss, pss = run_tree([sys.executable, __file__, "--run", kind, str(n), str(rounds), str(workers), str(steps)])
    return res | {"rss_mb": rss, "pss_mb": pss}


#: Ray binds its node to the loopback interface only with this (else to the machine's
#: outward address)
RAY_LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def flower(py: str, n: int, rounds: int, selected: int, job: str) -> dict:
    res, rss, pss = run_tree([py, str(HERE / "_flower_side.py"), str(n), str(rounds), str(selected), job],
                             env=os.environ | RAY_LOOPBACK)
    return res | {"rss_mb": rss, "pss_mb": pss}


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


# --------------------------------------------------------------------------- the three parts


def train_steps(steps: int) -> None:
    """``steps`` Int8 ``digits_cnn`` training steps of batch 32 (one device's work, warm)."""
    import numpy as np

    from edge_client.data import load_digits
    from edge_client.trainers import make_trainer
    from firmware_models import get_spec

    data = load_digits("train").subset(np.arange(256))
    trainer = make_trainer(get_spec("digits_cnn"), 8, seed=0)
    trainer.train(data, steps=1, batch=32)
    t0 = time.perf_counter()
    trainer.train(data, steps=steps, batch=32)
    print(json.dumps({"seconds": time.perf_counter() - t0}), flush=True)


def capacity(w: int, steps: int) -> float:
    """How many times one process's training throughput ``w`` independent processes get
    on this machine now (the parallel speed-up a loaded machine allows): one process,
    then ``w`` at once, each training ``steps`` steps."""
    def run(k: int) -> float:
        procs = [subprocess.Popen([sys.executable, __file__, "--train", str(steps)], stdout=subprocess.PIPE, text=True)
                 for _ in range(k)]
        return max(json.loads(p.communicate()[0].splitlines()[-1])["seconds"] for p in procs)

    return w * run(1) / run(w)


def bench_workers(quick: bool) -> None:
    n, steps, rounds = (4, 20, 2) if quick else (16, 200, 8)
    counts = [2] if quick else [1, 2] + ([cores()] if cores() > 2 else [])
    one_core = fedbit("workers-serial", n, rounds, 1, steps)
    res = {w: fedbit("workers", n, rounds, w, steps) for w in counts}
    anchor = "workers=1, one device at a time (one core), same run"
    for w in counts:
        r = res[w]
        assert r["workers"] == w and all(a == n for a in r["accepted"]), r
        case = (f"{n} Int8 digits_cnn devices x {steps} steps, workers={w} on {cores()} cores"
                + (" (two device threads in one process: information)" if w == 1 else ""))
        emit(case, "round_seconds", r["round_s"], "s", anchor, one_core["round_s"], rounds=rounds)
        if w == 1:
            continue
        speedup = one_core["round_s"] / r["round_s"]
        emit(case, "speedup", speedup, "x", "target", 1.7 if w == 2 else 10.0 * w / 16)
        if not quick:
            emit(case, "speedup_vs_machine", speedup, "x", f"{w} independent training processes vs 1, same run",
                 capacity(w, n * steps // w))


def bench_registered(quick: bool, workers: int, flwr_py: str | None) -> None:
    sizes = [1_000, 1_000_000] if quick else [1_000, 10_000, 100_000, 1_000_000]
    rounds = 3 if quick else ROUNDS
    res = {}
    for n in sizes:
        res[n] = fedbit("registered", n, rounds, workers)
        assert all(s == SELECTED for s in res[n]["selected"]), res[n]["selected"]
    base = res[1_000]
    for n in sizes:
        r = res[n]
        case = f"N={n:,} registered, {SELECTED} selected, workers={r['workers']}"
        emit(case, "round_seconds", r["round_s"], "s", "same at N=1,000", base["round_s"], rounds=rounds)
        emit(case, "startup_seconds", r["startup_s"], "s", "budget", STARTUP_BUDGET_S)
        emit(case, "rss", r["rss_mb"], "MB", "budget", BUDGET_MB)
        emit(case, "pss", r["pss_mb"], "MB", "budget", BUDGET_MB)
        emit(case, "coordinator_seconds", r["coordinator_s"], "s/round", "devices' training s/round",
             r["device_train_s"])
    if not flwr_py:
        return
    for n in (1_000, 10_000, 100_000):
        f = flower(flwr_py, n, rounds, SELECTED, "softmax")
        r = res.get(n) or fedbit("registered", n, rounds, workers)
        case = f"N={n:,} registered, {SELECTED} selected vs Flower"
        for metric, key, unit in (("round_seconds", "round_s", "s"), ("rss", "rss_mb", "MB"),
                                  ("pss", "pss_mb", "MB"), ("startup_seconds", "startup_s", "s")):
            emit(case, metric, r[key], unit, "Flower 1.40 run_simulation (Ray), same run", f[key])


def bench_mlp_vs_flower(flwr_py: str) -> None:
    n, rounds = 1_000, 8
    r = fedbit("mlp", n, rounds, cores())
    f = flower(flwr_py, n, rounds, 100, "mlp")
    case = f"float32 mlp, {n:,} registered, 100 selected, every core busy ({cores()} cores)"
    emit(case, "rounds_per_s", 1 / r["round_s"], "rounds/s", "Flower 1.40 run_simulation (Ray), same run",
         1 / f["round_s"], workers=r["workers"])
    emit(case, "rss", r["rss_mb"], "MB", "Flower 1.40 run_simulation (Ray), same run", f["rss_mb"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few devices and N = 1,000 / 1,000,000 only")
    ap.add_argument("--flower", metavar="PYTHON", help="an interpreter with flwr[simulation] (the anchor)")
    ap.add_argument("--workers", type=int, default=0,
                    help="round.workers of the registered-fleet runs (default 0: auto)")
    ap.add_argument("--only", choices=("workers", "registered", "flower"), help="one part only")
    ap.add_argument("--run", nargs=5, help=argparse.SUPPRESS)
    ap.add_argument("--train", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.train:
        train_steps(args.train)
        return
    if args.run:
        kind, n, rounds, workers, steps = args.run
        run_once(kind, int(n), int(rounds), int(workers), int(steps))
        return
    flwr_py = None if args.quick else flower_python(args.flower)
    if args.only in (None, "workers"):
        bench_workers(args.quick)
    if args.only in (None, "registered"):
        bench_registered(args.quick, args.workers, flwr_py)
    if flwr_py and args.only in (None, "flower"):
        bench_mlp_vs_flower(flwr_py)


if __name__ == "__main__":
    main()
