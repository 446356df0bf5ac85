"""Training throughput of the Int8 engine vs PyTorch float32 (issue 25's targets).

Prints JSON lines (docs/architecture.md#benchmarks; plus ``target``, ``spread`` and
``timing``):

- ``throughput`` (samples/s), Int8 ``IntTrainer`` vs PyTorch float32 (``TorchTrainer``,
  ``torch.set_num_threads(1)``), one thread each, batch 32, random data, models
  ``fedshift_cnn`` (target >= 3.0) and ``digits_cnn`` (>= 4.0); for information,
  ``ratio_torch_heap_kept``: the same ratio against PyTorch with glibc keeping freed
  activations (``edge_client.intnn.memory.keep_freed_memory``; by default glibc returns
  every activation over 128 KiB to the kernel and the next step faults its pages in
  again, which costs PyTorch ~15-20 % in a VM);
- ``fedshift_cnn int8 2 threads``: ``throughput`` against the same engine on one thread
  (target >= 1.7, needs two idle cores) and ``throughput_vs_float`` against PyTorch
  float32 on two threads (>= 3.0); ``machine_2core_scaling``: what two threads gain on
  this machine at all, once per round beside the engines (an L2-resident stream and a
  SIMD dot-product loop on private arrays: 2.0 for two real cores; two vCPUs sharing a
  physical core or a busy host give ~1.0-1.3, and then no kernel reaches 1.7);
- ``rss`` (MB): peak RSS of a device process training Int8 ``fedshift_cnn``, anchored on
  the 150 MB budget: the device runtime's trainer (``edge_client.runtime.
  default_trainer_factory``, which drops LLVM's pages from the process's resident memory
  once the kernels are loaded: ``edge_client.intnn.memory``) in a process without scipy,
  as the device wheel installs it (numpy, numba, msgpack, paho-mqtt: Numba imports
  ``scipy.linalg`` at its first kernel when scipy is there), loading numpy and llvmlite
  from copies written as pip writes a fresh install: how many pages of a library a fault
  maps depends on how its file came into the page cache (docs/performance.md, "Memory").
  Extra fields: the anonymous peak, the peak with scipy installed, without the release,
  and with the libraries as found in this environment (``as_found_mb``);
- ``warm_start_s``: process start to the end of the first training step, Numba cache
  warm, the same device process, anchored on the 1 s budget: the process's CPU time
  (what the start costs on an idle machine; the wall time, which a loaded machine
  stretches, is in ``wall_s``; extra: with scipy).

The machine may be shared: the engines run in separate subprocesses that take turns
(``ROUNDS`` rounds, one with ``--quick``); each round gives each engine the best of 4
chunks of steps and a ratio; a line reports the median ratio over rounds and their
min..max (``spread``). One-thread rates are measured in the thread's own CPU time (time
when another process has the core does not count against either engine); two-thread
rates in wall time (the speed-up is the point), which a loaded machine lowers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

MODELS = ("fedshift_cnn", "digits_cnn")
BATCH = 32
DATA_SAMPLES = 256  # random samples, cycled through (memory does not grow with steps)
ROUNDS = 3
TARGETS = {"fedshift_cnn": 3.0, "digits_cnn": 4.0}
RSS_BUDGET_MB = 150.0
WARM_BUDGET_S = 1.0
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def emit(case: str, metric: str, value: float, unit: str, anchor: str, anchor_value: float,
         **extra: object) -> None:
    print(json.dumps({
        "bench": "train_throughput", "case": case, "metric": metric,
        "value": round(value, 4), "unit": unit, "anchor": anchor,
        "anchor_value": round(anchor_value, 4),
        "ratio": round(value / anchor_value, 4) if anchor_value else None, **extra,
    }), flush=True)


# ----------------------------------------------------------------------------- workers


def _random_data(name: str, n: int, seed: int = 0):
    import numpy as np

    from edge_client.data import Dataset
    from firmware_models import get_spec

    spec = get_spec(name)
    rng = np.random.default_rng(seed)
    x = rng.random((n, *spec.input_shape), dtype=np.float32)
    y = rng.integers(0, spec.num_classes, n).astype(np.int64)
    return spec, Dataset(x, y)


def _rates(run, steps: int, chunks: int = 4) -> dict:
    """Samples/s of the fastest of ``chunks`` runs of steps/chunks steps each, in the
    calling thread's CPU time and in wall time."""
    per = max(1, steps // chunks)
    cpu = wall = float("inf")
    for _ in range(chunks):
        c0, t0 = time.thread_time(), time.perf_counter()
        run(per)
        cpu = min(cpu, time.thread_time() - c0)
        wall = min(wall, time.perf_counter() - t0)
    return {"cpu": per * BATCH / max(cpu, 1e-9), "wall": per * BATCH / wall}


def worker_int(name: str, steps: int, bits: int, threads: int) -> dict:
    """Int training throughput in this process, after one warm-up step."""
    from edge_client.trainers import IntTrainer

    spec, data = _random_data(name, DATA_SAMPLES)
    tr = IntTrainer(spec, bits, seed=0, threads=threads)
    tr.train(data, steps=1, batch=BATCH)          # compile / cache load, buffers
    out = _rates(lambda k: tr.train(data, steps=k, batch=BATCH), steps)
    tr.model.close()
    return out


def worker_torch(name: str, steps: int, threads: int, heap: str = "default") -> dict:
    """PyTorch float32 training throughput; ``heap == "kept"``: with glibc told to keep
    freed activations (``keep_freed_memory``, as the emulator's processes run)."""
    import torch

    from edge_client.trainers import TorchTrainer

    if heap == "kept":
        from edge_client.intnn.memory import keep_freed_memory

        keep_freed_memory()
    torch.set_num_threads(threads)
    spec, data = _random_data(name, DATA_SAMPLES)
    tr = TorchTrainer(spec, seed=0)
    tr.train(data, steps=2, batch=BATCH)
    return _rates(lambda k: tr.train(data, steps=k, batch=BATCH), steps)


def _status_mb(key: str) -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def _llvm_mb() -> float:
    """RSS of libllvmlite's mappings (Numba's compiler, mapped at import), MB."""
    total = 0
    cur = ""
    with open("/proc/self/smaps", encoding="ascii", errors="replace") as f:
        for line in f:
            parts = line.split()
            if parts and "-" in parts[0] and ":" not in parts[0]:
                cur = parts[5] if len(parts) > 5 else ""
            elif line.startswith("Rss:") and "llvmlite" in cur:
                total += int(parts[1])
    return total / 1024.0


def _device_trainer(spec, bits: int, release: bool):
    """The device runtime's trainer (or the same without the page release)."""
    from edge_client.runtime import default_trainer_factory

    if release:
        return default_trainer_factory(spec, bits, 0)
    from edge_client.trainers import IntTrainer

    return IntTrainer(spec, bits, seed=0)


def _device_install(scipy: str) -> None:
    """``scipy == "absent"``: make ``import scipy`` fail, as on a device install."""
    if scipy == "absent":
        sys.modules["scipy"] = None  # type: ignore[assignment]


def worker_rss(name: str, steps: int, bits: int, scipy: str, release: str) -> dict:
    """Peak RSS of a process that trains like a device: the device runtime's trainer, a
    data set of DATA_SAMPLES, ``steps`` steps."""
    _device_install(scipy)
    import resource

    import llvmlite
    import numpy

    spec, data = _random_data(name, DATA_SAMPLES)
    tr = _device_trainer(spec, bits, release == "release")
    anon = 0.0
    for _ in range(max(1, steps // 4)):
        tr.train(data, steps=4, batch=BATCH)
        anon = max(anon, _status_mb("RssAnon"))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    fresh = os.environ.get("FEDBIT_BENCH_FRESH")
    return {"rss_mb": peak, "anon_mb": anon, "llvm_mb": _llvm_mb(),
            "now_mb": _status_mb("VmRSS"),
            "fresh": bool(fresh) and all(m.__file__.startswith(fresh) for m in (numpy, llvmlite))}


def worker_first_step(name: str, bits: int, scipy: str = "installed") -> dict:
    """Seconds from interpreter start (passed in env) to the end of the first step."""
    _device_install(scipy)
    spec, data = _random_data(name, BATCH)
    tr = _device_trainer(spec, bits, True)
    tr.train(data, steps=1, batch=BATCH)
    t_start = float(os.environ["FEDBIT_BENCH_T0"])
    return {"seconds": time.time() - t_start, "cpu": time.process_time()}


def worker_scaling() -> dict:
    """This machine's own two-core scaling, for reading the 2-thread line: a stream over
    a private 64 KB array (L2-resident) and a SIMD dot-product loop, on one thread and on
    two at once (two vCPUs that share a physical core or its caches scale ~1.0-1.3)."""
    import threading

    import numpy as np
    from numba import njit

    @njit(nogil=True)
    def stream(a, reps):  # pragma: no cover (compiled)
        s = 0
        for _ in range(reps):
            for i in range(a.size):
                s += a[i]
        return s

    @njit(nogil=True)
    def dots(a, b, reps):  # pragma: no cover (compiled)
        s = np.int32(0)
        for _ in range(reps):
            for i in range(a.size):
                s = np.int32(s + np.int32(a[i]) * np.int32(b[i]))
        return s

    out = {}
    for name, fn, make in (("l2_stream", stream, lambda: (np.ones(1 << 16, np.int8), 2000)),
                           ("simd_dot", dots, lambda: (np.ones(4096, np.int8),
                                                       np.ones(4096, np.int8), 20000))):
        a1, a2 = make(), make()
        fn(*a1[:-1], 1)
        one = two = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            fn(*a1)
            one = min(one, time.perf_counter() - t0)
            t = threading.Thread(target=fn, args=a2)
            t0 = time.perf_counter()
            t.start()
            fn(*a1)
            t.join()
            two = min(two, time.perf_counter() - t0)
        out[name] = round(2 * one / two, 3)
    return out


def run_worker(*args: str, fresh: bool = False) -> dict:
    """One worker subprocess; ``fresh``: numpy and llvmlite imported from copies written
    as a fresh install writes them (:func:`fresh_copies`)."""
    env = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               FEDBIT_BENCH_T0=repr(time.time()))
    with tempfile.TemporaryDirectory(prefix="fedbit-bench-") as tmp:
        if fresh:
            fresh_copies(tmp)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (tmp, env.get("PYTHONPATH")) if p)
            env["FEDBIT_BENCH_FRESH"] = tmp
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", *args],
                             capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"worker {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def fresh_copies(dest: str) -> None:
    """Copy the numpy and llvmlite packages (and numpy's bundled libraries) into ``dest``
    as pip installs a wheel: 64 KiB writes, times kept (their ``.pyc`` stay valid). The
    page cache then holds the files in small folios, as after a fresh install or after
    the loader read them; a file read whole (``cat``, a backup, a checksum) is held in
    large folios, which a page fault maps whole."""
    import llvmlite
    import numpy

    def copy(src: str, dst: str) -> None:
        with open(src, "rb") as a, open(dst, "wb") as b:
            shutil.copyfileobj(a, b, 64 * 1024)
        shutil.copystat(src, dst)

    for pkg in (os.path.dirname(numpy.__file__), os.path.dirname(llvmlite.__file__)):
        for d in (pkg, pkg + ".libs"):
            if os.path.isdir(d):
                shutil.copytree(d, os.path.join(dest, os.path.basename(d)), copy_function=copy,
                                ignore=shutil.ignore_patterns("tests"))


# ----------------------------------------------------------------------------- main


def _summary(ratios: list[float]) -> dict:
    return {"spread": [round(min(ratios), 3), round(max(ratios), 3)], "rounds": len(ratios)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps, one round (CI)")
    ap.add_argument("--bits", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        kind, name, *rest = args.worker
        if kind == "int":
            res = worker_int(name, int(rest[0]), int(rest[1]), int(rest[2]))
        elif kind == "torch":
            res = worker_torch(name, int(rest[0]), int(rest[1]), *rest[2:])
        elif kind == "scaling":
            res = worker_scaling()
        elif kind == "rss":
            res = worker_rss(name, int(rest[0]), int(rest[1]), rest[2], rest[3])
        else:
            res = worker_first_step(name, int(rest[0]), *rest[1:])
        print(json.dumps(res))
        return 0

    steps = {"fedshift_cnn": 8 if args.quick else 40, "digits_cnn": 40 if args.quick else 300}
    rounds = 1 if args.quick else max(1, args.rounds)
    bits = str(args.bits)
    run_worker("first", "fedshift_cnn", bits)    # fills the Numba cache if cold
    rates: dict[str, list[dict]] = {}
    for _ in range(rounds):  # the engines take turns; each round gives one ratio per line
        for name in MODELS:
            n = str(steps[name])
            rates.setdefault(f"{name} int 1", []).append(run_worker("int", name, n, bits, "1"))
            rates.setdefault(f"{name} torch 1", []).append(run_worker("torch", name, n, "1"))
            if not args.quick:
                rates.setdefault(f"{name} torch 1 kept", []).append(
                    run_worker("torch", name, n, "1", "kept"))
        n = str(steps["fedshift_cnn"])
        rates.setdefault("fedshift_cnn int 2", []).append(
            run_worker("int", "fedshift_cnn", n, bits, "2"))
        rates.setdefault("fedshift_cnn torch 2", []).append(
            run_worker("torch", "fedshift_cnn", n, "2"))
        rates.setdefault("scaling", []).append(run_worker("scaling", "-"))  # 2-thread context
    q = f"int{bits}"
    for name in MODELS:
        ints, torches = rates[f"{name} int 1"], rates[f"{name} torch 1"]
        ratios = [a["cpu"] / b["cpu"] for a, b in zip(ints, torches, strict=True)]
        k = ratios.index(statistics.median_low(ratios))
        extra = {}
        if f"{name} torch 1 kept" in rates:  # information: PyTorch without glibc's page faults
            kept = [a["cpu"] / b["cpu"] for a, b in zip(ints, rates[f"{name} torch 1 kept"],
                                                         strict=True)]
            extra = {"ratio_torch_heap_kept": round(statistics.median_low(kept), 4)}
        emit(f"{name} {q}", "throughput", ints[k]["cpu"], "samples/s",
             f"{name} torch float32 1 thread", torches[k]["cpu"], target=f">= {TARGETS[name]}",
             timing="thread CPU time, best of 4 chunks", **_summary(ratios), **extra)
    machine = {k: [r[k] for r in rates["scaling"]] for k in rates["scaling"][0]}
    one, two = rates["fedshift_cnn int 1"], rates["fedshift_cnn int 2"]
    torch2 = rates["fedshift_cnn torch 2"]
    for metric, anchor, base, target in (
            ("throughput", f"fedshift_cnn {q} 1 thread", one, ">= 1.7"),
            ("throughput_vs_float", "fedshift_cnn torch float32 2 threads", torch2, ">= 3.0")):
        ratios = [a["wall"] / b["wall"] for a, b in zip(two, base, strict=True)]
        k = ratios.index(statistics.median_low(ratios))
        emit(f"fedshift_cnn {q} 2 threads", metric, two[k]["wall"], "samples/s", anchor,
             base[k]["wall"], target=target, timing="wall, best of 4 chunks (2 idle cores needed)",
             cpus=os.cpu_count(), load_1min=round(os.getloadavg()[0], 2),
             machine_2core_scaling=machine, **_summary(ratios))
    n = str(steps["fedshift_cnn"])
    mem = run_worker("rss", "fedshift_cnn", n, bits, "absent", "release", fresh=True)
    if not mem["fresh"]:
        raise RuntimeError("the rss worker did not import numpy and llvmlite from the fresh copies")
    extra = {}
    if not args.quick:  # the variants: with scipy installed, without the release, as found
        extra["with_scipy_mb"] = round(run_worker(
            "rss", "fedshift_cnn", n, bits, "installed", "release", fresh=True)["rss_mb"], 1)
        extra["without_release_mb"] = round(run_worker(
            "rss", "fedshift_cnn", n, bits, "absent", "keep", fresh=True)["rss_mb"], 1)
        extra["as_found_mb"] = round(
            run_worker("rss", "fedshift_cnn", n, bits, "absent", "release")["rss_mb"], 1)
    emit(f"fedshift_cnn {q}", "rss", mem["rss_mb"], "MB", "budget", RSS_BUDGET_MB,
         target="<= 1.0", process="device install (no scipy, numpy and llvmlite freshly "
                                  "written), device runtime's trainer",
         anon_mb=round(mem["anon_mb"], 1), after_warmup_mb=round(mem["now_mb"], 1),
         llvmlite_mb=round(mem["llvm_mb"], 1), **extra)
    warm = [run_worker("first", "fedshift_cnn", bits, "absent") for _ in range(rounds)]
    cpu = [w["cpu"] for w in warm]
    extra = {}
    if not args.quick:
        extra["with_scipy_s"] = round(statistics.median(
            run_worker("first", "fedshift_cnn", bits, "installed")["cpu"] for _ in range(rounds)), 3)
    emit(f"fedshift_cnn {q}", "warm_start_s", statistics.median(cpu), "s", "budget",
         WARM_BUDGET_S, target="<= 1.0", process="device install (no scipy)",
         timing="the process's CPU time to the end of its first step (wall on a loaded "
                "machine: wall_s)", spread=[round(min(cpu), 3), round(max(cpu), 3)],
         wall_s=round(statistics.median(w["seconds"] for w in warm), 3), **extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
