"""``fedbit``: the coordinator-side command line.

Subcommands: ``serve`` (the round loop; :mod:`coordinator.cli.serve`), ``emulate``/``demo``/
``report`` (the emulator; :mod:`coordinator.cli.emulate`), ``enroll``/``revoke``/
``broker-config`` (a secured job; :mod:`coordinator.cli.security`), ``status`` (a job's
picture in the terminal; :mod:`coordinator.cli.status`), ``release`` (a quarantined
device; :mod:`coordinator.cli.release`), ``export`` (a run's final model)
and ``broker`` (the embedded broker on its own). Heavy imports (numpy,
torch, paho) happen inside the commands so ``fedbit --help`` stays fast.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from coordinator import __version__
from coordinator.cli.emulate import add_emulate_commands
from coordinator.cli.release import add_release_command
from coordinator.cli.security import add_security_commands
from coordinator.cli.serve import add_serve_command
from coordinator.cli.status import add_status_command

if TYPE_CHECKING:  # pragma: no cover
    from types import FrameType


def _cmd_export(args: argparse.Namespace) -> int:
    from coordinator.ops.export import ONNX_DIR, export_model, export_run, load_final, variant_name
    from coordinator.ops.rundir import coordinator_dir
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
            out = args.out or coordinator_dir(args.run_dir) / ONNX_DIR / f"{variant_name(bits)}.onnx"
            paths = [export_model(ckpt, bits, out)]
    except ConfigError as exc:
        print(f"fedbit export: error: {exc}", file=sys.stderr)
        return 1
    for p in paths:
        print(p, flush=True)
    return 0


def _cmd_broker(args: argparse.Namespace) -> int:
    from coordinator.ops.broker import start_embedded_broker
    from edge_client.errors import ConfigError

    stop = threading.Event()

    def handler(_signum: int, _frame: FrameType | None) -> None:
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedbit",
        description="fedbit coordinator: full-precision aggregation server for low-bitwidth fleets.",
    )
    parser.add_argument("--version", action="version", version=f"fedbit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_serve_command(sub)
    p = sub.add_parser("export", help="export a run's final model (ONNX or a model message)",
                       description="Write a bitwidth variant of a run's final global model: "
                                   "ONNX (integer graph bit-exact with the Numba engine, or "
                                   "float32), or the model message a device downloads "
                                   "(an --out ending in .msgpack).")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (fedbit serve --out, or a fedbit "
                   "emulate run folder)")
    p.add_argument("--bits", type=int, default=None,
                   help="compute bitwidth of the variant, 2..16, or 32 for float32 (default 8)")
    p.add_argument("--out", metavar="FILE",
                   help="output file (default RUN_DIR/onnx/<variant>.onnx, RUN_DIR/out/onnx/ for an emulated "
                        "run; .msgpack: a model message)")
    p.add_argument("--round", type=int, default=None, metavar="N",
                   help="refuse unless N is the run's last completed round (the model a run keeps)")
    p.add_argument("--all", action="store_true",
                   help="every variant of the run (float32 and the devices' bitwidths) to RUN_DIR/onnx/")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("broker", help="run the embedded MQTT broker",
                       description="Run the broker `fedbit serve` embeds, on its own, until Ctrl-C or "
                                   "SIGTERM: mosquitto as a child process when it is on PATH, else amqtt "
                                   "in this process; on 127.0.0.1, anonymous and unencrypted (for trials: "
                                   "`fedbit serve --broker URL` and devices' --broker URL). A secured broker "
                                   "for other machines: fedbit broker-config.")
    p.add_argument("--port", type=int, default=None, help="TCP port (default: a free one)")
    p.add_argument("--kind", choices=["auto", "mosquitto", "amqtt"], default="auto",
                   help="which broker (auto: mosquitto when on PATH, else amqtt)")
    p.set_defaults(func=_cmd_broker)

    add_security_commands(sub)
    add_emulate_commands(sub)
    add_status_command(sub)
    add_release_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # (for the --resume line of a stopped run)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
