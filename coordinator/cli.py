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


def _secret_from(file: str | None, env: str, what: str) -> str | None:
    """A secret from ``file`` (its first line) or the environment variable ``env``; never
    from the command line (``ps`` shows it to every user)."""
    import os

    from edge_client.errors import ConfigError

    if file:
        try:
            return open(file, encoding="utf-8").read().splitlines()[0]
        except (OSError, IndexError) as exc:
            raise ConfigError(f"{what} {file}: cannot read a password from it ({exc})") from None
    return os.environ.get(env) or None


def _no_password_in_url(url: str, what: str) -> None:
    from edge_client.errors import ConfigError
    from edge_client.transport import parse_broker_url

    if parse_broker_url(url).password is not None:
        raise ConfigError(f"{what}: a password in the URL is visible to every user in `ps`; "
                          f"put it in --password-file FILE or FEDBIT_PASSWORD")


def _serve_broker(args: argparse.Namespace, max_packet: int) -> tuple[Any, dict[str, Any]]:
    """The broker ``fedbit serve`` talks to: (the embedded one it started, or None;
    MqttFleet's ``url``/``username``/``password``/``tls`` plus ``enrolment``, the job's
    registry path or "" when devices are not enrolled)."""
    from pathlib import Path

    from coordinator.broker import parse_listen, resolve_security, start_job_broker
    from coordinator.security import JobSecurity
    from edge_client.auth import load_credentials, tls_files
    from edge_client.errors import ConfigError
    from edge_client.transport import TlsOptions

    out = Path(args.out)
    sec_dir = Path(args.security_dir) if args.security_dir else out / "security"
    if args.broker:  # a broker someone else runs (fedbit broker-config writes its files)
        _no_password_in_url(args.broker, "--broker")
        conn: dict[str, Any] = {"url": args.broker, "username": args.username, "tls": None,
                                "password": _secret_from(args.password_file, "FEDBIT_PASSWORD", "--password-file")}
        if args.credentials:
            c = load_credentials(args.credentials)
            conn |= {"username": c.username, "password": c.password}
            if c.ca or c.cert:
                conn["tls"] = TlsOptions(*tls_files(c, out / "tls"))
            sec_dir = Path(args.security_dir) if args.security_dir else Path(args.credentials).parent
        if args.ca or args.cert or args.insecure:
            conn["tls"] = TlsOptions(args.ca, args.cert, args.key, args.insecure)
        registry = JobSecurity(sec_dir, args.job).registry_path
        if args.security_dir and not registry.exists():
            raise ConfigError(f"{registry}: no enrolment registry (fedbit broker-config or enroll makes it)")
        conn["enrolment"] = str(registry) if registry.exists() else ""
        if not conn["enrolment"]:
            print("note: no enrolment registry: updates are not checked for a device MAC "
                  "(fedbit broker-config writes one; pass --security-dir DIR)", flush=True)
        return None, conn
    if args.listen and args.port:
        raise ConfigError("--port and --listen: give one (--listen 127.0.0.1:PORT is --port PORT)")
    host, port = parse_listen(args.listen) if args.listen else ("127.0.0.1", args.port)
    mode = resolve_security(args.security, host)
    sec = JobSecurity(sec_dir, args.job) if mode != "none" else None
    jb = start_job_broker(host, port, security=mode, job_security=sec, hosts=args.hostname or None,
                          workdir=out / "broker" if mode != "none" else None, prefer=args.embedded,
                          max_packet_size=max_packet)
    if sec is None:
        print(f"broker: {jb.device_url} (embedded {jb.kind}; anonymous and unencrypted: loopback "
              f"only, for demos; devices connect with --broker {jb.device_url}; devices on other "
              f"machines: --listen HOST:PORT, TLS and per-device credentials)", flush=True)
        # amqtt keeps offline sessions only for clients with a username
        return jb, {"url": jb.coordinator_url, "username": "fedbit-coordinator", "password": None,
                    "tls": None, "enrolment": ""}
    info = sec.job_info()
    if not info or not str(info.get("broker", "")).endswith(f":{jb.device_url.rsplit(':', 1)[1]}"):
        if info:
            print(f"warning: credentials files made earlier name {info.get('broker')}; devices now dial "
                  f"{jb.device_url} (fedbit-edge run --broker URL overrides the file's)", flush=True)
        sec.save_job_info(jb.device_url, mode == "tls")
    n = len(sec.registry())
    what = ("TLS with client certificates of the job CA" if mode == "tls" else "no TLS (trusted network)")
    print(f"broker: {sec.job_info()['broker']} (embedded {jb.kind}; {what}, per-device passwords, "
          f"ACL; {n} device(s) enrolled in {sec.dir}; enrol one with: fedbit enroll ID --run {out})",
          flush=True)
    c = jb.credentials
    return jb, {"url": jb.coordinator_url, "username": c.username, "password": c.password, "tls": None,
                "enrolment": str(sec.registry_path)}


def _cmd_serve(args: argparse.Namespace) -> int:
    import json

    from coordinator.admission import AdmissionConfig
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
        strategy = build_strategy(args.strategy, **cfg.strategy_params)
        broker, conn = _serve_broker(args, limits.max_payload_bytes + 65536)
        admission.enrolment = conn.pop("enrolment")
        fleet = MqttFleet(conn.pop("url"), args.job, protocol=args.mqtt_version,
                          max_payload=limits.max_payload_bytes + 65536, **conn)
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


def _security_dir(args: argparse.Namespace) -> Any:
    from pathlib import Path

    if args.security_dir:
        return Path(args.security_dir)
    return Path(args.run or f"runs/{args.job}") / "security"


def _read_devices_csv(path: str) -> list[tuple[str, int]]:
    """``device_id[,max_samples]`` rows (a header row naming ``device_id`` is skipped)."""
    import csv

    from edge_client.errors import ConfigError

    rows: list[tuple[str, int]] = []
    try:
        with open(path, newline="", encoding="utf-8") as f:
            for n, row in enumerate(csv.reader(f), 1):
                cells = [c.strip() for c in row]
                if not cells or not cells[0] or cells[0].startswith("#") or (n == 1 and cells[0] == "device_id"):
                    continue
                try:
                    ms = int(cells[1]) if len(cells) > 1 and cells[1] else 0
                except ValueError:
                    raise ConfigError(f"{path}:{n}: max_samples {cells[1]!r} is not an integer") from None
                rows.append((cells[0], ms))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if not rows:
        raise ConfigError(f"{path}: no devices (one device_id[,max_samples] per line)")
    ids = [d for d, _ in rows]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{path}: a device id appears twice")
    return rows


def _cmd_enroll(args: argparse.Namespace) -> int:
    from pathlib import Path

    from coordinator.security import JobSecurity
    from edge_client.errors import ConfigError

    try:
        if bool(args.device_id) == bool(args.devices):
            raise ConfigError("give one DEVICE_ID or --devices CSV")
        sec = JobSecurity(_security_dir(args), args.job)
        if args.devices:
            rows = _read_devices_csv(args.devices)
            out_dir = Path(args.out) if args.out else None
        else:
            rows = [(args.device_id, args.max_samples)]
            out_dir = None
        for dev, ms in rows:
            out = (out_dir / f"{dev}.toml") if out_dir else (args.out if not args.devices else None)
            creds, path = sec.enroll(dev, broker=args.broker_url, max_samples=ms or args.max_samples, out=out)
            tls = "TLS client certificate, " if creds.cert else ""
            print(f"enrolled {dev} in job {args.job}: {tls}password and MAC key in {path} (mode 0600; "
                  f"broker {creds.broker}); on the device: fedbit-edge run --credentials {path.name} "
                  f"--profile PROFILE --data DATA", flush=True)
    except ConfigError as exc:
        print(f"fedbit enroll: error: {exc}", file=sys.stderr)
        return 1
    if sec.reload_broker():
        print("the job's running broker reloaded its password file", flush=True)
    return 0


def _cmd_revoke(args: argparse.Namespace) -> int:
    from coordinator.security import JobSecurity
    from edge_client.errors import ConfigError

    try:
        sec = JobSecurity(_security_dir(args), args.job)
        if not sec.revoke(args.device_id):
            raise ConfigError(f"{args.device_id!r} is not enrolled in job {args.job} ({sec.registry_path})")
    except ConfigError as exc:
        print(f"fedbit revoke: error: {exc}", file=sys.stderr)
        return 1
    reloaded = sec.reload_broker()
    print(f"revoked {args.device_id}: removed from {sec.passwd_path} and {sec.registry_path}; "
          + ("the job's running broker reloaded it (new connections are refused)" if reloaded else
             "reload the broker (SIGHUP, systemctl reload mosquitto) to refuse its next connect"),
          flush=True)
    return 0


def _broker_owns(path: Any) -> None:
    """Make the persistence folder; hand it to the ``mosquitto`` user when we are root
    (mosquitto started as root writes it as that user)."""
    import os

    path.mkdir(mode=0o700, exist_ok=True)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        import pwd

        try:
            u = pwd.getpwnam("mosquitto")
        except KeyError:
            return
        os.chown(path, u.pw_uid, u.pw_gid)


def _cmd_broker_config(args: argparse.Namespace) -> int:
    from pathlib import Path

    from coordinator.broker import DEFAULT_MAX_PACKET, parse_listen
    from coordinator.security import JobSecurity, default_hosts
    from edge_client.errors import ConfigError

    try:
        out = Path(args.out)
        host, port = parse_listen(args.listen)
        tls = args.security == "tls"
        rows = _read_devices_csv(args.devices)
        hosts = args.hostname or default_hosts(host)
        sec = JobSecurity(out, args.job)
        url = f"{'mqtts' if tls else 'mqtt'}://{hosts[0] if host in ('0.0.0.0', '::') else host}:{port}"
        if tls:
            sec.ensure_server_cert(hosts)
        sec.save_job_info(url, tls)
        sec.coordinator(url, tls=tls)
        for dev, ms in rows:
            sec.enroll(dev, broker=url, max_samples=ms)
        max_packet = args.max_payload + 65536 if args.max_payload else DEFAULT_MAX_PACKET
        conf = out / "mosquitto.conf"
        conf.write_text(sec.mosquitto_conf(host=host, port=port, tls=tls, workdir=out / "data",
                                           max_packet_size=max_packet))
        _broker_owns(out / "data")
    except ConfigError as exc:
        print(f"fedbit broker-config: error: {exc}", file=sys.stderr)
        return 1
    print(f"""broker configuration for job {args.job} in {out}:
  {conf}            mosquitto.conf ({'TLS with client certificates, ' if tls else ''}passwords, ACL, persistence)
  {out / 'devices'}/<id>.toml   {len(rows)} device credentials file(s): copy each to its device (mode 0600)
  {sec.coordinator_path}   the coordinator's credentials
run the broker:     mosquitto -c {conf}   (or as a service with this file; started as root it reads
                    passwd, acl and server.key as user mosquitto: they are group-readable to it)
run the job:        fedbit serve --broker {url} --credentials {sec.coordinator_path} --out RUN ...
on each device:     fedbit-edge run --credentials ID.toml --profile PROFILE --data DATA
devices dial {url}; the server certificate names {', '.join(hosts) if tls else '(no TLS)'}.
later:              fedbit enroll ID --security-dir {out} / fedbit revoke ID --security-dir {out},
                    then reload the broker (kill -HUP its pid; systemctl reload mosquitto)""", flush=True)
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
    print(summary.read_text(), flush=True)
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
    p.add_argument("--listen", metavar="HOST:PORT",
                   help="where the embedded broker listens for devices (0.0.0.0:8883: every "
                        "interface); beyond loopback it takes TLS, per-device passwords and an ACL")
    p.add_argument("--security", choices=["auto", "none", "password", "tls"], default="auto",
                   help="embedded broker security (auto: none on loopback, tls beyond it)")
    p.add_argument("--security-dir", metavar="DIR",
                   help="the job's CA, registry, password file and ACL (default OUT/security; "
                        "with --broker: the folder fedbit broker-config wrote)")
    p.add_argument("--hostname", action="append", metavar="NAME",
                   help="a name devices dial, for the server certificate (repeatable; default: "
                        "this host's names)")
    p.add_argument("--credentials", metavar="FILE",
                   help="the coordinator's credentials file for --broker (fedbit broker-config "
                        "writes DIR/coordinator.toml)")
    p.add_argument("--max-samples", type=int, default=0, metavar="N",
                   help="job-wide cap of an update's num_samples (0: none; enrolment and hello "
                        "declarations bound it too)")
    p.add_argument("--samples-policy", choices=["clip", "reject"], default="clip",
                   help="an update claiming more samples than its bound: clipped or rejected")
    p.add_argument("--max-registered", type=int, default=100_000, metavar="N",
                   help="most devices the job registers")
    p.add_argument("--hello-rate", type=float, default=1.0, metavar="PER_S",
                   help="hello/presence messages per device per second (after --hello-burst)")
    p.add_argument("--hello-burst", type=int, default=20, metavar="N")
    p.add_argument("--model", default="digits_cnn", metavar="SPEC", help="model spec name (digits_cnn)")
    p.add_argument("--rounds", type=int, default=5, metavar="N")
    p.add_argument("--strategy", default="fedavg", metavar="NAME", help="aggregation strategy (fedavg)")
    p.add_argument("--strategy-param", action="append", metavar="K=V", help="strategy parameter")
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

    p = sub.add_parser("broker", help="run the embedded MQTT broker",
                       description="mosquitto child process (when on PATH) or amqtt, on loopback.")
    p.add_argument("--port", type=int, default=None, help="TCP port (default: a free one)")
    p.add_argument("--kind", choices=["auto", "mosquitto", "amqtt"], default="auto")
    p.set_defaults(func=_cmd_broker)

    def job_folder(p: argparse.ArgumentParser) -> None:
        p.add_argument("--job", default="default", help="job id (topic prefix fedbit/<job>/)")
        p.add_argument("--run", metavar="DIR", help="the job's run folder, as `fedbit serve --out DIR` "
                       "(security material in DIR/security; default runs/<job>)")
        p.add_argument("--security-dir", metavar="DIR",
                       help="the security folder itself (e.g. what fedbit broker-config wrote)")

    p = sub.add_parser("enroll", help="create a device's credentials for a job",
                       description="Enroll a device: a random password (hashed into the broker's "
                                   "password file), a MAC key, and a client certificate of the job CA "
                                   "when the broker speaks TLS; writes one credentials file (mode 0600) "
                                   "for `fedbit-edge run --credentials FILE`. Secrets are never printed.")
    p.add_argument("device_id", nargs="?", metavar="DEVICE_ID")
    p.add_argument("--devices", metavar="CSV", help="enroll many: device_id[,max_samples] per line")
    p.add_argument("--out", metavar="FILE", help="credentials file (with --devices: a folder; "
                   "default SECURITY/devices/<id>.toml)")
    p.add_argument("--broker-url", metavar="URL",
                   help="the URL devices dial (default: what serve/broker-config recorded, else "
                        "mqtts://<this host>:8883)")
    p.add_argument("--max-samples", type=int, default=0, metavar="N",
                   help="samples the device may claim per update (0: what its hello declares)")
    job_folder(p)
    p.set_defaults(func=_cmd_enroll)

    p = sub.add_parser("revoke", help="revoke a device's credentials",
                       description="Remove a device from the job's registry and the broker's password "
                                   "file; a running embedded broker reloads it at once.")
    p.add_argument("device_id", metavar="DEVICE_ID")
    job_folder(p)
    p.set_defaults(func=_cmd_revoke)

    p = sub.add_parser("broker-config", help="write a mosquitto configuration for a broker you run",
                       description="The configuration `fedbit serve --listen` uses, for a mosquitto run "
                                   "elsewhere (systemd, another host): mosquitto.conf, CA and server "
                                   "certificate, password file, ACL, and credentials for the coordinator "
                                   "and every device.")
    p.add_argument("--devices", required=True, metavar="CSV", help="device_id[,max_samples] per line")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--job", default="default", help="job id (topic prefix fedbit/<job>/)")
    p.add_argument("--listen", default="0.0.0.0:8883", metavar="HOST:PORT")
    p.add_argument("--hostname", action="append", metavar="NAME",
                   help="a name devices dial (repeatable; the first goes into their URL)")
    p.add_argument("--security", choices=["tls", "password"], default="tls")
    p.add_argument("--max-payload", type=int, default=0, metavar="BYTES",
                   help="largest update (the broker's max_packet_size is this plus 64 KiB)")
    p.set_defaults(func=_cmd_broker_config)

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
