"""The coordinator's evaluator: chunked, threaded scoring equals the trainers' own
evaluation, whatever the thread count; the validation split only in the rounds asked for."""

from __future__ import annotations

import numpy as np
import pytest

import coordinator.evaluate as evaluate
from coordinator.evaluate import ModelEvaluator, evaluator_for
from edge_client.data import load_digits
from edge_client.errors import ConfigError
from edge_client.intnn import init_shared
from edge_client.trainers import make_trainer
from firmware_models import get_spec


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> int:
    """Chunks of 64 samples: the 360 digits test images make 6 chunks (the last shorter)."""
    monkeypatch.setattr(evaluate, "EVAL_CHUNK", 64)
    return 64


def _trained(bits: int, seed: int = 0) -> list[np.ndarray]:
    """Shared weights a few steps away from the init (scores that are not chance)."""
    spec = get_spec("digits_cnn")
    tr = make_trainer(spec, bits, seed=seed)
    tr.load_shared(init_shared(spec, seed))
    tr.train(load_digits("train"), steps=30, batch=32)
    return tr.to_shared()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_chunked_threaded_scores_equal_one_pass_of_the_trainer(small_chunks: int, threads: int) -> None:
    test = load_digits("test")
    variants = {"float32": _trained(32), "int8": _trained(8), "int6": _trained(6, seed=1)}
    scored = ModelEvaluator("digits_cnn", test, threads=threads)(variants)
    assert len(test) % small_chunks != 0  # a short last chunk is combined by its size
    for v, w in variants.items():
        tr = make_trainer(get_spec("digits_cnn"), int(v.removeprefix("int").replace("float", "")), seed=0)
        tr.load_shared(w)
        loss, acc = tr.evaluate(test)
        assert scored[v][1] == acc  # exactly: hits are counted, not averaged
        assert scored[v][0] == pytest.approx(loss, rel=1e-6)
    assert len({round(s[1], 6) for s in scored.values()}) > 1  # the variants' scores differ


def test_scores_do_not_depend_on_the_thread_count(small_chunks: int) -> None:
    test, val = load_digits("test"), load_digits("train").subset(np.arange(200))
    variants = {"float32": _trained(32), "int16": _trained(16), "int8": _trained(8)}
    one = ModelEvaluator("digits_cnn", test, validation=val, threads=1)(variants)
    two = ModelEvaluator("digits_cnn", test, validation=val, threads=2)
    assert two(variants) == one  # bit for bit: the chunks and the sums' order are fixed
    assert two(variants) == one  # again, on the threads and trainers kept from the first call
    two.close()


def test_the_test_split_only_in_the_reported_rounds_a_validation_subsample_before() -> None:
    test, val = load_digits("test"), load_digits("train").subset(np.arange(100))
    ev = evaluator_for("digits_cnn", test, {}, validation=val, report_from=4, val_sample=40, threads=2)
    w = {"int8": _trained(8)}
    early, late, outside = ev(w, at_round=3), ev(w, at_round=4), ev(w)
    assert np.isnan(early["int8"][1]) and early["int8"][2]["val_samples"] == 40  # no test split read
    assert late["int8"] == outside["int8"] and late["int8"][2] == early["int8"][2]  # the same subsample
    tr = make_trainer(get_spec("digits_cnn"), 8, seed=0)
    tr.load_shared(w["int8"])
    sub = ev._split("vsub")[0]
    assert late["int8"][1] == tr.evaluate(test)[1] and late["int8"][2]["val_accuracy"] == tr.evaluate(sub)[1]
    assert len(np.unique(sub.y)) > 3  # drawn at random, not the first 40
    whole = evaluator_for("digits_cnn", test, {}, validation=val, report_from=4)(w, at_round=1)["int8"]
    assert np.isnan(whole[1]) and whole[2]["val_samples"] == 100 and whole[2]["val_accuracy"] == tr.evaluate(val)[1]
    ev.report_from = 2  # (the emulator moves it at a plateau)
    assert ev(w, at_round=3) == late
    ev.close()
    # without a validation split every round reads the test split
    assert evaluator_for("digits_cnn", test, {}, report_from=4)(w, at_round=1)["int8"][1] == late["int8"][1]


def test_variants_that_run_the_same_network_are_scored_once() -> None:
    test = load_digits("test")
    w8 = _trained(8)
    ev = evaluator_for("digits_cnn", test, {"float_forward": "int8"})
    out = ev({"float32": w8, "int8": w8, "int6": w8})
    assert out["float32"] == out["int8"] != out["int6"]
    assert len({v for v, _ in ev._trainers}) == 2  # float32 in the Int8 forward and int8: scored once
    ev2 = evaluator_for("digits_cnn", test, {"float_forward": "int8"})
    other = [-w8[0]] + w8[1:]
    assert ev2({"float32": other, "int8": w8})["float32"] != out["int8"]  # other weights: scored on their own
    assert len(ev2._trainers) == 2


def test_a_thread_count_below_one_is_refused() -> None:
    with pytest.raises(ConfigError, match="threads must be >= 1, got 0"):
        ModelEvaluator("digits_cnn", load_digits("test"), threads=0)
