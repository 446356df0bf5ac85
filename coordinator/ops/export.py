"""Export a run's global model for deployment: ONNX (``firmware_models.onnx_export``) or the
model message a device downloads (``global.msgpack``), in any bitwidth variant.

A run directory keeps the model of its last completed round (``checkpoint.msgpack``).
Variant ``int<s>`` is what an s-bit device runs (``from_shared(W, s)``, then the integer
graph, bit-exact with the Numba engine); ``float32`` is the shared model for float
devices. A grouped strategy's per-bitwidth model is exported for its group, as
``coordinator.variants`` sends it.

``export_run(run_dir)`` writes ``RUN_DIR/onnx/<variant>.onnx`` for float32 and every
bitwidth that took part in the run (the devices' hellos, the grouped models); ``fedbit
serve`` calls it when its run is complete (``fedbit export RUN_DIR --all`` does the same).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from coordinator.ops.rundir import coordinator_dir
from coordinator.state import Checkpoint, RunState, atomic_write
from edge_client.errors import ConfigError, FedbitError
from edge_client.protocol import (
    Limits,
    ModelMessage,
    encode_message,
    model_variant,
    tensors_digest,
    variant_bits,
)
from firmware_models import ModelSpec, SpecError, resolve_model

ONNX_DIR = "onnx"


def load_final(run_dir: str | Path, round_id: int | None = None) -> Checkpoint:
    """The checkpoint of a run directory (a ``serve --out`` folder or an emulated run
    folder, :func:`~coordinator.ops.rundir.coordinator_dir`); ConfigError when there is
    none, or when ``round_id`` is given and is not the completed round (only that model
    is kept)."""
    try:
        run = coordinator_dir(run_dir)
    except ConfigError as exc:
        raise ConfigError(f"{exc}; no checkpoint.msgpack to export") from None
    ckpt = RunState(run, durable=False).load_checkpoint()
    if ckpt is None:
        raise ConfigError(f"{run}: no checkpoint.msgpack (no round completed yet)")
    if round_id is not None and round_id != ckpt.completed_round:
        raise ConfigError(f"{run}: round {round_id} is not available; a run keeps the model "
                          f"of its last completed round ({ckpt.completed_round})")
    return ckpt


def _spec(ckpt: Checkpoint) -> ModelSpec:
    try:
        return resolve_model(ckpt.model)
    except SpecError as exc:
        raise ConfigError(f"checkpoint of job {ckpt.job}: {exc}") from None


def run_bitwidths(ckpt: Checkpoint, devices: dict | None = None) -> list[int]:
    """32 (float32) and every compute bitwidth of the run's devices (``devices``: the run's
    registry, ``RunState.load_devices()``; default the checkpoint's own, as older runs kept
    it) and grouped models, ascending (32 last)."""
    bits = {32} | {int(b) for b in ckpt.group_weights}
    for hello in (ckpt.devices if devices is None else devices).values():
        try:
            bits.add(variant_bits(model_variant(int(hello["compute_bits"]),
                                                str(hello["trainer"]))))
        except (KeyError, TypeError, ValueError):
            continue  # a malformed registry entry names no variant
    return sorted(bits)


def variant_weights(ckpt: Checkpoint, bits: int) -> list[np.ndarray]:
    """The shared-domain weights variant ``bits`` is built from (the group's own model
    under a grouped strategy, else the global one)."""
    ws = ckpt.group_weights.get(int(bits), ckpt.weights)
    return [np.asarray(w, dtype=np.float32) for w in ws]


def variant_name(bits: int) -> str:
    """``int<s>`` for 2 <= s <= 16, ``float32`` for 32; ConfigError otherwise."""
    if isinstance(bits, bool) or not (bits == 32 or 2 <= int(bits) <= 16):
        raise ConfigError(f"--bits must be 2..16 or 32 (float32), got {bits}")
    return model_variant(int(bits), "int")


def export_model(ckpt: Checkpoint, bits: int, out: str | Path) -> Path:
    """Write variant ``bits`` of ``ckpt``'s model to ``out``: ONNX, or the encoded model
    message when ``out`` ends in ``.msgpack``. Returns the path."""
    from coordinator.variants import model_tensors

    variant = variant_name(bits)
    spec = _spec(ckpt)
    weights = variant_weights(ckpt, bits)
    out = Path(out)
    try:
        if out.suffix.lower() == ".msgpack":
            names = spec.param_names()
            tensors = model_tensors(weights, names, variant)
            msg = ModelMessage(round_id=ckpt.completed_round, variant=variant, model=ckpt.model,
                               tensors=tensors, digest=tensors_digest(tensors))
            out.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(out, encode_message(msg, Limits()), durable=False)
            return out
        from edge_client.intnn.export import shared_onnx
        from firmware_models.onnx_export import save

        save(shared_onnx(spec, weights, int(bits)), out)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"ONNX export needs the onnx package (pip install 'fedbit[onnx]'): "
                          f"{exc}") from None
    except (FedbitError, SpecError) as exc:
        raise ConfigError(f"{out}: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{out}: {exc.strerror or exc}") from None
    return out


def export_run(run_dir: str | Path, bitwidths: Sequence[int] | None = None) -> list[Path]:
    """``onnx/<variant>.onnx`` in the run directory (:func:`~coordinator.ops.rundir.coordinator_dir`:
    ``RUN_DIR`` or an emulated folder's ``RUN_DIR/out``) for each bitwidth (default:
    :func:`run_bitwidths`) of the run's final model; returns the paths written."""
    ckpt = load_final(run_dir)
    run = coordinator_dir(run_dir)
    out_dir = run / ONNX_DIR
    bits_list = (list(bitwidths) if bitwidths is not None
                 else run_bitwidths(ckpt, RunState(run).load_devices() or ckpt.devices))
    return [export_model(ckpt, b, out_dir / f"{variant_name(b)}.onnx") for b in bits_list]


def onnx_summary_lines(run_dir: str | Path, why_not: object = None) -> list[str]:
    """Markdown lines of a run summary listing the exported ONNX files (paths relative to
    ``run_dir``; ``why_not``: the reason recorded when there are none)."""
    root = Path(run_dir)
    try:
        files = sorted((coordinator_dir(root) / ONNX_DIR).glob("*.onnx"))
    except ConfigError:
        files = []
    if not files:
        reason = why_not if isinstance(why_not, str) and why_not else "none yet"
        return ["## Exported models", "", f"No ONNX files ({reason}); `fedbit export {root} --all` writes them.", ""]
    return ["## Exported models", "", "ONNX, one per bitwidth variant of the final model (`fedbit-edge predict "
            "--model FILE`):", "", *[f"- `{f.relative_to(root)}` ({f.stat().st_size:,} bytes)" for f in files], ""]
