"""``fedbit-edge``: the device-side command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from edge_client import __version__
from edge_client.connection import add_connect_timeout_option, add_device_connection_options
from edge_client.logs import add_logging_options
from edge_client.paths import device_state_dir


def _cmd_profiles(args: argparse.Namespace) -> int:
    from hw_profiles import list_profiles

    rows = list_profiles()
    head = (f"{'profile':<22} {'bits':>4} {'trainer':<7} {'uplink codec':<12} {'RAM MB':>7} "
            f"{'up kbps':>9} {'python':<7} image")
    print(head)
    print("-" * len(head))
    for p in rows:
        codec = f"{p.codec}-{p.codec_bits}"
        print(f"{p.name:<22} {p.compute_bits:>4} {p.trainer:<7} {codec:<12} {p.ram_mb:>7} "
              f"{p.uplink_kbps:>9.0f} {'>=' + p.python:<7} {p.image}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    import signal
    from pathlib import Path

    from edge_client.connection import connect_timeout, device_connector, device_identity
    from edge_client.data import load_source
    from edge_client.errors import ConfigError
    from edge_client.intnn.parallel import check_threads
    from edge_client.logs import setup_logging
    from edge_client.runtime import DeviceConfig, DeviceRuntime
    from hw_profiles import load_profile

    setup_logging(json_lines=args.log_json, level=args.log_level)
    try:
        ident = device_identity(args, device_state_dir)
        profile = load_profile(args.profile)
        data = load_source(args.data)
        overrides = {}
        if args.codec:
            overrides = {"codec": args.codec, "codec_bits": args.codec_bits or profile.codec_bits}
        if args.threads is not None:
            overrides["threads"] = check_threads(args.threads)
        if profile.is_integer:
            from edge_client.intnn.cuda.probe import choose

            overrides["engine"], engine_line = choose(args.engine or profile.engine)
            print(f"fedbit-edge: {engine_line}", flush=True)
        cfg = DeviceConfig.from_profile(
            args.id, profile, job=args.job, seed=args.seed,
            workdir=Path(args.workdir) if args.workdir else device_state_dir(args.id),
            exit_when_done=not args.stay, train_delay_s=args.delay, give_up_after_s=connect_timeout(args),
            model_files=tuple(args.model_file))
        for k, v in overrides.items():
            setattr(cfg, k, v)
        connect = device_connector(args, ident)
        if args.auto_codec:
            from edge_client.cli_device import auto_codec

            cfg.codec, cfg.codec_bits = auto_codec(args, profile, connect)
        if ident.max_samples and len(data.y) > ident.max_samples:
            logging.getLogger("fedbit.device").warning(
                "%d local samples, enrolled with %d: the coordinator bounds this device's weight by %d",
                len(data.y), ident.max_samples, ident.max_samples)
        rt = DeviceRuntime(cfg, data, connect)
    except (ConfigError, OSError, ValueError, ConnectionError) as exc:
        print(f"fedbit-edge run: error: {exc}", file=sys.stderr)
        return 1

    interrupted: list[int] = []

    def on_signal(signum, _frame):
        if signum == signal.SIGINT and interrupted:  # Ctrl-C again: now, even mid-training
            raise KeyboardInterrupt
        interrupted.append(signum)
        rt.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    threads = f", {cfg.threads} threads" if profile.is_integer else ""
    print(f"fedbit-edge: device {args.id} ({profile.name}, {profile.compute_bits}-bit "
          f"{profile.trainer}{threads}, uplink {cfg.codec}-{cfg.codec_bits}, {len(data.y)} "
          f"samples) -> {args.broker}, job {args.job}", flush=True)
    if profile.is_integer:
        from edge_client.intnn.compile_note import say_when_compiling

        say_when_compiling(lambda m: print(f"fedbit-edge: {m}", flush=True))
    try:
        n = rt.run(max_seconds=args.max_seconds or None)
    except KeyboardInterrupt:
        print(f"fedbit-edge: device {args.id} interrupted", file=sys.stderr, flush=True)
        return 130
    print(f"fedbit-edge: device {args.id} stopped after {n} round(s); "
          f"{rt.sent} sent, {rt.resent} re-sent from the outbox", flush=True)
    if rt.failure:
        print(f"fedbit-edge run: error: {rt.failure}", file=sys.stderr, flush=True)
        return 3
    return 130 if signal.SIGINT in interrupted else 0


def _cmd_predict(args: argparse.Namespace) -> int:
    from edge_client.errors import ConfigError
    from edge_client.predict import (
        check_expected,
        load_data,
        load_model,
        predict,
        write_predictions,
    )

    try:
        model = load_model(args.model)
        check_expected(model, spec=args.spec, bits=args.bits)
        data = load_data(args.data)
        pred = predict(model, data, engine=args.engine, batch=args.batch, threads=args.threads)
        if args.out:
            write_predictions(args.out, pred, data.y)
    except ConfigError as exc:
        print(f"fedbit-edge predict: error: {exc}", file=sys.stderr)
        return 1
    acc = pred.accuracy(data.y)
    print(json.dumps({"model": str(args.model), "spec": model.spec.name, "variant": model.variant,
                      "engine": pred.engine, "samples": len(data), "accuracy": acc,
                      "seconds": round(pred.seconds, 4), "out": args.out}), flush=True)
    return 0


def _cmd_warmup(args: argparse.Namespace) -> int:
    from edge_client.errors import FedbitError
    from edge_client.warmup import warm_up
    from firmware_models import SpecError
    from hw_profiles import ProfileError, load_profile

    try:
        profile = load_profile(args.profile)
        engine = "cpu"
        if profile.is_integer:
            from edge_client.intnn.cuda.probe import choose

            engine, line = choose(args.engine or profile.engine)
            print(f"compiling kernels for {profile.name} (Int{profile.compute_bits}, {profile.codec} "
                  f"uplink, {line}), first run only; minutes on a Raspberry Pi ...", file=sys.stderr,
                  flush=True)
        report = warm_up(profile, args.model, engine=engine)
    except (FedbitError, SpecError, ProfileError) as exc:
        print(f"fedbit-edge warmup: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"profile": report.profile, "model": report.model, "bits": report.bits,
                      "engine": report.engine, "compiled": report.compiled,
                      "train_s": round(report.train_s, 3),
                      "encode_s": round(report.encode_s, 3)}), flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedbit-edge",
        description="fedbit device SDK: integer-only local training, compressed uplinks, MQTT.",
    )
    parser.add_argument("--version", action="version", version=f"fedbit-edge {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("profiles", help="list the bundled hardware profiles",
                       description="One line per bundled hardware profile: compute bitwidth, trainer, "
                                   "uplink codec, RAM, uplink speed, the Python it needs and its OS image "
                                   "(`--profile NAME` of run, warmup, doctor; a TOML file of your own "
                                   "works too: docs/device.md#hardware-profiles).")
    p.set_defaults(func=_cmd_profiles)

    p = sub.add_parser("warmup", help="compile the kernels a profile's rounds run (first run only)",
                       description="One training step and one uplink encoding on random data, so "
                                   "that the first round does not wait for the compiler.")
    p.add_argument("--profile", required=True, metavar="NAME", help="hardware profile name or TOML path")
    p.add_argument("--model", default="digits_cnn", metavar="SPEC", help="model spec (digits_cnn)")
    p.add_argument("--engine", choices=("cpu", "cuda", "auto"), default=None,
                   help="the engine whose kernels to compile (default: the profile's; cuda kernels "
                        "go to numba-cuda's cache)")
    p.set_defaults(func=_cmd_warmup)

    # (allow_abbrev=False: an old `--password x` must not turn into `--password-file x`)
    p = sub.add_parser("run", help="run the device loop against a coordinator's broker",
                       description="Connect, say hello, train when selected, publish updates.",
                       allow_abbrev=False)
    add_device_connection_options(p)
    p.add_argument("--profile", required=True, metavar="NAME", help="hardware profile name or TOML path")
    p.add_argument("--data", required=True, metavar="SRC", help="fashion-mnist:K/N or digits:K/N (shard K of N), or a local IDX "
                   "or CIFAR-10 folder or .npz file (DIR:K/N for a shard)")
    p.add_argument("--model-file", action="append", default=[], metavar="FILE",
                   help="a user's model (TOML layers or a Python ModelSpec) this device may train when a "
                        "round announces a model file of that name (repeatable)")
    p.add_argument("--workdir", metavar="DIR", help="outbox, state and TLS files (default $XDG_STATE_HOME/fedbit/<id>, "
                   "else ~/.local/state/fedbit/<id>)")
    p.add_argument("--seed", type=int, default=0, help="seed of the device's local training (shuffling, "
                   "stochastic rounding; default 0)")
    p.add_argument("--codec", help="override the profile's uplink codec")
    p.add_argument("--codec-bits", type=int, default=0, metavar="N",
                   help="bits of --codec (default: the profile's)")
    p.add_argument("--auto-codec", action="store_true",
                   help="measure the link to the broker first and pick the uplink codec from it "
                        "(fedbit-edge measure-link)")
    p.add_argument("--delay", type=float, default=0.0, metavar="S",
                   help="wait S seconds before each local training (emulate a slow device)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="cores a training step uses (default: the profile's threads; the "
                        "results are the same for any N)")
    p.add_argument("--engine", choices=("cpu", "cuda", "auto"), default=None,
                   help="where the integer training steps run: cpu, cuda (the GPU; fails where the "
                        "CUDA engine cannot run) or auto (the GPU when it can, else the CPU, saying "
                        "why); default: the profile's engine. The results are the same")
    p.add_argument("--stay", action="store_true", help="keep running after the coordinator is done")
    p.add_argument("--max-seconds", type=float, default=0.0, help="stop after this long (0: never)")
    add_connect_timeout_option(p)
    add_logging_options(p)
    p.set_defaults(func=_cmd_run)

    from edge_client.cli_device import add_device_commands

    add_device_commands(sub)

    p = sub.add_parser("predict", help="run a model file on a data set (accuracy, predictions)",
                       description="Predict with a fedbit ONNX export or a global model "
                                   "(msgpack), on ONNX Runtime when installed, else on the "
                                   "Numba integer engine (the same answers either way).")
    p.add_argument("--model", required=True, metavar="FILE",
                   help="model.onnx (fedbit export) or global.msgpack (a model message)")
    p.add_argument("--data", required=True, metavar="SRC",
                   help="a .npz with x [N, C, H, W] (and y), or a data source: digits:test, "
                        "fashion-mnist:test, digits:K/N, an IDX or CIFAR-10 folder (its test split)")
    p.add_argument("--out", metavar="FILE", help="write the predictions (CSV, or .npz with the logits)")
    p.add_argument("--engine", choices=["auto", "onnxruntime", "numba"], default="auto",
                   help="auto: onnxruntime when installed, else numba")
    p.add_argument("--spec", metavar="NAME", help="refuse a model of another architecture")
    p.add_argument("--bits", type=int, default=None, help="refuse a model of another bitwidth (32: float32)")
    p.add_argument("--batch", type=int, default=256, metavar="N", help="samples per inference batch (default 256)")
    p.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads")
    p.set_defaults(func=_cmd_predict)
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
