"""Runs an experiment: every sweep combination with every seed, each an
:class:`~coordinator.emulation.run.Emulator` run, then the reports.

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

from coordinator.emulation.config import ExperimentConfig, expand_sweep, run_slug

#: config keys that do not change what one run computes: the name (it labels folders and
#: the job), which seeds the sweep has and the sweep table itself (its baselines and tuning
#: are read by the reports only)
_NOT_THE_RUN = ("name", "seeds", "sweep")


def finished_run(run_dir: str | Path, cfg: ExperimentConfig, seed: int) -> bool:
    """Whether ``run_dir`` holds a finished run of ``cfg`` (one sweep combination) with
    ``seed``: its ``emulation.json`` was written at the run's end (``wall_seconds``), it
    records the same config (every key but the name, the seed list and the sweep table), the same
    stage settings and the same seed, and ``out/metrics.jsonl`` has one record for each
    of ``cfg.rounds`` rounds (or for each round up to the simulated time budget,
    ``[clock] until_s``). Unreadable files count as not finished."""
    run_dir = Path(run_dir)
    try:
        info = json.loads((run_dir / "emulation.json").read_text())
        lines = (run_dir / "out" / "metrics.jsonl").read_text().splitlines()
    except (OSError, ValueError):
        return False
    if not isinstance(info, dict) or "wall_seconds" not in info or info.get("seed") != int(seed):
        return False
    rounds = sorted({_round(line) for line in lines if line.strip()} - {None})
    until = float(cfg.clock.until_s)  # (a run its simulated time budget ended)
    if rounds != list(range(1, cfg.rounds + 1)) and not (
            until and rounds == list(range(1, len(rounds) + 1)) and float(info.get("sim_seconds", 0.0)) >= until):
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
    """Run every sweep combination with every seed (``coordinator.emulation.run.Emulator``)
    and write the reports. One run goes to ``out`` itself; several to
    ``out/runs/<combination>/seed-<k>/`` with a sweep summary in ``out``. Returns the
    path of the top ``summary.md``. ``on_event(rounds)`` makes each run's progress
    callback; ``on_run(config, combination, seed, run_dir)`` another callback of the run
    (a watcher: the dashboard); ``echo`` prints what runs. ``resume``: keep the finished
    runs already in ``out`` (see the module docstring)."""
    from coordinator.emulation.report import combo_label, write_report, write_sweep_report
    from coordinator.emulation.run import Emulator
    from coordinator.ops.dashboard.monitor import fan_out

    out = Path(out)
    combos = expand_sweep(cfg)
    single = len(combos) == 1 and len(cfg.seeds) == 1
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
            if resume:
                _clear(run_dir)  # a run cut off part-way: made again from its first round
            if not single:
                echo(what)
            watcher = on_run(c, combo, seed, run_dir) if on_run else None
            Emulator(c, seed, run_dir, on_event=fan_out(on_event(c.rounds) if on_event else None, watcher)).run()
            summary = write_report(run_dir)
            runs.append((combo, seed, run_dir))
    if single:
        return summary
    return write_sweep_report(out, runs)
