"""Compile a device's kernels before its first round (``fedbit-edge warmup``).

Numba compiles the integer engine's kernels the first time they run and caches the
machine code (``__pycache__`` beside the installed package, or numba's user-wide cache
when that is not writable, or ``NUMBA_CACHE_DIR``). On a Raspberry Pi the first
compilation takes minutes; run once at install time (``fedbit-edge warmup --profile``,
which the systemd service's ``ExecStartPre`` does too), every later start loads the cache
in about a second. Warming runs the code a round runs: one training step of the profile's
bitwidth on random data, the profile's uplink encoding, and its decode.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from hw_profiles import HardwareProfile


@dataclass(frozen=True)
class WarmupReport:
    """What :func:`warm_up` did: ``train_s`` / ``encode_s`` wall seconds of the first
    (compiling or cache-loading) training step and encoding; ``compiled`` False for a
    float device (torch, nothing to compile); ``engine``: where the step ran."""

    profile: str
    model: str
    bits: int
    train_s: float
    encode_s: float
    compiled: bool
    engine: str = "cpu"


def warm_up(profile: HardwareProfile, model: str = "digits_cnn", *, batch: int = 32, seed: int = 0,
            engine: str = "cpu") -> WarmupReport:
    """Run one training step (on ``engine``: ``"cpu"`` or ``"cuda"``, whose kernels
    numba-cuda caches alike) and one uplink encoding of ``model`` as ``profile`` would.
    Float devices (``trainer = "torch"``) have nothing to compile and return at once."""
    from firmware_models import resolve_model

    spec = resolve_model(model)
    if not profile.is_integer:
        return WarmupReport(profile.name, model, 32, 0.0, 0.0, compiled=False)
    from edge_client.codecs import decode
    from edge_client.data import Dataset
    from edge_client.runtime import encode_update_tensors
    from edge_client.trainers import IntTrainer

    rng = np.random.default_rng(seed)
    x = rng.random((batch, *spec.input_shape), dtype=np.float32)
    data = Dataset(x, rng.integers(0, spec.num_classes, batch).astype(np.int64))
    t0 = time.perf_counter()
    trainer = IntTrainer(spec, profile.compute_bits, seed=seed, engine=engine)
    trainer.train(data, steps=1, batch=batch)
    t1 = time.perf_counter()
    names = [f"p{i}" for i in range(len(spec.param_shapes()))]
    tensors = encode_update_tensors(trainer.to_shared(), names, profile.codec, profile.codec_bits,
                                    int_weights=trainer.int_weights(), compute_bits=profile.compute_bits,
                                    ternary_weights=trainer.ternary_weights())
    for t in tensors:
        decode(t)
    return WarmupReport(profile.name, model, profile.compute_bits, t1 - t0, time.perf_counter() - t1,
                        compiled=True, engine=engine)
