"""Real fleets against a real ``fedbit serve``: N MQTT connections from a few processes.

Each run (one fleet size N) enrols N devices in a fresh job (passwords, the ACL and the
device MAC; no TLS: the handshakes would be the load generator's cost, not the
coordinator's), starts ``fedbit serve`` (its embedded mosquitto, ``fedshift_cnn``,
FedShift, ``--min-present N``: a round starts once every device is present, K of them
selected) and ``--procs`` load processes. Every device is one MQTT 3.1.1 connection of
``benchmarks/_mqtt_async.py`` that does what ``edge_client.runtime`` does: a signed
presence and hello (retained, a signed last will), the round, its model variant and the
status subscribed; when a retained announcement selects it, it waits for its variant
(``--download all``: every connected device receives every model, as the runtime does
today; ``selected``: it subscribes to the model only once selected), and ``--compute-s``
(spread +-``--jitter``) after the announcement arrived (or as soon as its model is in,
if later) publishes a real signed update (4-bit ASYM
``fedshift_cnn`` tensors, QoS 1, awaited until its PUBACK) and sends it again when the
round is announced again; on ``done`` it says offline and disconnects. A model is checked
once per load process (decoded, digest): the other devices of the process stream it in
64 KiB chunks and compare its length and three 4 KiB samples with that copy, so that
thousands of simultaneous downloads do not hold one copy each.

Measured per run: ``connections_held`` (connected at the first round and never dropped),
``round_seconds`` (steady rounds, after the first), the coordinator's CPU per accepted
update over sockets (the ``fedbit serve`` process and its children but mosquitto, in
each round's collection window) against the same ingest without sockets in the same run
(an in-process coordinator, the same enrolled and signed payloads as a burst; target
<= 1.5x), updates/s over sockets (collection window from the first update published),
the cores the coordinator (with its ingest workers), mosquitto and the load processes
used in that window (which one was the limit), mosquitto's CPU per round, and ``lost``:
updates the broker acknowledged to a device that no round counted (must be 0). Each line
carries ``loadavg`` (``/proc/loadavg``'s 1-minute figure at the run's start and end): on
a shared machine read the figures next to it.

Then, with ``--workers 1,2`` (the default), the same fleet of ``--workers-devices`` (1,000),
every device selected, with 1 and then 2 ingest workers back to back: ``ingest_speedup``,
the updates/s with 2 against 1 (target 1.6 where the broker is not the limit: the
lines' ``coord_cores`` / ``broker_cores`` / ``load_cores`` say which was).

    .venv/bin/python benchmarks/fleet_load.py [--quick] [--devices 100,1000,5000,10000]
        [--selected 1000] [--rounds 3] [--procs 2] [--compute-s 5] [--jitter 0.05]
        [--download selected|all] [--ingest-workers 0] [--workers 1,2] [--workers-devices 1000]

``--quick``: 30 devices of ``mlp``, 10 selected, 2 rounds, one load process (under a
minute). The process raises its own file-descriptor limit (its children inherit it) and
stops by itself (``--max-seconds``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from _fleet_devices import JOB, MODEL, load_main, update_payload, update_tensors  # noqa: E402

BENCH = "fleet_load"


def emit(case: str, metric: str, value: float, unit: str, anchor: str, anchor_value: float, **extra) -> None:
    rec = {"bench": BENCH, "case": case, "metric": metric, "value": round(float(value), 6), "unit": unit,
           "anchor": anchor, "anchor_value": round(float(anchor_value), 6),
           "ratio": round(float(value) / float(anchor_value), 6) if anchor_value else None}
    rec.update(extra)
    print(json.dumps(rec), flush=True)


def raise_fd_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit (children inherit it); the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def loadavg() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")


# --------------------------------------------------------------------------- job setup


def enrol(sec_dir: Path, n: int, url: str) -> list[tuple[str, str, str]]:
    """A job folder with ``n`` enrolled devices for a plaintext broker at ``url``:
    ``[(device id, password, MAC key hex)]`` (the registry and password file written once)."""
    from coordinator.ops.credentials import (
        Enrolled,
        JobSecurity,
        mosquitto_password_hash,
        new_password,
    )
    from edge_client.auth import new_mac_key

    sec = JobSecurity(sec_dir, JOB)
    sec.save_job_info(url, tls=False)
    sec.coordinator(url, tls=False)
    devices, rows = {}, []
    now = time.time()
    for i in range(n):
        dev, pw, key = f"d{i:05d}", new_password(), new_mac_key()
        devices[dev] = Enrolled(mosquitto_password_hash(pw), key, 10_000, now)
        rows.append((dev, pw, key))
    sec._save(devices, sec._coordinator_hash())  # one write for the whole fleet
    return rows


def eval_npz(path: Path, model: str, n: int = 64) -> str:
    """A small held-out set of random images of ``model``'s input shape (the evaluation
    runs, its score is noise)."""
    from firmware_models import get_spec

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (n, *get_spec(model).input_shape), dtype=np.uint8)
    y = rng.integers(0, 10, n).astype(np.int64)
    np.savez(path, x_train=x, y_train=y, x_test=x, y_test=y)
    return str(path)


# --------------------------------------------------------------------------- CPU sampling


def _cpu(pid: int) -> float:
    """utime + stime of ``pid`` (s), 0 when gone."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _children(pid: int) -> list[int]:
    out = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            out += [int(c) for c in (task / "children").read_text().split()]
    except OSError:
        pass
    return out


class CpuSampler(threading.Thread):
    """Every ``every`` s: (wall time, CPU s of the coordinator's process tree without the
    broker, of the broker, of the load processes ``load``); exited processes keep their
    last reading."""

    def __init__(self, serve_pid: int, every: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.serve_pid, self.every = serve_pid, every
        self.broker_pid: int | None = None
        self.load: list[int] = []
        self.samples: list[tuple[float, float, float, float]] = []
        self._seen: dict[int, float] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.every):
            tree, todo = [], [self.serve_pid]
            while todo:
                p = todo.pop()
                tree.append(p)
                todo += _children(p)
            for p in tree + self.load:
                if self.broker_pid is None and p != self.serve_pid and p in tree and _is_mosquitto(p):
                    self.broker_pid = p
                self._seen[p] = max(self._seen.get(p, 0.0), _cpu(p))
            load = sum(self._seen.get(p, 0.0) for p in self.load)
            coord = sum(v for p, v in self._seen.items() if p != self.broker_pid) - load
            self.samples.append((time.time(), coord, self._seen.get(self.broker_pid or -1, 0.0), load))

    def between(self, t0: float, t1: float) -> tuple[float, float, float]:
        """CPU s of (coordinator, broker, load processes) between wall times ``t0`` and ``t1``
        (linear between the samples around each)."""
        def at(t: float) -> np.ndarray:
            s = self.samples
            if not s:
                return np.zeros(3)
            after = next((k for k, x in enumerate(s) if x[0] > t), len(s))
            if after in (0, len(s)):
                return np.array(s[min(after, len(s) - 1)][1:])
            a, b = np.array(s[after - 1]), np.array(s[after])
            f = (t - a[0]) / max(1e-9, b[0] - a[0])
            return (a + f * (b - a))[1:]

        d = at(t1) - at(t0)
        return float(d[0]), float(d[1]), float(d[2])


def _is_mosquitto(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].endswith(b"mosquitto")
    except OSError:
        return False


# --------------------------------------------------------------------------- socket-free ingest


def socket_free(workdir: Path, rows: list[tuple[str, str, str]], sec_dir: Path, k: int, args) -> dict:
    """The coordinator's ingest of ``k`` of the same signed updates as a burst through the
    in-process fleet (no sockets): CPU s per update (process time, all threads) and
    updates/s, best of 3 passes."""
    from coordinator.config import ServerConfig
    from coordinator.fleet import InProcessFleet
    from coordinator.ops.admission import AdmissionConfig
    from coordinator.server import Coordinator
    from coordinator.state import RunState
    from coordinator.strategies import build_strategy
    from edge_client.intnn import init_shared
    from edge_client.protocol import topic
    from firmware_models import get_spec

    tensors = update_tensors(args.codec_bits, args.model)
    k = min(k, len(rows))
    ids = [d for d, _, _ in rows[:k]]
    cfg = ServerConfig(job=JOB, model=args.model, rounds=1, strategy="fedshift",
                       admission=AdmissionConfig(enrolment=str(sec_dir / "enrolled.json")))
    fleet = InProcessFleet(JOB)
    fleet.start()
    co = Coordinator(cfg, fleet, build_strategy("fedshift"), RunState(workdir / "socket-free"), evaluator=None,
                     init_weights=init_shared(get_spec(args.model), 0))
    sender = fleet.hub.client("sender")
    sender.connect()
    best_cpu, best_wall = float("inf"), float("inf")
    for rep in range(4):
        payloads = [update_payload(d, bytes.fromhex(key), rep + 1, tensors[i % len(tensors)], "", args.compute_bits,
                                   0.0) for i, (d, _, key) in enumerate(rows[:k])]
        rnd = co.open_round(rep + 1, ids)
        for d, p in zip(ids, payloads, strict=True):
            sender.publish(topic(JOB, "update", d), p)
        del payloads
        c0, w0 = time.process_time(), time.perf_counter()
        co.collector.pump(time.monotonic() + 600, stop=lambda rnd=rnd: len(rnd.accepted) >= len(ids))
        co.strategy.finish()
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        assert len(rnd.accepted) == k, co.collector.counts
        co.collector.close(rep + 1)
        co.state.inbox_prune(rep + 2)
        if rep:  # the first pass warms up (JIT, page cache)
            best_cpu, best_wall = min(best_cpu, cpu), min(best_wall, wall)
    fleet.close()
    return {"cpu_per_update_ms": best_cpu * 1e3 / k, "updates_per_s": k / best_wall, "updates": k}


# --------------------------------------------------------------------------- one run


def run_fleet(n: int, k: int, workers: int, args: argparse.Namespace, work: Path) -> dict:
    """One fleet of ``n`` devices, ``k`` selected per round, ``workers`` ingest workers
    (see the module docstring)."""
    from coordinator.ops.broker import free_port, wait_for_port

    port = free_port()
    url = f"mqtt://127.0.0.1:{port}"
    sec_dir, run_dir = work / "security", work / "run"
    rows = enrol(sec_dir, n, url)
    (work / "devices.json").write_text(json.dumps(rows))
    evalset = eval_npz(work / "eval.npz", args.model)
    env = os.environ | {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-c", "import sys; from coordinator.cli import main; sys.exit(main())", "serve", "--out", str(run_dir), "--security-dir", str(sec_dir),
           "--job", JOB, "--model", args.model, "--strategy", "fedshift", "--rounds", str(args.rounds),
           "--min-devices", str(k), "--max-devices", str(k), "--min-present", str(n), "--presence-timeout",
           str(args.max_seconds), "--round-timeout", str(args.round_timeout), "--port", str(port), "--quiet",
           "--eval-data", evalset, "--hello-burst", "100", "--max-registered", str(max(n * 2, 1000))]
    if workers:
        cmd += ["--ingest-workers", str(workers)]
    t0, load0 = time.time(), loadavg()
    serve = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             process_group=0)
    serve_out: list[str] = []
    threading.Thread(target=lambda: serve_out.extend(serve.stdout), daemon=True).start()
    sampler = CpuSampler(serve.pid)
    sampler.start()
    # devices that dial before the embedded broker listens are refused and give up: start
    # them once it does (a loaded machine may take seconds to start ``fedbit serve``)
    if not wait_for_port("127.0.0.1", port, timeout=120) or serve.poll() is not None:
        serve.kill()
        serve.wait()
        sampler.stop.set()
        raise RuntimeError(f"fedbit serve never listened on {port}: {''.join(serve_out)[-3000:]}")
    procs, per = [], -(-n // args.procs)
    for p in range(args.procs):
        first = p * per
        if first >= n:
            break
        cmd_l = [sys.executable, __file__, "--load-process", "--devices-file", str(work / "devices.json"),
                 "--first", str(first), "--count", str(min(per, n - first)), "--port", str(port),
                 "--compute-s", str(args.compute_s), "--jitter", str(args.jitter), "--model", args.model,
                 "--download", args.download, "--codec-bits",
                 str(args.codec_bits), "--compute-bits", str(args.compute_bits), "--stats",
                 str(work / f"stats{p}.json"), "--max-seconds", str(args.max_seconds)]
        procs.append(subprocess.Popen(cmd_l, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                      process_group=0))
    sampler.load = [pr.pid for pr in procs]
    try:
        end = time.monotonic() + args.max_seconds
        while serve.poll() is None:
            if time.monotonic() > end:
                raise subprocess.TimeoutExpired(cmd, args.max_seconds)
            if all(pr.poll() is not None for pr in procs):  # no device left: serve would wait
                try:  # for its --min-present until --max-seconds
                    serve.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    errors = [e for p in range(len(procs)) if (work / f"stats{p}.json").is_file()
                              for e in json.loads((work / f"stats{p}.json").read_text())["errors"]]
                    raise RuntimeError(f"the load processes ended, fedbit serve did not: {errors[:3]}") from None
            time.sleep(0.2)
        for pr in procs:
            pr.wait(timeout=120)
    finally:
        sampler.stop.set()
        for pr in [serve, *procs]:
            if pr.poll() is None:
                pr.kill()
                pr.wait()
    wall = time.time() - t0
    print(f"fleet_load: {n} devices: fedbit serve ran {wall:.1f} s", file=sys.stderr)
    if os.environ.get("FLEET_DEBUG"):
        print("".join(serve_out), file=sys.stderr)
    if serve.returncode != 0:
        raise RuntimeError(f"fedbit serve exited {serve.returncode}: {''.join(serve_out)[-3000:]}")
    stats = [json.loads((work / f"stats{p}.json").read_text()) for p in range(len(procs))]
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    acked: dict[int, set[str]] = {}
    for s in stats:
        for r, ids in s["acked"].items():
            acked.setdefault(int(r), set()).update(ids)
    lost = sum(len(acked.get(h["round"], set()) - set(h["accepted_ids"])) for h in history)
    first_pub = {}
    for s in stats:
        for r, t in s["published_at"].items():
            first_pub[int(r)] = min(first_pub.get(int(r), t), t)
    steady = history[1:] or history
    rounds = []
    for h in steady:
        start = h["time"] - h["round_seconds"]
        collect_end = start + h["collect_seconds"]
        t_first = first_pub.get(h["round"], start)
        window = max(1e-6, collect_end - t_first)
        coord_cpu, broker_cpu, load_cpu = sampler.between(t_first, collect_end)
        rounds.append({"round_seconds": h["round_seconds"], "accepted": h["accepted"],
                       "coord_cpu": coord_cpu, "broker_cpu": broker_cpu,
                       "broker_cpu_round": sampler.between(start, h["time"])[1],
                       "coord_cores": coord_cpu / window, "broker_cores": broker_cpu / window,
                       "load_cores": load_cpu / window, "updates_per_s": h["accepted"] / window})
    mean = {key: float(np.mean([r[key] for r in rounds])) for key in rounds[0]}
    return {"devices": n, "selected": k, "held": sum(s["held"] for s in stats),
            "connected": sum(s["connected"] for s in stats), "refused": sum(s["refused"] for s in stats),
            "dropped": sum(s["dropped"] for s in stats), "bad_models": sum(s["bad_models"] for s in stats),
            "resent": sum(s["resent"] for s in stats), "lost": lost, "rounds": len(history),
            "accepted": [h["accepted"] for h in history], "errors": sum((s["errors"] for s in stats), [])[:5],
            "wall_s": wall, "rows": rows, "sec_dir": sec_dir, "loadavg_start": load0, "workers": workers, **mean}


def _case(res: dict, args: argparse.Namespace) -> str:
    return (f"{res['devices']:,} devices, {res['selected']:,} selected, asym-{args.codec_bits} {args.model}, "
            f"{res['workers'] or 'no'} ingest worker(s), download {args.download}, compute {args.compute_s:g} s")


def _common(res: dict, args: argparse.Namespace) -> dict:
    return {"devices": res["devices"], "lost": res["lost"], "loadavg": [res["loadavg_start"], loadavg()],
            "selected": res["selected"], "procs": args.procs, "ingest_workers": res["workers"],
            "download": args.download, "rounds": res["rounds"], "accepted": res["accepted"],
            "dropped": res["dropped"], "refused": res["refused"], "bad_models": res["bad_models"],
            "resent": res["resent"], **{k: round(res[k], 3) for k in ("coord_cores", "broker_cores", "load_cores")}}


def report(res: dict, free: dict, args: argparse.Namespace) -> None:
    n, case, common = res["devices"], _case(res, args), _common(res, args)
    emit(case, "connections_held", res["held"], "connections", "devices", n, **common)
    emit(case, "round_seconds", res["round_seconds"], "s", "compute delay", args.compute_s, **common,
         broker_cpu_s_per_round=round(res["broker_cpu_round"], 3))
    per_update = res["coord_cpu"] * 1e3 / max(1, res["accepted"])
    emit(case, "coordinator_cpu_per_update", per_update, "ms", "same ingest without sockets (same run)",
         free["cpu_per_update_ms"], **common, target=1.5, socket_free_updates=free["updates"],
         coordinator_cpu_s_per_round=round(res["coord_cpu"], 3), broker_cpu_s_collect=round(res["broker_cpu"], 3))
    emit(case, "updates_per_s", res["updates_per_s"], "updates/s", "same ingest without sockets (same run)",
         free["updates_per_s"], **common)
    if res["errors"]:
        print(f"fleet_load: first errors: {res['errors']}", file=sys.stderr)


def one(n: int, k: int, workers: int, args: argparse.Namespace) -> dict:
    """Run and report one fleet; its figures."""
    work = Path(tempfile.mkdtemp(prefix="fedbit-fleet-"))
    try:
        res = run_fleet(n, k, workers, args, work)
        free = socket_free(work, res["rows"], res["sec_dir"], min(k, 200), args)
        report(res, free, args)
        return res
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="30 devices, 10 selected, 2 rounds (< 1 min)")
    ap.add_argument("--devices", default="100,1000,5000,10000", help="fleet sizes, comma-separated")
    ap.add_argument("--selected", type=int, default=1000, help="devices selected per round (at most the fleet)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--procs", type=int, default=2, help="load processes")
    ap.add_argument("--compute-s", type=float, default=5.0,
                    help="each device's compute delay, from the announcement (s)")
    ap.add_argument("--download", choices=["all", "selected"], default="selected")
    ap.add_argument("--ingest-workers", type=int, default=0, help="ingest workers of the fleet sizes' runs")
    ap.add_argument("--workers", default="1,2", help="then: these ingest worker counts, back to back, at "
                    "--workers-devices devices, all selected (empty: skip)")
    ap.add_argument("--workers-devices", type=int, default=1000)
    ap.add_argument("--codec-bits", type=int, default=4)
    ap.add_argument("--model", default=MODEL, help="the job's model (--quick: mlp)")
    ap.add_argument("--jitter", type=float, default=0.05, help="the compute delay's spread (+- fraction)")
    ap.add_argument("--compute-bits", type=int, default=8, help="the devices' bitwidth (their model variant)")
    ap.add_argument("--round-timeout", type=float, default=600)
    ap.add_argument("--max-seconds", type=float, default=1800, help="every process stops by itself after this")
    ap.add_argument("--connect-concurrency", type=int, default=200, help=argparse.SUPPRESS)
    ap.add_argument("--load-process", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--devices-file", help=argparse.SUPPRESS)
    ap.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--stats", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    raise_fd_limit()
    if args.load_process:
        return asyncio.run(load_main(args))
    sizes = [30] if args.quick else [int(x) for x in args.devices.split(",") if x.strip()]
    if args.quick:
        args.selected, args.rounds, args.compute_s, args.procs = 10, 2, min(args.compute_s, 0.3), 1
        args.model, args.workers = "mlp", ""
    for n in sizes:
        one(n, min(args.selected, n), args.ingest_workers, args)
    ws = [int(w) for w in args.workers.split(",") if w.strip()]
    if ws:
        n = args.workers_devices
        runs = {w: one(n, n, w, args) for w in ws}
        lo, hi = min(ws), max(ws)
        if hi > lo:
            emit(_case(runs[hi], args), "ingest_speedup", runs[hi]["updates_per_s"], "updates/s",
                 f"{lo or 'no'} ingest worker(s), same fleet, back to back", runs[lo]["updates_per_s"],
                 **_common(runs[hi], args), target=1.6,
                 anchor_cores={k: round(runs[lo][k], 3) for k in ("coord_cores", "broker_cores", "load_cores")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
