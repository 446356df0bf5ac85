""":class:`Watch`: what ``fedbit serve`` and ``fedbit emulate`` attach to their runs: a
:class:`FleetMonitor` fed by the round loop's events, the run directory's ``live.json``
(``fedbit status``), and the dashboard when ``--dashboard`` asks for it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coordinator.ops.dashboard.monitor import FleetMonitor, LiveFile

if TYPE_CHECKING:  # pragma: no cover
    from coordinator.ops.dashboard.web import Dashboard


class Watch:
    """A monitor, its ``live.json`` writer and (optionally) its dashboard.

    Args:
        listen: ``[HOST:]PORT`` of the dashboard ("" : none).
        security_dir: the job's security folder (TLS and the password beyond loopback).
        job_id: the job id (its CA's name).
        hostnames: names the dashboard certificate carries (default: this host's).
        password_file: the dashboard password's file (default beyond loopback: made in
            ``security_dir``).
    """

    def __init__(self, *, listen: str = "", security_dir: str | Path = "", job_id: str = "default",
                 hostnames: list[str] | None = None, password_file: str = "") -> None:
        self.monitor = FleetMonitor()
        self.live: LiveFile | None = None
        self.dashboard: Dashboard | None = None
        self.describe = ""
        if listen:
            from coordinator.ops.dashboard.access import dashboard_access
            from coordinator.ops.dashboard.web import Dashboard

            access = dashboard_access(listen, security_dir=security_dir, job=job_id, hostnames=hostnames,
                                      password_file=password_file)
            self.dashboard = Dashboard(self.monitor, access)
            self.describe = access.describe(self.dashboard.start())

    @property
    def url(self) -> str:
        return self.dashboard.url if self.dashboard is not None else ""

    def new_run(self, job: dict[str, Any], rounds: int, title: str, run_dir: str | Path,
                history: list[dict[str, Any]] | None = None) -> Callable[[str, dict[str, Any]], None]:
        """Watch a (new) run writing into ``run_dir`` (``history``: its completed rounds,
        when resumed); returns the ``on_event`` callback to give its coordinator."""
        if self.live is not None:
            self.live.close()
        self.monitor.new_run(job, rounds, title)
        if history:
            self.monitor.load_history(history)
        self.live = LiveFile(self.monitor, run_dir)
        return self.monitor

    def close(self, state: str) -> None:
        """The job ended (``done``, ``stopped``, ``error``): the final ``live.json``, and the
        dashboard stops."""
        self.monitor.close(state)
        if self.live is not None:
            self.live.close()
            self.live = None
        if self.dashboard is not None:
            self.dashboard.stop()
