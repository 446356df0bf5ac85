"""Int training throughput of one model in this interpreter (tools/py39_check.sh and
tools/device_check.sh run it on the host and in a root filesystem; runs on Python 3.9).

``train_probe.py MODEL STEPS`` prints one JSON line: samples/s of STEPS steps (batch 32,
256 random samples, after a first step that compiles or loads the kernels; with
``--chunks K``, of the fastest of K runs of STEPS steps: the least disturbed one on a
shared machine), the same per second of this process's CPU time (``samples_per_cpu_s``:
what a core gives, nearly blind to other processes' load), the first step's seconds and
the peak RSS (MB).

``train_probe.py MODEL STEPS --serve`` keeps the trainer and answers each line read from
stdin with one such measurement of STEPS more steps, so that two interpreters can be
measured in turns (interleaved: the machine's load falls on both alike).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

BATCH = 32
SAMPLES = 256


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("steps", type=int)
    ap.add_argument("--bits", type=int, default=8)
    ap.add_argument("--chunks", type=int, default=1, help="best of this many runs of STEPS steps")
    ap.add_argument("--serve", action="store_true", help="one measurement per stdin line")
    args = ap.parse_args(argv)

    import numpy as np

    from edge_client.data import Dataset
    from edge_client.trainers import IntTrainer
    from firmware_models import get_spec

    spec = get_spec(args.model)
    rng = np.random.default_rng(0)
    data = Dataset(rng.random((SAMPLES, *spec.input_shape), dtype=np.float32),
                   rng.integers(0, spec.num_classes, SAMPLES).astype(np.int64))
    trainer = IntTrainer(spec, args.bits, seed=0)
    t0 = time.perf_counter()
    trainer.train(data, steps=1, batch=BATCH)
    first = time.perf_counter() - t0

    def measure() -> dict:
        dt = cpu = float("inf")
        for _ in range(max(1, args.chunks)):
            t0, c0 = time.perf_counter(), time.process_time()
            trainer.train(data, steps=args.steps, batch=BATCH)
            dt = min(dt, time.perf_counter() - t0)
            cpu = min(cpu, time.process_time() - c0)
        return {"model": args.model, "bits": args.bits, "python": sys.version.split()[0],
                "samples_per_s": args.steps * BATCH / dt,
                "samples_per_cpu_s": args.steps * BATCH / max(cpu, 1e-9), "first_step_s": first,
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}

    if not args.serve:
        print(json.dumps(measure()), flush=True)
        return 0
    print(json.dumps({"ready": True, "first_step_s": first}), flush=True)
    for _ in sys.stdin:
        print(json.dumps(measure()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
