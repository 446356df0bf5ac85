"""ProWD's progressive weight dequantizer on weights from a real federated run (issue 11).

The weights: a federated run on the bundled digits with the project's own code, in this
process (``digits_cnn``; float32 devices with ``TorchTrainer``, Int8 devices with
``IntTrainer`` sending their own grid weights; IID shards of the digits train split;
FedAvg through ``build_strategy("fedavg")``; one local epoch a round). Every round's
global model and float32 devices' weights are kept. The dequantizer is trained as the
coordinator trains it (``ProwdDequantizer.train_version``: reconstruction over the ladder
+ distillation on a noise buffer, the issue's defaults) on the early rounds and judged on
the float32 devices' weights of the later rounds, held out by round.

Prints JSON lines (docs/architecture.md#benchmarks):

- ``l1`` (mean |ŵ - w| per weight, all layers) of ProWD's output for Int6 and Int8
  inputs (Q_6(w), Q_8(w): entering the fleet ladder 6 → 8 → 12 → 16 → 32 at 6 and 8)
  and ternary inputs (Q_2(w) = 0.5·ternary(w), the paper's ladder 2 → 4 → 8 → 16 → 32),
  anchored on plain dequantization (ŵ = Q(w)) of the same weights; "network": every layer
  through the network, "gated": what the stage applies (a layer whose held-out L1 was not
  lower passes through). Held out by round: trained on the first 2/3 of the rounds, the
  gates decided on the next round's float32 devices (as the stage does), the figures on
  the float32 devices of the rounds after. The issue's target: 0.8.
  Also, for reference, a rule that is no dequantizer at all: ``w_G + (Q(w) - Q(w_G))``
  (the low-bit weights re-anchored on the full-precision global model the device started
  from), on the same weights;
- ``epoch_s``: one training epoch of the default configuration, anchored on one
  federated round of the run (devices training one after the other + FedAvg);
- ``apply_ms``: the stage applied to one Int8 ``fedshift_cnn`` update (2.16 M weights,
  every layer on; grid detection + lookup tables + finiteness check), one torch thread,
  anchored on the plain path's fold of the same update (``fedavg`` ``accept``); target
  50 ms. And the same for an Int16 update (no table: the network runs on the blocks).

``--quick``: a shorter run and 2 training epochs (CI). ``--sweep``: also the
configurations tried to make the dequantizer help (ladder, block size, epochs, optimizer,
λ, buffer), one line each.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field

import numpy as np

BENCH = "dequantizer"


def emit(case: str, metric: str, value: float, unit: str, anchor: str, anchor_value: float, **extra) -> None:
    print(json.dumps({"bench": BENCH, "case": case, "metric": metric, "value": round(float(value), 6),
                      "unit": unit, "anchor": anchor, "anchor_value": round(float(anchor_value), 6),
                      "ratio": round(float(value) / float(anchor_value), 4) if anchor_value else None}
                     | extra), flush=True)


@dataclass
class Run:
    """Per round: the global model it started from and the float32 devices' weights."""

    globals_: list[list[np.ndarray]] = field(default_factory=list)
    floats: list[list[list[np.ndarray]]] = field(default_factory=list)
    round_s: list[float] = field(default_factory=list)


def federated_run(rounds: int, n_float: int, n_int: int, seed: int = 0) -> Run:
    """FedAvg on digits_cnn with float32 and Int8 devices (IID shards), in process."""
    from coordinator.strategies import ClientUpdate, build_strategy
    from edge_client.data import load_digits
    from edge_client.intnn import init_shared
    from edge_client.trainers import make_trainer
    from firmware_models import get_spec

    spec = get_spec("digits_cnn")
    train = load_digits("train")
    n = n_float + n_int
    perm = np.random.default_rng(seed).permutation(len(train))
    shards = [train.subset(np.sort(p)) for p in np.array_split(perm, n)]
    bits = [32] * n_float + [8] * n_int
    trainers = [make_trainer(spec, b, seed=seed + k) for k, b in enumerate(bits)]
    glob = init_shared(spec, seed)
    run = Run()
    for r in range(1, rounds + 1):
        t0 = time.perf_counter()
        strat = build_strategy("fedavg")
        strat.begin_round(r, glob)
        run.globals_.append([w.copy() for w in glob])
        floats = []
        for k, (tr, b) in enumerate(zip(trainers, bits, strict=True)):
            tr.load_shared(glob)
            tr.train(shards[k], epochs=1, batch=32)
            w = tr.to_shared()
            if b == 32:
                floats.append(w)
            strat.accept(ClientUpdate(f"d{k}", len(shards[k]), w, "weights", b, b < 32))
        glob = strat.finish().weights
        run.floats.append(floats)
        run.round_s.append(time.perf_counter() - t0)
    return run


def l1_figures(version, layout, held: list[list[np.ndarray]], bits: int) -> tuple[float, float, float]:
    """(plain, network, gated) mean L1 per weight over ``held``, for inputs on ``bits``."""
    from coordinator.strategies.dequantizer.ladder import quantize

    plain = net = gated = 0.0
    count = 0
    for w in held:
        for i, layer in enumerate(w):
            flat = layer.reshape(-1)
            x = quantize(flat, bits)
            y = version.dequantize(layout, i, x, bits)
            e_plain = float(np.abs(x - flat).sum(dtype=np.float64))
            e_net = float(np.abs(y - flat).sum(dtype=np.float64))
            plain += e_plain
            net += e_net
            gated += e_net if version.is_on(i, bits) else e_plain
            count += flat.size
    return plain / count, net / count, gated / count


def anchored_l1(run: Run, rounds: range, bits: int) -> tuple[float, float]:
    """(plain, global-anchored) mean L1 per weight of the float32 devices' weights of
    ``rounds``: ``ŵ = w_G + (Q(w) - Q(w_G))`` with w_G the round's starting model."""
    from coordinator.strategies.dequantizer.ladder import quantize

    plain = anch = 0.0
    count = 0
    for r in rounds:
        g = run.globals_[r]
        for w in run.floats[r]:
            for layer, gl in zip(w, g, strict=True):
                x = quantize(layer, bits)
                plain += float(np.abs(x - layer).sum(dtype=np.float64))
                anch += float(np.abs(gl + (x - quantize(gl, bits)) - layer).sum(dtype=np.float64))
                count += layer.size
    return plain / count, anch / count


def train_and_judge(run: Run, split: int, params: dict):
    """Train a version as the stage does on rounds [0, split) (global + float32 devices),
    its held-out check (the gates) on the float32 devices of round ``split``; returns
    (stage, version, layout, the float32 devices' weights of the later rounds, seconds):
    the figures are measured on weights neither training nor the gates saw."""
    from coordinator.strategies.dequantizer import ProwdDequantizer
    from coordinator.strategies.dequantizer.blocks import BlockLayout

    deq = ProwdDequantizer(model="digits_cnn", **({"background": False} | params))
    train = [m for r in range(split) for m in [run.globals_[r], *run.floats[r]]]
    gate = run.floats[split]
    test = [m for r in range(split + 1, len(run.floats)) for m in run.floats[r]]
    layout = BlockLayout([w.shape for w in train[0]], deq.cfg.block, deq.cfg.modules)
    t0 = time.perf_counter()
    version = deq.train_version(train, gate, 1, split, layout)
    return deq, version, layout, test, time.perf_counter() - t0


def report_l1(run: Run, split: int, params: dict, label: str, ladders: dict[str, tuple[int, ...]],
              extra: dict | None = None) -> dict:
    """Train and judge one version per ladder; print its l1 lines; returns the versions."""
    out = {}
    for name, ladder in ladders.items():
        _, version, layout, held, secs = train_and_judge(run, split, params | {"ladder": ladder})
        out[name] = version
        for bits in [b for b in (2, 6, 8) if b in ladder[:-1]]:
            plain, net, gated = l1_figures(version, layout, held, bits)
            case = f"digits_cnn int{bits} {name} ladder{label}"
            common = {"target": 0.8, "train_s": round(secs, 2), "test_models": len(held)} | (extra or {})
            emit(f"{case} network", "l1", net, "mean |w_hat - w|", "plain dequantization", plain, **common)
            emit(f"{case} gated", "l1", gated, "mean |w_hat - w|", "plain dequantization", plain,
                 layers_on=sum(version.is_on(i, bits) for i in range(len(layout.shapes))), **common)
    return out


def time_epoch(run: Run, split: int) -> None:
    import torch

    from coordinator.strategies.dequantizer import DequantizerConfig
    from coordinator.strategies.dequantizer.blocks import BlockLayout
    from coordinator.strategies.dequantizer.network import build_network
    from coordinator.strategies.dequantizer.stage import load_buffer
    from coordinator.strategies.dequantizer.train import Distillation, train_network
    from edge_client.intnn import alpha_shifts
    from firmware_models import get_spec

    spec = get_spec("digits_cnn")
    cfg = DequantizerConfig.from_params()
    train = [m for r in range(split) for m in [run.globals_[r], *run.floats[r]]]
    layout = BlockLayout([w.shape for w in train[0]], cfg.block)
    distill = Distillation(spec, [float(1 << a) for a in alpha_shifts(spec)],
                           torch.from_numpy(load_buffer("noise", spec.input_shape, cfg.buffer_size, 0)))
    net = build_network(cfg, 0)
    train_network(net, cfg, layout, train[:1], distill, seed=0, epochs=1)  # warm-up
    best = float("inf")
    for rep in range(3):
        st = train_network(net, cfg, layout, train, distill, seed=rep + 1, epochs=1)
        best = min(best, st.seconds)
    emit(f"digits_cnn {len(train)} models x {layout.n_blocks} blocks, default config", "epoch_s", best, "s",
         "one federated round of the run", float(np.median(run.round_s)), steps=st.steps, blocks=st.blocks)


def time_apply(version, reps: int) -> None:
    import torch

    from coordinator.strategies import ClientUpdate, build_strategy
    from coordinator.strategies.dequantizer import ProwdDequantizer
    from coordinator.strategies.dequantizer.ladder import quantize
    from edge_client.intnn import init_shared
    from firmware_models import get_spec

    torch.set_num_threads(1)
    spec = get_spec("fedshift_cnn")
    base = init_shared(spec, 0)
    deq = ProwdDequantizer(background=False)  # blocks are generic: a digits-trained version applies
    deq.begin_round(1, base)
    version.gates = {(i, b): True for i in range(len(base)) for b in version.cfg.ladder[:-1]}
    deq._version = version
    for bits in (8, 16):
        update = ClientUpdate("int-device", 100, [quantize(w, bits) for w in base], "weights", bits, True)
        deq(update)  # warm-up (numba, torch)
        times = []
        anchors = []
        for _ in range(reps):
            t0 = time.perf_counter()
            out = deq(update)
            times.append(time.perf_counter() - t0)
            strat = build_strategy("fedavg")
            strat.begin_round(1, base)
            t0 = time.perf_counter()
            strat.accept(update)
            anchors.append(time.perf_counter() - t0)
        assert all(a is not b for a, b in zip(out.weights, update.weights, strict=True))
        path = "lookup tables" if bits in version.tables else "network on the blocks"
        emit(f"fedshift_cnn int{bits} update ({spec.param_count:,} weights, {path}), 1 thread", "apply_ms",
             1e3 * float(np.median(times)), "ms", "plain fold of the same update (fedavg accept)",
             1e3 * float(np.median(anchors)), target_ms=50.0)


def sweep(run: Run, split: int) -> None:
    """What was tried to make the dequantizer help: one line per configuration, ladder and
    input (the paper's ladders, single steps straight to the float weights; block size,
    epochs, learning rate, optimizer, λ, the buffer, the residual form, 3x3 sub-networks)."""
    ladders = {"fleet": (6, 8, 12, 16, 32), "paper": (2, 4, 8, 16, 32), "2->32": (2, 32),
               "6->32": (6, 32), "8->32": (8, 32)}
    configs = [
        ("defaults", {}),
        ("epochs=20", {"epochs": 20}),
        ("block=2x4x4", {"block": (2, 4, 4)}),
        ("block=2x4x4 epochs=20", {"block": (2, 4, 4), "epochs": 20}),
        ("block=2x4x4 lr=0.1", {"block": (2, 4, 4), "lr": 0.1}),
        ("block=2x4x4 adam lr=1e-3", {"block": (2, 4, 4), "optimizer": "adam", "lr": 1e-3}),
        ("block=4x8x8", {"block": (4, 8, 8)}),
        ("lam=0", {"lam": 0.0}),
        ("buffer=digits:test", {"buffer": "digits:test"}),
        ("residual=literal", {"residual": "literal"}),
        ("kernel=3", {"kernel": 3}),
    ]
    for label, params in configs:
        report_l1(run, split, params, f" [{label}]", ladders, {"sweep": True})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CI size")
    ap.add_argument("--sweep", action="store_true", help="also the configurations tried (slow)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)  # everything on one core: the run, the training, the timings
    rounds, n_float, n_int = (6, 3, 3) if args.quick else (12, 4, 4)
    split = rounds * 2 // 3  # train on [0, split), gates on round split, figures after
    run = federated_run(rounds, n_float, n_int)
    ladders = {"fleet": (6, 8, 12, 16, 32), "paper": (2, 4, 8, 16, 32)}
    versions = report_l1(run, split, {"epochs": 2} if args.quick else {}, "", ladders)
    for bits in (2, 6, 8):
        plain, anch = anchored_l1(run, range(split + 1, rounds), bits)
        emit(f"digits_cnn int{bits} global-anchored rule (reference, not a dequantizer)", "l1", anch,
             "mean |w_hat - w|", "plain dequantization", plain)
    time_epoch(run, split)
    time_apply(versions["fleet"], 3 if args.quick else 7)
    if args.sweep:
        sweep(run, split)


if __name__ == "__main__":
    main()
