"""The broker helpers and the MQTT transport against real brokers on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coordinator.ops.broker import MosquittoBroker, free_port, start_embedded_broker
from edge_client.errors import ConfigError, ProtocolError
from edge_client.transport import LocalHub, MqttTransport, parse_broker_url, topic_matches

BIN = Path(sys.executable).parent


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); read its state
    try:
        return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0
    except OSError:
        return False


def test_mosquitto_config_applies_the_measured_fixes(tmp_path: Path) -> None:
    b = MosquittoBroker(1883, workdir=tmp_path, binary="/bin/true", max_packet_size=12345,
                        persistence=True)
    text = b.config_text()
    assert "max_queued_messages 0" in text          # the default 1000 drops QoS 1 silently
    assert "max_packet_size 12345" in text
    assert "message_size_limit" not in text         # deprecated: drops silently under 3.1.1
    assert "listener 1883 127.0.0.1" in text
    assert "autosave_interval 1" in text
    assert ("user root" in text) == (os.geteuid() == 0)


def test_parse_broker_url() -> None:
    a = parse_broker_url("mqtts://dev%40x:p%3Ass@broker.lan")
    assert (a.host, a.port, a.tls, a.username, a.password) == ("broker.lan", 8883, True, "dev@x", "p:ss")
    b = parse_broker_url("mqtt://127.0.0.1:1999")
    assert (b.port, b.tls, b.username) == (1999, False, None)
    for bad in ("http://x", "mqtt://", "mqtt://h:99999"):
        with pytest.raises(ConfigError):
            parse_broker_url(bad)


def test_topic_matching() -> None:
    assert topic_matches("fedbit/j/update/+", "fedbit/j/update/d1")
    assert not topic_matches("fedbit/j/update/+", "fedbit/j/update/d1/x")
    assert topic_matches("fedbit/#", "fedbit/j/round")
    assert not topic_matches("fedbit/j/round", "fedbit/j/status")


def test_mosquitto_stops_by_pid(mosquitto_bin: str) -> None:
    b = MosquittoBroker(binary=mosquitto_bin).start()
    pid = b.pid
    assert pid is not None and _pid_alive(pid)
    b.stop()
    assert not _pid_alive(pid)
    assert not b.workdir.exists()


def test_protocol_negotiation(mosquitto: MosquittoBroker, amqtt_broker) -> None:
    for url, want in ((mosquitto.url, "5"), (amqtt_broker.url, "3.1.1")):
        t = MqttTransport(url, "probe-test")
        t.connect(timeout=10)
        try:
            assert t.version == want
        finally:
            t.close()


def test_pubsub_retained_will_and_reconnect(any_broker) -> None:
    sub = MqttTransport(any_broker.url, "sub", subscriptions=["t/#"])
    pub = MqttTransport(any_broker.url, "pub", will=("t/will", b"gone"),
                        birth=[("t/born", b"hi", True)], backoff=(1, 2))
    sub.connect(10)
    pub.connect(10)
    try:
        got = {}
        end = time.monotonic() + 5
        while "t/born" not in got and time.monotonic() < end:
            m = sub.recv(0.5)
            if m:
                got[m.topic] = m.payload
        assert got.get("t/born") == b"hi"
        payload = os.urandom(300_000)
        assert pub.publish("t/big", payload, retain=True, timeout=10)
        m = sub.recv(5)
        assert m is not None and m.topic == "t/big" and m.payload == payload and m.qos == 1
        pub.drop_connection()                      # no DISCONNECT: the broker sends the will
        m = sub.recv(10)
        assert m is not None and (m.topic, m.payload) == ("t/will", b"gone")
        end = time.monotonic() + 10
        while pub.connects < 2 and time.monotonic() < end:
            time.sleep(0.1)
        assert pub.connects >= 2 and pub.connected  # reconnected with backoff
        # a late subscriber gets the retained message
        late = MqttTransport(any_broker.url, "late", subscriptions=["t/big"])
        late.connect(10)
        try:
            # (amqtt 0.12.1 has been seen to also hand a new session an unrelated retained
            # message; the device loop checks every topic, so only look for ours here)
            end = time.monotonic() + 5
            m = late.recv(1)
            while m is not None and m.topic != "t/big" and time.monotonic() < end:
                m = late.recv(1)
            assert m is not None and m.retain and m.payload == payload
        finally:
            late.close()
    finally:
        pub.close()
        sub.close()


def test_transport_refuses_oversized_payloads_locally() -> None:
    hub = LocalHub()
    t = hub.client("x", max_payload=10)
    t.connect()
    with pytest.raises(ProtocolError, match="payload"):
        t.publish("a/b", b"x" * 11)


def test_unacked_message_is_redelivered_after_a_crash(mosquitto: MosquittoBroker) -> None:
    """Manual ack + persistent session (v5): a message received but not acked before a
    crash comes back to the next session with the same client id."""
    kw = {"subscriptions": ["q/#"], "manual_ack": True, "persistent_session": True}
    c1 = MqttTransport(mosquitto.url, "coord-x", **kw)
    c1.connect(10)
    pub = MqttTransport(mosquitto.url, "pub-x")
    pub.connect(10)
    try:
        assert pub.publish("q/1", b"update-1", timeout=5)
        m = c1.recv(5)
        assert m is not None and m.payload == b"update-1"
        c1.kill()                                  # crash before persisting/acking
        assert pub.publish("q/2", b"update-2", timeout=5)  # arrives while it is down
        c2 = MqttTransport(mosquitto.url, "coord-x", **kw)
        c2.connect(10)
        try:
            seen = []
            end = time.monotonic() + 10
            while len(seen) < 2 and time.monotonic() < end:
                m = c2.recv(0.5)
                if m is not None:
                    seen.append(m.payload)
                    c2.ack(m)
            assert sorted(seen) == [b"update-1", b"update-2"]
        finally:
            c2.close()
    finally:
        pub.close()


def test_local_hub_session_redelivers_what_was_not_acked() -> None:
    """The in-process hub keeps a manual-ack client's session as a persistent MQTT session
    does: read-but-unacked and offline-queued messages come back on the next connect (same
    transport or a new one with the same id), acked ones do not, retained ones once."""
    hub = LocalHub()
    hub.route("q/status", b"retained", True)
    c1 = hub.client("coord", subscriptions=["q/#"], manual_ack=True)
    c1.connect()
    pub = hub.client("pub")
    pub.connect()
    assert (m := c1.recv(1)) is not None and m.retain and m.payload == b"retained"
    c1.ack(m)
    for p in (b"u1", b"u2", b"u3"):
        pub.publish("q/u", p)
    got = [c1.recv(1) for _ in range(2)]           # u1, u2 read; u3 still queued
    c1.ack(got[0])                                  # u1 persisted and acked; u2 not
    c1.close()                                      # gone (a crash leaves it the same)
    pub.publish("q/u", b"u4")                       # arrives while it is away
    assert hub.unacked("coord") == 3
    for fresh in (False, True):
        c = hub.client("coord", subscriptions=["q/#"], manual_ack=True) if fresh else c1
        c.connect()
        msgs = []
        while (m := c.recv(0.2)) is not None:
            msgs.append(m)
        assert [m.payload for m in msgs] == [b"u2", b"u3", b"u4", b"retained"]
        if fresh:                                   # this time they are persisted and acked
            for m in msgs:
                c.ack(m)
        c.close()
    c.connect()
    seen = []
    while (m := c.recv(0.2)) is not None:
        seen.append(m.payload)
        c.ack(m)
    assert seen == [b"retained"] and hub.unacked("coord") == 0


def test_embedded_prefers_mosquitto_and_falls_back(mosquitto_bin: str) -> None:
    b = start_embedded_broker()
    try:
        assert b.kind == "mosquitto"
    finally:
        b.stop()
    a = start_embedded_broker(prefer="amqtt")
    try:
        assert a.kind == "amqtt" and a.url.startswith("mqtt://127.0.0.1:")
    finally:
        a.stop()
    with pytest.raises(ConfigError):
        start_embedded_broker(prefer="rabbit")


def test_fedbit_broker_cli_runs_until_sigterm(mosquitto_bin: str) -> None:
    port = free_port()
    p = subprocess.Popen([str(BIN / "fedbit"), "broker", "--port", str(port)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert f"mqtt://127.0.0.1:{port}" in line and "mosquitto" in line
        t = MqttTransport(f"mqtt://127.0.0.1:{port}", "cli-test")
        t.connect(10)
        t.close()
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=15) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def certs(tmp_path: Path, openssl_bin: str) -> Path:
    """A throw-away CA, a server certificate for 127.0.0.1 and a client certificate."""
    d = tmp_path / "pki"
    d.mkdir()
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
             "-subj", "/CN=fedbit-test-ca", cwd=d)
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, cn, ext in (("server", "localhost", ["-extfile", "san.cnf"]), ("dev1", "dev1", [])):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.crt", "-days", "1", *ext, cwd=d)
    return d


def test_mqtts_with_client_certificates(mosquitto_bin: str, certs: Path) -> None:
    from edge_client.transport import TlsOptions

    tls = {"cafile": certs / "ca.crt", "certfile": certs / "server.crt",
           "keyfile": certs / "server.key", "require_certificate": True}
    with MosquittoBroker(binary=mosquitto_bin, tls=tls) as b:
        assert b.url_tls.startswith("mqtts://127.0.0.1:")
        ok = MqttTransport(b.url_tls, "dev1", tls=TlsOptions(str(certs / "ca.crt"), str(certs / "dev1.crt"),
                                                               str(certs / "dev1.key")),
                           subscriptions=["s/#"])
        ok.connect(10)
        try:
            assert ok.version == "5"
            assert ok.publish("s/x", b"over tls", timeout=5)
            m = ok.recv(5)
            assert m is not None and m.payload == b"over tls"
        finally:
            ok.close()
        # no client certificate: the handshake is refused
        bad = MqttTransport(b.url_tls, "nocert", tls=TlsOptions(str(certs / "ca.crt")), backoff=(0.2, 0.4))
        with pytest.raises(ConnectionError):
            bad.connect(timeout=2)
        bad.close()


def test_username_and_password(mosquitto_bin: str, mosquitto_passwd_bin: str, tmp_path: Path) -> None:
    pw = tmp_path / "passwd"
    subprocess.run([mosquitto_passwd_bin, "-b", "-c", str(pw), "dev1", "s3cret"], check=True,
                   capture_output=True)
    with MosquittoBroker(binary=mosquitto_bin, password_file=str(pw)) as b:
        host = b.url.split("//")[1]
        good = MqttTransport(f"mqtt://dev1:s3cret@{host}", "dev1")
        good.connect(10)
        assert good.connected
        good.close()
        wrong = MqttTransport(b.url, "dev1", username="dev1", password="nope")
        with pytest.raises(ConnectionError, match="refused|no session"):
            wrong.connect(timeout=2)
        wrong.close()


def test_close_survives_paho_thread_exit_race(mosquitto: MosquittoBroker) -> None:
    """paho 2.1's ``loop_stop`` reads ``_thread`` twice; when the network thread ends
    after DISCONNECT between the two reads it raises AttributeError (seen in CI as a
    device exiting 1 after a finished run). ``close()`` must treat that as stopped."""
    watcher = MqttTransport(mosquitto.url, "watch", subscriptions=["t/#"])
    dev = MqttTransport(mosquitto.url, "racy", will=("t/will", b"gone"))
    watcher.connect(10)
    dev.connect(10)
    try:
        client = dev._client
        real_stop = client.loop_stop

        def racy_stop():
            real_stop()
            raise AttributeError("'NoneType' object has no attribute 'join'")

        client.loop_stop = racy_stop
        dev.close(clear_will=("t/presence", b"offline"))  # must not raise
        assert not dev.connected
        m = watcher.recv(5)
        assert m is not None and (m.topic, m.payload) == ("t/presence", b"offline")
        assert watcher.recv(1.5) is None  # clean DISCONNECT: no will published
    finally:
        watcher.close()
