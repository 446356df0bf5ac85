"""The ``fedbit`` commands of a secured job: ``enroll``, ``revoke``, ``broker-config``, and
:func:`serve_broker`, the broker ``fedbit serve`` starts or reaches. Heavy imports happen
inside the functions.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the commands import lazily: a fast --help
    from pathlib import Path

    from coordinator.job import ServeJob
    from coordinator.ops.admission import AdmissionConfig
    from coordinator.ops.credentials import JobSecurity


def add_security_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``enroll``, ``revoke`` and ``broker-config`` subcommands."""
    from coordinator.ops.credentials import DEFAULT_MAX_SAMPLES

    def default_cap(p: argparse.ArgumentParser) -> None:
        p.add_argument("--default-max-samples", type=int, default=None, metavar="N",
                       help="the job's sample cap for devices enrolled without --max-samples (and CSV "
                            f"rows without one), recorded for later enrolments (default {DEFAULT_MAX_SAMPLES:,})")

    def job_folder(p: argparse.ArgumentParser) -> None:
        p.add_argument("--job", default=None, help="job id (topic prefix fedbit/<job>/; default: the "
                       "security folder's job, else 'default')")
        p.add_argument("--run", metavar="DIR", help="the job's run folder, as `fedbit serve --out DIR` "
                       "(security material in DIR/security, or where serve --security-dir put it; "
                       "default runs/<job>)")
        p.add_argument("--security-dir", metavar="DIR",
                       help="the security folder itself (e.g. what fedbit broker-config wrote)")

    p = sub.add_parser("enroll", help="create a device's credentials for a job",
                       description="Enroll a device: a random password (hashed into the broker's "
                                   "password file), a MAC key, and a client certificate of the job CA "
                                   "when the broker speaks TLS; writes one credentials file (mode 0600) "
                                   "for `fedbit-edge run --credentials FILE`. Secrets are never printed.")
    p.add_argument("device_id", nargs="?", metavar="DEVICE_ID",
                   help="the device's id ([A-Za-z0-9._-]+; or --devices CSV for many)")
    p.add_argument("--devices", metavar="CSV", help="enroll many: device_id[,max_samples] per line")
    p.add_argument("--out", metavar="FILE", help="credentials file (with --devices: a folder; "
                   "default SECURITY/devices/<id>.toml)")
    p.add_argument("--broker-url", metavar="URL",
                   help="the URL devices dial (default: what serve/broker-config recorded, else "
                        "mqtts://<this host>:8883)")
    p.add_argument("--max-samples", type=int, default=None, metavar="N",
                   help="samples the device may claim per update, its most weight in a round (default: "
                        "the job's --default-max-samples; 0: uncapped, which fedbit serve refuses "
                        "unless --allow-uncapped)")
    default_cap(p)
    job_folder(p)
    p.set_defaults(func=_cmd_enroll)

    p = sub.add_parser("revoke", help="revoke a device's credentials",
                       description="Remove a device from the job's registry and the broker's password "
                                   "file; a running embedded broker reloads it at once.")
    p.add_argument("device_id", metavar="DEVICE_ID", help="the device to revoke")
    job_folder(p)
    p.set_defaults(func=_cmd_revoke)

    p = sub.add_parser("broker-config", help="write a mosquitto configuration for a broker you run",
                       description="The configuration `fedbit serve --listen` uses, for a mosquitto run "
                                   "elsewhere (systemd, another host): mosquitto.conf, CA and server "
                                   "certificate, password file, ACL, and credentials for the coordinator "
                                   "and every device.")
    p.add_argument("--devices", required=True, metavar="CSV", help="device_id[,max_samples] per line")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="folder for mosquitto.conf, the CA, certificates, password file, ACL and every "
                        "credentials file (DIR/coordinator.toml for fedbit serve --credentials)")
    p.add_argument("--job", default="default", help="job id (topic prefix fedbit/<job>/)")
    p.add_argument("--listen", default="0.0.0.0:8883", metavar="HOST:PORT",
                   help="where mosquitto listens for devices (default 0.0.0.0:8883)")
    p.add_argument("--hostname", action="append", metavar="NAME",
                   help="a name devices dial (repeatable; the first goes into their URL)")
    p.add_argument("--security", choices=["tls", "password"], default="tls",
                   help="tls: TLS with client certificates of the job CA, passwords and the ACL (default); "
                        "password: passwords and the ACL without TLS (a trusted network only)")
    p.add_argument("--max-payload", type=int, default=0, metavar="BYTES",
                   help="largest update (the broker's max_packet_size is this plus 64 KiB)")
    p.add_argument("--edges", type=int, default=0, metavar="M",
                   help="M edge brokers for the devices, bridged to a core broker for the coordinator (--listen: "
                        "the core's; each device's credentials name its edge)")
    p.add_argument("--edge-address", action="append", metavar="HOST:PORT",
                   help="the address devices dial for each edge, one per edge (default: the core's host, "
                        "the ports after the core's)")
    p.add_argument("--ingest-workers", type=int, default=0, metavar="N",
                   help="users for fedbit serve --ingest-workers N (fedbit-coordinator-ingest-<i>: the "
                        "coordinator's password, read access to the updates)")
    default_cap(p)
    p.set_defaults(func=_cmd_broker_config)



def serve_broker(job: ServeJob, max_packet: int) -> tuple[Any, dict[str, Any]]:
    """The broker ``fedbit serve`` talks to (``job``: a :class:`~coordinator.job.ServeJob`):
    (the embedded one it started, or None; MqttFleet's ``url``/``username``/``password``/
    ``tls``/``client_id`` plus ``enrolment``, the job's registry path or "" when devices
    are not enrolled). The security mode follows the job: with enrolled devices, TLS (or
    passwords, for devices enrolled for a plaintext broker) and the ACL, loopback or not."""
    from pathlib import Path

    from coordinator.ops.broker import parse_listen, resolve_security, start_job_broker
    from coordinator.ops.credentials import COORDINATOR_USER, JobSecurity
    from edge_client.auth import load_credentials, tls_files
    from edge_client.connection import no_password_in_url, read_secret
    from edge_client.errors import ConfigError
    from edge_client.transport import TlsOptions

    b, name = job.broker, job.server.job
    out = Path(job.out)
    sec_dir = Path(b.security_dir) if b.security_dir else out / "security"
    if b.url:  # a broker someone else runs (fedbit broker-config writes its files)
        no_password_in_url(b.url, "--broker")
        conn: dict[str, Any] = {"url": b.url, "username": b.username or None, "tls": None,
                                "password": read_secret(b.password_file or None, "--password-file")}
        if b.credentials:
            c = load_credentials(b.credentials)
            conn |= {"username": c.username, "password": c.password, "client_id": c.username}
            if c.ca or c.cert:
                conn["tls"] = TlsOptions(*tls_files(c, out / "tls"))
            sec_dir = Path(b.security_dir) if b.security_dir else Path(b.credentials).parent
        if b.ca or b.cert or b.insecure:
            conn["tls"] = TlsOptions(b.ca or None, b.cert or None, b.key or None, b.insecure)
        sec = JobSecurity(sec_dir, name)
        if b.security_dir and not sec.registry_path.exists():
            raise ConfigError(f"{sec.registry_path}: no enrolment registry (fedbit broker-config or enroll makes it)")
        conn["enrolment"] = str(sec.registry_path) if sec.registry_path.exists() else ""
        if not conn["enrolment"]:
            print("note: no enrolment registry: updates are not checked for a device MAC "
                  "(fedbit broker-config writes one; pass --security-dir DIR)", flush=True)
        else:
            check_caps(sec, job.server.admission)
        return None, conn
    if b.listen and b.port:
        raise ConfigError("--port and --listen: give one (--listen 127.0.0.1:PORT is --port PORT)")
    host, port = parse_listen(b.listen) if b.listen else ("127.0.0.1", b.port or None)
    sec = JobSecurity(sec_dir, name)
    enrolled = len(sec.registry())
    mode = resolve_security(b.security, host, enrolled=enrolled, tls=bool(sec.job_info().get("tls", True)))
    if mode == "none":
        jb = start_job_broker(host, port, security=mode, prefer=b.embedded, max_packet_size=max_packet)
        print(f"broker: {jb.device_url} (embedded {jb.kind}; anonymous and unencrypted: loopback "
              f"only, for demos, as no device is enrolled in {sec.dir}; devices connect with --broker "
              f"{jb.device_url} --job {name}; devices on other machines: --listen HOST:PORT, TLS and "
              f"per-device credentials)", flush=True)
        # amqtt keeps offline sessions only for clients with a username; the anonymous
        # broker lets the coordinator hear every job (devices knocking on the wrong one)
        return jb, {"url": jb.coordinator_url, "username": COORDINATOR_USER, "password": None,
                    "tls": None, "enrolment": "", "watch_jobs": True}
    check_caps(sec, job.server.admission)
    sec.set_ingest_workers(getattr(job, "ingest_workers", 0))  # their users in the password files and ACL
    jb = start_job_broker(host, port, security=mode, job_security=sec, hosts=b.hostnames or None,
                          workdir=out / "broker", prefer=b.embedded, max_packet_size=max_packet)
    info = sec.job_info()
    if not info or not str(info.get("broker", "")).endswith(f":{jb.device_url.rsplit(':', 1)[1]}"):
        if info.get("broker"):
            print(f"warning: credentials files made earlier name {info.get('broker')}; devices now dial "
                  f"{jb.device_url} (fedbit-edge run --broker URL overrides the file's)", flush=True)
        sec.save_job_info(jb.device_url, mode == "tls")
    if sec_dir.resolve() != (out / "security").resolve():
        _record_security_dir(out, sec_dir)
    what = ("TLS with client certificates of the job CA" if mode == "tls" else "no TLS (trusted network)")
    print(f"broker: {sec.job_info()['broker']} (embedded {jb.kind}; {what}, per-device passwords, "
          f"ACL; {enrolled} device(s) enrolled in {sec.dir}; enrol one with: {enroll_hint(sec, out)})",
          flush=True)
    c = jb.credentials
    return jb, {"url": jb.coordinator_url, "username": c.username, "password": c.password, "tls": None,
                "client_id": c.username, "enrolment": str(sec.registry_path)}


def check_caps(sec: JobSecurity, admission: AdmissionConfig) -> None:
    """ConfigError when a device of the job is enrolled without a sample cap, the job has
    no ``--max-samples`` of its own and ``--allow-uncapped`` was not given."""
    from edge_client.errors import ConfigError

    if admission.max_samples or admission.allow_uncapped:
        return
    uncapped = sec.uncapped()
    if uncapped:
        more = f" and {len(uncapped) - 5} more" if len(uncapped) > 5 else ""
        raise ConfigError(f"{', '.join(uncapped[:5])}{more}: enrolled without a sample cap (--max-samples 0), "
                          f"so such a device weighs whatever it claims; re-enroll it with --max-samples N, "
                          f"give the job a cap (--max-samples N), or pass --allow-uncapped")


def enroll_hint(sec: JobSecurity, out: Path) -> str:
    """The ``fedbit enroll`` command line that reaches this job's security folder."""
    from pathlib import Path

    where = f"--run {out}" if Path(sec.dir).resolve() == (Path(out) / "security").resolve() \
        else f"--security-dir {sec.dir}"
    return f"fedbit enroll ID {where}" + (f" --job {sec.job}" if sec.job != "default" else "")


#: in a run folder: where its security folder is when ``serve --security-dir`` put it elsewhere
SECURITY_POINTER = "security-dir"


def _record_security_dir(out: Path, sec_dir: Path) -> None:
    from pathlib import Path

    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / SECURITY_POINTER).write_text(str(Path(sec_dir).resolve()) + "\n")


def _job_folder(args: argparse.Namespace) -> tuple[Path, str]:
    """(the security folder, the job id) of ``enroll``/``revoke``: ``--security-dir``, else
    the run folder's (``--run DIR``, default ``runs/<job>``: ``DIR/security``, or where
    ``serve --security-dir`` recorded it); the job is ``--job``, else the folder's own."""
    import json
    from pathlib import Path

    if args.security_dir:
        folder = Path(args.security_dir)
    else:
        run = Path(args.run or f"runs/{args.job or 'default'}")
        pointer = run / SECURITY_POINTER
        folder = Path(pointer.read_text().strip()) if not (run / "security").exists() and pointer.is_file() \
            else run / "security"
    job = args.job
    if job is None:
        for name in ("job.json", "enrolled.json"):
            try:
                job = json.loads((folder / name).read_text()).get("job")
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(job, str):
                break
        job = job if isinstance(job, str) else "default"
    return folder, job


def _read_devices_csv(path: str) -> list[tuple[str, int | None]]:
    """``device_id[,max_samples]`` rows (a header row naming ``device_id`` is skipped; no
    max_samples: None, the job's default)."""
    import csv

    from edge_client.errors import ConfigError

    rows: list[tuple[str, int | None]] = []
    try:
        with open(path, newline="", encoding="utf-8") as f:
            for n, row in enumerate(csv.reader(f), 1):
                cells = [c.strip() for c in row]
                if not cells or not cells[0] or cells[0].startswith("#") or (n == 1 and cells[0] == "device_id"):
                    continue
                try:
                    ms = int(cells[1]) if len(cells) > 1 and cells[1] else None
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

    from coordinator.ops.credentials import JobSecurity
    from edge_client.errors import ConfigError

    try:
        if bool(args.device_id) == bool(args.devices):
            raise ConfigError("give one DEVICE_ID or --devices CSV")
        folder, job = _job_folder(args)
        sec = JobSecurity(folder, job)
        if args.default_max_samples is not None:
            url, tls = sec.broker_url(args.broker_url)
            sec.save_job_info(url, tls, default_max_samples=args.default_max_samples)
        if args.devices:
            rows = _read_devices_csv(args.devices)
            out_dir = Path(args.out) if args.out else None
        else:
            rows = [(args.device_id, None)]
            out_dir = None
        made = sec.enroll_many([(dev, ms if ms is not None else args.max_samples,
                                 (out_dir / f"{dev}.toml") if out_dir else (args.out if not args.devices else None))
                                for dev, ms in rows], broker=args.broker_url)
        for creds, path in made:
            tls = "TLS client certificate, " if creds.cert else ""
            cap = f"at most {creds.max_samples:,} samples" if creds.max_samples else \
                "UNCAPPED (fedbit serve refuses it unless --allow-uncapped)"
            print(f"enrolled {creds.device_id} in job {job}: {tls}password and MAC key in {path} (mode 0600; "
                  f"broker {creds.broker}; {cap}); on the device: fedbit-edge run --credentials "
                  f"{path.name} --profile PROFILE --data DATA", flush=True)
    except ConfigError as exc:
        print(f"fedbit enroll: error: {exc}", file=sys.stderr)
        return 1
    if sec.reload_broker():
        print("the job's running broker reloaded its password file", flush=True)
    return 0


def _cmd_revoke(args: argparse.Namespace) -> int:
    from coordinator.ops.credentials import JobSecurity
    from edge_client.errors import ConfigError

    try:
        folder, job = _job_folder(args)
        sec = JobSecurity(folder, job)
        if not sec.revoke(args.device_id):
            raise ConfigError(f"{args.device_id!r} is not enrolled in job {job} ({sec.registry_path})")
    except ConfigError as exc:
        print(f"fedbit revoke: error: {exc}", file=sys.stderr)
        return 1
    reloaded = sec.reload_broker()
    print(f"revoked {args.device_id}: removed from {sec.passwd_path} and {sec.registry_path}; "
          + ("the job's running broker reloaded it (new connections are refused)" if reloaded else
             "reload the broker (SIGHUP, systemctl reload mosquitto) to refuse its next connect"),
          flush=True)
    return 0


def _edges_config(args: argparse.Namespace, sec: JobSecurity, rows: list, host: str, port: int, hosts: list[str],
                  tls: bool) -> int:
    """``broker-config --edges M``: a core broker and M bridged edges (coordinator.ops.brokerconf)."""
    from coordinator.ops.broker import DEFAULT_MAX_PACKET, parse_listen
    from coordinator.ops.brokerconf import Address, write_edges
    from edge_client.errors import ConfigError

    wild = ("0.0.0.0", "::", "")
    dial = hosts[0] if host in wild else host
    given = [parse_listen(a) for a in args.edge_address or []]
    m = args.edges or len(given)
    if given and len(given) != m:
        raise ConfigError(f"--edges {m} with {len(given)} --edge-address: give one address per edge")
    edges = [Address(host, p, dial if h in wild else h) for h, p in given] or \
        [Address(host, port + 1 + k, dial) for k in range(m)]
    core = Address(host, port, dial)
    max_packet = args.max_payload + 65536 if args.max_payload else DEFAULT_MAX_PACKET
    assign = write_edges(sec, rows, core=core, edges=edges, tls=tls, max_packet=max_packet,
                         ingest_workers=max(0, args.ingest_workers), hosts=hosts)
    out = sec.dir
    for k in range(m):
        _broker_owns(out / f"edge-{k}" / "data")
    _broker_owns(out / "core" / "data")
    counts = [sum(1 for e in assign.values() if e == k) for k in range(m)]
    print(f"""bridged brokers for job {args.job} in {out}:
  {out / 'core' / 'mosquitto.conf'}   the core ({core.url(tls)}): the coordinator and {m} edge bridge(s)
""" + "".join(f"  {out / f'edge-{k}' / 'mosquitto.conf'}   edge {k} ({edges[k].url(tls)}): {counts[k]} device(s)\n"
              for k in range(m)) + f"""  {out / 'edges.csv'}   which edge each device's credentials name
run each broker:    mosquitto -c FILE   (the core first; an edge's bridge retries until the core is up)
run the job:        fedbit serve --broker {core.url(tls)} --credentials {sec.coordinator_path} --out RUN ...
on each device:     fedbit-edge run --credentials ID.toml --profile PROFILE --data DATA""", flush=True)
    return 0


def _broker_owns(path: Path) -> None:
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

    from coordinator.ops.broker import DEFAULT_MAX_PACKET, parse_listen
    from coordinator.ops.brokerconf import broker_conf
    from coordinator.ops.credentials import JobSecurity, default_hosts
    from edge_client.errors import ConfigError

    try:
        out = Path(args.out)
        host, port = parse_listen(args.listen)
        tls = args.security == "tls"
        rows = _read_devices_csv(args.devices)
        hosts = args.hostname or default_hosts(host)
        sec = JobSecurity(out, args.job)
        url = f"{'mqtts' if tls else 'mqtt'}://{hosts[0] if host in ('0.0.0.0', '::') else host}:{port}"
        if args.edges or args.edge_address:
            return _edges_config(args, sec, rows, host, port, hosts, tls)
        if tls:
            sec.ensure_server_cert(hosts)
        sec.save_job_info(url, tls, default_max_samples=args.default_max_samples)
        sec.set_ingest_workers(max(0, args.ingest_workers))
        sec.coordinator(url, tls=tls)
        sec.enroll_many([(dev, ms, None) for dev, ms in rows], broker=url)
        max_packet = args.max_payload + 65536 if args.max_payload else DEFAULT_MAX_PACKET
        conf = out / "mosquitto.conf"
        conf.write_text(broker_conf(sec, host=host, port=port, tls=tls, workdir=out / "data",
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


