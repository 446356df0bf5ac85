"""The coordinator's side of one SecAgg+ round: route what devices send each other,
sum the masked inputs, and remove the masks with the shares of the survivors.

The server never holds one device's unmasked input: it sums the masked vectors in
ℤ/2^32 and subtracts, at the end, the survivors' self-masks and the pairwise masks that
dropped devices left behind (:meth:`SecAggServer.unmask`). It excludes, by name and reason
(:attr:`SecAggServer.excluded`): at keys, a signature that does not verify or an identity
other than the one pinned for the device (first seen wins); at shares, a device that does
not deal exactly one sealed share to each roster neighbour and one to itself; at masked
input, a device whose sealed share a neighbour could not open (its mask key is
reconstructed instead of its self-mask, so its input stays hidden; masked inputs are held
until the phase closes, then summed). At reveal, a share that does not match its dealer's
commitment is discarded and its sender named, and a secret is reconstructed from ``t``
good shares and checked against its owner's commitment (docs/security.md#secure-aggregation).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from edge_client.errors import ProtocolError
from edge_client.protocol.secure import (
    PeerKeys,
    PeerShare,
    SecAggInbox,
    SecAggKeys,
    SecAggMasked,
    SecAggReveal,
    SecAggRoster,
    SecAggShares,
    SecAggUnmask,
)
from edge_client.secagg import crypto, shamir
from edge_client.secagg.client import (
    MASK_LABEL,
    b_commitment,
    keys_statement,
    pair_sign,
    share_commitment,
)
from edge_client.secagg.encode import Grid
from edge_client.secagg.graph import default_degree, default_threshold, neighbours, x_coordinates

log = logging.getLogger("fedbit.secagg")


class UnmaskError(ProtocolError):
    """The sum cannot be unmasked (a secret has fewer good shares than the threshold)."""


class PhaseClosed(ProtocolError):
    """A message of a phase that is over (a late device): dropped, not held against it."""


@dataclass
class SecAggParams:
    """``degree`` k (0: ``default_degree(n)``), ``threshold`` t as a fraction of k."""

    degree: int = 0
    threshold: float = 0.5


@dataclass
class _Device:
    keys: SecAggKeys | None = None
    shares: dict[str, PeerShare] = field(default_factory=dict)  # recipient -> sealed share


class SecAggServer:
    """One secure round (see the module docstring).

    Args:
        job, round_id: the round.
        selected: the round's selected devices.
        grid: the encoding (``params``, ``slots``, ``frac_bits``...; ``slot`` is set per device).
        slot_of: device -> its slot.
        params: k and t.
        pinned: device -> pinned identity key (updated with first-seen keys).
        session: the round's session bytes (random when None).
    """

    def __init__(self, job: str, round_id: int, selected: Iterable[str], grid: Grid,
                 slot_of: Callable[[str], int], params: SecAggParams | None = None,
                 pinned: dict[str, bytes] | None = None, session: bytes | None = None) -> None:
        self.job, self.round_id = job, int(round_id)
        self.selected = sorted(selected)
        self.session = session if session is not None else secrets.token_bytes(16)
        params = params or SecAggParams()
        n = len(self.selected)
        self.degree = min(params.degree or default_degree(n), max(n - 1, 0))
        self.threshold = default_threshold(self.degree, params.threshold)
        self.graph = neighbours(self.selected, self.degree, self.session)
        self.xs = x_coordinates(self.selected)
        self.grid = grid
        self.slot_of = slot_of
        self.pinned = pinned if pinned is not None else {}
        self.devices: dict[str, _Device] = {}
        self.excluded: dict[str, str] = {}  # device -> why
        self.u1: list[str] = []  # advertised keys
        self.u2: list[str] = []  # dealt shares
        self.total = np.zeros(grid.length, dtype=np.uint32)
        self.u3: list[str] = []  # masked input counted
        self.survivors: list[str] = []  # masked input summed (set when phase 3 closes)
        self.dropped: list[str] = []  # dealt shares, then dropped or were excluded
        #: masked inputs (uniformly random without the masks) until phase 3 closes: an input
        #: whose device is excluded then is left out of the sum
        self._masked: dict[str, np.ndarray] = {}
        self.complaints: dict[str, set[str]] = {}
        self.revealed: dict[tuple[str, str], dict[int, bytes]] = {}  # (owner, secret) -> {x: share}
        self.bad_shares: dict[str, int] = {}
        self.phase = "keys"

    # ------------------------------------------------------------------ phase 1
    def keys(self, m: SecAggKeys) -> None:
        """A device's signed keys (ProtocolError, the device excluded, when they do not verify)."""
        d = self._member(m.device_id, m.round_id, "keys")
        if d.keys is not None:
            return
        pin = self.pinned.get(m.device_id)
        if pin is not None and pin != m.identity:
            self._exclude(m.device_id, "identity key differs from the one pinned for it")
        stmt = keys_statement(self.job, self.round_id, self.session, m.device_id, m.c_pk, m.s_pk, m.b_commit)
        if not crypto.verify(m.identity, m.signature, stmt):
            self._exclude(m.device_id, "bad signature on its keys")
        self.pinned.setdefault(m.device_id, m.identity)
        d.keys = m

    def rosters(self) -> dict[str, SecAggRoster]:
        """Close phase 1: each advertised device's roster (its advertised neighbours)."""
        self.u1 = sorted(u for u, d in self.devices.items() if d.keys is not None and u not in self.excluded)
        self.phase = "shares"
        out = {}
        for u in self.u1:
            peers = tuple(self._peer_keys(v) for v in self.graph[u] if v in self.u1)
            grid = Grid(**{**self.grid.to_map(), "slot": self.slot_of(u)})
            out[u] = SecAggRoster(u, self.round_id, self.session, self.threshold, self.xs[u], peers, grid.to_map())
        return out

    # ------------------------------------------------------------------ phase 2
    def shares(self, m: SecAggShares) -> None:
        """A device's sealed shares: exactly one for each of its advertised neighbours."""
        d = self._member(m.device_id, m.round_id, "shares")
        if m.device_id not in self.u1 or d.shares:
            return
        want = {v for v in self.graph[m.device_id] if v in self.u1} | {m.device_id}  # and its own
        got = {s.peer for s in m.shares}
        if got != want or any(len(s.hb) != 32 or len(s.hs) != 32 for s in m.shares):
            self._exclude(m.device_id, f"dealt shares to {sorted(got)}, expected its neighbours {sorted(want)}")
        d.shares = {s.peer: s for s in m.shares}

    def inboxes(self) -> dict[str, SecAggInbox]:
        """Close phase 2: each dealer's inbox (the shares its neighbours sealed for it)."""
        self.u2 = sorted(u for u in self.u1 if self.devices[u].shares and u not in self.excluded)
        self.phase = "masked"
        out = {}
        for u in self.u2:
            got = tuple(PeerShare(v, self.devices[v].shares[u].ct) for v in self.graph[u] if v in self.u2)
            out[u] = SecAggInbox(u, self.round_id, got)
        return out

    # ------------------------------------------------------------------ phase 3
    def masked(self, m: SecAggMasked) -> None:
        """Add a masked input into the running sum (it is never kept on its own)."""
        self._member(m.device_id, m.round_id, "masked")
        if m.device_id not in self.u2 or m.device_id in self._masked:
            return
        if len(m.data) != 4 * self.grid.length:
            self._exclude(m.device_id, f"masked input of {len(m.data) // 4} words, expected {self.grid.length}")
        for v in m.complaints:
            if v in self.graph[m.device_id]:
                self.complaints.setdefault(v, set()).add(m.device_id)
        self._masked[m.device_id] = np.frombuffer(m.data, dtype="<u4")
        self.u3.append(m.device_id)

    def unmask_requests(self) -> dict[str, SecAggUnmask]:
        """Close phase 3: who survived (self-masks to remove), who dropped or was excluded
        (their pairwise masks to remove); each survivor is asked about its neighbours."""
        for v, by in sorted(self.complaints.items()):
            if v not in self.excluded:
                self._exclude(v, f"its sealed shares did not open for {sorted(by)}", raise_=False)
        self.survivors = sorted(u for u in self.u3 if u not in self.excluded)
        self.dropped = sorted(u for u in self.u2 if u not in self.survivors)
        for u in self.survivors:
            self.total += self._masked[u]
        self._masked.clear()
        self.phase = "reveal"
        surv, drop = set(self.survivors), set(self.dropped)
        out = {}
        for u in self.survivors:
            nb = set(self.graph[u]) & set(self.u2)
            out[u] = SecAggUnmask(u, self.round_id, tuple(sorted(nb & surv)), tuple(sorted(nb & drop)))
        return out

    # ------------------------------------------------------------------ phase 4
    def reveal(self, m: SecAggReveal) -> None:
        """A survivor's shares; one that fails its dealer's commitment is discarded and its
        sender named (its input still counts: its own self-mask is someone else's to reveal)."""
        self._member(m.device_id, m.round_id, "reveal")
        if m.device_id not in self.survivors:
            return
        h = m.device_id
        asked = {(v, "b") for v in self.survivors} | {(v, "s") for v in self.dropped}
        for s in m.shares:
            dealt = self.devices.get(s.of)
            sealed = dealt.shares.get(h) if dealt is not None else None
            want = (sealed.hb if s.secret == "b" else sealed.hs) if sealed is not None else None
            if (s.of, s.secret) not in asked or want != share_commitment(s.secret, self.session, s.of, h, s.share):
                self.bad_shares[h] = self.bad_shares.get(h, 0) + 1
                continue
            self.revealed.setdefault((s.of, s.secret), {})[self.xs[h]] = s.share

    def unmask(self) -> np.ndarray:
        """The sum of the survivors' inputs (uint32 [grid.length]); UnmaskError naming the
        secret that cannot be reconstructed."""
        for h, n in sorted(self.bad_shares.items()):
            self.excluded.setdefault(h, f"{n} revealed share(s) did not match their dealers' commitments")
        if not self.survivors:
            raise UnmaskError(f"round {self.round_id}: no masked input survived")
        total = self.total.copy()
        for u in self.survivors:
            b = self._secret(u, "b")
            if b_commitment(self.session, u, b) != self.devices[u].keys.b_commit:
                raise UnmaskError(f"round {self.round_id}: {u}'s self-mask seed does not match its commitment")
            total -= crypto.prg_uint32(b, total.size)
        for u in self.dropped:
            sk = self._secret(u, "s")
            if crypto.x25519_public(sk) != self.devices[u].keys.s_pk:
                raise UnmaskError(f"round {self.round_id}: {u}'s reconstructed mask key does not match its key")
            for v in self.graph[u]:
                if v in self.survivors:  # v added pair_sign(v, u) * PRG(s_vu); take it out
                    seed = crypto.agree(sk, self.devices[v].keys.s_pk, MASK_LABEL, self.session)
                    if pair_sign(v, u) > 0:
                        total -= crypto.prg_uint32(seed, total.size)
                    else:
                        total += crypto.prg_uint32(seed, total.size)
        self.phase = "done"
        return total

    # ------------------------------------------------------------------ helpers
    def _secret(self, owner: str, kind: str) -> bytes:
        pts = sorted(self.revealed.get((owner, kind), {}).items())
        try:
            return shamir.combine(pts, self.threshold)
        except ProtocolError as exc:  # below the threshold, or shares that do not interpolate
            what = "self-mask seed" if kind == "b" else "mask key"
            raise UnmaskError(f"round {self.round_id}: {owner}'s {what}: {exc}") from None

    def _peer_keys(self, v: str) -> PeerKeys:
        k = self.devices[v].keys
        return PeerKeys(v, self.xs[v], k.identity, k.c_pk, k.s_pk, k.b_commit, k.signature)

    def _member(self, device_id: str, round_id: int, phase: str) -> _Device:
        if round_id != self.round_id:
            raise ProtocolError(f"round {round_id} is not the secure round {self.round_id}")
        if device_id not in self.xs:
            raise ProtocolError(f"{device_id!r} is not selected in round {self.round_id}")
        if phase != self.phase:
            raise PhaseClosed(f"{phase} message in phase {self.phase}")
        if device_id in self.excluded:
            raise ProtocolError(f"{device_id!r} is excluded from round {self.round_id}")
        return self.devices.setdefault(device_id, _Device())

    def _exclude(self, device_id: str, why: str, *, raise_: bool = True) -> None:
        self.excluded[device_id] = why
        log.warning("round %d: secure aggregation excludes %r: %s", self.round_id, device_id, why,
                    extra={"event": "secagg_excluded", "round": self.round_id, "device": device_id})
        if raise_:
            raise ProtocolError(f"{device_id!r} excluded: {why}")

    def report(self) -> Mapping[str, object]:
        """Figures for the round's metrics record."""
        return {"secagg_degree": self.degree, "secagg_threshold": self.threshold, "secagg_keys": len(self.u1),
                "secagg_shared": len(self.u2), "secagg_masked": len(self.u3),
                "secagg_survivors": len(self.survivors),
                "secagg_excluded": dict(sorted(self.excluded.items()))}
