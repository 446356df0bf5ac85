"""Runs an experiment: every sweep combination with every seed, each an
:class:`~coordinator.emulation.emulator.Emulator` run, then the reports.

``resume``: an interrupted sweep (a killed process, a machine's time limit) goes on from
where it stopped. A run folder that holds a finished run of the same combination and seed
(:func:`finished_run`) is kept and reported as it is; any other folder left at a run's
place (a run cut off part-way) is cleared and the run made again from its first round.
Only the config and the seed are compared: a change of fedbit's code between the two
invocations is not detected.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from coordinator.emulation.config import (
    ExperimentConfig,
    expand_sweep,
    from_dict,
    run_slug,
    set_dotted,
)
from coordinator.emulation.tuning import bracket, is_table, point_label, score

#: config keys that do not change what one run computes: the name (it labels folders and
#: the job), which seeds the sweep has and the sweep table itself (its baselines and tuning
#: are read by the reports only)
_NOT_THE_RUN = ("name", "seeds", "sweep")


def finished_run(run_dir: str | Path, cfg: ExperimentConfig, seed: int) -> bool:
    """Whether ``run_dir`` holds a finished run of ``cfg`` (one sweep combination) with
    ``seed``: its ``emulation.json`` was written at the run's end (``wall_seconds``), it
    records the same config (every key but the name, the seed list and the sweep table), the same
    stage settings and the same seed, and ``out/metrics.jsonl`` has one record for each
    round it ran (``cfg.rounds``, fewer when it stopped at a plateau: its ``stop``, or each
    round up to the simulated time budget, ``[clock] until_s``). Unreadable files count as
    not finished."""
    run_dir = Path(run_dir)
    try:
        info = json.loads((run_dir / "emulation.json").read_text())
        lines = (run_dir / "out" / "metrics.jsonl").read_text().splitlines()
    except (OSError, ValueError):
        return False
    if not isinstance(info, dict) or "wall_seconds" not in info or info.get("seed") != int(seed):
        return False
    rounds = sorted({_round(line) for line in lines if line.strip()} - {None})
    stop = info.get("stop") or {}
    ran = stop.get("rounds", cfg.rounds)
    if not isinstance(ran, int) or not 1 <= ran <= cfg.rounds or rounds != list(range(1, ran + 1)):
        return False
    until = float(cfg.clock.until_s)  # (fewer rounds: a plateau, or the simulated time budget)
    if ran < cfg.rounds and stop.get("plateau_round") is None and float(info.get("sim_seconds", 0.0)) < until:
        return False
    return (_run_keys(info.get("config")) == _run_keys(_plain(cfg.as_dict()))
            and info.get("paper_stage_params") == _plain(dict(cfg.paper_stage_params)))


def _round(line: str) -> int | None:
    try:
        r = json.loads(line).get("round")
    except (ValueError, AttributeError):
        return None
    return r if isinstance(r, int) else None


def _plain(value: Any) -> Any:
    """``value`` as ``emulation.json`` holds it (tuples as lists, keys as strings)."""
    return json.loads(json.dumps(value))


def _run_keys(config: Any) -> Any:
    return {k: v for k, v in config.items() if k not in _NOT_THE_RUN} if isinstance(config, dict) else None


def _clear(run_dir: Path) -> None:
    """Remove what a run cut off part-way left in ``run_dir`` (the coordinator's state,
    the devices' folders, the run's description); the folder itself stays (a single run's
    is the user's ``--out``)."""
    for name in ("out", "devices"):
        if (run_dir / name).is_dir():
            shutil.rmtree(run_dir / name)
    (run_dir / "emulation.json").unlink(missing_ok=True)


def run_experiment(cfg: ExperimentConfig, out: str | Path, *, on_event: Any = None, echo: Any = print,
                   on_run: Any = None, resume: bool = False) -> Path:
    """Run every sweep combination with every seed (``coordinator.emulation.emulator.Emulator``)
    and write the reports. One run goes to ``out`` itself; several to
    ``out/runs/<combination>/seed-<k>/`` with a sweep summary in ``out``. Returns the
    path of the top ``summary.md``. ``on_event(rounds)`` makes each run's progress
    callback; ``on_run(config, combination, seed, run_dir)`` another callback of the run
    (a watcher: the dashboard); ``echo`` prints what runs. ``resume``: keep the finished
    runs already in ``out`` (see the module docstring)."""
    from coordinator.emulation.report import combo_label, write_report, write_sweep_report

    out = Path(out)
    combos = expand_sweep(cfg)
    if is_table(cfg.sweep.get("tune")):
        combos = _tune(cfg, combos, out, on_event=on_event, echo=echo, on_run=on_run, resume=resume)
    single = len(combos) == 1 and len(cfg.seeds) == 1 and not is_table(cfg.sweep.get("tune"))
    total = len(combos) * len(cfg.seeds)
    runs = []
    for combo, c in combos:
        for seed in c.seeds:
            run_dir = out if single else out / "runs" / run_slug(combo) / f"seed-{seed}"
            what = f"run {len(runs) + 1}/{total}: {combo_label(combo)}, seed {seed}"
            if resume and finished_run(run_dir, c, seed):
                echo(f"{what}: finished before, kept")
                runs.append((combo, seed, run_dir))
                summary = run_dir / "summary.md" if (run_dir / "summary.md").is_file() else write_report(run_dir)
                continue
            if not single:
                echo(what)
            summary = _one_run(c, combo, seed, run_dir, on_event=on_event, on_run=on_run, resume=resume)
            runs.append((combo, seed, run_dir))
    if single:
        return summary
    return write_sweep_report(out, runs)


def _one_run(c: ExperimentConfig, combo: dict[str, Any], seed: int, run_dir: Path, *, on_event: Any,
             on_run: Any, resume: bool, report: bool = True) -> Path | None:
    """One emulated run (a part-way one cleared first under ``resume``) and its report
    (``report``; a tuning run's figures are read from its metrics)."""
    from coordinator.emulation.emulator import Emulator
    from coordinator.emulation.report import write_report
    from coordinator.ops.dashboard.monitor import fan_out

    if resume:
        _clear(run_dir)  # a run cut off part-way: made again from its first round
    watcher = on_run(c, combo, seed, run_dir) if on_run else None
    Emulator(c, seed, run_dir, on_event=fan_out(on_event(c.rounds) if on_event else None, watcher)).run()
    return write_report(run_dir) if report else None


def _tune(cfg: ExperimentConfig, combos: list[tuple[dict[str, Any], ExperimentConfig]], out: Path, *,
          on_event: Any, echo: Any, on_run: Any, resume: bool) -> list[tuple[dict[str, Any], ExperimentConfig]]:
    """The tuning runs of a ``[sweep.tune]`` table (coordinator.emulation.tuning) into
    ``out/tuning/``, their choices in ``out/tuning.json``; returns every combination's
    config with its chosen point, for the reported seeds."""
    from coordinator.emulation.report import combo_label, load_run, summarize_run

    tune = cfg.sweep["tune"]
    seeds = [int(x) for x in tune["seeds"]]
    record: dict[str, Any] = {"seeds": seeds, "by": tune.get("by"), "combinations": {}}
    chosen = []
    n_runs = sum(len(bracket(tune, combo)) for combo, _ in combos) * len(seeds)
    k = 0
    for combo, c in combos:
        scores: dict[str, float] = {}
        points = bracket(tune, combo)
        for point in points:
            pc = _with(c, point, seeds)
            summaries = []
            for seed in seeds:
                k += 1
                run_dir = out / "tuning" / run_slug(combo) / run_slug(point) / f"seed-{seed}"
                what = f"tuning run {k}/{n_runs}: {combo_label(combo)}, {point_label(point)}, seed {seed}"
                if resume and finished_run(run_dir, pc, seed):
                    echo(f"{what}: finished before, kept")
                else:
                    echo(what)
                    _one_run(pc, combo, seed, run_dir, on_event=on_event, on_run=on_run, resume=resume,
                             report=False)
                summaries.append(summarize_run(*load_run(run_dir)))
            scores[point_label(point)] = score(summaries)
        best = max(points, key=lambda p: scores[point_label(p)])
        record["combinations"][combo_label(combo)] = {
            "budget": len(points), "keys": sorted(best), "scores": scores, "chosen": best}
        chosen.append((combo, _with(c, best, c.seeds)))
    out.mkdir(parents=True, exist_ok=True)
    (out / "tuning.json").write_text(json.dumps(record, indent=1))
    return chosen


def _with(c: ExperimentConfig, point: dict[str, Any], seeds: list[int]) -> ExperimentConfig:
    """Config ``c`` with a tuning point's settings and ``seeds``."""
    raw = c.as_dict()
    for key, value in point.items():
        set_dotted(raw, key, value, f"{c.source} [sweep.tune]")
    raw["seeds"] = list(seeds)
    return from_dict(raw, c.source)
