"""The anchor of ``emulator_scale.py``: Flower's simulation engine doing the same job.

Run by ``emulator_scale.py --flower`` under an interpreter that has ``flwr[simulation]``
(never a fedbit dependency). N virtual SuperNodes, 10 sampled per round, each training a
softmax regression on 32 digits samples of its own (numpy, one epoch of SGD), FedAvg,
centralised evaluation off. Prints one JSON line: wall seconds per round after the first
(median) and start-up seconds (process start to the end of round 1, minus one steady
round), as ``emulator_scale.py`` measures fedbit.

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


def main(n: int, rounds: int, selected: int) -> None:
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
        w, b = msg.content["arrays"].to_numpy_ndarrays()
        rng = np.random.default_rng(int(context.node_config["partition-id"]))
        idx = rng.choice(len(y_all), 32, replace=False)
        x, y = x_all[idx], y_all[idx]
        for s in range(0, 32, 8):  # one epoch, batch 8, softmax regression
            xb, yb = x[s:s + 8], y[s:s + 8]
            z = xb @ w + b
            p = np.exp(z - z.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            p[np.arange(len(yb)), yb] -= 1.0
            w -= 0.1 * xb.T @ p / len(yb)
            b -= 0.1 * p.mean(axis=0)
        content = RecordDict({"arrays": ArrayRecord([w, b]), "metrics": MetricRecord({"num-examples": 32})})
        return Message(content=content, reply_to=msg)

    ends: list[float] = []
    server = ServerApp()

    @server.main()
    def main_(grid: Grid, context: Context) -> None:
        strategy = FedAvg(fraction_train=selected / n, fraction_evaluate=0.0, min_train_nodes=selected,
                          min_evaluate_nodes=0, min_available_nodes=n)
        init = ArrayRecord([np.zeros((64, 10), np.float32), np.zeros(10, np.float32)])
        strategy.start(grid=grid, initial_arrays=init, num_rounds=rounds,
                       evaluate_fn=lambda rnd, arrays: ends.append(time.monotonic()) or None)

    run_simulation(server_app=server, client_app=client, num_supernodes=n,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    # evaluate_fn runs before round 1 and after every round: ends[r] is the end of round r
    rounds_s = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    steady = sorted(rounds_s[1:])
    per_round = steady[len(steady) // 2] if steady else float("nan")
    print(json.dumps({"n": n, "round_s": per_round, "startup_s": ends[1] - T0 - per_round,
                      "rounds": rounds_s}), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
