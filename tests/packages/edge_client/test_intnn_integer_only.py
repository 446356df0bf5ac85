"""The integer engine computes with integers only, deterministically, without torch."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
import tracemalloc

import numba
import numpy as np
import pytest
from numba.core import compiler, types
from numba.core.compiler import CompilerBase, DefaultPassBuilder
from numba.core.compiler_machinery import FunctionPass, register_pass
from numba.core.registry import cpu_target
from numba.core.typed_passes import NopythonTypeInference

import edge_client.intnn.allocation as W
from edge_client.compat import zip_strict
from edge_client.data import Dataset
from edge_client.intnn import IntModel, init_shared
from edge_client.intnn import kernels as K
from edge_client.trainers import IntTrainer
from firmware_models import Conv2d, Flatten, Linear, MaxPool2d, ModelSpec, ReLU, get_spec


def small_spec() -> ModelSpec:
    return ModelSpec("small", (2, 6, 6), (
        Conv2d("c1", 2, 8, 3, padding=1), MaxPool2d("p1", 2, padding=1), ReLU("r1"),
        Conv2d("c2", 8, 4, 3, stride=2), ReLU("r2"), Flatten("f"), Linear("l1", 4, 6),
        ReLU("r3"), Linear("l2", 6, 3),
    ), 3)


def wide_spec() -> ModelSpec:
    return ModelSpec("wide", (12, 5, 5), (
        Conv2d("c1", 12, 6, 3, padding=1), ReLU("r1"), MaxPool2d("p1", 2),
        Flatten("f"), Linear("l1", 24, 3),
    ), 3)


def vnni_spec() -> ModelSpec:
    """Every path of the VNNI kernels (kernels.vnni, on a CPU that has them): the first
    conv's plane gradient, a K*C >= 32 conv forward, a linear layer with O = 64."""
    return ModelSpec("vnni", (3, 8, 8), (
        Conv2d("c1", 3, 8, 3, padding=1), ReLU("r1"), MaxPool2d("p1", 2),
        Conv2d("c2", 8, 16, 5, padding=1), ReLU("r2"), Flatten("f"), Linear("l1", 64, 64),
        ReLU("r3"), Linear("l2", 64, 3),
    ), 3)


def random_data(spec: ModelSpec, n: int, seed: int = 0) -> Dataset:
    rng = np.random.default_rng(seed)
    x = rng.random((n, *spec.input_shape), dtype=np.float32)
    return Dataset(x, rng.integers(0, spec.num_classes, n).astype(np.int64))


def _is_integer_type(t) -> bool:
    if isinstance(t, (types.Integer, types.Boolean)):
        return True
    if isinstance(t, types.Array):
        return isinstance(t.dtype, (types.Integer, types.Boolean))
    return t == types.none


@pytest.fixture(scope="module")
def trained_all_widths():
    """Run training steps and evaluation at several widths so every kernel is compiled."""
    spec = small_spec()
    data = random_data(spec, 20)
    for bits in (4, 6, 8, 12, 16):
        tr = IntTrainer(spec, bits, seed=1)
        tr.train(data, steps=2, batch=8, prox_mu=0.01, fedfor_alpha=0.1,
                 last_global_step=[np.full(s, 0.01, np.float32) for s in spec.param_shapes()])
        tr.train(data, steps=1, batch=8)
        tr.evaluate(data)
        ce = IntTrainer(spec, bits, seed=1, loss="ce")  # the integer softmax-CE option
        ce.train(data, steps=1, batch=8)
        wide = IntTrainer(wide_spec(), bits, seed=1)  # K*C >= 32: error-driven gradient
        wide.train(random_data(wide.spec, 8), steps=1, batch=8)
        sparse = IntModel(spec, bits, conv_impl="sparse")
        sparse.load_shared(init_shared(spec, 0))
        ws = sparse.workspace(4)
        sparse.train_step(ws, data.y[:4], 4, 3, 0, 0)
        # one and two threads, every op split: the VNNI linear update that makes its
        # gradient again runs on several threads (on one only for 2^18 weights and more)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(W, "SPLIT_MIN_MACS", 0)
            for threads in (1, 2):
                v = IntTrainer(vnni_spec(), bits, seed=1, threads=threads)
                v.train(random_data(v.spec, 8), steps=1, batch=8)
                v.evaluate(random_data(v.spec, 8))
                v.model.close()
    return spec


def test_kernel_signatures_are_integer_only(trained_all_widths):
    used = [k for k in K.TRAINING_KERNELS if k.signatures]
    assert len(used) >= 15
    for kernel in K.TRAINING_KERNELS:
        assert kernel.signatures, f"{kernel.py_func.__name__} never ran"
        for sig in kernel.signatures:
            bad = [a for a in sig if not _is_integer_type(a)]
            assert not bad, f"{kernel.py_func.__name__}{sig}: non-integer arguments {bad}"
            ret = kernel.overloads[sig].signature.return_type
            assert _is_integer_type(ret), f"{kernel.py_func.__name__} returns {ret}"


class _Typed(Exception):
    """Carries the type map out of :class:`_TypeOnly`'s pipeline."""

    def __init__(self, typemap: dict) -> None:
        super().__init__("typed")
        self.typemap = typemap


@register_pass(mutates_CFG=False, analysis_only=True)
class _StopAfterTyping(FunctionPass):
    _name = "fedbit_stop_after_typing"

    def __init__(self) -> None:
        FunctionPass.__init__(self)

    def run_pass(self, state):  # noqa: ANN001 - numba's pass interface
        raise _Typed(dict(state.typemap))


class _TypeOnly(CompilerBase):
    """Numba's untyped pipeline (which inlines the ``inline="always"`` helpers) and type
    inference, then stop: the typed IR of a kernel without the LLVM work of compiling it."""

    def define_pipelines(self):  # noqa: ANN201 - numba's interface
        pm = DefaultPassBuilder.define_untyped_pipeline(self.state)
        pm.add_pass(NopythonTypeInference, "nopython type inference")
        pm.add_pass(_StopAfterTyping, "stop after typing")
        pm.finalize()
        return [pm]


def typemap_of(py_func, sig) -> dict:
    """``{variable: numba type}`` of ``py_func`` typed for ``sig`` (inlined helpers included)."""
    flags = compiler.Flags()
    flags.nrt = True
    try:
        compiler.compile_extra(cpu_target.typing_context, cpu_target.target_context, py_func, sig.args,
                               sig.return_type, flags, {}, pipeline_class=_TypeOnly)
    except _Typed as typed:
        return typed.typemap
    raise AssertionError(f"{py_func.__name__}: type inference did not run")


def _is_float(t) -> bool:
    """A float or complex scalar, array, literal or tuple holding one."""
    if isinstance(t, types.Literal):
        return isinstance(t.literal_value, (float, complex))
    if isinstance(t, (types.Float, types.Complex)):
        return True
    if isinstance(t, types.Array):
        return _is_float(t.dtype)
    if isinstance(t, types.BaseTuple):
        return any(_is_float(x) for x in t.types)
    return False


def _floats(typemap: dict) -> dict:
    return {name: str(t) for name, t in typemap.items() if _is_float(t)}


def test_the_type_check_sees_float_variables_and_inlined_helpers():
    @numba.njit(inline="always")
    def half(v):
        return v * 0.5

    def kernel(x):
        return int(half(x))

    jitted = numba.njit(kernel)
    jitted(3)
    found = _floats(typemap_of(kernel, jitted.overloads[jitted.signatures[0]].signature))
    assert found and all(t == "float64" for t in found.values())


@pytest.mark.slow
@pytest.mark.parametrize("kernel", K.TRAINING_KERNELS, ids=lambda k: k.py_func.__name__)
def test_kernel_bodies_have_no_float_variable(trained_all_widths, kernel):
    """Type the training kernel again (same source, same argument types; type inference
    only) and check every typed variable, inlined helpers included: no float anywhere.
    One test per kernel: each takes a second or so of type inference."""
    assert kernel.signatures, f"{kernel.py_func.__name__} never ran"
    for sig in kernel.signatures[:2]:
        floats = _floats(typemap_of(kernel.py_func, kernel.overloads[sig].signature))
        assert not floats, f"{kernel.py_func.__name__}{sig}: float variables {floats}"


def test_training_step_allocates_no_float_arrays():
    spec = get_spec("digits_cnn")
    model = IntModel(spec, 8)
    model.load_shared(init_shared(spec, 0))
    ws = model.workspace(32)
    for f in dataclasses.fields(ws):
        value = getattr(ws, f.name)
        arrays = value if isinstance(value, list) else [value]
        for a in arrays:
            if isinstance(a, np.ndarray):
                assert a.dtype.kind in "iub", f"workspace.{f.name} has dtype {a.dtype}"
    for w, t in zip_strict(model.w, model.t):
        assert w.dtype == np.int8 and t.dtype == np.int8
    rng = np.random.default_rng(0)
    ws.x[:] = rng.integers(0, 128, ws.x.shape)
    y = rng.integers(0, 10, 32).astype(np.int64)
    model.train_step(ws, y, 32, 3, 0, 0)          # warm (compiles)
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        for step in range(1, 4):
            model.train_step(ws, y, 32, 3, 0, step)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # views and scalars only (Numba's own allocations are traced too: kernels allocate
    # nothing either); a float copy of any activation would be >= 32*8*8*16*4 bytes
    assert peak - base < 16_384


def test_torch_is_not_imported_by_integer_training():
    code = textwrap.dedent("""
        import sys
        from edge_client.data import load_digits, digits_shard
        from edge_client.trainers import make_trainer
        tr = make_trainer("digits_cnn", 8, seed=0)
        tr.train(digits_shard(1, 10), epochs=1)
        tr.evaluate(load_digits("test"))
        tr.to_shared()
        from edge_client.intnn import from_shared, to_shared, init_shared
        print("TORCH" if "torch" in sys.modules else "NO-TORCH")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "NO-TORCH"


@pytest.mark.parametrize("bits", [6, 8, 16])
def test_same_seed_same_result_bit_for_bit(bits):
    spec = small_spec()
    data = random_data(spec, 40, seed=3)
    runs = []
    for _ in range(2):
        tr = IntTrainer(spec, bits, seed=5)
        r1 = tr.train(data, epochs=2, batch=8)
        r2 = tr.train(data, steps=3, batch=16, prox_mu=0.1)
        runs.append((tr.int_weights(), r1.loss, r2.loss))
    for a, b in zip_strict(runs[0][0], runs[1][0]):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert runs[0][1:] == runs[1][1:]
    other = IntTrainer(spec, bits, seed=6)
    other.load_int(IntTrainer(spec, bits, seed=5).int_weights())  # same start, other seed
    other.train(data, epochs=2, batch=8)
    assert any(not np.array_equal(a, b)
               for a, b in zip_strict(other.int_weights(), runs[0][0]))
