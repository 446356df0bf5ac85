"""Watching a job: the live picture of the round loop and the ways to look at it.

- :mod:`~coordinator.ops.dashboard.monitor`: :class:`FleetMonitor`, an ``on_event``
  observer of the :class:`~coordinator.server.Coordinator` that keeps the job's picture,
  and :class:`LiveFile`, which writes it to ``RUN_DIR/live.json`` for ``fedbit status``;
- :mod:`~coordinator.ops.dashboard.metrics`: the picture as Prometheus metrics;
- :mod:`~coordinator.ops.dashboard.access`: where the dashboard listens and what it takes
  beyond loopback (the job's TLS, a password);
- :mod:`~coordinator.ops.dashboard.web`: the dashboard (aiohttp in its own thread), with
  the vendored uPlot chart library in ``static/``;
- :mod:`~coordinator.ops.dashboard.runview`: the picture of a run directory, running or
  finished (``fedbit status``).

aiohttp and prometheus-client (the ``coordinator`` extra) are imported only by ``web``
and ``metrics``, so a coordinator without ``--dashboard`` never loads them.
"""
