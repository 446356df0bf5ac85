"""Bit-for-bit agreement of the Numba kernels with a plain-numpy reference.

The reference below re-derives every formula of docs/algorithms.md §1 in the spec's own NCHW
layout with int64 numpy arithmetic and Python integers (no table, no Numba): forward
(ternary conv/linear, rounding shift, clip, ReLU, max-pool with padding and ties), SSE
output error, error quantization (eq. 12), weight gradient, stochastic-rounded update
(eq. 15-16) with the SplitMix64 counter stream, and a whole training step.
"""

from __future__ import annotations

import numpy as np
import pytest

from edge_client.compat import zip_strict
from edge_client.intnn import IntModel, act_max, alpha_shifts, grid_scale, weight_max
from edge_client.intnn import kernels as K
from firmware_models import Conv2d, Flatten, Linear, MaxPool2d, ModelSpec, ReLU

M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB


# ----------------------------------------------------------------------------- reference


def ref_round_shift(v: np.ndarray, k: int) -> np.ndarray:
    v = np.asarray(v, dtype=np.int64)
    if k > 0:
        half = 1 << (k - 1)
        r = (np.abs(v) + half) >> k
        return np.where(v < 0, -r, r)
    if k < 0:
        return v << (-k)
    return v.copy()


def ref_round_log2(m: int) -> int:
    b = int(m).bit_length() - 1
    return b + 1 if m * m > (1 << (2 * b + 1)) else b


def ref_mix64_int(z: int) -> int:
    z &= M64
    z = ((z ^ (z >> 30)) * MIX1) & M64
    z = ((z ^ (z >> 27)) * MIX2) & M64
    return z ^ (z >> 31)


def ref_stream_key(seed: int, step: int, layer: int, stream: int) -> int:
    z = ref_mix64_int(seed * GOLDEN + 0x1234567)
    z = ref_mix64_int(z ^ (step * 1048583 + layer * 131 + stream))
    return z


def ref_rand62(key: int, n: int) -> np.ndarray:
    """The first n draws of stream ``key`` (uint64 numpy wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        j = np.arange(1, n + 1, dtype=np.uint64)
        z = np.uint64(key & M64) + j * np.uint64(GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(MIX1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(MIX2)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(2)).astype(np.int64)


def ref_finish(acc: np.ndarray, shift: int, amax: int, relu: bool) -> np.ndarray:
    v = ref_round_shift(acc, shift)
    if relu:
        v = np.maximum(v, 0)
    return np.clip(v, -amax, amax)


def ref_windows(a: np.ndarray, k: int, stride: int, pad: int, fill: int) -> np.ndarray:
    """[N, C, Ho, Wo, k, k] windows of the padded input."""
    ap = np.pad(a, ((0, 0), (0, 0), (pad, pad), (pad, pad)), constant_values=fill)
    win = np.lib.stride_tricks.sliding_window_view(ap, (k, k), axis=(2, 3))
    return win[:, :, ::stride, ::stride]


def plane_len(n: int, h: int, w: int, pad: int) -> int:
    """Length of a padded-plane row for n samples of h x w (kernels.conv_forward_plane)."""
    wp = w + pad
    return pad * wp + pad + n * (h + pad) * wp


def ref_conv(a, t, stride, pad):
    k = t.shape[2]
    win = ref_windows(a.astype(np.int64), k, stride, pad, 0)
    return np.einsum("nchwij,ocij->nohw", win, t.astype(np.int64))


def ref_conv_back_data(eq, t, stride, pad, in_shape):
    n, c, h, w = in_shape
    k = t.shape[2]
    ho, wo = eq.shape[2], eq.shape[3]
    out = np.zeros((n, c, h + 2 * pad + stride * k, w + 2 * pad + stride * k), np.int64)
    e = eq.astype(np.int64)
    t64 = t.astype(np.int64)
    for kh in range(k):
        for kw in range(k):
            contrib = np.einsum("nohw,oc->nchw", e, t64[:, :, kh, kw])
            out[:, :, kh:kh + stride * ho:stride, kw:kw + stride * wo:stride] += contrib
    return out[:, :, pad:pad + h, pad:pad + w]


def ref_conv_wgrad(eq, a, stride, pad, k):
    win = ref_windows(a.astype(np.int64), k, stride, pad, 0)
    return np.einsum("nohw,nchwij->ocij", eq.astype(np.int64), win)


def ref_pool(a, k, stride, pad):
    """Max-pool forward: (out, flat winner index into each sample's [C, H, W] plane)."""
    n, c, h, w = a.shape
    sentinel = -(1 << 40)
    win = ref_windows(a.astype(np.int64), k, stride, pad, sentinel)
    flat = win.reshape(*win.shape[:4], k * k)
    arg = flat.argmax(axis=-1)  # first maximum in (kh, kw) order
    out = np.take_along_axis(flat, arg[..., None], axis=-1)[..., 0]
    ho, wo = out.shape[2], out.shape[3]
    iy = np.arange(ho)[None, None, :, None] * stride + arg // k - pad
    ix = np.arange(wo)[None, None, None, :] * stride + arg % k - pad
    cc = np.arange(c)[None, :, None, None]
    src = (cc * h + iy) * w + ix
    return out, src


def ref_pool_back(e, src, in_shape):
    n = e.shape[0]
    out = np.zeros((n, int(np.prod(in_shape[1:]))), np.int64)
    for i in range(n):
        np.add.at(out[i], src[i].ravel(), e[i].ravel().astype(np.int64))
    return out.reshape(in_shape)


def ref_softmax_error(z: np.ndarray, y: np.ndarray, bits: int, temp_shift: int):
    """Base-2 softmax error in Q15 from Python integers: (e, sum of 2^15 - p_true)."""
    fb = bits - 1
    table = [round(2.0 ** (30 - j / 16)) for j in range(16)]
    e = np.zeros(z.shape, np.int64)
    total = 0
    for n in range(z.shape[0]):
        row = [int(v) for v in z[n]]
        m = max(row)
        vals = []
        for v in row:
            d = (m - v) << temp_shift
            q, f = d >> fb, d & ((1 << fb) - 1)
            j = f >> (fb - 4) if fb >= 4 else f << (4 - fb)
            vals.append(table[j] >> q if q < 62 else 0)
        ssum = sum(vals)
        for o, v in enumerate(vals):
            p = (v << 15) // ssum
            if o == y[n]:
                total += (1 << 15) - p
                p -= 1 << 15
            e[n, o] = p
    return e, total


def ref_quantize_error(e: np.ndarray, bits: int) -> np.ndarray:
    amax = (1 << (bits - 1)) - 1
    m = int(np.abs(e.astype(np.int64)).max()) if e.size else 0
    if m == 0:
        return np.zeros_like(e, dtype=np.int64)
    sh = ref_round_log2(m) - (bits - 1)
    return np.clip(ref_round_shift(e, sh), -amax, amax)


def ref_stoch_round_shift(v: np.ndarray, sh: int, key: int) -> np.ndarray:
    """v / 2^sh stochastically rounded, element j drawing rand62(key, j)."""
    v = np.asarray(v, dtype=np.int64)
    if sh <= 0:
        return v << (-sh)
    av = np.abs(v)
    if sh > 62:
        av = av >> (sh - 62)
        sh = 62
    fl = av >> sh
    fr = av - (fl << sh)
    r = ref_rand62(key, v.size) >> (62 - sh)
    fl = fl + ((fr > 0) & (r < fr))
    return np.where(v < 0, -fl, fl)


def ref_update(w, g, lr_log2, wmax, key, extra=None, extra_shift=-1, key2=0):
    """Flat arrays in the engine's counter order; returns the new weights (int64)."""
    w = w.astype(np.int64)
    m = int(np.abs(g.astype(np.int64)).max()) if g.size else 0
    if m > 0:
        w = w - ref_stoch_round_shift(g, ref_round_log2(m) - lr_log2, key)
    if extra_shift >= 0:
        w = w - ref_stoch_round_shift(extra, extra_shift, key2)
    return np.clip(w, -wmax, wmax)


def ref_ternary(w: np.ndarray, thr: int) -> np.ndarray:
    return np.where(w > thr, 1, np.where(w < -thr, -1, 0)).astype(np.int64)


def to_kernel_layout(kind: str, g: np.ndarray, perm: np.ndarray | None) -> np.ndarray:
    if kind == "conv":
        return g.transpose(2, 3, 1, 0)
    return g[:, perm] if perm is not None else g


def ref_train_step(spec: ModelSpec, bits: int, weights: list[np.ndarray], x: np.ndarray,
                   y: np.ndarray, lr_log2: int, seed: int, step: int, loss: str = "sse",
                   temp_shift: int = 5) -> dict:
    """One integer training step in NCHW; weights are spec-layout grid integers."""
    amax = act_max(bits)
    wmax = weight_max(bits)
    thr = grid_scale(bits) // 4
    alphas = alpha_shifts(spec)
    tern = [ref_ternary(w.astype(np.int64), thr) for w in weights]
    acts = [x.astype(np.int64)]
    pools = {}
    layers = spec.layers
    p = 0
    pidx = {}
    for i, layer in enumerate(layers):
        a = acts[-1]
        if isinstance(layer, Conv2d):
            acc = ref_conv(a, tern[p], layer.stride, layer.padding)
            acts.append(ref_finish(acc, 1 + alphas[p], amax, False))
            pidx[i] = p
            p += 1
        elif isinstance(layer, Linear):
            acc = a @ tern[p].T
            acts.append(ref_finish(acc, 1 + alphas[p], amax, False))
            pidx[i] = p
            p += 1
        elif isinstance(layer, ReLU):
            acts.append(np.maximum(a, 0))
        elif isinstance(layer, MaxPool2d):
            out, src = ref_pool(a, layer.kernel, layer.step, layer.padding)
            pools[i] = src
            acts.append(out)
        elif isinstance(layer, Flatten):
            acts.append(a.reshape(a.shape[0], -1))
    z = acts[-1]
    if loss == "sse":
        e = z.copy()
        e[np.arange(len(y)), y] -= amax
        sse = int((e * e).sum())
    else:
        e, sse = ref_softmax_error(z, y, bits, temp_shift)
    new_w = [w.astype(np.int64).copy() for w in weights]
    eqs, grads = {}, {}
    first_param = min(pidx)
    perm = None
    for i in range(len(layers) - 1, -1, -1):
        layer = layers[i]
        if i < first_param:
            break
        if isinstance(layer, ReLU):
            e = np.where(acts[i + 1] > 0, e, 0)
        elif isinstance(layer, Flatten):
            e = e.reshape(acts[i].shape)
        elif isinstance(layer, MaxPool2d):
            e = ref_pool_back(e, pools[i], acts[i].shape)
        else:
            pi = pidx[i]
            eq = ref_quantize_error(e, bits)
            eqs[pi] = eq
            if isinstance(layer, Conv2d):
                g = ref_conv_wgrad(eq, acts[i], layer.stride, layer.padding, layer.kernel)
                e = ref_conv_back_data(eq, tern[pi], layer.stride, layer.padding, acts[i].shape)
                kind = "conv"
                perm = None
            else:
                g = eq.T @ acts[i]
                e = eq @ tern[pi]
                kind = "linear"
                perm = None
                if i > 0 and isinstance(layers[i - 1], Flatten) and acts[i - 1].ndim == 4:
                    c, h, w = acts[i - 1].shape[1:]
                    perm = np.arange(c * h * w).reshape(c, h, w).transpose(1, 2, 0).ravel()
            grads[pi] = g
            gk = to_kernel_layout(kind, g, perm)
            wk = to_kernel_layout(kind, new_w[pi], perm)
            key = ref_stream_key(seed, step, pi, 0)
            upd = ref_update(wk.ravel(), gk.ravel(), lr_log2, wmax, key).reshape(wk.shape)
            if kind == "conv":
                new_w[pi] = upd.transpose(3, 2, 0, 1)
            elif perm is not None:
                back = np.empty_like(upd)
                back[:, perm] = upd
                new_w[pi] = back
            else:
                new_w[pi] = upd
    return {"acts": acts, "sse": sse, "eq": eqs, "grads": grads, "weights": new_w}


# ----------------------------------------------------------------------------- helpers


def tiny_spec() -> ModelSpec:
    """Conv with padding, overlapping padded max-pool, strided conv, padded pool,
    stand-alone ReLU after a pool, flatten, two linears (the last without ReLU)."""
    return ModelSpec("tiny", (3, 9, 9), (
        Conv2d("c1", 3, 8, 3, padding=1), ReLU("r1"), MaxPool2d("p1", 3, 2, 1),
        Conv2d("c2", 8, 6, 3, stride=2, padding=1), MaxPool2d("p2", 2, padding=1),
        ReLU("r2"), Flatten("flat"), Linear("f1", 24, 12), ReLU("r3"), Linear("f2", 12, 5),
    ), 5)


def random_grid_weights(spec, bits, rng):
    wmax = weight_max(bits)
    return [rng.integers(-wmax, wmax + 1, size=s).astype(np.int64) for s in spec.param_shapes()]


def nchw(a):
    return a.transpose(0, 3, 1, 2) if a.ndim == 4 else a


BITS = [6, 8, 16]
LOW_BITS = [2, 3, 4, 12]


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("m", [1, 2, 3, 5, 7, 181, 182, 1023, 1449, 1 << 40, (1 << 62) + 12345,
                               (1 << 63) - 1])
def test_round_log2_matches_python_integers(m):
    assert K.round_log2(m) == ref_round_log2(m)


def test_round_log2_random():
    rng = np.random.default_rng(1)
    for m in rng.integers(1, 1 << 62, 2000):
        assert K.round_log2(int(m)) == ref_round_log2(int(m))


def test_random_stream_matches_reference():
    key = K.stream_key(7, 123, 2, 0)
    assert key & M64 == ref_stream_key(7, 123, 2, 0)
    draws = np.array([K.rand62(key, j) for j in range(257)])
    assert np.array_equal(draws, ref_rand62(key, 257))
    assert draws.min() >= 0 and draws.max() < (1 << 62)
    # roughly uniform: the top bit is set about half the time
    assert 0.4 < np.mean(ref_rand62(key, 20000) >> 61) < 0.6


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("stride,pad,k", [(1, 1, 3), (2, 1, 3), (1, 0, 5), (2, 2, 5), (3, 1, 2)])
def test_conv_forward_matches_reference(bits, stride, pad, k):
    rng = np.random.default_rng(bits * 100 + stride * 10 + pad)
    amax = act_max(bits)
    a = rng.integers(-amax, amax + 1, size=(3, 5, 9, 8))   # NCHW
    t = rng.integers(-1, 2, size=(7, 5, k, k))
    dt = np.int8 if bits <= 8 else np.int16
    saturated = False
    for shift in (0, 3):
        for relu in (False, True):
            ref = ref_finish(ref_conv(a, t, stride, pad), shift, amax, relu)
            out = np.zeros((3, ref.shape[2], ref.shape[3], 7), dt)
            K.conv_forward(np.ascontiguousarray(a.transpose(0, 2, 3, 1)).astype(dt),
                           np.ascontiguousarray(t.transpose(2, 3, 1, 0)).astype(np.int8),
                           stride, pad, shift, amax, relu, out, np.zeros(7, np.int32))
            assert np.array_equal(nchw(out), ref)
            # the pixel-vectorized variant: 2 samples per im2col group, blocks of 13 pixels
            out2 = np.zeros_like(out)
            ho, wo = ref.shape[2], ref.shape[3]
            K.conv_forward_col(np.ascontiguousarray(a.transpose(0, 2, 3, 1)).astype(dt),
                               np.ascontiguousarray(t.transpose(0, 2, 3, 1)).astype(np.int8),
                               stride, pad, shift, amax, relu, out2,
                               np.zeros((k * k * 5, 2 * ho * wo), dt), np.zeros(13, np.int32),
                               np.zeros(13 if bits <= 8 else 0, np.int16), np.zeros((7, 13), dt))
            assert np.array_equal(out2, out)
            if stride == 1:  # the padded-plane variant: ternary runs, blocks of 11 positions
                out3 = np.zeros_like(out)
                t_o = np.ascontiguousarray(t.transpose(0, 2, 3, 1)).astype(np.int8)
                lst = np.full((7, k * k * 5 + 1), -1, np.int32)
                cnt = np.zeros((7, 2), np.int32)
                K.ternary_lists(t_o, lst, cnt)
                assert np.array_equal(cnt[:, 1], (t != 0).reshape(7, -1).sum(axis=1))
                plane = np.full((5, plane_len(3, 9, 8, pad)), 99, dt)
                a_k = np.ascontiguousarray(a.transpose(0, 2, 3, 1)).astype(dt)
                for n0, n1 in ((0, 3), (0, 2), (2, 3)):  # sample ranges (threads) as well
                    K.conv_forward_plane(a_k, lst, cnt, k, pad, shift, amax, relu, out3, plane,
                                         np.zeros(k * k * 5, np.int32), np.zeros(11, np.int32),
                                         np.zeros(11 if bits <= 8 else 0, np.int16),
                                         np.zeros((7, 11), dt), n0, n1)
                assert np.array_equal(out3, out)
            saturated |= bool((np.abs(ref) == amax).any())
            if relu:
                assert (ref == 0).any()
    assert saturated, "saturation must be exercised"


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("k,stride,pad", [(2, 2, 0), (2, 2, 1), (3, 2, 1), (3, 1, 1), (3, 3, 0)])
def test_maxpool_forward_backward_with_ties(bits, k, stride, pad):
    rng = np.random.default_rng(k * 31 + stride * 7 + pad + bits)
    a = rng.integers(0, 3, size=(2, 4, 7, 6))  # tiny range: many ties
    a[0, 1] = 0  # windows whose maximum is 0
    out_ref, src = ref_pool(a, k, stride, pad)
    dt = np.int8 if bits <= 8 else np.int16
    ho, wo = out_ref.shape[2:]
    out = np.zeros((2, ho, wo, 4), dt)
    win = np.zeros((2, ho, wo, 4), np.int8)
    a_k = np.ascontiguousarray(a.transpose(0, 2, 3, 1)).astype(dt)
    K.maxpool_forward(a_k, k, stride, pad, out, win, True, False, 0, 1)  # two sample ranges
    K.maxpool_forward(a_k, k, stride, pad, out, win, True, False, 1, 2)
    assert np.array_equal(nchw(out), out_ref)
    assert win.min() >= 0 and win.max() < k * k
    out2 = np.zeros_like(out)
    K.maxpool_forward(a_k, k, stride, pad, out2, np.zeros((1, 1, 1, 1), np.int8), False, False, 0,
                      2)
    assert np.array_equal(out2, out)
    e = rng.integers(-50, 51, size=out_ref.shape)
    e_k = np.ascontiguousarray(e.transpose(0, 2, 3, 1)).astype(np.int32)
    back = np.full((2, 7, 6, 4), 9, np.int32)
    rdst, rval = np.zeros(6 * 4, np.int32), np.zeros(6 * 4, np.int32)
    K.maxpool_backward(e_k, win, k, stride, pad, back, rdst, rval)
    assert np.array_equal(nchw(back), ref_pool_back(e, src, a.shape))
    # after a ReLU: a window whose maximum is 0 routes nothing (the ReLU would zero it)
    win_r = np.zeros_like(win)
    K.maxpool_forward(a_k, k, stride, pad, out2, win_r, True, True, 0, 2)
    assert np.array_equal(win_r, np.where(out > 0, win, -1)) and (win_r < 0).any()
    K.maxpool_backward(e_k, win_r, k, stride, pad, back, rdst, rval)
    masked = np.where(a > 0, ref_pool_back(e, src, a.shape), 0)
    assert np.array_equal(nchw(back), masked)
    if k <= stride:  # routed and quantized in one pass
        for scale in (3, 50, 5000):
            e2 = rng.integers(-scale, scale + 1, size=e_k.shape).astype(np.int32)
            eq = np.full(a_k.shape, 5, dt)  # NHWC offsets
            kq = K.pool_error_quantize(e2, win_r, k, stride, pad, bits, eq, 7 * 6 * 4, 6 * 4, 4,
                                       1, rdst, rval)
            routed = np.where(a > 0, ref_pool_back(nchw(e2), src, a.shape), 0)
            assert np.array_equal(nchw(eq), ref_quantize_error(routed, bits))
            assert kq == (ref_round_log2(int(np.abs(routed).max())) if routed.any() else -1)
            eqp = np.full((4, 2, 9, 8), 5, dt)  # channel-major, rows of 8, samples of 9 rows
            K.pool_error_quantize(e2, win_r, k, stride, pad, bits, eqp, 9 * 8, 8, 1, 2 * 9 * 8,
                                  rdst, rval)
            assert np.array_equal(eqp[:, :, :7, :6].transpose(1, 0, 2, 3), nchw(eq))
            assert not eqp[:, :, 7:].any() and not eqp[:, :, :, 6:].any()
            # the batch's scale, then each sample on its own (as threads split it): the same
            assert K.pool_error_scale(e2, win_r) == kq
            for buf, strides in ((eq, (7 * 6 * 4, 6 * 4, 4, 1)), (eqp, (9 * 8, 8, 1, 2 * 9 * 8))):
                parts = np.full_like(buf, 7)
                for n0 in (1, 0):
                    K.pool_error_route(e2, win_r, k, stride, pad, bits, kq, parts, *strides, rdst,
                                       rval, n0, n0 + 1)
                assert np.array_equal(parts, buf)


@pytest.mark.parametrize("bits", BITS)
def test_quantize_error_matches_reference(bits):
    rng = np.random.default_rng(bits)
    dt = np.int8 if bits <= 8 else np.int16
    clipped = False
    # scale < 2^(s-1) exercises the left shift; max|e| just under 2^(k+1/2) the clipping
    for scale in (3, 100, 1440, 5000, 1 << 24):
        e = rng.integers(-scale, scale + 1, size=997).astype(np.int32)
        e[0] = scale
        out = np.zeros(997, dt)
        k = K.quantize_error(e, bits, out)
        assert k == ref_round_log2(int(np.abs(e).max()))
        ref = ref_quantize_error(e, bits)
        assert np.array_equal(out, ref)
        clipped |= bool((np.abs(ref) == act_max(bits)).any())
        act = rng.integers(-2, 3, size=997).astype(dt)
        out_m = np.zeros(997, dt)
        e_m = e.copy()
        k_m = K.mask_quantize_error(e_m, act, bits, out_m)
        masked = np.where(act > 0, e, 0)
        assert np.array_equal(out_m, ref_quantize_error(masked, bits))
        assert np.array_equal(e_m, masked)
        assert k_m == ref_round_log2(int(np.abs(masked).max()))
    assert clipped, "clipping must be exercised"
    zero = np.zeros(10, np.int32)
    out = np.ones(10, dt)
    assert K.quantize_error(zero, bits, out) == -1 and not out.any()
    out = np.ones(10, dt)
    assert K.mask_quantize_error(np.ones(10, np.int32), zero, bits, out) == -1 and not out.any()


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("stride,pad,k", [(1, 1, 3), (2, 1, 3), (1, 2, 5)])
def test_conv_backward_kernels_match_reference(bits, stride, pad, k):
    rng = np.random.default_rng(bits + stride * 3 + pad * 11 + k)
    amax = act_max(bits)
    dt = np.int8 if bits <= 8 else np.int16
    a = rng.integers(0, amax + 1, size=(4, 3, 8, 7))
    t = rng.integers(-1, 2, size=(5, 3, k, k))
    ho = (8 + 2 * pad - k) // stride + 1
    wo = (7 + 2 * pad - k) // stride + 1
    eq = rng.integers(-amax, amax + 1, size=(4, 5, ho, wo))
    eq[rng.random(eq.shape) < 0.4] = 0
    a_k = np.ascontiguousarray(a.transpose(0, 2, 3, 1)).astype(dt)
    eq_k = np.ascontiguousarray(eq.transpose(0, 2, 3, 1)).astype(dt)
    t_k = np.ascontiguousarray(t.transpose(0, 2, 3, 1)).astype(np.int8)
    back = np.zeros((4, 8, 7, 3), np.int32)
    K.conv_backward_data(eq_k, t_k, stride, pad, back, np.zeros(k * k * 3, np.int32))
    assert np.array_equal(nchw(back), ref_conv_back_data(eq, t, stride, pad, a.shape))
    if 5 * amax <= 32767:  # int16 per-pixel sums (O * amax fits)
        back16 = np.full((4, 8, 7, 3), 7, np.int32)
        for n0, n1 in ((0, 1), (1, 4)):  # two sample ranges
            K.conv_backward_data_narrow(eq_k, t_k, stride, pad, back16,
                                        np.zeros(k * k * 3, np.int16), np.zeros(9, np.int32),
                                        np.zeros(9, np.int32), n0, n1)
        assert np.array_equal(back16, back)
    for gdt in ((np.int32, np.int64) if bits <= 8 else (np.int64,)):  # int32 when it fits
        g = np.zeros((k, k, 3, 5), gdt)
        K.conv_weight_grad(eq_k, a_k, stride, pad, g, np.zeros(5, gdt))
        assert np.array_equal(g.transpose(3, 2, 0, 1), ref_conv_wgrad(eq, a, stride, pad, k))
        # driven by the non-zero errors (odd and even counts per output channel)
        for e_k in (eq_k, np.where(np.arange(5) == 2, 0, eq_k).astype(dt)):
            g = np.full((k, k, 3, 5), 3, gdt)
            a_pad = np.full((4, 8 + 2 * pad, 7 + 2 * pad, 3), 9, dt)
            K.pad_nhwc(a_k, pad, a_pad, 0, 3)
            K.pad_nhwc(a_k, pad, a_pad, 3, 4)
            gt = np.full((5, k * k * 3), 9, gdt)
            gmax = max(K.conv_weight_grad_sparse(e_k, a_pad, stride, g, gt,
                                                 np.zeros(4 * ho * wo + 4, np.int32),
                                                 np.zeros(4 * ho * wo + 4, np.int32), o0, o1)
                       for o0, o1 in ((0, 2), (2, 5)))  # output channels in two parts
            want = ref_conv_wgrad(nchw(e_k).astype(np.int64), a, stride, pad, k)
            assert np.array_equal(g.transpose(3, 2, 0, 1), want)
            assert gmax == np.abs(want).max()
    if bits <= 8:  # the int32 dot-product kernel, two samples per im2col group
        g = np.zeros((k, k, 3, 5), np.int32)
        cols = 2 * ho * wo
        K.conv_weight_grad_dot(eq_k, a_k, stride, pad, g, np.zeros((k * k * 3, cols), dt),
                               np.zeros((5, cols), dt), False)
        assert np.array_equal(g.transpose(3, 2, 0, 1), ref_conv_wgrad(eq, a, stride, pad, k))
        if stride == 1:  # the plane the forward left against the errors at plane positions
            wp, hs = 7 + pad, (8 + pad) * (7 + pad)
            plane = np.full((3, plane_len(4, 8, 7, pad)), 99, dt)
            t_o = rng.integers(-1, 2, size=(2, k, k, 3)).astype(np.int8)
            lst = np.zeros((2, k * k * 3 + 1), np.int32)
            cnt = np.zeros((2, 2), np.int32)
            offs = np.zeros(k * k * 3, np.int32)
            K.ternary_lists(t_o, lst, cnt)
            K.conv_forward_plane(a_k, lst, cnt, k, pad, 0, amax, True,
                                 np.zeros((4, ho, wo, 2), dt), plane, offs,
                                 np.zeros(16, np.int32), np.zeros(16, np.int16),
                                 np.zeros((2, 16), dt), 0, 4)
            eqp = np.full((5, 4 * hs), 5, dt)
            K.eq_to_planar(eq_k, wp, hs, eqp, 0, 2)
            K.eq_to_planar(eq_k, wp, hs, eqp, 2, 4)
            g = np.full((k, k, 3, 5), 7, np.int32)
            n_pos = 3 * hs + (ho - 1) * wp + wo
            gmax = max(K.conv_weight_grad_plane(eqp, plane, offs, n_pos, g, r0, r1)
                       for r0, r1 in ((0, 7), (7, k * k * 3)))  # weight rows in two parts
            want = ref_conv_wgrad(eq, a, stride, pad, k)
            assert np.array_equal(g.transpose(3, 2, 0, 1), want)
            assert gmax == np.abs(want).max()


@pytest.mark.parametrize("bits", BITS)
def test_linear_kernels_match_reference(bits):
    rng = np.random.default_rng(bits + 99)
    amax = act_max(bits)
    dt = np.int8 if bits <= 8 else np.int16
    a = rng.integers(-amax, amax + 1, size=(6, 600))
    a[rng.random(a.shape) < 0.4] = 0  # zero inputs are skipped
    a[0] = amax  # > 256 non-zero inputs in a row: the int16 partial sums are flushed
    t = rng.integers(-1, 2, size=(11, 600))
    t_k = np.ascontiguousarray(t.T).astype(np.int8)  # stored [F, O]
    idx, val = np.zeros(600, np.int32), np.zeros(600, np.int32)
    for n in (6, 5):  # an odd number of samples: one left after the pairs
        for shift, relu in ((3, True), (9, False)):
            out = np.zeros((n, 11), dt)
            for n0, n1 in ((0, 2), (2, n)):
                K.linear_forward(a[:n].astype(dt), t_k, shift, amax, relu, out,
                                 np.full(11, 5, np.int32),
                                 np.full(11 if bits <= 8 else 0, 5, np.int16), idx, val, n0, n1)
            assert np.array_equal(out, ref_finish(a[:n] @ t.T, shift, amax, relu))
    eq = rng.integers(-amax, amax + 1, size=(6, 11))
    eq[rng.random(eq.shape) < 0.3] = 0  # odd and even numbers of non-zero errors
    for masked in (False, True):
        back = np.full((6, 600), 3, np.int32)
        for n0, n1 in ((0, 3), (3, 6)):
            K.linear_backward_data(eq.astype(dt), t_k, a.astype(dt), masked, back, idx, n0, n1)
        want = eq @ t
        assert np.array_equal(back, np.where(a > 0, want, 0) if masked else want)
    for gdt in ((np.int32, np.int64) if bits <= 8 else (np.int64,)):
        g = np.full((600, 11), 3, gdt)
        a_t = np.zeros((600, 6), dt)
        gmax = max(K.linear_weight_grad(eq.astype(dt), a.astype(dt), g, idx, val, a_t, f0, f1)
                   for f0, f1 in ((0, 333), (333, 600)))
        assert np.array_equal(g, a.T @ eq) and gmax == np.abs(a.T @ eq).max()


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("lr_log2", [-3, 0, 3, 11, 40])
def test_update_matches_reference(bits, lr_log2):
    rng = np.random.default_rng(bits * 7 + lr_log2 + 50)
    wmax = weight_max(bits)
    thr = grid_scale(bits) // 4
    wdt = np.int8 if bits <= 8 else np.int16
    w = rng.integers(-wmax, wmax + 1, size=1500).astype(wdt)
    g = rng.integers(-(1 << 20), (1 << 20) + 1, size=1500).astype(np.int64)
    key = K.stream_key(bits, lr_log2, 1, 0)
    w_new = w.copy()
    t = np.zeros(1500, np.int8)
    for i0, i1 in ((0, 512), (512, 1500)):  # two parts, the first a multiple of 256
        K.sgd_update(w_new, g, int(np.abs(g).max()), lr_log2, wmax, thr, key, t,
                     np.zeros(0, np.int64), -1, key, 0, 0, i0, i1)
    ref = ref_update(w, g, lr_log2, wmax, key)
    assert np.array_equal(w_new, ref)
    assert np.array_equal(t, ref_ternary(ref, thr))
    # stored [F, O] = [30, 50] with the counter running over [O, F]; max |g| passed in
    w_t = np.ascontiguousarray(w.reshape(50, 30).T)
    g_t = np.ascontiguousarray(g.reshape(50, 30).T)
    t_t = np.zeros(1500, np.int8)
    for i0, i1 in ((0, 650), (650, 1500)):  # rows of 50
        K.sgd_update(w_t.reshape(-1), g_t.reshape(-1), int(np.abs(g).max()), lr_log2, wmax, thr,
                     key, t_t, np.zeros(0, np.int64), -1, key, 30, 50, i0, i1)
    assert np.array_equal(w_t.T.reshape(-1), ref)
    assert np.array_equal(t_t.reshape(30, 50).T.reshape(-1), ref_ternary(ref, thr))
    if lr_log2 >= 11:
        assert (np.abs(ref) == wmax).any(), "weight clipping must be exercised"


def test_update_huge_gradients_and_extra_term():
    """|G| near 2^62 with a small eta (shift > 62) and the FedProx/FedFOR fixed-point term."""
    rng = np.random.default_rng(5)
    w = rng.integers(-64, 65, size=300).astype(np.int8)
    g = rng.integers(-(1 << 62), 1 << 62, size=300).astype(np.int64)
    extra = rng.integers(-(1 << 30), 1 << 30, size=300).astype(np.int64)
    key, key2 = K.stream_key(1, 2, 3, 0), K.stream_key(1, 2, 3, 1)
    t = np.zeros(300, np.int8)
    w_new = w.copy()
    K.sgd_update(w_new, g, -1, -3, 64, 32, key, t, extra, 20, key2, 0, 0, 0, 300)
    want = ref_update(w, g, -3, 64, key, extra, 20, key2)
    assert np.array_equal(w_new, want)
    # the general loop in the [F, O] storage order: same draws per canonical index
    w_t = np.ascontiguousarray(w.reshape(20, 15).T)
    K.sgd_update(w_t.reshape(-1), np.ascontiguousarray(g.reshape(20, 15).T).reshape(-1), -1, -3,
                 64, 32, key, t, np.ascontiguousarray(extra.reshape(20, 15).T).reshape(-1), 20,
                 key2, 15, 20, 0, 300)
    assert np.array_equal(w_t.T.reshape(-1), want)


def test_stochastic_rounding_is_unbiased():
    """E[stoch_round(g * eta / 2^k)] = g * eta / 2^k (truncation toward zero, never floor)."""
    g = np.full(200_000, -3, np.int64)
    g[0] = -16  # max |g| = 16 -> k = 4; eta = 1 -> each element moves 3/16 LSB on average
    w = np.zeros(g.size, np.int8)
    t = np.zeros(g.size, np.int8)
    K.sgd_update(w, g, -1, 0, 64, 32, K.stream_key(0, 0, 0, 0), t, np.zeros(0, np.int64), -1, 0,
                 0, 0, 0, g.size)
    mean = w[1:].astype(np.float64).mean()
    assert abs(mean - 3 / 16) < 0.005
    assert set(np.unique(w[1:])) <= {0, 1}


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("temp_shift", [0, 3, 5, 9])
def test_softmax_error_matches_reference(bits, temp_shift):
    rng = np.random.default_rng(bits * 13 + temp_shift)
    amax = act_max(bits)
    z = rng.integers(-amax, amax + 1, size=(9, 10))
    z[0] = 0                      # uniform row
    z[1, 3] = amax                # one dominant logit
    z[1, :3] = -amax
    y = rng.integers(0, 10, size=9).astype(np.int64)
    dt = np.int8 if bits <= 8 else np.int16
    e = np.zeros((9, 10), np.int32)
    total = K.softmax_error(z.astype(dt), y, bits, temp_shift, e)
    ref_e, ref_total = ref_softmax_error(z, y, bits, temp_shift)
    assert np.array_equal(e, ref_e) and total == ref_total
    p = e.astype(np.int64)
    p[np.arange(9), y] += 1 << 15
    assert (p >= 0).all() and (p.sum(axis=1) <= 1 << 15).all()
    assert (p.sum(axis=1) > (1 << 15) - 11).all()  # floor loses < 1 per class


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("lr_log2,loss", [(3, "ce"), (3, "sse"), (30, "ce"), (30, "sse")])
def test_training_step_matches_reference(bits, lr_log2, loss):
    spec = tiny_spec()
    rng = np.random.default_rng(bits + lr_log2)
    amax = act_max(bits)
    weights = random_grid_weights(spec, bits, rng)
    n = 6
    x = rng.integers(0, amax + 1, size=(n, 3, 9, 9))
    y = rng.integers(0, 5, size=n).astype(np.int64)
    seed, step = 11, 4
    ref = ref_train_step(spec, bits, weights, x, y, lr_log2, seed, step, loss, 5)

    model = IntModel(spec, bits, loss=loss, ce_temp_shift=5)
    model.load_int([w.astype(model.wdtype) for w in weights])
    ws = model.workspace(8)
    ws.x[:n] = x.transpose(0, 2, 3, 1)
    # forward, layer by layer (ReLU after a conv/linear is fused into it)
    model.forward(ws, n)
    layer_out = {op.layer.name: ws.acts[i][:n] for i, op in enumerate(model.ops)}
    for i, layer in enumerate(spec.layers):
        if layer.name in layer_out and not isinstance(layer, Flatten):  # (h, w, c) inside
            expect = ref["acts"][i + 1]
            nxt = spec.layers[i + 1] if i + 1 < len(spec.layers) else None
            if isinstance(layer, (Conv2d, Linear)) and isinstance(nxt, ReLU):
                expect = ref["acts"][i + 2]
            assert np.array_equal(nchw(layer_out[layer.name]), expect), layer.name
    # a full step: loss, quantized errors, updated weights
    sse = model.train_step(ws, y, n, lr_log2, seed, step)
    assert sse == ref["sse"]
    for op in model.param_ops:
        i = model.ops.index(op)
        assert np.array_equal(nchw(model.quantized_error(ws, i, n)), ref["eq"][op.param]), \
            op.layer.name
    for got, want in zip_strict(model.int_weights(), ref["weights"]):
        assert np.array_equal(got, want)
    changed = sum(int((g != w).sum()) for g, w in zip_strict(model.int_weights(), weights))
    assert changed > 0
    # the first conv's gradient is the last one the step computed
    first = model.param_ops[0]
    g = ws.grads[first.param]
    assert np.array_equal(g.reshape(model.w[0].shape).transpose(3, 2, 0, 1), ref["grads"][0])


@pytest.mark.parametrize("name,kwargs", [("digits_cnn", {}), ("mlp", {}),
                                         ("vgg7_small", {"width": 0.0625, "image": 16}),
                                         ("fedshift_cnn", {})])
def test_zoo_models_step_matches_reference(name, kwargs):
    from firmware_models import get_spec

    spec = get_spec(name, **kwargs)
    bits = 8
    rng = np.random.default_rng(len(name))
    amax = act_max(bits)
    weights = random_grid_weights(spec, bits, rng)
    n = 3
    x = rng.integers(0, amax + 1, size=(n, *spec.input_shape))
    y = rng.integers(0, spec.num_classes, size=n).astype(np.int64)
    ref = ref_train_step(spec, bits, weights, x, y, 3, 2, 9)
    model = IntModel(spec, bits)
    model.load_int([w.astype(model.wdtype) for w in weights])
    ws = model.workspace(n)
    ws.x[:n] = x.transpose(0, 2, 3, 1) if x.ndim == 4 else x
    assert model.train_step(ws, y, n, 3, 2, 9) == ref["sse"]
    for got, want in zip_strict(model.int_weights(), ref["weights"]):
        assert np.array_equal(got, want)


@pytest.mark.parametrize("bits", LOW_BITS)
@pytest.mark.parametrize("loss", ["sse", "ce"])
def test_other_bitwidths_step_matches_reference(bits, loss):
    """s = 2, 3, 4 (activations of 1-3 magnitude bits, softmax fraction < 4 bits), 12."""
    spec = tiny_spec()
    rng = np.random.default_rng(bits * 5)
    amax = act_max(bits)
    weights = random_grid_weights(spec, bits, rng)
    x = rng.integers(0, amax + 1, size=(4, 3, 9, 9))
    y = rng.integers(0, 5, size=4).astype(np.int64)
    ref = ref_train_step(spec, bits, weights, x, y, 3, 1, 2, loss, 5)
    model = IntModel(spec, bits, loss=loss, ce_temp_shift=5)
    model.load_int([w.astype(model.wdtype) for w in weights])
    ws = model.workspace(4)
    ws.x[:4] = x.transpose(0, 2, 3, 1)
    assert model.train_step(ws, y, 4, 3, 1, 2) == ref["sse"]
    for got, want in zip_strict(model.int_weights(), ref["weights"]):
        assert np.array_equal(got, want)
