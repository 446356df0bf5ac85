"""``make gpu-check``: the CUDA engine on a GPU machine, in one run of at most 8 minutes,
one JSON line per step in ``$OUT/gpu-check.jsonl`` (default ``gpu-check/``):

1. ``deps``: the modules it needs import (missing ones installed from ``$OUT/wheels`` when
   there is one: ``make gpu-wheels`` fills it on a machine with a package index);
2. ``tests``: the CUDA engine's tests (``TESTS``) on the GPU, every kernel and training
   step byte for byte against the CPU engine;
3. ``fleet``: a 3-round emulated fleet (Int8 and Int16 devices) with ``round.engine =
   "cuda"`` against the CPU emulator: the same metrics and the same update bytes;
4. ``bench``: benchmarks/gpu.py's figures (``$OUT/bench.jsonl``).

Without a GPU it says so and exits 0 having checked nothing. ``--quick`` runs every step
small under Numba's CUDA simulator (the script's path on a machine without a GPU).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: modules the steps import (the coordinator's emulator, its reports, the tests, torch)
NEEDED = ("numpy", "numba", "msgpack", "paho.mqtt", "cryptography", "torch", "pytest", "scipy", "matplotlib",
          "aiohttp", "rich", "prometheus_client", "sklearn")
TESTS = ("tests/packages/edge_client/test_cuda_engine.py", "tests/packages/coordinator/test_cuda_fleet.py", "tests/packages/edge_client/test_cuda_device.py")
#: seconds each step may take (8 minutes in all)
LIMITS = {"tests": 200, "fleet": 90, "bench": 170}


def emit(out: Path, rec: dict) -> None:
    rec = {"time": round(time.time(), 1), **rec}
    print(json.dumps(rec), flush=True)
    with open(out / "gpu-check.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")


def deps(out: Path) -> dict:
    missing = [m for m in NEEDED if importlib.util.find_spec(m.split(".")[0]) is None]
    wheels = out / "wheels"
    installed = []
    if missing and wheels.is_dir():
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(wheels),
                               *[{"paho.mqtt": "paho-mqtt", "sklearn": "scikit-learn"}.get(m, m) for m in missing]],
                              capture_output=True, text=True)
        installed = missing if proc.returncode == 0 else []
        importlib.invalidate_caches()
        missing = [m for m in NEEDED if importlib.util.find_spec(m.split(".")[0]) is None]
    return {"step": "deps", "ok": not missing, "missing": missing, "installed_from_wheels": installed}


def run_tests(env: dict, quick: bool) -> dict:
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *TESTS]
    if quick:
        cmd += ["-k", "not emulator"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=LIMITS["tests"])
    except subprocess.TimeoutExpired as exc:
        return {"step": "tests", "ok": False, "why": f"timed out after {exc.timeout} s"}
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    return {"step": "tests", "ok": proc.returncode == 0, "summary": tail[-1] if tail else "",
            "seconds": round(time.monotonic() - t0, 1), "tail": tail if proc.returncode else []}


FLEET_CODE = r"""
import json, sys, time
from pathlib import Path
from coordinator.emulation.config import from_dict
from coordinator.emulation.pool import WorkerPool
from coordinator.emulation.emulator import Emulator
from edge_client.protocol import decode_message

out, quick = Path(sys.argv[1]), sys.argv[2] == "1"
WALL = {"time", "run", "round_seconds", "wait_seconds", "collect_seconds", "aggregate_seconds",
        "coordinator_seconds", "coordinator_cpu_seconds", "eval_seconds", "announce_seconds", "handle_seconds",
        "checkpoint_seconds", "device_train_seconds", "device_wall_seconds", "health_seconds"}
sent, engine = {}, ["cpu"]
publish = WorkerPool._publish
def record(self, device_id, payload):
    u = decode_message(payload)
    sent.setdefault(engine[0], {})[(device_id, u.round_id)] = [(t.name, t.data) for t in u.tensors] + [u.train_loss]
    return publish(self, device_id, payload)
WorkerPool._publish = record
tiny = out / "tiny.toml"
tiny.write_text('input = [1, 8, 8]\nlayers = [{type = "conv2d", out = 2, kernel = 3, stride = 2, padding = 1}, '
                '{type = "relu"}, {type = "maxpool2d", kernel = 2}, {type = "flatten"}, {type = "linear", out = 10}]\n')
raw = {"model": str(tiny) if quick else "digits_cnn", "rounds": 1 if quick else 3, "strategy": "fedavg",
       "transport": "inproc", "devices": {"raspberry-pi-4": 2 if quick else 12, "jetson-nano": 1 if quick else 4},
       "data": {"partition": "dirichlet", "alpha": 0.5}, "train": {"steps": 2 if quick else 10, "batch": 4 if quick else 32},
       "clock": {"seconds_per_sample": {"int8": 2e-5, "int16": 4e-5}}}
res, secs = {}, {}
for e in ("cpu", "cuda"):
    engine[0] = e
    cfg = from_dict(raw | {"name": e, "round": {"workers": 1, "engine": e}}, str(out / "fleet.toml"))
    t0 = time.monotonic()
    Emulator(cfg, 5, out / f"fleet-{e}").run()
    secs[e] = round(time.monotonic() - t0, 1)
    res[e] = [{k: v for k, v in json.loads(l).items() if k not in WALL}
              for l in (out / f"fleet-{e}" / "out" / "metrics.jsonl").read_text().splitlines()]
same_metrics = res["cpu"] == res["cuda"]
same_updates = sent.get("cpu") == sent.get("cuda")
print(json.dumps({"step": "fleet", "ok": same_metrics and same_updates and len(sent.get("cpu", {})) > 0,
                  "metrics_equal": same_metrics, "updates_equal": same_updates, "rounds": len(res["cpu"]),
                  "updates": len(sent.get("cpu", {})), "seconds": secs,
                  "accuracy": res["cuda"][-1].get("accuracy") if res["cuda"] else None}))
"""


def fleet(env: dict, out: Path, quick: bool) -> dict:
    try:
        proc = subprocess.run([sys.executable, "-c", FLEET_CODE, str(out), "1" if quick else "0"], capture_output=True,
                              text=True, env=env, cwd=ROOT, timeout=LIMITS["fleet"])
    except subprocess.TimeoutExpired as exc:
        return {"step": "fleet", "ok": False, "why": f"timed out after {exc.timeout} s"}
    last = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"step": "fleet"')]
    if proc.returncode or not last:
        return {"step": "fleet", "ok": False, "tail": (proc.stdout + proc.stderr).strip().splitlines()[-15:]}
    return json.loads(last[-1])


def bench(env: dict, out: Path, quick: bool) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--out", str(out / "bench.jsonl")]
    if quick:
        cmd += ["--quick", "--simulator"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=LIMITS["bench"])
    except subprocess.TimeoutExpired as exc:
        return {"step": "bench", "ok": False, "why": f"timed out after {exc.timeout} s"}
    lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    return {"step": "bench", "ok": proc.returncode == 0 and bool(lines),
            "figures": [{k: r[k] for k in ("case", "metric", "value", "unit", "anchor_value", "ratio")} for r in lines],
            "tail": [] if lines else (proc.stdout + proc.stderr).strip().splitlines()[-15:]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu-check", help="folder of the JSON lines")
    ap.add_argument("--quick", action="store_true", help="small, under Numba's CUDA simulator")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               NUMBA_ENABLE_CUDASIM="1" if args.quick else "0")
    env.pop("CI", None)
    os.environ.update({"NUMBA_ENABLE_CUDASIM": env["NUMBA_ENABLE_CUDASIM"]})
    sys.path.insert(0, str(ROOT))
    t0 = time.monotonic()
    rec = deps(out)
    emit(out, rec)
    if not rec["ok"]:
        print(f"gpu-check: missing {rec['missing']}: bring their wheels in {out / 'wheels'} (make gpu-wheels)")
        return 1
    from edge_client.intnn.cuda.probe import describe

    info = describe()
    emit(out, {"step": "gpu", **info})
    if not info["usable"]:
        print(f"gpu-check: no GPU here ({info['why']}); nothing checked. Run it on a GPU machine, or "
              f"`make gpu-check QUICK=1` for the script's path under Numba's CUDA simulator.")
        return 0
    results = []
    for step in (lambda: run_tests(env, args.quick), lambda: fleet(env, out, args.quick),
                 lambda: bench(env, out, args.quick)):
        results.append(step())
        emit(out, results[-1])  # each as it ends: a step cut short leaves the others' lines
    ok = all(r["ok"] for r in results)
    emit(out, {"step": "done", "ok": ok, "seconds": round(time.monotonic() - t0, 1), "quick": args.quick})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
