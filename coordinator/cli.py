"""``fedbit``: the coordinator-side command line.

Subcommands: ``serve`` (the round loop), ``emulate`` (a whole fleet on this machine: the
emulator, from a TOML experiment or the bundled default), ``demo`` (``emulate`` with the
bundled default), ``report`` (plots and summaries of emulated runs), ``broker`` (the
embedded broker on its own), ``enroll`` / ``revoke`` (device credentials) and
``broker-config`` (a secured mosquitto configuration for a broker run elsewhere). Heavy imports (numpy, torch, paho) happen inside the
commands so ``fedbit --help`` stays fast.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from coordinator import __version__
from coordinator.cli_security import add_security_commands, add_serve_security_options, serve_broker


def _kv(items: list[str] | None, what: str) -> dict[str, Any]:
    """``["k=v", ...]`` -> dict with int/float/bool/str values."""
    from edge_client.errors import ConfigError

    out: dict[str, Any] = {}
    for item in items or []:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise ConfigError(f"{what}: {item!r} is not KEY=VALUE")
        val: Any = v
        if v.lower() in ("true", "false"):
            val = v.lower() == "true"
        else:
            for cast in (int, float):
                try:
                    val = cast(v)
                    break
                except ValueError:
                    continue
        out[k] = val
    return out


def _toml_kv(items: list[str] | None) -> dict[str, Any]:
    """``["k=v", ...]`` with TOML values (``5``, ``0.1``, ``true``, ``[0, 1]``, ``"x"``); a
    bare word is a string."""
    import tomllib

    from edge_client.errors import ConfigError

    out: dict[str, Any] = {}
    for item in items or []:
        k, sep, v = item.partition("=")
        if not sep or not k.strip():
            raise ConfigError(f"--set: {item!r} is not KEY=VALUE")
        try:
            out[k.strip()] = tomllib.loads(f"v = {v}")["v"]
        except tomllib.TOMLDecodeError:
            out[k.strip()] = v
    return out


def _eval_data(src: str) -> Any:
    from edge_client.data import load_cifar10, load_digits, load_source

    if src in ("digits", "digits:test"):
        return load_digits("test")
    if src.startswith("digits:"):
        return load_source(src)
    return load_cifar10(src, "test")


def _sigterm_to_exit() -> None:
    def handler(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


def _cmd_serve(args: argparse.Namespace) -> int:
    import json

    from coordinator.admission import AdmissionConfig
    from coordinator.config import ServerConfig
    from coordinator.evaluate import evaluator_for
    from coordinator.fleet import MqttFleet
    from coordinator.logs import ProgressDisplay, setup_logging
    from coordinator.server import Coordinator, RoundError
    from coordinator.state import RunState
    from coordinator.strategies import build_strategy
    from edge_client.errors import ConfigError
    from edge_client.intnn import init_shared
    from edge_client.protocol import Limits
    from firmware_models import get_spec

    logger = setup_logging(json_lines=args.log_json, level=args.log_level)
    _sigterm_to_exit()
    broker = None
    try:
        hparams = {"epochs": args.epochs, "batch": args.batch}
        if args.steps:
            hparams["steps"] = args.steps
        hparams |= _kv(args.hparam, "--hparam")
        limits = Limits()
        if args.max_payload:
            limits = replace(limits, max_payload_bytes=args.max_payload)
        if args.max_abs_value is not None:  # checked with the rest by ServerConfig.validate
            limits = replace(limits, max_abs_value=args.max_abs_value)
        admission = AdmissionConfig(max_samples=args.max_samples, samples_policy=args.samples_policy,
                                    max_registered=args.max_registered, hello_rate=args.hello_rate,
                                    hello_burst=args.hello_burst)
        cfg = ServerConfig(
            job=args.job, model=args.model, rounds=args.rounds, strategy=args.strategy,
            strategy_params=_kv(args.strategy_param, "--strategy-param"), fraction=args.fraction,
            min_devices=args.min_devices, max_devices=args.max_devices,
            min_present=args.min_present, quorum=args.quorum,
            min_updates=args.min_updates, round_timeout_s=args.round_timeout,
            presence_timeout_s=args.presence_timeout, hparams=hparams, seed=args.seed, limits=limits,
            admission=admission,
        )
        cfg.validate()
        spec = get_spec(args.model)
        strategy = build_strategy(args.strategy, model=args.model, **cfg.strategy_params)
        broker, conn = serve_broker(args, limits.max_payload_bytes + 65536)
        admission.enrolment = conn.pop("enrolment")
        fleet = MqttFleet(conn.pop("url"), args.job, protocol=args.mqtt_version,
                          max_payload=limits.max_payload_bytes + 65536, **conn)
        evaluator = evaluator_for(args.model, _eval_data(args.eval_data),
                                  strategy.device_hparams(cfg.hparams), seed=args.seed)
        progress = None if args.quiet else ProgressDisplay(args.rounds)
        coord = Coordinator(cfg, fleet, strategy, RunState(args.out), evaluator=evaluator,
                            init_weights=init_shared(spec, args.seed), on_event=progress,
                            logger=logger.getChild("server"))
        print(f"fedbit serve: job {args.job}, model {args.model}, strategy {args.strategy}, "
              f"{args.rounds} round(s), out {args.out}", flush=True)
        history = coord.run(resume=args.resume)
        _export_finished_run(args.out)
        last = history[-1] if history else {}
        print(json.dumps({"rounds": len(history), "final_accuracy": last.get("accuracy"),
                          "broker": fleet.describe(), "metrics": str(coord.state.metrics_path)}),
              flush=True)
        fleet.close()
        return 0
    except (ConfigError, RoundError, ConnectionError) as exc:
        print(f"fedbit serve: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if broker is not None:
            broker.stop()


def _export_finished_run(run_dir: str) -> None:
    """After a complete run: the ONNX export of every bitwidth variant of the final model
    into ``RUN_DIR/onnx/`` (a note on stderr when onnx is not installed or the export
    fails; the run itself succeeded and ``fedbit export`` can be run again)."""
    import importlib.util

    from coordinator.export import export_run
    from edge_client.errors import ConfigError

    if importlib.util.find_spec("onnx") is None:
        print("fedbit serve: note: no ONNX export of the final model (pip install "
              "'fedbit[onnx]', then `fedbit export RUN_DIR --all`)", file=sys.stderr)
        return
    try:
        paths = export_run(run_dir)
    except ConfigError as exc:
        print(f"fedbit serve: ONNX export failed: {exc}", file=sys.stderr)
        return
    print(f"onnx: {', '.join(str(p) for p in paths)}", flush=True)


def _cmd_export(args: argparse.Namespace) -> int:
    from coordinator.export import ONNX_DIR, export_model, export_run, load_final, variant_name
    from edge_client.errors import ConfigError

    try:
        if args.all:
            if args.out or args.bits is not None or args.round is not None:
                raise ConfigError("--all writes every variant of the final model to "
                                  f"RUN_DIR/{ONNX_DIR}/: no --bits, --out or --round with it")
            paths = export_run(args.run_dir)
        else:
            ckpt = load_final(args.run_dir, args.round)
            bits = 8 if args.bits is None else args.bits
            out = args.out or f"{args.run_dir}/{ONNX_DIR}/{variant_name(bits)}.onnx"
            paths = [export_model(ckpt, bits, out)]
    except ConfigError as exc:
        print(f"fedbit export: error: {exc}", file=sys.stderr)
        return 1
    for p in paths:
        print(p, flush=True)
    return 0


def _cmd_broker(args: argparse.Namespace) -> int:
    from coordinator.broker import start_embedded_broker
    from edge_client.errors import ConfigError

    stop = threading.Event()

    def handler(_signum: int, _frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    try:
        broker = start_embedded_broker(args.port, prefer=args.kind)
    except ConfigError as exc:
        print(f"fedbit broker: error: {exc}", file=sys.stderr)
        return 1
    v = "MQTT 5 and 3.1.1" if broker.supports_v5 else "MQTT 3.1.1"
    print(f"broker: {broker.url} ({broker.kind}, {v}); Ctrl-C or SIGTERM stops it", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        broker.stop()
    return 0


def _cmd_emulate(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from coordinator.experiment import load_config, run_experiment
    from coordinator.logs import LiveProgress, setup_logging
    from edge_client.errors import ConfigError

    setup_logging(level=args.log_level)
    _sigterm_to_exit()
    try:
        cfg = load_config(args.config, _toml_kv(args.set))
    except ConfigError as exc:
        print(f"fedbit emulate: error: {exc}", file=sys.stderr)
        return 1
    out = Path(args.out) if args.out else Path("runs") / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if out.exists() and any(out.iterdir()):
        print(f"fedbit emulate: error: {out} is not empty: pick another --out", file=sys.stderr)
        return 1
    n_dev = sum(cfg.devices.values())
    print(f"fedbit emulate: {cfg.name} ({cfg.source}): {n_dev} devices "
          f"({', '.join(f'{n} {p}' for p, n in cfg.devices.items() if n)}), model {cfg.model}, "
          f"strategy {cfg.strategy}, {cfg.rounds} rounds, transport {cfg.transport}, "
          f"seeds {cfg.seeds}; run folder {out}", flush=True)
    bars: list[LiveProgress] = []

    def progress(rounds: int) -> LiveProgress | None:
        if args.quiet:
            return None
        bars.append(LiveProgress(rounds))
        return bars[-1]

    try:
        summary = run_experiment(cfg, out, on_event=progress, echo=lambda m: print(m, flush=True))
    except (ConfigError, ConnectionError) as exc:
        print(f"fedbit emulate: error: {exc}", file=sys.stderr)
        return 1
    finally:
        for b in bars:
            b.close()
    text = summary.read_text()
    # the result (a single run) or the whole table (a sweep); the rest is in the file
    start = text.find("## Result")
    print(text[start:text.find("\n## ", start + 1)] if start >= 0 else text, flush=True)
    print(f"fedbit emulate: report: {summary} (plots beside it); run folder kept: {out}", flush=True)
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from coordinator.report import write_report, write_sweep_report
    from edge_client.errors import ConfigError

    root = Path(args.run_dir)
    try:
        if (root / "out" / "metrics.jsonl").is_file():
            summary = write_report(root)
        elif (root / "results.json").is_file():
            results = json.loads((root / "results.json").read_text())
            summary = write_sweep_report(root, [(r["combination"], r["seed"], root / r["run"]) for r in results])
        else:
            raise ConfigError(f"{root}: not a run folder (no out/metrics.jsonl) nor a sweep folder (no results.json)")
    except ConfigError as exc:
        print(f"fedbit report: error: {exc}", file=sys.stderr)
        return 1
    print(f"fedbit report: {summary}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedbit",
        description="fedbit coordinator: full-precision aggregation server for low-bitwidth fleets.",
    )
    parser.add_argument("--version", action="version", version=f"fedbit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    # (allow_abbrev=False: an old `--password x` must not turn into `--password-file x`)
    p = sub.add_parser("serve", help="run the round loop (starts an embedded broker without --broker)",
                       description="Run federated rounds against the devices of one job.", allow_abbrev=False)
    p.add_argument("--broker", metavar="URL", help="mqtt://[user:pass@]host:port or mqtts://...; "
                   "without it an embedded broker starts and its URL is printed")
    p.add_argument("--embedded", choices=["auto", "mosquitto", "amqtt"], default="auto",
                   help="embedded broker kind (auto: mosquitto when on PATH, else amqtt)")
    p.add_argument("--port", type=int, default=None,
                   help="TCP port of the embedded broker on 127.0.0.1 (default: a free one)")
    add_serve_security_options(p)
    p.add_argument("--model", default="digits_cnn", metavar="SPEC", help="model spec name (digits_cnn)")
    p.add_argument("--rounds", type=int, default=5, metavar="N")
    p.add_argument("--strategy", default="fedavg", metavar="NAME",
                   help="aggregation strategy (fedavg); prowd = ProWD's dequantizer + selective aggregation")
    p.add_argument("--strategy-param", action="append", metavar="K=V",
                   help="strategy parameter (tau=0.1; the dequantizer's as dequantize.K=V, "
                        "e.g. dequantize.ladder=paper)")
    p.add_argument("--out", required=True, metavar="DIR", help="run directory (checkpoint, inbox, metrics.jsonl)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--job", default="default", help="job id (topic prefix fedbit/<job>/)")
    p.add_argument("--eval-data", default="digits:test", metavar="SRC",
                   help="held-out set: digits:test (default) or a CIFAR-10 folder")
    p.add_argument("--fraction", type=float, default=1.0, metavar="C", help="fraction of present devices per round")
    p.add_argument("--min-devices", type=int, default=1, help="fewest devices selected per round")
    p.add_argument("--max-devices", type=int, default=10_000, help="most devices selected per round")
    p.add_argument("--min-present", type=int, default=0,
                   help="devices that must be present before a round starts (default: --min-devices)")
    p.add_argument("--quorum", type=float, default=1.0, help="fraction of the selected that closes a round early")
    p.add_argument("--min-updates", type=int, default=1, help="fewer updates at the deadline keep the old model")
    p.add_argument("--round-timeout", type=float, default=60.0, metavar="S", help="round deadline in seconds")
    p.add_argument("--presence-timeout", type=float, default=120.0, metavar="S",
                   help="how long to wait for --min-devices devices")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=0, help="local steps per round (0: whole epochs)")
    p.add_argument("--hparam", action="append", metavar="K=V", help="extra announced hyper-parameter")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-payload", type=int, default=0, metavar="BYTES", help="largest accepted update")
    p.add_argument("--max-abs-value", type=float, default=None, metavar="X",
                   help="reject updates carrying a value with |v| > X (shared float domain; "
                        "default 1e6)")
    p.add_argument("--mqtt-version", choices=["auto", "5", "3.1.1"], default="auto")
    p.add_argument("--username")
    p.add_argument("--password-file", metavar="FILE",
                   help="the broker password, first line of FILE (or FEDBIT_PASSWORD; never "
                        "on the command line)")
    p.add_argument("--ca", metavar="PEM", help="CA certificate for mqtts://")
    p.add_argument("--cert", metavar="PEM", help="client certificate")
    p.add_argument("--key", metavar="PEM", help="client key")
    p.add_argument("--insecure", action="store_true", help="skip the TLS hostname check")
    p.add_argument("--log-json", action="store_true", help="JSON-lines logs on stderr")
    p.add_argument("--log-level", default="info")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("export", help="export a run's final model (ONNX or a model message)",
                       description="Write a bitwidth variant of a run's final global model: "
                                   "ONNX (integer graph bit-exact with the Numba engine, or "
                                   "float32), or the model message a device downloads "
                                   "(an --out ending in .msgpack).")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (fedbit serve --out)")
    p.add_argument("--bits", type=int, default=None,
                   help="compute bitwidth of the variant, 2..16, or 32 for float32 (default 8)")
    p.add_argument("--out", metavar="FILE",
                   help="output file (default RUN_DIR/onnx/<variant>.onnx; .msgpack: a model message)")
    p.add_argument("--round", type=int, default=None, metavar="N",
                   help="refuse unless N is the run's last completed round (the model a run keeps)")
    p.add_argument("--all", action="store_true",
                   help="every variant of the run (float32 and the devices' bitwidths) to RUN_DIR/onnx/")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("broker", help="run the embedded MQTT broker",
                       description="mosquitto child process (when on PATH) or amqtt, on loopback.")
    p.add_argument("--port", type=int, default=None, help="TCP port (default: a free one)")
    p.add_argument("--kind", choices=["auto", "mosquitto", "amqtt"], default="auto")
    p.set_defaults(func=_cmd_broker)

    add_security_commands(sub)

    for name in ("emulate", "demo"):
        if name == "emulate":
            p = sub.add_parser("emulate", help="a whole fleet on this machine: devices, links, coordinator",
                               description="Run an emulated fleet (real device runtimes, simulated links and "
                                           "compute, the real coordinator) from a TOML experiment; without one, "
                                           "the bundled default (20 mixed devices on non-IID digits). Writes a "
                                           "run folder with metrics, plots and a summary.")
            p.add_argument("config", nargs="?", help="experiment TOML file (default: the bundled one)")
        else:
            p = sub.add_parser("demo", help="`fedbit emulate` with the bundled default experiment",
                               description="The bundled default experiment: what `make demo` runs.")
            p.set_defaults(config=None)
        p.add_argument("--out", metavar="DIR", help="run folder (default: runs/<name>-<time>)")
        p.add_argument("--set", action="append", metavar="KEY=VALUE",
                       help="override a config key, dotted for sections (rounds=5, round.deadline_s=20)")
        p.add_argument("--quiet", action="store_true", help="no progress display")
        p.add_argument("--log-level", default="warning")
        p.set_defaults(func=_cmd_emulate)

    p = sub.add_parser("report", help="plots and a summary of an emulated run (or sweep) folder",
                       description="Writes accuracy.png, bytes.png and summary.md into a run folder, or the "
                                   "sweep summary into a sweep folder.")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.set_defaults(func=_cmd_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
