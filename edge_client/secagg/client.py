"""A device's side of one SecAgg+ round (Bell et al., CCS 2020): a state machine whose
methods take the coordinator's message and return the device's answer.

    c = SecAggClient(identity, job, device_id, round_id, session, selected)
    keys = c.keys()                       # -> SecAggKeys
    shares = c.on_roster(roster)          # -> SecAggShares
    masked = c.on_inbox(inbox, vector)    # -> SecAggMasked (vector: secure_vector(...))
    reveal = c.on_unmask(request)         # -> SecAggReveal

Every check that protects the device's input is made here, not trusted to the
coordinator: neighbours must be graph neighbours (the graph comes from the public
session), carry valid signatures, and number at least the threshold; an unmask request
may never ask for both secrets of one neighbour, nor name one that did not share.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from edge_client.errors import ProtocolError
from edge_client.protocol.secure import (
    PeerShare,
    RevealedShare,
    SecAggInbox,
    SecAggKeys,
    SecAggMasked,
    SecAggReveal,
    SecAggRoster,
    SecAggShares,
    SecAggUnmask,
)
from edge_client.secagg import crypto, shamir
from edge_client.secagg.graph import default_degree, neighbours
from edge_client.secagg.shamir import SHARE_BYTES

ENC_LABEL = b"fedbit-secagg-enc"
MASK_LABEL = b"fedbit-secagg-mask"


def keys_statement(job: str, round_id: int, session: bytes, device_id: str, c_pk: bytes, s_pk: bytes,
                   b_commit: bytes) -> bytes:
    """What a device's identity signs: its round keys, bound to job, round and session."""
    return b"fedbit-secagg-keys|" + crypto.digest(job.encode(), str(round_id).encode(), session,
                                                  device_id.encode(), c_pk, s_pk, b_commit)


def b_commitment(session: bytes, device_id: str, b: bytes) -> bytes:
    return crypto.digest(b"b", session, device_id.encode(), b)


def share_commitment(kind: str, session: bytes, owner: str, holder: str, share: bytes) -> bytes:
    """The dealer's commitment to the share of its secret ``kind`` that ``holder`` keeps."""
    return crypto.digest(kind.encode(), session, owner.encode(), holder.encode(), share)


def share_aad(session: bytes, sender: str, recipient: str) -> bytes:
    return crypto.digest(b"share", session, sender.encode(), recipient.encode())


def pair_sign(u: str, v: str) -> int:
    """+1 when ``u`` adds the pair's mask, -1 when it subtracts it (the smaller id adds)."""
    return 1 if u < v else -1


def mask_vector(x: np.ndarray, b: bytes, pair_seeds: Sequence[tuple[int, bytes]]) -> np.ndarray:
    """``x + PRG(b) + Σ ±PRG(s_uv)`` modulo 2^32 (uint32 arithmetic wraps)."""
    y = x.astype(np.uint32, copy=True)
    y += crypto.prg_uint32(b, y.size)
    for sign, seed in pair_seeds:
        if sign > 0:
            y += crypto.prg_uint32(seed, y.size)
        else:
            y -= crypto.prg_uint32(seed, y.size)
    return y


class SecAggClient:
    """One device in one secure round (see the module docstring).

    Args:
        identity: the device's Ed25519 private key (raw 32 bytes).
        job, device_id, round_id: who and when.
        session: the round's session bytes (announced).
        selected: the round's selected devices (the graph's nodes).
        degree: k (0: ``graph.default_degree``), as the coordinator announced.
    """

    def __init__(self, identity: bytes, job: str, device_id: str, round_id: int, session: bytes,
                 selected: Sequence[str], degree: int) -> None:
        self.identity = identity
        self.job, self.device_id, self.round_id, self.session = job, device_id, int(round_id), session
        k = min(degree or default_degree(len(selected)), max(len(selected) - 1, 0))  # as the coordinator
        self.graph_neighbours = set(neighbours(selected, k, session).get(device_id, ()))
        self._c_sk, self.c_pk = crypto.x25519_keypair()
        self._s_sk, self.s_pk = crypto.x25519_keypair()
        self._b = os.urandom(32)
        self.peers: dict[str, object] = {}
        self.threshold = 0
        self.x = 0
        self.grid: dict[str, object] = {}
        self.rejected: dict[str, str] = {}  # neighbour -> why it was left out (logged by the caller)
        self._held: dict[str, tuple[bytes, bytes]] = {}  # neighbour -> (its b share, its s share) we hold
        self._shared_with: list[str] = []
        self._masked_with: list[str] = []

    def keys(self) -> SecAggKeys:
        b_commit = b_commitment(self.session, self.device_id, self._b)
        stmt = keys_statement(self.job, self.round_id, self.session, self.device_id, self.c_pk, self.s_pk, b_commit)
        return SecAggKeys(self.device_id, self.round_id, crypto.identity_public(self.identity), self.c_pk,
                          self.s_pk, b_commit, crypto.sign(self.identity, stmt))

    def on_roster(self, roster: SecAggRoster) -> SecAggShares:
        """Check the neighbours' signed keys; deal both secrets to them, sealed."""
        self._check(roster.round_id, roster.device_id)
        if roster.session != self.session:
            raise ProtocolError("roster: session differs from the announced one")
        for p in roster.peers:
            why = None
            if p.device_id not in self.graph_neighbours:
                why = "not a neighbour on the round's graph"
            elif not crypto.verify(p.identity, p.signature, keys_statement(
                    self.job, self.round_id, self.session, p.device_id, p.c_pk, p.s_pk, p.b_commit)):
                why = "bad signature on its keys"
            if why:
                self.rejected[p.device_id] = why
            else:
                self.peers[p.device_id] = p
        if not 1 <= roster.threshold or len(self.peers) + 1 < roster.threshold:  # holders: they and we
            raise ProtocolError(f"roster: {len(self.peers)} valid neighbour(s) and this device < threshold "
                                f"{roster.threshold}")
        self.threshold, self.x, self.grid = roster.threshold, roster.x, dict(roster.grid)
        xs = {v: p.x for v, p in self.peers.items()}  # type: ignore[attr-defined]
        xs[self.device_id] = self.x
        if len(set(xs.values())) != len(xs):
            raise ProtocolError("roster: repeated x-coordinates")
        # shares for the neighbours and one the device keeps (it reveals it while it survives)
        b_shares = shamir.split(self._b, list(xs.values()), self.threshold)
        s_shares = shamir.split(self._s_sk, list(xs.values()), self.threshold)
        out = []
        for v in sorted(xs):
            sb, ss = b_shares[xs[v]], s_shares[xs[v]]
            c_pk = self.c_pk if v == self.device_id else self.peers[v].c_pk  # type: ignore[attr-defined]
            key = crypto.agree(self._c_sk, c_pk, ENC_LABEL, self.session)
            out.append(PeerShare(v, crypto.seal(key, sb + ss, share_aad(self.session, self.device_id, v)),
                                 share_commitment("b", self.session, self.device_id, v, sb),
                                 share_commitment("s", self.session, self.device_id, v, ss)))
        self._held[self.device_id] = (b_shares[self.x], s_shares[self.x])
        self._shared_with = sorted(self.peers)
        return SecAggShares(self.device_id, self.round_id, tuple(out))

    def on_inbox(self, inbox: SecAggInbox, vector: np.ndarray) -> SecAggMasked:
        """Open the shares addressed to us; mask ``vector`` (uint32) with the self-mask and
        the pairwise masks of every neighbour that shared. A share that does not open is a
        complaint (its sender is then dropped by the coordinator)."""
        self._check(inbox.round_id, inbox.device_id)
        complaints = []
        masked_with = []
        for s in inbox.shares:
            p = self.peers.get(s.peer)
            if p is None:
                raise ProtocolError(f"inbox: a share from {s.peer!r}, not a neighbour")
            masked_with.append(s.peer)
            try:
                key = crypto.agree(self._c_sk, p.c_pk, ENC_LABEL, self.session)
                plain = crypto.unseal(key, s.ct, share_aad(self.session, s.peer, self.device_id))
                if len(plain) != 2 * SHARE_BYTES:
                    raise ProtocolError("wrong length")
                self._held[s.peer] = (plain[:SHARE_BYTES], plain[SHARE_BYTES:])
            except ProtocolError:
                complaints.append(s.peer)
        if len(masked_with) + 1 < self.threshold:
            raise ProtocolError(f"inbox: {len(masked_with)} neighbour(s) shared, with this device < threshold "
                                f"{self.threshold}")
        seeds = [(pair_sign(self.device_id, v),
                  crypto.agree(self._s_sk, self.peers[v].s_pk, MASK_LABEL, self.session))  # type: ignore[attr-defined]
                 for v in sorted(masked_with)]
        self._masked_with = sorted(masked_with)
        y = mask_vector(vector, self._b, seeds)
        return SecAggMasked(self.device_id, self.round_id, y.astype("<u4").tobytes(), tuple(sorted(complaints)))

    def on_unmask(self, req: SecAggUnmask) -> SecAggReveal:
        """Reveal survivors' self-mask shares and dropped devices' mask-key shares, after
        checking that the request never asks both of one device, names only neighbours we
        masked with, and leaves at least the threshold of them surviving (with us)."""
        self._check(req.round_id, req.device_id)
        surv, drop = set(req.survivors), set(req.dropped)
        if surv & drop:
            raise ProtocolError(f"unmask: {sorted(surv & drop)} asked as both survivor and dropped")
        unknown = (surv | drop) - set(self._masked_with)
        if unknown:
            raise ProtocolError(f"unmask: {sorted(unknown)} are not neighbours that shared with us")
        if len(surv) + 1 < self.threshold:
            raise ProtocolError(f"unmask: {len(surv)} surviving neighbour(s): too few to reveal anything")
        out = [RevealedShare(v, "b", self._held[v][0]) for v in sorted(surv | {self.device_id}) if v in self._held]
        out += [RevealedShare(v, "s", self._held[v][1]) for v in sorted(drop) if v in self._held]
        return SecAggReveal(self.device_id, self.round_id, tuple(out))

    def _check(self, round_id: int, device_id: str) -> None:
        if round_id != self.round_id or device_id != self.device_id:
            raise ProtocolError(f"message for {device_id!r} round {round_id}, not {self.device_id!r} "
                                f"round {self.round_id}")


def load_identity(path: str | None) -> bytes:
    """The device's Ed25519 identity from ``path`` (created, mode 0600, when missing);
    a fresh one per process when ``path`` is None."""
    if path is None:
        return crypto.identity_keypair()[0]
    try:
        with open(path, "rb") as f:
            key = f.read()
        if len(key) == 32:
            return key
    except FileNotFoundError:
        pass
    key = crypto.identity_keypair()[0]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    os.replace(path + ".tmp", path)
    return key
