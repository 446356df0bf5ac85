"""The table of ``make faults``: one row per fault or attack, from the JSON lines the
suite wrote (``FEDBIT_FAULT_REPORT``).

    python tests/system/faults/table.py runs/faults.jsonl
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main(path: str) -> int:
    rows: dict[str, list[dict]] = defaultdict(list)
    with open(path, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            rows[rec["fault"]].append(rec)
    print("| fault or attack | tries | what happened | lost |")
    print("|---|---|---|---|")
    failed = 0
    for fault, recs in rows.items():
        ok = [r for r in recs if r["outcome"] != "FAILED"]
        failed += len(recs) - len(ok)
        outcomes = sorted({r["outcome"] for r in ok})
        what = "; ".join(outcomes)
        counts: dict[str, int] = defaultdict(int)
        for r in ok:
            for k, v in r.items():
                if k not in ("fault", "trial", "outcome", "lost") and isinstance(v, int):
                    counts[k] += v
        what += "".join(f"; {k.replace('_', ' ')}: {v}" for k, v in counts.items() if v)
        if len(ok) < len(recs):
            what += f"; FAILED {len(recs) - len(ok)} of {len(recs)}"
        print(f"| {fault} | {len(recs)} | {what} | {sum(r.get('lost', 0) for r in ok)} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
