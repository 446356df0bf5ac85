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

    def apply(self, m: Hello | Presence | None) -> None:
        """Record a checked hello (the device is then online) or presence message."""
        if isinstance(m, Hello):
            old = self.hellos.get(m.device_id)
            if old is not None:
                self._variants[model_variant(old.compute_bits, old.trainer)] -= 1
            self.hellos[m.device_id] = m
            self._variants[model_variant(m.compute_bits, m.trainer)] += 1
            self.online.add(m.device_id)
        elif isinstance(m, Presence):
            (self.online.add if m.online else self.online.discard)(m.device_id)

    def variants(self) -> set[str]:
        """The model variants the known devices run, ``float32`` always included."""
        return {FLOAT_VARIANT} | {v for v, n in self._variants.items() if n > 0}

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
        for h in state.values():
            reg.apply(Hello(**h))
        reg.online.clear()
        return reg
