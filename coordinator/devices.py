"""The devices the coordinator knows: every hello it accepted and who is online now.

Devices register one by one (a hello, then presence messages) or, when a fleet knows its
devices up front (the emulator: :meth:`Fleet.roster`), in bulk as :class:`Cohort` s: ids
``<prefix><i, zero-padded>`` for ``i < count`` sharing one hello but for their id and
sample count. A cohort costs the registry a few bytes per device (its sample counts),
not a hello object each: a million registered devices stay cheap to register, to count,
to select from and to checkpoint. A member's hello is made when it is asked for
(:attr:`DeviceRegistry.hellos` is a read-only mapping over both kinds).
"""

from __future__ import annotations

import bisect
import heapq
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from edge_client.errors import ConfigError
from edge_client.protocol import FLOAT_VARIANT, Hello, Presence, model_variant, valid_id

#: the key of the cohorts in :meth:`DeviceRegistry.to_state` (never a device id: ``@`` is
#: not allowed in one)
COHORTS_KEY = "@cohorts"


@dataclass(frozen=True, eq=False)
class Cohort:
    """Devices registered together: ids ``f"{prefix}{i:0{width}d}"`` for ``0 <= i < count``,
    each with ``hello`` but for its ``device_id`` and ``num_samples`` (one number for all,
    or ``int64 [count]``).

    ``prefix`` must end in a character that is not a digit, so that no two cohorts with
    different prefixes share an id; ConfigError otherwise.
    """

    prefix: str
    width: int
    count: int
    hello: Hello
    num_samples: int | np.ndarray

    def __post_init__(self) -> None:
        if not self.prefix or self.prefix[-1].isdigit() or not valid_id(self.prefix):
            raise ConfigError(f"cohort {self.prefix!r}: the id prefix must be a valid id ending in a non-digit")
        if self.count < 1 or self.width < len(str(self.count - 1)) or len(self.prefix) + self.width > 128:
            raise ConfigError(f"cohort {self.prefix!r}: {self.count} devices do not fit {self.width} digits")
        if isinstance(self.num_samples, np.ndarray):
            if self.num_samples.shape != (self.count,):
                raise ConfigError(f"cohort {self.prefix!r}: num_samples has shape {self.num_samples.shape}, "
                                  f"not ({self.count},)")
            object.__setattr__(self, "num_samples", self.num_samples.astype(np.int64))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Cohort) and (self.prefix, self.width, self.count, self.hello)
                == (other.prefix, other.width, other.count, other.hello)
                and np.array_equal(self.num_samples, other.num_samples))

    def device_id(self, i: int) -> str:
        return f"{self.prefix}{i:0{self.width}d}"

    def index(self, device_id: str) -> int | None:
        """The member index of ``device_id``, None when it is not a member."""
        rest = device_id[len(self.prefix):]
        if len(rest) != self.width or not device_id.startswith(self.prefix) or not rest.isdigit() \
                or not rest.isascii():
            return None
        i = int(rest)
        return i if i < self.count else None

    def samples(self, i: int) -> int:
        n = self.num_samples
        return int(n[i]) if isinstance(n, np.ndarray) else int(n)

    def hello_of(self, i: int) -> Hello:
        return replace(self.hello, device_id=self.device_id(i), num_samples=self.samples(i))

    @property
    def variant(self) -> str:
        return model_variant(self.hello.compute_bits, self.hello.trainer)

    def to_state(self) -> dict[str, Any]:
        return {"prefix": self.prefix, "width": self.width, "count": self.count,
                "hello": asdict(self.hello), "num_samples": self.num_samples}

    @classmethod
    def from_state(cls, st: dict[str, Any]) -> Cohort:
        n = st["num_samples"]
        return cls(str(st["prefix"]), int(st["width"]), int(st["count"]), Hello(**st["hello"]),
                   np.asarray(n, dtype=np.int64) if isinstance(n, np.ndarray | list) else int(n))


class CohortIds(Sequence[str]):
    """The ids of cohorts whose id ranges do not interleave, in sorted order, without
    making them (``len``, indexing, iteration)."""

    def __init__(self, cohorts: list[Cohort]) -> None:
        self._cohorts = sorted(cohorts, key=lambda c: c.device_id(0))
        self._starts = [0]
        for c in self._cohorts:
            self._starts.append(self._starts[-1] + c.count)

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, i: int) -> str:  # type: ignore[override]
        if not isinstance(i, int | np.integer):
            raise TypeError("CohortIds indexes with integers only")
        i = int(i)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        k = bisect.bisect_right(self._starts, i) - 1
        return self._cohorts[k].device_id(i - self._starts[k])

    def __iter__(self) -> Iterator[str]:
        for c in self._cohorts:
            yield from (c.device_id(i) for i in range(c.count))


def _interleave(cohorts: list[Cohort]) -> bool:
    """Whether the sorted ids of ``cohorts`` mix two cohorts (one prefix extends another
    by a digit: ``pi-`` and ``pi-4-``); then :class:`CohortIds` cannot list them."""
    for a in cohorts:
        for b in cohorts:
            if a is not b and b.prefix.startswith(a.prefix) and b.prefix[len(a.prefix)].isdigit():
                return True
    return False


class Hellos(Mapping[str, Hello]):
    """Read-only ``device id -> Hello`` over a registry's own hellos and its cohorts."""

    def __init__(self, reg: DeviceRegistry) -> None:
        self._reg = reg

    def __getitem__(self, device_id: str) -> Hello:
        reg = self._reg
        h = reg._hellos.get(device_id)
        if h is not None:
            return h
        found = reg.member(device_id)
        if found is None:
            raise KeyError(device_id)
        return found[0].hello_of(found[1])

    def __contains__(self, device_id: object) -> bool:
        return isinstance(device_id, str) and (device_id in self._reg._hellos
                                               or self._reg.member(device_id) is not None)

    def __len__(self) -> int:
        reg = self._reg
        return len(reg._hellos) - reg._members_said_hello + sum(c.count for c in reg.cohorts)

    def __iter__(self) -> Iterator[str]:
        reg = self._reg
        for c in reg.cohorts:
            yield from (c.device_id(i) for i in range(c.count))
        yield from (d for d in reg._hellos if reg.member(d) is None)


class DeviceRegistry:
    """Hello messages by device id, and the set of devices whose presence is online.

    A device is *present* (selectable) once it said hello and while it is online; a
    presence message alone (no hello yet) registers nothing selectable. Cohort members
    (:meth:`add_cohort`) are registered and online from the start; a presence message
    of one of them takes it offline or back as for any device.

    ``online`` holds the devices outside cohorts that are online (a presence message
    alone puts one there; the admission rules bound its size).
    """

    def __init__(self) -> None:
        self._hellos: dict[str, Hello] = {}
        self.hellos: Mapping[str, Hello] = Hellos(self)
        self.online: set[str] = set()
        self.cohorts: list[Cohort] = []
        self._members_said_hello = 0  # cohort members with a hello of their own in _hellos
        #: per cohort prefix: whether its members are online, and the members whose
        #: presence says otherwise
        self._cohort_online: dict[str, bool] = {}
        self._flipped: dict[str, set[str]] = {}
        self._variants: Counter[str] = Counter()  # devices per model variant
        self._state: dict[str, dict[str, Any]] = {}  # hellos as plain maps
        #: a hello or a cohort was added or changed since :meth:`to_state` was last saved
        self.changed = False
        self._present: Sequence[str] | None = None  # cache of present(), dropped on any change
        #: how many devices are present (kept by every change: O(1) to read)
        self.n_present = 0

    def member(self, device_id: str) -> tuple[Cohort, int] | None:
        """(cohort, index) of a cohort member, None for any other id."""
        for c in self.cohorts:
            i = c.index(device_id)
            if i is not None:
                return c, i
        return None

    def add_cohort(self, cohort: Cohort) -> None:
        """Register (and bring online) every member of ``cohort``; one equal to a registered
        cohort only brings its members online. ConfigError when its id range overlaps
        another cohort's or its hello's bitwidth is one no device declares."""
        from coordinator.ingest import DEVICE_BITS

        h = cohort.hello
        if h.compute_bits not in DEVICE_BITS or (h.trainer == "int" and h.compute_bits > 16):
            raise ConfigError(f"cohort {cohort.prefix!r}: unsupported compute_bits {h.compute_bits}")
        for c in self.cohorts:
            if c.prefix == cohort.prefix:
                if c != cohort:
                    raise ConfigError(f"cohort {cohort.prefix!r}: another cohort has that prefix")
                self._cohort_online[c.prefix] = True
                self._flipped[c.prefix] = set()
                self._present = None
                self.n_present = self._count_present()
                return
        self._members_said_hello += sum(1 for d in self._hellos if cohort.index(d) is not None)
        self.online -= {d for d in self.online if cohort.index(d) is not None}
        self.cohorts.append(cohort)
        self._cohort_online[cohort.prefix] = True
        self._flipped[cohort.prefix] = set()
        self._variants[cohort.variant] += cohort.count
        self.changed = True
        self._present = None
        self.n_present = self._count_present()

    def _count_present(self) -> int:
        own = sum(1 for d in self.online if d in self._hellos)
        return own + sum(c.count - len(self._flipped[c.prefix]) if self._cohort_online[c.prefix]
                         else len(self._flipped[c.prefix]) for c in self.cohorts)

    def apply(self, m: Hello | Presence | None) -> str | None:
        """Record a checked hello (the device is then online) or presence message; returns
        what changed for the operator: ``joined`` (a device with a hello came online, or
        changed its hello), ``left`` (it went offline), or None."""
        if isinstance(m, Hello):
            found = self.member(m.device_id)
            old = self.hellos.get(m.device_id)
            if old != m:
                if old is not None:
                    self._variants[model_variant(old.compute_bits, old.trainer)] -= 1
                elif m.device_id in self.online:  # online before its hello: present from now
                    self.n_present += 1
                if found is not None and m.device_id not in self._hellos:
                    self._members_said_hello += 1
                self._hellos[m.device_id] = m
                self._variants[model_variant(m.compute_bits, m.trainer)] += 1
                self._state[m.device_id] = asdict(m)
                self.changed = True
                self._present = None
            return "joined" if self._set_online(m.device_id, True, found) or old != m else None
        if isinstance(m, Presence) and self._set_online(m.device_id, m.online, found := self.member(m.device_id)) \
                and (found is not None or m.device_id in self._hellos):
            return "joined" if m.online else "left"
        return None

    def is_online(self, device_id: str) -> bool:
        found = self.member(device_id)
        if found is None:
            return device_id in self.online
        prefix = found[0].prefix
        return self._cohort_online[prefix] != (device_id in self._flipped[prefix])

    def _set_online(self, device_id: str, online: bool, found: tuple[Cohort, int] | None) -> bool:
        """Whether the device's online state changed."""
        if found is not None:
            prefix = found[0].prefix
            flip = self._flipped[prefix]
            if (self._cohort_online[prefix] != (device_id in flip)) == online:
                return False
            (flip.discard if device_id in flip else flip.add)(device_id)
            self.n_present += 1 if online else -1
        else:
            if (device_id in self.online) == online:
                return False
            (self.online.add if online else self.online.discard)(device_id)
            if device_id in self._hellos:
                self.n_present += 1 if online else -1
        self._present = None
        return True

    def variants(self) -> set[str]:
        """The model variants the known devices run, ``float32`` always included."""
        return {FLOAT_VARIANT} | {v for v, n in self._variants.items() if n > 0}

    def present(self) -> Sequence[str]:
        """Ids of devices that said hello (or are cohort members) and are online, sorted. A
        new list without cohorts; with them a read-only sequence (cohort ids are not made
        one by one unless other devices or offline members must be merged in)."""
        if self._present is None:
            own = sorted(d for d in self.online if d in self._hellos)
            if not self.cohorts:
                self._present = own
            elif not own and all(self._cohort_online.values()) and not any(self._flipped.values()) \
                    and not _interleave(self.cohorts):
                self._present = CohortIds(self.cohorts)
            else:  # the general case: every present id made and merged (rare with cohorts)
                runs = [[c.device_id(i) for i in range(c.count) if self.is_online(c.device_id(i))]
                        for c in sorted(self.cohorts, key=lambda c: c.device_id(0))]
                self._present = list(heapq.merge(own, *runs))
        return list(self._present) if isinstance(self._present, list) else self._present

    def to_state(self) -> dict[str, Any]:
        """The hellos as plain maps, for the run state, and the cohorts under
        :data:`COHORTS_KEY` (kept up to date by :meth:`apply`; do not modify)."""
        if not self.cohorts:
            return self._state
        return {**self._state, COHORTS_KEY: [c.to_state() for c in self.cohorts]}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> DeviceRegistry:
        """The registry a checkpoint recorded; every device offline until it speaks (a
        cohort until its fleet registers it again)."""
        reg = cls()
        for key, h in state.items():
            if key != COHORTS_KEY:
                reg.apply(Hello(**h))
        for st in state.get(COHORTS_KEY, []):
            c = Cohort.from_state(st)
            reg.add_cohort(c)
            reg._cohort_online[c.prefix] = False
        reg.online.clear()
        reg._present = None
        reg.changed = False
        reg.n_present = 0
        return reg


def state_size(state: dict[str, Any]) -> int:
    """How many devices a saved registry (:meth:`DeviceRegistry.to_state`) holds."""
    return len(DeviceRegistry.from_state(state).hellos) if COHORTS_KEY in state else len(state)


def state_kinds(state: dict[str, Any]) -> list[dict[str, Any]]:
    """The hello maps of a saved registry that tell its devices' kinds apart: every
    device's own, and one per cohort (its members share all but id and sample count)."""
    return [h for k, h in state.items() if k != COHORTS_KEY and isinstance(h, dict)] + [
        c["hello"] for c in state.get(COHORTS_KEY, []) if isinstance(c, dict) and isinstance(c.get("hello"), dict)]


def state_entries(state: dict[str, Any], limit: int) -> list[tuple[str, dict[str, Any]]]:
    """The first ``limit`` devices of a saved registry by id, as ``(id, hello map)``
    (cohort members made for the listing only)."""
    own = sorted((k, h) for k, h in state.items() if k != COHORTS_KEY and isinstance(h, dict))
    runs = [own]
    for st in state.get(COHORTS_KEY, []):
        c = Cohort.from_state(st)
        runs.append([(c.device_id(i), asdict(c.hello_of(i))) for i in range(min(limit, c.count))])
    return list(heapq.merge(*runs))[:limit]
