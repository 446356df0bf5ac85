"""What the defences of issue 13 cost, each against the undefended path in the same run.

Cases (``fedshift_cnn``, ~2.16 M parameters; asym-4 wire updates, ~1.08 MB each):
- the coordinator's update path (``Ingest.update`` + ``Strategy.fold``) with an enrolment
  registry (the device MAC verified before parsing: one AES-256-GMAC pass over the
  payload, ``edge_client.auth``) against the same path without it: ``updates_per_s``,
  40 distinct updates a pass, passes alternating, best of 25 each (issue 22's target:
  ratio >= 0.9); and the same with each update warm in cache (every update timed 15
  times on both paths, counted at its fastest), where the path without the MAC is ~4x
  faster and the MAC's one pass weighs more;
- a round of N updates (fold + finish) with robust aggregation (``clip``, ``trimmed_mean``,
  ``median``), and with the round loop's default poisoning defense (``coordinator.defense``:
  each update decoded once more to measure it, the first 32 held), against streaming
  FedAvg: ``round_seconds``, and the round's peak traced
  memory (tracemalloc, each update's bytes allocated as it arrives: what a mode holds, the
  per-layer matrices): ``peak_memory``.

Run: ``.venv/bin/python benchmarks/security.py [--quick]``; prints JSON lines.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from coordinator.ingest import Ingest, OpenRound
from coordinator.ops.admission import AdmissionConfig
from coordinator.ops.credentials import JobSecurity
from coordinator.strategies import EncodedUpdate, build_strategy
from edge_client import auth
from edge_client.codecs import encode
from edge_client.protocol import Limits, Update, encode_message
from firmware_models import get_spec

MODEL = "fedshift_cnn"
SHAPES = [tuple(s) for s in get_spec(MODEL).param_shapes()]


def emit(case: str, metric: str, value: float, unit: str, anchor: str, anchor_value: float) -> None:
    print(json.dumps({"bench": "security", "case": case, "metric": metric, "value": round(value, 5),
                      "unit": unit, "anchor": anchor, "anchor_value": round(anchor_value, 5),
                      "ratio": round(value / anchor_value, 4) if anchor_value else None}), flush=True)


def wire_sets(k: int) -> list[tuple]:
    rng = np.random.default_rng(0)
    base = [(0.05 * rng.standard_normal(s)).astype(np.float32) for s in SHAPES]
    return [tuple(encode(b + rng.normal(0, 0.01, b.shape).astype(np.float32), "asym", 4) for b in base)
            for _ in range(k)], base


def ingest_rate(ing: Ingest, payloads: list[tuple[str, bytes]], base: list[np.ndarray]) -> float:
    """Updates per second through ingest + fold (a fresh round for every pass), each
    update a distinct payload read from memory (40 of 1.08 MB: more than the caches hold)."""
    strat = build_strategy("fedavg")
    strat.begin_round(1, base)
    rnd = OpenRound(1, frozenset(d for d, _ in payloads))
    t0 = time.perf_counter()
    for dev, p in payloads:
        strat.fold(ing.update(dev, p, rnd, 0))
    strat.finish()
    return len(payloads) / (time.perf_counter() - t0)


def ingest_rates(ings: tuple[Ingest, Ingest], streams: tuple[list, list], base: list[np.ndarray],
                 repeats: int) -> tuple[float, float]:
    """Updates per second of each path through ``Ingest.update`` + ``Strategy.fold``: every
    update goes through both paths ``repeats`` times, the two alternating, and counts with
    its fastest time on each path (a machine shared with other work preempts a run now and
    then; the fastest of several is the update's own cost). Each time the update is handed
    over as a fresh copy, as the transport hands over a received message (a cold payload
    would make the MAC's pass a prefetch for the parser and the fold, and flatter it).
    Returns (first path's rate, second path's rate)."""
    strats = (build_strategy("fedavg"), build_strategy("fedavg"))
    for st in strats:
        st.begin_round(1, base)
    rnd = OpenRound(1, frozenset(d for d, _ in streams[0]))
    spent = [0.0, 0.0]
    for pair in zip(*streams, strict=True):
        best = [float("inf"), float("inf")]
        for _ in range(repeats):
            for k, (dev, p) in enumerate(pair):
                p = bytearray(p)  # (untimed)
                t0 = time.perf_counter()
                strats[k].fold(ings[k].update(dev, p, rnd, 0))
                best[k] = min(best[k], time.perf_counter() - t0)
        spent[0] += best[0]
        spent[1] += best[1]
    n = len(streams[0])
    return n / spent[0], n / spent[1]


def received(i: int, sets: list[tuple]) -> EncodedUpdate:
    """Update ``i`` as the coordinator holds it after parsing: its own copy of the bytes."""
    ts = tuple(type(t)(t.shape, t.dtype, t.codec, t.bits, bytes(bytearray(t.data)), dict(t.aux), t.name)
               for t in sets[i % len(sets)])
    return EncodedUpdate(f"d{i:04d}", 100, ts, "weights", 32, True)


def round_cost(params: dict, sets: list[tuple], base: list[np.ndarray], n: int) -> tuple[float, float]:
    """(seconds, peak traced MiB) of a round of ``n`` wire updates arriving (each one's
    bytes allocated as it arrives, dropped by the caller once folded), folded, finished:
    what a strategy keeps of them shows in the peak. (Making the copies is not timed.)
    ``params["defense"]``: the strategy inside the round loop's guard."""
    params = dict(params)
    guarded = params.pop("defense", False)
    strat = build_strategy("fedavg", **params)
    if guarded:
        from coordinator.defense.config import DefenseConfig
        from coordinator.defense.guard import GuardedStrategy

        strat = GuardedStrategy(strat, DefenseConfig())
    strat.begin_round(1, base)
    tracemalloc.start()
    dt = 0.0
    for i in range(n):
        u = received(i, sets)
        t0 = time.perf_counter()
        strat.fold(u)
        dt += time.perf_counter() - t0
        del u
    t0 = time.perf_counter()
    strat.finish()
    dt += time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return dt, peak / 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="CI size (< 60 s)")
    args = ap.parse_args()
    n_ingest, n_round, reps = (8, 4, 1) if args.quick else (40, 20, 3)
    sets, base = wire_sets(4)

    with tempfile.TemporaryDirectory() as tmp:
        sec = JobSecurity(Path(tmp) / "security", "bench")
        devs = [f"d{i:03d}" for i in range(n_ingest)]
        keys = {d: sec.enroll(d, broker="mqtt://127.0.0.1:1883")[0].mac_key_bytes for d in devs}
        limits = Limits()
        plain = [(d, encode_message(Update(d, 1, 100, 32, "weights", sets[i % 4]))) for i, d in enumerate(devs)]
        signed = [(d, auth.sign(p, keys[d])) for d, p in plain]
        ing_plain = Ingest(MODEL, SHAPES, limits)
        ing_mac = Ingest(MODEL, SHAPES, limits, AdmissionConfig(enrolment=str(sec.registry_path)), "bench")
        ingest_rates((ing_plain, ing_mac), (plain[:2], signed[:2]), base, 1)  # numba cache loads, imports
        best_plain = best_mac = 0.0
        for _ in range(reps if args.quick else 25):  # passes alternating, best of each
            best_plain = max(best_plain, ingest_rate(ing_plain, plain, base))
            best_mac = max(best_mac, ingest_rate(ing_mac, signed, base))
        size = len(signed[0][1]) / 1e6
        emit(f"{MODEL} asym-4 update ({size:.2f} MB): ingest + fold with the device MAC verified",
             "updates_per_s", best_mac, "updates/s", "the same without enrolment", best_plain)
        warm_plain, warm_mac = ingest_rates((ing_plain, ing_mac), (plain, signed), base, 3 if args.quick else 15)
        emit(f"{MODEL} asym-4 update ({size:.2f} MB) warm in cache: ingest + fold with the device MAC verified",
             "updates_per_s", warm_mac, "updates/s", "the same without enrolment (warm, fastest of 15)", warm_plain)

    round_cost({}, sets, base, 2)
    cases = (("clip=1 (wire bytes held)", {"clip": 1.0}), ("trimmed_mean trim=0.1", {"robust": "trimmed_mean"}),
             ("median", {"robust": "median"}), ("defense (the round loop's default)", {"defense": True}))
    anchor = (float("inf"), 0.0)
    best = [(float("inf"), 0.0)] * len(cases)
    for _ in range(reps):
        t, m = round_cost({}, sets, base, n_round)
        anchor = (min(anchor[0], t), m)
        for k, (_, params) in enumerate(cases):
            t, m = round_cost(params, sets, base, n_round)
            best[k] = (min(best[k][0], t), m)
    for (name, _), (t, m) in zip(cases, best, strict=True):
        case = f"{MODEL} {n_round} asym-4 updates, {'' if name.startswith('defense') else 'robust '}{name}"
        emit(case, "round_seconds", t, "s", "streaming fedavg round", anchor[0])
        emit(case, "peak_memory", m, "MiB", "streaming fedavg peak (tracemalloc)", anchor[1])


if __name__ == "__main__":
    main()
