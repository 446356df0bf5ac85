"""Inference throughput of the ONNX export vs the Numba engine vs PyTorch float32.

    python benchmarks/inference.py [--quick] [--profile]

``fedshift_cnn``, batch 1 and 32, one thread per engine, random images (integer inputs
``round(pixel * 127)``), each engine in its own subprocess (``NUMBA_NUM_THREADS=1``,
ONNX Runtime ``intra_op_num_threads=1`` sequential, ``torch.set_num_threads(1)``); the
engines take turns three times (once with ``--quick``) and each reports its best (in the
calling thread's CPU time):

- ONNX Runtime, Int8 integer graph (``fedbit export``), anchored on the Numba engine's
  Int8 forward (``IntModel.forward``) and on torch float32 (``TorchTrainer.forward``);
- the Numba engine, anchored on torch float32;
- ONNX Runtime, float32 graph, anchored on torch float32.

Prints JSON lines (docs/architecture.md#benchmarks). ``--profile`` also prints, on stderr,
ONNX Runtime's integer-graph time per operator type from its own profiler: microseconds a
call at batch 1 and the share of the time at batch 32 (profiling adds ~1 us to each node).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MODEL = "fedshift_cnn"
BITS = 8
BATCHES = (1, 32)
ROUNDS = 3  # turns of every engine (full run); --quick: one
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def emit(case: str, metric: str, value: float, unit: str, anchor: str, anchor_value: float,
         **extra: object) -> None:
    print(json.dumps({
        "bench": "inference", "case": case, "metric": metric, "value": round(value, 4),
        "unit": unit, "anchor": anchor, "anchor_value": round(anchor_value, 4),
        "ratio": round(value / anchor_value, 4) if anchor_value else None, **extra,
    }), flush=True)


# ----------------------------------------------------------------------------- workers


def _images(batch: int, seed: int = 0):
    import numpy as np

    from firmware_models import get_spec

    spec = get_spec(MODEL)
    x = np.random.default_rng(seed).random((batch, *spec.input_shape), dtype=np.float32)
    return spec, x


def _best_rate(run, batch: int, iters: int, chunks: int = 4) -> float:
    """Samples/s of the fastest of ``chunks`` timed runs of iters/chunks calls each, in
    the calling thread's CPU time (every engine runs single-threaded on the calling
    thread; on a shared machine, time when another process has the core does not count
    against any of them)."""
    run()  # warm-up (allocation, caches)
    per = max(1, iters // chunks)
    best = float("inf")
    for _ in range(chunks):
        t0 = time.thread_time()
        for _ in range(per):
            run()
        best = min(best, time.thread_time() - t0)
    return per * batch / max(best, 1e-9)


def worker_ort(iters: dict[int, int], profile: bool) -> dict:
    from edge_client.data import quantize_images
    from edge_client.intnn import IntModel, init_int, init_shared
    from edge_client.intnn.export import int_model_onnx, shared_onnx
    from edge_client.predict import ort_session

    spec, _ = _images(1)
    m = IntModel(spec, BITS)
    m.load_int(init_int(spec, 0, BITS))
    graphs = {"int": int_model_onnx(m), "float": shared_onnx(spec, init_shared(spec, 0), 32)}
    out: dict = {}
    for kind, graph in graphs.items():
        sess = ort_session(graph, threads=1)
        for batch, n in iters.items():
            _, x = _images(batch)
            feed = {"x": quantize_images(x, BITS) if kind == "int" else x}
            out[f"{kind}_{batch}"] = _best_rate(lambda s=sess, f=feed: s.run(None, f), batch, n)
    if profile:
        out["profile"] = _ort_profile(graphs["int"], BITS)
    return out


def _ort_profile(graph, bits: int) -> dict[str, dict[str, float]]:
    """Integer graph, per operator type (ONNX Runtime's profiler): ``"1"``, microseconds a
    call at batch 1; ``"32"``, the share of the kernel time at batch 32."""
    calls = 200
    one = _ort_op_times(graph, bits, 1, calls)
    many = _ort_op_times(graph, bits, 32, 5)
    total = sum(many.values()) or 1
    return {"1": {op: round(v / calls, 1) for op, v in one.most_common()},
            "32": {op: round(v / total, 4) for op, v in many.most_common()}}


def _ort_op_times(graph, bits: int, batch: int, calls: int):
    """Microseconds per operator type over ``calls`` profiled runs after a first one (whose
    nodes, which allocate, are left out)."""
    import collections

    import onnxruntime as ort

    from edge_client.data import quantize_images

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(os.environ.get("TMPDIR", "/tmp"), "fedbit-ort")
    sess = ort.InferenceSession(graph.SerializeToString(), so, providers=["CPUExecutionProvider"])
    _, x = _images(batch)
    feed = {"x": quantize_images(x, bits)}
    for _ in range(calls + 1):
        sess.run(None, feed)
    path = sess.end_profiling()
    try:
        with open(path, encoding="utf-8") as f:
            events = json.load(f)
    finally:
        os.remove(path)
    nodes = [e for e in events
             if e.get("cat") == "Node" and str(e.get("name", "")).endswith("_kernel_time")]
    per_call = len(nodes) // (calls + 1)
    per_op: collections.Counter = collections.Counter()
    for e in nodes[per_call:]:  # the first call's nodes: allocation, caches
        per_op[e["args"]["op_name"]] += e["dur"]
    return per_op


def worker_numba(iters: dict[int, int]) -> dict:
    from edge_client.intnn import IntModel, init_int

    spec, _ = _images(1)
    m = IntModel(spec, BITS)
    m.load_int(init_int(spec, 0, BITS))
    out = {}
    for batch, n in iters.items():
        _, x = _images(batch)
        xq = m.prepare_inputs(x)
        ws = m.workspace(batch, train=False)

        def run(ws=ws, xq=xq, batch=batch):
            ws.x[:batch] = xq
            return m.forward(ws, batch)

        out[f"int_{batch}"] = _best_rate(run, batch, n)
    return out


def worker_torch(iters: dict[int, int]) -> dict:
    import torch

    from edge_client.trainers import TorchTrainer

    torch.set_num_threads(1)
    spec, _ = _images(1)
    tr = TorchTrainer(spec, seed=0)
    out = {}
    for batch, n in iters.items():
        _, x = _images(batch)
        xt = torch.from_numpy(x)

        def run(xt=xt):
            with torch.no_grad():
                return tr.forward(xt)

        out[f"float_{batch}"] = _best_rate(run, batch, n)
    return out


def run_worker(*args: str) -> dict:
    env = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", *args],
                         capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"worker {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer calls (CI)")
    ap.add_argument("--profile", action="store_true",
                    help="print ONNX Runtime's time per operator type on stderr")
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        kind, spec_iters = args.worker[0], json.loads(args.worker[1])
        iters = {int(b): int(n) for b, n in spec_iters.items()}
        if kind == "ort":
            res = worker_ort(iters, args.worker[2:] == ["profile"])
        elif kind == "numba":
            res = worker_numba(iters)
        else:
            res = worker_torch(iters)
        print(json.dumps(res))
        return 0

    iters = {1: 40, 32: 8} if args.quick else {1: 400, 32: 60}
    spec_iters = json.dumps(iters)
    # the machine is shared: the engines take turns, ROUNDS times, and each keeps its best
    numba: dict = {}
    ort: dict = {}
    torch: dict = {}
    for r in range(1 if args.quick else ROUNDS):
        for best, res in ((numba, run_worker("numba", spec_iters)),
                          (ort, run_worker("ort", spec_iters,
                                           *(["profile"] if args.profile and r == 0 else []))),
                          (torch, run_worker("torch", spec_iters))):
            for key, v in res.items():
                best[key] = v if key == "profile" else max(best.get(key, 0.0), v)
    name, q = MODEL, f"int{BITS}"
    for b in BATCHES:
        ort_int, ort_float = ort[f"int_{b}"], ort[f"float_{b}"]
        nb, tf = numba[f"int_{b}"], torch[f"float_{b}"]
        emit(f"{name} {q} onnxruntime batch {b}", "throughput", ort_int, "samples/s",
             f"{name} {q} numba engine batch {b}", nb, threads=1)
        emit(f"{name} {q} onnxruntime batch {b}", "throughput_vs_float", ort_int, "samples/s",
             f"{name} torch float32 batch {b}", tf, threads=1)
        emit(f"{name} {q} numba engine batch {b}", "throughput", nb, "samples/s",
             f"{name} torch float32 batch {b}", tf, threads=1)
        emit(f"{name} float32 onnxruntime batch {b}", "throughput", ort_float, "samples/s",
             f"{name} torch float32 batch {b}", tf, threads=1)
    if args.profile:
        prof = ort["profile"]
        times = ", ".join(f"{op} {v:g}" for op, v in prof["1"].items())
        shares = ", ".join(f"{op} {v:.0%}" for op, v in prof["32"].items())
        print(f"onnxruntime {q} graph, batch 1, us a call per operator type (profiled: each "
              f"node ~1 us more): {times}", file=sys.stderr)
        print(f"onnxruntime {q} graph, batch 32, time per operator type: {shares}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
