"""The AVX-512 VNNI kernels (edge_client.intnn.kernels.vnni) against the generic ones, bit
for bit: the conv forward, the plane weight gradient, and whole training runs with the
VNNI kernels on and off. Skipped, with the reason, on a CPU without the instruction."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import edge_client.intnn.allocation as W
from edge_client.compat import zip_strict
from edge_client.data import Dataset
from edge_client.intnn import IntModel, step
from edge_client.intnn import kernels as K
from edge_client.intnn.kernels import vnni as V
from edge_client.intnn.kernels import vnni_linear as VL
from edge_client.intnn.workspace import plane_len
from edge_client.trainers import IntTrainer
from firmware_models import Conv2d, Flatten, Linear, MaxPool2d, ModelSpec, ReLU, get_spec

needs_vnni = pytest.mark.skipif(not K.VNNI, reason="this CPU has no AVX-512 VNNI (the "
                                "generic kernels run; their tests cover them)")


def ternary(rng, shape, p_zero=0.4) -> np.ndarray:
    p = (1 - p_zero) / 2
    return rng.choice(np.array([-1, 0, 1], np.int8), size=shape, p=[p, p_zero, p])


@needs_vnni
@pytest.mark.parametrize("shift", [1, 2, 5, 9, 16, 22, 23])
def test_the_int32_lane_finish_equals_the_generic_one(shift):
    """_finish_fast (sixteen int32 lanes, |v| clamped first) against _finish_run (int64)
    on ties of both signs, the clamp's edges, int32's extremes, runs not a multiple of 16
    and offsets into both arrays, with and without ReLU, Int8 and Int6 clips."""
    from edge_client.intnn.kernels.conv_forward import _finish_run as generic

    finish = V._finish_fast
    rng = np.random.default_rng(shift)
    for amax in (127, 31):
        lim = (amax + 1) << shift
        half = 1 << (shift - 1)
        edges = [0, 1, -1, half, -half, half - 1, -(half - 1), 3 * half, -3 * half,
                 lim - 1, lim, lim + 1, -lim + 1, -lim, -lim - 1, lim - half, -(lim - half),
                 2 ** 31 - 1, -2 ** 31, 2 ** 31 - half, -2 ** 31 + half]
        src = np.concatenate([np.array(edges, np.int64),
                              rng.integers(-2 * lim, 2 * lim, 400)]).astype(np.int32)
        for relu in (True, False):
            for s0, d0, m in ((0, 0, src.size), (3, 5, src.size - 7), (1, 0, 16), (2, 1, 15)):
                want = np.full(src.size + 8, 77, np.int8)
                got = want.copy()
                generic(src, s0, want, d0, m, shift, amax, relu)
                finish(src, s0, got, d0, m, shift, amax, relu)
                assert np.array_equal(got, want), (amax, relu, s0, d0, m)


@needs_vnni
@pytest.mark.parametrize("case", range(12))
def test_the_vnni_conv_forward_equals_the_generic_one(case):
    rng = np.random.default_rng(case)
    n = int(rng.integers(1, 5))
    c = int(rng.choice([1, 3, 8, 16, 33]))
    o = int(rng.choice([1, 4, 6, 13, 32, 48, 64, 80, 112]))
    k = int(rng.choice([1, 3, 5]))
    stride = int(rng.choice([1, 2]))
    pad = int(rng.integers(0, k))
    h, w = int(rng.integers(k, 12)), int(rng.integers(k, 12))
    amax = 127 if case % 3 else 31
    a = rng.integers(-amax, amax + 1, (n, h, w, c)).astype(np.int8)
    if case % 4 == 0:
        a[a < 0] = 0  # after a ReLU
    t_kkco = ternary(rng, (k, k, c, o))
    tb = np.ascontiguousarray(t_kkco.transpose(3, 0, 1, 2))
    h_out = (h + 2 * pad - k) // stride + 1
    w_out = (w + 2 * pad - k) // stride + 1
    ng = -(-(k * c) // 4)  # groups of four bytes per kernel row
    n_op = V.padded(o, 16)
    tp = np.full((k * ng, n_op, 4), 9, np.int8)  # pad_rows clears the slack
    corr = np.full(n_op, 9, np.int32)
    V.pad_rows(tb, tp, corr)
    rows = tp.reshape(k, ng, n_op, 4).transpose(2, 0, 1, 3).reshape(n_op, k, 4 * ng)
    assert np.array_equal(rows[:o, :, :k * c], tb.reshape(o, k, k * c))
    assert not rows[o:].any() and not rows[:, :, k * c:].any()
    assert np.array_equal(corr[:o], 128 * tb.reshape(o, -1).sum(1)) and not corr[o:].any()
    for shift, relu in ((int(rng.integers(1, 9)), True), (int(rng.integers(1, 9)), False),
                        (0, False), (-1, False)):
        ref = np.zeros((n, h_out, w_out, o), np.int8)
        K.conv_forward(a, t_kkco, stride, pad, shift, amax, relu, ref, np.zeros(o, np.int32))
        for block in (4, 8, 64):
            out = np.full_like(ref, 55)
            acc = np.zeros(block * n_op, np.int32)
            size = n * (h + 2 * pad) * (w + 2 * pad) * c
            # 3 bytes after the padded input: a kernel row is read in groups of four
            a_pad = np.full(size + 4, 3, np.int8)[:size].reshape(n, h + 2 * pad, w + 2 * pad, c)
            for lo, hi in ((0, n // 2), (n // 2, n)):  # two threads' sample ranges
                V.conv_forward_vnni(a, tp, corr, k, stride, pad, shift, amax, relu, out, a_pad,
                                    acc, lo, hi)
            assert np.array_equal(out, ref), (case, shift, block)
            padded_ref = np.zeros_like(a_pad)
            K.pad_nhwc(a, pad, padded_ref, 0, n)  # what the weight gradient reads
            assert np.array_equal(a_pad, padded_ref)


@needs_vnni
@pytest.mark.parametrize("case", range(8))
def test_the_vnni_plane_weight_gradient_equals_the_generic_one(case):
    rng = np.random.default_rng(100 + case)
    n = int(rng.integers(1, 4))
    c = int(rng.choice([1, 3, 5]))
    o = int(rng.choice([1, 3, 4, 8, 11]))
    k = int(rng.choice([1, 3, 5]))
    pad = int(rng.integers(0, k))
    h, w = int(rng.integers(k, 20)), int(rng.integers(k, 20))
    wp, hs = w + pad, (h + pad) * (w + pad)
    h_out, w_out = h + 2 * pad - k + 1, w + 2 * pad - k + 1
    a = rng.integers(-127, 128, (n, h, w, c)).astype(np.int8)
    t = ternary(rng, (o, k, k, c))
    lst = np.zeros((o, k * k * c + 1), np.int32)
    cnt = np.zeros((o, 2), np.int32)
    K.ternary_lists(t, lst, cnt)
    # the plane forward writes the plane and the run offsets the gradient reads
    plane = np.zeros((c, plane_len(n, h, w, pad)), np.int8)
    offs = np.zeros(k * k * c, np.int32)
    K.conv_forward_plane(a, lst, cnt, k, pad, 3, 127, True,
                         np.zeros((n, h_out, w_out, o), np.int8), plane, offs,
                         np.zeros(64, np.int32), np.zeros(64, np.int16),
                         np.zeros((o, 64), np.int8), 0, n)
    plane2 = np.full_like(plane, 7)
    offs2 = np.zeros_like(offs)
    for lo, hi in ((0, n // 2), (n // 2, n)):
        V.plane_for_grad(a, k, pad, plane2, offs2, lo, hi)  # what the VNNI forward skips
    assert np.array_equal(plane2, plane) and np.array_equal(offs2, offs)
    n_pos = (n - 1) * hs + (h_out - 1) * wp + w_out
    eqp = np.zeros((o, n * hs), np.int8)
    e = rng.integers(-127, 128, (o, n, h_out, w_out)).astype(np.int8)
    e[rng.random(e.shape) < 0.6] = 0
    for s in range(n):
        for y in range(h_out):
            eqp[:, s * hs + y * wp: s * hs + y * wp + w_out] = e[:, s, y]
    rows = k * k * c
    ref = np.zeros((k, k, c, o), np.int32)
    gmax_ref = K.conv_weight_grad_plane(eqp, plane, offs, n_pos, ref, 0, rows)
    # dense check of the reference itself: G[r, o] = sum over pixels of a * e
    a_pad = np.pad(a.astype(np.int64), ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    dense = np.einsum("nyxkhc,onyx->khco", np.lib.stride_tricks.sliding_window_view(
        a_pad, (k, k), axis=(1, 2)).transpose(0, 1, 2, 4, 5, 3)[:, :h_out, :w_out],
        e.astype(np.int64))
    assert np.array_equal(ref, dense)
    got = np.full_like(ref, 77)
    split = (0, rows // 2 | 1, rows) if rows > 2 else (0, rows)  # odd boundaries too
    gmax = max(V.conv_weight_grad_plane_vnni(eqp, plane, offs, n_pos, got, lo, hi)
               for lo, hi in zip_strict(split[:-1], split[1:]))
    assert np.array_equal(got, ref) and gmax == gmax_ref


@needs_vnni
@pytest.mark.parametrize("case", range(10))
def test_the_vnni_conv_backward_data_equals_the_generic_one(case):
    """Strides, paddings (patches cut at every border), channel counts that are not
    multiples of 16 (plain-integer row tails) and over 64 outputs (two channel masks),
    errors of both signs with -128, all-zero pixels, two threads' sample ranges, stale
    output and scratch."""
    rng = np.random.default_rng(500 + case)
    n = int(rng.integers(1, 5))
    c = int(rng.choice([1, 3, 16, 32, 40]))
    o = int(rng.choice([1, 4, 13, 64, 70]))
    k = int(rng.choice([1, 3, 5]))
    stride = int(rng.choice([1, 2]))
    pad = int(rng.integers(0, k))
    h, w = int(rng.integers(k, 12)), int(rng.integers(k, 12))
    h_out = (h + 2 * pad - k) // stride + 1
    w_out = (w + 2 * pad - k) // stride + 1
    eq = rng.integers(-128, 128, (n, h_out, w_out, o)).astype(np.int8)
    eq[rng.random(eq.shape) < rng.choice([0.0, 0.5, 0.9])] = 0
    eq[0, 0, 0] = 0  # a pixel without errors
    tb = ternary(rng, (o, k, k, c))
    ref = np.zeros((n, h, w, c), np.int32)
    K.conv_backward_data(eq, tb, stride, pad, ref, np.zeros(k * k * c, np.int32))
    assert ref.any()
    got = np.full_like(ref, 5)
    split = (0, n // 2, n)
    for lo, hi in zip_strict(split[:-1], split[1:]):
        V.conv_backward_data_vnni(eq, tb, stride, pad, got, np.full(o + 4, 9, np.int32),
                                  np.full(o + 4, 9, np.int32), lo, hi)
    assert np.array_equal(got, ref), (case, n, c, o, k, stride, pad)


@needs_vnni
@pytest.mark.parametrize("case", range(9))
def test_the_vnni_error_driven_conv_gradient_equals_the_generic_one(case):
    rng = np.random.default_rng(300 + case)
    n = int(rng.integers(1, 6))
    c = int(rng.choice([4, 11, 16, 32]))
    o = int(rng.choice([1, 5, 16, 70]))  # 70: two blocks of channel masks
    k = int(rng.choice([3, 5]))  # K*C from 12 to 160: whole 16-byte chunks and tails
    if case == 8:  # K*C = 144: a call on five chunks of 16, then one on four
        c, k = 48, 3
    stride = int(rng.choice([1, 2]))
    pad = int(rng.integers(0, k))
    h, w = int(rng.integers(k, 14)), int(rng.integers(k, 14))
    h_out = (h + 2 * pad - k) // stride + 1
    w_out = (w + 2 * pad - k) // stride + 1
    a = rng.integers(-128, 128, (n, h, w, c)).astype(np.int8)
    eq = rng.integers(-127, 128, (n, h_out, w_out, o)).astype(np.int8)
    eq[rng.random(eq.shape) < 0.7] = 0
    a_pad = np.zeros((n, h + 2 * pad, w + 2 * pad, c), np.int8)
    K.pad_nhwc(a, pad, a_pad, 0, n)
    scratch = [np.zeros(n * h_out * w_out + 8, np.int32) for _ in range(2)]
    ref = np.zeros((k, k, c, o), np.int32)
    gmax_ref = K.conv_weight_grad_sparse(eq, a_pad, stride, ref, np.zeros((o, k * k * c),
                                         np.int32), *scratch, 0, o)
    dense = np.zeros((k, k, c, o), np.int64)
    for kh in range(k):
        for kw in range(k):
            win = a_pad[:, kh:kh + stride * h_out:stride, kw:kw + stride * w_out:stride]
            dense[kh, kw] = np.einsum("nyxc,nyxo->co", win.astype(np.int64),
                                      eq.astype(np.int64))
    assert np.array_equal(ref, dense)
    # the VNNI form's buckets: from the least scratch it takes (chunks of 5 pixels) up
    for size in (8 * min(64, o), int(rng.integers(8 * min(64, o), 40 * min(64, o))),
                 min(64, o) * (V.SPARSE_CHUNK + 4)):
        for parts in (((0, o),), ((0, o // 2), (o // 2, o))):  # one call; two threads'
            buckets = [np.full(size, 7, np.int32) for _ in range(2)]
            got = np.full_like(ref, 4)
            gt = np.full((o, k * k * c), 6, np.int32)
            gmax = max(V.conv_weight_grad_sparse_vnni(eq, a_pad, stride, got, gt, *buckets,
                                                      lo, hi) for lo, hi in parts)
            assert np.array_equal(got, ref) and gmax == gmax_ref, (size, parts)
    with pytest.raises(ValueError, match="under 8 per channel"):
        V.conv_weight_grad_sparse_vnni(eq, a_pad, stride, got, gt, np.zeros(7, np.int32),
                                       np.zeros(7, np.int32), 0, 1)


@needs_vnni
@pytest.mark.parametrize("case", range(8))
def test_the_vnni_linear_backward_data_equals_the_generic_one(case):
    rng = np.random.default_rng(200 + case)
    n = int(rng.integers(1, 9))
    f = int(rng.integers(1, 300))
    o = int(rng.choice([64, 70, 128, 200, 512]))
    t = ternary(rng, (f, o))
    eq = rng.integers(-127, 128, (n, o)).astype(np.int8)
    eq[rng.random(eq.shape) < 0.5] = 0
    a_in = rng.integers(-5, 6, (n, f)).astype(np.int8)
    for masked in (False, True):
        ref = np.zeros((n, f), np.int32)
        K.linear_backward_data(eq, t, a_in, masked, ref, np.zeros(f + 4, np.int32), 0, n)
        dense = eq.astype(np.int64) @ t.T.astype(np.int64)
        assert np.array_equal(ref, np.where(a_in > 0, dense, 0) if masked else dense)
        got = np.full_like(ref, 3)
        corr = np.zeros(n + 4, np.int32)
        for lo, hi in ((0, n // 2), (n // 2, n)):
            VL.linear_backward_data_vnni(eq, t, a_in, masked, got, corr, lo, hi)
        assert np.array_equal(got, ref), (case, masked)


@needs_vnni
@pytest.mark.parametrize("case", range(8))
def test_the_vnni_linear_forward_equals_the_generic_one(case):
    """Blocks of rows x up to 32 samples, non-zero inputs in fours (some blocks empty),
    outputs in 16-lane chunks and a tail (O 16 / 70 / 512), any int8 input, both parts of
    a two-thread split; bits 8 and 4 (shift, clip)."""
    rng = np.random.default_rng(300 + case)
    n = int(rng.choice([1, 5, 33, 40]))
    f = int(rng.choice([1, 37, 128, 129, 300, 4096]))
    o = int(rng.choice([16, 70, 512]))
    amax = 127 if case % 2 == 0 else 7
    t = ternary(rng, (f, o))
    a = rng.integers(-amax, amax + 1, (n, f)).astype(np.int8)
    a[rng.random(a.shape) < 0.6] = 0
    a[:, : min(f, 128) // 2] = 0  # a block's first half empty: rows skipped
    shift = int(rng.integers(0, 8))
    for relu in (False, True):
        ref = np.zeros((n, o), np.int8)
        K.linear_forward(a, t, shift, amax, relu, ref, np.zeros(o, np.int32),
                         np.zeros(o, np.int16), np.zeros(f + 4, np.int32),
                         np.zeros(f + 4, np.int32), 0, n)
        dense = a.astype(np.int64) @ t.astype(np.int64)
        half = np.int64(1) << max(shift - 1, 0)
        want = np.sign(dense) * ((np.abs(dense) + half) >> shift) if shift else dense
        want = np.clip(np.maximum(want, 0) if relu else want, -amax, amax)
        assert np.array_equal(ref, want)
        got = np.full_like(ref, 3)
        for lo, hi in ((0, n // 2), (n // 2, n)):
            VL.linear_forward_vnni(a, t, shift, amax, relu, got,
                                   np.full(VL.FORWARD_SAMPLES * o, 9, np.int32),
                                   np.full(min(f, VL.FORWARD_ROWS) + 4, 5, np.int32),
                                   np.full(min(f, VL.FORWARD_ROWS) + 4, 5, np.int32), lo, hi)
        assert np.array_equal(got, ref), (case, relu)


@needs_vnni
@pytest.mark.parametrize("n,f,o", [(32, 300, 512), (7, 33, 64), (13, 100, 128), (1, 5, 64)])
def test_the_vnni_linear_weight_gradient_equals_the_generic_one(n, f, o):
    rng = np.random.default_rng(n * f)
    a = rng.integers(-128, 128, (n, f)).astype(np.int8)
    a[rng.random(a.shape) < 0.5] = 0
    eq = rng.integers(-127, 128, (n, o)).astype(np.int8)
    ref = np.zeros((f, o), np.int32)
    gmax_ref = K.linear_weight_grad(eq, a, ref, np.zeros(n + 4, np.int32),
                                    np.zeros(n + 4, np.int32), np.zeros((f, n), np.int8), 0, f)
    assert np.array_equal(ref, a.T.astype(np.int64) @ eq.astype(np.int64))
    n4 = V.padded(n, 4)
    got = np.full_like(ref, 9)
    a_t = np.full((f, n4), 5, np.int8)  # stale bytes past n must not matter
    split = (0, f // 2 | 1, f) if f > 2 else (0, f)
    gmax = max(VL.linear_weight_grad_vnni(eq, a, got, a_t, np.full(n4 * o, 3, np.int8), lo, hi)
               for lo, hi in zip_strict(split[:-1], split[1:]))
    assert np.array_equal(got, ref) and gmax == gmax_ref


@needs_vnni
@pytest.mark.parametrize("n,f,o,sh", [(32, 301, 128, 9), (5, 8, 64, 1), (9, 40, 192, 62)])
def test_the_fused_linear_update_equals_gradient_then_update(n, f, o, sh):
    rng = np.random.default_rng(f)
    a = rng.integers(-128, 128, (n, f)).astype(np.int8)
    eq = rng.integers(-127, 128, (n, o)).astype(np.int8)
    w0 = rng.integers(-127, 128, (f, o)).astype(np.int8)
    g = a.T.astype(np.int64) @ eq.astype(np.int64)
    n4 = V.padded(n, 4)
    a_t, ep = np.zeros((f, n4), np.int8), np.zeros(n4 * o, np.int8)
    gmax = VL.linear_grad_max_vnni(eq, a, a_t, ep, 0, f)
    assert gmax == np.abs(g).max()
    w_ref, t_ref = w0.copy(), np.zeros((f, o), np.int8)
    key = int(K.stream_key(3, 7, 1, 0))
    # sgd_update's shift is round_log2(gmax) - lr_log2: pick lr_log2 for the wanted sh
    lr_log2 = int(K.round_log2(gmax)) - sh
    K.sgd_update(w_ref.reshape(-1), g.astype(np.int32).reshape(-1), gmax, lr_log2, 100, 20,
                 key, t_ref.reshape(-1), np.zeros(0, np.int64), -1, key, f, o, 0, f * o)
    w, t = w0.copy(), np.zeros((f, o), np.int8)
    for lo, hi in ((0, f // 2 | 1), (f // 2 | 1, f)):
        VL.linear_update_vnni(eq, a, a_t, ep, w.reshape(-1), t.reshape(-1), sh, 100, 20, key, f,
                             lo, hi)
    assert np.array_equal(w, w_ref) and np.array_equal(t, t_ref)


def small_cnn() -> ModelSpec:
    """A conv with K*C >= 32 (the VNNI forward) after a stride-1 3-channel conv (the plane
    forward, whose weight gradient runs on VNNI), an odd channel count, linears whose
    backward-data runs on VNNI (O >= 64, 70 not a multiple of 64), one whose weight
    gradient does too (O = 64) and one with neither (O = 10)."""
    return ModelSpec("vnni_cnn", (3, 12, 12), (
        Conv2d("c1", 3, 8, 5, padding=1), ReLU("r1"), MaxPool2d("p1", 2, padding=1),
        Conv2d("c2", 8, 13, 5, padding=1), ReLU("r2"), MaxPool2d("p2", 2),
        Flatten("f"), Linear("l1", 13 * 2 * 2, 70), ReLU("r3"), Linear("l2", 70, 64),
        ReLU("r4"), Linear("l3", 64, 10),
    ), 10)


def _train(spec: ModelSpec, bits: int, threads: int, d: Dataset) -> tuple[list, float, float]:
    tr = IntTrainer(spec, bits, seed=5, threads=threads)
    r = tr.train(d, steps=5, batch=16)
    _, acc = tr.evaluate(d)
    tr.model.close()
    return tr.int_weights(), r.loss, acc


@needs_vnni
@pytest.mark.parametrize("name,bits", [("small", 8), ("small", 6), ("digits_cnn", 8)])
def test_training_with_and_without_vnni_gives_the_same_weights(monkeypatch, name, bits):
    spec = small_cnn() if name == "small" else get_spec(name)
    rng = np.random.default_rng(bits)
    d = Dataset(rng.random((48, *spec.input_shape), dtype=np.float32),
                rng.integers(0, spec.num_classes, 48).astype(np.int64))
    on = IntModel(spec, bits)
    assert any(op.vnni for op in on.param_ops)  # a VNNI conv forward, a VNNI linear gradient
    assert any(lep is not None for lep in on.workspace(16).scratch[0].lep)
    with_vnni = _train(spec, bits, 1, d)
    monkeypatch.setattr(K, "VNNI", False)
    assert not any(op.vnni for op in IntModel(spec, bits).param_ops)
    without = _train(spec, bits, 1, d)
    assert with_vnni[1:] == without[1:]
    for a, b in zip_strict(with_vnni[0], without[0]):
        assert np.array_equal(a, b)
    monkeypatch.setattr(K, "VNNI", True)
    # split over two threads, every op (the linear update then makes its gradient again)
    monkeypatch.setattr(W, "SPLIT_MIN_MACS", 0)
    fused = []
    real = step._ParamBackward._fused_update
    monkeypatch.setattr(step._ParamBackward, "_fused_update",
                        lambda *a: fused.append(real(*a)) or fused[-1])
    two = _train(spec, bits, 2, d)
    assert any(fused)
    assert two[1:] == without[1:]
    for a, b in zip_strict(two[0], without[0]):
        assert np.array_equal(a, b)


def test_int16_activations_never_take_the_vnni_kernels():
    model = IntModel(small_cnn(), 12)
    assert not any(op.vnni for op in model.param_ops)
    assert all(tv is None for tv in model.tv)


def test_fedbit_no_vnni_turns_the_vnni_kernels_off():
    code = "from edge_client.intnn import kernels as K; print(K.VNNI)"
    env = dict(os.environ, FEDBIT_NO_VNNI="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
    env["FEDBIT_NO_VNNI"] = "0"  # "0" or unset: the CPU decides
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == str(V._target_has_vnni())
