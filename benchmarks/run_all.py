"""Run every benchmark script and collect their JSON lines into one file.

    python benchmarks/run_all.py [--quick] [--jobs N] [--out benchmarks/results/latest.jsonl]

Each ``benchmarks/<name>.py`` prints one JSON object per line; lines that are not JSON
(progress, warnings) are passed through to stderr. A failing benchmark makes the run
fail, after the others have run. ``--jobs N`` runs N scripts at a time: for checking that
they run (the test suite's ``--quick --jobs 2``), never for figures, since the scripts'
timings would then share the CPU. Every line records the versions it was measured with
(``versions``: Python, the kernel, numpy, numba, llvmlite, torch). Named benchmarks
(``run_all.py eval_share``) replace their own lines in ``--out`` and keep the others'.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: the packages whose versions every line records (the engine's compiler and the anchors')
VERSIONED = ("numpy", "numba", "llvmlite", "torch")


def versions() -> dict[str, str]:
    """This interpreter's Python, the kernel (``platform.release()``) and the VERSIONED
    packages' versions (``"absent"`` when not installed)."""
    out = {"python": platform.python_version(), "kernel": platform.release()}
    for name in VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="pass --quick to every benchmark")
    ap.add_argument("--jobs", type=int, default=1,
                    help="scripts run at a time (default 1; more only to check they run)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "latest.jsonl")
    ap.add_argument("names", nargs="*", help="benchmark names (default: all)")
    args = ap.parse_args()

    scripts = sorted(p for p in HERE.glob("*.py") if p.name != Path(__file__).name and not p.name.startswith("_"))
    if args.names:
        scripts = [p for p in scripts if p.stem in args.names]
    def run(script: Path) -> tuple[subprocess.CompletedProcess[str], float]:
        cmd = [sys.executable, str(script)] + (["--quick"] if args.quick else [])
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
        return proc, time.perf_counter() - t0

    failed: list[str] = []
    records: list[dict] = []
    measured_with = versions()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        # results in script order, whatever order they finish in
        for script, (proc, seconds) in zip(scripts, pool.map(run, scripts), strict=True):
            print(f"== {script.name}", file=sys.stderr, flush=True)
            for line in proc.stdout.splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    print(line, file=sys.stderr)
                    continue
                if isinstance(rec, dict):
                    rec.setdefault("quick", args.quick)
                    rec.setdefault("versions", measured_with)
                    records.append(rec)
                    print(line, flush=True)
            if proc.returncode != 0:
                failed.append(script.name)
                print(proc.stderr[-4000:], file=sys.stderr)
            print(f"   {seconds:.1f} s, exit {proc.returncode}", file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.names and args.out.is_file():  # the other benchmarks' lines already there are kept
        records = _merged([json.loads(line) for line in args.out.read_text(encoding="utf-8").splitlines()
                           if line.strip()], records)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    tmp.replace(args.out)
    print(f"wrote {len(records)} results to {args.out}", file=sys.stderr)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _merged(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` with each benchmark of ``new`` in place of its old lines (where its first one
    was; a benchmark new to the file at the end)."""
    ran = {r.get("bench") for r in new}
    out: list[dict] = []
    for r in old:
        if r.get("bench") not in ran:
            out.append(r)
        elif not any(x.get("bench") == r.get("bench") for x in out):
            out += [x for x in new if x.get("bench") == r.get("bench")]
    return out + [x for x in new if not any(y.get("bench") == x.get("bench") for y in old)]


if __name__ == "__main__":
    sys.exit(main())
