"""Every arm tuned, equally: a bracket per method, an equal budget, tuning seeds apart.

A sweep's ``tune`` may be a table::

    [sweep.tune]
    seeds = [100, 101]                  # tuning seeds: none of the reported ``seeds``
    by = "method"                       # a dimension whose values get their own bracket
    default = {"train.lr" = [0.3, 1, 3, 10]}           # any value without one
    "FedAvg float SGD" = {"train.lr" = [0.3, 1], "train.momentum" = [0.0, 0.9]}

Every bracket is a grid of settings (every combination of its lists) of the same size,
the **budget**: each method is given as many tries as every other. For every sweep
combination, each point of its bracket (the bracket of its ``by`` value, else
``default``) runs on every tuning seed; the point with the best validation score (the
mean over tuning seeds of the mean over groups of the last rounds' validation accuracy)
is chosen, and the combination then runs with it on the reported seeds, which no choice
has seen. ``tuning.json`` lists every point's score and the choices; the sweep's report
says what was tuned and the values chosen.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from edge_client.errors import ConfigError

#: the tune table's own keys (the others name brackets)
OWN_KEYS = ("seeds", "by", "default")


def is_table(tune: object) -> bool:
    return isinstance(tune, dict)


def check_tune(tune: Mapping[str, Any], dims: Mapping[str, list[str]], seeds: Sequence[int]) -> None:
    """ConfigError naming ``sweep.tune.<key>`` when the table does not fit the sweep's
    dimensions ``dims`` ({dimension: value labels}) and its reported ``seeds``."""
    tseeds = tune.get("seeds")
    if not isinstance(tseeds, list) or not tseeds or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in tseeds):
        raise ConfigError(f"sweep.tune.seeds: a non-empty list of integers >= 0 (the tuning seeds), got {tseeds!r}")
    shared = sorted(set(tseeds) & set(seeds))
    if shared:
        raise ConfigError(f"sweep.tune.seeds: {shared} are reported seeds too: the reported seeds must be fresh")
    by = tune.get("by")
    if by is not None and (not isinstance(by, str) or by.lstrip("@") not in dims):
        raise ConfigError(f"sweep.tune.by: {by!r} is not one of the sweep's dimensions {sorted(dims)}")
    labels = dims.get(str(by).lstrip("@"), []) if by is not None else []
    brackets = {k: v for k, v in tune.items() if k not in OWN_KEYS}
    for name in brackets:
        if name not in labels:
            raise ConfigError(f"sweep.tune.{name}: not a value of sweep.tune.by ({by!r}: {labels})")
    if "default" in tune:
        brackets["default"] = tune["default"]
    if not brackets:
        raise ConfigError("sweep.tune: no bracket (a table of \"key\" = [values] per method, or `default`)")
    for name, b in brackets.items():
        if not isinstance(b, dict) or not b or not all(isinstance(v, list) and v for v in b.values()):
            raise ConfigError(f"sweep.tune.{name}: a table of dotted keys, each a non-empty list of values")
    missing = [x for x in labels if x not in brackets and "default" not in brackets]
    if missing:
        raise ConfigError(f"sweep.tune: no bracket for {missing} (give one, or `default`)")
    sizes = {name: math.prod(len(v) for v in b.values()) for name, b in brackets.items()}
    if len(set(sizes.values())) > 1:
        raise ConfigError(f"sweep.tune: the brackets' budgets differ ({sizes}): give every method as many "
                          "settings to try")


def bracket(tune: Mapping[str, Any], combo: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The settings to try for sweep combination ``combo``: every point of its bracket,
    each ``{dotted key: value}``."""
    by = str(tune.get("by", "")).lstrip("@")
    b = tune.get(str(combo.get(by)), tune.get("default")) if by else tune.get("default")
    keys = list(b)
    return [dict(zip(keys, vals, strict=True)) for vals in itertools.product(*(b[k] for k in keys))]


def point_label(point: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in point.items())


def score(summaries: Sequence[Mapping[str, Any]]) -> float:
    """The validation score of one point: over its runs' summaries, the mean over seeds of
    the mean over groups of ``val_mean_last``; -inf without validation figures."""
    per_seed = []
    for s in summaries:
        vals = [g["val_mean_last"] for g in s.get("groups", {}).values()
                if isinstance(g.get("val_mean_last"), int | float) and math.isfinite(g["val_mean_last"])]
        if vals:
            per_seed.append(sum(vals) / len(vals))
    return sum(per_seed) / len(per_seed) if per_seed else -math.inf
