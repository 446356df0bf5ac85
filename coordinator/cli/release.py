"""``fedbit release``: the operator's side of the quarantine (:mod:`coordinator.defense.reputation`):
list a job's quarantined devices, or let one back in."""

from __future__ import annotations

import argparse
import sys


def add_release_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("release", help="list a job's quarantined devices, or release one",
                       description="A device whose updates were norm-bounded or refused in several rounds is "
                                   "quarantined: never selected until the operator releases it. Without "
                                   "DEVICE_ID: the quarantined devices and why. With it: a release request in "
                                   "RUN_DIR/release/, which the coordinator takes before it selects the next "
                                   "round (a stopped job: when it resumes).")
    p.add_argument("device_id", nargs="?", metavar="DEVICE_ID",
                   help="the device to release (none: list the quarantined devices and why)")
    p.add_argument("--run", required=True, metavar="RUN_DIR", help="the job's run folder (fedbit serve --out, "
                   "or a fedbit emulate run folder)")
    p.set_defaults(func=_cmd_release)


def _cmd_release(args: argparse.Namespace) -> int:
    from coordinator.defense.reputation import Reputation, request_release
    from coordinator.ops.rundir import coordinator_dir
    from edge_client.errors import ConfigError
    from edge_client.protocol import valid_id

    try:
        run = coordinator_dir(args.run)
        if args.device_id is None:
            rep = Reputation(run_dir=run)
            rep.load()
            if not rep.quarantined:
                print(f"no device is quarantined in {run}")
            for dev, q in sorted(rep.quarantined.items()):
                print(f"{dev}: quarantined after round {q.get('round')} ({'; '.join(q.get('reasons', []))})")
            return 0
        if not valid_id(args.device_id):
            raise ConfigError(f"{args.device_id!r} is not a device id")
        _, record = request_release(run, args.device_id)
    except ConfigError as exc:
        print(f"fedbit release: error: {exc}", file=sys.stderr)
        return 1
    if record is None:
        print(f"{args.device_id} is not quarantined in {run} (as last saved); the request stays for the "
              f"coordinator, which ignores it unless the device is quarantined by then")
    else:
        print(f"release of {args.device_id} requested (quarantined after round {record.get('round')}); "
              f"the coordinator takes it before it selects the next round")
    return 0
