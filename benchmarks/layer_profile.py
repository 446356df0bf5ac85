"""Where an Int8 training step spends its time: per layer and phase, against the layer's
arithmetic bound on this CPU (issue 25).

    python benchmarks/layer_profile.py [--quick] [--markdown benchmarks/results/layer_profile.md]

One thread, batch 32, random data (as ``train_throughput``), models ``fedshift_cnn`` and
``digits_cnn``. Every kernel call of a step is timed (thread CPU time) and attributed to
its layer and phase: forward, backward-data, weight gradient, stochastic update, and the
error routing + quantization between them. The bound of a phase is its dense
multiply-accumulates (N*Ho*Wo*O*K*K*C for a conv, N*F*O for a linear) over the int8
rate of this CPU measured in the same run (``benchmarks/_simd_rate.py``: the best of a
ternary add into int16 and an int8 dot product, as Numba compiles them), and for the
update its weights over the rate of one SplitMix64 draw + clip per weight. A kernel that
skips zeros (ternary weights, errors after ReLU / max-pool, zero activations) can beat
the dense bound (fraction > 1).

Prints JSON lines: per layer and phase ``seconds`` (per step, median over steps)
anchored on the bound (or, for pooling and error routing, on the step's total); per
model ``arithmetic_bound_fraction`` of the conv layers (bound seconds / measured seconds,
summed over their forward, backward-data and weight gradient) anchored on the 0.5
target: the fastest step's against the best rate measured (both the machine's
undisturbed pace: on a shared VM the rate itself moved 280-430 G MAC/s between runs),
the median step's in ``median_step_fraction``; the micro-benchmark rates. ``--markdown``
writes the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _simd_rate  # noqa: E402 (benchmarks/ is not a package)

MODELS = ("fedshift_cnn", "digits_cnn")
BATCH = 32
PHASES = ("forward", "backward-data", "weight gradient", "update", "error routing + quantization")
KERNEL_PHASE = {
    "conv_forward_plane": "forward", "conv_forward_vnni": "forward",
    "conv_forward_col": "forward", "conv_forward": "forward",
    "linear_forward": "forward", "linear_forward_vnni": "forward", "maxpool_forward": "forward",
    "relu_forward": "forward",
    "conv_backward_data_narrow": "backward-data", "conv_backward_data": "backward-data",
    "conv_backward_data_vnni": "backward-data",
    "linear_backward_data": "backward-data", "linear_backward_data_vnni": "backward-data",
    "conv_weight_grad_plane": "weight gradient", "conv_weight_grad_plane_vnni": "weight gradient",
    "plane_for_grad": "weight gradient",
    "conv_weight_grad_sparse": "weight gradient", "conv_weight_grad_sparse_vnni": "weight gradient",
    "conv_weight_grad_dot": "weight gradient", "conv_weight_grad": "weight gradient",
    "linear_weight_grad": "weight gradient", "linear_weight_grad_vnni": "weight gradient",
    "linear_grad_max_vnni": "weight gradient", "linear_update_vnni": "update", "pad_nhwc": "weight gradient",
    "eq_to_planar": "weight gradient", "grad_max": "update",
    "sgd_update": "update", "ternary_copies": "update", "pad_rows": "update", "stream_key": "update",
    "regularizer_terms": "update",
    "pool_error_scale": "error routing + quantization",
    "pool_error_route": "error routing + quantization",
    "mask_quantize_error": "error routing + quantization",
    "quantize_error": "error routing + quantization", "relu_mask": "error routing + quantization",
    "maxpool_backward": "error routing + quantization",
    "sse_error": "loss", "softmax_error": "loss",
}
# what each kernel does today and what closing the rest of its gap would take
NOTES = {
    ("conv", "forward"): "VNNI: straight from the padded input, four input bytes broadcast "
                         "x the ternary weights packed per kernel row, 4 pixels x 64 "
                         "channels of vpdpbusd a block, pixels stepped without divisions, "
                         "sums finished in int32 lanes; the broadcast form tops at ~75% of "
                         "the dot-product rate (measured alone), and it is dense: zero "
                         "weights cost as much as others, a 15-byte kernel row takes 16. "
                         "Else: ternary runs of the padded plane added in int16, 8 per pass.",
    ("conv", "backward-data"): "VNNI: per output pixel its non-zero errors (5-15%, a bit "
                               "mask per 64 channels) in fours against their weight rows "
                               "interleaved, the sums in registers, added into the patch it "
                               "covers (the add of K rows per pixel is a third of its time). "
                               "Else: the same errors combine weight rows in int16.",
    ("conv", "weight gradient"): "K*C >= 32: error-driven (only non-zero errors, listed for "
                                 "64 channels in one pass over the errors): with VNNI a "
                                 "channel's whole list against its patches' bytes "
                                 "interleaved, its gradient row in registers (a dense VNNI "
                                 "gradient is 2x slower: 80-90% of the errors are zero); "
                                 "K*C < 32 (first conv): dot products over the plane "
                                 "positions, 2 rows x 4 channels of vpdpbusd, in chunks of "
                                 "positions that stay in L1.",
    ("linear", "forward"): "driven by the non-zero inputs (25-50% after ReLU + pool): VNNI "
                           "(O >= 16): 128 weight rows at a time for up to 32 samples, each "
                           "sample's non-zero inputs in fours against their rows interleaved "
                           "(the rows stay in L1 across the samples); else rows of the "
                           "[F, O] ternary weights added in int16, a sample at a time.",
    ("linear", "backward-data"): "VNNI (O >= 64): 4 weight rows x 2 samples of vpdpbusd "
                                 "dot products, dense, masked after; else dot products only "
                                 "where the input is positive, four weight rows per pass.",
    ("linear", "weight gradient"): "VNNI (O a multiple of 64): four samples' products per "
                                   "vpdpbusd into 16 outputs' lanes (no reduction), two rows "
                                   "x 64 outputs a block; on several threads, and for 2^18 "
                                   "weights or more on one, only its max: the update makes it "
                                   "again (8 MB of int32 for fc1 never stored). Else driven by "
                                   "the non-zero inputs.",
    ("linear", "update"): "one SplitMix64 draw per weight (bit-exact stream), fused clip + "
                          "ternarize; memory-bound on G (int32) + w + t.",
    ("conv", "update"): "as linear; plus the backward copy and the +-1 run lists.",
    ("pool", "forward"): "2x2 windows vectorized over channels (C = 16-64 is below a 64-byte "
                         "vector: part scalar); winners as int8 cells.",
}


def _macs(op) -> int:
    return BATCH * op.macs()


def _is_conv(op) -> bool:
    """The convolutions (the headline fraction is theirs): weight layers on feature maps."""
    return op.param >= 0 and len(op.out_shape) == 3


def profile_model(name: str, steps: int) -> tuple[list, dict]:
    """(ops, {(op index, phase): [seconds per step]})."""
    from edge_client.intnn import IntModel, init_int, parallel, step
    from edge_client.intnn import kernels as K
    from firmware_models import get_spec

    spec = get_spec(name)
    model = IntModel(spec, 8)
    model.load_int(init_int(spec, 0, 8))
    ws = model.workspace(BATCH)
    rng = np.random.default_rng(0)
    xq = model.prepare_inputs(rng.random((256, *spec.input_shape), dtype=np.float32))
    y = rng.integers(0, spec.num_classes, 256).astype(np.int64)
    current = [-1]
    acc: dict = defaultdict(float)

    def timed(nm, fn):
        def wrapper(*args):
            t0 = time.thread_time_ns()
            out = fn(*args)
            acc[(current[0], KERNEL_PHASE.get(nm, "other"))] += time.thread_time_ns() - t0
            return out
        return wrapper

    def at_layer(fn, i):
        def wrapper(*args):
            current[0] = i
            return fn(*args)
        return wrapper

    def forward_op(fn):  # the forward on one thread: an op at a time
        def wrapper(m, w, i, *args):
            current[0] = i
            return fn(m, w, i, *args)
        return wrapper

    def stages(fn):  # a backward op's code between its groups (quantizing, copies)
        def wrapper(self):
            gen = fn(self)
            while True:
                current[0] = self.i
                try:
                    tasks = next(gen)
                except StopIteration:
                    return
                yield tasks
        return wrapper

    def run_group(fn):  # each task's kernels attributed to the op it is tagged with
        def wrapper(self, tasks):
            copies = [dataclasses.replace(t, kernel=at_layer(t.kernel, t.tag)) for t in tasks]
            fn(self, copies)
            for t, c in zip(tasks, copies, strict=True):
                t.results = c.results
        return wrapper

    originals = {nm: getattr(K, nm) for nm in KERNEL_PHASE if hasattr(K, nm)}
    hooks = [(step, "forward_op", "_forward_op", forward_op),
             (step._ParamBackward, "stages", "stages", stages),
             (parallel.Splitter, "run_group", "run_group", run_group)]
    saved = {key: getattr(owner, name) for owner, key, name, _ in hooks}
    for nm, fn in originals.items():
        setattr(K, nm, timed(nm, fn))
    for owner, key, name, hook in hooks:
        setattr(owner, name, hook(saved[key]))
    per_step: dict = defaultdict(list)
    try:
        for s in range(steps + 2):
            i0 = (s * BATCH) % 256
            ws.x[:BATCH] = xq[i0:i0 + BATCH]
            acc.clear()
            model.train_step(ws, y[i0:i0 + BATCH], BATCH, 3, 0, s)
            if s >= 2:  # two warm-up steps
                for key, ns in acc.items():
                    per_step[key].append(ns * 1e-9)
    finally:
        for nm, fn in originals.items():
            setattr(K, nm, fn)
        for owner, key, name, _ in hooks:
            setattr(owner, name, saved[key])
    return model.ops, per_step


def emit(case: str, metric: str, value: float, unit: str, anchor: str, anchor_value: float,
         **extra) -> None:
    print(json.dumps({
        "bench": "layer_profile", "case": case, "metric": metric, "value": round(value, 6),
        "unit": unit, "anchor": anchor, "anchor_value": round(anchor_value, 6),
        "ratio": round(value / anchor_value, 4) if anchor_value else None, **extra}), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and repeats (CI)")
    ap.add_argument("--markdown", type=Path, help="write the table to this file")
    args = ap.parse_args(argv)
    repeats, scale = (3, 0.2) if args.quick else (25, 1.0)
    rates = _simd_rate.measure(repeats=repeats, scale=scale)
    profiles = {}
    for name in MODELS:
        profiles[name] = profile_model(name, 4 if args.quick else
                                       (30 if name == "fedshift_cnn" else 200))
        # the rates again between models: a shared machine disturbs some repeats, the
        # best of every one of them is this CPU's rate
        again = _simd_rate.measure(repeats=repeats, scale=scale)
        rates = {k: max(v, again[k]) for k, v in rates.items()}
    mac = rates["int8_mac"]
    for key in ("ternary_add", "int8_dot", "vnni_dot", "update"):
        if key not in rates:  # vnni_dot: only on a CPU with AVX-512 VNNI
            continue
        emit(f"int8 SIMD rate: {key}", "rate", rates[key] / 1e9, "G/s", "int8_mac", mac / 1e9)
    tables = []
    for name in MODELS:
        ops, per_step = profiles[name]
        rows = []
        conv_bound = conv_meas = 0.0
        conv_keys = []
        total = sum(statistics.median(v) for v in per_step.values())
        for i, op in enumerate(ops):
            if op.view or op.layer.is_relu:
                continue
            row = {"layer": op.layer.name, "kind": op.layer.file_type, "cells": {}}
            for phase in PHASES:
                times = per_step.get((i, phase))
                if not times:
                    continue
                t = statistics.median(times)
                if phase == "update":
                    bound = _weights(op) / rates["update"]
                elif phase in ("forward", "backward-data", "weight gradient") and _macs(op):
                    bound = _macs(op) / mac
                else:
                    bound = 0.0
                row["cells"][phase] = (t, bound)
                if bound:  # against the bound; else against the step's total (its share)
                    emit(f"{name} {op.layer.name} {phase}", "seconds", t, "s",
                         "int8 arithmetic bound", bound, share=round(t / total, 4),
                         fraction_of_bound=round(bound / t, 3))
                else:
                    emit(f"{name} {op.layer.name} {phase}", "seconds", t, "s",
                         "the step's total", total)
                if _is_conv(op) and phase in ("forward", "backward-data", "weight gradient"):
                    conv_bound += bound
                    conv_meas += t
                    conv_keys.append((i, phase))
            rows.append(row)
        # the headline pairs like with like: the fastest step's conv time (the step least
        # disturbed by the machine's other work) against the best rate measured; the
        # median step's is reported beside it
        per_conv_step = [sum(v) for v in zip(*(per_step[key] for key in conv_keys), strict=True)]
        fastest = min(per_conv_step) if per_conv_step else 0.0
        frac = conv_bound / fastest if fastest else 0.0
        frac_median = conv_bound / conv_meas if conv_meas else 0.0
        emit(f"{name} int8 conv layers", "arithmetic_bound_fraction", frac, "fraction", "target",
             0.5, bound_s=round(conv_bound, 6), measured_s=round(fastest, 6),
             median_step_s=round(conv_meas, 6), median_step_fraction=round(frac_median, 3),
             steps=len(per_conv_step), int8_mac_gps=round(mac / 1e9, 1))
        tables.append((name, rows, total, frac, frac_median, len(per_conv_step)))
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(_markdown(tables, rates), encoding="utf-8")
    return 0


def _weights(op) -> int:
    return int(np.prod(op.weight_shape)) if op.param >= 0 else 0


def _markdown(tables, rates) -> str:
    out = ["# Int8 training step per layer and phase, against the arithmetic bound", "",
           "Written by `python benchmarks/layer_profile.py --markdown "
           "benchmarks/results/layer_profile.md` (one thread, batch 32, random data, thread "
           "CPU time, median over steps). Each cell: measured ms per step / bound ms "
           "(fraction of the bound). The bound of a forward, backward-data or weight-gradient "
           "phase is its dense multiply-accumulates over the int8 rate measured in the same "
           f"run: {rates['int8_mac'] / 1e9:.0f} G MAC/s (ternary add into int16 "
           f"{rates['ternary_add'] / 1e9:.0f} G/s, int8 dot product "
           f"{rates['int8_dot'] / 1e9:.0f} G/s"
           + (f", VNNI dot products (vpdpbusd) {rates['vnni_dot'] / 1e9:.0f} G/s"
              if "vnni_dot" in rates else "")
           + ", L1-resident); the update's is one SplitMix64 "
           f"draw + clip per weight at {rates['update'] / 1e9:.2f} G weights/s. A fraction "
           "above 1 means the kernel skips enough zeros (ternary weights, errors after ReLU "
           "and max-pool, zero activations) to beat the dense bound.", ""]
    for name, rows, total, frac, frac_median, steps in tables:
        out += [f"## {name}", "", f"Step total {total * 1e3:.2f} ms (32 samples); conv layers "
                f"(forward + backward-data + weight gradient) at {frac:.2f} of their bound in "
                f"the fastest of {steps} steps (the best rate against the least disturbed "
                f"step), {frac_median:.2f} in the median step (the cells).", "",
                "| layer | " + " | ".join(PHASES) + " |",
                "|---|" + "---|" * len(PHASES)]
        for row in rows:
            cells = []
            for phase in PHASES:
                if phase not in row["cells"]:
                    cells.append("")
                    continue
                t, b = row["cells"][phase]
                cells.append(f"{t * 1e3:.3f} / {b * 1e3:.3f} ({b / t:.2f})" if b else
                             f"{t * 1e3:.3f}")
            out.append(f"| {row['layer']} ({row['kind']}) | " + " | ".join(cells) + " |")
        out.append("")
    out += ["## What each kernel does and what the rest of its gap would take", ""]
    for (kind, phase), text in NOTES.items():
        out.append(f"- **{kind} {phase}**: {text}")
    out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
