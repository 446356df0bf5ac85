"""Runs an experiment: every sweep combination with every seed, each an
:class:`~coordinator.emulation.run.Emulator` run, then the reports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from coordinator.emulation.config import ExperimentConfig, expand_sweep, run_slug


def run_experiment(cfg: ExperimentConfig, out: str | Path, *,
                   on_event: Any = None, echo: Any = print, on_run: Any = None) -> Path:
    """Run every sweep combination with every seed (``coordinator.emulation.run.Emulator``)
    and write the reports. One run goes to ``out`` itself; several to
    ``out/runs/<combination>/seed-<k>/`` with a sweep summary in ``out``. Returns the
    path of the top ``summary.md``. ``on_event(rounds)`` makes each run's progress
    callback; ``on_run(config, combination, seed, run_dir)`` another callback of the run
    (a watcher: the dashboard); ``echo`` prints what runs."""
    from coordinator.emulation.report import combo_label, write_report, write_sweep_report
    from coordinator.emulation.run import Emulator
    from coordinator.ops.dashboard.monitor import fan_out

    out = Path(out)
    combos = expand_sweep(cfg)
    single = len(combos) == 1 and len(cfg.seeds) == 1
    runs = []
    for combo, c in combos:
        for seed in c.seeds:
            run_dir = out if single else out / "runs" / run_slug(combo) / f"seed-{seed}"
            if not single:
                echo(f"run {len(runs) + 1}/{len(combos) * len(cfg.seeds)}: {combo_label(combo)}, seed {seed}")
            watcher = on_run(c, combo, seed, run_dir) if on_run else None
            Emulator(c, seed, run_dir, on_event=fan_out(on_event(c.rounds) if on_event else None, watcher)).run()
            summary = write_report(run_dir)
            runs.append((combo, seed, run_dir))
    if single:
        return summary
    return write_sweep_report(out, runs)
