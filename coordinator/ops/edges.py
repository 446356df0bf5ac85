"""Edge brokers bridged to a core broker (``fedbit broker-config --edges M``).

Devices connect to one of M edge brokers; each edge forwards its devices' messages to
the core broker, where the coordinator (and its ingest workers) connect, and brings the
core's round, models and status back (a mosquitto bridge: one persistent QoS 1 session
per edge). What each file holds, under the job folder ``DIR``::

    DIR/core/mosquitto.conf     the core: one listener (TLS with client certificates of
                                the job CA unless --security password), passwords, ACL
    DIR/core/passwd, acl        the coordinator, its ingest workers and one user per edge
                                (``fedbit-edge-<k>``: publish device topics, read the
                                round, models and status)
    DIR/edge-<k>/mosquitto.conf an edge: the devices' listener (TLS, client certificates,
                                passwords, the device ACL, client id = username) and the
                                bridge to the core (its own user, password and client
                                certificate)
    DIR/edge-<k>/passwd, acl    its devices only; ``bridge.crt``/``.key``, ``server.crt``/``.key``
    DIR/edges.csv               device_id,edge: which edge each device's credentials name
    DIR/devices/<id>.toml       each device's credentials, naming its edge's URL

The core trusts an edge to enforce the device ACL (a device publishes only under its own
id); a compromised edge still cannot make the coordinator count a message in another
device's name (the device MAC, checked by the coordinator), only drop or delay them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from coordinator.ops.security import (
    JobSecurity,
    acl_text,
    issue,
    mosquitto_password_hash,
    new_password,
)
from edge_client.auth import write_private
from edge_client.errors import ConfigError
from edge_client.protocol import topic

#: an edge's user at the core (and its bridge's client id)
EDGE_USER = "fedbit-edge-{k}"
#: what an edge forwards to the core (out) and brings back (in)
OUT_KINDS = ("update", "hello", "presence", "secagg")
IN_TOPICS = ("round", "model/+", "status", "secagg-in/+")


@dataclass(frozen=True)
class Address:
    """Where a broker listens (``host``, ``port``) and the name clients dial (``dial``)."""

    host: str
    port: int
    dial: str

    def url(self, tls: bool) -> str:
        return f"{'mqtts' if tls else 'mqtt'}://{self.dial}:{self.port}"


def _limits(max_packet: int, data: Path) -> list[str]:
    return [f"max_packet_size {int(max_packet)}", "max_queued_messages 0",
            f"max_queued_bytes {max(4 * int(max_packet), 256 * 1024 * 1024)}", "max_inflight_messages 0",
            "persistence true", f"persistence_location {data.resolve()}/", "autosave_interval 1"]


def _listener(addr: Address, tls: bool, ca: Path, cert: Path, key: Path) -> list[str]:
    lines = [f"listener {addr.port} {addr.host}", "use_username_as_clientid true"]
    if tls:
        lines += [f"cafile {ca.resolve()}", f"certfile {cert.resolve()}", f"keyfile {key.resolve()}",
                  "require_certificate true", "tls_version tlsv1.2"]
    return lines


def edge_acl(job: str, edges: int, readers: list[str]) -> str:
    """The core's ACL: the job's (the coordinator, its ingest workers ``readers``, the
    device patterns) plus one block per edge user: publish the device topics it
    forwards, read what it brings back."""
    root = topic(job, "round").rsplit("/", 1)[0]
    blocks = []
    for k in range(edges):
        blocks += [f"user {EDGE_USER.format(k=k)}"] + [f"topic write {root}/{kind}/+" for kind in OUT_KINDS] \
            + [f"topic read {root}/{t}" for t in IN_TOPICS] + [""]
    return acl_text(job, readers).rstrip("\n") + "\n\n" + "\n".join(blocks)


def write_edges(sec: JobSecurity, rows: list[tuple[str, int | None]], *, core: Address, edges: list[Address],
                tls: bool, max_packet: int, ingest_workers: int = 0, hosts: list[str] = ()) -> dict[str, int]:
    """Write the core's and every edge's configuration into ``sec``'s folder (see the module
    docstring), enrol ``rows`` (device id, sample cap), each device on edge ``i % M`` in
    file order; returns device id -> edge. ``hosts``: more names for the server
    certificates (each broker's dial name is in its own)."""
    if len(edges) < 1:
        raise ConfigError("--edges: at least 1")
    d = sec.dir
    hosts = sorted({core.dial, *(e.dial for e in edges), *hosts, "localhost", "127.0.0.1"})
    core_url = core.url(tls)
    sec.save_job_info(core_url, tls)
    sec.set_ingest_workers(ingest_workers)
    sec.coordinator(core_url, tls=tls)
    assign: dict[str, int] = {}
    for i, (dev, ms) in enumerate(rows):
        k = i % len(edges)
        sec.enroll(dev, broker=edges[k].url(tls), max_samples=ms)
        assign[dev] = k
    registry = sec.registry()
    own = [line for line in sec.coordinator_passwd_path.read_text().splitlines() if line]
    if tls:
        sec.ensure_ca()
    (d / "core").mkdir(exist_ok=True)
    if tls:
        issue(d, "core/server", core.dial, hosts=hosts)
    edge_lines = []
    for k, addr in enumerate(edges):
        ed = d / f"edge-{k}"
        ed.mkdir(exist_ok=True)
        (ed / "data").mkdir(mode=0o700, exist_ok=True)
        user, password = EDGE_USER.format(k=k), new_password()
        edge_lines.append(f"{user}:{mosquitto_password_hash(password)}")
        mine = sorted(dev for dev, e in assign.items() if e == k)
        write_private(ed / "passwd", "".join(f"{dev}:{registry[dev].password_hash}\n" for dev in mine))
        write_private(ed / "acl", acl_text(sec.job))
        if tls:
            issue(d, f"edge-{k}/server", addr.dial, hosts=hosts)
            issue(d, f"edge-{k}/bridge", user)
        conf = [f"# generated by fedbit broker-config for job {sec.job}: edge {k} of {len(edges)}",
                "per_listener_settings false", "allow_anonymous false", f"password_file {(ed / 'passwd').resolve()}",
                f"acl_file {(ed / 'acl').resolve()}", *_limits(max_packet, ed / "data"),
                *_listener(addr, tls, d / "ca.crt", ed / "server.crt", ed / "server.key"), "",
                f"connection {user}", f"address {core.dial}:{core.port}", f"remote_clientid {user}",
                f"remote_username {user}", f"remote_password {password}", "cleansession false",
                "bridge_protocol_version mqttv311", "try_private true", "notifications false",
                "restart_timeout 1 10"]
        if tls:
            conf += [f"bridge_cafile {(d / 'ca.crt').resolve()}", f"bridge_certfile {(ed / 'bridge.crt').resolve()}",
                     f"bridge_keyfile {(ed / 'bridge.key').resolve()}"]
        root = topic(sec.job, "round").rsplit("/", 1)[0]
        conf += [f"topic {root}/{kind}/+ out 1" for kind in OUT_KINDS] + [f"topic {root}/{t} in 1" for t in IN_TOPICS]
        write_private(ed / "mosquitto.conf", "\n".join(conf) + "\n")
        for f in ("passwd", "acl", "mosquitto.conf", "server.key", "bridge.key"):
            if (ed / f).exists():
                sec.share_with_broker(ed / f)
    core_dir = d / "core"
    (core_dir / "data").mkdir(mode=0o700, exist_ok=True)
    write_private(core_dir / "passwd", "\n".join(own + edge_lines) + "\n")
    write_private(core_dir / "acl", edge_acl(sec.job, len(edges), sec.ingest_users()))
    conf = [f"# generated by fedbit broker-config for job {sec.job}: the core of {len(edges)} edge(s)",
            "per_listener_settings false", "allow_anonymous false",
            f"password_file {(core_dir / 'passwd').resolve()}", f"acl_file {(core_dir / 'acl').resolve()}",
            *_limits(max_packet, core_dir / "data"),
            *_listener(core, tls, d / "ca.crt", core_dir / "server.crt", core_dir / "server.key")]
    write_private(core_dir / "mosquitto.conf", "\n".join(conf) + "\n")
    for f in ("passwd", "acl", "mosquitto.conf", "server.key"):
        if (core_dir / f).exists():
            sec.share_with_broker(core_dir / f)
    (d / "edges.csv").write_text("device_id,edge\n" + "".join(f"{dev},{k}\n" for dev, k in assign.items()))
    return assign

