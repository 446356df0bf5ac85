"""The dashboard: an aiohttp server in a thread of its own, watching a :class:`FleetMonitor`.

Routes (GET only): ``/`` the page (``static/index.html``, charts drawn with the vendored
uPlot); ``/static/...`` its script, style sheet and uPlot (MIT licence beside it);
``/events`` server-sent events (``snapshot`` on connect and when a new run starts, then
``update``: at once when a round completes, else at the next tick, every ``throttle_s``,
after any change; a comment every 15 s keeps proxies from closing a quiet stream);
``/api/state`` the picture as JSON (``?rounds=N``: the last N rounds); ``/metrics``
Prometheus metrics (:mod:`~coordinator.ops.dashboard.metrics`).

The round loop never waits for it: the monitor's listener only schedules a wake-up of
this thread's event loop. A bad request gets a 4xx naming why (400, 401, 404, 405, 421 for
a ``Host`` header naming another site on an open loopback dashboard, against DNS
rebinding; 429 past ``max_clients`` streams); a handler's own failure is a 500 of that
request only. Beyond loopback it serves HTTPS behind a password (:mod:`~coordinator.ops.dashboard.access`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import BasicAuth, web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from coordinator.ops.credentials import is_loopback
from coordinator.ops.dashboard.access import Access
from coordinator.ops.dashboard.metrics import registry_for
from coordinator.ops.dashboard.monitor import FleetMonitor
from edge_client.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from aiohttp.typedefs import Handler

STATIC = Path(__file__).with_name("static")
log = logging.getLogger("fedbit.dashboard")

_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY",
}


class Dashboard:
    """The dashboard of ``monitor`` served as ``access`` says (see the module docstring).

    Args:
        monitor: the picture.
        access: address, TLS files, password.
        max_clients: most event streams at once.
        throttle_s: least time between two messages of one stream (s).
    """

    def __init__(self, monitor: FleetMonitor, access: Access, *, max_clients: int = 32,
                 throttle_s: float = 0.25) -> None:
        self.monitor = monitor
        self.access = access
        self.max_clients = max_clients
        self.throttle_s = throttle_s
        self.registry = registry_for(monitor)
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._clients: set[asyncio.Event] = set()
        self._mark: tuple[int, int] = (0, 0)  # (run, rounds completed) the streams were woken for
        self._closing = False
        self._index = (STATIC / "index.html").read_bytes()

    # ------------------------------------------------------------------ life cycle

    def start(self, timeout: float = 30.0) -> str:
        """Listen (in a daemon thread) and return the URL; ConfigError when the address
        cannot be bound or the TLS files are unusable."""
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._serve())
            except BaseException as exc:  # noqa: BLE001 - handed to start()
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name="fedbit-dashboard", daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise ConfigError(f"dashboard: not listening after {timeout:.0f} s")
        if failure:
            exc = failure[0]
            what = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise ConfigError(f"dashboard: cannot serve on {self.access.host}:{self.access.port} ({what})")
        self.monitor.add_listener(self._poke)
        self.monitor.dashboard_url = self.url
        return self.url

    async def _serve(self) -> None:
        app = web.Application(middlewares=[self._guard], client_max_size=64 * 1024)
        app.router.add_get("/", self._page)
        app.router.add_get("/events", self._events)
        app.router.add_get("/api/state", self._state)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_static("/static", STATIC, follow_symlinks=False)
        ctx = None
        if self.access.cert:
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            ctx.load_cert_chain(str(self.access.cert), str(self.access.key))
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.access.host, self.access.port, ssl_context=ctx)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        shown = f"[{host}]" if ":" in host else host
        self.url = f"{self.access.scheme}://{shown}:{port}/"

    def stop(self, timeout: float = 5.0) -> None:
        """Close every stream and stop listening."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return

        async def shutdown() -> None:
            self._closing = True
            for ev in self._clients:
                ev.set()
            for _ in range(50):  # each stream sends its last picture (at most 0.5 s)
                if not self._clients:
                    break
                await asyncio.sleep(0.01)
            if self._runner is not None:
                await self._runner.cleanup()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout)
        except Exception as exc:  # noqa: BLE001 - stopping anyway
            log.debug("dashboard shutdown: %s", exc)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)

    def _poke(self) -> None:
        """The monitor changed (called on the round loop's thread). Only a completed round
        or a new run wakes this thread's loop (a cross-thread wake-up costs the round loop
        a GIL hand-over); the streams pick up other changes at their next tick."""
        loop, mark = self._loop, (self.monitor.run, self.monitor.completed)
        if mark == self._mark or loop is None or loop.is_closed():
            return
        self._mark = mark
        try:
            loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the loop closed meanwhile
            pass

    def _wake(self) -> None:
        for ev in self._clients:
            ev.set()

    # ------------------------------------------------------------------ handlers

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        a = self.access
        if not a.password_sha256 and not host_allowed(request.host, a.names):
            raise web.HTTPMisdirectedRequest(text="this dashboard answers to its own names and the loopback "
                                                  "addresses only\n")
        if a.password_sha256:
            try:
                auth = BasicAuth.decode(request.headers.get("Authorization", ""))
            except ValueError:
                auth = None
            if auth is None or not a.allows(auth.login, auth.password):
                raise web.HTTPUnauthorized(headers={"WWW-Authenticate": 'Basic realm="fedbit dashboard"'},
                                           text="user fedbit and the dashboard password, please\n")
        resp = await handler(request)
        if not resp.prepared:
            resp.headers.update(_HEADERS)
        return resp

    async def _page(self, request: web.Request) -> web.Response:
        return web.Response(body=self._index, content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-store"})

    async def _state(self, request: web.Request) -> web.Response:
        n = request.query.get("rounds")
        after = 0
        if n is not None:
            if not n.isdigit() or len(n) > 9:
                raise web.HTTPBadRequest(text=f"rounds: expected a count >= 0, got {n[:40]!r}\n")
            after = max(0, self.monitor.snapshot(rounds_after=None)["rounds_done"] - int(n))
        return web.json_response(self.monitor.snapshot(rounds_after=after), headers={"Cache-Control": "no-store"})

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _events(self, request: web.Request) -> web.StreamResponse:
        if len(self._clients) >= self.max_clients:
            raise web.HTTPTooManyRequests(text=f"at most {self.max_clients} event streams\n")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store",
                                           "X-Accel-Buffering": "no", **_HEADERS})
        await resp.prepare(request)
        ev = asyncio.Event()
        self._clients.add(ev)
        run, sent, version = None, 0, -1
        try:
            while True:
                ev.clear()
                snap = self.monitor.snapshot(rounds_after=sent if run == self.monitor.run else 0)
                kind = "update"
                if snap["run"] != run or snap["rounds_after"] > snap["rounds_done"]:
                    snap = self.monitor.snapshot(rounds_after=0)
                    kind = "snapshot"
                run, sent, version = snap["run"], snap["rounds_done"], snap["version"]
                await resp.write(f"event: {kind}\ndata: {json.dumps(snap)}\n\n".encode())
                if self._closing:  # (the last picture went out)
                    break
                # a completed round (or a new run) wakes the stream at once; other changes
                # go out at the next tick, every throttle_s
                quiet = time.monotonic()
                while not ev.is_set() and self.monitor.version == version:
                    try:
                        await asyncio.wait_for(ev.wait(), timeout=self.throttle_s)
                    except TimeoutError:
                        if time.monotonic() - quiet > 15.0:  # (proxies close silent streams)
                            await resp.write(b": keep-alive\n\n")
                            quiet = time.monotonic()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._clients.discard(ev)
        return resp


def host_allowed(host: str, names: tuple[str, ...] = ()) -> bool:
    """Whether a ``Host`` header names this dashboard: one of ``names`` (the configured host
    names and the listen address), ``localhost``, or a loopback address literal
    (``127.0.0.1:PORT``, ``[::1]``), compared exactly. A page of another site that
    rebinds its name to 127.0.0.1 sends its own name, ``127.attacker.example`` included."""
    if host.startswith("["):
        name = host[1:].partition("]")[0]
    else:
        name = host.rpartition(":")[0] if host.count(":") == 1 else host
    name = name.lower().rstrip(".")
    return bool(name) and (name in {n.lower() for n in names} or is_loopback(name))
