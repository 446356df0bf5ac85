"""What kills first-layer filters in one round (issue 27; docs/training-health.md).

    python experiments/collapse_mechanism.py [--seed 0] [--steps 50]
        [--out benchmarks/results/experiments/collapse-mechanism]

The issue's digits fleet (digits_cnn; 4 Int6, 4 Int8, 4 float32 devices; Dirichlet(0.3)
split drawn as the emulator draws it for ``--seed``), one round from the initial model:
every device trains ``--steps`` local steps of batch 32 on its shard with the trainers
the devices run (float devices on the Int8 forward), and the round's model is the
sample-weighted average (FedAvg), as the coordinator computes it. The float devices train
twice: with the integer devices' step (what they do now) and with the SGD step they took
before (lr 1.0, momentum 0.9, gradient norm clipped to 2.0: written out here).

Reports per device kind: live ``conv1`` filters after the local round (of those live at
the start), the mean |dW| of ``conv1`` per step (first 5 steps, the rest) and over the
round, the fraction of ``conv1`` at -0.5; per step of one float device, its live
filters; for the average, its live filters and, for each filter that died, in how many
float and integer updates it was still live. Writes ``OUT.json`` and ``OUT.md``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "experiments"
FLEET = (("int6", 4), ("int8", 4), ("float32", 4))


def sgd_round(tr, data, steps: int, batch: int, seed: int, on_step) -> None:
    """The float devices' previous local round on an integer forward: SGD, lr 1.0, momentum
    0.9 (fresh buffers), the gradient norm clipped to 2.0, W clipped to +-0.5 after each step."""
    import torch

    from edge_client.trainers.common import batches
    from edge_client.trainers.floating import sgd_step

    rng = np.random.default_rng([seed, 0])
    x_all, y_all = torch.from_numpy(data.x), torch.from_numpy(data.y)
    buffers: list = [None] * len(tr.params)
    for idx in batches(len(data), batch, steps, rng):
        ti = torch.from_numpy(idx)
        for p in tr.params:
            p.grad = None
        tr._loss(tr.forward(x_all[ti]), y_all[ti]).backward()
        with torch.no_grad():
            torch.nn.utils.clip_grad_norm_(tr.params, 2.0)
            sgd_step(tr.params, buffers, 1.0, 0.9)
            for p in tr.params:
                p.clamp_(-0.5, 0.5)
        on_step(tr.to_shared()[0])


def local_round(kind: str, spec, w0, data, steps: int, seed: int, step_rule: str) -> list[np.ndarray]:
    """conv1 after every local step (index 0: the start) of one device's round."""
    from edge_client.trainers import IntTrainer, TorchTrainer

    traj = [w0[0].copy()]
    if kind == "float32":
        tr = TorchTrainer(spec, seed=seed, forward="int8")
        tr.load_shared(w0)
        if step_rule == "sgd":
            sgd_round(tr, data, steps, 32, seed, traj.append)
            return traj + [tr.to_shared()]
    else:
        tr = IntTrainer(spec, int(kind[3:]), seed=seed)
        tr.load_shared(w0)
    for _ in range(steps):  # one step per call: the same steps as one call (fresh rng per call)
        tr.train(data, steps=1, batch=32)
        traj.append(tr.to_shared()[0])
    return traj + [tr.to_shared()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--out", type=Path, default=RESULTS / "collapse-mechanism")
    args = ap.parse_args()

    import torch

    from coordinator.emulation.datasets import load_dataset, partition
    from coordinator.emulation.fleet_plan import derive_seed
    from edge_client.intnn import init_shared
    from edge_client.intnn.liveness import liveness, ternary_codes
    from firmware_models import get_spec

    torch.set_num_threads(1)
    spec = get_spec("digits_cnn")
    split = load_dataset("digits")
    kinds = [k for k, n in FLEET for _ in range(n)]
    shards = partition("dirichlet", split.train.y, len(kinds), np.random.default_rng(derive_seed("data", args.seed)),
                       alpha=0.3)
    w0 = init_shared(spec, args.seed)

    def live(w) -> np.ndarray:  # per conv1 filter: a positive Int8 ternary tap
        return (ternary_codes(w, 8) > 0).reshape(w.shape[0], -1).any(axis=1)

    live0 = live(w0[0])
    out: dict = {"seed": args.seed, "steps": args.steps, "live_at_start": int(live0.sum()), "rules": {}}
    integer_devices: dict[int, list[np.ndarray]] = {}  # the same in both runs
    for rule in ("integer", "sgd"):
        rows, updates = [], []
        for i, kind in enumerate(kinds):
            data = split.train.subset(shards[i])
            if kind == "float32" or i not in integer_devices:
                integer_devices[i] = local_round(kind, spec, w0, data, args.steps, derive_seed("device", args.seed, i),
                                                 rule)
            traj = list(integer_devices[i])
            final = traj.pop()
            d = [float(np.abs(b - a).mean()) for a, b in zip(traj, traj[1:], strict=False)]
            rows.append({"device": i, "kind": kind, "samples": len(data), "live": int((live(final[0]) & live0).sum()),
                         "step_first5": float(np.mean(d[:5])), "step_rest": float(np.mean(d[5:])),
                         "moved": float(np.abs(final[0] - w0[0]).mean()), "at_minus_clip": float((final[0] <= -0.5).mean()),
                         "live_per_step": [int(live(t).sum()) for t in traj[:11]]})
            updates.append((final, len(data), kind))
        tot = sum(n for _, n, _ in updates)
        avg = [sum(u[k] * (n / tot) for u, n, _ in updates).astype(np.float32) for k in range(len(w0))]
        alive = live(avg[0])
        deaths = []
        for f in np.flatnonzero(live0 & ~alive):
            fl = sum(bool(live(u[0])[f]) for u, _, k in updates if k == "float32")
            it = sum(bool(live(u[0])[f]) for u, _, k in updates if k != "float32")
            deaths.append({"filter": int(f), "live_in_float_updates": fl, "live_in_integer_updates": it})
        out["rules"][rule] = {"devices": rows, "average_live": int(alive.sum()),
                              "average_live_all_layers": [lv.live for lv in liveness(spec, avg, 8)], "deaths": deaths}
        print(rule, "average: conv1 live", int(alive.sum()), "of", int(live0.sum()), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(out, indent=1))
    args.out.with_suffix(".md").write_text(markdown(out))
    print(f"wrote {args.out.with_suffix('.md')}")
    return 0


def markdown(out: dict) -> str:
    lines = [f"# What kills first-layer filters in one round (digits, seed {out['seed']}, {out['steps']} local steps)",
             "", "`python experiments/collapse_mechanism.py` (see its docstring). conv1 filters live at the start: "
             f"{out['live_at_start']} of 16.", "",
             "| float devices' step | kind | live conv1 filters after the local round | mean abs(dW) per step, "
             "steps 1-5 | steps 6+ | mean abs(W_end - W_0) | at -0.5 |", "|---|---|---|---|---|---|---|"]
    for rule, r in out["rules"].items():
        for kind in ("int6", "int8", "float32"):
            rows = [d for d in r["devices"] if d["kind"] == kind]
            lines.append(f"| {rule} | {kind} | {', '.join(str(d['live']) for d in rows)} | "
                         f"{np.mean([d['step_first5'] for d in rows]):.4f} | {np.mean([d['step_rest'] for d in rows]):.4f} | "
                         f"{np.mean([d['moved'] for d in rows]):.3f} | {np.mean([d['at_minus_clip'] for d in rows]):.2f} |")
    lines += ["", "Live conv1 filters of the first float device after each of its first 10 steps: " + "; ".join(
        f"{rule}: {next(d for d in r['devices'] if d['kind'] == 'float32')['live_per_step']}"
        for rule, r in out["rules"].items()), ""]
    for rule, r in out["rules"].items():
        lines.append(f"- {rule}: the average (FedAvg) keeps {r['average_live']} conv1 filters "
                     f"(live units per layer {r['average_live_all_layers']}); filters that died: " +
                     (", ".join(f"#{d['filter']} (live in {d['live_in_float_updates']}/4 float, "
                                f"{d['live_in_integer_updates']}/8 integer updates)" for d in r["deaths"]) or "none"))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
