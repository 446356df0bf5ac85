"""``fedbit emulate`` (a whole fleet on this machine from an experiment file), ``fedbit
demo`` (the bundled default experiment) and ``fedbit report`` (plots and summaries)."""

from __future__ import annotations

import argparse
import math
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the commands import lazily: a fast --help
    from collections.abc import Callable
    from pathlib import Path

    from coordinator.cli.common import StopPoint
    from coordinator.emulation.config import ExperimentConfig


def add_emulate_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from edge_client.logs import add_logging_options

    for name in ("emulate", "demo"):
        if name == "emulate":
            p = sub.add_parser("emulate", help="a whole fleet on this machine: devices, links, coordinator",
                               description="Run an emulated fleet (real device runtimes, simulated links and "
                                           "compute, the real coordinator) from a TOML experiment; without one, "
                                           "the bundled default (20 mixed devices on non-IID digits). Writes a "
                                           "run folder with metrics, plots and a summary.")
            p.add_argument("config", nargs="?", help="experiment TOML file (default: the bundled one)")
        else:
            p = sub.add_parser("demo", help="`fedbit emulate` with the bundled default experiment",
                               description="The bundled default experiment: what `make demo` runs.")
            p.set_defaults(config=None)
        p.add_argument("--out", metavar="DIR", help="run folder (default: runs/<name>-<time>)")
        p.add_argument("--set", action="append", metavar="KEY=VALUE",
                       help="override a config key, dotted for sections (rounds=5, round.deadline_s=20)")
        p.add_argument("--on-collapse", choices=["rollback", "log"],
                       help="a collapsed aggregate (every group at chance, a constant output, a dead layer): "
                            "go back to the last healthy model without that round's updates (the default), "
                            "or log it and keep it; sets the config's on_collapse")
        p.add_argument("--resume", action="store_true",
                       help="go on with an interrupted run or sweep in --out: its finished runs (same "
                            "config and seed) are kept, a run cut off part-way is made again")
        p.add_argument("--quiet", action="store_true", help="no progress display")
        p.add_argument("--dashboard", metavar="[HOST:]PORT", default="",
                       help="serve the live dashboard and Prometheus /metrics while it runs (8080: on 127.0.0.1; "
                            "0: a free port; beyond loopback: HTTPS with a CA in OUT/security and a password)")
        add_logging_options(p, default_level="warning")
        p.set_defaults(func=_cmd_emulate)

    p = sub.add_parser("report", help="plots and a summary of a run (serve or emulate) or sweep folder",
                       description="Writes accuracy.png, bytes.png and summary.md into a run folder (a `fedbit "
                                   "emulate` run or a `fedbit serve --out` folder), or the sweep summary into a "
                                   "sweep folder.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (fedbit emulate, fedbit serve --out), "
                   "a sweep folder, or any folder inside one (out/, onnx/)")
    p.set_defaults(func=_cmd_report)


def _cmd_emulate(args: argparse.Namespace) -> int:
    from coordinator.cli.common import (
        Interrupted,
        StopPoint,
        resume_command,
        stop_on_signals,
        stopped_line,
    )

    stop_on_signals()
    point = StopPoint()
    where: dict[str, str] = {}
    try:
        return _emulate(args, point, where)
    except Interrupted as exc:  # (workers, brokers and the dashboard are stopped by now)
        if "out" not in where:
            print(f"fedbit {args.command}: stopped by {exc.name} before it started", file=sys.stderr, flush=True)
            return exc.status
        resume = resume_command("fedbit", getattr(args, "argv", [args.command]), {"--out": where["out"]})
        note = "; finished runs are kept, the interrupted one starts again" if point.run else \
            "; the run starts again from its first round"
        print(stopped_line(f"fedbit {args.command}", exc, point, resume, note), file=sys.stderr, flush=True)
        return exc.status


def _emulate(args: argparse.Namespace, point: StopPoint, where: dict[str, str]) -> int:
    import time
    from pathlib import Path

    from coordinator.config import parse_assignments
    from coordinator.emulation.config import expand_sweep, load_config
    from coordinator.emulation.experiment import run_experiment
    from coordinator.ops.dashboard.monitor import fan_out
    from coordinator.ops.dashboard.watch import Watch
    from coordinator.ops.logs import LiveProgress
    from edge_client.errors import ConfigError
    from edge_client.intnn.compile_note import say_when_compiling
    from edge_client.logs import setup_logging

    setup_logging(json_lines=args.log_json, level=args.log_level)
    try:
        overrides = parse_assignments(args.set) | ({"on_collapse": args.on_collapse} if args.on_collapse else {})
        cfg = load_config(args.config, overrides)
        expand_sweep(cfg)  # every combination (its values, profiles, codecs) checked before anything is written
    except ConfigError as exc:
        print(f"fedbit emulate: error: {exc}", file=sys.stderr)
        return 1
    out = Path(args.out) if args.out else Path("runs") / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if args.resume and not args.out:
        print("fedbit emulate: error: --resume needs the --out of the run to go on with", file=sys.stderr)
        return 1
    if out.exists() and any(out.iterdir()) and not args.resume:
        print(f"fedbit emulate: error: {out} is not empty: pick another --out, or --resume to go on "
              "with the run there", file=sys.stderr)
        return 1
    try:
        watch = Watch(listen=args.dashboard, security_dir=out / "security", job_id="emulate")
    except ConfigError as exc:
        print(f"fedbit emulate: error: {exc}", file=sys.stderr)
        return 1
    where["out"] = str(out)
    if watch.describe:
        print(watch.describe, flush=True)
    print(header(cfg, out), flush=True)
    say_when_compiling(lambda m: print(m, flush=True))
    bars: list[LiveProgress] = []

    def progress(rounds: int) -> LiveProgress | None:
        if args.quiet:
            return None
        bars.append(LiveProgress(rounds))
        return bars[-1]

    def watched(c: ExperimentConfig, combo: dict[str, Any], seed: int, run_dir: Path
                ) -> Callable[[str, dict[str, Any]], None]:
        label = ", ".join(f"{k}={v}" for k, v in combo.items())
        if run_dir != out:  # one run of several
            point.new_run(f"the run {label + ', ' if label else ''}seed {seed}")
        return fan_out(point, watch.new_run(c.as_dict() | {"seed": seed}, c.rounds, f"{c.name}: seed {seed}"
                             + (f" ({label})" if label else ""), run_dir / "out"))

    outcome = "error"
    try:
        summary = run_experiment(cfg, out, on_event=progress, echo=lambda m: print(m, flush=True), on_run=watched,
                                 resume=args.resume)
        outcome = "done"
    except (ConfigError, ConnectionError) as exc:
        print(f"fedbit emulate: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        outcome = "stopped"
        raise
    finally:
        for b in bars:
            b.close()
        watch.close(outcome)
    text = summary.read_text()
    # the result (a single run) or the whole table (a sweep); the rest is in the file
    start = text.find("## Result")
    print(text[start:text.find("\n## ", start + 1)] if start >= 0 else text, flush=True)
    print(f"fedbit emulate: report: {summary} (plots beside it); run folder kept: {out}", flush=True)
    return 0


def header(cfg: ExperimentConfig, out: Path) -> str:
    """The first line of ``fedbit emulate``: the experiment, its fleet, what a run is and
    what the sweep varies (a swept key is given as its values, never as the base's)."""
    from coordinator.emulation.analysis import ANALYSIS_KEYS

    swept = {k.lstrip("@"): [v["label"] if isinstance(v, dict) else v for v in vs]
             for k, vs in cfg.sweep.items() if k not in ANALYSIS_KEYS}
    shown = {"model": cfg.model, "strategy": cfg.strategy, "rounds": cfg.rounds, "transport": cfg.transport}
    what = ", ".join(f"{k} {' | '.join(map(str, swept[k]))} (swept)" if k in swept else f"{k} {v}"
                     for k, v in shown.items())
    more = [f"{k} = {' | '.join(map(str, vs))}" for k, vs in swept.items() if k not in shown]
    n_runs = len(cfg.seeds) * math.prod(len(vs) for vs in swept.values())
    devices = ", ".join(f"{n} {p}" for p, n in cfg.devices.items() if n)
    return (f"fedbit emulate: {cfg.name} ({cfg.source}): {sum(cfg.devices.values())} devices ({devices}), "
            f"{what}{'; sweep: ' + '; '.join(more) if more else ''}; seeds {cfg.seeds} ({n_runs} run(s)); "
            f"run folder {out}")


def _cmd_report(args: argparse.Namespace) -> int:
    import json

    from coordinator.emulation.report import write_report, write_sweep_report
    from coordinator.ops.rundir import find_run, sweep_runs
    from edge_client.errors import ConfigError

    try:
        run = find_run(args.run_dir)
        if run.kind != "sweep":
            summary = write_report(run.path)
        elif (run.path / "results.json").is_file():
            results = json.loads((run.path / "results.json").read_text())
            summary = write_sweep_report(run.path, [(r["combination"], r["seed"], run.path / r["run"])
                                                    for r in results])
        else:
            raise ConfigError(f"{run.path}: a sweep that did not finish (no results.json): go on with it "
                              f"(`fedbit emulate CONFIG --out {run.path} --resume`) or report one of its "
                              f"{len(sweep_runs(run.path))} run folders")
    except ConfigError as exc:
        print(f"fedbit report: error: {exc}", file=sys.stderr)
        return 1
    print(f"fedbit report: {summary}")
    return 0
