"""The device side of secure aggregation on its own (Python 3.9, no coordinator): sealed
shares, signed keys, pairwise masks that cancel, Shamir, the graph and the grid."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from edge_client.errors import ProtocolError
from edge_client.protocol import decode_message, encode_message
from edge_client.protocol.secure import PeerKeys, PeerShare, SecAggInbox, SecAggRoster, SecAggUnmask
from edge_client.secagg import SecAggClient, crypto, shamir
from edge_client.secagg.encode import Grid, centered, secure_vector, split_slots
from edge_client.secagg.graph import neighbours

SESSION = b"s" * 16


def _pair():
    ids = ["u", "v"]
    ident = {d: crypto.identity_keypair()[0] for d in ids}
    cs = {d: SecAggClient(ident[d], "job", d, 1, SESSION, ids, 0) for d in ids}
    keys = {d: cs[d].keys() for d in ids}
    grid = Grid(params=6, frac_bits=4).to_map()
    rosters = {d: SecAggRoster(d, 1, SESSION, 2, i + 1, tuple(
        PeerKeys(e, j + 1, k.identity, k.c_pk, k.s_pk, k.b_commit, k.signature)
        for j, (e, k) in enumerate(sorted(keys.items())) if e != d), grid) for i, d in enumerate(ids)}
    return ids, cs, rosters


def test_two_devices_masks_cancel_and_shares_open_only_for_their_recipient() -> None:
    ids, cs, rosters = _pair()
    shares = {d: cs[d].on_roster(decode_message(encode_message(rosters[d]))) for d in ids}
    assert {s.peer for s in shares["u"].shares} == {"u", "v"}  # its neighbour and itself
    inbox = {d: SecAggInbox(d, 1, tuple(PeerShare(e, next(s.ct for s in shares[e].shares if s.peer == d))
                                        for e in ids if e != d)) for d in ids}
    x = {"u": np.arange(8, dtype=np.uint32), "v": np.full(8, 2 ** 32 - 1, dtype=np.uint32)}
    y = {d: np.frombuffer(cs[d].on_inbox(inbox[d], x[d]).data, "<u4") for d in ids}
    # the pair's masks cancel: y_u + y_v - PRG(b_u) - PRG(b_v) = x_u + x_v (mod 2^32)
    b = {d: cs[d]._b for d in ids}
    total = y["u"] + y["v"] - crypto.prg_uint32(b["u"], 8) - crypto.prg_uint32(b["v"], 8)
    assert np.array_equal(total, x["u"] + x["v"]) and not np.array_equal(y["u"], x["u"])
    # a share sealed for v does not open for anyone else, nor after any change
    key = crypto.agree(cs["u"]._c_sk, cs["v"].c_pk, b"fedbit-secagg-enc", SESSION)
    ct = next(s.ct for s in shares["u"].shares if s.peer == "v")
    with pytest.raises(ProtocolError):
        crypto.unseal(key, ct[:-1] + bytes([ct[-1] ^ 1]), b"aad")
    # reveal: b shares of survivors (and its own), never both secrets of one device
    rev = cs["u"].on_unmask(SecAggUnmask("u", 1, ("v",), ()))
    assert sorted((s.of, s.secret) for s in rev.shares) == [("u", "b"), ("v", "b")]


def test_a_forged_neighbour_is_left_out_and_a_greedy_request_refused() -> None:
    ids, cs, rosters = _pair()
    r = rosters["u"]
    forged = dataclasses.replace(r, peers=(dataclasses.replace(r.peers[0], signature=bytes(64)),))
    with pytest.raises(ProtocolError, match="valid neighbour"):
        cs["u"].on_roster(forged)
    assert cs["u"].rejected == {"v": "bad signature on its keys"}
    ids, cs, rosters = _pair()
    cs["u"].on_roster(rosters["u"])
    cs["u"]._masked_with = ["v"]
    with pytest.raises(ProtocolError, match="both"):
        cs["u"].on_unmask(SecAggUnmask("u", 1, ("v",), ("v",)))


def test_shamir_graph_and_grid() -> None:
    s = bytes(range(32))
    sh = shamir.split(s, [3, 5, 7, 9], 3)
    assert shamir.combine([(9, sh[9]), (3, sh[3]), (7, sh[7])], 3) == s
    g = neighbours([f"d{i}" for i in range(20)], 6, SESSION)
    assert all(len(v) == 6 for v in g.values())
    grid = Grid(params=4, slots=2, slot=1, frac_bits=8)
    v = secure_vector([np.array([1, -2, 3, -4], np.int8)], grid, 5, np.random.default_rng(0), int_bits=8)
    assert list(centered(v[6:])) == [10, -20, 30, -40, 5, 1] and not v[:6].any()
    (_, w0, n0), (s1, w1, n1) = split_slots(v, grid)
    assert (w0, n0, w1, n1) == (0, 0, 5, 1) and list(s1) == [10 / 256, -20 / 256, 30 / 256, -40 / 256]
