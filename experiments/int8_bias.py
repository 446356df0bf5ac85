"""Issue 11 (b): is the Int8 update's pull toward zero WAGE's nature or a bias?

    python experiments/int8_bias.py [--quick] [--out benchmarks/results/experiments]

Extends the lead's measurement (research notes, ``int8_bias.py``): on digits_cnn,

1. **one step, fixed batch.** E[Δ_int8] over stochastic-rounding seeds against the
   gradient of the same function (the Int8 forward computed in float,
   ``TorchTrainer(forward="int8")``: straight-through SSE gradient ``g``), split into the
   weights at the clip ±0.5 and the others; and against the *projected* gradient Π(-g)
   (the outward components of weights at the clip removed, as any clipped method must).
   A bias is what E[Δ] does beyond Π(-g).
2. **one local round** (the ProWD settings: 200 steps of batch 32 on a 2-class shard) of an
   Int8 device and of a float device from the same global model: update norms, cos(Δint8,
   Δfloat), the pull toward zero cos(Δ, -W) split at the clip, for the float device
   training its float forward or the Int8 forward (``float_forward``), the Int8 step
   η = 8 or 2 LSB (``lr_shift`` 3 / 1), and the Int8 device's latent weights clipped at
   ±0.5 each step (WAGE code) or at ±(1 - 1/S) (ProWD text), the shared domain's ±0.5
   applied once to what it sends.

Both from a model trained centrally in the float forward (what the global model of a
FedAvg fleet of float devices looks like: it piles weights at the clip) and one trained
in the Int8 forward. Prints Markdown; ``--out DIR`` also writes ``int8_bias.md`` / ``.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

LSB = 1.0 / 128


def cos(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
    n = np.linalg.norm(a) * np.linalg.norm(b)
    return float(a @ b / n) if n > 0 else float("nan")


def at_clip(w: np.ndarray, clip: float = 0.5) -> np.ndarray:
    return np.abs(w) >= clip - LSB / 2


def projected(neg_g: np.ndarray, w: np.ndarray, clip: float = 0.5) -> np.ndarray:
    """Π(-g): a weight at +clip cannot move up, one at -clip cannot move down."""
    out = neg_g.copy()
    out[(w >= clip - LSB / 2) & (neg_g > 0)] = 0
    out[(w <= -clip + LSB / 2) & (neg_g < 0)] = 0
    return out


def train_central(spec, forward: str, epochs: int, data) -> list[np.ndarray]:
    from edge_client.trainers import TorchTrainer

    t = TorchTrainer(spec, seed=0, forward=forward)
    t.train(data, epochs=epochs, batch=32)
    return t.to_shared()


def ste_grad(spec, w: list[np.ndarray], batch) -> list[np.ndarray]:
    """The straight-through SSE gradient of the Int8 forward at ``w``."""
    import torch

    from edge_client.trainers import TorchTrainer

    t = TorchTrainer(spec, forward="int8")
    t.load_shared(w)
    for p in t.params:
        p.grad = None
    t._loss(t.forward(torch.from_numpy(batch.x)), torch.from_numpy(batch.y)).backward()
    return [p.grad.numpy().astype(np.float64) for p in t.params]


def one_step(spec, w0: list[np.ndarray], batch, seeds: int) -> list[dict]:
    """Section 1: per layer, E[Δ_int8] of one step against -g and Π(-g)."""
    from edge_client.trainers import IntTrainer

    deltas = []
    for seed in range(seeds):
        it = IntTrainer(spec, 8, seed=seed)
        it.load_shared(w0)
        start = it.to_shared()
        it.train(batch, steps=1, batch=len(batch))
        deltas.append([a - b for a, b in zip(it.to_shared(), start, strict=True)])
    it = IntTrainer(spec, 8)
    it.load_shared(w0)
    w = it.to_shared()  # on the grid
    g = ste_grad(spec, w, batch)
    rows = []
    for i, name in enumerate(spec.param_names()):
        e = np.mean([d[i] for d in deltas], axis=0).ravel()
        wi, ng = w[i].ravel(), -g[i].ravel()
        pg = projected(ng, wi)
        c = at_clip(wi)
        rows.append({
            "layer": name, "at_clip": float(c.mean()),
            "cos_E_negW_clip": cos(e[c], -wi[c]) if c.any() else None,
            "cos_E_negW_inner": cos(e[~c], -wi[~c]),
            "cos_negg_negW_clip": cos(ng[c], -wi[c]) if c.any() else None,
            "cos_projg_negW_clip": cos(pg[c], -wi[c]) if c.any() else None,
            "cos_E_negg": cos(e, ng), "cos_E_projg": cos(e, pg),
            "cos_E_projg_clip": cos(e[c], pg[c]) if c.any() else None,
            "cos_E_projg_inner": cos(e[~c], pg[~c]),
        })
    return rows


def local_round(spec, w0: list[np.ndarray], shard, *, steps: int, float_forward: str, lr_shift: int,
                int_clip: float, seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(Δ_int8, Δ_float) of one local round from ``w0`` on ``shard``; the Int8 device's
    result clipped to the shared domain's ±0.5 (a no-op when its latent clip is 0.5)."""
    from edge_client.trainers import IntTrainer, TorchTrainer

    it = IntTrainer(spec, 8, seed=seed, lr_shift=lr_shift, clip=int_clip)
    it.load_shared(w0)
    start = it.to_shared()
    it.train(shard, steps=steps, batch=32)
    d_int = [np.clip(a, -0.5, 0.5) - b for a, b in zip(it.to_shared(), start, strict=True)]
    ft = TorchTrainer(spec, seed=seed, lr=0.1, momentum=0.9, grad_clip=2.0, forward=float_forward)
    ft.load_shared(start)
    ft.train(shard, steps=steps, batch=32)
    d_float = [a - b for a, b in zip(ft.to_shared(), start, strict=True)]
    return d_int, d_float


CONDITIONS = [
    # label, float_forward, lr_shift, int8 latent clip
    ("float fwd, eta 8, clip 0.5 (today)", "float32", 3, 0.5),
    ("float fwd, eta 2, clip 0.5", "float32", 1, 0.5),
    ("float fwd, eta 8, latent clip 127/128", "float32", 3, 127 / 128),
    ("int8 fwd, eta 8, clip 0.5", "int8", 3, 0.5),
    ("int8 fwd, eta 2, clip 0.5", "int8", 1, 0.5),
    ("int8 fwd, eta 8, latent clip 127/128", "int8", 3, 127 / 128),
]


def round_rows(spec, w0, shards, steps: int) -> list[dict]:
    """Section 2: per condition and layer, mean over shards."""
    rows = []
    w_flat = [w.ravel() for w in w0]
    for label, fwd, shift, clip in CONDITIONS:
        acc: dict[str, list[list[float]]] = {}
        for k, shard in enumerate(shards):
            d_int, d_float = local_round(spec, w0, shard, steps=steps, float_forward=fwd, lr_shift=shift,
                                         int_clip=clip, seed=k)
            for i, name in enumerate(spec.param_names()):
                di, df, wi = d_int[i].ravel(), d_float[i].ravel(), w_flat[i]
                c = at_clip(wi)
                vals = [np.linalg.norm(di) / max(np.linalg.norm(df), 1e-12), cos(di, df),
                        cos(di[c], -wi[c]) if c.any() else np.nan, cos(di[~c], -wi[~c]),
                        cos(df[c], -wi[c]) if c.any() else np.nan, cos(df[~c], -wi[~c])]
                acc.setdefault(name, []).append(vals)
        for name, v in acc.items():
            m = np.nanmean(np.array(v, dtype=np.float64), axis=0)
            rows.append({"condition": label, "layer": name, "norm_ratio": m[0], "cos_int_float": m[1],
                         "int_pull_clip": m[2], "int_pull_inner": m[3], "float_pull_clip": m[4],
                         "float_pull_inner": m[5]})
    return rows


def fmt(v) -> str:
    return "n/a" if v is None or (isinstance(v, float) and np.isnan(v)) else f"{v:+.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer seeds, shards and steps")
    ap.add_argument("--out", type=Path, default=None, help="also write int8_bias.md/.json here")
    args = ap.parse_args()

    import torch

    from coordinator.emulation.datasets import partition
    from edge_client.data import load_digits
    from edge_client.trainers import IntTrainer
    from firmware_models import get_spec

    torch.set_num_threads(1)
    t0 = time.monotonic()
    spec = get_spec("digits_cnn")
    train, test = load_digits("train"), load_digits("test")
    batch = train.subset(np.arange(32))
    seeds, n_shards, steps, epochs = (16, 2, 50, 2) if args.quick else (64, 4, 200, 3)
    shards = [train.subset(s) for s in partition("shards", train.y, 10, np.random.default_rng(0))[:n_shards]]
    out: dict = {"quick": args.quick, "seeds": seeds, "shards": n_shards, "steps": steps, "models": {}}
    lines = ["# Issue 11 (b): the Int8 pull toward zero, measured", "",
             f"`python experiments/int8_bias.py{' --quick' if args.quick else ''}`: digits_cnn; one step: "
             f"E over {seeds} stochastic-rounding seeds on a fixed batch of 32; one round: {steps} steps of "
             f"batch 32 (float device: SGD lr 0.1, momentum 0.9, clip 2) on {n_shards} two-class shards, "
             "from the same model. `g`: the straight-through SSE gradient of the Int8 forward (computed in "
             "float); Π(-g): -g with the outward components of weights at the clip ±0.5 removed.", ""]
    printed = 0
    for forward in ("float32", "int8"):
        w0 = train_central(spec, forward, epochs, train)
        it = IntTrainer(spec, 8)
        it.load_shared(w0)
        from edge_client.trainers import TorchTrainer

        tf = TorchTrainer(spec, forward=forward)
        tf.load_shared(w0)
        acc_own, acc_int = tf.evaluate(test)[1], it.evaluate(test)[1]
        steps_rows = one_step(spec, w0, batch, seeds)
        rrows = round_rows(spec, w0, shards, steps)
        out["models"][forward] = {"accuracy_own_forward": acc_own, "accuracy_int8_engine": acc_int,
                                  "one_step": steps_rows, "round": rrows}
        lines += [f"## A model trained centrally in the {forward} forward ({epochs} epochs)", "",
                  f"Test accuracy: {100 * acc_own:.1f}% in its own forward, {100 * acc_int:.1f}% in the Int8 engine.", "",
                  "### One step: E[Δ_int8] against the gradient of the Int8 forward", "",
                  "| layer | at clip | cos(E,-W) clip | cos(E,-W) inner | cos(-g,-W) clip | cos(Π(-g),-W) clip "
                  "| cos(E,-g) | cos(E,Π(-g)) | cos(E,Π(-g)) clip | cos(E,Π(-g)) inner |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in steps_rows:
            lines.append(f"| {r['layer']} | {r['at_clip']:.2f} | {fmt(r['cos_E_negW_clip'])} | {fmt(r['cos_E_negW_inner'])} | "
                         f"{fmt(r['cos_negg_negW_clip'])} | {fmt(r['cos_projg_negW_clip'])} | {fmt(r['cos_E_negg'])} | "
                         f"{fmt(r['cos_E_projg'])} | {fmt(r['cos_E_projg_clip'])} | {fmt(r['cos_E_projg_inner'])} |")
        lines += ["", "### One local round: the Int8 device's update against the float device's", "",
                  "| condition | layer | \\|Δint8\\| / \\|Δfloat\\| | cos(Δint8, Δfloat) | Int8 pull: clip / inner "
                  "| float pull: clip / inner |", "|---|---|---|---|---|---|"]
        for r in rrows:
            lines.append(f"| {r['condition']} | {r['layer']} | {r['norm_ratio']:.2f} | {fmt(r['cos_int_float'])} | "
                         f"{fmt(r['int_pull_clip'])} / {fmt(r['int_pull_inner'])} | "
                         f"{fmt(r['float_pull_clip'])} / {fmt(r['float_pull_inner'])} |")
        lines.append("")
        print("\n".join(lines[printed:]), flush=True)
        printed = len(lines)
    out["seconds"] = time.monotonic() - t0
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "int8_bias.md").write_text("\n".join(lines) + "\n")
        (args.out / "int8_bias.json").write_text(json.dumps(out, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
