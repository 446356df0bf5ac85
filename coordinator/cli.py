"""``fedbit``: the coordinator-side command line.

Subcommands: ``serve`` (the round loop), ``broker`` (the embedded broker on its own),
``demo`` (broker + coordinator + a few mixed devices, a few rounds on digits). Heavy
imports (numpy, torch, paho) happen inside the commands so ``fedbit --help`` stays fast.
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
from coordinator.demo import DEFAULT_DEVICES


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

    from coordinator.broker import start_embedded_broker
    from coordinator.config import ServerConfig
    from coordinator.evaluate import make_evaluator
    from coordinator.fleet import MqttFleet
    from coordinator.logs import ProgressDisplay, setup_logging
    from coordinator.server import Coordinator, RoundError
    from coordinator.state import RunState
    from coordinator.strategies import build_strategy
    from edge_client.errors import ConfigError
    from edge_client.intnn import init_shared
    from edge_client.protocol import Limits
    from edge_client.transport import TlsOptions
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
        cfg = ServerConfig(
            job=args.job, model=args.model, rounds=args.rounds, strategy=args.strategy,
            strategy_params=_kv(args.strategy_param, "--strategy-param"), fraction=args.fraction,
            min_devices=args.min_devices, max_devices=args.max_devices,
            min_present=args.min_present, quorum=args.quorum,
            min_updates=args.min_updates, round_timeout_s=args.round_timeout,
            presence_timeout_s=args.presence_timeout, hparams=hparams, seed=args.seed, limits=limits,
        )
        cfg.validate()
        spec = get_spec(args.model)
        strategy = build_strategy(args.strategy, model=args.model, **cfg.strategy_params)
        url = args.broker
        username = args.username
        if not url:
            broker = start_embedded_broker(args.port, prefer=args.embedded)
            url = broker.url
            username = username or "fedbit-coordinator"  # amqtt keeps offline sessions only with one
            print(f"broker: {url} (embedded {broker.kind}; devices connect with --broker {url})",
                  flush=True)
        tls = None
        if args.ca or args.cert or args.insecure:
            tls = TlsOptions(args.ca, args.cert, args.key, args.insecure)
        fleet = MqttFleet(url, args.job, username=username, password=args.password, tls=tls,
                          protocol=args.mqtt_version, max_payload=limits.max_payload_bytes + 65536)
        evaluator = make_evaluator(args.model, _eval_data(args.eval_data), seed=args.seed)
        progress = None if args.quiet else ProgressDisplay(args.rounds)
        coord = Coordinator(cfg, fleet, strategy, RunState(args.out), evaluator=evaluator,
                            init_weights=init_shared(spec, args.seed), on_event=progress,
                            logger=logger.getChild("server"))
        print(f"fedbit serve: job {args.job}, model {args.model}, strategy {args.strategy}, "
              f"{args.rounds} round(s), out {args.out}", flush=True)
        history = coord.run(resume=args.resume)
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


def _cmd_demo(args: argparse.Namespace) -> int:
    from coordinator.demo import run_demo

    return run_demo(rounds=args.rounds, devices=args.devices, kind=args.embedded,
                    model=args.model, timeout=args.timeout, keep=args.keep,
                    strategy=args.strategy)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedbit",
        description="fedbit coordinator: full-precision aggregation server for low-bitwidth fleets.",
    )
    parser.add_argument("--version", action="version", version=f"fedbit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("serve", help="run the round loop (starts an embedded broker without --broker)",
                       description="Run federated rounds against the devices of one job.")
    p.add_argument("--broker", metavar="URL", help="mqtt://[user:pass@]host:port or mqtts://...; "
                   "without it an embedded broker starts and its URL is printed")
    p.add_argument("--embedded", choices=["auto", "mosquitto", "amqtt"], default="auto",
                   help="embedded broker kind (auto: mosquitto when on PATH, else amqtt)")
    p.add_argument("--port", type=int, default=None,
                   help="TCP port of the embedded broker (default: a free one)")
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
    p.add_argument("--password")
    p.add_argument("--ca", metavar="PEM", help="CA certificate for mqtts://")
    p.add_argument("--cert", metavar="PEM", help="client certificate")
    p.add_argument("--key", metavar="PEM", help="client key")
    p.add_argument("--insecure", action="store_true", help="skip the TLS hostname check")
    p.add_argument("--log-json", action="store_true", help="JSON-lines logs on stderr")
    p.add_argument("--log-level", default="info")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("broker", help="run the embedded MQTT broker",
                       description="mosquitto child process (when on PATH) or amqtt, on loopback.")
    p.add_argument("--port", type=int, default=None, help="TCP port (default: a free one)")
    p.add_argument("--kind", choices=["auto", "mosquitto", "amqtt"], default="auto")
    p.set_defaults(func=_cmd_broker)

    p = sub.add_parser("demo", help="embedded broker + coordinator + mixed devices, a few rounds",
                       description="Runs a coordinator and a few mixed devices (Int6, Int8, Int16, float32; "
                                   "integer, K-means, ASYM and float32 uplinks) "
                                   "as subprocesses on the embedded broker; prints accuracy per round.")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--devices", default=DEFAULT_DEVICES,
                   help="comma-separated hardware profiles, one per device")
    p.add_argument("--strategy", default="fedshift", help="aggregation strategy (see `fedbit serve --help`)")
    p.add_argument("--model", default="digits_cnn")
    p.add_argument("--embedded", choices=["auto", "mosquitto", "amqtt"], default="auto")
    p.add_argument("--timeout", type=float, default=110.0, metavar="S", help="give up after S seconds")
    p.add_argument("--keep", metavar="DIR", help="keep the run directory here")
    p.set_defaults(func=_cmd_demo)
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
