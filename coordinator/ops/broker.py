"""MQTT brokers fedbit starts itself: the embedded default and the test helper.

- :class:`MosquittoBroker` runs ``mosquitto`` as a child process with a generated config
  on a loopback port (free port chosen at run time unless given). It applies the measured
  fixes of docs/mqtt.md: ``user root`` when started as root, ``max_queued_messages 0``
  with a byte bound instead (the default 1000 silently drops QoS 1 messages),
  ``max_packet_size`` (never the deprecated ``message_size_limit``). It is stopped by PID.
- :class:`AmqttBroker` runs amqtt 0.12.1 in-process on its own event-loop thread, bound to
  ``127.0.0.1:PORT`` (its default would be ``0.0.0.0:1883``). MQTT 3.1.1 only.
- :func:`start_embedded_broker` picks mosquitto when it is on ``PATH``, else amqtt.

Both expose ``url`` (``mqtt://127.0.0.1:PORT``), ``kind``, ``supports_v5`` and ``stop()``,
and work as context managers.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from edge_client.errors import ConfigError
from edge_client.protocol import DEFAULT_LIMITS

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable

    from coordinator.ops.credentials import JobSecurity
    from edge_client.auth import Credentials

#: Broker-side packet cap: the protocol's payload cap plus room for topic and headers.
DEFAULT_MAX_PACKET = DEFAULT_LIMITS.max_payload_bytes + 64 * 1024

log = logging.getLogger("fedbit.broker")


class Broker(Protocol):
    """What every broker helper offers."""

    url: str
    kind: str
    supports_v5: bool

    def stop(self) -> None: ...


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (bind to port 0, read, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_for_port(host: str, port: int, timeout: float = 10.0) -> bool:
    """Poll until a TCP connect to ``host:port`` succeeds; False after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


def dial_host(host: str) -> str:
    """The address to connect to for a listener bound to ``host`` (loopback for a
    wildcard bind)."""
    return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)


def mosquitto_path() -> str | None:
    """Path of the ``mosquitto`` binary on ``PATH``, or None."""
    return shutil.which("mosquitto")


class MosquittoBroker:
    """A ``mosquitto`` child process on a loopback port with a generated config.

    Args:
        port: TCP port; ``None`` picks a free one.
        host: listen address (loopback by default).
        workdir: where the config, log and persistence files go (a temp dir by default,
            removed on :meth:`stop`).
        max_packet_size: bytes; larger packets close the sender's connection.
        persistence: keep sessions and queued QoS 1 messages on disk (``autosave_interval 1``).
        password_file / acl_file: optional mosquitto files (anonymous access otherwise).
        tls: optional ``{"port", "cafile", "certfile", "keyfile", "require_certificate"}``
            for an extra TLS listener (``url_tls`` then names it); ``"host"`` binds it
            elsewhere than ``host`` (``0.0.0.0``: every interface), and
            ``"identity_as_username": False`` keeps the CONNECT username (checked against
            the password file) instead of the certificate's CN.
        devices: optional ``{"host", "port", "password_file"}`` (plus ``"tls"``: a dict
            as above) for a separate listener of the devices (``url_devices`` names it):
            then every listener has its own password file (``per_listener_settings``), the
            main one ``password_file`` (the coordinator's alone), the devices' theirs.
        clientid_is_username: the broker replaces every client id by the username
            (``use_username_as_clientid``): nobody can take over another user's session.
        binary: the mosquitto executable (``PATH`` lookup by default).

    A listener on a wildcard address (``0.0.0.0``, ``::``) is dialled through loopback.
    :meth:`reload` (SIGHUP) makes mosquitto re-read its password file and ACL.
    """

    kind = "mosquitto"
    supports_v5 = True

    def __init__(self, port: int | None = None, *, host: str = "127.0.0.1",
                 workdir: str | Path | None = None, max_packet_size: int = DEFAULT_MAX_PACKET,
                 persistence: bool = False, password_file: str | None = None,
                 acl_file: str | None = None, tls: dict[str, Any] | None = None,
                 devices: dict[str, Any] | None = None, clientid_is_username: bool = False,
                 binary: str | None = None) -> None:
        self.binary = binary or mosquitto_path()
        if not self.binary:
            raise ConfigError("mosquitto: not found on PATH (apt-get install mosquitto)")
        self.host = host
        self.port = port or free_port(host)
        self._own_dir = workdir is None
        # resolved: the config path on mosquitto's command line is what `fedbit revoke` and a
        # resumed coordinator match a recorded broker by, whatever the current directory
        self.workdir = Path(workdir).resolve() if workdir else Path(tempfile.mkdtemp(prefix="fedbit-mosq-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.max_packet_size = int(max_packet_size)
        self.persistence = persistence
        self.password_file = password_file
        self.acl_file = acl_file
        self.tls = dict(tls) if tls else None
        if self.tls is not None:
            self.tls.setdefault("host", host)
            self.tls.setdefault("port", free_port(dial_host(self.tls["host"])))
        self.devices = dict(devices) if devices else None
        if self.devices is not None:
            self.devices.setdefault("port", free_port(dial_host(self.devices["host"])))
        self.clientid_is_username = clientid_is_username
        self.proc: subprocess.Popen[bytes] | None = None
        self._keeper: threading.Thread | None = None
        self._stopping = threading.Event()
        #: how many times :meth:`keep_alive` started the broker again after it died
        self.restarts = 0
        self.url = f"mqtt://{dial_host(host)}:{self.port}"
        self.url_tls = f"mqtts://{dial_host(self.tls['host'])}:{self.tls['port']}" if self.tls else ""
        self.url_devices = ""
        if self.devices is not None:
            scheme = "mqtts" if self.devices.get("tls") else "mqtt"
            self.url_devices = f"{scheme}://{dial_host(self.devices['host'])}:{self.devices['port']}"
        self.config_path = self.workdir / "mosquitto.conf"
        self.log_path = self.workdir / "mosquitto.log"

    def config_text(self) -> str:
        """The generated mosquitto.conf."""
        per_listener = self.devices is not None
        lines = [
            "# generated by fedbit (coordinator/ops/broker.py)",
            f"per_listener_settings {'true' if per_listener else 'false'}",
            f"max_packet_size {self.max_packet_size}",
            "max_queued_messages 0",
            f"max_queued_bytes {max(4 * self.max_packet_size, 256 * 1024 * 1024)}",
            "max_inflight_messages 0",
            "log_type error", "log_type warning", "log_type notice",
            f"log_dest file {self.log_path}",
            "connection_messages true",
            f"pid_file {self.workdir / 'mosquitto.pid'}",
        ]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            lines.append("user root")  # else it drops to `mosquitto` before reading files
        if self.persistence:
            lines += ["persistence true", f"persistence_location {self.workdir}/",
                      "autosave_interval 1"]
        else:
            lines.append("persistence false")
        if not per_listener:
            lines += self._auth_lines(self.password_file)
        lines.append(f"listener {self.port} {self.host}")
        lines += self._listener_lines(self.password_file if per_listener else None, None)
        if self.tls:
            lines.append(f"listener {self.tls['port']} {self.tls['host']}")
            lines += self._listener_lines(None, self.tls)
        if self.devices is not None:
            lines.append(f"listener {self.devices['port']} {self.devices['host']}")
            lines += self._listener_lines(self.devices.get("password_file"), self.devices.get("tls"))
        return "\n".join(lines) + "\n"

    def _auth_lines(self, password_file: str | None) -> list[str]:
        lines = ["allow_anonymous false", f"password_file {password_file}"] if password_file \
            else ["allow_anonymous true"]
        return lines + ([f"acl_file {self.acl_file}"] if self.acl_file else [])

    def _listener_lines(self, password_file: str | None, tls: dict[str, Any] | None) -> list[str]:
        """The settings under one ``listener`` line: its own password file and ACL (with
        per-listener settings), client id = username, TLS."""
        lines = self._auth_lines(password_file) if self.devices is not None else []
        if self.clientid_is_username:
            lines.append("use_username_as_clientid true")
        if tls:
            lines += [f"cafile {tls['cafile']}", f"certfile {tls['certfile']}", f"keyfile {tls['keyfile']}",
                      "tls_version tlsv1.2"]
            if tls.get("require_certificate"):
                lines.append("require_certificate true")
                if tls.get("identity_as_username", True):
                    lines.append("use_identity_as_username true")
        return lines

    def start(self, timeout: float = 10.0) -> MosquittoBroker:
        """Write the config, spawn mosquitto, wait until the port accepts connections."""
        self.config_path.write_text(self.config_text())
        try:
            self._spawn(timeout)
        except ConfigError:
            self.stop()
            raise
        return self

    def _spawn(self, timeout: float) -> None:
        # (a process group of its own: a terminal's Ctrl-C reaches the coordinator only,
        # which says goodbye through the broker, then stops it by PID)
        self.proc = subprocess.Popen(
            [self.binary, "-c", str(self.config_path)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, process_group=0,
        )
        ports = [(self.host, self.port)] + ([(self.tls["host"], self.tls["port"])] if self.tls else []) \
            + ([(self.devices["host"], self.devices["port"])] if self.devices else [])
        for h, p in ports:
            if not wait_for_port(dial_host(h), p, timeout) or self.proc.poll() is not None:
                err = self._drain_stderr()
                self._end_process()
                raise ConfigError(f"mosquitto: did not start on {h}:{p}: {err}")

    def keep_alive(self, on_restart: Callable[[int], None] | None = None, interval: float = 0.5) -> None:
        """Watch the broker from a daemon thread and start it again (same config, ports and
        persistence) when it dies; ``on_restart(pid)`` is called after each restart. Clients
        reconnect on their own and a persistent broker gives them their sessions back, so a
        round in progress continues. :meth:`stop` ends the watch first."""
        if self._keeper is not None:
            return

        def watch() -> None:
            while not self._stopping.wait(interval):
                proc = self.proc
                if proc is None or proc.poll() is None:
                    continue
                log.warning("mosquitto (pid %d) exited with %s; starting it again", proc.pid, proc.returncode,
                            extra={"event": "broker_restart"})
                if proc.stderr:
                    proc.stderr.close()
                try:
                    self._spawn(10.0)
                except ConfigError as exc:  # (the next tick tries again)
                    log.error("%s", exc, extra={"event": "broker_restart_failed"})
                    continue
                self.restarts += 1
                if on_restart is not None:
                    on_restart(self.pid)

        self._keeper = threading.Thread(target=watch, name="fedbit-broker-keeper", daemon=True)
        self._keeper.start()

    def reload(self) -> None:
        """SIGHUP: mosquitto re-reads its password file and ACL (new connections see
        them; sessions already up keep going)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGHUP)

    def _drain_stderr(self) -> str:
        if self.proc is None or self.proc.stderr is None:
            return ""
        if self.proc.poll() is None:
            return "(still running)"
        text = self.proc.stderr.read().decode(errors="replace").strip()
        try:
            text += " " + self.log_path.read_text()[-2000:]
        except OSError:
            pass
        return text

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def kill(self) -> None:
        """SIGKILL the broker (simulates a crash); the workdir is kept."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        """SIGTERM by PID, SIGKILL after 5 s; remove the temp workdir if we made it."""
        self._stopping.set()
        if self._keeper is not None:
            self._keeper.join(15)
            self._keeper = None
        self._end_process()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _end_process(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=5)
            if self.proc.stderr:
                self.proc.stderr.close()
            self.proc = None

    def __enter__(self) -> MosquittoBroker:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class AmqttBroker:
    """amqtt 0.12.1 in this process, on its own event-loop thread, bound to loopback.

    MQTT 3.1.1 only (a v5 client is refused at connect); offline sessions are kept only
    for clients that connect with a username; PUBACK timeout fixed at 5 s.
    """

    kind = "amqtt"
    supports_v5 = False

    def __init__(self, port: int | None = None, *, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = port or free_port(host)
        self.url = f"mqtt://{host}:{self.port}"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop_evt: asyncio.Event | None = None
        self._error: BaseException | None = None

    def _config(self) -> dict[str, Any]:
        return {
            "listeners": {"default": {"type": "tcp", "bind": f"{self.host}:{self.port}",
                                      "max_connections": 0}},
            "timeout_disconnect_delay": 0,
            "plugins": {
                "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True},
            },
        }

    async def _main(self) -> None:
        from amqtt.broker import Broker as _AmqttBroker  # lazy: optional dependency

        # amqtt logs every probe connection and refused v5 client at ERROR with a
        # traceback; keep its own failures quiet unless the caller turns them on.
        logging.getLogger("amqtt").setLevel(logging.CRITICAL)
        asyncio.get_running_loop().set_exception_handler(
            lambda _loop, ctx: log.debug("amqtt loop: %s", ctx.get("message")))
        self._stop_evt = asyncio.Event()
        broker = _AmqttBroker(self._config())
        try:
            await broker.start()
        except BaseException as exc:  # reported to start()
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        await self._stop_evt.wait()
        try:
            await asyncio.wait_for(broker.shutdown(), timeout=10)
        except Exception:  # noqa: BLE001 - best effort on shutdown
            pass

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            self._error = exc
            self._ready.set()
        finally:
            loop.close()

    def start(self, timeout: float = 15.0) -> AmqttBroker:
        """Start the loop thread and wait until the listener accepts connections."""
        try:
            import amqtt  # noqa: F401
        except ImportError:
            raise ConfigError("amqtt: not installed (pip install 'fedbit[coordinator]')") from None
        self._thread = threading.Thread(target=self._run, name="fedbit-amqtt", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout) or self._error is not None:
            self.stop()
            raise ConfigError(f"amqtt: did not start on {self.host}:{self.port}: {self._error!r}")
        if not wait_for_port(self.host, self.port, timeout):
            self.stop()
            raise ConfigError(f"amqtt: {self.host}:{self.port} does not accept connections")
        return self

    def stop(self) -> None:
        """Shut the broker down and join its thread."""
        loop, evt = self._loop, self._stop_evt
        if loop is not None and evt is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(evt.set)
            except RuntimeError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=15)
            self._thread = None

    def __enter__(self) -> AmqttBroker:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_embedded_broker(port: int | None = None, *, prefer: str = "auto",
                          workdir: str | Path | None = None,
                          max_packet_size: int = DEFAULT_MAX_PACKET) -> MosquittoBroker | AmqttBroker:
    """Start the default broker: mosquitto when on PATH (``prefer="auto"``), else amqtt.

    ``prefer`` is ``"auto"``, ``"mosquitto"`` or ``"amqtt"``. The returned broker is
    started; call ``stop()`` (or use it as a context manager) when done.
    """
    if prefer not in ("auto", "mosquitto", "amqtt"):
        raise ConfigError(f"broker: unknown kind {prefer!r} (auto, mosquitto, amqtt)")
    if prefer == "mosquitto" or (prefer == "auto" and mosquitto_path()):
        return MosquittoBroker(port, workdir=workdir, max_packet_size=max_packet_size,
                               persistence=workdir is not None).start()
    return AmqttBroker(port).start()


#: what ``--security`` may say: ``auto`` = ``none`` on loopback, ``tls`` beyond it
SECURITY_MODES = ("auto", "none", "password", "tls")


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::]:PORT`` for IPv6; ``:PORT`` = every interface) -> (host, port)."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--listen: {value!r} is not HOST:PORT")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


def resolve_security(mode: str, host: str, *, enrolled: int = 0, tls: bool = True) -> str:
    """The security a job's broker on ``host`` gets. The mode follows the job, not the
    address: a job with ``enrolled`` devices always runs passwords and the ACL, with TLS
    unless its devices were enrolled for a plaintext broker (``tls`` False: ``password``);
    ``auto`` without enrolments is ``none`` (anonymous) on loopback and ``tls`` beyond it.
    Anonymous access beyond loopback, or with enrolled devices, is refused."""
    from coordinator.ops.credentials import is_loopback

    if mode not in SECURITY_MODES:
        raise ConfigError(f"--security: {mode!r} is not one of {', '.join(SECURITY_MODES)}")
    if mode == "auto":
        if enrolled:
            return "tls" if tls else "password"
        return "none" if is_loopback(host) else "tls"
    if mode == "none" and enrolled:
        raise ConfigError(f"--security none: the job has {enrolled} enrolled device(s); anonymous "
                          f"access is refused (leave --security out: TLS, passwords and the ACL)")
    if mode == "none" and not is_loopback(host):
        raise ConfigError(f"--listen {host}: anonymous access beyond loopback is refused; "
                          f"use --security tls (the default there) or password")
    return mode


class JobBroker:
    """The embedded broker of ``fedbit serve``: what devices dial (``device_url``), what
    the coordinator dials (``coordinator_url``, with ``credentials`` unless anonymous),
    and the ``security`` it runs with (``none``, ``password``, ``tls``).

    - ``none``: the anonymous loopback broker of demos (mosquitto, else amqtt).
    - ``password``: mosquitto, devices on a plaintext listener with per-device passwords.
    - ``tls``: mosquitto, devices on a TLS listener that wants a client certificate of the
      job CA and the device's password.

    In both, the coordinator connects through a loopback listener of its own whose
    password file holds only the coordinator (a device's password is refused there; its
    traffic, the round's bulk, skips TLS), the ACL holds on every listener, and the broker
    replaces every client id by the username: a device cannot take over another device's
    or the coordinator's session by connecting under its client id.
    """

    def __init__(self, broker: MosquittoBroker | AmqttBroker, device_url: str, coordinator_url: str,
                 security: str, credentials: Credentials | None = None) -> None:
        self.broker = broker
        self.device_url = device_url
        self.coordinator_url = coordinator_url
        self.security = security
        self.credentials = credentials
        self.kind = broker.kind

    def stop(self) -> None:
        self.broker.stop()


def start_job_broker(host: str, port: int | None, *, security: str,
                     job_security: JobSecurity | None = None,
                     hosts: list[str] | None = None, workdir: str | Path | None = None,
                     prefer: str = "auto", max_packet_size: int = DEFAULT_MAX_PACKET) -> JobBroker:
    """Start ``fedbit serve``'s broker on ``host:port`` with ``security`` (resolved: see
    :func:`resolve_security`); ``job_security`` is the job's
    :class:`~coordinator.ops.credentials.JobSecurity` (needed unless ``none``), ``hosts`` the
    names devices dial (the server certificate's SAN)."""
    if security == "none":
        b = start_embedded_broker(port, prefer=prefer, workdir=workdir, max_packet_size=max_packet_size) \
            if host == "127.0.0.1" else _anonymous_on(host, port, prefer, workdir, max_packet_size)
        if isinstance(b, MosquittoBroker):
            b.keep_alive()
        return JobBroker(b, b.url, b.url, "none")
    if prefer == "amqtt" or not mosquitto_path():
        raise ConfigError(f"--security {security}: needs mosquitto (apt-get install mosquitto); "
                          "the amqtt fallback serves anonymous loopback demos only")
    sec = job_security
    if sec is None:
        raise ConfigError(f"--security {security}: no security folder")
    port = port or (8883 if security == "tls" else 1883)
    # the devices' listener knows the devices alone: the coordinator's password is refused there
    devices: dict[str, Any] = {"host": host, "port": port, "password_file": str(sec.devices_passwd_path)}
    if security == "tls":
        from coordinator.ops.credentials import default_hosts

        sec.ensure_server_cert(hosts or default_hosts(host))
        devices["tls"] = {"cafile": str(sec.ca_path), "certfile": str(sec.server_cert),
                          "keyfile": str(sec.server_key), "require_certificate": True,
                          "identity_as_username": False}
    b = MosquittoBroker(None, host="127.0.0.1", workdir=workdir, max_packet_size=max_packet_size,
                        persistence=workdir is not None, password_file=str(sec.coordinator_passwd_path),
                        acl_file=str(sec.acl_path), devices=devices, clientid_is_username=True)
    scheme = "mqtts" if security == "tls" else "mqtt"
    public = f"{scheme}://{(hosts or [dial_host(host)])[0] if host in ('0.0.0.0', '::', '') else host}:{port}"
    creds = sec.coordinator(b.url, tls=False)  # (before start: the password files must hold it)
    sec.write_broker_files()  # (a folder made before devices.passwd existed gets it)
    sec.stop_recorded_broker()  # a broker left behind by a coordinator killed with -9
    b.start()
    sec.record_broker(b.pid or 0, b.config_path)
    b.keep_alive(on_restart=lambda pid: sec.record_broker(pid or 0, b.config_path))
    return JobBroker(b, public, b.url, security, creds)


def _anonymous_on(host: str, port: int | None, prefer: str, workdir: str | Path | None,
                  max_packet_size: int) -> MosquittoBroker | AmqttBroker:
    if prefer == "mosquitto" or (prefer == "auto" and mosquitto_path()):
        return MosquittoBroker(port, host=host, workdir=workdir, max_packet_size=max_packet_size,
                               persistence=workdir is not None).start()
    return AmqttBroker(port, host=host).start()
