"""What the commands say about a run names what each figure is: the group of every
accuracy (progress lines, the round's log line, serve's final JSON), the swept values of
a sweep; and serve refuses a used --out before it starts anything."""

from __future__ import annotations

import signal
from pathlib import Path

from coordinator.cli.emulate import header
from coordinator.emulation.config import from_dict
from coordinator.ops.logs import final_line, group_accuracy_text, round_line

RECORD = {"round": 3, "accuracy": 0.961, "accepted": 4, "selected": 4, "round_seconds": 1.5,
          "groups": {"int8": {"accuracy": 0.906}, "float32": {"accuracy": 0.961}, "int6": {"accuracy": 0.9}}}


def test_every_accuracy_names_its_group() -> None:
    assert group_accuracy_text(RECORD) == "float32 0.9610 int6 0.9000 int8 0.9060"
    assert round_line(RECORD, 5).startswith("round 3/5: accuracy float32 0.9610 int6 0.9000 int8 0.9060, 4/4 updates")
    one = {k: v for k, v in RECORD.items() if k != "groups"}
    assert round_line(one, 5).startswith("round 3/5: accuracy float32 0.9610,")  # named even when alone
    last = final_line([RECORD], broker="b", metrics="m")
    assert last == {"rounds": 1, "final_accuracy": {"float32": 0.961, "int6": 0.9, "int8": 0.906},
                    "broker": "b", "metrics": "m"}
    assert list(last["final_accuracy"]) == ["float32", "int6", "int8"]
    assert final_line([]) == {"rounds": 0, "final_accuracy": {}}


def test_emulate_says_what_a_sweep_varies() -> None:
    cfg = from_dict({"name": "q", "rounds": 3, "seeds": [0, 1], "devices": {"raspberry-pi-4": 2, "desktop": 1},
                     "sweep": {"strategy": ["fedavg", "fedshift"], "data.alpha": [0.1, 0.5]}}, "q.toml")
    line = header(cfg, Path("out"))
    assert "strategy fedavg | fedshift (swept)" in line and "strategy fedavg," not in line
    assert "sweep: data.alpha = 0.1 | 0.5" in line and "seeds [0, 1] (8 run(s))" in line


def test_serve_refuses_a_used_out_before_it_starts_a_broker(tmp_path: Path, capsys) -> None:
    from coordinator.cli import main

    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoint.msgpack").write_bytes(b"x")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert main(["serve", "--model", "mlp", "--out", str(out), "--quiet"]) == 1
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    captured = capsys.readouterr()
    assert f"{out} holds a previous run: pass --resume or use another --out" in captured.err
    assert "broker:" not in captured.out and not (out / "security").exists()
