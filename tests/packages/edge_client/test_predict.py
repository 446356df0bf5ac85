"""Device inference and run exports (issue 14): ``fedbit export`` and ``fedbit-edge
predict`` on a trained run's checkpoint, the same answers from ONNX Runtime and the Numba
engine, and clear errors for files that are not models, mismatched models, bad data."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from coordinator.ops.export import export_model, export_run, load_final, run_bitwidths
from coordinator.state import Checkpoint, RunState
from edge_client.data import Dataset, load_digits
from edge_client.errors import ConfigError
from edge_client.predict import check_expected, load_data, load_model, predict
from edge_client.protocol import Status, encode_message
from edge_client.trainers import IntTrainer

BIN = Path(sys.executable).parent
ENV = os.environ | {"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}


@pytest.fixture(scope="module", autouse=True)
def _onnx(onnx_runtime) -> None:
    """Every test here needs onnx and onnxruntime (conftest.onnx_runtime)."""


def _hello(dev: str, bits: int, trainer: str) -> dict:
    return {"device_id": dev, "profile": "p", "compute_bits": bits, "trainer": trainer,
            "codec": "int", "codec_bits": 8, "num_samples": 10, "sdk_version": "0"}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, IntTrainer]:
    """A run directory whose checkpoint holds a trained digits_cnn (an Int8 device's
    weights after a few epochs), with an Int8, an Int6 and a float device in its registry."""
    tr = IntTrainer("digits_cnn", 8, seed=1)
    tr.train(load_digits("train"), epochs=2, batch=32)
    out = tmp_path_factory.mktemp("run")
    RunState(out, durable=False).save_checkpoint(Checkpoint(
        job="j", model="digits_cnn", completed_round=4, weights=tr.to_shared(),
        devices={"a": _hello("a", 8, "int"), "b": _hello("b", 6, "int"),
                 "c": _hello("c", 32, "torch")}))
    return out, tr


def test_exports_of_a_trained_run_load_and_predict_in_a_fresh_process(run_dir, tmp_path) -> None:
    run, trainer = run_dir
    proc = subprocess.run([str(BIN / "fedbit"), "export", str(run), "--all"], capture_output=True,
                          text=True, timeout=120, env=ENV)
    assert proc.returncode == 0, proc.stderr
    names = sorted(Path(p).name for p in proc.stdout.split())
    assert names == ["float32.onnx", "int6.onnx", "int8.onnx"]
    preds = tmp_path / "p.csv"
    proc = subprocess.run([str(BIN / "fedbit-edge"), "predict", "--model", str(run / "onnx" / "int8.onnx"),
                           "--data", "digits:test", "--out", str(preds)],
                          capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    test = load_digits("test")
    _, acc = trainer.evaluate(test)
    assert report["engine"] == "onnxruntime" and report["variant"] == "int8"
    assert report["samples"] == len(test) and report["accuracy"] == acc > 0.3
    rows = list(csv.DictReader(preds.open()))
    assert len(rows) == len(test) and [int(r["label"]) for r in rows] == test.y.tolist()
    numba = predict(load_model(run / "onnx" / "int8.onnx"), test, engine="numba")
    assert [int(r["prediction"]) for r in rows] == numba.labels.tolist()


@pytest.mark.parametrize("bits", [6, 8, 16])
def test_onnx_and_msgpack_models_give_the_same_answers_on_both_engines(run_dir, tmp_path,
                                                                      bits: int) -> None:
    run, _ = run_dir
    ckpt = load_final(run)
    test = load_digits("test")
    got = {}
    for suffix in ("onnx", "msgpack"):
        model = load_model(export_model(ckpt, bits, tmp_path / f"m.{suffix}"))
        assert (model.spec.name, model.bits) == ("digits_cnn", bits)
        for engine in ("onnxruntime", "numba"):
            got[suffix, engine] = predict(model, test, engine=engine, batch=100)
    first = got["onnx", "onnxruntime"]
    assert first.logits.dtype == (np.int8 if bits <= 8 else np.int16)
    for p in got.values():
        np.testing.assert_array_equal(p.logits, first.logits)
        np.testing.assert_array_equal(p.labels, first.labels)
    assert first.accuracy(test.y) > 0.3


def test_the_float32_export_predicts_like_the_float_model(run_dir, tmp_path) -> None:
    from coordinator.evaluate import make_evaluator

    run, _ = run_dir
    ckpt = load_final(run)
    test = load_digits("test")
    model = load_model(export_model(ckpt, 32, tmp_path / "f.onnx"))
    assert model.variant == "float32"
    pred = predict(model, test)
    _, acc = make_evaluator("digits_cnn", test)({"float32": ckpt.weights})["float32"]
    assert pred.accuracy(test.y) == pytest.approx(acc, abs=1e-9)
    with pytest.raises(ConfigError, match="runs on ONNX Runtime only"):
        predict(model, test, engine="numba")


def test_run_variants_and_rounds(run_dir) -> None:
    run, _ = run_dir
    ckpt = load_final(run)
    assert run_bitwidths(ckpt) == [6, 8, 32]
    with pytest.raises(ConfigError, match="round 2 is not available.*last completed round \\(4\\)"):
        load_final(run, 2)
    assert load_final(run, 4).completed_round == 4


def test_files_that_are_not_fedbit_models_are_named_in_the_error(run_dir, tmp_path) -> None:
    import onnx
    from onnx import TensorProto, helper

    run, _ = run_dir
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\x00\x01 not a model at all" * 10)
    with pytest.raises(ConfigError, match=f"{junk}: not an ONNX model"):
        load_model(junk)
    plain = tmp_path / "plain.onnx"
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    onnx.save(helper.make_model(g), str(plain))
    with pytest.raises(ConfigError, match=f"{plain}: an ONNX model, but not a fedbit export"):
        load_model(plain)
    with pytest.raises(ConfigError, match="checkpoint.msgpack is not one"):
        load_model(run / "checkpoint.msgpack")
    status = tmp_path / "status.msgpack"
    status.write_bytes(encode_message(Status("done", 3, "x")))
    with pytest.raises(ConfigError, match="a Status message, not a model"):
        load_model(status)
    with pytest.raises(ConfigError, match="missing.onnx"):
        load_model(tmp_path / "missing.onnx")


def test_spec_and_bitwidth_mismatches_are_refused(run_dir, tmp_path) -> None:
    import onnx

    run, _ = run_dir
    path = export_model(load_final(run), 8, tmp_path / "m.onnx")
    model = load_model(path)
    with pytest.raises(ConfigError, match="m.onnx: digits_cnn int8, expected 6 bits"):
        check_expected(model, bits=6)
    with pytest.raises(ConfigError, match="a digits_cnn model, expected mlp"):
        check_expected(model, spec="mlp")
    check_expected(model, spec="digits_cnn", bits=8)
    # metadata that contradicts the graph: the file says Int16, its input is int8
    proto = onnx.load(str(path))
    for p in proto.metadata_props:
        if p.key == "fedbit.bits":
            p.value = "16"
        if p.key == "fedbit.amax":
            p.value = "32767"
    bad = tmp_path / "lying.onnx"
    onnx.save(proto, str(bad))
    with pytest.raises(ConfigError, match="lying.onnx: metadata says digits_cnn at 16 bits"):
        load_model(bad)


def test_data_of_the_wrong_shape_or_labels_is_refused(run_dir, tmp_path) -> None:
    run, _ = run_dir
    model = load_model(export_model(load_final(run), 8, tmp_path / "m.onnx"))
    cifar_like = Dataset(np.zeros((4, 3, 32, 32), np.float32), np.zeros(4, np.int64))
    with pytest.raises(ConfigError, match="samples of shape \\[3, 32, 32\\], the model "
                                          "\\(digits_cnn\\) expects \\[1, 8, 8\\]"):
        predict(model, cifar_like)
    npz = tmp_path / "d.npz"
    np.savez(npz, x=np.zeros((5, 1, 8, 8), np.float32), y=np.array([0, 1, 2, 3, 12]))
    with pytest.raises(ConfigError, match="label 12 outside the model's 10 classes"):
        predict(model, load_data(str(npz)))
    np.savez(npz, x=np.zeros((5, 1, 8, 8), np.int16))
    with pytest.raises(ConfigError, match="'x' must be float images"):
        load_data(str(npz))
    np.savez(npz, x=np.full((2, 1, 8, 8), 255, np.uint8))  # pixels: intensity 1.0
    assert load_data(str(npz)).x.max() == 1.0
    np.savez(npz, x=np.full((3, 1, 8, 8), 0.5, np.float32))  # unlabelled: predictions only
    pred = predict(model, load_data(str(npz)))
    assert pred.labels.shape == (3,) and pred.accuracy(np.full(3, -1)) is None
    with pytest.raises(ConfigError, match="data source .*nowhere.*a folder or a .npz file"):
        load_data(str(tmp_path / "nowhere"))


def test_export_run_without_a_checkpoint_and_bad_bits(tmp_path) -> None:
    from coordinator.cli import main

    with pytest.raises(ConfigError, match="no checkpoint.msgpack"):
        export_run(tmp_path)
    (tmp_path / "r").mkdir()
    assert main(["export", str(tmp_path / "r"), "--bits", "8"]) == 1
    ckpt = Checkpoint(job="j", model="mlp", completed_round=1,
                      weights=[np.zeros(s, np.float32) for s in [(128, 64), (10, 128)]])
    with pytest.raises(ConfigError, match="--bits must be 2..16 or 32"):
        export_model(ckpt, 17, tmp_path / "x.onnx")
