"""Codec encode/decode times and K-means quality on FedShift's model size (2,105,000 weights).

Anchors: FedShift Table 2 (Apple M1 Pro): uniform 10 ms, K-means 179 ms (4 bits) and
2,172 ms (8 bits); scikit-learn's KMeans (n_init=1) run here, on the same data, for time
and MSE. Single-threaded numba (no parallel kernels). ``--quick``: scikit-learn at 8 bits
runs on a fixed 100,000-element subsample (ours on the same subsample for the MSE ratio,
the case name says so; full-size sklearn at 8 bits takes ~50 s here), on the Gaussian
data only.

Server-side decode (asym and kmeans, 4 and 8 bits): ``decode_ms`` with ``out=`` (into a
reused float32 buffer) and ``decode_accumulate_ms`` (``acc += w * decode(t)``, float32
``acc``), against the memory floor measured in the same run: ``np.add(acc, x, out=acc)``
over a ready float32 array of the same size.

Times are the best of 7 rounds (1 with ``--quick``) in which every case of both data
kinds runs once, in turn (see :func:`interleaved_best_ms`). Prints one JSON line per result
(docs/architecture.md#benchmarks).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from edge_client.codecs import decode, decode_accumulate, encode

N = 2_105_000
PAPER_MS = {"asym-4": 10.0, "asym-8": 10.0, "kmeans-4": 179.0, "kmeans-8": 2172.0}
CASES = (("asym", 4), ("asym", 8), ("kmeans", 4), ("kmeans", 8))


def emit(case: str, metric: str, value: float, unit: str, anchor: str, anchor_value: float) -> None:
    print(json.dumps({
        "bench": "codecs", "case": case, "metric": metric, "value": float(f"{value:.6g}"), "unit": unit,
        "anchor": anchor, "anchor_value": anchor_value,
        "ratio": round(value / anchor_value, 4) if anchor_value else None,
    }), flush=True)


def data(kind: str, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "gauss":
        return rng.normal(0, 0.05, n).astype(np.float32)
    tail = rng.random(n) < 0.05  # 5% Student-t(2) * 0.2 in N(0, 0.05)
    return np.where(tail, rng.standard_t(2, n) * 0.2, rng.normal(0, 0.05, n)).astype(np.float32)


def interleaved_best_ms(fns: dict[str, object], rounds: int) -> dict[str, float]:
    """Best time (ms) of each zero-argument callable over ``rounds`` rounds, every round
    running each callable once, in turn, after one warm-up call each (JIT cache load).

    Interleaving spreads every case over the whole measurement, so a slow spell of the
    machine (these are shared vCPUs) costs each case one round instead of whole cases."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for key, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[key] = min(best[key], (time.perf_counter() - t) * 1e3)
    return best


def time_cases(xs: dict[str, np.ndarray], rounds: int):
    """For each data kind in ``xs``: its encoded tensors per (codec, bits) of
    :data:`CASES`, and the best times (ms) of ``"<kind> <codec>-<bits> encode|decode|into|
    accumulate"`` and ``"<kind> floor"`` (the memory floor), all cases of all kinds
    interleaved in the same rounds."""
    fns: dict[str, object] = {}
    tensors: dict[str, dict[tuple[str, int], object]] = {}
    for kind, x in xs.items():
        buf = np.empty_like(x)
        acc = np.zeros_like(x)
        ts = tensors[kind] = {(c, b): encode(x, c, b) for c, b in CASES}
        fns[f"{kind} floor"] = lambda x=x, acc=acc: np.add(acc, x, out=acc)
        for (c, b), t in ts.items():
            fns[f"{kind} {c}-{b} encode"] = lambda x=x, c=c, b=b: encode(x, c, b)
            fns[f"{kind} {c}-{b} decode"] = lambda t=t: decode(t)
            fns[f"{kind} {c}-{b} into"] = lambda t=t, buf=buf: decode(t, out=buf)
            fns[f"{kind} {c}-{b} accumulate"] = lambda t=t, acc=acc: decode_accumulate(t, acc, 0.01)
    return tensors, interleaved_best_ms(fns, rounds)


def mse(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean((y.astype(np.float64) - x) ** 2))


def sklearn_kmeans(x: np.ndarray, bits: int) -> tuple[float, float]:
    from sklearn.cluster import KMeans
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):
        t = time.perf_counter()
        km = KMeans(2**bits, n_init=1, random_state=0).fit(x.reshape(-1, 1).astype(np.float64))
        ms = (time.perf_counter() - t) * 1e3
    return ms, mse(x, km.cluster_centers_.ravel()[km.labels_].astype(np.float32))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CI mode: Gaussian data, sklearn 8-bit on a 100k subsample")
    args = ap.parse_args()
    rounds = 1 if args.quick else 7
    xs = {kind: data(kind, N) for kind in (("gauss",) if args.quick else ("gauss", "heavy"))}
    tensors, best = time_cases(xs, rounds)
    floor_name = "np.add(acc, x, out=acc) float32 (memory floor)"
    for kind, x in xs.items():
        ts = tensors[kind]
        floor_ms = round(best[f"{kind} floor"], 4)
        for (codec, bits), t in ts.items():
            key, case = f"{kind} {codec}-{bits}", f"{codec}-{bits} {kind} n={N}"
            enc_ms = best[f"{key} encode"]
            emit(case, "encode_ms", enc_ms, "ms", "FedShift Table 2 (M1 Pro)", PAPER_MS[f"{codec}-{bits}"])
            emit(case, "decode_ms", best[f"{key} decode"], "ms", "target", 10.0)
            emit(f"{case} out=", "decode_ms", best[f"{key} into"], "ms", floor_name, floor_ms)
            emit(case, "decode_accumulate_ms", best[f"{key} accumulate"], "ms", floor_name, floor_ms)
            if codec != "kmeans":
                continue
            m = mse(x, decode(t))
            emit(case, "mse", m, "", f"asym-{bits} mse", mse(x, decode(ts["asym", bits])))
            sub = x[:100_000] if args.quick and bits == 8 else x
            sk_ms, sk_mse = sklearn_kmeans(sub, bits)
            ours = m if sub is x else mse(sub, decode(encode(sub, "kmeans", bits)))
            tag = f"{codec}-{bits} {kind} n={sub.size}" + (" (subsample)" if sub is not x else "")
            emit(tag, "mse", ours, "", "sklearn KMeans n_init=1 mse", sk_mse)
            if sub is not x:
                enc_ms = interleaved_best_ms({"sub": lambda s=sub, b=bits: encode(s, "kmeans", b)}, rounds)["sub"]
            emit(tag, "encode_ms", enc_ms, "ms", "sklearn KMeans n_init=1 fit ms (1 thread)", sk_ms)

if __name__ == "__main__":
    main()
