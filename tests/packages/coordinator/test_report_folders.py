"""``fedbit report``, ``status`` and ``export`` on every folder a run or a sweep writes, and
the report's plots: a ``fedbit serve`` folder reports wall time and no simulated panel
(no "nan"), a sweep folder names the run folders to pick, accuracy is in percent on
integer round ticks, groups and codecs keep fixed, distinct colour-blind-safe styles."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from coordinator.cli import main
from coordinator.emulation import plots
from coordinator.ops.rundir import coordinator_dir, find_run


def serve_folder(d: Path, rounds: int = 5) -> Path:
    """What ``fedbit serve --out d`` leaves: metrics.jsonl (no simulated clock) and live.json."""
    d.mkdir(parents=True)
    recs = [{"round": r, "accuracy": 0.5 + 0.05 * r, "selected": 3, "accepted": 3, "stragglers": 0,
             "round_seconds": 1.25, "wait_seconds": 0.5 if r == 1 else 0.0,
             "uplink_bytes": {"float32-32": 4000, "int-8": 1000},
             "groups": {"float32": {"accuracy": 0.5 + 0.05 * r}, "int8": {"accuracy": 0.45 + 0.05 * r},
                        "int6": {"accuracy": 0.4 + 0.05 * r}}} for r in range(1, rounds + 1)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (d / "live.json").write_text(json.dumps({"state": "done", "title": "job farm: mlp, fedavg",
                                             "job": {"job": "farm", "model": "mlp", "strategy": "fedavg",
                                                     "seed": 0, "round": {"quorum": 1.0}}}))
    return d


def emulated_run(d: Path) -> Path:
    serve_folder(d / "out", rounds=3)
    recs = [json.loads(line) | {"sim_time": 2.0 * i} for i, line in
            enumerate((d / "out" / "metrics.jsonl").read_text().splitlines(), 1)]
    (d / "out" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (d / "emulation.json").write_text(json.dumps({"config": {"name": "tiny"}, "seed": 0, "source": "tiny.toml",
                                                  "wall_seconds": 4.0}))
    return d


def sweep(d: Path) -> Path:
    for combo in ("strategy-fedavg", "strategy-fedshift"):
        for seed in (0, 1):
            emulated_run(d / "runs" / combo / f"seed-{seed}")
    return d


def test_report_on_a_serve_folder_gives_wall_time_and_no_simulated_panel(tmp_path: Path, monkeypatch, capsys) -> None:
    run = serve_folder(tmp_path / "job2")
    figs: list = []
    real_save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path, dpi: figs.append(fig) or real_save(fig, path, dpi))
    assert main(["report", str(run)]) == 0
    text = (run / "summary.md").read_text()
    assert "nan" not in text.lower() and "simulated" not in text
    assert text.startswith("# job farm: mlp, fedavg\n") and "seed 0" not in text.splitlines()[0]
    assert "Made by `fedbit serve`" in text and "Config: `fedbit serve`" not in text
    assert "5 rounds in 6.8 s of wall time; 0 straggler(s) in all." in text
    assert "| int6 |" in text and "| job | `farm` |" in text
    acc, _bytes = figs
    assert len(acc.axes) == 1  # the round panel only
    ax = acc.axes[0]
    assert ax.get_ylim() == (0, 100) and "%" in ax.get_ylabel()
    assert all(float(t).is_integer() for t in ax.get_xticks())
    lines = {ln.get_label().split(":")[0]: ln for ln in ax.get_lines()}
    assert {ln.get_color() for ln in lines.values()} == {plots.group_colour(g) for g in ("float32", "int8", "int6")}
    assert len({ln.get_linestyle() for ln in lines.values()}) == 3 and len({ln.get_marker() for ln in lines.values()}) == 3
    assert all(float(t).is_integer() for t in _bytes.axes[0].get_xticks())


def test_emulated_run_keeps_its_simulated_panel_and_out_or_onnx_folders_mean_the_run(tmp_path: Path) -> None:
    run = emulated_run(tmp_path / "r")
    (run / "out" / "onnx").mkdir()
    for given in (run, run / "out", run / "out" / "onnx"):
        found = find_run(given)
        assert (found.kind, found.path, found.coordinator) == ("emulated", run, run / "out")
    assert main(["report", str(run / "out")]) == 0
    text = (run / "summary.md").read_text()
    assert text.startswith("# tiny: seed 0") and "3 rounds in 4.0 s of wall time and 6.0 s of simulated time" in text
    assert not (run / "out" / "summary.md").exists()


def test_status_and_export_on_a_sweep_folder_point_at_a_run_folder(tmp_path: Path, capsys) -> None:
    root = sweep(tmp_path / "sw")
    for cmd in (["status"], ["export", "--bits", "8"]):
        assert main([cmd[0], str(root), *cmd[1:]]) == 1
        err = capsys.readouterr().err
        assert f"{root}: a sweep folder (4 runs); this takes one run: {root}/runs/<combination>/seed-<k>, e.g. " \
               f"{root}/runs/strategy-fedavg/seed-0" in err, err
    for part in (root / "runs", root / "runs" / "strategy-fedshift"):
        with pytest.raises(Exception, match=re.escape(f"{part}: holds ")):
            coordinator_dir(part)
    assert coordinator_dir(root / "runs" / "strategy-fedshift" / "seed-1") == \
        root / "runs" / "strategy-fedshift" / "seed-1" / "out"
    assert main(["status", str(root / "runs" / "strategy-fedshift" / "seed-1"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rounds"]


def test_sweep_plot_titles_its_panels_neutrally_with_distinct_series(tmp_path: Path, monkeypatch) -> None:
    figs: list = []
    monkeypatch.setattr(plots, "_save", lambda fig, path, dpi: figs.append(fig) or True)
    curves = {"float32": [0.1 * r for r in range(1, 8)], "int8": [0.09 * r for r in range(1, 8)]}
    runs = {f"strategy=s{i}": [curves, {g: [v + 0.01 for v in c] for g, c in curves.items()}] for i in range(5)}
    plots.plot_sweep(tmp_path / "c.png", runs, ["float32", "int8"], {}, "the last 5 of 7 rounds")
    (fig,) = figs
    for ax, g in zip(fig.axes, ["float32", "int8"], strict=True):
        assert ax.get_title() == f"{g} model" and ax.title.get_color() in ("black", "#000000", (0, 0, 0, 1))
        assert ax.get_ylim() == (0, 100) and all(float(t).is_integer() for t in ax.get_xticks())
    styles = [(ln.get_color(), ln.get_linestyle()) for ln in fig.axes[0].get_lines()]
    assert len(set(styles)) == 5 and len({c for c, _ in styles}) == 5


def test_the_dashboard_draws_groups_and_codecs_in_the_reports_colours() -> None:
    js = (Path(plots.__file__).parents[1] / "ops" / "dashboard" / "static" / "dashboard.js").read_text()
    for g, colour in plots.GROUP_COLOURS.items():
        assert re.search(rf"\b{g}: \[\"{colour}\"", js), g
    for c, colour in plots.CODEC_COLOURS.items():
        assert re.search(rf"\b{c}: \"{colour}\"", js), c
    assert plots.group_colour("int6") != plots.group_colour("int8")
