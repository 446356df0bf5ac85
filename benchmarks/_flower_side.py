"""The anchor of ``emulator_scale.py``: Flower's simulation engine doing the same job.

Run by ``emulator_scale.py --flower`` under an interpreter that has ``flwr[simulation]``
(never a fedbit dependency; ``make bench-flower`` makes one in ``.venv-flower``).

    _flower_side.py N ROUNDS SELECTED [JOB]

N virtual SuperNodes, SELECTED sampled per round, FedAvg, centralised evaluation off;
each client holds 32 digits samples of its own and trains one epoch of SGD, batch 8:

- ``softmax`` (default): a softmax regression in numpy (the registered-fleet scaling job);
- ``mlp``: the float32 ``mlp`` of fedbit's model zoo (64-128-10, ReLU) in torch with one
  thread, batch 32, as fedbit's float devices train it (the every-core throughput job).

Each client asks Ray for one CPU, so Flower runs one client per core at once. Prints one
JSON line: wall seconds per round after the first (median) and start-up seconds (process
start to the end of round 1, minus one steady round), as ``emulator_scale.py`` measures
fedbit.

This file does not import fedbit: it must run in Flower's environment.
"""

from __future__ import annotations

import json
import sys
import time

T0 = time.monotonic()


def _digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.data / 16.0).astype("float32"), d.target.astype("int64")


def _softmax_step(w, b, x, y):
    import numpy as np

    for s in range(0, 32, 8):  # one epoch, batch 8, softmax regression
        xb, yb = x[s:s + 8], y[s:s + 8]
        z = xb @ w + b
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        p[np.arange(len(yb)), yb] -= 1.0
        w -= 0.1 * xb.T @ p / len(yb)
        b -= 0.1 * p.mean(axis=0)
    return [w, b]


def _mlp_step(arrays, x, y):
    import torch

    torch.set_num_threads(1)
    w1, b1, w2, b2 = (torch.from_numpy(a.copy()).requires_grad_(True) for a in arrays)
    opt = torch.optim.SGD([w1, b1, w2, b2], lr=0.1, momentum=0.9)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    for s in range(0, len(yt), 32):  # one epoch, batch 32
        opt.zero_grad()
        h = torch.relu(xt[s:s + 32] @ w1.T + b1)
        loss = torch.nn.functional.cross_entropy(h @ w2.T + b2, yt[s:s + 32])
        loss.backward()
        opt.step()
    return [t.detach().numpy() for t in (w1, b1, w2, b2)]


def main(n: int, rounds: int, selected: int, job: str = "softmax") -> None:
    import numpy as np
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    x_all, y_all = _digits()
    client = ClientApp()

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        arrays = msg.content["arrays"].to_numpy_ndarrays()
        rng = np.random.default_rng(int(context.node_config["partition-id"]))
        idx = rng.choice(len(y_all), 32, replace=False)
        x, y = x_all[idx], y_all[idx]
        out = _mlp_step(arrays, x, y) if job == "mlp" else _softmax_step(*arrays, x, y)
        content = RecordDict({"arrays": ArrayRecord(out), "metrics": MetricRecord({"num-examples": 32})})
        return Message(content=content, reply_to=msg)

    ends: list[float] = []
    server = ServerApp()

    @server.main()
    def main_(grid: Grid, context: Context) -> None:
        strategy = FedAvg(fraction_train=selected / n, fraction_evaluate=0.0, min_train_nodes=selected,
                          min_evaluate_nodes=0, min_available_nodes=n)
        if job == "mlp":
            rng = np.random.default_rng(0)
            init = ArrayRecord([(rng.standard_normal((128, 64)) * 0.1).astype(np.float32), np.zeros(128, np.float32),
                                (rng.standard_normal((10, 128)) * 0.1).astype(np.float32), np.zeros(10, np.float32)])
        else:
            init = ArrayRecord([np.zeros((64, 10), np.float32), np.zeros(10, np.float32)])
        strategy.start(grid=grid, initial_arrays=init, num_rounds=rounds,
                       evaluate_fn=lambda rnd, arrays: ends.append(time.monotonic()) or None)

    run_simulation(server_app=server, client_app=client, num_supernodes=n,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    # evaluate_fn runs before round 1 and after every round: ends[r] is the end of round r
    rounds_s = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    steady = sorted(rounds_s[1:])
    per_round = steady[len(steady) // 2] if steady else float("nan")
    print(json.dumps({"n": n, "job": job, "round_s": per_round, "startup_s": ends[1] - T0 - per_round,
                      "rounds": rounds_s}), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), *(sys.argv[4:5]))
