"""Folding updates straight from their wire tensors (``Strategy.fold``): the same
aggregate as decoding first, checked whole before anything is added, and the codecs'
multi-update pass (``accumulate_many``) bit-exact against numpy."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from coordinator.strategies import EncodedUpdate, build_strategy
from coordinator.strategies.checks import check_encoded, is_lossy
from coordinator.strategies.decode import decode_update
from edge_client.codecs import CODECS, accumulate_many, accumulator, decode, encode, unpack
from edge_client.errors import ProtocolError
from edge_client.protocol import EncodedTensor

SHAPES = [(6, 5), (17,), (4, 3, 3)]
#: every codec that folds into the sums and takes a float device's float32 weights, at its
#: default and its lowest width
FOLDING = [(n, b) for n, c in CODECS.items() if c.accumulates and c.device_input == "shared"
           for b in sorted({c.default_bits, c.bits_range[0]})]


def model(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(0, 0.1, s).astype(np.float32) for s in SHAPES]


def encoded(i: int, base: list[np.ndarray], codec: str, bits: int | None, *, kind="weights") -> EncodedUpdate:
    w = [b + np.float32(0.01) * np.random.default_rng(100 + i).standard_normal(b.shape).astype(np.float32)
         for b in base]
    ts = tuple(encode(x, codec, bits) for x in w)
    return EncodedUpdate(f"dev{i:02d}", 10 + i, ts, kind, 32 if i % 3 else 8, is_lossy(ts))


def decoded(u: EncodedUpdate):
    return decode_update(u)


@pytest.mark.parametrize("name", ["fedavg", "fedshift", "prowd-swa+fedshift", "grouped-asym", "fedpaq"])
def test_encoded_path_matches_the_decoded_path(name: str) -> None:
    base = model(0)
    kind = "delta" if name == "fedpaq" else "weights"
    ups = [encoded(i, base if kind == "weights" else [np.zeros_like(b) for b in base], *FOLDING[i % len(FOLDING)],
                   kind=kind) for i in range(max(11, len(FOLDING)))]
    a, b = build_strategy(name), build_strategy(name)
    a.begin_round(3, base)
    b.begin_round(3, base)
    for u in ups:
        assert a.takes_encoded(u)
        a.fold(u)
    for u in reversed(ups):  # any order
        b.accept(decoded(u))
    ra, rb = a.finish(), b.finish()
    for x, y in zip(ra.weights, rb.weights, strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=2e-6)
    assert ra.stats["n_inferior"] == rb.stats["n_inferior"] > 0
    assert set(ra.group_weights) == set(rb.group_weights)


def test_a_bad_tensor_anywhere_rejects_the_whole_update_before_the_sum() -> None:
    base = model(1)
    good = [encoded(i, base, "asym", 4) for i in range(3)]
    bad = encoded(7, base, "asym", 4)
    broken = list(bad.tensors)
    broken[2] = EncodedTensor(broken[2].shape, "float32", "asym", 4, broken[2].data,
                              {"min": 1.0, "max": -1.0})  # the last layer: max < min
    cases = [  # the codecs' checks when folding (the ingest's rules: test_ingest.py)
        (EncodedUpdate(bad.device_id, 5, tuple(broken), "weights", 32, True), "aux.max"),
        (EncodedUpdate(bad.device_id, 5, (*bad.tensors[:2], EncodedTensor(
            (4, 3, 3), "float32", "float32", 32, np.full(36, np.nan, np.float32).tobytes(), {})),
            "weights", 32, False), "NaN"),
    ]
    ref = build_strategy("fedshift")
    ref.begin_round(1, base)
    for u in good:
        ref.fold(u)
    want = ref.finish().weights
    for u, match in cases:
        s = build_strategy("fedshift")
        s.begin_round(1, base)
        s.fold(good[0])
        with pytest.raises(ProtocolError, match=match):
            s.fold(u)
        for g in good[1:]:
            s.fold(g)
        for x, y in zip(s.finish().weights, want, strict=True):
            assert np.array_equal(x, y)


def test_danuq_table_overflow_is_rejected() -> None:
    x = np.random.default_rng(0).normal(0, 1, 50).astype(np.float32)
    t = encode(x, "danuq", 4, sigma_g=1.0)
    huge = EncodedTensor(t.shape, t.dtype, t.codec, t.bits, t.data, {**t.aux, "sigma_g": 3e38})
    with pytest.raises(ProtocolError, match="non-finite"):
        accumulator(huge)
    with pytest.raises(ProtocolError, match="non-finite"):
        decode(huge)


def test_integer_device_updates_are_folded_in_the_shared_domain() -> None:
    """``int`` tensors of an Int8 / Int6 / Int16 device fold straight into the sums as
    ``q / 2^(max(s, 8) - 1)``, the same as decoding them first; from a float device, or
    through ``ternary``, they do not."""
    base = model(2)
    rng = np.random.default_rng(4)
    ups = []
    for i, s_bits in enumerate((8, 6, 16, 8, 8)):
        dtype = np.int8 if s_bits <= 8 else np.int16
        half = 1 << (max(s_bits, 8) - 1)
        q = [rng.integers(-half // 2, half // 2, s).astype(dtype) for s in SHAPES]
        ups.append(EncodedUpdate(f"i{i}", 5 + i, tuple(encode(x, "int", max(s_bits, 8)) for x in q),
                                 "weights", s_bits, True))
    a, b = build_strategy("fedshift"), build_strategy("fedshift")
    a.begin_round(1, base)
    b.begin_round(1, base)
    for u in ups:
        assert a.takes_encoded(u)
        a.fold(u)
        b.accept(decoded(u))
    for x, y in zip(a.finish().weights, b.finish().weights, strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)
    from_float = EncodedUpdate("f", 1, ups[0].tensors, "weights", 32, True)
    with pytest.raises(ProtocolError, match="integer tensor"):
        check_encoded(from_float, SHAPES, 1e6)
    # a ternary uplink is decoded first (no fused decode), with the same result
    tern = EncodedUpdate("t", 1, tuple(encode(np.sign(b).astype(np.int8), "ternary") for b in base),
                         "weights", 8, True)
    s, ref = build_strategy("fedshift"), build_strategy("fedshift")
    s.begin_round(1, base)
    ref.begin_round(1, base)
    assert not s.takes_encoded(tern)
    s.fold(tern)
    ref.accept(decode_update(tern))
    assert s._decode_buffers.allocated == 1
    for x, y in zip(s.finish().weights, ref.finish().weights, strict=True):
        np.testing.assert_array_equal(x, y)


def _affine4_reference(adders, acc: np.ndarray, weights) -> np.ndarray:
    """numpy: acc + (c + ((q0 s0 + q1 s1) + (q2 s2 + q3 s3))), all float32."""
    f = np.float32
    a0 = [f(w * a.lo) for a, w in zip(adders, weights, strict=True)] + [f(0)] * (4 - len(adders))
    a1 = [f(w * a.step) for a, w in zip(adders, weights, strict=True)] + [f(0)] * (4 - len(adders))
    q = [unpack(a.tensor.data, a.n, a.bits).astype(np.float32) for a in adders]
    q += [q[0]] * (4 - len(q))
    c = ((a0[0] + a0[1]) + a0[2]) + a0[3]
    return acc + (c + ((q[0] * a1[0] + q[1] * a1[1]) + (q[2] * a1[2] + q[3] * a1[3])))


@settings(max_examples=60, deadline=None)
@given(n=hst.integers(0, 300), bits=hst.sampled_from([4, 8]), k=hst.integers(1, 6),
       seed=hst.integers(0, 2**16))
def test_accumulate_many_is_bit_exact_and_close_to_one_at_a_time(n: int, bits: int, k: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    ts = [encode(rng.normal(0, 0.1, n).astype(np.float32), "asym", bits) for _ in range(k)]
    adders = [accumulator(t) for t in ts]
    weights = [float(w) for w in rng.uniform(0.5, 200, k)]
    acc0 = rng.normal(0, 1, n).astype(np.float32)
    acc = acc0.copy()
    accumulate_many(adders, acc, weights)
    # the reference: fours (and a trailing three) fused, the rest one at a time, in order
    ref = acc0.copy()
    fused = list(range(0, k - 2, 4))
    done = set()
    for s in fused:
        chunk = list(range(s, min(s + 4, k)))
        if len(chunk) >= 3:
            ref = _affine4_reference([adders[i] for i in chunk], ref, [weights[i] for i in chunk])
            done.update(chunk)
    for i in range(k):
        if i not in done:
            one = ref.copy()
            adders[i](one, weights[i])
            ref = one
    assert np.array_equal(acc, ref)
    seq = acc0.astype(np.float64)
    for t, w in zip(ts, weights, strict=True):
        seq += w * decode(t).astype(np.float64)
    scale = sum(weights) * 0.5 + 1
    np.testing.assert_allclose(acc, seq, rtol=0, atol=scale * 4e-7 * k)


def test_accumulate_many_with_mixed_codecs_and_a_float64_sum() -> None:
    rng = np.random.default_rng(3)
    x = [rng.normal(0, 0.1, 40).astype(np.float32) for _ in range(6)]
    ts = [encode(x[0], "asym", 4), encode(x[1], "kmeans", 4), encode(x[2], "asym", 4),
          encode(x[3], "asym", 4), encode(x[4], "float32"), encode(x[5], "asym", 4)]
    for dtype in (np.float32, np.float64):
        acc = np.zeros(40, dtype)
        accumulate_many([accumulator(t) for t in ts], acc, [1.0] * 6)
        want = sum(decode(t).astype(np.float64) for t in ts)
        np.testing.assert_allclose(acc, want, rtol=0, atol=1e-5)


def test_sigma_loc_is_read_from_every_layer_or_rejected() -> None:
    from coordinator.strategies.checks import sigma_loc_of

    x = np.random.default_rng(0).normal(0, 1, 20).astype(np.float32)
    ts = [encode(x, "danuq", 2, sigma_g=1.0) for _ in range(2)]
    assert sigma_loc_of("d", ts) == [pytest.approx(float(ts[0].aux["sigma_loc"]))] * 2 and is_lossy(ts)
    assert sigma_loc_of("d", [ts[0], encode(x, "float32")]) is None and is_lossy([ts[0]])
    assert not is_lossy([encode(x, "float32")])
    for v in ("x", -1.0, True):
        bad = EncodedTensor(ts[1].shape, ts[1].dtype, ts[1].codec, ts[1].bits, ts[1].data, {**ts[1].aux, "sigma_loc": v})
        with pytest.raises(ProtocolError, match="sigma_loc"):
            sigma_loc_of("d", [ts[0], bad])


_AUX_VALUES = hst.one_of(hst.floats(allow_nan=True, allow_infinity=True), hst.integers(-2**40, 2**40),
                         hst.booleans(), hst.text(max_size=3), hst.none())


@settings(max_examples=300, deadline=None)
@given(layer=hst.integers(0, 2), codec=hst.sampled_from(sorted({n for n, _ in FOLDING})), data=hst.data(),
       value=_AUX_VALUES, bits=hst.integers(-1, 40), cut=hst.integers(-3, 3))
def test_malformed_wire_tensors_raise_protocol_errors_and_leave_the_sums_alone(layer, codec, data, value, bits, cut):
    base = model(9)
    s = build_strategy("fedshift")
    s.begin_round(1, base)
    ts = [encode(b + np.float32(0.01), codec) for b in base]
    t = ts[layer]
    key = data.draw(hst.sampled_from([*sorted(t.aux), "extra"]))
    aux = dict(t.aux)
    if isinstance(aux.get("codebook"), list) and key == "codebook":
        aux[key] = [value] * len(aux["codebook"])
    else:
        aux[key] = value
    data = t.data[:max(0, len(t.data) + cut)] if cut < 0 else t.data + b"\0" * cut
    ts[layer] = EncodedTensor(t.shape, t.dtype, t.codec, bits if bits != -1 else t.bits, data, aux)
    u = EncodedUpdate("fuzz", 3, tuple(ts), "weights", 32, True)
    s.fold(encoded(1, base, "asym", 4))
    if not s.takes_encoded(u):  # bits/codec combinations the decode path handles
        return
    try:
        s.fold(u)
    except ProtocolError:
        # rejected: the sums hold exactly the good update
        s._sums.flush()
        ref = build_strategy("fedshift")
        ref.begin_round(1, base)
        ref.fold(encoded(1, base, "asym", 4))
        ref._sums.flush()
        for x, y in zip(s._sums.sums[32], ref._sums.sums[32], strict=True):
            assert np.array_equal(x, y)
        return
    assert s.finish().stats["n_updates"] == 2  # accepted: it folds without error
