"""Enrolment, credentials, MACs, and the generated broker configuration proven against a
real mosquitto: TLS works; plaintext, missing certificates, foreign CAs and bad passwords
are refused; a device cannot publish as another device, nor a round, a model or a status;
a revoked device is refused on its next connect; oversized packets are dropped; the
``broker-config`` files run a mosquitto as written."""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgpack
import pytest

from coordinator.cli.security import _job_folder, check_caps, enroll_hint
from coordinator.ops.admission import AdmissionConfig
from coordinator.ops.broker import JobBroker, free_port, resolve_security, start_job_broker
from coordinator.ops.credentials import (
    COORDINATOR_USER,
    DEFAULT_MAX_SAMPLES,
    EnrolledDevices,
    JobSecurity,
    acl_text,
    check_device_id,
    mosquitto_password_hash,
)
from edge_client import auth
from edge_client.errors import ConfigError, ProtocolError
from edge_client.protocol import Hello, Presence, Status, decode_message, encode_message, topic
from edge_client.transport import MqttTransport, TlsOptions

JOB = "sec"
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.mosquitto


# --------------------------------------------------------------------------- units


def test_password_hash_is_what_mosquitto_passwd_writes(mosquitto_passwd_bin: str, tmp_path: Path) -> None:
    f = tmp_path / "pw"
    subprocess.run([mosquitto_passwd_bin, "-b", "-c", str(f), "dev1", "s3cret pass"], check=True,
                   capture_output=True)
    user, _, line = f.read_text().strip().partition(":")
    _, kind, rounds, salt, _ = line.split("$")
    assert (user, kind, rounds) == ("dev1", "7", "101")
    assert mosquitto_password_hash("s3cret pass", base64.b64decode(salt)) == line
    assert mosquitto_password_hash("s3cret pasS", base64.b64decode(salt)) != line
    assert mosquitto_password_hash("x") != mosquitto_password_hash("x")  # fresh salts


def test_mac_covers_every_byte_and_leaves_the_message_readable() -> None:
    key, other = os.urandom(32), os.urandom(32)
    hello = encode_message(Hello("d1", "pi", 8, "int", "int", 8, 120, "0.1"))
    signed = auth.sign(hello, key)
    assert auth.verify(signed, key) and not auth.verify(signed, other) and not auth.verify(hello, key)
    assert decode_message(signed) == decode_message(hello)          # a keyless reader sees the same
    resigned = auth.sign(signed, key)                                # the entry replaced,
    assert resigned != signed and auth.verify(resigned, key)         # with a fresh nonce
    assert len(resigned) == len(signed) and auth.strip_mac(resigned) == hello
    assert auth.strip_mac(signed) == hello
    for i in range(len(signed)):                                     # any flipped byte is seen
        bad = bytearray(signed)
        bad[i] ^= 0x20
        assert not auth.verify(bytes(bad), key), i
    assert not auth.verify(signed[:-1], key) and not auth.verify(signed + b"\0", key)
    assert not auth.verify(signed, key[:16]) and not auth.verify(b"", key)
    # a map with 15 entries grows into a map16 header
    body = {f"k{i}": i for i in range(15)}
    s15 = auth.sign(msgpack.packb(body), key)
    assert s15[0] == 0xDE and auth.verify(s15, key) and msgpack.unpackb(s15)["k14"] == 14
    with pytest.raises(ProtocolError):
        auth.sign(b"\x93\x01\x02\x03", key)                          # not a map


def test_credentials_file_roundtrip_mode_and_errors(tmp_path: Path) -> None:
    c = auth.Credentials("j", "dev1", "mqtts://h:8883", "dev1", "pw\"'", auth.new_mac_key(), 300,
                         "-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n", "", "")
    p = auth.write_private(tmp_path / "d.toml", c.to_toml())
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert auth.load_credentials(p) == c
    os.chmod(p, 0o644)
    with pytest.raises(ConfigError, match="readable by others.*chmod 600"):
        auth.load_credentials(p)
    os.chmod(p, 0o600)
    for line, culprit in (("device_id = \"a/b\"", "device_id"), ("mac_key = \"xyz\"", "mac_key"),
                          ("colour = 1", "unknown keys"), ("broker = \"http://x\"", "broker")):
        bad = tmp_path / "bad.toml"
        text = "\n".join(ln for ln in c.to_toml().splitlines() if not ln.startswith(line.split()[0] + " "))
        auth.write_private(bad, text + "\n" + line + "\n")
        with pytest.raises(ConfigError, match=culprit):
            auth.load_credentials(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        auth.load_credentials(tmp_path / "missing.toml")


def test_device_ids_and_the_acl() -> None:
    for bad in ("", "a/b", "+", "#", COORDINATOR_USER, f"{COORDINATOR_USER}-x", "x" * 129):
        with pytest.raises(ConfigError):
            check_device_id(bad)
    text = acl_text("farm")
    assert "pattern write fedbit/farm/update/%u" in text and "pattern read fedbit/farm/round" in text
    # secure aggregation: a device sends under its own id and reads only what is addressed to it
    assert "pattern write fedbit/farm/secagg/%u" in text and "pattern read fedbit/farm/secagg-in/%u" in text
    assert f"user {COORDINATOR_USER}\ntopic readwrite fedbit/farm/#" in text
    assert "pattern write fedbit/farm/round" not in text and "pattern write fedbit/farm/model" not in text


def test_enrolment_registry_and_its_coordinator_view(openssl_bin: str, tmp_path: Path) -> None:
    sec = JobSecurity(tmp_path / "s", JOB)
    c1, p1 = sec.enroll("dev1", broker="mqtt://127.0.0.1:1883", max_samples=500)
    assert not c1.cert and stat.S_IMODE(p1.stat().st_mode) == 0o600      # plain mqtt: no certificate
    view = EnrolledDevices(sec.registry_path, JOB, recheck_s=0.0)
    assert view.key("dev1") == c1.mac_key_bytes and view.max_samples("dev1") == 500
    assert view.key("dev2") is None
    c2, _ = sec.enroll("dev2")
    assert view.key("dev2") == c2.mac_key_bytes                         # re-read when the file changes
    passwd = sec.passwd_path.read_text()
    assert f"{COORDINATOR_USER}:$7$" in passwd and "dev1:$7$" in passwd and c1.password not in passwd
    assert sec.devices_passwd_path.read_text().splitlines() == passwd.splitlines()[1:]   # no coordinator
    assert sec.revoke("dev1") and not sec.revoke("dev1")
    assert view.key("dev1") is None and "dev1:" not in sec.passwd_path.read_text()
    assert not (sec.dir / "devices" / "dev1.toml").exists()
    with pytest.raises(ConfigError, match="registry of job"):
        EnrolledDevices(sec.registry_path, "otherjob")


def test_the_secure_mode_follows_the_job_not_the_address() -> None:
    assert resolve_security("auto", "127.0.0.1") == "none"                 # the demo: no enrolments
    assert resolve_security("auto", "0.0.0.0") == "tls"
    assert resolve_security("auto", "127.0.0.1", enrolled=2) == "tls"      # loopback, enrolled: TLS
    assert resolve_security("auto", "localhost", enrolled=2, tls=False) == "password"  # mqtt:// enrolments
    with pytest.raises(ConfigError, match="2 enrolled device.*anonymous access is refused"):
        resolve_security("none", "127.0.0.1", enrolled=2)
    with pytest.raises(ConfigError, match="beyond loopback"):
        resolve_security("none", "0.0.0.0")
    assert resolve_security("auto", "127.attacker.example") == "tls"     # a name, not a loopback literal
    assert resolve_security("auto", "::1") == resolve_security("auto", "127.0.0.2") == "none"


def test_enrolment_caps_samples_by_default_and_serve_refuses_uncapped(openssl_bin: str, tmp_path: Path) -> None:
    sec = JobSecurity(tmp_path / "s", JOB)
    c1, _ = sec.enroll("dev1", broker="mqtt://127.0.0.1:1883")
    assert c1.max_samples == DEFAULT_MAX_SAMPLES == EnrolledDevices(sec.registry_path, JOB).max_samples("dev1")
    sec.save_job_info("mqtt://127.0.0.1:1883", False, default_max_samples=500)
    assert sec.enroll("dev2")[0].max_samples == 500 and sec.enroll("dev3", max_samples=7)[0].max_samples == 7
    check_caps(sec, AdmissionConfig())                                    # every device capped
    sec.enroll("dev4", max_samples=0)                                     # explicitly uncapped
    with pytest.raises(ConfigError, match="dev4: enrolled without a sample cap.*--allow-uncapped"):
        check_caps(sec, AdmissionConfig())
    check_caps(sec, AdmissionConfig(allow_uncapped=True))
    check_caps(sec, AdmissionConfig(max_samples=100))                     # a job-wide cap bounds it
    with pytest.raises(ConfigError, match="default_max_samples"):
        sec.save_job_info("mqtt://127.0.0.1:1883", False, default_max_samples=-1)


def test_csv_enrolment_is_all_or_nothing(tmp_path: Path, capsys) -> None:
    from coordinator.cli import main

    sec = JobSecurity(tmp_path / "s", JOB)
    sec.save_job_info("mqtt://127.0.0.1:1883", False)
    for rows, why in ((["dev1,5", "dev2", "bad id!,3"], "not a valid id"),
                      (["dev1", f"{COORDINATOR_USER},4"], "reserved for the coordinator"),
                      (["dev1", "dev2,-4"], "max_samples: must be an integer")):
        (tmp_path / "d.csv").write_text("\n".join(rows) + "\n")
        assert main(["enroll", "--devices", str(tmp_path / "d.csv"), "--security-dir", str(sec.dir)]) == 1
        assert why in capsys.readouterr().err
        assert sec.registry() == {} and not (sec.dir / "devices").exists()   # nobody enrolled
    (tmp_path / "d.csv").write_text("device_id,max_samples\ndev1,5\ndev2\n")
    assert main(["enroll", "--devices", str(tmp_path / "d.csv"), "--security-dir", str(sec.dir)]) == 0
    assert {d: e.max_samples for d, e in sec.registry().items()} == {"dev1": 5, "dev2": DEFAULT_MAX_SAMPLES}
    assert sorted(p.name for p in (sec.dir / "devices").iterdir()) == ["dev1.toml", "dev2.toml"]


def test_hints_and_enroll_find_the_jobs_folder(tmp_path: Path) -> None:
    from argparse import Namespace

    sec = JobSecurity(tmp_path / "elsewhere", "farm")
    sec.save_job_info("mqtt://127.0.0.1:1883", False)
    assert enroll_hint(sec, tmp_path / "run") == f"fedbit enroll ID --security-dir {sec.dir} --job farm"
    assert enroll_hint(JobSecurity(tmp_path / "run" / "security", "default"), tmp_path / "run") == \
        f"fedbit enroll ID --run {tmp_path / 'run'}"
    assert _job_folder(Namespace(security_dir=str(sec.dir), run=None, job=None)) == (sec.dir, "farm")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "security-dir").write_text(f"{sec.dir}\n")     # what serve --security-dir records
    assert _job_folder(Namespace(security_dir=None, run=str(tmp_path / "run"), job=None)) == (sec.dir, "farm")
    assert _job_folder(Namespace(security_dir=None, run=str(tmp_path / "new"), job=None)) == \
        (tmp_path / "new" / "security", "default")


# --------------------------------------------------------------------------- a real mosquitto


def refused(url: str, client_id: str, *, username: str | None = None, password: str | None = None,
            tls: TlsOptions | None = None, timeout: float = 5.0) -> str:
    """Connect once with paho; '' when the broker accepted the session, else why not
    (returns as soon as the broker answers or hangs up)."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    from edge_client.transport import parse_broker_url

    a = parse_broker_url(url)
    res: dict[str, str] = {}
    done = threading.Event()
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
    if username:
        c.username_pw_set(username, password)
    if tls is not None:
        c.tls_set(ca_certs=tls.ca_file, certfile=tls.cert_file, keyfile=tls.key_file)

    def on_connect(_c, _u, _f, rc, _p=None):
        res.setdefault("why", "" if not rc.is_failure else f"refused: {rc}")
        done.set()

    def on_disconnect(_c, _u, _f, rc, _p=None):
        res.setdefault("why", f"disconnected: {rc}")
        done.set()

    c.on_connect, c.on_disconnect = on_connect, on_disconnect
    try:
        c.connect(a.host, a.port, keepalive=5)
    except Exception as exc:  # noqa: BLE001 - a TLS handshake refused
        return f"{type(exc).__name__}: {exc}"
    end = time.monotonic() + timeout
    while not done.is_set() and time.monotonic() < end:
        rc = c.loop(0.05)  # (driven here: no network thread to wind down afterwards)
        if rc != 0:
            res.setdefault("why", f"connection lost: {rc}")
            break
    c.disconnect()
    return res.get("why", "no answer")


class Job:
    """A job secured as `fedbit serve --listen` does it, with its broker (its folders under
    ``tmp``, which may be a relative path, as ``--out runs/x`` is)."""

    def __init__(self, tmp: Path, max_packet: int = 200_000) -> None:
        self.port = free_port()
        self.sec = JobSecurity(tmp / "security", JOB)
        self.creds = {d: self.sec.enroll(d, broker=f"mqtts://127.0.0.1:{self.port}")[0] for d in ("dev1", "dev2")}
        self.broker: JobBroker = start_job_broker("127.0.0.1", self.port, security="tls", job_security=self.sec,
                                                  hosts=["127.0.0.1", "localhost"], workdir=tmp / "broker",
                                                  max_packet_size=max_packet)
        self.tmp = tmp
        self.clients: list[MqttTransport] = []

    def tls(self, dev: str) -> TlsOptions:
        return TlsOptions(*auth.tls_files(self.creds[dev], self.tmp / f"tls-{dev}"))

    def device(self, dev: str, **kw) -> MqttTransport:
        c = self.creds[dev]
        t = MqttTransport(c.broker, dev, username=c.username, password=c.password, tls=self.tls(dev),
                          **({"protocol": "5"} | kw))
        t.connect(10)
        self.clients.append(t)
        return t

    def coordinator(self) -> MqttTransport:
        c = self.broker.credentials
        t = MqttTransport(self.broker.coordinator_url, "fedbit-coordinator-sec", username=c.username,
                          password=c.password, subscriptions=[f"fedbit/{JOB}/#"])
        t.connect(10)
        self.clients.append(t)
        return t

    def close(self) -> None:
        # (in parallel: a session waiting to reconnect takes ~1 s to stop)
        threads = [threading.Thread(target=t.close) for t in self.clients]
        for th in threads:
            th.start()
        for th in threads:
            th.join(10)
        self.broker.stop()


@pytest.fixture
def job(mosquitto_bin: str, openssl_bin: str, tmp_path: Path):
    j = Job(tmp_path)
    try:
        yield j
    finally:
        j.close()


def drain(t: MqttTransport, until: bytes, timeout: float = 10.0) -> list[tuple[str, bytes]]:
    """Messages ``t`` receives up to and including one whose payload is ``until``."""
    got: list[tuple[str, bytes]] = []
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        m = t.recv(0.2)
        if m is not None:
            got.append((m.topic, m.payload))
            if m.payload == until:
                return got
    raise AssertionError(f"{until!r} never arrived; got {got}")


def test_devices_publish_only_under_their_own_id(job: Job) -> None:
    coord = job.coordinator()
    assert job.broker.coordinator_url.startswith("mqtt://127.0.0.1:") and coord.version == "5"
    dev2 = job.device("dev2", subscriptions=[topic(JOB, "round"), topic(JOB, "model", "float32"),
                                             topic(JOB, "status")])
    for name, payload in [(topic(JOB, "update", "dev2"), b"spoofed update"),
                          (topic(JOB, "hello", "dev2"), b"spoofed hello"),
                          (topic(JOB, "presence", "dev2"), b"spoofed presence"),
                          (topic(JOB, "round"), b"fake round"),
                          (topic(JOB, "model", "float32"), b"fake model"),
                          (topic(JOB, "status"), b"fake status")]:
        # mosquitto 2.0 drops the message and the publisher's connection (v5 and 3.1.1)
        dev1 = job.device("dev1", backoff=(5, 5))
        assert dev1.version == "5" and dev1.address.tls
        dev1.publish(name, payload, qos=0)
        end = time.monotonic() + 5
        while dev1.connected and time.monotonic() < end:
            time.sleep(0.02)
        assert not dev1.connected, name
    dev1 = job.device("dev1", subscriptions=[topic(JOB, "round"), f"fedbit/{JOB}/update/+"])
    assert dev1.publish(topic(JOB, "update", "dev1"), b"dev1's own", timeout=5)
    got = drain(coord, b"dev1's own")
    assert got == [(topic(JOB, "update", "dev1"), b"dev1's own")]     # in order: nothing else came
    assert coord.publish(topic(JOB, "round"), b"real round", retain=True, timeout=5)
    assert [p for _, p in drain(dev2, b"real round")] == [b"real round"]
    dev2.publish(topic(JOB, "update", "dev2"), b"dev2's update", timeout=5)
    drain(coord, b"dev2's update")
    assert all(p != b"dev2's update" for _, p in drain(dev1, b"real round"))  # nor read another's


def test_plaintext_bad_credentials_and_foreign_certificates_are_refused(job: Job, tmp_path: Path) -> None:
    c = job.creds["dev1"]
    url, tls = c.broker, job.tls("dev1")
    assert refused(url, "dev1", username="dev1", password=c.password, tls=tls) == ""
    assert refused(url.replace("mqtts", "mqtt"), "dev1", username="dev1", password=c.password)
    assert refused(url, "dev1", username="dev1", password="wrong", tls=tls)
    assert refused(url, "dev1", username="nobody", password=c.password, tls=tls)
    assert refused(url, "dev1", username="dev1", password=job.creds["dev2"].password, tls=tls)
    assert refused(url, "dev1", username="dev1", password=c.password, tls=TlsOptions(tls.ca_file))
    other = JobSecurity(tmp_path / "other", "other")                   # a certificate of another CA
    oc, _ = other.enroll("dev1", broker=url)
    assert refused(url, "dev1", username="dev1", password=c.password,
                   tls=TlsOptions(tls.ca_file, *auth.tls_files(oc, tmp_path / "otls")[1:]))
    # the coordinator's own listener: no anonymous client, no device password (the devices'
    # rule, certificate and password, holds everywhere a device can connect)
    cc = job.broker.credentials
    assert refused(job.broker.coordinator_url, "anon")
    assert refused(job.broker.coordinator_url, "dev1", username="dev1", password=c.password)
    assert refused(job.broker.coordinator_url, "x", username=COORDINATOR_USER, password=c.password)
    assert refused(job.broker.coordinator_url, "x", username=COORDINATOR_USER, password=cc.password) == ""
    # and the coordinator's password on the devices' listener (with a device's certificate): refused
    assert refused(url, COORDINATOR_USER, username=COORDINATOR_USER, password=cc.password, tls=tls)


def test_a_device_cannot_take_over_another_client_id(job: Job) -> None:
    """dev2, with its own valid credentials, connects under dev1's client id and under the
    coordinator's: the broker makes its client id its username, so neither victim is
    pushed off, no retained 'coordinator offline' status appears, and dev2 stays bound to
    its own topics."""
    coord = job.coordinator()
    dev1 = job.device("dev1", subscriptions=[topic(JOB, "status")])
    c2 = job.creds["dev2"]
    for victim in ("dev1", "fedbit-coordinator-sec", COORDINATOR_USER):
        t = MqttTransport(c2.broker, victim, username="dev2", password=c2.password, tls=job.tls("dev2"),
                          protocol="5")
        t.connect(10)
        job.clients.append(t)
        t.publish(topic(JOB, "update", "dev2"), f"dev2 as {victim}".encode(), timeout=5)
        drain(coord, f"dev2 as {victim}".encode())            # it is dev2 (the ACL let it publish as dev2)
        t.publish(topic(JOB, "update", "dev1"), b"as dev1", qos=0)  # and only as dev2: dropped
    dev2 = job.device("dev2")
    dev2.publish(topic(JOB, "update", "dev2"), b"marker", timeout=5)
    assert all(p != b"as dev1" for _, p in drain(coord, b"marker"))
    assert (coord.connects, dev1.connects) == (1, 1) and coord.connected and dev1.connected
    assert coord.publish(topic(JOB, "status"), b"still here", retain=True, timeout=5)
    got = drain(dev1, b"still here")
    assert all(p != b"as dev1" for _, p in got) and len([p for _, p in got if p]) == 1  # no will fired


def test_revoked_device_is_refused_on_its_next_connect(job: Job) -> None:
    dev2 = job.device("dev2")
    assert dev2.connected
    env = os.environ | {"PATH": os.environ.get("PATH", "") + ":/usr/sbin"}
    proc = subprocess.run([str(BIN / "fedbit"), "revoke", "dev2", "--security-dir", str(job.sec.dir),
                           "--job", JOB], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0 and "reloaded it" in proc.stdout, proc.stdout + proc.stderr
    c2 = job.creds["dev2"]
    end = time.monotonic() + 5
    while (why := refused(c2.broker, "dev2", username="dev2", password=c2.password, tls=job.tls("dev2"))) == "" \
            and time.monotonic() < end:
        time.sleep(0.1)  # the SIGHUP is handled by mosquitto's main loop
    assert why, "the revoked device still connects"
    c1 = job.creds["dev1"]
    assert refused(c1.broker, "dev1", username="dev1", password=c1.password, tls=job.tls("dev1")) == ""
    assert EnrolledDevices(job.sec.registry_path, JOB).key("dev2") is None
    # the revoked device itself: told why, and it gives up (exit 3) after --connect-timeout
    creds = auth.write_private(job.tmp / "dev2.toml", c2.to_toml())
    r = subprocess.run([str(BIN / "fedbit-edge"), "run", "--credentials", str(creds), "--profile", "desktop",
                        "--data", "digits:1/9", "--workdir", str(job.tmp / "dev2"), "--connect-timeout", "3"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 3, r.stderr[-2000:]
    assert "not authorised: this device may be revoked" in r.stderr and "gives up" in r.stderr
    assert c2.password not in r.stderr + r.stdout


def test_revocation_reaches_a_broker_started_from_a_relative_folder(mosquitto_bin: str, openssl_bin: str,
                                                                     tmp_path: Path, monkeypatch, capsys) -> None:
    """`--out runs/x`: the recorded config path and mosquitto's command line are matched
    resolved, so `fedbit revoke` (run from elsewhere) reloads the broker, the revoked device
    is refused within 5 s, and a resumed coordinator finds the broker a kill -9 left."""
    monkeypatch.chdir(tmp_path)
    j = Job(Path("runs") / "x")
    try:
        c2 = j.creds["dev2"]
        assert refused(c2.broker, "dev2", username="dev2", password=c2.password, tls=j.tls("dev2")) == ""
        assert j.sec._recorded_broker() == j.broker.broker.pid       # what --resume stops when orphaned
        from coordinator.cli import main

        monkeypatch.chdir(tmp_path / "runs")                           # `fedbit revoke` run from elsewhere
        assert main(["revoke", "dev2", "--run", "x", "--job", JOB]) == 0
        assert "the job's running broker reloaded it" in capsys.readouterr().out
        t0 = time.monotonic()
        while refused(c2.broker, "dev2", username="dev2", password=c2.password, tls=j.tls("dev2")) == "":
            assert time.monotonic() - t0 < 5, "the revoked device still connects"
            time.sleep(0.1)
    finally:
        j.close()


def test_the_broker_drops_packets_over_its_limit(job: Job) -> None:
    coord = job.coordinator()
    c = job.creds["dev1"]
    dev1 = MqttTransport(c.broker, "dev1", username="dev1", password=c.password, tls=job.tls("dev1"),
                         max_payload=10_000_000, backoff=(1, 2))
    dev1.connect(10)
    job.clients.append(dev1)
    dev1.publish(topic(JOB, "update", "dev1"), b"x" * 300_000, qos=0)   # > max_packet_size 200,000
    end = time.monotonic() + 10
    while dev1.connects < 2 and time.monotonic() < end:
        time.sleep(0.05)
    assert dev1.connects >= 2                                            # the broker hung up on it
    dev1.publish(topic(JOB, "update", "dev1"), b"small", timeout=5)
    assert [p for _, p in drain(coord, b"small")] == [b"small"]          # the big one never came


def test_broker_config_runs_a_mosquitto_as_written(mosquitto_bin: str, openssl_bin: str, tmp_path: Path) -> None:
    csv = tmp_path / "devices.csv"
    csv.write_text("device_id,max_samples\npi-1,400\npi-2\n")
    # (outside pytest's 0700 tmp folder: mosquitto started as root reads its files as
    # user mosquitto, as a system service would)
    base = Path(tempfile.mkdtemp(prefix="fedbit-broker-config-"))
    os.chmod(base, 0o711)
    port, out = free_port(), base / "cfg"
    proc = subprocess.run([str(BIN / "fedbit"), "broker-config", "--devices", str(csv), "--out", str(out),
                           "--job", JOB, "--listen", f"127.0.0.1:{port}", "--hostname", "127.0.0.1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for d in ("pi-1", "pi-2"):
        c = auth.load_credentials(out / "devices" / f"{d}.toml")        # (mode 0600, or it refuses)
        assert c.password not in proc.stdout and c.broker == f"mqtts://127.0.0.1:{port}"
    assert auth.load_credentials(out / "devices" / "pi-1.toml").max_samples == 400
    conf = (out / "mosquitto.conf").read_text()
    assert "allow_anonymous false" in conf and "require_certificate true" in conf
    assert f"listener {port} 127.0.0.1" in conf and "max_packet_size" in conf
    p = subprocess.Popen([mosquitto_bin, "-c", str(out / "mosquitto.conf")], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    try:
        from coordinator.ops.broker import wait_for_port

        assert wait_for_port("127.0.0.1", port, 10), p.stderr.read().decode() if p.poll() is not None else ""
        cc = auth.load_credentials(out / "coordinator.toml")
        coord = MqttTransport(cc.broker, "fedbit-coordinator-x", username=cc.username, password=cc.password,
                              tls=TlsOptions(*auth.tls_files(cc, tmp_path / "ctls")),
                              subscriptions=[f"fedbit/{JOB}/update/+"])
        coord.connect(10)
        c1 = auth.load_credentials(out / "devices" / "pi-1.toml")
        dev = MqttTransport(c1.broker, "pi-1", username=c1.username, password=c1.password,
                            tls=TlsOptions(*auth.tls_files(c1, tmp_path / "dtls")))
        dev.connect(10)
        try:
            dev.publish(topic(JOB, "update", "pi-2"), b"spoof", timeout=5)
            dev.publish(topic(JOB, "update", "pi-1"), b"own", timeout=5)
            assert [m for _, m in drain(coord, b"own")] == [b"own"]
        finally:
            dev.close()
            coord.close()
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=10)
        shutil.rmtree(base, ignore_errors=True)


def test_secrets_never_reach_the_command_line(tmp_path: Path) -> None:
    for cmd in (["fedbit", "serve", "--out", str(tmp_path), "--password", "x"],
                ["fedbit-edge", "run", "--broker", "mqtt://h:1", "--id", "d", "--profile", "desktop",
                 "--data", "digits:1/9", "--password", "x"]):
        r = subprocess.run([str(BIN / cmd[0]), *cmd[1:]], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "unrecognized arguments: --password" in r.stderr
    r = subprocess.run([str(BIN / "fedbit-edge"), "run", "--broker", "mqtt://u:secret@h:1", "--id", "d",
                        "--profile", "desktop", "--data", "digits:1/9"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "visible to every user" in r.stderr


def test_hello_status_bytes_are_what_they_were() -> None:
    """Signing adds exactly one map entry (the wire format of unsigned messages is unchanged)."""
    key = os.urandom(32)
    for m in (Presence("d", True), Status("waiting", 0, "x")):
        plain = encode_message(m)
        signed = auth.sign(plain, key)
        assert len(signed) == len(plain) + len(auth.MAC_TAG) + auth.MAC_BYTES
        assert hashlib.sha256(auth.strip_mac(signed)).digest() == hashlib.sha256(plain).digest()


@pytest.mark.slow
def test_secure_serve_end_to_end(mosquitto_bin: str, openssl_bin: str, tmp_path: Path) -> None:
    """The secure setup as a user runs it: `fedbit enroll --devices`, `fedbit serve --listen`
    on loopback (TLS, passwords, ACL, MACs: the job has enrolled devices), two `fedbit-edge
    run --credentials`; no secret is printed; pi-1 has the default sample cap."""
    port, run = free_port(), tmp_path / "run"
    csv = tmp_path / "devices.csv"
    csv.write_text("pi-1\npi-2,500\n")
    env = os.environ | {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}
    r = subprocess.run([str(BIN / "fedbit"), "enroll", "--devices", str(csv), "--job", JOB, "--run", str(run),
                        "--broker-url", f"mqtts://127.0.0.1:{port}"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    files = {d: run / "security" / "devices" / f"{d}.toml" for d in ("pi-1", "pi-2")}
    secrets = [auth.load_credentials(f).password for f in files.values()]
    logs = {n: open(tmp_path / f"{n}.log", "wb") for n in ("serve", "pi-1", "pi-2")}  # noqa: SIM115
    # (no --security: a job with enrolled devices runs TLS, passwords and the ACL on loopback too)
    procs = [subprocess.Popen([str(BIN / "fedbit"), "serve", "--listen", f"127.0.0.1:{port}",
                               "--hostname", "127.0.0.1", "--job", JOB, "--out", str(run), "--model", "mlp",
                               "--rounds", "2", "--min-devices", "2", "--steps", "4", "--quiet", "--log-json"],
                              stdout=logs["serve"], stderr=subprocess.STDOUT, env=env)]
    for i, d in enumerate(files):
        procs.append(subprocess.Popen([str(BIN / "fedbit-edge"), "run", "--credentials", str(files[d]),
                                       "--profile", "raspberry-pi-4", "--data", f"digits:{i + 1}/2",
                                       "--workdir", str(tmp_path / d), "--max-seconds", "120"],
                                      stdout=logs[d], stderr=subprocess.STDOUT, env=env))
    try:
        assert procs[0].wait(timeout=150) == 0, (tmp_path / "serve.log").read_text()[-3000:]
        for p in procs[1:]:
            assert p.wait(timeout=30) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    from coordinator.state import RunState

    lines = RunState(run).read_metrics()
    assert [m["accepted_ids"] for m in lines] == [["pi-1", "pi-2"]] * 2
    assert not any(k.startswith("rejected") for m in lines for k in m["counts"])
    text = "".join((tmp_path / f"{n}.log").read_text() for n in logs)
    assert "TLS with client certificates" in text and f"mqtts://127.0.0.1:{port}" in text
    assert f"at most {DEFAULT_MAX_SAMPLES:,} samples" in r.stdout and "at most 500 samples" in r.stdout
    assert not any(s in text for s in secrets)
