"""How a process reaches a fedbit broker: the connection options both command lines share
(``fedbit-edge`` and ``fedbit serve``), secrets that never come from the command line, and a
device's identity from its credentials file.

:func:`add_connection_options` defines ``--credentials``, ``--broker``, ``--mqtt-version``,
``--username``, ``--password-file``, ``--ca``, ``--cert``, ``--key`` and ``--insecure`` once;
``dest`` maps each option to the attribute it sets (``fedbit serve`` stores them under its
job file's ``broker.*`` keys), and ``suppress`` leaves an option that was not given out of
the namespace, so that it does not override a config file. A device's commands use
:func:`add_device_connection_options`, which adds ``--id`` and ``--job``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge_client.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from edge_client.transport import MqttTransport, TlsOptions

#: option name -> (argparse keyword arguments); ``--credentials``' help is the caller's
_OPTIONS: dict[str, dict[str, Any]] = {
    "broker": {"metavar": "URL", "help": "mqtt://[user@]host:port or mqtts://host:port"},
    "mqtt_version": {"choices": ["auto", "5", "3.1.1"], "help": "MQTT protocol version (auto)"},
    "username": {"metavar": "NAME", "help": "broker user name"},
    "password_file": {"metavar": "FILE", "help": "the broker password, first line of FILE (or "
                      "FEDBIT_PASSWORD; never on the command line)"},
    "ca": {"metavar": "PEM", "help": "CA certificate for mqtts://"},
    "cert": {"metavar": "PEM", "help": "client certificate"},
    "key": {"metavar": "PEM", "help": "client key"},
    "insecure": {"action": "store_true", "help": "skip the TLS hostname check"},
}
DEFAULT_MQTT_VERSION = "auto"


def add_connection_options(p: argparse.ArgumentParser, *, credentials_help: str,
                           dest: Mapping[str, str] | None = None, suppress: bool = False) -> None:
    """Add the shared broker options to ``p`` (see the module docstring)."""
    dest = dest or {}

    def add(name: str, **kw: Any) -> None:
        flag = "--" + name.replace("_", "-")
        kw = dict(kw)
        if suppress:
            kw["default"] = argparse.SUPPRESS
        elif name == "mqtt_version":
            kw["default"] = DEFAULT_MQTT_VERSION
        p.add_argument(flag, dest=dest.get(name, name), **kw)

    add("credentials", metavar="FILE", help=credentials_help)
    for name, kw in _OPTIONS.items():
        add(name, **kw)


def _add_device_identity_options(p: argparse.ArgumentParser) -> None:
    """``--id`` and ``--job`` of a device (both default to the credentials file's)."""
    p.add_argument("--id", help="device id ([A-Za-z0-9._-]+; default: the credentials file's)")
    p.add_argument("--job", default=None, help="job id (default: the credentials file's, else 'default')")


CREDENTIALS_HELP = ("the credentials file `fedbit enroll` wrote (broker, id, job, password, "
                    "certificates, MAC key; mode 0600)")


def add_device_connection_options(p: argparse.ArgumentParser) -> None:
    """The broker, identity and TLS options of every ``fedbit-edge`` command that talks to a
    broker."""
    add_connection_options(p, credentials_help=CREDENTIALS_HELP)
    _add_device_identity_options(p)


#: ``fedbit-edge run --connect-timeout``'s default in an interactive run (s); under systemd
#: (``INVOCATION_ID`` set) the default is 0: a service retries forever
INTERACTIVE_CONNECT_TIMEOUT = 60.0
#: a device's reconnect backoff (s): from 1 s, doubling, capped at 30 s, each wait jittered
DEVICE_BACKOFF = (1.0, 30.0)


def add_connect_timeout_option(p: argparse.ArgumentParser) -> None:
    """``--connect-timeout S`` of a device loop (see :func:`connect_timeout`)."""
    p.add_argument("--connect-timeout", type=float, default=None, metavar="S",
                   help="give up, exit status 3, after S seconds without a broker session (at the start "
                        "or after losing it); 0: retry forever (default: 0 under systemd, where the "
                        f"service manager restarts it, else {INTERACTIVE_CONNECT_TIMEOUT:g})")


def connect_timeout(args: argparse.Namespace) -> float:
    """The device's give-up time (s; 0: never): ``--connect-timeout``, else 0 when run by
    systemd (it sets ``INVOCATION_ID``) and :data:`INTERACTIVE_CONNECT_TIMEOUT` otherwise."""
    value = getattr(args, "connect_timeout", None)
    if value is None:
        return 0.0 if os.environ.get("INVOCATION_ID") else INTERACTIVE_CONNECT_TIMEOUT
    if not value >= 0:
        raise ConfigError(f"--connect-timeout: must be >= 0 seconds (0: retry forever), got {value}")
    return float(value)


def read_secret(file: str | None, what: str, env: str = "FEDBIT_PASSWORD") -> str | None:
    """A secret from ``file`` (its first line) or the environment variable ``env``; never
    from the command line (``ps`` shows it to every user)."""
    if file:
        try:
            return Path(file).read_text(encoding="utf-8").splitlines()[0]
        except (OSError, IndexError) as exc:
            raise ConfigError(f"{what} {file}: cannot read a password from it ({exc})") from None
    return os.environ.get(env) or None


def no_password_in_url(url: str, what: str) -> None:
    """ConfigError when ``url`` carries a password (``ps`` would show it to everyone)."""
    from edge_client.transport import parse_broker_url

    if parse_broker_url(url).password is not None:
        raise ConfigError(f"{what}: a password in the URL is visible to every user in `ps`; put "
                          f"it in --credentials FILE, --password-file FILE or FEDBIT_PASSWORD")


@dataclass
class Identity:
    """Who a device is and how it proves it: broker credentials, TLS files, the MAC key of
    its updates (empty: unsigned), and the sample count it was enrolled with (0: none)."""

    username: str | None = None
    password: str | None = None
    tls: TlsOptions | None = None
    mac_key: bytes = b""
    max_samples: int = 0


def device_identity(args: argparse.Namespace, state_dir: Callable[[str], Path]) -> Identity:
    """The device's identity from ``--credentials FILE`` (which fills in ``--broker``,
    ``--id``, ``--job`` unless given; they must agree with it), else ``--username`` and a
    password from ``--password-file``/``FEDBIT_PASSWORD``. ``state_dir(device_id)`` is
    where the TLS files of a credentials file are unpacked unless ``--workdir`` says."""
    out = Identity(username=args.username)
    if args.credentials:
        from edge_client.auth import load_credentials, tls_files
        from edge_client.transport import TlsOptions

        c = load_credentials(args.credentials)
        if args.id and args.id != c.device_id:
            raise ConfigError(f"--id {args.id} != the credentials' device {c.device_id} ({args.credentials})")
        if args.job not in (None, c.job):
            raise ConfigError(f"--job {args.job} != the credentials' job {c.job} ({args.credentials})")
        args.id, args.job, args.broker = c.device_id, c.job, args.broker or c.broker
        out = Identity(username=c.username, password=c.password, max_samples=c.max_samples,
                       mac_key=c.mac_key_bytes if c.mac_key else b"")
        if c.ca or c.cert:
            workdir = Path(args.workdir) if getattr(args, "workdir", None) else state_dir(c.device_id)
            out.tls = TlsOptions(*tls_files(c, workdir / "tls"))
    if not args.broker or not args.id:
        raise ConfigError("--broker and --id are required (or --credentials FILE, which has both)")
    no_password_in_url(args.broker, "--broker")
    if args.password_file or out.password is None:
        out.password = read_secret(args.password_file, "--password-file")
    args.job = args.job or "default"
    return out


def device_connector(args: argparse.Namespace, ident: Identity) -> Callable[..., Any]:
    """``connect(**kw)`` -> an MqttTransport of this device, signing what it publishes
    when the device has a MAC key; ``--ca``/``--cert``/``--key``/``--insecure`` replace the
    credentials file's TLS files."""
    from edge_client.transport import MqttTransport, TlsOptions

    tls = ident.tls
    if args.ca or args.cert or args.insecure:
        tls = TlsOptions(args.ca, args.cert, args.key, args.insecure)

    def connect(**kw: Any) -> MqttTransport:
        kw.setdefault("backoff", DEVICE_BACKOFF)
        return MqttTransport(args.broker, args.id, username=ident.username, password=ident.password,
                             tls=tls, protocol=args.mqtt_version, **kw)

    if ident.mac_key:
        from edge_client.auth import signing_connector

        return signing_connector(connect, ident.mac_key)
    return connect
