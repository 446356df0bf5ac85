"""Device inference (``fedbit-edge predict``): a model file and a data set -> predictions.

A model file is a fedbit ONNX export (``fedbit export``; integer Int2..Int16 or float32)
or a global model as the wire carries it (``global.msgpack``: an encoded ``ModelMessage``,
e.g. ``fedbit export RUN_DIR --bits 8 --out global.msgpack``). Two engines give the same
answers: ONNX Runtime (``pip install 'fedbit[onnx]'``; the integer graph is bit-exact with
the Numba engine) and the Numba integer engine (``IntModel.forward``), which needs nothing
beyond the base install for a msgpack model (and the ``onnx`` package to read an ONNX
file's weights). ``auto`` takes ONNX Runtime when it is installed; a float32 model runs on
ONNX Runtime only (a device has no torch).

Every problem with the inputs (a file that is not a model, a spec or bitwidth that does
not match, data of the wrong shape) raises :class:`ConfigError` naming the culprit.
"""

from __future__ import annotations

import importlib.util
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from edge_client.data import Dataset, float_images, load_source, quantize_images
from edge_client.errors import ConfigError, FedbitError, ProtocolError
from firmware_models import ModelSpec, SpecError, get_spec

if TYPE_CHECKING:  # pragma: no cover
    import onnx
    import onnxruntime as ort

    from edge_client.intnn import IntModel

ENGINES = ("auto", "onnxruntime", "numba")
MAX_MODEL_BYTES = 512 * 1024 * 1024
_MSGPACK_MAP_FIRST = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])


def have_onnxruntime() -> bool:
    """True when ``onnxruntime`` (and ``onnx``) can be imported."""
    return (importlib.util.find_spec("onnxruntime") is not None
            and importlib.util.find_spec("onnx") is not None)


@dataclass
class LoadedModel:
    """A model file, read and checked.

    ``bits``: compute bitwidth s (2..16), or 32 for a float32 model; ``graph``: the ONNX
    export (the file itself, or built from a msgpack model when ONNX Runtime runs it);
    ``int_weights``/``float_weights``: a msgpack model's tensors (spec layout).
    """

    path: str
    spec: ModelSpec
    bits: int
    source: str  # "onnx" | "msgpack"
    graph: onnx.ModelProto | None = None
    int_weights: list[np.ndarray] | None = None
    float_weights: list[np.ndarray] | None = None
    round_id: int | None = None

    @property
    def variant(self) -> str:
        from edge_client.protocol import model_variant

        return model_variant(self.bits, "int")


# ============================================================================ model files

#: the first bytes of the coordinator's checksummed state files (``coordinator/state.py``)
_STATE_FILE_MAGIC = b"FBS1"


def load_model(path: str | os.PathLike[str]) -> LoadedModel:
    """Read an ONNX export or a msgpack model message; ConfigError names the file."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > MAX_MODEL_BYTES:
            raise ConfigError(f"{p}: {size} bytes, larger than any fedbit model "
                              f"({MAX_MODEL_BYTES} bytes)")
        data = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"model file {p}: {exc.strerror or exc}") from None
    if not data:
        raise ConfigError(f"{p}: empty file, not a model")
    if data[:4] == _STATE_FILE_MAGIC:
        raise ConfigError(f"{p}: a fedbit run's state file (a checkpoint), not a model; a run's "
                          f"checkpoint.msgpack is not one: `fedbit export RUN_DIR --out "
                          f"global.msgpack` writes one")
    if p.suffix.lower() != ".onnx" and data[0] in _MSGPACK_MAP_FIRST:
        return _load_msgpack(p, data)
    return _load_onnx(p, data)


def _load_onnx(p: Path, data: bytes) -> LoadedModel:
    if importlib.util.find_spec("onnx") is None:
        raise ConfigError(f"{p}: reading an ONNX model needs the onnx package "
                          f"(pip install 'fedbit[onnx]')")
    from firmware_models.onnx_export import describe, parse

    try:
        graph = parse(data)
        info = describe(graph)
    except SpecError as exc:
        raise ConfigError(f"{p}: {exc}") from None
    return LoadedModel(str(p), info.spec, info.bits, "onnx", graph=graph)


def _load_msgpack(p: Path, data: bytes) -> LoadedModel:
    from edge_client.codecs import decode
    from edge_client.protocol import ModelMessage, decode_message, variant_bits

    try:
        msg = decode_message(data)
    except ProtocolError as exc:
        raise ConfigError(f"{p}: not a fedbit model message ({exc}); a run's "
                          f"checkpoint.msgpack is not one: `fedbit export RUN_DIR --out "
                          f"global.msgpack` writes one") from None
    if not isinstance(msg, ModelMessage):
        raise ConfigError(f"{p}: a {type(msg).__name__} message, not a model")
    try:
        spec = get_spec(msg.model)
        bits = variant_bits(msg.variant)
        arrays = [decode(t) for t in msg.tensors]
    except (SpecError, FedbitError, ValueError) as exc:
        raise ConfigError(f"{p}: {exc}") from None
    shapes = spec.param_shapes()
    got = [list(a.shape) for a in arrays]
    if got != [list(s) for s in shapes]:
        raise ConfigError(f"{p}: tensors {got} do not match {spec.name}'s "
                          f"{[list(s) for s in shapes]}")
    model = LoadedModel(str(p), spec, bits, "msgpack", round_id=msg.round_id)
    if bits == 32:
        model.float_weights = [np.asarray(a, np.float32) for a in arrays]
    else:
        if any(a.dtype.kind not in "iu" for a in arrays):
            raise ConfigError(f"{p}: variant {msg.variant} carries non-integer tensors")
        model.int_weights = arrays
        _int_model(model)  # checks the integers against the bitwidth's clip bound
    return model


def _int_model(model: LoadedModel) -> IntModel:
    """The Numba engine's model of an integer ``model``."""
    from edge_client.intnn import IntModel
    from edge_client.intnn.export import int_model_from_onnx

    if model.bits == 32:
        raise ConfigError(f"{model.path}: a float32 model runs on ONNX Runtime only "
                          f"(pip install 'fedbit[onnx]'), or use an int<s> variant")
    try:
        if model.int_weights is not None:
            m = IntModel(model.spec, model.bits)
            m.load_int(model.int_weights)
            return m
        from firmware_models.onnx_export import describe

        assert model.graph is not None
        return int_model_from_onnx(model.graph, describe(model.graph))
    except (FedbitError, SpecError) as exc:
        raise ConfigError(f"{model.path}: {exc}") from None


def onnx_graph(model: LoadedModel) -> onnx.ModelProto:
    """The ONNX export of ``model`` (built from a msgpack model's tensors when needed)."""
    if model.graph is None:
        from edge_client.intnn.export import int_model_onnx, shared_onnx

        if model.bits == 32:
            assert model.float_weights is not None
            model.graph = shared_onnx(model.spec, model.float_weights, 32)
        else:
            model.graph = int_model_onnx(_int_model(model))
    return model.graph


def check_expected(model: LoadedModel, *, spec: str | None = None,
                   bits: int | None = None) -> None:
    """ConfigError when ``model`` is not the expected spec / bitwidth (a device checks
    that the file it was given is the model it can run)."""
    if spec and spec != model.spec.name:
        raise ConfigError(f"{model.path}: a {model.spec.name} model, expected {spec}")
    if bits and bits != model.bits:
        raise ConfigError(f"{model.path}: {model.spec.name} {model.variant}, "
                          f"expected {bits} bits")


# ============================================================================ data


def load_data(src: str) -> Dataset:
    """Data to predict: a ``.npz`` with ``x`` (float32 ``[N, C, H, W]`` in [0, 1] or
    uint8 pixels) and optionally ``y`` (int labels), or any data source
    (``edge_client.data.load_source``: ``digits:test``, ``fashion-mnist:test``,
    ``digits:K/N``, an IDX or CIFAR-10 folder, a ``.npz`` with ``x_test``/``y_test``),
    its test split unless the source names a part."""
    if src.endswith(".npz") and os.path.isfile(src) and _npz_has_x(src):
        return _load_npz(src)
    return load_source(src, default_part="test")


def _npz_has_x(src: str) -> bool:
    try:
        with np.load(src, allow_pickle=False) as f:
            return "x" in f.files
    except (OSError, ValueError) as exc:
        raise ConfigError(f"data {src}: not a readable .npz ({exc})") from None


def _load_npz(src: str) -> Dataset:
    try:
        with np.load(src, allow_pickle=False) as f:
            if "x" not in f:
                raise ConfigError(f"data {src}: no array 'x' (has {sorted(f.files)})")
            x = np.asarray(f["x"])
            y = np.asarray(f["y"]) if "y" in f else None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"data {src}: not a readable .npz ({exc})") from None
    if (x.dtype.kind != "f" and x.dtype != np.uint8) or x.ndim < 2:
        raise ConfigError(f"data {src}: 'x' must be float images [N, C, H, W] in [0, 1] or "
                          f"uint8 pixels, got {x.dtype} {list(x.shape)}")
    if x.dtype == np.uint8:
        x = x.astype(np.float32) / np.float32(255.0)
    if not np.all(np.isfinite(x)):
        raise ConfigError(f"data {src}: 'x' has NaN/Inf values")
    if y is None:
        y = np.full(len(x), -1, np.int64)  # unlabelled
    elif y.dtype.kind not in "iu" or y.shape != (len(x),):
        raise ConfigError(f"data {src}: 'y' must be {len(x)} integer labels, got {y.dtype} "
                          f"{list(y.shape)}")
    return Dataset(np.ascontiguousarray(x, dtype=np.float32), y.astype(np.int64))


def check_data(model: LoadedModel, data: Dataset, src: str = "data") -> None:
    """ConfigError when the samples do not fit the model (shape, label range)."""
    want = tuple(model.spec.input_shape)
    if tuple(data.x.shape[1:]) != want:
        raise ConfigError(f"{src}: samples of shape {list(data.x.shape[1:])}, the model "
                          f"({model.spec.name}) expects {list(want)}")
    y = data.y[data.y >= 0]
    if y.size and int(y.max()) >= model.spec.num_classes:
        raise ConfigError(f"{src}: label {int(y.max())} outside the model's "
                          f"{model.spec.num_classes} classes")


# ============================================================================ engines


@dataclass
class Prediction:
    """``logits`` ``[N, classes]`` (the integer dtype of the model's bitwidth, or
    float32), ``labels`` int64 ``[N]`` (first maximum), the engine that ran, seconds."""

    logits: np.ndarray
    labels: np.ndarray
    engine: str
    seconds: float

    def accuracy(self, y: np.ndarray) -> float | None:
        """Fraction of labelled samples (``y >= 0``) predicted right; None without labels."""
        known = y >= 0
        if not known.any():
            return None
        return float(np.mean(self.labels[known] == y[known]))


def ort_session(graph: onnx.ModelProto, threads: int = 1) -> ort.InferenceSession:
    """An ONNX Runtime CPU session with ``threads`` intra-op threads, sequential."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = max(1, int(threads))
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(graph.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])


def _inputs(model: LoadedModel, x: np.ndarray) -> np.ndarray:
    """The graph input of float images: float32, or the s-bit integers (NCHW)."""
    if model.bits == 32:
        return float_images(x)
    return np.ascontiguousarray(quantize_images(x, model.bits))


def _run_ort(model: LoadedModel, x: np.ndarray, batch: int, threads: int) -> np.ndarray:
    sess = ort_session(onnx_graph(model), threads)
    xin = _inputs(model, x)
    parts = [sess.run(["logits"], {"x": xin[s:s + batch]})[0] for s in range(0, len(x), batch)]
    return np.concatenate(parts)


def _run_numba(model: LoadedModel, x: np.ndarray, batch: int) -> np.ndarray:
    m = _int_model(model)
    xq = m.prepare_inputs(x)
    ws = m.workspace(min(batch, len(x)), train=False)
    out = np.empty((len(x), model.spec.num_classes), m.adtype)
    for s in range(0, len(x), ws.capacity):
        n = min(ws.capacity, len(x) - s)
        ws.x[:n] = xq[s:s + n]
        out[s:s + n] = m.forward(ws, n)
    return out


def resolve_engine(model: LoadedModel, engine: str = "auto") -> str:
    """The engine that will run ``model``: ``auto`` -> onnxruntime when installed, else
    numba (a float32 model needs onnxruntime)."""
    if engine not in ENGINES:
        raise ConfigError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if engine == "auto":
        engine = "onnxruntime" if have_onnxruntime() else "numba"
    if engine == "onnxruntime" and not have_onnxruntime():
        raise ConfigError("engine onnxruntime: not installed (pip install 'fedbit[onnx]')")
    if engine == "numba" and model.bits == 32:
        raise ConfigError(f"{model.path}: a float32 model runs on ONNX Runtime only "
                          f"(pip install 'fedbit[onnx]'), or use an int<s> variant")
    return engine


def predict(model: LoadedModel, data: Dataset, *, engine: str = "auto", batch: int = 256,
            threads: int = 1) -> Prediction:
    """Logits and labels of every sample of ``data`` (float images in [0, 1])."""
    if batch < 1:
        raise ConfigError(f"batch must be >= 1, got {batch}")
    check_data(model, data)
    engine = resolve_engine(model, engine)
    t0 = time.perf_counter()
    if len(data) == 0:
        dtype = np.float32 if model.bits == 32 else np.int8 if model.bits <= 8 else np.int16
        logits = np.zeros((0, model.spec.num_classes), dtype)
    elif engine == "onnxruntime":
        logits = _run_ort(model, data.x, batch, threads)
    else:
        logits = _run_numba(model, data.x, batch)
    # first maximum, as ONNX ArgMax and the engine's argmax_correct
    labels = np.argmax(logits, axis=1).astype(np.int64)
    return Prediction(logits, labels, engine, time.perf_counter() - t0)


def write_predictions(path: str | os.PathLike[str], pred: Prediction, y: np.ndarray) -> None:
    """``.npz``: arrays ``labels``, ``logits`` (and ``y``); anything else: CSV lines
    ``index,prediction[,label]`` with a header."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.suffix.lower() == ".npz":
            np.savez(p, labels=pred.labels, logits=pred.logits, y=y)
            return
        labelled = bool((y >= 0).any())
        with open(p, "w", encoding="utf-8") as f:
            f.write("index,prediction,label\n" if labelled else "index,prediction\n")
            for i, k in enumerate(pred.labels.tolist()):
                f.write(f"{i},{k},{int(y[i])}\n" if labelled else f"{i},{k}\n")
    except OSError as exc:
        raise ConfigError(f"--out {p}: {exc.strerror or exc}") from None
