"""The integer engine on a GPU (docs/performance.md#the-gpu), each figure against an anchor
measured in the same run on the same machine:

- one device, Int8 ``fedshift_cnn``, batch 32: training samples/s of the CUDA engine vs
  PyTorch float32 (cuDNN) training the same model on the same GPU;
- a fleet round, 100 Int8 devices x 50 local steps of batch 32, trained together on the
  GPU (``edge_client.intnn.cuda.fleet``) vs the CPU engine in ``workers`` processes (the
  CPU emulator's workers: each device trained by an ``IntTrainer``) and vs PyTorch
  float32 training the same devices' steps one device after another on the GPU;
- the conv layers' share of the GPU's int8 rate: their multiply-accumulates per second in
  the fleet round over the int8 rate of the GPU's tensor cores (``torch._int_mm``);
- the CPU engine in 16 worker processes vs 1 (the emulator's workers: 16 vs 1).

Without a GPU (numba's real CUDA target finds none) it prints one line saying so on
stderr and nothing else; ``--simulator`` runs it under Numba's CUDA simulator anyway
(``make gpu-check QUICK=1`` here: the script's path, not its figures).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TINY = {"name": "tiny", "input": [3, 8, 8], "layers": [
    {"type": "conv2d", "out": 4, "kernel": 3, "padding": 1}, {"type": "relu"},
    {"type": "maxpool2d", "kernel": 2}, {"type": "flatten"}, {"type": "linear", "out": 10}]}


def spec_of(quick: bool):
    from firmware_models import fedshift_cnn
    from firmware_models.files import spec_from_table

    return spec_from_table(TINY, "tiny") if quick else fedshift_cnn()


def line(case: str, metric: str, value: float, unit: str, anchor: str, anchor_value: float, **kw) -> dict:
    return {"bench": "gpu", "case": case, "metric": metric, "value": value, "unit": unit, "anchor": anchor,
            "anchor_value": anchor_value, "ratio": value / anchor_value if anchor_value else 0.0, **kw}


def data(spec, n: int, seed: int = 0):
    from edge_client.data import Dataset

    rng = np.random.default_rng(seed)
    return Dataset(rng.integers(0, 256, (n, *spec.input_shape)).astype(np.uint8),
                   rng.integers(0, spec.num_classes, n).astype(np.int64))


# ----------------------------------------------------------------------------- torch


def torch_device() -> str:
    """Where the torch anchors run: the GPU, or the CPU under the simulator (the path only)."""
    from edge_client.intnn.cuda import device as dev

    return "cuda" if dev.mode() == "gpu" else "cpu"


def torch_sync() -> None:
    import torch

    if torch_device() == "cuda":
        torch.cuda.synchronize()


class TorchDevice:
    """A float32 device training ``spec`` on the GPU with torch (cuDNN), plain SGD."""

    def __init__(self, spec, seed: int = 0) -> None:
        import torch

        self.torch = torch
        torch.backends.cudnn.benchmark = True
        g = torch.Generator().manual_seed(seed)
        self.spec = spec
        self.params = [(torch.randn(tuple(s), generator=g) * 0.05).to(torch_device()).requires_grad_()
                       for s in spec.param_shapes()]

    def step(self, x, y) -> None:
        torch = self.torch
        h, p = x, 0
        for layer in self.spec.layers:
            if layer.has_weights:
                h = layer.torch_forward(torch, h, self.params[p])
                p += 1
            else:
                h = layer.torch_forward(torch, h)
        loss = torch.nn.functional.cross_entropy(h, y)
        grads = torch.autograd.grad(loss, self.params)
        with torch.no_grad():
            for w, gr in zip(self.params, grads, strict=True):
                w.sub_(0.01 * gr)


def torch_batches(ds, batch: int, steps: int, seed: int):
    import torch

    rng = np.random.default_rng(seed)
    where = torch_device()
    x = torch.from_numpy(ds.x.astype(np.float32) / 255).to(where)
    y = torch.from_numpy(ds.y).to(where)
    return [(x[i], y[i]) for i in (torch.from_numpy(rng.integers(0, len(ds), batch)).to(where)
                                   for _ in range(steps))]


# ----------------------------------------------------------------------------- measurements


def one_device(spec, quick: bool, gpu: str) -> list[dict]:
    from edge_client.intnn.cuda import device as dev
    from edge_client.trainers import IntTrainer

    batch, steps = (2, 2) if quick else (32, 60)
    ds = data(spec, batch * 8)
    tr = IntTrainer(spec, 8, seed=1, engine="cuda")
    tr.train(ds, steps=2, batch=batch)  # compile, load
    t0 = time.perf_counter()
    tr.train(ds, steps=steps, batch=batch)
    dev.synchronize()
    int_sps = steps * batch / (time.perf_counter() - t0)
    td = TorchDevice(spec)
    work = torch_batches(ds, batch, steps + 5, 0)
    for x, y in work[:5]:
        td.step(x, y)
    torch_sync()
    t0 = time.perf_counter()
    for x, y in work[5:]:
        td.step(x, y)
    torch_sync()
    torch_sps = steps * batch / (time.perf_counter() - t0)
    return [line(f"{spec.name} int8 batch {batch} one device on {gpu}", "throughput", int_sps, "samples/s",
                 "torch float32 cuDNN, same model, same GPU", torch_sps)]


def _cpu_device(args) -> float:
    """One device's training on the CPU engine, in a worker process (seconds)."""
    spec_quick, seed, n, steps, batch = args
    from edge_client.trainers import IntTrainer

    spec = spec_of(spec_quick)
    ds = data(spec, n, seed)
    tr = IntTrainer(spec, 8, seed=seed)
    t0 = time.perf_counter()
    tr.train(ds, steps=steps, batch=batch)
    return time.perf_counter() - t0


def cpu_fleet(quick: bool, devices: int, steps: int, batch: int, workers: int) -> float:
    """Wall seconds of ``devices`` CPU devices' steps in ``workers`` processes (one thread
    each, as the emulator's workers), after each process loaded its kernels."""
    env = {"NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    os.environ.update(env)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_cpu_device, [(quick, 0, batch * 2, 1, batch)] * workers))  # warm each process
        t0 = time.perf_counter()
        list(pool.map(_cpu_device, [(quick, s, batch * 4, steps, batch) for s in range(devices)]))
        return time.perf_counter() - t0


def fleet(spec, quick: bool, gpu: str, cores: int) -> list[dict]:
    from edge_client.intnn.cuda import device as dev
    from edge_client.intnn.cuda.fleet import FleetJob, ResidentData, train_together
    from edge_client.trainers import IntTrainer

    devices, steps, batch = (3, 2, 2) if quick else (100, 50, 32)
    per = batch * 4
    ds = data(spec, devices * per)
    resident = ResidentData(ds.x)

    def jobs():
        out = []
        for d in range(devices):
            rows = np.arange(d * per, (d + 1) * per)
            tr = IntTrainer(spec, 8, seed=d)
            out.append(FleetJob(tr, tr.plan(ds.subset(rows), steps=steps, batch=batch), rows))
        return out

    train_together(jobs()[:2], resident)  # compile, load
    # every kernel's time: the same round with a synchronizing launcher (where the next
    # optimization goes: the conv kernels' share and, among them, which of the three)
    kernel_s: dict[str, float] = {}
    launch = dev.launch

    def timed(kernel, *a):
        name = getattr(getattr(kernel, "py_func", kernel), "__name__", "") or "?"
        dev.synchronize()
        t = time.perf_counter()
        launch(kernel, *a)
        dev.synchronize()
        kernel_s[name] = kernel_s.get(name, 0.0) + time.perf_counter() - t

    work = jobs()
    dev.synchronize()
    t0 = time.perf_counter()
    train_together(work, resident)
    dev.synchronize()
    gpu_s = time.perf_counter() - t0
    dev.launch = timed  # every kernel launches through the device module
    try:
        train_together(jobs(), resident)
    finally:
        dev.launch = launch
    model_macs = sum(op.macs() for op in work[0].trainer.model.ops if op.param >= 0 and len(op.in_shape) == 3)
    conv_macs = 3 * model_macs * devices * steps * batch  # forward, backward-data, gradient
    workers = min(16, cores)
    cpu_s = cpu_fleet(quick, devices, steps, batch, workers)
    out = [line(f"{spec.name} int8 fleet round {devices} devices x {steps} steps batch {batch} on {gpu}",
                "speedup", cpu_s / gpu_s, "x", f"CPU engine, {workers} worker processes (emulator workers)", 1.0,
                gpu_seconds=gpu_s, cpu_seconds=cpu_s)]
    td = TorchDevice(spec)
    work_t = torch_batches(ds, batch, steps, 1)
    td.step(*work_t[0])
    torch_sync()
    t0 = time.perf_counter()
    for _ in range(devices):  # one device after another, each its own model
        td = TorchDevice(spec)
        for x, y in work_t:
            td.step(x, y)
    torch_sync()
    torch_s = time.perf_counter() - t0
    out.append(line(out[0]["case"], "speedup_vs_torch_sequential", torch_s / gpu_s, "x",
                    "torch float32, the devices one after another on the same GPU", 1.0, torch_seconds=torch_s))
    peak = int8_peak(256 if quick else 8192)
    conv_s = sum(v for k, v in kernel_s.items() if k.startswith("conv_"))
    rate = conv_macs / conv_s if conv_s else 0.0
    out.append(line(f"{spec.name} int8 conv layers in the fleet round on {gpu}", "int8_rate_fraction",
                    rate / peak if peak else 0.0, "fraction", "tensor-core int8 rate (torch._int_mm)",
                    1.0, peak_macs_per_s=peak, conv_macs_per_s=rate, conv_seconds=conv_s,
                    kernel_seconds={k: round(v, 4) for k, v in sorted(kernel_s.items(), key=lambda kv: -kv[1])}))
    return out


def int8_peak(n: int) -> float:
    """Multiply-accumulates per second of int8 matrix products on the tensor cores."""
    import torch

    a = torch.randint(-127, 127, (n, n), dtype=torch.int8, device=torch_device())
    b = torch.randint(-127, 127, (n, n), dtype=torch.int8, device=torch_device())
    torch._int_mm(a, b)
    torch_sync()
    t0 = time.perf_counter()
    for _ in range(10):
        torch._int_mm(a, b)
    torch_sync()
    return 10 * n ** 3 / (time.perf_counter() - t0)


def cpu_workers(quick: bool, cores: int) -> list[dict]:
    devices, steps, batch = (4, 1, 2) if quick else (64, 5, 32)
    many = min(16, cores)
    one = cpu_fleet(quick, devices, steps, batch, 1)
    sixteen = cpu_fleet(quick, devices, steps, batch, many)
    return [line(f"cpu engine {devices} devices x {steps} steps, {many} workers vs 1 ({cores} cores)", "speedup",
                 one / sixteen, "x", "1 worker, 1 thread", 1.0, seconds_many=sixteen, seconds_one=one)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (the script's path, not its figures)")
    ap.add_argument("--simulator", action="store_true", help="run under Numba's CUDA simulator if no GPU")
    ap.add_argument("--out", help="append the JSON lines here too")
    args = ap.parse_args(argv)
    from edge_client.intnn.cuda import device as dev
    from edge_client.intnn.cuda.probe import usable

    ok, why = usable()
    if not ok or (dev.simulator() and not args.simulator):
        print(f"benchmarks/gpu.py: no GPU here ({why}); nothing measured (make gpu-check on a GPU machine)",
              file=sys.stderr)
        return 0
    gpu = why.split(" (compute")[0]
    cores = len(os.sched_getaffinity(0))
    spec = spec_of(args.quick)
    lines = one_device(spec, args.quick, gpu) + fleet(spec, args.quick, gpu, cores) + cpu_workers(args.quick, cores)
    for rec in lines:
        rec["quick"] = args.quick
        print(json.dumps(rec), flush=True)
    if args.out:
        with open(args.out, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
