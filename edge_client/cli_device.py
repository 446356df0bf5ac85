"""``fedbit-edge doctor``, ``measure-link`` and ``install-service``: the commands that
prepare a Raspberry Pi or Jetson to be a fleet device (``edge_client/cli.py`` wires them in).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from edge_client.doctor import Check
from edge_client.transport.base import Transport
from hw_profiles import HardwareProfile

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable

#: the model the link test sizes an update of (the model of make demo and the quick start)
LINK_MODEL = "digits_cnn"


def add_device_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from edge_client.connection import add_device_connection_options

    p = sub.add_parser("doctor", help="check that this machine can be a fleet device",
                       description="One verdict line per check (PASS/FAIL); exit 1 when any fails.",
                       allow_abbrev=False)
    add_device_connection_options(p)
    p.add_argument("--profile", required=True, metavar="NAME", help="hardware profile name or TOML path")
    p.add_argument("--timeout", type=float, default=10.0, metavar="S", help="broker connect timeout")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("measure-link", help="measure uplink throughput and latency to the broker; "
                       "recommend an uplink codec",
                       description="Publish probe messages of an update's sizes to the broker (topic "
                                   "linktest/<id>, which nobody subscribes to), measure the uplink's "
                                   "throughput and latency, and recommend the most precise uplink codec "
                                   "whose update fits --budget seconds (fedbit-edge run --auto-codec "
                                   "does the same before it starts).", allow_abbrev=False)
    add_device_connection_options(p)
    p.add_argument("--profile", required=True, metavar="NAME", help="hardware profile name or TOML path")
    p.add_argument("--model", default=LINK_MODEL, metavar="SPEC", help="model whose update is sized")
    p.add_argument("--budget", type=float, default=2.0, metavar="S",
                   help="seconds one update may take to upload (default 2)")
    p.set_defaults(func=cmd_measure_link)

    p = sub.add_parser("install-service", help="write a systemd unit that runs this device",
                       description="Write a systemd unit (and its environment file, mode 0600) that warms "
                                   "the kernels up, then runs `fedbit-edge run --stay` as a service: "
                                   "restarted on failure, reconnecting forever with capped, jittered "
                                   "backoff. Run as root, or give --dir; --dry-run prints the files.",
                       allow_abbrev=False)
    p.add_argument("--profile", required=True, metavar="NAME", help="hardware profile name or TOML path")
    p.add_argument("--data", required=True, metavar="SRC", help="the device's local data (as for run)")
    p.add_argument("--broker", metavar="URL", help="the broker (or in the credentials file)")
    p.add_argument("--id", help="device id (or in the credentials file)")
    p.add_argument("--credentials", metavar="FILE", help="the credentials file `fedbit enroll` wrote")
    p.add_argument("--name", default="fedbit-edge", help="unit name (fedbit-edge)")
    p.add_argument("--user", default=None, help="run as this user (default: the current one)")
    p.add_argument("--dir", default="/etc/systemd/system", metavar="DIR", help="where the unit goes")
    p.add_argument("--dry-run", action="store_true", help="print the files instead of writing them")
    p.set_defaults(func=cmd_install_service)


def _connected(args: argparse.Namespace, timeout: float) -> Transport:
    from edge_client.connection import device_connector, device_identity
    from edge_client.paths import device_state_dir

    t = device_connector(args, device_identity(args, device_state_dir))(backoff=(0.2, 1.0))
    try:
        t.connect(timeout)
    except BaseException:
        t.close()
        raise
    return t


def cmd_doctor(args: argparse.Namespace) -> int:
    from edge_client import doctor
    from edge_client.errors import ConfigError
    from hw_profiles import ProfileError, load_profile

    try:
        profile = load_profile(args.profile)
    except ProfileError as exc:
        print(f"fedbit-edge doctor: error: {exc}", file=sys.stderr)
        return 1
    checks = [doctor.check_python(profile), doctor.check_image(profile), doctor.check_jit()]
    if not profile.is_integer:
        checks.append(doctor.check_torch(profile))
    if profile.engine != "cpu":
        checks.append(doctor.check_gpu(profile))
    checks += [doctor.check_ram(profile), doctor.check_clock()]
    files = {"--ca": args.ca, "--cert": args.cert, "--key": args.key, "--credentials": args.credentials}
    if any(files.values()):
        checks.append(doctor.check_files(files))
    if args.broker or args.credentials:
        transport = None
        try:
            check, transport = doctor.check_broker(lambda t: _connected(args, t), args.timeout)
        except ConfigError as exc:
            check = doctor.Check("broker", False, str(exc))
        checks.append(check)
        if transport is not None:
            checks.append(_link_check(args, profile, transport))
    for c in checks:
        print(c.line(), flush=True)
    failed = [c.name for c in checks if not c.ok]
    warned = [c.name for c in checks if c.ok and c.warn]
    print(f"doctor: {len(checks) - len(failed)} of {len(checks)} checks passed"
          + (f"; failed: {', '.join(failed)}" if failed else "")
          + (f"; warnings: {', '.join(warned)}" if warned else ""), flush=True)
    return 1 if failed else 0


def _link_check(args: argparse.Namespace, profile: HardwareProfile, transport: Transport) -> Check:
    try:
        link, choice = _measure(args, profile, transport, LINK_MODEL, 2.0)
    except ConnectionError as exc:
        return Check("uplink", False, str(exc))
    finally:
        transport.close()
    return Check("uplink", True, f"{link.throughput_kbps:,.0f} kbit/s, {link.latency_ms:.1f} ms; "
                                 f"recommended uplink {choice.codec}-{choice.bits} ({choice.reason})")


def _measure(args: argparse.Namespace, profile: HardwareProfile, transport: Transport, model: str,
             budget: float):
    import numpy as np

    from edge_client.link import choose_codec, measure_link
    from edge_client.protocol import topic
    from firmware_models import resolve_model

    link = measure_link(transport, topic(args.job or "default", "linktest", args.id))
    n = sum(int(np.prod(s)) for s in resolve_model(model).param_shapes())
    return link, choose_codec(profile, n, link, budget_s=budget)


def auto_codec(args: argparse.Namespace, profile: HardwareProfile, connect: Callable[..., Transport]
               ) -> tuple[str, int]:
    """``run --auto-codec``: measure the link over one connection of this device and return
    the recommended ``(codec, bits)``; logged with the measurement."""
    import logging

    t = connect(backoff=(0.2, 1.0))
    try:
        t.connect(30.0)
        link, choice = _measure(args, profile, t, LINK_MODEL, 2.0)
    finally:
        t.close()
    logging.getLogger("fedbit.device").info(
        "link %.0f kbit/s, %.1f ms: uplink %s-%d (%s)", link.throughput_kbps, link.latency_ms,
        choice.codec, choice.bits, choice.reason)
    return choice.codec, choice.bits


def cmd_measure_link(args: argparse.Namespace) -> int:
    from edge_client.errors import ConfigError
    from firmware_models import SpecError
    from hw_profiles import ProfileError, load_profile

    try:
        profile = load_profile(args.profile)
        transport = _connected(args, 10.0)
        try:
            link, choice = _measure(args, profile, transport, args.model, args.budget)
        finally:
            transport.close()
    except (ConfigError, ProfileError, SpecError, ConnectionError, OSError) as exc:
        print(f"fedbit-edge measure-link: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"throughput_kbps": round(link.throughput_kbps, 1), "latency_ms": round(link.latency_ms, 2),
                      "codec": choice.codec, "codec_bits": choice.bits, "upload_s": round(choice.upload_s, 3),
                      "reason": choice.reason}), flush=True)
    return 0


def service_files(args: argparse.Namespace, exe: str, state_dir: Path) -> dict[str, str]:
    """``{path: text}`` of the systemd unit and its environment file (mode 0600)."""
    env_path = state_dir / "service.env"
    run = [exe, "run", "--profile", args.profile, "--data", args.data, "--workdir", str(state_dir), "--stay",
           "--connect-timeout", "0"]  # (a service retries forever, with capped, jittered backoff)
    for flag in ("broker", "id", "credentials"):
        if getattr(args, flag):
            value = getattr(args, flag)
            run += [f"--{flag}", str(Path(value).resolve()) if flag == "credentials" else value]
    user = args.user or os.environ.get("USER") or "root"
    unit = f"""[Unit]
Description=fedbit federated-learning device ({args.profile})
Wants=network-online.target
After=network-online.target time-sync.target

[Service]
Type=simple
User={user}
WorkingDirectory={state_dir}
# secrets (FEDBIT_PASSWORD) and the numba cache; mode 0600
EnvironmentFile={env_path}
ExecStartPre={shlex.join([exe, "warmup", "--profile", args.profile])}
ExecStart={shlex.join(run)}
Restart=on-failure
RestartSec=10
TimeoutStartSec=1800

[Install]
WantedBy=multi-user.target
"""
    env = (f"NUMBA_CACHE_DIR={state_dir / 'numba-cache'}\n"
           "# FEDBIT_PASSWORD=...   (without --credentials)\n")
    return {str(Path(args.dir) / f"{args.name}.service"): unit, str(env_path): env}


def cmd_install_service(args: argparse.Namespace) -> int:
    from edge_client.errors import ConfigError
    from edge_client.paths import device_state_dir
    from hw_profiles import ProfileError, load_profile

    try:
        load_profile(args.profile)
        if not args.credentials and not (args.broker and args.id):
            raise ConfigError("--broker and --id, or --credentials FILE, are needed")
        device = args.id
        if args.credentials:
            from edge_client.auth import load_credentials

            device = device or load_credentials(args.credentials).device_id
        state_dir = device_state_dir(device)
        exe = str(Path(sys.argv[0]).resolve()) if Path(sys.argv[0]).name == "fedbit-edge" else \
            str(Path(sys.executable).with_name("fedbit-edge"))
        files = service_files(args, exe, state_dir)
    except (ConfigError, ProfileError, OSError) as exc:
        print(f"fedbit-edge install-service: error: {exc}", file=sys.stderr)
        return 1
    unit_path = next(p for p in files if p.endswith(".service"))
    if args.dry_run:
        for path, text in files.items():
            print(f"# {path}\n{text}")
        return 0
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        for path, text in files.items():
            p = Path(path)
            p.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if p.name.endswith(".env") else 0o644)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
    except OSError as exc:
        print(f"fedbit-edge install-service: error: {exc} (as root, or --dir DIR)", file=sys.stderr)
        return 1
    name = Path(unit_path).stem
    print(f"wrote {unit_path} and {state_dir / 'service.env'} (mode 0600)\n"
          f"enable it: sudo systemctl daemon-reload && sudo systemctl enable --now {name}\n"
          f"its log:   journalctl -u {name} -f", flush=True)
    return 0
