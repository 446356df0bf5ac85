"""The devices the coordinator knows: every hello it accepted and who is online now."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from edge_client.protocol import Hello, Presence


class DeviceRegistry:
    """Hello messages by device id, and the set of devices whose presence is online.

    A device is *present* (selectable) once it said hello and while it is online; a
    presence message alone (no hello yet) registers nothing selectable.
    """

    def __init__(self) -> None:
        self.hellos: dict[str, Hello] = {}
        self.online: set[str] = set()

    def apply(self, m: Hello | Presence | None) -> None:
        """Record a checked hello (the device is then online) or presence message."""
        if isinstance(m, Hello):
            self.hellos[m.device_id] = m
            self.online.add(m.device_id)
        elif isinstance(m, Presence):
            (self.online.add if m.online else self.online.discard)(m.device_id)

    def present(self) -> list[str]:
        """Ids of devices that said hello and are online, sorted."""
        return sorted(d for d in self.online if d in self.hellos)

    def to_state(self) -> dict[str, dict[str, Any]]:
        """The hellos as plain maps, for a checkpoint."""
        return {d: asdict(h) for d, h in self.hellos.items()}

    @classmethod
    def from_state(cls, state: dict[str, dict[str, Any]]) -> DeviceRegistry:
        """The registry a checkpoint recorded; every device offline until it speaks."""
        reg = cls()
        reg.hellos = {d: Hello(**h) for d, h in state.items()}
        return reg
