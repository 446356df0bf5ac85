"""The anchor of ``secagg.py``: one round of Flower's ``SecAggPlusWorkflow`` (Flower 1.40's
simulation engine) on the same model size, devices and dropout as fedbit's SecAgg+ round.

Run by ``secagg.py --flower PYTHON`` under an interpreter that has ``flwr[simulation]``
(``make bench-flower`` makes ``.venv-flower``; never a fedbit dependency):

    _flower_secagg.py N SHARES THRESHOLD DROPPED SHAPES_JSON

N SuperNodes, each returning the model it received (no training: the round is the
protocol alone); the first DROPPED partitions fail when asked for their masked vector
(after sharing their keys). Prints one JSON line: the server app thread's CPU seconds
for the round (``server_cpu_s``: the workflow's own work, what fedbit's coordinator time
measures), the simulation process's CPU seconds and the round's wall seconds.

This file does not import fedbit: it must run in Flower's environment.
"""

from __future__ import annotations

import json
import logging
import sys
import time


def main() -> None:
    import numpy as np
    from flwr.client import ClientApp, NumPyClient
    from flwr.client.mod import secaggplus_mod
    from flwr.common import Context, Message
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
    from flwr.server import LegacyContext, ServerApp, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
    from flwr.simulation import run_simulation

    n, shares, threshold, dropped = (int(a) for a in sys.argv[1:5])
    shapes = [tuple(s) for s in json.loads(sys.argv[5])]
    init = [np.random.default_rng(0).normal(0, 0.05, s).astype(np.float32) for s in shapes]
    out: dict = {}

    class Device(NumPyClient):
        def fit(self, parameters, config):
            return parameters, 600, {}

    def drop(msg: Message, ctx: Context, call_next):
        cfg = msg.content.config_records.get(RECORD_KEY_CONFIGS)
        if cfg is not None and cfg.get(Key.STAGE) == Stage.COLLECT_MASKED_VECTORS \
                and int(ctx.node_config.get("partition-id", n)) < dropped:
            raise RuntimeError("dropped")
        return call_next(msg, ctx)

    client = ClientApp(client_fn=lambda ctx: Device().to_client(), mods=[drop, secaggplus_mod])
    server = ServerApp()

    @server.main()
    def _main(grid, context) -> None:
        from flwr.common import ndarrays_to_parameters

        strategy = FedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=n, min_available_clients=n,
                          initial_parameters=ndarrays_to_parameters(init))
        ctx = LegacyContext(context=context, config=ServerConfig(num_rounds=1), strategy=strategy)
        wf = DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(num_shares=shares, reconstruction_threshold=threshold))
        c0, w0 = time.thread_time(), time.perf_counter()
        wf(grid, ctx)
        out["server_cpu_s"] = time.thread_time() - c0
        out["round_wall_s"] = time.perf_counter() - w0

    logging.getLogger("flwr").setLevel(logging.ERROR)
    p0 = time.process_time()
    run_simulation(server_app=server, client_app=client, num_supernodes=n,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    out["process_cpu_s"] = time.process_time() - p0
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
