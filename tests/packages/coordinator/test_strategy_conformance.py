"""What every registered strategy promises, checked for each name ``build_strategy``
knows (``available_strategies()``: every combiner, alone and behind each mask, and the
presets), so that a new combiner, mask or preset is covered without editing a test: the
aggregate does not depend on the order updates are folded in, a checkpoint taken between
rounds resumes to the same results bit for bit, and an empty round is refused and leaves
nothing behind. What each one computes is in ``test_strategies*.py``.
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from coordinator.strategies import EncodedUpdate, available_strategies, build_strategy
from coordinator.strategies.decode import decode_update
from edge_client.codecs import encode
from edge_client.errors import ProtocolError
from edge_client.protocol import float32_tensor

#: a model the dequantizer can name (ProWD's needs one); the updates follow its shapes
MODEL = "mlp"
NAMES = available_strategies()


def _model(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(0, 0.1, s).astype(np.float32) for s in _shapes()]


def _shapes() -> list[tuple[int, ...]]:
    from firmware_models import get_spec

    return [tuple(s) for s in get_spec(MODEL).param_shapes()]


def _updates(glob: list[np.ndarray], seed: int) -> list[EncodedUpdate]:
    """Nine updates of a mixed fleet: float devices lossless and through a lossy codec,
    one sending its change, integer devices of two widths sending their own integers."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(9):
        w = [np.clip(g + rng.normal(0, 0.02, g.shape).astype(np.float32), -0.5, 0.5) for g in glob]
        n = int(rng.integers(5, 50))
        if i % 3 == 0:
            ts = tuple(float32_tensor(x) for x in w)
            out.append(EncodedUpdate(f"f{i}", n, ts, "weights", 32, False))
        elif i % 3 == 1:
            kind = "delta" if i == 4 else "weights"
            ts = tuple(encode((x - g) if kind == "delta" else x, "asym", 8) for x, g in zip(w, glob, strict=True))
            out.append(EncodedUpdate(f"q{i}", n, ts, kind, 32, True))
        else:
            bits = 8 if i % 2 else 6
            ts = tuple(encode(np.rint(x * 128).astype(np.int8), "int", 8) for x in w)
            out.append(EncodedUpdate(f"i{i}", n, ts, "weights", bits, False))
    return out


def _run(name: str, rounds: list[list[EncodedUpdate]], glob: list[np.ndarray], s=None, decoded: bool = False):
    """Fold each round's updates (``decoded``: decode them first and ``accept`` them)."""
    s = s or build_strategy(name, model=MODEL)
    results = []
    for r, ups in enumerate(rounds, start=1):
        s.begin_round(r, glob)
        for u in ups:
            if decoded:
                s.accept(decode_update(u))
            else:
                s.fold(u)
        results.append(s.finish())
        glob = results[-1].weights
    return s, results


def _same(a, b, exact: bool) -> None:
    check = np.testing.assert_array_equal if exact else (
        lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6))
    assert len(a.weights) == len(b.weights)
    for x, y in zip(a.weights, b.weights, strict=True):
        check(x, y)
    assert sorted(a.group_weights) == sorted(b.group_weights)
    for bits in a.group_weights:
        for x, y in zip(a.group_weights[bits], b.group_weights[bits], strict=True):
            check(x, y)
    assert a.stats["n_updates"] == b.stats["n_updates"] and a.stats["n_inferior"] == b.stats["n_inferior"]


@pytest.mark.parametrize("name", NAMES)
def test_fold_order_does_not_change_the_aggregate(name: str) -> None:
    """Nor does decoding first (``accept``, the path of updates built from arrays)."""
    glob = _model(0)
    ups = _updates(glob, 1)
    _, (ref,) = _run(name, [ups], glob)
    assert all(np.isfinite(w).all() for w in ref.weights) and ref.stats["n_updates"] == len(ups)
    for seed in (0, 1):
        order = np.random.default_rng(seed).permutation(len(ups))
        _, (got,) = _run(name, [[ups[i] for i in order]], glob)
        _same(ref, got, exact=False)
    _, (dec,) = _run(name, [ups[::-1]], glob, decoded=True)
    _same(ref, dec, exact=False)


@pytest.mark.parametrize("name", NAMES)
def test_a_checkpoint_between_rounds_resumes_bit_for_bit(name: str) -> None:
    glob = _model(2)
    r1, r2 = _updates(glob, 3), _updates(glob, 4)
    s, (first,) = _run(name, [r1], glob)
    blob = msgpack.packb(s.state_dict(), use_bin_type=True)
    t = build_strategy(name, model=MODEL)
    t.load_state_dict(msgpack.unpackb(blob, raw=False))
    _, (a,) = _run(name, [r2], first.weights, s)
    _, (b,) = _run(name, [r2], first.weights, t)
    _same(a, b, exact=True)
    sa, sb = s.server_state(), t.server_state()
    assert sorted(sa) == sorted(sb)
    for key in sa:
        assert (sa[key] is None) == (sb[key] is None)
        if sa[key] is not None:
            assert all(np.array_equal(x, y) for x, y in zip(sa[key], sb[key], strict=True))


@pytest.mark.parametrize("name", NAMES)
def test_an_empty_round_is_refused_and_leaves_nothing_behind(name: str) -> None:
    glob = _model(5)
    ups = _updates(glob, 6)
    s = build_strategy(name, model=MODEL)
    with pytest.raises(ProtocolError, match="no round"):
        s.fold(ups[0])
    with pytest.raises(ProtocolError, match="no round"):
        s.accept(decode_update(ups[0]))
    s.begin_round(1, glob)
    with pytest.raises(ProtocolError, match="no update"):
        s.finish()
    _, (after_empty,) = _run(name, [ups], glob, s)
    _, (fresh,) = _run(name, [ups], glob)
    _same(after_empty, fresh, exact=True)
