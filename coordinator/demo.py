"""``fedbit demo`` / ``make demo``: the whole system on one machine, for real.

Starts the embedded broker (mosquitto child process when on PATH, else amqtt), runs the
coordinator in this process and one ``fedbit-edge run`` subprocess per device (default:
raspberry-pi-4 (Int8, own integers), raspberry-pi-zero-2w (Int6), raspberry-pi-5 (Int8,
K-means-4 uplink), jetson-nano (Int16, ASYM-8 uplink), desktop (float32, lossless)), each
on its own shard of the bundled digits training split, for a few rounds of ``digits_cnn``
with FedShift (the integer and lossy-uplink devices are its "inferior" clients); prints the accuracy per round on the digits test split and a summary.
Exit status 0 when every round completed with updates, 1 otherwise.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_DEVICES = "raspberry-pi-4,raspberry-pi-zero-2w,raspberry-pi-5,jetson-nano,desktop"


def run_demo(*, rounds: int = 8, devices: str = DEFAULT_DEVICES,
             strategy: str = "fedshift",
             kind: str = "auto", model: str = "digits_cnn", timeout: float = 110.0,
             keep: str | None = None, epochs: int = 2) -> int:
    """Run the demo; returns the process exit status."""
    from coordinator.broker import start_embedded_broker
    from coordinator.config import ServerConfig
    from coordinator.evaluate import make_evaluator
    from coordinator.fleet import MqttFleet
    from coordinator.logs import ProgressDisplay, setup_logging
    from coordinator.server import Coordinator
    from coordinator.state import RunState
    from coordinator.strategies import build_strategy
    from edge_client.data import load_digits
    from edge_client.intnn import init_shared
    from firmware_models import get_spec
    from hw_profiles import load_profile

    profiles = [p.strip() for p in devices.split(",") if p.strip()]
    loaded = [load_profile(p) for p in profiles]
    setup_logging(level="warning")
    run_dir = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="fedbit-demo-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    broker = start_embedded_broker(prefer=kind)
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    print("fedbit demo: what runs")
    print(f"  broker      : embedded {broker.kind} at {broker.url}")
    print(f"  coordinator : this process; model {model}, strategy {strategy}, {rounds} rounds, "
          f"{epochs} local epoch(s), evaluation on the digits test split")
    try:
        for i, (name, prof) in enumerate(zip(profiles, loaded, strict=True)):
            dev = f"demo-{i + 1}-{prof.name}"
            log = open(run_dir / f"{dev}.log", "wb")  # noqa: SIM115 - closed below
            logs.append(log)
            cmd = [sys.executable, "-m", "edge_client.cli", "run", "--broker", broker.url,
                   "--profile", name, "--data", f"digits:{i + 1}/{len(profiles)}", "--id", dev,
                   "--job", "demo", "--workdir", str(run_dir / dev), "--seed", str(i),
                   "--max-seconds", str(int(timeout) + 30)]
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
            print(f"  device {i + 1}    : {dev}: {prof.compute_bits}-bit {prof.trainer} trainer, "
                  f"uplink {prof.codec}-{prof.codec_bits}, data digits:{i + 1}/{len(profiles)} "
                  f"(subprocess pid {procs[-1].pid})")
        print(f"  run dir     : {run_dir} (out/metrics.jsonl, device logs)", flush=True)
        spec = get_spec(model)
        cfg = ServerConfig(job="demo", model=model, rounds=rounds, min_devices=len(profiles),
                           # rounds close as soon as every device answered; the deadline
                           # only bounds a stuck device (round 1 includes JIT compilation)
                           round_timeout_s=max(30.0, timeout / 2),
                           presence_timeout_s=60.0, hparams={"epochs": epochs, "batch": 32})
        fleet = MqttFleet(broker.url, "demo", username="fedbit-coordinator")
        coord = Coordinator(cfg, fleet, build_strategy(strategy, model=model), RunState(run_dir / "out"),
                            evaluator=make_evaluator(model, load_digits("test")),
                            init_weights=init_shared(spec, 0), on_event=ProgressDisplay(rounds))
        history = coord.run()
        fleet.close()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.terminate()
        ok = len(history) == rounds and all(h["accepted"] > 0 for h in history)
        print("\nsummary")
        print(f"  {'round':>5} {'updates':>8} {'accuracy':>9} {'seconds':>8}")
        for h in history:
            acc = h["accuracy"]
            print(f"  {h['round']:>5} {h['accepted']:>4}/{h['selected']:<3} "
                  f"{acc if acc is None else f'{acc:.4f}':>9} {h['round_seconds']:>8.2f}")
        first, last = history[0]["accuracy"], history[-1]["accuracy"]
        print(f"  accuracy {first:.4f} after round 1 -> {last:.4f} after round {len(history)}; "
              f"{len(profiles)} devices over {broker.kind}; {time.monotonic() - t0:.1f} s in all")
        print("fedbit demo: OK" if ok else "fedbit demo: FAILED (a round had no updates)")
        return 0 if ok else 1
    except Exception as exc:  # noqa: BLE001 - report and fail
        print(f"fedbit demo: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=5)
        for log in logs:
            log.close()
        broker.stop()
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)
