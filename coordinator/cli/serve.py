"""``fedbit serve``: the round loop against the devices of one job, configured by a job
file (``--config``, :mod:`coordinator.job`) and flags that override it."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the commands import lazily: a fast --help
    from coordinator.job import ServeJob


def add_serve_command(sub: Any) -> None:
    from coordinator.job import add_job_options

    # (allow_abbrev=False: an old `--password x` must not turn into `--password-file x`)
    p = sub.add_parser("serve", help="run the round loop (starts an embedded broker without --broker)",
                       description="Run federated rounds against the devices of one job. Settings come from "
                                   "the job file (--config FILE, see examples/job.toml); flags and --set "
                                   "KEY=VALUE override it.", allow_abbrev=False)
    add_job_options(p)
    p.set_defaults(func=_cmd_serve)


def _eval_data(src: str) -> Any:
    from edge_client.data import load_source

    return load_source(src, default_part="test")


def _cmd_serve(args: argparse.Namespace) -> int:
    from coordinator.cli.common import (
        Interrupted,
        StopPoint,
        resume_command,
        stop_on_signals,
        stopped_line,
    )

    stop_on_signals()
    point = StopPoint()
    try:
        return _serve(args, point)
    except Interrupted as exc:  # (the broker, the dashboard and live.json are closed by now)
        resume = resume_command("fedbit", getattr(args, "argv", ["serve"]))
        print(stopped_line("fedbit serve", exc, point, resume), file=sys.stderr, flush=True)
        return exc.status


def _serve(args: argparse.Namespace, point: Any) -> int:
    import json
    from pathlib import Path

    from coordinator.cli.security import serve_broker
    from coordinator.evaluate import evaluator_for
    from coordinator.fleet import MqttFleet
    from coordinator.ingest_workers import ingest_workers_for
    from coordinator.job import coordinator_for, job_from_args
    from coordinator.ops.dashboard.monitor import fan_out
    from coordinator.ops.dashboard.watch import Watch
    from coordinator.ops.logs import ProgressDisplay, final_line, hide_events
    from coordinator.server import RoundError
    from coordinator.state import RunState
    from coordinator.strategies import build_strategy
    from edge_client.errors import ConfigError
    from edge_client.intnn import init_shared
    from edge_client.intnn.compile_note import say_when_compiling
    from edge_client.intnn.memory import keep_freed_memory
    from edge_client.logs import setup_logging
    from firmware_models import resolve_model

    keep_freed_memory()  # each round's evaluation reuses the heap (edge_client/intnn/memory.py)
    try:
        job = job_from_args(args)
    except ConfigError as exc:
        print(f"fedbit serve: error: {exc}", file=sys.stderr)
        return 1
    cfg = job.server
    logger = setup_logging(json_lines=job.log_json, level=job.log_level)
    say_when_compiling(lambda m: print(m, flush=True))
    progress = None if job.quiet else ProgressDisplay(cfg.rounds)
    if progress is not None and not job.log_json:  # what the progress lines say is not logged again
        hide_events(logger, ProgressDisplay.SHOWN)
    broker = watch = None
    outcome = "error"
    try:
        # (before a broker starts or live.json is overwritten; a new --out is made only later)
        if not job.resume and Path(job.out).is_dir() and RunState(job.out).has_run():
            raise ConfigError(f"{job.out} holds a previous run: pass --resume or use another --out")
        spec = resolve_model(cfg.model)
        strategy = build_strategy(cfg.strategy, model=cfg.model, **cfg.strategy_params)
        broker, conn = serve_broker(job, cfg.limits.max_payload_bytes + 65536)
        cfg.admission.enrolment = conn.pop("enrolment")
        url, conn = conn.pop("url"), conn | {"protocol": job.broker.mqtt_version,
                                             "max_payload": cfg.limits.max_payload_bytes + 65536}
        workers = ingest_workers_for(job, broker, url, conn, logger) if job.ingest_workers else None
        fleet = workers.fleet_for(url, cfg.job, **conn) if workers else MqttFleet(url, cfg.job, **conn)
        strategy = workers.wrap(strategy) if workers else strategy
        evaluator = evaluator_for(cfg.model, _eval_data(job.eval_data), strategy.device_hparams(cfg.hparams),
                                  seed=cfg.seed, watch_held_out=True)  # a deployment: no test split
        state = RunState(job.out)
        watch = Watch(listen=job.dashboard.listen, security_dir=_security_dir(job), job_id=cfg.job,
                      hostnames=job.broker.hostnames or None, password_file=job.dashboard.password_file)
        if watch.describe:
            print(watch.describe, flush=True)
        observe = watch.new_run(job.table, cfg.rounds, f"job {cfg.job}: {cfg.model}, {cfg.strategy}", job.out,
                                state.read_metrics() if job.resume else None)
        coord = coordinator_for(cfg, fleet, strategy, state, evaluator=evaluator,
                                init_weights=init_shared(spec, cfg.seed), on_event=fan_out(progress, observe, point),
                                logger=logger.getChild("server"))
        if workers:
            workers.attach(coord.collector, coord.strategy)
        print(f"fedbit serve: job {cfg.job}, model {cfg.model}, strategy {cfg.strategy}, "
              f"{cfg.rounds} round(s), out {job.out}", flush=True)
        try:
            history = coord.run(resume=job.resume)
        except KeyboardInterrupt:
            outcome = "stopped"
            raise
        outcome = "done"
        _export_finished_run(job.out)
        print(json.dumps(final_line(history, broker=fleet.describe(), metrics=str(coord.state.metrics_path))),
              flush=True)
        fleet.close()
        return 0
    except (ConfigError, RoundError, ConnectionError) as exc:
        print(f"fedbit serve: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if watch is not None:
            watch.close(outcome)
        if broker is not None:
            broker.stop()


def _security_dir(job: ServeJob) -> str:
    """The job's security folder, as :func:`~coordinator.cli.security.serve_broker` finds it."""
    from pathlib import Path

    b = job.broker
    if b.security_dir:
        return b.security_dir
    if b.url and b.credentials:
        return str(Path(b.credentials).parent)
    return str(Path(job.out) / "security")


def _export_finished_run(run_dir: str) -> None:
    """After a complete run: the ONNX export of every bitwidth variant of the final model
    into ``RUN_DIR/onnx/`` (a note on stderr when onnx is not installed or the export
    fails; the run itself succeeded and ``fedbit export`` can be run again)."""
    import importlib.util

    from coordinator.ops.export import export_run
    from edge_client.errors import ConfigError

    if importlib.util.find_spec("onnx") is None:
        print("fedbit serve: note: no ONNX export of the final model (pip install "
              "'fedbit[onnx]', then `fedbit export RUN_DIR --all`)", file=sys.stderr)
        return
    try:
        paths = export_run(run_dir)
    except ConfigError as exc:
        print(f"fedbit serve: ONNX export failed: {exc}", file=sys.stderr)
        return
    print(f"onnx: {', '.join(str(p) for p in paths)}", flush=True)
