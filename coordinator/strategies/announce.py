"""What a round announces: the configured hyper-parameters plus what the strategy needs
from devices (docs/architecture.md#one-round: the announcement carries the hyper-parameters).

A strategy declares its needs through its stages (``Combiner.device_hparams``): FedPAQ and
FedWSQ need devices to send their update ``W - W_global`` (``content = "delta"``), FedWSQ
also weight standardization and DANUQ at its bits (``ws``, ``codec``, ``codec_bits``; the
server's σ_g travels with the model, ``ModelMessage.sigma_g``), FedGroupedAvg with
``scale_lr`` a per-group ``lr_scale.<variant>`` (ProWD appendix A). The user does not have to
know: :func:`announced_hparams` adds them, and refuses a configured value that contradicts
one (ConfigError naming the key). Every key is checked against
:data:`edge_client.hparams.HPARAMS` (unknown key or bad value: ConfigError naming it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from edge_client.errors import ConfigError
from edge_client.hparams import validate_hparams
from edge_client.protocol import Hello, model_variant


def variant_counts(devices: Sequence[Hello]) -> dict[str, int]:
    """Selected devices per model variant (``float32``, ``int8``, ...)."""
    out: dict[str, int] = {}
    for h in devices:
        v = model_variant(h.compute_bits, h.trainer)
        out[v] = out.get(v, 0) + 1
    return out


def announced_hparams(strategy: str, configured: Mapping[str, Any],
                      required: Mapping[str, Any]) -> dict[str, Any]:
    """``configured`` with ``required`` added; ConfigError when a configured value differs
    from a required one, or when any key or value is not a valid hyper-parameter."""
    validate_hparams(configured)
    out = dict(configured)
    for key, value in required.items():
        if key in configured and configured[key] != value:
            raise ConfigError(f"hparams.{key} = {configured[key]!r} contradicts strategy "
                              f"{strategy!r}, which announces {key} = {value!r}")
        out[key] = value
    validate_hparams(out, where=f"strategy {strategy!r} hparams")
    return out
