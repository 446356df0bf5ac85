"""Where the dashboard listens and who may look: loopback is open, anything beyond it
takes the job's TLS and a password (as the broker does).

``--dashboard [HOST:]PORT``: a bare port listens on 127.0.0.1 (port 0: a free one). Beyond
loopback (``0.0.0.0:8080``, a LAN address) the dashboard serves HTTPS with a certificate of
the job CA (``SECURITY/dashboard.crt``, its names: ``--hostname`` or this host's) and asks
for HTTP basic authentication, user ``fedbit``, with the password of
``dashboard.password_file`` or else ``SECURITY/dashboard.password`` (random, made on first
use, mode 0600; the clear text is only in that file). There is no way to serve it beyond
loopback without both.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from coordinator.ops.credentials import JobSecurity, default_hosts, is_loopback, issue, new_password
from edge_client.auth import write_private
from edge_client.errors import ConfigError

USERNAME = "fedbit"
PASSWORD_FILE = "dashboard.password"
CERT_STEM = "dashboard"


def parse_address(value: str | int) -> tuple[str, int]:
    """``[HOST:]PORT`` -> (host, port): a bare port is on 127.0.0.1; ``[::1]:PORT`` for
    IPv6; port 0 asks for a free one. ConfigError for anything else."""
    text = str(value).strip()
    host, sep, port = text.rpartition(":")
    host = host.strip("[]") if sep else "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) < 65536 or (sep and not host):
        raise ConfigError(f"--dashboard: {text!r} is not [HOST:]PORT (8080, 127.0.0.1:8080, 0.0.0.0:8080)")
    if host != "localhost":
        try:
            ipaddress.ip_address(host)
        except ValueError:
            if not all(part.isalnum() or "-" in part for part in host.split(".")):
                raise ConfigError(f"--dashboard: {host!r} is not a host name or address") from None
    return host, int(port)


@dataclass(frozen=True)
class Access:
    """How the dashboard is served: TLS files (None: plain HTTP, loopback only) and the
    SHA-256 of the password (empty: no authentication, loopback only)."""

    host: str
    port: int
    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None
    password_sha256: bytes = b""
    password_file: Path | None = None
    #: the names a ``Host`` header may give (the listen address, ``--hostname`` s; the
    #: loopback literals always pass): anything else is refused (DNS rebinding)
    names: tuple[str, ...] = ()

    @property
    def scheme(self) -> str:
        return "https" if self.cert else "http"

    def allows(self, username: str, password: str) -> bool:
        """Whether basic-auth ``username``/``password`` is let in (constant-time compare)."""
        if not self.password_sha256:
            return True
        digest = hashlib.sha256(password.encode()).digest()
        return hmac.compare_digest(digest, self.password_sha256) and hmac.compare_digest(username, USERNAME)

    def describe(self, url: str) -> str:
        """One line for the operator: where, and what it takes."""
        if not self.cert:
            auth = f", user {USERNAME}, password in {self.password_file}" if self.password_sha256 else ""
            return f"dashboard: {url} (loopback only{auth}); Prometheus metrics at {url}metrics"
        return (f"dashboard: {url} (TLS with a certificate of the job CA {self.ca}; user {USERNAME}, password "
                f"in {self.password_file}); Prometheus metrics at {url}metrics")


def dashboard_access(address: str | int, *, security_dir: str | Path, job: str,
                     hostnames: list[str] | None = None, password_file: str = "") -> Access:
    """What serving on ``address`` takes (see the module docstring); makes the job CA, the
    dashboard certificate and the password file when they are missing."""
    host, port = parse_address(address)
    pw_path = Path(password_file) if password_file else None
    names = tuple(dict.fromkeys([host, *(hostnames or [])]))
    if is_loopback(host):
        if pw_path is None:
            return Access(host, port, names=names)
        return Access(host, port, password_sha256=_hash(_read(pw_path)), password_file=pw_path, names=names)
    sec = JobSecurity(security_dir, job)
    sec.ensure_ca()
    cert, key = _certificate(sec, hostnames or default_hosts(host))
    if pw_path is None:
        pw_path = sec.dir / PASSWORD_FILE
        if not pw_path.exists():
            write_private(pw_path, new_password() + "\n")
    return Access(host, port, cert=cert, key=key, ca=sec.ca_path, password_sha256=_hash(_read(pw_path)),
                  password_file=pw_path, names=names)


def _certificate(sec: JobSecurity, hosts: list[str]) -> tuple[Path, Path]:
    """``dashboard.crt``/``.key`` of the job CA naming ``hosts`` (re-issued when a name is
    missing)."""
    cert, key, names = sec.dir / f"{CERT_STEM}.crt", sec.dir / f"{CERT_STEM}.key", sec.dir / f"{CERT_STEM}.hosts"
    want = set(hosts)
    if cert.exists() and key.exists() and names.exists():
        have = set(names.read_text().split())
        if want <= have:
            return cert, key
        want |= have
    ordered = sorted(want)
    issue(sec.dir, CERT_STEM, ordered[0], hosts=ordered)
    names.write_text("\n".join(ordered) + "\n")
    return cert, key


def _read(path: Path) -> str:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"dashboard.password_file {path}: cannot read ({exc.strerror or exc})") from None
    if not lines or not lines[0].strip():
        raise ConfigError(f"dashboard.password_file {path}: empty (its first line is the password)")
    return lines[0].strip()


def _hash(password: str) -> bytes:
    return hashlib.sha256(password.encode()).digest()
