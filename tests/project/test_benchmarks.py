"""Every benchmark script still runs (``make bench --quick``'s path) and reports the
figures its issue asks for, each against an anchor measured in the same run."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: per benchmark, the (case substring, metric) lines its issue names
WANTED = {
    "aggregate": [("fedshift n=", "throughput"), ("prowd-swa", "throughput"), ("wire tensors", "throughput"),
                  ("vs 10 updates", "rss")],
    "emulator_scale": [("N=1,000,000", "round_seconds"), ("N=1,000,000", "rss"), ("N=1,000,000", "pss"),
                       ("N=1,000,000", "startup_seconds"), ("N=1,000,000", "coordinator_seconds"),
                       ("workers=2", "round_seconds"), ("workers=2", "speedup")],
    "inference": [("int8 onnxruntime batch 1", "throughput"), ("int8 onnxruntime batch 32", "throughput"),
                  ("int8 onnxruntime batch 1", "throughput_vs_float"),
                  ("int8 onnxruntime batch 32", "throughput_vs_float"),
                  ("int8 numba engine batch 1", "throughput"), ("int8 numba engine batch 32", "throughput")],
    "codecs": [("kmeans-8", "encode_ms"), ("kmeans-4", "encode_ms"), ("asym-8", "encode_ms"),
               ("kmeans-4", "mse")],
    "dequantizer": [("int2 preset (context=global) gated", "l1"), ("int4 preset (context=global) gated", "l1"),
                    ("int2 preset (context=global) network", "l1"), ("the preset's config", "epoch_s"),
                    ("ternary Int8 update", "apply_ms"), ("the round's tables", "compile_s")],
    "regularizer_strength": [("int8 fedprox", "relative_pull"), ("int16 fedprox", "relative_pull"),
                             ("int8 fedfor", "penalty_drop")],
    "round_overhead": [("fedshift_cnn asym-4", "updates_per_s"), ("20 devices", "coordinator_seconds_per_round"),
                       ("dashboard on vs off", "dashboard_cost_fraction"),
                       ("dashboard on vs off", "page_update_latency_s")],
    "security": [("MAC verified", "updates_per_s"), ("robust clip", "round_seconds"), ("robust median", "round_seconds"),
                 ("robust trimmed_mean", "peak_memory"), ("robust median", "peak_memory"),
                 ("defense (the round loop's default)", "round_seconds")],
    "train_throughput": [("fedshift_cnn int8", "throughput"), ("digits_cnn int8", "throughput"),
                         ("fedshift_cnn int8 2 threads", "throughput"),
                         ("fedshift_cnn int8 2 threads", "throughput_vs_float"),
                         ("fedshift_cnn int8", "rss"), ("fedshift_cnn int8", "warm_start_s")],
    "eval_share": [("fmnist-mixed-fleet", "eval_share")],
    "secagg": [("devices", "device_cpu_seconds"), ("devices", "uplink_bytes")],
    "fleet_load": [("devices", "connections_held"), ("devices", "coordinator_cpu_per_update"),
                   ("devices", "round_seconds"), ("devices", "updates_per_s")],
    "layer_profile": [("fedshift_cnn int8 conv layers", "arithmetic_bound_fraction"),
                      ("fedshift_cnn conv2 forward", "seconds"),
                      ("int8 SIMD rate: ternary_add", "rate")],
}


@pytest.mark.slow
def test_run_all_quick_writes_every_benchmarks_lines(tmp_path: Path) -> None:
    out = tmp_path / "quick.jsonl"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run_all.py"), "--quick", "--jobs", "2",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=540, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert recs and all(r["quick"] is True for r in recs)
    # every line says what it was measured with
    assert all(r["versions"]["numba"] == metadata.version("numba")
               and r["versions"]["llvmlite"] == metadata.version("llvmlite")
               and r["versions"]["numpy"] == metadata.version("numpy") for r in recs)
    for r in recs:
        assert {"bench", "case", "metric", "value", "unit", "anchor", "anchor_value", "ratio"} <= set(r)
        assert r["value"] == r["value"] and r["value"] >= 0  # not NaN
    for bench, wanted in WANTED.items():
        mine = [r for r in recs if r["bench"] == bench]
        for case, metric in wanted:
            assert any(case in r["case"] and r["metric"] == metric and r["anchor_value"] for r in mine), \
                (bench, case, metric, [(r["case"], r["metric"]) for r in mine])
    fleet = [r for r in recs if r["bench"] == "fleet_load"]
    assert all(r["lost"] == 0 and r["devices"] > 0 for r in fleet), fleet  # nothing acknowledged is lost
    assert all(r["ratio"] == 1.0 for r in fleet if r["metric"] == "connections_held"), fleet


def test_a_named_run_replaces_its_own_lines_and_keeps_the_others() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_run_all", ROOT / "benchmarks" / "run_all.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    old = [{"bench": "a", "v": 1}, {"bench": "b", "v": 1}, {"bench": "a", "v": 2}, {"bench": "c", "v": 1}]
    assert mod._merged(old, [{"bench": "a", "v": 9}, {"bench": "d", "v": 9}]) == [
        {"bench": "a", "v": 9}, {"bench": "b", "v": 1}, {"bench": "c", "v": 1}, {"bench": "d", "v": 9}]
