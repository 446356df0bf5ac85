"""Streaming aggregation throughput and memory (issue 6).

Cases (fedshift_cnn, ~2.16 M float32 parameters, updates generated on the fly):
- throughput of streaming ``fedshift`` and ``prowd-swa`` (half Int8, half Float32) over
  N updates (accept + finish), in updates/s, against ``np.mean(stacked, axis=0)`` over the
  same N updates stacked, timed in the same run (stacking not timed); and of ``fedshift``
  fed asym-4 wire tensors (``fold``: decoded straight into the sums);
- peak RSS of a fresh subprocess streaming 1,000 vs 10 updates into ``fedshift``.

Run: ``.venv/bin/python benchmarks/aggregate.py [--quick]``; prints JSON lines.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import numpy as np

from coordinator.strategies import ClientUpdate, EncodedUpdate, build_strategy
from edge_client.codecs import decode, encode, get_codec
from firmware_models import get_spec

SHAPES = [tuple(s) for s in get_spec("fedshift_cnn").param_shapes()]


def make_update(i: int, base: list[np.ndarray], bits: int, via_codec: bool = False) -> ClientUpdate:
    """A distinct update, cheaply: the base model scaled and shifted per update.

    ``via_codec``: the layers go through the float32 codec (encode, then ``decode``, which
    verifies finiteness) and the update carries ``finite=True`` as the coordinator's
    decode path sets it, so the strategy does not re-read it for NaN/Inf. (Encoding and
    decoding are not timed, like the anchor's stacking.)"""
    s, t = np.float32(1 + 1e-3 * (i % 97)), np.float32(1e-4 * (i % 13))
    layers = [b * s + t for b in base]
    if via_codec:
        layers = [decode(encode(w, codec="float32")) for w in layers]
    return ClientUpdate(f"d{i}", 100 + i % 7, layers, "weights", bits, bits < 32,
                        finite=via_codec and get_codec("float32").finite_output)


def base_model(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(0.05 * rng.standard_normal(s)).astype(np.float32) for s in SHAPES]


def encoded_sets(base: list[np.ndarray], k: int = 4) -> list[tuple]:
    """``k`` distinct asym-4 encodings of perturbed base models (re-labelled per device)."""
    rng = np.random.default_rng(1)
    return [tuple(encode(b + rng.normal(0, 0.01, b.shape).astype(np.float32), codec="asym", bits=4)
                  for b in base) for _ in range(k)]


def stream_seconds(name: str, n: int, base: list[np.ndarray], via_codec: bool = False,
                   encoded: list[tuple] | None = None, **params) -> float:
    """accept (or, with ``encoded`` wire tensors, fold) of ``n`` updates + finish."""
    strat = build_strategy(name, **params)
    strat.begin_round(1, base)
    spent = 0.0
    for i in range(n):
        bits = 8 if (name.startswith("prowd") and i % 2) else 32
        if encoded is not None:
            eu = EncodedUpdate(f"d{i}", 100 + i % 7, encoded[i % len(encoded)], "weights", bits, True)
            t0 = time.perf_counter()
            strat.fold(eu)
            spent += time.perf_counter() - t0
            continue
        u = make_update(i, base, bits, via_codec)
        t0 = time.perf_counter()
        strat.accept(u)
        spent += time.perf_counter() - t0
        del u
    t0 = time.perf_counter()
    strat.finish()
    return spent + time.perf_counter() - t0


def stacked_mean_seconds(n: int, base: list[np.ndarray]) -> float:
    total = 0.0
    for layer_i in range(len(base)):  # one layer at a time: the stack of all is 8.6 MB x n
        stack = np.stack([make_update(i, base, 32).weights[layer_i] for i in range(n)])
        t0 = time.perf_counter()
        np.mean(stack, axis=0)
        total += time.perf_counter() - t0
        del stack
    return total


def emit(case: str, metric: str, value: float, unit: str, anchor: str, anchor_value: float) -> None:
    print(json.dumps({"bench": "aggregate", "case": case, "metric": metric, "value": round(value, 4),
                      "unit": unit, "anchor": anchor, "anchor_value": round(anchor_value, 4),
                      "ratio": round(value / anchor_value, 4) if anchor_value else None}), flush=True)


def rss_child(n: int) -> None:
    base = base_model()
    strat = build_strategy("fedshift")
    strat.begin_round(1, base)
    for i in range(n):
        strat.accept(make_update(i, base, 32 if i % 2 else 8))
    strat.finish()
    print(peak_self_kib())


def peak_self_kib() -> int:
    """This process's peak RSS in KiB: VmHWM (ru_maxrss survives exec on Linux, so a
    child would report its parent's peak)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def peak_rss_kib(n: int) -> int:
    out = subprocess.run([sys.executable, __file__, "--rss-child", str(n)], check=True,
                         capture_output=True, text=True).stdout
    return int(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="CI size, one pass (the path, not the figures)")
    ap.add_argument("--rss-child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rss_child is not None:
        rss_child(args.rss_child)
        return
    n = 40 if args.quick else 100
    reps = 1 if args.quick else 5  # --quick: the script's path, not its figures
    big = 200 if args.quick else 1000
    base = base_model()
    stream_seconds("fedshift", 4, base)  # numba compile / cache load outside the timing
    cases = (
        ("fedshift", {"via_codec": True}, " (decoded: finiteness verified by the codec)"),
        ("fedshift", {}, " (raw arrays: the strategy checks finiteness)"),
        ("fedshift", {"acc_dtype": "float64"}, " acc=float64 (raw arrays)"),
        ("prowd-swa", {"tau": 0.1, "via_codec": True}, " (decoded)"),
        ("fedshift", {"encoded": encoded_sets(base)},
         " (asym-4 wire tensors: fused decode+accumulate, the coordinator's path)"),
    )
    # interleaved: each pass times the anchor and every case once, so that a burst of
    # load elsewhere on the machine hits one pass of all of them, not one case's passes;
    # the best pass of each is kept
    mean_t = float("inf")
    best = [float("inf")] * len(cases)
    for _ in range(reps):
        mean_t = min(mean_t, stacked_mean_seconds(n, base))
        for k, (name, params, _) in enumerate(cases):
            best[k] = min(best[k], stream_seconds(name, n, base, **params))
    anchor = n / mean_t
    for (name, _, suffix), t in zip(cases, best, strict=True):
        emit(f"fedshift_cnn {name} n={n}{suffix}", "throughput", n / t, "updates/s", "np.mean stacked", anchor)
    small, large = peak_rss_kib(10), peak_rss_kib(big)
    emit(f"fedshift_cnn fedshift {big} vs 10 updates", "rss", large / 1024, "MiB",
         "rss 10 updates", small / 1024)


if __name__ == "__main__":
    main()
