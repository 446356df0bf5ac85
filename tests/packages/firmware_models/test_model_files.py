"""A user's own model from a file (TOML layers or a Python ModelSpec): the same spec as the
zoo's, accepted by emulate, serve's job file, export and a device's integer engine; every
mistake named by file and layer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_client.compat import zip_strict
from firmware_models import SpecError, load_model_file, mnist_cnn, resolve_model

MNIST_CNN_TOML = """
name = "my_mnist_cnn"
input = [1, 28, 28]
classes = 10
layers = [
  {type = "conv2d", out = 16, kernel = 3, padding = 1}, {type = "relu"}, {type = "maxpool2d", kernel = 2},
  {type = "conv2d", out = 32, kernel = 3, padding = 1, in = 16}, {type = "relu"}, {type = "maxpool2d", kernel = 2},
  {type = "flatten"}, {type = "linear", out = 128}, {type = "relu"}, {type = "linear", out = 10},
]
"""

TINY_TOML = """
input = [1, 8, 8]
[[layers]]
type = "conv2d"
out = 8
kernel = 3
padding = 1
[[layers]]
type = "relu"
[[layers]]
type = "maxpool2d"
kernel = 2
[[layers]]
type = "flatten"
[[layers]]
type = "linear"
name = "head"
out = 10
"""


def test_a_toml_model_is_the_zoo_model_it_describes(tmp_path: Path) -> None:
    path = tmp_path / "cnn.toml"
    path.write_text(MNIST_CNN_TOML)
    spec = load_model_file(str(path))
    zoo = mnist_cnn()
    assert spec.name == "my_mnist_cnn" and spec.layers == zoo.layers  # same names, same shapes
    assert spec.param_shapes() == zoo.param_shapes() and spec.input_shape == (1, 28, 28)
    tiny = tmp_path / "tiny.toml"
    tiny.write_text(TINY_TOML)
    t = resolve_model(str(tiny))
    assert t.name == "tiny" and t.param_names() == ["conv1", "head"] and t.num_classes == 10


def test_a_python_model_file(tmp_path: Path) -> None:
    path = tmp_path / "pymodel.py"
    path.write_text("from firmware_models import Flatten, Linear, ModelSpec, ReLU\n"
                    "MODEL = ModelSpec('py_mlp', (1, 8, 8), (Flatten('f'), Linear('fc1', 64, 32), ReLU('r'),"
                    " Linear('fc2', 32, 10)), 10)\n")
    assert load_model_file(str(path)).param_shapes() == [(32, 64), (10, 32)]
    path.write_text("x = 1\n\nraise RuntimeError('boom')\n")
    with pytest.raises(SpecError, match=r"pymodel.py \(line 3\): RuntimeError: boom"):
        load_model_file(str(path))
    path.write_text("from firmware_models import Flatten, Linear, ModelSpec\n"
                    "A = ModelSpec('a', (4,), (Linear('fc', 5, 2),), 2)\n")
    with pytest.raises(SpecError, match=r"pymodel.py: fc: Linear expects \[5\], got \[4\]"):
        load_model_file(str(path))
    path.write_text("y = 2\n")
    with pytest.raises(SpecError, match="define MODEL"):
        load_model_file(str(path))


@pytest.mark.parametrize("layers, culprit", [
    ('{type = "conv2d", out = 4, kernel = 3}, {type = "linear", out = 10}',
     r"layers\[1\] \(linear fc1\): needs a flat input.*add a flatten layer"),
    ('{type = "conv2d", out = 4}', r"layers\[0\] \(conv2d conv1\): needs 'kernel'"),
    ('{type = "conv2d", out = 4, kernel = 3, in = 3}', r"layers\[0\] \(conv2d conv1\): in = 3 but .* 1 input channels"),
    ('{type = "conv2d", out = 4, kernel = 9}', r"layers\[0\] \(conv1\): .*smaller than the kernel"),
    ('{type = "conv2d", out = 4, kernel = 3, bias = true}', r"layers\[0\] \(conv2d conv1\): unknown key 'bias'"),
    ('{type = "conv2d", out = -4, kernel = 3}', r"layers\[0\] \(conv2d conv1\): out must be an integer >= 1"),
    ('{type = "attention"}', r"layers\[0\]: type 'attention' is not one of"),
    ('{type = "flatten"}, {type = "linear", out = 7}', r"layers\[1\] \(fc1\) outputs 7 values but classes = 10"),
    ('{type = "flatten"}, {type = "linear", out = 10, name = "x"}, {type = "relu", name = "x"}',
     "duplicate layer names"),
])
def test_a_bad_layer_is_named_by_file_index_and_name(tmp_path: Path, layers: str, culprit: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(f"input = [1, 8, 8]\nclasses = 10\nlayers = [{layers}]\n")
    with pytest.raises(SpecError, match=culprit) as e:
        load_model_file(str(path))
    assert str(path) in str(e.value)


def test_bad_files_and_references(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="not found"):
        load_model_file(str(tmp_path / "none.toml"))
    (tmp_path / "broken.toml").write_text("input = [1, 8\n")
    with pytest.raises(SpecError, match="broken.toml: not valid TOML"):
        load_model_file(str(tmp_path / "broken.toml"))
    (tmp_path / "zoo.toml").write_text('name = "digits_cnn"\n' + TINY_TOML)
    with pytest.raises(SpecError, match="bundled model's"):
        resolve_model(str(tmp_path / "zoo.toml"))
    (tmp_path / "tiny.toml").write_text(TINY_TOML)
    # a device never loads a path a coordinator announces: only the files it was given
    with pytest.raises(SpecError, match="--model-file tiny.toml"):
        resolve_model("/somewhere/tiny.toml", allow_paths=False)
    given = {"tiny.toml": load_model_file(str(tmp_path / "tiny.toml"))}
    assert resolve_model("/coordinator/path/tiny.toml", given, allow_paths=False).name == "tiny"
    with pytest.raises(SpecError, match="unknown model 'resnet'"):
        resolve_model("resnet")


@pytest.mark.host
def test_a_toml_model_runs_in_emulate_serve_export_and_on_devices(tmp_path: Path) -> None:
    """The same file through the emulator (real device runtimes with the integer engine,
    the coordinator, the ONNX export), `fedbit export`, and serve's job file."""
    from coordinator.cli import main
    from coordinator.emulation.config import load_config
    from coordinator.emulation.emulator import Emulator
    from coordinator.job import load_job
    from edge_client.errors import ConfigError
    from edge_client.runtime import DeviceConfig, load_model_files

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny.toml").write_text(TINY_TOML)
    exp = tmp_path / "exp.toml"
    exp.write_text('model = "models/tiny.toml"\nrounds = 2\nstrategy = "fedavg"\n'
                   "[devices]\nraspberry-pi-4 = 2\ndesktop = 1\n[train]\nsteps = 30\n"
                   "[clock]\nseconds_per_sample = {float32 = 1e-4, int8 = 1e-4}\n")
    cfg = load_config(exp)
    assert cfg.model == str((tmp_path / "models" / "tiny.toml").resolve())  # next to the config
    run = tmp_path / "run"
    result = Emulator(cfg, 0, run).run()
    last = result.history[-1]["groups"]
    assert set(last) == {"float32", "int8"} and last["int8"]["accuracy"] > 0.3  # chance is 0.1
    assert sorted(result.info["onnx"]) == ["float32.onnx", "int8.onnx"]
    assert main(["export", str(run / "out"), "--bits", "8", "--out", str(tmp_path / "m.msgpack")]) == 0
    # serve's job file: the model relative to the job file, a bad one named with its layer
    job = tmp_path / "job.toml"
    job.write_text('model = "models/tiny.toml"\nout = "r"\n')
    assert load_job(job).server.model == cfg.model
    (tmp_path / "models" / "bad.toml").write_text(TINY_TOML.replace("out = 10", "out = 10\nstride = 2"))
    job.write_text('model = "models/bad.toml"\nout = "r"\n')
    with pytest.raises(ConfigError, match=r"job.toml: model: model file .*bad.toml: layers\[4\] \(linear head\): "
                                          r"unknown key 'stride'"):
        load_job(job)
    with pytest.raises(ConfigError, match="bad.toml"):
        load_model_files([str(tmp_path / "models" / "bad.toml")])
    with pytest.raises(ConfigError, match="exp.toml: model: .*nope.toml: not found"):
        load_config(exp, {"model": "nope.toml"})
    assert DeviceConfig("d", 8, "int", "int", 8).model_files == ()
    metrics = [json.loads(x) for x in (run / "out" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["model"] == cfg.model and np.isfinite(metrics[-1]["groups"]["float32"]["loss"])


MLP28_TOML = """
input = [1, 28, 28]
layers = [{type = "flatten"}, {type = "linear", out = 32}, {type = "relu"}, {type = "linear", out = 10}]
"""


@pytest.mark.slow
@pytest.mark.mosquitto
@pytest.mark.host
def test_serve_and_real_devices_train_a_model_file_on_fashion_mnist(tmp_path: Path, mosquitto_bin: str,
                                                                     fashion_mnist: str) -> None:
    """``fedbit serve --model FILE --eval-data fashion-mnist:test`` with two real device
    processes (``--data fashion-mnist:K/N --model-file FILE``; one Int8, one float32)."""
    import subprocess
    import sys

    from coordinator.ops.broker import free_port

    bin_dir = Path(sys.executable).parent
    model = tmp_path / "mlp28.toml"
    model.write_text(MLP28_TOML)
    port = free_port()
    out = tmp_path / "run"
    coord = subprocess.Popen(
        [str(bin_dir / "fedbit"), "serve", "--out", str(out), "--rounds", "1", "--port", str(port),
         "--model", str(model), "--eval-data", "fashion-mnist:test", "--set", "round.min_devices=2",
         "--set", "train.steps=20", "--set", "round.timeout_s=60", "--quiet", "--job", "fm"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    devices = []
    try:
        for i, prof in enumerate(["raspberry-pi-4", "desktop"]):
            devices.append(subprocess.Popen(
                [str(bin_dir / "fedbit-edge"), "run", "--broker", f"mqtt://127.0.0.1:{port}", "--profile", prof,
                 "--data", f"fashion-mnist:{i + 1}/20", "--model-file", str(model), "--id", f"dev{i}",
                 "--job", "fm", "--workdir", str(tmp_path / f"dev{i}"), "--max-seconds", "120"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        stdout, stderr = coord.communicate(timeout=180)
    finally:
        for p in [coord, *devices]:
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=20)
    assert coord.returncode == 0, stderr
    rec = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert rec["accepted"] == 2 and rec["model"] == str(model)
    assert rec["groups"]["float32"]["accuracy"] > 0.3 and rec["groups"]["int8"]["accuracy"] > 0.3  # chance: 0.1


def test_the_papers_initialisation_is_part_of_the_spec(tmp_path: Path) -> None:
    """fedshift_cnn starts from Kaiming/He normal on the effective weight W/alpha (the
    FedShift paper's), clipped to the shared domain; the others from WAGE's eq. 10; a model
    file may choose."""
    import math

    from edge_client.intnn import init_shared
    from edge_client.intnn.quant import alpha_log2
    from firmware_models import fedshift_cnn

    spec = fedshift_cnn()
    assert spec.init == "he" and spec == fedshift_cnn()
    for w, fan_in in zip_strict(init_shared(spec, 0), spec.fan_ins()):
        sd = (1 << alpha_log2(fan_in)) * math.sqrt(2.0 / fan_in)
        expect = math.erfc(0.5 / (sd * math.sqrt(2)))          # P(|N(0, sd)| >= 0.5): at the clip
        assert abs(float(np.mean(np.abs(w) >= 0.5)) - expect) < 0.02 and np.abs(w).max() <= 0.5
    wage = init_shared(mnist_cnn(), 0)
    assert all(abs(float(np.mean(np.abs(w) >= 0.5)) - 1 / 3) < 0.03 for w in wage)  # U(-0.75, 0.75)
    path = tmp_path / "he.toml"
    path.write_text('init = "he"\n' + TINY_TOML)
    assert load_model_file(str(path)).init == "he"
    path.write_text('init = "xavier"\n' + TINY_TOML)
    with pytest.raises(SpecError, match="init 'xavier' is not one of"):
        load_model_file(str(path))


_VALUES = st.one_of(st.integers(-3, 40), st.booleans(), st.text(max_size=4), st.none())


def test_any_table_is_a_model_or_a_spec_error() -> None:
    """Fuzzed model tables (types, keys and values right or wrong) either build a spec or
    raise SpecError naming the source: never another exception."""
    from firmware_models.files import spec_from_table

    layer = st.dictionaries(st.sampled_from(["type", "out", "kernel", "in", "stride", "padding", "name", "x"]),
                            st.one_of(st.sampled_from(["conv2d", "linear", "relu", "maxpool2d", "flatten", "fc"]),
                                      _VALUES), max_size=5)
    table = st.fixed_dictionaries({"layers": st.lists(layer, max_size=6)},
                                  optional={"input": st.lists(st.integers(-1, 12), max_size=4), "classes": _VALUES,
                                            "name": _VALUES, "init": st.sampled_from(["wage", "he", "x"])})

    @settings(max_examples=120, deadline=None)
    @given(t=table)
    def check(t: dict) -> None:
        try:
            spec = spec_from_table(t, "fuzz.toml")
        except SpecError as exc:
            assert "fuzz.toml" in str(exc)
        else:
            assert spec.param_shapes() is not None and spec.num_classes >= 2

    check()
