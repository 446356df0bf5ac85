"""What secure aggregation costs: one SecAgg+ round of 100 devices of ``mnist_cnn``
(206,736 parameters) with 10 % of them dropping after sharing their keys (before their
masked input: the costly case, whose pairwise masks the coordinator must rebuild).

Cases, all from one round of ``coordinator.privacy.loopback`` (the coordinator's
``SecAggServer`` and 100 ``SecAggClient``s in this process, every message encoded and
decoded; each party's CPU time is its thread time in its own calls):

- ``coordinator_seconds``: the coordinator's CPU for the round (routing, summing, the
  reconstruction of 90 self-masks and 10 mask keys, the masks' removal, its messages'
  encoding and decoding) against Flower 1.40's ``SecAggPlusWorkflow`` on the same model
  size, devices, shares (15 = k + 1) and threshold (8), with 10 devices failing at the
  masked-vector stage: the CPU time of Flower's server app thread for the round
  (``_flower_secagg.py`` in Flower's venv; ``--flower PYTHON`` or ``FEDBIT_FLOWER_PYTHON``,
  else ``.venv-flower`` when there is one); target ratio <= 1/3;
- ``device_cpu_seconds``: the slowest device's CPU for the round (keys, signatures, shares,
  sealing, masking with k = 14 neighbours, its vector's encoding) on one core of this
  machine, against the budget of 1 s; ``pi4_estimate`` scales it by the raspberry-pi-4
  profile's ``relative_speed``;
- ``uplink_bytes``: a surviving device's bytes over the round (all four messages) against
  its unmasked Int8 update (the ``int`` codec at 8 bits).

Run: ``.venv/bin/python benchmarks/secagg.py [--quick] [--flower PYTHON]``; prints JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from coordinator.privacy import dp
from coordinator.privacy.loopback import Costs, run_round
from coordinator.privacy.secagg import SecAggParams, SecAggServer
from edge_client.protocol import Update, encode_message
from edge_client.runtime import encode_update_tensors
from edge_client.secagg import crypto
from edge_client.secagg.encode import Grid, secure_vector
from firmware_models import resolve_model
from hw_profiles import load_profile

HERE = Path(__file__).resolve().parent


def emit(case: str, metric: str, value: float, unit: str, anchor: str, anchor_value: float | None, **extra) -> None:
    print(json.dumps({"bench": "secagg", "case": case, "metric": metric, "value": round(value, 5), "unit": unit,
                      "anchor": anchor, "anchor_value": None if anchor_value is None else round(anchor_value, 5),
                      "ratio": round(value / anchor_value, 4) if anchor_value else None, **extra}), flush=True)


def flower_python(arg: str | None) -> str | None:
    for cand in (arg, os.environ.get("FEDBIT_FLOWER_PYTHON"), str(HERE.parent / ".venv-flower" / "bin" / "python")):
        if cand and Path(cand).exists():
            return cand
    return None


def fedbit_round(model: str, n: int, dropped: int, seed: int = 0) -> tuple[Costs, dict, float]:
    spec = resolve_model(model)
    shapes = [tuple(s) for s in spec.param_shapes()]
    params = sum(int(np.prod(s)) for s in shapes)
    ids = [f"dev-{i:03d}" for i in range(n)]
    keys = {u: crypto.identity_keypair()[0] for u in ids}
    rng = np.random.default_rng(seed)
    updates = {u: [rng.integers(-20, 21, s).astype(np.int8) for s in shapes] for u in ids}  # Int8 grid deltas
    grid = Grid(params, frac_bits=dp.secure_frac_bits(1.0, 600.0 * n))
    srv = SecAggServer("bench", 1, ids, grid, lambda u: 0, SecAggParams())
    costs = Costs()
    t0 = time.perf_counter()
    run_round(srv, keys, lambda u, g: secure_vector(updates[u], g, 600, np.random.default_rng(1), int_bits=8),
              drop={u: "masked" for u in ids[:dropped]}, costs=costs)
    wall = time.perf_counter() - t0
    int8 = encode_message(Update(ids[-1], 1, 600, 8, "delta", encode_update_tensors(
        [u.astype(np.float32) for u in updates[ids[-1]]], spec.param_names(), "int", 8,
        int_weights=updates[ids[-1]], compute_bits=8, delta=True)))
    return costs, {"degree": srv.degree, "threshold": srv.threshold, "survivors": len(srv.survivors),
                   "int8_bytes": len(int8), "shapes": shapes}, wall


def flower_round(py: str, n: int, shares: int, threshold: int, dropped: int, shapes: list) -> dict:
    cmd = [py, str(HERE / "_flower_secagg.py"), str(n), str(shares), str(threshold), str(dropped),
           json.dumps([list(s) for s in shapes])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=7200)
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"Flower's round failed: {proc.stderr[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="20 devices of digits_cnn, no Flower")
    ap.add_argument("--flower", metavar="PYTHON", help="an interpreter with flwr[simulation] (the anchor)")
    args = ap.parse_args()
    model, n = ("digits_cnn", 20) if args.quick else ("mnist_cnn", 100)
    dropped = n // 10
    costs, info, wall = fedbit_round(model, n, dropped)
    case = f"{model} {n} devices, {dropped} drop after sharing keys"
    flwr = None if args.quick else flower_python(args.flower)
    anchor = flower_round(flwr, n, info["degree"] + 1, info["threshold"], dropped, info["shapes"]) if flwr else None
    emit(case, "coordinator_seconds", costs.server, "s",
         "Flower 1.40 SecAggPlusWorkflow server CPU" if anchor else "none (no Flower venv)",
         anchor["server_cpu_s"] if anchor else None, target="<= 0.333", timing="thread CPU time, one round",
         k=info["degree"], t=info["threshold"], survivors=info["survivors"], fedbit_round_wall_s=round(wall, 3),
         flower=anchor)
    dev = sorted(costs.devices.values())
    speed = load_profile("raspberry-pi-4").relative_speed
    emit(case, "device_cpu_seconds", dev[-1], "s", "budget", 1.0, target="<= 1.0", median=round(statistics.median(dev), 5),
         pi4_estimate=round(dev[-1] / speed, 4), pi4_relative_speed=speed, timing="thread CPU time, slowest device")
    survivor = next(u for u in sorted(costs.uplink) if u.endswith(f"{n - 1:03d}"))
    emit(case, "uplink_bytes", costs.uplink[survivor], "B", "unmasked Int8 update (int codec, 8 bits)",
         info["int8_bytes"], note="keys + shares + masked uint32 vector + reveal of one surviving device")


if __name__ == "__main__":
    sys.exit(main())
