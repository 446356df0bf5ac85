"""SecAgg+ (edge_client.secagg, coordinator.privacy.secagg): the secure sum equals the plain
integer sum bit for bit with devices dropping in every phase; below the threshold nothing
unmasks; one masked input looks uniform; bad signatures and bad shares are excluded and
named while the round completes; the wire refuses malformed secure-aggregation messages."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from scipy import stats

from coordinator.privacy.loopback import run_round
from coordinator.privacy.secagg import SecAggParams, SecAggServer, UnmaskError
from edge_client.errors import ProtocolError
from edge_client.protocol import decode_message, encode_message
from edge_client.protocol.secure import SecAggKeys, SecAggMasked, SecAggReveal, SecAggShares
from edge_client.secagg import crypto, shamir
from edge_client.secagg.encode import Grid, secure_vector, split_slots
from edge_client.secagg.graph import default_degree, neighbours

IDS = [f"dev-{i:02d}" for i in range(10)]
KEYS = {u: crypto.identity_keypair()[0] for u in IDS + [f"big-{i:02d}" for i in range(30)]}


def _inputs(ids, grid, seed=0):
    """Each device's uint32 vector: random int8-device grid differences, weighted."""
    rng = np.random.default_rng(seed)
    out = {}
    for i, u in enumerate(ids):
        q = rng.integers(-127, 128, grid.params).astype(np.int8)
        out[u] = secure_vector([q], dataclasses.replace(grid, slot=i % grid.slots), 1 + i, rng, int_bits=8)
    return out


def _server(ids, grid, **kw):
    kw.setdefault("params", SecAggParams(degree=len(ids) - 1))  # the complete graph unless told
    return SecAggServer("job", 3, ids, grid, lambda u: ids.index(u) % grid.slots, **kw)


def _plain_sum(vecs, ids):
    total = np.zeros_like(next(iter(vecs.values())))
    for u in ids:
        total += vecs[u]
    return total


GRID = Grid(params=37, slots=2, frac_bits=12)


def test_secure_sum_is_bit_exact_with_dropouts_in_every_phase() -> None:
    vecs = _inputs(IDS, GRID)
    srv = _server(IDS, GRID)
    assert srv.threshold == 5 and srv.degree == 9  # the complete graph of 10, t = 5
    # n - t = 5 devices drop: two before their keys, one after its keys, one after dealing
    # shares, one after its masked input (counted, but it reveals nothing)
    drop = {"dev-00": "keys", "dev-01": "keys", "dev-02": "shares", "dev-03": "masked", "dev-04": "reveal"}
    total = run_round(srv, {u: KEYS[u] for u in IDS}, lambda u, g: vecs[u], drop=drop)
    counted = [u for u in IDS if u not in ("dev-00", "dev-01", "dev-02", "dev-03")]
    assert srv.survivors == counted and srv.dropped == ["dev-03"]
    assert np.array_equal(total, _plain_sum(vecs, counted))
    # the slots decode to Σ ω·q·2^(F-7) per group, Σ ω and the count
    (s0, w0, n0), (s1, w1, n1) = split_slots(total, GRID)
    assert (n0, n1) == (3, 3) and w0 + w1 == sum(1 + IDS.index(u) for u in counted)


def test_sparse_graph_sum_with_ten_percent_dropouts(seed: int = 1) -> None:
    ids = [f"big-{i:02d}" for i in range(30)]
    grid = Grid(params=16, frac_bits=10)
    srv = _server(ids, grid, params=SecAggParams(degree=8))
    assert srv.degree == 8 and all(len(v) == 8 for v in srv.graph.values())
    rng = np.random.default_rng(seed)
    drop = {u: str(rng.choice(["shares", "masked", "reveal"])) for u in rng.choice(ids, 3, replace=False)}
    vecs = _inputs(ids, grid, seed)
    total = run_round(srv, {u: KEYS[u] for u in ids}, lambda u, g: vecs[u], drop=drop)
    assert np.array_equal(total, _plain_sum(vecs, srv.survivors))


def test_graph_is_k_regular_and_fixed_by_the_session() -> None:
    ids = [f"d{i}" for i in range(100)]
    k = default_degree(100)
    g = neighbours(ids, k, b"s1")
    assert k == 14 and all(len(v) == k for v in g.values())
    assert all(u in g[v] for u in ids for v in g[u])  # symmetric
    assert g == neighbours(list(reversed(ids)), k, b"s1") and g != neighbours(ids, k, b"s2")


def test_below_threshold_unmasking_fails() -> None:
    vecs = _inputs(IDS, GRID)
    srv = _server(IDS, GRID)
    # 6 drop after masking: their inputs are in, but only 4 < t = 5 devices reveal shares
    drop = {u: "reveal" for u in IDS[:6]}
    with pytest.raises(UnmaskError, match="self-mask seed: 4 share.* < threshold 5"):
        run_round(srv, {u: KEYS[u] for u in IDS}, lambda u, g: vecs[u], drop=drop)
    secret = bytes(range(32))
    shares = shamir.split(secret, [1, 2, 3, 4, 5], 3)
    assert shamir.combine(list(shares.items())[1:4], 3) == secret
    with pytest.raises(shamir.BelowThreshold):
        shamir.combine(list(shares.items())[:2], 3)
    # a wrong share does not give the secret back (the caller checks its commitment)
    pts = list(shares.items())[:2] + [(9, (12345).to_bytes(shamir.SHARE_BYTES, "big"))]
    with pytest.raises(ProtocolError):
        assert shamir.combine(pts, 3) != secret
        raise ProtocolError("a wrong secret")


def test_one_masked_input_is_indistinguishable_from_uniform() -> None:
    grid = Grid(params=1 << 15, frac_bits=12)
    ids = IDS[:4]
    zero = {u: np.zeros(grid.length, np.uint32) for u in ids}  # the most structured input there is
    seen = {}
    srv = _server(ids, grid)

    def keep(phase, m):
        if phase == "masked":
            seen[m.device_id] = np.frombuffer(m.data, "<u4")
        return m

    run_round(srv, {u: KEYS[u] for u in ids}, lambda u, g: zero[u], tamper=keep)
    y = seen[ids[0]]
    top = np.bincount(y >> 24, minlength=256)
    assert stats.chisquare(top).pvalue > 1e-4  # the high bytes are uniform
    assert stats.chisquare(np.bincount(y & 0xFF, minlength=256)).pvalue > 1e-4  # and the low
    assert stats.kstest(y / 2.0 ** 32, "uniform").pvalue > 1e-4
    # the same test sees the structure of an unmasked grid input at once
    x = _inputs(ids, grid)[ids[0]]
    assert stats.chisquare(np.bincount(x >> 24, minlength=256)).pvalue < 1e-12


def test_bad_signature_is_excluded_and_named_and_the_round_completes() -> None:
    vecs = _inputs(IDS, GRID)
    srv = _server(IDS, GRID)

    def forge(phase, m):
        if phase == "keys" and m.device_id == "dev-07":
            return dataclasses.replace(m, signature=bytes(64))
        return m

    total = run_round(srv, {u: KEYS[u] for u in IDS}, lambda u, g: vecs[u], tamper=forge)
    assert "bad signature" in srv.excluded["dev-07"] and "dev-07" not in srv.u1
    assert np.array_equal(total, _plain_sum(vecs, [u for u in IDS if u != "dev-07"]))


def test_pinned_identity_is_enforced() -> None:
    srv = _server(IDS, GRID, pinned={"dev-05": crypto.identity_keypair()[1]})
    vecs = _inputs(IDS, GRID)
    total = run_round(srv, {u: KEYS[u] for u in IDS}, lambda u, g: vecs[u])
    assert "pinned" in srv.excluded["dev-05"]
    assert np.array_equal(total, _plain_sum(vecs, [u for u in IDS if u != "dev-05"]))


def test_bad_shares_are_excluded_and_named_and_the_round_completes() -> None:
    vecs = _inputs(IDS, GRID)
    srv = _server(IDS, GRID)

    def corrupt(phase, m):
        if phase == "shares" and m.device_id == "dev-02":  # one sealed share changed in flight
            s = list(m.shares)
            s[0] = dataclasses.replace(s[0], ct=s[0].ct[:-1] + bytes([s[0].ct[-1] ^ 1]))
            return dataclasses.replace(m, shares=tuple(s))
        if phase == "shares" and m.device_id == "dev-06":  # deals to fewer than its neighbours
            return dataclasses.replace(m, shares=m.shares[1:])
        if phase == "reveal" and m.device_id == "dev-09":  # reveals a wrong share
            s = list(m.shares)
            s[0] = dataclasses.replace(s[0], share=bytes(shamir.SHARE_BYTES))
            return dataclasses.replace(m, shares=tuple(s))
        return m

    total = run_round(srv, {u: KEYS[u] for u in IDS}, lambda u, g: vecs[u], tamper=corrupt)
    assert "did not open" in srv.excluded["dev-02"] and "dev-02" in srv.dropped  # masked, then excluded
    assert "expected its neighbours" in srv.excluded["dev-06"] and "dev-06" not in srv.u2
    assert "commitments" in srv.excluded["dev-09"]  # its bad share discarded; its input counts
    assert np.array_equal(total, _plain_sum(vecs, [u for u in IDS if u not in ("dev-02", "dev-06")]))


def test_a_device_never_reveals_both_secrets_of_a_neighbour() -> None:
    vecs = _inputs(IDS, GRID)
    srv = _server(IDS, GRID)
    reqs = {}
    orig = srv.unmask_requests

    def greedy():
        out = orig()
        for u, r in out.items():  # a curious coordinator asks for survivors' mask keys too
            reqs[u] = r
            out[u] = dataclasses.replace(r, dropped=r.dropped + r.survivors[:1])
        return out

    srv.unmask_requests = greedy
    with pytest.raises(UnmaskError):
        run_round(srv, {u: KEYS[u] for u in IDS}, lambda u, g: vecs[u])
    assert reqs and not srv.revealed  # every device refused: nothing revealed


@pytest.mark.parametrize("bad", [
    {"kind": "sa_keys", "device_id": "a", "round_id": 1, "identity": b"x", "c_pk": bytes(32), "s_pk": bytes(32),
     "b_commit": bytes(32), "signature": bytes(64)},
    {"kind": "sa_masked", "device_id": "a", "round_id": 1, "data": b"abc"},
    {"kind": "sa_reveal", "device_id": "a", "round_id": 1, "shares": [{"of": "b", "secret": "x", "share": bytes(66)}]},
    {"kind": "sa_shares", "device_id": "a", "round_id": 1, "shares": [{"peer": "b", "ct": b"", "hb": b"", "hs": b""}]},
    {"kind": "sa_unmask", "device_id": "a", "round_id": 1, "survivors": ["b", "b"], "dropped": []},
])
def test_malformed_secure_messages_are_refused(bad) -> None:
    import msgpack

    with pytest.raises(ProtocolError):
        decode_message(msgpack.packb({"v": 1, **bad}, use_bin_type=True))


def test_secure_messages_round_trip() -> None:
    m = SecAggKeys("a", 1, bytes(32), bytes(32), bytes(32), bytes(32), bytes(64))
    assert decode_message(encode_message(m)) == m
    m2 = SecAggMasked("a", 1, bytes(8), ("b",))
    assert decode_message(encode_message(m2)) == m2
    assert decode_message(encode_message(SecAggShares("a", 1, ()))) == SecAggShares("a", 1, ())
    assert decode_message(encode_message(SecAggReveal("a", 1, ()))) == SecAggReveal("a", 1, ())
