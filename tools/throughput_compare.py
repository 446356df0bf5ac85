"""Int training throughput of two interpreters on the same machine, measured in turns.

``throughput_compare.py --a NAME CMD --b NAME CMD`` starts ``CMD`` (a shell command that
runs ``tools/train_probe.py MODEL STEPS --serve``) for A and for B, then asks them for a
measurement alternately (A B, B A, A B, ...: load changes fall on both alike) ``--pairs``
times. Prints one JSON line per pair in the benchmark format (value: B's throughput,
anchor: A's in the same pair; ``--metric``: samples per second of the probe's CPU time,
by default, which the machine's other load barely moves, or wall-clock samples/s) and a
summary line: the median ratio B/A with the min and max over the pairs, and the median
wall-clock ratio beside it. Exit 1 when the median ratio is below ``--min-ratio``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from typing import Any


class Probe:
    def __init__(self, name: str, cmd: str) -> None:
        self.name = name
        self.proc = subprocess.Popen(["bash", "-c", cmd], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)
        self.ready = self._read()  # the first step: compile or cache load

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.strip()
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"{self.name}: the probe exited ({self.proc.wait()}) without an answer")

    def measure(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", nargs=2, metavar=("NAME", "CMD"), required=True, help="the anchor")
    ap.add_argument("--b", nargs=2, metavar=("NAME", "CMD"), required=True)
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--case", default="fedshift_cnn int8", help="the case name in the JSON lines")
    ap.add_argument("--metric", choices=["samples_per_cpu_s", "samples_per_s"], default="samples_per_cpu_s")
    ap.add_argument("--min-ratio", type=float, default=0.0)
    args = ap.parse_args(argv)

    a = Probe(args.a[0], args.a[1])
    b = Probe(args.b[0], args.b[1])
    ratios, wall = [], []
    try:
        for i in range(args.pairs):
            if i % 2 == 0:
                ra, rb = a.measure(), b.measure()
            else:
                rb, ra = b.measure(), a.measure()
            ratio = rb[args.metric] / ra[args.metric]
            ratios.append(ratio)
            wall.append(rb["samples_per_s"] / ra["samples_per_s"])
            unit = "samples/s" if args.metric == "samples_per_s" else "samples/CPU-s"
            print(json.dumps({"bench": "python_versions", "case": f"{args.case} {b.name}", "metric": "throughput",
                              "value": round(rb[args.metric], 1), "unit": unit,
                              "anchor": f"{args.case} {a.name}, same machine, interleaved",
                              "anchor_value": round(ra[args.metric], 1), "ratio": round(ratio, 4),
                              "wall_ratio": round(wall[-1], 4), "pair": i + 1}), flush=True)
    finally:
        a.close()
        b.close()
    med = statistics.median(ratios)
    print(json.dumps({"bench": "python_versions", "case": f"{args.case} {b.name} / {a.name}",
                      "metric": "throughput_ratio", "per": args.metric, "median": round(med, 4),
                      "min": round(min(ratios), 4), "max": round(max(ratios), 4), "pairs": len(ratios),
                      "wall_median": round(statistics.median(wall), 4), "min_ratio": args.min_ratio,
                      "first_step_s": {a.name: round(a.ready["first_step_s"], 2),
                                       b.name: round(b.ready["first_step_s"], 2)},
                      "commands": {a.name: shlex.split(args.a[1])[-4:], b.name: shlex.split(args.b[1])[-4:]}}),
          flush=True)
    if med < args.min_ratio:
        print(f"throughput_compare: {b.name} runs at {med:.3f} of {a.name} (median of {len(ratios)} pairs), "
              f"below {args.min_ratio}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
