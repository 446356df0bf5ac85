"""Training throughput of the Int8 engine vs PyTorch float32, one thread each.

Prints JSON lines (docs/architecture.md#benchmarks):

- ``throughput`` (samples/s) of Int8 IntTrainer steps, batch 32, random data, anchored
  on PyTorch float32 training of the same architecture (TorchTrainer's model, SGD) on
  the same CPU with ``torch.set_num_threads(1)``; models ``fedshift_cnn`` and
  ``digits_cnn``;
- ``rss`` (MB): peak resident memory of a separate Int8 training process (fedshift_cnn),
  anchored on the 200 MB budget;
- ``warm_start_s``: time from process start to the end of the first training step of a
  second run (Numba cache hit), anchored on the 3 s budget.

``--quick`` runs fewer steps (CI, < 60 s). Integer work runs in subprocesses with
``NUMBA_NUM_THREADS=1`` so torch and numba never share a process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MODELS = ("fedshift_cnn", "digits_cnn")
BATCH = 32
DATA_SAMPLES = 256  # random samples, cycled through (memory does not grow with steps)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def emit(case: str, metric: str, value: float, unit: str, anchor: str,
         anchor_value: float) -> None:
    print(json.dumps({
        "bench": "train_throughput", "case": case, "metric": metric,
        "value": round(value, 4), "unit": unit, "anchor": anchor,
        "anchor_value": round(anchor_value, 4),
        "ratio": round(value / anchor_value, 4) if anchor_value else None,
    }), flush=True)


# ----------------------------------------------------------------------------- workers


def _random_data(name: str, n: int, seed: int = 0):
    import numpy as np

    from edge_client.data import Dataset
    from firmware_models import get_spec

    spec = get_spec(name)
    rng = np.random.default_rng(seed)
    x = rng.random((n, *spec.input_shape), dtype=np.float32)
    y = rng.integers(0, spec.num_classes, n).astype(np.int64)
    return spec, Dataset(x, y)


def worker_int(name: str, steps: int, bits: int) -> dict:
    """Int training throughput in this process (samples/s), after one warm-up step."""
    import resource

    from edge_client.trainers import IntTrainer

    spec, data = _random_data(name, DATA_SAMPLES)
    tr = IntTrainer(spec, bits, seed=0)
    tr.train(data, steps=1, batch=BATCH)          # compile / cache load, buffers
    rate = _best_rate(lambda k: tr.train(data, steps=k, batch=BATCH), steps)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    return {"samples_per_s": rate, "rss_mb": rss_mb}


def _best_rate(run, steps: int, chunks: int = 4) -> float:
    """Samples/s of the fastest of ``chunks`` timed runs of steps/chunks steps each (the
    machine is shared: the best chunk is the least disturbed one, for both engines)."""
    per = max(1, steps // chunks)
    best = float("inf")
    for _ in range(chunks):
        t0 = time.perf_counter()
        run(per)
        best = min(best, time.perf_counter() - t0)
    return per * BATCH / best


def worker_torch(name: str, steps: int) -> dict:
    import torch

    from edge_client.trainers import TorchTrainer

    torch.set_num_threads(1)
    spec, data = _random_data(name, DATA_SAMPLES)
    tr = TorchTrainer(spec, seed=0)
    tr.train(data, steps=2, batch=BATCH)
    return {"samples_per_s": _best_rate(lambda k: tr.train(data, steps=k, batch=BATCH), steps)}


def worker_first_step(name: str, bits: int) -> dict:
    """Seconds from interpreter start (passed in env) to the end of the first step."""
    from edge_client.trainers import IntTrainer

    spec, data = _random_data(name, BATCH)
    tr = IntTrainer(spec, bits, seed=0)
    tr.train(data, steps=1, batch=BATCH)
    t_start = float(os.environ["FEDBIT_BENCH_T0"])
    return {"seconds": time.time() - t_start}


def run_worker(*args: str) -> dict:
    env = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               FEDBIT_BENCH_T0=repr(time.time()))
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", *args],
                         capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"worker {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (CI)")
    ap.add_argument("--bits", type=int, default=8)
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        kind, name, *rest = args.worker
        if kind == "int":
            res = worker_int(name, int(rest[0]), int(rest[1]))
        elif kind == "torch":
            res = worker_torch(name, int(rest[0]))
        else:
            res = worker_first_step(name, int(rest[0]))
        print(json.dumps(res))
        return 0

    steps = {"fedshift_cnn": 8 if args.quick else 40, "digits_cnn": 40 if args.quick else 300}
    bits = args.bits
    run_worker("first", "digits_cnn", str(bits))      # fills the Numba cache if cold
    for name in MODELS:
        ti = run_worker("int", name, str(steps[name]), str(bits))
        tt = run_worker("torch", name, str(steps[name]))
        emit(f"{name} int{bits}", "throughput", ti["samples_per_s"], "samples/s",
             f"{name} torch float32 1 thread", tt["samples_per_s"])
        if name == "fedshift_cnn":
            emit(f"{name} int{bits}", "rss", ti["rss_mb"], "MB", "budget", 200.0)
    warm = run_worker("first", "fedshift_cnn", str(bits))
    emit(f"fedshift_cnn int{bits}", "warm_start_s", warm["seconds"], "s", "budget", 3.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
