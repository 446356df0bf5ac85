"""Strategy names -> stage compositions.

A name is ``[<mask>+]<combiner>``: combiners ``fedavg``, ``fedshift``, ``grouped``,
``grouped-asym``, ``fedpaq``, ``fedwsq``, ``fedavgm``; mask ``prowd-swa`` (alone it means
``prowd-swa+fedavg``). The dequantize stage is a parameter (``dequantize="none"`` |
``"prowd"``), not part of the name, except in ``prowd``: ProWD in full,
``dequantize="prowd"`` + ``prowd-swa`` + ``fedavg``. Params go to the stage that owns them:
``tau``, ``fill``, ``tau_mode`` (mask; also as ``swa.<key>``); ``layers`` (fedshift); ``server_lr`` (fedpaq, fedwsq); ``bits``
(fedwsq); ``server_momentum``, ``server_lr`` (fedavgm); ``scale_lr`` (grouped, grouped-asym); ``weighted`` (False: 1/N averaging, the
FedShift and ProWD papers' choice), ``sigma_momentum``, ``acc_dtype``, ``batch``
(strategy); ``dequantize`` and ``dequantize_params`` (a dict), or ``dequantize.<key>`` one
at a time (``fedbit serve --strategy-param dequantize.epochs=2``); ``clip``, ``robust``,
``trim`` (robust aggregation: a :class:`~coordinator.strategies.robust.RobustStrategy`,
which holds the round's updates; without them the strategy streams). ``model`` (the model
spec's name, which the coordinator knows) goes to a dequantizer that uses it. Unknown
params are errors.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from coordinator.strategies.base import Strategy
from coordinator.strategies.combine import (
    Combiner,
    FedAvgCombine,
    FedAvgMCombine,
    FedPaqCombine,
    FedShiftCombine,
    FedWsqCombine,
    GroupedCombine,
)
from coordinator.strategies.dequantize import build_dequantizer
from coordinator.strategies.mask import MaskStage, NoMask, ProwdSwaMask
from edge_client.errors import ConfigError

COMBINERS: dict[str, Callable[..., Combiner]] = {
    "fedavg": FedAvgCombine,
    "fedshift": FedShiftCombine,
    "fedpaq": FedPaqCombine,
    "fedavgm": FedAvgMCombine,
    "fedwsq": FedWsqCombine,
    "grouped": lambda scale_lr=False: GroupedCombine(asymmetric=False, scale_lr=scale_lr),
    "grouped-asym": lambda scale_lr=False: GroupedCombine(asymmetric=True, scale_lr=scale_lr),
}
MASKS: dict[str, Callable[..., MaskStage]] = {"prowd-swa": ProwdSwaMask}
#: combiners a mask may precede (a per-group model has no high/low split)
MASKABLE = ("fedavg", "fedshift", "fedpaq")
#: names that stand for a whole composition: name -> (mask, combiner, default dequantizer)
PRESETS: dict[str, tuple[str, str, str]] = {"prowd": ("prowd-swa", "fedavg", "prowd")}
_STRATEGY_PARAMS = ("weighted", "sigma_momentum", "acc_dtype", "batch")
_ROBUST_PARAMS = ("clip", "robust", "trim")
_DEQ_PREFIX = "dequantize."
_SWA_PREFIX = "swa."


def strategy_stages(name: str, params: dict[str, Any] | None = None) -> frozenset[str]:
    """The optional stages strategy ``name`` with ``params`` has: ``"swa"`` (a selective
    weight aggregation mask) and ``"dequantize"`` (a dequantizer other than ``none``); a
    ``swa.<key>`` / ``dequantize.<key>`` parameter is valid only with its stage."""
    params = params or {}
    mask_name, _, _ = name.rpartition("+")
    deq = params.get("dequantize", "none")
    if name in PRESETS:
        mask_name = PRESETS[name][0]
        deq = params.get("dequantize", PRESETS[name][2])
    elif name in MASKS:
        mask_name = name
    return frozenset(({"swa"} if mask_name else set()) | ({"dequantize"} if deq != "none" else set()))


def folds_in_parts(name: str, params: dict[str, Any] | None = None) -> str:
    """Why strategy ``name`` with ``params`` cannot fold a round in parts whose sums are
    added later (ingest workers), "" when it can: robust aggregation holds the round's
    updates, a dequantizer reads every one."""
    params = params or {}
    if any(k in params for k in _ROBUST_PARAMS):
        return "holds the round's updates (robust aggregation)"
    if "dequantize" in strategy_stages(name, params):
        return "reads every update (its dequantizer)"
    return ""


def available_strategies() -> list[str]:
    """Every valid name."""
    names = list(COMBINERS)
    for m in MASKS:
        names.append(m)
        names += [f"{m}+{c}" for c in MASKABLE]
    return names + list(PRESETS)


def _take(factory: Callable[..., Any], params: dict[str, Any]) -> dict[str, Any]:
    keys = [k for k in inspect.signature(factory).parameters if k in params]
    return {k: params.pop(k) for k in keys}


def build_strategy(name: str, *, model: str | None = None, **params: Any) -> Strategy:
    """Build the named strategy; ConfigError listing the valid names when unknown.
    ``model``: the model spec's name, for a dequantizer that uses it."""
    valid = available_strategies()
    if name not in valid:
        raise ConfigError(f"unknown strategy {name!r}; valid: {', '.join(valid)}")
    params = dict(params)
    mask_name, _, comb_name = name.rpartition("+")
    if name in MASKS:
        mask_name, comb_name = name, "fedavg"
    if name in PRESETS:
        mask_name, comb_name, deq_name = PRESETS[name]
        params.setdefault("dequantize", deq_name)
    deq_params = dict(params.pop("dequantize_params", None) or {})
    for key in [k for k in params if k.startswith(_DEQ_PREFIX)]:
        deq_params[key[len(_DEQ_PREFIX):]] = params.pop(key)
    for key in [k for k in params if k.startswith(_SWA_PREFIX)]:
        if not mask_name:
            raise ConfigError(f"strategy {name!r} has no selective weight aggregation: {key!r}")
        params[key[len(_SWA_PREFIX):]] = params.pop(key)
    mask: MaskStage = MASKS[mask_name](**_take(MASKS[mask_name], params)) if mask_name else NoMask()
    combiner = COMBINERS[comb_name](**_take(COMBINERS[comb_name], params))
    deq = build_dequantizer(params.pop("dequantize", "none"), model=model, **deq_params)
    strat = {k: params.pop(k) for k in _STRATEGY_PARAMS if k in params}
    robust = {k: params.pop(k) for k in _ROBUST_PARAMS if k in params}
    if params:
        raise ConfigError(f"strategy {name!r}: unknown parameters {sorted(params)}")
    if robust:
        from coordinator.strategies.robust import RobustStrategy

        return RobustStrategy(name, combiner, mask, deq, **robust, **strat)
    return Strategy(name, combiner, mask, deq, **strat)
