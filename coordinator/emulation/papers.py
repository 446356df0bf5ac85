"""Each paper's own settings, in one place, for experiments that reproduce it.

:func:`paper_settings` gives a strategy name, its params and the hyper-parameters to
announce, as the papers state them (the source is given per entry); an experiment passes
them to :class:`~coordinator.config.ServerConfig` and ``build_strategy`` and scales rounds,
clients and data to its machine. What a paper leaves open is not filled in here: FedFOR's
α is swept in the paper (its appendix C), so ``fedfor`` has none and the caller must give
one (``paper_settings("fedfor", fedfor_alpha=...)``).

Averaging: FedShift's and ProWD's papers (and FedShift's code) average the clients'
models 1/N (``weighted=False``); fedbit's default weights by sample count.

Beyond a strategy and announced settings, a paper may fix its integer devices' uplink
(``int_codec``: ProWD's Table 2 clients send ternary weights, its §3.2 and §5.1) and the
settings of a stage its method has (``stage_params``, ``swa.<key>`` for selective weight
aggregation, ``dequantize.<key>`` for the dequantizer): they apply to a run only when its
strategy has that stage (a ``fedavg`` baseline of the paper's runs without them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edge_client.errors import ConfigError
from edge_client.hparams import HPARAMS


@dataclass(frozen=True)
class PaperSettings:
    """A strategy (name, params) and the hyper-parameters its paper trains devices with."""

    strategy: str
    strategy_params: dict[str, Any] = field(default_factory=dict)
    hparams: dict[str, Any] = field(default_factory=dict)
    source: str = ""
    #: the uplink of every integer device ("<codec>[-<bits>]"), unless the config gives one
    int_codec: str = ""
    #: stage settings (``swa.<key>``, ``dequantize.<key>``), for strategies with that stage
    stage_params: dict[str, Any] = field(default_factory=dict)


_PROWD_DEVICES = {"lr": 0.1, "momentum": 0.9, "grad_clip": 2.0, "lr_shift": 3, "steps": 200, "wn": True}
_PROWD = ("ProWD appendix A: 200 local steps; float32 SGD lr 0.1, momentum 0.9, gradient-norm clip 2.0; "
          "integer eta = 8; appendix B: Weight Normalization on the float32 clients (wn); Table 2: "
          "the Int8 clients send ternary weights; ")
#: ProWD's own stages as its appendices A and C give them, where fedbit decided otherwise
#: said so (docs/algorithms.md §4): the dequantizer's Table 2 ladder Int2 -> Int4 -> Int8 ->
#: Int16 -> Float32, convolutional blocks (3x3) over conv slices, tau = 0.1 (eq. 18),
#: lambda = 1, batch 16, 5 epochs; [decision] the blocks read the global model the device
#: started from (context "global") and train with Adam (lr 1e-3; the paper's SGD at 0.01
#: barely moves them in 5 epochs); SWA's tau = 0.1, [decision] read as the fraction kept
_PROWD_STAGES = {"swa.tau": 0.1, "swa.tau_mode": "keep", "dequantize.ladder": "paper",
                 "dequantize.block": "slices", "dequantize.kernel": 3, "dequantize.context": "global",
                 "dequantize.optimizer": "adam", "dequantize.lr": 1e-3}


PAPERS: dict[str, PaperSettings] = {
    "fedshift": PaperSettings(
        "fedshift", {"weighted": False},
        {"lr": 0.005, "momentum": 0.9, "batch": 50, "epochs": 10, "kmeans_method": "authors"},
        "FedShift §4: SGD lr 0.005, momentum 0.9, batch 50, 10 local epochs; 1/N averaging and "
        "the authors' K-means (their code, docs/algorithms.md §3-4)"),
    "prowd": PaperSettings("prowd", {"weighted": False}, dict(_PROWD_DEVICES),
                           _PROWD + "1/N averaging; ProWD in full (dequantizer + SWA, appendix C)",
                           "ternary", dict(_PROWD_STAGES)),
    "prowd-fedprox": PaperSettings("fedavg", {"weighted": False}, _PROWD_DEVICES | {"prox_mu": 0.01},
                                   _PROWD + "FedProx baseline with mu = 0.01 (the best of 0.01, 0.1, 1)",
                                   "ternary", dict(_PROWD_STAGES)),
    "prowd-grouped": PaperSettings("grouped", {"weighted": False, "scale_lr": True}, dict(_PROWD_DEVICES),
                                   _PROWD + "FedGroupedAvg with the learning rates scaled by the "
                                   "group's share of the clients", "ternary", dict(_PROWD_STAGES)),
    "prowd-grouped-asym": PaperSettings("grouped-asym", {"weighted": False, "scale_lr": True},
                                        dict(_PROWD_DEVICES), _PROWD + "FedGroupedAvg-Asymmetric, "
                                        "scaled learning rates", "ternary", dict(_PROWD_STAGES)),
    "fedfor": PaperSettings("fedavg", {}, {"lr": 0.01, "momentum": 0.0, "batch": 32},
                            "FedFOR appendix D: SGD lr 0.01, no momentum, batch 32 (digits); alpha "
                            "is swept (appendix C): give fedfor_alpha"),
    "fedwsq": PaperSettings("fedwsq", {"server_lr": 1.0}, {"lr": 0.1, "momentum": 0.0, "epochs": 5},
                            "FedWSQ supplement C: SGD lr 0.1, no momentum, 5 local epochs, global "
                            "lr 1, WS with rho = 0.001 (the float trainer's default); its weight "
                            "decay 0.001 and lr decay 0.995 per round are not modelled"),
}


def paper_settings(name: str, **hparams: Any) -> PaperSettings:
    """The settings of paper ``name`` (:data:`PAPERS`), with ``hparams`` added or replaced;
    ConfigError naming an unknown paper or hyper-parameter. ``fedfor`` needs
    ``fedfor_alpha``."""
    if name not in PAPERS:
        raise ConfigError(f"unknown paper {name!r}; known: {', '.join(PAPERS)}")
    unknown = sorted(set(hparams) - set(HPARAMS))
    if unknown:
        raise ConfigError(f"paper {name!r}: unknown hyper-parameter {unknown[0]!r}")
    p = PAPERS[name]
    if name == "fedfor" and "fedfor_alpha" not in hparams:
        raise ConfigError("paper 'fedfor': give fedfor_alpha (the paper sweeps it)")
    return PaperSettings(p.strategy, dict(p.strategy_params), p.hparams | hparams, p.source, p.int_codec,
                         dict(p.stage_params))
