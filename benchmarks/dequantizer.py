"""ProWD's progressive weight dequantizer on Fashion-MNIST-trained weights (issues 11, 26).

The weights: a federated run of the ProWD preset's devices, in this process, with the
project's own code: ``mnist_cnn`` on Fashion-MNIST (an IID subset), float32 devices
training with Weight Normalization (``TorchTrainer(weight_norm=True)``, the paper's
appendix A settings), Int8 devices (``IntTrainer``) sending ternary weights, FedAvg with
1/N averaging (``build_strategy("fedavg")``). Every round's global model, the float32
devices' weights and the Int8 devices' own grid weights are kept.

The dequantizer is the preset's (``coordinator.emulation.papers``: the paper's ladder
2 -> 4 -> 8 -> 16 -> 32, 3x3 blocks over conv slices reading the global model the device
started from, compiled into per-round tables), trained as the coordinator trains it
(``ProwdDequantizer.train_version``) on the first 2/3 of the rounds (float32 devices'
weights paired with their round's global), its gates decided on the next round's float32
devices, the figures measured on the float32 devices of the rounds after (held out by
round). Prints JSON lines (docs/benchmarks.md):

- ``l1``: mean |ŵ - w| per weight over all layers for ternary (Q_2, the Int8 devices'
  uplink, the headline) and 4-bit (Q_4) inputs, "network" (every layer dequantized) and
  "gated" (what the stage applies), anchored on plain dequantization (ŵ = Q(w)) of the same
  weights; target 0.8. The same for the paper's own form (``context = "update"``: the
  blocks read only the received weights; trained also on the Int8 devices' received
  weights against their global) and, for information, on the Int8 devices' own grid
  weights behind their ternary uplinks (no target: the dequantizer never sees them);
- ``apply_ms``: the stage applied to one ternary Int8 update (grid check + table lookup
  per layer), anchored on the plain fold of the same update as the coordinator folds it
  (``fold`` of the encoded update: decode + add); target 2x. ``compile_s``: the round's
  tables, compiled when the round opens (between rounds), anchored on a federated round;
  ``epoch_s``: one training epoch, anchored on a federated round.

``--quick``: a tiny run (CI). ``--sweep``: also the configurations tried (kernel, context,
optimizer, λ, epochs, the block network of issue 11), one line each.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field

import numpy as np

BENCH = "dequantizer"
MODEL = "mnist_cnn"


def emit(case: str, metric: str, value: float, unit: str, anchor: str, anchor_value: float, **extra) -> None:
    print(json.dumps({"bench": BENCH, "case": case, "metric": metric, "value": round(float(value), 6),
                      "unit": unit, "anchor": anchor, "anchor_value": round(float(anchor_value), 6),
                      "ratio": round(float(value) / float(anchor_value), 4) if anchor_value else None}
                     | extra), flush=True)


@dataclass
class Run:
    """Per round: the global model it started from, the float32 devices' weights, the Int8
    devices' own grid weights (shared domain)."""

    globals_: list[list[np.ndarray]] = field(default_factory=list)
    floats: list[list[list[np.ndarray]]] = field(default_factory=list)
    ints: list[list[list[np.ndarray]]] = field(default_factory=list)
    round_s: list[float] = field(default_factory=list)


def preset_params() -> dict:
    """The dequantizer settings of ``paper = "prowd"`` (its ``dequantize.<key>``)."""
    from coordinator.emulation.papers import PAPERS

    return {k.split(".", 1)[1]: v for k, v in PAPERS["prowd"].stage_params.items() if k.startswith("dequantize.")}


def federated_run(rounds: int, n_float: int, n_int: int, steps: int, per_device: int, seed: int = 0) -> Run:
    """FedAvg (1/N) of WN float32 devices and ternary-uplink Int8 devices, in process."""
    from coordinator.emulation.papers import PAPERS
    from coordinator.strategies import ClientUpdate, build_strategy
    from coordinator.strategies.prowd_dequantizer.ladder import quantize
    from edge_client.data import load_split
    from edge_client.intnn import init_shared
    from edge_client.trainers import make_trainer
    from firmware_models import get_spec

    hp = PAPERS["prowd"].hparams
    spec = get_spec(MODEL)
    train = load_split("fashion-mnist", split="train")
    n = n_float + n_int
    perm = np.random.default_rng(seed).permutation(len(train))[: n * per_device]
    shards = [train.subset(np.sort(p)) for p in np.array_split(perm, n)]
    bits = [32] * n_float + [8] * n_int
    trainers = [make_trainer(spec, 32, seed=seed + k, lr=hp["lr"], momentum=hp["momentum"],
                             grad_clip=hp["grad_clip"], weight_norm=True) if b == 32
                else make_trainer(spec, b, seed=seed + k, lr_shift=hp["lr_shift"]) for k, b in enumerate(bits)]
    glob = init_shared(spec, seed)
    run = Run()
    for r in range(rounds):
        t0 = time.perf_counter()
        strat = build_strategy("fedavg", weighted=False)
        strat.begin_round(r, glob)
        run.globals_.append([w.copy() for w in glob])
        floats, ints = [], []
        for k, (tr, b) in enumerate(zip(trainers, bits, strict=True)):
            tr.load_shared(glob)
            tr.train(shards[k], steps=steps, batch=32)
            w = tr.to_shared()
            (floats if b == 32 else ints).append(w)
            sent = w if b == 32 else [quantize(x, 2) for x in w]  # the Int8 device's ternary forward weights
            strat.accept(ClientUpdate(f"d{k}", len(shards[k]), sent, "weights", b, b < 32))
        glob = strat.finish().weights
        run.floats.append(floats)
        run.ints.append(ints)
        run.round_s.append(time.perf_counter() - t0)
    return run


def train_and_judge(run: Run, split: int, params: dict):
    """A version trained as the stage trains one, on rounds [0, split), its gates on round
    ``split``; returns (stage, version, seconds)."""
    from coordinator.strategies.prowd_dequantizer import ProwdDequantizer
    from coordinator.strategies.prowd_dequantizer.ladder import grid_precision, quantize
    from coordinator.strategies.prowd_dequantizer.stage import RoundData, _slice_split

    deq = ProwdDequantizer(model=MODEL, **({"background": False} | params))
    deq.begin_round(0, run.globals_[0])
    pool = []
    for r in range(split + 1):
        rd = RoundData(r, run.globals_[r], list(run.floats[r]))
        if not deq.anchored:
            for w in run.ints[r]:
                t = [quantize(x, 2) for x in w]
                rd.ints.append((t, tuple(grid_precision(x) for x in t)))
        pool.append(rd)
    train, gate = _slice_split(pool)
    t0 = time.perf_counter()
    version = deq.train_version(train, gate, 1, split, deq._layout)
    return deq, version, time.perf_counter() - t0


def l1_figures(deq, version, run: Run, rounds: range, bits: int, which: str = "floats") -> tuple[float, float, float]:
    """(plain, network, gated) mean L1 per weight over the float32 devices' (or the Int8
    devices' own) weights of ``rounds``, for inputs on the ``bits`` grid."""
    from coordinator.strategies.prowd_dequantizer.ladder import quantize
    from coordinator.strategies.prowd_dequantizer.slices import compile_tables
    from coordinator.strategies.prowd_dequantizer.slicetrain import dequantize_layer

    plain = net = gated = 0.0
    count = 0
    for r in rounds:
        tables = compile_tables(version.net, deq._layout, run.globals_[r], [bits]) if deq.anchored else None
        for w in getattr(run, which)[r]:
            for i, layer in enumerate(w):
                flat = layer.reshape(-1)
                x = quantize(flat, bits)
                y = dequantize_layer(version.net, deq._layout, i, x, bits, tables)
                e_plain = float(np.abs(x - flat).sum(dtype=np.float64))
                e_net = float(np.abs(y - flat).sum(dtype=np.float64))
                plain += e_plain
                net += e_net
                gated += e_net if version.is_on(i, bits) else e_plain
                count += flat.size
    return plain / count, net / count, gated / count


def report_l1(run: Run, split: int, params: dict, label: str, extra: dict | None = None,
              ints: bool = False) -> tuple:
    """Train and judge one version; print its l1 lines; returns (stage, version)."""
    deq, version, secs = train_and_judge(run, split, params)
    held = range(split + 1, len(run.floats))
    for bits in (2, 4):
        common = {"target": 0.8, "train_s": round(secs, 2), "test_models": sum(len(run.floats[r]) for r in held)}
        plain, net, gated = l1_figures(deq, version, run, held, bits)
        case = f"{MODEL} int{bits} {label}"
        emit(f"{case} network", "l1", net, "mean |w_hat - w|", "plain dequantization", plain, **common | (extra or {}))
        emit(f"{case} gated", "l1", gated, "mean |w_hat - w|", "plain dequantization", plain,
             layers_on=sum(version.is_on(i, bits) for i in range(len(deq._layout.shapes))),
             per_layer=[round(d / p, 3) if p else None for (i, b), (p, d) in sorted(version.heldout.items()) if b == bits],
             **common | (extra or {}))
        if ints and bits == 2:
            plain, net, gated = l1_figures(deq, version, run, held, bits, "ints")
            emit(f"{case} gated, Int8 devices' own weights (information)", "l1", gated, "mean |w_hat - w|",
                 "plain dequantization", plain)
    return deq, version


def time_epoch(run: Run, split: int, deq, version, reps: int) -> None:
    """One more training epoch of ``version``'s network (a copy: ``version`` is left as
    it is), timed ``reps`` times; the epoch's cost does not depend on the weights."""
    import copy

    from coordinator.strategies.prowd_dequantizer.slicetrain import train_slices
    from coordinator.strategies.prowd_dequantizer.stage import RoundData, _slice_split

    train, _ = _slice_split([RoundData(r, run.globals_[r], list(run.floats[r])) for r in range(split + 1)])
    best = float("inf")
    for rep in range(reps):
        st = train_slices(copy.deepcopy(version.net), deq.cfg, deq._layout, train, deq._distillation(),
                          seed=rep, epochs=1)
        best = min(best, st.seconds)
    emit(f"{MODEL} {len(train)} pairs, the preset's config", "epoch_s", best, "s",
         "one federated round of the run", float(np.median(run.round_s)), steps=st.steps, planes=st.blocks)


def time_apply(deq, version, run: Run, reps: int) -> None:
    """The stage on one ternary Int8 update vs the plain fold of the same encoded update."""
    from coordinator.strategies import ClientUpdate, EncodedUpdate, build_strategy
    from coordinator.strategies.prowd_dequantizer.ladder import quantize
    from edge_client.codecs import encode
    from edge_client.intnn import TERNARY_WEIGHT

    glob = run.globals_[-1]
    t = [np.rint(quantize(w, 2) / TERNARY_WEIGHT).astype(np.int8) for w in run.ints[-1][0]]
    encoded = EncodedUpdate("int-device", 100, tuple(encode(x, "ternary", scale=TERNARY_WEIGHT) for x in t),
                            "weights", 8, True)
    decoded = ClientUpdate("int-device", 100, [TERNARY_WEIGHT * x.astype(np.float32) for x in t], "weights", 8, True)
    deq._version = version
    for i in range(len(glob)):
        version.gates[(i, 2)] = True  # every layer on: the most the stage can cost
    deq._seen = {2}  # the rung the fleet's integer updates came in on (ternary)
    t0 = time.perf_counter()
    deq.begin_round(99, glob)
    deq._round_tables()
    compile_s = time.perf_counter() - t0
    out = deq(decoded)
    assert all(a is not b for a, b in zip(out.weights, decoded.weights, strict=True))
    times, anchors = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        deq(decoded)
        times.append(time.perf_counter() - t0)
        strat = build_strategy("fedavg")
        strat.begin_round(1, glob)
        t0 = time.perf_counter()
        strat.fold(encoded)
        anchors.append(time.perf_counter() - t0)
    n = sum(w.size for w in glob)
    emit(f"{MODEL} ternary Int8 update ({n:,} weights, every layer looked up), 1 thread", "apply_ms",
         1e3 * float(np.median(times)), "ms", "plain fold of the same update (decode + add)",
         1e3 * float(np.median(anchors)), target_ratio=2.0)
    emit(f"{MODEL} the round's tables (ternary rung), when the round opens", "compile_s", compile_s, "s",
         "one federated round of the run", float(np.median(run.round_s)))


def sweep(run: Run, split: int, base: dict) -> None:
    """What was tried: one configuration per line (ternary and 4-bit gated figures)."""
    configs = [
        ("kernel=1", {"kernel": 1}),
        ("context=update (the paper's form)", {"context": "update"}),
        ("sgd lr=0.01 (the paper's optimizer)", {"optimizer": "sgd", "lr": 0.01}),
        ("lam=0 (no distillation)", {"lam": 0.0}),
        ("epochs=10", {"epochs": 10}),
        ("growth=16", {"growth": 16}),
    ]
    for label, params in configs:
        report_l1(run, split, base | params, f"[{label}]", {"sweep": True})
    # issue 11's block network (kernel 1, two-channel blocks, the received weights only)
    from coordinator.strategies.prowd_dequantizer import ProwdDequantizer
    from coordinator.strategies.prowd_dequantizer.blocks import BlockLayout

    for ladder in ("paper",):
        deq = ProwdDequantizer(model=MODEL, background=False, ladder=ladder)
        models = [m for r in range(split) for m in [run.globals_[r], *run.floats[r]]]
        layout = BlockLayout([w.shape for w in models[0]], deq.cfg.block, deq.cfg.modules)
        v = deq.train_version(models, run.floats[split], 1, split, layout)
        held = [m for r in range(split + 1, len(run.floats)) for m in run.floats[r]]
        from coordinator.strategies.prowd_dequantizer.ladder import quantize

        for bits in (2, 4):
            plain = gated = 0.0
            for w in held:
                for i, layer in enumerate(w):
                    x = quantize(layer.reshape(-1), bits)
                    y = v.dequantize(layout, i, x, bits) if v.is_on(i, bits) else x
                    plain += float(np.abs(x - layer.reshape(-1)).sum())
                    gated += float(np.abs(y - layer.reshape(-1)).sum())
            emit(f"{MODEL} int{bits} [issue 11's block network, {ladder} ladder] gated", "l1", gated, "sum |w_hat - w|",
                 "plain dequantization", plain, sweep=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CI size")
    ap.add_argument("--sweep", action="store_true", help="also the configurations tried (slow)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)  # everything on one core: the run, the training, the timings
    if args.quick:
        rounds, n_float, n_int, steps, per_device = 3, 2, 1, 10, 320
    else:
        rounds, n_float, n_int, steps, per_device = 9, 4, 2, 100, 3000
    split = rounds * 2 // 3 - 1  # train on [0, split), gates on round split, figures after
    run = federated_run(rounds, n_float, n_int, steps, per_device)
    base = preset_params() | ({"epochs": 1, "max_train_blocks": 256} if args.quick else {})
    deq, version = report_l1(run, split, base, "preset (context=global)", ints=True)
    if not args.quick:
        report_l1(run, split, base | {"context": "update"}, "paper's form (context=update)", ints=True)
    time_epoch(run, split, deq, version, 1 if args.quick else 2)
    time_apply(deq, version, run, 1 if args.quick else 15)
    if args.sweep:
        sweep(run, split, base)


if __name__ == "__main__":
    main()
