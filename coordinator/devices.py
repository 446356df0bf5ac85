"""The devices the coordinator knows: every hello it accepted and who is online now."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from typing import Any

from edge_client.protocol import FLOAT_VARIANT, Hello, Presence, model_variant


class DeviceRegistry:
    """Hello messages by device id, and the set of devices whose presence is online.

    A device is *present* (selectable) once it said hello and while it is online; a
    presence message alone (no hello yet) registers nothing selectable.
    """

    def __init__(self) -> None:
        self.hellos: dict[str, Hello] = {}
        self.online: set[str] = set()
        self._variants: Counter[str] = Counter()  # devices per model variant
        self._state: dict[str, dict[str, Any]] = {}  # hellos as plain maps
        #: a hello was added or changed since :meth:`to_state` was last saved
        self.changed = False
        self._present: list[str] | None = None  # cache of present(), dropped on any change
        #: how many devices are present (kept by every change: O(1) to read)
        self.n_present = 0

    def apply(self, m: Hello | Presence | None) -> str | None:
        """Record a checked hello (the device is then online) or presence message; returns
        what changed for the operator: ``joined`` (a device with a hello came online, or
        changed its hello), ``left`` (it went offline), or None."""
        if isinstance(m, Hello):
            old = self.hellos.get(m.device_id)
            if old != m:
                if old is not None:
                    self._variants[model_variant(old.compute_bits, old.trainer)] -= 1
                elif m.device_id in self.online:  # online before its hello: present from now
                    self.n_present += 1
                self.hellos[m.device_id] = m
                self._variants[model_variant(m.compute_bits, m.trainer)] += 1
                self._state[m.device_id] = asdict(m)
                self.changed = True
                self._present = None
            return "joined" if self._set_online(m.device_id, True) or old != m else None
        if isinstance(m, Presence) and self._set_online(m.device_id, m.online) and m.device_id in self.hellos:
            return "joined" if m.online else "left"
        return None

    def _set_online(self, device_id: str, online: bool) -> bool:
        """Whether the device's online state changed."""
        if (device_id in self.online) == online:
            return False
        (self.online.add if online else self.online.discard)(device_id)
        self._present = None
        if device_id in self.hellos:
            self.n_present += 1 if online else -1
        return True

    def variants(self) -> set[str]:
        """The model variants the known devices run, ``float32`` always included."""
        return {FLOAT_VARIANT} | {v for v, n in self._variants.items() if n > 0}

    def present(self) -> list[str]:
        """Ids of devices that said hello and are online, sorted (a new list)."""
        if self._present is None:
            self._present = sorted(d for d in self.online if d in self.hellos)
        return list(self._present)

    def to_state(self) -> dict[str, dict[str, Any]]:
        """The hellos as plain maps, for the run state (kept up to date by :meth:`apply`;
        do not modify)."""
        return self._state

    @classmethod
    def from_state(cls, state: dict[str, dict[str, Any]]) -> DeviceRegistry:
        """The registry a checkpoint recorded; every device offline until it speaks."""
        reg = cls()
        for h in state.values():
            reg.apply(Hello(**h))
        reg.online.clear()
        reg._present = None
        reg.n_present = 0
        reg.changed = False
        return reg
