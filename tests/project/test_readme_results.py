"""The README's "What the experiments show" comes from the result files: rendering it again
from ``benchmarks/results/experiments/`` gives the README's text figure for figure, a
changed result changes the figure that quotes it, and every comparison says whether its
runs reached a plateau."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import readme_results as rr  # noqa: E402

NUMBER = re.compile(r"[+−-]?\d+(?:\.\d+)?")


def test_the_readme_section_is_the_rendering_of_the_result_files() -> None:
    text = rr.section((ROOT / "README.md").read_text())
    assert text == rr.render(), "README.md is stale: run python tools/readme_results.py --write"
    assert len(NUMBER.findall(text)) > 80
    for stale in ("+13", "85.7", "reproduces"):  # figures and verdicts no result file holds
        assert stale not in text
    flat = " ".join(text.split())
    items = flat.split(" - ")[1:]
    marks = ("not run to a plateau", "plateaued", "still climbing")
    assert len(items) == 5 and all(any(m in item for m in marks) for item in items)
    # every comparison (ProWD: one per τ reading; FedBuff: one per regime)
    assert sum(flat.count(m) for m in marks) == 5 + len(rr.FEDBUFF)


def test_a_changed_result_changes_the_figure_that_quotes_it(tmp_path: Path) -> None:
    for f in [*rr.RESULTS.glob("fmnist-*.json"), *rr.RESULTS.glob("fedbuff*-speedup.json")]:
        shutil.copy(f, tmp_path / f.name)
    path = tmp_path / "fmnist-fedfor.analysis.json"
    a = json.loads(path.read_text())
    (row,) = [r for c in a["paired"] for label, r in c["rows"].items() if label == "method=FedFOR, split=shards"]
    row["float32"]["mean"] = 0.123
    path.write_text(json.dumps(a))
    before, after = rr.render(), rr.render(tmp_path)
    assert "shards FedFOR +5.1 [" in before and "shards FedFOR +12.3 [" in after
    changed = [(x, y) for x, y in zip(NUMBER.findall(before), NUMBER.findall(after), strict=True) if x != y]
    assert changed == [("+5.1", "+12.3")]
    # runs with stop records are marked by them
    runs = json.loads((tmp_path / "fmnist-prowd-ablation-tau.json").read_text())
    for r in runs:
        r["stop"] = {"rounds": 80, "plateau_round": 60, "climbing": False, "split": "validation"}
    (tmp_path / "fmnist-prowd-ablation-tau.json").write_text(json.dumps(runs))
    assert "(`fmnist-prowd-ablation-tau`, plateaued)" in " ".join(rr.render(tmp_path).split())
    runs[0]["stop"]["climbing"] = True
    (tmp_path / "fmnist-prowd-ablation-tau.json").write_text(json.dumps(runs))
    assert "after 80 rounds, still climbing in 1 of 20 runs" in " ".join(rr.render(tmp_path).split())


def test_the_fedbuff_item_quotes_each_regimes_speedup(tmp_path: Path) -> None:
    for f in rr.RESULTS.glob("fedbuff*-speedup.json"):
        shutil.copy(f, tmp_path / f.name)
    path = tmp_path / "fedbuff-dirichlet-speedup.json"
    a = json.loads(path.read_text())
    a["figures"]["speedup"] |= {"mean": 7.25, "ci95": [6.5, 8.0]}
    a["reached"]["buffered"] = a["reached"]["seeds"] - 1
    path.write_text(json.dumps(a))
    item = " ".join(rr.fedbuff(tmp_path).split())
    assert "Dirichlet(0.3) 40 s (still climbing 9/10) 7.25× [6.50, 8.00] (reached 4/5)," in item
    assert "IID 120 s (plateaued)" in item
    assert item.count("×") == len(rr.FEDBUFF)
